//! KL estimators, advantage estimators, loss-reduction weights, off-policy correction and the
//! KL controller: every vector of docs/specs/algorithms.md, plus hand-computed cases.

use candle_core::{Device, Tensor};
use oxrl::algo::off_policy::{
    outlier_sequence_mask, ratio_token_mask, sequence_ratio_mask, sequence_truncated_is, token_truncated_is,
};
use oxrl::algo::{
    apply_kl_penalty_to_rewards, broadcast_over_mask, gae, grpo_advantages, loss_reduction_weights, masked_whiten,
    reinforce_plus_plus, rloo_advantages, sequence_scores, AdaptiveKlController, AdvantageEstimator, KlController,
    KlEstimator, LossReduction, OffPolicyCorrection, SequenceMaskMetric,
};
use serde_json::json;

fn assert_vec(actual: &[f32], expected: &[f64], tol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: {actual:?} vs {expected:?}");
    for (a, e) in actual.iter().zip(expected) {
        assert!((*a as f64 - e).abs() <= tol, "{what}: got {actual:?}, expected {expected:?}");
    }
}

fn assert_rows(actual: &[Vec<f32>], expected: &[&[f64]], tol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}");
    for (a, e) in actual.iter().zip(expected) {
        assert_vec(a, e, tol, what);
    }
}

// ---- KL estimators ----

#[test]
fn kl_estimators_spec_vector() {
    let t = |v: &[f64]| Tensor::new(v, &Device::Cpu).unwrap();
    let lp = t(&[0.2, 0.3, 0.5]);
    let reference = t(&[0.1, 0.2, 0.4]);
    let mask = Tensor::new(&[1u8, 1, 0], &Device::Cpu).unwrap();
    let run = |e: KlEstimator, lp: &Tensor| e.per_token(lp, &reference, &mask).unwrap().to_vec1::<f64>().unwrap();
    let as_f32 = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<_>>();
    assert_vec(&as_f32(run(KlEstimator::K1, &lp)), &[0.1, 0.1, 0.0], 1e-7, "k1");
    assert_vec(&as_f32(run(KlEstimator::K2, &lp)), &[0.005, 0.005, 0.0], 1e-7, "k2");
    assert_vec(&as_f32(run(KlEstimator::K3, &lp)), &[0.0048374, 0.0048374, 0.0], 1e-7, "k3");
    assert_vec(&as_f32(run(KlEstimator::Abs, &t(&[0.0, 0.3, 0.5]))), &[0.1, 0.1, 0.0], 1e-7, "abs");
    // NaN at the masked position: exactly 0.
    let nan_lp = t(&[0.2, 0.3, f64::NAN]);
    for e in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3, KlEstimator::Abs] {
        let v = run(e, &nan_lp);
        assert_eq!(v[2], 0.0, "{e:?}");
        assert!((v[0] - e.estimate(0.2, 0.1)).abs() < 1e-15);
    }
    assert!((KlEstimator::K3.estimate(0.2, 0.1) - 0.0048374180359595).abs() < 1e-12);
    // k3 clamps: x = clamp(−Δ, −20, 20), result clamped to 10.
    assert_eq!(KlEstimator::K3.estimate(-100.0, 0.0), 10.0);
    assert!((KlEstimator::K3.estimate(100.0, 0.0) - ((-20f64).exp() + 20.0 - 1.0).min(10.0)).abs() < 1e-12);
    assert!(KlEstimator::from_name("k5").unwrap_err().to_string().contains("`k5`"));
}

// ---- advantages ----

#[test]
fn grpo_spec_vector_and_std_normalisation() {
    let scores = [6.0, 3.0, 9.0, 12.0];
    let groups = ["a", "a", "b", "b"];
    assert_vec(&grpo_advantages(&scores, &groups, false).unwrap(), &[1.5, -1.5, -1.5, 1.5], 1e-6, "grpo no std");
    // σ (n − 1) of {6, 3} = √4.5.
    let a = 1.5 / (4.5f64.sqrt() + 1e-6);
    assert_vec(&grpo_advantages(&scores, &groups, true).unwrap(), &[a, -a, -a, a], 1e-6, "grpo");
    // A group of one: μ = 0, σ = 1.
    assert_vec(&grpo_advantages(&[2.0], &[7], true).unwrap(), &[2.0 / (1.0 + 1e-6)], 1e-7, "grpo single");
    assert_vec(&grpo_advantages(&[2.0], &[7], false).unwrap(), &[2.0], 1e-7, "grpo single no std");
    // Groups need not be contiguous.
    assert_vec(
        &grpo_advantages(&[6.0, 9.0, 3.0, 12.0], &[0, 1, 0, 1], false).unwrap(),
        &[1.5, -1.5, -1.5, 1.5],
        1e-6,
        "interleaved",
    );
    assert!(grpo_advantages(&scores, &groups[..3], true).is_err());
}

