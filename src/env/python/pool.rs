//! A pool of Python worker processes that run the user's code: reward functions and environments.
//!
//! ```text
//! start:  spawn `workers` × `python -u -c worker.py` (the user's interpreter: their venv)
//!         each imports the reward file and env modules once, answers ready (or fatal: an
//!         error at start, before any model is loaded)
//! call:   a call goes to a worker (round-robin, or an env instance's own worker); the
//!         worker's thread sends what has queued as one batch line and reads one answer per call
//!         timeout:  a call running longer than `timeout` (calls run in order, each from the
//!                   previous answer on) kills its worker (the call answers TimedOut); the
//!                   batch's other calls go again to the restarted worker
//!         death:    a worker that exits mid-batch is restarted and its calls sent again once;
//!                   a call whose worker dies twice answers Died
//! stop:   dropping the pool kills and reaps every worker
//! ```
//! No process outlives the pool: workers are killed on drop, on errors and at the end of a
//! run; they sit in their own process group (Ctrl-C is the trainer's, which then stops them)
//! and, on Linux, get SIGKILL when the thread that started them ends (`PR_SET_PDEATHSIG`), so a
//! trainer killed outright takes them with it. The protocol is in `worker.py`.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::handle::{channel, Handle, Reply};
use crate::locks::lock;
use crate::{Error, Result};

/// The worker's script, run with `python -u -c`.
const WORKER_SCRIPT: &str = include_str!("worker.py");
/// Most calls in one batch line.
const MAX_BATCH: usize = 256;
/// stderr lines kept per worker for the message of a worker that died.
const STDERR_TAIL: usize = 20;

/// What the pool runs and how.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolSpec {
    /// The interpreter (a name on PATH or a path).
    pub python: String,
    pub workers: usize,
    /// Longest a single call may run.
    pub timeout: Duration,
    /// Longest a worker may take to import the user's code and say it is ready.
    pub start_timeout: Duration,
    /// The reward function: file and function name.
    pub reward: Option<(String, String)>,
    /// Modules (file paths or import names) whose classes are environments.
    pub env_modules: Vec<String>,
}

/// How one call ended.
#[derive(Clone, Debug, PartialEq)]
pub enum CallResult {
    Ok(Value),
    /// The user's code raised: the Python traceback.
    Raised(String),
    /// The user's code returned a value of the wrong shape: what was wrong.
    BadReturn(String),
    TimedOut(Duration),
    /// Its worker died (twice, or could not be restarted): why.
    Died(String),
}

/// What every worker reported at start.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ready {
    pub env_classes: Vec<String>,
    pub reward_async: bool,
}

struct Job {
    call: Map<String, Value>,
    reply: Reply<CallResult>,
    /// Sent again once already after its worker died.
    retried: bool,
}

/// The pool: one thread per worker process, each owning its process.
pub struct PythonPool {
    /// The live workers' process ids, by worker.
    pids: Arc<Mutex<Vec<u32>>>,
    senders: Vec<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    next_worker: AtomicUsize,
    next_instance: AtomicU64,
    ready: Ready,
}

impl PythonPool {
    /// Starts every worker and waits until each has imported the user's code; the first that
    /// cannot is the error (and the others are stopped).
    pub fn start(spec: PoolSpec) -> Result<PythonPool> {
        let spec = Arc::new(spec);
        let pids = Arc::new(Mutex::new(vec![0; spec.workers.max(1)]));
        let mut pool = PythonPool {
            pids: pids.clone(),
            senders: vec![],
            threads: vec![],
            next_worker: AtomicUsize::new(0),
            next_instance: AtomicU64::new(0),
            ready: Ready::default(),
        };
        let mut started = vec![];
        for index in 0..spec.workers.max(1) {
            let (tx, rx) = mpsc::channel();
            let (ready_tx, ready_rx) = mpsc::channel();
            let (spec, pids) = (spec.clone(), pids.clone());
            let thread = std::thread::Builder::new()
                .name(format!("python-worker-{index}"))
                .spawn(move || worker_thread(&spec, index, &pids, rx, ready_tx))
                .map_err(|e| Error::Other(format!("cannot start a Python worker thread: {e}")))?;
            pool.senders.push(tx);
            pool.threads.push(thread);
            started.push(ready_rx);
        }
        for ready in started {
            // The thread answers once: ready, or why not (it never hangs: the start is timed).
            match ready.recv() {
                Ok(Ok(r)) => pool.ready = r,
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::Other("a Python worker thread stopped during start".into())),
            }
        }
        Ok(pool)
    }

    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    pub fn workers(&self) -> usize {
        self.senders.len()
    }

    /// The process ids of the live workers (0 for one being restarted).
    pub fn pids(&self) -> Vec<u32> {
        lock(&self.pids).clone()
    }

    /// A fresh environment instance: its id and the worker it lives in.
    pub fn new_instance(&self) -> (u64, usize) {
        let id = self.next_instance.fetch_add(1, Ordering::Relaxed);
        (id, (id % self.senders.len() as u64) as usize)
    }

    /// Submits one call (`{"op": ..., ...}`) to `worker`, or to the next worker in turn.
    pub fn call(&self, worker: Option<usize>, call: Map<String, Value>) -> Handle<CallResult> {
        let index = worker.unwrap_or_else(|| self.next_worker.fetch_add(1, Ordering::Relaxed)) % self.senders.len();
        let (reply, handle) = channel();
        if let Err(mpsc::SendError(job)) = self.senders[index].send(Job { call, reply, retried: false }) {
            job.reply.send(Err(Error::UserCode("the Python worker pool has stopped".into())));
        }
        handle
    }
}

