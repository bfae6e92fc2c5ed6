//! Gemma 3 text (sliding-window and global layers, sandwich norms with `1 + w`, q/k norms,
//! GELU-tanh MLP, scaled embeddings, tied head) against transformers 5.24 in float64
//! (tests/fixtures/hf-2026/gemma3): log-probs and last logits, the tape's gradients and loss, one
//! AdamW step, PEFT LoRA log-probs, greedy tokens; the engine's windowed cache against the
//! trainer's forward past the window; the configs Gemma 3 refuses.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::logprobs::target_logprobs;
use oxrl::model::lora;
use oxrl::model::tape::Tape;
use oxrl::model::Transformer;

const ARCH: &str = "gemma3";

fn load() -> Transformer {
    Transformer::load(&fixture_dir(ARCH), DType::F32, &Device::Cpu).unwrap()
}

/// Target log-probs [3, T] of the golden batch, 0 where not valid.
fn golden_logprobs(m: &Transformer, b: &Batch) -> Tensor {
    let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
    let targets = Tensor::new(b.targets.concat(), &Device::Cpu).unwrap().reshape((3, ())).unwrap();
    masked(&target_logprobs(&logits, &targets).unwrap(), &b.valid)
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

/// The golden loss Σ −log p · w through the tape in `dtype`: the loss and every parameter's
/// gradient by name.
fn tape_loss_and_gradients(dtype: DType) -> (f64, Vec<(String, Tensor)>) {
    let b = Golden::load(ARCH).batch();
    let mut m = Transformer::load(&fixture_dir(ARCH), dtype, &Device::Cpu).unwrap();
    let vars = m.make_trainable().unwrap();
    let (rows, targets) = real_rows(&b);
    let mut tape = Tape::forward(&m, &b.ids, &b.positions, &b.mask, true).unwrap();
    let lp = tape.logprobs(&rows, &targets).unwrap();
    let t = b.ids[0].len();
    let w: Vec<f64> = rows.iter().map(|&i| b.weights[i as usize / t][i as usize % t] as f64).collect();
    let w = Tensor::new(w, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    let loss = (&lp * &w).unwrap().neg().unwrap().sum_all().unwrap();
    let grads = tape.backward(&loss.backward().unwrap()).unwrap();
    let named = vars
        .iter()
        .map(|(name, var)| {
            // The tied embedding has two parts, the head's and the gather's.
            let parts: Vec<&Tensor> =
                grads.iter().filter(|(p, _)| p.id() == var.as_tensor().id()).map(|(_, g)| g).collect();
            assert!(!parts.is_empty(), "no gradient for {name}");
            let sum = parts[1..].iter().fold(parts[0].clone(), |a, g| (a + *g).unwrap());
            (name.clone(), sum)
        })
        .collect();
    (loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), named)
}

fn grad_of<'a>(grads: &'a [(String, Tensor)], name: &str) -> &'a Tensor {
    &grads.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no param {name}")).1
}

/// The tape's loss and gradients against the fixture's (the scaled and tied embedding, a
/// sliding layer's q_proj, an MLP's down_proj, the final norm: within 1e-4 relative), every
/// parameter with a gradient (the four norms of each block and the q/k norms among them), and
/// the f32 tape against the f64 one.
#[test]
fn gemma3_tape_gradients_match_transformers() {
    let g = Golden::load(ARCH);
    let (loss, grads) = tape_loss_and_gradients(DType::F32);
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
    let (_, grads64) = tape_loss_and_gradients(DType::F64);
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
    use oxrl::rollout::{Engine, EngineConfig, EngineCore, Request, SamplingParams, StopReason};
    let (prompt, want) = Golden::load(ARCH).greedy();
    let params = SamplingParams { max_tokens: want.len(), temperature: 0.0, ignore_eos: true, ..Default::default() };
    let mut e = EngineCore::new(load(), EngineConfig { eos_token_ids: vec![2], ..Default::default() }).unwrap();
    e.add_request(Request::new(prompt.clone(), params.clone())).unwrap();
    let out = e.run_until_idle().unwrap().pop().unwrap().1;
    assert_eq!(out.samples[0].tokens, want, "engine core");
    assert_eq!(out.samples[0].stop_reason, StopReason::Length);
    let e = Engine::start(load(), EngineConfig::default()).unwrap();
    let out = e.generate(Request::new(prompt, params)).unwrap();
    assert_eq!(out.samples[0].tokens, want, "engine thread");
}

/// The worker's cross-entropy step on the golden rows, in f64: transformers' loss and per-token
/// log-probs, then one AdamW step to the fixture's weights (1e-5). The first AdamW step moves a
/// weight by lr·g/(|g| + eps): for gradients near eps it amplifies any noise (in f32, an lm_head
/// element of 1e-7 moves 8e-5 off), hence f64.
#[test]
fn gemma3_worker_adamw_step_reproduces_transformers() {
    use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
    let g = Golden::load(ARCH);
    let b = g.batch();
    let datums: Vec<Datum> = (0..b.ids.len())
        .map(|r| {
            let start = b.mask[r].iter().position(|&m| m == 1).unwrap();
            let tokens = &b.ids[r][start..];
            let n = tokens.len() - 1;
            Datum::supervised(tokens[..n].to_vec(), tokens[1..].to_vec(), b.weights[r][start..start + n].to_vec())
        })
        .collect();
    let m = Transformer::load(&fixture_dir(ARCH), DType::F64, &Device::Cpu).unwrap();
    let mut w = Worker::new(m, WorkerConfig::default()).unwrap();
    let ce = common::loss("cross_entropy", &serde_json::json!({}));
    let out = w.forward_backward(&datums, Some(&ce), true).unwrap();
    let golden_loss = g.get("loss").to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
    let loss = out.metrics.value("loss:sum").unwrap();
    assert!((loss - golden_loss).abs() < 1e-4 * golden_loss.abs().max(1.0), "loss {loss} vs {golden_loss}");
    let golden_lp = g.f32_2d("target_logprobs");
    for (r, rec) in out.loss_fn_outputs.iter().enumerate() {
        let start = b.mask[r].iter().position(|&m| m == 1).unwrap();
        for (t, &lp) in rec.logprobs.iter().enumerate() {
            if b.valid[r][start + t] != 0.0 {
                assert!((lp - golden_lp[r][start + t]).abs() < 1e-4, "row {r} token {t}: {lp}");
            }
        }
    }
    let a = &g.json["adamw"];
    let params = AdamParams {
        learning_rate: a["lr"].as_f64().unwrap(),
        beta1: a["betas"][0].as_f64().unwrap(),
        beta2: a["betas"][1].as_f64().unwrap(),
        eps: a["eps"].as_f64().unwrap(),
        weight_decay: a["weight_decay"].as_f64().unwrap(),
        grad_clip_norm: 0.0,
    };
    w.optim_step(&params).unwrap();
    let mut checked = 0;
    for (name, want) in &g.tensors {
        let Some(param) = name.strip_prefix("adamw.") else { continue };
        let got = w.params().iter().find(|(n, _)| n == param).unwrap().1.as_tensor().clone();
        let (got, want) = (got.to_dtype(DType::F32).unwrap().flatten_all().unwrap(), want.flatten_all().unwrap());
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-5, "{param} after AdamW off by {err}");
        checked += 1;
    }
    assert_eq!(checked, 4, "parameters checked");
}
