//! The user's Python code in RL: verl-style reward functions and SkyRL-style text envs through the
//! worker pool, the ecosystem's datasets as they are, and every fault of user code (an
//! exception, a hang, a wrong return type, a worker that dies, a missing file, function or class)
//! with its message — and no Python process left behind after any of them.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use oxrl::env::python::{CallResult, PoolSpec, PythonPool};
use oxrl::trainer::rl::run_rl;
use oxrl::trainer::{RlConfig, RunOptions};
use serde_json::{json, Map, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn spec(file: &str, name: &str, timeout_s: f64) -> PoolSpec {
    PoolSpec {
        python: "python3".into(),
        workers: 1,
        timeout: Duration::from_secs_f64(timeout_s),
        start_timeout: Duration::from_secs(60),
        reward: Some((fixture(file).display().to_string(), name.into())),
        env_modules: vec![],
    }
}

fn score_call(solution: &str, extra_info: Value) -> Map<String, Value> {
    let call = json!({"op": "score", "args": {
        "data_source": "test", "solution_str": solution, "ground_truth": "42", "extra_info": extra_info,
    }});
    call.as_object().unwrap().clone()
}

/// Every pid gone (killed and reaped) once the pool is dropped.
fn assert_gone(pids: &[u32]) {
    for pid in pids.iter().filter(|&&p| p != 0) {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "python worker {pid} outlived its pool");
    }
}

/// Python processes started by the process `parent` (the worker's `--oxrl-parent` argument).
fn workers_of(parent: u32) -> Vec<String> {
    let tag = format!("--oxrl-parent={parent}");
    let mut found = vec![];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(&tag) {
                found.push(entry.file_name().to_string_lossy().to_string());
            }
        }
    }
    found
}

#[test]
fn the_pool_scores_batches_with_sync_and_async_functions() {
    let pool = PythonPool::start(PoolSpec { workers: 2, ..spec("python/faults.py", "good", 30.0) }).unwrap();
    let handles: Vec<_> = ["42", "7", "4200"].iter().map(|s| pool.call(None, score_call(s, Value::Null))).collect();
    let results: Vec<CallResult> = handles.into_iter().map(|h| h.wait().unwrap()).collect();
    assert_eq!(results[0], CallResult::Ok(json!({"score": 1.0, "extra": {"acc": 1.0, "length": 2.0}})));
    assert_eq!(results[1], CallResult::Ok(json!({"score": 0.25, "extra": {"acc": 0.0, "length": 1.0}})));
    assert_eq!(results[2], CallResult::Ok(json!({"score": 0.25, "extra": {"acc": 0.0, "length": 4.0}})));
    let pids = pool.pids();
    assert_eq!(pids.len(), 2);
    drop(pool);
    assert_gone(&pids);

    let pool = PythonPool::start(spec("python/faults.py", "good_async", 30.0)).unwrap();
    assert!(pool.ready().reward_async);
    let handles: Vec<_> = (1..=20).map(|n| pool.call(None, score_call(&"x".repeat(n), Value::Null))).collect();
    for (n, h) in (1..=20).zip(handles) {
        assert_eq!(h.wait().unwrap(), CallResult::Ok(json!({"score": n as f64 / 10.0, "extra": {}})));
    }
}

