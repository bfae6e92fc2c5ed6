//! The HTTP endpoints (`/api/v1/...`), each a thin handler: parse the body, check the caller,
//! hand the work to [`Models`](super::models::Models) / [`Futures`](super::futures::Futures),
//! answer in the shape the SDK validates. One file per resource: `sessions`, `training`,
//! `checkpoints`, `sampling`, `listings`, `futures`; here the router, the key check and
//! redaction middleware, the caller checks every handler shares, and the service endpoints.
//! Request types and their validation are in [`types`], limits in
//! [`limits`](super::limits).

mod checkpoints;
mod futures;
mod listings;
mod sampling;
mod sessions;
mod training;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::checkpoints::{CheckpointRef, Kind};
use super::errors::{ApiError, ApiResult};
use super::external_weights as ext;
use super::futures::{new_id, to_outcome, PROTOBUF};
use super::models::Job;
use super::models::TrainingModel;
use super::store::{now, CheckpointRow, ModelRow, StoredOutcome};
use super::types;
use super::wire::{self, FwdBwd};
use super::AppState;
use crate::algo::Loss;

pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/get_server_capabilities", get(capabilities))
        .route("/client/config", post(empty_object))
        .route("/client/dynamic_config", post(dynamic_config))
        .route("/cancel_future", post(futures::cancel_future))
        .route("/telemetry", post(telemetry))
        .route("/create_session", post(sessions::create_session))
        .route("/session_heartbeat", post(sessions::session_heartbeat))
        .route("/sessions/{id}/finish", post(sessions::finish_session))
        .route("/sessions", get(listings::sessions))
        .route("/sessions/{id}", get(listings::session))
        .route("/create_model", post(training::create_model))
        .route("/get_info", post(training::get_info))
        .route("/forward_backward", post(training::forward_backward))
        .route("/forward", post(training::forward))
        .route("/optim_step", post(training::optim_step))
        .route("/save_weights", post(checkpoints::save_weights))
        .route("/load_weights", post(training::load_weights))
        .route("/weights_info", post(training::weights_info))
        .route("/save_weights_for_sampler", post(checkpoints::save_weights_for_sampler))
        .route("/create_sampling_session", post(sampling::create_sampling_session))
        .route("/samplers/{id}", get(sampling::get_sampler))
        .route("/asample", post(sampling::asample))
        .route("/training_runs", get(listings::training_runs))
        .route("/training_runs/{run}", get(listings::training_run))
        .route("/training_runs/{run}/checkpoints", get(listings::run_checkpoints))
        .route(
            "/training_runs/{run}/checkpoints/{segment}/{name}",
            axum::routing::delete(checkpoints::delete_checkpoint),
        )
        .route(
            "/training_runs/{run}/checkpoints/{segment}/{name}/publish",
            post(checkpoints::publish).delete(checkpoints::unpublish),
        )
        .route("/training_runs/{run}/checkpoints/{segment}/{name}/ttl", axum::routing::put(checkpoints::set_ttl))
        .route("/save_weights_external", post(checkpoints::save_weights_external))
        .route(
            "/training_runs/{run}/checkpoints/{segment}/{name}/external_weights_urls",
            get(checkpoints::external_weights_urls),
        )
        .route("/external_weights_files/{run}/{name}/{file}", get(checkpoints::external_weights_file))
        .route("/checkpoints", get(listings::all_checkpoints))
        .route("/retrieve_future", post(futures::retrieve_future));
    Router::new()
        .nest("/api/v1", api)
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(middleware::from_fn_with_state(state.clone(), redact_errors))
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .layer(middleware::from_fn_with_state(state.clone(), super::body_limit::refuse_oversized))
        .with_state(state)
}

/// What a connection past the connection cap may do (see [`super::connections`]): `healthz`
/// answers as always, `readyz` says the server is busy, anything else is a 503 to retry.
pub fn health_only_router(state: Arc<AppState>) -> Router {
    let message = Arc::new(format!(
        "the server's connection limit is reached (oxrl serve --max-connections {}): retry",
        state.limits.max_connections
    ));
    let m = message.clone();
    Router::new()
        .route("/api/v1/healthz", get(healthz))
        .route("/api/v1/readyz", get(move || std::future::ready(busy(&m))))
        .fallback(move || std::future::ready(busy(&message)))
}

