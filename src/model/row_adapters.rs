//! Many LoRA adapters over one base model in one batch: row r of a batch uses its own adapter
//! (or none), so a sampling engine serves every adapter of a base in a single forward.
//!
//! ```text
//! y = x·Wᵀ (+ the model's own adapter, if any)
//! for each adapter a in use, with R_a the batch rows using it:
//!     y[R_a] += s_a · (x[R_a]·A_aᵀ)·B_aᵀ
//! ```
//! An [`Adapter`] is a PEFT adapter detached from any model: one (A, B, s) per projection it
//! targets, in [`Transformer::linears_mut`] order. [`RowAdapters`] groups a batch's rows by
//! adapter; each group costs a row gather, two rank-r matmuls and a scatter-add per targeted
//! projection, so the cost grows with the adapters in use, not with the rows. A row's result is
//! the same computation as the adapter attached to the model alone (up to float summation order
//! of the matmuls over fewer rows).
//!
//! Simplifications: the rows of a group are gathered per projection (no segmented kernel as in
//! Punica/S-LoRA); adapters must be over the same base shapes (checked when loaded).

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
    /// The adapter attached to `model` (which must have one).
    pub fn from_model(model: &Transformer, config: LoraConfig) -> Self {
        let pairs = model.clone().linears_mut().into_iter().map(|(_, lin)| lin.lora.clone()).collect();
        Adapter { config, pairs }
    }

    /// Reads a PEFT adapter directory for `base` (shapes checked against it; the base is not
    /// changed).
    pub fn load_peft(base: &Transformer, dir: &Path) -> Result<Self> {
        let mut model = base.clone();
        let (config, _) = lora::load_peft(&mut model, dir, false)?;
        Ok(Self::from_model(&model, config))
    }

    fn pair(&self, index: usize) -> Option<&LoraPair> {
        self.pairs.get(index).and_then(Option::as_ref)
    }
}

/// A batch's rows grouped by the adapter they use (rows without one are in no group).
#[derive(Debug, Default)]
pub struct RowAdapters {
    /// (row indices as a u32 tensor, their adapter).
    groups: Vec<(Tensor, Arc<Adapter>)>,
}

impl RowAdapters {
    /// Groups `rows` (one entry per batch row) by adapter; None when no row has one.
    pub fn new(rows: &[Option<&Arc<Adapter>>], device: &Device) -> Result<Option<Self>> {
        let mut groups: Vec<(Vec<u32>, Arc<Adapter>)> = vec![];
        for (r, a) in rows.iter().enumerate() {
            let Some(a) = a else { continue };
            match groups.iter_mut().find(|(_, g)| Arc::ptr_eq(g, a)) {
                Some((idx, _)) => idx.push(r as u32),
                None => groups.push((vec![r as u32], (*a).clone())),
            }
        }
        if groups.is_empty() {
            return Ok(None);
        }
        let groups = groups
            .into_iter()
            .map(|(idx, a)| Ok((Tensor::new(idx.as_slice(), device)?, a)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(RowAdapters { groups }))
    }

    /// `lin.forward(x)` plus each group's adapter delta of projection `index` on its rows
    /// (rows are dim 0 of `x`).
    pub fn forward(adapters: Option<&Self>, lin: &Linear, x: &Tensor, index: usize) -> Result<Tensor> {
        let mut y = lin.forward(x)?;
        for (rows, adapter) in adapters.map_or(&[][..], |a| &a.groups) {
            if let Some(pair) = adapter.pair(index) {
                let delta = pair.delta(&x.index_select(rows, 0)?)?;
                y = y.index_add(rows, &delta, 0)?;
            }
        }
        Ok(y)
    }
}