#[test]
fn each_fault_of_a_reward_function_is_reported() {
    let one = |name: &str, solution: &str, timeout_s: f64, extra: Value| {
        let pool = PythonPool::start(spec("python/faults.py", name, timeout_s)).unwrap();
        let result = pool.call(None, score_call(solution, extra)).wait().unwrap();
        let pids = pool.pids();
        drop(pool);
        assert_gone(&pids);
        result
    };
    match one("raises", "a", 30.0, Value::Null) {
        CallResult::Raised(tb) => {
            assert!(tb.contains("KeyError: 'missing key'"), "{tb}");
            assert!(tb.contains("faults.py\", line"), "the traceback names the file and line: {tb}");
        }
        other => panic!("{other:?}"),
    }
    for (name, what) in [
        ("returns_string", "must be a number, got str"),
        ("returns_nan", "is nan"),
        ("no_score", "returned a dict without `score` (keys: reward)"),
    ] {
        match one(name, "a", 30.0, Value::Null) {
            CallResult::BadReturn(m) => assert!(m.contains(what), "{name}: {m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    // A worker that dies is restarted and the call sent again once; twice is a failure.
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        one("dies_once", "a", 30.0, json!({"dir": dir.path()})),
        CallResult::Ok(json!({"score": 0.75, "extra": {}}))
    );
    match one("dies_always", "a", 30.0, Value::Null) {
        CallResult::Died(why) => {
            assert!(why.contains("died twice") && why.contains("about to die"), "{why}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_call_past_the_timeout_is_cut_and_the_others_go_on() {
    let pool = PythonPool::start(spec("python/faults.py", "hangs", 1.0)).unwrap();
    let first = pool.pids();
    let calls: Vec<_> = ["a", "hang", "b"].iter().map(|s| pool.call(None, score_call(s, Value::Null))).collect();
    let results: Vec<CallResult> = calls.into_iter().map(|h| h.wait().unwrap()).collect();
    let ok = CallResult::Ok(json!({"score": 0.5, "extra": {}}));
    assert_eq!(results, vec![ok.clone(), CallResult::TimedOut(Duration::from_secs(1)), ok.clone()]);
    assert_gone(&first); // the hung worker was killed and a new one started
    assert_eq!(pool.call(None, score_call("c", Value::Null)).wait().unwrap(), ok);
    let pids = pool.pids();
    drop(pool);
    assert_gone(&pids);
}

#[test]
fn missing_files_functions_and_classes_fail_at_start() {
    let start_err = |s: PoolSpec| PythonPool::start(s).err().expect("must fail").to_string();
    let e = start_err(spec("python/nope.py", "compute_score", 30.0));
    assert!(e.contains("reward.custom_function: no file") && e.contains("nope.py"), "{e}");
    let e = start_err(spec("python/faults.py", "compute_score", 30.0));
    assert!(e.contains("has no function `compute_score`"), "{e}");
    let e = start_err(spec("python/faults.py", "not_a_function", 30.0));
    assert!(e.contains("`not_a_function`") && e.contains("is not callable"), "{e}");
    let e = start_err(PoolSpec { python: "/no/such/python".into(), ..spec("python/faults.py", "good", 30.0) });
    assert!(e.contains("cannot start the Python interpreter `/no/such/python`"), "{e}");
    let modules =
        |m: &str| PoolSpec { reward: None, env_modules: vec![m.into()], ..spec("python/faults.py", "good", 30.0) };
    let e = start_err(modules("no_such_module_xyz"));
    assert!(e.contains("ModuleNotFoundError") && e.contains("no_such_module_xyz"), "{e}");
    let e = start_err(modules(&fixture("python/faults.py").display().to_string()));
    assert!(e.contains("defines no environment class"), "{e}");
    let pool = PythonPool::start(modules(&fixture("python/text_envs.py").display().to_string())).unwrap();
    assert_eq!(pool.ready().env_classes, ["NeverDoneEnv", "RaisingEnv", "TwoTurnEnv"]);
}

// --- RL runs -------------------------------------------------------------------------------------

/// A tiny GRPO run on `train_file` (one-token replies at temperature 1, so a few are bare digits
/// and earn the format reward: rewards vary and the policy moves).
fn sets(model: &Path, run: &Path, train_file: &Path, extra: &[&str]) -> Vec<String> {
    let mut sets = vec![
        format!("model.path={}", model.display()),
        format!("output.run_dir={}", run.display()),
        format!("data.train_file={}", train_file.display()),
        "data.eval_fraction=0.125".into(),
        "rollout.n_samples=8".into(),
        "rollout.eval_samples=2".into(),
        "env.max_turn_tokens=1".into(),
        "train.prompts_per_step=4".into(),
        "train.max_steps=3".into(),
        "train.eval_every=2".into(),
        "algorithm.loss_config={ ent_coef = 0.05 }".into(),
        "optimizer.lr=1e-3".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

fn run(sets: &[String]) -> oxrl::Result<(Vec<Value>, Vec<u8>)> {
    let cfg = RlConfig::load(None, sets)?;
    let (d, engines) = oxrl::launch::rl_runtime(&cfg, Some(1))?;
    run_rl(&cfg, &d, &engines, &RunOptions::default())?;
    let lines = std::fs::read_to_string(cfg.output.run_dir.join("metrics.jsonl")).unwrap();
    let weights = std::fs::read(cfg.output.run_dir.join("final/model.safetensors")).unwrap();
    Ok((lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect(), weights))
}

/// `sets` resolved and written to `dir/name.toml`, for the `oxrl` binary.
fn write_config(dir: &Path, name: &str, sets: &[String]) -> PathBuf {
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, RlConfig::load(None, sets).unwrap().to_toml().unwrap()).unwrap();
    config
}

/// `oxrl rl --config config`'s exit status and stderr.
fn oxrl_rl(config: &Path) -> (bool, String) {
    let out = common::oxrl_command().args(["rl", "--config"]).arg(config).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

/// A metrics line without the keys that measure time.
fn untimed(line: &Value) -> Map<String, Value> {
    let mut m = line.as_object().unwrap().clone();
    m.retain(|k, _| !k.starts_with("time_") && !matches!(k.as_str(), "samples_per_s" | "elapsed_s" | "peak_rss_gb"));
    m
}

fn assert_same_run(builtin: &(Vec<Value>, Vec<u8>), python: &(Vec<Value>, Vec<u8>), what: &str) {
    assert_eq!(builtin.0.len(), python.0.len(), "{what}");
    for (a, b) in builtin.0.iter().zip(&python.0) {
        assert_eq!(untimed(a), untimed(b), "{what}: the metrics differ");
    }
    assert!(builtin.1 == python.1, "{what}: the final weights differ");
    let rewarded: f64 = builtin.0.iter().map(|l| l["reward_mean"].as_f64().unwrap()).sum();
    assert!(rewarded > 0.0, "{what}: no episode earned a reward, so the comparison shows little");
}

/// verl's parquet of the demo's task scored by a Python `compute_score` that computes what the
/// built-in `arithmetic` env computes: the same run, bit for bit, in sync and in async mode.
#[test]
fn a_python_reward_trains_what_the_builtin_env_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let data = fixture("verl/arithmetic.parquet");
    let reward = fixture("python/arithmetic_reward.py");
    for (mode, extra) in [("sync", vec![]), ("async", vec!["mode=\"async\"", "async_rl.max_staleness=0"])] {
        let mut builtin = extra.clone();
        builtin.extend(["data.env=\"arithmetic\"", "env.format_reward=0.5"]);
        let mut python = extra.clone();
        let path = format!("reward.custom_function.path={}", reward.display());
        python.extend([path.as_str(), "reward.custom_function.name=\"compute_score_format_half\""]);
        let a = run(&sets(&model, &tmp.path().join(format!("{mode}-builtin")), &data, &builtin)).unwrap();
        let b = run(&sets(&model, &tmp.path().join(format!("{mode}-python")), &data, &python)).unwrap();
        assert_same_run(&a, &b, mode);
    }
}

/// The same under `mpirun -np 2`: each process its own pool.
#[cfg(feature = "mpi")]
#[test]
fn a_python_reward_trains_what_the_builtin_env_trains_under_mpi() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let base = sets(&model, &tmp.path().join("unused"), &fixture("verl/arithmetic.parquet"), &[]);
    let config = write_config(tmp.path(), "rl", &base);
    let reward = format!("reward.custom_function.path=\"{}\"", fixture("python/arithmetic_reward.py").display());
    let both = |run: &str, extra: &[&str]| {
        let mut s = vec![format!("output.run_dir=\"{run}\"")];
        s.extend(extra.iter().map(|x| x.to_string()));
        let s: Vec<&str> = s.iter().map(String::as_str).collect();
        let out = common::mpirun(2, "rl", &config, &s).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let dir = tmp.path().join(run);
        let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let lines: Vec<Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (lines, std::fs::read(dir.join("final/model.safetensors")).unwrap())
    };
    let a = both("builtin", &["data.env=\"arithmetic\"", "env.format_reward=0.5"]);
    let b = both("python", &[&reward, "reward.custom_function.name=\"compute_score_format_half\"", "reward.workers=2"]);
    assert_same_run(&a, &b, "mpirun -np 2");
}

/// verl's GSM8K rows train with the built-in `math` env and no code; a reward function's extra
/// keys are logged per step and per data source.
#[test]
fn verl_gsm8k_rows_train_with_the_math_env_and_extra_keys_are_logged() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let data = fixture("verl/gsm8k.parquet");
    let (lines, _) = run(&sets(&model, &tmp.path().join("math"), &data, &["data.env=\"math\""])).unwrap();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["episodes_generated"], 32);
    assert_eq!(lines[0]["reward/openai/gsm8k/score"], lines[0]["reward_mean"]);

    let reward = format!("reward.custom_function.path={}", fixture("python/faults.py").display());
    let (lines, _) =
        run(&sets(&model, &tmp.path().join("extras"), &data, &[&reward, "reward.custom_function.name=\"good\""]))
            .unwrap();
    for l in &lines {
        // `good` scores 1 for the answer (two of the rows' answers are one digit), else 0.25;
        // `acc` is its verdict, `length` the reply's characters.
        let acc = l["reward/acc"].as_f64().unwrap();
        assert_eq!(l["reward_mean"].as_f64().unwrap(), 0.25 + 0.75 * acc, "{l}");
        assert_eq!(l["correct_mean"], l["reward/acc"], "{l}");
        let length = l["reward/length"].as_f64().unwrap();
        assert!((0.0..=4.0).contains(&length), "{l}"); // one byte decodes to at most one char (or U+FFFD)
        assert_eq!(l["reward/openai/gsm8k/length"], l["reward/length"], "{l}");
    }
}

fn skyrl_rows(dir: &Path, class: &str) -> PathBuf {
    let path = dir.join(format!("{class}.jsonl"));
    let rows: Vec<String> = (0..8)
        .map(|i| {
            json!({
                "prompt": [{"role": "user", "content": format!("Say {i}.")}],
                "env_class": class,
                "reward_spec": {"method": "rule", "ground_truth": i.to_string()},
                "extra_info": {"index": i},
            })
            .to_string()
        })
        .collect();
    std::fs::write(&path, rows.join("\n")).unwrap();
    path
}

/// SkyRL's rows with a two-turn Python env train (two turns an episode); an env that never says
/// done stops at env.max_turns, truncated, with the rewards of its turns.
#[test]
fn skyrl_rows_with_python_envs_train_and_the_turn_limit_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 512, 7);
    let modules = format!("env.python_modules=[\"{}\"]", fixture("python/text_envs.py").display());
    let two = skyrl_rows(tmp.path(), "TwoTurnEnv");
    let (lines, _) = run(&sets(&model, &tmp.path().join("two"), &two, &[&modules])).unwrap();
    for l in &lines {
        assert_eq!(l["turns_mean"], 2.0, "{l}");
        let r = l["reward_mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&r) && (r * 64.0).fract() == 0.0, "{l}");
    }
    let never = skyrl_rows(tmp.path(), "NeverDoneEnv");
    let (lines, _) = run(&sets(&model, &tmp.path().join("never"), &never, &[&modules, "env.max_turns=3"])).unwrap();
    for l in &lines {
        assert_eq!(l["turns_mean"], 3.0, "{l}");
        assert_eq!(l["reward_mean"], 0.75, "{l}");
    }
    let raising = skyrl_rows(tmp.path(), "RaisingEnv");
    let e = run(&sets(&model, &tmp.path().join("raising"), &raising, &[&modules])).unwrap_err().to_string();
    assert!(
        e.contains("env class `RaisingEnv` (step) raised on row") && e.contains("ValueError: the env broke"),
        "{e}"
    );
    assert!(e.contains("RaisingEnv.jsonl:"), "the row's file:line: {e}");
}

/// A reward function that raises stops the run with the traceback and the row after a checkpoint
/// (and leaves no Python process); with `on_error = "zero"` the run goes on and counts them.
#[test]
fn a_raising_reward_stops_the_run_after_a_checkpoint_or_scores_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let data = fixture("verl/arithmetic.parquet");
    let reward = format!("reward.custom_function.path={}", fixture("python/faults.py").display());
    let name = "reward.custom_function.name=\"raises_after_32_calls\"";
    let config = write_config(tmp.path(), "raise", &sets(&model, &tmp.path().join("raise"), &data, &[&reward, name]));
    let mut c = common::oxrl_command();
    c.args(["rl", "--config"]).arg(&config).args(["--set", "train.checkpoint_every=1"]);
    let child = c.stderr(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("reward.custom_function `raises_after_32_calls`") && err.contains("raised on row"), "{err}");
    assert!(err.contains("arithmetic.parquet: row") && err.contains("RuntimeError: call 33"), "{err}");
    assert!(err.contains("faults.py\", line"), "{err}");
    // The first step finished and is kept.
    assert!(err.contains("checkpoint at step 1") && err.contains("--resume"), "{err}");
    assert!(tmp.path().join("raise/checkpoints/step_000001/trainer_state.json").exists());
    assert_eq!(std::fs::read_to_string(tmp.path().join("raise/metrics.jsonl")).unwrap().lines().count(), 1);
    // Fixed, it resumes from there.
    let mut c = common::oxrl_command();
    c.args(["rl", "--resume", "--config"]).arg(&config).args(["--set", "reward.custom_function.name=\"good\""]);
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(tmp.path().join("raise/metrics.jsonl")).unwrap().lines().count(), 3);
    assert!(workers_of(pid).is_empty(), "python workers left behind: {:?}", workers_of(pid));

    // Scored 0 and counted instead.
    let zero = sets(
        &model,
        &tmp.path().join("zero"),
        &data,
        &[&reward, "reward.custom_function.name=\"raises\"", "reward.on_error=\"zero\""],
    );
    let (lines, _) = run(&zero).unwrap();
    for l in &lines {
        assert_eq!(l["reward_errors"], 32, "{l}");
        assert_eq!(l["reward_mean"], 0.0, "{l}");
    }
    // A wrong return type is an error even so: it is a bug, not a case of the data.
    let bad = sets(
        &model,
        &tmp.path().join("bad"),
        &data,
        &[&reward, "reward.custom_function.name=\"returns_nan\"", "reward.on_error=\"zero\""],
    );
    let e = run(&bad).unwrap_err().to_string();
    assert!(e.contains("`returns_nan`") && e.contains("returned a bad value for row") && e.contains("is nan"), "{e}");
}

