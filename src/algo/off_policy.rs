//! Off-policy correction between the policy a mini-batch starts from (`old`) and the sampler
//! that generated it (`roll`), when behaviour log-probs exist. Host rows, one per sequence.
//!
//! `ρ_t = safe_exp(old_t − roll_t)`, i.e. `log ρ_t = clamp(old_t − roll_t, −20, 20)`. Only
//! valid tokens (mask ≠ 0) are looked at; every mask returned is 0 wherever the input mask is.
//! 1. Outlier mask ([`outlier_sequence_mask`]): drop a whole sequence if any valid token has
//!    `ρ > high` or `ρ < low`.
//! 2. Token mask ([`ratio_token_mask`]): keep tokens with `low ≤ ρ ≤ high`.
//! 3. Truncated IS, detached multipliers of the loss: token level `min(ρ_t, cap)` (cap 2)
//!    ([`token_truncated_is`]); sequence level `min(exp(Σ_t m_t log ρ_t), cap)` (cap 5)
//!    ([`sequence_truncated_is`]), the same for every valid token of the sequence.
//! 4. Sequence mask ([`sequence_ratio_mask`]): keep a sequence if the geometric mean
//!    `exp(Σ m log ρ / max(Σ m, 1))` is in [0.99, 1.01], or, by choice, the product
//!    `exp(Σ m log ρ)` is in [0.5, 2.0] (compared in log space: no overflow).
//!
//! [`OffPolicyCorrection`] chains the configured steps: its `mask` is the loss mask after every
//! mask (use it for the reduction weights), its `is_weights` the truncated-IS factors (1 when
//! truncated IS is off, 0 where the final mask is 0) to multiply into the token weights.

use serde_json::Value;

use super::config_object::{unknown_name, ConfigObject};
use super::metrics::Metrics;
use super::rows::{check_same_layout, is_valid};
use crate::{Error, Result};

fn log_ratio(old: f32, roll: f32) -> f64 {
    (old as f64 - roll as f64).clamp(-20.0, 20.0)
}

/// `Σ_t m_t log ρ_t` and `Σ_t m_t` of one sequence.
fn sequence_log_ratio(old: &[f32], roll: &[f32], mask: &[f32]) -> (f64, f64) {
    let mut sum = 0.0;
    let mut count = 0.0;
    for t in 0..mask.len() {
        if is_valid(mask[t]) {
            sum += log_ratio(old[t], roll[t]);
            count += 1.0;
        }
    }
    (sum, count)
}

fn check_inputs(old: &[Vec<f32>], roll: &[Vec<f32>], mask: &[Vec<f32>]) -> Result<()> {
    check_same_layout("old_logprobs", old, "mask", mask)?;
    check_same_layout("rollout_logprobs", roll, "mask", mask)
}

fn check_band(what: &str, low: f64, high: f64) -> Result<()> {
    // Written so that a NaN bound is rejected too.
    if low.partial_cmp(&high).is_none_or(|order| order.is_gt()) {
        return Err(Error::input(format!("{what}: low {low} must not exceed high {high}")));
    }
    Ok(())
}

/// 1 per sequence kept, 0 per sequence with a valid token whose ρ is outside [low, high].
pub fn outlier_sequence_mask(
    old: &[Vec<f32>],
    roll: &[Vec<f32>],
    mask: &[Vec<f32>],
    low: f64,
    high: f64,
) -> Result<Vec<f32>> {
    check_inputs(old, roll, mask)?;
    check_band("outlier mask", low, high)?;
    let (log_low, log_high) = (low.ln(), high.ln());
    Ok((0..mask.len())
        .map(|i| {
            let outlier = (0..mask[i].len()).any(|t| {
                let lr = log_ratio(old[i][t], roll[i][t]);
                is_valid(mask[i][t]) && (lr > log_high || lr < log_low)
            });
            if outlier {
                0.0
            } else {
                1.0
            }
        })
        .collect())
}

/// The input mask with tokens whose ρ is outside [low, high] set to 0.
pub fn ratio_token_mask(
    old: &[Vec<f32>],
    roll: &[Vec<f32>],
    mask: &[Vec<f32>],
    low: f64,
    high: f64,
) -> Result<Vec<Vec<f32>>> {
    check_inputs(old, roll, mask)?;
    check_band("token mask", low, high)?;
    let (log_low, log_high) = (low.ln(), high.ln());
    Ok(per_token(old, roll, mask, |lr| if lr >= log_low && lr <= log_high { 1.0 } else { 0.0 }))
}

/// `min(ρ_t, cap)` at valid tokens, 0 elsewhere.
pub fn token_truncated_is(old: &[Vec<f32>], roll: &[Vec<f32>], mask: &[Vec<f32>], cap: f64) -> Result<Vec<Vec<f32>>> {
    check_inputs(old, roll, mask)?;
    Ok(per_token(old, roll, mask, |lr| lr.exp().min(cap)))
}

