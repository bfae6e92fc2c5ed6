//! The engine's own API ([`crate::rollout::engine_api`]): what a trainer's
//! [`RemoteEngine`](crate::rollout::RemoteEngine) calls. Bodies are MessagePack, errors are a
//! status with the reason as text.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::EngineServer;
use crate::locks::lock;
use crate::rollout::engine::Ticket;
use crate::rollout::engine_api::{self as api, EngineInfo, Submit};
use crate::rollout::{PauseMode, RequestOutput};

type Reply = Result<Response, (StatusCode, String)>;

fn bad_request(e: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::BAD_REQUEST, e.to_string())
}

fn unpack<T: DeserializeOwned>(body: &[u8]) -> Result<T, (StatusCode, String)> {
    rmp_serde::from_slice(body).map_err(|e| bad_request(format!("the body is not the expected MessagePack: {e}")))
}

fn pack<T: Serialize>(value: &T) -> Reply {
    let bytes = rmp_serde::to_vec_named(value).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(([(header::CONTENT_TYPE, api::MSGPACK)], bytes).into_response())
}

/// The engine's name, dtype, weight version and health (JSON, no key needed).
pub async fn health(State(s): State<Arc<EngineServer>>) -> Json<EngineInfo> {
    let server = s.clone();
    let health = tokio::task::spawn_blocking(move || server.engine.health()).await.unwrap_or_else(|_| {
        crate::rollout::EngineHealth {
            alive: false,
            stats: None,
            completed_requests: 0,
            failed_steps: 0,
            last_error: Some("the health check panicked".into()),
        }
    });
    let version = health.stats.as_ref().map_or(0, |st| st.version);
    Json(EngineInfo { model: s.name.clone(), dtype: s.dtype.clone(), version, lora_rank: s.lora_rank, health })
}

/// Runs one request to its end (or its abort by a pause, or its cancellation).
pub async fn generate(State(s): State<Arc<EngineServer>>, body: Bytes) -> Reply {
    let Submit { ticket, request } = unpack(&body)?;
    request.params.validate().map_err(bad_request)?;
    let (reply, handle) = crate::handle::channel::<RequestOutput>();
    let engine_ticket = s.engine.new_ticket();
    lock(&s.tickets).insert(ticket, engine_ticket);
    let _in_flight = InFlight { server: s.clone(), ticket, engine_ticket };
    s.engine.submit_with(engine_ticket, request, Box::new(move |out| reply.send(out)));
    pack(&handle.await.map_err(bad_request)?)
}

/// A request being answered: when its handler ends — answered, or dropped because the caller
/// hung up — its ticket is forgotten and the engine stops working on it.
struct InFlight {
    server: Arc<EngineServer>,
    ticket: Ticket,
    engine_ticket: Ticket,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.server.tickets).remove(&self.ticket);
        drop(self.server.engine.cancel(self.engine_ticket)); // a no-op once it has finished
    }
}

pub async fn cancel(State(s): State<Arc<EngineServer>>, body: Bytes) -> Reply {
    let ticket: Ticket = unpack(&body)?;
    let engine_ticket = lock(&s.tickets).get(&ticket).copied();
    if let Some(t) = engine_ticket {
        s.engine.cancel(t).await.map_err(bad_request)?;
    }
    pack(&())
}

pub async fn pause(State(s): State<Arc<EngineServer>>, body: Bytes) -> Reply {
    let mode: PauseMode = unpack(&body)?;
    s.engine.pause(mode).await.map_err(bad_request)?;
    pack(&())
}

/// The body (empty, or msgpack nil from the client) is read all the same: a call answered
/// before its body arrived would have its connection closed, and a client's next call on it
/// would find the engine gone.
pub async fn resume(State(s): State<Arc<EngineServer>>, _body: Bytes) -> Reply {
    s.engine.resume().await.map_err(bad_request)?;
    pack(&())
}

/// New weights, whole: a full snapshot, or adapters of the rank the engine was started with.
pub async fn weights(State(s): State<Arc<EngineServer>>, body: Bytes) -> Reply {
    let server = s.clone();
    let weights = tokio::task::spawn_blocking(move || server.decode_weights(&body))
        .await
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(bad_request)?;
    s.engine.update_weights(&weights).await.map_err(bad_request)?;
    pack(&())
}
