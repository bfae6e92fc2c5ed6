//! [`SamplerWeights`]: a versioned snapshot of a policy's weights, for the sampling engines.
//!
//! A worker makes one after its optimizer steps (`Worker::sampler_weights`): every base
//! parameter by HF name for full fine-tuning, or only the LoRA adapters (PEFT names) with their
//! config. The tensors are private copies in fresh storage, because the optimizer updates its
//! variables in place (`Var::set`): a snapshot that shared their storage would change under the
//! engine at the next `optim_step`. The snapshot itself is immutable and reference-counted, so
//! any number of engines take it without copying it again. `version` is the number of optimizer
//! steps behind these weights; engines stamp it on every token they sample with them.

use std::sync::Arc;

use super::lora::LoraConfig;
use super::transformer::Transformer;
use super::weight_update::WeightUpdate;
use crate::Result;

#[derive(Clone, Debug)]
pub struct SamplerWeights {
    version: u64,
    update: Arc<WeightUpdate>,
}

impl SamplerWeights {
    /// The weights of `model` as an engine needs them: the adapters only when `lora` is given
    /// (the engine's base is the same frozen base), every base parameter otherwise.
    pub fn snapshot(model: &Transformer, lora: Option<&LoraConfig>, version: u64) -> Result<Self> {
        let update = match lora {
            Some(config) => WeightUpdate::lora_snapshot(model, config)?,
            None => WeightUpdate::full_snapshot(model)?,
        };
        Ok(SamplerWeights { version, update: Arc::new(update) })
    }

    /// Optimizer steps behind these weights.
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn update(&self) -> &WeightUpdate {
        &self.update
    }

    pub fn is_lora(&self) -> bool {
        matches!(*self.update, WeightUpdate::Lora { .. })
    }

    /// Total bytes of the tensors.
    pub fn num_bytes(&self) -> usize {
        let tensors = match &*self.update {
            WeightUpdate::Full(t) => t,
            WeightUpdate::Lora { tensors, .. } => tensors,
        };
        tensors.iter().map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}
