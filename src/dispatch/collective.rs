//! Collectives between the data-parallel ranks of a group: the seam where NCCL plugs in.
//!
//! [`InProcess`] is the implementation for ranks that are threads of one process: each rank
//! deposits its tensors, the last to arrive sums them **in rank order** (so the result is the
//! same whatever the arrival order, bit for bit) and every rank receives the sum. A generation
//! counter lets the same object serve call after call. Half-precision tensors are summed in
//! f32 and rounded once.
//!
//! Across processes ([`InProcess::across`], a [`World`] of W processes with L local ranks
//! each): the last local rank to arrive sums the W·L ranks' tensors with the other processes
//! ([`sum_across`]: reduce-scatter, then all-gather), every element added in global rank order —
//! the same additions in the same order as W·L threads of one process, so the sum is the same
//! bits.

use std::sync::{Condvar, Mutex};

use candle_core::{DType, Tensor};

use super::sum_across::sum_across;
use crate::world::World;
use crate::{Error, Result};

/// All-reduce with SUM over `world_size` ranks.
pub trait Collective: Send + Sync {
    fn world_size(&self) -> usize;
    /// Replaces each of `tensors` by its sum over all ranks. Every rank passes tensors of the
    /// same shapes, in the same order. The ranks of one process may receive the same sums (one
    /// storage, computed once): a rank that keeps them must not write into them in place while
    /// others still read them.
    fn all_reduce_sum(&self, rank: usize, tensors: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// Every rank's `bytes`, in global rank order (how ranks in other processes share their
    /// outputs). Every rank calls it, at the same point of the same call.
    fn all_gather_bytes(&self, rank: usize, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// The sum over all ranks of tensor `i`, kept by rank `owners[i]` alone (`None` on the
    /// others): a reduce-scatter by whole tensors, added in rank order like the all-reduce. The
    /// tensors are handed over, their storage with them: a sum may be written over it.
    fn reduce_to_owners(&self, rank: usize, tensors: Vec<Tensor>, owners: &[usize]) -> Result<Vec<Option<Tensor>>>;
    /// Every rank's `Some` tensors (each index `Some` on at most one rank) on every rank (`root`
    /// `None`) or on rank `root` alone. `sizes[i]`: tensor i's element count, on every rank.
    fn gather_owned(
        &self,
        rank: usize,
        mine: Vec<Option<Tensor>>,
        sizes: &[usize],
        root: Option<usize>,
    ) -> Result<Vec<Option<Tensor>>>;
    /// Called when a rank fails before reaching a collective: wakes every waiting rank with
    /// an error instead of letting it wait forever. The collective stays failed afterwards.
    fn abort(&self, reason: &str);
    /// Whether the tensors [`Collective::gather_owned`] hands a rank from other ranks are its
    /// alone (fresh buffers no other rank or tensor shares), so that it may take their storage.
    fn gathers_alone(&self) -> bool {
        false
    }
}

/// What a rank deposits and what it takes back.
#[derive(Clone)]
enum Payload {
    Tensors(Vec<Tensor>),
    /// Tensors some of which are elsewhere (`None`).
    Owned(Vec<Option<Tensor>>),
    Bytes(Vec<Vec<u8>>),
}

struct State {
    generation: u64,
    deposits: Vec<Option<Payload>>,
    result: Option<Payload>,
    taken: usize,
    failed: Option<String>,
    aborted: Option<String>,
}

pub struct InProcess {
    /// Local ranks (threads of this process).
    n: usize,
    /// The processes beyond this one, if any.
    world: Option<&'static dyn World>,
    state: Mutex<State>,
    cv: Condvar,
}

impl InProcess {
    /// `world_size` ranks, all threads of this process.
    pub fn new(world_size: usize) -> Self {
        Self::with_world(world_size, None)
    }

    /// `local` ranks here and as many in each other process of `world`; global rank
    /// `process · local + i` is local rank i of that process.
    pub fn across(local: usize, world: &'static dyn World) -> Self {
        Self::with_world(local, (world.size() > 1).then_some(world))
    }

    fn with_world(world_size: usize, world: Option<&'static dyn World>) -> Self {
        InProcess {
            n: world_size,
            world,
            state: Mutex::new(State {
                generation: 0,
                deposits: vec![None; world_size],
                result: None,
                taken: 0,
                failed: None,
                aborted: None,
            }),
            cv: Condvar::new(),
        }
    }
}

impl InProcess {
    /// The global rank of local rank `rank`: process p's ranks are p·n .. (p+1)·n.
    fn global_rank(&self, rank: usize) -> usize {
        self.world.map_or(0, |w| w.rank()) * self.n + rank
    }
}

/// The sum over `deposits` (one list per rank), added in rank order.
pub(super) fn sum_in_rank_order(deposits: Vec<Vec<Tensor>>) -> Result<Vec<Tensor>> {
    let mut it = deposits.into_iter();
    let first = it.next().expect("world size > 0");
    let dtypes: Vec<DType> = first.iter().map(|t| t.dtype()).collect();
    let wide = |t: Tensor| match t.dtype() {
        DType::BF16 | DType::F16 => t.to_dtype(DType::F32),
        _ => Ok(t),
    };
    let mut acc = first.into_iter().map(wide).collect::<candle_core::Result<Vec<_>>>()?;
    for other in it {
        if other.len() != acc.len() {
            return Err(Error::Other("all_reduce: ranks passed different numbers of tensors".into()));
        }
        for (a, b) in acc.iter_mut().zip(other) {
            *a = (&*a + wide(b)?)?;
        }
    }
    Ok(acc.into_iter().zip(dtypes).map(|(t, d)| t.to_dtype(d)).collect::<candle_core::Result<Vec<_>>>()?)
}

impl InProcess {
    /// Deposits `mine` as local rank `rank`; the last local rank to arrive combines all deposits
    /// (local rank order) with `combine`, and every rank takes the result.
    fn rendezvous(
        &self,
        rank: usize,
        mine: Payload,
        combine: impl FnOnce(Vec<Payload>) -> Result<Payload>,
    ) -> Result<Payload> {
        let poisoned = |_| Error::Other("collective: a rank panicked".into());
        let mut s = self.state.lock().map_err(poisoned)?;
        if let Some(reason) = &s.aborted {
            return Err(Error::Other(format!("collective aborted: {reason}")));
        }
        // Wait until the previous generation's result has been taken by everyone.
        while s.result.is_some() && s.aborted.is_none() {
            s = self.cv.wait(s).map_err(poisoned)?;
        }
        let gen = s.generation;
        if s.deposits[rank].is_some() {
            return Err(Error::Other(format!("collective: rank {rank} entered twice")));
        }
        s.deposits[rank] = Some(mine);
        if s.deposits.iter().all(|d| d.is_some()) {
            let all: Vec<Payload> = s.deposits.iter_mut().map(|d| d.take().expect("every rank deposited")).collect();
            match combine(all) {
                Ok(r) => s.result = Some(r),
                Err(e) => {
                    s.failed = Some(e.to_string());
                    s.result = Some(Payload::Bytes(vec![]));
                }
            }
            s.generation += 1;
            self.cv.notify_all();
        }
        while s.generation == gen && s.aborted.is_none() {
            s = self.cv.wait(s).map_err(poisoned)?;
        }
        if let Some(reason) = &s.aborted {
            return Err(Error::Other(format!("collective aborted: {reason}")));
        }
        let out = s.result.clone().expect("result set with the generation");
        let failed = s.failed.clone();
        s.taken += 1;
        if s.taken == self.n {
            s.taken = 0;
            s.result = None;
            s.failed = None;
            self.cv.notify_all();
        }
        match failed {
            Some(msg) => Err(Error::Other(msg)),
            None => Ok(out),
        }
    }
}

fn tensors(p: Payload) -> Vec<Tensor> {
    match p {
        Payload::Tensors(t) => t,
        _ => unreachable!("a tensor rendezvous holds tensors"),
    }
}

fn owned(p: Payload) -> Vec<Option<Tensor>> {
    match p {
        Payload::Owned(t) => t,
        _ => unreachable!("an owned-tensor rendezvous holds owned tensors"),
    }
}

fn bytes(p: Payload) -> Vec<Vec<u8>> {
    match p {
        Payload::Bytes(b) => b,
        _ => unreachable!("a byte rendezvous holds bytes"),
    }
}

/// The union of the ranks' `Some` tensors, by index; an error if two ranks hold the same one.
fn union(all: Vec<Vec<Option<Tensor>>>) -> Result<Vec<Option<Tensor>>> {
    let mut it = all.into_iter();
    let mut acc = it.next().unwrap_or_default();
    for (r, other) in it.enumerate() {
        if other.len() != acc.len() {
            return Err(Error::Other("gather: ranks passed different numbers of tensors".into()));
        }
        for (i, (a, b)) in acc.iter_mut().zip(other).enumerate() {
            if let Some(b) = b {
                if a.replace(b).is_some() {
                    return Err(Error::Other(format!("gather: rank {} and another rank both hold tensor {i}", r + 1)));
                }
            }
        }
    }
    Ok(acc)
}

impl Collective for InProcess {
    fn world_size(&self) -> usize {
        self.n * self.world.map_or(1, |w| w.size())
    }

    fn all_reduce_sum(&self, rank: usize, mine: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if self.n == 1 && self.world.is_none() {
            return Ok(mine);
        }
        let world = self.world;
        let combine = move |all: Vec<Payload>| {
            let local: Vec<Vec<Tensor>> = all.into_iter().map(tensors).collect();
            let sum = match world {
                None => sum_in_rank_order(local)?,
                Some(world) => sum_across(world, &local)?,
            };
            Ok(Payload::Tensors(sum))
        };
        self.rendezvous(rank, Payload::Tensors(mine), combine).map(tensors)
    }

    fn all_gather_bytes(&self, rank: usize, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        if self.n == 1 && self.world.is_none() {
            return Ok(vec![mine]);
        }
        let world = self.world;
        let combine = move |all: Vec<Payload>| {
            let local: Vec<Vec<u8>> = all.into_iter().map(|p| bytes(p).pop().expect("one deposit")).collect();
            let Some(world) = world else { return Ok(Payload::Bytes(local)) };
            // Each process's local deposits, length-prefixed, in one message.
            let mut packed = vec![];
            for b in &local {
                packed.extend((b.len() as u64).to_le_bytes());
                packed.extend(b);
            }
            let mut global = vec![];
            for (process, msg) in world.all_gather(&packed)?.into_iter().enumerate() {
                let mut at = 0;
                while at < msg.len() {
                    let len = msg.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().expect("8")) as usize);
                    let item = len.and_then(|n| msg.get(at + 8..at + 8 + n));
                    let item = item
                        .ok_or_else(|| Error::Other(format!("all_gather: process {process}'s message is truncated")))?;
                    at += 8 + item.len();
                    global.push(item.to_vec());
                }
            }
            Ok(Payload::Bytes(global))
        };
        self.rendezvous(rank, Payload::Bytes(vec![mine]), combine).map(bytes)
    }

