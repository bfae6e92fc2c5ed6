//! Experiment tracking (`[tracking]`): tiny SFT and RL runs of the `oxrl` binary with every
//! backend, read back with TensorBoard's and W&B's own packages (`tests/tracking/read_back.py`)
//! and compared with `metrics.jsonl`, value for value; a resume; bad names and interpreters
//! refused at start; the W&B worker's life (Ctrl-C, a dead worker, Drop, oxrl killed) with no
//! process left behind.
//!
//! The packages live in `.venv-tinker/` (git-ignored), which `.ci/run` installs (pinned below):
//! tests download nothing, so without them they fail with the command to run. They are skipped,
//! with a message, only when no Python 3 is installed. W&B runs offline (`WANDB_MODE=offline` in
//! the environment of the run, or of a wrapper interpreter for the library-level tests), with
//! its config and cache folders in the test's temporary directory.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use oxrl::launch::sft_dispatch;
use oxrl::trainer::metrics::METRICS_FILE;
use oxrl::trainer::tracking::wandb::{WandbInit, WandbWorker};
use oxrl::trainer::tracking::{Backend, Tracker, TrackingSection};
use oxrl::trainer::{RlConfig, RunOptions, SftConfig};
use serde_json::{json, Map, Value};

const WANDB: &str = "wandb==0.31.0";
const TENSORBOARD: &str = "tensorboard==2.21.0";
/// The variable that marks the processes of one test (inherited by the W&B worker and by
/// wandb's service process), to find any left behind.
const TAG: &str = "OXRL_TRACKING_TEST";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The venv's python with wandb and tensorboard installed, or None when there is no Python at
/// all. Found once per test process.
fn python() -> Option<PathBuf> {
    static PYTHON: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    PYTHON.get_or_init(find_python).clone()
}

fn find_python() -> Option<PathBuf> {
    let venv = repo().join(".venv-tinker");
    let python = venv.join("bin/python");
    let (wandb, tb) = (&WANDB[7..], &TENSORBOARD[13..]);
    let check = format!(
        "import wandb, tensorboard, sys; sys.exit(0 if (wandb.__version__, tensorboard.__version__) == ('{wandb}', '{tb}') else 1)"
    );
    if python.exists() && Command::new(&python).args(["-c", &check]).status().is_ok_and(|s| s.success()) {
        return Some(python);
    }
    if !["python3", "python"].into_iter().any(|p| Command::new(p).arg("--version").output().is_ok()) {
        eprintln!("skipped: no Python 3 installed");
        return None;
    }
    panic!(
        "{WANDB} and {TENSORBOARD} are not installed in {}: run `.ci/run` once, or `python3 -m venv .venv-tinker && \
         .venv-tinker/bin/python -m pip install {WANDB} {TENSORBOARD}`",
        venv.display()
    );
}

/// The environment of a tracked run: W&B offline, its folders under `tmp`, and the test's tag.
fn offline_env(tmp: &Path, tag: &str) -> Vec<(String, String)> {
    let dir = |name: &str| tmp.join(name).display().to_string();
    vec![
        ("WANDB_MODE".into(), "offline".into()),
        ("WANDB_CONFIG_DIR".into(), dir("wandb-config")),
        ("WANDB_CACHE_DIR".into(), dir("wandb-cache")),
        ("WANDB_DATA_DIR".into(), dir("wandb-data")),
        (TAG.into(), tag.into()),
    ]
}

/// An interpreter for `tracking.python` that runs the venv's python with `env` and `args`
/// before the worker's own (a shell script that execs it: the worker's pid is python's).
fn wrapper(tmp: &Path, name: &str, python: &Path, env: &[(String, String)], args: &str) -> PathBuf {
    let exports: String = env.iter().map(|(k, v)| format!("export {k}='{v}'\n")).collect();
    let path = tmp.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{exports}exec '{}' {args} \"$@\"\n", python.display())).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A tag unique to this test run.
