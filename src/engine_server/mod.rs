//! `oxrl engine`: one continuous-batching sampling engine as a server of its own, so that
//! trainers on other processes or machines sample on it, and users evaluate a policy with their
//! usual OpenAI clients.
//!
//! ```text
//! client ──HTTP──► auth (Bearer key, if any) ──► oxrl API (MessagePack, rollout::engine_api)
//!                                             └► OpenAI API (JSON or server-sent events:
//!                                                models, completions, chat with tool calls)
//!                                                        │
//!                                             one Engine (its own thread and thread budget)
//! ```
//! The engine is the in-process [`Engine`]: a request is the same request, so for the same
//! seeds and weights a remote engine returns the tokens and log-probs an in-process one does.
//! Weights arrive whole (safetensors) and the engine applies them between two decode steps
//! (`WeightUpdate::apply` checks every tensor first): no request sees half an update, and a
//! refused push leaves the old version serving. LoRA adapters given at start (`--lora
//! NAME=DIR`, PEFT layout) are served beside the model under their names. Files:
//! [`oxrl_routes`]; the OpenAI API: [`openai`] (shared), [`completions`], [`chat`],
//! [`tool_calls`], [`streaming`], [`jobs`].

pub mod chat;
pub mod completions;
pub mod jobs;
pub mod openai;
pub mod oxrl_routes;
pub mod streaming;
pub mod tool_calls;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use candle_core::Device;

use crate::model::row_adapters::Adapter;
use crate::model::tokenizer::Tokenizer;
use crate::model::{weights, SamplerWeights, Transformer};
use crate::rollout::engine::Ticket;
use crate::rollout::engine_api as api;
use crate::rollout::weight_broadcast;
use crate::rollout::{Engine, EngineConfig};
use crate::world;

/// How `oxrl engine` runs.
#[derive(Clone, Debug)]
pub struct EngineServerConfig {
    /// The base model (Hugging Face layout).
    pub model: PathBuf,
    /// `host:port`; port 0 picks a free one (printed at start).
    pub listen: String,
    /// Compute dtype (`f32`, `bf16`): the trainer's `model.dtype`, for its numerics.
    pub dtype: String,
    pub device: String,
    /// Tensor-math threads of the engine.
    pub threads: usize,
    /// Rows decoded together at most.
    pub max_batch: usize,
    /// The rank of the LoRA adapters it takes (0: full weights only).
    pub lora_rank: usize,
    /// One API key per line; `None`: no authentication.
    pub api_keys: Option<PathBuf>,
    /// Largest request body in bytes (a full weight push is one body).
    pub body_limit: usize,
    /// LoRA adapters (PEFT directories) served under their names beside the model.
    pub adapters: Vec<(String, PathBuf)>,
}

/// What every handler shares.
pub struct EngineServer {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    /// The name clients use (the model directory's name, a Hub snapshot's repo id), and the path
    /// it was given as.
    pub name: String,
    pub path: String,
    pub dtype: String,
    pub device: Device,
    pub lora_rank: usize,
    /// The names of the LoRA adapters it serves (a request's `model` names one).
    pub adapters: Vec<String>,
    /// The model's context (max_position_embeddings) and vocabulary size.
    pub context: usize,
    pub vocab_size: usize,
    api_keys: Option<HashSet<String>>,
    /// The engine's ticket of each request in flight, by the caller's ticket.
    pub tickets: Mutex<HashMap<Ticket, Ticket>>,
}

impl EngineServer {
    /// Loads the model and starts the engine.
    pub fn start(config: &EngineServerConfig) -> anyhow::Result<Arc<EngineServer>> {
        let dtype = weights::parse_dtype(&config.dtype)?;
        let device = weights::parse_device(&config.device)?;
        let tokenizer = Arc::new(Tokenizer::from_dir(&config.model)?);
        let model = Transformer::load(&config.model, dtype, &device)?;
        let mut adapters = vec![];
        for (name, dir) in &config.adapters {
            anyhow::ensure!(!adapters.iter().any(|(n, _)| n == name), "two LoRA adapters are named `{name}`");
            let adapter = Adapter::load_peft(&model, dir).map_err(|e| anyhow::anyhow!("LoRA adapter `{name}`: {e}"))?;
            adapters.push((name.clone(), Arc::new(adapter)));
        }
        let (context, vocab_size) = (model.config.max_position_embeddings, model.config.vocab_size);
        let mut eos_token_ids = tokenizer.eos_token_ids().to_vec();
        if eos_token_ids.is_empty() {
            eos_token_ids = model.config.eos_token_ids.clone();
        }
        let engine = Engine::start(
            model,
            EngineConfig {
                max_batch: config.max_batch.max(1),
                kv_cache_tokens: None,
                eos_token_ids,
                tokenizer: Some(tokenizer.clone()),
                threads: config.threads.max(1),
            },
        )?;
        for (name, adapter) in &adapters {
            engine.add_adapter(name, adapter.clone()).wait()?;
        }
        // A Hub snapshot is served under its repo id, as clients name the model.
        let name = crate::model::hub::served_name(&config.model).unwrap_or_else(|| "model".into());
        let api_keys = config.api_keys.as_deref().map(read_api_keys).transpose()?;
        Ok(Arc::new(EngineServer {
            engine,
            tokenizer,
            name,
            path: config.model.display().to_string(),
            dtype: config.dtype.clone(),
            device,
            lora_rank: config.lora_rank,
            adapters: adapters.into_iter().map(|(n, _)| n).collect(),
            context,
            vocab_size,
            api_keys,
            tickets: Mutex::new(HashMap::new()),
        }))
    }

