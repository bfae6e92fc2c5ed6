//! Gemma 3's departures from the shared block, on the tape: the norms of a block's mixer and
//! MLP outputs, the GELU-tanh gate, the embedding scale, the sliding layers' tables and mask.
//!
//! A post-norm y = rms_norm(x)·(1 + w) sits between a branch and the residual add: the forward
//! keeps x for the backward, which turns the residual's gradient into the branch's (and w's).
//! The MLP's gate activation is GELU-tanh instead of SiLU; the embeddings are scaled by
//! √hidden_size (backward: the same factor on the gathered rows' gradient). A sliding layer
//! reads its own RoPE tables and its windowed bias ([`Local`]).

use candle_core::{Device, Tensor};

use super::{host, model_norm, rms_norm_backward, Grads};
use crate::model::gemma3::{embed_scale, PostNorms};
use crate::model::ops::{gelu_tanh, swiglu, Real};
use crate::model::sliding_window;
use crate::model::transformer::{Block, Transformer};
use crate::Result;

/// What the sliding layers read instead of the shared tables and bias.
pub(super) struct Local<T> {
    pub cos: Vec<T>,
    pub sin: Vec<T>,
    /// The windowed additive mask [B, T, T] (emptied unless a block is to be recomputed).
    pub bias: Vec<T>,
}

impl<T: Real> Local<T> {
    /// For a model with sliding layers.
    pub fn new(model: &Transformer, positions: &[Vec<u32>], mask: &[Vec<u8>]) -> Result<Option<Self>> {
        let (Some(window), Some(rope)) = (model.config.sliding_window(), model.rope_local.as_ref()) else {
            return Ok(None);
        };
        let (cos, sin) = rope.tables(positions, T::DTYPE)?;
        let t = mask.first().map_or(0, Vec::len);
        let bias = sliding_window::attention_bias(mask, 0, t, window, &Device::Cpu)?.to_dtype(T::DTYPE)?;
        Ok(Some(Local { cos: host(&cos)?, sin: host(&sin)?, bias: host(&bias)? }))
    }
}

/// The branches' outputs before their post-norms, for the backward.
pub(super) struct PostRecord<T> {
    pub attn: Vec<T>,
    pub mlp: Vec<T>,
}

/// y = the post-norm `which` of `layer` applied to a branch's output x, and x when the layer has
/// post-norms (else y = x and None).
pub(super) fn forward<T: Real>(
    model: &Transformer,
    layer: &Block,
    which: fn(&PostNorms) -> &Tensor,
    x: Vec<T>,
) -> Result<(Vec<T>, Option<Vec<T>>)> {
    match &layer.post_norms {
        Some(p) => Ok((model_norm(model, &x, which(p))?, Some(x))),
        None => Ok((x, None)),
    }
}

/// The gradient of a branch's output from the residual's `dh`, through its post-norm `which`
/// (whose weight's gradient is pushed); `dh` itself without post-norms.
pub(super) fn backward<T: Real>(
    model: &Transformer,
    layer: &Block,
    which: fn(&PostNorms) -> &Tensor,
    x: Option<&[T]>,
    dh: &[T],
    grads: &mut Grads<T>,
) -> Result<Option<Vec<T>>> {
    let (Some(p), Some(x)) = (&layer.post_norms, x) else { return Ok(None) };
    let mut dx = vec![T::of(0.0); dh.len()];
    rms_norm_backward(model, x, dh, which(p), &mut dx, grads)?;
    Ok(Some(dx))
}

/// The MLP's gated activation: GELU-tanh for Gemma 3, else SiLU.
pub(super) fn activation<T: Real>(model: &Transformer, gate: &[T], up: &[T]) -> Vec<T> {
    match model.config.gemma3 {
        Some(_) => gelu_tanh::forward(gate, up),
        None => swiglu::forward(gate, up),
    }
}

/// The backward of [`activation`].
pub(super) fn activation_backward<T: Real>(
    model: &Transformer,
    gate: &[T],
    up: &[T],
    dy: &[T],
    d_gate: &mut [T],
    d_up: &mut [T],
) {
    match model.config.gemma3 {
        Some(_) => gelu_tanh::backward(gate, up, dy, d_gate, d_up),
        None => swiglu::backward(gate, up, dy, d_gate, d_up),
    }
}

/// The embedding's factor (1 but for Gemma 3), in `T`.
pub(super) fn embedding_scale<T: Real>(model: &Transformer) -> Result<Option<T>> {
    match model.config.gemma3 {
        Some(_) => Ok(Some(T::of(embed_scale(model.config.hidden_size, model.dtype)?))),
        None => Ok(None),
    }
}

/// h ← h · s as candle's affine computes it (x · s + 0), so the tape's embeddings are the
/// engine's bits.
pub(super) fn scale_embeddings<T: Real>(h: &mut [T], s: T) {
    for x in h.iter_mut() {
        *x = *x * s + T::of(0.0);
    }
}
