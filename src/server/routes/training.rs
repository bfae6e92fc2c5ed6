//! Training models: create, info, forward / forward_backward (limits, admission and
//! `stable_reinforce`'s provenance checked; refusals fail in the request's turn), optim_step,
//! loading a checkpoint's weights.

use super::*;

pub(super) async fn create_model(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
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
    let build =
        state.models.register(&model_id, &req.session_id, (base.clone(), &req.base_model), lora.clone(), None)?;
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

pub(super) async fn get_info(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::ModelRequest = types::parse_json(&body, "get_info")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    Ok(Json(json!({
        "type": "get_info",
        "model_id": model.id,
        "model_data": {"arch": model.base.arch, "model_name": model.named, "tokenizer_id": model.named},
        "is_lora": true,
        "lora_rank": model.lora.rank,
        "model_name": model.named,
    })))
}

pub(super) async fn forward_backward(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    run_fwdbwd(state, headers, body, false).await
}

pub(super) async fn forward(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    run_fwdbwd(state, headers, body, true).await
}

pub(super) async fn run_fwdbwd(
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
    let checked = state.limits.train_tokens(tokens).and_then(|()| model.admit(tokens, budget)).and_then(|admitted| {
        if req.loss_fn == "stable_reinforce" {
            // Its `q` and weights come from what this server recorded when it sampled.
            let session = model.id.split(':').next().unwrap_or_default();
            let key = api_key(&headers);
            crate::server::provenance::resolve(
                &state.stability,
                key.as_deref(),
                session,
                &mut req.data,
                &req.provenance,
            )?;
        }
        Ok(admitted)
    });
    let forward_only = req.forward_only || forward_path;
    let kind = if forward_only { "forward" } else { "forward_backward" };
    let (st, key) = (state.clone(), api_key(&headers));
    let model_id = model.id.clone();
    let request_id = state.models.submit(&model, req.seq_id, move || {
        let request_id = st.futures.create(Some(&model_id), kind, key.as_deref())?;
        let rid = request_id.clone();
        let job: Job = Box::new(move |dispatch| {
            let admitted = match checked {
                Ok(admitted) => admitted,
                Err(e) => return st.futures.complete(&rid, to_outcome(Err(e))),
            };
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
                        proto: wire::output_to_proto(&out),
                        json: wire::output_to_json(&out).to_string(),
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

pub(super) async fn optim_step(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
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

pub(super) async fn load_weights(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
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
            // A mismatch is the caller's to fix: refused in the request's turn with both settings
            // named, never left to the worker (whose error would read as the server's).
            let checked = serde_json::from_str::<types::LoraConfigWire>(&row.lora_config)
                .map_err(|e| ApiError::server(format!("checkpoint `{uri}`: bad LoRA record: {e}")))
                .and_then(|saved| crate::server::models::check_loadable(&uri, &saved, &id, &model.lora));
            queue(&state, &model, seq_id, "load_weights", checked, move |(), st, dispatch, rid| {
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
            let after: crate::server::models::AfterBuild = Box::new(move |d, id| load(d, id).wait());
            let build =
                state.models.register(&model_id, session_id, (base.clone(), &base_name), lora.clone(), Some(after))?;
            let metadata = req.user_metadata.as_ref().map(|m| m.to_string()).unwrap_or_default();
            state.limits.metadata(&metadata)?;
            state.limits.models_per_key(callers(&state, &headers, state.models.sessions()))?;
            state.store.add_model(&model_id, session_id, &base_name, &row.lora_config, &metadata)?;
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

pub(super) async fn weights_info(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::WeightsInfoRequest = types::parse_json(&body, "weights_info")?;
    let c = CheckpointRef::parse(&req.tinker_path)?;
    let row = readable_checkpoint(&state, &headers, &c)?;
    let lora: Value = serde_json::from_str(&row.lora_config).unwrap_or(Value::Null);
    Ok(Json(json!({"base_model": row.base_model, "is_lora": true, "lora_rank": lora["rank"]})))
}
