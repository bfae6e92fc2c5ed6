//! What dispatch needs from a worker beyond the training calls: a gradient all-reduce hook and
//! moving state between the device and host memory (colocated roles).
//!
//! Offload copies the trainable parameters and the AdamW moments into host tensors (fresh
//! storage, [`HostCopy`]) and drops the device moments; backload writes them back. The device
//! copies of the parameters stay allocated: a candle `Var` cannot give up its storage while the
//! model holds it, so on CPU the move exercises the logic without freeing memory. Frozen base
//! weights under LoRA are not moved (they never change, so a host copy would only cost memory).

use candle_core::{Device, Tensor};

use super::adamw::Moments;
use super::rank::Worker;
use crate::{Error, Result};

/// Parameters and/or optimizer moments held in host memory while the worker is offloaded.
#[derive(Debug, Default)]
pub struct HostCopy {
    params: Option<Vec<Tensor>>,
    moments: Option<Vec<Option<Moments>>>,
}

fn to_host(t: &Tensor) -> Result<Tensor> {
    // `copy` gives new storage even on the CPU, so the host copy is truly separate.
    Ok(t.to_device(&Device::Cpu)?.copy()?)
}

impl Worker {
    /// Replaces the accumulated gradients by `reduce(gradients)` — the all-reduce of dispatch.
    /// Parameters without a gradient contribute zeros, so every rank passes the same shapes.
    pub fn reduce_gradients(&mut self, reduce: impl FnOnce(Vec<Tensor>) -> Result<Vec<Tensor>>) -> Result<()> {
        let mut local = Vec::with_capacity(self.params.len());
        for (i, (_, var)) in self.params.iter().enumerate() {
            local.push(match self.grads[i].take() {
                Some(g) => g,
                None => var.as_tensor().zeros_like()?,
            });
        }
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

    /// Copies the parameters (`model`) and/or takes the moments (`optimizer`) to host memory.
    pub fn offload(&mut self, model: bool, optimizer: bool, host: &mut HostCopy) -> Result<()> {
        if model && host.params.is_none() {
            host.params = Some(self.params.iter().map(|(_, v)| to_host(v.as_tensor())).collect::<Result<_>>()?);
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

    /// Writes back what `offload` took (the parts asked for that are on the host).
    pub fn backload(&mut self, model: bool, optimizer: bool, host: &mut HostCopy) -> Result<()> {
        let device = self.model.device.clone();
        if model {
            if let Some(params) = host.params.take() {
                for ((_, var), t) in self.params.iter().zip(params) {
                    var.set(&t.to_device(&device)?)?;
                }
            }
        }
        if optimizer {
            if let Some(moments) = host.moments.take() {
                for (slot, m) in self.moments.iter_mut().zip(moments) {
                    *slot = match m {
                        Some(m) => Some(Moments {
                            exp_avg: m.exp_avg.to_device(&device)?.copy()?,
                            exp_avg_sq: m.exp_avg_sq.to_device(&device)?.copy()?,
                            step: m.step,
                        }),
                        None => None,
                    };
                }
            }
        }
        Ok(())
    }
}
