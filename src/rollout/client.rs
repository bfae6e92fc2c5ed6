//! The client over N engines: routing, abort-and-continue retry, and pause / resume / weight
//! updates for all of them.
//!
//! Routing: a request with a `group` goes to the engine that took its group first (so the
//! prompts of a GRPO group share an engine, and identical prompts admitted together share one
//! prefill); otherwise, and for a new group, to the engine with the fewest requests in flight.
//!
//! Abort-and-continue (specs/algorithms.md): while a sample's stop reason is `abort`, wait until
//! unpaused, resubmit prompt + accumulated tokens with `max_tokens = original − accumulated`,
//! and append the tokens, log-probs and versions (an abort that produced no token adds nothing);
//! the stop reason is the last call's. The continuation also skips the random draws already
//! used, so a seeded sample continues its own stream: with unchanged weights the result equals
//! the uninterrupted one. Simplification: a stop string that straddles an abort boundary is not
//! detected (each call checks only its own completion).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use super::engine::{Engine, EngineHealth};
use super::engine_core::PauseMode;
use super::request::{Generation, Request, RequestOutput, StopReason};
use super::weights::WeightUpdate;
use crate::{Error, Result};

pub struct EngineClient {
    engines: Vec<Engine>,
    in_flight: Vec<AtomicUsize>,
    groups: Mutex<HashMap<u64, usize>>,
    paused: Mutex<bool>,
    unpaused: Condvar,
}

/// Counts a request in flight on engine `i` until dropped.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EngineClient {
    pub fn new(engines: Vec<Engine>) -> Result<Self> {
        if engines.is_empty() {
            return Err(Error::input("an engine client needs at least one engine"));
        }
        let in_flight = engines.iter().map(|_| AtomicUsize::new(0)).collect();
        Ok(EngineClient {
            engines,
            in_flight,
            groups: Mutex::new(HashMap::new()),
            paused: Mutex::new(false),
            unpaused: Condvar::new(),
        })
    }

    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Requests in flight per engine, as this client counts them.
    pub fn load(&self) -> Vec<usize> {
        self.in_flight.iter().map(|x| x.load(Ordering::SeqCst)).collect()
    }

    fn least_loaded(&self) -> usize {
        (0..self.engines.len())
            .min_by_key(|&i| (self.in_flight[i].load(Ordering::SeqCst), i))
            .expect("at least one engine")
    }

    /// The engine for a request of `group`.
    pub fn route(&self, group: Option<u64>) -> usize {
        match group {
            None => self.least_loaded(),
            Some(g) => {
                let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
                *groups.entry(g).or_insert_with(|| self.least_loaded())
            }
        }
    }

    /// One call to one engine, without retry.
    pub fn generate_once(&self, req: Request) -> Result<RequestOutput> {
        let i = self.route(req.group);
        self.in_flight[i].fetch_add(1, Ordering::SeqCst);
        let _guard = InFlight(&self.in_flight[i]);
        self.engines[i].generate(req)
    }

    fn wait_unpaused(&self) {
        let mut p = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        while *p {
            p = self.unpaused.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Generates with abort-and-continue: a pause in `abort` mode is invisible in the result but
    /// for the versions of the tokens.
    pub fn generate(&self, mut req: Request) -> Result<RequestOutput> {
        req.params.validate()?;
        req.params.seed.get_or_insert_with(rand::random);
        let mut out = self.generate_once(req.clone())?;
        for (j, g) in out.samples.iter_mut().enumerate() {
            while g.stop_reason == StopReason::Abort {
                self.wait_unpaused();
                let r = self.generate_once(continuation(&req, j, g))?.samples.remove(0);
                g.append(r);
            }
        }
        Ok(out)
    }

    /// Pauses every engine; `generate` calls that get aborted wait for `resume`.
    pub fn pause(&self, mode: PauseMode) -> Result<()> {
        // Set first, so that a retry triggered by this pause already sees it.
        *self.paused.lock().unwrap_or_else(|e| e.into_inner()) = true;
        for e in &self.engines {
            e.pause(mode)?;
        }
        Ok(())
    }

    pub fn resume(&self) -> Result<()> {
        for e in &self.engines {
            e.resume()?;
        }
        *self.paused.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.unpaused.notify_all();
        Ok(())
    }

    /// Sends the update to every engine (each keeps its own copy of the weights).
    pub fn update_weights(&self, update: &WeightUpdate, version: u64) -> Result<()> {
        for (i, e) in self.engines.iter().enumerate() {
            e.update_weights(update.clone(), version).map_err(|err| Error::Other(format!("engine {i}: {err}")))?;
        }
        Ok(())
    }

    pub fn health(&self) -> Vec<EngineHealth> {
        self.engines.iter().map(|e| e.health()).collect()
    }
}

/// The request that continues sample `sample` of `original` after an abort that left `so_far`:
/// prompt + tokens so far, the remaining max_tokens, the sample's own seed with the draws
/// already used skipped. `original.params.seed` must be set.
pub fn continuation(original: &Request, sample: usize, so_far: &Generation) -> Request {
    let mut params = original.params.clone();
    params.max_tokens = original.params.max_tokens.saturating_sub(so_far.tokens.len());
    params.seed = original.params.seed.map(|s| s.wrapping_add(sample as u64));
    Request {
        prompt: original.prompt.iter().chain(&so_far.tokens).copied().collect(),
        params,
        num_samples: 1,
        prompt_logprobs: false,
        group: original.group,
        rng_skip: original.rng_skip + so_far.tokens.len(),
    }
}