/// `min(exp(Σ_t m_t log ρ_t), cap)` per sequence.
pub fn sequence_truncated_is(old: &[Vec<f32>], roll: &[Vec<f32>], mask: &[Vec<f32>], cap: f64) -> Result<Vec<f32>> {
    check_inputs(old, roll, mask)?;
    Ok((0..mask.len()).map(|i| sequence_log_ratio(&old[i], &roll[i], &mask[i]).0.exp().min(cap) as f32).collect())
}

/// Which sequence statistic of ρ the sequence mask bounds, with its bounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SequenceMaskMetric {
    /// `exp(mean_t log ρ_t)` in [low, high]; default [0.99, 1.01].
    GeometricMean { low: f64, high: f64 },
    /// `exp(Σ_t log ρ_t)` in [low, high]; default [0.5, 2.0].
    Product { low: f64, high: f64 },
}

/// 1 per sequence kept, 0 per sequence whose statistic is outside its bounds.
pub fn sequence_ratio_mask(
    old: &[Vec<f32>],
    roll: &[Vec<f32>],
    mask: &[Vec<f32>],
    metric: SequenceMaskMetric,
) -> Result<Vec<f32>> {
    check_inputs(old, roll, mask)?;
    Ok((0..mask.len())
        .map(|i| {
            let (sum, count) = sequence_log_ratio(&old[i], &roll[i], &mask[i]);
            let (statistic, low, high) = match metric {
                SequenceMaskMetric::GeometricMean { low, high } => (sum / count.max(1.0), low, high),
                SequenceMaskMetric::Product { low, high } => (sum, low, high),
            };
            if statistic >= low.ln() && statistic <= high.ln() {
                1.0
            } else {
                0.0
            }
        })
        .collect())
}

fn per_token(old: &[Vec<f32>], roll: &[Vec<f32>], mask: &[Vec<f32>], f: impl Fn(f64) -> f64) -> Vec<Vec<f32>> {
    (0..mask.len())
        .map(|i| {
            (0..mask[i].len())
                .map(|t| if is_valid(mask[i][t]) { f(log_ratio(old[i][t], roll[i][t])) as f32 } else { 0.0 })
                .collect()
        })
        .collect()
}

/// Truncated importance sampling, at one level, with its cap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TruncatedIs {
    /// `min(ρ_t, cap)`; default cap 2.
    Token { cap: f64 },
    /// `min(exp(Σ_t m_t log ρ_t), cap)`; default cap 5.
    Sequence { cap: f64 },
}

/// The configured off-policy correction steps; `None` = step off.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffPolicyCorrection {
    /// `(low, high)` of the outlier sequence mask.
    pub outlier: Option<(f64, f64)>,
    /// `(low, high)` of the token mask.
    pub token_mask: Option<(f64, f64)>,
    pub truncated_is: Option<TruncatedIs>,
    pub sequence_mask: Option<SequenceMaskMetric>,
}

/// The result of [`OffPolicyCorrection::apply`].
#[derive(Clone, Debug, PartialEq)]
pub struct OffPolicyOutcome {
    /// The loss mask after every configured mask.
    pub mask: Vec<Vec<f32>>,
    /// Detached per-token multipliers of the loss; 1 without truncated IS; 0 where `mask` is 0.
    pub is_weights: Vec<Vec<f32>>,
    /// `off_policy_ratio:mean` (ρ over the input's valid tokens), `off_policy_outlier_fraction:mean`
    /// and `off_policy_sequence_mask_fraction:mean` (sequences dropped / sequences),
    /// `off_policy_token_mask_fraction:mean` (tokens dropped / valid tokens),
    /// `off_policy_is_weight:mean` (over the tokens kept) — each present when its step is on.
    pub metrics: Metrics,
}

const CONFIG_KEYS: [&str; 9] = [
    "outlier_low",
    "outlier_high",
    "token_mask_low",
    "token_mask_high",
    "tis_level",
    "tis_cap",
    "sequence_mask",
    "sequence_mask_low",
    "sequence_mask_high",
];

