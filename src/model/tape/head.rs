//! The LM head, the target log-probs and (optionally) the entropy on the tape:
//! z = lm_head(h), log p(y) = z_y − lse(z), H = lse(z) − Σ p·z with p = softmax(z).
//!
//! Only the rows the loss reads (real tokens) go through the head, in chunks of rows whose
//! logits take at most [`CHUNK_LOGITS`] elements. The backward turns each chunk's logits in place
//! into
//!   dz = g_lp · (onehot(y) − p) − g_H · p · (z − Σ p·z)
//! and runs the projection's backward on it: dx of the chunk's rows, and dW accumulated chunk
//! after chunk. The logits [M, V] are kept for the backward, or, under activation checkpointing,
//! dropped after the forward and recomputed chunk by chunk: the same call on the same rows gives
//! the same bits, so both settings give the same gradients, while the recomputing one holds one
//! chunk of logits instead of all of them (at Qwen's 152k vocabulary, 0.6 GB at 1,024 rows).
//! A head with a bias or an adapter runs as one chunk.

use rayon::prelude::*;

use super::matmul::{matmul, product, Mat};
use super::{linear, Grads, Held};
use crate::model::linear::Linear;
use crate::model::ops::{logprob_lse, Real};
use crate::{Error, Result};

/// Elements of logits computed at once (128 MiB of f32).
pub const CHUNK_LOGITS: usize = 1 << 25;

pub struct HeadRecord<T> {
    rows: Vec<u32>,
    targets: Vec<u32>,
    x: Vec<T>,
    u: Option<Vec<T>>,
    /// Rows per chunk.
    chunk: usize,
    /// The logits [M, V], when kept (else recomputed in the backward).
    logits: Option<Vec<T>>,
    lse: Vec<T>,
    /// The entropies, when asked for.
    entropy: Option<Vec<T>>,
}

/// The log-probs, the entropies (when asked for) and the record.
pub type HeadOutput<T> = (Vec<T>, Option<Vec<T>>, HeadRecord<T>);

/// Rows per chunk for a head of `vocab` outputs, with at most `budget` logits a chunk.
fn chunk_rows(lm_head: &Linear, vocab: usize, m: usize, budget: usize) -> usize {
    match lm_head.bias.is_some() || lm_head.lora.is_some() {
        true => m.max(1),
        false => (budget / vocab.max(1)).clamp(1, m.max(1)),
    }
}

/// log p(targets[i]) (and with `entropy` the entropy) for hidden row rows[i] of `hidden`
/// [.., width], and the record (`keep_logits`: keep them for the backward rather than recompute
/// them there), in chunks of rows of at most `budget` logits ([`CHUNK_LOGITS`]).
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Real>(
    lm_head: &Linear,
    hidden: &[T],
    width: usize,
    rows: &[u32],
    targets: &[u32],
    entropy: bool,
    keep_logits: bool,
    budget: usize,
) -> Result<HeadOutput<T>> {
    let vocab = lm_head.weight.dim(0)?;
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::input(format!("target id {bad} is out of range for vocabulary {vocab}")));
    }
    let m = rows.len();
    let mut x = vec![T::of(0.0); m * width];
    for (dst, &r) in x.chunks_mut(width).zip(rows) {
        dst.copy_from_slice(&hidden[r as usize * width..(r as usize + 1) * width]);
    }
    let chunk = chunk_rows(lm_head, vocab, m, budget);
    let mut kept = Vec::with_capacity(if keep_logits { m * vocab } else { 0 });
    let mut u = None;
    let mut out = vec![(T::of(0.0), T::of(0.0), T::of(0.0)); m];
    for (c, out) in out.chunks_mut(chunk).enumerate() {
        let start = c * chunk;
        let n = out.len();
        let (logits, u_c) = linear::forward(lm_head, &x[start * width..(start + n) * width], n)?;
        u = u.or(u_c); // an adapter makes one chunk
        out.par_iter_mut().enumerate().with_min_len(16).for_each_init(
            || vec![T::of(0.0); if entropy { vocab } else { 0 }],
            |p, (i, o)| {
                let z = &logits[i * vocab..(i + 1) * vocab];
                let (lp, lse) = logprob_lse::row_forward(z, targets[start + i]);
                *o = (lp, lse, if entropy { row_entropy(z, lse, p) } else { T::of(0.0) });
            },
        );
        if keep_logits {
            kept.extend_from_slice(&logits);
        }
    }
    let logprobs = out.iter().map(|o| o.0).collect();
    let lse = out.iter().map(|o| o.1).collect();
    let entropy = entropy.then(|| out.iter().map(|o| o.2).collect::<Vec<T>>());
    let logits = keep_logits.then_some(kept);
    let record = HeadRecord {
        rows: rows.to_vec(),
        targets: targets.to_vec(),
        x,
        u,
        chunk,
        logits,
        lse,
        entropy: entropy.clone(),
    };
    Ok((logprobs, entropy, record))
}

