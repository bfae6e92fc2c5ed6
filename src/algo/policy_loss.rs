//! The RL trainer's policy losses, per token, before the weight `w`.
//!
//! `lp` the learner's log-probs ([`LossInputs::learner_logprobs`]), `old` the ratio anchor
//! ([`LossInputs::logprobs`], the datum's `logprobs`), `roll` the sampler's
//! ([`LossInputs::rollout_logprobs`]), `ref` the reference policy's ([`LossInputs::ref_logprobs`]).
//! `r = exp(lp − old)` unless said otherwise, `A` advantages, `sg` stop-gradient:
//! - `regular`: `−min(r·A, clamp(r, 1−ε_lo, 1+ε_hi)·A)`; config `eps_clip_low` = `eps_clip_high`
//!   = 0.2. Metric `clip_fraction:mean`: tokens where the clamped term is strictly chosen.
//! - `dual_clip`: `regular`, then where `A < 0`: `min(−A·c, loss)`; config adds `clip_ratio_c`
//!   = 3 (> 1). Metric `dual_clip_fraction:mean`: tokens where `−A·c` is strictly chosen.
//! - `gspo`: `s_i = masked_mean_t(lp − old)` over sequence i (needs `sequence_ids`);
//!   `log r_t = min(lp_t − sg(lp_t) + sg(s_i), 10)`, then the `regular` surrogate with that `r`
//!   (a sequence-level ratio with a token-level gradient). Same config as `regular`.
//! - `cispo`: `−A · sg(clamp(r, 1−ε_lo, 1+ε_hi)) · lp` with `eps_clip_low` = 1.0,
//!   `eps_clip_high` = 4.0, and `anchor` = `"old"` (r against `old`) or `"rollout"` (against
//!   `roll`).
//! - `sapo`: `r = safe_exp(lp − old)`, `τ = tau_pos` (1.0) if `A > 0` else `tau_neg` (1.05),
//!   loss `−σ(τ(r−1)) · (4/τ) · A`; `σ(x)` computed as `½(1 + tanh(x/2))` (no overflow).
//! - `rollout_is`: `r = exp(lp − roll)`; `−sg(r · 1[1−ε_lo < r < 1+ε_hi]) · A · lp`, with
//!   `eps_clip_low` = `eps_clip_high` = 0.2 (algorithms.md gives no default; this is ours).
//!   `clip_fraction:mean` counts the tokens masked out.
//! - `cross_entropy`: `−lp`. `importance_sampling`: `−exp(lp − old) · A`.
//!
//! Every loss also accepts `kl_coef` (0 = off), `kl_estimator` (`k1`, `k2`, `k3` (default),
//! `abs`) and `ent_coef` (0 = off): the per-token loss gets `+ kl_coef · k(lp, ref)` (needs
//! `ref_logprobs`) and `− ent_coef · H_t` (needs `entropy`). `kl:mean` is reported whenever
//! `ref_logprobs` are given, `entropy:mean` whenever `entropy` is; `importance_ratio:mean` for
//! every ratio-based loss.

use candle_core::{DType, Tensor};
use serde_json::Value;

use super::config_object::{unknown_name, ConfigObject};
use super::kl::KlEstimator;
use super::loss::{missing_input, LossInputs, LossOutput, MaskedInputs};
use super::masking::safe_exp;
use super::surrogate::{clipped_ratio_policy_gradient, clipped_surrogate, masked_ratio_policy_gradient, RatioBand};
use crate::{Error, Result};

/// Which log-probs the `cispo` ratio is taken against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RatioAnchor {
    Old,
    Rollout,
}

/// The policy-gradient part of a trainer loss.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyObjective {
    Regular { band: RatioBand },
    DualClip { band: RatioBand, clip_ratio_c: f64 },
    Gspo { band: RatioBand },
    Cispo { band: RatioBand, anchor: RatioAnchor },
    Sapo { tau_pos: f64, tau_neg: f64 },
    RolloutIs { band: RatioBand },
    CrossEntropy,
    ImportanceSampling,
}