fn tag(name: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

/// The live processes whose environment holds `TAG=tag` (zombies have none).
fn tagged_processes(tag: &str) -> Vec<(u32, String)> {
    let needle = format!("{TAG}={tag}");
    let mut found = vec![];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        if environ.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            found.push((pid, cmd.chars().take(120).collect()));
        }
    }
    found
}

/// No process of the test is left (wandb's service exits once its parent is gone: give it a
/// few seconds).
fn assert_none_left(tag: &str) {
    let start = Instant::now();
    loop {
        let left = tagged_processes(tag);
        if left.is_empty() {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "processes left behind: {left:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether process `pid` is gone, or a zombie (dead, not yet reaped) whose threads have all
/// exited too (before that its files, pipes included, are still open).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => {
            let zombie = stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'));
            let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
            zombie && threads <= 1
        }
    }
}

fn wait_gone(pid: u32, within: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    gone(pid)
}

/// What the backends hold for `run_dir`, read back by `tests/tracking/read_back.py`.
fn read_back(python: &Path, run_dir: &Path) -> Value {
    let out = Command::new(python).arg(repo().join("tests/tracking/read_back.py")).arg(run_dir).output().unwrap();
    assert!(out.status.success(), "read_back.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

type Series = BTreeMap<String, Vec<(u64, f64)>>;

/// A value of `read_back.py`'s: the exact decimal of a double, as a string.
fn exact(v: &Value) -> f64 {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v}")).parse().unwrap()
}

/// `{key: [[step, value], ...]}` of `read_back.py`'s.
fn series(v: &Value) -> Series {
    let points = |p: &Value| p.as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap(), exact(&p[1]))).collect();
    v.as_object().unwrap().iter().map(|(k, p)| (k.clone(), points(p))).collect()
}

/// The steps of `metrics.jsonl`'s lines, as `read_back.py` gives them.
fn steps(back: &Value) -> Vec<u64> {
    back["metrics"]["steps"].as_array().unwrap().iter().map(|s| s.as_u64().unwrap()).collect()
}

/// TensorBoard's scalars and the last W&B run's history hold exactly `metrics.jsonl`'s values
/// (TensorBoard's as f32) at every step; the W&B run (of `wandb_runs` in the folder) finished
/// with exit code 0, under the run directory's name. Returns what `read_back.py` read.
fn assert_backends_hold_the_metrics(python: &Path, run_dir: &Path, wandb_runs: usize) -> Value {
    let back = read_back(python, run_dir);
    let expected = series(&back["metrics"]["series"]);
    assert!(expected.len() > 3 && !steps(&back).is_empty(), "{back}");

    let as_f32: Series =
        expected.iter().map(|(k, v)| (k.clone(), v.iter().map(|&(s, x)| (s, x as f32 as f64)).collect())).collect();
    assert_eq!(series(&back["tensorboard"]["scalars"]), as_f32, "TensorBoard's scalars are not metrics.jsonl's");

    let runs = back["wandb"].as_array().unwrap();
    assert_eq!(runs.len(), wandb_runs, "W&B runs: {runs:?}");
    let run = runs.last().unwrap();
    assert_eq!(run["exit_code"], json!(0));
    assert_eq!(run["name"], json!(run_dir.file_name().unwrap().to_string_lossy()));
    let history = run["history"].as_array().unwrap();
    let history_steps: Vec<u64> = history.iter().map(|h| h[0].as_u64().unwrap()).collect();
    assert_eq!(history_steps, steps(&back));
    let mut wb = Series::new();
    for h in history {
        for (k, v) in h[1].as_object().unwrap() {
            wb.entry(k.clone()).or_default().push((h[0].as_u64().unwrap(), exact(v)));
        }
    }
    assert_eq!(wb, expected, "W&B's history is not metrics.jsonl's");
    back
}

