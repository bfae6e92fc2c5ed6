//! The HTTP endpoints (`/api/v1/...`), each a thin handler: parse the body, check the caller,
//! hand the work to [`Models`] / [`Futures`], answer in the shape the SDK validates.

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
use super::types::{self, FwdBwd};
use super::AppState;
use crate::algo::Loss;

pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/healthz", get(healthz))
        .route("/get_server_capabilities", get(capabilities))
        .route("/client/config", post(empty_object))
        .route("/client/dynamic_config", post(dynamic_config))
        .route("/cancel_future", post(cancel_future))
        .route("/telemetry", post(telemetry))
        .route("/create_session", post(create_session))
        .route("/session_heartbeat", post(session_heartbeat))
        .route("/sessions/{id}/finish", post(finish_session))
        .route("/sessions", get(sessions))
        .route("/sessions/{id}", get(session))
        .route("/create_model", post(create_model))
        .route("/get_info", post(get_info))
        .route("/forward_backward", post(forward_backward))
        .route("/forward", post(forward))
        .route("/optim_step", post(optim_step))
        .route("/save_weights", post(save_weights))
        .route("/load_weights", post(load_weights))
        .route("/weights_info", post(weights_info))
        .route("/save_weights_for_sampler", post(save_weights_for_sampler))
        .route("/create_sampling_session", post(create_sampling_session))
        .route("/samplers/{id}", get(get_sampler))
        .route("/asample", post(asample))
        .route("/training_runs", get(training_runs))
        .route("/training_runs/{run}", get(training_run))
        .route("/training_runs/{run}/checkpoints", get(run_checkpoints))
        .route("/training_runs/{run}/checkpoints/{segment}/{name}", axum::routing::delete(delete_checkpoint))
        .route("/training_runs/{run}/checkpoints/{segment}/{name}/publish", post(publish).delete(unpublish))
        .route("/training_runs/{run}/checkpoints/{segment}/{name}/ttl", axum::routing::put(set_ttl))
        .route("/save_weights_external", post(save_weights_external))
        .route("/training_runs/{run}/checkpoints/{segment}/{name}/external_weights_urls", get(external_weights_urls))
        .route("/external_weights_files/{run}/{name}/{file}", get(external_weights_file))
        .route("/checkpoints", get(all_checkpoints))
        .route("/retrieve_future", post(retrieve_future));
    Router::new()
        .nest("/api/v1", api)
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(middleware::from_fn_with_state(state.clone(), redact_errors))
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
}

