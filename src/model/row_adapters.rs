//! Many LoRA adapters over one base model in one batch: row r of a batch uses its own adapter
//! (or none), so a sampling engine serves every adapter of a base in a single forward.
//!
//! ```text
//! y = x·Wᵀ (+ the model's own adapter, if any)
//! for each adapter a in use, with R_a the batch rows using it:
//!     y[R_a] += s_a · (x[R_a]·A_aᵀ)·B_aᵀ
//! ```
//! An [`Adapter`] is a PEFT adapter detached from any model: one (A, B, s) per projection it
//! targets, in [`Transformer::linears_mut`] order. [`RowAdapters`] orders a batch's rows by
//! adapter; per targeted projection the input rows are gathered into that order once, each
//! adapter's rank-r product runs on its contiguous rows, and the deltas are gathered back and
//! added once, so the copies do not grow with the number of adapters (only the small matmuls
//! do). A batch of one adapter needs no reordering and computes exactly what the adapter attached
//! to the model computes; so does a row of a mixed batch, bit for bit (the products' order does
//! not depend on how many rows share them: `ops::matmul_wt`).
//!
//! Simplifications: gathers instead of a segmented kernel (Punica/S-LoRA's SGMV); adapters must
//! be over the same base shapes (checked when loaded).

use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::linear::{Linear, LoraPair};
use super::lora::{self, LoraConfig};
use super::transformer::Transformer;
use crate::Result;

/// A LoRA adapter on its own: the (A, B, scale) of each projection it targets.
#[derive(Debug)]
pub struct Adapter {
    pub config: LoraConfig,
    /// By projection index ([`Transformer::linears_mut`] order); None where not targeted.
    pairs: Vec<Option<LoraPair>>,
}

impl Adapter {
    /// The adapter attached to `model` (which must have one), in tensors of its own where the
    /// model's are variables ([`LoraPair::owned`]): training the model in place does not change it.
    pub fn from_model(model: &Transformer, config: LoraConfig) -> Result<Self> {
        let mut pairs = vec![];
        for (_, lin) in model.clone().linears_mut() {
            pairs.push(lin.lora.as_ref().map(LoraPair::owned).transpose()?);
        }
        Ok(Adapter { config, pairs })
    }

    /// Reads a PEFT adapter directory for `base` (shapes checked against it; the base is not
    /// changed).
    pub fn load_peft(base: &Transformer, dir: &Path) -> Result<Self> {
        let mut model = base.clone();
        let (config, _) = lora::load_peft(&mut model, dir, false)?;
        Self::from_model(&model, config)
    }

    fn pair(&self, index: usize) -> Option<&LoraPair> {
        self.pairs.get(index).and_then(Option::as_ref)
    }
}

/// A batch's rows grouped by the adapter they use.
#[derive(Debug)]
pub struct RowAdapters {
    /// Batch rows reordered so that each adapter's rows are contiguous (rows without an adapter
    /// last); None when the batch is already in that order.
    order: Option<(Tensor, Tensor)>,
    /// Per adapter in use: (first row in the reordered batch, rows, adapter).
    spans: Vec<(usize, usize, Arc<Adapter>)>,
    /// Rows without an adapter (at the end of the reordered batch).
    bare: usize,
}

impl RowAdapters {
    /// Groups `rows` (one entry per batch row) by adapter; None when no row has one.
    pub fn new(rows: &[Option<&Arc<Adapter>>], device: &Device) -> Result<Option<Self>> {
        let mut groups: Vec<(Vec<u32>, Arc<Adapter>)> = vec![];
        let mut bare = vec![];
        for (r, a) in rows.iter().enumerate() {
            let Some(a) = a else {
                bare.push(r as u32);
                continue;
            };
            match groups.iter_mut().find(|(_, g)| Arc::ptr_eq(g, a)) {
                Some((idx, _)) => idx.push(r as u32),
                None => groups.push((vec![r as u32], (*a).clone())),
            }
        }
        if groups.is_empty() {
            return Ok(None);
        }
        let perm: Vec<u32> =
            groups.iter().flat_map(|(idx, _)| idx.iter().copied()).chain(bare.iter().copied()).collect();
        let order = if perm.iter().enumerate().all(|(i, &r)| i == r as usize) {
            None
        } else {
            let mut inverse = vec![0u32; perm.len()];
            for (i, &r) in perm.iter().enumerate() {
                inverse[r as usize] = i as u32;
            }
            Some((Tensor::new(perm.as_slice(), device)?, Tensor::new(inverse.as_slice(), device)?))
        };
        let mut start = 0;
        let spans = groups
            .into_iter()
            .map(|(idx, a)| {
                start += idx.len();
                (start - idx.len(), idx.len(), a)
            })
            .collect();
        Ok(Some(RowAdapters { order, spans, bare: bare.len() }))
    }

    /// `lin.forward(x)` plus, on each row (dim 0 of `x`), its adapter's delta of projection
    /// `index`. One gather of the rows into adapter order, one rank-r product per adapter, one
    /// gather back: the copies do not grow with the number of adapters.
    pub fn forward(adapters: Option<&Self>, lin: &Linear, x: &Tensor, index: usize) -> Result<Tensor> {
        let y = lin.forward(x)?;
        let Some(ra) = adapters else { return Ok(y) };
        if ra.spans.iter().all(|(.., a)| a.pair(index).is_none()) {
            return Ok(y);
        }
        let xs = match &ra.order {
            Some((perm, _)) => x.index_select(perm, 0)?,
            None => x.clone(),
        };
        let zeros = |rows: usize| -> Result<Tensor> {
            let mut dims = y.dims().to_vec();
            dims[0] = rows;
            Ok(Tensor::zeros(dims, y.dtype(), y.device())?)
        };
        let mut parts = Vec::with_capacity(ra.spans.len() + 1);
        for (start, len, a) in &ra.spans {
            parts.push(match a.pair(index) {
                Some(pair) => pair.delta(&xs.narrow(0, *start, *len)?)?,
                None => zeros(*len)?,
            });
        }
        if ra.bare > 0 {
            parts.push(zeros(ra.bare)?);
        }
        let delta = if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts, 0)? };
        let delta = match &ra.order {
            Some((_, inverse)) => delta.index_select(inverse, 0)?,
            None => delta,
        };
        Ok((y + delta)?)
    }
}
