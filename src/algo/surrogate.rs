//! Ratio-based surrogate objectives shared by the Tinker and trainer loss families.
//!
//! - Clipped surrogate (PPO): `loss = −min(r·A, clamp(r, lo, hi)·A)`; the clip is "active" at a
//!   token when the clamped term is strictly the smaller one (its gradient is then 0).
//! - Clipped-ratio policy gradient (CISPO): `loss = −sg(clamp(r, lo, hi)) · lp · A`; the clip is
//!   active where `r ∉ [lo, hi]`.
//! - Masked-ratio policy gradient (rollout IS): `loss = −sg(r · 1[lo < r < hi]) · A · lp`; the
//!   mask is active where `r ∉ (lo, hi)`.
//!
//! `lo`, `hi` are absolute ratio thresholds ([`RatioBand`]). Each function returns the loss and a
//! u8 indicator of where the clip/mask is active (for the `clip_fraction` metric).

use candle_core::Tensor;

use crate::{Error, Result};

/// Ratio thresholds `[low, high]`, e.g. `[1 − ε_lo, 1 + ε_hi]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RatioBand {
    pub low: f64,
    pub high: f64,
}

impl RatioBand {
    /// The band `[1 − eps_low, 1 + eps_high]`.
    pub fn around_one(eps_low: f64, eps_high: f64) -> Result<Self> {
        if eps_low < 0.0 || eps_high < 0.0 {
            return Err(Error::input(format!(
                "clip epsilons must be ≥ 0, got eps_clip_low={eps_low}, eps_clip_high={eps_high}"
            )));
        }
        Ok(RatioBand { low: 1.0 - eps_low, high: 1.0 + eps_high })
    }

    /// The band `[low, high]`, which must be ordered.
    pub fn new(low: f64, high: f64) -> Result<Self> {
        if low > high {
            return Err(Error::input(format!("ratio band low {low} is above high {high}")));
        }
        Ok(RatioBand { low, high })
    }
}

/// `(−min(r·A, clamp(r)·A), 1[clamped term strictly smaller])`.
pub fn clipped_surrogate(ratio: &Tensor, advantages: &Tensor, band: RatioBand) -> Result<(Tensor, Tensor)> {
    let unclipped = (ratio * advantages)?;
    let clipped = (ratio.clamp(band.low, band.high)? * advantages)?;
    let clip_active = clipped.detach().lt(&unclipped.detach())?;
    let loss = unclipped.minimum(&clipped)?.neg()?;
    Ok((loss, clip_active))
}

/// `(−sg(clamp(r)) · lp · A, 1[r outside [lo, hi]])`.
pub fn clipped_ratio_policy_gradient(
    ratio: &Tensor,
    logprobs: &Tensor,
    advantages: &Tensor,
    band: RatioBand,
) -> Result<(Tensor, Tensor)> {
    let ratio = ratio.detach();
    let clipped = ratio.clamp(band.low, band.high)?;
    let clip_active = clipped.ne(&ratio)?;
    let loss = ((clipped * logprobs)? * advantages)?.neg()?;
    Ok((loss, clip_active))
}

/// `(−sg(r · 1[lo < r < hi]) · A · lp, 1[r outside (lo, hi)])`.
pub fn masked_ratio_policy_gradient(
    ratio: &Tensor,
    logprobs: &Tensor,
    advantages: &Tensor,
    band: RatioBand,
) -> Result<(Tensor, Tensor)> {
    let ratio = ratio.detach();
    let inside = ratio.gt(band.low)?.mul(&ratio.lt(band.high)?)?;
    let kept_ratio = inside.where_cond(&ratio, &ratio.zeros_like()?)?;
    let loss = ((kept_ratio * advantages)? * logprobs)?.neg()?;
    let mask_active = inside.eq(0u8)?;
    Ok((loss, mask_active))
}
