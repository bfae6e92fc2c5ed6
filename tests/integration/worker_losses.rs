//! Every loss through the worker on the tiny qwen3 model in f64:
//! - its accumulated gradient against central finite differences of the returned `loss:sum`
//!   (for losses with a stop-gradient factor — `cispo`, `gspo`, `rollout_is` — whose value
//!   moves with the detached factor, against finite differences of `Σ_t c_t · lp_t(θ)` with
//!   `c_t = ∂(loss_t·w_t)/∂lp_t` derived by hand at θ0, the factor held fixed as autograd does:
//!   the returned `loss:sum` of `cross_entropy` with weights `−c_t`);
//! - its value recomputed by hand, in plain f64, from the returned log-probs (or values) and the
//!   inputs, against `loss:sum` and every `elementwise_loss`.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::fixture_dir;
use oxrl::model::Transformer;
use oxrl::worker::{Datum, LossFnInputs, Worker, WorkerConfig};
use serde_json::{json, Value};

/// Deterministic pseudo-random numbers in [0, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
}

fn worker(critic: bool) -> Worker {
    let model = Transformer::load(&fixture_dir("qwen3"), DType::F64, &Device::Cpu).unwrap();
    Worker::new(model, WorkerConfig { critic, seed: 3, micro_batch_size: Some(2), ..Default::default() }).unwrap()
}

/// Three datums (lengths 7, 4, 9) with targets and weights (one weight 0, some negative).
fn base_batch() -> Vec<Datum> {
    let mut rng = Lcg(11);
    [7usize, 4, 9]
        .iter()
        .map(|&n| {
            let ids: Vec<u32> = (0..n).map(|_| (rng.next() * 300.0) as u32).collect();
            let targets: Vec<u32> = (0..n).map(|_| (rng.next() * 300.0) as u32).collect();
            let weights: Vec<f32> = (0..n).map(|t| if t == 1 { 0.0 } else { rng.range(-0.5, 1.5) as f32 }).collect();
            Datum::supervised(ids, targets, weights)
        })
        .collect()
}

/// RL inputs around the current log-probs: q = lp + δ, so that ratios fall on both sides of
/// the clip bands.
fn rl_batch(w: &mut Worker) -> Vec<Datum> {
    let mut batch = base_batch();
    let lps = w.forward(&batch, None, true).unwrap().loss_fn_outputs;
    let mut rng = Lcg(5);
    for (d, out) in batch.iter_mut().zip(lps) {
        let around = |rng: &mut Lcg, spread: f64| {
            out.logprobs.iter().map(|&lp| (lp as f64 + rng.range(-spread, spread)) as f32).collect()
        };
        let n = d.len();
        d.loss_fn_inputs.logprobs = Some(around(&mut rng, 0.4));
        d.loss_fn_inputs.rollout_logprobs = Some(around(&mut rng, 0.4));
        d.loss_fn_inputs.ref_logprobs = Some(around(&mut rng, 0.5));
        d.loss_fn_inputs.advantages = Some((0..n).map(|_| rng.range(-1.5, 1.5) as f32).collect());
    }
    batch
}

fn critic_batch() -> Vec<Datum> {
    let mut rng = Lcg(9);
    base_batch()
        .into_iter()
        .map(|d| {
            let n = d.len();
            let weights = d.loss_fn_inputs.weights.clone();
            Datum {
                input_tokens: d.input_tokens,
                loss_fn_inputs: LossFnInputs {
                    weights,
                    // Around the head's initial outputs (|v| ≲ 1) so both clip regimes occur.
                    values: Some((0..n).map(|_| rng.range(-0.6, 0.6) as f32).collect()),
                    returns: Some((0..n).map(|_| rng.range(-1.0, 1.0) as f32).collect()),
                    ..Default::default()
                },
            }
        })
        .collect()
}

/// One token's inputs for the hand formulas.
struct Tok {
    lp: f64,
    q: f64,
    roll: f64,
    adv: f64,
    reference: f64,
    entropy: f64,
    /// gspo: the masked mean of lp − q over the token's sequence.
    seq_mean: f64,
}

fn clamp(x: f64, lo: f64, hi: f64) -> f64 {
    x.max(lo).min(hi)
}

fn surrogate(r: f64, a: f64, lo: f64, hi: f64) -> f64 {
    -(r * a).min(clamp(r, lo, hi) * a)
}

fn cfg_f64(cfg: &Value, key: &str, default: f64) -> f64 {
    cfg.get(key).and_then(Value::as_f64).unwrap_or(default)
}

