//! When the data-parallel ranks' gradients are summed (`train.gradient_sum`,
//! `launch.gradient_sum`): once, at the optimizer step (`step`, the default), or after every
//! micro-batch (`micro_batch`).
//!
//! ```text
//! step:        each rank adds up its micro-batches, g_r = (g_r1 + g_r2) + …
//!              the step sums the ranks, G = Σ_r g_r                       (DDP's no_sync)
//! micro_batch: for each round m (as many as the busiest rank has; zeros from a rank without)
//!                  S_m = Σ_r g_rm, kept by the owner under sharding       (FSDP, ZeRO-2/3)
//!              G = (S_1 + S_2) + …
//! ```
//! The two orders of additions give different bits, so the setting is a choice of the run, and
//! every sharding mode gives the bits of `none` under the same setting. `step` sums once and
//! keeps each rank's gradients whole until then. `micro_batch` sums every round, and between
//! rounds a rank keeps the sums it owns: under `full` a round's gradients are summed unit by
//! unit during its backward (`unit_reduce.rs`), each added into the running sum as soon as it
//! is made (the head's block by block: `head_stream.rs`), so a rank holds its slice of the
//! gradients plus one unit's, however many micro-batches it runs. In the other modes a round's gradients
//! are summed after its backward, so a rank holds its own sums plus the round's whole gradients
//! (twice the gradients under `none`).
//!
//! Between calls the accumulators hold the summed gradients ([`Worker::gradients_summed`]); the
//! step takes them as they are.

use std::sync::Arc;

use candle_core::Tensor;

use super::in_place::add_in_place;
use super::sharded_step::RankExchange;
use super::sharding::Sharding;
use super::worker::Worker;
use crate::world::{decode, encode};
use crate::{Error, Result};

crate::choice! {
    /// When the data-parallel ranks' gradients are summed.
    #[derive(Default)]
    pub enum GradientSum("gradient_sum") {
        /// Once, at the optimizer step, after each rank has added up its micro-batches.
        #[default]
        Step = "step",
        /// After every micro-batch; a rank keeps only the sums it owns.
        MicroBatch = "micro_batch",
    }
}

/// The most micro-batches any rank of the group brings to a call, given this rank's count (or
/// why it refuses its batch): every rank learns whether one refused, and then fails with that
/// reason, so that none waits in a collective the others never reach.
pub(super) fn agree_on_rounds(ex: &dyn RankExchange, mine: std::result::Result<usize, String>) -> Result<usize> {
    let all = ex.all_gather_bytes(encode(&mine)?)?;
    if let Err(e) = mine {
        return Err(Error::input(e));
    }
    let mut most = 0;
    for (rank, bytes) in all.iter().enumerate() {
        match decode::<std::result::Result<usize, String>>(bytes)? {
            Ok(n) => most = most.max(n),
            Err(e) => return Err(Error::input(format!("data-parallel rank {rank} refused its batch: {e}"))),
        }
    }
    Ok(most)
}

/// `acc += sum`, or `sum` itself where there is no `acc` yet; in `acc`'s storage when this rank
/// alone reads it (`in_place`), else into a new tensor.
pub(super) fn add_sum(acc: &mut Option<Tensor>, sum: Tensor, in_place: bool) -> Result<()> {
    match acc {
        Some(a) if in_place && add_in_place(a, &sum)? => {}
        Some(a) => *a = (&*a + &sum)?,
        None => *acc = Some(sum),
    }
    Ok(())
}

impl Worker {
    /// Makes this worker one rank of a group whose collectives go over `ex` (dispatch gives each
    /// rank its side); without one a worker is a group of one.
    pub fn join_group(&mut self, ex: Arc<dyn RankExchange>) {
        self.exchange = Some(ex);
    }

    /// Whether the accumulators hold the ranks' summed gradients (`gradient_sum = "micro_batch"`
    /// after a backward), which the step applies without summing again.
    pub fn gradients_summed(&self) -> bool {
        self.summed
    }

    /// Whether this call's backward sums every micro-batch across the ranks.
    pub(super) fn sums_each_micro_batch(&self) -> bool {
        self.config.gradient_sum == GradientSum::MicroBatch
    }

    /// The exchange a round's sums go over: the sliced weights' once no gather is in flight
    /// (`full`), else the group's; `None` for a worker alone.
    pub(super) fn round_exchange(&self) -> Result<Option<Arc<dyn RankExchange>>> {
        match &self.slices {
            Some(slices) => Ok(Some(slices.exchange()?)),
            None => Ok(self.exchange.clone()),
        }
    }