    /// A weight push's body (safetensors, [`SamplerWeights::to_safetensors`]), checked against
    /// what this engine takes.
    pub fn decode_weights(&self, body: &[u8]) -> crate::Result<SamplerWeights> {
        let weights = SamplerWeights::from_safetensors(body, &self.device)?;
        if let crate::model::weight_update::WeightUpdate::Lora { config, .. } = weights.update() {
            if config.rank != self.lora_rank {
                return Err(crate::Error::input(format!(
                    "LoRA adapters of rank {} for an engine started with --lora-rank {}",
                    config.rank, self.lora_rank
                )));
            }
        }
        Ok(weights)
    }

    /// Whether a request names this engine's model (by name or by the path it was started with).
    pub fn serves(&self, model: &str) -> bool {
        model == self.name || model == self.path
    }
}

fn read_api_keys(path: &std::path::Path) -> anyhow::Result<HashSet<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let keys: HashSet<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
    anyhow::ensure!(!keys.is_empty(), "{}: no API keys in the file", path.display());
    Ok(keys)
}

/// Every route: the oxrl API, the OpenAI API and the health check.
pub fn router(state: Arc<EngineServer>, body_limit: usize) -> Router {
    Router::new()
        .route(api::HEALTH, get(oxrl_routes::health))
        .route(api::GENERATE, post(oxrl_routes::generate))
        .route(api::CANCEL, post(oxrl_routes::cancel))
        .route(api::PAUSE, post(oxrl_routes::pause))
        .route(api::RESUME, post(oxrl_routes::resume))
        .route(api::WEIGHTS, post(oxrl_routes::weights))
        .route("/v1/models", get(openai::models))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .fallback(|| async { (StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// With API keys, every route but the health check needs `Authorization: Bearer KEY`.
async fn check_api_key(State(state): State<Arc<EngineServer>>, req: Request, next: Next) -> Response {
    if let Some(keys) = &state.api_keys {
        if req.uri().path() != api::HEALTH {
            let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok());
            let key = auth.and_then(|a| a.strip_prefix("Bearer "));
            if !key.is_some_and(|k| keys.contains(k.trim())) {
                return (StatusCode::UNAUTHORIZED, "missing or unknown API key (header Authorization: Bearer KEY)")
                    .into_response();
            }
        }
    }
    next.run(req).await
}

/// Serves until the process is stopped (blocking; runs its own tokio runtime). Started by an
/// MPI launcher beside a trainer, the engine joins the trainer's job: it takes weights from
/// trainer 0's broadcasts ([`weight_broadcast`]) as well as over HTTP, and stops when the
/// trainer ends the job.
pub fn run(config: EngineServerConfig) -> anyhow::Result<()> {
    let state = EngineServer::start(&config)?;
    let listener =
        std::net::TcpListener::bind(&config.listen).map_err(|e| anyhow::anyhow!("binding {}: {e}", config.listen))?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let url = public_url(local);
    eprintln!("oxrl engine: listening on {url} (model {}, {})", state.name, state.dtype);
    let (end_of_job, ended) = tokio::sync::oneshot::channel::<()>();
    let receiver = if world::launched_by_mpi() {
        let link = world::join_as_engine(&url)?;
        let server = state.clone();
        Some(std::thread::spawn(move || {
            let served = weight_broadcast::serve_weights(link, |body| {
                let weights = server.decode_weights(body).map_err(|e| e.to_string())?;
                server.engine.update_weights(&weights).wait().map_err(|e| e.to_string())
            });
            let _ = end_of_job.send(());
            served
        }))
    } else {
        std::mem::forget(end_of_job); // serve until stopped
        None
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let shutdown = async move {
            let _ = ended.await;
        };
        axum::serve(listener, router(state, config.body_limit)).with_graceful_shutdown(shutdown).await?;
        anyhow::Ok(())
    })?;
    if let Some(receiver) = receiver {
        receiver.join().map_err(|_| anyhow::anyhow!("the weight receiver panicked"))??;
    }
    Ok(())
}

/// The URL trainers reach `local` at: the machine's name when it listens on every interface.
fn public_url(local: std::net::SocketAddr) -> String {
    if !local.ip().is_unspecified() {
        return format!("http://{local}");
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string());
    format!("http://{}:{}", host.ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "localhost".into()), local.port())
}