/// With an API-key file, every request but `healthz` and the signed external-weights downloads
/// (whose signature is their credential: clients fetch them with plain urllib) needs a listed
/// `X-API-Key`.
async fn check_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(keys) = &state.api_keys {
        let path = req.uri().path();
        let signed = path.strip_prefix(ext::FILES_PREFIX).is_some_and(|rest| rest.split('/').count() == 3);
        if path != "/api/v1/healthz" && !signed {
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

async fn empty_object() -> Json<Value> {
    Json(json!({}))
}

/// The SDK's feature flags: cancel abandoned samples (`cancel_future`); the rest default.
async fn dynamic_config() -> Json<Value> {
    Json(json!({"sample_cancel_enabled": true}))
}

async fn cancel_future(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::RetrieveFutureRequest = types::parse_json(&body, "cancel_future")?;
    check_future(&state, &headers, &req.request_id)?;
    state.futures.cancel(&req.request_id)?;
    Ok(Json(json!({})))
}

async fn telemetry() -> Json<Value> {
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

async fn create_session(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::CreateSessionRequest = types::parse_json(&body, "create_session")?;
    let id = new_id();
    let tags = serde_json::to_string(&req.tags).unwrap_or_default();
    let meta = req.user_metadata.map(|m| m.to_string()).unwrap_or_default();
    state.limits.metadata(&meta)?;
    state.store.add_session(&id, api_key(&headers).as_deref(), &tags, &meta, req.sdk_version.as_deref())?;
    Ok(Json(json!({"type": "create_session", "session_id": id})))
}

async fn session_heartbeat(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::SessionRequest = types::parse_json(&body, "session_heartbeat")?;
    check_session(&state, &headers, &req.session_id)?;
    state.store.heartbeat(&req.session_id)?;
    Ok(Json(json!({"type": "session_heartbeat"})))
}

async fn finish_session(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    check_session(&state, &headers, &id)?;
    state.store.finish_session(&id)?;
    // Free the session's training models and samplers (their checkpoints stay). Dropping a model
    // waits for its queued calls: off the async threads.
    let st = state.clone();
    let sid = id.clone();
    tokio::task::spawn_blocking(move || {
        st.models.drop_session(&sid);
        st.samplers.drop_session(&sid);
    })
    .await
    .map_err(|e| ApiError::server(format!("finishing the session failed: {e}")))?;
    Ok(Json(json!({})))
}

fn future_response(request_id: String, model_id: Option<&str>) -> Json<Value> {
    match model_id {
        Some(m) => Json(json!({"request_id": request_id, "model_id": m})),
        None => Json(json!({"request_id": request_id})),
    }
}

async fn create_model(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::CreateModelRequest = types::parse_json(&body, "create_model")?;
    check_open_session(&state, &headers, &req.session_id)?;
    let base = state.served.iter().find(|m| m.matches(&req.base_model)).cloned().ok_or_else(|| {
        let names: Vec<&str> = state.served.iter().map(|m| m.name.as_str()).collect();
        ApiError::user(format!("unknown base_model `{}` (served: {})", req.base_model, names.join(", ")))
    })?;
    if let Some(opt) = &req.optimizer_config {
        let ty = opt.get("type").and_then(Value::as_str).unwrap_or("adamw");
        if ty != "adamw" {
            return Err(ApiError::user(format!("optimizer `{ty}` is not supported (only adamw)")));
        }
    }
    let model_id = format!("{}:train:{}", req.session_id, req.model_seq_id);
    let lora = req.lora_config.clone().unwrap_or_default();
    state.limits.lora_rank(lora.rank)?;
    let metadata = req.user_metadata.as_ref().map(|m| m.to_string()).unwrap_or_default();
    state.limits.metadata(&metadata)?;
    let key = api_key(&headers);
    state.limits.models_per_key(callers(&state, &headers, state.models.sessions()))?;
    let build = state.models.register(&model_id, &req.session_id, base.clone(), lora.clone(), None)?;
    // The run reports `base_model` as the client named it (a served name or the path given to
    // --model: cookbook code compares the two).
    state.store.add_model(
        &model_id,
        &req.session_id,
        &req.base_model,
        &serde_json::to_string(&lora).unwrap_or_default(),
        &metadata,
    )?;
    let request_id = state.futures.create(Some(&model_id), "create_model", key.as_deref())?;
    let (st, rid) = (state.clone(), request_id.clone());
    tokio::spawn(async move {
        let result = tokio::task::spawn_blocking(build)
            .await
            .unwrap_or_else(|e| Err(ApiError::server(format!("building the model failed: {e}"))));
        st.futures.complete_json(&rid, result);
    });
    Ok(future_response(request_id, Some(&model_id)))
}

async fn get_info(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::ModelRequest = types::parse_json(&body, "get_info")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    Ok(Json(json!({
        "type": "get_info",
        "model_id": model.id,
        "model_data": {"arch": model.base.arch, "model_name": model.base.name,
                       "tokenizer_id": model.base.path.display().to_string()},
        "is_lora": true,
        "lora_rank": model.lora.rank,
        "model_name": model.base.name,
    })))
}

async fn forward_backward(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    run_fwdbwd(state, headers, body, false).await
}

async fn forward(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    run_fwdbwd(state, headers, body, true).await
}

async fn run_fwdbwd(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Bytes,
    forward_path: bool,
) -> ApiResult<Json<Value>> {
    if headers.get(header::CONTENT_ENCODING).is_some_and(|v| v != "identity") {
        return Err(ApiError::user("compressed request bodies are not supported (Content-Encoding)"));
    }
    let is_proto =
        headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with(PROTOBUF));
    let mut req = if is_proto { FwdBwd::from_proto(&body)? } else { FwdBwd::from_json(&body, forward_path)? };
    let model = training_model(&state, &headers, &req.model_id)?;
    // A request refused from here on fails its future in its turn, so that its seq_id is used
    // and the model's later requests do not wait for it forever.
    let tokens: usize = req.data.iter().map(|d| d.input_tokens.len()).sum();
    let budget = state.limits.tokens_in_flight_budget(model.base.bytes_per_token, state.memory_available);
    let (mut refused, mut admitted) = (state.limits.train_tokens(tokens).err(), None);
    if refused.is_none() {
        match model.admit(tokens, budget) {
            Ok(a) => admitted = Some(a),
            Err(e) => refused = Some(e),
        }
    }
    if refused.is_none() && req.loss_fn == "stable_reinforce" {
        // Its `q` and weights come from what this server recorded when it sampled.
        let session = model.id.split(':').next().unwrap_or_default();
        let key = api_key(&headers);
        refused =
            super::provenance::resolve(&state.stability, key.as_deref(), session, &mut req.data, &req.provenance).err();
    }
    let forward_only = req.forward_only || forward_path;
    let kind = if forward_only { "forward" } else { "forward_backward" };
    let (st, key) = (state.clone(), api_key(&headers));
    let model_id = model.id.clone();
    let request_id = state.models.submit(&model, req.seq_id, move || {
        let request_id = st.futures.create(Some(&model_id), kind, key.as_deref())?;
        let rid = request_id.clone();
        let job: Job = Box::new(move |dispatch| {
            if let Some(e) = refused {
                return st.futures.complete(&rid, to_outcome(Err(e)));
            }
            // A bad loss name or config fails this future, in its turn.
            let loss = match Loss::parse(&req.loss_fn, &req.loss_fn_config) {
                Ok(l) => l,
                Err(e) => return st.futures.complete(&rid, to_outcome(Err(e.into()))),
            };
            let handle = if forward_only {
                dispatch.submit_forward(&model_id, &req.data, Some(&loss), true)
            } else {
                dispatch.submit_forward_backward(&model_id, &req.data, Some(&loss), true)
            };
            tokio::spawn(async move {
                let done = handle.await;
                drop(admitted); // its tokens are no longer in flight
                let outcome = match done {
                    Ok(out) => StoredOutcome::Proto {
                        proto: types::output_to_proto(&out),
                        json: types::output_to_json(&out).to_string(),
                    },
                    Err(e) => to_outcome(Err(e.into())),
                };
                st.futures.complete(&rid, outcome);
            });
        });
        Ok((request_id, job))
    })?;
    Ok(future_response(request_id, Some(&model.id)))
}

async fn optim_step(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::OptimStepRequest = types::parse_json(&body, "optim_step")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    let params = req.adam_params.unwrap_or_default().to_params();
    let (st, key) = (state.clone(), api_key(&headers));
    let model_id = model.id.clone();
    let request_id = state.models.submit(&model, req.seq_id, move || {
        let request_id = st.futures.create(Some(&model_id), "optim_step", key.as_deref())?;
        let rid = request_id.clone();
        let job: Job = Box::new(move |dispatch| {
            if let Err(e) = params.validate() {
                return st.futures.complete(&rid, to_outcome(Err(e.into())));
            }
            let handle = dispatch.submit_optim_step(&model_id, &params);
            tokio::spawn(async move {
                let result = handle.await.map_err(ApiError::from).map(|grad_norm| {
                    let metrics: BTreeMap<&str, f64> =
                        [("grad_norm:mean", grad_norm), ("learning_rate:mean", params.learning_rate)].into();
                    json!({"metrics": metrics})
                });
                st.futures.complete_json(&rid, result);
            });
        });
        Ok((request_id, job))
    })?;
    Ok(future_response(request_id, Some(&model.id)))
}

async fn retrieve_future(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Response> {
    let req: types::RetrieveFutureRequest = types::parse_json(&body, "retrieve_future")?;
    let accept_proto = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains(PROTOBUF));
    check_future(&state, &headers, &req.request_id)?;
    state.futures.retrieve(&req.request_id, accept_proto).await
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

async fn save_weights(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::SaveWeightsRequest = types::parse_json(&body, "save_weights")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    let name = req.path.clone().unwrap_or_else(|| format!("seq-{}", req.seq_id));
    let (session_id, base, lora) = (model.session_id.clone(), model.base.name.clone(), model.lora.clone());
    let model_id = model.id.clone();
    let checked = types::expiry(req.ttl_seconds);
    queue(&state, &model, req.seq_id, "save_weights", checked, move |expires_at, st, dispatch, rid| {
        let prepared = CheckpointRef::new(&model_id, Kind::Weights, &name).and_then(|c| {
            if !req.overwrite && st.store.checkpoint(&c)?.is_some() {
                return Err(ApiError::user(format!("checkpoint `{}` exists (pass overwrite=True)", c.uri())));
            }
            Ok(c)
        });
        let c = match prepared {
            Ok(c) => c,
            Err(e) => return st.futures.complete_json(&rid, Err(e)),
        };
        let dir = c.dir(&st.data_dir);
        let handle = dispatch.submit_save_state(&model_id, &dir);
        tokio::spawn(async move {
            let result = async {
                handle.await?;
                let row = CheckpointRow {
                    path: dir.display().to_string(),
                    created: now(),
                    session_id,
                    base_model: base,
                    lora_config: serde_json::to_string(&lora).unwrap_or_default(),
                    public: false,
                    expires_at,
                };
                st.store.add_checkpoint(&c, &row)?;
                Ok(json!({"path": c.uri(), "type": "save_weights"}))
            }
            .await;
            st.futures.complete_json(&rid, result);
        });
    })
}

/// Exports the model's weights (LoRA: the PEFT adapter) into an `external_weights` checkpoint,
/// age-encrypted to the request's recipients if any; a repeated name replaces the old export
/// (the cookbook always exports as `download`).
async fn save_weights_external(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::SaveWeightsExternalRequest = types::parse_json(&body, "save_weights_external")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    let name = req.path.clone().unwrap_or_else(|| format!("seq-{}", req.seq_id));
    let checked = ext::parse_recipients(req.age_encryption_recipients.as_deref()).and_then(|recipients| {
        let c = CheckpointRef::new(&model.id, Kind::ExternalWeights, &name)?;
        Ok((recipients, c, types::expiry(req.ttl_seconds)?))
    });
    let (session_id, base, lora) = (model.session_id.clone(), model.base.name.clone(), model.lora.clone());
    let model_id = model.id.clone();
    queue(&state, &model, req.seq_id, "save_weights_external", checked, move |checked, st, dispatch, rid| {
        let (recipients, c, expires_at) = checked;
        // Exported beside the data, then moved (or encrypted) into place: the checkpoint
        // directory never holds a half-written or, for an encrypted export, a plaintext file.
        let staging = st.data_dir.join("staging").join(rid.replace(':', "_"));
        let handle = dispatch.submit_export(&model_id, &staging, false);
        tokio::spawn(async move {
            let result = async {
                handle.await?;
                let (dir, stage) = (c.dir(&st.data_dir), staging.clone());
                let stored =
                    tokio::task::spawn_blocking(move || ext::store_export(&stage, &dir, recipients.as_deref()))
                        .await
                        .map_err(|e| ApiError::server(format!("storing the export failed: {e}")))?;
                let _ = std::fs::remove_dir_all(&staging);
                let size = stored?;
                let row = CheckpointRow {
                    path: c.dir(&st.data_dir).display().to_string(),
                    created: now(),
                    session_id,
                    base_model: base,
                    lora_config: serde_json::to_string(&lora).unwrap_or_default(),
                    public: false,
                    expires_at,
                };
                st.store.add_checkpoint(&c, &row)?;
                Ok(json!({"path": c.uri(), "size_bytes": size, "type": "save_weights_external"}))
            }
            .await;
            st.futures.complete_json(&rid, result);
        });
    })
}

/// Signed download URLs, one per file of an `external_weights` checkpoint, valid for
/// [`ext::URL_LIFETIME_S`].
async fn external_weights_urls(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((run, segment, name)): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    let c = CheckpointRef::new(&run, Kind::parse(&segment)?, &name)?;
    if c.kind != Kind::ExternalWeights {
        return Err(ApiError::user(format!(
            "`{}` is not an export: download URLs are for tinker://RUN/external_weights/NAME (save_weights_external)",
            c.uri()
        )));
    }
    let row = readable_checkpoint(&state, &headers, &c)?;
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let base = ext::base_url(state.public_url.as_deref(), host)?;
    let expires = now() as u64 + ext::URL_LIFETIME_S;
    let mut files: Vec<String> = std::fs::read_dir(&row.path)
        .map_err(|e| ApiError::server(format!("listing {}: {e}", row.path)))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    files.sort();
    let urls: serde_json::Map<String, Value> = files
        .into_iter()
        .map(|f| {
            let url = state.url_signer.url(&base, &c.run_id, &c.name, &f, expires);
            (f, Value::String(url))
        })
        .collect();
    Ok(Json(json!({"urls": urls, "expires": ext::rfc3339(expires)})))
}

/// One file of an export, for a URL [`external_weights_urls`] signed: 403 for a bad or expired
/// signature, 404 once the checkpoint is gone. No API key (see [`check_api_key`]).
async fn external_weights_file(
    State(state): State<Arc<AppState>>,
    Path((run, name, file)): Path<(String, String, String)>,
    uri: axum::http::Uri,
) -> ApiResult<Response> {
    let forbidden = |why: &str| ApiError {
        status: axum::http::StatusCode::FORBIDDEN,
        category: super::errors::Category::User,
        message: format!("{why}: ask for new download URLs (external_weights_urls)"),
    };
    let (expires, sig) = ext::parse_query(uri.query()).ok_or_else(|| forbidden("the URL is not signed"))?;
    if !state.url_signer.verify(&run, &name, &file, expires, &sig) {
        return Err(forbidden("bad signature"));
    }
    if (expires as f64) < now() {
        return Err(forbidden("the URL expired"));
    }
    let c = CheckpointRef::new(&run, Kind::ExternalWeights, &name)?;
    super::checkpoints::check_segment("file name", &file)?;
    let gone = || ApiError::not_found(format!("no file `{file}` in `{}` (deleted or expired)", c.uri()));
    let row = state.store.checkpoint(&c)?.ok_or_else(gone)?;
    let path = std::path::PathBuf::from(&row.path).join(&file);
    // Read whole: exports are adapters (tens of MB); a file vanishing meanwhile is a 404.
    let bytes = tokio::task::spawn_blocking(move || std::fs::read(path))
        .await
        .map_err(|e| ApiError::server(format!("reading the file failed: {e}")))?
        .map_err(|_| gone())?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, bytes.len().to_string()),
        ],
        bytes,
    )
        .into_response())
}

