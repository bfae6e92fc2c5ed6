//! New policy weights for an engine: every base parameter, or only the LoRA adapters.
//!
//! The update is applied to a copy of the model (cheap: tensors are shared) and swapped in only
//! when every tensor checked out, so a bad update leaves the engine on its old weights. Tensors
//! are copied into fresh storage: the trainer updates its variables in place, and the engine's
//! weights must not move under a running generation.

use std::collections::HashMap;

use candle_core::Tensor;

use super::linear::LoraPair;
use super::lora::LoraConfig;
use super::transformer::Transformer;
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub enum WeightUpdate {
    /// Every base parameter by HF name (as [`Transformer::named_params`] lists them).
    Full(Vec<(String, Tensor)>),
    /// Adapters by PEFT name (`base_model.model.<module>.lora_{A,B}.weight`) for every module
    /// `config` targets; they replace whatever adapters the engine had.
    Lora { config: LoraConfig, tensors: Vec<(String, Tensor)> },
}

/// A private copy of `t` in the model's dtype and device.
fn own(t: &Tensor, model: &Transformer) -> Result<Tensor> {
    let t = t.to_device(&model.device)?;
    let t = if t.dtype() == model.dtype { t.copy()? } else { t.to_dtype(model.dtype)? };
    Ok(t.detach())
}

/// The model with `update` applied; `model` itself is untouched.
pub fn updated(model: &Transformer, update: &WeightUpdate) -> Result<Transformer> {
    let mut m = model.clone();
    match update {
        WeightUpdate::Full(tensors) => {
            let mut by_name: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let src = model.clone();
            m.visit_params_mut(&mut |name, slot| {
                let t = by_name
                    .remove(name)
                    .ok_or_else(|| Error::input(format!("weight update: parameter `{name}` is missing")))?;
                if t.dims() != slot.dims() {
                    return Err(Error::input(format!(
                        "weight update: `{name}` has shape {:?}, the model's is {:?}",
                        t.dims(),
                        slot.dims()
                    )));
                }
                *slot = own(t, &src)?;
                Ok(())
            })?;
            if let Some(name) = by_name.keys().next() {
                return Err(Error::input(format!("weight update: `{name}` is not a parameter of this model")));
            }
        }
        WeightUpdate::Lora { config, tensors } => {
            config.validate()?;
            let mut by_name: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let src = model.clone();
            let r = config.rank;
            let mut attached = 0;
            for (module, lin) in m.linears_mut() {
                if !config.targets(&module) {
                    lin.lora = None;
                    continue;
                }
                let (out, inp) = lin.weight.dims2()?;
                let mut take = |name: String, shape: [usize; 2]| -> Result<Tensor> {
                    let t = by_name
                        .remove(name.as_str())
                        .ok_or_else(|| Error::input(format!("weight update: adapter `{name}` is missing")))?;
                    if t.dims() != shape {
                        return Err(Error::input(format!(
                            "weight update: `{name}` has shape {:?}, expected {shape:?}",
                            t.dims()
                        )));
                    }
                    own(t, &src)
                };
                let a = take(format!("base_model.model.{module}.lora_A.weight"), [r, inp])?;
                let b = take(format!("base_model.model.{module}.lora_B.weight"), [out, r])?;
                lin.lora = Some(LoraPair { a, b, scale: config.scale() });
                attached += 1;
            }
            if attached == 0 {
                return Err(Error::input(format!(
                    "weight update: LoRA target_modules {:?} match no projection",
                    config.target_modules
                )));
            }
            if let Some(name) = by_name.keys().next() {
                return Err(Error::input(format!("weight update: `{name}` is not an adapter targeted by the config")));
            }
        }
    }
    Ok(m)
}
