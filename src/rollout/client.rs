//! The client over N engines: routing, abort-and-continue, and pause / resume / weight updates
//! for all of them — without a thread per request.
//!
//! Routing: a request with a `route_key` goes to the engine that took its key first (so the
//! samples of one RL prompt share an engine, and identical prompts admitted together share one
//! prefill); otherwise, and for a new key, to the engine with the fewest requests in flight.
//!
//! Abort-and-continue (docs/specs/algorithms.md) is event-driven: an engine hands each output to a
//! callback of the client (on the engine thread). A sample whose stop reason is `abort` is
//! continued at once if the client is not paused, or parked until [`EngineClient::resume`]
//! otherwise: the continuation is prompt + accumulated tokens with `max_tokens = original −
//! accumulated`, and its tokens, log-probs and versions are appended (an abort that produced no
//! token adds nothing); the stop reason is the last call's. The continuation also skips the
//! random draws already used, so a seeded sample continues its own stream: with unchanged
//! weights the result equals the uninterrupted one. The request's handle completes when every
//! sample has really stopped; cancelling it ends the samples in flight (stop reason `cancelled`)
//! and never continues them. Simplification: a stop string that straddles an abort boundary is
//! not detected (each call checks only its own completion).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::engine::{Engine, EngineHealth, Ticket};
use super::engine_core::PauseMode;
use super::request::{Generation, Request, RequestOutput, StopReason, TopLogprobs};
use super::sampling_engine::{join_all, SamplingEngine};
use super::shared_engines::Sharing;
use crate::handle::{self, Handle, Reply};
use crate::locks::lock;
use crate::model::SamplerWeights;
use crate::world::World;
use crate::{Error, Result};

pub struct EngineClient {
    shared: Arc<ClientState>,
    /// Engines shared with the other processes of the job (see [`Sharing`]).
    sharing: Option<Sharing>,
}

struct ClientState {
    engines: Vec<Box<dyn SamplingEngine>>,
    in_flight: Vec<AtomicUsize>,
    /// Engines found unreachable: nothing is routed to them until one answers again.
    down: Vec<AtomicBool>,
    /// A health probe of a down engine is running / has found it answering again.
    probing: Vec<AtomicBool>,
    answering: Vec<AtomicBool>,
    /// What happened to the engines since [`EngineClient::take_events`] (which fell, which
    /// rejoined).
    events: Mutex<Vec<String>>,
    /// The engine of each route key seen.
    routes: Mutex<HashMap<u64, usize>>,
    pause: Mutex<PauseState>,
}

#[derive(Default)]
struct PauseState {
    paused: bool,
    /// Samples aborted by a pause, waiting for `resume`.
    parked: Vec<(Arc<Pending>, usize)>,
}

/// One client request while its samples are being completed.
struct Pending {
    original: Request,
    state: Mutex<PendingState>,
}

struct PendingState {
    /// Each sample as accumulated so far.
    samples: Vec<Generation>,
    prompt_logprobs: Option<Vec<f32>>,
    prompt_topk: Option<Vec<TopLogprobs>>,
    /// Samples not yet really stopped.
    left: usize,
    /// The engine call each sample is in, if any.
    live: Vec<Option<(usize, Ticket)>>,
    cancelled: bool,
    reply: Option<Reply<RequestOutput>>,
}

impl EngineClient {
    /// A client over engines of this process.
    pub fn new(engines: Vec<Engine>) -> Result<Self> {
        Self::over(engines.into_iter().map(|e| Box::new(e) as Box<dyn SamplingEngine>).collect())
    }

    /// A client over any engines: of this process, or remote ones.
    pub fn over(engines: Vec<Box<dyn SamplingEngine>>) -> Result<Self> {
        if engines.is_empty() {
            return Err(Error::input("an engine client needs at least one engine"));
        }
        let in_flight = engines.iter().map(|_| AtomicUsize::new(0)).collect();
        let flags = || engines.iter().map(|_| AtomicBool::new(false)).collect();
        let (down, probing, answering) = (flags(), flags(), flags());
        let shared = ClientState {
            engines,
            in_flight,
            down,
            probing,
            answering,
            events: Mutex::default(),
            routes: Mutex::new(HashMap::new()),
            pause: Mutex::default(),
        };
        Ok(EngineClient { shared: Arc::new(shared), sharing: None })
    }

