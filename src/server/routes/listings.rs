//! Listings: sessions, training runs and checkpoints the caller may see, paged.

use super::*;

/// `limit` and `offset` from the query string (defaults 20 and 0).
pub(super) fn page(uri: &axum::http::Uri) -> ApiResult<(usize, usize)> {
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

pub(super) fn cursor(offset: usize, limit: usize, total: usize) -> Value {
    json!({"offset": offset, "limit": limit, "total_count": total})
}

pub(super) fn checkpoint_json(c: &CheckpointRef, row: &CheckpointRow) -> Value {
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
pub(super) fn visible_runs(state: &AppState, headers: &HeaderMap) -> ApiResult<Vec<Value>> {
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
pub(super) async fn sessions(
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
pub(super) async fn session(
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

pub(super) async fn training_runs(
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

pub(super) async fn training_run(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(run): Path<String>,
) -> ApiResult<Json<Value>> {
    let runs = visible_runs(&state, &headers)?;
    let found = runs.into_iter().find(|r| r["training_run_id"] == run.as_str());
    Ok(Json(found.ok_or_else(|| ApiError::not_found(format!("no training run `{run}`")))?))
}

/// The caller's checkpoints (of one run if given).
pub(super) fn visible_checkpoints(state: &AppState, headers: &HeaderMap, run: Option<&str>) -> ApiResult<Vec<Value>> {
    let mut out = vec![];
    for (c, row) in state.store.checkpoints(run)? {
        if check_session(state, headers, &row.session_id).is_ok() {
            out.push(checkpoint_json(&c, &row));
        }
    }
    Ok(out)
}

pub(super) async fn run_checkpoints(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(run): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(json!({"checkpoints": visible_checkpoints(&state, &headers, Some(&run))?})))
}

pub(super) async fn all_checkpoints(
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
