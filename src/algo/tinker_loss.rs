//! The Tinker API's losses (server names), per token, before the weight `w`.
//!
//! `lp` = [`LossInputs::learner_logprobs`], `q` = `loss_fn_inputs.logprobs` ([`LossInputs::logprobs`]),
//! `r = exp(lp − q)`:
//!
//! | name | per-token loss | config |
//! |---|---|---|
//! | `cross_entropy` | `−lp` (times `w`, any real, gives Tinker's `−lp·w`) | — |
//! | `importance_sampling` | `−r·A` | — |
//! | `ppo` | `−min(r·A, clamp(r, lo, hi)·A)` | `clip_low_threshold` = 0.8, `clip_high_threshold` = 1.2 |
//! | `cispo` | `−sg(clamp(r, lo, hi))·lp·A` | same thresholds |
//! | `dro` | `−(lp·A − ½·β·(lp − q)²)` | `beta` = 0.05 |
//! | `stable_reinforce` | `−sg(min(r, c))·A·lp + ½·k·(lp − q)²` | `ratio_cap` c = 2, `kl_coeff` k = 0 |
//!
//! `stable_reinforce` is Tinker's name; its exact objective is not public. oxrl's is REINFORCE
//! with truncated importance sampling (TIS, Yao et al. 2025: the gradient `−min(r, c)·A·∇lp`,
//! bounded however far the sampler drifted) plus an optional quadratic pull towards the sampler.
//! The server fills `q` with the log-probs it recorded when it sampled the tokens
//! (`record_stability_info`), never the client's, and `w` with the datum's sampled positions.
//!
//! The worker multiplies by the weights (default 1 on RL datums) and sums. Metrics:
//! `importance_ratio:mean` (the ratio losses), `clip_fraction:mean` (`ppo`, `cispo`).
//! The ratio is a plain `exp`, as in Tinker: no clamping of `lp − q`.

use serde_json::Value;

use super::config_object::{unknown_key, unknown_name, ConfigObject};
use super::loss::{LossInputs, LossOutput, MaskedInputs};
use super::surrogate::{clipped_ratio_policy_gradient, clipped_surrogate, RatioBand};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
pub enum TinkerLoss {
    CrossEntropy,
    ImportanceSampling,
    Ppo { band: RatioBand },
    Cispo { band: RatioBand },
    Dro { beta: f64 },
    StableReinforce { ratio_cap: f64, kl_coeff: f64 },
}

const THRESHOLD_KEYS: [&str; 2] = ["clip_low_threshold", "clip_high_threshold"];

impl TinkerLoss {
    pub const NAMES: [&'static str; 6] =
        ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "stable_reinforce"];

    /// The loss `name` with its `loss_fn_config` (a JSON object or null), validated.
    pub fn from_config(name: &str, config: &Value) -> Result<Self> {
        let keys = config_keys(name).ok_or_else(|| unknown_name("loss", name, &Self::NAMES))?;
        let c = ConfigObject::new(owner(name), config, keys)?;
        match name {
            "cross_entropy" => Ok(Self::CrossEntropy),
            "importance_sampling" => Ok(Self::ImportanceSampling),
            "ppo" => Ok(Self::Ppo { band: thresholds(&c)? }),
            "cispo" => Ok(Self::Cispo { band: thresholds(&c)? }),
            "dro" => {
                // Tinker documents `beta` as settable but not its default; 0.05 is the value its
                // documentation's example uses, and the cookbook sends none.
                let beta = c.f64_or("beta", 0.05)?;
                if beta < 0.0 {
                    return Err(crate::Error::input(format!("loss `dro`: beta must be non-negative (got {beta})")));
                }
                Ok(Self::Dro { beta })
            }
            "stable_reinforce" => {
                let (ratio_cap, kl_coeff) = (c.f64_or("ratio_cap", 2.0)?, c.f64_or("kl_coeff", 0.0)?);
                if ratio_cap <= 0.0 || kl_coeff < 0.0 {
                    return Err(crate::Error::input(format!(
                        "loss `stable_reinforce`: ratio_cap must be positive and kl_coeff non-negative \
                         (got {ratio_cap}, {kl_coeff})"
                    )));
                }
                Ok(Self::StableReinforce { ratio_cap, kl_coeff })
            }
            _ => unreachable!("config_keys knows only the names above"),
        }
    }

