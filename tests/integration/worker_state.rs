//! Checkpoints, LoRA, the critic, optimizer details, and input errors.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::lora::{self, LoraConfig};
use oxrl::model::Transformer;
use oxrl::worker::{AdamParams, Datum, LossFnInputs, Worker, WorkerConfig};
use serde_json::json;

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn batch(seed: u64) -> Vec<Datum> {
    let mut s = seed;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    [6usize, 9, 3, 7]
        .iter()
        .map(|&n| {
            let ids: Vec<u32> = (0..n).map(|_| (next() * 300.0) as u32).collect();
            let targets: Vec<u32> = (0..n).map(|_| (next() * 300.0) as u32).collect();
            let mut d = Datum::supervised(ids, targets, (0..n).map(|_| (next() * 0.2) as f32).collect());
            d.loss_fn_inputs.values = Some((0..n).map(|_| (next() - 0.5) as f32).collect());
            d.loss_fn_inputs.returns = Some((0..n).map(|_| (next() * 2.0 - 1.0) as f32).collect());
            d
        })
        .collect()
}

fn params_bits(w: &Worker) -> Vec<(String, Vec<u32>)> {
    w.params()
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect()
}

fn train_step(w: &mut Worker, seed: u64, loss: &str) -> f64 {
    let b = batch(seed);
    let loss = common::loss(loss, &json!({}));
    w.forward_backward(&b[..2], Some(&loss), false).unwrap();
    w.forward_backward(&b[2..], Some(&loss), false).unwrap();
    let p = AdamParams { learning_rate: 1e-2, weight_decay: 0.01, grad_clip_norm: 0.5, ..Default::default() };
    w.optim_step(&p).unwrap()
}

fn configs() -> Vec<(&'static str, WorkerConfig, &'static str)> {
    vec![
        ("full", WorkerConfig { seed: 1, micro_batch_size: Some(2), ..Default::default() }, "cross_entropy"),
        (
            "lora",
            WorkerConfig {
                seed: 2,
                lora: Some(LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "lm_head"])),
                ..Default::default()
            },
            "cross_entropy",
        ),
        ("critic", WorkerConfig { seed: 3, critic: true, ..Default::default() }, "value"),
    ]
}

#[test]
fn save_load_then_step_equals_step_bit_for_bit() {
    for (what, cfg, loss) in configs() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let mut a = Worker::new(load("llama"), cfg.clone()).unwrap();
        train_step(&mut a, 1, loss);
        train_step(&mut a, 2, loss);
        a.save_state(&dir).unwrap();
        // Saving again over the same name replaces it and leaves no temporary directory.
        a.save_state(&dir).unwrap();
        let names: Vec<String> =
            std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        assert_eq!(names, vec!["ckpt".to_string()], "{what}");

        // A worker with a different seed and no history, restored from the checkpoint.
        let mut b = Worker::new(load("llama"), WorkerConfig { seed: 99, ..cfg.clone() }).unwrap();
        b.load_state(&dir).unwrap();
        assert_eq!(b.step(), 2, "{what}");
        assert_eq!(b.rng_state(), a.rng_state(), "{what}");
        assert_eq!(params_bits(&a), params_bits(&b), "{what}: parameters differ after load");
        let na = train_step(&mut a, 3, loss);
        let nb = train_step(&mut b, 3, loss);
        assert_eq!(na.to_bits(), nb.to_bits(), "{what}: grad norm");
        assert_eq!(params_bits(&a), params_bits(&b), "{what}: parameters differ after a step");
        for (name, _) in a.params() {
            let (ma, mb) = (a.moments(name).unwrap(), b.moments(name).unwrap());
            assert_eq!(ma.step, mb.step);
            assert_eq!(max_abs_diff(&ma.exp_avg_sq, &mb.exp_avg_sq), 0.0, "{what}: {name}");
        }
    }
}

