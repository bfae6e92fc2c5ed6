//! KL penalty in the rewards, and its coefficient controller.
//!
//! - Penalty ([`apply_kl_penalty_to_rewards`]): `r_t −= coef · kl_t` at valid tokens, with
//!   `kl_t` an estimator ([`KlEstimator`]) of `lp_t` (the sampling / old policy) against
//!   `ref_t`. It also returns the batch KL used to drive the controller: the mean over
//!   sequences of each sequence's masked-mean `kl_t` (sequences without valid tokens count 0).
//! - Adaptive coefficient ([`AdaptiveKlController`]):
//!   `coef *= 1 + clip(kl / target − 1, −0.2, 0.2) · n / horizon`, with `n` the number of
//!   samples (steps) the KL was measured over. [`KlController::Fixed`] keeps `coef`.

use super::kl::KlEstimator;
use super::rows::{check_same_layout, is_valid};
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveKlController {
    pub coef: f64,
    pub target: f64,
    pub horizon: f64,
}

impl AdaptiveKlController {
    pub fn new(initial_coef: f64, target: f64, horizon: f64) -> Result<Self> {
        if !(target > 0.0 && horizon > 0.0) {
            return Err(Error::input(format!(
                "adaptive KL controller needs target > 0 and horizon > 0, got {target}, {horizon}"
            )));
        }
        Ok(AdaptiveKlController { coef: initial_coef, target, horizon })
    }

    /// `coef *= 1 + clip(current_kl / target − 1, −0.2, 0.2) · n_steps / horizon`.
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        let proportional_error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
        self.coef *= 1.0 + proportional_error * n_steps as f64 / self.horizon;
    }
}

/// A fixed or adaptive KL coefficient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KlController {
    Fixed(f64),
    Adaptive(AdaptiveKlController),
}

impl KlController {
    pub fn coef(&self) -> f64 {
        match self {
            KlController::Fixed(coef) => *coef,
            KlController::Adaptive(controller) => controller.coef,
        }
    }

    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if let KlController::Adaptive(controller) = self {
            controller.update(current_kl, n_steps);
        }
    }
}

/// Rewards with `coef · kl_t` subtracted at valid tokens, and the batch KL (see module docs).
pub fn apply_kl_penalty_to_rewards(
    token_rewards: &[Vec<f32>],
    logprobs: &[Vec<f32>],
    ref_logprobs: &[Vec<f32>],
    mask: &[Vec<f32>],
    coef: f64,
    estimator: KlEstimator,
) -> Result<(Vec<Vec<f32>>, f64)> {
    check_same_layout("rewards", token_rewards, "mask", mask)?;
    check_same_layout("logprobs", logprobs, "mask", mask)?;
    check_same_layout("ref_logprobs", ref_logprobs, "mask", mask)?;
    let mut penalised = Vec::with_capacity(mask.len());
    let mut sequence_kl_sum = 0.0;
    for i in 0..mask.len() {
        let (mut kl_sum, mut count) = (0.0, 0.0);
        let row: Vec<f32> = (0..mask[i].len())
            .map(|t| {
                if !is_valid(mask[i][t]) {
                    return token_rewards[i][t];
                }
                let kl = estimator.estimate(logprobs[i][t] as f64, ref_logprobs[i][t] as f64);
                kl_sum += kl;
                count += 1.0;
                (token_rewards[i][t] as f64 - coef * kl) as f32
            })
            .collect();
        if count > 0.0 {
            sequence_kl_sum += kl_sum / count;
        }
        penalised.push(row);
    }
    let batch_kl = if mask.is_empty() { 0.0 } else { sequence_kl_sum / mask.len() as f64 };
    Ok((penalised, batch_kl))
}
