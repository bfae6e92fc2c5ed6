//! Causal grouped-query attention on slices, forward and backward.
//!
//! Per batch row b and query head h (sharing key/value head h / rep, rep = H / KV):
//!   P = softmax(scale · Q Kᵀ + bias),  O = P V
//! and backward, from dO:
//!   dP = dO Vᵀ,  dV += Pᵀ dO,  dS = scale · P ⊙ (dP − rowsum(dP ⊙ P)),  dQ = dS K,  dK += dSᵀ Q.
//! One rayon task per (b, kv head): its `rep` query heads run one after another so that dK and
//! dV add up inside the task (no atomics, no per-head copies). The products are single-threaded
//! gemm calls inside the task. P is kept for the backward ([B, H, T, T]); the mask is the
//! additive bias [B, T, T] the candle path uses. The forward is the engine's fused attention
//! kernel run on these slices (one summation order for sampling and training).

use rayon::prelude::*;

use super::matmul::{matmul, Mat};
use crate::model::ops::{cached_attention, softmax, Real};

/// The attention's sizes: batch rows, tokens per row, query heads, key/value heads, head dim.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub kvh: usize,
    pub d: usize,
}

impl Dims {
    fn rep(&self) -> usize {
        self.h / self.kvh
    }

    /// v (projection layout [B·T, KV·D]) of head `kv` in row `b`: T × D, rows KV·D apart.
    fn v_head<'a, T>(&self, v: &'a [T], b: usize, kv: usize) -> Mat<'a, T> {
        Mat::strided(&v[b * self.t * self.kvh * self.d + kv * self.d..], self.t, self.d, self.kvh * self.d)
    }
}

/// From q [B, H, T, D] and k [B, KV, T, D] (rotated), v [B·T, KV·D] and bias [B, T, T]:
/// the probabilities p [B, H, T, T] and the output [B·T, H·D] (the o_proj input). The forward is
/// the sampler's decode kernel itself ([`cached_attention::forward_slices`]): the same dot
/// products, softmax and weighted sums, so the trainer's log-probs are the engine's bits.
pub fn forward<T: Real>(q: &[T], k: &[T], v: &[T], bias: &[T], dims: Dims, scale: f64) -> (Vec<T>, Vec<T>) {
    let Dims { b, t, h, kvh, d } = dims;
    cached_attention::forward_slices(q, k, v, bias, (b, h, kvh, t, d), scale)
}

/// The gradients (dq [B, H, T, D], dk [B, KV, T, D], dv [B·T, KV·D]) for the output gradient
/// `d_out` [B·T, H·D], from what [`forward`] was given and returned.
pub fn backward<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    p: &[T],
    d_out: &[T],
    dims: Dims,
    scale: f64,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let Dims { b, t, h, kvh, d } = dims;
    let rep = dims.rep();
    let mut dq = vec![T::of(0.0); b * h * t * d];
    let mut dk = vec![T::of(0.0); b * kvh * t * d];
    let mut dv = vec![T::of(0.0); b * kvh * t * d];
    dq.par_chunks_mut(rep * t * d).zip(dk.par_chunks_mut(t * d)).zip(dv.par_chunks_mut(t * d)).enumerate().for_each(
        |(task, ((dq, dk), dv))| {
            let (bi, kv) = (task / kvh, task % kvh);
            let k_head = Mat::of(&k[task * t * d..], t, d);
            let v_head = dims.v_head(v, bi, kv);
            let (mut dp, mut ds) = (vec![T::of(0.0); t * t], vec![T::of(0.0); t * t]);
            for r in 0..rep {
                let hi = kv * rep + r;
                let ph = &p[((bi * h + hi) * t) * t..][..t * t];
                let d_oh = Mat::strided(&d_out[bi * t * h * d + hi * d..], t, d, h * d);
                matmul(&mut dp, t, d_oh, v_head.t(), false, false);
                matmul(dv, d, Mat::of(ph, t, t).t(), d_oh, r > 0, false);
                for i in 0..t {
                    let row = i * t..(i + 1) * t;
                    softmax::backward_row(&mut ds[row.clone()], &ph[row.clone()], &dp[row], scale);
                }
                matmul(&mut dq[r * t * d..], d, Mat::of(&ds, t, t), k_head, false, false);
                let q_head = Mat::of(&q[(bi * h + hi) * t * d..], t, d);
                matmul(dk, d, Mat::of(&ds, t, t).t(), q_head, r > 0, false);
            }
        },
    );
    (dq, dk, heads_to_rows(&dv, kvh, t, d))
}

/// [B, X, T, D] → [B, T, X, D] (heads back into the rows of a projection's layout).
pub fn heads_to_rows<T: Real>(x: &[T], heads: usize, t: usize, d: usize) -> Vec<T> {
    let mut out = vec![T::of(0.0); x.len()];
    out.par_chunks_mut(heads * d).enumerate().for_each(|(bt, row)| {
        let (bi, ti) = (bt / t, bt % t);
        for (hi, dst) in row.chunks_mut(d).enumerate() {
            dst.copy_from_slice(&x[((bi * heads + hi) * t + ti) * d..][..d]);
        }
    });
    out
}