impl OffPolicyCorrection {
    /// From a JSON object with optional keys: `outlier_low`/`outlier_high` (either turns the
    /// outlier mask on; a missing bound is 0 / +∞), `token_mask_low`/`token_mask_high` (same),
    /// `tis_level` (`"token"` | `"sequence"`) with `tis_cap` (default 2 / 5), `sequence_mask`
    /// (`"geometric"` | `"product"`) with `sequence_mask_low`/`sequence_mask_high` (defaults
    /// [0.99, 1.01] / [0.5, 2.0]).
    pub fn from_config(config: &Value) -> Result<Self> {
        let c = ConfigObject::new("off-policy correction", config, &CONFIG_KEYS)?;
        let band = |low_key: &str, high_key: &str| -> Result<Option<(f64, f64)>> {
            let (low, high) = (c.optional_f64(low_key)?, c.optional_f64(high_key)?);
            if low.is_none() && high.is_none() {
                return Ok(None);
            }
            let (low, high) = (low.unwrap_or(0.0), high.unwrap_or(f64::INFINITY));
            check_band(&format!("off-policy correction `{low_key}`/`{high_key}`"), low, high)?;
            Ok(Some((low, high)))
        };
        let outlier = band("outlier_low", "outlier_high")?;
        let token_mask = band("token_mask_low", "token_mask_high")?;
        let truncated_is = match c.optional_str("tis_level")? {
            None => None,
            Some("token") => Some(TruncatedIs::Token { cap: c.f64_or("tis_cap", 2.0)? }),
            Some("sequence") => Some(TruncatedIs::Sequence { cap: c.f64_or("tis_cap", 5.0)? }),
            Some(other) => return Err(unknown_name("truncated IS level", other, &["token", "sequence"])),
        };
        let bounds = |low: f64, high: f64| -> Result<(f64, f64)> {
            let bounds = (c.f64_or("sequence_mask_low", low)?, c.f64_or("sequence_mask_high", high)?);
            check_band("off-policy correction `sequence_mask`", bounds.0, bounds.1)?;
            Ok(bounds)
        };
        let sequence_mask = match c.optional_str("sequence_mask")? {
            None => None,
            Some("geometric") => {
                let (low, high) = bounds(0.99, 1.01)?;
                Some(SequenceMaskMetric::GeometricMean { low, high })
            }
            Some("product") => {
                let (low, high) = bounds(0.5, 2.0)?;
                Some(SequenceMaskMetric::Product { low, high })
            }
            Some(other) => return Err(unknown_name("sequence mask metric", other, &["geometric", "product"])),
        };
        Ok(OffPolicyCorrection { outlier, token_mask, truncated_is, sequence_mask })
    }

    pub fn apply(&self, old: &[Vec<f32>], roll: &[Vec<f32>], mask: &[Vec<f32>]) -> Result<OffPolicyOutcome> {
        check_inputs(old, roll, mask)?;
        let mut metrics = Metrics::new();
        let sequences = mask.len() as f64;
        let valid_tokens = |m: &[Vec<f32>]| m.iter().flatten().filter(|&&x| is_valid(x)).count() as f64;
        let ratio_sum: f64 = per_token(old, roll, mask, f64::exp).iter().flatten().map(|&x| x as f64).sum();
        metrics.add_mean("off_policy_ratio", ratio_sum, valid_tokens(mask));

        let mut current: Vec<Vec<f32>> = mask.to_vec();
        let drop_sequences = |current: &mut Vec<Vec<f32>>, keep: &[f32]| -> f64 {
            let mut dropped = 0.0;
            for (row, &k) in current.iter_mut().zip(keep) {
                if k == 0.0 {
                    dropped += 1.0;
                    row.iter_mut().for_each(|m| *m = 0.0);
                }
            }
            dropped
        };
        if let Some((low, high)) = self.outlier {
            let keep = outlier_sequence_mask(old, roll, mask, low, high)?;
            let dropped = drop_sequences(&mut current, &keep);
            metrics.add_mean("off_policy_outlier_fraction", dropped, sequences);
        }
        if let Some((low, high)) = self.token_mask {
            let before = valid_tokens(mask);
            let kept = ratio_token_mask(old, roll, mask, low, high)?;
            let dropped = before - valid_tokens(&kept);
            for (row, kept_row) in current.iter_mut().zip(&kept) {
                for (m, &k) in row.iter_mut().zip(kept_row) {
                    if k == 0.0 {
                        *m = 0.0;
                    }
                }
            }
            metrics.add_mean("off_policy_token_mask_fraction", dropped, before);
        }
        if let Some(metric) = self.sequence_mask {
            let keep = sequence_ratio_mask(old, roll, mask, metric)?;
            let dropped = keep.iter().filter(|&&k| k == 0.0).count() as f64;
            drop_sequences(&mut current, &keep);
            metrics.add_mean("off_policy_sequence_mask_fraction", dropped, sequences);
        }

        let factors: Vec<Vec<f32>> = match self.truncated_is {
            None => mask.iter().map(|row| vec![1.0; row.len()]).collect(),
            Some(TruncatedIs::Token { cap }) => token_truncated_is(old, roll, mask, cap)?,
            Some(TruncatedIs::Sequence { cap }) => {
                let per_sequence = sequence_truncated_is(old, roll, mask, cap)?;
                mask.iter().zip(per_sequence).map(|(row, f)| vec![f; row.len()]).collect()
            }
        };
        let is_weights: Vec<Vec<f32>> = current
            .iter()
            .zip(&factors)
            .map(|(m, f)| m.iter().zip(f).map(|(&m, &f)| if is_valid(m) { f } else { 0.0 }).collect())
            .collect();
        if self.truncated_is.is_some() {
            let sum: f64 = is_weights.iter().flatten().map(|&x| x as f64).sum();
            metrics.add_mean("off_policy_is_weight", sum, valid_tokens(&current));
        }
        Ok(OffPolicyOutcome { mask: current, is_weights, metrics })
    }
}
