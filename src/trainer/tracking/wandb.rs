//! The W&B backend: a Python worker process (`tracking.python -c` the embedded
//! `wandb_worker.py`) that calls `wandb.init`, then `wandb.log(metrics, step=step)` for every
//! metrics line sent to it as JSON on its stdin, and `wandb.finish()` at the end.
//!
//! Start-up waits for the worker's ready line (or its error, with the traceback) for at most
//! [`START_TIMEOUT`]: no interpreter, no `wandb` or a failing `wandb.init` is an error before
//! training, never metrics lost in silence. A worker that died mid-run makes the next
//! [`WandbWorker::log`] an error naming it, with the end of its stderr (which is otherwise
//! forwarded to oxrl's).
//!
//! The worker is never left behind: [`WandbWorker::close`] (a clean end) and `Drop` (an error
//! path: the W&B run ends with exit code 1) close its stdin and wait for `wandb.finish` for at
//! most [`FINISH_TIMEOUT`], then kill it. It runs in a process group of its own with SIGINT
//! ignored, so Ctrl-C in the terminal reaches oxrl alone, which finishes its step and closes it;
//! on Linux it is also killed when the thread that started it ends (`PR_SET_PDEATHSIG`: oxrl
//! killed, or exiting at a second Ctrl-C).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};

/// The worker's script, run with `python -c`.
pub const WORKER_SCRIPT: &str = include_str!("wandb_worker.py");
/// How long `wandb.init` may take: beyond wandb's own init timeout (90 s), so that its error,
/// when it times out, is the one reported.
pub const START_TIMEOUT: Duration = Duration::from_secs(150);
/// How long `wandb.finish` may take (online it uploads what is left).
pub const FINISH_TIMEOUT: Duration = Duration::from_secs(120);
/// Lines of the worker's stderr kept for error messages.
const STDERR_TAIL: usize = 40;

/// `wandb.init`'s arguments.
pub struct WandbInit<'a> {
    pub project: &'a str,
    pub name: &'a str,
    /// Where wandb writes its files (`DIR/wandb/`): the run directory.
    pub dir: &'a Path,
    /// The run's resolved config.
    pub config: &'a Value,
}

/// A running W&B worker.
pub struct WandbWorker {
    child: Child,
    /// `None` once closed (the worker's EOF).
    stdin: Option<ChildStdin>,
    python: String,
    stderr: StderrTail,
}