/// A trainer policy loss: objective plus optional KL penalty and entropy bonus.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyLoss {
    pub objective: PolicyObjective,
    /// `kl_coef` (0 = no KL term).
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    /// `ent_coef` (0 = no entropy bonus).
    pub entropy_coef: f64,
}

const COMMON_KEYS: [&str; 3] = ["kl_coef", "kl_estimator", "ent_coef"];

impl PolicyLoss {
    pub const NAMES: [&'static str; 8] =
        ["regular", "dual_clip", "gspo", "cispo", "sapo", "rollout_is", "cross_entropy", "importance_sampling"];

    /// The loss `name` with its config (a JSON object or null), validated.
    pub fn from_config(name: &str, config: &Value) -> Result<Self> {
        let specific: &[&str] = match name {
            "regular" | "gspo" | "rollout_is" => &["eps_clip_low", "eps_clip_high"],
            "dual_clip" => &["eps_clip_low", "eps_clip_high", "clip_ratio_c"],
            "cispo" => &["eps_clip_low", "eps_clip_high", "anchor"],
            "sapo" => &["tau_pos", "tau_neg"],
            "cross_entropy" | "importance_sampling" => &[],
            _ => return Err(unknown_name("policy loss", name, &Self::NAMES)),
        };
        let allowed: Vec<&str> = specific.iter().chain(COMMON_KEYS.iter()).copied().collect();
        let c = ConfigObject::new(format!("policy loss `{name}`"), config, &allowed)?;
        let band = |eps_low: f64, eps_high: f64| -> Result<RatioBand> {
            RatioBand::around_one(c.f64_or("eps_clip_low", eps_low)?, c.f64_or("eps_clip_high", eps_high)?)
        };
        let objective = match name {
            "regular" => PolicyObjective::Regular { band: band(0.2, 0.2)? },
            "gspo" => PolicyObjective::Gspo { band: band(0.2, 0.2)? },
            "rollout_is" => PolicyObjective::RolloutIs { band: band(0.2, 0.2)? },
            "dual_clip" => {
                let clip_ratio_c = c.f64_or("clip_ratio_c", 3.0)?;
                if clip_ratio_c <= 1.0 {
                    return Err(c.invalid("clip_ratio_c", format!("must be > 1, got {clip_ratio_c}")));
                }
                PolicyObjective::DualClip { band: band(0.2, 0.2)?, clip_ratio_c }
            }
            "cispo" => {
                let anchor = match c.optional_str("anchor")?.unwrap_or("old") {
                    "old" => RatioAnchor::Old,
                    "rollout" => RatioAnchor::Rollout,
                    other => return Err(c.invalid("anchor", format!("`{other}` is not `old` or `rollout`"))),
                };
                PolicyObjective::Cispo { band: band(1.0, 4.0)?, anchor }
            }
            "sapo" => {
                let tau_pos = c.f64_or("tau_pos", 1.0)?;
                let tau_neg = c.f64_or("tau_neg", 1.05)?;
                if tau_pos <= 0.0 || tau_neg <= 0.0 {
                    return Err(Error::input(format!(
                        "policy loss `sapo`: tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}"
                    )));
                }
                PolicyObjective::Sapo { tau_pos, tau_neg }
            }
            "cross_entropy" => PolicyObjective::CrossEntropy,
            _ => PolicyObjective::ImportanceSampling,
        };
        let kl_estimator = match c.optional_str("kl_estimator")? {
            Some(estimator) => KlEstimator::from_name(estimator).map_err(crate::Error::input)?,
            None => KlEstimator::K3,
        };
        Ok(PolicyLoss {
            objective,
            kl_coef: c.f64_or("kl_coef", 0.0)?,
            kl_estimator,
            entropy_coef: c.f64_or("ent_coef", 0.0)?,
        })
    }

    pub fn name(&self) -> &'static str {
        match self.objective {
            PolicyObjective::Regular { .. } => "regular",
            PolicyObjective::DualClip { .. } => "dual_clip",
            PolicyObjective::Gspo { .. } => "gspo",
            PolicyObjective::Cispo { .. } => "cispo",
            PolicyObjective::Sapo { .. } => "sapo",
            PolicyObjective::RolloutIs { .. } => "rollout_is",
            PolicyObjective::CrossEntropy => "cross_entropy",
            PolicyObjective::ImportanceSampling => "importance_sampling",
        }
    }