#[test]
fn rloo_spec_vector() {
    let a = rloo_advantages(&[6.0, 3.0, 9.0, 12.0, 1.0], &[0, 0, 1, 1, 2]).unwrap();
    assert_vec(&a, &[3.0, -3.0, -3.0, 3.0, 0.0], 1e-6, "rloo");
    // n = 3: s − mean(others).
    let a = rloo_advantages(&[1.0, 2.0, 6.0], &[0, 0, 0]).unwrap();
    assert_vec(&a, &[1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5], 1e-6, "rloo n=3");
}

#[test]
fn scores_and_broadcast() {
    assert_vec(&sequence_scores(&[vec![0.0, 1.0, 5.0], vec![3.0]]), &[6.0, 3.0], 0.0, "scores");
    let b = broadcast_over_mask(&[2.0, -1.0], &[vec![1.0, 1.0, 0.0], vec![0.0, 1.0]]).unwrap();
    assert_rows(&b, &[&[2.0, 2.0, 0.0], &[0.0, -1.0]], 0.0, "broadcast");
}

#[test]
fn reinforce_plus_plus_spec_vector() {
    let out = reinforce_plus_plus(&[vec![1.0, 2.0, 3.0]], &[vec![1.0, 1.0, 0.0]], 1.0).unwrap();
    assert_rows(&out.returns, &[&[3.0, 2.0, 3.0]], 1e-6, "returns");
    // Whitening of {3, 2}: mean 2.5, unbiased var 0.5.
    let z = 0.5 / (0.5f64 + 1e-8).sqrt();
    assert_rows(&out.advantages, &[&[z, -z, 0.0]], 1e-6, "advantages");
    // γ = 0.5: G = [1 + 0.5·(2 + 0.5·3), 2 + 1.5, 3].
    let out = reinforce_plus_plus(&[vec![1.0, 2.0, 3.0]], &[vec![1.0, 1.0, 1.0]], 0.5).unwrap();
    assert_rows(&out.returns, &[&[2.75, 3.5, 3.0]], 1e-6, "discounted");
}

#[test]
fn gae_spec_vector() {
    let out = gae(&[vec![1.0, 2.0, 3.0]], &[vec![0.5, 1.0, 1.5]], &[vec![1.0, 1.0, 1.0]], 1.0, 1.0).unwrap();
    assert_rows(&out.returns, &[&[6.0, 5.0, 3.0]], 1e-6, "returns");
    // Raw advantages = returns − V = [5.5, 4, 1.5], whitened.
    let raw = [5.5, 4.0, 1.5];
    let mean = 11.0 / 3.0;
    let var: f64 = raw.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / 2.0;
    let expected: Vec<f64> = raw.iter().map(|x| (x - mean) / (var + 1e-8).sqrt()).collect();
    assert_rows(&out.advantages, &[&expected], 1e-6, "advantages");
}

#[test]
fn gae_discounting_and_masked_tokens() {
    // γ = 0.9, λ = 0.5, one sequence: δ = [1 + 0.9·2 − 1, 0 − 2] = [1.8, −2],
    // A = [1.8 + 0.45·(−2), −2] = [0.9, −2], returns = A + V = [1.9, 0].
    let out = gae(&[vec![1.0, 0.0]], &[vec![1.0, 2.0]], &[vec![1.0, 1.0]], 0.9, 0.5).unwrap();
    assert_rows(&out.returns, &[&[1.9, 0.0]], 1e-6, "returns");
    // A masked (observation) token is skipped: r = [1, 0, 2], V = [0.5, 9, 1], m = [1, 0, 1]:
    // t2: A = 2 − 1 = 1; t0: δ = 1 + V_2 − 0.5 = 1.5, A = 2.5 → returns [3, 0, 2].
    let out = gae(&[vec![1.0, 0.0, 2.0]], &[vec![0.5, 9.0, 1.0]], &[vec![1.0, 0.0, 1.0]], 1.0, 1.0).unwrap();
    assert_rows(&out.returns, &[&[3.0, 0.0, 2.0]], 1e-6, "masked returns");
    assert_eq!(out.advantages[0][1], 0.0);
}

