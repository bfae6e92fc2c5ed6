//! `oxrl serve`: the Tinker HTTP protocol (`docs/specs/tinker-protocol.md`), so that the official
//! `tinker` Python SDK and the tinker-cookbook recipes train on oxrl unchanged.
//!
//! Architecture (the server knows the lower layers only through their APIs):
//! ```text
//!  SDK ──HTTP/1.1 JSON | protobuf──► routes (axum handlers: parse, check key/session)
//!                                      │
//!          ┌───────────────────────────┼──────────────────────────────┐
//!          ▼                           ▼                              ▼
//!   store (SQLite:             models: one LoRA training        futures: request id →
//!   sessions, models,          model per SDK client over a      outcome; retrieve_future
//!   futures, checkpoints)      shared base (Dispatch), a        long-polls, then try_again
//!                              seq_id-ordered queue per model
//! ```
//! A training call (forward_backward, optim_step, …) is queued on its model in seq_id order and,
//! in its turn, submitted to the [`crate::dispatch::Dispatch`] (non-blocking: a
//! [`crate::handle::Handle`]); a tokio task awaits the handle and completes the future.
//! Gradients accumulate in the worker across forward_backward calls until optim_step.
//!
//! Files: [`routes`] (endpoints, one file per resource), [`types`] (JSON request types and their
//! validation), [`wire`] (datum and output conversions), [`proto`] (protobuf messages),
//! [`limits`] (every limit, admission), [`provenance`] and [`stability_records`]
//! (`stable_reinforce`), [`connections`] (which connections are taken, idle timeout), [`http`]
//! (the accept loop, header deadline), [`body_limit`] (413 for a body over the limit), [`fair_share`]
//! (sampling turns between tenants), [`futures`], [`models`], [`samplers`] (sampling sessions), [`store`], [`checkpoints`] (names and
//! paths), [`external_weights`] (exports to download: age encryption, signed URLs), [`errors`].

pub mod body_limit;
pub mod checkpoints;
pub mod connections;
pub mod errors;
pub mod external_weights;
pub mod fair_share;
pub mod futures;
pub mod http;
pub mod limits;
pub mod models;
pub mod proto;
pub mod provenance;
pub mod routes;
pub mod samplers;
pub mod stability_records;
pub mod store;
pub mod types;
pub mod wire;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use models::{Models, ServedModel};
use store::Store;

/// How `oxrl serve` runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Base model directories (Hugging Face layout); clients name them by directory name or path.
    pub models: Vec<PathBuf>,
    pub host: String,
    pub port: u16,
    /// SQLite database and checkpoints.
    pub data_dir: PathBuf,
    /// One API key per line (blank lines and `#` comments ignored); `None`: no authentication.
    pub api_keys: Option<PathBuf>,
    /// Tensor-math threads per training model.
    pub threads: usize,
    /// Largest request body in bytes.
    pub body_limit: usize,
    /// How long `retrieve_future` waits before answering `try_again`.
    pub long_poll: Duration,
    /// A session without a heartbeat for this long is finished: its models and samplers are
    /// freed (the SDK sends one every 10 s). Checked every `session_timeout / 4`.
    pub session_timeout: Duration,
    /// What one request or API key may ask for.
    pub limits: limits::Limits,
    /// On SIGTERM or Ctrl-C: stop accepting, and wait this long at most for the work in flight
    /// to finish and its results to be stored (retrievable after a restart).
    pub drain: Duration,
    /// Scheme and authority of the download URLs (`save_weights_external`), for a server behind
    /// a proxy or NAT; `None`: `http://` + the request's Host header.
    pub public_url: Option<String>,
}

/// What every handler shares.
pub struct AppState {
    pub served: Vec<ServedModel>,
    pub models: Arc<Models>,
    pub samplers: samplers::Samplers,
    pub futures: futures::Futures,
    pub store: Arc<Store>,
    pub api_keys: Option<HashSet<String>>,
    pub body_limit: usize,
    pub data_dir: PathBuf,
    pub session_timeout: Duration,
    pub limits: limits::Limits,
    /// Samples recorded for `stable_reinforce` (`record_stability_info`).
    pub stability: stability_records::StabilityRecords,
    /// Memory available on the machine at start (admission budgets derive from it).
    pub memory_available: Option<usize>,
    pub public_url: Option<String>,
    /// Signs the download URLs of external weights.
    pub url_signer: external_weights::UrlSigner,
}

fn read_api_keys(path: &std::path::Path) -> anyhow::Result<HashSet<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let keys: HashSet<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
    if keys.is_empty() {
        anyhow::bail!("{}: no API keys in the file", path.display());
    }
    Ok(keys)
}

