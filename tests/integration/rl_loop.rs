//! The synchronous RL loop end to end on a tiny model: metrics, checkpoints, resume.

use crate::common;

use std::path::Path;

use oxrl::dispatch::Dispatch;
use oxrl::rollout::EngineClient;
use oxrl::trainer::rl::run_rl;
use oxrl::trainer::RlConfig;
use oxrl::trainer::RunOptions;

fn config(model: &Path, run: &Path, extra: &[&str]) -> RlConfig {
    let mut sets: Vec<String> = vec![
        format!("model.path={}", model.display()),
        format!("output.run_dir={}", run.display()),
        "data.synthetic_train=40".into(),
        "data.synthetic_eval=8".into(),
        "rollout.n_samples=4".into(),
        "rollout.eval_samples=2".into(),
        "env.max_turn_tokens=4".into(),
        "train.prompts_per_step=4".into(),
        "train.max_steps=3".into(),
        "train.eval_every=2".into(),
        "optimizer.lr=1e-3".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    RlConfig::load(None, &sets).unwrap()
}

fn runtime(cfg: &RlConfig) -> (Dispatch, EngineClient) {
    oxrl::launch::rl_runtime(cfg, Some(1)).unwrap()
}

#[test]
fn a_short_run_writes_metrics_checkpoints_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let cfg = config(&model, &tmp.path().join("run"), &["algorithm.kl.coef=0.05", "train.checkpoint_every=2"]);
    let (d, engines) = runtime(&cfg);
    let s = run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 3);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(tmp.path().join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for key in [
        "step",
        "reward_mean",
        "response_length_mean",
        "kl_mean",
        "entropy_mean",
        "clip_fraction",
        "grad_norm",
        "time_generate_s",
        "time_train_s",
        "time_sync_s",
        "samples_per_s",
    ] {
        assert!(lines[0].get(key).is_some(), "metrics line lacks `{key}`: {}", lines[0]);
    }
    assert!(lines[1].get("eval_pass_at_1").is_some() && lines[0].get("eval_pass_at_1").is_none());
    // Sync RL samples and trains on the same weights: the sampler's log-probs are the trainer's
    // bits, so the mismatch is exactly 0.
    for l in &lines {
        let m = l["logprob_mismatch_max"].as_f64().unwrap_or_else(|| panic!("{l}"));
        assert_eq!(m, 0.0, "logprob_mismatch_max: {l}");
    }
    eprintln!("{}", lines[2]);
    assert!(s.export_dir.unwrap().join("model.safetensors").exists());
}

/// Sampling at a temperature, the trainer's log-probs are those of the tempered distribution
/// the sampler drew from, bit for bit: the mismatch is 0 at T = 0.7 as at 1 (with the trainer
/// at the model's own distribution it is 0.107 here), a reference's KL at the same temperature.
#[test]
fn sampling_at_a_temperature_trains_on_the_samplers_logprobs() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let extra = ["rollout.temperature=0.7", "train.max_steps=2", "train.eval_every=0", "algorithm.kl.coef=0.05"];
    let cfg = config(&model, &tmp.path().join("run"), &extra);
    let (d, engines) = runtime(&cfg);
    run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap();
    let text = std::fs::read_to_string(tmp.path().join("run/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert_eq!(l["logprob_mismatch_max"].as_f64(), Some(0.0), "{l}");
    }
}

/// Every algorithm path runs end to end: GAE with a critic, a LoRA policy, dynamic sampling
/// with replacement and the zero-variance filter, rollout IS with truncated IS, sequence mean,
/// adaptive KL in the reward, several mini-batches and epochs.
#[test]
fn algorithm_variants_run_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let variants: [&[&str]; 5] = [
        &["algorithm.advantage=\"gae\"", "algorithm.lambda=0.95", "critic.lr=1e-3"],
        &[
            "model.lora.rank=4",
            "model.lora.targets=[\"q_proj\",\"v_proj\"]",
            "train.mini_batches=2",
            "train.update_epochs=2",
        ],
        &[
            "algorithm.dynamic_sampling=\"replace\"",
            "algorithm.max_sampling_rounds=2",
            "algorithm.zero_variance_filter=true",
        ],
        &[
            "algorithm.loss=\"rollout_is\"",
            "algorithm.off_policy.tis_level=\"token\"",
            "algorithm.reduction=\"sequence_mean\"",
        ],
        &[
            "algorithm.kl.coef=0.05",
            "algorithm.kl.in_reward=true",
            "algorithm.kl.adaptive=true",
            "algorithm.advantage=\"rloo\"",
        ],
    ];
    for (i, extra) in variants.iter().enumerate() {
        let mut sets = vec!["train.max_steps=2", "algorithm.loss_config.ent_coef=0.01"];
        if extra.iter().any(|s| s.contains("rollout_is")) {
            sets.pop(); // rollout_is has no entropy term of its own here; keep its config plain
        }
        sets.extend_from_slice(extra);
        let cfg = config(&model, &tmp.path().join(format!("run{i}")), &sets);
        let (d, engines) = runtime(&cfg);
        assert_eq!(d.ids().len(), 1 + cfg.needs_reference() as usize + cfg.needs_critic() as usize);
        let s = run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap_or_else(|e| panic!("variant {extra:?}: {e}"));
        if cfg.model.lora.rank > 0 {
            assert!(
                s.export_dir.as_ref().unwrap().join("adapter_model.safetensors").exists(),
                "a LoRA policy exports its adapter"
            );
        }
        assert_eq!(s.steps, 2, "variant {extra:?}");
        let text = std::fs::read_to_string(tmp.path().join(format!("run{i}/metrics.jsonl"))).unwrap();
        assert_eq!(text.lines().count(), 2, "variant {extra:?}");
        assert!(s.export_dir.unwrap().exists());
    }
}

