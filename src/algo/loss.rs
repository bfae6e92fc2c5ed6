//! The loss interface shared by every loss family, and [`Loss`], any loss by name.
//!
//! Inputs ([`LossInputs`]) are tensors of one shape — typically 1-D, all tokens of a
//! micro-batch concatenated — on any device, in the dtype of the differentiable input
//! (`learner_logprobs`, or `learner_values` for the critic; the others are cast to it). A token
//! counts when its weight is non-zero. The inputs a datum carries keep the datum's field names
//! (`logprobs` is the ratio anchor, `values` the critic's predictions at generation time).
//!
//! A loss returns ([`LossOutput`]):
//! - `per_token_loss`: the loss of each token *before* its weight, differentiable, and exactly
//!   0 where `w = 0` even if some input there is NaN or ±inf (masking by `where`, see
//!   [`super::masking`]);
//! - `weighted_sum`: the 0-d tensor `Σ_t per_token_loss_t · w_t` — the worker contract's plain
//!   sum, the tensor to call `.backward()` on; Tinker's `elementwise_loss` is
//!   `per_token_loss · w`;
//! - `metrics`: `loss:sum` (= weighted_sum), `ntokens:sum` (tokens with `w ≠ 0`), and the
//!   loss's own `name:mean` metrics as `(sum, count)` pairs over the tokens with `w ≠ 0`, so
//!   that merging micro-batches gives exact means (see [`super::metrics`]).
//!
//! Families: [`TinkerLoss`] (the Tinker API's names), [`PolicyLoss`] (the RL trainer's names,
//! with optional KL and entropy terms), [`ValueLoss`] (the critic). `cispo` exists in both
//! families with different semantics, hence the separate namespaces; [`Loss::parse`] reads
//! any loss from one name (`cispo` vs `policy/cispo`) and its JSON config, in two steps that
//! callers may also take apart: [`LossName::lookup`](super::LossName::lookup) and
//! [`LossName::build`](super::LossName::build).

use candle_core::{DType, Tensor};
use serde_json::Value;

use super::kl::KlEstimator;
use super::masking::{mask_count, masked_sum, token_mask, zero_where_masked};
use super::metrics::{Metrics, PendingMetrics};
use super::policy_loss::PolicyLoss;
use super::tinker_loss::TinkerLoss;
use super::value_loss::ValueLoss;
use crate::{Error, Result};

/// Per-token inputs of a loss, all of the same shape as `weights`.
///
/// The fields a datum carries (`worker::LossFnInputs`) have the datum's names, so that
/// `loss_fn_inputs.X` is `LossInputs::X`; what the learner computes in this step is named
/// `learner_*` (and `entropy`, `sequence_ids`, which no datum carries).
#[derive(Clone, Debug)]
pub struct LossInputs {
    /// `w`: the weight of each token's loss; `w = 0` masks the token. Any real value.
    pub weights: Tensor,
    /// `lp`: the learner's log-prob of the target token (differentiable).
    pub learner_logprobs: Option<Tensor>,
    /// `q` (Tinker) / `old` (the RL trainer): the anchor of the ratio `r = exp(lp − q)`.
    pub logprobs: Option<Tensor>,
    /// `roll`: behaviour (sampler) log-probs, for `rollout_is` and `cispo` anchored on rollout.
    pub rollout_logprobs: Option<Tensor>,
    /// `A`: advantages.
    pub advantages: Option<Tensor>,
    /// Reference-policy log-probs, for the KL term.
    pub ref_logprobs: Option<Tensor>,
    /// `H_t`: per-token entropy of the learner (may be differentiable), for the entropy bonus.
    pub entropy: Option<Tensor>,
    /// Index of the sequence each token belongs to (any integer dtype), for `gspo`.
    pub sequence_ids: Option<Tensor>,
    /// `v`: the critic's predictions now (differentiable), for the value loss.
    pub learner_values: Option<Tensor>,
    /// `v_old`: the critic's predictions when the batch was generated, for value clipping.
    pub values: Option<Tensor>,
    /// `R`: value targets.
    pub returns: Option<Tensor>,
}

