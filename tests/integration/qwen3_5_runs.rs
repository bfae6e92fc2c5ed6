//! Qwen3.5 through the binary: `oxrl init-model --arch qwen3_5` with its hybrid options (and
//! their misuse refused), `oxrl sft` (full and LoRA on every projection) whose export loads
//! and scores like the run's last weights, and a seeded sync `oxrl rl` run that is the same bits
//! twice.

use super::family_runs::{load_export, seeded_sync_grpo, sft_four_steps, LORA_ALL_LINEAR};
use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use oxrl::model::Transformer;
use serde_json::Value;

/// `oxrl init-model --arch qwen3_5` of a tiny hybrid: DeltaNet, DeltaNet, full attention.
fn init_model(dir: &Path) {
    let out = common::oxrl_command()
        .args(["init-model", "--arch", "qwen3_5", "--hidden", "32", "--layers", "3", "--heads", "2"])
        .args(["--kv-heads", "1", "--head-dim", "16", "--intermediate", "64", "--max-position", "256"])
        .args(["--layer-types", "linear,linear,full", "--linear-key-heads", "1", "--linear-value-heads", "2"])
        .args(["--linear-key-head-dim", "8", "--linear-value-head-dim", "16", "--seed", "3", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn init_model_writes_the_hybrid_stack_and_refuses_misused_options() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3_5_text");
    assert_eq!(cfg["layer_types"], serde_json::json!(["linear_attention", "linear_attention", "full_attention"]));
    assert_eq!((cfg["linear_num_key_heads"].as_u64(), cfg["linear_num_value_heads"].as_u64()), (Some(1), Some(2)));
    let m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
    assert!(m.layers[0].attention().is_none() && m.layers[2].attention().is_some());
    // A DeltaNet layer's parameters, as transformers names them.
    let names: Vec<String> = m.named_params().into_iter().map(|(n, _)| n).collect();
    for p in ["A_log", "dt_bias", "conv1d.weight", "in_proj_qkv.weight", "in_proj_a.weight", "norm.weight"] {
        assert!(names.contains(&format!("model.layers.1.linear_attn.{p}")), "{p} missing: {names:?}");
    }
    let err = |args: &[&str]| -> String {
        let out = common::oxrl_command().args(args).arg("--out").arg(dir.path().join("x")).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = err(&["init-model", "--arch", "qwen3", "--layer-types", "full,full"]);
    assert!(e.contains("--arch qwen3_5"), "{e}");
    let e = err(&["init-model", "--arch", "qwen3_5", "--layers", "2", "--layer-types", "linear"]);
    assert!(e.contains("--layer-types lists 1 layers"), "{e}");
    let e = err(&["init-model", "--arch", "qwen3_5", "--layers", "2", "--layer-types", "linear,sliding"]);
    assert!(e.contains("`sliding`"), "{e}");
    let e = err(&["init-model", "--arch", "qwen3_5", "--heads", "4", "--linear-key-heads", "3"]);
    assert!(e.contains("linear_num_key_heads"), "{e}");
}

/// `oxrl sft` for 4 steps, full and LoRA on every projection: the loss falls, and the export
/// (a LoRA run's PEFT adapter on the base) loads as a Qwen3.5 model and scores.
#[test]
fn sft_runs_on_qwen3_5_and_exports_a_loadable_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    for (name, lora) in [("full", ""), ("lora", LORA_ALL_LINEAR)] {
        let export = sft_four_steps(dir.path(), &model, name, lora);
        let (m, adapted) = load_export(&model, &export, !lora.is_empty());
        assert!(m.is_hybrid(), "{name}");
        // A LoRA run exports the PEFT adapter (every DeltaNet and attention projection).
        if !lora.is_empty() {
            assert!(adapted.contains(&"model.layers.0.linear_attn.in_proj_qkv".to_string()), "{adapted:?}");
            assert_eq!(adapted.len(), 2 * 8 + 7, "{adapted:?}");
        }
    }
}

/// A seeded sync GRPO run of `oxrl rl` on the hybrid model, twice: the same metrics (timings
/// aside) and the same final weights, bit for bit.
#[test]
fn seeded_sync_rl_on_qwen3_5_is_the_same_bits_twice() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let (a, b) = (seeded_sync_grpo(dir.path(), &model, "a"), seeded_sync_grpo(dir.path(), &model, "b"));
    assert_eq!(a.0, b.0, "metrics differ between the two runs");
    assert!(a.1 == b.1, "final weights differ between the two runs");
}