/// A missing function is an error at start, before any model is loaded (the model path is bad
/// too: the reward's error comes first).
#[test]
fn a_missing_function_fails_before_the_model_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let reward = format!("reward.custom_function.path={}", fixture("python/faults.py").display());
    let s =
        sets(&tmp.path().join("no-model"), &tmp.path().join("run"), &fixture("verl/arithmetic.parquet"), &[&reward]);
    let (ok, err) = oxrl_rl(&write_config(tmp.path(), "function", &s));
    assert!(!ok);
    assert!(err.contains("has no function `compute_score`"), "{err}");
    assert!(!tmp.path().join("run").exists(), "nothing ran");
    // A row naming an env class the modules do not define: its file:line, before the model too.
    let rows = skyrl_rows(tmp.path(), "TwoTurnEnvv");
    let modules = format!("env.python_modules=[\"{}\"]", fixture("python/text_envs.py").display());
    let s = sets(&tmp.path().join("no-model"), &tmp.path().join("run"), &rows, &[&modules]);
    let (ok, err) = oxrl_rl(&write_config(tmp.path(), "class", &s));
    assert!(!ok);
    assert!(err.contains("TwoTurnEnvv.jsonl: row 1") || err.contains("TwoTurnEnvv.jsonl:1"), "{err}");
    assert!(err.contains("unknown env `TwoTurnEnvv`; did you mean `TwoTurnEnv`?"), "{err}");
}

