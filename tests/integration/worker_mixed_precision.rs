//! Mixed precision (bf16 compute, f32 master weights and moments) against f32 training, on the
//! qwen3 fixture: the target is a training loss within 1e-2 of f32's after 20 steps. The
//! same run without masters (pure bf16) is measured too, at a learning rate small enough that
//! its updates are rounded away, so the comparison shows what the masters are for; and a
//! checkpoint round trip resumes bit-for-bit from the f32 masters.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::Transformer;
use oxrl::worker::mixed_precision::MASTER_FILE;
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

const STEPS: usize = 20;

/// 4 sequences of 32 tokens (vocab 300) with token-mean weights: the same batch every step, so
/// the loss falls steadily.
fn batch() -> Vec<Datum> {
    let (b, t) = (4, 32);
    let tok = |r: usize, i: usize, salt: usize| ((r * 977 + i * 131 + salt * 37) % 300) as u32;
    (0..b)
        .map(|r| {
            let ids = (0..t).map(|i| tok(r, i, 0)).collect();
            let targets = (0..t).map(|i| tok(r, i + 1, 0)).collect();
            Datum::supervised(ids, targets, vec![1.0 / (b * t) as f32; t])
        })
        .collect()
}

fn worker(dtype: DType, master_weights: bool) -> Worker {
    let model = Transformer::load(&fixture_dir("qwen3"), dtype, &Device::Cpu).unwrap();
    Worker::new(model, WorkerConfig { master_weights, ..Default::default() }).unwrap()
}

fn params() -> AdamParams {
    AdamParams { learning_rate: 1e-3, weight_decay: 0.01, ..Default::default() }
}

/// `steps` optimizer steps on the batch; returns the loss before each step and after the last
/// (each computed by the worker in its own precision).
fn train(w: &mut Worker, steps: usize, p: &AdamParams) -> Vec<f64> {
    let (b, ce) = (batch(), loss("cross_entropy", &json!({})));
    let mut losses = Vec::new();
    for _ in 0..steps {
        let out = w.forward_backward(&b, Some(&ce), false).unwrap();
        losses.push(out.metrics.value("loss:sum").unwrap());
        w.optim_step(p).unwrap();
    }
    losses.push(w.forward(&b, Some(&ce), false).unwrap().metrics.value("loss:sum").unwrap());
    losses
}

/// The worker's f32 masters, every parameter's (an unsharded worker keeps them all).
fn masters(w: &Worker) -> Vec<Tensor> {
    w.master_weights().unwrap().iter().map(|m| m.clone().expect("an unsharded worker keeps every master")).collect()
}

#[test]
fn bf16_mixed_precision_tracks_f32_after_20_steps() {
    let p = params();
    let f32_losses = train(&mut worker(DType::F32, true), STEPS, &p);
    let mut mixed = worker(DType::BF16, true);
    assert!(mixed.master_weights().is_some(), "a bf16 worker keeps f32 masters by default");
    let mixed_losses = train(&mut mixed, STEPS, &p);
    let (f, m) = (f32_losses[STEPS], mixed_losses[STEPS]);
    eprintln!("loss after {STEPS} steps: f32 {f:.5} (from {:.5}), bf16 mixed {m:.5}", f32_losses[0]);
    // The assertion is on real training: the f32 loss fell by far more than the tolerance.
    assert!(f32_losses[0] - f > 0.5, "f32 training barely moved: {f32_losses:?}");
    assert!((m - f).abs() < 1e-2, "bf16 mixed {m} vs f32 {f}: |Δ| = {}", (m - f).abs());
    // The masters are f32 and the parameters are exactly their bf16 rounding.
    for ((name, var), master) in mixed.params().iter().zip(masters(&mixed)) {
        assert_eq!((var.dtype(), master.dtype()), (DType::BF16, DType::F32), "{name}");
        let rounded = master.to_dtype(DType::BF16).unwrap();
        assert_eq!(max_abs_diff(&rounded, var.as_tensor()), 0.0, "{name}");
    }
}

