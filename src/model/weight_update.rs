//! New policy weights for a model: every base parameter, or only the LoRA adapters.
//!
//! The trainer takes a snapshot ([`WeightUpdate::full_snapshot`], [`WeightUpdate::lora_snapshot`])
//! and an engine applies it with [`WeightUpdate::apply`]. The update is applied to a copy of the
//! model (cheap: tensors are shared) that is returned only when every tensor checked out, so a
//! bad update leaves the caller on its old weights.
//!
//! Storage: the trainer's variables are updated in place (candle's `Var::set`), and an engine's
//! weights must not move under a running generation. Snapshots therefore copy every tensor into
//! fresh storage, and `apply` relies on that: a tensor already in the model's dtype and on its
//! device is used as it is (no second copy; the engines behind one client then share one copy).
//! Whoever builds an update by hand must hand over tensors nobody mutates afterwards. As a
//! safety net `apply` still copies a tensor that is a variable's own (`Tensor::is_variable`),
//! the easy mistake of passing `Var::as_tensor()` straight through; a tensor derived from a
//! variable without a copy (e.g. `detach()`) is not detected.

use candle_core::{DType, Device, Tensor};

use super::lora::{self, LoraConfig};
use super::named_tensors::NamedTensors;
use super::transformer::Transformer;
use crate::Result;

/// The source label of snapshot tensors in error messages.
const SOURCE: &str = "weight update";

#[derive(Debug, Clone)]
pub enum WeightUpdate {
    /// Every base parameter by HF name (as [`Transformer::named_params`] lists them).
    Full(NamedTensors),
    /// Adapters by PEFT name ([`lora::adapter_names`]) for every module `config` targets; they
    /// replace whatever adapters the model had.
    Lora { config: LoraConfig, tensors: NamedTensors },
}

/// A copy of `t` in fresh storage, detached from any graph.
fn fresh(t: &Tensor) -> Result<Tensor> {
    Ok(t.copy()?.detach())
}

impl WeightUpdate {
    /// Every base parameter of `model` by HF name, copied into fresh storage.
    pub fn full_snapshot(model: &Transformer) -> Result<Self> {
        let mut tensors = NamedTensors::new(SOURCE);
        for (name, t) in model.named_params() {
            tensors.insert(name, fresh(&t)?)?;
        }
        Ok(WeightUpdate::Full(tensors))
    }

    /// The adapters of `model` by PEFT name, copied into fresh storage, with their `config`.
    pub fn lora_snapshot(model: &Transformer, config: &LoraConfig) -> Result<Self> {
        let mut tensors = NamedTensors::new(SOURCE);
        for (name, t) in &lora::adapter_tensors(model)? {
            tensors.insert(name, fresh(t)?)?;
        }
        Ok(WeightUpdate::Lora { config: config.clone(), tensors })
    }

    /// `model` with the update applied; `model` itself is untouched. A missing tensor, a wrong
    /// shape or a tensor the model has no place for is an error naming it.
    pub fn apply(&self, model: &Transformer) -> Result<Transformer> {
        let mut m = model.clone();
        match self {
            WeightUpdate::Full(tensors) => {
                let mut tensors = on_model(tensors, model)?;
                m.visit_params_mut(&mut |name, slot| {
                    *slot = tensors.take(name, slot.dims(), model.dtype)?;
                    Ok(())
                })?;
                tensors.reject_leftovers(|_| false, "not a parameter of this model")?;
            }
            WeightUpdate::Lora { config, tensors } => {
                lora::attach_tensors(&mut m, config, &mut on_model(tensors, model)?, false)?;
            }
        }
        Ok(m)
    }
}

/// The tensors on the model's device in its dtype, copied only where needed (see the module
/// documentation): a conversion or a move makes fresh storage anyway, a variable's own tensor is
/// copied, anything else is used as it is.
fn on_model(tensors: &NamedTensors, model: &Transformer) -> Result<NamedTensors> {
    tensors.map(|_, t| private(t, model.dtype, &model.device))
}

fn private(t: &Tensor, dtype: DType, device: &Device) -> Result<Tensor> {
    let t = if t.device().same_device(device) {
        if t.dtype() == dtype && t.is_variable() {
            t.copy()?
        } else {
            t.to_dtype(dtype)?
        }
    } else {
        t.to_device(device)?.to_dtype(dtype)?
    };
    Ok(t.detach())
}
