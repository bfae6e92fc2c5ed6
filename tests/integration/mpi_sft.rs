//! SFT over several processes under `mpirun` (the cargo feature `mpi`): the same parameters, bit
//! for bit, as the same data-parallel ranks as threads of one process, sharded or not; a bit-exact resume after
//! a kill, under mpirun or as threads of one process; a killed process ends the run instead of
//! hanging it. The processes are spawned by
//! this test binary, so the runner counts these tests.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
    r#"{"messages":[{"role":"user","content":"def add(a, b)"},{"role":"assistant","content":"return a + b"}]}"#,
];

/// A config in `dir` training the qwen3 fixture for `steps` steps into `dir/<run>`.
fn write_config(dir: &Path, steps: usize) -> PathBuf {
    std::fs::write(dir.join("data.jsonl"), ROWS.join("\n") + "\n").unwrap();
    let path = dir.join("run.toml");
    let model = common::fixture_dir("qwen3");
    std::fs::write(
        &path,
        format!(
            "[model]\npath = {:?}\n[data]\ntrain_file = \"data.jsonl\"\n[optimizer]\nlr = 0.01\n\
             [train]\nbatch_size = 2\nmicro_batch_size = 1\nmax_steps = {steps}\neval_every = 0\n\
             checkpoint_every = 1\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    path
}

fn mpirun(np: usize, config: &Path, sets: &[&str]) -> Command {
    common::mpirun(np, "sft", config, sets)
}

fn ok(out: Output) -> Output {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn oxrl_sft(config: &Path, sets: &[&str]) -> Output {
    let mut c = common::oxrl_command();
    c.current_dir(config.parent().unwrap()).args(["sft", "--config"]).arg(config);
    for s in sets {
        c.args(["--set", s]);
    }
    ok(c.output().unwrap())
}

#[test]
fn two_processes_train_what_two_threads_do() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 3);
    ok(mpirun(2, &config, &["output.run_dir=\"mpi\""]).output().unwrap());
    oxrl_sft(&config, &["output.run_dir=\"dp2\"", "train.data_parallel=2"]);
    oxrl_sft(&config, &["output.run_dir=\"dp1\""]);
    let model = |run: &str| dir.path().join(run).join("final/model.safetensors");
    let (mpi, dp2, dp1) = (model("mpi"), model("dp2"), model("dp1"));
    assert!(std::fs::read(&mpi).unwrap() == std::fs::read(&dp2).unwrap(), "mpirun -np 2 differs from dp = 2");
    let d = common::file_max_diff(&mpi, &dp1);
    assert!(d <= 1e-6, "mpirun -np 2 is {d} from one rank");
    assert!(
        common::file_max_diff(&mpi, &common::fixture_dir("qwen3").join("model.safetensors")) > 1e-4,
        "nothing trained"
    );
    // Process 0 alone wrote the run: one metrics line a step, equal to the threads' run's losses.
    let lines = |run: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.path().join(run).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (a, b) = (lines("mpi"), lines("dp2"));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((&x["loss"], &x["grad_norm"]), (&y["loss"], &y["grad_norm"]));
    }
}