/// The per-token loss before the weight (docs/specs/algorithms.md), and its derivative in lp with
/// every stop-gradient factor held fixed.
fn hand_loss(name: &str, cfg: &Value, t: &Tok) -> (f64, f64) {
    let r = (t.lp - t.q).exp();
    let band = |lo: f64, hi: f64| (1.0 - cfg_f64(cfg, "eps_clip_low", lo), 1.0 + cfg_f64(cfg, "eps_clip_high", hi));
    let (mut loss, mut dloss) = match name {
        "cross_entropy" | "policy/cross_entropy" => (-t.lp, -1.0),
        "importance_sampling" | "policy/importance_sampling" => (-r * t.adv, -r * t.adv),
        "ppo" | "regular" | "dual_clip" => {
            let (lo, hi) = if name == "ppo" {
                (cfg_f64(cfg, "clip_low_threshold", 0.8), cfg_f64(cfg, "clip_high_threshold", 1.2))
            } else {
                band(0.2, 0.2)
            };
            let l = surrogate(r, t.adv, lo, hi);
            let unclipped = r * t.adv <= clamp(r, lo, hi) * t.adv;
            let d = if unclipped { -r * t.adv } else { 0.0 };
            if name == "dual_clip" && t.adv < 0.0 && -t.adv * 3.0 < l {
                (-t.adv * 3.0, 0.0)
            } else {
                (l, d)
            }
        }
        "cispo" | "policy/cispo" | "policy/cispo@rollout" => {
            let (lo, hi) = if name == "cispo" { (0.8, 1.2) } else { band(1.0, 4.0) };
            let r = if name.ends_with("@rollout") { (t.lp - t.roll).exp() } else { r };
            let c = clamp(r, lo, hi);
            (-c * t.lp * t.adv, -c * t.adv)
        }
        "stable_reinforce" => {
            let (c, k) = (cfg_f64(cfg, "ratio_cap", 2.0), cfg_f64(cfg, "kl_coeff", 0.0));
            let w = r.min(c);
            (-w * t.adv * t.lp + 0.5 * k * (t.lp - t.q).powi(2), -w * t.adv + k * (t.lp - t.q))
        }
        "dro" => {
            let beta = cfg_f64(cfg, "beta", 0.0);
            (-(t.lp * t.adv - 0.5 * beta * (t.lp - t.q).powi(2)), -(t.adv - beta * (t.lp - t.q)))
        }
        "gspo" => {
            let (lo, hi) = band(0.2, 0.2);
            let r = t.seq_mean.min(10.0).exp();
            let unclipped = r * t.adv <= clamp(r, lo, hi) * t.adv;
            (surrogate(r, t.adv, lo, hi), if unclipped { -r * t.adv } else { 0.0 })
        }
        "sapo" => {
            let r = clamp(t.lp - t.q, -20.0, 20.0).exp();
            let tau = if t.adv > 0.0 { 1.0 } else { 1.05 };
            let s = 1.0 / (1.0 + (-tau * (r - 1.0)).exp());
            (-s * 4.0 / tau * t.adv, -s * (1.0 - s) * tau * r * 4.0 / tau * t.adv)
        }
        "rollout_is" => {
            let (lo, hi) = band(0.2, 0.2);
            let r = (t.lp - t.roll).exp();
            let kept = if r > lo && r < hi { r } else { 0.0 };
            (-kept * t.adv * t.lp, -kept * t.adv)
        }
        other => panic!("no hand formula for {other}"),
    };
    let kl_coef = cfg_f64(cfg, "kl_coef", 0.0);
    if kl_coef != 0.0 {
        // k3 with Δ = lp − ref, x = −Δ: e^x − x − 1 (no clamp reached at these values).
        let x = -(t.lp - t.reference);
        loss += kl_coef * (x.exp() - x - 1.0);
        dloss += kl_coef * (1.0 - x.exp());
    }
    loss -= cfg_f64(cfg, "ent_coef", 0.0) * t.entropy;
    (loss, dloss)
}

/// Per-token entropies of the model's distributions at each datum's positions, in f64.
fn entropies(w: &Worker, batch: &[Datum]) -> Vec<Vec<f64>> {
    batch
        .iter()
        .map(|d| {
            let n = d.len();
            let logits = w
                .model()
                .forward(std::slice::from_ref(&d.input_tokens), &[(0..n as u32).collect()], &[vec![1; n]], None)
                .unwrap();
            let rows: Vec<Vec<f32>> = logits.squeeze(0).unwrap().to_vec2().unwrap();
            rows.iter()
                .map(|z| {
                    let m = z.iter().fold(f64::MIN, |a, &b| a.max(b as f64));
                    let s: f64 = z.iter().map(|&x| (x as f64 - m).exp()).sum();
                    let lse = m + s.ln();
                    -z.iter().map(|&x| (x as f64 - lse).exp() * (x as f64 - lse)).sum::<f64>()
                })
                .collect()
        })
        .collect()
}