/// `load_weights` (Tinker's load without optimizer): the parameters of the checkpoint, a fresh
/// optimizer — the next step equals that of a fresh worker given those parameters.
#[test]
fn load_weights_restores_parameters_with_a_fresh_optimizer() {
    let (_, cfg, loss) = configs().remove(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let mut a = Worker::new(load("llama"), cfg.clone()).unwrap();
    train_step(&mut a, 1, loss);
    train_step(&mut a, 2, loss);
    a.save_state(&dir).unwrap();
    let mut b = Worker::new(load("llama"), cfg.clone()).unwrap();
    b.load_weights(&dir).unwrap();
    assert_eq!(params_bits(&a), params_bits(&b));
    assert_eq!(b.step(), 0);
    assert!(a.params().iter().all(|(n, _)| b.moments(n).is_none()));
    // b steps like a worker that starts from a's parameters with no optimizer history: its
    // first AdamW step moves every trained parameter by about lr (bias-corrected m/√v ≈ ±1),
    // unlike a's, whose moments remember two steps.
    let before = params_bits(&b);
    train_step(&mut b, 3, loss);
    train_step(&mut a, 3, loss);
    assert_ne!(params_bits(&a), params_bits(&b), "a fresh optimizer took the same step");
    assert_ne!(params_bits(&b), before);
    assert_eq!(b.step(), 1);
}

#[test]
fn load_state_refuses_a_mismatched_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, full_cfg, _) = configs().remove(0);
    let (_, lora_cfg, _) = configs().remove(1);
    let full = Worker::new(load("llama"), full_cfg.clone()).unwrap();
    full.save_state(&tmp.path().join("full")).unwrap();
    let mut lora_worker = Worker::new(load("llama"), lora_cfg).unwrap();
    let err = lora_worker.load_state(&tmp.path().join("full")).unwrap_err().to_string();
    assert!(err.contains("lora"), "{err}");
    let mut other_arch = Worker::new(load("qwen2"), full_cfg).unwrap();
    let err = other_arch.load_state(&tmp.path().join("full")).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn lora_trains_only_adapters_and_exports_peft_and_merged() {
    let cfg = LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "up_proj"]);
    let base = load("qwen3");
    let mut w = Worker::new(base.clone(), WorkerConfig { lora: Some(cfg.clone()), ..Default::default() }).unwrap();
    assert!(w.params().iter().all(|(n, _)| n.contains(".lora_A.") || n.contains(".lora_B.")));
    assert_eq!(w.params().len(), 2 * 3 * 2);
    for seed in 1..=3 {
        train_step(&mut w, seed, "cross_entropy");
    }
    // The frozen base is untouched.
    for ((name, a), (_, b)) in w.model().named_params().iter().zip(base.named_params()) {
        assert_eq!(max_abs_diff(a, &b), 0.0, "{name} changed");
    }
    let probe = batch(7);
    let want = w.forward(&probe, None, true).unwrap().loss_fn_outputs;

    let tmp = tempfile::tempdir().unwrap();
    w.export(&tmp.path().join("peft"), false).unwrap();
    let mut m = load("qwen3");
    let (saved, _) = lora::load_peft(&mut m, &tmp.path().join("peft"), false).unwrap();
    assert_eq!(saved, cfg);
    w.export(&tmp.path().join("merged"), true).unwrap();
    let merged = Transformer::load(&tmp.path().join("merged"), DType::F32, &Device::Cpu).unwrap();
    for model in [m, merged] {
        let got =
            Worker::new(model, WorkerConfig::default()).unwrap().forward(&probe, None, true).unwrap().loss_fn_outputs;
        for (a, b) in got.iter().zip(&want) {
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "exported model log-prob {x} vs {y}");
            }
        }
    }
}

