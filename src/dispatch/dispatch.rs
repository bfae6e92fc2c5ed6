//! [`Dispatch`]: any number of models by id, and colocation between them.
//!
//! A launcher (the CLI, the server) creates models from [`WorkerSpec`]s under ids it chooses —
//! `policy`, `ref`, `critic` for the trainers, one per client for the server — and can create
//! and drop them at run time. A trainer receives the ready dispatch and calls
//! `dispatch.submit_forward_backward("policy", ...)`: it never sees a device, a mesh or a dp
//! size (it asks [`Dispatch::batch_multiple`] for the batch-size multiple it needs). LoRA models
//! over the same base share its weights in memory ([`BaseModels`]).
//!
//! Every call returns a [`Handle`] at once (`.await` it, or `.wait()`); calls on one model run
//! in submission order. The blocking forms (`forward_backward`, …) submit and wait.
//!
//! When the models are colocated (they share one device), each call first applies the moves of
//! the [`Residency`] state machine: the other models are offloaded, the parts this call needs
//! are brought back (a forward needs the model; training needs model and optimizer). The moves
//! are queued like calls: the call waits on its model's queue behind a barrier on the other
//! models' offloads, so submitting never blocks.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};

use super::base_models::BaseModels;
use super::residency::{Move, Parts, Residency};
use super::split::lcm;
use super::worker_group::{BuildWorker, WorkerGroup};
use super::worker_spec::WorkerSpec;
use crate::algo::Loss;
use crate::handle::Handle;
use crate::locks::{lock, read, write};
use crate::model::{SamplerWeights, Transformer};
use crate::worker::{AdamParams, Datum, ForwardBackwardOutput, Sharding, Worker};
use crate::{Error, Result};

#[derive(Default)]
pub struct Dispatch {
    models: RwLock<BTreeMap<String, Arc<WorkerGroup>>>,
    /// All models share one device and take turns on it.
    colocated: bool,
    /// Held from the moves of a call until the call is queued, so calls and moves interleave
    /// consistently.
    residency: Mutex<Residency>,
    bases: BaseModels,
}

impl Dispatch {
    pub fn new(colocated: bool) -> Self {
        Dispatch { colocated, ..Default::default() }
    }

    pub fn is_colocated(&self) -> bool {
        self.colocated
    }

    /// Builds the workers of a new model `id` as `spec` says (blocks until they are built).
    pub fn create_model(&self, id: &str, spec: &WorkerSpec) -> Result<()> {
        if id.is_empty() {
            return Err(Error::input("a model id must not be empty"));
        }
        if read(&self.models).contains_key(id) {
            return Err(Error::input(format!("model `{id}` already exists")));
        }
        let config = spec.worker.clone();
        let build: BuildWorker = if spec.worker.sharding == Sharding::Full {
            // Each rank slices the weights, releasing in place those it does not keep, so it loads
            // a model of its own: a LoRA base shared with other ranks or models would be released
            // under them, and a full fine-tuning copy beside a shared load would hold the model
            // twice while the rank is built.
            let (dir, dtype, device) = (spec.model_dir.clone(), spec.dtype, spec.device.clone());
            Arc::new(move |_| Worker::new(Transformer::load(&dir, dtype, &device)?, config.clone()))
        } else {
            let base = if spec.worker.lora.is_some() {
                self.bases.acquire(id, &spec.model_dir, spec.dtype, &spec.device)?
            } else {
                Transformer::load(&spec.model_dir, spec.dtype, &spec.device)?
            };
            Arc::new(move |_| Worker::new(base.clone(), config.clone()))
        };
        let mut residency = lock(&self.residency);
        let made = WorkerGroup::new(id, spec.mesh, spec.threads, build);
        let group = match made {
            Ok(g) => g,
            Err(e) => {
                self.bases.release(id);
                return Err(e);
            }
        };
        if self.colocated {
            let moves = residency.init_model(id);
            self.apply(&moves)?.into_iter().try_for_each(Handle::wait)?;
        }
        write(&self.models).insert(id.to_string(), Arc::new(group));
        Ok(())
    }

    /// Drops model `id`: its workers stop once the calls already submitted have run, and a
    /// shared base is freed with its last user.
    pub fn drop_model(&self, id: &str) -> Result<()> {
        let group = write(&self.models).remove(id);
        let group = group.ok_or_else(|| self.unknown(id))?;
        lock(&self.residency).forget(id);
        drop(group);
        self.bases.release(id);
        Ok(())
    }

    /// The ids of the models, sorted.
    pub fn ids(&self) -> Vec<String> {
        read(&self.models).keys().cloned().collect()
    }

    /// Shared base models held now (LoRA models over one base count once).
    pub fn shared_bases(&self) -> usize {
        self.bases.len()
    }

    fn unknown(&self, id: &str) -> Error {
        let ids = self.ids();
        Error::input(format!(
            "no model `{id}` (models: {})",
            if ids.is_empty() { "none".into() } else { ids.join(", ") }
        ))
    }

    pub fn model(&self, id: &str) -> Result<Arc<WorkerGroup>> {
        read(&self.models).get(id).cloned().ok_or_else(|| self.unknown(id))
    }

    /// The batch-size multiple every model can split evenly (the lcm of their dp sizes).
    pub fn batch_multiple(&self) -> usize {
        let models = read(&self.models);
        lcm(&models.values().map(|g| g.dp_size()).collect::<Vec<_>>())
    }

