//! Gemma 3 through the binary: `oxrl init-model --arch gemma3` with its sliding-window options
//! (and their misuse refused), `oxrl sft` (full and LoRA on every projection) whose export
//! loads and scores, and a seeded sync `oxrl rl` run (generations past the window) that is the
//! same bits twice.

use super::family_runs::{load_export, seeded_sync_grpo, sft_four_steps, LORA_ALL_LINEAR};
use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use oxrl::model::Transformer;
use serde_json::Value;

/// `oxrl init-model --arch gemma3` of a tiny model: two sliding layers (window 8), one global.
fn init_model(dir: &Path) {
    let out = common::oxrl_command()
        .args(["init-model", "--arch", "gemma3", "--hidden", "32", "--layers", "3", "--heads", "2"])
        .args(["--kv-heads", "1", "--head-dim", "16", "--intermediate", "64", "--max-position", "256"])
        .args(["--sliding-window", "8", "--sliding-window-pattern", "3", "--rope-local-theta", "5000"])
        .args(["--seed", "3", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn init_model_writes_gemma3_and_refuses_misused_options() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "gemma3_text");
    assert_eq!(cfg["layer_types"], serde_json::json!(["sliding_attention", "sliding_attention", "full_attention"]));
    assert_eq!(cfg["sliding_window"], 8);
    assert_eq!(cfg["hidden_activation"], "gelu_pytorch_tanh");
    assert_eq!(cfg["rope_parameters"]["sliding_attention"]["rope_theta"], 5000.0);
    let m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
    assert!(m.config.tie_word_embeddings && m.rope_local.is_some());
    assert!(m.layers[0].attention().unwrap().sliding && !m.layers[2].attention().unwrap().sliding);
    // The four norms of a block and the head norms, as transformers names them, at 0 (1 + w).
    let params = m.named_params();
    for p in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    {
        let (_, w) = params.iter().find(|(n, _)| *n == format!("model.layers.1.{p}.weight")).expect(p);
        assert_eq!(w.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{p}");
    }
    assert!(params.iter().any(|(n, _)| n == "model.layers.1.self_attn.q_norm.weight"));
    let err = |args: &[&str]| -> String {
        let out = common::oxrl_command().args(args).arg("--out").arg(dir.path().join("x")).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = err(&["init-model", "--arch", "qwen3", "--sliding-window", "8"]);
    assert!(e.contains("--arch gemma3"), "{e}");
    let e = err(&["init-model", "--arch", "gemma3", "--sliding-window", "0"]);
    assert!(e.contains("--sliding-window must be positive"), "{e}");
    let e = err(&["init-model", "--arch", "gemma3", "--sliding-window-pattern", "0"]);
    assert!(e.contains("--sliding-window-pattern must be positive"), "{e}");
}

/// `oxrl sft` for 4 steps, full and LoRA on every projection: the loss falls, and the export
/// (a LoRA run's PEFT adapter on the base) loads as a Gemma 3 model and scores.
#[test]
fn sft_runs_on_gemma3_and_exports_a_loadable_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    for (name, lora) in [("full", ""), ("lora", LORA_ALL_LINEAR)] {
        let export = sft_four_steps(dir.path(), &model, name, lora);
        let (m, adapted) = load_export(&model, &export, !lora.is_empty());
        assert!(m.config.gemma3.is_some(), "{name}");
        // A LoRA run exports the PEFT adapter (every projection of every layer).
        if !lora.is_empty() {
            assert!(adapted.contains(&"model.layers.0.self_attn.q_proj".to_string()), "{adapted:?}");
            assert_eq!(adapted.len(), 3 * 7, "{adapted:?}");
        }
    }
}

/// A seeded sync GRPO run of `oxrl rl` on Gemma 3, twice: the same metrics (timings
/// aside) and the same final weights, bit for bit.
#[test]
fn seeded_sync_rl_on_gemma3_is_the_same_bits_twice() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let (a, b) = (seeded_sync_grpo(dir.path(), &model, "a"), seeded_sync_grpo(dir.path(), &model, "b"));
    assert_eq!(a.0, b.0, "metrics differ between the two runs");
    assert!(a.1 == b.1, "final weights differ between the two runs");
}