    /// Starts a call that sums each micro-batch: the sums so far leave the accumulators, which
    /// then hold one round's gradients at a time. Returns the sums, which
    /// [`Worker::end_summing_call`] puts back.
    pub(super) fn start_summing_call(&mut self) -> Result<Vec<Option<Tensor>>> {
        if !self.summed && self.grads.iter().any(Option::is_some) {
            return Err(Error::Other("gradients of this rank alone are pending where sums were expected".into()));
        }
        Ok(std::mem::replace(&mut self.grads, vec![None; self.params.len()]))
    }

    /// Ends a call that summed each micro-batch over `rounds` rounds: `sums` become the
    /// accumulators again. After any round they are sums on every rank alike (the count is the
    /// group's), so every rank's step skips the sum together; a call without a round on any rank
    /// leaves them as they were.
    pub(super) fn end_summing_call(&mut self, mut sums: Vec<Option<Tensor>>, rounds: usize) {
        // A round that failed under `full` left them with its unit reduce.
        if let Some(running) = self.unit_reduce.take().and_then(|state| state.running) {
            sums = running;
        }
        if sums.len() != self.params.len() {
            sums = vec![None; self.params.len()];
        }
        self.grads = sums;
        self.summed |= rounds > 0;
    }

    /// Starts one round: under `full`, its gradients are summed unit by unit as the backward
    /// finishes them, each added into `sums` there (which the unit reduce holds until
    /// [`Worker::end_round`]).
    pub(super) fn start_round(&mut self, sums: &mut Vec<Option<Tensor>>) -> Result<()> {
        if self.slices.is_some() {
            self.start_unit_reduce(Some(std::mem::take(sums)))?;
        }
        Ok(())
    }

    /// Ends one round: the gradients its backward left (all of them but the ones a `full` rank
    /// summed during it) are summed across the ranks, and every sum this rank keeps is added to
    /// `sums`.
    pub(super) fn end_round(&mut self, sums: &mut Vec<Option<Tensor>>) -> Result<()> {
        let n = self.params.len();
        let done = match self.unit_reduce.take() {
            Some(state) => {
                *sums = state.running.ok_or_else(|| Error::Other("a round's unit reduce lost its sums".into()))?;
                state.done
            }
            None => vec![false; n],
        };
        let rest: Vec<usize> = (0..n).filter(|&i| !done[i]).collect();
        let ex = self.round_exchange()?;
        // Unsharded ranks of one process share the all-reduce's sums (one tensor read by each):
        // those are added out of place. A sum only its owner keeps is the owner's to write.
        let mine_alone = self.shard.is_some() || ex.as_ref().is_none_or(|ex| ex.gathers_alone());
        let round: Vec<Option<Tensor>> = match ex {
            Some(ex) => self.sum_to_keepers(&rest, &*ex)?,
            // Alone: the round's own gradients are the sums.
            None => rest.iter().map(|&i| self.grads[i].take()).collect(),
        };
        for (&i, sum) in rest.iter().zip(round) {
            if let Some(sum) = sum {
                add_sum(&mut sums[i], sum, mine_alone)?;
            }
        }
        Ok(())
    }

    /// The local gradients of parameters `which` (zeros where there is none), summed over the
    /// ranks: on their owners alone under `gradients` and `full`, kept by their owners under
    /// `optimizer` and by every rank unsharded (`None` where this rank keeps no sum).
    pub(super) fn sum_to_keepers(&mut self, which: &[usize], ex: &dyn RankExchange) -> Result<Vec<Option<Tensor>>> {
        if which.is_empty() {
            return Ok(vec![]);
        }
        let local = self.take_local_gradients(which)?;
        let sums: Vec<Option<Tensor>> = match &self.shard {
            Some(plan) if matches!(plan.mode, Sharding::Gradients | Sharding::Full) => {
                let owners: Vec<usize> = which.iter().map(|&i| plan.owners[i]).collect();
                ex.reduce_to_owners(local, &owners)?
            }
            Some(plan) => {
                ex.all_reduce(local)?.into_iter().zip(which).map(|(g, &i)| plan.owns(i).then_some(g)).collect()
            }
            None => ex.all_reduce(local)?.into_iter().map(Some).collect(),
        };
        if sums.len() != which.len() {
            return Err(Error::Other(format!("{} summed gradients for {} parameters", sums.len(), which.len())));
        }
        Ok(sums)
    }
}