    /// Queues the moves; the handles of the offloads (a call must wait for them).
    fn apply(&self, moves: &[Move]) -> Result<Vec<Handle<()>>> {
        let mut offloads = vec![];
        for m in moves {
            match m {
                Move::Offload(id, parts) => offloads.push(self.model(id)?.submit_offload(*parts)),
                Move::Backload(id, parts) => {
                    // Queued on the model itself, ahead of the call: FIFO order suffices.
                    drop(self.model(id)?.submit_backload(*parts));
                }
            }
        }
        Ok(offloads)
    }

    /// Queues `call` on model `id` with the parts it `needs` resident.
    fn on_model<T: Send + 'static>(
        &self,
        id: &str,
        needs: Parts,
        call: impl FnOnce(&WorkerGroup) -> Handle<T>,
    ) -> Handle<T> {
        let group = match self.model(id) {
            Ok(g) => g,
            Err(e) => return Handle::ready(Err(e)),
        };
        if !self.colocated {
            return call(&group);
        }
        let mut residency = lock(&self.residency);
        let moves = residency.prepare(id, needs);
        match self.apply(&moves) {
            Ok(offloads) if !offloads.is_empty() => {
                drop(group.submit_barrier(offloads));
            }
            Ok(_) => {}
            Err(e) => return Handle::ready(Err(e)),
        }
        call(&group)
    }

    pub fn submit_forward_backward(
        &self,
        id: &str,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
    ) -> Handle<ForwardBackwardOutput> {
        self.on_model(id, Parts::ALL, |g| g.submit_forward_backward(batch, loss, per_token))
    }

    pub fn submit_forward(
        &self,
        id: &str,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
    ) -> Handle<ForwardBackwardOutput> {
        self.on_model(id, Parts::MODEL, |g| g.submit_forward(batch, loss, per_token))
    }

    /// Places mini-batches on the model's ranks ahead of time (no residency change: staged
    /// data is not model state).
    pub fn stage(&self, id: &str, minibatches: &[Vec<Datum>]) -> Handle<()> {
        match self.model(id) {
            Ok(g) => g.stage(minibatches),
            Err(e) => Handle::ready(Err(e)),
        }
    }

    pub fn submit_forward_backward_staged(
        &self,
        id: &str,
        index: usize,
        loss: &Loss,
        per_token: bool,
    ) -> Handle<ForwardBackwardOutput> {
        self.on_model(id, Parts::ALL, |g| g.submit_forward_backward_staged(index, loss, per_token))
    }

    pub fn submit_optim_step(&self, id: &str, params: &AdamParams) -> Handle<f64> {
        self.on_model(id, Parts::ALL, |g| g.submit_optim_step(*params))
    }

    pub fn submit_save_state(&self, id: &str, dir: &Path) -> Handle<()> {
        self.on_model(id, Parts::ALL, |g| g.submit_save_state(dir))
    }

    pub fn submit_load_state(&self, id: &str, dir: &Path) -> Handle<()> {
        self.on_model(id, Parts::ALL, |g| g.submit_load_state(dir))
    }

    /// Loads only the parameters of a state (the optimizer starts afresh).
    pub fn submit_load_weights(&self, id: &str, dir: &Path) -> Handle<()> {
        self.on_model(id, Parts::ALL, |g| g.submit_load_weights(dir))
    }

    pub fn submit_export(&self, id: &str, dir: &Path, merge_lora: bool) -> Handle<()> {
        self.on_model(id, Parts::MODEL, |g| g.submit_export(dir, merge_lora))
    }

    /// A private, versioned snapshot of the weights engines need (see [`SamplerWeights`]).
    pub fn submit_sampler_weights(&self, id: &str) -> Handle<SamplerWeights> {
        self.on_model(id, Parts::MODEL, |g| g.submit_sampler_weights())
    }

    // Blocking forms: submit and wait.

    pub fn forward_backward(
        &self,
        id: &str,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
    ) -> Result<ForwardBackwardOutput> {
        self.submit_forward_backward(id, batch, loss, per_token).wait()
    }

    pub fn forward(
        &self,
        id: &str,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
    ) -> Result<ForwardBackwardOutput> {
        self.submit_forward(id, batch, loss, per_token).wait()
    }

    pub fn optim_step(&self, id: &str, params: &AdamParams) -> Result<f64> {
        self.submit_optim_step(id, params).wait()
    }

    /// One optimizer step on `batch`: forward_backward, then optim_step with `params`; returns
    /// the forward_backward's output and the gradient norm. Under `sharding = "full"` the
    /// gradients may then be summed to their owners during the backward (see
    /// [`Worker::forward_backward_for_step`]), which a lone forward_backward cannot do, not
    /// knowing whether more gradients follow before the step.
    pub fn forward_backward_step(
        &self,
        id: &str,
        batch: &[Datum],
        loss: &Loss,
        per_token: bool,
        params: &AdamParams,
    ) -> Result<(ForwardBackwardOutput, f64)> {
        let fb = self.on_model(id, Parts::ALL, |g| g.submit_forward_backward_for_step(batch, Some(loss), per_token));
        let out = fb.wait()?;
        Ok((out, self.optim_step(id, params)?))
    }

    pub fn save_state(&self, id: &str, dir: &Path) -> Result<()> {
        self.submit_save_state(id, dir).wait()
    }

    pub fn load_state(&self, id: &str, dir: &Path) -> Result<()> {
        self.submit_load_state(id, dir).wait()
    }

    pub fn export(&self, id: &str, dir: &Path, merge_lora: bool) -> Result<()> {
        self.submit_export(id, dir, merge_lora).wait()
    }

    pub fn sampler_weights(&self, id: &str) -> Result<SamplerWeights> {
        self.submit_sampler_weights(id).wait()
    }
}