/// Builds the shared state: served models checked, data dir and database opened.
pub fn state(config: &ServerConfig) -> anyhow::Result<Arc<AppState>> {
    if config.models.is_empty() {
        anyhow::bail!("no model to serve: give at least one --model DIR");
    }
    let served = config.models.iter().map(|p| ServedModel::from_dir(p)).collect::<crate::Result<Vec<_>>>()?;
    std::fs::create_dir_all(&config.data_dir).map_err(|e| anyhow::anyhow!("{}: {e}", config.data_dir.display()))?;
    // Saves killed midway left hidden temporary directories: the old checkpoints are intact.
    for path in crate::files::sweep_interrupted_writes(&config.data_dir)? {
        eprintln!("oxrl serve: finished an interrupted save: {}", path.display());
    }
    // Exports a crash interrupted (save_weights_external stages them here): never registered.
    let _ = std::fs::remove_dir_all(config.data_dir.join("staging"));
    let store = Arc::new(Store::open(&config.data_dir.join("server.sqlite")).map_err(|e| anyhow::anyhow!(e.message))?);
    let api_keys = config.api_keys.as_deref().map(read_api_keys).transpose()?;
    if let Some(url) = &config.public_url {
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.contains(['?', '#']) {
            anyhow::bail!("--public-url `{url}`: give a scheme and authority, e.g. https://tinker.example.com");
        }
    }
    Ok(Arc::new(AppState {
        served,
        models: Arc::new(Models::new(config.threads)),
        samplers: samplers::Samplers::new(config.limits.max_samples),
        futures: futures::Futures::new(store.clone(), config.long_poll, config.data_dir.clone()),
        store,
        api_keys,
        body_limit: config.body_limit,
        data_dir: config.data_dir.clone(),
        session_timeout: config.session_timeout,
        limits: config.limits.clone(),
        stability: stability_records::StabilityRecords::new(config.limits.max_recorded_tokens_per_key),
        memory_available: limits::memory_available(),
        public_url: config.public_url.clone(),
        url_signer: external_weights::UrlSigner::open(&config.data_dir)?,
    }))
}

/// Serves until the process is stopped (blocking; runs its own tokio runtime).
pub fn run(config: ServerConfig) -> anyhow::Result<()> {
    let state = state(&config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", config.host, config.port);
        let listener =
            tokio::net::TcpListener::bind(&addr).await.map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
        let local = listener.local_addr()?;
        let names: Vec<&str> = state.served.iter().map(|m| m.name.as_str()).collect();
        eprintln!("oxrl serve: listening on http://{local} (models: {})", names.join(", "));
        spawn_session_reaper(state.clone());
        http::serve_until(listener, state.clone(), stop_signal()).await?;
        drain(&state, config.drain).await;
        Ok(())
    })
}

pub use http::{serve, serve_until};

/// SIGTERM (what service managers and `kill` send) or Ctrl-C.
async fn stop_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// After the listener closed: waits up to `limit` for the pending futures to complete (their
/// outcomes reach the database), then returns; what is still pending then is failed as after a
/// crash when the server next starts.
async fn drain(state: &AppState, limit: Duration) {
    let start = tokio::time::Instant::now();
    let pending = state.futures.pending();
    eprintln!("oxrl serve: stopping; {pending} requests in flight (waiting up to {} s)", limit.as_secs());
    while state.futures.pending() > 0 && start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = state.futures.pending();
    eprintln!("oxrl serve: stopped after {:.1} s, {left} requests unfinished", start.elapsed().as_secs_f64());
}

/// Finishes sessions whose heartbeats stopped (see [`ServerConfig::session_timeout`]), freeing
/// their models and samplers; deletes expired checkpoints and results past their retention. Runs on the current tokio runtime until the process ends.
pub fn spawn_session_reaper(state: Arc<AppState>) {
    tokio::spawn(async move {
        let period = (state.session_timeout / 4).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(period).await;
            let st = state.clone();
            let reaped = tokio::task::spawn_blocking(move || -> Result<usize, errors::ApiError> {
                let stale = st.store.stale_sessions(st.session_timeout.as_secs_f64())?;
                for id in &stale {
                    st.store.finish_session(id)?;
                    st.models.drop_session(id);
                    st.samplers.drop_session(id);
                }
                // Checkpoints past their TTL: the entry first (as a delete does), then the files.
                for (c, dir) in st.store.expired_checkpoints()? {
                    st.store.delete_checkpoint(&c)?;
                    let _ = std::fs::remove_dir_all(dir);
                }
                // Results past their retention.
                st.store.delete_futures_older_than(st.limits.result_retention_s as f64)?;
                st.stability.sweep();
                Ok(stale.len())
            })
            .await;
            if let Ok(Err(e)) = reaped {
                eprintln!("oxrl serve: session reaper: {}", e.message);
            }
        }
    });
}
