//! Qwen3.5's gated attention output: `o_proj(attn ⊙ σ(gate))`, the gate a second half of each
//! head's q_proj output.
//!
//! `y = a · σ(g)` with `σ(g) = 1 / (1 + e^−g)`; backward `da = dy · σ(g)`,
//! `dg = dy · a · σ(g)(1 − σ(g))`. On host slices, one function for the engine's forward and the
//! trainer's (the same bits whatever the batch).

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::ops::Real;
use crate::Result;

/// Elements per rayon task.
const CHUNK: usize = 16_384;

fn sigmoid<T: Real>(x: T) -> T {
    T::of(1.0) / (T::of(1.0) + (T::of(0.0) - x).exp())
}

/// a ⊙ σ(g).
pub fn forward<T: Real>(a: &[T], g: &[T]) -> Vec<T> {
    let mut y = a.to_vec();
    y.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(y, g)| {
        for (y, &g) in y.iter_mut().zip(g) {
            *y *= sigmoid(g);
        }
    });
    y
}

/// (da, dg) for the output gradient `dy`.
pub fn backward<T: Real>(a: &[T], g: &[T], dy: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut da, mut dg) = (vec![T::of(0.0); a.len()], vec![T::of(0.0); a.len()]);
    da.par_chunks_mut(CHUNK).zip(dg.par_chunks_mut(CHUNK)).enumerate().for_each(|(c, (da, dg))| {
        let base = c * CHUNK;
        for (j, (da, dg)) in da.iter_mut().zip(dg.iter_mut()).enumerate() {
            let s = sigmoid(g[base + j]);
            *da = dy[base + j] * s;
            *dg = dy[base + j] * a[base + j] * s * (T::of(1.0) - s);
        }
    });
    (da, dg)
}

/// [`forward`] on tensors of one shape (f64 in f64, anything else in f32), on the host.
pub fn apply(a: &Tensor, g: &Tensor) -> Result<Tensor> {
    let host = |t: &Tensor, d: DType| -> Result<Tensor> { Ok(t.to_dtype(d)?.flatten_all()?.to_device(&Device::Cpu)?) };
    let y = match a.dtype() {
        DType::F64 => {
            let (x, y) = (host(a, DType::F64)?.to_vec1::<f64>()?, host(g, DType::F64)?.to_vec1::<f64>()?);
            Tensor::from_vec(forward(&x, &y), a.shape(), &Device::Cpu)?
        }
        _ => {
            let (x, y) = (host(a, DType::F32)?.to_vec1::<f32>()?, host(g, DType::F32)?.to_vec1::<f32>()?);
            Tensor::from_vec(forward(&x, &y), a.shape(), &Device::Cpu)?
        }
    };
    Ok(y.to_dtype(a.dtype())?.to_device(a.device())?)
}
