//! The worker contract's exactness, in f32 on the tiny fixtures:
//! - one `cross_entropy` forward_backward + AdamW step reproduces transformers' `loss`,
//!   `grad.*` and `adamw.*` (golden.safetensors);
//! - micro-batch size 1, 2, all, a token budget, and two calls of half the batch each give the
//!   same gradient (1e-5 relative) and the same metrics;
//! - padding datums with weight 0 change nothing; `return_per_token_outputs = false` returns
//!   empty records and identical metrics and gradients.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::algo::Loss;
use oxrl::model::Transformer;
use oxrl::worker::{AdamParams, Datum, ForwardBackwardOutput, Worker, WorkerConfig};
use serde_json::json;

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn worker(arch: &str, micro_batch_size: Option<usize>, max_tokens: Option<usize>) -> Worker {
    let cfg = WorkerConfig { micro_batch_size, max_tokens_per_microbatch: max_tokens, ..Default::default() };
    Worker::new(load(arch), cfg).unwrap()
}

/// The golden batch as datums: row r's real (unpadded) tokens, next-token targets, weights.
fn golden_datums(g: &Golden) -> Vec<Datum> {
    let b = g.batch();
    (0..b.ids.len())
        .map(|r| {
            let start = b.mask[r].iter().position(|&m| m == 1).unwrap();
            let tokens = &b.ids[r][start..];
            let n = tokens.len() - 1;
            let weights = b.weights[r][start..start + n].to_vec();
            // The last real position has no target; its weight is 0 in the fixture.
            assert_eq!(b.weights[r][b.ids[r].len() - 1], 0.0);
            Datum::supervised(tokens[..n].to_vec(), tokens[1..].to_vec(), weights)
        })
        .collect()
}

#[test]
fn one_adamw_step_reproduces_transformers() {
    for arch in ARCHS {
        let g = Golden::load(arch);
        let mut w = worker(arch, None, None);
        let out =
            w.forward_backward(&golden_datums(&g), Some(&common::loss("cross_entropy", &json!({}))), true).unwrap();
        let golden_loss = g.get("loss").to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
        let loss = out.metrics.value("loss:sum").unwrap();
        assert!((loss - golden_loss).abs() < 1e-4 * golden_loss.abs().max(1.0), "{arch}: loss {loss} vs {golden_loss}");
        // Per-datum log-probs are the golden target log-probs at the real positions.
        let golden_lp = g.f32_2d("target_logprobs");
        let b = g.batch();
        for (r, rec) in out.loss_fn_outputs.iter().enumerate() {
            let start = b.mask[r].iter().position(|&m| m == 1).unwrap();
            for (t, &lp) in rec.logprobs.iter().enumerate() {
                if b.valid[r][start + t] != 0.0 {
                    assert!((lp - golden_lp[r][start + t]).abs() < 1e-4, "{arch}: row {r} token {t}");
                }
            }
        }
        let grads = w.gradients();
        let mut checked = vec![];
        for (name, t) in &g.tensors {
            let Some(param) = name.strip_prefix("grad.") else { continue };
            let grad = grads
                .iter()
                .find(|(n, _)| n == &param)
                .and_then(|(_, g)| *g)
                .unwrap_or_else(|| panic!("{arch}: no gradient for {param}"));
            let err = rel_err(grad, t);
            assert!(err < 1e-4, "{arch}: gradient of {param} off by {err} relative");
            checked.push(param.to_string());
        }
        let params = g.adamw();
        let norm = w.optim_step(&params).unwrap();
        assert!(norm.is_finite() && norm > 0.0);
        assert_eq!(w.step(), 1);
        assert!(w.gradients().iter().all(|(_, g)| g.is_none()), "{arch}: gradients not zeroed");
        for param in &checked {
            let var = &w.params().iter().find(|(n, _)| n == param).unwrap().1;
            let err = max_abs_diff(var.as_tensor(), g.get(&format!("adamw.{param}")));
            assert!(err < 1e-5, "{arch}: {param} after AdamW off by {err}");
        }
        assert!(checked.len() >= 4, "{arch}: only {} parameters checked", checked.len());
    }
}