    /// These engines, shared by the processes of `world` (see `Sharing`); `link`: they are
    /// the processes of the MPI job's engine link, at `urls`.
    pub fn shared_by(self, world: &'static dyn World, link: Option<(&'static dyn World, Vec<String>)>) -> Self {
        EngineClient { sharing: Sharing::new(world, link), ..self }
    }

    /// Whether this process leaves pause, resume and updates to process 0.
    fn follower(&self) -> bool {
        self.sharing.as_ref().is_some_and(Sharing::follower)
    }

    pub fn engines(&self) -> &[Box<dyn SamplingEngine>] {
        &self.shared.engines
    }

    /// Engine calls in flight per engine, as this client counts them.
    pub fn load(&self) -> Vec<usize> {
        self.shared.in_flight.iter().map(|x| x.load(Ordering::SeqCst)).collect()
    }

    /// The engine for a request with `route_key`.
    pub fn route(&self, route_key: Option<u64>) -> usize {
        self.shared.route(route_key)
    }

    /// Submits a request with abort-and-continue: a pause in `abort` mode is invisible in the
    /// result but for the versions of the tokens. The handle can cancel the request.
    pub fn submit(&self, mut req: Request) -> Handle<RequestOutput> {
        if let Err(e) = req.params.validate() {
            return Handle::ready(Err(e));
        }
        if req.num_samples == 0 {
            return Handle::ready(Err(Error::input("num_samples must be positive")));
        }
        req.params.seed.get_or_insert_with(rand::random);
        let (reply, handle) = handle::channel();
        let n = req.num_samples;
        let pending = Arc::new(Pending {
            original: req,
            state: Mutex::new(PendingState {
                samples: vec![Generation::empty(); n],
                prompt_logprobs: None,
                prompt_topk: None,
                left: n,
                live: vec![None; n],
                cancelled: false,
                reply: Some(reply),
            }),
        });
        ClientState::send(&self.shared, &pending, None);
        let (weak, p) = (Arc::downgrade(&self.shared), pending);
        handle.with_cancel(move || ClientState::cancel(&weak, &p))
    }

    /// Submits and waits (see [`EngineClient::submit`]).
    pub fn generate(&self, req: Request) -> Result<RequestOutput> {
        self.submit(req).wait()
    }

    /// Pauses every engine; samples aborted by the pause wait for `resume`.
    pub fn pause(&self, mode: PauseMode) -> Handle<()> {
        if self.follower() {
            return Handle::ready(Ok(()));
        }
        // Set first, so that a continuation triggered by this pause already sees it.
        lock(&self.shared.pause).paused = true;
        self.on_all(|e| e.pause(mode), || {})
    }

    /// What happened to the engines since the last call: which fell (their requests went to
    /// the others) and which rejoined.
    pub fn take_events(&self) -> Vec<String> {
        std::mem::take(&mut lock(&self.shared.events))
    }

    /// Which engines are down now.
    pub fn down(&self) -> Vec<bool> {
        self.shared.down.iter().map(|d| d.load(Ordering::SeqCst)).collect()
    }

    /// Resumes every engine, then continues the parked samples.
    pub fn resume(&self) -> Handle<()> {
        if self.follower() {
            return Handle::ready(Ok(()));
        }
        let shared = Arc::downgrade(&self.shared);
        self.on_all(
            |e| e.resume(),
            move || {
                if let Some(shared) = shared.upgrade() {
                    ClientState::unpause(&shared);
                }
            },
        )
    }

    /// Sends the weights to every engine (those of this process share the snapshot; none
    /// copies it). A down engine is probed in the background; once a probe found it answering,
    /// it rejoins at the next update, at those weights. ClientState engines: see `Sharing` (the
    /// call then returns once every process knows the update done).
    pub fn update_weights(&self, weights: &SamplerWeights) -> Handle<()> {
        let Some(sharing) = &self.sharing else { return self.update_own(weights) };
        Handle::ready(sharing.update(weights, || self.update_own(weights).wait()))
    }

    /// [`EngineClient::update_weights`] by this process.
    fn update_own(&self, weights: &SamplerWeights) -> Handle<()> {
        let shared = &self.shared;
        for i in (0..shared.engines.len()).filter(|&i| shared.is_down(i)) {
            if shared.answering[i].swap(false, Ordering::SeqCst) {
                shared.down[i].store(false, Ordering::SeqCst);
                lock(&shared.events).push(format!("{} rejoined", shared.name(i)));
                // Keys that moved away while it was down spread over all engines again.
                lock(&shared.routes).clear();
            } else if !shared.probing[i].swap(true, Ordering::SeqCst) {
                let shared = self.shared.clone();
                std::thread::spawn(move || {
                    let answering = shared.engines[i].health().alive;
                    shared.answering[i].store(answering, Ordering::SeqCst);
                    shared.probing[i].store(false, Ordering::SeqCst);
                });
            }
        }
        self.on_all(|e| e.update_weights(weights), || {})
    }

    /// `call` on every engine that is up, at once; completes when all have (then runs `then`),
    /// with the first error in engine order, naming the engine. An engine found down is marked
    /// so and left out; with none left, that is the error.
    fn on_all(
        &self,
        call: impl Fn(&dyn SamplingEngine) -> Handle<()>,
        then: impl FnOnce() + Send + 'static,
    ) -> Handle<()> {
        let up: Vec<usize> = (0..self.shared.engines.len()).filter(|&i| !self.shared.is_down(i)).collect();
        let handles = up.iter().map(|&i| call(self.shared.engines[i].as_ref())).collect();
        let shared = self.shared.clone();
        join_all(handles, move |results| {
            then();
            let mut first_error = None;
            for (&i, r) in up.iter().zip(results) {
                match r {
                    Err(Error::EngineDown(why)) => shared.mark_down(i, &why),
                    Err(e) => {
                        first_error.get_or_insert_with(|| Error::Other(format!("{}: {e}", shared.name(i))));
                    }
                    Ok(()) => {}
                }
            }
            match first_error {
                Some(e) => Err(e),
                None if (0..shared.engines.len()).all(|i| shared.is_down(i)) => Err(shared.all_down()),
                None => Ok(()),
            }
        })
    }

    pub fn health(&self) -> Vec<EngineHealth> {
        self.shared.engines.iter().map(|e| e.health()).collect()
    }
}