async fn load_weights(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::LoadWeightsRequest = types::parse_json(&body, "load_weights")?;
    let c = CheckpointRef::parse(&req.path)?;
    if c.kind != Kind::Weights {
        return Err(ApiError::user(format!(
            "`{}` holds {}; load_weights needs a save_state checkpoint (tinker://RUN/weights/NAME)",
            req.path,
            if c.kind == Kind::SamplerWeights { "sampler weights" } else { "an export to download" }
        )));
    }
    let row = readable_checkpoint(&state, &headers, &c)?;
    let dir = std::path::PathBuf::from(&row.path);
    let optimizer = req.optimizer;
    let load = move |dispatch: &crate::dispatch::Dispatch, id: &str| {
        if optimizer {
            dispatch.submit_load_state(id, &dir)
        } else {
            dispatch.submit_load_weights(id, &dir)
        }
    };
    match (&req.model_id, &req.session_id) {
        (Some(model_id), None) => {
            let model = training_model(&state, &headers, model_id)?;
            let seq_id =
                req.seq_id.ok_or_else(|| ApiError::user("load_weights: `seq_id` is required with `model_id`"))?;
            let (id, uri) = (model.id.clone(), c.uri());
            queue(&state, &model, seq_id, "load_weights", Ok(()), move |(), st, dispatch, rid| {
                let handle = load(dispatch, &id);
                tokio::spawn(async move {
                    let result = handle.await.map_err(ApiError::from);
                    let result = result.map(|()| json!({"path": uri, "model_id": id, "type": "load_weights"}));
                    st.futures.complete_json(&rid, result);
                });
            })
        }
        (None, Some(session_id)) => {
            check_open_session(&state, &headers, session_id)?;
            let model_seq_id = req
                .model_seq_id
                .ok_or_else(|| ApiError::user("load_weights: `model_seq_id` is required with `session_id`"))?;
            let base_name = req.base_model.clone().unwrap_or(row.base_model.clone());
            let base = state.served.iter().find(|m| m.matches(&base_name)).cloned().ok_or_else(|| {
                ApiError::user(format!("the checkpoint's base model `{base_name}` is not served here"))
            })?;
            let lora: types::LoraConfigWire = serde_json::from_str(&row.lora_config)
                .map_err(|e| ApiError::server(format!("checkpoint `{}`: bad LoRA record: {e}", c.uri())))?;
            let model_id = format!("{session_id}:train:{model_seq_id}");
            let after: super::models::AfterBuild = Box::new(move |d, id| load(d, id).wait());
            let build = state.models.register(&model_id, session_id, base.clone(), lora.clone(), Some(after))?;
            state.store.add_model(&model_id, session_id, &base.name, &row.lora_config, "")?;
            let request_id = state.futures.create(Some(&model_id), "load_weights", api_key(&headers).as_deref())?;
            let (st, rid, uri) = (state.clone(), request_id.clone(), c.uri());
            tokio::spawn(async move {
                let result = tokio::task::spawn_blocking(build)
                    .await
                    .unwrap_or_else(|e| Err(ApiError::server(format!("building the model failed: {e}"))));
                let result = result.map(|v| json!({"path": uri, "model_id": v["model_id"], "type": "load_weights"}));
                st.futures.complete_json(&rid, result);
            });
            Ok(future_response(request_id, Some(&model_id)))
        }
        _ => Err(ApiError::user("load_weights: give either `model_id` + `seq_id` or `session_id` + `model_seq_id`")),
    }
}

