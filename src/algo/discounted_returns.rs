//! Token-level advantages from discounted returns (REINFORCE++, GAE), whitened over the batch.
//!
//! - `reinforce++`: `G_t = r_t + γ·G_{t+1}` from the last token back, where the carried return
//!   is reset after a masked token (`G_{t+1}` counts only if `m_{t+1} ≠ 0`); returns = G at
//!   every position (masked ones included); advantages = masked whitening of G.
//! - `gae`: `δ_t = r_t + γ·V_{t+1} − V_t` (`V_T = 0`), `A_t = δ_t + γλ·A_{t+1}`;
//!   returns = A + V; advantages = masked whitening of A. A masked token (e.g. an observation
//!   in a multi-turn response) is skipped: it neither changes the carried `V_{t+1}` nor the
//!   carried `A_{t+1}`, and its own advantage and return are 0.
//!
//! Whitening ([`super::whitening::masked_whiten`]) spans all valid tokens of the batch;
//! advantages are 0 at masked positions.

use super::rows::{check_same_layout, is_valid};
use super::whitening::masked_whiten;
use crate::Result;

/// Advantages and returns, one row per sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct AdvantagesAndReturns {
    pub advantages: Vec<Vec<f32>>,
    pub returns: Vec<Vec<f32>>,
}

pub fn reinforce_plus_plus(token_rewards: &[Vec<f32>], mask: &[Vec<f32>], gamma: f32) -> Result<AdvantagesAndReturns> {
    check_same_layout("rewards", token_rewards, "mask", mask)?;
    let gamma = gamma as f64;
    let returns: Vec<Vec<f32>> = token_rewards
        .iter()
        .zip(mask)
        .map(|(rewards, mask)| {
            let mut row = vec![0f32; rewards.len()];
            let mut carried = 0f64;
            for t in (0..rewards.len()).rev() {
                let g = rewards[t] as f64 + gamma * carried;
                row[t] = g as f32;
                carried = if is_valid(mask[t]) { g } else { 0.0 };
            }
            row
        })
        .collect();
    let advantages = masked_whiten(&returns, mask)?;
    Ok(AdvantagesAndReturns { advantages, returns })
}

pub fn gae(
    token_rewards: &[Vec<f32>],
    values: &[Vec<f32>],
    mask: &[Vec<f32>],
    gamma: f32,
    lambda: f32,
) -> Result<AdvantagesAndReturns> {
    check_same_layout("rewards", token_rewards, "mask", mask)?;
    check_same_layout("values", values, "mask", mask)?;
    let (gamma, lambda) = (gamma as f64, lambda as f64);
    let mut raw_advantages = Vec::with_capacity(mask.len());
    let mut returns = Vec::with_capacity(mask.len());
    for ((rewards, values), mask) in token_rewards.iter().zip(values).zip(mask) {
        let n = rewards.len();
        let (mut adv_row, mut ret_row) = (vec![0f32; n], vec![0f32; n]);
        let (mut next_value, mut next_advantage) = (0f64, 0f64);
        for t in (0..n).rev() {
            if !is_valid(mask[t]) {
                continue;
            }
            let value = values[t] as f64;
            let delta = rewards[t] as f64 + gamma * next_value - value;
            let advantage = delta + gamma * lambda * next_advantage;
            adv_row[t] = advantage as f32;
            ret_row[t] = (advantage + value) as f32;
            next_value = value;
            next_advantage = advantage;
        }
        raw_advantages.push(adv_row);
        returns.push(ret_row);
    }
    let advantages = masked_whiten(&raw_advantages, mask)?;
    Ok(AdvantagesAndReturns { advantages, returns })
}