/// Runs the `oxrl` binary in `tmp` with `env`; its output (stderr shown if it fails and
/// `must_succeed`).
fn oxrl(tmp: &Path, args: &[&str], env: &[(String, String)]) -> Output {
    let out = common::oxrl_command().args(args).current_dir(tmp).envs(env.iter().cloned()).output().unwrap();
    assert!(out.status.success(), "oxrl {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    out
}

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"messages":[{"role":"user","content":"Hello, world!"},{"role":"assistant","content":"the answer is 42"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"def add(a, b)"},{"role":"assistant","content":"return a + b"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
];

/// An SFT config file in `tmp` on the qwen3 fixture: batches of 2, eval (2 of the 6 rows) every
/// 2 steps, `max_steps` steps, run directory `run-sft`, and `tracking` as the `[tracking]`
/// table's body.
fn sft_config(tmp: &Path, max_steps: usize, tracking: &str) -> PathBuf {
    std::fs::write(tmp.join("data.jsonl"), ROWS.join("\n") + "\n").unwrap();
    let config = format!(
        "[model]\npath = {:?}\n[data]\ntrain_file = \"data.jsonl\"\neval_fraction = 0.34\n\
         [optimizer]\nlr = 0.01\n[train]\nbatch_size = 2\nmicro_batch_size = 1\nmax_steps = {max_steps}\neval_every = 2\n\
         [output]\nrun_dir = \"run-sft\"\n[tracking]\n{tracking}\n",
        common::fixture_dir("qwen3").display().to_string()
    );
    let path = tmp.join("sft.toml");
    std::fs::write(&path, config).unwrap();
    path
}

#[test]
fn an_sft_run_tracks_every_metric_to_tensorboard_and_wandb() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path();
    let tag = tag("sft");
    let config = sft_config(tmp, 4, &format!("python = {:?}", python.display().to_string()));
    // The backends set on the command line, as any key.
    let set = r#"tracking.backends=["jsonl", "tensorboard", "wandb"]"#;
    oxrl(tmp, &["sft", "--config", config.to_str().unwrap(), "--set", set], &offline_env(tmp, &tag));
    let back = assert_backends_hold_the_metrics(&python, &tmp.join("run-sft"), 1);
    assert_eq!(steps(&back), [1, 2, 3, 4]);
    // Keys on some steps only are tracked on those steps.
    let eval_steps: Vec<u64> = series(&back["metrics"]["series"])["eval_loss"].iter().map(|p| p.0).collect();
    assert_eq!(eval_steps, [2, 4]);
    // W&B's run config is the resolved config.
    let config = &back["wandb"][0]["config"];
    assert_eq!(config["train"]["max_steps"], json!(4));
    assert_eq!(config["tracking"]["backends"], json!(["jsonl", "tensorboard", "wandb"]));
    assert_none_left(&tag);
}

#[test]
fn an_rl_run_tracks_every_metric_to_tensorboard_and_wandb() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path();
    let tag = tag("rl");
    let model = tmp.join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let config = format!(
        "[model]\npath = \"model\"\n[data]\nsynthetic_train = 16\nsynthetic_eval = 3\n\
         [rollout]\nn_samples = 4\neval_samples = 2\n[env]\nmax_turn_tokens = 6\n\
         [train]\nprompts_per_step = 4\nmax_steps = 3\neval_every = 2\n[optimizer]\nlr = 1e-3\n\
         [output]\nrun_dir = \"run-rl\"\n\
         [tracking]\nbackends = [\"jsonl\", \"tensorboard\", \"wandb\"]\nproject = \"oxrl-tests\"\npython = {:?}\n",
        python.display().to_string()
    );
    std::fs::write(tmp.join("rl.toml"), config).unwrap();
    oxrl(tmp, &["rl", "--config", "rl.toml"], &offline_env(tmp, &tag));
    let back = assert_backends_hold_the_metrics(&python, &tmp.join("run-rl"), 1);
    assert_eq!(steps(&back), [1, 2, 3]);
    let eval_steps: Vec<u64> = series(&back["metrics"]["series"])["eval_pass_at_1"].iter().map(|p| p.0).collect();
    assert_eq!(eval_steps, [2, 3]);
    let config = &back["wandb"][0]["config"];
    assert_eq!(config["mode"], json!("sync"));
    assert_eq!(config["train"]["prompts_per_step"], json!(4));
    // The project is W&B's, not in the offline run's records: its folder names the run.
    assert_none_left(&tag);
}