async fn weights_info(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::WeightsInfoRequest = types::parse_json(&body, "weights_info")?;
    let c = CheckpointRef::parse(&req.tinker_path)?;
    let row = readable_checkpoint(&state, &headers, &c)?;
    let lora: Value = serde_json::from_str(&row.lora_config).unwrap_or(Value::Null);
    Ok(Json(json!({"base_model": row.base_model, "is_lora": true, "lora_rank": lora["rank"]})))
}

/// Where an ephemeral sampler's adapter is exported.
fn ephemeral_dir(state: &AppState, sampler_id: &str) -> std::path::PathBuf {
    state.data_dir.join("ephemeral").join(sampler_id.replace(':', "_"))
}

async fn save_weights_for_sampler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::SaveWeightsForSamplerRequest = types::parse_json(&body, "save_weights_for_sampler")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    let (session_id, base, lora) = (model.session_id.clone(), model.base.clone(), model.lora.clone());
    let model_id = model.id.clone();
    let checked = types::expiry(req.ttl_seconds);
    queue(&state, &model, req.seq_id, "save_weights_for_sampler", checked, move |expires_at, st, dispatch, rid| {
        // Named: a registered checkpoint. Ephemeral: a sampling session over the weights now.
        let target = match (&req.path, req.sampling_session_seq_id) {
            (Some(name), _) => CheckpointRef::new(&model_id, Kind::SamplerWeights, name).map(|c| (Some(c), None)),
            (None, Some(n)) => Ok((None, Some(format!("{session_id}:sample:{n}")))),
            (None, None) => Err(ApiError::user("save_weights_for_sampler: give `path` or `sampling_session_seq_id`")),
        };
        let (named, sampler_id) = match target {
            Ok(t) => t,
            Err(e) => return st.futures.complete_json(&rid, Err(e)),
        };
        let dir = match (&named, &sampler_id) {
            (Some(c), _) => c.dir(&st.data_dir),
            (None, Some(id)) => ephemeral_dir(&st, id),
            (None, None) => unreachable!("one of the two is set above"),
        };
        let handle = dispatch.submit_export(&model_id, &dir, false);
        tokio::spawn(async move {
            let result = async {
                handle.await?;
                if let Some(c) = named {
                    let row = CheckpointRow {
                        path: dir.display().to_string(),
                        created: now(),
                        session_id,
                        base_model: base.name.clone(),
                        lora_config: serde_json::to_string(&lora).unwrap_or_default(),
                        public: false,
                        expires_at,
                    };
                    st.store.add_checkpoint(&c, &row)?;
                    // Samplers made from an older save under this name take the new weights.
                    let (st2, uri) = (st.clone(), c.uri());
                    tokio::task::spawn_blocking(move || st2.samplers.checkpoint_changed(&uri, Some(&dir)))
                        .await
                        .map_err(|e| ApiError::server(format!("reloading its samplers failed: {e}")))??;
                    return Ok(json!({"path": c.uri(), "type": "save_weights_for_sampler"}));
                }
                let id = sampler_id.unwrap_or_default();
                let st2 = st.clone();
                let sid = id.clone();
                tokio::task::spawn_blocking(move || st2.samplers.create_ephemeral(&sid, &base, &dir))
                    .await
                    .map_err(|e| ApiError::server(format!("starting the sampler failed: {e}")))??;
                Ok(json!({"sampling_session_id": id, "type": "save_weights_for_sampler"}))
            }
            .await;
            st.futures.complete_json(&rid, result);
        });
    })
}

