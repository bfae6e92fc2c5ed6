//! RL over several processes under `mpirun` (the cargo feature `mpi`): each process samples its
//! share of every step's groups on its own engine, or on an engine process of the job that
//! process 0 updates over MPI; async RL with process 0 generating. Each run trains what the same
//! data-parallel ranks as threads of one process train, bit for bit (sync: within 1e-6 of one
//! rank). The processes are spawned by this test binary.

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
    // Sharded across the processes (the owners' sums, the gathered parameters; under `full` the
    // layers gathered for every forward and backward, the reference's too): the same bits.
    for mode in ["gradients", "full"] {
        let sets = [format!("output.run_dir=\"{mode}\""), format!("launch.sharding=\"{mode}\"")];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        ok(common::mpirun(2, "rl", &config, &sets).output().unwrap());
        assert!(std::fs::read(model(mode)).unwrap() == std::fs::read(&dp2).unwrap(), "{mode} mpirun -np 2 differs");
        for (x, y) in metrics(&dir.path().join(mode)).iter().zip(&b) {
            assert_eq!((&x["loss"], &x["grad_norm"]), (&y["loss"], &y["grad_norm"]), "{mode}, step {}", x["step"]);
        }
    }
}

/// `mpirun -np 2 oxrl rl … : -np 1 oxrl engine --model MODEL …`: two trainer processes and a
/// sampling engine process of their MPI job (which they share; process 0 broadcasts weights).
fn mpirun_with_engine(config: &Path, sets: &[&str], engine_args: &[&str]) -> std::process::Command {
    let model = config.parent().unwrap().join("model");
    let mut c = common::mpirun(2, "rl", config, sets);
    c.args([":", "-np", "1", env!("CARGO_BIN_EXE_oxrl"), "--threads", "1", "engine", "--model"]).arg(model);
    c.args(["--listen", "127.0.0.1:0"]).args(engine_args);
    c
}

/// Runs `oxrl rl` as one process with 2 data-parallel ranks and its own engine, into `run`;
/// returns the exported policy (`file` of `final/`).
fn in_process_dp2(config: &Path, run: &str, sets: &[&str], file: &str) -> Vec<u8> {
    let dir = config.parent().unwrap();
    let mut c = common::oxrl_command();
    c.current_dir(dir).args(["rl", "--config"]).arg(config);
    c.args(["--set", &format!("output.run_dir=\"{run}\""), "--set", "launch.data_parallel=2"]);
    for s in sets {
        c.args(["--set", s]);
    }
    ok(c.output().unwrap());
    std::fs::read(dir.join(run).join("final").join(file)).unwrap()
}

/// Sync RL with the sampling engine a process of the trainers' MPI job: both trainer processes
/// sample their share on it, process 0 broadcasts each step's weights over MPI, and the run
/// trains what 2 ranks of one process with their own engine do, bit for bit. The job ends (the
/// engine leaves when the trainers are done).
#[test]
fn an_engine_in_the_mpi_job_takes_weights_over_mpi() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 3);
    let out = ok(mpirun_with_engine(&config, &["output.run_dir=\"job\""], &[]).output().unwrap());
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(text.matches("oxrl engine: listening on http://127.0.0.1:").count(), 1, "{text}");
    let job = std::fs::read(dir.path().join("job/final/model.safetensors")).unwrap();
    assert!(
        job == in_process_dp2(&config, "dp2", &[], "model.safetensors"),
        "the MPI job with an engine process differs from dp = 2"
    );
    let initial = dir.path().join("model/model.safetensors");
    assert!(common::file_max_diff(&dir.path().join("job/final/model.safetensors"), &initial) > 1e-3, "nothing trained");
    let (a, b) = (metrics(&dir.path().join("job")), metrics(&dir.path().join("dp2")));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        for key in ["reward_mean", "weight_version", "loss", "eval_pass_at_1"] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
    }
}

/// Async RL across processes: process 0 generates on the job's engine process (LoRA adapters
/// broadcast in flight, `keep` mode) and hands each step's groups to process 1; with
/// `max_staleness = 0` the run equals sync RL of 2 ranks in one process, bit for bit.
#[test]
fn async_rl_across_processes_with_staleness_0_equals_sync() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), 3);
    let lora = ["model.lora.rank=4", "model.lora.alpha=8"];
    let mut sets = vec!["output.run_dir=\"job\"", "mode=\"async\"", "async_rl.max_staleness=0"];
    sets.extend(lora);
    ok(mpirun_with_engine(&config, &sets, &["--lora-rank", "4"]).output().unwrap());
    let job = std::fs::read(dir.path().join("job/final/adapter_model.safetensors")).unwrap();
    let sync = in_process_dp2(&config, "sync", &lora, "adapter_model.safetensors");
    assert!(job == sync, "async across processes differs from sync RL");
    let lines = metrics(&dir.path().join("job"));
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| l["staleness_max"] == 0.0), "{lines:?}");
    assert!(lines.iter().all(|l| l["grad_norm"].as_f64().unwrap() > 0.0), "nothing trained: {lines:?}");
}