/// A resumed run writes a new event file and replays the kept lines into it: TensorBoard shows
/// the resumed run's value of every step, also of steps the first run had logged after its last
/// checkpoint.
#[test]
fn a_resumed_run_shows_the_latest_value_of_every_step() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path();
    std::fs::write(tmp.join("data.jsonl"), ROWS.join("\n") + "\n").unwrap();
    let run_dir = tmp.join("run");
    let sets: Vec<String> = vec![
        format!("model.path={:?}", common::fixture_dir("qwen3").display().to_string()),
        format!("data.train_file={:?}", tmp.join("data.jsonl").display().to_string()),
        format!("output.run_dir={:?}", run_dir.display().to_string()),
        "train.batch_size=2".into(),
        "train.micro_batch_size=1".into(),
        "train.max_steps=4".into(),
        "train.checkpoint_every=2".into(),
        r#"tracking.backends=["jsonl", "tensorboard"]"#.into(),
    ];
    let cfg = SftConfig::load(None, &sets).unwrap();
    let run = |opts: RunOptions| {
        let dispatch = sft_dispatch(&cfg, Some(1)).unwrap();
        oxrl::trainer::sft::run_sft(&cfg, &dispatch, &opts).unwrap()
    };
    assert!(run(RunOptions { stop_after: Some(3), ..Default::default() }).interrupted);
    let first = series(&read_back(&python, &run_dir)["metrics"]["series"])["elapsed_s"].clone();
    // As if the first run had died after logging step 3: its last checkpoint is step 2.
    std::fs::remove_dir_all(run_dir.join("checkpoints/step_000003")).unwrap();
    assert!(!run(RunOptions { resume: true, ..Default::default() }).interrupted);

    let back = read_back(&python, &run_dir);
    assert_eq!(steps(&back), [1, 2, 3, 4]);
    let metrics = series(&back["metrics"]["series"]);
    assert_eq!(metrics["elapsed_s"][..2], first[..2]);
    assert_ne!(metrics["elapsed_s"][2], first[2], "the resumed step 3 should differ in its timing");
    assert_eq!(back["tensorboard"]["files"], json!(2));
    let as_f32: Series =
        metrics.iter().map(|(k, v)| (k.clone(), v.iter().map(|&(s, x)| (s, x as f32 as f64)).collect())).collect();
    assert_eq!(series(&back["tensorboard"]["scalars"]), as_f32);
    assert!(back["wandb"].as_array().unwrap().is_empty());
}

