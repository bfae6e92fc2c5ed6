//! [`Engine`]: an [`EngineCore`] owned by an [`Actor`] — its own thread and thread budget.
//!
//! Requests, pauses, weight updates and cancellations are jobs on the actor's queue; between
//! jobs, while requests are running, the actor runs one decode step at a time, and it sleeps
//! when idle or paused. Every call returns a [`Handle`] at once; a request's output goes to its
//! handle, or to a callback ([`Engine::submit_with`], how the engine client continues aborted
//! samples without a thread per request). Pause, resume and weight updates complete once
//! applied, so `pause(Keep); update_weights(..); resume()` from one caller happens between two
//! decode steps. A single request can be cancelled: it completes with what it has, stop reason
//! `cancelled`. A request can be watched ([`Engine::submit_watched`]): after each decode step its
//! new tokens go to the watcher (streaming servers), before its output goes to its sink. A failed step fails the requests in flight (with the reason) and the engine
//! carries on; if the thread dies, every handle yields an error instead of hanging.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::engine_core::{EngineConfig, EngineCore, EngineStats, PauseMode, RequestId};
use super::request::{Request, RequestOutput, StopReason, TopLogprobs};
use crate::actor::{Actor, ActorState};
use crate::handle::{self, Handle};
use crate::locks::lock;
use crate::model::row_adapters::Adapter;
use crate::model::{SamplerWeights, Transformer};
use crate::{Error, Result};

/// Where a request's output goes (called on the engine thread).
pub type Sink = Box<dyn FnOnce(Result<RequestOutput>) + Send>;

/// A request's number on its engine, chosen at submission (so it can be cancelled at once).
pub type Ticket = u64;

/// The tokens one sample of a watched request gained in one decode step, with their log-probs
/// (and top log-probs when asked for).
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub sample: usize,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub topk: Vec<TopLogprobs>,
}

/// Where a watched request's deltas go (called on the engine thread).
pub type Watcher = Box<dyn FnMut(Delta) + Send>;

/// A watcher and how many tokens of each sample it has been given.
struct Watch {
    sent: HashMap<usize, usize>,
    watcher: Watcher,
}

/// What an engine reports about itself.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineHealth {
    /// False when the engine thread is gone; the other fields are then empty.
    pub alive: bool,
    pub stats: Option<EngineStats>,
    pub completed_requests: u64,
    pub failed_steps: u64,
    pub last_error: Option<String>,
}

/// The engine thread's state.
pub struct EngineState {
    core: EngineCore,
    sinks: HashMap<RequestId, (Ticket, Sink)>,
    tickets: HashMap<Ticket, RequestId>,
    watches: HashMap<RequestId, Watch>,
    completed: u64,
    failed_steps: u64,
    last_error: Option<String>,
}

impl ActorState for EngineState {
    fn has_work(&self) -> bool {
        self.core.has_work()
    }

    fn work(&mut self) {
        match self.core.step() {
            Ok(outs) => {
                self.report_progress();
                self.deliver(outs)
            }
            Err(e) => {
                let msg = format!("engine step failed: {e}");
                self.tickets.clear();
                self.watches.clear();
                for (_, (_, sink)) in self.sinks.drain() {
                    sink(Err(Error::Other(msg.clone())));
                }
                self.core.reset();
                self.failed_steps += 1;
                self.last_error = Some(msg);
            }
        }
    }
}

impl EngineState {
    fn add(&mut self, ticket: Ticket, req: Request, sink: Sink, watcher: Option<Watcher>) {
        match self.core.add_request(req) {
            Ok(id) => {
                self.sinks.insert(id, (ticket, sink));
                self.tickets.insert(ticket, id);
                if let Some(watcher) = watcher {
                    self.watches.insert(id, Watch { sent: HashMap::new(), watcher });
                }
            }
            Err(e) => sink(Err(e)),
        }
    }

    /// Gives each watcher the tokens its request's samples gained since it last heard.
    fn report_progress(&mut self) {
        for (id, w) in &mut self.watches {
            for (sample, g) in self.core.progress(*id) {
                let sent = w.sent.entry(sample).or_insert(0);
                if g.tokens.len() > *sent {
                    let from = *sent;
                    *sent = g.tokens.len();
                    (w.watcher)(Delta {
                        sample,
                        tokens: g.tokens[from..].to_vec(),
                        logprobs: g.logprobs[from..].to_vec(),
                        topk: g.topk.get(from..).map_or(vec![], <[_]>::to_vec),
                    });
                }
            }
        }
    }

    fn deliver(&mut self, outs: Vec<(RequestId, RequestOutput)>) {
        for (id, out) in outs {
            self.completed += 1;
            self.watches.remove(&id);
            if let Some((ticket, sink)) = self.sinks.remove(&id) {
                self.tickets.remove(&ticket);
                sink(Ok(out));
            }
        }
    }

    fn cancel(&mut self, ticket: Ticket) -> Result<()> {
        let Some(&id) = self.tickets.get(&ticket) else { return Ok(()) };
        if let Some(mut out) = self.core.abort(id)? {
            for g in &mut out.samples {
                g.stop_reason = StopReason::Cancelled;
            }
            self.deliver(vec![(id, out)]);
        }
        Ok(())
    }

    pub(crate) fn pause(&mut self, mode: PauseMode) {
        let outs = self.core.pause(mode);
        self.deliver(outs);
    }

