//! The official `tinker` SDK (pinned 0.38.0) against `oxrl serve` on loopback with a tiny model.
//!
//! The SDK lives in a virtual environment at `.venv-tinker/` (git-ignored) that `.ci/run`
//! installs (`python3 -m venv` + `pip install tinker==0.38.0`): tests download nothing, so
//! without it they fail with the command to run. They are skipped, with a message, only when no
//! Python 3 is installed.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TINKER: &str = "tinker==0.38.0";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The venv's python with the SDK installed, or None when there is no Python at all. Found once
/// per test process (the tests run in parallel).
pub(crate) fn sdk_python() -> Option<PathBuf> {
    static PYTHON: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    PYTHON.get_or_init(find_sdk_python).clone()
}

fn find_sdk_python() -> Option<PathBuf> {
    let venv = repo().join(".venv-tinker");
    let python = venv.join("bin/python");
    let has_sdk = |p: &Path| {
        Command::new(p)
            .args(["-c", "import tinker, sys; sys.exit(0 if tinker.__version__ == '0.38.0' else 1)"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if python.exists() && has_sdk(&python) {
        return Some(python);
    }
    ["python3", "python"].into_iter().find(|p| Command::new(p).arg("--version").output().is_ok())?;
    panic!(
        "{TINKER} is not installed in {}: run `.ci/run` once, or `python3 -m venv .venv-tinker && \
         .venv-tinker/bin/python -m pip install {TINKER}`",
        venv.display()
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// GET `path` on the server; the status line and body.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(model: &Path, data: &Path, port: u16) -> Server {
    let child = common::oxrl_command()
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", &port.to_string(), "--data-dir"])
        .arg(data)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    let start = Instant::now();
    loop {
        if let Some(r) = http_get(port, "/api/v1/healthz") {
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            assert!(r.contains(r#""status":"ok""#), "{r}");
            return server;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the server did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs `tests/tinker/SCRIPT` against the server on `port`; asserts it ends with `ok`.
fn run_script(python: &Path, script: &str, port: u16, out_dir: &Path) -> String {
    let out = Command::new(python)
        .arg(repo().join("tests/tinker").join(script))
        .env("TINKER_BASE_URL", format!("http://127.0.0.1:{port}"))
        .env("TINKER_API_KEY", "tml-oxrl-test")
        .env("OXRL_MODEL", "tiny")
        .env("OXRL_OUT", out_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{script}:\n{stdout}");
    assert!(out.status.success(), "{script} failed ({}):\n{stdout}\n{stderr}", out.status);
    assert!(stdout.trim_end().ends_with("ok"), "{stdout}");
    stdout
}

/// Runs `tests/tinker/SCRIPT` against a fresh server on a tiny model of `seed`: the run's
/// directory (model, `data/`) and the script's output; `None` (skipped, said) without python3.
fn run_on_fresh_server(script: &str, seed: u64) -> Option<(tempfile::TempDir, String)> {
    let Some(python) = sdk_python() else {
        eprintln!("SKIPPED: no python3 on this machine (the tinker SDK test needs Python 3.11+)");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    common::tiny_byte_model(&model, 64, 128, seed);
    let port = free_port();
    let _server = start_server(&model, &dir.path().join("data"), port);
    let stdout = run_script(&python, script, port, dir.path());
    Some((dir, stdout))
}

#[test]
fn sdk_sft_loop_and_losses() {
    let Some(python) = sdk_python() else {
        eprintln!("SKIPPED: no python3 on this machine (the tinker SDK test needs Python 3.11+)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    common::tiny_byte_model(&model, 64, 128, 7);
    let port = free_port();
    let _server = start_server(&model, &dir.path().join("data"), port);

    // Protocol basics without the SDK: capabilities list the model; an unknown path is a 404.
    let caps = http_get(port, "/api/v1/get_server_capabilities").unwrap();
    assert!(caps.contains(r#""model_name":"tiny""#), "{caps}");
    assert!(http_get(port, "/api/v1/nope").unwrap().starts_with("HTTP/1.1 404"));

    let stdout = run_script(&python, "sft_loop.py", port, dir.path());
    assert!(stdout.contains("sft: loss") && stdout.contains("importance_sampling: loss:sum"), "{stdout}");
}

/// Sampling: ephemeral and named sampler weights, num_samples 2, log-probs equal to the
/// trainer's, compute_logprobs, seeds, stop token ids.
#[test]
fn sdk_sampling() {
    let Some((_dir, stdout)) = run_on_fresh_server("sampling.py", 5) else { return };
    assert!(stdout.contains("log-probs equal the trainer's") && stdout.contains("named sampler weights"), "{stdout}");
}

/// RestClient listings and checkpoint deletion; ppo, cispo and dro loss:sum recomputed client-side;
/// four SDK clients training concurrently.
#[test]
fn sdk_listings_rl_losses_and_concurrent_clients() {
    let Some((_dir, stdout)) = run_on_fresh_server("rest_and_losses.py", 9) else { return };
    for want in ["listings:", "ppo: loss:sum", "cispo: loss:sum", "dro: loss:sum", "four concurrent clients"] {
        assert!(stdout.contains(want), "{want}: {stdout}");
    }
}

/// A cookbook-style RL loop (sample → reward → importance_sampling → optim_step, new sampler
/// weights every iteration): the reward rises on a toy task.
#[test]
fn sdk_rl_loop_reward_rises() {
    let Some((dir, stdout)) = run_on_fresh_server("rl_loop.py", 13) else { return };
    assert!(stdout.contains("reward "), "{stdout}");
    // 40 iterations, 40 ephemeral samplers: only the newest MAX_EPHEMERAL (32) are kept.
    let kept = std::fs::read_dir(dir.path().join("data/ephemeral")).unwrap().count();
    assert_eq!(kept, oxrl::server::samplers::MAX_EPHEMERAL);
}

/// The cookbook's default RL loss, built as its `rl_loop.py` builds it (record_stability_info,
/// provenance spans, `stable_reinforce` with a `kl_coeff`): the reward rises and every step's
/// `loss:sum` equals the client-side recomputation from the trainer's and sampler's log-probs.
#[test]
fn sdk_stable_reinforce_with_provenance() {
    let Some((_dir, stdout)) = run_on_fresh_server("stable_reinforce.py", 13) else { return };
    assert!(stdout.contains("reward ") && stdout.contains("worst relative"), "{stdout}");
}

/// save_state, create-from-state with and without optimizer, load_state; then `kill -9` of the
/// server and a restart on the same data dir: the checkpoint is loadable and reproduces the
/// saved log-probs.
#[test]
fn sdk_checkpoints_survive_kill_9() {
    let Some(python) = sdk_python() else {
        eprintln!("SKIPPED: no python3 on this machine (the tinker SDK test needs Python 3.11+)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    common::tiny_byte_model(&model, 64, 128, 11);
    let data = dir.path().join("data");
    let port = free_port();
    let mut server = start_server(&model, &data, port);
    let stdout = run_script(&python, "checkpoints.py", port, dir.path());
    assert!(stdout.contains("with optimizer: next step equal"), "{stdout}");
    server.0.kill().unwrap(); // SIGKILL
    server.0.wait().unwrap();
    let port = free_port();
    let _server = start_server(&model, &data, port);
    run_script(&python, "restart.py", port, dir.path());
}

/// save_weights_external encrypted to an age x25519 key, as the cookbook's
/// `weights.download` does it: signed URLs downloaded with urllib, decrypted with pyrage to the
/// files of an unencrypted export; TTL renewal and deletion.
#[test]
fn sdk_external_weights_encrypted_download() {
    let Some(python) = sdk_python() else {
        eprintln!("SKIPPED: no python3 on this machine (the tinker SDK test needs Python 3.11+)");
        return;
    };
    let has_pyrage = Command::new(&python).args(["-c", "import pyrage"]).status().is_ok_and(|s| s.success());
    assert!(has_pyrage, "pyrage is not installed in .venv-tinker: run `.ci/run` once, or `.venv-tinker/bin/python -m pip install pyrage==1.4.0`");
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    common::tiny_byte_model(&model, 64, 128, 17);
    let port = free_port();
    let _server = start_server(&model, &dir.path().join("data"), port);
    let stdout = run_script(&python, "external_weights.py", port, dir.path());
    assert!(stdout.contains("decrypted == plain export") && stdout.contains("URLs 404"), "{stdout}");
}