/// A 503 with `Retry-After`, category `server`.
fn busy(message: &str) -> Response {
    let error = ApiError { status: axum::http::StatusCode::SERVICE_UNAVAILABLE, ..ApiError::server(message) };
    let mut r = error.into_response();
    r.headers_mut().insert(header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
    r
}

/// With an API-key file, every request but `healthz`, `readyz` and the signed external-weights downloads
/// (whose signature is their credential: clients fetch them with plain urllib) needs a listed
/// `X-API-Key`.
async fn check_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(keys) = &state.api_keys {
        let path = req.uri().path();
        let signed = path.strip_prefix(ext::FILES_PREFIX).is_some_and(|rest| rest.split('/').count() == 3);
        if path != "/api/v1/healthz" && path != "/api/v1/readyz" && !signed {
            let key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
            if !key.is_some_and(|k| keys.contains(k)) {
                return ApiError::unauthorized("missing or unknown API key (header X-API-Key)").into_response();
            }
        }
    }
    next.run(req).await
}

/// With API keys, a future is the caller's if its key created it; another key's is a 404, as
/// for sessions and models.
fn check_future(state: &AppState, headers: &HeaderMap, id: &str) -> ApiResult<()> {
    if state.api_keys.is_some() && state.store.future_key(id)? != Some(api_key(headers)) {
        return Err(ApiError::not_found(format!("no future `{id}`")));
    }
    Ok(())
}

/// Sampler `id`, if the caller may use it: a base model's (anyone), a checkpoint path's
/// (whoever may read the checkpoint), a session's (`{session}:sample:{n}`: that session's key
/// only, else a 404 as for models).
fn usable_sampler(state: &AppState, headers: &HeaderMap, id: &str) -> ApiResult<Arc<super::samplers::Sampler>> {
    if let Some(path) = id.strip_prefix("path:") {
        readable_checkpoint(state, headers, &CheckpointRef::parse(path)?)?;
    } else if !id.starts_with("base:") {
        let session = id.split(':').next().unwrap_or_default();
        check_session(state, headers, session)
            .map_err(|_| ApiError::not_found(format!("no sampling session `{id}`")))?;
    }
    state.samplers.get(id)
}

/// Error answers name checkpoints by their `tinker://` paths, never by the server's.
async fn redact_errors(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    if response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH); // the text changes length
    match axum::body::to_bytes(body, 1 << 20).await {
        Ok(bytes) => {
            let text = super::checkpoints::redact(&String::from_utf8_lossy(&bytes), &state.data_dir);
            Response::from_parts(parts, axum::body::Body::from(text))
        }
        Err(_) => Response::from_parts(parts, axum::body::Body::empty()),
    }
}

/// How many of `sessions` (one entry per model or sampler alive) are the caller's key's.
fn callers(state: &AppState, headers: &HeaderMap, sessions: Vec<String>) -> usize {
    let key = Some(api_key(headers));
    sessions.iter().filter(|s| state.store.session_key(s).ok().flatten() == key).count()
}

fn api_key(headers: &HeaderMap) -> Option<String> {
    headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(String::from)
}

/// The caller may use session `id`: it exists and, with API keys, was created with the
/// caller's key.
fn check_session(state: &AppState, headers: &HeaderMap, id: &str) -> ApiResult<()> {
    let owner = state.store.session_key(id)?.ok_or_else(|| ApiError::not_found(format!("no session `{id}`")))?;
    if state.api_keys.is_some() && owner != api_key(headers) {
        return Err(ApiError::not_found(format!("no session `{id}`")));
    }
    Ok(())
}

/// [`check_session`], for what adds to a session (models, samplers): a finished session (by
/// its client, or for want of heartbeats) takes nothing new, since nothing would free it.
fn check_open_session(state: &AppState, headers: &HeaderMap, id: &str) -> ApiResult<()> {
    check_session(state, headers, id)?;
    if state.store.session_finished(id)? {
        return Err(ApiError::user(format!(
            "session `{id}` is finished (ended, or no heartbeat in time): create a new session"
        )));
    }
    Ok(())
}

