//! The worker's side of `sharding = "full"` (ZeRO-3): which rank keeps each base weight, and the
//! [`UnitGather`] that makes a unit of the model whole over the data-parallel group.
//!
//! A trained base weight's keeper is the rank that owns it in the optimizer's [`ShardPlan`], so
//! the rank that updates a weight always holds it whole. A LoRA model's frozen base is sliced by
//! a plan of its own over the base weights (same rule: largest first, to the least-loaded rank);
//! each rank then holds a base of its own, loaded for it ([`crate::dispatch::Dispatch`]), since a
//! base shared with other ranks or models would be released under them. The others release a
//! weight ([`sharded_weights`]) and receive the keeper's bits just before a forward or backward
//! reads the unit, freeing them after. Adapters and a value head stay whole; the optimizer step
//! all-gathers their new values as under `gradients`.
//!
//! Lockstep: the units are gathered by collectives, so every rank must run the same number of
//! forwards and backwards per call. Before a call's micro-batches the ranks agree on the largest
//! count (and on whether any rank's batch was refused); a rank with fewer walks the units of the
//! ones it lacks without computing.
//!
//! Prefetch: while a unit is computed, the next one of the same walk is gathered on a thread of
//! its own (so at most two units are whole at once). The next unit follows from the one before:
//! after the embedding or a layer reached going up, the layer above (the head after the last);
//! after a head gathered again (a backward) or a layer reached going down, the layer below. A
//! forward's head is not followed (a backward may not come), nor is a backward's first layer,
//! so no gather is in flight when a walk ends and another collective begins. Every rank sees
//! the same walks, hence starts the same gathers in the same order.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use candle_core::{Tensor, Var};

use super::sharded_step::RankExchange;
use super::sharding::ShardPlan;
use crate::locks::lock;
use crate::model::named_tensors::NamedTensors;
use crate::model::sharded_weights::{self, forward_units, Unit, UnitGather};
use crate::model::Transformer;
use crate::world::{decode, encode};
use crate::{Error, Result};

/// One unit's weights, in the model's order.
struct UnitWeights {
    names: Vec<String>,
    tensors: Vec<Tensor>,
    owners: Vec<usize>,
    sizes: Vec<usize>,
}

pub struct WeightSlices {
    ex: Arc<dyn RankExchange>,
    rank: usize,
    layers: usize,
    units: HashMap<Unit, Arc<UnitWeights>>,
    /// The tensors that are sliced.
    sliced: HashSet<candle_core::TensorId>,
    /// The unit gathered last, the gather of the next one in flight, and the unit that gather
    /// made whole once it was waited for (before another collective).
    last: Mutex<Option<Unit>>,
    prefetch: Mutex<Option<(Unit, JoinHandle<Result<()>>)>>,
    ready: Mutex<Option<Unit>>,
}

impl WeightSlices {
    /// The slices of `model`'s base weights over the group `ex` serves (this rank: `plan.rank`):
    /// a trained weight (one of `params`) kept by its owner in `plan`, a frozen one (a LoRA
    /// model's base) by its keeper in a plan over the base weights ([`ShardPlan::new`]). `None`
    /// when there is nothing to slice (a model of no weights).
    pub fn new(
        model: &Transformer,
        params: &[(String, Var)],
        plan: &ShardPlan,
        ex: Arc<dyn RankExchange>,
    ) -> Result<Option<Self>> {
        let mut owner_of: HashMap<_, usize> =
            params.iter().enumerate().map(|(i, (_, v))| (v.as_tensor().id(), plan.owners[i])).collect();
        let frozen: Vec<(String, Tensor)> =
            model.named_params().into_iter().filter(|(_, t)| !owner_of.contains_key(&t.id())).collect();
        let sizes: Vec<usize> = frozen.iter().map(|(_, t)| t.elem_count()).collect();
        let frozen_plan = ShardPlan::new(plan.mode, plan.rank, plan.ranks, &sizes);
        owner_of.extend(frozen.iter().zip(&frozen_plan.owners).map(|((_, t), &o)| (t.id(), o)));
        let mut sliced = HashSet::new();
        let mut units: HashMap<Unit, UnitWeights> = HashMap::new();
        for (name, unit, t) in model.weight_units() {
            let Some(&owner) = owner_of.get(&t.id()) else { continue };
            sliced.insert(t.id());
            let u = units.entry(unit).or_insert_with(|| UnitWeights {
                names: vec![],
                tensors: vec![],
                owners: vec![],
                sizes: vec![],
            });
            u.names.push(name);
            u.sizes.push(t.elem_count());
            u.tensors.push(t);
            u.owners.push(owner);
        }
        if units.is_empty() {
            return Ok(None);
        }
        let units = units.into_iter().map(|(k, u)| (k, Arc::new(u))).collect();
        Ok(Some(WeightSlices {
            ex,
            rank: plan.rank,
            layers: model.layers.len(),
            units,
            sliced,
            last: Mutex::new(None),
            prefetch: Mutex::new(None),
            ready: Mutex::new(None),
        }))
    }

