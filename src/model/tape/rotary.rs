//! RoPE on the first `rd` channels of each head (a partial rotary factor), on slices.
//!
//! The rotated part goes through the fused kernels of [`crate::model::ops::rope`] as a head of
//! `rd` channels (what the candle path does with a narrowed view, so both give the same bits);
//! the other `d − rd` channels pass through, moved to the [B, H, T, D] layout (backward: back to
//! [B, T, H, D]). With rd = d it is the kernel itself.

use rayon::prelude::*;

use crate::model::ops::{rope, Real};

/// x [B, T, H, D] → rope(x) [B, H, T, D], rotating channels [0, rd) of each head.
pub fn forward<T: Real>(x: &[T], cos: &[T], sin: &[T], (t, h, d): (usize, usize, usize), rd: usize) -> Vec<T> {
    if rd == d {
        return rope::forward_kernel(x, cos, sin, (t, h, d));
    }
    let heads = x.len() / d;
    let mut part = vec![T::of(0.0); heads * rd];
    for (dst, src) in part.chunks_mut(rd).zip(x.chunks(d)) {
        dst.copy_from_slice(&src[..rd]);
    }
    let rot = rope::forward_kernel(&part, cos, sin, (t, h, rd));
    let mut out = vec![T::of(0.0); x.len()];
    // out[b, hi, ti] = [rot[b, hi, ti] | x[b, ti, hi, rd..]]
    out.par_chunks_mut(t * d).enumerate().for_each(|(bh, chunk)| {
        let (bi, hi) = (bh / h, bh % h);
        for (ti, dst) in chunk.chunks_mut(d).enumerate() {
            dst[..rd].copy_from_slice(&rot[(bh * t + ti) * rd..][..rd]);
            dst[rd..].copy_from_slice(&x[((bi * t + ti) * h + hi) * d + rd..][..d - rd]);
        }
    });
    out
}

/// The backward of [`forward`]: g [B, H, T, D] → dx [B, T, H, D].
pub fn backward<T: Real>(g: &[T], cos: &[T], sin: &[T], (t, h, d): (usize, usize, usize), rd: usize) -> Vec<T> {
    if rd == d {
        return rope::backward_kernel(g, cos, sin, (t, h, d));
    }
    let heads = g.len() / d;
    let mut part = vec![T::of(0.0); heads * rd];
    for (dst, src) in part.chunks_mut(rd).zip(g.chunks(d)) {
        dst.copy_from_slice(&src[..rd]);
    }
    let rot = rope::backward_kernel(&part, cos, sin, (t, h, rd));
    let mut dx = vec![T::of(0.0); g.len()];
    // dx[b, ti, hi] = [rot[b, ti, hi] | g[b, hi, ti, rd..]]
    dx.par_chunks_mut(h * d).enumerate().for_each(|(bt, row)| {
        let (bi, ti) = (bt / t, bt % t);
        for (hi, dst) in row.chunks_mut(d).enumerate() {
            dst[..rd].copy_from_slice(&rot[(bt * h + hi) * rd..][..rd]);
            dst[rd..].copy_from_slice(&g[((bi * h + hi) * t + ti) * d + rd..][..d - rd]);
        }
    });
    dx
}