    pub(crate) fn resume(&mut self) {
        self.core.resume();
    }

    pub(crate) fn update_weights(&mut self, weights: &SamplerWeights) -> Result<()> {
        self.core.update_weights(weights.update(), weights.version())
    }

    fn health(&self) -> EngineHealth {
        EngineHealth {
            alive: true,
            stats: Some(self.core.stats()),
            completed_requests: self.completed,
            failed_steps: self.failed_steps,
            last_error: self.last_error.clone(),
        }
    }
}

pub struct Engine {
    actor: Arc<Actor<EngineState>>,
    next_ticket: AtomicU64,
}

impl Engine {
    /// Starts an engine thread owning `model`, with `config.threads` tensor-math threads.
    pub fn start(model: Transformer, config: EngineConfig) -> Result<Engine> {
        let threads = config.threads;
        let actor = Actor::spawn("oxrl-engine", threads, move || {
            Ok(EngineState {
                core: EngineCore::new(model, config)?,
                sinks: HashMap::new(),
                tickets: HashMap::new(),
                watches: HashMap::new(),
                completed: 0,
                failed_steps: 0,
                last_error: None,
            })
        })?;
        Ok(Engine { actor: Arc::new(actor), next_ticket: AtomicU64::new(0) })
    }

    /// A fresh ticket for [`Engine::submit_with`].
    pub fn new_ticket(&self) -> Ticket {
        self.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    /// Queues a request under `ticket` whose output goes to `sink` (called on the engine
    /// thread, or at once on this one if the engine has stopped).
    pub fn submit_with(&self, ticket: Ticket, req: Request, sink: Sink) {
        self.submit_watched(ticket, req, sink, None)
    }

    /// [`Engine::submit_with`], the request's new tokens going to `watcher` after each decode
    /// step (those of the step that completes the request arrive in its output only).
    pub fn submit_watched(&self, ticket: Ticket, req: Request, sink: Sink, watcher: Option<Watcher>) {
        // If the thread is gone the job never runs: the sink is then answered here.
        let slot = Arc::new(Mutex::new(Some(sink)));
        let job_slot = slot.clone();
        let posted = self.actor.post(move |s| {
            if let Some(sink) = lock(&job_slot).take() {
                s.add(ticket, req, sink, watcher);
            }
        });
        if let Err(e) = posted {
            if let Some(sink) = lock(&slot).take() {
                sink(Err(e));
            }
        }
    }

    /// Queues a request; the handle yields its output (or why it failed) and can cancel it.
    pub fn submit(&self, req: Request) -> Handle<RequestOutput> {
        let (reply, handle) = handle::channel();
        let ticket = self.new_ticket();
        self.submit_with(ticket, req, Box::new(move |r| reply.send(r)));
        let actor = self.actor.clone();
        handle.with_cancel(move || {
            let _ = actor.post(move |s| {
                let _ = s.cancel(ticket);
            });
        })
    }

    /// Ends request `ticket` now with what it has (stop reason `cancelled`); a no-op if it has
    /// finished.
    pub fn cancel(&self, ticket: Ticket) -> Handle<()> {
        self.actor.call(move |s| s.cancel(ticket))
    }

    /// Submits and waits. A request aborted by a pause returns with stop reason `abort`; see
    /// [`super::client::EngineClient`] for the continuation.
    pub fn generate(&self, req: Request) -> Result<RequestOutput> {
        self.submit(req).wait()
    }

    /// Completes once the engine is paused (with `Abort`, once the aborted requests are
    /// answered).
    pub fn pause(&self, mode: PauseMode) -> Handle<()> {
        self.actor.call(move |s| {
            s.pause(mode);
            Ok(())
        })
    }

    pub fn resume(&self) -> Handle<()> {
        self.actor.call(|s| {
            s.resume();
            Ok(())
        })
    }

    /// Completes once the new weights are in place (or with why they were refused); tokens
    /// sampled from then on carry `weights.version()`.
    pub fn update_weights(&self, weights: &SamplerWeights) -> Handle<()> {
        let weights = weights.clone();
        self.actor.call(move |s| s.update_weights(&weights))
    }

    /// Registers LoRA adapter `name` for later requests (`Request::adapter`); replaces one of
    /// that name.
    pub fn add_adapter(&self, name: &str, adapter: Arc<Adapter>) -> Handle<()> {
        let name = name.to_string();
        self.actor.call(move |s| {
            s.core.add_adapter(&name, adapter);
            Ok(())
        })
    }

    /// Unregisters adapter `name` (requests already submitted keep it); yields whether it existed.
    pub fn remove_adapter(&self, name: &str) -> Handle<bool> {
        let name = name.to_string();
        self.actor.call(move |s| Ok(s.core.remove_adapter(&name)))
    }

    /// Reads something off the engine's current model (tests, diagnostics), between steps.
    pub fn inspect<R: Send + 'static>(&self, f: impl FnOnce(&Transformer) -> R + Send + 'static) -> Handle<R> {
        self.actor.call(move |s| Ok(f(s.core.model())))
    }

    pub fn health(&self) -> EngineHealth {
        let dead = EngineHealth { alive: false, stats: None, completed_requests: 0, failed_steps: 0, last_error: None };
        self.actor.call(|s| Ok(s.health())).wait().unwrap_or(dead)
    }
}