#[test]
fn full_export_loads_as_a_model_and_critic_returns_values() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Worker::new(load("qwen2"), WorkerConfig::default()).unwrap();
    train_step(&mut w, 1, "cross_entropy");
    w.export(&tmp.path().join("hf"), false).unwrap();
    let m = Transformer::load(&tmp.path().join("hf"), DType::F32, &Device::Cpu).unwrap();
    for ((name, a), (_, b)) in m.named_params().iter().zip(w.model().named_params()) {
        assert_eq!(max_abs_diff(a, &b), 0.0, "{name}");
    }

    let mut critic = Worker::new(load("qwen2"), WorkerConfig { critic: true, ..Default::default() }).unwrap();
    let b = batch(3);
    let out = critic.forward(&b, None, true).unwrap();
    for (d, rec) in b.iter().zip(&out.loss_fn_outputs) {
        assert_eq!(rec.values.len(), d.len());
        assert!(rec.logprobs.is_empty());
    }
    let fb = critic.forward_backward(&b, Some(&common::loss("value", &json!({"value_clip": 0.3}))), true).unwrap();
    assert!(fb.metrics.value("value_clip_fraction:mean").is_some() && fb.metrics.value("values:mean").is_some());
    let grads = critic.gradients();
    for name in ["value_head.weight", "value_head.bias", "model.layers.0.self_attn.q_proj.weight"] {
        assert!(grads.iter().any(|(n, g)| *n == name && g.is_some()), "{name} has no gradient");
    }
    // The unembedding is unused by a critic: no gradient, and AdamW leaves it alone.
    let head_before = critic.model().lm_head.weight.copy().unwrap();
    critic.optim_step(&AdamParams { weight_decay: 0.1, ..Default::default() }).unwrap();
    assert_eq!(max_abs_diff(&critic.model().lm_head.weight, &head_before), 0.0);
    // Critic and policy losses do not mix.
    let err =
        critic.forward_backward(&b, Some(&common::loss("cross_entropy", &json!({}))), true).unwrap_err().to_string();
    assert!(err.contains("critic"), "{err}");
    let err = w.forward_backward(&b, Some(&common::loss("value", &json!({}))), true).unwrap_err().to_string();
    assert!(err.contains("critic"), "{err}");
}

#[test]
fn optim_step_clips_skips_non_finite_and_zeroes() {
    let mut w = Worker::new(load("llama"), WorkerConfig::default()).unwrap();
    let b = batch(5);
    w.forward_backward(&b, Some(&common::loss("cross_entropy", &json!({}))), false).unwrap();
    let grads: Vec<Tensor> = w.gradients().iter().map(|(_, g)| g.unwrap().clone()).collect();
    let norm: f64 = grads
        .iter()
        .map(|g| g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64)
        .sum::<f64>()
        .sqrt();
    let before = w.params()[0].1.as_tensor().copy().unwrap();

    // A non-finite gradient: the norm is reported, nothing moves, gradients are dropped.
    let mut bad = Worker::new(load("llama"), WorkerConfig::default()).unwrap();
    bad.forward_backward(&b, Some(&common::loss("cross_entropy", &json!({}))), false).unwrap();
    let huge = b
        .iter()
        .map(|d| Datum {
            loss_fn_inputs: LossFnInputs { weights: Some(vec![3e38; d.len()]), ..d.loss_fn_inputs.clone() },
            ..d.clone()
        })
        .collect::<Vec<_>>();
    bad.forward_backward(&huge, Some(&common::loss("cross_entropy", &json!({}))), false).unwrap();
    let p0 = bad.params()[0].1.as_tensor().copy().unwrap();
    let n = bad.optim_step(&AdamParams::default()).unwrap();
    assert!(!n.is_finite(), "norm {n}");
    assert_eq!(bad.step(), 0);
    assert_eq!(max_abs_diff(bad.params()[0].1.as_tensor(), &p0), 0.0);
    assert!(bad.gradients().iter().all(|(_, g)| g.is_none()));

    // Clipping: the returned norm is the pre-clip one; with clip ≥ norm the update equals no clip.
    let mut unclipped = Worker::new(load("llama"), WorkerConfig::default()).unwrap();
    unclipped.forward_backward(&b, Some(&common::loss("cross_entropy", &json!({}))), false).unwrap();
    let got =
        w.optim_step(&AdamParams { grad_clip_norm: norm * 1e-3, learning_rate: 0.0, ..Default::default() }).unwrap();
    assert!((got - norm).abs() < 1e-4 * norm, "{got} vs {norm}");
    assert_eq!(max_abs_diff(w.params()[0].1.as_tensor(), &before), 0.0, "lr 0 moved the parameters");
    // The first moment saw the clipped gradient: m = (1 − β1) · g · clip / norm.
    let m = &w.moments(&w.params()[0].0).unwrap().exp_avg;
    let want = (grads[0].clone() * (0.1 * 1e-3 * norm / (norm + 1e-6))).unwrap();
    assert!(rel_err(m, &want) < 1e-5);
    unclipped.optim_step(&AdamParams { grad_clip_norm: norm * 2.0, ..Default::default() }).unwrap();
    let mut plain = Worker::new(load("llama"), WorkerConfig::default()).unwrap();
    plain.forward_backward(&b, Some(&common::loss("cross_entropy", &json!({}))), false).unwrap();
    plain.optim_step(&AdamParams::default()).unwrap();
    for ((name, a), (_, c)) in unclipped.params().iter().zip(plain.params()) {
        assert_eq!(max_abs_diff(a.as_tensor(), c.as_tensor()), 0.0, "{name}");
    }
}

