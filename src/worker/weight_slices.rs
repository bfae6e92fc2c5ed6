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

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Tensor, Var};

use super::sharded_step::RankExchange;
use super::sharding::ShardPlan;
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
    units: HashMap<Unit, UnitWeights>,
    /// The parameters (by worker index) that are sliced weights.
    sliced: Vec<bool>,
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
        Ok(Some(WeightSlices { ex, rank: plan.rank, layers: model.layers.len(), units, sliced }))
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
        let mut out = NamedTensors::new("gathered weights");
        for unit in forward_units(self.layers) {
            let Some(u) = self.units.get(&unit) else { continue };
            let mine = self.mine(u);
            let got = self.ex.gather_owned(mine, &u.sizes, None)?;
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
        for unit in forward_units(self.layers) {
            let Some(u) = self.units.get(&unit) else { continue };
            let got = self.ex.gather_owned(self.mine(u), &u.sizes, None)?;
            if fill {
                self.fill_from(u, got)?;
            }
        }
        Ok(())
    }

    fn mine(&self, u: &UnitWeights) -> Vec<Option<Tensor>> {
        u.tensors.iter().zip(&u.owners).map(|(t, &o)| (o == self.rank).then(|| t.clone())).collect()
    }

    fn fill_from(&self, u: &UnitWeights, got: Vec<Option<Tensor>>) -> Result<()> {
        for (((t, &owner), name), from) in u.tensors.iter().zip(&u.owners).zip(&u.names).zip(got) {
            if owner == self.rank || !sharded_weights::is_released(t) {
                continue;
            }
            let from = from.ok_or_else(|| Error::Other(format!("no rank sent `{name}`")))?;
            sharded_weights::fill(t, &from)?;
        }
        Ok(())
    }
}

impl UnitGather for WeightSlices {
    fn gather(&self, unit: Unit) -> Result<()> {
        let Some(u) = self.units.get(&unit) else { return Ok(()) };
        let got = self.ex.gather_owned(self.mine(u), &u.sizes, None)?;
        self.fill_from(u, got)
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