/// The sampler for a `tinker://` path: the checkpoint's base with its adapter.
async fn sampler_for_path(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    id: &str,
    path: &str,
) -> ApiResult<Arc<super::samplers::Sampler>> {
    let c = CheckpointRef::parse(path)?;
    if c.kind == Kind::ExternalWeights {
        return Err(ApiError::user(format!("`{path}` is an export to download, not weights to sample from")));
    }
    let row = readable_checkpoint(state, headers, &c)?;
    let base = state.served.iter().find(|m| m.matches(&row.base_model)).cloned().ok_or_else(|| {
        ApiError::user(format!("the checkpoint's base model `{}` is not served here", row.base_model))
    })?;
    let (st, id, uri) = (state.clone(), id.to_string(), c.uri());
    let dir = std::path::PathBuf::from(row.path);
    Ok(tokio::task::spawn_blocking(move || st.samplers.create(&id, &base, Some(&dir), Some(uri)))
        .await
        .map_err(|e| ApiError::server(format!("starting the sampler failed: {e}")))??)
}

async fn sampler_for_base(state: &Arc<AppState>, name: &str) -> ApiResult<Arc<super::samplers::Sampler>> {
    let base = state.served.iter().find(|m| m.matches(name)).cloned().ok_or_else(|| {
        let names: Vec<&str> = state.served.iter().map(|m| m.name.as_str()).collect();
        ApiError::user(format!("unknown base_model `{name}` (served: {})", names.join(", ")))
    })?;
    let st = state.clone();
    let id = format!("base:{}", base.name);
    Ok(tokio::task::spawn_blocking(move || st.samplers.create(&id, &base, None, None))
        .await
        .map_err(|e| ApiError::server(format!("starting the sampler failed: {e}")))??)
}