    /// Whether units `a` and `b` hold a tensor in common (a tied head and the embedding): such a
    /// pair is never gathered ahead, since releasing `a` would free part of `b`.
    fn share(&self, a: Unit, b: Unit) -> bool {
        let (Some(a), Some(b)) = (self.units.get(&a), self.units.get(&b)) else { return false };
        a.tensors.iter().any(|t| b.tensors.iter().any(|u| u.id() == t.id()))
    }

    /// Waits for the gather in flight, if any, so that no other collective runs beside it; the
    /// unit it made whole is then ready for [`UnitGather::gather`].
    fn settle(&self) -> Result<()> {
        let Some((fetched, handle)) = lock(&self.prefetch).take() else { return Ok(()) };
        handle.join().map_err(|_| Error::Other("a weight gather thread panicked".into()))??;
        *lock(&self.ready) = Some(fetched);
        Ok(())
    }

    /// For each unit of a backward ([`sharded_weights::gradient_units`]), the sliced weights
    /// (worker order, `params`) whose gradient is final once that unit's backward is done: the
    /// last unit that reads them (a tied embedding's is the Embed unit, after the head's part).
    pub fn completed_by(&self, params: &[(String, Var)]) -> HashMap<Unit, Vec<usize>> {
        let index_of: HashMap<_, usize> =
            params.iter().enumerate().map(|(i, (_, v))| (v.as_tensor().id(), i)).collect();
        let mut last: HashMap<usize, Unit> = HashMap::new();
        for unit in sharded_weights::gradient_units(self.layers) {
            for t in self.units.get(&unit).map(|u| &u.tensors[..]).unwrap_or_default() {
                if let Some(&i) = index_of.get(&t.id()) {
                    last.insert(i, unit);
                }
            }
        }
        let mut out: HashMap<Unit, Vec<usize>> = HashMap::new();
        for (i, unit) in last {
            out.entry(unit).or_default().push(i);
        }
        out.values_mut().for_each(|v| v.sort_unstable());
        out
    }

    /// [`RankExchange::reduce_to_owners`] over the group, after the gather in flight.
    pub fn reduce_to_owners(&self, tensors: Vec<Tensor>, owners: &[usize]) -> Result<Vec<Option<Tensor>>> {
        self.settle()?;
        self.ex.reduce_to_owners(tensors, owners)
    }

    /// The group's exchange, for collectives of the worker's own, once no gather is in flight.
    pub fn exchange(&self) -> Result<Arc<dyn RankExchange>> {
        self.settle()?;
        Ok(self.ex.clone())
    }

    /// [`RankExchange::all_gather_bytes`] over the group, after the gather in flight.
    pub fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.settle()?;
        self.ex.all_gather_bytes(bytes)
    }

    /// Whether `t` is a sliced weight.
    pub fn is_sliced(&self, t: &Tensor) -> bool {
        self.sliced.contains(&t.id())
    }

    /// Frees every weight this rank does not own, and returns the memory to the kernel.
    pub fn release_unowned(&self) -> Result<()> {
        for &u in self.units.keys() {
            self.release(u)?;
        }
        crate::memory::return_freed();
        Ok(())
    }

    /// What the group's ranks bring to a call, given this rank's micro-batch count and whether it
    /// holds gradients from earlier calls (or why it cannot run): the largest count and whether
    /// any rank holds gradients. Every rank learns whether any rank refused its batch, and then
    /// fails with that reason.
    pub fn agree(&self, mine: std::result::Result<(usize, bool), String>) -> Result<(usize, bool)> {
        self.settle()?;
        let all = self.ex.all_gather_bytes(encode(&mine)?)?;
        if let Err(e) = mine {
            return Err(Error::input(e));
        }
        let (mut most, mut pending) = (0, false);
        for (rank, bytes) in all.iter().enumerate() {
            match decode::<std::result::Result<(usize, bool), String>>(bytes)? {
                Ok((n, p)) => (most, pending) = (most.max(n), pending || p),
                Err(e) => return Err(Error::input(format!("data-parallel rank {rank} refused its batch: {e}"))),
            }
        }
        Ok((most, pending))
    }

    /// Every sliced weight gathered unit by unit: on a rank that asks (`keep`), the whole set by
    /// HF name, copied into fresh storage; nothing elsewhere. Every rank calls it.
    pub fn whole(&self, keep: bool) -> Result<Option<NamedTensors>> {
        self.settle()?;
        let mut out = NamedTensors::new("gathered weights");
        for unit in forward_units(self.layers) {
            let Some(u) = self.units.get(&unit) else { continue };
            let got = self.ex.gather_owned(mine(u, self.rank), &u.sizes, None)?;
            if !keep {
                continue;
            }
            for (name, t) in u.names.iter().zip(got) {
                let t = t.ok_or_else(|| Error::Other(format!("no rank sent `{name}`")))?;
                if !out.contains(name) {
                    out.insert(name.clone(), t.copy()?.detach())?;
                }
            }
        }
        Ok(keep.then_some(out))
    }

    /// Makes every sliced weight whole on this rank (every rank calls it; `fill` false: take
    /// part without keeping them).
    pub fn fill_all(&self, fill: bool) -> Result<()> {
        self.settle()?;
        for unit in forward_units(self.layers) {
            let Some(u) = self.units.get(&unit) else { continue };
            match fill {
                true => fetch(&*self.ex, u, self.rank)?,
                false => drop(self.ex.gather_owned(mine(u, self.rank), &u.sizes, None)?),
            }
        }
        Ok(())
    }
}

