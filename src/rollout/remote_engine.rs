//! [`RemoteEngine`]: an engine in another process or machine (`oxrl engine`), reached over its
//! HTTP API ([`super::engine_api`]), as a [`SamplingEngine`] for the engine client.
//!
//! Each request in flight waits for its answer on a thread of its own (blocking HTTP: simple,
//! and a trainer has at most a few hundred requests in flight); pause, resume, cancel and weight
//! pushes are calls of their own. Weights go as one safetensors body, never JSON floats.
//!
//! An engine that dies closes its connections, and its calls fail at once (`EngineDown`). One
//! that stops answering (hung, stopped, its machine gone without a reset) is found by a
//! watchdog: `/health` every `timeout / 4`, and when one gets no answer within `timeout`, every
//! request in flight is answered `EngineDown` (the engine client sends it to another engine)
//! and a late answer is dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::engine::{EngineHealth, Sink, Ticket};
use super::engine_api::{self as api, EngineInfo, Submit};
use super::engine_core::PauseMode;
use super::request::{Request, RequestOutput};
use super::sampling_engine::SamplingEngine;
use crate::handle::{self, Handle};
use crate::locks::lock;
use crate::model::SamplerWeights;
use crate::{Error, Result};

pub struct RemoteEngine {
    inner: Arc<Inner>,
    next_ticket: AtomicU64,
}

/// Where a request's answer goes: taken once, by its thread or by the watchdog.
type SinkSlot = Arc<Mutex<Option<Sink>>>;

struct Inner {
    url: String,
    api_key: Option<String>,
    agent: ureq::Agent,
    /// The health probe's agent: no answer within `timeout` is an engine that stopped.
    probe: ureq::Agent,
    timeout: Duration,
    in_flight: Mutex<HashMap<Ticket, SinkSlot>>,
}

/// How long an engine may leave a health probe unanswered. Long enough for a weight push of a
/// large model to be applied (the engine answers between two of its jobs).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

impl RemoteEngine {
    /// The engine at `url` (`http://host:port`), checked with a `/health` call, watched with
    /// [`DEFAULT_TIMEOUT`].
    pub fn connect(url: &str, api_key: Option<String>) -> Result<(RemoteEngine, EngineInfo)> {
        Self::connect_with(url, api_key, DEFAULT_TIMEOUT)
    }

    /// [`RemoteEngine::connect`], taken for down when a health probe waits `timeout`.
    pub fn connect_with(url: &str, api_key: Option<String>, timeout: Duration) -> Result<(RemoteEngine, EngineInfo)> {
        let agent = |global: Option<Duration>| -> ureq::Agent {
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_connect(Some(Duration::from_secs(10).min(timeout)))
                .timeout_global(global)
                .build()
                .into()
        };
        let inner = Arc::new(Inner {
            url: url.trim_end_matches('/').to_string(),
            api_key,
            agent: agent(None),
            probe: agent(Some(timeout)),
            timeout,
            in_flight: Mutex::new(HashMap::new()),
        });
        let info = inner.info()?;
        let watched = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("oxrl-engine-watchdog".into())
            .spawn(move || watchdog(watched, timeout / 4))
            .map_err(|e| Error::Other(format!("cannot start a thread: {e}")))?;
        // Tickets of several trainers on one engine must not meet: start at a random point.
        let engine = RemoteEngine { inner, next_ticket: AtomicU64::new(rand::random::<u64>() >> 1) };
        Ok((engine, info))
    }

    /// What the engine says of itself now.
    pub fn info(&self) -> Result<EngineInfo> {
        self.inner.info()
    }

    /// Runs `call` on a thread of its own; the handle yields its result.
    fn spawn<T: Send + 'static>(&self, call: impl FnOnce(&Inner) -> Result<T> + Send + 'static) -> Handle<T> {
        let (reply, out) = handle::channel();
        let inner = self.inner.clone();
        let spawned = std::thread::Builder::new().name("oxrl-remote-engine".into()).spawn(move || {
            reply.send(call(&inner));
        });
        match spawned {
            Ok(_) => out,
            Err(e) => Handle::ready(Err(Error::Other(format!("cannot start a thread: {e}")))),
        }
    }
}

/// Probes the engine every `period` while it is in use; a probe without an answer fails every
/// request in flight with `EngineDown`. Ends with the engine's client.
fn watchdog(inner: std::sync::Weak<Inner>, period: Duration) {
    loop {
        std::thread::sleep(period);
        let Some(inner) = inner.upgrade() else { return };
        if lock(&inner.in_flight).is_empty() {
            continue;
        }
        if let Err(e) = inner.info() {
            let stopped: Vec<SinkSlot> = lock(&inner.in_flight).drain().map(|(_, s)| s).collect();
            for slot in stopped {
                if let Some(sink) = lock(&slot).take() {
                    sink(Err(Error::EngineDown(format!("engine {} stopped answering ({e})", inner.url))));
                }
            }
        }
    }
}

