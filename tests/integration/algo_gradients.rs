//! Gradient checks in F64: autograd of `Σ_t loss_t · w_t` against central finite differences
//! (losses without stop-gradient), or against the hand-derived gradient (losses whose ratio is
//! stop-gradient: there a finite difference would also move the detached factor).
//! Masked tokens hold NaN in every non-differentiable input and must get a gradient of exactly 0.

use candle_core::{Device, Tensor, Var};
use oxrl::algo::{Loss, LossInputs};
use serde_json::json;

const NAN: f64 = f64::NAN;

fn t(v: &[f64]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

const W: [f64; 5] = [1.0, 0.5, 2.0, 0.0, -0.7];
const OLD: [f64; 5] = [-1.1, -0.9, -1.5, NAN, -0.3];
const ROLL: [f64; 5] = [-1.0, -0.6, -2.5, NAN, -0.35];
const ADV: [f64; 5] = [1.0, 2.0, -0.5, NAN, -1.5];
const REF: [f64; 5] = [-1.2, -0.4, -2.1, NAN, -0.1];
const LP: [f64; 5] = [-1.0, -0.5, -2.0, -0.8, -0.2];

fn inputs(lp: Tensor) -> LossInputs {
    LossInputs::new(t(&W))
        .with_learner_logprobs(lp)
        .with_logprobs(t(&OLD))
        .with_rollout_logprobs(t(&ROLL))
        .with_advantages(t(&ADV))
        .with_ref_logprobs(t(&REF))
        .with_entropy(t(&[0.5, 1.0, 1.5, NAN, 0.2]))
        .with_sequence_ids(Tensor::new(&[0u32, 0, 1, 1, 2], &Device::Cpu).unwrap())
}

fn autograd(loss: &Loss, make: impl Fn(Tensor) -> LossInputs, x0: &[f64]) -> Vec<f64> {
    let var = Var::new(x0, &Device::Cpu).unwrap();
    let out = loss.compute(&make(var.as_tensor().clone())).unwrap();
    let grads = out.weighted_sum.backward().unwrap();
    grads.get(var.as_tensor()).expect("a gradient for the variable").to_vec1::<f64>().unwrap()
}

fn finite_difference(loss: &Loss, make: impl Fn(Tensor) -> LossInputs, x0: &[f64]) -> Vec<f64> {
    let h = 1e-6;
    let f = |x: &[f64]| loss.compute(&make(t(x))).unwrap().weighted_sum.to_scalar::<f64>().unwrap();
    (0..x0.len())
        .map(|i| {
            let (mut plus, mut minus) = (x0.to_vec(), x0.to_vec());
            plus[i] += h;
            minus[i] -= h;
            (f(&plus) - f(&minus)) / (2.0 * h)
        })
        .collect()
}

fn assert_gradients(name: &str, actual: &[f64], expected: &[f64]) {
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let tol = 1e-6 * e.abs().max(1e-3);
        assert!(
            (a - e).abs() <= tol,
            "{name}: d/dx[{i}] autograd {a} vs expected {e} (all: {actual:?} vs {expected:?})"
        );
    }
    assert_eq!(actual[3].to_bits(), 0f64.to_bits(), "{name}: masked token must get exactly 0, got {}", actual[3]);
}

fn check_against_finite_differences(loss: Loss) {
    let name = format!("{loss:?}");
    let grad = autograd(&loss, inputs, &LP);
    let fd = finite_difference(&loss, inputs, &LP);
    assert!(grad.iter().any(|g| g.abs() > 1e-3), "{name}: gradient is trivially zero");
    assert_gradients(&name, &grad, &fd);
}

#[test]
fn tinker_losses_match_finite_differences() {
    check_against_finite_differences(Loss::tinker("cross_entropy", &json!({})).unwrap());
    check_against_finite_differences(Loss::tinker("importance_sampling", &json!({})).unwrap());
    check_against_finite_differences(Loss::tinker("ppo", &json!({})).unwrap());
    check_against_finite_differences(Loss::tinker("dro", &json!({"beta": 0.7})).unwrap());
}

#[test]
fn trainer_losses_match_finite_differences() {
    check_against_finite_differences(Loss::policy("regular", &json!({})).unwrap());
    check_against_finite_differences(Loss::policy("dual_clip", &json!({})).unwrap());
    // c = 1.05 makes the dual clip bind at token 4 (loss 1.658 > −A·c = 1.575): gradient 0 there.
    let dual = Loss::policy("dual_clip", &json!({"clip_ratio_c": 1.05})).unwrap();
    assert_eq!(autograd(&dual, inputs, &LP)[4], 0.0);
    check_against_finite_differences(dual);
    check_against_finite_differences(Loss::policy("sapo", &json!({})).unwrap());
    check_against_finite_differences(Loss::policy("cross_entropy", &json!({})).unwrap());
    check_against_finite_differences(Loss::policy("importance_sampling", &json!({})).unwrap());
}

#[test]
fn kl_and_entropy_terms_match_finite_differences() {
    for estimator in ["k1", "k2", "k3", "abs"] {
        check_against_finite_differences(
            Loss::policy("regular", &json!({"kl_coef": 0.3, "kl_estimator": estimator, "ent_coef": 0.1})).unwrap(),
        );
    }
}

#[test]
fn entropy_bonus_gradient_flows_to_entropy() {
    let loss = Loss::policy("cross_entropy", &json!({"ent_coef": 0.25})).unwrap();
    let h0 = [0.5, 1.0, 1.5, 0.3, 0.2];
    let make = |h: Tensor| LossInputs::new(t(&W)).with_learner_logprobs(t(&LP)).with_entropy(h);
    let grad = autograd(&loss, make, &h0);
    let fd = finite_difference(&loss, make, &h0);
    let expected: Vec<f64> = W.iter().map(|w| -0.25 * w).collect();
    assert_gradients("entropy bonus", &grad, &fd);
    assert_gradients("entropy bonus (analytic)", &grad, &expected);
}

