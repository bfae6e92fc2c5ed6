//! Qwen3.5 through the binary: `oxrl init-model --arch qwen3_5` with its hybrid options (and
//! their misuse refused), `oxrl sft` (full and LoRA on every projection) whose export loads
//! and scores like the run's last weights, and a seeded sync `oxrl rl` run that is the same bits
//! twice.

use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use oxrl::model::{lora, Transformer};
use oxrl::trainer::run_dir::EXPORT_DIR;
use oxrl::trainer::RlConfig;
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

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
];

/// `oxrl sft` for 4 steps, full and LoRA on every projection: the loss falls, and the export
/// (a LoRA run's PEFT adapter on the base) loads as a Qwen3.5 model and scores.
#[test]
fn sft_runs_on_qwen3_5_and_exports_a_loadable_model() {
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
        // A LoRA run exports the PEFT adapter (every DeltaNet and attention projection).
        let export = run.join(EXPORT_DIR);
        let m = match lora.is_empty() {
            true => Transformer::load(&export, DType::F32, &Device::Cpu).unwrap(),
            false => {
                let mut m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
                lora::load_peft(&mut m, &export, false).unwrap();
                let adapted: Vec<String> =
                    m.linears_mut().into_iter().filter(|(_, l)| l.lora.is_some()).map(|(n, _)| n).collect();
                assert!(adapted.contains(&"model.layers.0.linear_attn.in_proj_qkv".to_string()), "{adapted:?}");
                assert_eq!(adapted.len(), 2 * 8 + 7, "{adapted:?}");
                m
            }
        };
        assert!(m.is_hybrid(), "{name}");
        let seq: Vec<u32> = (0..12).map(|i| 40 + 7 * i).collect();
        let n = seq.len() as u32;
        let logits = m.forward(std::slice::from_ref(&seq), &[(0..n).collect()], &[vec![1; seq.len()]], None).unwrap();
        let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{name}: the export's logits");
    }
}

/// A seeded sync GRPO run of `oxrl rl` on the hybrid model, twice: the same metrics (timings
/// aside) and the same final weights, bit for bit.
#[test]
fn seeded_sync_rl_on_qwen3_5_is_the_same_bits_twice() {
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
    assert_eq!(a.0, b.0, "metrics differ between the two runs");
    assert!(a.1 == b.1, "final weights differ between the two runs");
}