impl Drop for PythonPool {
    fn drop(&mut self) {
        self.senders.clear(); // each worker thread sees its queue close, kills and reaps its process
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One running worker process.
struct Process {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    python: String,
    /// Killed or exited: the next batch needs a fresh process.
    dead: bool,
    /// The reward function is `async def`: a batch of scores runs at once.
    reward_async: bool,
    /// The batch in flight runs its calls at once.
    concurrent: bool,
}

impl Process {
    fn start(spec: &PoolSpec) -> Result<(Process, Ready)> {
        let mut command = Command::new(&spec.python);
        command
            .args(["-u", "-c", WORKER_SCRIPT])
            // Names the trainer in the process list, so a leftover worker can be traced to it.
            .arg(format!("--oxrl-parent={}", std::process::id()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("PYTHONUNBUFFERED", "1");
        crate::child_process::detach(&mut command);
        let mut child = command.spawn().map_err(|e| {
            Error::UserCode(format!("reward.python: cannot start the Python interpreter `{}`: {e}", spec.python))
        })?;
        let (Some(stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            return Err(Error::Other("a Python worker started without its pipes".into()));
        };
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let tail = stderr_tail.clone();
        std::thread::spawn(move || {
            // The user's prints and warnings: shown as they come, the last few kept for a
            // message if the worker dies.
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[python] {line}");
                let mut t = lock(&tail);
                if t.len() == STDERR_TAIL {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        let mut process = Process {
            child,
            stdin,
            lines,
            stderr_tail,
            python: spec.python.clone(),
            dead: false,
            reward_async: false,
            concurrent: false,
        };
        let setup = json!({
            "reward": spec.reward.as_ref().map(|(path, name)| json!({"path": path, "name": name})),
            "env_modules": spec.env_modules,
        });
        if process.send_line(&setup.to_string()).is_err() {
            return Err(Error::UserCode(format!("the Python worker exited at start{}", process.death_note())));
        }
        match process.lines.recv_timeout(spec.start_timeout) {
            Ok(line) => {
                let v: Value = serde_json::from_str(&line)
                    .map_err(|_| Error::UserCode(format!("the Python worker said `{line}` instead of ready")))?;
                if let Some(fatal) = v.get("fatal").and_then(Value::as_str) {
                    return Err(Error::UserCode(fatal.trim_end().to_string()));
                }
                let ready = &v["ready"];
                let env_classes = ready["env_classes"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|c| c.as_str().map(String::from)).collect())
                    .unwrap_or_default();
                let reward_async = ready["reward_async"].as_bool().unwrap_or(false);
                process.reward_async = reward_async;
                Ok((process, Ready { env_classes, reward_async }))
            }
            Err(RecvTimeoutError::Timeout) => Err(Error::UserCode(format!(
                "the Python worker did not finish importing the user's code in {:.0} s",
                spec.start_timeout.as_secs_f64()
            ))),
            Err(RecvTimeoutError::Disconnected) => {
                Err(Error::UserCode(format!("the Python worker exited at start{}", process.death_note())))
            }
        }
    }

    fn send_line(&mut self, line: &str) -> std::io::Result<()> {
        self.stdin.write_all(line.as_bytes())?;
        self.stdin.write_all(b"\n")?;
        self.stdin.flush()
    }

    /// ` (exit status …): last stderr lines`, for messages about a worker that is gone.
    fn death_note(&mut self) -> String {
        self.dead = true;
        let _ = self.child.kill();
        let status = self.child.wait().map(|s| format!(" ({s})")).unwrap_or_default();
        std::thread::sleep(Duration::from_millis(20)); // the stderr reader's last lines
        let tail: Vec<String> = lock(&self.stderr_tail).iter().cloned().collect();
        if tail.is_empty() {
            status
        } else {
            format!("{status}; its last output:\n{}", tail.join("\n"))
        }
    }

    /// Runs a batch: answers every call it can and returns the calls to send again to a fresh
    /// worker (this one is then dead or killed).
    fn run(&mut self, jobs: Vec<Job>, next_id: &mut u64, timeout: Duration) -> Vec<Job> {
        let mut pending: HashMap<u64, Job> = HashMap::new();
        let mut calls = vec![];
        for mut job in jobs {
            *next_id += 1;
            job.call.insert("id".into(), json!(*next_id));
            calls.push(Value::Object(job.call.clone()));
            pending.insert(*next_id, job);
        }
        let line = json!({ "calls": calls }).to_string();
        if self.send_line(&line).is_err() {
            return self.died(pending);
        }
        self.concurrent = self.reward_async && calls.iter().all(|c| c["op"] == "score");
        // Calls run in order, each from the previous answer on (an async function's all at once
        // from the batch's arrival): the call running is the first unanswered one, running since
        // the last answer.
        let mut progress = Instant::now();
        while !pending.is_empty() {
            let wait = (progress + timeout).saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(wait) {
                Ok(line) => {
                    let Ok(v) = serde_json::from_str::<Value>(&line) else {
                        eprintln!("[python] {line}");
                        continue;
                    };
                    let Some(job) = v.get("id").and_then(Value::as_u64).and_then(|id| pending.remove(&id)) else {
                        continue;
                    };
                    progress = Instant::now();
                    let result = if let Some(ok) = v.get("ok") {
                        CallResult::Ok(ok.clone())
                    } else if let Some(bad) = v.get("bad_return").and_then(Value::as_str) {
                        CallResult::BadReturn(bad.to_string())
                    } else {
                        CallResult::Raised(v.get("error").and_then(Value::as_str).unwrap_or("").trim_end().to_string())
                    };
                    job.reply.send(Ok(result));
                }
                Err(RecvTimeoutError::Timeout) => {
                    // The running call times out (an async batch: every call still running);
                    // the rest go again to a fresh worker.
                    let late: Vec<u64> = if self.concurrent {
                        pending.keys().copied().collect()
                    } else {
                        pending.keys().min().into_iter().copied().collect()
                    };
                    for id in late {
                        if let Some(job) = pending.remove(&id) {
                            job.reply.send(Ok(CallResult::TimedOut(timeout)));
                        }
                    }
                    self.dead = true;
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return pending.into_values().collect();
                }
                Err(RecvTimeoutError::Disconnected) => return self.died(pending),
            }
        }
        Vec::new()
    }

    /// The worker is gone with `pending` unanswered: calls already sent again answer Died, the
    /// others go again.
    fn died(&mut self, pending: HashMap<u64, Job>) -> Vec<Job> {
        let note = self.death_note();
        let mut again = vec![];
        for (_, mut job) in pending {
            if job.retried {
                job.reply.send(Ok(CallResult::Died(format!(
                    "its Python worker died twice running it (`{}`){note}",
                    self.python
                ))));
            } else {
                job.retried = true;
                again.push(job);
            }
        }
        again
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A worker's thread: starts its process, then runs the batches of its queue until the pool is
/// dropped, restarting the process when it dies or is killed for a timeout.
fn worker_thread(
    spec: &PoolSpec,
    index: usize,
    pids: &Mutex<Vec<u32>>,
    queue: Receiver<Job>,
    ready: Sender<Result<Ready>>,
) {
    let set_pid = |p: Option<&Process>| lock(pids)[index] = p.map_or(0, |p| p.child.id());
    let mut process = match Process::start(spec) {
        Ok((p, r)) => {
            set_pid(Some(&p));
            let _ = ready.send(Ok(r));
            Some(p)
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut next_id = 0u64;
    while let Ok(first) = queue.recv() {
        let mut jobs = vec![first];
        while jobs.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        while !jobs.is_empty() {
            let p = match process.as_mut() {
                Some(p) => p,
                None => match Process::start(spec) {
                    Ok((p, _)) => {
                        set_pid(Some(&p));
                        process.insert(p)
                    }
                    Err(e) => {
                        for job in jobs.drain(..) {
                            job.reply.send(Ok(CallResult::Died(format!("its Python worker could not restart: {e}"))));
                        }
                        break;
                    }
                },
            };
            jobs = p.run(jobs, &mut next_id, spec.timeout);
            if p.dead {
                process = None; // a fresh one for the calls that go again, or the next batch
                set_pid(None);
            }
        }
    }
}
