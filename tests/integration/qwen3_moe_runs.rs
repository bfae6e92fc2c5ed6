//! Qwen3-MoE through the binary: `oxrl init-model --arch qwen3_moe` with its expert options (and
//! their misuse refused), `oxrl sft` (full and LoRA) whose export loads and scores, and a seeded
//! sync `oxrl rl` run that is the same bits twice, with no token routed differently by the
//! sampler and the trainer.

use super::family_runs::{load_export, seeded_sync_grpo, sft_four_steps, LORA_ALL_LINEAR};
use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use oxrl::model::transformer::FeedForward;
use oxrl::model::Transformer;
use serde_json::Value;

/// `oxrl init-model --arch qwen3_moe` of a tiny MoE: 3 layers, the middle one dense, 4 experts,
/// top-2.
fn init_model(dir: &Path) {
    let out = common::oxrl_command()
        .args(["init-model", "--arch", "qwen3_moe", "--hidden", "32", "--layers", "3", "--heads", "2"])
        .args(["--kv-heads", "1", "--head-dim", "16", "--intermediate", "64", "--max-position", "256"])
        .args(["--num-experts", "4", "--experts-per-token", "2", "--moe-intermediate-size", "16"])
        .args(["--mlp-only-layers", "1", "--seed", "3", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn init_model_writes_the_experts_and_refuses_misused_options() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3_moe");
    assert_eq!((cfg["num_experts"].as_u64(), cfg["num_experts_per_tok"].as_u64()), (Some(4), Some(2)));
    assert_eq!(cfg["mlp_only_layers"], serde_json::json!([1]));
    let m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(m.layers[0].mlp, FeedForward::Sparse(_)) && matches!(m.layers[1].mlp, FeedForward::Dense(_)));
    // The experts' and the router's parameters, as the Hub names them.
    let names: Vec<String> = m.named_params().into_iter().map(|(n, _)| n).collect();
    for p in ["gate.weight", "experts.3.gate_proj.weight", "experts.0.up_proj.weight", "experts.2.down_proj.weight"] {
        assert!(names.contains(&format!("model.layers.2.mlp.{p}")), "{p} missing: {names:?}");
    }
    assert!(names.contains(&"model.layers.1.mlp.up_proj.weight".to_string()));
    let err = |args: &[&str]| -> String {
        let out = common::oxrl_command().args(args).arg("--out").arg(dir.path().join("x")).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = err(&["init-model", "--arch", "qwen3", "--num-experts", "4"]);
    assert!(e.contains("--arch qwen3_moe"), "{e}");
    let e = err(&["init-model", "--arch", "qwen3_moe", "--num-experts", "4", "--experts-per-token", "5"]);
    assert!(e.contains("num_experts_per_tok"), "{e}");
}

/// `oxrl sft` for 4 steps, full and LoRA on every projection: the loss falls, and the export
/// (a LoRA run's PEFT adapter on the base) loads as a Qwen3-MoE model and scores.
#[test]
fn sft_runs_on_qwen3_moe_and_exports_a_loadable_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    for (name, lora) in [("full", ""), ("lora", LORA_ALL_LINEAR)] {
        let export = sft_four_steps(dir.path(), &model, name, lora);
        let (m, adapted) = load_export(&model, &export, !lora.is_empty());
        assert!(m.config.moe.is_some(), "{name}");
        // A LoRA run exports the PEFT adapter: the attention's projections only (PEFT over
        // transformers 5 takes the MLP names for the experts, which oxrl does not adapt), by
        // name: PEFT's "all-linear" would adapt the routers, the experts and the dense MLP's
        // projections too.
        if !lora.is_empty() {
            let cfg: Value =
                serde_json::from_str(&std::fs::read_to_string(export.join("adapter_config.json")).unwrap()).unwrap();
            assert_eq!(cfg["target_modules"], serde_json::json!(["k_proj", "o_proj", "q_proj", "v_proj"]));
            assert!(adapted.contains(&"model.layers.1.self_attn.o_proj".to_string()), "{adapted:?}");
            assert_eq!(adapted.len(), 3 * 4, "{adapted:?}");
        }
    }
}

/// A seeded sync GRPO run of `oxrl rl` on the MoE model, twice: the same metrics (timings
/// aside) and the same final weights, bit for bit.
#[test]
fn seeded_sync_rl_on_qwen3_moe_is_the_same_bits_twice() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let (a, b) = (seeded_sync_grpo(dir.path(), &model, "a"), seeded_sync_grpo(dir.path(), &model, "b"));
    // The sampler routed every sampled token as the trainer does, and its log-probs are the
    // trainer's bits.
    for line in &a.0 {
        assert_eq!(line["router_mismatch"], 0, "{line}");
        assert_eq!(line["logprob_mismatch_max"], 0.0, "{line}");
    }
    assert_eq!(a.0, b.0, "metrics differ between the two runs");
    assert!(a.1 == b.1, "final weights differ between the two runs");
}