impl ClientState {
    fn name(&self, i: usize) -> String {
        format!("engine {i} ({})", self.engines[i].describe())
    }

    fn is_down(&self, i: usize) -> bool {
        self.down[i].load(Ordering::SeqCst)
    }

    /// Marks engine `i` down (once), recording why.
    fn mark_down(&self, i: usize, why: &str) {
        if !self.down[i].swap(true, Ordering::SeqCst) {
            lock(&self.events).push(format!("{} fell: {why}; its requests went to the others", self.name(i)));
        }
    }

    fn all_down(&self) -> Error {
        let events = lock(&self.events).join("; ");
        Error::EngineDown(format!("every sampling engine is down ({events})"))
    }

    /// The least loaded engine that is up (engine 0 when none is: a call to it fails).
    fn least_loaded(&self) -> usize {
        (0..self.engines.len())
            .min_by_key(|&i| (self.is_down(i), self.in_flight[i].load(Ordering::SeqCst), i))
            .expect("at least one engine")
    }

    /// A route key stays on its engine while that engine is up.
    fn route(&self, route_key: Option<u64>) -> usize {
        match route_key {
            None => self.least_loaded(),
            Some(key) => {
                let mut routes = lock(&self.routes);
                let engine = routes.entry(key).or_insert_with(|| self.least_loaded());
                if self.is_down(*engine) {
                    *engine = self.least_loaded();
                }
                *engine
            }
        }
    }

    /// Sends the whole request (`sample` None) or the continuation of one sample to an engine.
    fn send(this: &Arc<ClientState>, pending: &Arc<Pending>, sample: Option<usize>) {
        let req = match sample {
            None => pending.original.clone(),
            Some(j) => {
                let state = lock(&pending.state);
                // Cancelled while this continuation was on its way: `cancel` ended the sample.
                if state.cancelled {
                    return;
                }
                continuation(&pending.original, j, &state.samples[j])
            }
        };
        let i = this.route(req.route_key);
        if this.is_down(i) {
            return Pending::fail(pending, this.all_down());
        }
        let engine = &this.engines[i];
        this.in_flight[i].fetch_add(1, Ordering::SeqCst);
        let (weak, p) = (Arc::downgrade(this), pending.clone());
        // Recorded before the call can answer (a cancel must find it).
        let ticket = engine.new_ticket();
        {
            let mut state = lock(&pending.state);
            match sample {
                None => state.live.iter_mut().for_each(|l| *l = Some((i, ticket))),
                Some(j) => state.live[j] = Some((i, ticket)),
            }
        }
        engine.submit_with(
            ticket,
            req,
            Box::new(move |out| match weak.upgrade() {
                Some(shared) => ClientState::on_output(&shared, &p, i, sample, out),
                None => Pending::fail(&p, Error::Other("the engine client was dropped".into())),
            }),
        );
    }

