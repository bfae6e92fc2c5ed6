//! Log-probabilities of target tokens from logits, numerically stable.
//!
//! log p(y) = z_y − logsumexp(z),  logsumexp(z) = m + log Σ exp(z − m),  m = max z (detached:
//! it cancels in the value and its gradient). Computing `log(softmax(z))` instead underflows to
//! −inf for unlikely tokens. The full [B, T, V] log-softmax is never materialised: only the
//! picked logit and the log-normaliser are.

use candle_core::{DType, Tensor, D};

use crate::Result;

/// logsumexp over the last dimension, keeping it (shape [..., 1]).
pub fn logsumexp_keepdim(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    Ok((logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + max)?)
}

/// log-softmax over the last dimension.
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    Ok(logits.broadcast_sub(&logsumexp_keepdim(logits)?)?)
}

/// log p(targets) for logits [B, T, V] and target ids [B, T] (u32); returns [B, T] in f32.
pub fn target_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    // gather needs contiguous operands; callers often pass a narrowed view of the logits.
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let picked = logits.gather(&targets.contiguous()?.unsqueeze(D::Minus1)?, D::Minus1)?;
    Ok((picked - logsumexp_keepdim(&logits)?)?.squeeze(D::Minus1)?)
}