#[test]
fn unknown_backends_and_a_missing_jsonl_are_refused_with_the_key() {
    let sft = |backends: &str| {
        let sets = ["model.path=m".to_string(), "data.train_file=d".into(), format!("tracking.backends={backends}")];
        SftConfig::load(None, &sets).unwrap_err().to_string()
    };
    let rl = |backends: &str| {
        let sets = ["model.path=m".to_string(), format!("tracking.backends={backends}")];
        RlConfig::load(None, &sets).unwrap_err().to_string()
    };
    let unknown =
        "unknown tracking backend `tensorbord`; did you mean `tensorboard`? (valid: jsonl, tensorboard, wandb)";
    for e in [sft(r#"["jsonl", "tensorbord"]"#), rl(r#"["jsonl", "tensorbord"]"#)] {
        assert!(e.contains("tracking.backends") && e.contains(unknown), "{e}");
    }
    let e = sft(r#"["wandbb"]"#);
    assert!(e.contains("unknown tracking backend `wandbb`; did you mean `wandb`?"), "{e}");
    for e in [sft(r#"["tensorboard"]"#), rl(r#"["wandb"]"#)] {
        assert!(e.contains("`tracking.backends`: must include \"jsonl\""), "{e}");
    }
    let e = rl(r#"["jsonl", "wandb", "wandb"]"#);
    assert!(e.contains("\"wandb\" is listed twice"), "{e}");
    // The defaults: metrics.jsonl alone.
    let d = SftConfig::default().tracking;
    assert_eq!(d, TrackingSection::default());
    assert_eq!(RlConfig::default().tracking, d);
    assert_eq!(d.backends, [Backend::Jsonl]);
}

#[test]
fn wandb_start_failures_are_errors_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path();
    // No such interpreter: the SFT run fails in its run directory's opening, before a step.
    let config = sft_config(tmp, 2, "backends = [\"jsonl\", \"wandb\"]\npython = \"/nonexistent/python3\"");
    let cfg = SftConfig::load(Some(&config), &[]).unwrap();
    let dispatch = sft_dispatch(&cfg, Some(1)).unwrap();
    let e = oxrl::trainer::sft::run_sft(&cfg, &dispatch, &RunOptions::default()).unwrap_err().to_string();
    assert_eq!(
        e,
        "invalid input: tracking backend `wandb`: cannot run tracking.python = `/nonexistent/python3`: \
         No such file or directory (os error 2)"
    );
    let run_dir = tmp.join("run-sft");
    assert!(!run_dir.join(METRICS_FILE).exists() && !run_dir.join("checkpoints").exists());

    let Some(python) = python() else { return };
    let tag = tag("start");
    let env = offline_env(tmp, &tag);
    let start = |python: &Path| {
        let section = TrackingSection {
            backends: vec![Backend::Jsonl, Backend::Wandb],
            python: python.display().to_string(),
            ..Default::default()
        };
        Tracker::start(&section, tmp, &json!({})).err().expect("should not start").to_string()
    };
    // An interpreter without wandb (the venv's, without its site-packages).
    let e = start(&wrapper(tmp, "no-wandb", &python, &env, "-S"));
    assert!(e.contains("cannot import wandb: ModuleNotFoundError: No module named 'wandb'"), "{e}");
    assert!(e.starts_with("tracking backend `wandb` (worker `"), "{e}");
    // wandb.init failing (an invalid WANDB_MODE).
    let mut bad_mode = env.clone();
    bad_mode[0].1 = "bogus".into();
    let e = start(&wrapper(tmp, "bad-mode", &python, &bad_mode, ""));
    assert!(e.contains("wandb.init failed: ValidationError") && e.contains("bogus"), "{e}");
    // An interpreter that dies before it answers.
    let e = start(&wrapper(tmp, "dies", &python, &env, "-c 'import sys; sys.stderr.write(\"boom\\n\"); sys.exit(3)'"));
    assert!(e.contains("the worker ended before wandb.init returned (exit status: 3)") && e.ends_with("boom"), "{e}");
    assert_none_left(&tag);
}

/// Reads the single W&B run under `dir`.
fn only_wandb_run(python: &Path, dir: &Path) -> Value {
    let back = read_back(python, dir);
    let runs = back["wandb"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{runs:?}");
    runs[0].clone()
}

fn metrics(loss: f64) -> Map<String, Value> {
    json!({"loss": loss, "tokens": 12}).as_object().unwrap().clone()
}

#[test]
fn the_wandb_worker_ignores_sigint_reports_its_death_and_never_stays_behind() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tag = tag("worker");
    let offline = wrapper(dir.path(), "python-offline", &python, &offline_env(dir.path(), &tag), "");
    let start = |name: &str| {
        let run = dir.path().join(name);
        std::fs::create_dir_all(&run).unwrap();
        let init = WandbInit { project: "oxrl-tests", name, dir: &run, config: &json!({"a": 1}) };
        (WandbWorker::start(offline.to_str().unwrap(), &init, Duration::from_secs(120)).unwrap(), run)
    };

    // Ctrl-C reaches the worker too when it is sent to a process group it is in: it goes on.
    let (mut w, run) = start("sigint");
    w.log(1, &metrics(0.5)).unwrap();
    unsafe { libc::kill(w.pid() as i32, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(300));
    w.log(2, &metrics(0.25)).unwrap();
    let pid = w.pid();
    w.close().unwrap();
    assert!(gone(pid));
    let r = only_wandb_run(&python, &run);
    assert_eq!(r["exit_code"], json!(0));
    assert_eq!(r["config"]["a"], json!(1));
    assert_eq!(r["history"], json!([[1, {"loss": "0.5", "tokens": "12.0"}], [2, {"loss": "0.25", "tokens": "12.0"}]]));

    // A worker that died: the next line is an error naming it.
    let (mut w, _) = start("killed");
    w.log(1, &metrics(0.5)).unwrap();
    unsafe { libc::kill(w.pid() as i32, libc::SIGKILL) };
    assert!(wait_gone(w.pid(), Duration::from_secs(10)));
    let e = w.log(2, &metrics(0.25)).unwrap_err().to_string();
    assert!(e.starts_with("tracking backend `wandb` (worker `") && e.contains("the worker has died (signal: 9"), "{e}");
    drop(w);

    // Dropped without close (an error ended the run): the W&B run ends as failed, the worker
    // exits.
    let (mut w, run) = start("dropped");
    w.log(1, &metrics(0.5)).unwrap();
    let pid = w.pid();
    drop(w);
    assert!(gone(pid));
    let r = only_wandb_run(&python, &run);
    assert_eq!(r["exit_code"], json!(1));
    assert_eq!(r["history"], json!([[1, {"loss": "0.5", "tokens": "12.0"}]]));
    assert_none_left(&tag);
}

/// `oxrl sft` with W&B, started in a process group of its own as a shell would; returns it
/// once its first metrics line is written, with its W&B worker's pid.
fn long_sft_run(tmp: &Path, python: &Path, tag: &str) -> (std::process::Child, u32) {
    use std::os::unix::process::CommandExt;
    let config = sft_config(
        tmp,
        100_000,
        &format!("backends = [\"jsonl\", \"wandb\"]\npython = {:?}", python.display().to_string()),
    );
    let mut child = common::oxrl_command()
        .args(["sft", "--config", config.to_str().unwrap()])
        .current_dir(tmp)
        .envs(offline_env(tmp, tag))
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let metrics = tmp.join("run-sft").join(METRICS_FILE);
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |t| t.is_empty()) {
        assert!(child.try_wait().unwrap().is_none(), "oxrl sft ended early");
        assert!(start.elapsed() < Duration::from_secs(120), "no metrics line after 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let oxrl = child.id();
    let worker = tagged_processes(tag)
        .into_iter()
        .find(|(pid, _)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1)).and_then(|p| p.parse().ok());
            ppid == Some(oxrl)
        })
        .expect("the W&B worker, a child of oxrl");
    (child, worker.0)
}

#[test]
fn ctrl_c_finishes_the_wandb_run_and_a_killed_oxrl_takes_its_worker_along() {
    let Some(python) = python() else { return };

    // Ctrl-C to the whole process group: oxrl finishes its step, checkpoints, closes W&B.
    let dir = tempfile::tempdir().unwrap();
    let tag_int = tag("ctrl-c");
    let (child, _) = long_sft_run(dir.path(), &python, &tag_int);
    unsafe { libc::kill(-(child.id() as i32), libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let run_dir = dir.path().join("run-sft");
    assert!(!out.status.success() && run_dir.join("checkpoints").exists(), "{out:?}");
    let back = read_back(&python, &run_dir);
    assert_eq!(back["wandb"].as_array().unwrap().len(), 1);
    let r = &back["wandb"][0];
    assert_eq!(r["exit_code"], json!(0));
    let history = r["history"].as_array().unwrap();
    assert_eq!(history.len(), steps(&back).len());
    let losses = series(&back["metrics"]["series"])["loss"].clone();
    assert_eq!(exact(&history.last().unwrap()[1]["loss"]), losses.last().unwrap().1);
    assert_none_left(&tag_int);

    // oxrl killed: its worker dies with it.
    let dir = tempfile::tempdir().unwrap();
    let tag_kill = tag("kill");
    let (mut child, worker) = long_sft_run(dir.path(), &python, &tag_kill);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(wait_gone(worker, Duration::from_secs(10)), "the W&B worker outlived oxrl");
    assert_none_left(&tag_kill);
}
