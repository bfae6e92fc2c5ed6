//! What dispatch needs from a worker beyond the training calls: a gradient all-reduce hook and
//! moving state between the device and host memory (colocated roles).
//!
//! Offload copies the trainable parameters, their accumulated gradients (and f32 master weights,
//! under mixed precision) and the AdamW moments into fresh host tensors ([`HostCopy`]) and then *releases* the device storage: every slot of
//! the model that held a trainable parameter (and the worker's own variable) is replaced by an
//! empty placeholder, so nothing keeps the old storage alive. Backload builds new variables from
//! the host copy and puts them back in the same slots, bit-exactly. While offloaded, training
//! calls are refused with a clear error.
//!
//! Frozen base weights under LoRA are not moved: they never change and may be shared with other
//! models over the same base (see `dispatch`), so only the adapters, the value head and the
//! optimizer state leave the device.

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};

use super::adamw::Moments;
use super::value_head;
use super::worker::Worker;
use crate::{Error, Result};

/// Parameters, gradients and/or optimizer moments held in host memory while offloaded.
#[derive(Debug, Default)]
pub struct HostCopy {
    params: Option<Vec<Tensor>>,
    masters: Option<Vec<Option<Tensor>>>,
    grads: Option<Vec<Option<Tensor>>>,
    moments: Option<Vec<Option<Moments>>>,
}