async fn create_sampling_session(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::CreateSamplingSessionRequest = types::parse_json(&body, "create_sampling_session")?;
    check_open_session(&state, &headers, &req.session_id)?;
    state.limits.samplers_per_key(callers(&state, &headers, state.samplers.sessions()))?;
    let id = format!("{}:sample:{}", req.session_id, req.sampling_session_seq_id);
    let sampler = match (&req.model_path, &req.base_model) {
        (Some(path), _) => sampler_for_path(&state, &headers, &id, path).await?,
        (None, Some(base)) => {
            let shared = sampler_for_base(&state, base).await?;
            let (st, sid, b) = (state.clone(), id.clone(), shared.base.clone());
            tokio::task::spawn_blocking(move || st.samplers.create(&sid, &b, None, None))
                .await
                .map_err(|e| ApiError::server(format!("starting the sampler failed: {e}")))??
        }
        (None, None) => return Err(ApiError::user("create_sampling_session: give `model_path` or `base_model`")),
    };
    Ok(Json(json!({"sampling_session_id": sampler.id, "type": "create_sampling_session"})))
}

async fn get_sampler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let s = usable_sampler(&state, &headers, &id)?;
    Ok(Json(json!({"sampler_id": s.id, "base_model": s.base.name, "model_path": s.model_path})))
}

/// Top-k log-probs per position at most.
const MAX_TOPK: i64 = 1024;

