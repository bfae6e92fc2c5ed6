//! `mesh` dispatch of a batch: pad, split into contiguous data-parallel chunks, merge back.
//!
//! A batch of n datums is padded to a multiple of dp with copies of a real datum whose weights are
//! 0 (so they add nothing to any loss or gradient), then cut into dp contiguous chunks of equal
//! size; chunk i goes to every worker with dp rank i. On return, the outputs of the collection
//! ranks are concatenated in dp order and the padding (always at the end) is dropped, so the
//! caller gets exactly one output per real datum, in input order.

use crate::{Error, Result};

/// The chunks for each dp rank and the number of real datums.
#[derive(Debug)]
pub struct Split<T> {
    pub chunks: Vec<Vec<T>>,
    pub real: usize,
}

/// Pads `batch` with `padding(first datum)` to a multiple of `dp` and splits it.
pub fn pad_and_split<T: Clone>(batch: &[T], dp: usize, padding: impl Fn(&T) -> T) -> Result<Split<T>> {
    if batch.is_empty() {
        return Err(Error::input("empty batch"));
    }
    if dp == 0 {
        return Err(Error::input("dp size must be positive"));
    }
    let n = batch.len();
    let padded = n.div_ceil(dp) * dp;
    let mut all: Vec<T> = batch.to_vec();
    let pad = padding(&batch[0]);
    all.resize(padded, pad);
    let per = padded / dp;
    let mut chunks = Vec::with_capacity(dp);
    let mut it = all.into_iter();
    for _ in 0..dp {
        chunks.push(it.by_ref().take(per).collect());
    }
    Ok(Split { chunks, real: n })
}

/// Concatenates per-dp-rank outputs in rank order and drops the padding.
pub fn merge_outputs<O>(per_rank: Vec<Vec<O>>, real: usize) -> Vec<O> {
    let mut out: Vec<O> = per_rank.into_iter().flatten().collect();
    out.truncate(real);
    out
}

/// The largest batch-size multiple needed by all roles: lcm of their dp sizes.
pub fn lcm(sizes: &[usize]) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    sizes.iter().fold(1, |acc, &x| if x == 0 { acc } else { acc / gcd(acc, x) * x })
}