#[test]
fn a_bad_prompt_row_is_reported_with_its_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let data = tmp.path().join("prompts.jsonl");
    std::fs::write(&data, "{\"prompt\": \"What is 1 + 1?\", \"answer\": \"2\"}\n{\"prompt\": \"What is 2 + 2?\"}\n")
        .unwrap();
    let cfg =
        config(&model, &tmp.path().join("run"), &[&format!("data.train_file={}", data.display()), "data.env=\"math\""]);
    let (d, engines) = runtime(&cfg);
    let err = run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap_err().to_string();
    assert!(err.contains("prompts.jsonl:2") && err.contains("answer"), "{err}");
    // With on_bad_row = skip the run goes on without it.
    let cfg = config(
        &model,
        &tmp.path().join("run2"),
        &[
            &format!("data.train_file={}", data.display()),
            "data.env=\"math\"",
            "data.on_bad_row=\"skip\"",
            "train.max_steps=1",
        ],
    );
    let (d, engines) = runtime(&cfg);
    assert_eq!(run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap().steps, 1);
}

/// From a random model: one-token replies, a format reward for any bare integer (the arithmetic
/// env's `format_reward`), full reward for the right one. GRPO must raise the mean reward.
#[test]
fn a_short_grpo_run_on_arithmetic_raises_the_reward() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let cfg = config(
        &model,
        &tmp.path().join("run"),
        &[
            "train.max_steps=30",
            "train.eval_every=0",
            "train.prompts_per_step=8",
            "rollout.n_samples=8",
            "env.max_turn_tokens=1",
            "env.format_reward=0.5",
            "optimizer.lr=2e-2",
            "train.seed=3",
        ],
    );
    let (d, engines) = runtime(&cfg);
    run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap();
    let rewards: Vec<f64> = std::fs::read_to_string(tmp.path().join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["reward_mean"].as_f64().unwrap())
        .collect();
    let first: f64 = rewards[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = rewards[25..].iter().sum::<f64>() / 5.0;
    eprintln!("reward: first 5 steps {first:.3}, last 5 {last:.3}: {rewards:?}");
    assert!(last > first + 0.3, "reward did not rise: {first:.3} → {last:.3}");
}

/// `RunOptions::finish_when` ends an RL run as finished (exported) once it says so, as in SFT;
/// it is asked after every step with the steps done.
#[test]
fn finish_when_ends_the_run_as_finished() {
    use std::sync::{Arc, Mutex};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    for mode in ["sync", "async"] {
        let run = tmp.path().join(mode);
        let cfg = config(&model, &run, &[&format!("mode=\"{mode}\""), "train.max_steps=5", "train.eval_every=0"]);
        let (d, engines) = runtime(&cfg);
        let asked = Arc::new(Mutex::new(vec![]));
        let log = asked.clone();
        let finish_when = oxrl::trainer::FinishWhen(Arc::new(move |steps, _d| {
            log.lock().unwrap().push(steps);
            Ok(steps == 2)
        }));
        let s =
            run_rl(&cfg, &d, &engines, &RunOptions { finish_when: Some(finish_when), ..Default::default() }).unwrap();
        assert_eq!(s.steps, 2, "{mode}");
        assert_eq!(*asked.lock().unwrap(), [1, 2], "{mode}");
        assert!(s.export_dir.unwrap().join("model.safetensors").exists(), "{mode}: finished runs export");
        assert_eq!(std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().count(), 2, "{mode}");
    }
}

/// `time_generate_s` is, in both modes, the wall seconds the loop waited for the step's groups:
/// a part of the step's wall time (so the parts of all steps fit in the run's), and in async
/// mode the same wait that `time_wait_data_s` reports.
#[test]
fn time_generate_s_is_the_wait_for_the_groups_in_both_modes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    for mode in ["sync", "async"] {
        let run = tmp.path().join(mode);
        let cfg = config(&model, &run, &[&format!("mode=\"{mode}\""), "train.eval_every=0"]);
        let (d, engines) = runtime(&cfg);
        let t = std::time::Instant::now();
        run_rl(&cfg, &d, &engines, &RunOptions::default()).unwrap();
        let wall = t.elapsed().as_secs_f64();
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let f = |l: &serde_json::Value, k: &str| l[k].as_f64().unwrap_or_else(|| panic!("{mode}: no `{k}` in {l}"));
        let parts: f64 =
            lines.iter().map(|l| f(l, "time_generate_s") + f(l, "time_train_s") + f(l, "time_sync_s")).sum();
        assert!(parts <= wall, "{mode}: the steps' parts ({parts} s) exceed the run's wall time ({wall} s)");
        for l in &lines {
            assert!(f(l, "time_generate_s") > 0.0, "{mode}: {l}");
            if mode == "async" {
                let (generate, wait) = (f(l, "time_generate_s"), f(l, "time_wait_data_s"));
                assert!(wait <= generate && generate - wait < 0.5, "{mode}: generate {generate} s, wait {wait} s");
            }
        }
    }
}
