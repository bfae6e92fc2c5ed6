//! The `oxrl` command line: one subcommand per file, each a thin layer over the library.

mod bench;
mod config;
mod demo;
mod engine;
mod generate;
mod init_model;
mod plot;
mod rl;
mod run_args;
mod score;
mod serve;
mod sft;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "oxrl", version, about = "LLM post-training: SFT and RL for Llama / Qwen2 / Qwen3 models")]
struct Cli {
    /// Worker threads for tensor math (default: 1 for generation and benchmarks, all cores otherwise).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a randomly initialised model with a byte-level tokenizer, for experiments and tests.
    InitModel(init_model::Args),
    /// Log-probability of every token of each input sequence.
    Score(score::Args),
    /// Sample a continuation of a prompt.
    Generate(generate::Args),
    /// Run configs: `config show` prints the resolved config as TOML.
    Config(config::Args),
    /// Supervised fine-tuning from a TOML config.
    Sft(run_args::RunArgs),
    /// Reinforcement learning (GRPO, PPO, ...) from a TOML config.
    Rl(run_args::RunArgs),
    /// A tiny model learns a task on the CPU: short SFT, then GRPO; a before/after table.
    Demo(demo::Args),
    /// One metric of several runs' metrics.jsonl on one plot (PNG).
    Plot(plot::Args),
    /// The Tinker-compatible training server: the `tinker` SDK trains LoRA adapters over HTTP.
    Serve(serve::Args),
    /// One sampling engine as a server: oxrl's API for remote trainers, and OpenAI's.
    Engine(engine::Args),
    /// Benchmarks: a training step or decoding on the benchmark model (or --model), JSON lines.
    Bench(bench::Args),
}

/// Runs the command line; returns the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    // Decoding one sequence is faster on one thread (BENCHMARKS.md); benchmarks
    // name their thread count, one unless told. The commands that compute on the calling thread
    // run in a pool of that many threads; the others pass `--threads` to the launcher, which
    // gives each worker rank and engine its own pool (none of it goes through the environment).
    let threads = cli.threads.or(match cli.command {
        Command::Generate(_) | Command::Bench(_) => Some(1),
        _ => None,
    });
    let pool_threads = threads.unwrap_or_else(crate::launch::cores);
    // Under mpirun / srun, join the run's processes first (MPI starts on this thread); an engine
    // joins once it knows its URL (`oxrl engine`).
    if !matches!(cli.command, Command::Engine(_)) {
        if let Err(e) = crate::world::world() {
            eprintln!("error: {e:#}");
            return 1;
        }
    }
    let result = match cli.command {
        Command::InitModel(a) => init_model::run(a),
        Command::Score(a) => on_pool(pool_threads, || score::run(a)),
        Command::Generate(a) => on_pool(pool_threads, || generate::run(a)),
        Command::Config(a) => config::run(a),
        Command::Sft(a) => sft::run(a, cli.threads),
        Command::Rl(a) => rl::run(a, cli.threads),
        Command::Demo(a) => demo::run(a, cli.threads),
        Command::Plot(a) => plot::run(a),
        Command::Serve(a) => serve::run_cmd(a, cli.threads),
        Command::Engine(a) => engine::run_cmd(a, cli.threads),
        Command::Bench(a) => on_pool(pool_threads, || bench::run(a)),
    };
    // Trainer 0 lets the job's engine processes go (a no-op without them).
    let result = result.and_then(|()| crate::rollout::weight_broadcast::release_engines().map_err(Into::into));
    match (result, crate::world::joined()) {
        (Ok(()), _) => {
            crate::world::finalize();
            0
        }
        (Err(e), Some(world)) if world.size() > 1 || crate::world::engine_link().is_some() => {
            // The other processes may be waiting for this one: end them all, naming this one.
            eprintln!("error in process {} of {}: {e:#}", world.rank(), world.size());
            world.abort(1);
            1
        }
        (Err(e), _) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

/// Runs `f` inside a rayon pool of `threads` threads, for the commands that compute on
/// the calling thread (trainers and servers run their workers and engines as actors, each inside
/// its own pool already). From a thread outside the pool every parallel op is handed across
/// threads, even at one thread, and at two the pool's threads spin beside the caller: measured
/// with `oxrl bench decode`, 64 requests, 7.2–7.5k → 7.9k tokens/s at one thread and
/// 7.3–8.6k → 9.6–9.9k at two.
fn on_pool(threads: usize, f: impl FnOnce() -> anyhow::Result<()> + Send) -> anyhow::Result<()> {
    rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build()?.install(f)
}

/// Which model a command runs: a HF model directory or Hub repo id, optionally with a LoRA adapter.
#[derive(clap::Args)]
pub(crate) struct ModelArgs {
    /// A model directory in the Hugging Face layout, or a Hub repo id (`Qwen/Qwen3-0.6B`),
    /// downloaded into the Hugging Face cache; an existing directory of that name wins.
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// The Hub revision (branch, tag or commit) of a --model given by repo id; default main.
    #[arg(long, default_value = "")]
    pub revision: String,
    /// A PEFT LoRA adapter directory (or Hub repo id) to apply.
    #[arg(long)]
    pub lora: Option<std::path::PathBuf>,
    /// Run dtype: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Where the model runs: cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

impl ModelArgs {
    /// --model and --lora made local directories: a Hub repo id becomes its snapshot in the
    /// Hugging Face cache, downloaded if need be (see `model::hub`).
    pub fn resolve(&mut self) -> anyhow::Result<()> {
        self.model = crate::model::hub::resolve_model_dir(&self.model, &self.revision)?;
        if let Some(l) = &self.lora {
            self.lora = Some(crate::model::hub::resolve_model_dir(l, "")?);
        }
        Ok(())
    }

    /// The model's weights, with the adapter applied if one was given.
    pub fn load(&self) -> anyhow::Result<crate::model::Transformer> {
        let dtype = crate::model::weights::parse_dtype(&self.dtype)?;
        let device = crate::model::weights::parse_device(&self.device)?;
        let mut model = crate::model::Transformer::load(&self.model, dtype, &device)?;
        if let Some(l) = &self.lora {
            crate::model::lora::load_peft(&mut model, l, false)?;
        }
        Ok(model)
    }
}