/// Ctrl-C (a checkpoint, then exit) and a trainer killed outright both take the Python workers
/// with them.
#[test]
fn no_python_worker_outlives_an_interrupted_or_killed_trainer() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let reward = format!("reward.custom_function.path={}", fixture("python/arithmetic_reward.py").display());
    for (signal, run) in [("-INT", "interrupted"), ("-KILL", "killed")] {
        let s = sets(
            &model,
            &tmp.path().join(run),
            &fixture("verl/arithmetic.parquet"),
            &[&reward, "train.max_steps=100000", "reward.workers=2"],
        );
        let config = write_config(tmp.path(), run, &s);
        let mut child = common::oxrl_command()
            .args(["rl", "--config"])
            .arg(&config)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let metrics = tmp.path().join(run).join("metrics.jsonl");
        let started = std::time::Instant::now();
        while std::fs::read_to_string(&metrics).map_or(true, |t| t.lines().count() < 2) {
            assert!(started.elapsed().as_secs() < 120, "the run did not get going");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(workers_of(child.id()).len(), 2, "two workers while it runs");
        let kill = std::process::Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
        assert!(kill.success());
        child.wait().unwrap();
        // The kernel delivers the parent-death signal as the trainer's threads end.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !workers_of(child.id()).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(workers_of(child.id()).is_empty(), "{run}: python workers left: {:?}", workers_of(child.id()));
        if signal == "-INT" {
            let checkpoints = std::fs::read_dir(tmp.path().join(run).join("checkpoints")).unwrap().count();
            assert!(checkpoints >= 1, "Ctrl-C leaves a checkpoint");
        }
    }
}
