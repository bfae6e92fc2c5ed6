//! Sampling: sessions over a base model, a checkpoint path or a training model's weights;
//! `asample` (with `record_stability_info`).

use super::*;

/// The sampler for a `tinker://` path: the checkpoint's base with its adapter.
pub(super) async fn sampler_for_path(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    id: &str,
    path: &str,
) -> ApiResult<Arc<crate::server::samplers::Sampler>> {
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

pub(super) async fn sampler_for_base(
    state: &Arc<AppState>,
    name: &str,
) -> ApiResult<Arc<crate::server::samplers::Sampler>> {
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

pub(super) async fn create_sampling_session(
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

pub(super) async fn get_sampler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let s = usable_sampler(&state, &headers, &id)?;
    Ok(Json(json!({"sampler_id": s.id, "base_model": s.base.name, "model_path": s.model_path})))
}

/// Top-k log-probs per position at most.
pub(super) const MAX_TOPK: i64 = 1024;

pub(super) async fn asample(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
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
    let key_for_turns = key.clone();
    let request_id = state.futures.create(None, "sample", key.as_deref())?;
    // `record_stability_info`: the sequences are kept for `stable_reinforce`, owned by this key
    // (and the sampling session's session).
    let record = req.record_stability_info.unwrap_or(false).then(|| {
        let session = req.sampling_session_id.as_deref().filter(|id| !id.starts_with("path:"));
        (key, session.and_then(|id| id.split(':').next()).map(String::from), Arc::new(request.prompt.clone()))
    });
    // Its turn on the engine: round-robin across keys, then the caller's sessions (see
    // fair_share). Cancelling while it waits ends it without sampling.
    let tenant =
        (key_for_turns, req.sampling_session_id.as_deref().and_then(|id| id.split(':').next()).map(String::from));
    let waiting = Arc::new(tokio::sync::Notify::new());
    let give_up = waiting.clone();
    state.futures.set_canceller(&request_id, Some(Arc::new(move || give_up.notify_one())));
    let rows = request.num_samples;
    let (st, rid) = (state.clone(), request_id.clone());
    tokio::spawn(async move {
        let ticket = tokio::select! {
            ticket = sampler.share.admit(tenant, rows) => ticket,
            () = waiting.notified() => {
                let cancelled = ApiError::user("the sampling request was cancelled (cancel_future)");
                st.futures.complete(&rid, to_outcome(Err(cancelled)));
                return;
            }
        };
        let handle = sampler.submit(request, ticket.priority);
        st.futures.set_canceller(&rid, handle.canceller());
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
                let (proto, json) = wire::sample_to_proto_and_json(&out, topk, last_n);
                StoredOutcome::Proto { proto, json: json.to_string() }
            }
            Err(e) => to_outcome(Err(e.into())),
        };
        drop(ticket);
        st.futures.complete(&rid, outcome);
    });
    let ids: Vec<String> = (0..req.num_samples).map(|j| format!("{request_id}:{j}")).collect();
    Ok(Json(json!({"request_id": request_id, "sample_sequence_ids": ids})))
}
