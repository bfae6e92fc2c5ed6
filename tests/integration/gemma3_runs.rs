//! Gemma 3 through the binary: `oxrl init-model --arch gemma3` with its sliding-window options
//! (and their misuse refused), `oxrl sft` (full and LoRA on every projection) whose export
//! loads and scores, and a seeded sync `oxrl rl` run (generations past the window) that is the
//! same bits twice.

use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use oxrl::model::{lora, Transformer};
use oxrl::trainer::run_dir::EXPORT_DIR;
use oxrl::trainer::RlConfig;
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

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
];

/// `oxrl sft` for 4 steps, full and LoRA on every projection: the loss falls, and the export
/// (a LoRA run's PEFT adapter on the base) loads as a Gemma 3 model and scores.
#[test]
fn sft_runs_on_gemma3_and_exports_a_loadable_model() {
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
        // A LoRA run exports the PEFT adapter (every projection of every layer).
        let export = run.join(EXPORT_DIR);
        let m = match lora.is_empty() {
            true => Transformer::load(&export, DType::F32, &Device::Cpu).unwrap(),
            false => {
                let mut m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
                lora::load_peft(&mut m, &export, false).unwrap();
                let adapted: Vec<String> =
                    m.linears_mut().into_iter().filter(|(_, l)| l.lora.is_some()).map(|(n, _)| n).collect();
                assert!(adapted.contains(&"model.layers.0.self_attn.q_proj".to_string()), "{adapted:?}");
                assert_eq!(adapted.len(), 3 * 7, "{adapted:?}");
                m
            }
        };
        assert!(m.config.gemma3.is_some(), "{name}");
        let seq: Vec<u32> = (0..12).map(|i| 40 + 7 * i).collect();
        let n = seq.len() as u32;
        let logits = m.forward(std::slice::from_ref(&seq), &[(0..n).collect()], &[vec![1; seq.len()]], None).unwrap();
        let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{name}: the export's logits");
    }
}

/// A seeded sync GRPO run of `oxrl rl` on Gemma 3, twice: the same metrics (timings
/// aside) and the same final weights, bit for bit.
#[test]
fn seeded_sync_rl_on_gemma3_is_the_same_bits_twice() {
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
