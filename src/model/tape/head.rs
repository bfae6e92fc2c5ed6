//! The LM head, the target log-probs and (optionally) the entropy on the tape:
//! z = lm_head(h), log p(y) = z_y − lse(z), H = lse(z) − Σ p·z with p = softmax(z).
//!
//! Only the rows the loss reads (real tokens) go through the head. The logits [M, V] are kept for
//! the backward, which turns them in place into
//!   dz = g_lp · (onehot(y) − p) − g_H · p · (z − Σ p·z)
//! and then runs the projection's backward. (The candle path kept the same logits, plus their
//! gradient and a zero-filled buffer for it.)

use rayon::prelude::*;

use super::{linear, Grads};
use crate::model::linear::Linear;
use crate::model::ops::{logprob_lse, Real};
use crate::{Error, Result};

pub struct HeadRecord<T> {
    rows: Vec<u32>,
    targets: Vec<u32>,
    x: Vec<T>,
    u: Option<Vec<T>>,
    logits: Vec<T>,
    lse: Vec<T>,
    /// The entropies, when asked for.
    entropy: Option<Vec<T>>,
}

/// The log-probs, the entropies (when asked for) and the record.
pub type HeadOutput<T> = (Vec<T>, Option<Vec<T>>, HeadRecord<T>);

/// log p(targets[i]) (and with `entropy` the entropy) for hidden row rows[i] of `hidden`
/// [.., width], and the record.
pub fn forward<T: Real>(
    lm_head: &Linear,
    hidden: &[T],
    width: usize,
    rows: &[u32],
    targets: &[u32],
    entropy: bool,
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
    let (logits, u) = linear::forward(lm_head, &x, m)?;
    let mut out = vec![(T::of(0.0), T::of(0.0), T::of(0.0)); m];
    out.par_iter_mut().enumerate().with_min_len(16).for_each_init(
        || vec![T::of(0.0); if entropy { vocab } else { 0 }],
        |p, (i, o)| {
            let z = &logits[i * vocab..(i + 1) * vocab];
            let (lp, lse) = logprob_lse::row_forward(z, targets[i]);
            *o = (lp, lse, if entropy { row_entropy(z, lse, p) } else { T::of(0.0) });
        },
    );
    let logprobs = out.iter().map(|o| o.0).collect();
    let lse = out.iter().map(|o| o.1).collect();
    let entropy = entropy.then(|| out.iter().map(|o| o.2).collect::<Vec<T>>());
    let record =
        HeadRecord { rows: rows.to_vec(), targets: targets.to_vec(), x, u, logits, lse, entropy: entropy.clone() };
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
    let HeadRecord { rows, targets, x, u, mut logits, lse, entropy } = rec;
    let (m, vocab) = (rows.len(), lm_head.weight.dim(0)?);
    match (g_entropy, entropy) {
        (Some(g_h), Some(h)) => {
            logits.par_chunks_mut(vocab).enumerate().with_min_len(16).for_each_init(
                || vec![T::of(0.0); vocab],
                |t, (i, z)| {
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
        _ => logits.par_chunks_mut(vocab).enumerate().with_min_len(16).for_each(|(i, z)| {
            logprob_lse::row_backward(z, targets[i], lse[i], g[i], T::of(0.0));
        }),
    }
    let mut dx = None;
    linear::backward(lm_head, &x, u.as_deref(), &logits, m, &mut dx, grads)?;
    let dx = dx.expect("set by the backward");
    let mut d_hidden = vec![T::of(0.0); n_rows * width];
    for (src, &r) in dx.chunks(width).zip(&rows) {
        for (a, &b) in d_hidden[r as usize * width..(r as usize + 1) * width].iter_mut().zip(src) {
            *a += b;
        }
    }
    Ok(d_hidden)
}
