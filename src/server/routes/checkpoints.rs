//! The checkpoint lifecycle: save (training state, sampler weights, external exports with
//! signed download URLs), publish, TTL, delete.

use super::*;

pub(super) async fn save_weights(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::SaveWeightsRequest = types::parse_json(&body, "save_weights")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    let name = req.path.clone().unwrap_or_else(|| format!("seq-{}", req.seq_id));
    let (session_id, base, lora) = (model.session_id.clone(), model.named.clone(), model.lora.clone());
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
pub(super) async fn save_weights_external(
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
    let (session_id, base, lora) = (model.session_id.clone(), model.named.clone(), model.lora.clone());
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
pub(super) async fn external_weights_urls(
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
pub(super) async fn external_weights_file(
    State(state): State<Arc<AppState>>,
    Path((run, name, file)): Path<(String, String, String)>,
    uri: axum::http::Uri,
) -> ApiResult<Response> {
    let forbidden = |why: &str| ApiError {
        status: axum::http::StatusCode::FORBIDDEN,
        category: crate::server::errors::Category::User,
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
    crate::server::checkpoints::check_segment("file name", &file)?;
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

pub(super) async fn save_weights_for_sampler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::SaveWeightsForSamplerRequest = types::parse_json(&body, "save_weights_for_sampler")?;
    let model = training_model(&state, &headers, &req.model_id)?;
    let (session_id, base, lora) = (model.session_id.clone(), model.base.clone(), model.lora.clone());
    // Checkpoints record the base as the client named it: a load reports it back the same way.
    let base_named = model.named.clone();
    let model_id = model.id.clone();
    let checked = types::expiry(req.ttl_seconds);
    let owner = api_key(&headers);
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
                        base_model: base_named,
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
                tokio::task::spawn_blocking(move || st2.samplers.create_ephemeral(owner.as_deref(), &sid, &base, &dir))
                    .await
                    .map_err(|e| ApiError::server(format!("starting the sampler failed: {e}")))??;
                Ok(json!({"sampling_session_id": id, "type": "save_weights_for_sampler"}))
            }
            .await;
            st.futures.complete_json(&rid, result);
        });
    })
}

/// The caller's checkpoint named by a listing path.
pub(super) fn path_checkpoint(
    state: &AppState,
    headers: &HeaderMap,
    (run, segment, name): &(String, String, String),
) -> ApiResult<CheckpointRef> {
    let c = CheckpointRef::new(run, Kind::parse(segment)?, name)?;
    find_checkpoint(state, headers, &c)?;
    Ok(c)
}

/// Makes a checkpoint loadable and samplable with any API key (not deletable).
pub(super) async fn publish(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(path): Path<(String, String, String)>,
    _body: Bytes,
) -> ApiResult<Json<Value>> {
    state.store.set_checkpoint_public(&path_checkpoint(&state, &headers, &path)?, true)?;
    Ok(Json(json!({})))
}

pub(super) async fn unpublish(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(path): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    state.store.set_checkpoint_public(&path_checkpoint(&state, &headers, &path)?, false)?;
    Ok(Json(json!({})))
}

/// Sets (or, with `ttl_seconds: null`, removes) a checkpoint's expiry, counted from now.
pub(super) async fn set_ttl(
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

pub(super) async fn delete_checkpoint(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((run, segment, name)): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    let c = CheckpointRef::new(&run, Kind::parse(&segment)?, &name)?;
    // Only the owner's session deletes; anyone else's request is told it does not exist.
    find_checkpoint(&state, &headers, &c)?;
    state.store.delete_checkpoint(&c)?;
    state.samplers.checkpoint_changed(&c.uri(), None)?;
    // The registry entry goes first: a crash in between leaves an orphan directory, never a
    // listed checkpoint without files.
    let dir = c.dir(&state.data_dir);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| ApiError::server(format!("removing {}: {e}", dir.display())))?;
    }
    Ok(Json(json!({})))
}