/// Sharding across processes: `mpirun -np 2` under `gradients`, `-np 3` under `optimizer`, and
/// `full` at 2 and 3 processes end with the parameters (and losses, gradient norms) of the same
/// ranks unsharded as threads of one process, bit for bit, the norm clipped; the checkpoints the
/// sharded processes wrote (the optimizer state and, under `full`, the weights gathered to process
/// 0) resume as unsharded threads to the same end. The same with the gradients summed after each
/// micro-batch (`gradients` at 2 processes, `full` at 3).
#[test]
fn sharded_processes_train_what_unsharded_threads_do() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 3);
    let clip = "optimizer.grad_clip_norm=0.05";
    let model = |run: &str| std::fs::read(dir.path().join(run).join("final/model.safetensors")).unwrap();
    let lines = |run: &str| std::fs::read_to_string(dir.path().join(run).join("metrics.jsonl")).unwrap();
    let norms = |text: String| -> Vec<(serde_json::Value, serde_json::Value)> {
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|v| (v["loss"].clone(), v["grad_norm"].clone()))
            .collect()
    };
    for np in [2, 3] {
        oxrl_sft(&config, &[&format!("output.run_dir=\"dp{np}\""), &format!("train.data_parallel={np}"), clip]);
    }
    for (np, mode) in [(2, "gradients"), (3, "optimizer"), (2, "full"), (3, "full")] {
        let run = format!("mpi{np}{mode}");
        ok(mpirun(np, &config, &[&format!("output.run_dir=\"{run}\""), &format!("train.sharding=\"{mode}\""), clip])
            .output()
            .unwrap());
        assert!(model(&run) == model(&format!("dp{np}")), "mpirun -np {np} under {mode} differs");
        assert_eq!(norms(lines(&run)), norms(lines(&format!("dp{np}"))), "{mode} at {np}");
    }
    // Summed across the processes after each of a rank's two micro-batches.
    let each = ["train.batch_size=4", "train.gradient_sum=\"micro_batch\"", clip];
    for (np, mode) in [(2, "gradients"), (3, "full")] {
        let (threads, run) = (format!("each_dp{np}"), format!("each_mpi{np}{mode}"));
        let (out, dp, shard) = (
            format!("output.run_dir=\"{threads}\""),
            format!("train.data_parallel={np}"),
            format!("train.sharding=\"{mode}\""),
        );
        oxrl_sft(&config, &[&[out.as_str(), dp.as_str()][..], &each].concat());
        let out = format!("output.run_dir=\"{run}\"");
        let sets = [&[out.as_str(), shard.as_str()][..], &each].concat();
        ok(mpirun(np, &config, &sets).output().unwrap());
        assert!(model(&run) == model(&threads), "mpirun -np {np} under {mode}, summing each micro-batch, differs");
        assert_eq!(norms(lines(&run)), norms(lines(&threads)), "{mode} at {np}, summing each micro-batch");
    }
    // LoRA under `full`: each process keeps its slice of the frozen base.
    let lora = ["model.lora.rank=4", "model.lora.alpha=8"];
    let adapters = |run: &str| std::fs::read(dir.path().join(run).join("final/adapter_model.safetensors")).unwrap();
    oxrl_sft(&config, &[&["output.run_dir=\"lora_dp2\"", "train.data_parallel=2", clip][..], &lora].concat());
    let sets = [&["output.run_dir=\"lora_mpi2\"", "train.sharding=\"full\"", clip][..], &lora].concat();
    ok(mpirun(2, &config, &sets).output().unwrap());
    assert!(adapters("lora_mpi2") == adapters("lora_dp2"), "LoRA under full, mpirun -np 2, differs");
    assert_eq!(norms(lines("lora_mpi2")), norms(lines("lora_dp2")), "LoRA under full at 2");
    // Resume the step-2 checkpoints of sharded processes as unsharded threads.
    for (np, mode) in [(2, "gradients"), (3, "full")] {
        let (from, to) = (dir.path().join(format!("mpi{np}{mode}")), dir.path().join(format!("resumed{np}")));
        assert!(Command::new("cp").arg("-r").arg(&from).arg(&to).status().unwrap().success());
        std::fs::remove_dir_all(to.join("checkpoints/step_000003")).unwrap();
        std::fs::remove_dir_all(to.join("final")).unwrap();
        let mut c = common::oxrl_command();
        c.current_dir(dir.path()).args(["sft", "--resume", "--config"]).arg(&config);
        let sets = [format!("output.run_dir=\"resumed{np}\""), format!("train.data_parallel={np}"), clip.into()];
        for set in &sets {
            c.args(["--set", set]);
        }
        ok(c.output().unwrap());
        assert!(
            model(&format!("resumed{np}")) == model(&format!("dp{np}")),
            "the {mode} checkpoint resumed unsharded differs"
        );
    }
}