async fn asample(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    let req: types::SampleRequest = types::parse_json(&body, "asample")?;
    let sampler = match (&req.sampling_session_id, &req.model_path, &req.base_model) {
        (Some(id), _, _) => usable_sampler(&state, &headers, id)?,
        (None, Some(path), _) => sampler_for_path(&state, &headers, &format!("path:{path}"), path).await?,
        (None, None, Some(base)) => sampler_for_base(&state, base).await?,
        _ => return Err(ApiError::user("asample: give `sampling_session_id`, `model_path` or `base_model`")),
    };
    if req.target_prompt_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::user("target_prompt_logprobs is not supported by this server"));
    }
    if req.prompt_alt_tokens_k.is_some_and(|k| k != 0) {
        return Err(ApiError::user("prompt_alt_tokens_k is not supported by this server"));
    }
    let prompt = req.prompt.tokens("prompt")?;
    if prompt.is_empty() {
        return Err(ApiError::user("prompt: no tokens"));
    }
    let count = |v: Option<i64>, name: &str| -> ApiResult<usize> {
        match v.unwrap_or(0) {
            k @ 0..=MAX_TOPK => Ok(k as usize),
            k => Err(ApiError::user(format!("{name} must be in 0..={MAX_TOPK}, got {k}"))),
        }
    };
    let topk = (
        count(req.topk_prompt_logprobs, "topk_prompt_logprobs")?,
        count(req.topk_sample_logprobs, "topk_sample_logprobs")?,
    );
    let prompt_logprobs = req.prompt_logprobs.unwrap_or(false);
    let last_n = match req.prompt_logprobs_last_n {
        None => None,
        Some(n) if !prompt_logprobs => {
            return Err(ApiError::user(format!("prompt_logprobs_last_n ({n}) needs prompt_logprobs")))
        }
        Some(n) if n < 1 || n as usize >= prompt.len() => {
            return Err(ApiError::user(format!(
                "prompt_logprobs_last_n must be in 1..={} (the prompt length − 1), got {n}",
                prompt.len() - 1
            )))
        }
        Some(n) => Some(n as usize),
    };
    let params = req.sampling_params.to_params()?;
    state.limits.sample(req.num_samples, params.max_tokens, prompt.len(), topk)?;
    let request = crate::rollout::Request {
        num_samples: req.num_samples,
        prompt_logprobs,
        prompt_topk: topk.0,
        sample_topk: topk.1,
        ..crate::rollout::Request::new(prompt, params)
    };
    let key = api_key(&headers);
    let request_id = state.futures.create(None, "sample", key.as_deref())?;
    // `record_stability_info`: the sequences are kept for `stable_reinforce`, owned by this key
    // (and the sampling session's session).
    let record = req.record_stability_info.unwrap_or(false).then(|| {
        let session = req.sampling_session_id.as_deref().filter(|id| !id.starts_with("path:"));
        (key, session.and_then(|id| id.split(':').next()).map(String::from), Arc::new(request.prompt.clone()))
    });
    let handle = sampler.submit(request);
    state.futures.set_canceller(&request_id, handle.canceller());
    let (st, rid) = (state.clone(), request_id.clone());
    tokio::spawn(async move {
        let outcome = match handle.await {
            Ok(out) if out.samples.iter().any(|g| g.stop_reason == crate::rollout::StopReason::Cancelled) => {
                to_outcome(Err(ApiError::user("the sampling request was cancelled (cancel_future)")))
            }
            Ok(out) => {
                if let Some((key, session, prompt)) = record {
                    for (j, g) in out.samples.iter().enumerate() {
                        let id = format!("{rid}:{j}");
                        let (tokens, logprobs) = (g.tokens.clone(), g.logprobs.clone());
                        st.stability.record(key.as_deref(), session.as_deref(), id, prompt.clone(), tokens, logprobs);
                    }
                }
                let (proto, json) = types::sample_to_proto_and_json(&out, topk, last_n);
                StoredOutcome::Proto { proto, json: json.to_string() }
            }
            Err(e) => to_outcome(Err(e.into())),
        };
        st.futures.complete(&rid, outcome);
    });
    let ids: Vec<String> = (0..req.num_samples).map(|j| format!("{request_id}:{j}")).collect();
    Ok(Json(json!({"request_id": request_id, "sample_sequence_ids": ids})))
}

/// `limit` and `offset` from the query string (defaults 20 and 0).
fn page(uri: &axum::http::Uri) -> ApiResult<(usize, usize)> {
    let (mut limit, mut offset) = (20usize, 0usize);
    for pair in uri.query().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let parse =
            |v: &str| v.parse::<usize>().map_err(|_| ApiError::user(format!("query `{k}`: `{v}` is not a count")));
        match k {
            "limit" => limit = parse(v)?,
            "offset" => offset = parse(v)?,
            _ => {}
        }
    }
    Ok((limit, offset))
}

fn cursor(offset: usize, limit: usize, total: usize) -> Value {
    json!({"offset": offset, "limit": limit, "total_count": total})
}

fn checkpoint_json(c: &CheckpointRef, row: &CheckpointRow) -> Value {
    let size: u64 = std::fs::read_dir(&row.path)
        .map(|d| d.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0);
    json!({
        "checkpoint_id": format!("{}/{}", c.kind.as_str(), c.name),
        "checkpoint_type": match c.kind {
            Kind::Weights => "training",
            Kind::SamplerWeights => "sampler",
            Kind::ExternalWeights => "external",
        },
        "time": row.created,
        "tinker_path": c.uri(),
        "size_bytes": size,
        "public": row.public,
        "expires_at": row.expires_at,
    })
}

/// The caller's training runs as the SDK's `TrainingRun`s.
fn visible_runs(state: &AppState, headers: &HeaderMap) -> ApiResult<Vec<Value>> {
    let checkpoints = state.store.checkpoints(None)?;
    let mut runs = vec![];
    for ModelRow { id, session_id, base_model, lora_config: lora, user_metadata, created } in state.store.models()? {
        if check_session(state, headers, &session_id).is_err() {
            continue;
        }
        let lora: Value = serde_json::from_str(&lora).unwrap_or(Value::Null);
        let last = |kind: Kind| {
            checkpoints.iter().rev().find(|(c, _)| c.run_id == id && c.kind == kind).map(|(c, r)| checkpoint_json(c, r))
        };
        runs.push(json!({
            "training_run_id": id,
            "base_model": base_model,
            "model_owner": session_id,
            "is_lora": true,
            "lora_rank": lora["rank"],
            "last_request_time": created,
            "last_checkpoint": last(Kind::Weights),
            "last_sampler_checkpoint": last(Kind::SamplerWeights),
            // The cookbook takes its renderer name back from here when it resumes.
            "user_metadata": serde_json::from_str::<Value>(&user_metadata).ok().filter(Value::is_object),
        }));
    }
    Ok(runs)
}