/// Hand-computed (Σ loss·w, per-token loss·w, per-token ∂(loss·w)/∂lp) from log-probs `lps`.
fn hand(
    name: &str,
    cfg: &Value,
    batch: &[Datum],
    lps: &[Vec<f64>],
    ent: &[Vec<f64>],
) -> (f64, Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut total = 0.0;
    let (mut elementwise, mut coefs) = (vec![], vec![]);
    for (i, d) in batch.iter().enumerate() {
        let x = &d.loss_fn_inputs;
        let get = |v: &Option<Vec<f32>>, t: usize| v.as_ref().map_or(0.0, |v| v[t] as f64);
        let w: Vec<f64> = x.weights.as_ref().unwrap().iter().map(|&w| w as f64).collect();
        let valid: Vec<usize> = (0..d.len()).filter(|&t| w[t] != 0.0).collect();
        let seq_mean = valid.iter().map(|&t| lps[i][t] - get(&x.logprobs, t)).sum::<f64>() / valid.len().max(1) as f64;
        let (mut e_row, mut c_row) = (vec![], vec![]);
        for t in 0..d.len() {
            let tok = Tok {
                lp: lps[i][t],
                q: get(&x.logprobs, t),
                roll: get(&x.rollout_logprobs, t),
                adv: get(&x.advantages, t),
                reference: get(&x.ref_logprobs, t),
                entropy: ent.get(i).map_or(0.0, |e| e[t]),
                seq_mean,
            };
            let (l, dl) = if w[t] == 0.0 { (0.0, 0.0) } else { hand_loss(name, cfg, &tok) };
            total += l * w[t];
            e_row.push(l * w[t]);
            c_row.push(dl * w[t]);
        }
        elementwise.push(e_row);
        coefs.push(c_row);
    }
    (total, elementwise, coefs)
}

fn to_f64(rows: &[Vec<f32>]) -> Vec<Vec<f64>> {
    rows.iter().map(|r| r.iter().map(|&x| x as f64).collect()).collect()
}

fn set_entry(w: &Worker, name: &str, index: usize, value: f64) -> f64 {
    let var = &w.params().iter().find(|(n, _)| n == name).unwrap().1;
    let shape = var.as_tensor().dims().to_vec();
    let mut flat: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    let old = flat[index];
    flat[index] = value;
    var.set(&Tensor::from_vec(flat, shape, &Device::Cpu).unwrap()).unwrap();
    old
}

const PERTURBED: [&str; 3] =
    ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"];

