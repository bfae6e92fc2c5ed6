//! [`SamplingEngine`]: what the engine client needs of an engine, wherever it runs — a thread of
//! this process ([`Engine`]) or a process of its own reached over HTTP
//! ([`RemoteEngine`](super::remote_engine::RemoteEngine)). The client's routing,
//! abort-and-continue, cancellation and per-token versions work the same over both.

use super::engine::{Engine, EngineHealth, Sink, Ticket};
use super::engine_core::PauseMode;
use super::request::Request;
use crate::handle::{self, Handle};
use crate::model::SamplerWeights;
use crate::Result;

pub trait SamplingEngine: Send + Sync {
    /// Where the engine is, for messages ("local engine 0", its URL).
    fn describe(&self) -> String;
    /// A fresh ticket for [`SamplingEngine::submit_with`].
    fn new_ticket(&self) -> Ticket;
    /// Queues a request under `ticket`; its output (or why it failed) goes to `sink`.
    fn submit_with(&self, ticket: Ticket, req: Request, sink: Sink);
    /// Ends request `ticket` now with what it has (stop reason `cancelled`).
    fn cancel(&self, ticket: Ticket) -> Handle<()>;
    /// Completes once paused (with `Abort`, once the aborted requests are answered).
    fn pause(&self, mode: PauseMode) -> Handle<()>;
    fn resume(&self) -> Handle<()>;
    /// Completes once the weights are in place, or with why they were refused (the old ones
    /// then keep serving).
    fn update_weights(&self, weights: &SamplerWeights) -> Handle<()>;
    fn health(&self) -> EngineHealth;
}

impl SamplingEngine for Engine {
    fn describe(&self) -> String {
        "a local engine".into()
    }

    fn new_ticket(&self) -> Ticket {
        Engine::new_ticket(self)
    }

    fn submit_with(&self, ticket: Ticket, req: Request, sink: Sink) {
        Engine::submit_with(self, ticket, req, sink)
    }

    fn cancel(&self, ticket: Ticket) -> Handle<()> {
        Engine::cancel(self, ticket)
    }

    fn pause(&self, mode: PauseMode) -> Handle<()> {
        Engine::pause(self, mode)
    }

    fn resume(&self) -> Handle<()> {
        Engine::resume(self)
    }

    fn update_weights(&self, weights: &SamplerWeights) -> Handle<()> {
        Engine::update_weights(self, weights)
    }

    fn health(&self) -> EngineHealth {
        Engine::health(self)
    }
}

/// One handle for many: once all have completed, `finish` turns their results (in order) into
/// the joined result.
pub fn join_all(
    handles: Vec<Handle<()>>,
    finish: impl FnOnce(Vec<Result<()>>) -> Result<()> + Send + 'static,
) -> Handle<()> {
    let (reply, joined) = handle::channel();
    let wait = move || reply.send(finish(handles.into_iter().map(Handle::wait).collect()));
    if let Err(e) = std::thread::Builder::new().name("oxrl-engines-join".into()).spawn(wait) {
        return Handle::ready(Err(crate::Error::Other(format!("cannot start a thread: {e}"))));
    }
    joined
}