#[test]
fn bad_input_errors_name_the_datum_and_the_field() {
    let mut w = Worker::new(load("llama"), WorkerConfig::default()).unwrap();
    let good = batch(1);
    type Case = (Box<dyn Fn(&mut Vec<Datum>)>, &'static str, &'static [&'static str]);
    let cases: Vec<Case> = vec![
        (
            Box::new(|b| b[2].loss_fn_inputs.weights.as_mut().unwrap().push(1.0)),
            "cross_entropy",
            &["datum 2", "weights", "length"],
        ),
        (
            Box::new(|b| b[1].loss_fn_inputs.target_tokens.as_mut().unwrap()[3] = 300),
            "cross_entropy",
            &["datum 1", "target_tokens", "300"],
        ),
        (Box::new(|b| b[3].input_tokens[0] = 1000), "cross_entropy", &["datum 3", "input_tokens", "1000"]),
        (
            Box::new(|b| b[0].loss_fn_inputs.weights.as_mut().unwrap()[2] = f32::NAN),
            "cross_entropy",
            &["datum 0", "weights", "NaN"],
        ),
        (Box::new(|b| b[1].loss_fn_inputs.target_tokens = None), "cross_entropy", &["datum 1", "target_tokens"]),
        (Box::new(|_| {}), "ppo", &["datum 0", "logprobs"]),
        (Box::new(|b| b[2].loss_fn_inputs.values = None), "cross_entropy", &["datum 2", "values"]),
        (Box::new(|b| b[1].input_tokens.clear()), "cross_entropy", &["datum 1", "empty"]),
        (Box::new(|b| b.clear()), "cross_entropy", &["empty batch"]),
    ];
    for (mutate, loss, needles) in cases {
        let mut b = good.clone();
        mutate(&mut b);
        let err = w.forward_backward(&b, Some(&common::loss(loss, &json!({}))), true).unwrap_err().to_string();
        for needle in needles {
            assert!(err.contains(needle), "error `{err}` does not mention `{needle}`");
        }
    }
    // A backward needs a loss.
    let err = w.forward_backward(&good, None, true).unwrap_err().to_string();
    assert!(err.contains("needs a loss"), "{err}");
    // Names and configs are checked when the loss is parsed.
    let err = oxrl::algo::Loss::parse("ppo_typo", &json!({})).unwrap_err().to_string();
    assert!(err.contains("unknown loss") && err.contains("ppo"), "{err}");
    let err = oxrl::algo::Loss::parse("ppo", &json!({"clip_low": 0.5})).unwrap_err().to_string();
    assert!(err.contains("unknown config key `clip_low`"), "{err}");
    let err = oxrl::algo::Loss::parse("dro", &json!({"beta": -1.0})).unwrap_err().to_string();
    assert!(err.contains("beta must be non-negative"), "{err}");
    let err = w
        .forward_backward(&good, Some(&common::loss("policy/cross_entropy", &json!({"kl_coef": 0.1}))), true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ref_logprobs"), "{err}");
    assert!(w.gradients().iter().all(|(_, g)| g.is_none()), "a failed call accumulated gradients");

    // A datum longer than the token budget.
    let mut small =
        Worker::new(load("llama"), WorkerConfig { max_tokens_per_microbatch: Some(8), ..Default::default() }).unwrap();
    let err =
        small.forward_backward(&good, Some(&common::loss("cross_entropy", &json!({}))), true).unwrap_err().to_string();
    assert!(err.contains("datum 1") && err.contains("max_tokens_per_microbatch"), "{err}");

    // Datums round-trip through JSON; unknown fields are refused.
    let text = serde_json::to_string(&good[0]).unwrap();
    assert_eq!(serde_json::from_str::<Datum>(&text).unwrap(), good[0]);
    let err = serde_json::from_str::<Datum>(r#"{"input_tokens":[1],"loss_fn_inputs":{"weight":[1]}}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight"), "{err}");
}