/// The caller's sessions (RestClient.list_sessions).
async fn sessions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> ApiResult<Json<Value>> {
    let (limit, offset) = page(&uri)?;
    let key = api_key(&headers);
    let ids: Vec<String> = state
        .store
        .sessions()?
        .into_iter()
        .filter(|(_, owner, _)| state.api_keys.is_none() || *owner == key)
        .map(|(id, ..)| id)
        .collect();
    let total = ids.len();
    let page: Vec<String> = ids.into_iter().skip(offset).take(limit).collect();
    Ok(Json(json!({"sessions": page, "cursor": cursor(offset, limit, total)})))
}

/// One of the caller's sessions: its training runs and samplers (RestClient.get_session).
async fn session(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    check_session(&state, &headers, &id)?;
    let metadata = state.store.sessions()?.into_iter().find(|s| s.0 == id).map(|s| s.2).unwrap_or_default();
    let metadata: Value = serde_json::from_str(&metadata).unwrap_or(Value::Null);
    let runs: Vec<String> = state.store.models()?.into_iter().filter(|m| m.session_id == id).map(|m| m.id).collect();
    Ok(Json(json!({
        "training_run_ids": runs,
        "sampler_ids": state.samplers.session_ids(&id),
        "user_metadata": if metadata.is_object() { metadata } else { Value::Null },
    })))
}

async fn training_runs(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> ApiResult<Json<Value>> {
    let (limit, offset) = page(&uri)?;
    let runs = visible_runs(&state, &headers)?;
    let total = runs.len();
    let page: Vec<Value> = runs.into_iter().skip(offset).take(limit).collect();
    Ok(Json(json!({"training_runs": page, "cursor": cursor(offset, limit, total)})))
}

async fn training_run(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(run): Path<String>,
) -> ApiResult<Json<Value>> {
    let runs = visible_runs(&state, &headers)?;
    let found = runs.into_iter().find(|r| r["training_run_id"] == run.as_str());
    Ok(Json(found.ok_or_else(|| ApiError::not_found(format!("no training run `{run}`")))?))
}

/// The caller's checkpoints (of one run if given).
fn visible_checkpoints(state: &AppState, headers: &HeaderMap, run: Option<&str>) -> ApiResult<Vec<Value>> {
    let mut out = vec![];
    for (c, row) in state.store.checkpoints(run)? {
        if check_session(state, headers, &row.session_id).is_ok() {
            out.push(checkpoint_json(&c, &row));
        }
    }
    Ok(out)
}

async fn run_checkpoints(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(run): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(json!({"checkpoints": visible_checkpoints(&state, &headers, Some(&run))?})))
}

async fn all_checkpoints(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> ApiResult<Json<Value>> {
    let (limit, offset) = page(&uri)?;
    let all = visible_checkpoints(&state, &headers, None)?;
    let total = all.len();
    let page: Vec<Value> = all.into_iter().skip(offset).take(limit).collect();
    Ok(Json(json!({"checkpoints": page, "cursor": cursor(offset, limit, total)})))
}

/// The caller's checkpoint named by a listing path.
fn path_checkpoint(
    state: &AppState,
    headers: &HeaderMap,
    (run, segment, name): &(String, String, String),
) -> ApiResult<CheckpointRef> {
    let c = CheckpointRef::new(run, Kind::parse(segment)?, name)?;
    find_checkpoint(state, headers, &c)?;
    Ok(c)
}

/// Makes a checkpoint loadable and samplable with any API key (not deletable).
async fn publish(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(path): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    state.store.set_checkpoint_public(&path_checkpoint(&state, &headers, &path)?, true)?;
    Ok(Json(json!({})))
}

async fn unpublish(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(path): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    state.store.set_checkpoint_public(&path_checkpoint(&state, &headers, &path)?, false)?;
    Ok(Json(json!({})))
}

/// Sets (or, with `ttl_seconds: null`, removes) a checkpoint's expiry, counted from now.
async fn set_ttl(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(path): Path<(String, String, String)>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::SetTtlRequest = types::parse_json(&body, "ttl")?;
    let c = path_checkpoint(&state, &headers, &path)?;
    state.store.set_checkpoint_expiry(&c, types::expiry(req.ttl_seconds)?)?;
    Ok(Json(json!({})))
}

async fn delete_checkpoint(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((run, segment, name)): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    let c = CheckpointRef::new(&run, Kind::parse(&segment)?, &name)?;
    let row = find_checkpoint(&state, &headers, &c)?;
    state.store.delete_checkpoint(&c)?;
    state.samplers.checkpoint_changed(&c.uri(), None)?;
    // The registry entry goes first: a crash in between leaves an orphan directory, never a
    // listed checkpoint without files.
    let dir = c.dir(&state.data_dir);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| ApiError::server(format!("removing {}: {e}", dir.display())))?;
    }
    let _ = row;
    Ok(Json(json!({})))
}