/// The unit a walk over a model of `layers` layers reads after `unit`, given the one it read
/// before (see the module documentation); `None` where the walk may end.
fn next_unit(layers: usize, before: Option<Unit>, unit: Unit) -> Option<Unit> {
    let up = |i: usize| if i + 1 < layers { Unit::Layer(i + 1) } else { Unit::Head };
    let down = |i: usize| i.checked_sub(1).map(Unit::Layer);
    match (before, unit) {
        (_, Unit::Embed) => Some(if layers > 0 { Unit::Layer(0) } else { Unit::Head }),
        (Some(Unit::Embed), Unit::Layer(i)) => Some(up(i)),
        (Some(Unit::Layer(j)), Unit::Layer(i)) if j + 1 == i => Some(up(i)),
        (Some(Unit::Layer(j)), Unit::Layer(i)) if i + 1 == j => down(i),
        (Some(Unit::Head), Unit::Layer(i)) => down(i),
        (Some(Unit::Head), Unit::Head) => layers.checked_sub(1).map(Unit::Layer),
        _ => None,
    }
}

/// The unit's tensors this rank owns (`None` for the others).
fn mine(u: &UnitWeights, rank: usize) -> Vec<Option<Tensor>> {
    u.tensors.iter().zip(&u.owners).map(|(t, &o)| (o == rank).then(|| t.clone())).collect()
}

/// Gives this rank's released tensors of `u` the owners' elements (`take`: the gathered tensors'
/// storage itself, [`RankExchange::gathers_alone`]).
fn fill_from(u: &UnitWeights, rank: usize, got: Vec<Option<Tensor>>, take: bool) -> Result<()> {
    for (((t, &owner), name), from) in u.tensors.iter().zip(&u.owners).zip(&u.names).zip(got) {
        if owner == rank || !sharded_weights::is_released(t) {
            continue;
        }
        let from = from.ok_or_else(|| Error::Other(format!("no rank sent `{name}`")))?;
        match take {
            true => sharded_weights::fill_taking(t, from)?,
            false => sharded_weights::fill(t, &from)?,
        }
    }
    Ok(())
}

/// Gathers unit `u` whole on this rank.
fn fetch(ex: &dyn RankExchange, u: &UnitWeights, rank: usize) -> Result<()> {
    let got = ex.gather_owned(mine(u, rank), &u.sizes, None)?;
    fill_from(u, rank, got, ex.gathers_alone())
}

impl UnitGather for WeightSlices {
    fn gather(&self, unit: Unit) -> Result<()> {
        self.settle()?;
        if lock(&self.ready).take() != Some(unit) {
            if let Some(u) = self.units.get(&unit) {
                fetch(&*self.ex, u, self.rank)?;
            }
        }
        let before = lock(&self.last).replace(unit);
        if let Some(next) = next_unit(self.layers, before, unit).filter(|&n| !self.share(unit, n)) {
            if let Some(u) = self.units.get(&next) {
                let (ex, u, rank) = (self.ex.clone(), u.clone(), self.rank);
                let handle = std::thread::Builder::new()
                    .name("oxrl-prefetch".into())
                    .spawn(move || fetch(&*ex, &u, rank))
                    .map_err(|e| Error::Other(format!("cannot start a weight gather thread: {e}")))?;
                *lock(&self.prefetch) = Some((next, handle));
            }
        }
        Ok(())
    }

    fn release(&self, unit: Unit) -> Result<()> {
        let Some(u) = self.units.get(&unit) else { return Ok(()) };
        for (t, &owner) in u.tensors.iter().zip(&u.owners) {
            if owner != self.rank && !sharded_weights::is_released(t) {
                sharded_weights::release(t)?;
            }
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        self.ex.abort(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::sharded_weights::backward_units;

    /// Following a forward and then a backward walk, each unit names the next of its walk, and
    /// nothing after a forward's head or a backward's first layer.
    #[test]
    fn the_next_unit_follows_the_walks() {
        for layers in [1, 3] {
            let walk: Vec<Unit> = forward_units(layers).into_iter().chain(backward_units(layers)).collect();
            let mut before = Some(Unit::Layer(7)); // whatever came before the call
            let mut predicted = vec![];
            for &u in &walk {
                predicted.push(next_unit(layers, before, u));
                before = Some(u);
            }
            let f = layers + 2;
            let mut want: Vec<Option<Unit>> = walk[1..f].iter().copied().map(Some).collect();
            want.push(None); // the forward's head: a backward may not follow
            want.extend(walk[f + 1..].iter().copied().map(Some));
            want.push(None); // the backward's last layer
            assert_eq!(predicted, want, "{layers} layers");
            // A forward that follows a forward starts over.
            assert_eq!(next_unit(layers, Some(Unit::Head), Unit::Embed), Some(Unit::Layer(0)));
        }
    }
}
