//! Helpers of the crate's unit tests.

use candle_core::{DType, Device, Tensor};

/// Every element's bits (widened to f64, exact for every float dtype), for equality tests that
/// must not forgive a rounding.
pub fn bits(t: &Tensor) -> Vec<u64> {
    let v = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// Rank r's gradients for the collectives' tests: f32 of several sizes (one of them empty), a
/// bf16 and an f64, of values of many magnitudes (so that the order of additions shows in the
/// bits).
pub fn rank_gradients(r: usize) -> Vec<Tensor> {
    let v = |n: usize, k: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * 7 + r * 13 + k) as f32).sin() * 10f32.powi((i % 9) as i32 - 4)).collect()
    };
    let d = &Device::Cpu;
    vec![
        Tensor::from_vec(v(23, 0), (23,), d).unwrap(),
        Tensor::from_vec(v(0, 1), (0,), d).unwrap(),
        Tensor::from_vec(v(12, 2), (3, 4), d).unwrap().to_dtype(DType::BF16).unwrap(),
        Tensor::from_vec(v(17, 3), (17,), d).unwrap().to_dtype(DType::F64).unwrap(),
        Tensor::from_vec(v(5, 4), (5,), d).unwrap(),
    ]
}
