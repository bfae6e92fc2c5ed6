//! The fully asynchronous RL loop end to end on a tiny model: equal to the synchronous trainer
//! with `max_staleness = 0`, bounded staleness and complete prompt bookkeeping otherwise, and
//! no prompt trained twice or skipped across a SIGKILL and resume.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use oxrl::dispatch::Dispatch;
use oxrl::rollout::EngineClient;
use oxrl::trainer::rl::run_rl;
use oxrl::trainer::RlConfig;
use oxrl::trainer::RunOptions;
use serde_json::Value;

pub(crate) fn config(model: &Path, run: &Path, extra: &[&str]) -> RlConfig {
    let mut sets: Vec<String> = vec![
        format!("model.path={}", model.display()),
        format!("output.run_dir={}", run.display()),
        "data.synthetic_train=40".into(),
        "data.synthetic_eval=8".into(),
        "rollout.n_samples=4".into(),
        "rollout.eval_samples=2".into(),
        "env.max_turn_tokens=6".into(),
        "train.prompts_per_step=4".into(),
        "train.mini_batches=2".into(),
        "train.max_steps=3".into(),
        "train.eval_every=0".into(),
        "train.seed=5".into(),
        // An entropy bonus: every step changes the policy even without reward.
        "algorithm.loss_config={ ent_coef = 0.05 }".into(),
        "optimizer.lr=5e-3".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    RlConfig::load(None, &sets).unwrap()
}

fn runtime(cfg: &RlConfig) -> (Dispatch, EngineClient) {
    oxrl::launch::rl_runtime(cfg, Some(1)).unwrap()
}

pub(crate) fn metric_lines(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub(crate) fn safetensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let tensors = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    let mut v: Vec<(String, Vec<f32>)> =
        tensors.into_iter().map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn staleness_zero_reproduces_the_synchronous_trainer() {
    let tmp = sync_and_staleness_zero(&[]);
    assert_same_training(&tmp.path().join("sync"), &tmp.path().join("async"), 0.0);
}

/// 10 prompts, 4 a step, 4 steps: steps cross the end of the prompt set mid-batch, and the
/// async stream must cut its groups across epochs as the sync loader does. Bit-identical.
#[test]
fn staleness_zero_reproduces_the_synchronous_trainer_on_a_ragged_prompt_set() {
    let tmp = sync_and_staleness_zero(&["data.synthetic_train=10", "train.max_steps=4"]);
    assert_same_training(&tmp.path().join("sync"), &tmp.path().join("async"), 0.0);
}

/// A directory with a model and the runs `sync` and `async` (`max_staleness = 0`) on it.
fn sync_and_staleness_zero(extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path();
    let model = tmp.join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    for (name, mode) in [("sync", &["mode=\"sync\""][..]), ("async", &["mode=\"async\"", "async_rl.max_staleness=0"])] {
        let sets: Vec<&str> = mode.iter().chain(extra).copied().collect();
        let cfg = config(&model, &tmp.join(name), &sets);
        let (d, engines) = runtime(&cfg);
        let s = run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap();
        assert_eq!(s.steps, cfg.train.max_steps);
    }
    dir
}

/// Same final parameters (within `tol`; 0: bit for bit) and the same metrics step by step; and
/// the runs trained.
fn assert_same_training(sync: &Path, asy: &Path, tol: f32) {
    let finals = [sync, asy].map(|run| safetensors(&run.join("final/model.safetensors")));
    let initial = safetensors(&sync.parent().unwrap().join("model/model.safetensors"));
    let (mut max_diff, mut moved) = (0f32, 0f32);
    for (((name, a), (_, b)), (_, init)) in finals[0].iter().zip(&finals[1]).zip(&initial) {
        for ((x, y), z) in a.iter().zip(b).zip(init) {
            max_diff = max_diff.max((x - y).abs());
            moved = moved.max((x - z).abs());
        }
        assert_eq!(a.len(), b.len(), "{name}");
    }
    assert!(max_diff <= tol, "async (max_staleness 0) differs from sync by {max_diff}");
    assert!(moved > 1e-3, "the runs did not train ({moved})");
    let (sync, asy) = (metric_lines(sync), metric_lines(asy));
    assert_eq!(sync.len(), asy.len());
    for (a, b) in sync.iter().zip(&asy) {
        // Every metric the sync run writes, but the timings (the sampler's log-probs too: they do
        // not depend on the engine's batch).
        for (key, x) in a.as_object().unwrap() {
            if !key.starts_with("time_") && key != "samples_per_s" && key != "peak_rss_gb" {
                assert_eq!(x, &b[key], "`{key}` at step {}", a["step"]);
            }
        }
        assert_eq!(b["staleness_max"], 0.0);
    }
}

/// `max_staleness` is part of an async run's checkpoint: a resume keeps the bound, and a config
/// that changes it is refused by name (the books of the stream were kept under the old bound).
#[test]
fn max_staleness_survives_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let run = tmp.path().join("run");
    let sets = |staleness: &str| -> Vec<String> {
        vec![
            "mode=\"async\"".into(),
            format!("async_rl.max_staleness={staleness}"),
            "train.max_steps=4".into(),
            "train.checkpoint_every=1".into(),
        ]
    };
    let cfg = |s: &str| config(&model, &run, &sets(s).iter().map(String::as_str).collect::<Vec<_>>());
    let first = cfg("2");
    let (d, engines) = runtime(&first);
    let s = run_rl(&first, &d, &engines, &RunOptions { stop_after: Some(2), ..Default::default() }).unwrap();
    assert_eq!(s.steps, 2);
    let state = read_state(&run.join("checkpoints/step_000002"));
    assert_eq!(state["stream"]["staleness"]["max_staleness"], 2, "{state}");

    let changed = cfg("1");
    let (d, engines) = runtime(&changed);
    let err =
        run_rl(&changed, &d, &engines, &RunOptions { resume: true, ..Default::default() }).unwrap_err().to_string();
    assert!(err.contains("async_rl.max_staleness") && err.contains('2') && err.contains('1'), "{err}");

    let same = cfg("2");
    let (d, engines) = runtime(&same);
    let s = run_rl(&same, &d, &engines, &RunOptions { resume: true, ..Default::default() }).unwrap();
    assert_eq!(s.steps, 4);
    let state = read_state(&run.join("checkpoints/step_000004"));
    assert_eq!(state["stream"]["staleness"]["max_staleness"], 2, "{state}");
    assert_complete(&state, "resumed run");
    assert!(metric_lines(&run).iter().all(|l| l["staleness_max"].as_f64().unwrap() <= 2.0));
}

/// With max_staleness 1 and dynamic sampling: every metric of the mode is written, no group is
/// staler than the bound, and the checkpoint's ids are complete: consumed ∪ filtered ∪ pending is
/// 0..K with every id once.
#[test]
fn bounded_staleness_with_filtering_keeps_complete_books() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let extra = [
        "mode=\"async\"",
        "async_rl.max_staleness=1",
        "async_rl.weight_update=\"abort\"",
        "algorithm.zero_variance_filter=true",
        "train.max_steps=4",
        "train.eval_every=2",
    ];
    let cfg = config(&model, &tmp.path().join("run"), &extra);
    let (d, engines) = runtime(&cfg);
    let s = run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 4);
    let lines = metric_lines(&tmp.path().join("run"));
    assert_eq!(lines.len(), 4);
    for line in &lines {
        for key in [
            "staleness_mean",
            "staleness_max",
            "weight_version",
            "time_wait_data_s",
            "time_wait_capacity_s",
            "episodes_mixed_versions",
            "reward_mean",
            "samples_per_s",
        ] {
            assert!(line.get(key).is_some(), "metrics line lacks `{key}`: {line}");
        }
        assert!(line["staleness_max"].as_f64().unwrap() <= 1.0, "{line}");
        assert_eq!(line["episodes_trained"], 16);
    }
    // Two optimizer steps per step (two mini-batches).
    assert_eq!(lines[3]["weight_version"], 8);
    assert!(lines[1].get("eval_pass_at_1").is_some());

    let state = read_state(&tmp.path().join("run/checkpoints/step_000004"));
    let consumed = ids(&state["stream"]["consumed"]);
    assert_eq!(consumed.len(), 16);
    assert_complete(&state, "final checkpoint");
    assert!(tmp.path().join("run/staleness.png").exists());

    // The synchronous trainer refuses to resume an asynchronous run's checkpoint.
    let sync = config(&model, &tmp.path().join("run"), &["mode=\"sync\"", "train.max_steps=6"]);
    let (d, engines) = runtime(&sync);
    let err = run_rl(&sync, &d, &engines, &RunOptions { resume: true, ..Default::default() }).unwrap_err().to_string();
    assert!(err.contains("mode = \"async\""), "{err}");
}