    /// The error [`from_config`](Self::from_config) gives for a config key `key` that this
    /// loss does not take.
    pub fn unknown_key(&self, key: &str) -> crate::Error {
        let name = self.name();
        unknown_key(&owner(name), key, config_keys(name).unwrap_or_default())
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::CrossEntropy => "cross_entropy",
            Self::ImportanceSampling => "importance_sampling",
            Self::Ppo { .. } => "ppo",
            Self::Cispo { .. } => "cispo",
            Self::Dro { .. } => "dro",
            Self::StableReinforce { .. } => "stable_reinforce",
        }
    }

    pub fn compute(&self, inputs: &LossInputs) -> Result<LossOutput> {
        let mut x = MaskedInputs::new(self.name(), inputs, &inputs.learner_logprobs)?;
        let lp = x.required("learner_logprobs", &inputs.learner_logprobs)?;
        let loss = match self {
            Self::CrossEntropy => lp.neg()?,
            Self::ImportanceSampling => {
                let (ratio, adv) = ratio_and_advantages(&x, inputs, &lp)?;
                x.mean_metric("importance_ratio", &ratio)?;
                (ratio * adv)?.neg()?
            }
            Self::Ppo { band } => {
                let (ratio, adv) = ratio_and_advantages(&x, inputs, &lp)?;
                let (loss, clip_active) = clipped_surrogate(&ratio, &adv, *band)?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("clip_fraction", &clip_active)?;
                loss
            }
            Self::Cispo { band } => {
                let (ratio, adv) = ratio_and_advantages(&x, inputs, &lp)?;
                let (loss, clip_active) = clipped_ratio_policy_gradient(&ratio, &lp, &adv, *band)?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("clip_fraction", &clip_active)?;
                loss
            }
            Self::Dro { beta } => {
                let q = x.required("logprobs", &inputs.logprobs)?;
                let adv = x.required("advantages", &inputs.advantages)?;
                let penalty = ((&lp - q)?.sqr()? * (0.5 * beta))?;
                ((&lp * adv)? - penalty)?.neg()?
            }
            Self::StableReinforce { ratio_cap, kl_coeff } => {
                let (ratio, adv) = ratio_and_advantages(&x, inputs, &lp)?;
                let q = x.required("logprobs", &inputs.logprobs)?;
                let capped = ratio.clamp(0.0, *ratio_cap)?.detach();
                let capped_at = ratio.ge(*ratio_cap)?.to_dtype(ratio.dtype())?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("ratio_capped_fraction", &capped_at)?;
                let pull = ((&lp - q)?.sqr()? * (0.5 * kl_coeff))?;
                ((capped * adv)? * &lp)?.neg()?.add(&pull)?
            }
        };
        x.finish(&loss)
    }
}

/// The config keys of the loss `name`; `None` when there is no such loss.
fn config_keys(name: &str) -> Option<&'static [&'static str]> {
    Some(match name {
        "cross_entropy" | "importance_sampling" => &[],
        "ppo" | "cispo" => &THRESHOLD_KEYS,
        "dro" => &["beta"],
        "stable_reinforce" => &["ratio_cap", "kl_coeff"],
        _ => return None,
    })
}

/// Who a config error is about.
fn owner(name: &str) -> String {
    format!("loss `{name}`")
}

fn thresholds(config: &ConfigObject) -> Result<RatioBand> {
    RatioBand::new(config.f64_or("clip_low_threshold", 0.8)?, config.f64_or("clip_high_threshold", 1.2)?)
}

/// `(r = exp(lp − q), A)`, both masked.
fn ratio_and_advantages(
    x: &MaskedInputs,
    inputs: &LossInputs,
    lp: &candle_core::Tensor,
) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
    let q = x.required("logprobs", &inputs.logprobs)?;
    let adv = x.required("advantages", &inputs.advantages)?;
    Ok(((lp - q)?.exp()?, adv))
}