/// Ten datums of lengths 1..=13, with RL inputs, on qwen3.
fn rl_batch() -> Vec<Datum> {
    let mut s = 7u64;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    [5usize, 13, 1, 8, 3, 11, 6, 2, 9, 4]
        .iter()
        .map(|&n| {
            let ids: Vec<u32> = (0..n).map(|_| (next() * 300.0) as u32).collect();
            let targets: Vec<u32> = (0..n).map(|_| (next() * 300.0) as u32).collect();
            let weights: Vec<f32> = (0..n).map(|_| (next() * 0.1) as f32).collect();
            let mut d = Datum::supervised(ids, targets, weights);
            d.loss_fn_inputs.logprobs = Some((0..n).map(|_| (-5.7 + next() * 0.6 - 0.3) as f32).collect());
            d.loss_fn_inputs.advantages = Some((0..n).map(|_| (next() * 2.0 - 1.0) as f32).collect());
            d
        })
        .collect()
}

/// The Tinker `ppo` loss with a narrow clip band (both clip regimes occur).
fn ppo() -> Loss {
    common::loss("ppo", &json!({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}))
}

fn grads_of(w: &Worker) -> Vec<(String, Tensor)> {
    w.gradients().into_iter().map(|(n, g)| (n.to_string(), g.expect("a gradient").clone())).collect()
}

fn assert_same_grads(what: &str, a: &[(String, Tensor)], b: &[(String, Tensor)], tol: f64) {
    assert_eq!(a.len(), b.len());
    for ((name, ga), (_, gb)) in a.iter().zip(b) {
        let err = rel_err(ga, gb);
        assert!(err <= tol, "{what}: gradient of {name} differs by {err} relative");
    }
}

fn assert_same_metrics(what: &str, a: &ForwardBackwardOutput, b: &ForwardBackwardOutput, tol: f64) {
    let (ra, rb) = (a.metrics.reduce(), b.metrics.reduce());
    assert_eq!(ra.keys().collect::<Vec<_>>(), rb.keys().collect::<Vec<_>>(), "{what}");
    for (k, va) in &ra {
        let vb = rb[k];
        assert!((va - vb).abs() <= tol * (1.0 + vb.abs()), "{what}: {k} = {va} vs {vb}");
    }
    // Means are merged from (sum, count) pairs: counts are exact.
    for (k, v) in a.metrics.iter().filter(|(k, _)| k.ends_with(":mean")) {
        assert_eq!(v.count, b.metrics.get(k).unwrap().count, "{what}: count of {k}");
    }
}

#[test]
fn any_micro_batching_gives_the_same_gradient() {
    let batch = rl_batch();
    let mut whole = worker("qwen3", None, None);
    let reference = whole.forward_backward(&batch, Some(&ppo()), true).unwrap();
    let reference_grads = grads_of(&whole);
    assert!(reference.metrics.value("clip_fraction:mean").unwrap() > 0.0);

    for (micro_batch, budget) in
        [(Some(1), None), (Some(2), None), (Some(10), None), (None, Some(26)), (Some(3), Some(20))]
    {
        let what = format!("micro_batch_size {micro_batch:?}, max_tokens {budget:?}");
        let mut w = worker("qwen3", micro_batch, budget);
        let out = w.forward_backward(&batch, Some(&ppo()), true).unwrap();
        assert_same_grads(&what, &grads_of(&w), &reference_grads, 1e-5);
        assert_same_metrics(&what, &out, &reference, 1e-5);
        for (i, (a, b)) in out.loss_fn_outputs.iter().zip(&reference.loss_fn_outputs).enumerate() {
            assert_eq!(a.logprobs.len(), batch[i].len());
            for (x, y) in a.logprobs.iter().zip(&b.logprobs).chain(a.elementwise_loss.iter().zip(&b.elementwise_loss)) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}: datum {i}: {x} vs {y}");
            }
        }
    }

    // Two calls of half the batch each accumulate to one call of the whole.
    let mut halves = worker("qwen3", Some(4), None);
    let a = halves.forward_backward(&batch[..5], Some(&ppo()), true).unwrap();
    let b = halves.forward_backward(&batch[5..], Some(&ppo()), true).unwrap();
    assert_same_grads("two calls", &grads_of(&halves), &reference_grads, 1e-5);
    let mut merged = a.metrics.clone();
    merged.merge(&b.metrics);
    let merged = ForwardBackwardOutput { metrics: merged, loss_fn_outputs: vec![] };
    assert_same_metrics("two calls", &merged, &reference, 1e-5);

    // The same through an optimizer step: equal parameters afterwards.
    let p = AdamParams { learning_rate: 1e-3, ..Default::default() };
    let (na, nb) = (whole.optim_step(&p).unwrap(), halves.optim_step(&p).unwrap());
    assert!((na - nb).abs() <= 1e-5 * na);
    for ((name, va), (_, vb)) in whole.params().iter().zip(halves.params()) {
        assert!(max_abs_diff(va.as_tensor(), vb.as_tensor()) < 1e-6, "{name} differs after the step");
    }
}

