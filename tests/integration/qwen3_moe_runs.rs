//! Qwen3-MoE through the binary: `oxrl init-model --arch qwen3_moe` with its expert options (and
//! their misuse refused), `oxrl sft` (full and LoRA) whose export loads and scores, and a seeded
//! sync `oxrl rl` run that is the same bits twice, with no token routed differently by the
//! sampler and the trainer.

use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use oxrl::model::transformer::FeedForward;
use oxrl::model::{lora, Transformer};
use oxrl::trainer::run_dir::EXPORT_DIR;
use oxrl::trainer::RlConfig;
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

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
];

/// `oxrl sft` for 4 steps, full and LoRA on every projection: the loss falls, and the export
/// (a LoRA run's PEFT adapter on the base) loads as a Qwen3-MoE model and scores.
#[test]
fn sft_runs_on_qwen3_moe_and_exports_a_loadable_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, ROWS.join("\n") + "\n").unwrap();
    for (name, lora) in [("full", ""), ("lora", "[model.lora]\nrank = 4\nalpha = 8\ntargets = [\"all-linear\"]\n")] {
        let run = dir.path().join(name);
        let cfg = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "[model]\npath = {:?}\n{lora}[data]\ntrain_file = {:?}\n[train]\nbatch_size = 4\nmicro_batch_size = 2\nmax_steps = 4\neval_every = 0\n[optimizer]\nlr = 0.01\n[output]\nrun_dir = {:?}\n",
                model.display().to_string(),
                data.display().to_string(),
                run.display().to_string()
            ),
        )
        .unwrap();
        let out = common::oxrl_command().args(["sft", "--config"]).arg(&cfg).output().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 4, "{name}");
        let loss = |l: &Value| l["loss"].as_f64().unwrap();
        assert!(lines.iter().all(|l| loss(l).is_finite()), "{name}: {lines:?}");
        assert!(loss(&lines[3]) < loss(&lines[0]), "{name}: the loss did not fall: {lines:?}");
        // A LoRA run exports the PEFT adapter: the attention's projections only (PEFT over
        // transformers 5 takes the MLP names for the experts, which oxrl does not adapt).
        let export = run.join(EXPORT_DIR);
        let m = match lora.is_empty() {
            true => Transformer::load(&export, DType::F32, &Device::Cpu).unwrap(),
            false => {
                let mut m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
                lora::load_peft(&mut m, &export, false).unwrap();
                // The projections by name: PEFT's "all-linear" would adapt the routers, the
                // experts and the dense MLP's projections too.
                let cfg: Value =
                    serde_json::from_str(&std::fs::read_to_string(export.join("adapter_config.json")).unwrap())
                        .unwrap();
                let names = ["k_proj", "o_proj", "q_proj", "v_proj"];
                assert_eq!(cfg["target_modules"], serde_json::json!(names));
                let adapted: Vec<String> =
                    m.linears_mut().into_iter().filter(|(_, l)| l.lora.is_some()).map(|(n, _)| n).collect();
                assert!(adapted.contains(&"model.layers.1.self_attn.o_proj".to_string()), "{adapted:?}");
                assert_eq!(adapted.len(), 3 * 4, "{adapted:?}");
                m
            }
        };
        assert!(m.config.moe.is_some(), "{name}");
        let seq: Vec<u32> = (0..12).map(|i| 40 + 7 * i).collect();
        let n = seq.len() as u32;
        let logits = m.forward(std::slice::from_ref(&seq), &[(0..n).collect()], &[vec![1; seq.len()]], None).unwrap();
        let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{name}: the export's logits");
    }
}

/// A seeded sync GRPO run of `oxrl rl` on the MoE model, twice: the same metrics (timings
/// aside) and the same final weights, bit for bit.
#[test]
fn seeded_sync_rl_on_qwen3_moe_is_the_same_bits_twice() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    init_model(&model);
    let run = |name: &str| {
        let run_dir = dir.path().join(name);
        let mut sets = common::tiny_grpo_sets(&model, 3, 5e-3);
        sets.extend([
            format!("output.run_dir={:?}", run_dir.display().to_string()),
            "mode=\"sync\"".into(),
            "train.seed=11".into(),
            "train.eval_every=0".into(),
        ]);
        let cfg = dir.path().join(format!("{name}.toml"));
        std::fs::write(&cfg, RlConfig::load(None, &sets).unwrap().to_toml().unwrap()).unwrap();
        let out = common::oxrl_command().args(["rl", "--config"]).arg(&cfg).output().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let mut v: Value = serde_json::from_str(l).unwrap();
                v.as_object_mut().unwrap().retain(|k, _| {
                    !k.starts_with("time_") && !matches!(k.as_str(), "samples_per_s" | "elapsed_s" | "peak_rss_gb")
                });
                v
            })
            .collect();
        (lines, super::rl_async::safetensors(&run_dir.join("final/model.safetensors")))
    };
    let (a, b) = (run("a"), run("b"));
    assert_eq!(a.0.len(), 3);
    // The sampler routed every sampled token as the trainer does, and its log-probs are the
    // trainer's bits.
    for line in &a.0 {
        assert_eq!(line["router_mismatch"], 0, "{line}");
        assert_eq!(line["logprob_mismatch_max"], 0.0, "{line}");
    }
    assert_eq!(a.0, b.0, "metrics differ between the two runs");
    assert!(a.1 == b.1, "final weights differ between the two runs");
}
