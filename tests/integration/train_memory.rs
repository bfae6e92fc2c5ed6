//! The memory settings end to end (`train.activation_checkpointing` for SFT,
//! `launch.activation_checkpointing` for RL): a run with them ends with the same exported weights,
//! byte for byte, and the same metrics (every key but the timings and the memory) as the run
//! without, on 2 in-process data-parallel ranks; and the metrics lines report `peak_rss_gb`.
//! `train.sharding` / `launch.sharding`: an unknown name gets the nearest one, and a mode the
//! workers do not serve yet is refused at load, naming the key and what is missing.

use crate::common;

use std::path::Path;

use common::fixture_dir;
use oxrl::launch::{rl_runtime, sft_dispatch};
use oxrl::trainer::rl::run_rl;
use oxrl::trainer::run_dir::EXPORT_DIR;
use oxrl::trainer::{RlConfig, RunOptions, SftConfig};
use serde_json::Value;

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"def add(a, b)"},{"role":"assistant","content":"return a + b"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
];

/// Keys that measure the machine rather than the training.
fn measured(key: &str) -> bool {
    key.starts_with("time_") || key.ends_with("_per_s") || key == "elapsed_s" || key == "peak_rss_gb"
}

/// The run's metrics lines without the measured keys, and its exported weights.
fn outcome(run: &Path, weights: &str) -> (Vec<Value>, Vec<u8>) {
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines = lines
        .lines()
        .map(|l| {
            let mut v: serde_json::Map<String, Value> = serde_json::from_str(l).unwrap();
            let rss = v.get("peak_rss_gb").and_then(Value::as_f64);
            assert!(rss.is_some_and(|g| g > 0.0), "peak_rss_gb missing or not positive: {l}");
            v.retain(|k, _| !measured(k));
            Value::Object(v)
        })
        .collect();
    (lines, std::fs::read(run.join(EXPORT_DIR).join(weights)).unwrap())
}

fn sft(dir: &Path, name: &str, lora: bool, extra: &[&str]) -> (Vec<Value>, Vec<u8>) {
    let data = dir.join("data.jsonl");
    std::fs::write(&data, ROWS.join("\n") + "\n").unwrap();
    let run = dir.join(name);
    let mut sets: Vec<String> = vec![
        format!("model.path={:?}", fixture_dir("qwen3").display().to_string()),
        format!("data.train_file={:?}", data.display().to_string()),
        format!("output.run_dir={:?}", run.display().to_string()),
        "optimizer.lr=0.01".into(),
        "train.batch_size=4".into(),
        "train.micro_batch_size=1".into(),
        "train.eval_every=0".into(),
        "train.max_steps=3".into(),
        "train.data_parallel=2".into(),
    ];
    if lora {
        sets.extend(["model.lora.rank=4".into(), "model.lora.alpha=8".into()]);
    }
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = SftConfig::load(None, &sets).unwrap();
    let dispatch = sft_dispatch(&cfg, Some(1)).unwrap();
    oxrl::trainer::sft::run_sft(&cfg, &dispatch, &RunOptions::default()).unwrap();
    outcome(&run, if lora { "adapter_model.safetensors" } else { "model.safetensors" })
}

fn grpo(dir: &Path, name: &str, extra: &[&str]) -> (Vec<Value>, Vec<u8>) {
    let model = dir.join("model");
    if !model.exists() {
        common::tiny_byte_model(&model, 32, 256, 7);
    }
    let run = dir.join(name);
    let mut sets: Vec<String> = vec![
        format!("model.path={}", model.display()),
        format!("output.run_dir={}", run.display()),
        "data.synthetic_train=40".into(),
        "rollout.n_samples=4".into(),
        "env.max_turn_tokens=4".into(),
        "train.prompts_per_step=4".into(),
        "train.max_steps=2".into(),
        "train.eval_every=0".into(),
        "optimizer.lr=1e-3".into(),
        "algorithm.kl.coef=0.05".into(),
        "launch.data_parallel=2".into(),
        "launch.micro_batch_size=2".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = RlConfig::load(None, &sets).unwrap();
    let (dispatch, engines) = rl_runtime(&cfg, Some(1)).unwrap();
    run_rl(&cfg, &dispatch, &engines, &RunOptions::default()).unwrap();
    outcome(&run, "model.safetensors")
}

#[test]
fn sft_with_activation_checkpointing_ends_bit_identical() {
    for lora in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (m0, w0) = sft(dir.path(), "plain", lora, &[]);
        let (m1, w1) = sft(dir.path(), "ckpt", lora, &["train.activation_checkpointing=true"]);
        assert_eq!(m0.len(), 3);
        assert_eq!(m0, m1, "lora {lora}: metrics");
        assert!(w0 == w1, "lora {lora}: exported weights differ");
    }
}

#[test]
fn grpo_with_activation_checkpointing_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (m0, w0) = grpo(dir.path(), "plain", &[]);
    let (m1, w1) = grpo(dir.path(), "ckpt", &["launch.activation_checkpointing=true"]);
    assert_eq!(m0.len(), 2);
    assert_eq!(m0, m1, "metrics");
    assert!(w0 == w1, "exported weights differ");
}

#[test]
fn sharding_names_are_checked_and_unserved_modes_refused() {
    let sft = |value: &str| {
        let sets = [
            "model.path=\"m\"".to_string(),
            "data.train_file=\"d.jsonl\"".into(),
            format!("train.sharding=\"{value}\""),
        ];
        SftConfig::load(None, &sets).map(|c| c.train.sharding.name()).map_err(|e| e.to_string())
    };
    let rl = |value: &str| {
        let sets = ["model.path=\"m\"".to_string(), format!("launch.sharding=\"{value}\"")];
        RlConfig::load(None, &sets).map(|c| c.launch.sharding.name()).map_err(|e| e.to_string())
    };
    assert_eq!(sft("none"), Ok("none"));
    assert_eq!(rl("none"), Ok("none"));
    for (load, key) in
        [(&sft as &dyn Fn(&str) -> Result<&'static str, String>, "train.sharding"), (&rl, "launch.sharding")]
    {
        let e = load("optimiser").unwrap_err();
        assert!(e.contains(key) && e.contains("did you mean `optimizer`?"), "{e}");
        for mode in ["optimizer", "gradients", "full"] {
            let e = load(mode).unwrap_err();
            assert!(e.contains(key) && e.contains(&format!("sharding = \"{mode}\" is not available yet")), "{e}");
        }
        let e = load("full").unwrap_err();
        assert!(e.contains("gather each layer's parameters"), "{e}");
    }
}