    fn reduce_to_owners(&self, rank: usize, mine: Vec<Tensor>, owners: &[usize]) -> Result<Vec<Option<Tensor>>> {
        let global = self.global_rank(rank);
        let keep = |all: Vec<Option<Tensor>>| -> Vec<Option<Tensor>> {
            all.into_iter().zip(owners).map(|(t, &o)| if o == global { t } else { None }).collect()
        };
        let Some(world) = self.world else {
            // One process: the all-reduce's sum (computed once, shared), each rank keeping its own.
            return Ok(keep(self.all_reduce_sum(rank, mine)?.into_iter().map(Some).collect()));
        };
        let owners_of = owners.to_vec();
        let combine = move |all: Vec<Payload>| {
            let local: Vec<Vec<Tensor>> = all.into_iter().map(tensors).collect();
            Ok(Payload::Owned(super::owned_across::reduce_to_owners(world, local, &owners_of)?))
        };
        Ok(keep(self.rendezvous(rank, Payload::Tensors(mine), combine).map(owned)?))
    }

    fn gather_owned(
        &self,
        rank: usize,
        mine: Vec<Option<Tensor>>,
        sizes: &[usize],
        root: Option<usize>,
    ) -> Result<Vec<Option<Tensor>>> {
        let n = mine.len();
        let device = mine.iter().flatten().next().map(|t| t.device().clone()).unwrap_or(candle_core::Device::Cpu);
        let (world, sizes) = (self.world, sizes.to_vec());
        let root_process = root.map(|r| r / self.n);
        let combine = move |all: Vec<Payload>| {
            let here = union(all.into_iter().map(owned).collect())?;
            Ok(Payload::Owned(match world {
                None => here,
                Some(world) => super::owned_across::gather(world, here, &sizes, root_process, &device)?,
            }))
        };
        let all = if self.n == 1 && self.world.is_none() {
            mine
        } else {
            self.rendezvous(rank, Payload::Owned(mine), combine).map(owned)?
        };
        Ok(match root {
            Some(r) if r != self.global_rank(rank) => vec![None; n],
            _ => all,
        })
    }

