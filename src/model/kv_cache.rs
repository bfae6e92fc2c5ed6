//! An external key/value cache for incremental decoding.
//!
//! Holds, per layer, the rotated keys and the values of every position seen so far
//! ([B, kv_heads, S, head_dim]), plus the host-side key mask (1 = real token, 0 = padding) that
//! the attention bias of later steps needs. The cache belongs to the caller, so a sampler can
//! keep one per batch, drop it, or rebuild it at will; the model only appends to it.
//!
//! Appending does not copy the whole cache: each layer writes into a buffer with spare columns
//! (capacity doubling, so the copies are amortised O(1) per token) and the cached keys/values
//! are views of its first S columns. A write only ever lands past the end of every view that
//! exists, so views stay valid; a clone or any row surgery starts without spare buffers, so two
//! caches never write into the same one.

use candle_core::{Tensor, D};

use crate::Result;

/// Columns a fresh buffer holds at least.
const MIN_CAPACITY: usize = 64;

#[derive(Debug)]
pub struct KvCache {
    /// Per layer, the cached keys and values (views of `buffers` when those exist).
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per layer, [B, kv_heads, capacity, head_dim] buffers whose first S columns are `layers`.
    buffers: Vec<Option<(Tensor, Tensor)>>,
    /// [B][S] key mask of the cached positions.
    key_mask: Vec<Vec<u8>>,
}

impl Clone for KvCache {
    /// Shares the cached tensors (immutable views) but not the spare buffers.
    fn clone(&self) -> Self {
        KvCache { layers: self.layers.clone(), buffers: vec![None; self.layers.len()], key_mask: self.key_mask.clone() }
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self::from_parts(vec![None; num_layers], vec![])
    }

    fn from_parts(layers: Vec<Option<(Tensor, Tensor)>>, key_mask: Vec<Vec<u8>>) -> Self {
        KvCache { buffers: vec![None; layers.len()], layers, key_mask }
    }

    /// Number of cached positions.
    pub fn seq_len(&self) -> usize {
        self.key_mask.first().map_or(0, |r| r.len())
    }

    pub fn key_mask(&self) -> &[Vec<u8>] {
        &self.key_mask
    }

    pub(crate) fn extend_mask(&mut self, new: &[Vec<u8>]) {
        if self.key_mask.is_empty() {
            self.key_mask = new.to_vec();
        } else {
            for (row, add) in self.key_mask.iter_mut().zip(new) {
                row.extend_from_slice(add);
            }
        }
    }

    /// Appends this step's keys and values for `layer` and returns the full cached ones.
    pub(crate) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let len = self.layers[layer].as_ref().map_or(0, |(pk, _)| pk.dim(D::Minus2).unwrap_or(0));
        let new_len = len + k.dim(D::Minus2)?;
        let fits = self.buffers[layer].as_ref().is_some_and(|(bk, _)| {
            bk.dim(D::Minus2).is_ok_and(|cap| cap >= new_len) && bk.dim(0).ok() == k.dim(0).ok()
        });
        if !fits {
            // A new buffer with room to grow; the cached columns are copied once.
            let (b, kvh, _, d) = k.dims4()?;
            let cap = (2 * new_len).max(MIN_CAPACITY);
            let bk = Tensor::zeros((b, kvh, cap, d), k.dtype(), k.device())?;
            let bv = Tensor::zeros((b, kvh, cap, d), v.dtype(), v.device())?;
            if let Some((pk, pv)) = &self.layers[layer] {
                bk.slice_set(&pk.contiguous()?, 2, 0)?;
                bv.slice_set(&pv.contiguous()?, 2, 0)?;
            }
            self.buffers[layer] = Some((bk, bv));
        }
        let (bk, bv) = self.buffers[layer].as_ref().expect("buffer ensured above");
        bk.slice_set(&k, 2, len)?;
        bv.slice_set(&v, 2, len)?;
        let out = (bk.narrow(2, 0, new_len)?, bv.narrow(2, 0, new_len)?);
        self.layers[layer] = Some(out.clone());
        Ok(out)
    }
}

