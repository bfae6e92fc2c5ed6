//! The LM head, the target log-probs and (optionally) the entropy on the tape:
//! z = lm_head(h) · s, log p(y) = z_y − lse(z), H = lse(z) − Σ p·z with p = softmax(z), where
//! s = 1 / temperature (1: the model's own distribution; a sampler at temperature T draws from
//! softmax(lm_head(h) / T), and its log-probs are these at s = 1/T, the logits scaled as the
//! sampler scales them: each rounded product z · s in the logits' dtype).
//!
//! Only the rows the loss reads (real tokens) go through the head, in chunks of rows whose
//! logits take at most [`CHUNK_LOGITS`] elements. The backward turns the logits in place into
//!   dz = g_lp · (onehot(y) − p) − g_H · p · (z − Σ p·z)
//! times s, and runs the projection's backward on it, in blocks of vocabulary rows
//! ([`VOCAB_BLOCK`]), each over the row chunks: dW of the block accumulated chunk after chunk, dx of each chunk's rows
//! accumulated block after block. A block of dW is then final before the next is begun, and can
//! be handed on at once (`sharding = "full"` sums it to its owner: `worker/head_stream.rs`).
//! The logits [M, V] are kept for the backward, or, under activation checkpointing, dropped after
//! the forward and recomputed block by block: the forward's product gives every logit the same
//! bits whatever the columns computed with it, so both settings give the same gradients, while
//! the recomputing one holds one chunk's block of logits instead of all of them (at Qwen's 152k
//! vocabulary, 0.6 GB at 1,024 rows). A head with a bias or an adapter runs as one chunk and
//! one block.

use std::ops::Range;

use rayon::prelude::*;

use super::matmul::{matmul, Mat};
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
    /// s = 1 / temperature, as the logits' dtype.
    scale: T,
}

/// How [`forward`] runs.
#[derive(Clone, Copy, Debug)]
pub struct HeadForward {
    /// The entropies too.
    pub entropy: bool,
    /// Keep the logits for the backward rather than recompute them there.
    pub keep_logits: bool,
    /// At most this many logits a chunk of rows ([`CHUNK_LOGITS`]).
    pub budget: usize,
    /// s = 1 / temperature: the logits are scaled by it (1: as they are).
    pub inv_temperature: f64,
}

