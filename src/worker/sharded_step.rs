//! The optimizer step of a rank that owns a slice of the parameters ([`super::ShardPlan`]):
//! ZeRO-1 (`optimizer`), ZeRO-2 (`gradients`) and ZeRO-3 (`full`, whose weights live in slices
//! between steps: [`super::weight_slices`]).
//!
//! ```text
//! summed gradients   optimizer: all-reduce, then keep only the owned ones
//!                    gradients, full: reduce to owners (each sum lands on its owner alone)
//! norm               each owner's Σ g² per parameter, all-gathered, added in parameter order
//! update             AdamW on the owned parameters (moments and masters live only there)
//! parameters         every owner's new values all-gathered; the others are set from them
//!                    (full: not the sliced weights, which the next forward gathers)
//! ```
//! Every step is the arithmetic of the unsharded one: the same sums in the same rank order, the
//! same per-parameter squares added in the same order, the same update code on the same inputs.
//! So the weights, the norm and every metric are the bits of `sharding = "none"`.
//!
//! Checkpoints stay layout-free: saving gathers the owners' moments and masters to rank 0,
//! which writes them as an unsharded worker would; loading reads the whole state and keeps the
//! owned part. A checkpoint resumes under any sharding and rank count.

use std::path::Path;
use std::sync::Arc;

use candle_core::Tensor;

use super::adamw::{clip_coefficient, norm_of_squares, square_sums, AdamParams, Moments};
use super::sharding::ShardPlan;
use super::weight_slices::WeightSlices;
use super::worker::Worker;
use crate::model::sharded_weights::WeightGate;
use crate::model::tape::Tape;
use crate::model::weight_update::WeightUpdate;
use crate::model::SamplerWeights;
use crate::world::{decode, encode};
use crate::{Error, Result};

/// What a sharded step exchanges with the other data-parallel ranks (dispatch serves it over
/// its collective). Every rank calls each method at the same point with tensors of the same
/// shapes in the same order.
pub trait RankExchange: Send + Sync {
    /// The sum over every rank of each tensor, on every rank.
    fn all_reduce(&self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// The sum over every rank of tensor `i`, on rank `owners[i]` only (`None` elsewhere). The
    /// tensors are handed over, their storage with them: a sum may be written over it.
    fn reduce_to_owners(&self, tensors: Vec<Tensor>, owners: &[usize]) -> Result<Vec<Option<Tensor>>>;
    /// Every rank's `Some` tensors (each index `Some` on at most one rank; tensor i has
    /// `sizes[i]` elements), on every rank (`root` `None`) or on rank `root` alone (the others get
    /// `None`s).
    fn gather_owned(
        &self,
        mine: Vec<Option<Tensor>>,
        sizes: &[usize],
        root: Option<usize>,
    ) -> Result<Vec<Option<Tensor>>>;
    /// Every rank's bytes, in rank order.
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// Whether the other ranks' tensors `gather_owned` returns are this rank's alone (it may
    /// take their storage rather than copy it).
    fn gathers_alone(&self) -> bool {
        false
    }
    /// Wakes the other ranks with an error: this rank will not reach the next collective.
    fn abort(&self, reason: &str);
}

impl Worker {
    /// Makes this worker one of `plan.ranks` ranks owning the parameters `plan` gives it: the
    /// optimizer state of the others is dropped.
    pub fn shard(&mut self, plan: ShardPlan) -> Result<()> {
        if plan.owners.len() != self.params.len() {
            return Err(Error::Other(format!(
                "a shard plan of {} parameters for a worker of {}",
                plan.owners.len(),
                self.params.len()
            )));
        }
        self.shard = Some(plan);
        self.drop_unowned_state();
        Ok(())
    }

    /// [`Worker::shard`] for `full`: also keeps only the owned base weights, releasing the others;
    /// the forward and backward gather them unit by unit over `ex` (`WeightSlices`).
    pub fn shard_full(&mut self, plan: ShardPlan, ex: Arc<dyn RankExchange>) -> Result<()> {
        if !Tape::serves(&self.model) {
            return Err(Error::input(format!(
                "sharding = \"full\": only the CPU training path gathers weights layer by layer; this model is \
                 on {:?} (use \"gradients\")",
                self.model.device.location()
            )));
        }
        self.shard(plan.clone())?;
        if let Some(slices) = WeightSlices::new(&self.model, &self.params, &plan, ex)? {
            let slices = Arc::new(slices);
            slices.release_unowned()?;
            self.model.weight_gate = Some(WeightGate(slices.clone()));
            self.slices = Some(slices);
        }
        Ok(())
    }

