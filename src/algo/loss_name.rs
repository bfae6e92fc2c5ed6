//! Losses by name, as callers give them (a name and a JSON config), and back.
//!
//! Names:
//! - a Tinker API name (`cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`) is the
//!   Tinker loss of that name ([`Loss::tinker`]);
//! - an RL-trainer name that Tinker does not use (`regular`, `dual_clip`, `gspo`, `sapo`,
//!   `rollout_is`) is that trainer loss ([`Loss::policy`]);
//! - `policy/NAME` is the trainer loss NAME whatever it is; it is needed for the three names
//!   both families use (`policy/cispo`, `policy/cross_entropy`, `policy/importance_sampling`),
//!   e.g. to add a KL penalty (`kl_coef`) or entropy bonus (`ent_coef`) to them;
//! - `value` is the critic's clipped value loss ([`Loss::value`]).
//!
//! A name is looked up first ([`LossName::lookup`]), then built with its config
//! ([`LossName::build`]); [`Loss::parse`] does both. The config is validated by the loss
//! itself: unknown keys and bad values are errors. [`Loss::qualified_name`] and
//! [`Loss::config`] give back a name and a config that [`Loss::parse`] turns into the same loss.

use serde_json::{json, Value};

use super::config_object::unknown_name;
use super::loss::Loss;
use super::policy_loss::{PolicyLoss, PolicyObjective, RatioAnchor};
use super::surrogate::RatioBand;
use super::tinker_loss::TinkerLoss;
use crate::Result;

/// The trainer names reachable without the `policy/` prefix.
const TRAINER_ONLY: [&str; 5] = ["regular", "dual_clip", "gspo", "sapo", "rollout_is"];

const POLICY_PREFIX: &str = "policy/";

/// A loss looked up by name, before its config: which family, and which loss of it.
/// [`LossName::lookup`] then [`LossName::build`] is [`Loss::parse`], taken apart for callers
/// that tell a bad name from a bad config (the RL config blames different keys for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossName {
    /// A Tinker API loss, one of [`TinkerLoss::NAMES`].
    Tinker(&'static str),
    /// An RL-trainer policy loss, one of [`PolicyLoss::NAMES`].
    Policy(&'static str),
    /// The critic's value loss.
    Value,
}

impl LossName {
    /// The loss called `name` (see the module documentation); an error names the valid names.
    pub fn lookup(name: &str) -> Result<LossName> {
        if name == "value" {
            return Ok(LossName::Value);
        }
        if let Some(trainer_name) = name.strip_prefix(POLICY_PREFIX) {
            return find(&PolicyLoss::NAMES, trainer_name)
                .map(LossName::Policy)
                .ok_or_else(|| unknown_name("policy loss", trainer_name, &PolicyLoss::NAMES));
        }
        if let Some(n) = find(&TinkerLoss::NAMES, name) {
            return Ok(LossName::Tinker(n));
        }
        if let Some(n) = find(&TRAINER_ONLY, name) {
            return Ok(LossName::Policy(n));
        }
        let mut valid: Vec<String> =
            TinkerLoss::NAMES.iter().chain(TRAINER_ONLY.iter()).map(|s| s.to_string()).collect();
        valid.extend(PolicyLoss::NAMES.iter().map(|n| format!("{POLICY_PREFIX}{n}")));
        valid.push("value".into());
        let valid: Vec<&str> = valid.iter().map(String::as_str).collect();
        Err(unknown_name("loss", name, &valid))
    }

    /// This loss with its config (a JSON object or null), validated by the loss itself.
    pub fn build(self, config: &Value) -> Result<Loss> {
        match self {
            LossName::Tinker(name) => Loss::tinker(name, config),
            LossName::Policy(name) => Loss::policy(name, config),
            LossName::Value => Loss::value(config),
        }
    }
}

impl Loss {
    /// The loss `name` with its config (a JSON object or null), validated:
    /// [`LossName::lookup`] then [`LossName::build`].
    pub fn parse(name: &str, config: &Value) -> Result<Loss> {
        LossName::lookup(name)?.build(config)
    }

    /// The name [`Loss::parse`] takes for this loss: [`Loss::name`], with `policy/` in front
    /// of a trainer loss whose name alone would mean the Tinker loss.
    pub fn qualified_name(&self) -> String {
        match self {
            Loss::Policy(p) if !TRAINER_ONLY.contains(&p.name()) => format!("{POLICY_PREFIX}{}", p.name()),
            _ => self.name().to_string(),
        }
    }

    /// Every config key of this loss with its value (defaults written out), such that
    /// `Loss::parse(&self.qualified_name(), &self.config())` is this loss.
    pub fn config(&self) -> Value {
        match self {
            Loss::Tinker(TinkerLoss::CrossEntropy | TinkerLoss::ImportanceSampling) => json!({}),
            Loss::Tinker(TinkerLoss::Ppo { band } | TinkerLoss::Cispo { band }) => {
                json!({"clip_low_threshold": band.low, "clip_high_threshold": band.high})
            }
            Loss::Tinker(TinkerLoss::Dro { beta }) => json!({"beta": beta}),
            Loss::Tinker(TinkerLoss::StableReinforce { ratio_cap, kl_coeff }) => {
                json!({"ratio_cap": ratio_cap, "kl_coeff": kl_coeff})
            }
            Loss::Policy(p) => policy_config(p),
            Loss::Value(v) => json!({"value_clip": v.value_clip}),
        }
    }
}

/// `name` as it is spelt in `names`.
fn find(names: &[&'static str], name: &str) -> Option<&'static str> {
    names.iter().copied().find(|n| *n == name)
}

fn policy_config(p: &PolicyLoss) -> Value {
    // Epsilons are stored as the band `[1 − ε_lo, 1 + ε_hi]`; `1 − (1 − ε)` is exact for the
    // usual ε ≤ 1, so the band survives the round trip.
    let eps = |band: &RatioBand| json!({"eps_clip_low": 1.0 - band.low, "eps_clip_high": band.high - 1.0});
    let mut config = match &p.objective {
        PolicyObjective::Regular { band } | PolicyObjective::Gspo { band } | PolicyObjective::RolloutIs { band } => {
            eps(band)
        }
        PolicyObjective::DualClip { band, clip_ratio_c } => {
            let mut c = eps(band);
            c["clip_ratio_c"] = json!(clip_ratio_c);
            c
        }
        PolicyObjective::Cispo { band, anchor } => {
            let mut c = eps(band);
            c["anchor"] = json!(match anchor {
                RatioAnchor::Old => "old",
                RatioAnchor::Rollout => "rollout",
            });
            c
        }
        PolicyObjective::Sapo { tau_pos, tau_neg } => json!({"tau_pos": tau_pos, "tau_neg": tau_neg}),
        PolicyObjective::CrossEntropy | PolicyObjective::ImportanceSampling => json!({}),
    };
    config["kl_coef"] = json!(p.kl_coef);
    config["kl_estimator"] = json!(p.kl_estimator.name());
    config["ent_coef"] = json!(p.entropy_coef);
    config
}
