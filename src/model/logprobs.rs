//! Log-probabilities of target tokens from logits, numerically stable.
//!
//! log p(y) = z_y − logsumexp(z),  logsumexp(z) = m + log Σ exp(z − m),  m = max z (detached:
//! it cancels in the value and its gradient). Computing `log(softmax(z))` instead underflows to
//! −inf for unlikely tokens. The full [B, T, V] log-softmax is never materialised: only the
//! picked logit and the log-normaliser are. The entropy reuses the same normaliser:
//! H = logsumexp(z) − Σ_v p_v · z_v. Everything runs in f32 at least (f64 stays f64, for
//! finite-difference checks).

use candle_core::{Tensor, D};

pub use super::ops::logprob_lse::logsumexp_keepdim;
use super::ops::norm_dtype;

use crate::Result;

/// `(log p(targets), logsumexp)` for logits [..., V] and u32 target ids [...]: log-probs of the
/// shape of `targets`, the normaliser keeping its last dimension [..., 1].
pub fn target_logprobs_and_lse(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    // Fused on the CPU (no [.., V] tensor kept for the backward); the primitive graph elsewhere.
    super::ops::logprob_lse::forward(&logits.to_dtype(norm_dtype(logits.dtype()))?, targets)
}

/// log p(targets) for logits [..., V] and target ids [...] (u32).
pub fn target_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(target_logprobs_and_lse(logits, targets)?.0)
}

/// Entropy of the softmax of each row of logits [..., V], given their logsumexp [..., 1].
pub fn entropy(logits: &Tensor, lse: &Tensor) -> Result<Tensor> {
    let logits = logits.to_dtype(lse.dtype())?;
    let probs = logits.broadcast_sub(lse)?.exp()?;
    let expected_logit = (probs * &logits)?.sum(D::Minus1)?;
    Ok((lse.squeeze(D::Minus1)? - expected_logit)?)
}
