//! Gradients summed to their owners as the backward goes (`sharding = "full"`).
//!
//! Under `full` a rank keeps only its slice of the weights, but its gradient accumulators stay
//! whole until the step sums each to its owner: a rank's peak still holds every gradient. When a
//! step's gradients come from a single backward on every rank (one micro-batch each, nothing
//! accumulated before, the optimizer step next: [`Worker::forward_backward_for_step`]), a
//! weight's local gradient is final as soon as the backward has finished the last unit that
//! reads it, so it is summed to its owner there and dropped on the other ranks:
//!
//! ```text
//! backward, unit by unit (Head, Layer(L−1), …, Layer(0), Embed):
//!     add the unit's gradients to the accumulators
//!     for each sliced weight the unit finishes: reduce to its owner, keep the sum there only
//! step: the owners' sums as the summed gradients (the rest reduced as usual)
//! ```
//! A rank then holds its owned sums and one unit's gradients, not every gradient (FSDP's
//! reduce-scatter after each layer's backward). The head weight's gradient, as large as the
//! embedding's, is summed in blocks of rows while the head's backward makes them
//! (`head_stream.rs`).
//!
//! The sums are the step's: each rank's local gradient is its one backward's (a tied embedding's
//! two parts added in the same order), zeros where it has none, summed over the ranks in rank
//! order, so the bits are those of `none`. With more micro-batches or calls per step, a rank's
//! local gradient is final only after its last backward; summing earlier would change the
//! order of the additions, hence the bits, so the accumulators stay whole until the step (as
//! under FSDP's `no_sync`) — unless the run asks for sums after every micro-batch
//! (`gradient_sum = "micro_batch"`, `gradient_sum.rs`), which runs this reduce in each
//! micro-batch's backward and adds each sum into the owner's running sum.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use super::gradient_sum::add_sum;
use super::head_stream::HeadStream;
use super::weight_slices::WeightSlices;
use super::worker::Worker;
use crate::locks::lock;
use crate::model::sharded_weights::Unit;
use crate::model::tape::Tape;
use crate::{Error, Result};

/// The state of one step whose gradients are summed during its backward.
pub(super) struct UnitReduce {
    /// The sliced weights each unit's backward finishes (worker order).
    completed_by: HashMap<Unit, Vec<usize>>,
    /// The summed gradient of each finished weight this rank owns.
    pub(super) summed: Vec<Option<Tensor>>,
    /// Whether weight `i`'s gradient has been summed (on every rank).
    pub(super) done: Vec<bool>,
    /// The head weight (its index) when its gradient is summed block by block.
    pub(super) head: Option<(usize, Arc<Mutex<HeadStream>>)>,
    /// Summing each micro-batch (`gradient_sum.rs`): the sums of the earlier ones, which each
    /// finished weight's sum is added into at once, so that a rank never holds two sums of a
    /// weight.
    pub(super) running: Option<Vec<Option<Tensor>>>,
}

impl UnitReduce {
    /// Weight `i`'s sum (`None` on a rank that does not own it), made: kept for the step, or
    /// added into the running sums (the owner's alone: in place).
    fn keep(&mut self, i: usize, sum: Option<Tensor>) -> Result<()> {
        self.done[i] = true;
        match (&mut self.running, sum) {
            (Some(running), Some(sum)) => add_sum(&mut running[i], sum, true),
            (None, sum) => {
                self.summed[i] = sum;
                Ok(())
            }
            (Some(_), None) => Ok(()),
        }
    }
}

impl Worker {
    /// Starts summing this call's gradients during its backward (every rank of the group starts
    /// together: see [`Worker::forward_backward_for_step`]); `running`: the sums of earlier
    /// micro-batches, which this backward's are added into (`gradient_sum.rs`).
    pub(super) fn start_unit_reduce(&mut self, running: Option<Vec<Option<Tensor>>>) -> Result<()> {
        let slices = self.slices.as_ref().ok_or_else(|| Error::Other("unit reduce without sliced weights".into()))?;
        let n = self.params.len();
        let mut completed_by = slices.completed_by(&self.params);
        let head = self.head_stream(slices, running.as_deref());
        if let Some((i, _)) = &head {
            completed_by.values_mut().for_each(|list| list.retain(|j| j != i));
        }
        let head = head.map(|(i, h)| (i, Arc::new(Mutex::new(h))));
        self.unit_reduce =
            Some(UnitReduce { completed_by, summed: vec![None; n], done: vec![false; n], head, running });
        Ok(())
    }

    /// The head weight's index and its stream, when the tape can hand its gradient over in
    /// blocks: a policy's trained, sliced head on the tape ([`Tape::streams_head`]).
    fn head_stream(&self, slices: &Arc<WeightSlices>, sums: Option<&[Option<Tensor>]>) -> Option<(usize, HeadStream)> {
        let w = &self.model.lm_head.weight;
        let eligible = self.value_head.is_none() && Tape::serves(&self.model) && Tape::streams_head(&self.model);
        let i = self.params.iter().position(|(_, v)| v.as_tensor().id() == w.id())?;
        let plan = self.shard.as_ref()?;
        let shape = w.dims2().ok()?;
        let tied = w.id() == self.model.embed_tokens.id();
        let into = sums.and_then(|s| s.get(i).cloned().flatten()).filter(|_| plan.owns(i));
        (eligible && slices.is_sliced(w)).then(|| {
            let stream = HeadStream::new(slices.clone(), plan.owners[i], shape, self.accumulator_dtype(i), tied, into);
            (i, stream)
        })
    }

    /// The backward has finished `unit`: the weights it finishes are summed to their owners
    /// (zeros from a rank without their gradient) and leave the accumulators. Nothing unless a
    /// unit reduce is running.
    pub(super) fn unit_done(&mut self, unit: Unit) -> Result<()> {
        let Some(state) = self.unit_reduce.as_mut() else { return Ok(()) };
        if let Some((i, head)) = state.head.clone() {
            let mut head = lock(&head);
            let last = match unit {
                Unit::Head => {
                    head.finish_blocks()?;
                    !head.tied()
                }
                Unit::Embed => head.tied(),
                Unit::Layer(_) => false,
            };
            if last {
                let sum = head.finish()?;
                state.keep(i, sum)?;
            }
        }
        let Some(finished) = state.completed_by.remove(&unit) else { return Ok(()) };
        let (Some(slices), Some(plan)) = (self.slices.clone(), &self.shard) else {
            return Err(Error::Other("unit reduce without sliced weights".into()));
        };
        let owners: Vec<usize> = finished.iter().map(|&i| plan.owners[i]).collect();
        let local = self.take_local_gradients(&finished)?;
        let summed = slices.reduce_to_owners(local, &owners)?;
        let state = self.unit_reduce.as_mut().expect("checked above");
        for (&i, sum) in finished.iter().zip(summed) {
            state.keep(i, sum)?;
        }
        Ok(())
    }

    /// An error when a gradient arrives for a weight whose sum is already made.
    pub(super) fn check_not_summed(&self, i: usize) -> Result<()> {
        match &self.unit_reduce {
            Some(state) if state.done[i] => Err(Error::Other(format!(
                "a gradient of `{}` arrived after its unit's backward had summed it across ranks",
                self.params[i].0
            ))),
            _ => Ok(()),
        }
    }
}
