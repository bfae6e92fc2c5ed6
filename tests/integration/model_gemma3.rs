//! Gemma 3 text (sliding-window and global layers, sandwich norms with `1 + w`, q/k norms,
//! GELU-tanh MLP, scaled embeddings, tied head) against transformers 5.24 in float64
//! (tests/fixtures/hf-2026/gemma3): log-probs and last logits, the tape's gradients and loss, one
//! AdamW step, PEFT LoRA log-probs, greedy tokens; the engine's windowed cache against the
//! trainer's forward past the window; the configs Gemma 3 refuses.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::golden_checks::{golden_logprobs, grad_of, tape_loss_and_gradients};
use common::*;
use oxrl::model::lora;
use oxrl::model::Transformer;

const ARCH: &str = "gemma3";

fn load() -> Transformer {
    Transformer::load(&fixture_dir(ARCH), DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn gemma3_logprobs_and_last_logits_match_transformers() {
    let g = Golden::load(ARCH);
    let b = g.batch();
    let m = load();
    let err = max_abs_diff(&golden_logprobs(&m, &b), g.get("target_logprobs"));
    assert!(err < 1e-4, "target log-probs differ by {err}");
    let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
    let t = logits.dim(1).unwrap();
    let last = logits.narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap();
    let err = max_abs_diff(&last, g.get("logits_last"));
    assert!(err < 1e-4, "last logits differ by {err}");
}

/// The tape's loss and gradients against the fixture's (the scaled and tied embedding, a
/// sliding layer's q_proj, an MLP's down_proj, the final norm: within 1e-4 relative), every
/// parameter with a gradient (the four norms of each block and the q/k norms among them), and
/// the f32 tape against the f64 one.
#[test]
fn gemma3_tape_gradients_match_transformers() {
    let g = Golden::load(ARCH);
    let (loss, grads) = tape_loss_and_gradients(ARCH, DType::F32);
    let golden_loss = g.get("loss").to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
    assert!((loss - golden_loss).abs() < 1e-4 * golden_loss.abs().max(1.0), "loss {loss} vs {golden_loss}");
    let mut checked = 0;
    for (name, want) in &g.tensors {
        let Some(param) = name.strip_prefix("grad.") else { continue };
        let err = rel_err(grad_of(&grads, param), want);
        assert!(err < 1e-4, "gradient of {param} off by {err} relative");
        checked += 1;
    }
    assert_eq!(checked, 4, "gradients checked");
    // 3 layers × (4 projections, 3 MLP projections, 4 norms, 2 head norms), embedding, norm.
    assert_eq!(grads.len(), 3 * 13 + 2);
    for (name, g) in &grads {
        assert!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "{name}: zero gradient");
    }
    // f32 against f64, every parameter.
    let (_, grads64) = tape_loss_and_gradients(ARCH, DType::F64);
    for (name, g) in &grads {
        let err = rel_err(g, grad_of(&grads64, name));
        assert!(err < 1e-4, "{name}: f32 gradient off the f64 one by {err} relative");
    }
}

/// PEFT's adapter (q_proj, v_proj, up_proj) gives PEFT's log-probs, on the engine's
/// forward and on the tape.
#[test]
fn gemma3_lora_adapter_logprobs_match_peft() {
    let g = Golden::load(ARCH);
    let b = g.batch();
    let mut m = load();
    lora::load_peft(&mut m, &fixture_dir(ARCH).join("lora"), false).unwrap();
    let err = max_abs_diff(&golden_logprobs(&m, &b), g.get("lora.target_logprobs"));
    assert!(err < 1e-4, "LoRA log-probs differ from PEFT by {err}");
    let moved = max_abs_diff(&golden_logprobs(&load(), &b), g.get("lora.target_logprobs"));
    assert!(moved > 1e-2, "the adapter changes nothing ({moved})");
}

/// The engine's greedy decode (prefill, then one token at a time, the sliding layers' cache cut
/// to the window: 13 + 12 tokens against a window of 6) gives transformers' 12 greedy tokens,
/// in the core and on the engine thread.
#[test]
fn gemma3_greedy_tokens_equal_transformers() {
    golden_checks::assert_greedy_tokens(ARCH, load);
}

/// The worker's cross-entropy step on the golden rows, in f64: transformers' loss and per-token
/// log-probs, then one AdamW step to the fixture's weights (1e-5). The first AdamW step moves a
/// weight by lr·g/(|g| + eps): for gradients near eps it amplifies any noise (in f32, an lm_head
/// element of 1e-7 moves 8e-5 off), hence f64.
#[test]
fn gemma3_worker_adamw_step_reproduces_transformers() {
    assert_eq!(golden_checks::assert_adamw_step(ARCH, |_, _| None), 4, "parameters checked");
}

/// A generation far past the window (5 + 60 tokens, window 6), sampled at temperature 1: each
/// token's log-prob is the trainer's forward of the whole sequence, bit for bit — the engine's
/// sliding layers attend over their cut caches, the trainer's over every key with the window
/// as a mask.
#[test]
fn gemma3_generation_past_the_window_is_the_trainers_bits() {
    use oxrl::rollout::{EngineConfig, EngineCore, Request, SamplingParams};
    use oxrl::worker::{Datum, Worker, WorkerConfig};
    let prompt: Vec<u32> = vec![5, 17, 42, 99, 7];
    let params =
        SamplingParams { max_tokens: 60, temperature: 1.0, seed: Some(9), ignore_eos: true, ..Default::default() };
    let mut e = EngineCore::new(load(), EngineConfig { eos_token_ids: vec![2], ..Default::default() }).unwrap();
    e.add_request(Request::new(prompt.clone(), params)).unwrap();
    let sample = e.run_until_idle().unwrap().pop().unwrap().1.samples.remove(0);
    assert_eq!(sample.tokens.len(), 60);
    let seq: Vec<u32> = prompt.iter().chain(&sample.tokens).copied().collect();
    let n = seq.len() - 1;
    let mut w = Worker::new(load(), WorkerConfig::default()).unwrap();
    let datum = Datum::supervised(seq[..n].to_vec(), seq[1..].to_vec(), vec![1.0; n]);
    let fwd = w.forward(&[datum], None, true).unwrap();
    let trainer = &fwd.loss_fn_outputs[0].logprobs[prompt.len() - 1..];
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&sample.logprobs), bits(trainer));
}

