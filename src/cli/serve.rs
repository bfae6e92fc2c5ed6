//! `oxrl serve`: the Tinker-compatible training server (see `oxrl::server`).

use std::path::PathBuf;
use std::time::Duration;

use crate::server::limits::Limits;
use crate::server::{run, ServerConfig};

#[derive(clap::Args)]
pub struct Args {
    /// A base model directory to serve, or a Hub repo id (`Qwen/Qwen3-0.6B`) downloaded into the
    /// Hugging Face cache and served under that name (repeat for several).
    #[arg(long = "model", required = true)]
    pub models: Vec<PathBuf>,
    /// The Hub revision (branch, tag or commit) of each --model given by repo id; default main.
    #[arg(long, default_value = "")]
    pub revision: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Where the server keeps its database and checkpoints.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// A file of API keys, one per line; without it, no authentication.
    #[arg(long)]
    pub api_keys: Option<PathBuf>,
    /// A session without a heartbeat for this many seconds is finished and its models freed.
    #[arg(long, default_value_t = 600)]
    pub session_timeout_s: u64,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 256)]
    pub max_body_mib: usize,
    /// Largest LoRA rank of a training model.
    #[arg(long, default_value_t = Limits::default().max_lora_rank)]
    pub max_lora_rank: usize,
    /// Tokens (all datums together) in one forward or forward_backward.
    #[arg(long, default_value_t = Limits::default().max_train_tokens)]
    pub max_train_tokens: usize,
    /// Samples in one sampling request.
    #[arg(long, default_value_t = Limits::default().max_samples)]
    pub max_samples: usize,
    /// Values one sampling result may hold (samples × max_tokens × (1 + top-k) + prompt × (1 + top-k)).
    #[arg(long, default_value_t = Limits::default().max_sample_values)]
    pub max_sample_values: usize,
    /// Bytes of a session's or model's user_metadata.
    #[arg(long, default_value_t = Limits::default().max_metadata_bytes)]
    pub max_metadata_bytes: usize,
    /// Training models alive per API key.
    #[arg(long, default_value_t = Limits::default().max_models_per_key)]
    pub max_models_per_key: usize,
    /// Sampling sessions alive per API key.
    #[arg(long, default_value_t = Limits::default().max_samplers_per_key)]
    pub max_samplers_per_key: usize,
    /// Connections open at once; past it, connections answer health and readiness checks only.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    pub max_connections: usize,
    /// Connections open at once from one address; more are answered 429 and closed.
    #[arg(long, default_value_t = Limits::default().max_connections_per_peer)]
    pub max_connections_per_peer: usize,
    /// Seconds a client has to send a request's headers (and an idle keep-alive connection stays open).
    #[arg(long, default_value_t = Limits::default().header_timeout_s)]
    pub header_timeout_s: u64,
    /// Seconds a connection may send nothing while the server waits to read from it.
    #[arg(long, default_value_t = Limits::default().idle_timeout_s)]
    pub idle_timeout_s: u64,
    /// Seconds a finished request's result is kept for retrieval.
    #[arg(long, default_value_t = Limits::default().result_retention_s)]
    pub result_retention_s: u64,
    /// Tokens of the samples recorded for `stable_reinforce` kept per API key (oldest forgotten first).
    #[arg(long, default_value_t = Limits::default().max_recorded_tokens_per_key)]
    pub max_recorded_tokens_per_key: usize,
    /// Tokens of training requests in flight per model (0: half the machine's available memory
    /// over the base model's bytes per token).
    #[arg(long, default_value_t = Limits::default().max_tokens_in_flight)]
    pub max_tokens_in_flight: usize,
    /// On SIGTERM or Ctrl-C, seconds to wait for the requests in flight to finish.
    #[arg(long, default_value_t = 30)]
    pub drain_s: u64,
    /// Scheme and authority of the external-weights download URLs (e.g.
    /// `https://tinker.example.com`), for a server behind a proxy; default: `http://` + the
    /// Host the client used.
    #[arg(long)]
    pub public_url: Option<String>,
}

pub fn run_cmd(args: Args, threads: Option<usize>) -> anyhow::Result<()> {
    let models = args
        .models
        .iter()
        .map(|m| crate::model::hub::resolve_model_dir(m, &args.revision))
        .collect::<crate::Result<_>>()?;
    run(ServerConfig {
        models,
        host: args.host,
        port: args.port,
        data_dir: args.data_dir,
        api_keys: args.api_keys,
        threads: threads.unwrap_or(1),
        body_limit: args.max_body_mib << 20,
        long_poll: Duration::from_secs(30),
        session_timeout: Duration::from_secs(args.session_timeout_s),
        drain: Duration::from_secs(args.drain_s),
        public_url: args.public_url,
        limits: Limits {
            max_lora_rank: args.max_lora_rank,
            max_train_tokens: args.max_train_tokens,
            max_samples: args.max_samples,
            max_sample_values: args.max_sample_values,
            max_metadata_bytes: args.max_metadata_bytes,
            max_models_per_key: args.max_models_per_key,
            max_samplers_per_key: args.max_samplers_per_key,
            max_connections: args.max_connections,
            max_connections_per_peer: args.max_connections_per_peer,
            header_timeout_s: args.header_timeout_s,
            idle_timeout_s: args.idle_timeout_s,
            result_retention_s: args.result_retention_s,
            max_recorded_tokens_per_key: args.max_recorded_tokens_per_key,
            max_tokens_in_flight: args.max_tokens_in_flight,
        },
    })
}