#[test]
fn masked_whitening_spans_the_batch() {
    let x = vec![vec![1.0, 100.0], vec![2.0, 3.0]];
    let m = vec![vec![1.0, 0.0], vec![1.0, 1.0]];
    // Valid {1, 2, 3}: mean 2, unbiased var 1.
    let s = 1.0 / (1.0f64 + 1e-8).sqrt();
    assert_rows(&masked_whiten(&x, &m).unwrap(), &[&[-s, 0.0], &[0.0, s]], 1e-6, "whiten");
    assert_rows(&masked_whiten(&[vec![5.0]], &[vec![1.0]]).unwrap(), &[&[0.0]], 0.0, "single");
    assert!(masked_whiten(&x, &m[..1]).is_err());
}

#[test]
fn advantage_estimators_by_name() {
    let rewards = vec![vec![0.0, 6.0], vec![3.0, 0.0]];
    let mask = vec![vec![1.0, 1.0], vec![1.0, 0.0]];
    let grpo = AdvantageEstimator::from_config("grpo", &json!({"norm_by_std": false})).unwrap();
    let out = grpo.compute(&rewards, None, &mask, &[0, 0]).unwrap();
    assert_rows(&out.advantages, &[&[1.5, 1.5], &[-1.5, 0.0]], 1e-6, "grpo");
    let rloo = AdvantageEstimator::from_config("rloo", &json!(null)).unwrap();
    assert_rows(
        &rloo.compute(&rewards, None, &mask, &[0, 0]).unwrap().advantages,
        &[&[3.0, 3.0], &[-3.0, 0.0]],
        1e-6,
        "rloo",
    );
    let gae_estimator = AdvantageEstimator::from_config("gae", &json!({"gamma": 1.0, "lambda": 1.0})).unwrap();
    assert!(gae_estimator.compute(&rewards, None, &mask, &[0, 0]).is_err());
    let e = AdvantageEstimator::from_config("grpoo", &json!({})).unwrap_err().to_string();
    assert!(e.contains("`grpoo`") && e.contains("did you mean `grpo`"), "{e}");
    let e = AdvantageEstimator::from_config("gae", &json!({"lam": 0.9})).unwrap_err().to_string();
    assert!(e.contains("`lam`") && e.contains("lambda"), "{e}");
}

// ---- loss reduction ----

#[test]
fn loss_reduction_weights_per_mode() {
    let mask = vec![vec![1.0, 1.0, 0.0], vec![1.0, 0.0, 0.0], vec![1.0, 1.0, 1.0, 1.0]];
    let groups = ["a", "a", "b"];
    let weights = |mode| loss_reduction_weights(mode, &mask, &groups).unwrap();
    let tm = 1.0 / 7.0;
    assert_rows(&weights(LossReduction::TokenMean), &[&[tm, tm, 0.0], &[tm, 0.0, 0.0], &[tm; 4]], 1e-7, "token_mean");
    let (s0, s1, s2) = (1.0 / 6.0, 1.0 / 3.0, 1.0 / 12.0);
    assert_rows(
        &weights(LossReduction::SequenceMean),
        &[&[s0, s0, 0.0], &[s1, 0.0, 0.0], &[s2; 4]],
        1e-7,
        "sequence_mean",
    );
    let n = 1.0 / (3.0 * 8.0);
    assert_rows(
        &weights(LossReduction::from_name("seq_mean_token_sum_norm", Some(8)).unwrap()),
        &[&[n, n, 0.0], &[n, 0.0, 0.0], &[n; 4]],
        1e-7,
        "seq_mean_token_sum_norm",
    );
    // P = 2; group a has 3 valid tokens, group b 4.
    let (pa, pb) = (1.0 / 6.0, 1.0 / 8.0);
    assert_rows(&weights(LossReduction::PromptMean), &[&[pa, pa, 0.0], &[pa, 0.0, 0.0], &[pb; 4]], 1e-7, "prompt_mean");
    // A sequence without valid tokens: max(Σ m, 1) keeps weights finite.
    let empty = loss_reduction_weights(LossReduction::SequenceMean, &[vec![0.0, 0.0]], &[0]).unwrap();
    assert_rows(&empty, &[&[0.0, 0.0]], 0.0, "empty");
    assert!(LossReduction::from_name("seq_mean_token_sum_norm", None).is_err());
    assert!(LossReduction::from_name("token_sum", None).unwrap_err().to_string().contains("`token_sum`"));
}

