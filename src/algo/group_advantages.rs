//! Outcome advantages from groups of samples that share a prompt (GRPO, RLOO).
//!
//! A sequence's score is `s = Σ_t r_t`, the plain sum of its token rewards ([`sequence_scores`]).
//! With `μ_g`, `σ_g` the mean and unbiased (n − 1) standard deviation of the scores of group g
//! of size n:
//! - `grpo`: `(s − μ_g) / (σ_g + 1e-6)`; with `norm_by_std = false`: `s − μ_g`. A group of one
//!   sample uses `μ = 0, σ = 1`.
//! - `rloo`: `(s − μ_g) · n / (n − 1)` (= s minus the mean of the *other* samples); a group of
//!   one gets 0.
//!
//! Per-sequence advantages become per-token ones with [`broadcast_over_mask`]: `A_t = A · m_t`.
//! Group ids are any hashable type (prompt uids, indices).

use std::hash::Hash;

use super::rows::{check_group_count, group_members};
use crate::{Error, Result};

/// `s_i = Σ_t r_it`.
pub fn sequence_scores(token_rewards: &[Vec<f32>]) -> Vec<f32> {
    token_rewards.iter().map(|row| row.iter().map(|&r| r as f64).sum::<f64>() as f32).collect()
}

/// GRPO advantages, one per sequence.
pub fn grpo_advantages<G: Eq + Hash>(scores: &[f32], groups: &[G], norm_by_std: bool) -> Result<Vec<f32>> {
    check_group_count(scores.len(), groups)?;
    let mut advantages = vec![0f32; scores.len()];
    for members in group_members(groups) {
        let (mean, std) = if members.len() == 1 {
            (0.0, 1.0)
        } else {
            mean_and_unbiased_std(members.iter().map(|&i| scores[i] as f64))
        };
        for &i in &members {
            let centred = scores[i] as f64 - mean;
            advantages[i] = if norm_by_std { centred / (std + 1e-6) } else { centred } as f32;
        }
    }
    Ok(advantages)
}

/// RLOO advantages, one per sequence.
pub fn rloo_advantages<G: Eq + Hash>(scores: &[f32], groups: &[G]) -> Result<Vec<f32>> {
    check_group_count(scores.len(), groups)?;
    let mut advantages = vec![0f32; scores.len()];
    for members in group_members(groups) {
        let n = members.len() as f64;
        if members.len() < 2 {
            continue;
        }
        let mean = members.iter().map(|&i| scores[i] as f64).sum::<f64>() / n;
        for &i in &members {
            advantages[i] = ((scores[i] as f64 - mean) * n / (n - 1.0)) as f32;
        }
    }
    Ok(advantages)
}

/// `A_it = A_i · m_it`.
pub fn broadcast_over_mask(per_sequence: &[f32], mask: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    if per_sequence.len() != mask.len() {
        return Err(Error::input(format!("{} advantages for {} sequences", per_sequence.len(), mask.len())));
    }
    Ok(mask.iter().zip(per_sequence).map(|(row, &a)| row.iter().map(|&m| a * m).collect()).collect())
}

fn mean_and_unbiased_std(values: impl Iterator<Item = f64> + Clone) -> (f64, f64) {
    let n = values.clone().count() as f64;
    let mean = values.clone().sum::<f64>() / n;
    let variance = values.map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, variance.sqrt())
}
