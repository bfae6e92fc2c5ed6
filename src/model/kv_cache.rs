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
