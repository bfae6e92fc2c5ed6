//! An RL config built into what a run uses: the step recipe (advantage, reduction, KL,
//! off-policy correction), the policy and critic losses and the KL controller, each built once
//! from its section of the config ([`RlConfig::plan`]); [`RlConfig::validate`] runs the same
//! builders, so that a run that starts never meets a config error later.

use serde_json::Value as Json;

use super::config::{toml_to_json, DynamicSampling, RlConfig};
use super::group::GroupFilter;
use super::step::StepRecipe;
use crate::algo::{
    AdaptiveKlController, AdvantageEstimator, AdvantageKind, KlController, KlEstimator, Loss, LossName, LossReduction,
    OffPolicyCorrection,
};
use crate::{Error, Result};

/// An RL config built into what a run uses ([`RlConfig::plan`]); nothing in it is parsed again.
#[derive(Clone, Debug)]
pub struct RlPlan {
    /// How episodes become datums; its `kl_coef` is the initial coefficient.
    pub recipe: StepRecipe,
    /// The policy loss, with the initial KL coefficient when the KL term is in the loss.
    pub loss: Loss,
    /// The critic's loss, when a critic is trained (GAE).
    pub value_loss: Option<Loss>,
    /// The KL coefficient over the run (fixed or adaptive).
    pub kl: KlController,
}

/// Why the policy loss could not be built ([`RlConfig::build_loss`]), by the part of the
/// config at fault.
pub(super) enum LossFault {
    /// `algorithm.loss` names no loss.
    Name(Error),
    /// `algorithm.loss_config` is not a config of that loss.
    Config(Error),
    /// The loss takes no KL term, which `algorithm.kl` puts in it.
    KlTerm(Error),
}

impl LossFault {
    fn into_error(self) -> Error {
        match self {
            LossFault::Name(e) | LossFault::Config(e) | LossFault::KlTerm(e) => e,
        }
    }
}

impl RlConfig {
    /// The policy loss: `algorithm.loss` with `algorithm.loss_config`, and the KL term
    /// (`kl_coef` = `algorithm.kl.coef`, `kl_estimator`) when the KL penalty is in the loss.
    pub fn loss(&self) -> Result<Loss> {
        self.loss_with_kl_coef(self.algorithm.kl.coef)
    }

    /// [`loss`](Self::loss) with the KL coefficient `kl_coef` (the adaptive controller's
    /// current one); no KL term when the penalty is in the reward or `kl_coef` is 0.
    pub fn loss_with_kl_coef(&self, kl_coef: f64) -> Result<Loss> {
        self.build_loss(kl_coef).map_err(LossFault::into_error)
    }

    /// The one builder of the policy loss: the name looked up once, the config parsed once,
    /// then the KL term added; an error says which of the three refused, so that validation
    /// can name the config key at fault.
    pub(super) fn build_loss(&self, kl_coef: f64) -> std::result::Result<Loss, LossFault> {
        let a = &self.algorithm;
        let name = LossName::lookup(&a.loss).map_err(LossFault::Name)?;
        let loss = name.build(&toml_to_json(&a.loss_config)).map_err(LossFault::Config)?;
        if kl_coef > 0.0 && !a.kl.in_reward {
            return loss.with_kl_term(kl_coef, a.kl.estimator).map_err(LossFault::KlTerm);
        }
        Ok(loss)
    }

    /// The critic's loss: the clipped value loss with `critic.value_clip`.
    pub fn value_loss(&self) -> Result<Loss> {
        Loss::value(&serde_json::json!({ "value_clip": self.critic.value_clip }))
    }

    /// The advantage estimator, with the keys it takes among `norm_by_std`, `gamma`, `lambda`.
    pub fn advantage(&self) -> Result<AdvantageEstimator> {
        let a = &self.algorithm;
        let config = match a.advantage {
            AdvantageKind::Grpo => serde_json::json!({ "norm_by_std": a.norm_by_std }),
            AdvantageKind::ReinforcePlusPlus => serde_json::json!({ "gamma": a.gamma }),
            AdvantageKind::Gae => serde_json::json!({ "gamma": a.gamma, "lambda": a.lambda }),
            AdvantageKind::Rloo => Json::Null,
        };
        AdvantageEstimator::of(a.advantage, &config)
    }

    /// The loss reduction (`max_seq_len` 0 is unset).
    pub fn reduction(&self) -> Result<LossReduction> {
        let a = &self.algorithm;
        LossReduction::of(a.reduction, (a.max_seq_len > 0).then_some(a.max_seq_len))
    }

    /// The KL estimator of `algorithm.kl.estimator`.
    pub fn kl_estimator(&self) -> Result<KlEstimator> {
        Ok(self.algorithm.kl.estimator)
    }

    /// The KL coefficient over the run: fixed, or adaptive toward `kl.target`.
    pub fn kl_controller(&self) -> Result<KlController> {
        let kl = &self.algorithm.kl;
        Ok(if kl.adaptive {
            KlController::Adaptive(AdaptiveKlController::new(kl.coef, kl.target, kl.horizon)?)
        } else {
            KlController::Fixed(kl.coef)
        })
    }

    /// The off-policy correction; `None` when `algorithm.off_policy` is empty.
    pub fn off_policy(&self) -> Result<Option<OffPolicyCorrection>> {
        let table = &self.algorithm.off_policy;
        if table.is_empty() {
            return Ok(None);
        }
        OffPolicyCorrection::from_config(&toml_to_json(table)).map(Some)
    }

    /// What a run needs of the config, built once when it opens: the step recipe (advantage,
    /// reduction, KL, off-policy correction), the policy loss, the critic's loss and the KL
    /// controller. [`validate`](Self::validate) has run the same builders.
    pub fn plan(&self) -> Result<RlPlan> {
        let a = &self.algorithm;
        Ok(RlPlan {
            recipe: StepRecipe {
                advantage: self.advantage()?,
                reduction: self.reduction()?,
                kl_coef: a.kl.coef,
                kl_estimator: self.kl_estimator()?,
                kl_in_reward: a.kl.in_reward,
                off_policy: self.off_policy()?,
            },
            loss: self.loss()?,
            value_loss: if self.needs_critic() { Some(self.value_loss()?) } else { None },
            kl: self.kl_controller()?,
        })
    }

    /// Which groups are dropped before training (`zero_variance_filter`, `dynamic_sampling`).
    pub fn group_filter(&self) -> GroupFilter {
        let a = &self.algorithm;
        GroupFilter {
            equal_rewards: a.zero_variance_filter,
            equal_verdicts: a.dynamic_sampling != DynamicSampling::None,
        }
    }
}
