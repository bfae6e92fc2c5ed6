//! The worker's batch: a list of datums, and what the worker returns per datum.
//!
//! A datum is `input_tokens` (length N) and per-token `loss_fn_inputs`, each of length N:
//! `target_tokens` (the token whose log-prob is taken at each position), `weights` (default 1),
//! `logprobs` (the ratio anchor: Tinker's `q`, the RL trainer's `old`), `advantages`,
//! `ref_logprobs` (for a KL term), `rollout_logprobs` (the sampler's, for `rollout_is` and
//! `cispo` anchored on rollout; absent = the same as `logprobs`), `values` (the critic's
//! predictions when the batch was generated) and `returns` (value targets).
//!
//! Validation ([`validate_batch`]) checks every length against `input_tokens`, every id against
//! the vocabulary and every value for finiteness, and that an optional field is present on all
//! datums or on none (micro-batches concatenate them). Each error names the datum and the field.

use serde::{Deserialize, Serialize};

use crate::model::check_token_ids;
use crate::{Error, Result};

/// One sequence of a batch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Datum {
    pub input_tokens: Vec<u32>,
    #[serde(default)]
    pub loss_fn_inputs: LossFnInputs,
}

/// Per-token inputs of a datum; every present field has the length of `input_tokens`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossFnInputs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_tokens: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advantages: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ref_logprobs: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_logprobs: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub returns: Option<Vec<f32>>,
}

/// The float fields of [`LossFnInputs`] by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatField {
    Weights,
    Logprobs,
    Advantages,
    RefLogprobs,
    RolloutLogprobs,
    Values,
    Returns,
}

impl FloatField {
    pub const ALL: [FloatField; 7] = [
        FloatField::Weights,
        FloatField::Logprobs,
        FloatField::Advantages,
        FloatField::RefLogprobs,
        FloatField::RolloutLogprobs,
        FloatField::Values,
        FloatField::Returns,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FloatField::Weights => "weights",
            FloatField::Logprobs => "logprobs",
            FloatField::Advantages => "advantages",
            FloatField::RefLogprobs => "ref_logprobs",
            FloatField::RolloutLogprobs => "rollout_logprobs",
            FloatField::Values => "values",
            FloatField::Returns => "returns",
        }
    }
}

impl LossFnInputs {
    pub fn float(&self, field: FloatField) -> Option<&Vec<f32>> {
        match field {
            FloatField::Weights => self.weights.as_ref(),
            FloatField::Logprobs => self.logprobs.as_ref(),
            FloatField::Advantages => self.advantages.as_ref(),
            FloatField::RefLogprobs => self.ref_logprobs.as_ref(),
            FloatField::RolloutLogprobs => self.rollout_logprobs.as_ref(),
            FloatField::Values => self.values.as_ref(),
            FloatField::Returns => self.returns.as_ref(),
        }
    }
}

impl Datum {
    /// A supervised datum: `input_tokens` with next-token targets and weights.
    pub fn supervised(input_tokens: Vec<u32>, target_tokens: Vec<u32>, weights: Vec<f32>) -> Self {
        Datum {
            input_tokens,
            loss_fn_inputs: LossFnInputs {
                target_tokens: Some(target_tokens),
                weights: Some(weights),
                ..Default::default()
            },
        }
    }

    pub fn len(&self) -> usize {
        self.input_tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_tokens.is_empty()
    }
}

/// What the worker returns for one datum. Empty vectors are absent from the JSON; with
/// `return_per_token_outputs = false` every vector is empty.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LossFnOutput {
    /// Learner log-probs of the target tokens (policy workers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
    /// `per_token_loss · weight` (when a loss was given).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub elementwise_loss: Vec<f32>,
    /// Critic predictions (critic workers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<f32>,
}

impl LossFnOutput {
    pub fn is_empty(&self) -> bool {
        self.logprobs.is_empty() && self.elementwise_loss.is_empty() && self.values.is_empty()
    }
}

/// What a batch must carry, beyond `input_tokens`.
#[derive(Clone, Debug, Default)]
pub struct Requirements {
    pub target_tokens: bool,
    pub floats: Vec<FloatField>,
}

/// Checks the batch against the vocabulary size and the fields the call needs.
pub fn validate_batch(batch: &[Datum], vocab_size: usize, needs: &Requirements) -> Result<()> {
    if batch.is_empty() {
        return Err(Error::input("empty batch: no datums"));
    }
    for (i, datum) in batch.iter().enumerate() {
        let n = datum.len();
        if n == 0 {
            return Err(Error::input(format!("datum {i}: input_tokens is empty")));
        }
        check_token_ids(&datum.input_tokens, vocab_size, format_args!("datum {i}: input_tokens"))?;
        let inputs = &datum.loss_fn_inputs;
        match &inputs.target_tokens {
            Some(targets) => {
                check_len(i, "target_tokens", targets.len(), n)?;
                check_token_ids(targets, vocab_size, format_args!("datum {i}: loss_fn_inputs.target_tokens"))?;
            }
            None if needs.target_tokens => return Err(missing(i, "target_tokens")),
            None => {}
        }
        for field in FloatField::ALL {
            match inputs.float(field) {
                Some(values) => {
                    check_len(i, field.name(), values.len(), n)?;
                    if let Some(pos) = values.iter().position(|v| !v.is_finite()) {
                        return Err(Error::input(format!(
                            "datum {i}: loss_fn_inputs.{} has the non-finite value {} at position {pos}",
                            field.name(),
                            values[pos]
                        )));
                    }
                }
                None if needs.floats.contains(&field) => return Err(missing(i, field.name())),
                None => {}
            }
        }
    }
    // An optional field is on every datum or on none: micro-batches concatenate them.
    for field in FloatField::ALL {
        let first = batch[0].loss_fn_inputs.float(field).is_some();
        if let Some(i) = batch.iter().position(|d| d.loss_fn_inputs.float(field).is_some() != first) {
            let (with, without) = if first { (0, i) } else { (i, 0) };
            return Err(Error::input(format!(
                "datum {without}: loss_fn_inputs.{} is absent but datum {with} has it (give it on every datum or on none)",
                field.name()
            )));
        }
    }
    Ok(())
}

fn missing(datum: usize, field: &str) -> Error {
    Error::input(format!("datum {datum}: loss_fn_inputs.{field} is required by this call but absent"))
}

fn check_len(datum: usize, field: &str, len: usize, n: usize) -> Result<()> {
    if len != n {
        return Err(Error::input(format!(
            "datum {datum}: loss_fn_inputs.{field} has length {len} but input_tokens has length {n}"
        )));
    }
    Ok(())
}
