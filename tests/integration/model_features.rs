//! KV-cache decode, greedy generation, LoRA, save/load and sharded checkpoints.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::{logprobs::target_logprobs, lora, Transformer};
use oxrl::rollout::{generate, SamplingParams};

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn golden_logprobs(m: &Transformer, b: &Batch) -> Tensor {
    let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
    let targets = Tensor::new(b.targets.concat(), &Device::Cpu).unwrap().reshape((b.ids.len(), ())).unwrap();
    masked(&target_logprobs(&logits, &targets).unwrap(), &b.valid)
}

fn cols(rows: &[Vec<u32>], from: usize, to: usize) -> Vec<Vec<u32>> {
    rows.iter().map(|r| r[from..to].to_vec()).collect()
}

#[test]
fn kv_cache_decode_equals_full_forward() {
    for arch in ARCHS {
        let g = Golden::load(arch);
        let b = g.batch();
        let m = load(arch);
        let full = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
        let t = b.ids[0].len();
        let prefill = 9;
        let mut cache = m.new_cache();
        let mask_cols =
            |from: usize, to: usize| -> Vec<Vec<u8>> { b.mask.iter().map(|r| r[from..to].to_vec()).collect() };
        let mut pieces = vec![m
            .forward(
                &cols(&b.ids, 0, prefill),
                &cols(&b.positions, 0, prefill),
                &mask_cols(0, prefill),
                Some(&mut cache),
            )
            .unwrap()];
        for i in prefill..t {
            pieces.push(
                m.forward(
                    &cols(&b.ids, i, i + 1),
                    &cols(&b.positions, i, i + 1),
                    &mask_cols(i, i + 1),
                    Some(&mut cache),
                )
                .unwrap(),
            );
        }
        assert_eq!(cache.seq_len(), t);
        let inc = Tensor::cat(&pieces, 1).unwrap();
        // Compare at real positions only (padded query positions are unspecified).
        let valid: Vec<Vec<f32>> = b.mask.iter().map(|r| r.iter().map(|&x| x as f32).collect()).collect();
        let v = Tensor::new(valid.concat(), &Device::Cpu).unwrap().reshape((3, t, 1)).unwrap();
        let err = max_abs_diff(&full.broadcast_mul(&v).unwrap(), &inc.broadcast_mul(&v).unwrap());
        assert!(err < 1e-5, "{arch}: incremental decode differs from full forward by {err}");
    }
}

#[test]
fn fill_cache_leaves_the_cache_a_forward_leaves() {
    // A prefill by `fill_cache_adapted` (the last block stops at its keys and values) and one by
    // the full forward: every later step sees the same cache, so gives the same logits, bit for
    // bit (the same operations on the same numbers).
    for arch in ARCHS {
        let g = Golden::load(arch);
        let b = g.batch();
        let m = load(arch);
        let t = b.ids[0].len();
        let prefill = 9;
        let mask_cols =
            |from: usize, to: usize| -> Vec<Vec<u8>> { b.mask.iter().map(|r| r[from..to].to_vec()).collect() };
        let (ids, pos, mask) = (cols(&b.ids, 0, prefill), cols(&b.positions, 0, prefill), mask_cols(0, prefill));
        let mut full = m.new_cache();
        m.forward(&ids, &pos, &mask, Some(&mut full)).unwrap();
        let mut filled = m.new_cache();
        m.fill_cache_adapted(&ids, &pos, &mask, &mut filled, None).unwrap();
        assert_eq!(filled.seq_len(), prefill);
        assert_eq!(filled.key_mask(), full.key_mask());
        for i in prefill..t {
            let step = |cache: &mut oxrl::model::KvCache| {
                let (ids, pos) = (cols(&b.ids, i, i + 1), cols(&b.positions, i, i + 1));
                m.forward(&ids, &pos, &mask_cols(i, i + 1), Some(cache)).unwrap().flatten_all().unwrap()
            };
            let (a, c) = (step(&mut full).to_vec1::<f32>().unwrap(), step(&mut filled).to_vec1::<f32>().unwrap());
            assert!(a == c, "{arch}: step {i} after fill_cache differs from after the full forward");
        }
    }
}