impl WandbWorker {
    /// Starts the worker with interpreter `python` and waits (at most `timeout`) until its
    /// `wandb.init` returned. Every failure is an error naming the interpreter and the cause.
    pub fn start(python: &str, init: &WandbInit, timeout: Duration) -> Result<Self> {
        let mut cmd = Command::new(python);
        cmd.arg("-c").arg(WORKER_SCRIPT).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        crate::child_process::detach(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| {
            Error::input(format!("tracking backend `wandb`: cannot run tracking.python = `{python}`: {e}"))
        })?;
        let (stdout, stderr) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
        let mut worker = WandbWorker {
            stdin: child.stdin.take(),
            child,
            python: python.to_string(),
            stderr: StderrTail::read(stderr),
        };
        // The worker's one reply, read in a thread so that the wait can time out.
        let (tx, reply) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let n = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(n.ok().filter(|&n| n > 0).map(|_| line));
        });
        let message = json!({
            "project": init.project,
            "name": init.name,
            "dir": init.dir.to_string_lossy(),
            "config": init.config,
        });
        // A worker dead at once shows as a missing reply below, with its status and stderr.
        let _ = worker.send(&message);
        match worker.wait_ready(&reply, timeout) {
            Ok(()) => Ok(worker),
            Err(e) => {
                worker.kill();
                Err(e)
            }
        }
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn wait_ready(&mut self, reply: &Receiver<Option<String>>, timeout: Duration) -> Result<()> {
        let line = match reply.recv_timeout(timeout) {
            Ok(Some(line)) => line,
            Ok(None) | Err(RecvTimeoutError::Disconnected) => {
                let status = wait_for(&mut self.child, Duration::from_secs(5));
                let status = status.map_or("still running".to_string(), |s| s.to_string());
                return Err(self.error(&format!("the worker ended before wandb.init returned ({status})")));
            }
            Err(RecvTimeoutError::Timeout) => {
                return Err(self.error(&format!("wandb.init did not return within {} s", timeout.as_secs())));
            }
        };
        let reply: Value = serde_json::from_str(&line)
            .map_err(|_| self.error(&format!("unexpected reply from the worker: {}", line.trim_end())))?;
        if let Some(e) = reply.get("error").and_then(Value::as_str) {
            return Err(self.error(e.trim_end()));
        }
        if reply.get("ready") != Some(&Value::Bool(true)) {
            return Err(self.error(&format!("unexpected reply from the worker: {}", line.trim_end())));
        }
        Ok(())
    }

    /// Sends one metrics line: `wandb.log(metrics, step=step)`. A worker that has died is an
    /// error naming it.
    pub fn log(&mut self, step: u64, metrics: &Map<String, Value>) -> Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Err(self.error(&format!("the worker has died ({status})")));
        }
        self.send(&json!({ "step": step, "metrics": metrics })).map_err(|e| {
            let status = wait_for(&mut self.child, Duration::from_millis(500));
            let status = status.map_or(String::new(), |s| format!(" ({s})"));
            self.error(&format!("cannot send to the worker: {e}{status}"))
        })
    }

    /// Ends the W&B run cleanly (`wandb.finish(exit_code=0)`) and waits for the worker to exit.
    pub fn close(mut self) -> Result<()> {
        if self.stdin.is_some() {
            // A worker that died shows in its exit status below.
            let _ = self.send(&json!({ "finish": 0 }));
        }
        match self.finish() {
            Some(status) if status.success() => Ok(()),
            Some(status) => Err(self.error(&format!("wandb.finish failed ({status})"))),
            None => Err(self.error(&format!("wandb.finish did not end within {} s", FINISH_TIMEOUT.as_secs()))),
        }
    }

    fn send(&mut self, message: &Value) -> std::io::Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| std::io::Error::other("the worker's input is closed"))?;
        let mut line = message.to_string();
        line.push('\n');
        stdin.write_all(line.as_bytes()).and_then(|_| stdin.flush())
    }

    /// Closes the worker's stdin and waits for it to exit (killed after [`FINISH_TIMEOUT`]).
    fn finish(&mut self) -> Option<ExitStatus> {
        self.stdin = None;
        let status = wait_for(&mut self.child, FINISH_TIMEOUT);
        if status.is_none() {
            self.kill();
        }
        status
    }

    /// Kills the worker's process group and reaps it.
    fn kill(&mut self) {
        self.stdin = None;
        if let Ok(None) = self.child.try_wait() {
            crate::child_process::kill_group(&mut self.child);
            let _ = self.child.wait();
        }
    }

    /// An error about the worker: what happened, and the end of its stderr.
    fn error(&self, what: &str) -> Error {
        let tail = self.stderr.text(Duration::from_secs(1));
        let tail = if tail.is_empty() { String::new() } else { format!("\nits stderr ended with:\n{tail}") };
        Error::Other(format!(
            "tracking backend `wandb` (worker `{} -c`, pid {}): {what}{tail}",
            self.python,
            self.pid()
        ))
    }
}

impl Drop for WandbWorker {
    /// Not closed: an error ended the run. EOF without "finish" ends the W&B run with exit code
    /// 1, then the worker exits (killed if it does not in time).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.finish();
        }
    }
}

/// The worker's stderr, forwarded line by line to oxrl's, with its last lines kept.
struct StderrTail {
    lines: Arc<Mutex<VecDeque<String>>>,
    /// Disconnected once the stderr reader has seen EOF.
    eof: Receiver<()>,
}

impl StderrTail {
    fn read(stderr: impl std::io::Read + Send + 'static) -> Self {
        let lines = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, eof) = mpsc::channel::<()>();
        let kept = lines.clone();
        std::thread::spawn(move || {
            let _eof = tx; // dropped at EOF
            for line in BufReader::new(stderr).lines().map_while(std::io::Result::ok) {
                eprintln!("{line}");
                let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
                if kept.len() == STDERR_TAIL {
                    kept.pop_front();
                }
                kept.push_back(line);
            }
        });
        StderrTail { lines, eof }
    }

    /// The kept lines, after waiting at most `wait` for the stream to end (a dead worker's
    /// last words may still be in the pipe).
    fn text(&self, wait: Duration) -> String {
        let _ = self.eof.recv_timeout(wait);
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines.iter().map(String::as_str).collect::<Vec<_>>().join("\n")
    }
}

/// The child's exit status, waiting at most `timeout`; `None` if it is still running.
fn wait_for(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => return None,
        }
    }
}
