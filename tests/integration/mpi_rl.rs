//! Sync RL over several processes under `mpirun` (the cargo feature `mpi`): each process samples
//! its share of every step's groups on its own engine and evaluates its share of the eval
//! prompts; the run trains what the same data-parallel ranks as threads of one process train,
//! bit for bit, and is within 1e-6 of one rank. The processes are spawned by this test binary.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use oxrl::trainer::RlConfig;

/// A GRPO config in `dir` (KL penalty, so the reference model runs across processes too;
/// evaluation every step) on a tiny byte-level model, `steps` steps.
fn write_config(dir: &Path, steps: usize) -> PathBuf {
    let model = dir.join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let mut sets = common::tiny_grpo_sets(&model, steps, 1e-3);
    sets.push("algorithm.kl.coef=0.05".into());
    let path = dir.join("rl.toml");
    std::fs::write(&path, RlConfig::load(None, &sets).unwrap().to_toml().unwrap()).unwrap();
    path
}

fn ok(out: Output) -> Output {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn metrics(run: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn two_processes_train_what_two_threads_do() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 3);
    ok(common::mpirun(2, "rl", &config, &["output.run_dir=\"mpi\""]).output().unwrap());
    let in_process = |run: &str, dp: usize| {
        let mut c = common::oxrl_command();
        c.current_dir(dir.path()).args(["rl", "--config"]).arg(&config);
        c.args(["--set", &format!("output.run_dir=\"{run}\""), "--set", &format!("launch.data_parallel={dp}")]);
        ok(c.output().unwrap());
    };
    in_process("dp2", 2);
    in_process("dp1", 1);
    let model = |run: &str| dir.path().join(run).join("final/model.safetensors");
    let (mpi, dp2, dp1) = (model("mpi"), model("dp2"), model("dp1"));
    assert!(std::fs::read(&mpi).unwrap() == std::fs::read(&dp2).unwrap(), "mpirun -np 2 differs from dp = 2");
    let d = common::file_max_diff(&mpi, &dp1);
    assert!(d <= 1e-6, "mpirun -np 2 is {d} from one rank");
    assert!(common::file_max_diff(&mpi, &dir.path().join("model/model.safetensors")) > 1e-3, "nothing trained");
    // Process 0 alone wrote the run: a line a step, with the groups (rewards), the update and the
    // evaluation (shared among the processes) of the threads' run.
    let (a, b) = (metrics(&dir.path().join("mpi")), metrics(&dir.path().join("dp2")));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        for key in ["reward_mean", "episodes_generated", "loss", "grad_norm", "kl_mean", "eval_pass_at_1"] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
    }
}

#[test]
fn async_rl_under_mpirun_is_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 1);
    let out = common::mpirun(2, "rl", &config, &["mode=\"async\"", "output.run_dir=\"run\""]).output().unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("mode = \"async\" runs in one process"), "{text}");
    assert!(!dir.path().join("run").exists(), "the refused run wrote its directory");
}