    fn abort(&self, reason: &str) {
        if let Ok(mut s) = self.state.lock() {
            s.aborted.get_or_insert_with(|| reason.to_string());
            self.cv.notify_all();
        }
    }

    /// One rank in this process: the others' tensors arrive from other processes into buffers
    /// of their own (ranks of one process share the owner's tensor).
    fn gathers_alone(&self) -> bool {
        self.n == 1
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::test_support::bits;
    use crate::world::ThreadWorld;

    /// Global rank r's gradients: values of many magnitudes (so that the order of the additions
    /// shows in the bits), in f32, f64 and bf16.
    fn grads(r: usize) -> Vec<Tensor> {
        let v: Vec<f32> = (0..97).map(|i| ((i * 7 + r * 13) as f32).sin() * 10f32.powi((i % 9) as i32 - 4)).collect();
        let t = Tensor::from_vec(v, (97,), &Device::Cpu).unwrap();
        vec![t.clone(), t.to_dtype(DType::F64).unwrap(), t.to_dtype(DType::BF16).unwrap().reshape((1, 97)).unwrap()]
    }

    /// 3 processes × 2 ranks sum to the bits of 6 ranks in one process (97 elements cut into
    /// uneven chunks by the reduce-scatter), and gather bytes in global rank order.
    #[test]
    fn ranks_across_processes_sum_as_threads_of_one_do() {
        let (processes, local) = (3, 2);
        let threads = InProcess::new(processes * local);
        let expected: Vec<Vec<Tensor>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..processes * local)
                .map(|r| {
                    let c = &threads;
                    s.spawn(move || c.all_reduce_sum(r, grads(r)).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let collectives: Vec<InProcess> = (ThreadWorld::world(processes).into_iter())
            .map(|w| InProcess::across(local, Box::leak(Box::new(w)) as &'static dyn World))
            .collect();
        let got: Vec<(Vec<Tensor>, Vec<Vec<u8>>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..processes * local)
                .map(|r| {
                    let c = &collectives[r / local];
                    s.spawn(move || {
                        let sum = c.all_reduce_sum(r % local, grads(r)).unwrap();
                        let gathered = c.all_gather_bytes(r % local, vec![r as u8; r + 1]).unwrap();
                        (sum, gathered)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (sum, gathered)) in got.iter().enumerate() {
            assert_eq!(collectives[0].world_size(), processes * local);
            for (a, b) in sum.iter().zip(&expected[r]) {
                assert_eq!((a.dtype(), a.dims()), (b.dtype(), b.dims()));
                assert_eq!(bits(a), bits(b), "rank {r}: the sum across processes differs from one process's");
            }
            assert_eq!(*gathered, (0..processes * local).map(|q| vec![q as u8; q + 1]).collect::<Vec<_>>(), "rank {r}");
        }
        // And the sum is not order-free: adding in another order changes the bits.
        let reversed = sum_in_rank_order((0..processes * local).rev().map(grads).collect()).unwrap();
        assert_ne!(bits(&reversed[0]), bits(&expected[0][0]));
    }
}