    /// An engine answered a call of `pending` (all samples, or the continuation of `sample`).
    fn on_output(
        this: &Arc<ClientState>,
        pending: &Arc<Pending>,
        engine: usize,
        sample: Option<usize>,
        out: Result<RequestOutput>,
    ) {
        this.in_flight[engine].fetch_sub(1, Ordering::SeqCst);
        let mut out = match out {
            Ok(o) => o,
            // The call is lost with its engine: sent again to another, from what the samples
            // had before it (a seeded sample draws the same tokens again).
            Err(Error::EngineDown(why)) => {
                this.mark_down(engine, &why);
                return ClientState::send(this, pending, sample);
            }
            Err(e) => return Pending::fail(pending, e),
        };
        let mut to_continue = vec![];
        let finished = {
            let mut st = lock(&pending.state);
            let parts: Vec<(usize, Generation)> = match sample {
                None => {
                    st.prompt_logprobs = out.prompt_logprobs.take();
                    st.prompt_topk = out.prompt_topk.take();
                    out.samples.into_iter().enumerate().collect()
                }
                Some(j) => out.samples.into_iter().take(1).map(|g| (j, g)).collect(),
            };
            for (j, g) in parts {
                st.live[j] = None;
                st.samples[j].append(g);
                if st.samples[j].stop_reason == StopReason::Abort {
                    if st.cancelled {
                        st.samples[j].stop_reason = StopReason::Cancelled;
                    } else {
                        to_continue.push(j);
                        continue;
                    }
                }
                st.left -= 1;
            }
            st.left == 0
        };
        if finished {
            return Pending::finish(pending);
        }
        for j in to_continue {
            let mut pause = lock(&this.pause);
            if pause.paused {
                pause.parked.push((pending.clone(), j));
            } else {
                drop(pause);
                ClientState::send(this, pending, Some(j));
            }
        }
    }

    /// Continues every parked sample (after the engines resumed).
    fn unpause(this: &Arc<ClientState>) {
        let parked = {
            let mut pause = lock(&this.pause);
            pause.paused = false;
            std::mem::take(&mut pause.parked)
        };
        for (pending, j) in parked {
            if lock(&pending.state).cancelled {
                continue;
            }
            ClientState::send(this, &pending, Some(j));
        }
    }

    /// Cancels a request: parked samples end now, samples in an engine call are cancelled there.
    fn cancel(this: &Weak<ClientState>, pending: &Arc<Pending>) {
        let (live, finished) = {
            let mut st = lock(&pending.state);
            if st.cancelled || st.reply.is_none() {
                return;
            }
            st.cancelled = true;
            let live: Vec<(usize, Ticket)> = st.live.iter().flatten().copied().collect();
            let mut parked = vec![];
            for j in 0..st.samples.len() {
                if st.live[j].is_none() && st.samples[j].stop_reason == StopReason::Abort {
                    parked.push(j);
                }
            }
            for j in parked {
                st.samples[j].stop_reason = StopReason::Cancelled;
                st.left -= 1;
            }
            (live, st.left == 0)
        };
        if finished {
            return Pending::finish(pending);
        }
        if let Some(shared) = this.upgrade() {
            let mut seen = vec![];
            for (i, ticket) in live {
                if !seen.contains(&(i, ticket)) {
                    seen.push((i, ticket));
                    drop(shared.engines[i].cancel(ticket));
                }
            }
        }
    }
}

impl Pending {
    fn finish(this: &Pending) {
        let mut st = lock(&this.state);
        if let Some(reply) = st.reply.take() {
            let samples = std::mem::take(&mut st.samples);
            let (prompt_logprobs, prompt_topk) = (st.prompt_logprobs.take(), st.prompt_topk.take());
            reply.send(Ok(RequestOutput { samples, prompt_logprobs, prompt_topk }));
        }
    }

    fn fail(this: &Pending, e: Error) {
        if let Some(reply) = lock(&this.state).reply.take() {
            reply.send(Err(e));
        }
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
        prompt_topk: 0,
        sample_topk: original.sample_topk,
        route_key: original.route_key,
        adapter: original.adapter.clone(),
        rng_skip: original.rng_skip + so_far.tokens.len(),
        logit_bias: original.logit_bias.clone(),
        priority: original.priority,
    }
}
