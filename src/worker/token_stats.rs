//! Per-token log-probs and entropies from logits [N, V], differentiable, in the logits' dtype.
//!
//! `log p(y) = z_y − lse(z)` and `H = lse(z) − Σ_v p_v · z_v` with `p = exp(z − lse(z))` and
//! `lse` the max-shifted logsumexp (model::logprobs). Unlike `model::logprobs::target_logprobs`
//! nothing is cast to f32, so an f64 model gives f64 log-probs (for finite-difference checks).

use candle_core::{Tensor, D};

use crate::model::logprobs::logsumexp_keepdim;
use crate::Result;

/// `(log p(targets) [N], lse [N, 1])` for logits [N, V] and u32 targets [N].
pub fn token_logprobs(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let lse = logsumexp_keepdim(logits)?;
    let picked = logits.gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?;
    Ok(((picked - &lse)?.squeeze(D::Minus1)?, lse))
}

/// Entropy of the softmax of each row, [N], given the row logsumexps [N, 1].
pub fn token_entropy(logits: &Tensor, lse: &Tensor) -> Result<Tensor> {
    let probs = logits.broadcast_sub(lse)?.exp()?;
    let expected_logit = (probs * logits)?.sum(D::Minus1)?;
    Ok((lse.squeeze(D::Minus1)? - expected_logit)?)
}
