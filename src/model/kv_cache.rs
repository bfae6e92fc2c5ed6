//! An external key/value cache for incremental decoding.
//!
//! Holds, per layer, the rotated keys and the values of every position seen so far
//! ([B, kv_heads, S, head_dim]), plus the host-side key mask (1 = real token, 0 = padding) that
//! the attention bias of later steps needs. The cache belongs to the caller, so a sampler can
//! keep one per batch, drop it, or rebuild it at will; the model only appends to it.

use candle_core::{Tensor, D};

use crate::Result;

#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// [B][S] key mask of the cached positions.
    key_mask: Vec<Vec<u8>>,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        KvCache { layers: vec![None; num_layers], key_mask: vec![] }
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
        let (k, v) = match &self.layers[layer] {
            None => (k.clone(), v.clone()),
            Some((pk, pv)) => (Tensor::cat(&[pk, k], D::Minus2)?, Tensor::cat(&[pv, v], D::Minus2)?),
        };
        self.layers[layer] = Some((k.clone(), v.clone()));
        Ok((k, v))
    }
}

/// Row surgery for continuous batching: rows leave the batch, join it, or fan out from one
/// prefilled prompt. Every row's newest position stays in the last column (left padding), so one
/// batched decode step appends one column for all rows.
impl KvCache {
    /// A cache of `rows` rows with nothing cached yet (a prompt of one token has no prefix).
    pub fn with_empty_rows(num_layers: usize, rows: usize) -> Self {
        KvCache { layers: vec![None; num_layers], key_mask: vec![vec![]; rows] }
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
                    let idx = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), k.device())?;
                    Some((k.index_select(&idx, 0)?, v.index_select(&idx, 0)?))
                }
            });
        }
        let key_mask = rows.iter().map(|&r| self.key_mask[r].clone()).collect();
        let mut out = KvCache { layers, key_mask };
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
                    let k = Tensor::cat(&[pad(a.as_ref().map(|x| &x.0), &like.0, ns, s)?, pad(b.as_ref().map(|x| &x.0), &like.0, no, o)?], 0)?;
                    let v = Tensor::cat(&[pad(a.as_ref().map(|x| &x.1), &like.1, ns, s)?, pad(b.as_ref().map(|x| &x.1), &like.1, no, o)?], 0)?;
                    Some((k, v))
                }
            };
            self.layers[l] = merged;
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