/// Row surgery for continuous batching: rows leave the batch, join it, or fan out from one
/// prefilled prompt. Every row's newest position stays in the last column (left padding), so one
/// batched decode step appends one column for all rows.
impl KvCache {
    /// A cache of `rows` rows with nothing cached yet (a prompt of one token has no prefix).
    pub fn with_empty_rows(num_layers: usize, rows: usize) -> Self {
        Self::from_parts(vec![None; num_layers], vec![vec![]; rows])
    }

    /// Number of rows (0 before the first forward).
    pub fn num_rows(&self) -> usize {
        self.key_mask.len()
    }

    /// The cache of `rows` only, in that order; a row may repeat (one prompt, n samples).
    /// Leading columns that are padding in every kept row are dropped.
    pub fn select_rows(&self, rows: &[usize]) -> Result<KvCache> {
        if rows.is_empty() {
            return Ok(KvCache::new(self.layers.len()));
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                None => None,
                Some((k, v)) => {
                    let idx =
                        Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), k.device())?;
                    Some((k.contiguous()?.index_select(&idx, 0)?, v.contiguous()?.index_select(&idx, 0)?))
                }
            });
        }
        let key_mask = rows.iter().map(|&r| self.key_mask[r].clone()).collect();
        let mut out = Self::from_parts(layers, key_mask);
        out.trim_left()?;
        Ok(out)
    }

    /// Appends the rows of `other` after ours, left-padding whichever side is shorter.
    pub fn append_rows(&mut self, other: &KvCache) -> Result<()> {
        if other.num_rows() == 0 {
            return Ok(());
        }
        if self.num_rows() == 0 {
            *self = other.clone();
            return Ok(());
        }
        let (s, o) = (self.seq_len(), other.seq_len());
        let len = s.max(o);
        let (ns, no) = (self.num_rows(), other.num_rows());
        // Left-pads `t` [rows, kvh, n, d] to `len` columns; a missing layer (nothing cached)
        // becomes zeros shaped like the other side's.
        let pad = |t: Option<&Tensor>, like: &Tensor, rows: usize, n: usize| -> Result<Tensor> {
            Ok(match t {
                Some(t) if n < len => t.pad_with_zeros(2, len - n, 0)?,
                Some(t) => t.clone(),
                None => {
                    let (_, kvh, _, d) = like.dims4()?;
                    Tensor::zeros((rows, kvh, len, d), like.dtype(), like.device())?
                }
            })
        };
        for l in 0..self.layers.len() {
            let merged = match (&self.layers[l], &other.layers[l]) {
                (None, None) => None,
                (a, b) => {
                    let like = a.as_ref().or(b.as_ref()).expect("one side is cached");
                    let k = Tensor::cat(
                        &[
                            pad(a.as_ref().map(|x| &x.0), &like.0, ns, s)?,
                            pad(b.as_ref().map(|x| &x.0), &like.0, no, o)?,
                        ],
                        0,
                    )?;
                    let v = Tensor::cat(
                        &[
                            pad(a.as_ref().map(|x| &x.1), &like.1, ns, s)?,
                            pad(b.as_ref().map(|x| &x.1), &like.1, no, o)?,
                        ],
                        0,
                    )?;
                    Some((k, v))
                }
            };
            self.layers[l] = merged;
            self.buffers[l] = None;
        }
        for row in self.key_mask.iter_mut() {
            row.splice(0..0, std::iter::repeat_n(0, len - s));
        }
        for row in &other.key_mask {
            self.key_mask.push([vec![0u8; len - o], row.clone()].concat());
        }
        Ok(())
    }

    /// Drops the leading columns that are padding in every row (they were the prefix of rows
    /// that have left the batch).
    pub fn trim_left(&mut self) -> Result<()> {
        let s = self.seq_len();
        let drop = (0..s).take_while(|&j| self.key_mask.iter().all(|r| r[j] == 0)).count();
        if drop == 0 {
            return Ok(());
        }
        self.buffers.iter_mut().for_each(|b| *b = None);
        for slot in self.layers.iter_mut() {
            *slot = match slot.take() {
                Some((k, v)) if drop < s => Some((k.narrow(2, drop, s - drop)?, v.narrow(2, drop, s - drop)?)),
                _ => None,
            };
        }
        for r in self.key_mask.iter_mut() {
            r.drain(..drop);
        }
        Ok(())
    }
}
