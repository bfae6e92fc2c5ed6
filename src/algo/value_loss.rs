//! The critic's clipped value loss, per token, before the weight `w`.
//!
//! `v` the critic's prediction now ([`LossInputs::learner_values`], differentiable), `v_old` its
//! prediction when the batch was generated ([`LossInputs::values`], the datum's `values`), `R`
//! the return ([`LossInputs::returns`]), `ε` = `value_clip` (default 0.2, ≥ 0):
//! `loss = ½ · max((v − R)², (clamp(v, v_old − ε, v_old + ε) − R)²)`.
//! Metrics: `value_clip_fraction:mean` (tokens where the clipped term is strictly larger) and
//! `values:mean`.

use serde_json::Value;

use super::config_object::{unknown_key, ConfigObject};
use super::loss::{LossInputs, LossOutput, MaskedInputs};
use crate::Result;

const OWNER: &str = "value loss";
const CONFIG_KEYS: [&str; 1] = ["value_clip"];

#[derive(Clone, Debug, PartialEq)]
pub struct ValueLoss {
    pub value_clip: f64,
}

impl ValueLoss {
    /// The config: `{"value_clip": ε}` (or null for the default 0.2).
    pub fn from_config(config: &Value) -> Result<Self> {
        let c = ConfigObject::new(OWNER, config, &CONFIG_KEYS)?;
        let value_clip = c.f64_or("value_clip", 0.2)?;
        if value_clip < 0.0 {
            return Err(c.invalid("value_clip", format!("must be ≥ 0, got {value_clip}")));
        }
        Ok(ValueLoss { value_clip })
    }

    /// The error [`from_config`](Self::from_config) gives for a config key `key` that this
    /// loss does not take.
    pub fn unknown_key(&self, key: &str) -> crate::Error {
        unknown_key(OWNER, key, &CONFIG_KEYS)
    }

    pub fn compute(&self, inputs: &LossInputs) -> Result<LossOutput> {
        let mut x = MaskedInputs::new("value", inputs, &inputs.learner_values)?;
        let v = x.required("learner_values", &inputs.learner_values)?;
        let v_old = x.required("values", &inputs.values)?;
        let returns = x.required("returns", &inputs.returns)?;

        let clipped_v = v.maximum(&(&v_old - self.value_clip)?)?.minimum(&(&v_old + self.value_clip)?)?;
        let unclipped_error = (&v - &returns)?.sqr()?;
        let clipped_error = (clipped_v - &returns)?.sqr()?;
        let clip_active = clipped_error.detach().gt(&unclipped_error.detach())?;
        let loss = (unclipped_error.maximum(&clipped_error)? * 0.5)?;

        x.mean_metric("value_clip_fraction", &clip_active)?;
        // `values:mean` reports the critic's current predictions `v`.
        x.mean_metric("values", &v)?;
        x.finish(&loss)
    }
}
