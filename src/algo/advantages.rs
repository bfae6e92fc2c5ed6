//! Advantage estimators by name, for trainer configs.
//!
//! | name | config | computes |
//! |---|---|---|
//! | `grpo` | `norm_by_std` (bool, default true) | [`grpo_advantages`] of the sequence scores, broadcast over the mask |
//! | `rloo` | — | [`rloo_advantages`], broadcast over the mask |
//! | `reinforce++` | `gamma` (1.0) | [`reinforce_plus_plus`] |
//! | `gae` | `gamma` (1.0), `lambda` (1.0) | [`gae`] (needs values) |
//!
//! For the outcome estimators (`grpo`, `rloo`) the returns are the advantages.

use std::hash::Hash;

use serde_json::Value;

use super::config_object::ConfigObject;
use super::discounted_returns::{gae, reinforce_plus_plus, AdvantagesAndReturns};
use super::group_advantages::{broadcast_over_mask, grpo_advantages, rloo_advantages, sequence_scores};
use crate::{Error, Result};

crate::choice! {
    /// Which advantage estimator (what a run config names; [`AdvantageEstimator::of`] builds it
    /// with its settings).
    pub enum AdvantageKind("advantage estimator") {
        Grpo = "grpo",
        Rloo = "rloo",
        ReinforcePlusPlus = "reinforce++",
        /// Trains a critic.
        Gae = "gae",
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AdvantageEstimator {
    Grpo { norm_by_std: bool },
    Rloo,
    ReinforcePlusPlus { gamma: f32 },
    Gae { gamma: f32, lambda: f32 },
}

impl AdvantageEstimator {
    /// The estimator called `name`, with the settings of `config`.
    pub fn from_config(name: &str, config: &Value) -> Result<Self> {
        Self::of(AdvantageKind::from_name(name).map_err(Error::input)?, config)
    }

    /// The estimator `kind`, with the settings of `config` (the keys it takes, and no others).
    pub fn of(kind: AdvantageKind, config: &Value) -> Result<Self> {
        let owner = format!("advantage estimator `{kind}`");
        match kind {
            AdvantageKind::Grpo => {
                let c = ConfigObject::new(owner, config, &["norm_by_std"])?;
                let norm_by_std = match config.get("norm_by_std") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => return Err(c.invalid("norm_by_std", format!("must be a boolean, got {other}"))),
                };
                Ok(Self::Grpo { norm_by_std })
            }
            AdvantageKind::Rloo => {
                ConfigObject::new(owner, config, &[])?;
                Ok(Self::Rloo)
            }
            AdvantageKind::ReinforcePlusPlus => {
                let c = ConfigObject::new(owner, config, &["gamma"])?;
                Ok(Self::ReinforcePlusPlus { gamma: c.f64_or("gamma", 1.0)? as f32 })
            }
            AdvantageKind::Gae => {
                let c = ConfigObject::new(owner, config, &["gamma", "lambda"])?;
                Ok(Self::Gae { gamma: c.f64_or("gamma", 1.0)? as f32, lambda: c.f64_or("lambda", 1.0)? as f32 })
            }
        }
    }

    /// Advantages and returns for a batch: token rewards, critic values (GAE only), mask, and
    /// one group id per sequence (GRPO, RLOO).
    pub fn compute<G: Eq + Hash>(
        &self,
        token_rewards: &[Vec<f32>],
        values: Option<&[Vec<f32>]>,
        mask: &[Vec<f32>],
        groups: &[G],
    ) -> Result<AdvantagesAndReturns> {
        let outcome = |per_sequence: Vec<f32>| -> Result<AdvantagesAndReturns> {
            let advantages = broadcast_over_mask(&per_sequence, mask)?;
            Ok(AdvantagesAndReturns { returns: advantages.clone(), advantages })
        };
        match *self {
            Self::Grpo { norm_by_std } => {
                outcome(grpo_advantages(&sequence_scores(token_rewards), groups, norm_by_std)?)
            }
            Self::Rloo => outcome(rloo_advantages(&sequence_scores(token_rewards), groups)?),
            Self::ReinforcePlusPlus { gamma } => reinforce_plus_plus(token_rewards, mask, gamma),
            Self::Gae { gamma, lambda } => {
                let values = values.ok_or_else(|| Error::input("advantage estimator `gae` needs critic values"))?;
                gae(token_rewards, values, mask, gamma, lambda)
            }
        }
    }
}
