//! `oxrl serve`: the Tinker-compatible training server (see `oxrl::server`).

use std::path::PathBuf;
use std::time::Duration;

use crate::server::{run, ServerConfig};

#[derive(clap::Args)]
pub struct Args {
    /// A base model directory to serve (repeat for several).
    #[arg(long = "model", required = true)]
    pub models: Vec<PathBuf>,
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
}

pub fn run_cmd(args: Args, threads: Option<usize>) -> anyhow::Result<()> {
    run(ServerConfig {
        models: args.models,
        host: args.host,
        port: args.port,
        data_dir: args.data_dir,
        api_keys: args.api_keys,
        threads: threads.unwrap_or(1),
        body_limit: args.max_body_mib << 20,
        long_poll: Duration::from_secs(30),
        session_timeout: Duration::from_secs(args.session_timeout_s),
    })
}