/// Training model `id` of the caller's. A model the store knows but memory does not was freed
/// with its finished session, or lost in a restart (models live in memory, checkpoints on disk):
/// the error says which, and how to go on.
fn training_model(state: &AppState, headers: &HeaderMap, id: &str) -> ApiResult<Arc<TrainingModel>> {
    match state.models.get(id) {
        Ok(model) => {
            check_session(state, headers, &model.session_id)?;
            Ok(model)
        }
        Err(e) => match state.store.models()?.into_iter().find(|m| m.id == id) {
            Some(row) if state.store.session_finished(&row.session_id)? => Err(ApiError::not_found(format!(
                "training model `{id}` was freed: its session `{}` finished (or stopped sending heartbeats)",
                row.session_id
            ))),
            Some(row) if check_session(state, headers, &row.session_id).is_ok() => Err(ApiError::user(format!(
                "training model `{id}` was lost when the server restarted (models live in memory; checkpoints \
                 survive): create a training client from one of its checkpoints (see the run's checkpoints)"
            ))),
            _ => Err(e),
        },
    }
}

async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Ready to take work: answered on a connection under the connection cap (one past it gets a 503).
async fn readyz() -> Json<Value> {
    Json(json!({"status": "ready"}))
}

// Handlers that need no body still take it (`_body`): hyper closes a connection whose request
// was answered before its body was read, and a client's next call on that pooled connection
// fails as if the server were gone.
async fn empty_object(_body: Bytes) -> Json<Value> {
    Json(json!({}))
}

/// The SDK's feature flags: cancel abandoned samples (`cancel_future`); the rest default.
async fn dynamic_config(_body: Bytes) -> Json<Value> {
    Json(json!({"sample_cancel_enabled": true}))
}

async fn telemetry(_body: Bytes) -> Json<Value> {
    Json(json!({"status": "accepted"}))
}

async fn capabilities(State(state): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<Value> = state
        .served
        .iter()
        .map(|m| {
            json!({"model_name": m.name, "max_context_length": m.max_context_length,
                   "trainable": true, "sampleable": true})
        })
        .collect();
    Json(json!({"supported_models": models}))
}

fn future_response(request_id: String, model_id: Option<&str>) -> Json<Value> {
    match model_id {
        Some(m) => Json(json!({"request_id": request_id, "model_id": m})),
        None => Json(json!({"request_id": request_id})),
    }
}

/// Queues `work` on `model` at `seq_id` with a new future of `kind`; `work` runs in the model's
/// turn with the state, the dispatch and the request id, and must complete the future.
/// Queues `work` on `model` in `seq_id`'s turn with what the request's checks gave (`checked`);
/// a request that failed them still takes its turn, failing its future then, so that its
/// `seq_id` is used and the model's later requests do not wait for it forever.
fn queue<T: Send + 'static>(
    state: &Arc<AppState>,
    model: &TrainingModel,
    seq_id: i64,
    kind: &'static str,
    checked: ApiResult<T>,
    work: impl FnOnce(T, Arc<AppState>, &Arc<crate::dispatch::Dispatch>, String) + Send + 'static,
) -> ApiResult<Json<Value>> {
    let st = state.clone();
    let model_id = model.id.clone();
    // The model's session's key: the caller's (training_model checked it).
    let key = state.store.session_key(&model.session_id)?.flatten();
    let request_id = state.models.submit(model, seq_id, move || {
        let request_id = st.futures.create(Some(&model_id), kind, key.as_deref())?;
        let rid = request_id.clone();
        let job: Job = Box::new(move |dispatch| match checked {
            Ok(checked) => work(checked, st, dispatch, rid),
            Err(e) => st.futures.complete_json(&rid, Err(e)),
        });
        Ok((request_id, job))
    })?;
    Ok(future_response(request_id, Some(&model.id)))
}

/// The registry entry of `c`, if the caller may use it (with API keys: created by the caller's
/// key); otherwise a user error naming it.
fn find_checkpoint(state: &AppState, headers: &HeaderMap, c: &CheckpointRef) -> ApiResult<CheckpointRow> {
    let missing = || ApiError::not_found(format!("no checkpoint `{}`", c.uri()));
    let row = state.store.checkpoint(c)?.ok_or_else(missing)?;
    check_session(state, headers, &row.session_id).map_err(|_| missing())?;
    Ok(row)
}

/// [`find_checkpoint`], or a published checkpoint of anyone's (to load or sample from).
fn readable_checkpoint(state: &AppState, headers: &HeaderMap, c: &CheckpointRef) -> ApiResult<CheckpointRow> {
    match state.store.checkpoint(c)? {
        Some(row) if row.public => Ok(row),
        _ => find_checkpoint(state, headers, c),
    }
}

/// Where an ephemeral sampler's adapter is exported.
fn ephemeral_dir(state: &AppState, sampler_id: &str) -> std::path::PathBuf {
    state.data_dir.join("ephemeral").join(sampler_id.replace(':', "_"))
}
