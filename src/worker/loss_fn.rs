//! Losses by name, as the worker's callers give them, and the datum fields each one needs.
//!
//! Names (the families are in `algo`):
//! - a Tinker API name (`cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`) is the
//!   Tinker loss of that name ([`Loss::tinker`]);
//! - an RL-trainer name that Tinker does not use (`regular`, `dual_clip`, `gspo`, `sapo`,
//!   `rollout_is`) is that trainer loss ([`Loss::policy`]);
//! - `policy/NAME` is the trainer loss NAME whatever it is, for the three names both families
//!   use (`policy/cispo`, `policy/cross_entropy`, `policy/importance_sampling`) and for any
//!   trainer loss with a KL penalty (`kl_coef`) or entropy bonus (`ent_coef`);
//! - `value` is the critic's clipped value loss ([`Loss::value`]), for critic workers only.
//!
//! The config is validated by the loss itself: unknown keys and bad values are errors.

use serde_json::Value;

use super::batch::{FloatField, Requirements};
use crate::algo::config::unknown_name;
use crate::algo::{Loss, PolicyLoss, PolicyObjective, TinkerLoss};
use crate::Result;

/// The trainer names reachable without the `policy/` prefix.
const TRAINER_ONLY: [&str; 5] = ["regular", "dual_clip", "gspo", "sapo", "rollout_is"];

/// The loss `name` with its config, validated.
pub fn resolve_loss(name: &str, config: &Value) -> Result<Loss> {
    if name == "value" {
        return Loss::value(config);
    }
    if let Some(trainer_name) = name.strip_prefix("policy/") {
        return Loss::policy(trainer_name, config);
    }
    if TinkerLoss::NAMES.contains(&name) {
        return Loss::tinker(name, config);
    }
    if TRAINER_ONLY.contains(&name) {
        return Loss::policy(name, config);
    }
    let mut valid: Vec<String> = TinkerLoss::NAMES.iter().chain(TRAINER_ONLY.iter()).map(|s| s.to_string()).collect();
    valid.extend(PolicyLoss::NAMES.iter().map(|n| format!("policy/{n}")));
    valid.push("value".into());
    let valid: Vec<&str> = valid.iter().map(String::as_str).collect();
    Err(unknown_name("loss", name, &valid))
}

/// Whether the loss wants the learner's per-token entropy (an entropy bonus is configured).
pub fn needs_entropy(loss: &Loss) -> bool {
    matches!(loss, Loss::Policy(p) if p.entropy_coef != 0.0)
}

/// The datum fields the loss reads. `rollout_logprobs` is never required: when absent the
/// worker uses `logprobs` in its place (one policy sampled and anchors the ratio), so ratio
/// losses always need `logprobs`.
pub fn requirements(loss: &Loss) -> Requirements {
    use FloatField::*;
    let floats = match loss {
        Loss::Value(_) => vec![Values, Returns],
        Loss::Tinker(TinkerLoss::CrossEntropy) => vec![],
        Loss::Tinker(_) => vec![Logprobs, Advantages],
        Loss::Policy(p) => {
            let mut f = match &p.objective {
                PolicyObjective::CrossEntropy => vec![],
                _ => vec![Logprobs, Advantages],
            };
            if p.kl_coef != 0.0 {
                f.push(RefLogprobs);
            }
            f
        }
    };
    Requirements { target_tokens: !matches!(loss, Loss::Value(_)), floats }
}
