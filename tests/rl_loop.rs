//! The synchronous RL loop end to end on a tiny model: metrics, checkpoints, resume.

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use oxrl::dispatch::{Dispatch, WorkerSpec};
use oxrl::model::config::{Arch, ModelShape};
use oxrl::model::tokenizer::{Tokenizer, BYTE_LEVEL_VOCAB_SIZE};
use oxrl::model::{init, Transformer};
use oxrl::rollout::{Engine, EngineClient, EngineConfig};
use oxrl::trainer::rl::run_rl;
use oxrl::trainer::sft::RunOptions;
use oxrl::trainer::RlConfig;
use oxrl::worker::WorkerConfig;

fn tiny_model(dir: &Path) {
    let shape = ModelShape {
        vocab_size: BYTE_LEVEL_VOCAB_SIZE,
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 16,
        rope_theta: 10000.0,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
    };
    init::write_random_model(dir, Arch::Qwen3, &shape, 7, DType::F32).unwrap();
}

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
    let d = Dispatch::new(false);
    d.create_model("policy", &WorkerSpec { worker: WorkerConfig::default(), ..WorkerSpec::new(&cfg.model.path) })
        .unwrap();
    if cfg.needs_reference() {
        d.create_model("ref", &WorkerSpec::new(&cfg.model.path)).unwrap();
    }
    if cfg.needs_critic() {
        d.create_model(
            "critic",
            &WorkerSpec {
                worker: WorkerConfig { critic: true, ..Default::default() },
                ..WorkerSpec::new(&cfg.model.path)
            },
        )
        .unwrap();
    }
    let tok = Tokenizer::from_dir(&cfg.model.path).unwrap();
    let base = Transformer::load(&cfg.model.path, DType::F32, &candle_core::Device::Cpu).unwrap();
    let engine = Engine::start(
        base,
        EngineConfig {
            eos_token_ids: tok.eos_token_ids().to_vec(),
            tokenizer: Some(Arc::new(tok)),
            ..Default::default()
        },
    )
    .unwrap();
    (d, EngineClient::new(vec![engine]).unwrap())
}

#[test]
fn a_short_run_writes_metrics_checkpoints_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
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
    eprintln!("{}", lines[2]);
    assert!(s.export_dir.unwrap().join("model.safetensors").exists());
}