/// z ← z · s, unless s is 1.
fn scale_logits<T: Real>(z: &mut [T], s: T) {
    if s != T::of(1.0) {
        z.par_chunks_mut(1 << 14).for_each(|z| z.iter_mut().for_each(|v| *v *= s));
    }
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
/// [.., width], and the record, as `options` say.
pub fn forward<T: Real>(
    lm_head: &Linear,
    hidden: &[T],
    width: usize,
    rows: &[u32],
    targets: &[u32],
    options: HeadForward,
) -> Result<HeadOutput<T>> {
    let HeadForward { entropy, keep_logits, budget, inv_temperature } = options;
    let scale = T::of(inv_temperature);
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
        let (mut logits, u_c) = linear::forward(lm_head, &x[start * width..(start + n) * width], n)?;
        scale_logits(&mut logits, scale);
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
        scale,
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

/// Rows of the head weight per block of its backward (56 MiB of f32 gradient at a width of
/// 896): the unit in which the weight's gradient is made, and can be handed on.
pub const VOCAB_BLOCK: usize = 1 << 14;

/// The blocks of vocabulary rows the backward walks: ⌈vocab / block⌉ blocks of equal size (to a
/// row), the same for every rank and every sharding.
pub fn vocab_blocks(vocab: usize, block: usize) -> Vec<Range<usize>> {
    let count = vocab.div_ceil(block.max(1)).max(1);
    let size = vocab.div_ceil(count).max(1);
    (0..count).map(|b| b * size..((b + 1) * size).min(vocab)).filter(|r| !r.is_empty()).collect()
}

/// Where the backward puts the head weight's gradient.
pub enum WeightGradient<'a, T> {
    /// Whole, pushed with the others.
    Whole,
    /// Each block of rows handed over as soon as it is final: `(first row, rows [n, width])`.
    Blocks(&'a mut dyn FnMut(usize, Vec<T>) -> Result<()>),
}

/// The gradient of the hidden states [n_rows, width] (zero at rows the head did not read) for
/// the log-probs' gradient `g` and the entropies' `g_entropy`, the head weight's gradient put
/// where `dw` says (its other gradients pushed).
///
/// A head without a bias or an adapter runs in blocks of vocabulary rows ([`vocab_blocks`] of
/// `block`), each over the row chunks:
///   for each block v: for each chunk c: z[c, v] (kept or recomputed) → dz[c, v];
///   dW[v] += dz[c, v]ᵀ · x[c]; dx[c] += dz[c, v] · W[v]
/// so that a block of dW is final once its chunks are done and need not wait for the others.
/// Each element of z and dz reads only its own logit (the forward's product is one fixed-order
/// chain per output, whatever the columns: `matmul_wt`), so recomputed blocks are the bits of
/// kept ones; dW and dx are the same blocked products whatever `dw` says.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Real>(
    lm_head: &Linear,
    rec: HeadRecord<T>,
    g: &[T],
    g_entropy: Option<&[T]>,
    n_rows: usize,
    width: usize,
    block: usize,
    grads: &mut Grads<T>,
    dw: WeightGradient<'_, T>,
) -> Result<Vec<T>> {
    let HeadRecord { rows, targets, x, u, chunk, mut logits, lse, entropy, scale } = rec;
    let (m, vocab) = (rows.len(), lm_head.weight.dim(0)?);
    let mut d_hidden = vec![T::of(0.0); n_rows * width];
    let train_w = lm_head.weight.is_variable();
    if m == 0 {
        return Ok(d_hidden);
    }
    let grad = Grad { targets: &targets, lse: &lse, g, g_entropy, entropy: entropy.as_deref() };
    let dx = if lm_head.bias.is_some() || lm_head.lora.is_some() {
        if let WeightGradient::Blocks(_) = dw {
            return Err(Error::Other("the head's gradient in blocks needs a head without a bias or an adapter".into()));
        }
        // One chunk (see `chunk_rows`): the projection's own backward.
        let mut z = match logits {
            Some(all) => all,
            None => {
                let mut z = linear::forward(lm_head, &x, m)?.0;
                scale_logits(&mut z, scale);
                z
            }
        };
        block_to_gradient(&mut z, vocab, 0..vocab, 0, m, &grad);
        scale_logits(&mut z, scale);
        let mut dx = None;
        linear::backward(lm_head, &x, u.as_deref(), &z, m, &mut dx, grads)?;
        dx.expect("set by the backward")
    } else {
        let w = Held::<T>::new(&lm_head.weight)?;
        let w = w.slice()?;
        let mut dx = vec![T::of(0.0); m * width];
        let mut whole = match (&dw, train_w) {
            (WeightGradient::Whole, true) => Some(vec![T::of(0.0); vocab * width]),
            _ => None,
        };
        let mut dw = dw;
        for (b, cols) in vocab_blocks(vocab, block).into_iter().enumerate() {
            let nb = cols.len();
            let w_v = &w[cols.start * width..cols.end * width];
            let mut part = match (&whole, train_w) {
                (None, true) => vec![T::of(0.0); nb * width],
                _ => vec![],
            };
            for (c, start) in (0..m).step_by(chunk.max(1)).enumerate() {
                let n = chunk.min(m - start);
                let x_c = &x[start * width..(start + n) * width];
                let mut recomputed = vec![];
                let (z, ld): (&mut [T], usize) = match logits.as_mut() {
                    Some(all) => (&mut all[start * vocab + cols.start..(start + n - 1) * vocab + cols.end], vocab),
                    None => {
                        recomputed = linear::xwt(x_c, w_v, n, nb, width);
                        scale_logits(&mut recomputed, scale);
                        (&mut recomputed, nb)
                    }
                };
                block_to_gradient(z, ld, cols.clone(), start, n, &grad);
                if scale != T::of(1.0) {
                    // dz with respect to the unscaled logits: times s (row i's part only).
                    for row in z.chunks_mut(ld).take(n) {
                        row[..nb].iter_mut().for_each(|v| *v *= scale);
                    }
                }
                let dz = Mat::strided(&*z, n, nb, ld);
                let dw_dst: Option<&mut [T]> = match whole.as_mut() {
                    Some(all) => Some(&mut all[cols.start * width..cols.end * width]),
                    None if train_w => Some(&mut part),
                    None => None,
                };
                rayon::join(
                    || {
                        if let Some(dst) = dw_dst {
                            matmul(dst, width, dz.t(), Mat::of(x_c, n, width), c > 0, true);
                        }
                    },
                    || {
                        let dx_c = &mut dx[start * width..(start + n) * width];
                        matmul(dx_c, width, dz, Mat::of(w_v, nb, width), b > 0, true);
                    },
                );
            }
            if let (WeightGradient::Blocks(hand), true) = (&mut dw, train_w) {
                hand(cols.start, part)?;
            }
        }
        if let Some(all) = whole {
            grads.push(&lm_head.weight, all);
        }
        dx
    };
    for (src, &r) in dx.chunks(width).zip(&rows) {
        for (a, &b) in d_hidden[r as usize * width..(r as usize + 1) * width].iter_mut().zip(src) {
            *a += b;
        }
    }
    Ok(d_hidden)
}

/// What turns logits into their gradient (see the module documentation).
struct Grad<'a, T> {
    targets: &'a [u32],
    lse: &'a [T],
    g: &'a [T],
    g_entropy: Option<&'a [T]>,
    entropy: Option<&'a [T]>,
}

