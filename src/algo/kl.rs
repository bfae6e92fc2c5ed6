//! KL estimators between the learner and a reference policy, per token, from log-probs only.
//!
//! With `Δ = lp − ref` (log-probs of the sampled token):
//! - `k1 = Δ`
//! - `abs = |Δ|`
//! - `k2 = ½ Δ²`
//! - `k3`: `x = clamp(−Δ, −20, 20)`, `k3 = clamp(eˣ − x − 1, −10, 10)` (Schulman's low-variance
//!   unbiased estimator, clamped for stability).
//!
//! Masked positions yield exactly 0, even if an input there is NaN (see [`super::masking`]).
//! [`KlEstimator::per_token`] works on tensors (differentiable in `lp`, for a KL loss term);
//! [`KlEstimator::estimate`] on one pair of f64 (for a KL penalty in rewards).

use candle_core::Tensor;

use super::masking::zero_where_masked;
use crate::Result;

crate::choice! {
    /// The estimator `k(lp, ref)` of the KL to the reference, per token.
    pub enum KlEstimator("KL estimator") {
        K1 = "k1",
        K2 = "k2",
        K3 = "k3",
        Abs = "abs",
    }
}

impl KlEstimator {
    /// The estimate at every token, 0 where `mask` (u8) is 0. Any shape; `lp`, `ref_lp`, `mask`
    /// of the same shape; the result has `lp`'s dtype.
    pub fn per_token(self, lp: &Tensor, ref_lp: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let lp = zero_where_masked(lp, mask)?;
        let ref_lp = zero_where_masked(&ref_lp.to_dtype(lp.dtype())?, mask)?;
        let delta = (lp - ref_lp)?;
        let kl = match self {
            Self::K1 => delta,
            Self::Abs => delta.abs()?,
            Self::K2 => (delta.sqr()? * 0.5)?,
            Self::K3 => {
                let x = delta.neg()?.clamp(-20f64, 20f64)?;
                ((x.exp()? - x)? - 1.0)?.clamp(-10f64, 10f64)?
            }
        };
        zero_where_masked(&kl, mask)
    }

    /// The estimate for one token.
    pub fn estimate(self, lp: f64, ref_lp: f64) -> f64 {
        let delta = lp - ref_lp;
        match self {
            Self::K1 => delta,
            Self::Abs => delta.abs(),
            Self::K2 => 0.5 * delta * delta,
            Self::K3 => {
                let x = (-delta).clamp(-20.0, 20.0);
                (x.exp() - x - 1.0).clamp(-10.0, 10.0)
            }
        }
    }
}
