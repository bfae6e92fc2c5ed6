//! The worker's side of `sharding = "full"` (ZeRO-3): which rank keeps each base weight, and the
//! [`UnitGather`] that makes a unit of the model whole over the data-parallel group.
//!
//! A base weight's keeper is the rank that owns it in the optimizer's [`ShardPlan`], so the rank
//! that updates a weight always holds it whole. The others release it ([`sharded_weights`]) and
//! receive the owner's bits just before a forward or backward reads the unit, freeing them after.
//! Only trainable base weights are sliced: a LoRA model's frozen base stays whole (ranks that are
//! threads of one process share one copy of it already), and so do adapters and a value head,
//! whose new values the optimizer step all-gathers as under `gradients`.
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

use std::collections::HashMap;
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
    /// The parameters (by worker index) that are sliced weights.
    sliced: Vec<bool>,
    /// The unit gathered last, and the gather of the next one in flight.
    last: Mutex<Option<Unit>>,
    prefetch: Mutex<Option<(Unit, JoinHandle<Result<()>>)>>,
}

impl WeightSlices {
    /// The slices of `model`'s trainable base weights (`params`, owned as `plan` says); `None`
    /// when there are none (a LoRA model).
    pub fn new(
        model: &Transformer,
        params: &[(String, Var)],
        plan: &ShardPlan,
        ex: Arc<dyn RankExchange>,
    ) -> Result<Option<Self>> {
        let owner_of: HashMap<_, usize> =
            params.iter().enumerate().map(|(i, (_, v))| (v.as_tensor().id(), plan.owners[i])).collect();
        let mut sliced = vec![false; params.len()];
        let index_of: HashMap<_, usize> =
            params.iter().enumerate().map(|(i, (_, v))| (v.as_tensor().id(), i)).collect();
        let mut units: HashMap<Unit, UnitWeights> = HashMap::new();
        for (name, unit, t) in model.weight_units() {
            let Some(&owner) = owner_of.get(&t.id()) else { continue };
            sliced[index_of[&t.id()]] = true;
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
        }))
    }

    /// Whether units `a` and `b` hold a tensor in common (a tied head and the embedding): such a
    /// pair is never gathered ahead, since releasing `a` would free part of `b`.
    fn share(&self, a: Unit, b: Unit) -> bool {
        let (Some(a), Some(b)) = (self.units.get(&a), self.units.get(&b)) else { return false };
        a.tensors.iter().any(|t| b.tensors.iter().any(|u| u.id() == t.id()))
    }

    /// Waits for the gather in flight, if any; whether it was `unit`'s.
    fn settle(&self, unit: Option<Unit>) -> Result<bool> {
        let Some((fetched, handle)) = lock(&self.prefetch).take() else { return Ok(false) };
        handle.join().map_err(|_| Error::Other("a weight gather thread panicked".into()))??;
        Ok(Some(fetched) == unit)
    }

    /// Whether parameter `i` (worker order) is a sliced weight.
    pub fn is_sliced(&self, i: usize) -> bool {
        self.sliced[i]
    }

    /// Frees every weight this rank does not own.
    pub fn release_unowned(&self) -> Result<()> {
        for &u in self.units.keys() {
            self.release(u)?;
        }
        Ok(())
    }

    /// The group's largest micro-batch count, given this rank's (or why it cannot run): every rank
    /// learns whether any rank refused its batch, and then fails with that reason.
    pub fn agree(&self, mine: std::result::Result<usize, String>) -> Result<usize> {
        self.settle(None)?;
        let all = self.ex.all_gather_bytes(encode(&mine)?)?;
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

    /// Every sliced weight gathered unit by unit: on a rank that asks (`keep`), the whole set by
    /// HF name, copied into fresh storage; nothing elsewhere. Every rank calls it.
    pub fn whole(&self, keep: bool) -> Result<Option<NamedTensors>> {
        self.settle(None)?;
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
        self.settle(None)?;
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

/// Gives this rank's released tensors of `u` the owners' elements.
fn fill_from(u: &UnitWeights, rank: usize, got: Vec<Option<Tensor>>) -> Result<()> {
    for (((t, &owner), name), from) in u.tensors.iter().zip(&u.owners).zip(&u.names).zip(got) {
        if owner == rank || !sharded_weights::is_released(t) {
            continue;
        }
        let from = from.ok_or_else(|| Error::Other(format!("no rank sent `{name}`")))?;
        sharded_weights::fill(t, &from)?;
    }
    Ok(())
}

/// Gathers unit `u` whole on this rank.
fn fetch(ex: &dyn RankExchange, u: &UnitWeights, rank: usize) -> Result<()> {
    let got = ex.gather_owned(mine(u, rank), &u.sizes, None)?;
    fill_from(u, rank, got)
}

impl UnitGather for WeightSlices {
    fn gather(&self, unit: Unit) -> Result<()> {
        if !self.settle(Some(unit))? {
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