    pub fn compute(&self, inputs: &LossInputs) -> Result<LossOutput> {
        let mut x = MaskedInputs::new(self.name(), inputs, &inputs.learner_logprobs)?;
        let lp = x.required("learner_logprobs", &inputs.learner_logprobs)?;
        let mut loss = self.objective_loss(&mut x, inputs, &lp)?;

        if let Some(ref_lp) = x.optional("ref_logprobs", &inputs.ref_logprobs)? {
            let kl = self.kl_estimator.per_token(&lp, &ref_lp, &x.mask)?;
            x.mean_metric("kl", &kl)?;
            if self.kl_coef != 0.0 {
                loss = (loss + (kl * self.kl_coef)?)?;
            }
        } else if self.kl_coef != 0.0 {
            return Err(missing_input(self.name(), "ref_logprobs"));
        }

        if let Some(entropy) = x.optional("entropy", &inputs.entropy)? {
            x.mean_metric("entropy", &entropy)?;
            if self.entropy_coef != 0.0 {
                loss = (loss - (entropy * self.entropy_coef)?)?;
            }
        } else if self.entropy_coef != 0.0 {
            return Err(missing_input(self.name(), "entropy"));
        }
        x.finish(&loss)
    }

    fn objective_loss(&self, x: &mut MaskedInputs, inputs: &LossInputs, lp: &Tensor) -> Result<Tensor> {
        let name = self.name();
        let need = |t: Option<Tensor>, field: &str| t.ok_or_else(|| missing_input(name, field));
        let old = x.optional("logprobs", &inputs.logprobs)?;
        let roll = x.optional("rollout_logprobs", &inputs.rollout_logprobs)?;
        let advantages = x.optional("advantages", &inputs.advantages)?;
        let loss = match &self.objective {
            PolicyObjective::CrossEntropy => return Ok(lp.neg()?),
            PolicyObjective::ImportanceSampling => {
                let ratio = (lp - need(old, "logprobs")?)?.exp()?;
                x.mean_metric("importance_ratio", &ratio)?;
                (ratio * need(advantages, "advantages")?)?.neg()?
            }
            PolicyObjective::Regular { band } => {
                let ratio = (lp - need(old, "logprobs")?)?.exp()?;
                let (loss, clip_active) = clipped_surrogate(&ratio, &need(advantages, "advantages")?, *band)?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("clip_fraction", &clip_active)?;
                loss
            }
            PolicyObjective::DualClip { band, clip_ratio_c } => {
                let advantages = need(advantages, "advantages")?;
                let ratio = (lp - need(old, "logprobs")?)?.exp()?;
                let (loss, clip_active) = clipped_surrogate(&ratio, &advantages, *band)?;
                let (loss, dual_clip_active) = dual_clip(&loss, &advantages, *clip_ratio_c)?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("clip_fraction", &clip_active)?;
                x.mean_metric("dual_clip_fraction", &dual_clip_active)?;
                loss
            }
            PolicyObjective::Gspo { band } => {
                let old = need(old, "logprobs")?;
                let ids = need(inputs.sequence_ids.clone(), "sequence_ids")?;
                x.check_shape("sequence_ids", &ids)?;
                let ratio = sequence_level_ratio(lp, &old, &ids, &x.mask)?;
                let (loss, clip_active) = clipped_surrogate(&ratio, &need(advantages, "advantages")?, *band)?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("clip_fraction", &clip_active)?;
                loss
            }
            PolicyObjective::Cispo { band, anchor } => {
                let anchor_lp = match anchor {
                    RatioAnchor::Old => need(old, "logprobs")?,
                    RatioAnchor::Rollout => need(roll, "rollout_logprobs")?,
                };
                let ratio = (lp - anchor_lp)?.exp()?;
                let advantages = need(advantages, "advantages")?;
                let (loss, clip_active) = clipped_ratio_policy_gradient(&ratio, lp, &advantages, *band)?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("clip_fraction", &clip_active)?;
                loss
            }
            PolicyObjective::Sapo { tau_pos, tau_neg } => {
                let ratio = safe_exp(&(lp - need(old, "logprobs")?)?)?;
                x.mean_metric("importance_ratio", &ratio)?;
                soft_adaptive_policy_loss(&ratio, &need(advantages, "advantages")?, *tau_pos, *tau_neg)?
            }
            PolicyObjective::RolloutIs { band } => {
                let ratio = (lp - need(roll, "rollout_logprobs")?)?.exp()?;
                let advantages = need(advantages, "advantages")?;
                let (loss, mask_active) = masked_ratio_policy_gradient(&ratio, lp, &advantages, *band)?;
                x.mean_metric("importance_ratio", &ratio)?;
                x.mean_metric("clip_fraction", &mask_active)?;
                loss
            }
        };
        Ok(loss)
    }
}

