//! Activation checkpointing on candle's graph: a model that trains through candle's autograd
//! (off the CPU tape, [`crate::model::tape::Tape::serves`]: a GPU) keeps each decoder block's
//! input instead of every activation of every block.
//!
//! ```text
//! forward:  h₀ = embed(ids)
//!           for each block i: keep hᵢ; hᵢ₊₁ = blockᵢ(hᵢ) on a detached hᵢ, detached again
//!               (the block's activations are freed as soon as it is done)
//!           the final norm, and the caller's head and loss, on a fresh variable v = h_L
//! backward: g = ∂loss/∂v from the caller's backward of the loss
//!           for i = L−1 … 0: y = blockᵢ(vᵢ) on a fresh variable vᵢ = hᵢ; the backward of
//!               Σ(y ⊙ g) gives the block's parameter gradients, and g ← ∂/∂vᵢ
//!           the backward of Σ(embed(ids) ⊙ g): the embedding's
//! ```
//!
//! The backward of Σ(y ⊙ g) hands y exactly g (the sum's gradient is ones, times g), and the
//! recomputed block is the same graph on the same bits, so each block's gradients are the ones
//! candle's backward of the whole graph computes. The embedding's gather is differentiated here
//! by the rules of the graph's (each step's gradient added to zeros; where the embedding is
//! oxrl's node, its table gradient added to what the head's part left, else candle's: the
//! gathered rows added into the head's part row by row): a tied embedding gets the whole
//! graph's bits too.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::ops::embedding;
use super::transformer::{model_norm, BlockInputs, Transformer};
use crate::{Error, Result};

/// A forward that kept only its blocks' inputs, waiting for its backward.
pub struct GraphCheckpoint {
    model: Transformer,
    /// The batch's token ids, row after row.
    ids: Vec<u32>,
    inputs: BlockInputs,
    /// Each block's input hᵢ, detached.
    kept: Vec<Tensor>,
    /// The variable the final norm (and the caller's graph) starts from.
    out: Var,
}

impl GraphCheckpoint {
    /// The final hidden states [B, T, hidden] (as [`Transformer::forward_hidden`] computes them,
    /// on a graph that starts at the last block's output) and the checkpoint for the backward.
    pub fn forward(
        model: &Transformer,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
    ) -> Result<(Tensor, GraphCheckpoint)> {
        model.check_whole("the graph forward")?;
        model.check_inputs(input_ids, positions, mask)?;
        let ids = input_ids.concat();
        let inputs = model.block_inputs(positions, mask)?;
        let mut h = model.embed(input_ids)?.detach();
        let mut kept = Vec::with_capacity(model.layers.len());
        for i in 0..model.layers.len() {
            let next = model.train_block(i, &h, &inputs)?.detach();
            kept.push(h);
            h = next;
        }
        let out = Var::from_tensor(&h)?;
        let hidden = model_norm(out.as_tensor(), &model.norm, &model.config)?;
        Ok((hidden, GraphCheckpoint { model: model.clone(), ids, inputs, kept, out }))
    }

    /// The gradients of `params` (those that have one), given the store of the caller's
    /// backward of its loss: the loss's own (the final norm, the head), then the blocks' last to
    /// first, then the embedding's (a tied one's head part included). Only the store's when the
    /// loss did not depend on the hidden states.
    pub fn backward(mut self, store: &GradStore, params: &[Tensor]) -> Result<Vec<(Tensor, Tensor)>> {
        let mut grads: Vec<(Tensor, Tensor)> =
            params.iter().filter_map(|p| store.get(p).map(|g| (p.clone(), g.clone()))).collect();
        let Some(mut g) = store.get(self.out.as_tensor()).cloned() else { return Ok(grads) };
        for i in (0..self.model.layers.len()).rev() {
            let h =
                self.kept.pop().ok_or_else(|| Error::Other("graph checkpoint: a block's input is missing".into()))?;
            let v = Var::from_tensor(&h)?;
            drop(h);
            let y = self.model.train_block(i, v.as_tensor(), &self.inputs)?;
            let part = (y * &g)?.sum_all()?.backward()?;
            // Detached: a gradient computed from variables records how, and would keep the
            // recomputed block alive through it.
            grads.extend(params.iter().filter_map(|p| part.get(p).map(|gp| (p.clone(), gp.detach()))));
            g = part
                .get(v.as_tensor())
                .map(Tensor::detach)
                .ok_or_else(|| Error::Other(format!("graph checkpoint: no gradient reached block {i}'s input")))?;
        }
        let embed = &self.model.embed_tokens;
        if params.iter().any(|p| p.id() == embed.id()) {
            // Backward through `Transformer::embed`: the scale, the dtype, the shape, the gather.
            let added = |x: Tensor| -> Result<Tensor> { Ok((x.zeros_like()? + x)?) };
            if self.model.config.gemma3.is_some() {
                let scale = super::gemma3::embed_scale(self.model.config.hidden_size, self.model.dtype)?;
                g = added(g.affine(scale, 0.)?)?;
            }
            if g.dtype() != embed.dtype() {
                g = added(g.to_dtype(embed.dtype())?)?;
            }
            let g = added(g.reshape((self.ids.len(), ()))?)?;
            let acc = grads.iter().position(|(p, _)| p.id() == embed.id()).map(|k| grads.remove(k).1);
            let table = match (acc, embedding::serves(embed)) {
                // The node's backward: the gather's table gradient, added to the head's part.
                (Some(acc), true) => (acc + embedding::table_gradient(embed, &self.ids, &g)?)?,
                (None, true) => embedding::table_gradient(embed, &self.ids, &g)?,
                // candle's: the rows added into the head's part (or zeros) one by one.
                (acc, false) => {
                    let acc = match acc {
                        Some(acc) => acc,
                        None => embed.zeros_like()?,
                    };
                    let index = Tensor::from_slice(&self.ids, self.ids.len(), embed.device())?;
                    acc.index_add(&index, &g, 0)?
                }
            };
            grads.push((embed.clone(), table));
        }
        Ok(grads)
    }
}
