//! Helpers of the crate's unit tests.

use candle_core::{DType, Tensor};

/// Every element's bits (widened to f64, exact for every float dtype), for equality tests that
/// must not forgive a rounding.
pub fn bits(t: &Tensor) -> Vec<u64> {
    let v = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}