/// Checks one loss: value by hand, gradient by finite differences.
fn check(name: &str, cfg: Value, critic: bool) {
    let mut w = worker(critic);
    let batch = if critic { critic_batch() } else { rl_batch(&mut w) };
    let (loss_name, cfg_for_worker) = match name.strip_suffix("@rollout") {
        Some(base) => (base, {
            let mut c = cfg.clone();
            c["anchor"] = json!("rollout");
            c
        }),
        None => (name, cfg.clone()),
    };
    let loss = common::loss(loss_name, &cfg_for_worker);
    let out = w.forward_backward(&batch, Some(&loss), true).unwrap();
    let loss_sum = out.metrics.value("loss:sum").unwrap();

    // The value, by hand from the returned per-token outputs.
    let ent = if cfg_f64(&cfg, "ent_coef", 0.0) != 0.0 { entropies(&w, &batch) } else { vec![] };
    let (total, elementwise, coefs) = if critic {
        let values: Vec<Vec<f64>> =
            out.loss_fn_outputs.iter().map(|o| o.values.iter().map(|&v| v as f64).collect()).collect();
        let eps = cfg_f64(&cfg, "value_clip", 0.2);
        let mut total = 0.0;
        let mut elementwise = vec![];
        for (d, v) in batch.iter().zip(&values) {
            let x = &d.loss_fn_inputs;
            let row: Vec<f64> = (0..d.len())
                .map(|t| {
                    let (w, old, ret) = (
                        x.weights.as_ref().unwrap()[t] as f64,
                        x.values.as_ref().unwrap()[t] as f64,
                        x.returns.as_ref().unwrap()[t] as f64,
                    );
                    let clipped = clamp(v[t], old - eps, old + eps);
                    0.5 * (v[t] - ret).powi(2).max((clipped - ret).powi(2)) * w
                })
                .collect();
            total += row.iter().sum::<f64>();
            elementwise.push(row);
        }
        (total, elementwise, vec![])
    } else {
        let lps = to_f64(&out.loss_fn_outputs.iter().map(|o| o.logprobs.clone()).collect::<Vec<_>>());
        hand(name, &cfg, &batch, &lps, &ent)
    };
    assert!((total - loss_sum).abs() <= 1e-5 * (1.0 + total.abs()), "{name}: loss:sum {loss_sum} vs by hand {total}");
    for (i, (o, e)) in out.loss_fn_outputs.iter().zip(&elementwise).enumerate() {
        assert_eq!(o.elementwise_loss.len(), batch[i].len(), "{name}: datum {i}");
        for (t, (&a, &b)) in o.elementwise_loss.iter().zip(e).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{name}: datum {i} token {t}: elementwise {a} vs {b}"
            );
        }
    }
    assert!(loss_sum.abs() > 1e-6, "{name}: trivial loss");
    // Both sides of every clip are exercised.
    for key in ["clip_fraction:mean", "value_clip_fraction:mean"] {
        if let Some(f) = out.metrics.value(key) {
            assert!(f > 0.0 && f < 1.0, "{name}: {key} = {f}: one regime only");
        }
    }

    // The gradient, by finite differences.
    let frozen =
        ["cispo", "stable_reinforce", "policy/cispo", "policy/cispo@rollout", "gspo", "rollout_is"].contains(&name);
    // Σ_t c_t · lp_t(θ) is the `cross_entropy` loss with weights −c_t (computed in f64).
    let surrogate_batch: Vec<Datum> = batch
        .iter()
        .zip(&coefs)
        .map(|(d, c)| {
            Datum::supervised(
                d.input_tokens.clone(),
                d.loss_fn_inputs.target_tokens.clone().unwrap(),
                c.iter().map(|&c| -c as f32).collect(),
            )
        })
        .collect();
    let cross_entropy = common::loss("cross_entropy", &json!({}));
    let objective = |w: &mut Worker| -> f64 {
        let (b, l) = if frozen { (&surrogate_batch, &cross_entropy) } else { (&batch, &loss) };
        w.forward(b, Some(l), false).unwrap().metrics.value("loss:sum").unwrap()
    };
    let (h, rel) = (1e-5, 1e-5);
    let mut params: Vec<&str> = PERTURBED.to_vec();
    if critic {
        params.push("value_head.weight");
    }
    let grads: Vec<(String, Vec<f64>)> = w
        .gradients()
        .into_iter()
        .filter(|(n, _)| params.contains(n))
        .map(|(n, g)| {
            (
                n.to_string(),
                g.unwrap_or_else(|| panic!("{name}: no gradient for {n}")).flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect();
    let mut nonzero = 0;
    for (param, g) in &grads {
        let argmax = (0..g.len()).max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs())).unwrap();
        let scale = g[argmax].abs();
        for index in [argmax, 0, g.len() / 2] {
            let x0 = set_entry(&w, param, index, 0.0);
            set_entry(&w, param, index, x0 + h);
            let plus = objective(&mut w);
            set_entry(&w, param, index, x0 - h);
            let minus = objective(&mut w);
            set_entry(&w, param, index, x0);
            let fd = (plus - minus) / (2.0 * h);
            let tol = rel * (fd.abs() + 1e-2 * scale) + 1e-9;
            assert!(
                (g[index] - fd).abs() <= tol,
                "{name}: ∂/∂{param}[{index}] autograd {} vs finite difference {fd}",
                g[index]
            );
            nonzero += usize::from(g[index].abs() > 1e-8);
        }
    }
    assert!(nonzero >= 3, "{name}: gradients trivially zero");
}

#[test]
fn tinker_losses() {
    check("cross_entropy", json!({}), false);
    check("importance_sampling", Value::Null, false);
    check("ppo", json!({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), false);
    check("cispo", json!({}), false);
    check("dro", json!({"beta": 0.7}), false);
    check("stable_reinforce", json!({"ratio_cap": 1.1, "kl_coeff": 0.3}), false);
}

#[test]
fn trainer_policy_losses() {
    check("policy/cross_entropy", json!({}), false);
    check("policy/importance_sampling", json!({}), false);
    check("regular", json!({"eps_clip_low": 0.1, "eps_clip_high": 0.15}), false);
    check("dual_clip", json!({"eps_clip_low": 0.1, "eps_clip_high": 0.1}), false);
    check("gspo", json!({"eps_clip_low": 0.05, "eps_clip_high": 0.05}), false);
    check("policy/cispo", json!({"eps_clip_low": 0.2, "eps_clip_high": 0.2}), false);
    check("policy/cispo@rollout", json!({"eps_clip_low": 0.2, "eps_clip_high": 0.2}), false);
    check("sapo", json!({}), false);
    check("rollout_is", json!({}), false);
}

#[test]
fn kl_penalty_and_entropy_bonus() {
    check("regular", json!({"kl_coef": 0.3, "kl_estimator": "k3"}), false);
    check("policy/cross_entropy", json!({"ent_coef": 0.05}), false);
    check("regular", json!({"kl_coef": 0.2, "ent_coef": 0.1}), false);
}

#[test]
fn critic_value_loss() {
    check("value", json!({"value_clip": 0.1}), true);
}