impl LossInputs {
    pub fn new(weights: Tensor) -> Self {
        LossInputs {
            weights,
            learner_logprobs: None,
            logprobs: None,
            rollout_logprobs: None,
            advantages: None,
            ref_logprobs: None,
            entropy: None,
            sequence_ids: None,
            learner_values: None,
            values: None,
            returns: None,
        }
    }
    pub fn with_learner_logprobs(mut self, t: Tensor) -> Self {
        self.learner_logprobs = Some(t);
        self
    }
    pub fn with_logprobs(mut self, t: Tensor) -> Self {
        self.logprobs = Some(t);
        self
    }
    pub fn with_rollout_logprobs(mut self, t: Tensor) -> Self {
        self.rollout_logprobs = Some(t);
        self
    }
    pub fn with_advantages(mut self, t: Tensor) -> Self {
        self.advantages = Some(t);
        self
    }
    pub fn with_ref_logprobs(mut self, t: Tensor) -> Self {
        self.ref_logprobs = Some(t);
        self
    }
    pub fn with_entropy(mut self, t: Tensor) -> Self {
        self.entropy = Some(t);
        self
    }
    pub fn with_sequence_ids(mut self, t: Tensor) -> Self {
        self.sequence_ids = Some(t);
        self
    }
    pub fn with_learner_values(mut self, t: Tensor) -> Self {
        self.learner_values = Some(t);
        self
    }
    pub fn with_values(mut self, t: Tensor) -> Self {
        self.values = Some(t);
        self
    }
    pub fn with_returns(mut self, t: Tensor) -> Self {
        self.returns = Some(t);
        self
    }
}

/// What a loss returns; see the module documentation.
#[derive(Clone, Debug)]
pub struct LossOutput {
    pub per_token_loss: Tensor,
    pub weighted_sum: Tensor,
    pub metrics: Metrics,
}

/// Any loss, by family.
#[derive(Clone, Debug, PartialEq)]
pub enum Loss {
    Tinker(TinkerLoss),
    Policy(PolicyLoss),
    Value(ValueLoss),
}

impl Loss {
    /// A Tinker API loss (`cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`).
    pub fn tinker(name: &str, config: &Value) -> Result<Self> {
        Ok(Loss::Tinker(TinkerLoss::from_config(name, config)?))
    }

    /// An RL-trainer policy loss (`regular`, `dual_clip`, `gspo`, `cispo`, `sapo`, `rollout_is`,
    /// `cross_entropy`, `importance_sampling`).
    pub fn policy(name: &str, config: &Value) -> Result<Self> {
        Ok(Loss::Policy(PolicyLoss::from_config(name, config)?))
    }

    /// The critic's clipped value loss.
    pub fn value(config: &Value) -> Result<Self> {
        Ok(Loss::Value(ValueLoss::from_config(config)?))
    }

    pub fn name(&self) -> &'static str {
        match self {
            Loss::Tinker(loss) => loss.name(),
            Loss::Policy(loss) => loss.name(),
            Loss::Value(_) => "value",
        }
    }

    /// The same loss with its KL coefficient set to `coef` (an adaptive controller's current
    /// one), when it carries a KL term; any other loss unchanged.
    pub fn with_kl_coef(&self, coef: f64) -> Loss {
        match self {
            Loss::Policy(p) if p.kl_coef != 0.0 => Loss::Policy(PolicyLoss { kl_coef: coef, ..p.clone() }),
            other => other.clone(),
        }
    }

    /// The same loss with a KL penalty toward the reference policy (`coef`, `estimator`), as
    /// `kl_coef` and `kl_estimator` in its config would give. Only the trainer's policy losses
    /// take one; any other refuses it with the error its config would give for `kl_coef`.
    pub fn with_kl_term(&self, coef: f64, estimator: KlEstimator) -> Result<Loss> {
        match self {
            Loss::Policy(p) => Ok(Loss::Policy(PolicyLoss { kl_coef: coef, kl_estimator: estimator, ..p.clone() })),
            Loss::Tinker(t) => Err(t.unknown_key("kl_coef")),
            Loss::Value(v) => Err(v.unknown_key("kl_coef")),
        }
    }

    pub fn compute(&self, inputs: &LossInputs) -> Result<LossOutput> {
        match self {
            Loss::Tinker(loss) => loss.compute(inputs),
            Loss::Policy(loss) => loss.compute(inputs),
            Loss::Value(loss) => loss.compute(inputs),
        }
    }
}

