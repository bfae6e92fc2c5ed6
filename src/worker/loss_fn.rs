//! What the worker needs to know about a loss: the datum fields it reads and whether it wants
//! the learner's entropy. Losses are parsed by name with [`Loss::parse`].

use super::batch::{FloatField, Requirements};
use crate::algo::{Loss, PolicyObjective, TinkerLoss};

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