/// Turns the logits of the columns `cols` of rows `start..start + n` into their gradient, in
/// place: row i's part is `z[i · ld..i · ld + cols.len()]`.
fn block_to_gradient<T: Real>(z: &mut [T], ld: usize, cols: Range<usize>, start: usize, n: usize, grad: &Grad<'_, T>) {
    let nb = cols.len();
    let target = |i: usize| {
        let t = grad.targets[i] as usize;
        cols.contains(&t).then(|| t - cols.start)
    };
    let rows = z.par_chunks_mut(ld).take(n).enumerate().with_min_len(16);
    match (grad.g_entropy, grad.entropy) {
        (Some(g_h), Some(h)) => rows.for_each_init(
            || vec![T::of(0.0); nb],
            |t, (i, z)| {
                let (i, z) = (start + i, &mut z[..nb]);
                let g = grad.g[i];
                // t = z − lse, z ← p, then dz = −p · (g_lp + g_H · (z − Σ p·z)), z − Σ p·z = t + H.
                for (t, z) in t.iter_mut().zip(z.iter_mut()) {
                    *z -= grad.lse[i];
                    *t = *z;
                }
                T::exp_in_place(z);
                for (z, &t) in z.iter_mut().zip(t.iter()) {
                    *z = T::of(0.0) - *z * (g + g_h[i] * (t + h[i]));
                }
                if let Some(y) = target(i) {
                    z[y] += g;
                }
            },
        ),
        _ => rows.for_each(|(i, z)| {
            let i = start + i;
            logprob_lse::part_backward(&mut z[..nb], target(i), grad.lse[i], grad.g[i], T::of(0.0));
        }),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::*;

    /// What one head backward gave: log-probs, entropies, dx, and dW with the first row of each
    /// block it was handed over in (none when whole).
    type Run<T> = (Vec<T>, Vec<T>, Vec<T>, Vec<T>, Vec<usize>);

    /// The head of a vocabulary of 11 and a width of 5 over 7 of 9 rows, run with `budget`
    /// logits a chunk and vocabulary blocks of `block` rows; dW whole or in blocks (`blocks`).
    fn run<T: Real + candle_core::WithDType>(keep: bool, budget: usize, block: usize, blocks: bool) -> Run<T> {
        run_at(keep, budget, block, blocks, 1.0)
    }

    /// [`run`] at 1 / temperature `inv_t`.
    fn run_at<T: Real + candle_core::WithDType>(
        keep: bool,
        budget: usize,
        block: usize,
        blocks: bool,
        inv_t: f64,
    ) -> Run<T> {
        let (vocab, width, n_rows) = (11, 5, 9);
        let w: Vec<T> = (0..vocab * width).map(|i| T::of(((i * 7 % 13) as f64 - 6.0) * 0.11)).collect();
        let weight = Var::from_tensor(&Tensor::from_vec(w, (vocab, width), &Device::Cpu).unwrap()).unwrap();
        let head = Linear::new(weight.as_tensor().clone(), None);
        let hidden: Vec<T> = (0..n_rows * width).map(|i| T::of(((i * 5 % 17) as f64 - 8.0) * 0.07)).collect();
        let rows: Vec<u32> = vec![0, 2, 3, 4, 5, 7, 8];
        let targets: Vec<u32> = vec![1, 10, 0, 4, 4, 9, 2];
        let g: Vec<T> = (0..rows.len()).map(|i| T::of(0.3 - 0.1 * i as f64)).collect();
        let g_h: Vec<T> = (0..rows.len()).map(|i| T::of(0.05 * i as f64)).collect();
        let options = HeadForward { entropy: true, keep_logits: keep, budget, inv_temperature: inv_t };
        let (lp, h, rec) = forward(&head, &hidden, width, &rows, &targets, options).unwrap();
        assert_eq!(rec.chunk, (budget / vocab).clamp(1, rows.len()));
        let mut grads = Grads { list: vec![] };
        let (mut dw, mut starts) = (vec![], vec![]);
        let mut hand = |start: usize, part: Vec<T>| {
            assert_eq!(start * width, dw.len(), "blocks out of order");
            starts.push(start);
            dw.extend(part);
            Ok(())
        };
        let to = if blocks { WeightGradient::Blocks(&mut hand) } else { WeightGradient::Whole };
        let dx = backward(&head, rec, &g, Some(&g_h), n_rows, width, block, &mut grads, to).unwrap();
        if !blocks {
            dw = grads.list.pop().unwrap().1;
        }
        assert!(grads.list.is_empty());
        (lp, h.unwrap(), dx, dw, starts)
    }

    /// In chunks of 3 rows and blocks of 4 vocabulary rows, the head recomputing its logits
    /// gives the bits of the head keeping them (log-probs, entropies, dx, dW), in f32 (the
    /// forward's fixed-order product) and f64; dW handed over block by block is the whole one's
    /// bits; and one chunk and one block agree with them up to the order of the sums (f64).
    #[test]
    fn blocks_and_recomputed_chunks_give_the_bits_of_kept_ones() {
        let (chunks, block) = (3 * 11, 4);
        let kept = run::<f32>(true, chunks, block, false);
        assert_eq!(run::<f32>(false, chunks, block, false), kept, "recomputed blocks differ from kept ones");
        let kept = run::<f64>(true, chunks, block, false);
        assert_eq!(run::<f64>(false, chunks, block, false), kept, "recomputed blocks differ from kept ones (f64)");
        let handed = run::<f64>(false, chunks, block, true);
        assert_eq!(handed.4, vec![0, 4, 8]);
        assert_eq!((&handed.0, &handed.1, &handed.2, &handed.3), (&kept.0, &kept.1, &kept.2, &kept.3));
        let whole = run::<f64>(true, 1 << 20, 1 << 20, false);
        assert_eq!(run::<f64>(false, 1 << 20, 1 << 20, false), whole);
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-12 * (1.0 + y.abs()));
        assert!(close(&kept.0, &whole.0) && close(&kept.1, &whole.1) && close(&kept.2, &whole.2));
        assert!(close(&kept.3, &whole.3), "blocked dW is not the one-block dW");
        assert!(kept.3.iter().any(|&x| x != 0.0) && kept.2.iter().any(|&x| x != 0.0), "nothing flowed back");
    }

    /// At a temperature the head's log-probs, entropies, dx and dW are those of candle's graph
    /// of log_softmax(x · Wᵀ · s) (f64, 1e-12), s = 1 / temperature; recomputed blocks keep the
    /// kept ones' bits (f32); and they differ from the untempered head's.
    #[test]
    fn a_temperature_scales_the_logits_in_value_and_gradient() {
        let inv_t = 1.0 / 0.7;
        let (chunks, block) = (3 * 11, 4);
        let kept = run_at::<f32>(true, chunks, block, false, inv_t);
        assert_eq!(run_at::<f32>(false, chunks, block, false, inv_t), kept, "recomputed tempered blocks differ");
        let got = run_at::<f64>(false, chunks, block, true, inv_t);
        assert_ne!(got.0, run::<f64>(false, chunks, block, true).0, "the temperature changed nothing");

        // The reference: the same head on candle's graph (`run`'s inputs).
        let (vocab, width, n_rows) = (11, 5, 9);
        let w: Vec<f64> = (0..vocab * width).map(|i| ((i * 7 % 13) as f64 - 6.0) * 0.11).collect();
        let hidden: Vec<f64> = (0..n_rows * width).map(|i| ((i * 5 % 17) as f64 - 8.0) * 0.07).collect();
        let rows: Vec<u32> = vec![0, 2, 3, 4, 5, 7, 8];
        let targets: Vec<u32> = vec![1, 10, 0, 4, 4, 9, 2];
        let g: Vec<f64> = (0..rows.len()).map(|i| 0.3 - 0.1 * i as f64).collect();
        let g_h: Vec<f64> = (0..rows.len()).map(|i| 0.05 * i as f64).collect();
        let dev = Device::Cpu;
        let wv = Var::from_tensor(&Tensor::from_vec(w, (vocab, width), &dev).unwrap()).unwrap();
        let hv = Var::from_tensor(&Tensor::from_vec(hidden, (n_rows, width), &dev).unwrap()).unwrap();
        let idx = Tensor::from_vec(rows.clone(), rows.len(), &dev).unwrap();
        let x = hv.as_tensor().index_select(&idx, 0).unwrap();
        let z = (x.matmul(&wv.as_tensor().t().unwrap()).unwrap() * inv_t).unwrap();
        let max = z.max_keepdim(1).unwrap().detach();
        let shifted = z.broadcast_sub(&max).unwrap();
        let logp = shifted.broadcast_sub(&shifted.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap()).unwrap();
        let tgt = Tensor::from_vec(targets, (rows.len(), 1), &dev).unwrap();
        let lp = logp.gather(&tgt, 1).unwrap().squeeze(1).unwrap();
        let h = (logp.exp().unwrap() * &logp).unwrap().sum(1).unwrap().neg().unwrap();
        let loss = ((&lp * Tensor::new(g, &dev).unwrap()).unwrap().sum_all().unwrap()
            + (&h * Tensor::new(g_h, &dev).unwrap()).unwrap().sum_all().unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let close = |what: &str, a: &[f64], b: &[f64]| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{what}: {x} against the graph's {y}");
            }
        };
        close("log-probs", &got.0, &flat(&lp));
        close("entropies", &got.1, &flat(&h));
        close("dx", &got.2, &flat(grads.get(hv.as_tensor()).unwrap()));
        close("dW", &got.3, &flat(grads.get(wv.as_tensor()).unwrap()));
    }

    #[test]
    fn vocabulary_blocks_are_even_and_cover_it() {
        assert_eq!(vocab_blocks(11, 4), vec![0..4, 4..8, 8..11]);
        assert_eq!(vocab_blocks(151_936, VOCAB_BLOCK).len(), 10);
        assert!(vocab_blocks(151_936, VOCAB_BLOCK).iter().all(|r| r.len() == 15_194 || r.len() == 15_190));
        assert_eq!(vocab_blocks(5, 1 << 14), vec![0..5]);
    }
}