/// The oxrl processes mpirun started (its children), once there are `n`.
fn ranks_of(mpirun: u32, n: usize) -> Vec<String> {
    let t = Instant::now();
    loop {
        let out = Command::new("pgrep").args(["-P", &mpirun.to_string()]).output().unwrap();
        let pids: Vec<String> = String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect();
        if pids.len() == n || t.elapsed() > Duration::from_secs(30) {
            return pids;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `path` exists (or the run ended by itself).
fn wait_for(path: &Path, child: &mut std::process::Child) {
    let t = Instant::now();
    while !path.exists() && child.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(120), "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_killed_run_resumes_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 40);
    ok(mpirun(2, &config, &["output.run_dir=\"whole\""]).output().unwrap());
    // Both processes SIGKILLed once a checkpoint drawn at random (steps 1 to 5) exists.
    let kill_after = common::random_step(5);
    let mut child = mpirun(2, &config, &["output.run_dir=\"parts\""]).spawn().unwrap();
    let ranks = ranks_of(child.id(), 2);
    wait_for(&dir.path().join(format!("parts/checkpoints/step_{kill_after:06}")), &mut child);
    for pid in &ranks {
        let _ = Command::new("kill").args(["-9", pid]).status();
    }
    let _ = child.wait();
    assert!(!dir.path().join("parts/final").exists(), "the run finished before the kill (after step {kill_after})");
    // The same run resumed as two threads of one process: checkpoints do not depend on the layout.
    assert!(Command::new("cp")
        .arg("-r")
        .arg(dir.path().join("parts"))
        .arg(dir.path().join("threads"))
        .status()
        .unwrap()
        .success());
    let resumed = ok(mpirun(2, &config, &["output.run_dir=\"parts\""]).arg("--resume").output().unwrap());
    assert!(String::from_utf8_lossy(&resumed.stderr).contains("resumed from"));
    let mut c = common::oxrl_command();
    c.current_dir(dir.path()).args(["sft", "--resume", "--config"]).arg(&config);
    ok(c.args(["--set", "output.run_dir=\"threads\"", "--set", "train.data_parallel=2"]).output().unwrap());
    let model = |run: &str| std::fs::read(dir.path().join(run).join("final/model.safetensors")).unwrap();
    assert!(model("whole") == model("parts"), "killed after step {kill_after}: the resumed run differs");
    assert!(model("whole") == model("threads"), "killed after step {kill_after}: resumed as threads, it differs");
}

#[test]
fn a_killed_process_ends_the_run_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 100_000);
    let child = mpirun(2, &config, &["output.run_dir=\"run\"", "train.checkpoint_every=0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ranks = ranks_of(child.id(), 2);
    assert_eq!(ranks.len(), 2, "two processes under mpirun: {ranks:?}");
    // Once training runs, kill process 1 (the one that writes nothing).
    let metrics = dir.path().join("run/metrics.jsonl");
    let t = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 2 {
        assert!(t.elapsed() < Duration::from_secs(60), "the run did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed_at = Instant::now();
    assert!(Command::new("kill").args(["-9", &ranks[1]]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let waited = killed_at.elapsed();
    assert!(waited < Duration::from_secs(30), "the run took {waited:?} to end");
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("rank 1"), "the error does not name the killed process: {text}");
}

/// Processes started on different configs (here: another `train.max_steps` for process 1) are
/// refused at start, naming the process that differs.
#[test]
fn processes_on_different_configs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 3);
    // mpirun's MPMD form: one command per process, after the first mpirun's own options.
    let first = mpirun(1, &config, &["output.run_dir=\"run\""]);
    let mut args: Vec<std::ffi::OsString> = first.get_args().map(|a| a.to_os_string()).collect();
    args.extend([":", "-np", "1", env!("CARGO_BIN_EXE_oxrl"), "--threads", "1", "sft", "--config"].map(Into::into));
    args.extend([config.as_os_str().to_os_string(), "--set".into(), "output.run_dir=\"run\"".into()]);
    args.extend(["--set".into(), "train.max_steps=4".into()]);
    let mut c = Command::new("mpirun");
    c.args(&args).current_dir(dir.path());
    for (k, v) in first.get_envs() {
        if let Some(v) = v {
            c.env(k, v);
        }
    }
    let out = c.output().unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("differ from process 0") && text.contains("process 1"), "{text}");
}