#[test]
fn padding_datums_change_nothing_and_the_gate_changes_only_the_records() {
    let batch = rl_batch();
    let mut plain = worker("qwen3", Some(4), None);
    let reference = plain.forward_backward(&batch, Some(&ppo()), true).unwrap();
    let reference_grads = grads_of(&plain);

    // Weight-0 copies (with junk advantages) interleaved: same loss, metrics and gradient.
    let mut padded = vec![];
    for d in &batch {
        padded.push(d.clone());
        let mut pad = d.clone();
        pad.loss_fn_inputs.weights = Some(vec![0.0; d.len()]);
        pad.loss_fn_inputs.advantages = Some(vec![1e6; d.len()]);
        padded.push(pad);
    }
    let mut w = worker("qwen3", Some(4), None);
    let out = w.forward_backward(&padded, Some(&ppo()), true).unwrap();
    assert_same_metrics("padding", &out, &reference, 1e-6);
    assert_same_grads("padding", &grads_of(&w), &reference_grads, 1e-6);
    for (i, rec) in out.loss_fn_outputs.iter().enumerate() {
        if i % 2 == 1 {
            assert!(rec.elementwise_loss.iter().all(|&x| x == 0.0), "padding datum {i} has a loss");
        }
    }

    // The gate: empty records, identical metrics and gradient.
    let mut gated = worker("qwen3", Some(4), None);
    let out = gated.forward_backward(&batch, Some(&ppo()), false).unwrap();
    assert_eq!(out.loss_fn_outputs.len(), batch.len());
    assert!(out.loss_fn_outputs.iter().all(|r| r.is_empty()));
    assert_eq!(out.metrics, reference.metrics, "metrics differ with the gate off");
    assert_same_grads("gate", &grads_of(&gated), &reference_grads, 0.0);
}

#[test]
fn forward_returns_logprobs_and_metrics_without_gradients() {
    let batch = rl_batch();
    let mut w = worker("qwen3", Some(3), None);
    let fwd = w.forward(&batch, Some(&ppo()), true).unwrap();
    assert!(w.gradients().iter().all(|(_, g)| g.is_none()), "forward accumulated gradients");
    let fb = w.forward_backward(&batch, Some(&ppo()), true).unwrap();
    assert_eq!(fwd.metrics, fb.metrics);
    assert_eq!(fwd.loss_fn_outputs, fb.loss_fn_outputs);
    let plain = w.forward(&batch, None, true).unwrap();
    assert!(plain.metrics.is_empty());
    for (a, b) in plain.loss_fn_outputs.iter().zip(&fb.loss_fn_outputs) {
        assert_eq!(a.logprobs, b.logprobs);
        assert!(a.elementwise_loss.is_empty());
    }
}
