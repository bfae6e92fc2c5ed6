//! candle's backward as oxrl patches it (`vendor/candle-core`): off the CPU a node's first
//! gradient is stored as it is (a variable's made contiguous, any other kept as the view it is)
//! instead of added into a fresh zero buffer. Run here on the CPU
//! (`with_first_gradients_stored`), every family's graph gives the gradient values the zero
//! buffers give (a zero's sign may differ: 0 + (−0) is +0), for full fine-tuning and LoRA, in
//! f32, f64 and bf16: the GPU's backward computes what candle's always did.

use crate::common;

use candle_core::backprop::with_first_gradients_stored;
use candle_core::{DType, Device, Tensor};
use common::*;

fn values_of(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
}

#[test]
fn first_gradients_stored_as_they_are_give_the_same_values() {
    for arch in ARCHS.iter().copied().chain(["qwen3_moe", "gemma3", "qwen3_5"]) {
        let b = Golden::load(arch).batch();
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            for lora_rank in [0, 3] {
                let what = format!("{arch} {dtype:?} lora {lora_rank}");
                let (m, vars) = trainable(arch, dtype, lora_rank);
                let gradients = || {
                    let hidden = m.forward_hidden(&b.ids, &b.positions, &b.mask, None).unwrap();
                    let logits = m.lm_head.forward(&hidden).unwrap();
                    let w = Tensor::from_vec(values(logits.elem_count(), 9), logits.shape(), &Device::Cpu).unwrap();
                    let store = (&logits * &w.to_dtype(logits.dtype()).unwrap()).unwrap().sum_all().unwrap();
                    let store = store.backward().unwrap();
                    // A variable's gradient is contiguous however its first part came (a
                    // transpose's gradient is kept as a view only for the node that reads it).
                    let got: Vec<Option<&Tensor>> = vars.iter().map(|(_, v)| store.get(v.as_tensor())).collect();
                    assert!(got.iter().flatten().all(|g| g.is_contiguous()), "a variable's gradient is a view");
                    got.into_iter().map(|g| g.map(values_of)).collect::<Vec<_>>()
                };
                let zero_buffers = gradients();
                let stored = with_first_gradients_stored(gradients);
                let reached = zero_buffers.iter().flatten().filter(|g| g.iter().any(|&x| x != 0.0)).count();
                assert!(reached >= 9, "{what}: only {reached} non-zero gradients");
                for (i, ((name, _), (a, s))) in vars.iter().zip(zero_buffers.iter().zip(&stored)).enumerate() {
                    assert!(a == s, "{what}: gradient {i} ({name}) differs");
                }
            }
        }
    }
}
