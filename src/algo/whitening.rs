//! Masked whitening of token values over a whole batch.
//!
//! Over the valid positions (mask ≠ 0) of all sequences: `μ` the mean, `var` the unbiased
//! variance (divide by n − 1), and `x̂ = (x − μ) / sqrt(var + 1e-8)`. Masked positions get 0.
//! With fewer than two valid positions `var` is taken as 0 (and then `x̂ = 0`).

use super::rows::{check_same_layout, is_valid};
use crate::Result;

pub fn masked_whiten(x: &[Vec<f32>], mask: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    check_same_layout("values", x, "mask", mask)?;
    let valid = || {
        x.iter().zip(mask).flat_map(|(xr, mr)| xr.iter().zip(mr).filter(|(_, &m)| is_valid(m)).map(|(&v, _)| v as f64))
    };
    let n = valid().count() as f64;
    let mean = if n > 0.0 { valid().sum::<f64>() / n } else { 0.0 };
    let variance = if n > 1.0 { valid().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    let scale = 1.0 / (variance + 1e-8).sqrt();
    Ok(x.iter()
        .zip(mask)
        .map(|(xr, mr)| {
            xr.iter()
                .zip(mr)
                .map(|(&v, &m)| if is_valid(m) { ((v as f64 - mean) * scale) as f32 } else { 0.0 })
                .collect()
        })
        .collect())
}