    /// What an engine needs of this worker's weights ([`Worker::sampler_weights`]) on a rank that
    /// asks (`keep`), `None` elsewhere. Every rank of a `full` group calls it: the weights are
    /// gathered unit by unit into the snapshot, never whole in the model.
    pub fn sampler_weights_gathered(&self, keep: bool) -> Result<Option<SamplerWeights>> {
        self.check_resident()?;
        match &self.slices {
            // A LoRA model's engines need its adapters alone, which every rank holds whole.
            Some(slices) if self.config.lora.is_none() => {
                let tensors = slices.whole(keep)?;
                Ok(tensors.map(|t| SamplerWeights::new(self.step, WeightUpdate::Full(t))))
            }
            _ => keep.then(|| self.sampler_weights()).transpose(),
        }
    }

    /// Runs `f` with every weight whole on this rank when `here` (the others take part in the
    /// gathers), then releases what this rank does not own. Every rank of a `full` group calls it;
    /// without sliced weights it is `f` (when `here`).
    pub fn with_whole_weights(&self, here: bool, f: impl FnOnce(&Worker) -> Result<()>) -> Result<()> {
        let Some(slices) = &self.slices else { return if here { f(self) } else { Ok(()) } };
        slices.fill_all(here)?;
        let out = if here { f(self) } else { Ok(()) };
        slices.release_unowned()?;
        out
    }

    /// An error naming `what` while this rank holds only its slice of the weights (`full`):
    /// reading them needs every rank ([`Worker::with_whole_weights`]).
    pub(super) fn check_weights_whole(&self, what: &str) -> Result<()> {
        let sliced = self.params.iter().find(|(_, v)| crate::model::sharded_weights::is_released(v.as_tensor()));
        match sliced {
            Some((name, _)) => Err(Error::input(format!(
                "{what}: this rank holds only its slice of the weights (sharding = \"full\"; `{name}` is another \
                 rank's); every rank of the group must take part in gathering them"
            ))),
            None => Ok(()),
        }
    }

    /// The sizes [`ShardPlan::new`] splits: each trainable parameter's element count.
    pub fn param_sizes(&self) -> Vec<usize> {
        self.params.iter().map(|(_, v)| v.elem_count()).collect()
    }

    /// Forgets the moments and masters of parameters another rank owns.
    pub(super) fn drop_unowned_state(&mut self) {
        let Some(plan) = &self.shard else { return };
        for i in 0..self.params.len() {
            if !plan.owns(i) {
                self.moments[i] = None;
                if let Some(masters) = self.masters.as_mut() {
                    masters[i] = None;
                }
            }
        }
    }

    /// The accumulated gradient of each parameter of `which`, zeros where there is none (in the
    /// accumulators' dtype: f32 under mixed precision), so that every rank passes the same
    /// shapes.
    pub(super) fn take_local_gradients(&mut self, which: &[usize]) -> Result<Vec<Tensor>> {
        which.iter().map(|&i| self.take_local_gradient(i)).collect()
    }

    /// Parameter `i`'s accumulated gradient, taken, or zeros (see
    /// [`Worker::take_local_gradients`]).
    pub(super) fn take_local_gradient(&mut self, i: usize) -> Result<Tensor> {
        if let Some(g) = self.grads[i].take() {
            return Ok(g);
        }
        let v = self.params[i].1.as_tensor();
        Ok(Tensor::zeros(v.shape(), self.accumulator_dtype(i), v.device())?)
    }

    /// One AdamW step of a sharded rank on its accumulated gradients (see the module
    /// documentation; gradients a backward already summed to their owners,
    /// `worker/unit_reduce.rs`, are taken as they are); returns the global gradient norm before
    /// clipping, as [`Worker::optim_step`] does, with the same handling of a non-finite norm.
    pub fn optim_step_sharded(&mut self, params: &AdamParams, ex: &dyn RankExchange) -> Result<f64> {
        params.validate()?;
        self.check_resident()?;
        let plan =
            self.shard.clone().ok_or_else(|| Error::Other("optim_step_sharded on an unsharded worker".into()))?;
        let n = self.params.len();
        // Every rank started the unit reduce together, so every rank sums the same rest; sums
        // made after each micro-batch are taken as they are.
        let (mut owned, summed) = match self.unit_reduce.take() {
            Some(state) => (state.summed, state.done),
            None if self.summed => (std::mem::replace(&mut self.grads, vec![None; n]), vec![true; n]),
            None => (vec![None; n], vec![false; n]),
        };
        let rest: Vec<usize> = (0..n).filter(|&i| !summed[i]).collect();
        for (&i, sum) in rest.iter().zip(self.sum_to_keepers(&rest, ex)?) {
            owned[i] = sum;
        }

        // The norm: the owners' squares, in parameter order.
        let mine: Vec<(usize, &Tensor)> =
            owned.iter().enumerate().filter_map(|(i, g)| Some((i, g.as_ref()?))).collect();
        let squares = square_sums(&mine.iter().map(|(_, g)| *g).collect::<Vec<_>>())?;
        let indexed: Vec<(usize, f64)> = mine.iter().map(|(i, _)| *i).zip(squares).collect();
        let mut by_param: Vec<Option<f64>> = vec![None; self.params.len()];
        for (rank, bytes) in ex.all_gather_bytes(encode(&indexed)?)?.iter().enumerate() {
            let theirs: Vec<(usize, f64)> = decode(bytes)?;
            for (i, sq) in theirs {
                match by_param.get_mut(i) {
                    Some(slot @ None) => *slot = Some(sq),
                    _ => return Err(Error::Other(format!("rank {rank} sent the square sum of parameter {i} twice"))),
                }
            }
        }
        let all: Vec<f64> = by_param
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.ok_or_else(|| Error::Other(format!("no rank owns parameter {i}'s gradient"))))
            .collect::<Result<_>>()?;
        let norm = norm_of_squares(&all);
        self.zero_grad();
        if !norm.is_finite() {
            return Ok(norm);
        }