/// At a learning rate below half a bf16 ulp of most weights, pure bf16 (no masters) rounds the
/// updates away and does not learn; the masters accumulate them. Same batch and steps.
#[test]
fn pure_bf16_loses_small_updates_that_masters_keep() {
    let p = AdamParams { learning_rate: 2e-5, ..Default::default() };
    let f = train(&mut worker(DType::F32, true), STEPS, &p);
    let m = train(&mut worker(DType::BF16, true), STEPS, &p);
    let pure = train(&mut worker(DType::BF16, false), STEPS, &p);
    let (df, dm, dp) = (f[0] - f[STEPS], m[0] - m[STEPS], pure[0] - pure[STEPS]);
    eprintln!("loss decrease over {STEPS} steps at lr 2e-5: f32 {df:.5}, bf16 mixed {dm:.5}, pure bf16 {dp:.5}");
    assert!((dm - df).abs() < 0.25 * df, "mixed precision should learn as f32 does: {dm} vs {df}");
    assert!(dp < 0.5 * df, "pure bf16 was expected to lose most small updates: {dp} vs f32 {df}");
    // So the 1e-2 check of the test above fails without masters, here.
    assert!((pure[STEPS] - f[STEPS]).abs() > 1e-2 && (m[STEPS] - f[STEPS]).abs() < 1e-2);
}

#[test]
fn mixed_precision_checkpoint_resumes_exactly_from_f32_masters() {
    let p = params();
    let mut a = worker(DType::BF16, true);
    train(&mut a, 3, &p);
    let dir = tempfile::tempdir().unwrap();
    a.save_state(dir.path()).unwrap();
    assert!(dir.path().join(MASTER_FILE).exists());
    let mut b = worker(DType::BF16, true);
    b.load_state(dir.path()).unwrap();
    for (x, y) in masters(&a).iter().zip(masters(&b)) {
        assert_eq!(max_abs_diff(x, &y), 0.0);
    }
    let (la, lb) = (train(&mut a, 2, &p), train(&mut b, 2, &p));
    assert_eq!(la, lb, "a resumed mixed-precision run must continue bit-for-bit");
    // Exported weights are in the compute dtype.
    let out = dir.path().join("export");
    b.export(&out, false).unwrap();
    let exported = Transformer::load(&out, DType::F32, &Device::Cpu).unwrap();
    let stored = oxrl::model::NamedTensors::load_file(&out.join("model.safetensors"), &Device::Cpu).unwrap();
    let first = &b.params()[0].0;
    assert_eq!(stored.get(first).unwrap().dtype(), DType::BF16);
    assert_eq!(exported.config.vocab_size, 300);
}

/// LoRA under mixed precision: the adapters are the trained parameters, so they get the f32
/// masters; offloading to host memory and back keeps masters and adapters bit-exact.
#[test]
fn lora_adapters_get_masters_and_survive_offload() {
    use oxrl::model::lora::LoraConfig;
    use oxrl::worker::placement::HostCopy;
    let model = Transformer::load(&fixture_dir("qwen3"), DType::BF16, &Device::Cpu).unwrap();
    let lora = Some(LoraConfig::new(4, 8.0, &["all-linear"]));
    let mut w = Worker::new(model, WorkerConfig { lora, ..Default::default() }).unwrap();
    let before = masters(&w);
    assert_eq!(before.len(), w.params().len());
    assert!(w.params().iter().all(|(n, _)| n.contains("lora_")), "only adapters are trained");
    let losses = train(&mut w, 3, &params());
    assert!(losses[3] < losses[0], "{losses:?}");
    let after = masters(&w);
    assert!(before.iter().zip(&after).any(|(a, b)| max_abs_diff(a, b) > 0.0), "the masters were updated");

    let mut host = HostCopy::default();
    w.offload(true, true, &mut host).unwrap();
    assert!(w.master_weights().is_none(), "offloaded masters leave the device");
    w.backload(true, true, &mut host).unwrap();
    for ((x, y), (name, var)) in after.iter().zip(masters(&w)).zip(w.params()) {
        assert_eq!(max_abs_diff(x, &y), 0.0, "{name}");
        assert_eq!(max_abs_diff(&x.to_dtype(DType::BF16).unwrap(), var.as_tensor()), 0.0, "{name}");
    }
}

/// An f32 checkpoint loaded into a bf16 worker gives its masters the full f32 values (the
/// parameters are their rounding), so switching precision mid-run loses nothing but the rounding.
#[test]
fn f32_checkpoint_gives_bf16_worker_full_precision_masters() {
    let mut f = worker(DType::F32, true);
    train(&mut f, 2, &params());
    let dir = tempfile::tempdir().unwrap();
    f.save_state(dir.path()).unwrap();
    let mut b = worker(DType::BF16, true);
    b.load_state(dir.path()).unwrap();
    for (((name, fv), master), (_, bv)) in f.params().iter().zip(masters(&b)).zip(b.params()) {
        assert_eq!(max_abs_diff(fv.as_tensor(), &master), 0.0, "{name}");
        assert_eq!(max_abs_diff(&master.to_dtype(DType::BF16).unwrap(), bv.as_tensor()), 0.0, "{name}");
    }
}