/// Where `A < 0`: `min(−A·c, loss)`. Returns the loss and where `−A·c` is strictly chosen.
fn dual_clip(loss: &Tensor, advantages: &Tensor, c: f64) -> Result<(Tensor, Tensor)> {
    let negative = advantages.lt(0f64)?;
    let bound = (advantages * (-c))?;
    let bounded = loss.minimum(&bound)?;
    let active = negative.mul(&bound.lt(&loss.detach())?)?;
    Ok((negative.where_cond(&bounded, loss)?, active))
}

/// GSPO's ratio: `exp(min(lp − sg(lp) + sg(s_seq), 10))` with `s_seq` the masked mean of
/// `lp − old` over the token's sequence. Inputs already masked (0 at masked positions).
fn sequence_level_ratio(lp: &Tensor, old: &Tensor, sequence_ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let shape = lp.shape().clone();
    if shape.elem_count() == 0 {
        return Ok(lp.ones_like()?);
    }
    let n = shape.elem_count();
    let ids = sequence_ids.to_dtype(DType::U32)?.reshape(n)?.contiguous()?;
    let log_ratio = (lp - old)?.detach().reshape(n)?;
    let mask = mask.to_dtype(lp.dtype())?.reshape(n)?;
    let num_sequences = ids.max(0)?.to_scalar::<u32>()? as usize + 1;
    let zeros = Tensor::zeros(num_sequences, lp.dtype(), lp.device())?;
    let sums = zeros.index_add(&ids, &log_ratio, 0)?;
    let counts = zeros.index_add(&ids, &mask, 0)?.maximum(1f64)?;
    let sequence_mean = (sums / counts)?.index_select(&ids, 0)?.reshape(&shape)?;
    let log_ratio = ((lp - lp.detach())? + sequence_mean)?.minimum(10f64)?;
    Ok(log_ratio.exp()?)
}

/// SAPO: `−σ(τ(r−1)) · (4/τ) · A`, `τ = tau_pos` where `A > 0`, else `tau_neg`.
fn soft_adaptive_policy_loss(ratio: &Tensor, advantages: &Tensor, tau_pos: f64, tau_neg: f64) -> Result<Tensor> {
    let positive = advantages.gt(0f64)?;
    let tau = positive.where_cond(
        &Tensor::full(tau_pos, ratio.shape(), ratio.device())?.to_dtype(ratio.dtype())?,
        &Tensor::full(tau_neg, ratio.shape(), ratio.device())?.to_dtype(ratio.dtype())?,
    )?;
    let gate = sigmoid(&((ratio - 1.0)? * &tau)?)?;
    Ok(((gate * 4.0)? / tau)?.mul(advantages)?.neg()?)
}

/// `σ(x) = ½(1 + tanh(x/2))`, finite with a finite gradient for every finite x.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(((x * 0.5)?.tanh()? + 1.0)?.affine(0.5, 0.0)?)
}
