//! [`RemoteEngine`]: an engine in another process or machine (`oxrl engine`), reached over its
//! HTTP API ([`super::engine_api`]), as a [`SamplingEngine`] for the engine client.
//!
//! Each request in flight waits for its answer on a thread of its own (blocking HTTP: simple,
//! and a trainer has at most a few hundred requests in flight); pause, resume, cancel and weight
//! pushes are calls of their own. Weights go as one safetensors body, never JSON floats.

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
use crate::model::SamplerWeights;
use crate::{Error, Result};

pub struct RemoteEngine {
    inner: Arc<Inner>,
    next_ticket: AtomicU64,
}

struct Inner {
    url: String,
    api_key: Option<String>,
    agent: ureq::Agent,
}

impl RemoteEngine {
    /// The engine at `url` (`http://host:port`), checked with a `/health` call.
    pub fn connect(url: &str, api_key: Option<String>) -> Result<(RemoteEngine, EngineInfo)> {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(10)))
            .build();
        let inner = Inner { url: url.trim_end_matches('/').to_string(), api_key, agent: config.into() };
        let info = inner.info()?;
        // Tickets of several trainers on one engine must not meet: start at a random point.
        let engine = RemoteEngine { inner: Arc::new(inner), next_ticket: AtomicU64::new(rand::random::<u64>() >> 1) };
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

impl Inner {
    fn fail(&self, what: &str, why: impl std::fmt::Display) -> Error {
        Error::Other(format!("engine {}: {what}: {why}", self.url))
    }

    /// A call that reached no answer: the engine is down (it answered with an error: `fail`).
    fn down(&self, what: &str, why: ureq::Error) -> Error {
        Error::EngineDown(format!("engine {} is down ({what}: {why})", self.url))
    }

    fn post(&self, path: &str, content_type: &str, body: &[u8]) -> Result<Vec<u8>> {
        let mut req = self.agent.post(format!("{}{path}", self.url)).header("content-type", content_type);
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

    fn call<B: Serialize, R: DeserializeOwned>(&self, path: &str, body: &B) -> Result<R> {
        let body = rmp_serde::to_vec_named(body).map_err(|e| self.fail(path, e))?;
        let bytes = self.post(path, api::MSGPACK, &body)?;
        rmp_serde::from_slice(&bytes).map_err(|e| self.fail(path, format!("a reply that is not MessagePack: {e}")))
    }

    fn info(&self) -> Result<EngineInfo> {
        let mut resp =
            self.agent.get(format!("{}{}", self.url, api::HEALTH)).call().map_err(|e| self.down("health", e))?;
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
        // The sink is answered on the request's thread, or here if no thread starts.
        let slot = Arc::new(Mutex::new(Some(sink)));
        let (inner, thread_slot) = (self.inner.clone(), slot.clone());
        let spawned = std::thread::Builder::new().name("oxrl-remote-request".into()).spawn(move || {
            let out: Result<RequestOutput> = inner.call(api::GENERATE, &Submit { ticket, request });
            if let Some(sink) = thread_slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                sink(out);
            }
        });
        if let Err(e) = spawned {
            if let Some(sink) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                sink(Err(Error::Other(format!("cannot start a thread: {e}"))));
            }
        }
    }

    fn cancel(&self, ticket: Ticket) -> Handle<()> {
        self.spawn(move |e| e.call(api::CANCEL, &ticket))
    }

    fn pause(&self, mode: PauseMode) -> Handle<()> {
        self.spawn(move |e| e.call(api::PAUSE, &mode))
    }

    fn resume(&self) -> Handle<()> {
        self.spawn(|e| e.call(api::RESUME, &()))
    }

    fn update_weights(&self, weights: &SamplerWeights) -> Handle<()> {
        let weights = weights.clone();
        self.spawn(move |e| {
            let body = weights.to_safetensors()?;
            e.post(api::WEIGHTS, "application/octet-stream", &body).map(drop)
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