/// H = lse − Σ p·z of one row, with `p` as scratch.
fn row_entropy<T: Real>(z: &[T], lse: T, p: &mut [T]) -> T {
    for (p, &x) in p.iter_mut().zip(z) {
        *p = x - lse;
    }
    T::exp_in_place(p);
    let mut ez = T::of(0.0);
    for (&p, &x) in p.iter().zip(z) {
        ez += p * x;
    }
    lse - ez
}

/// The gradient of the hidden states [n_rows, width] (zero at rows the head did not read) for
/// the log-probs' gradient `g` and the entropies' `g_entropy`, pushing the head's own gradients.
pub fn backward<T: Real>(
    lm_head: &Linear,
    rec: HeadRecord<T>,
    g: &[T],
    g_entropy: Option<&[T]>,
    n_rows: usize,
    width: usize,
    grads: &mut Grads<T>,
) -> Result<Vec<T>> {
    let HeadRecord { rows, targets, x, u, chunk, mut logits, lse, entropy } = rec;
    let (m, vocab) = (rows.len(), lm_head.weight.dim(0)?);
    let mut d_hidden = vec![T::of(0.0); n_rows * width];
    if m == 0 {
        return Ok(d_hidden);
    }
    let w = Held::<T>::new(&lm_head.weight)?;
    let w_m = Mat::of(w.slice()?, vocab, width);
    let train_w = lm_head.weight.is_variable();
    let mut dw: Option<Vec<T>> = None;
    for start in (0..m).step_by(chunk) {
        let n = chunk.min(m - start);
        let x_c = &x[start * width..(start + n) * width];
        let mut recomputed = None;
        let z: &mut [T] = match logits.as_mut() {
            Some(all) => &mut all[start * vocab..(start + n) * vocab],
            None => recomputed.insert(linear::forward(lm_head, x_c, n)?.0),
        };
        logits_to_gradient(z, vocab, start, &targets, &lse, g, g_entropy, entropy.as_deref());
        let dx = if n == m {
            // One chunk: the projection's own backward (a bias, an adapter).
            let mut dx = None;
            linear::backward(lm_head, &x, u.as_deref(), z, m, &mut dx, grads)?;
            dx.expect("set by the backward")
        } else {
            let dz = Mat::of(&*z, n, vocab);
            let ((), dx) = rayon::join(
                || match (train_w, dw.as_mut()) {
                    (false, _) => {}
                    (true, Some(acc)) => matmul(acc, width, dz.t(), Mat::of(x_c, n, width), true, true),
                    (true, None) => dw = Some(product(dz.t(), Mat::of(x_c, n, width), true)),
                },
                || product(dz, w_m, true),
            );
            dx
        };
        for (src, &r) in dx.chunks(width).zip(&rows[start..start + n]) {
            for (a, &b) in d_hidden[r as usize * width..(r as usize + 1) * width].iter_mut().zip(src) {
                *a += b;
            }
        }
    }
    if let Some(dw) = dw {
        grads.push(&lm_head.weight, dw);
    }
    Ok(d_hidden)
}