fn read_state(checkpoint: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(checkpoint.join("trainer_state.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// consumed ∪ filtered ∪ pending = 0..K, each id once.
fn assert_complete(state: &Value, what: &str) {
    let s = &state["stream"];
    let mut all: Vec<u64> = [ids(&s["consumed"]), ids(&s["filtered"]), ids(&s["pending"])].concat();
    let unique: BTreeSet<u64> = all.iter().copied().collect();
    assert_eq!(unique.len(), all.len(), "{what}: an id is recorded twice: {s}");
    all.sort();
    assert_eq!(all, (0..all.len() as u64).collect::<Vec<_>>(), "{what}: an id is missing: {s}");
}

fn write_config(dir: &Path, run: &str) -> PathBuf {
    let path = dir.join(format!("{run}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
mode = "async"
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
zero_variance_filter = true
loss_config = {{ ent_coef = 0.05 }}
[async_rl]
max_staleness = 2
[optimizer]
lr = 5e-3
[train]
prompts_per_step = 4
max_steps = 8
eval_every = 0
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
fn sigkill_then_resume_trains_no_prompt_twice_and_skips_none() {
    let tmp = tempfile::tempdir().unwrap();
    common::tiny_byte_model(&tmp.path().join("model"), 32, 256, 3);
    // Killed once the checkpoint of a step drawn at random (1 to 5 of 8) exists.
    let kill_after = common::random_step(5);
    let cfg = write_config(tmp.path(), "cut");
    let checkpoint = tmp.path().join(format!("cut/checkpoints/step_{kill_after:06}"));
    common::rl_killed_after(&cfg, &checkpoint);
    assert!(!tmp.path().join("cut/final").exists(), "the run finished before the kill (kill_after {kill_after})");
    let before = read_state(&checkpoint);
    assert_complete(&before, "checkpoint before the kill");
    let out = common::oxrl_command().args(["rl", "--resume", "--config"]).arg(&cfg).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("resumed from"), "killed after step {kill_after}");

    let after = read_state(&tmp.path().join("cut/checkpoints/step_000008"));
    assert_complete(&after, "final checkpoint");
    let consumed = ids(&after["stream"]["consumed"]);
    assert_eq!(consumed.len(), 8 * 4, "8 steps of 4 groups");
    // The resumed run extends the books it was resumed from.
    let (c0, f0) = (ids(&before["stream"]["consumed"]), ids(&before["stream"]["filtered"]));
    assert_eq!(&consumed[..c0.len()], &c0[..]);
    assert_eq!(&ids(&after["stream"]["filtered"])[..f0.len()], &f0[..]);
    let lines = metric_lines(&tmp.path().join("cut"));
    assert_eq!(lines.iter().map(|l| l["step"].as_u64().unwrap()).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>());
    assert!(lines.iter().all(|l| l["staleness_max"].as_f64().unwrap() <= 2.0));
}
