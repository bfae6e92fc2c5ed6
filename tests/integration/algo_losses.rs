//! Loss values on a small hand-computed example, masking, metrics and config validation.
//!
//! Example (token 3 is masked by weight 0 and holds NaN / ±inf in every input):
//! lp = [−1, −0.5, −2], old = [−1.1, −0.9, −1.5], roll = [−1, −0.6, −2.5], A = [1, 2, −0.5],
//! ref = [−1.2, −0.4, −2.1], H = [0.5, 1, 1.5], w = [1, 0.5, 2, 0], sequences [0, 0, 1, 1].
//! r = exp(lp − old) = [e^0.1, e^0.4, e^−0.5]; the expected numbers were computed by hand
//! (a few lines of scalar Python) from the formulas of algorithms.md.

use candle_core::{DType, Device, Tensor};
use oxrl::algo::{KlEstimator, Loss, LossInputs, LossName, LossOutput, Metrics};
use serde_json::{json, Value};

const NAN: f64 = f64::NAN;
const INF: f64 = f64::INFINITY;

fn t(v: &[f64]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn example() -> LossInputs {
    LossInputs::new(t(&[1.0, 0.5, 2.0, 0.0]))
        .with_learner_logprobs(t(&[-1.0, -0.5, -2.0, NAN]))
        .with_logprobs(t(&[-1.1, -0.9, -1.5, NAN]))
        .with_rollout_logprobs(t(&[-1.0, -0.6, -2.5, INF]))
        .with_advantages(t(&[1.0, 2.0, -0.5, NAN]))
        .with_ref_logprobs(t(&[-1.2, -0.4, -2.1, -INF]))
        .with_entropy(t(&[0.5, 1.0, 1.5, NAN]))
        .with_sequence_ids(Tensor::new(&[0u32, 0, 1, 1], &Device::Cpu).unwrap())
}

fn assert_close(actual: f64, expected: f64, tol: f64, what: &str) {
    assert!((actual - expected).abs() <= tol * (1.0 + expected.abs()), "{what}: got {actual}, expected {expected}");
}

/// Checks the three valid per-token losses, the exact 0 at the masked token, and the sum.
fn check(out: &LossOutput, expected: [f64; 3], expected_sum: f64) {
    let per_token = out.per_token_loss.to_vec1::<f64>().unwrap();
    for i in 0..3 {
        assert_close(per_token[i], expected[i], 1e-8, &format!("per-token loss {i}"));
    }
    assert_eq!(per_token[3].to_bits(), 0f64.to_bits(), "masked token must give exactly +0, got {}", per_token[3]);
    let sum = out.weighted_sum.to_scalar::<f64>().unwrap();
    assert_close(sum, expected_sum, 1e-8, "weighted sum");
    assert_close(out.metrics.value("loss:sum").unwrap(), expected_sum, 1e-8, "loss:sum");
    assert_eq!(out.metrics.value("ntokens:sum"), Some(3.0));
}

fn run(loss: Loss) -> LossOutput {
    loss.compute(&example()).unwrap()
}

fn mean_metric(out: &LossOutput, key: &str) -> f64 {
    let v = out.metrics.get(key).unwrap_or_else(|| panic!("missing metric {key} in {:?}", out.metrics));
    assert_eq!(v.count, 3.0, "{key} counts the valid tokens");
    v.sum / v.count
}

const R: [f64; 3] = [1.1051709180756477, 1.4918246976412703, 0.6065306597126334];

#[test]
fn tinker_cross_entropy() {
    let out = run(Loss::tinker("cross_entropy", &Value::Null).unwrap());
    check(&out, [1.0, 0.5, 2.0], 5.25);
}

#[test]
fn tinker_cross_entropy_negative_weights() {
    let inputs = LossInputs::new(t(&[-1.0, 2.0, 0.0])).with_learner_logprobs(t(&[-1.0, -0.5, NAN]));
    let out = Loss::tinker("cross_entropy", &json!({})).unwrap().compute(&inputs).unwrap();
    assert_close(out.weighted_sum.to_scalar::<f64>().unwrap(), -1.0 + 1.0, 1e-12, "sum");
    assert_eq!(out.metrics.value("ntokens:sum"), Some(2.0));
    assert_eq!(out.per_token_loss.to_vec1::<f64>().unwrap(), vec![1.0, 0.5, 0.0]);
}

#[test]
fn tinker_importance_sampling() {
    let out = run(Loss::tinker("importance_sampling", &json!({})).unwrap());
    check(&out, [-1.105170918, -2.983649395, 0.30326533], -1.990464956);
    assert_close(mean_metric(&out, "importance_ratio:mean"), (R[0] + R[1] + R[2]) / 3.0, 1e-12, "ratio");
}

#[test]
fn tinker_ppo_default_thresholds() {
    let out = run(Loss::tinker("ppo", &json!({})).unwrap());
    check(&out, [-1.105170918, -2.4, 0.4], -1.505170918);
    assert_close(mean_metric(&out, "clip_fraction:mean"), 2.0 / 3.0, 1e-12, "clip fraction");
}

#[test]
fn tinker_ppo_custom_thresholds() {
    let out = run(Loss::tinker("ppo", &json!({"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})).unwrap());
    // Nothing clipped: the loss is the plain −r·A.
    check(&out, [-1.105170918, -2.983649395, 0.30326533], -1.990464956);
    assert_eq!(mean_metric(&out, "clip_fraction:mean"), 0.0);
}

#[test]
fn tinker_cispo() {
    let out = run(Loss::tinker("cispo", &json!({})).unwrap());
    // −clamp(r, 0.8, 1.2)·lp·A = [1.10517·1·1, 1.2·0.5·2, −0.8·2·0.5]
    check(&out, [1.105170918, 1.2, -0.8], 0.105170918);
    assert_close(mean_metric(&out, "clip_fraction:mean"), 2.0 / 3.0, 1e-12, "clip fraction");
}

#[test]
fn tinker_dro() {
    let out = run(Loss::tinker("dro", &json!({"beta": 0.5})).unwrap());
    // −(lp·A − ¼(lp − q)²) = [1 + 0.0025, 1 + 0.04, −(1 + 0.0625)]
    check(&out, [1.0025, 1.04, -1.0625 + 0.125], -0.3525);
}

#[test]
fn tinker_stable_reinforce() {
    let out = run(Loss::tinker("stable_reinforce", &json!({"ratio_cap": 1.2, "kl_coeff": 0.5})).unwrap());
    // −min(r, 1.2)·A·lp + ¼(lp − q)² = [1.105170918 + 0.0025, 1.2·2·0.5 + 0.04, −0.606530660 + 0.0625]
    check(&out, [1.107670918, 1.24, -0.54403066], 0.639609598);
    assert_close(mean_metric(&out, "ratio_capped_fraction:mean"), 1.0 / 3.0, 1e-12, "capped fraction");
    assert_close(mean_metric(&out, "importance_ratio:mean"), (R[0] + R[1] + R[2]) / 3.0, 1e-12, "ratio");
    // Defaults: cap 2 (nothing capped here), no pull: −r·A·lp.
    let out = run(Loss::tinker("stable_reinforce", &json!({})).unwrap());
    check(&out, [1.105170918, 1.491824698, -0.60653066], 0.638021947);
}

#[test]
fn policy_regular_and_kl_entropy_terms() {
    let out = run(Loss::policy("regular", &json!({})).unwrap());
    check(&out, [-1.105170918, -2.4, 0.4], -1.505170918);
    assert_close(mean_metric(&out, "clip_fraction:mean"), 2.0 / 3.0, 1e-12, "clip fraction");
    // kl:mean (k3 by default) and entropy:mean are reported when the inputs are present.
    assert_close(mean_metric(&out, "kl:mean"), 0.009579696396529705, 1e-12, "kl");
    assert_close(mean_metric(&out, "entropy:mean"), 1.0, 1e-12, "entropy");

    let out = run(Loss::policy("regular", &json!({"kl_coef": 0.1, "ent_coef": 0.01})).unwrap());
    check(&out, [-1.108297843, -2.409482908, 0.385483742], -1.542071813);
}

#[test]
fn policy_kl_estimators_in_loss() {
    // k1 term only: + 0.5·(lp − ref) = [0.1, −0.05, 0.05]
    let out = run(Loss::policy("cross_entropy", &json!({"kl_coef": 0.5, "kl_estimator": "k1"})).unwrap());
    check(&out, [1.1, 0.45, 2.05], 1.1 + 0.225 + 4.1);
    let out = run(Loss::policy("cross_entropy", &json!({"kl_coef": 0.5, "kl_estimator": "abs"})).unwrap());
    check(&out, [1.1, 0.55, 2.05], 1.1 + 0.275 + 4.1);
    let out = run(Loss::policy("cross_entropy", &json!({"kl_coef": 2.0, "kl_estimator": "k2"})).unwrap());
    check(&out, [1.04, 0.51, 2.01], 1.04 + 0.255 + 4.02);
}

#[test]
fn policy_dual_clip() {
    // On the example no token has A < 0 with a large ratio: same as regular.
    let out = run(Loss::policy("dual_clip", &json!({})).unwrap());
    check(&out, [-1.105170918, -2.4, 0.4], -1.505170918);
    assert_eq!(mean_metric(&out, "dual_clip_fraction:mean"), 0.0);
    // r = e² with A = −1: regular gives 7.389; dual clip bounds it by −A·c = 3.
    // r = e² with A = +1: clipped to −1.2. r = e^−2 with A = −1: regular 0.8 < 3.
    let inputs = LossInputs::new(t(&[1.0, 1.0, 1.0]))
        .with_learner_logprobs(t(&[0.0, 0.0, -2.0]))
        .with_logprobs(t(&[-2.0, -2.0, 0.0]))
        .with_advantages(t(&[-1.0, 1.0, -1.0]));
    let out = Loss::policy("dual_clip", &json!({})).unwrap().compute(&inputs).unwrap();
    let per_token = out.per_token_loss.to_vec1::<f64>().unwrap();
    assert_close(per_token[0], 3.0, 1e-12, "dual-clipped");
    assert_close(per_token[1], -1.2, 1e-12, "clipped");
    assert_close(per_token[2], 0.8, 1e-12, "clipped low");
    assert_close(out.metrics.value("dual_clip_fraction:mean").unwrap(), 1.0 / 3.0, 1e-12, "dual fraction");
    let out = Loss::policy("dual_clip", &json!({"clip_ratio_c": 10.0})).unwrap().compute(&inputs).unwrap();
    assert_close(out.per_token_loss.to_vec1::<f64>().unwrap()[0], 7.38905609893065, 1e-12, "c = 10");
}

#[test]
fn policy_gspo_uses_sequence_mean_ratio() {
    // s = [(0.1 + 0.4)/2, −0.5] (token 3 is masked out of sequence 1's mean):
    // r = [e^0.25, e^0.25, e^−0.5] → all three clipped.
    let out = run(Loss::policy("gspo", &json!({})).unwrap());
    check(&out, [-1.2, -2.4, 0.4], -1.6);
    assert_close(mean_metric(&out, "clip_fraction:mean"), 1.0, 1e-12, "clip fraction");
    let e = 0.25f64.exp();
    assert_close(mean_metric(&out, "importance_ratio:mean"), (2.0 * e + R[2]) / 3.0, 1e-12, "ratio");
}

#[test]
fn policy_cispo_anchors() {
    // Defaults ε_lo = 1, ε_hi = 4: clamp(r, 0, 5) never binds here: −A·r·lp.
    let out = run(Loss::policy("cispo", &json!({})).unwrap());
    check(&out, [1.105170918, 1.491824698, -0.60653066], 0.638021947);
    assert_eq!(mean_metric(&out, "clip_fraction:mean"), 0.0);
    // Against roll: r = [1, e^0.1, e^0.5].
    let out = run(Loss::policy("cispo", &json!({"anchor": "rollout"})).unwrap());
    check(&out, [1.0, 1.105170918, -1.648721271], -1.744857082);
    // With ε_hi = 0.1 the band is [0, 1.1]: r = e^0.1·… clipped where above 1.1.
    let out = run(Loss::policy("cispo", &json!({"anchor": "rollout", "eps_clip_high": 0.1})).unwrap());
    check(&out, [1.0, 1.1, -1.1], 1.0 + 0.55 - 2.2);
    assert_close(mean_metric(&out, "clip_fraction:mean"), 2.0 / 3.0, 1e-12, "clip fraction");
}

#[test]
fn policy_sapo() {
    let out = run(Loss::policy("sapo", &json!({})).unwrap());
    check(&out, [-2.105074085, -4.964289521, 0.758397666], -3.070423512);
}

#[test]
fn policy_rollout_is() {
    // r = exp(lp − roll) = [1, e^0.1, e^0.5]; the last is outside (0.8, 1.2) and masked out.
    let out = run(Loss::policy("rollout_is", &json!({})).unwrap());
    check(&out, [1.0, 1.105170918, 0.0], 1.552585459);
    assert_close(mean_metric(&out, "clip_fraction:mean"), 1.0 / 3.0, 1e-12, "masked fraction");
}

#[test]
fn policy_cross_entropy_and_importance_sampling() {
    check(&run(Loss::policy("cross_entropy", &json!({})).unwrap()), [1.0, 0.5, 2.0], 5.25);
    check(
        &run(Loss::policy("importance_sampling", &Value::Null).unwrap()),
        [-1.105170918, -2.983649395, 0.30326533],
        -1.990464956,
    );
}

#[test]
fn value_loss_clipped() {
    // v = [0.5, 1, −0.2], v_old = [0.2, 1.1, 0.3], R = [1, 0, 0.1], ε = 0.2:
    // ½·max((v−R)², (clip(v)−R)²) = [½·0.36, ½·1, ½·0.09]; token 0 takes the clipped term.
    let inputs = LossInputs::new(t(&[1.0, 0.5, 2.0, 0.0]))
        .with_learner_values(t(&[0.5, 1.0, -0.2, NAN]))
        .with_values(t(&[0.2, 1.1, 0.3, INF]))
        .with_returns(t(&[1.0, 0.0, 0.1, NAN]));
    let out = Loss::value(&json!({"value_clip": 0.2})).unwrap().compute(&inputs).unwrap();
    check(&out, [0.18, 0.5, 0.045], 0.52);
    assert_close(mean_metric(&out, "value_clip_fraction:mean"), 1.0 / 3.0, 1e-12, "clip fraction");
    assert_close(mean_metric(&out, "values:mean"), 1.3 / 3.0, 1e-12, "values");
    // No clipping with a wide band: ½(v − R)².
    let out = Loss::value(&json!({"value_clip": 10.0})).unwrap().compute(&inputs).unwrap();
    check(&out, [0.125, 0.5, 0.045], 0.125 + 0.25 + 0.09);
}

#[test]
fn f32_inputs_work_and_agree() {
    let f32s = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
    let e = example();
    let mut inputs = LossInputs::new(f32s(&e.weights))
        .with_learner_logprobs(f32s(e.learner_logprobs.as_ref().unwrap()))
        .with_logprobs(f32s(e.logprobs.as_ref().unwrap()))
        .with_advantages(f32s(e.advantages.as_ref().unwrap()));
    inputs.sequence_ids = e.sequence_ids.clone();
    for name in ["ppo", "importance_sampling", "cispo"] {
        let out = Loss::tinker(name, &json!({})).unwrap().compute(&inputs).unwrap();
        assert_eq!(out.per_token_loss.dtype(), DType::F32);
        let reference = run(Loss::tinker(name, &json!({})).unwrap());
        let a = out.weighted_sum.to_scalar::<f32>().unwrap() as f64;
        assert_close(a, reference.weighted_sum.to_scalar::<f64>().unwrap(), 1e-6, name);
        assert_eq!(out.per_token_loss.to_vec1::<f32>().unwrap()[3], 0.0);
    }
}

#[test]
fn nan_and_inf_at_masked_positions_give_exact_zero_for_every_loss() {
    let losses = [
        Loss::tinker("cross_entropy", &json!({})).unwrap(),
        Loss::tinker("importance_sampling", &json!({})).unwrap(),
        Loss::tinker("ppo", &json!({})).unwrap(),
        Loss::tinker("cispo", &json!({})).unwrap(),
        Loss::tinker("dro", &json!({"beta": 1.0})).unwrap(),
        Loss::policy("regular", &json!({"kl_coef": 0.1, "ent_coef": 0.1})).unwrap(),
        Loss::policy("dual_clip", &json!({})).unwrap(),
        Loss::policy("gspo", &json!({})).unwrap(),
        Loss::policy("cispo", &json!({"anchor": "rollout"})).unwrap(),
        Loss::policy("sapo", &json!({})).unwrap(),
        Loss::policy("rollout_is", &json!({})).unwrap(),
    ];
    for loss in losses {
        let out = loss.compute(&example()).unwrap();
        let per_token = out.per_token_loss.to_vec1::<f64>().unwrap();
        assert_eq!(per_token[3], 0.0, "{}", loss.name());
        assert!(per_token.iter().all(|x| x.is_finite()), "{}: {per_token:?}", loss.name());
        assert!(out.weighted_sum.to_scalar::<f64>().unwrap().is_finite(), "{}", loss.name());
        for (key, value) in out.metrics.iter() {
            assert!(value.sum.is_finite() && value.count.is_finite(), "{}: {key} = {value:?}", loss.name());
        }
    }
}

#[test]
fn metrics_merge_exactly_across_micro_batches() {
    let whole = run(Loss::tinker("ppo", &json!({})).unwrap());
    let slice = |x: &Option<Tensor>, a: usize, n: usize| x.as_ref().unwrap().narrow(0, a, n).unwrap();
    let e = example();
    let part = |a: usize, n: usize| {
        LossInputs::new(e.weights.narrow(0, a, n).unwrap())
            .with_learner_logprobs(slice(&e.learner_logprobs, a, n))
            .with_logprobs(slice(&e.logprobs, a, n))
            .with_advantages(slice(&e.advantages, a, n))
    };
    let loss = Loss::tinker("ppo", &json!({})).unwrap();
    // Micro-batches of 1 and 3 tokens: the mean of means would be (1·0 + 2/2)/2 = 0.5, not 2/3.
    let mut merged = Metrics::new();
    merged.merge(&loss.compute(&part(0, 1)).unwrap().metrics);
    merged.merge(&loss.compute(&part(1, 3)).unwrap().metrics);
    for key in ["clip_fraction:mean", "importance_ratio:mean", "loss:sum", "ntokens:sum"] {
        assert_close(merged.value(key).unwrap(), whole.metrics.value(key).unwrap(), 1e-12, key);
    }
    assert_close(merged.value("clip_fraction:mean").unwrap(), 2.0 / 3.0, 1e-12, "clip fraction");
    let reduced = merged.reduce();
    assert!(reduced.keys().all(|k| k.matches(':').count() == 1));
}

fn error_of(result: oxrl::Result<Loss>) -> String {
    match result {
        Ok(loss) => panic!("expected an error, got {loss:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unknown_names_and_keys_are_errors_that_name_them() {
    let e = error_of(Loss::tinker("ppoo", &json!({})));
    assert!(e.contains("`ppoo`") && e.contains("did you mean `ppo`") && e.contains("dro"), "{e}");
    let e = error_of(Loss::tinker("regular", &json!({})));
    assert!(e.contains("`regular`") && e.contains("cross_entropy, importance_sampling, ppo, cispo, dro"), "{e}");
    let e = error_of(Loss::policy("grpo", &json!({})));
    assert!(e.contains("`grpo`") && e.contains("dual_clip"), "{e}");
    let e = error_of(Loss::tinker("ppo", &json!({"clip_low": 0.9})));
    assert!(e.contains("`clip_low`") && e.contains("did you mean `clip_low_threshold`"), "{e}");
    let e = error_of(Loss::tinker("cross_entropy", &json!({"beta": 1.0})));
    assert!(e.contains("`beta`") && e.contains("no config keys"), "{e}");
    let e = error_of(Loss::policy("regular", &json!({"clip_ratio_c": 3.0})));
    assert!(e.contains("`clip_ratio_c`") && e.contains("eps_clip_low"), "{e}");
    let e = error_of(Loss::policy("sapo", &json!({"tau": 1.0})));
    assert!(e.contains("`tau`") && e.contains("tau_pos"), "{e}");
    let e = error_of(Loss::value(&json!({"clip": 0.2})));
    assert!(e.contains("`clip`") && e.contains("value_clip"), "{e}");
}

#[test]
fn invalid_config_values_are_errors() {
    // Without `beta`, dro takes 0.05 (Tinker's documented example; the cookbook sends none).
    assert_eq!(Loss::tinker("dro", &json!({})).unwrap(), Loss::tinker("dro", &json!({"beta": 0.05})).unwrap());
    assert_ne!(Loss::tinker("dro", &json!({})).unwrap(), Loss::tinker("dro", &json!({"beta": 0.5})).unwrap());
    assert!(error_of(Loss::tinker("dro", &json!({"beta": -0.1}))).contains("non-negative"));
    assert!(error_of(Loss::tinker("dro", &json!({"beta": "big"}))).contains("finite number"));
    assert!(error_of(Loss::tinker("ppo", &json!([1, 2]))).contains("JSON object"));
    assert!(error_of(Loss::tinker("ppo", &json!({"clip_low_threshold": 1.5, "clip_high_threshold": 1.2})))
        .contains("above"));
    assert!(error_of(Loss::policy("regular", &json!({"kl_estimator": "k4"}))).contains("`k4`"));
    assert!(error_of(Loss::policy("cispo", &json!({"anchor": "ref"}))).contains("`ref`"));
    assert!(error_of(Loss::policy("dual_clip", &json!({"clip_ratio_c": 1.0}))).contains("> 1"));
    assert!(error_of(Loss::policy("regular", &json!({"eps_clip_low": -0.1}))).contains("≥ 0"));
    assert!(error_of(Loss::value(&json!({"value_clip": -1.0}))).contains("≥ 0"));
}

#[test]
fn missing_or_misshapen_inputs_are_errors() {
    let only_lp = LossInputs::new(t(&[1.0])).with_learner_logprobs(t(&[-1.0]));
    let e = Loss::tinker("ppo", &json!({})).unwrap().compute(&only_lp).unwrap_err().to_string();
    assert!(e.contains("`logprobs`"), "{e}");
    let e = Loss::policy("regular", &json!({"kl_coef": 0.1}))
        .unwrap()
        .compute(&only_lp.clone().with_logprobs(t(&[-1.0])).with_advantages(t(&[1.0])))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`ref_logprobs`"), "{e}");
    let mut no_ids = example();
    no_ids.sequence_ids = None;
    let e = Loss::policy("gspo", &json!({})).unwrap().compute(&no_ids).unwrap_err().to_string();
    assert!(e.contains("`sequence_ids`"), "{e}");
    let bad = example().with_advantages(t(&[1.0, 2.0]));
    let e = Loss::tinker("ppo", &json!({})).unwrap().compute(&bad).unwrap_err().to_string();
    assert!(e.contains("`advantages`") && e.contains("shape"), "{e}");
}

#[test]
fn parse_reads_each_family_by_name() {
    let parse = |name: &str, config: Value| Loss::parse(name, &config).unwrap();
    assert_eq!(parse("ppo", json!({})), Loss::tinker("ppo", &json!({})).unwrap());
    assert_eq!(parse("cispo", Value::Null), Loss::tinker("cispo", &Value::Null).unwrap());
    assert_eq!(parse("policy/cispo", json!({})), Loss::policy("cispo", &json!({})).unwrap());
    assert_eq!(parse("regular", json!({"kl_coef": 0.1})), Loss::policy("regular", &json!({"kl_coef": 0.1})).unwrap());
    assert_eq!(parse("policy/regular", json!({})), Loss::policy("regular", &json!({})).unwrap());
    assert_eq!(parse("value", json!({"value_clip": 0.5})), Loss::value(&json!({"value_clip": 0.5})).unwrap());
    let e = error_of(Loss::parse("dual_clipp", &json!({})));
    assert!(e.contains("unknown loss `dual_clipp`; did you mean `dual_clip`?"), "{e}");
    assert!(e.contains("(valid: cross_entropy, importance_sampling, ppo, cispo, dro, stable_reinforce, regular, dual_clip, gspo, sapo, rollout_is, policy/regular,"), "{e}");
    assert!(e.ends_with("policy/importance_sampling, value)"), "{e}");
    let e = error_of(Loss::parse("policy/ppo", &json!({})));
    assert!(e.contains("unknown policy loss `ppo`"), "{e}");
    let e = error_of(Loss::parse("ppo", &json!({"eps_clip_low": 0.2})));
    assert!(e.contains("`eps_clip_low`"), "{e}");
}

#[test]
fn qualified_name_and_config_parse_back_to_the_same_loss() {
    let losses = [
        ("cross_entropy", json!({})),
        ("importance_sampling", json!({})),
        ("ppo", json!({"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})),
        ("cispo", json!({})),
        ("dro", json!({"beta": 0.5})),
        ("regular", json!({"eps_clip_low": 0.1, "eps_clip_high": 0.28, "kl_coef": 0.01, "kl_estimator": "k2"})),
        ("dual_clip", json!({"clip_ratio_c": 4.0, "ent_coef": 0.001})),
        ("gspo", json!({})),
        ("policy/cispo", json!({"anchor": "rollout"})),
        ("sapo", json!({"tau_pos": 2.0})),
        ("rollout_is", json!({})),
        ("policy/cross_entropy", json!({"kl_coef": 0.1})),
        ("policy/importance_sampling", json!({})),
        ("value", json!({})),
    ];
    for (name, config) in losses {
        let loss = Loss::parse(name, &config).unwrap();
        assert_eq!(loss.qualified_name(), name);
        assert_eq!(Loss::parse(&loss.qualified_name(), &loss.config()).unwrap(), loss, "{name}");
    }
    let regular = Loss::parse("regular", &json!({})).unwrap();
    assert_eq!(
        regular.config(),
        json!({"eps_clip_low": 0.19999999999999996, "eps_clip_high": 0.19999999999999996, "kl_coef": 0.0, "kl_estimator": "k3", "ent_coef": 0.0})
    );
    assert_eq!(
        Loss::parse("cispo", &json!({})).unwrap().config(),
        json!({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    );
}

#[test]
fn lookup_then_build_is_parse() {
    for name in ["ppo", "cispo", "stable_reinforce", "policy/cispo", "regular", "rollout_is", "value"] {
        let built = LossName::lookup(name).unwrap().build(&Value::Null).unwrap();
        assert_eq!(built, Loss::parse(name, &Value::Null).unwrap(), "{name}");
    }
    assert_eq!(LossName::lookup("cispo").unwrap(), LossName::Tinker("cispo"));
    assert_eq!(LossName::lookup("policy/cispo").unwrap(), LossName::Policy("cispo"));
    // The name's errors are parse's, whatever the config.
    let lookup_error = |name: &str| LossName::lookup(name).unwrap_err().to_string();
    for name in ["dual_clipp", "policy/ppo"] {
        assert_eq!(lookup_error(name), error_of(Loss::parse(name, &json!({"no_such_key": 1}))), "{name}");
    }
}

#[test]
fn the_kl_term_is_what_kl_coef_and_kl_estimator_in_the_config_give() {
    let with_term = |name: &str| Loss::parse(name, &json!({})).unwrap().with_kl_term(0.1, KlEstimator::K2);
    let by_config = |name: &str| Loss::parse(name, &json!({"kl_coef": 0.1, "kl_estimator": "k2"}));
    for name in ["regular", "policy/cispo"] {
        assert_eq!(with_term(name).unwrap(), by_config(name).unwrap(), "{name}");
    }
    // Losses that take none refuse it with their config's error, word for word.
    for name in ["ppo", "cross_entropy", "stable_reinforce", "value"] {
        assert_eq!(error_of(with_term(name)), error_of(by_config(name)), "{name}");
    }
}

#[test]
fn losses_can_be_shared_across_threads() {
    fn shareable<T: Clone + std::fmt::Debug + Send + Sync>() {}
    shareable::<Loss>();
    shareable::<LossInputs>();
}
