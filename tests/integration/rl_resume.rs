//! Resume after SIGKILL: `oxrl rl` killed at a random step and resumed with `--resume` ends with
//! the same parameters, bit for bit, as an uninterrupted run (and the same metrics).

use crate::common;

use std::path::{Path, PathBuf};

/// A config whose every step changes the policy: an entropy bonus gives gradients even when
/// the (random) model earns no reward; GRPO with a KL term to the reference on top.
fn write_config(dir: &Path, run: &str) -> PathBuf {
    let path = dir.join(format!("{run}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
[model]
path = "model"
[data]
synthetic_train = 60
synthetic_eval = 8
[env]
max_turn_tokens = 6
[rollout]
n_samples = 4
eval_samples = 2
[algorithm]
loss_config = {{ ent_coef = 0.05 }}
[algorithm.kl]
coef = 0.1
[optimizer]
lr = 5e-3
[train]
prompts_per_step = 4
max_steps = 6
eval_every = 3
checkpoint_every = 1
seed = 11
[output]
run_dir = "{run}"
"#
        ),
    )
    .unwrap();
    path
}

#[test]
fn sigkill_at_a_random_step_then_resume_equals_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    common::tiny_byte_model(&tmp.path().join("model"), 32, 256, 3);
    let whole = write_config(tmp.path(), "whole");
    let out = common::oxrl_command().args(["rl", "--config"]).arg(&whole).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Killed once the checkpoint of a step drawn at random, 1 to 4 of 6, exists.
    let kill_after = common::random_step(4);
    let cut = write_config(tmp.path(), "cut");
    let checkpoint = tmp.path().join(format!("cut/checkpoints/step_{kill_after:06}"));
    common::rl_killed_after(&cut, &checkpoint);
    assert!(!tmp.path().join("cut/final").exists(), "the run finished before the kill (kill_after {kill_after})");
    let out = common::oxrl_command().args(["rl", "--resume", "--config"]).arg(&cut).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("resumed from"), "killed after step {kill_after}");

    let a = std::fs::read(tmp.path().join("whole/final/model.safetensors")).unwrap();
    let b = std::fs::read(tmp.path().join("cut/final/model.safetensors")).unwrap();
    assert!(a == b, "killed after step {kill_after}: the resumed run's parameters differ");
    let read = |run: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(tmp.path().join(run).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                // Timings differ run to run; everything else must not.
                v.as_object_mut()
                    .unwrap()
                    .retain(|k, _| !k.starts_with("time_") && k != "samples_per_s" && k != "peak_rss_gb");
                v
            })
            .collect()
    };
    // Everything but timing is exact: sampler numerics do not depend on the engine's batch
    //, so the resumed run's metrics are the whole run's bits.
    let (whole, resumed) = (read("whole"), read("cut"));
    assert_eq!(whole.len(), resumed.len());
    for (a, b) in whole.iter().zip(&resumed) {
        assert_eq!(a, b, "killed after step {kill_after}: step {} differs", a["step"]);
    }
    // The run really trained: the final parameters are not the initial ones.
    let first = tmp.path().join("whole/checkpoints");
    assert!(first.exists());
    assert_ne!(a, std::fs::read(tmp.path().join("model/model.safetensors")).unwrap());
}