#[test]
fn token_mean_weights_make_the_loss_invariant_to_splitting() {
    // Σ w·loss over the mini-batch equals the plain token mean, whatever rows go to which
    // micro-batch, because the weights are computed once on the whole mini-batch.
    let mask = vec![vec![1.0, 1.0, 0.0], vec![1.0, 1.0, 1.0]];
    let loss = [vec![2.0, 4.0, 99.0], vec![1.0, 1.0, 1.0]];
    let w = loss_reduction_weights(LossReduction::TokenMean, &mask, &[0, 1]).unwrap();
    let part = |i: usize| loss[i].iter().zip(&w[i]).map(|(l, w)| l * w).sum::<f32>();
    assert!((part(0) + part(1) - 9.0 / 5.0).abs() < 1e-6);
}

// ---- off-policy correction ----

type Rows = Vec<Vec<f32>>;

fn off_policy_example() -> (Rows, Rows, Rows) {
    // log ρ = old − roll = [0, 0.5, −0.1] | [0, masked 50 → clamped 20].
    let old = vec![vec![0.0, 0.0, 0.0], vec![0.0, 0.0]];
    let roll = vec![vec![0.0, -0.5, 0.1], vec![0.0, -50.0]];
    let mask = vec![vec![1.0, 1.0, 1.0], vec![1.0, 0.0]];
    (old, roll, mask)
}

#[test]
fn off_policy_masks_and_truncated_is() {
    let (old, roll, mask) = off_policy_example();
    let e05 = 0.5f64.exp();
    let em01 = (-0.1f64).exp();
    // 1. Outlier: sequence 0 has ρ = 1.65 > 1.5; sequence 1's huge ρ is masked.
    assert_vec(&outlier_sequence_mask(&old, &roll, &mask, 0.5, 1.5).unwrap(), &[0.0, 1.0], 0.0, "outlier");
    assert_vec(&outlier_sequence_mask(&old, &roll, &mask, 0.92, 2.0).unwrap(), &[0.0, 1.0], 0.0, "outlier low");
    assert_vec(&outlier_sequence_mask(&old, &roll, &mask, 0.5, 2.0).unwrap(), &[1.0, 1.0], 0.0, "no outlier");
    // 2. Token mask [0.95, 1.5].
    assert_rows(
        &ratio_token_mask(&old, &roll, &mask, 0.95, 1.5).unwrap(),
        &[&[1.0, 0.0, 0.0], &[1.0, 0.0]],
        0.0,
        "token mask",
    );
    // 3. Truncated IS.
    assert_rows(
        &token_truncated_is(&old, &roll, &mask, 2.0).unwrap(),
        &[&[1.0, e05, em01], &[1.0, 0.0]],
        1e-6,
        "tis token",
    );
    assert_rows(
        &token_truncated_is(&old, &roll, &mask, 1.2).unwrap(),
        &[&[1.0, 1.2, em01], &[1.0, 0.0]],
        1e-6,
        "tis cap",
    );
    let e04 = 0.4f64.exp();
    assert_vec(&sequence_truncated_is(&old, &roll, &mask, 5.0).unwrap(), &[e04, 1.0], 1e-6, "tis seq");
    assert_vec(&sequence_truncated_is(&old, &roll, &mask, 1.2).unwrap(), &[1.2, 1.0], 1e-6, "tis seq cap");
    // 4. Sequence masks: geometric mean e^{0.4/3} = 1.143 is outside [0.99, 1.01]; product e^0.4 in [0.5, 2].
    let geometric = SequenceMaskMetric::GeometricMean { low: 0.99, high: 1.01 };
    assert_vec(&sequence_ratio_mask(&old, &roll, &mask, geometric).unwrap(), &[0.0, 1.0], 0.0, "geometric");
    let product = SequenceMaskMetric::Product { low: 0.5, high: 2.0 };
    assert_vec(&sequence_ratio_mask(&old, &roll, &mask, product).unwrap(), &[1.0, 1.0], 0.0, "product");
    let product = SequenceMaskMetric::Product { low: 0.5, high: 1.4 };
    assert_vec(&sequence_ratio_mask(&old, &roll, &mask, product).unwrap(), &[0.0, 1.0], 0.0, "product high");
}

