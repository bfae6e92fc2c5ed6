//! `oxrl engine`: one sampling engine as a server of its own (see `oxrl::engine_server`).

use std::path::PathBuf;

use crate::engine_server::{run, EngineServerConfig};

#[derive(clap::Args)]
pub struct Args {
    /// The base model directory (Hugging Face layout), or a Hub repo id (`Qwen/Qwen3-0.6B`),
    /// downloaded into the Hugging Face cache and served under that name.
    #[arg(long)]
    pub model: PathBuf,
    /// The Hub revision (branch, tag or commit) of a --model given by repo id; default main.
    #[arg(long, default_value = "")]
    pub revision: String,
    /// Where to listen, `host:port` (port 0: a free one, printed at start).
    #[arg(long, default_value = "127.0.0.1:8100")]
    pub listen: String,
    /// The rank of the LoRA adapters trainers push (0: full weights only).
    #[arg(long, default_value_t = 0)]
    pub lora_rank: usize,
    /// Compute dtype: f32 or bf16 (the trainer's `model.dtype`).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Rows decoded together at most.
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// A file of API keys, one per line: requests and weight pushes need `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_keys: Option<PathBuf>,
    /// Largest request body, in MiB (a full weight push is one body).
    #[arg(long, default_value_t = 8192)]
    pub max_body_mib: usize,
    /// A LoRA adapter to serve beside the model, `NAME=DIR` (PEFT layout; DIR may be a Hub repo
    /// id); requests whose `model` is NAME sample with it. Repeatable.
    #[arg(long = "lora", value_parser = parse_adapter)]
    pub adapters: Vec<(String, PathBuf)>,
}

fn parse_adapter(arg: &str) -> Result<(String, PathBuf), String> {
    match arg.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => Ok((name.to_string(), PathBuf::from(dir))),
        _ => Err(format!("expected NAME=DIR, got `{arg}`")),
    }
}

pub fn run_cmd(a: Args, threads: Option<usize>) -> anyhow::Result<()> {
    let resolve = crate::model::hub::resolve_model_dir;
    let adapters =
        a.adapters.into_iter().map(|(name, dir)| Ok((name, resolve(&dir, "")?))).collect::<crate::Result<_>>()?;
    run(EngineServerConfig {
        model: resolve(&a.model, &a.revision)?,
        listen: a.listen,
        dtype: a.dtype,
        device: a.device,
        threads: threads.unwrap_or(1),
        max_batch: a.max_batch,
        lora_rank: a.lora_rank,
        api_keys: a.api_keys,
        body_limit: a.max_body_mib << 20,
        adapters,
    })
}
