//! Collectives between the data-parallel ranks of a group: the seam where NCCL plugs in.
//!
//! [`InProcess`] is the implementation for ranks that are threads of one process: each rank
//! deposits its tensors, the last to arrive sums them **in rank order** (so the result is the
//! same whatever the arrival order, bit for bit) and every rank receives the sum. A generation
//! counter lets the same object serve call after call.

use std::sync::{Condvar, Mutex};

use candle_core::Tensor;

use crate::{Error, Result};

/// All-reduce with SUM over `world_size` ranks.
pub trait Collective: Send + Sync {
    fn world_size(&self) -> usize;
    /// Replaces each of `tensors` by its sum over all ranks. Every rank passes tensors of the
    /// same shapes, in the same order.
    fn all_reduce_sum(&self, rank: usize, tensors: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// Called when a rank fails before reaching a collective: wakes every waiting rank with
    /// an error instead of letting it wait forever. The collective stays failed afterwards.
    fn abort(&self, reason: &str);
}

struct State {
    generation: u64,
    deposits: Vec<Option<Vec<Tensor>>>,
    result: Option<Vec<Tensor>>,
    taken: usize,
    failed: Option<String>,
    aborted: Option<String>,
}

pub struct InProcess {
    n: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl InProcess {
    pub fn new(world_size: usize) -> Self {
        InProcess {
            n: world_size,
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

fn sum_in_rank_order(deposits: &mut [Option<Vec<Tensor>>]) -> Result<Vec<Tensor>> {
    let mut it = deposits.iter_mut().map(|d| d.take().expect("every rank deposited"));
    let mut acc = it.next().expect("world size > 0");
    for other in it {
        if other.len() != acc.len() {
            return Err(Error::Other("all_reduce: ranks passed different numbers of tensors".into()));
        }
        for (a, b) in acc.iter_mut().zip(other) {
            *a = (&*a + b)?;
        }
    }
    Ok(acc)
}

impl Collective for InProcess {
    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce_sum(&self, rank: usize, tensors: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if self.n == 1 {
            return Ok(tensors);
        }
        let mut s = self.state.lock().map_err(|_| Error::Other("all_reduce: a rank panicked".into()))?;
        if let Some(reason) = &s.aborted {
            return Err(Error::Other(format!("all_reduce aborted: {reason}")));
        }
        // Wait until the previous generation's result has been taken by everyone.
        while s.result.is_some() && s.aborted.is_none() {
            s = self.cv.wait(s).map_err(|_| Error::Other("all_reduce: a rank panicked".into()))?;
        }
        let gen = s.generation;
        if s.deposits[rank].is_some() {
            return Err(Error::Other(format!("all_reduce: rank {rank} entered twice")));
        }
        s.deposits[rank] = Some(tensors);
        if s.deposits.iter().all(|d| d.is_some()) {
            match sum_in_rank_order(&mut s.deposits) {
                Ok(r) => s.result = Some(r),
                Err(e) => {
                    s.failed = Some(e.to_string());
                    s.result = Some(vec![]);
                }
            }
            s.generation += 1;
            self.cv.notify_all();
        }
        while s.generation == gen && s.aborted.is_none() {
            s = self.cv.wait(s).map_err(|_| Error::Other("all_reduce: a rank panicked".into()))?;
        }
        if let Some(reason) = &s.aborted {
            return Err(Error::Other(format!("all_reduce aborted: {reason}")));
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

    fn abort(&self, reason: &str) {
        if let Ok(mut s) = self.state.lock() {
            s.aborted.get_or_insert_with(|| reason.to_string());
            self.cv.notify_all();
        }
    }
}