        let coef = clip_coefficient(norm, params.grad_clip_norm);
        for (i, grad) in owned.into_iter().enumerate() {
            if let Some(grad) = grad {
                self.update_param(i, grad, coef, params)?;
            }
        }
        // Every rank takes the owners' new parameters, except sliced weights (`full`), which
        // stay with their owners until a forward gathers them.
        let shared: Vec<usize> = (0..self.params.len())
            .filter(|&i| !self.slices.as_ref().is_some_and(|s| s.is_sliced(self.params[i].1.as_tensor())))
            .collect();
        let mine = shared.iter().map(|&i| plan.owns(i).then(|| self.params[i].1.as_tensor().clone())).collect();
        let sizes: Vec<usize> = shared.iter().map(|&i| self.params[i].1.elem_count()).collect();
        let gathered = ex.gather_owned(mine, &sizes, None)?;
        for (&i, value) in shared.iter().zip(gathered) {
            if plan.owns(i) {
                continue;
            }
            let value = value.ok_or_else(|| Error::Other(format!("no rank sent parameter {i}")))?;
            self.params[i].1.set(&value)?;
        }
        self.step += 1;
        Ok(norm)
    }

    /// The whole optimizer state (moments and masters by parameter) gathered on rank 0 of a
    /// sharded group, which then writes the checkpoint as an unsharded worker would (`write`:
    /// whether this rank's process writes). Every rank of the group calls it.
    pub fn save_state_sharded(&self, dir: &Path, write: bool, ex: &dyn RankExchange) -> Result<()> {
        let plan =
            self.shard.as_ref().ok_or_else(|| Error::Other("save_state_sharded on an unsharded worker".into()))?;
        let pick = |f: &dyn Fn(&Moments) -> &Tensor| -> Vec<Option<Tensor>> {
            self.moments.iter().map(|m| m.as_ref().map(|m| f(m).clone())).collect()
        };
        let sizes = self.param_sizes();
        // Sliced weights (`full`) are gathered to rank 0 for the parameter file (a LoRA model's
        // holds its adapters alone, which are whole).
        let gathered = self.slices.as_ref().filter(|_| self.config.lora.is_none());
        if let Some(slices) = gathered {
            slices.fill_all(plan.rank == 0 && write)?;
        }
        let exp_avg = ex.gather_owned(pick(&|m| &m.exp_avg), &sizes, Some(0))?;
        let exp_avg_sq = ex.gather_owned(pick(&|m| &m.exp_avg_sq), &sizes, Some(0))?;
        let masters = match &self.masters {
            Some(m) => Some(ex.gather_owned(m.clone(), &sizes, Some(0))?),
            None => None,
        };
        let steps: Vec<(usize, u64)> =
            self.moments.iter().enumerate().filter_map(|(i, m)| Some((i, m.as_ref()?.step))).collect();
        let all_steps = ex.all_gather_bytes(encode(&steps)?)?;
        if plan.rank != 0 || !write {
            return Ok(());
        }
        let mut step_of: Vec<Option<u64>> = vec![None; self.params.len()];
        for bytes in &all_steps {
            for (i, step) in decode::<Vec<(usize, u64)>>(bytes)? {
                *step_of.get_mut(i).ok_or_else(|| Error::Other(format!("a step count for parameter {i}")))? =
                    Some(step);
            }
        }
        let moments: Vec<Option<Moments>> = exp_avg
            .into_iter()
            .zip(exp_avg_sq)
            .zip(step_of)
            .map(|((m, v), step)| match (m, v, step) {
                (Some(exp_avg), Some(exp_avg_sq), Some(step)) => Some(Moments { exp_avg, exp_avg_sq, step }),
                _ => None,
            })
            .collect();
        let written = self.write_state(dir, &moments, masters.as_deref());
        if let Some(slices) = gathered {
            slices.release_unowned()?;
        }
        written
    }
}
