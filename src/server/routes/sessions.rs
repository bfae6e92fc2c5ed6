//! Sessions: create, heartbeat, finish (its models and samplers freed).

use super::*;

pub(super) async fn create_session(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::CreateSessionRequest = types::parse_json(&body, "create_session")?;
    let id = new_id();
    let tags = serde_json::to_string(&req.tags).unwrap_or_default();
    let meta = req.user_metadata.map(|m| m.to_string()).unwrap_or_default();
    state.limits.metadata(&meta)?;
    state.store.add_session(&id, api_key(&headers).as_deref(), &tags, &meta, req.sdk_version.as_deref())?;
    Ok(Json(json!({"type": "create_session", "session_id": id})))
}

pub(super) async fn session_heartbeat(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::SessionRequest = types::parse_json(&body, "session_heartbeat")?;
    check_session(&state, &headers, &req.session_id)?;
    state.store.heartbeat(&req.session_id)?;
    Ok(Json(json!({"type": "session_heartbeat"})))
}

pub(super) async fn finish_session(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    _body: Bytes,
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