#[test]
fn off_policy_correction_from_config() {
    let (old, roll, mask) = off_policy_example();
    let off = OffPolicyCorrection::from_config(
        &json!({"token_mask_low": 0.95, "token_mask_high": 1.5, "tis_level": "token"}),
    )
    .unwrap();
    let out = off.apply(&old, &roll, &mask).unwrap();
    assert_rows(&out.mask, &[&[1.0, 0.0, 0.0], &[1.0, 0.0]], 0.0, "mask");
    assert_rows(&out.is_weights, &[&[1.0, 0.0, 0.0], &[1.0, 0.0]], 1e-6, "is weights");
    assert!((out.metrics.value("off_policy_token_mask_fraction:mean").unwrap() - 0.5).abs() < 1e-12);

    let off = OffPolicyCorrection::from_config(&json!({"tis_level": "sequence", "sequence_mask": "product"})).unwrap();
    let out = off.apply(&old, &roll, &mask).unwrap();
    assert_rows(&out.mask, &[&[1.0, 1.0, 1.0], &[1.0, 0.0]], 0.0, "mask");
    let e04 = 0.4f64.exp();
    assert_rows(&out.is_weights, &[&[e04, e04, e04], &[1.0, 0.0]], 1e-6, "is weights");

    let off = OffPolicyCorrection::from_config(&json!({"outlier_high": 1.5})).unwrap();
    let out = off.apply(&old, &roll, &mask).unwrap();
    assert_rows(&out.mask, &[&[0.0, 0.0, 0.0], &[1.0, 0.0]], 0.0, "outlier");
    assert!((out.metrics.value("off_policy_outlier_fraction:mean").unwrap() - 0.5).abs() < 1e-12);

    let e = OffPolicyCorrection::from_config(&json!({"tis": "token"})).unwrap_err().to_string();
    assert!(e.contains("`tis`") && e.contains("tis_level"), "{e}");
    assert!(OffPolicyCorrection::from_config(&json!({"tis_level": "batch"})).is_err());
    assert!(OffPolicyCorrection::from_config(&json!({"token_mask_low": 2.0, "token_mask_high": 1.0})).is_err());
}

// ---- KL in rewards and the adaptive controller ----

#[test]
fn kl_penalty_in_rewards() {
    let (rewards, batch_kl) = apply_kl_penalty_to_rewards(
        &[vec![0.0, 0.0, 1.0]],
        &[vec![0.2, 0.3, 0.5]],
        &[vec![0.1, 0.2, 0.4]],
        &[vec![1.0, 1.0, 0.0]],
        0.5,
        KlEstimator::K1,
    )
    .unwrap();
    assert_rows(&rewards, &[&[-0.05, -0.05, 1.0]], 1e-7, "rewards");
    assert!((batch_kl - 0.1).abs() < 1e-7);
}

#[test]
fn adaptive_kl_controller() {
    let mut c = AdaptiveKlController::new(0.1, 6.0, 10000.0).unwrap();
    c.update(12.0, 100); // error clipped to +0.2
    assert!((c.coef - 0.1 * (1.0 + 0.2 * 0.01)).abs() < 1e-15);
    let before = c.coef;
    c.update(3.0, 100); // error −0.5 clipped to −0.2
    assert!((c.coef - before * (1.0 - 0.2 * 0.01)).abs() < 1e-15);
    let before = c.coef;
    c.update(6.6, 1000); // error +0.1
    assert!((c.coef - before * (1.0 + 0.1 * 0.1)).abs() < 1e-15);
    let mut fixed = KlController::Fixed(0.3);
    fixed.update(100.0, 100);
    assert_eq!(fixed.coef(), 0.3);
    let mut adaptive = KlController::Adaptive(AdaptiveKlController::new(0.3, 1.0, 10.0).unwrap());
    adaptive.update(2.0, 5);
    assert!((adaptive.coef() - 0.3 * 1.1).abs() < 1e-15);
    assert!(AdaptiveKlController::new(0.1, 0.0, 1.0).is_err());
}