/// Decoding 100 tokens one at a time: a sliding layer's cache stays within its window's bound
/// (the last 5 keys plus at most 64 columns of room) while the global layer's holds every token,
/// and the logits of the last step equal those of a cache that kept everything.
#[test]
fn gemma3_sliding_layers_cache_only_the_window() {
    let m = load();
    let prefix: Vec<u32> = (0..5).map(|i| 3 + i * 11).collect();
    let mut cache = m.new_cache();
    let pos = |a: usize, n: usize| vec![(a as u32..(a + n) as u32).collect::<Vec<_>>()];
    m.forward(std::slice::from_ref(&prefix), &pos(0, 5), &[vec![1; 5]], Some(&mut cache)).unwrap();
    let mut tokens = prefix;
    let mut last = None;
    for step in 0..100 {
        let tok = ((step * 37) % 250 + 3) as u32;
        tokens.push(tok);
        let at = tokens.len() - 1;
        last = Some(m.forward(&[vec![tok]], &pos(at, 1), &[vec![1]], Some(&mut cache)).unwrap());
        let sliding = cache.layer(0).unwrap().0.dim(2).unwrap();
        assert!(sliding <= 5 + 64, "step {step}: a sliding layer holds {sliding} columns");
    }
    assert_eq!(cache.layer(2).unwrap().0.dim(2).unwrap(), 105, "the global layer holds every token");
    // The sliding layers' columns: cut at least once.
    assert!(cache.layer(1).unwrap().0.dim(2).unwrap() < 105);
    // Every column kept (one prefill of the whole sequence but the last token, then the step).
    let mut full = m.new_cache();
    let n = tokens.len();
    m.forward(&[tokens[..n - 1].to_vec()], &pos(0, n - 1), &[vec![1; n - 1]], Some(&mut full)).unwrap();
    let want = m.forward(&[vec![tokens[n - 1]]], &pos(n - 1, 1), &[vec![1]], Some(&mut full)).unwrap();
    let bits =
        |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&last.unwrap()), bits(&want));
}

/// Configs Gemma 3 derives or refuses: layer types from `sliding_window_pattern`, both RoPE
/// bases from the older fields, and by name soft-capping, bidirectional attention and the
/// vision-language layout.
#[test]
fn gemma3_config_derivations_and_refusals() {
    use oxrl::model::model_config::{LayerType, ModelConfig};
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir(ARCH).join("config.json")).unwrap()).unwrap();
    let parse = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        edit(&mut v);
        ModelConfig::from_value(v, std::path::Path::new("config.json"))
    };
    let c = parse(&|v| {
        let o = v.as_object_mut().unwrap();
        o.remove("layer_types");
        o.remove("_sliding_window_pattern");
        o.remove("rope_parameters");
        o.insert("num_hidden_layers".into(), 7.into());
        o.insert("sliding_window_pattern".into(), 3.into());
        o.insert("rope_theta".into(), 500000.0.into());
        o.insert("rope_local_base_freq".into(), 20000.0.into());
    })
    .unwrap();
    use LayerType::{FullAttention as F, SlidingAttention as S};
    assert_eq!(c.layer_types, vec![S, S, F, S, S, F, S]);
    let g = c.gemma3.as_ref().unwrap();
    assert_eq!((c.rope_theta, g.global_rope_theta, g.local_rope_theta), (500000.0, 500000.0, 20000.0));
    assert_eq!(c.attention_scale(), 1.0 / 16.0);
    assert!(c.tie_word_embeddings && c.norm_unit_offset && c.qk_norm);
    let refused = |edit: &dyn Fn(&mut serde_json::Value), needle: &str| {
        let e = parse(edit).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    };
    refused(&|v| v["final_logit_softcapping"] = 30.0.into(), "final_logit_softcapping");
    refused(&|v| v["attn_logit_softcapping"] = 50.0.into(), "attn_logit_softcapping");
    refused(&|v| v["use_bidirectional_attention"] = true.into(), "bidirectional");
    refused(&|v| v["hidden_activation"] = "silu".into(), "gelu_pytorch_tanh");
    refused(
        &|v| v["layer_types"] = serde_json::json!(["sliding_attention", "linear_attention", "full_attention"]),
        "layer_types",
    );
    refused(&|v| v["model_type"] = "gemma3".into(), "vision-language");
    refused(&|v| v["sliding_window"] = 0.into(), "sliding_window");
}
