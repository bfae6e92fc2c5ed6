//! The tape (the hand-written forward and backward of the body and head on the CPU) against
//! candle's autograd of the same model: values and the gradient of every trainable tensor, in
//! f64 to 1e-10 and in f32 to 1e-4, for each model family (Llama with tied embeddings, Qwen2
//! with q/k/v biases, Qwen3 with head norms), full fine-tuning and LoRA on every projection
//! including lm_head, on the golden batch (left padding, ragged rows); cut at the hidden states,
//! at the target log-probs, and at the log-probs with the entropies.

use crate::common;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use common::*;
use oxrl::model::logprobs::{entropy, target_logprobs_and_lse};
use oxrl::model::tape::Tape;
use oxrl::model::Transformer;

/// Each variable's gradient: candle's part plus the tape's parts (a tied embedding has both).
fn gradient(var: &Var, store: &GradStore, taped: &[(Tensor, Tensor)]) -> Option<Tensor> {
    let id = var.as_tensor().id();
    let mut parts = store
        .get(var.as_tensor())
        .into_iter()
        .cloned()
        .chain(taped.iter().filter(|(p, _)| p.id() == id).map(|(_, g)| g.clone()));
    let first = parts.next()?;
    Some(parts.fold(first, |a, g| (a + g).unwrap()))
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let err = rel_err(a, b);
    assert!(err < tol, "{what}: off by {err} relative");
}

/// Compares the tape with candle's graph for one model: the hidden-state cut (a random linear
/// function of the final hidden states) and the log-prob cut (a weighted sum of the targets'
/// log-probs through the head).
fn compare(arch: &str, dtype: DType, lora_rank: usize, tol: f64) {
    let what = format!("{arch} {dtype:?} lora {lora_rank}");
    let b = Golden::load(arch).batch();
    let (rows, targets) = real_rows(&b);
    let (m, vars) = trainable(arch, dtype, lora_rank);

    // Cut at the hidden states.
    let reference = m.forward_hidden(&b.ids, &b.positions, &b.mask, None).unwrap();
    let w = random_like(&reference, 3, 1.0);
    let ref_store = (&reference * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let mut tape = Tape::forward(&m, &b.ids, &b.positions, &b.mask, true).unwrap();
    let hidden = tape.hidden().unwrap();
    assert_close(&format!("{what}: hidden states"), &hidden, &reference, tol);
    let store = (&hidden * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let taped = tape.backward(&store).unwrap();
    let mut checked = 0;
    for (name, var) in &vars {
        let want = ref_store.get(var.as_tensor());
        let got = gradient(var, &store, &taped);
        match (want, got) {
            (Some(want), Some(got)) => assert_close(&format!("{what}: d {name} (hidden cut)"), &got, want, tol),
            // lm_head's own tensors are outside the body: neither side differentiates them here.
            (None, None) => assert!(name.contains("lm_head"), "{what}: {name} got no gradient"),
            (want, got) => panic!("{what}: {name}: reference {:?}, tape {:?}", want.is_some(), got.is_some()),
        }
        checked += 1;
    }
    assert!(checked >= 9, "{what}: only {checked} tensors");

    // Cut at the target log-probs: the head runs on the tape too.
    let gather = Tensor::new(rows.as_slice(), &Device::Cpu).unwrap();
    let hd = reference.dim(2).unwrap();
    let reference = m.forward_hidden(&b.ids, &b.positions, &b.mask, None).unwrap();
    let real = reference.reshape(((), hd)).unwrap().index_select(&gather, 0).unwrap();
    let target_t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    // The head as the worker runs it (`Transformer::logits` would round to f32).
    let logits = m.lm_head.forward(&real).unwrap();
    let (ref_lp, lse) = target_logprobs_and_lse(&logits, &target_t).unwrap();
    let ref_h = entropy(&logits, &lse).unwrap();
    let (w, wh) = (random_like(&ref_lp, 5, 1.0), random_like(&ref_lp, 6, 1.0));
    // Log-probs alone, then with the entropy in the loss too.
    for with_entropy in [false, true] {
        let loss = |lp: &Tensor, h: &Tensor| {
            let l = (lp * &w).unwrap().sum_all().unwrap();
            if with_entropy {
                (l + (h * &wh).unwrap().sum_all().unwrap()).unwrap()
            } else {
                l
            }
        };
        let ref_store = loss(&ref_lp, &ref_h).backward().unwrap();
        let mut tape = Tape::forward(&m, &b.ids, &b.positions, &b.mask, true).unwrap();
        let (lp, h) = if with_entropy {
            let (lp, h) = tape.logprobs_and_entropy(&rows, &targets).unwrap();
            assert_close(&format!("{what}: entropies"), &h, &ref_h, tol);
            (lp, h)
        } else {
            (tape.logprobs(&rows, &targets).unwrap(), ref_h.detach())
        };
        assert_close(&format!("{what}: log-probs"), &lp, &ref_lp, tol);
        let store = loss(&lp, &h).backward().unwrap();
        let taped = tape.backward(&store).unwrap();
        for (name, var) in &vars {
            let want = ref_store.get(var.as_tensor()).unwrap_or_else(|| panic!("{what}: no reference d {name}"));
            let got = gradient(var, &store, &taped).unwrap_or_else(|| panic!("{what}: no tape d {name}"));
            assert_close(&format!("{what}: d {name} (head cut, entropy {with_entropy})"), &got, want, tol);
        }
    }
}

#[test]
fn tape_equals_candle_autograd_in_f64() {
    for arch in ARCHS {
        for lora_rank in [0, 3] {
            compare(arch, DType::F64, lora_rank, 1e-10);
        }
    }
}

#[test]
fn tape_equals_candle_autograd_in_f32() {
    for arch in ARCHS {
        for lora_rank in [0, 3] {
            compare(arch, DType::F32, lora_rank, 1e-4);
        }
    }
}

#[test]
fn tape_refuses_bad_requests() {
    let b = Golden::load("qwen3").batch();
    let m = Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu).unwrap();
    let vocab = m.config.vocab_size as u32;
    let n = (b.ids.len() * b.ids[0].len()) as u32;
    let fwd = || Tape::forward(&m, &b.ids, &b.positions, &b.mask, true).unwrap();
    let err = |r: oxrl::Result<Tensor>| r.unwrap_err().to_string();
    assert!(err(fwd().logprobs(&[0, n], &[1, 1])).contains("beyond"), "row past the batch");
    assert!(err(fwd().logprobs(&[0], &[vocab])).contains("out of range"), "target past the vocabulary");
    assert!(err(fwd().logprobs(&[0, 1], &[1])).contains("targets"), "rows and targets differ");
    let store = Tensor::new(1f32, &Device::Cpu).unwrap().backward().unwrap();
    assert!(fwd().backward(&store).unwrap_err().to_string().contains("before its output"));
    // A forward that did not record cannot be differentiated.
    let mut t = Tape::forward(&m, &b.ids, &b.positions, &b.mask, false).unwrap();
    let h = t.hidden().unwrap();
    let store = h.sum_all().unwrap().backward().unwrap();
    assert!(t.backward(&store).unwrap_err().to_string().contains("did not record"));
    // Bad token ids are refused as the candle path refuses them.
    let mut ids = b.ids.clone();
    ids[0][0] = vocab;
    assert!(Tape::forward(&m, &ids, &b.positions, &b.mask, true).is_err());
}