#[test]
fn greedy_logprobs_equal_forward_logprobs_and_batch_does_not_change_rows() {
    let m = load("qwen3");
    let prompts = vec![vec![5, 6, 7, 8, 9], vec![40, 41], vec![100, 3, 17, 250]];
    let p = SamplingParams { max_tokens: 6, temperature: 0.0, ignore_eos: true, ..Default::default() };
    let batched = generate(&m, &prompts, &p, &[2]).unwrap();
    for (prompt, g) in prompts.iter().zip(&batched) {
        let solo = generate(&m, std::slice::from_ref(prompt), &p, &[2]).unwrap();
        assert_eq!(solo[0].tokens, g.tokens);
        // Score prompt + completion with the training forward.
        let seq: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
        let n = seq.len();
        let logits = m.forward(std::slice::from_ref(&seq), &[(0..n as u32).collect()], &[vec![1; n]], None).unwrap();
        let targets = Tensor::new(&seq[1..], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let lp: Vec<f32> = target_logprobs(&logits.narrow(1, 0, n - 1).unwrap(), &targets)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (i, &x) in g.logprobs.iter().enumerate() {
            let y = lp[prompt.len() - 1 + i];
            assert!((x - y).abs() < 1e-5, "token {i}: sampler {x} vs forward {y}");
        }
    }
}

/// LoRA log-probs on the golden batch against `lora.target_logprobs` (PEFT's own output with the
/// shipped adapter, in float64), and the adapter visibly moves them.
#[test]
fn lora_adapter_logprobs_match_peft() {
    for arch in ARCHS {
        let g = Golden::load(arch);
        let b = g.batch();
        let mut m = load(arch);
        lora::load_peft(&mut m, &fixture_dir(arch).join("lora"), false).unwrap();
        let err = max_abs_diff(&golden_logprobs(&m, &b), g.get("lora.target_logprobs"));
        assert!(err < 1e-4, "{arch}: LoRA log-probs differ from PEFT by {err}");
        let moved = max_abs_diff(&golden_logprobs(&load(arch), &b), g.get("lora.target_logprobs"));
        assert!(moved > 1e-2, "{arch}: the adapter changes nothing ({moved})");
    }
}

/// LoRA applied on the fly equals the base with W + (alpha/r)·B·A folded in by hand in f64
/// (independent of `lora::merge`), and `lora::merge` gives the same model again.
#[test]
fn lora_adapter_equals_an_independent_merge() {
    for arch in ARCHS {
        let g = Golden::load(arch);
        let b = g.batch();
        let dir = fixture_dir(arch);
        let mut m = load(arch);
        let (cfg, vars) = lora::load_peft(&mut m, &dir.join("lora"), false).unwrap();
        assert!(vars.is_empty());
        assert_eq!((cfg.rank, cfg.alpha), (4, 8.0));
        let with = golden_logprobs(&m, &b);
        let base = golden_logprobs(&load(arch), &b);
        assert!(max_abs_diff(&with, &base) > 1e-2, "{arch}: the adapter changed nothing");

        let adapter = candle_core::safetensors::load(dir.join("lora/adapter_model.safetensors"), &Device::Cpu).unwrap();
        let mut hand = load(arch);
        let mut folded = 0;
        hand.visit_params_mut(&mut |name, w| {
            let module = name.trim_end_matches(".weight");
            if let (Some(a), Some(bm)) = (
                adapter.get(&format!("base_model.model.{module}.lora_A.weight")),
                adapter.get(&format!("base_model.model.{module}.lora_B.weight")),
            ) {
                let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
                let delta = (f(bm).matmul(&f(a)).unwrap() * 2.0).unwrap();
                *w = (f(w) + delta).unwrap().to_dtype(DType::F32).unwrap();
                folded += 1;
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(folded, 6, "{arch}: q, v and up of two layers");
        let err = max_abs_diff(&golden_logprobs(&hand, &b), &with);
        assert!(err < 1e-5, "{arch}: on-the-fly LoRA differs from the hand merge by {err}");

        lora::merge(&mut m).unwrap();
        let err = max_abs_diff(&golden_logprobs(&m, &b), &with);
        assert!(err < 1e-5, "{arch}: merged model differs by {err}");
    }
}

#[test]
fn lora_is_the_only_trainable_part_and_gets_gradients() {
    let g = Golden::load("qwen2");
    let b = g.batch();
    let mut m = load("qwen2");
    let cfg = lora::LoraConfig::new(2, 4.0, &["q_proj", "down_proj", "lm_head"]);
    let vars = lora::attach_new(&mut m, &cfg, 7).unwrap();
    assert_eq!(vars.len(), 2 * (2 * 2 + 1));
    // B = 0: a fresh adapter does not change the model.
    let base = golden_logprobs(&load("qwen2"), &b);
    assert!(max_abs_diff(&golden_logprobs(&m, &b), &base) == 0.0);
    let loss = golden_logprobs(&m, &b).sum_all().unwrap();
    let grads = loss.backward().unwrap();
    for (name, v) in &vars {
        assert!(grads.get(v.as_tensor()).is_some(), "{name} has no gradient");
    }
    // Base weights are frozen: no gradient reaches them.
    for (name, t) in m.named_params() {
        assert!(grads.get(&t).is_none(), "frozen {name} got a gradient");
    }
}

#[test]
fn save_then_load_is_bit_exact() {
    for arch in ARCHS {
        let m = load(arch);
        let dir = tempfile::tempdir().unwrap();
        m.save(dir.path(), DType::F32).unwrap();
        let m2 = Transformer::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
        let (a, b) = (m.named_params(), m2.named_params());
        assert_eq!(a.len(), b.len());
        for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert_eq!(
                ta.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                tb.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "{arch}: {na}"
            );
        }
        // Tied embeddings are not written twice, as transformers expects.
        let saved = candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu).unwrap();
        assert_eq!(saved.contains_key("lm_head.weight"), !m.config.tie_word_embeddings, "{arch}");
    }
}

#[test]
fn lora_save_then_load_is_bit_exact() {
    let mut m = load("llama");
    let cfg = lora::LoraConfig::new(3, 6.0, &["k_proj", "o_proj", "gate_proj"]);
    lora::attach_new(&mut m, &cfg, 1).unwrap();
    // Make B non-zero so the round trip is meaningful.
    for (_, lin) in m.linears_mut() {
        if let Some(l) = lin.lora.as_mut() {
            l.b = (l.a.sum_all().unwrap().broadcast_add(&Tensor::ones(l.b.dims(), DType::F32, &Device::Cpu).unwrap()))
                .unwrap();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    lora::save_peft(&m, &cfg, dir.path()).unwrap();
    let mut m2 = load("llama");
    let (cfg2, _) = lora::load_peft(&mut m2, dir.path(), true).unwrap();
    assert_eq!(cfg, cfg2);
    let (a, b) = (lora::adapter_tensors(&m).unwrap(), lora::adapter_tensors(&m2).unwrap());
    assert_eq!(a.len(), 12);
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(
            ta.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            tb.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
}

#[test]
fn all_linear_is_written_as_peft_writes_it() {
    let mut m = load("qwen2");
    let cfg = lora::LoraConfig::new(2, 4.0, &["all-linear"]);
    lora::attach_new(&mut m, &cfg, 0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    lora::save_peft(&m, &cfg, dir.path()).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(json["target_modules"], serde_json::json!("all-linear"), "PEFT reads all-linear only as a string");
    // Every projection but lm_head got an adapter, and it loads back.
    assert_eq!(lora::adapter_tensors(&m).unwrap().len(), 2 * 7 * 2);
    let mut m2 = load("qwen2");
    assert_eq!(lora::load_peft(&mut m2, dir.path(), false).unwrap().0, cfg);
}

#[test]
fn sharded_checkpoint_loads_like_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_dir("qwen3");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let all = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<_> = all.keys().cloned().collect();
    names.sort();
    let mut map = serde_json::Map::new();
    for (k, chunk) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        // Store the second shard in bf16 to exercise conversion.
        let dtype = if k == 0 { DType::F32 } else { DType::BF16 };
        let part: std::collections::HashMap<String, Tensor> =
            chunk.iter().map(|n| (n.clone(), all[n].to_dtype(dtype).unwrap())).collect();
        candle_core::safetensors::save(&part, dir.path().join(&file)).unwrap();
        for n in chunk {
            map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let sharded = Transformer::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let single = load("qwen3");
    for ((n, a), (_, b)) in single.named_params().iter().zip(sharded.named_params().iter()) {
        let expect = if names.chunks(names.len() / 2 + 1).next().unwrap().contains(n) {
            a.clone()
        } else {
            a.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap()
        };
        assert_eq!(
            expect.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{n}"
        );
    }
}

#[test]
fn bf16_run_is_close_to_f32() {
    let g = Golden::load("llama");
    let b = g.batch();
    let m = Transformer::load(&fixture_dir("llama"), DType::BF16, &Device::Cpu).unwrap();
    let lp = golden_logprobs(&m, &b);
    let err = max_abs_diff(&lp, g.get("target_logprobs"));
    assert!(err < 0.1, "bf16 log-probs differ by {err}");
}

/// RoPE scaling (Llama 3's rule, tied embeddings; linear, Qwen2 with biases) against
/// transformers on 300 tokens — far past the 32-position original context — from
/// `tests/fixtures/rope_scaling/*/reference.json` (`tests/fixtures/make_rope_scaling_reference.py`).
/// The configs use transformers 5's `rope_parameters`; the same in the older `rope_scaling` +
/// `rope_theta` spelling must give the same model.
#[test]
fn rope_scaling_matches_transformers() {
    for name in ["llama3", "linear"] {
        let dir = fixture_dir("..").join("rope_scaling").join(name);
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let seq: Vec<u32> =
            reference["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let want: Vec<f32> =
            reference["target_logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let n = seq.len();
        let score = |m: &Transformer| -> Vec<f32> {
            let logits =
                m.forward(std::slice::from_ref(&seq), &[(0..n as u32).collect()], &[vec![1; n]], None).unwrap();
            let targets = Tensor::new(&seq[1..], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            target_logprobs(&logits.narrow(1, 0, n - 1).unwrap(), &targets)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let max_err = |got: &[f32]| got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let m = Transformer::load(&dir, DType::F32, &Device::Cpu).unwrap();
        let err = max_err(&score(&m));
        assert!(err < 1e-4, "{name}: log-probs differ from transformers by {err}");

        // The legacy spelling of the same config.
        let legacy = tempfile::tempdir().unwrap();
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let params = cfg.as_object_mut().unwrap().remove("rope_parameters").unwrap();
        cfg["rope_theta"] = params["rope_theta"].clone();
        let mut scaling = params.clone();
        scaling.as_object_mut().unwrap().remove("rope_theta");
        cfg["rope_scaling"] = scaling;
        std::fs::write(legacy.path().join("config.json"), cfg.to_string()).unwrap();
        std::fs::copy(dir.join("model.safetensors"), legacy.path().join("model.safetensors")).unwrap();
        let m = Transformer::load(legacy.path(), DType::F32, &Device::Cpu).unwrap();
        let err = max_err(&score(&m));
        assert!(err < 1e-4, "{name} (rope_scaling spelling): log-probs differ from transformers by {err}");
    }
}

/// The cache grows in place (spare columns written after the cached ones). Two clones of one
/// prefix, extended with different tokens, must not see each other's writes.
#[test]
fn cloned_caches_extend_independently() {
    let m = load("qwen2");
    let prefix: Vec<u32> = vec![5, 6, 7, 8, 9];
    let mut a = m.new_cache();
    m.forward(std::slice::from_ref(&prefix), &[(0..5).collect()], &[vec![1; 5]], Some(&mut a)).unwrap();
    let mut b = a.clone();
    let last = |cache: &mut oxrl::model::KvCache, tokens: &[u32]| -> Tensor {
        let mut out = None;
        for &t in tokens {
            let pos = cache.seq_len() as u32;
            out = Some(m.forward(&[vec![t]], &[vec![pos]], &[vec![1]], Some(cache)).unwrap());
        }
        out.unwrap().squeeze(0).unwrap().squeeze(0).unwrap()
    };
    // Interleave the two so each writes while the other holds views of the same prefix.
    let a1 = last(&mut a, &[100, 101]);
    let b1 = last(&mut b, &[200]);
    let a2 = last(&mut a, &[102]);
    let b2 = last(&mut b, &[201, 202]);
    let full = |tokens: &[u32]| -> Tensor {
        let seq: Vec<u32> = prefix.iter().chain(tokens).copied().collect();
        let n = seq.len();
        let logits = m.forward(&[seq], &[(0..n as u32).collect()], &[vec![1; n]], None).unwrap();
        logits.narrow(1, n - 1, 1).unwrap().squeeze(0).unwrap().squeeze(0).unwrap()
    };
    for (what, got, want) in [
        ("a1", a1, full(&[100, 101])),
        ("b1", b1, full(&[200])),
        ("a2", a2, full(&[100, 101, 102])),
        ("b2", b2, full(&[200, 201, 202])),
    ] {
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-5, "{what}: {err}");
    }
}