#[test]
fn value_loss_matches_finite_differences() {
    let loss = Loss::value(&json!({"value_clip": 0.2})).unwrap();
    // Token 0 takes the clipped term (gradient 0), token 1 sits inside the clip band, token 2
    // and 4 take the unclipped term.
    let v0 = [0.5, 1.0, -0.2, 0.7, 2.0];
    let make = |v: Tensor| {
        LossInputs::new(t(&W))
            .with_learner_values(v)
            .with_values(t(&[0.2, 1.1, 0.3, NAN, 1.5]))
            .with_returns(t(&[1.0, 0.0, 0.1, NAN, 0.0]))
    };
    let grad = autograd(&loss, make, &v0);
    let fd = finite_difference(&loss, make, &v0);
    assert_gradients("value loss", &grad, &fd);
    // Analytic: w·(v − R) where unclipped wins, 0 where the clipped value wins.
    assert_gradients("value loss (analytic)", &grad, &[0.0, 0.5 * 1.0, 2.0 * -0.3, 0.0, -0.7 * 2.0]);
}

fn clamp(x: f64, lo: f64, hi: f64) -> f64 {
    x.max(lo).min(hi)
}

#[test]
fn stop_gradient_losses_have_the_hand_derived_gradient() {
    let ratio = |anchor: &[f64; 5], i: usize| (LP[i] - anchor[i]).exp();
    let at_valid =
        |f: &dyn Fn(usize) -> f64| -> Vec<f64> { (0..5).map(|i| if i == 3 { 0.0 } else { W[i] * f(i) }).collect() };

    // Tinker cispo: d/dlp [−sg(clamp(r, 0.8, 1.2))·lp·A] = −clamp(r)·A.
    let loss = Loss::tinker("cispo", &json!({})).unwrap();
    let expected = at_valid(&|i| -clamp(ratio(&OLD, i), 0.8, 1.2) * ADV[i]);
    assert_gradients("tinker cispo", &autograd(&loss, inputs, &LP), &expected);

    // Trainer cispo, both anchors, band [0, 5].
    let loss = Loss::policy("cispo", &json!({})).unwrap();
    let expected = at_valid(&|i| -clamp(ratio(&OLD, i), 0.0, 5.0) * ADV[i]);
    assert_gradients("cispo old", &autograd(&loss, inputs, &LP), &expected);
    let loss = Loss::policy("cispo", &json!({"anchor": "rollout", "eps_clip_high": 0.1})).unwrap();
    let expected = at_valid(&|i| -clamp(ratio(&ROLL, i), 0.0, 1.1) * ADV[i]);
    assert_gradients("cispo rollout", &autograd(&loss, inputs, &LP), &expected);

    // rollout_is: −r·1[0.8 < r < 1.2]·A, r against roll.
    let loss = Loss::policy("rollout_is", &json!({})).unwrap();
    let expected = at_valid(&|i| {
        let r = ratio(&ROLL, i);
        if r > 0.8 && r < 1.2 {
            -r * ADV[i]
        } else {
            0.0
        }
    });
    let grad = autograd(&loss, inputs, &LP);
    assert!(grad[2] == 0.0 && grad[0] != 0.0, "{grad:?}");
    assert_gradients("rollout_is", &grad, &expected);
}

#[test]
fn gspo_gradient_is_token_level_with_the_sequence_ratio() {
    // s per sequence: seq 0 = mean(0.1, 0.4) = 0.25, seq 1 = −0.5 (token 3 masked), seq 2 = 0.1.
    // r_t = e^{s}; d loss_t / d lp_t = −r·A where the unclipped term is chosen, else 0.
    let s = [0.25, 0.25, -0.5, 0.0, 0.1];
    let expected: Vec<f64> = (0..5)
        .map(|i| {
            if i == 3 {
                return 0.0;
            }
            let r: f64 = f64::exp(s[i]);
            let unclipped = r * ADV[i];
            let clipped = clamp(r, 0.8, 1.2) * ADV[i];
            if clipped < unclipped {
                0.0
            } else {
                -W[i] * r * ADV[i]
            }
        })
        .collect();
    let loss = Loss::policy("gspo", &json!({})).unwrap();
    let grad = autograd(&loss, inputs, &LP);
    assert!(grad[4] != 0.0, "the in-band sequence must have a gradient: {grad:?}");
    assert_gradients("gspo", &grad, &expected);
    // With a band wide enough that nothing clips, every valid token gets −w·r·A.
    let loss = Loss::policy("gspo", &json!({"eps_clip_low": 0.9, "eps_clip_high": 9.0})).unwrap();
    let expected: Vec<f64> = (0..5).map(|i| if i == 3 { 0.0 } else { -W[i] * f64::exp(s[i]) * ADV[i] }).collect();
    assert_gradients("gspo wide", &autograd(&loss, inputs, &LP), &expected);
}

#[test]
fn nan_learner_logprob_at_a_masked_token_gets_zero_gradient() {
    let mut lp = LP;
    lp[3] = NAN;
    for loss in [
        Loss::tinker("ppo", &json!({})).unwrap(),
        Loss::tinker("dro", &json!({"beta": 1.0})).unwrap(),
        Loss::policy("gspo", &json!({})).unwrap(),
        Loss::policy("sapo", &json!({"kl_coef": 0.1})).unwrap(),
    ] {
        let grad = autograd(&loss, inputs, &lp);
        assert_eq!(grad[3], 0.0, "{}", loss.name());
        assert!(grad.iter().all(|g| g.is_finite()), "{}: {grad:?}", loss.name());
    }
}
