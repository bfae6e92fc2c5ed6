//! Token masks on tensors, and the two numeric guards every loss uses.
//!
//! A token counts when its weight is non-zero: `m_t = 1[w_t ≠ 0]` (weights may be negative).
//! Masking is `where(m, x, 0)`, never `x · m`: a NaN or ±inf at a masked position stays out of
//! both the value and the gradient (`0 · NaN` would be NaN). Losses first replace every input
//! at masked positions by 0 with [`zero_where_masked`], compute, then mask the result again, so
//! even the intermediate values behind a masked token are finite.
//!
//! `safe_exp(d) = exp(clamp(d, −20, 20))` (algorithms.md).

use candle_core::{DType, Tensor};

use crate::Result;

/// The u8 mask `1[w ≠ 0]`.
pub fn token_mask(weights: &Tensor) -> Result<Tensor> {
    Ok(weights.ne(0f64)?)
}

/// `x` where `mask` is 1, exactly 0 elsewhere (in value and gradient).
pub fn zero_where_masked(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(mask.where_cond(x, &x.zeros_like()?)?)
}

/// 0-d tensor `Σ_t m_t · x_t`, computed with `where` so masked NaNs do not leak.
pub fn masked_sum(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(zero_where_masked(x, mask)?.sum_all()?)
}

/// 0-d tensor `Σ_t m_t` in `dtype` (the u8 mask is converted first: a u8 sum would overflow).
pub fn mask_count(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(mask.to_dtype(dtype)?.sum_all()?)
}

/// `exp(clamp(x, −20, 20))`.
pub fn safe_exp(x: &Tensor) -> Result<Tensor> {
    Ok(x.clamp(-20f64, 20f64)?.exp()?)
}
