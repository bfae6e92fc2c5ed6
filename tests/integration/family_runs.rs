//! What the per-family run tests (`gemma3_runs`, `qwen3_5_runs`, `qwen3_moe_runs`) share: a
//! short `oxrl sft` through the binary (full or LoRA) whose export loads and scores, and a
//! seeded sync `oxrl rl` GRPO run whose metrics and final weights two runs compare.

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use oxrl::model::{lora, Transformer};
use oxrl::trainer::run_dir::EXPORT_DIR;
use oxrl::trainer::RlConfig;
use serde_json::Value;

/// The `[model.lora]` section of a LoRA run on every projection.
pub const LORA_ALL_LINEAR: &str = "[model.lora]\nrank = 4\nalpha = 8\ntargets = [\"all-linear\"]\n";

/// Chat and instruction rows of every format `oxrl sft` reads.
const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
];

/// `oxrl sft` of `model` for 4 steps in `dir/name` (`lora`: a `[model.lora]` section, or "" for
/// full fine-tuning): every loss is finite and the last is below the first. Returns the export.
pub fn sft_four_steps(dir: &Path, model: &Path, name: &str, lora: &str) -> PathBuf {
    let data = dir.join("data.jsonl");
    std::fs::write(&data, ROWS.join("\n") + "\n").unwrap();
    let run = dir.join(name);
    let cfg = dir.join(format!("{name}.toml"));
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
    run.join(EXPORT_DIR)
}

/// An SFT run's export as a model (a LoRA run's, its PEFT adapter on the base `model`) that
/// scores a sequence with finite logits, and the names of the projections it adapts (none for
/// a full run).
pub fn load_export(model: &Path, export: &Path, lora: bool) -> (Transformer, Vec<String>) {
    let (m, adapted) = match lora {
        false => (Transformer::load(export, DType::F32, &Device::Cpu).unwrap(), vec![]),
        true => {
            let mut m = Transformer::load(model, DType::F32, &Device::Cpu).unwrap();
            lora::load_peft(&mut m, export, false).unwrap();
            let adapted = m.linears_mut().into_iter().filter(|(_, l)| l.lora.is_some()).map(|(n, _)| n).collect();
            (m, adapted)
        }
    };
    let seq: Vec<u32> = (0..12).map(|i| 40 + 7 * i).collect();
    let n = seq.len() as u32;
    let logits = m.forward(std::slice::from_ref(&seq), &[(0..n).collect()], &[vec![1; seq.len()]], None).unwrap();
    let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    assert!(v.iter().all(|x| x.is_finite()), "{}: the export's logits", export.display());
    (m, adapted)
}

/// A seeded sync GRPO run of `oxrl rl` on `model` for 3 steps in `dir/name`: its metrics lines
/// without the timings, and its final weights.
pub fn seeded_sync_grpo(dir: &Path, model: &Path, name: &str) -> (Vec<Value>, Vec<(String, Vec<f32>)>) {
    let run_dir = dir.join(name);
    let mut sets = common::tiny_grpo_sets(model, 3, 5e-3);
    sets.extend([
        format!("output.run_dir={:?}", run_dir.display().to_string()),
        "mode=\"sync\"".into(),
        "train.seed=11".into(),
        "train.eval_every=0".into(),
    ]);
    let cfg = dir.join(format!("{name}.toml"));
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
    assert_eq!(lines.len(), 3, "{name}");
    (lines, super::rl_async::safetensors(&run_dir.join("final/model.safetensors")))
}
