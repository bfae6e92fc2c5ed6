//! Pure functions on tensors and host vectors: losses, advantage and KL estimators, loss
//! reductions, off-policy correction. No models, no devices chosen here, no I/O.
//!
//! Two kinds of data:
//! - **Losses** ([`loss`], [`tinker_loss`], [`policy_loss`], [`value_loss`], [`kl`]) work on
//!   candle tensors (any float dtype, any device), differentiable in the learner's log-probs
//!   (or the critic's values), one entry per token.
//! - **Trainer-side estimators** ([`advantages`], [`group_advantages`], [`discounted_returns`], [`whitening`],
//!   [`reduction`], [`off_policy`], [`kl_control`]) work on host data: a batch is `&[Vec<f32>]`,
//!   one row per sequence (response tokens), with a 0/1 mask of the same layout and, where
//!   prompts matter, a group id per sequence. Arithmetic is in f64, results are f32.
//!
//! Exact formulas: `docs/specs/algorithms.md`; each file restates its own.

pub mod advantages;
pub mod config_object;
pub mod discounted_returns;
pub mod group_advantages;
pub mod kl;
pub mod kl_control;
pub mod loss;
mod loss_name;
pub mod masking;
pub mod metrics;
pub mod off_policy;
pub mod policy_loss;
pub mod reduction;
mod rows;
pub mod surrogate;
pub mod tinker_loss;
pub mod value_loss;
pub mod whitening;

pub use advantages::{AdvantageEstimator, AdvantageKind};
pub use discounted_returns::{gae, reinforce_plus_plus, AdvantagesAndReturns};
pub use group_advantages::{broadcast_over_mask, grpo_advantages, rloo_advantages, sequence_scores};
pub use kl::KlEstimator;
pub use kl_control::{apply_kl_penalty_to_rewards, AdaptiveKlController, KlController};
pub use loss::{Loss, LossInputs, LossOutput};
pub use loss_name::LossName;
pub use metrics::{MetricValue, Metrics};
pub use off_policy::{OffPolicyCorrection, OffPolicyOutcome, SequenceMaskMetric, TruncatedIs};
pub use policy_loss::{PolicyLoss, PolicyObjective, RatioAnchor};
pub use reduction::{loss_reduction_weights, LossReduction, ReductionKind};
pub use surrogate::RatioBand;
pub use tinker_loss::TinkerLoss;
pub use value_loss::ValueLoss;
pub use whitening::masked_whiten;