fn to_host(t: &Tensor) -> Result<Tensor> {
    // `copy` gives new storage even on the CPU, so the host copy never aliases the device one;
    // `detach` first, or the copy of a variable would record it in its autograd history and
    // keep the device storage alive.
    Ok(t.detach().to_device(&Device::Cpu)?.copy()?)
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

fn to_device(t: Tensor, device: &Device) -> Result<Tensor> {
    Ok(if device.is_cpu() { t } else { t.to_device(device)? })
}

impl Worker {
    /// Replaces the accumulated gradients by `reduce(gradients)` — the all-reduce of dispatch.
    /// Parameters without a gradient contribute zeros, so every rank passes the same shapes.
    /// Gradients already summed after each micro-batch ([`Worker::gradients_summed`]) stay as
    /// they are.
    pub fn reduce_gradients(&mut self, reduce: impl FnOnce(Vec<Tensor>) -> Result<Vec<Tensor>>) -> Result<()> {
        self.check_resident()?;
        if self.summed {
            return Ok(());
        }
        let all: Vec<usize> = (0..self.params.len()).collect();
        let local = self.take_local_gradients(&all)?;
        let reduced = reduce(local)?;
        if reduced.len() != self.params.len() {
            return Err(Error::Other(format!(
                "all-reduce returned {} gradients for {} parameters",
                reduced.len(),
                self.params.len()
            )));
        }
        self.grads = reduced.into_iter().map(Some).collect();
        Ok(())
    }

    /// An error if the parameters are in host memory.
    pub(super) fn check_resident(&self) -> Result<()> {
        if self.offloaded {
            return Err(Error::input("this worker is offloaded to host memory: backload it before training calls"));
        }
        Ok(())
    }

    pub fn is_offloaded(&self) -> bool {
        self.offloaded
    }

    /// Bytes of trainable parameters, gradients and moments the worker holds on its device.
    pub fn resident_bytes(&self) -> usize {
        self.param_bytes() + self.gradient_bytes() + self.optimizer_bytes()
    }

    /// Bytes of trainable parameters the worker holds (under `full` sharding, the weights it
    /// keeps; the others are released between gathers).
    pub fn param_bytes(&self) -> usize {
        self.params.iter().map(|(_, v)| crate::model::sharded_weights::held_bytes(v.as_tensor())).sum()
    }

    /// Bytes of the model's base weights this rank holds, trained or frozen (under `full`, its
    /// slice of them, a LoRA model's frozen base included).
    pub fn weight_bytes(&self) -> usize {
        self.model.named_params().iter().map(|(_, t)| crate::model::sharded_weights::held_bytes(t)).sum()
    }

    /// Bytes of gradients the worker holds: its accumulators and, while a backward's gradients
    /// are summed to their owners (`worker/unit_reduce.rs`), the sums it owns.
    pub fn gradient_bytes(&self) -> usize {
        let accumulated: usize = self.grads.iter().flatten().map(bytes).sum();
        let summed: usize = self.unit_reduce.iter().flat_map(|u| u.summed.iter().flatten()).map(bytes).sum();
        accumulated + summed
    }

    /// Bytes of optimizer state the worker holds: AdamW moments and f32 master weights (under
    /// sharding, those of its own parameters).
    pub fn optimizer_bytes(&self) -> usize {
        let moments: usize = self.moments.iter().flatten().map(|m| bytes(&m.exp_avg) + bytes(&m.exp_avg_sq)).sum();
        let masters: usize = self.masters.iter().flatten().flatten().map(bytes).sum();
        moments + masters
    }

    /// Moves the parameters and their gradients (`model`) and/or the moments (`optimizer`) to
    /// host memory, releasing the device storage.
    pub fn offload(&mut self, model: bool, optimizer: bool, host: &mut HostCopy) -> Result<()> {
        if model && self.slices.is_some() {
            return Err(Error::input(
                "sharding = \"full\" keeps each rank's slice of the weights in place; it cannot be offloaded",
            ));
        }
        if model && !self.offloaded {
            let params = self.params.iter().map(|(_, v)| to_host(v.as_tensor())).collect::<Result<Vec<_>>>()?;
            let grads =
                self.grads.iter_mut().map(|g| g.take().map(|g| to_host(&g)).transpose()).collect::<Result<Vec<_>>>()?;
            let (dtype, device) = (self.model.dtype, self.model.device.clone());
            self.replace_params(&mut |_| Ok(Tensor::zeros(0, dtype, &device)?))?;
            host.params = Some(params);
            host.grads = Some(grads);
            host.masters = match self.masters.take() {
                Some(m) => Some(m.iter().map(|t| t.as_ref().map(to_host).transpose()).collect::<Result<Vec<_>>>()?),
                None => None,
            };
            self.offloaded = true;
        }
        if optimizer && host.moments.is_none() {
            let mut taken = Vec::with_capacity(self.moments.len());
            for m in self.moments.iter_mut() {
                taken.push(match m.take() {
                    Some(m) => Some(Moments {
                        exp_avg: to_host(&m.exp_avg)?,
                        exp_avg_sq: to_host(&m.exp_avg_sq)?,
                        step: m.step,
                    }),
                    None => None,
                });
            }
            host.moments = Some(taken);
        }
        Ok(())
    }

    /// Brings back what `offload` took (the parts asked for that are on the host).
    pub fn backload(&mut self, model: bool, optimizer: bool, host: &mut HostCopy) -> Result<()> {
        let device = self.model.device.clone();
        if model {
            if let (Some(params), Some(grads)) = (host.params.take(), host.grads.take()) {
                let names: Vec<String> = self.params.iter().map(|(n, _)| n.clone()).collect();
                let mut by_name: HashMap<String, Tensor> = names.iter().cloned().zip(params).collect();
                self.replace_params(&mut |name| {
                    let t = by_name.remove(name).ok_or_else(|| Error::Other(format!("no host copy of `{name}`")))?;
                    to_device(t, &device)
                })?;
                self.grads =
                    grads.into_iter().map(|g| g.map(|g| to_device(g, &device)).transpose()).collect::<Result<_>>()?;
                self.masters = match host.masters.take() {
                    Some(m) => Some(
                        m.into_iter()
                            .map(|t| t.map(|t| to_device(t, &device)).transpose())
                            .collect::<Result<Vec<_>>>()?,
                    ),
                    None => None,
                };
                self.offloaded = false;
            }
        }
        if optimizer {
            if let Some(moments) = host.moments.take() {
                for (slot, m) in self.moments.iter_mut().zip(moments) {
                    *slot = match m {
                        Some(m) => Some(Moments {
                            exp_avg: to_device(m.exp_avg, &device)?,
                            exp_avg_sq: to_device(m.exp_avg_sq, &device)?,
                            step: m.step,
                        }),
                        None => None,
                    };
                }
            }
        }
        Ok(())
    }

    /// Puts a new variable made from `value(name)` in every trainable slot — the model's
    /// tensors, the worker's variable list and the value head — dropping the old ones.
    fn replace_params(&mut self, value: &mut dyn FnMut(&str) -> Result<Tensor>) -> Result<()> {
        let mut made: HashMap<String, Var> = HashMap::new();
        if self.config.lora.is_some() {
            for (module, lin) in self.model.linears_mut() {
                if let Some(pair) = lin.lora.as_mut() {
                    let (a, b) = crate::model::lora::adapter_names(&module);
                    fresh(value, &a, &mut pair.a, &mut made)?;
                    fresh(value, &b, &mut pair.b, &mut made)?;
                }
            }
        } else {
            self.model.visit_params_mut(&mut |name, slot| fresh(value, name, slot, &mut made))?;
        }
        if let Some(head) = self.value_head.as_mut() {
            for (name, var) in [(value_head::WEIGHT, &mut head.weight), (value_head::BIAS, &mut head.bias)] {
                fresh(value, name, &mut var.as_tensor().clone(), &mut made)?;
                *var = made[name].clone();
            }
        }
        for (name, var) in self.params.iter_mut() {
            *var = made
                .remove(name)
                .ok_or_else(|| Error::Other(format!("trainable `{name}` has no slot in the model")))?;
        }
        Ok(())
    }
}

/// A new variable from `value(name)`, put in `slot` and recorded in `made`.
fn fresh(
    value: &mut dyn FnMut(&str) -> Result<Tensor>,
    name: &str,
    slot: &mut Tensor,
    made: &mut HashMap<String, Var>,
) -> Result<()> {
    let var = Var::from_tensor(&value(name)?)?;
    *slot = var.as_tensor().clone();
    made.insert(name.to_string(), var);
    Ok(())
}