/// Turns the logits `z` of the rows `start..` into their gradient, in place (see the module
/// documentation).
#[allow(clippy::too_many_arguments)]
fn logits_to_gradient<T: Real>(
    z: &mut [T],
    vocab: usize,
    start: usize,
    targets: &[u32],
    lse: &[T],
    g: &[T],
    g_entropy: Option<&[T]>,
    entropy: Option<&[T]>,
) {
    match (g_entropy, entropy) {
        (Some(g_h), Some(h)) => {
            z.par_chunks_mut(vocab).enumerate().with_min_len(16).for_each_init(
                || vec![T::of(0.0); vocab],
                |t, (i, z)| {
                    let i = start + i;
                    // t = z − lse, z ← p, then dz = −p · (g_lp + g_H · (z − Σ p·z)), z − Σ p·z = t + H.
                    for (t, z) in t.iter_mut().zip(z.iter_mut()) {
                        *z -= lse[i];
                        *t = *z;
                    }
                    T::exp_in_place(z);
                    for (z, &t) in z.iter_mut().zip(t.iter()) {
                        *z = T::of(0.0) - *z * (g[i] + g_h[i] * (t + h[i]));
                    }
                    z[targets[i] as usize] += g[i];
                },
            );
        }
        _ => z.par_chunks_mut(vocab).enumerate().with_min_len(16).for_each(|(i, z)| {
            let i = start + i;
            logprob_lse::row_backward(z, targets[i], lse[i], g[i], T::of(0.0));
        }),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::*;

    /// In chunks of 3 rows, the head recomputing its logits gives the bits of the head keeping
    /// them (log-probs, entropies, dx, dW); and both agree with one chunk up to the order of dW's
    /// sum (in f64).
    #[test]
    fn recomputed_chunks_give_the_bits_of_kept_ones() {
        let (vocab, width, n_rows) = (11, 5, 9);
        let w: Vec<f64> = (0..vocab * width).map(|i| ((i * 7 % 13) as f64 - 6.0) * 0.11).collect();
        let weight = Var::from_tensor(&Tensor::from_vec(w, (vocab, width), &Device::Cpu).unwrap()).unwrap();
        let head = Linear::new(weight.as_tensor().clone(), None);
        let hidden: Vec<f64> = (0..n_rows * width).map(|i| ((i * 5 % 17) as f64 - 8.0) * 0.07).collect();
        let rows: Vec<u32> = vec![0, 2, 3, 4, 5, 7, 8];
        let targets: Vec<u32> = vec![1, 10, 0, 4, 4, 9, 2];
        let g: Vec<f64> = (0..rows.len()).map(|i| 0.3 - 0.1 * i as f64).collect();
        let g_h: Vec<f64> = (0..rows.len()).map(|i| 0.05 * i as f64).collect();
        let run = |keep: bool, budget: usize| {
            let (lp, h, rec) = forward(&head, &hidden, width, &rows, &targets, true, keep, budget).unwrap();
            assert_eq!(rec.chunk, (budget / vocab).clamp(1, rows.len()));
            let mut grads = Grads { list: vec![] };
            let dx = backward(&head, rec, &g, Some(&g_h), n_rows, width, &mut grads).unwrap();
            let dw = grads.list.pop().unwrap().1;
            assert!(grads.list.is_empty());
            (lp, h.unwrap(), dx, dw)
        };
        let kept = run(true, 3 * vocab);
        assert_eq!(run(false, 3 * vocab), kept, "recomputed chunks differ from kept ones");
        let whole = run(true, 1 << 20);
        assert_eq!(run(false, 1 << 20), whole);
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-12 * (1.0 + y.abs()));
        assert!(close(&kept.0, &whole.0) && close(&kept.1, &whole.1) && close(&kept.2, &whole.2));
        assert!(close(&kept.3, &whole.3), "chunked dW is not the one-chunk dW");
        assert!(kept.3.iter().any(|&x| x != 0.0) && kept.2.iter().any(|&x| x != 0.0), "nothing flowed back");
    }
}