impl Inner {
    fn fail(&self, what: &str, why: impl std::fmt::Display) -> Error {
        Error::Other(format!("engine {}: {what}: {why}", self.url))
    }

    /// A call that reached no answer: the engine is down (it answered with an error: `fail`).
    fn down(&self, what: &str, why: ureq::Error) -> Error {
        Error::EngineDown(format!("engine {} is down ({what}: {why})", self.url))
    }

    /// POSTs `body`; waits at most `timeout` for the whole exchange (None: as long as it takes).
    fn post(&self, path: &str, content_type: &str, body: &[u8], timeout: Option<Duration>) -> Result<Vec<u8>> {
        let mut req = self.agent.post(format!("{}{path}", self.url)).header("content-type", content_type);
        req = req.config().timeout_global(timeout).build();
        if let Some(key) = &self.api_key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let mut resp = req.send(body).map_err(|e| self.down(path, e))?;
        let status = resp.status();
        let bytes = resp.body_mut().with_config().limit(u64::MAX).read_to_vec().map_err(|e| self.down(path, e))?;
        if !status.is_success() {
            return Err(self.fail(path, format!("{status}: {}", String::from_utf8_lossy(&bytes))));
        }
        Ok(bytes)
    }

    fn call<B: Serialize, R: DeserializeOwned>(&self, path: &str, body: &B, timeout: Option<Duration>) -> Result<R> {
        let body = rmp_serde::to_vec_named(body).map_err(|e| self.fail(path, e))?;
        let bytes = self.post(path, api::MSGPACK, &body, timeout)?;
        rmp_serde::from_slice(&bytes).map_err(|e| self.fail(path, format!("a reply that is not MessagePack: {e}")))
    }

    fn info(&self) -> Result<EngineInfo> {
        let mut resp =
            self.probe.get(format!("{}{}", self.url, api::HEALTH)).call().map_err(|e| self.down("health", e))?;
        if !resp.status().is_success() {
            return Err(self.fail("health", resp.status()));
        }
        let text = resp.body_mut().read_to_string().map_err(|e| self.fail("health", e))?;
        serde_json::from_str(&text).map_err(|e| self.fail("health", e))
    }
}

impl SamplingEngine for RemoteEngine {
    fn describe(&self) -> String {
        format!("engine {}", self.inner.url)
    }

    fn new_ticket(&self) -> Ticket {
        self.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    fn submit_with(&self, ticket: Ticket, request: Request, sink: Sink) {
        // The sink is answered on the request's thread, by the watchdog, or here if no thread
        // starts: whoever takes it first.
        let slot: SinkSlot = Arc::new(Mutex::new(Some(sink)));
        lock(&self.inner.in_flight).insert(ticket, slot.clone());
        let (inner, thread_slot) = (self.inner.clone(), slot.clone());
        let spawned = std::thread::Builder::new().name("oxrl-remote-request".into()).spawn(move || {
            // No time limit: a long generation is fine; a stopped engine is the watchdog's.
            let out: Result<RequestOutput> = inner.call(api::GENERATE, &Submit { ticket, request }, None);
            lock(&inner.in_flight).remove(&ticket);
            if let Some(sink) = lock(&thread_slot).take() {
                sink(out);
            }
        });
        if let Err(e) = spawned {
            lock(&self.inner.in_flight).remove(&ticket);
            if let Some(sink) = lock(&slot).take() {
                sink(Err(Error::Other(format!("cannot start a thread: {e}"))));
            }
        }
    }

    fn cancel(&self, ticket: Ticket) -> Handle<()> {
        self.spawn(move |e| e.call(api::CANCEL, &ticket, Some(e.timeout)))
    }

    fn pause(&self, mode: PauseMode) -> Handle<()> {
        self.spawn(move |e| e.call(api::PAUSE, &mode, Some(e.timeout)))
    }

    fn resume(&self) -> Handle<()> {
        self.spawn(|e| e.call(api::RESUME, &(), Some(e.timeout)))
    }

    fn update_weights(&self, weights: &SamplerWeights) -> Handle<()> {
        let weights = weights.clone();
        self.spawn(move |e| {
            let body = weights.to_safetensors()?;
            // The timeout, and time to move the body at 20 MB/s at least.
            let timeout = e.timeout + Duration::from_secs_f64(body.len() as f64 / 20e6);
            e.post(api::WEIGHTS, "application/octet-stream", &body, Some(timeout)).map(drop)
        })
    }

    fn health(&self) -> EngineHealth {
        match self.inner.info() {
            Ok(info) => info.health,
            Err(e) => EngineHealth {
                alive: false,
                stats: None,
                completed_requests: 0,
                failed_steps: 0,
                last_error: Some(e.to_string()),
            },
        }
    }
}