/// The error for a loss called without an input it needs.
pub(crate) fn missing_input(loss_name: &str, field: &str) -> Error {
    Error::input(format!("loss `{loss_name}` needs the per-token input `{field}`"))
}

/// The inputs of one loss call, checked, cast to the differentiable input's dtype, and with
/// masked positions replaced by 0; plus the metrics being gathered.
pub(crate) struct MaskedInputs<'a> {
    inputs: &'a LossInputs,
    loss_name: &'static str,
    pub mask: Tensor,
    pub dtype: DType,
    count: Tensor,
    pending: PendingMetrics,
}

impl<'a> MaskedInputs<'a> {
    /// `dtype_of` names the differentiable input whose dtype every input is cast to.
    pub fn new(loss_name: &'static str, inputs: &'a LossInputs, dtype_of: &Option<Tensor>) -> Result<Self> {
        let dtype = match dtype_of {
            Some(t) => t.dtype(),
            None => inputs.weights.dtype(),
        };
        let mask = token_mask(&inputs.weights)?;
        let count = mask_count(&mask, dtype)?;
        Ok(MaskedInputs { inputs, loss_name, mask, dtype, count, pending: PendingMetrics::new() })
    }

    /// A required input, with masked positions set to 0.
    pub fn required(&self, field: &str, value: &Option<Tensor>) -> Result<Tensor> {
        let tensor = value.as_ref().ok_or_else(|| missing_input(self.loss_name, field))?;
        self.prepare(field, tensor)
    }

    /// An optional input, with masked positions set to 0.
    pub fn optional(&self, field: &str, value: &Option<Tensor>) -> Result<Option<Tensor>> {
        value.as_ref().map(|t| self.prepare(field, t)).transpose()
    }

    fn prepare(&self, field: &str, tensor: &Tensor) -> Result<Tensor> {
        self.check_shape(field, tensor)?;
        zero_where_masked(&tensor.to_dtype(self.dtype)?, &self.mask)
    }

    /// Checks that `tensor` has the shape of the weights.
    pub fn check_shape(&self, field: &str, tensor: &Tensor) -> Result<()> {
        if tensor.shape() != self.inputs.weights.shape() {
            return Err(Error::input(format!(
                "loss `{}`: input `{field}` has shape {:?} but `weights` has shape {:?}",
                self.loss_name,
                tensor.dims(),
                self.inputs.weights.dims()
            )));
        }
        Ok(())
    }

    /// Records the metric `name:mean` = masked mean of `x` (any dtype, e.g. a u8 indicator).
    pub fn mean_metric(&mut self, name: &str, x: &Tensor) -> Result<()> {
        let sum = masked_sum(&x.detach().to_dtype(self.dtype)?, &self.mask)?;
        self.pending.mean(name, &sum, &self.count)
    }

    /// Masks the per-token loss, forms the weighted sum and gathers the metrics.
    pub fn finish(mut self, per_token_loss: &Tensor) -> Result<LossOutput> {
        let per_token_loss = zero_where_masked(per_token_loss, &self.mask)?;
        let weights = self.inputs.weights.to_dtype(self.dtype)?;
        let weighted_sum = (&per_token_loss * &weights)?.sum_all()?;
        self.pending.sum("loss", &weighted_sum)?;
        self.pending.sum("ntokens", &self.count)?;
        let metrics = self.pending.finish()?;
        Ok(LossOutput { per_token_loss, weighted_sum, metrics })
    }
}
