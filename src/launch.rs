//! Launching: the one place that turns a run config into workers and engines.
//!
//! Devices, data-parallel meshes and thread budgets are chosen here and nowhere else, so
//! trainers receive a built [`Dispatch`] (and [`EngineClient`]) and never name them. Thread
//! budgets are explicit: every worker rank and every engine is an [`Actor`](crate::actor::Actor)
//! that runs inside its own rayon pool of the number of threads given here, and oxrl's tensor
//! math takes its thread count from the pool it runs in, never from the environment. So a
//! library caller (`launch::rl_runtime(&cfg, threads)` then `trainer::rl::run_rl`) and
//! `oxrl rl --config` (which makes the same two calls) run with the same threads and compute
//! the same result.
//!
//! The `oxrl` subcommands call these functions; tests, benchmarks and examples call them too.

use std::sync::Arc;

use candle_core::Device;

use crate::dispatch::mesh::MeshShape;
use crate::dispatch::{Dispatch, WorkerSpec};
use crate::model::lora::LoraConfig;
use crate::model::tokenizer::Tokenizer;
use crate::model::{weights, Transformer};
use crate::rollout::sampler::is_greedy;
use crate::rollout::{Engine, EngineClient, EngineConfig, RemoteEngine, SamplingEngine};
use crate::trainer::model_ids::{CRITIC, POLICY, REFERENCE};
use crate::trainer::sections::ModelSection;
use crate::trainer::{RlConfig, SftConfig};
use crate::worker::{Sharding, WorkerConfig};
use crate::world::{self, world, World};
use crate::{Error, Result};

/// Cores available to this process.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The client over the engines of their own at `urls` (`launch.remote_engines`, or the engine
/// processes of the MPI job), each checked to serve the run's model in its dtype, and shared by
/// the run's processes (process 0 updates them: over the job's engine link for its own engines).
/// The caller gives them the policy's initial weights, so that a run never depends on how an
/// engine was started, only on what it serves.
fn remote_engines(cfg: &RlConfig, urls: &[String], link: Option<&'static dyn World>) -> Result<EngineClient> {
    let key = std::env::var("OXRL_ENGINE_API_KEY").ok();
    // The name the engine gives the model: a Hub snapshot's repo id, else its directory's name.
    let expected_name = crate::model::hub::served_name(&cfg.model.path);
    let mut engines: Vec<Box<dyn SamplingEngine>> = vec![];
    for url in urls {
        let timeout = std::time::Duration::from_secs_f64(cfg.launch.remote_timeout_s);
        let (engine, info) = RemoteEngine::connect_with(url, key.clone(), timeout)?;
        if expected_name.as_deref() != Some(info.model.as_str()) || info.dtype != cfg.model.dtype {
            return Err(Error::input(format!(
                "the engine at {url} serves `{}` in {}, this run trains `{}` in {}",
                info.model,
                info.dtype,
                expected_name.unwrap_or_default(),
                cfg.model.dtype
            )));
        }
        if cfg.model.lora.rank > 0 && info.lora_rank != cfg.model.lora.rank {
            return Err(Error::input(format!(
                "the engine at {url} takes LoRA adapters of rank {} (--lora-rank), this run trains rank {}",
                info.lora_rank, cfg.model.lora.rank
            )));
        }
        engines.push(Box::new(engine));
    }
    Ok(EngineClient::over(engines)?.shared_by(world()?, link.map(|l| (l, urls.to_vec()))))
}

/// The variables in which launchers give a process its place among those of its node.
const LOCAL_RANK_VARS: [&str; 4] = ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"];

/// This process's place among the processes of its node, as the launcher's environment
/// (`var`) gives it: `LOCAL_RANK`, then OpenMPI's, MPICH's and Slurm's variables.
pub fn node_local_rank(var: impl Fn(&str) -> Option<String>) -> Option<usize> {
    LOCAL_RANK_VARS.iter().find_map(|v| var(v)?.trim().parse().ok())
}

/// The device of this process's ranks and engines: `cuda` without an index in a run of several
/// processes is the GPU of the process's local rank on its node, so `mpirun -np 8` on a node of
/// 8 GPUs puts one process on each (`cuda:N` is taken as given).
pub fn process_device(name: &str) -> Result<Device> {
    if name == "cuda" && world()?.size() > 1 {
        let local = node_local_rank(|v| std::env::var(v).ok()).ok_or_else(|| {
            Error::input(format!(
                "model.device = \"cuda\" under a launcher: none of {} says which GPU is this process's; \
                 set LOCAL_RANK or name the device (cuda:N)",
                LOCAL_RANK_VARS.join(", ")
            ))
        })?;
        return weights::parse_device(&format!("cuda:{local}"));
    }
    weights::parse_device(name)
}

/// The policy of an SFT run: `train.data_parallel` ranks on `model.device` in each process of
/// the run (so `mpirun -np N` trains with N × that many ranks, every process holding its
/// share), each with `threads_per_rank` tensor-math threads (default: the cores shared evenly
/// among this process's ranks).
pub fn sft_dispatch(cfg: &SftConfig, threads_per_rank: Option<usize>) -> Result<Dispatch> {
    let dp = cfg.train.data_parallel.max(1);
    let processes = world()?.size();
    let lora = lora_config(&cfg.model);
    let spec = WorkerSpec {
        dtype: weights::parse_dtype(&cfg.model.dtype)?,
        device: process_device(&cfg.model.device)?,
        mesh: MeshShape::dp(dp * processes),
        threads: threads_per_rank.unwrap_or((cores() / dp).max(1)),
        worker: WorkerConfig {
            lora,
            seed: cfg.train.seed,
            critic: false,
            micro_batch_size: Some(cfg.train.micro_batch_size),
            max_tokens_per_microbatch: (cfg.train.max_tokens_per_microbatch > 0)
                .then_some(cfg.train.max_tokens_per_microbatch),
            master_weights: cfg.model.master_weights,
            activation_checkpointing: cfg.train.activation_checkpointing,
            sharding: cfg.train.sharding,
            gradient_sum: cfg.train.gradient_sum,
            router_aux_loss_coef: cfg.train.router_aux_loss_coef,
            temperature: 1.0,
        },
        ..WorkerSpec::new(&cfg.model.path)
    };
    let dispatch = Dispatch::new(false);
    dispatch.create_model(POLICY, &spec)?;
    Ok(dispatch)
}

/// The `[model.lora]` adapter, `None` for rank 0 (full fine-tuning).
fn lora_config(model: &ModelSection) -> Option<LoraConfig> {
    (model.lora.rank > 0).then(|| {
        let targets: Vec<&str> = model.lora.targets.iter().map(String::as_str).collect();
        LoraConfig::new(model.lora.rank, model.lora.alpha, &targets)
    })
}

/// The workers and engines of an RL run.
///
/// Dispatch models: [`POLICY`] (LoRA or full per `[model]`), [`REFERENCE`] when the run has a KL
/// penalty (full weights of the same model; only forward runs on it, so it never changes), and
/// [`CRITIC`] (a value head) when the advantage is GAE; each with `launch.data_parallel` ranks of
/// `threads` tensor-math threads (default `launch.trainer_threads`, 0 = the cores shared among the
/// ranks) and `launch.micro_batch_size` / `max_tokens_per_microbatch`. Engines: `launch.engines`
/// engines on the base model, `launch.engine_threads` threads each, stopping at the tokenizer's
/// EOS ids, batching up to `prompts_per_step × n_samples` rows (at least 64) — or, with
/// `launch.remote_engines`, the `oxrl engine` servers at those URLs. Under `mpirun -np N` each
/// process holds `launch.data_parallel` of the N × that many ranks and its own engines
/// (colocated), which sample its share of every step's groups — unless the job has engine
/// processes of its own (`mpirun -np N oxrl rl … : -np E oxrl engine …`), which all trainers
/// then share and process 0 updates over MPI. Remote or job engines are shared the same way.
pub fn rl_runtime(cfg: &RlConfig, threads: Option<usize>) -> Result<(Dispatch, EngineClient)> {
    let l = &cfg.launch;
    let dp = l.data_parallel.max(1);
    let processes = world()?.size();
    let dtype = weights::parse_dtype(&cfg.model.dtype)?;
    let device = process_device(&cfg.model.device)?;
    let threads = match threads.unwrap_or(l.trainer_threads) {
        0 => (cores() / dp).max(1),
        n => n,
    };
    let worker = WorkerConfig {
        lora: None,
        seed: cfg.train.seed,
        critic: false,
        micro_batch_size: (l.micro_batch_size > 0).then_some(l.micro_batch_size),
        max_tokens_per_microbatch: (l.max_tokens_per_microbatch > 0).then_some(l.max_tokens_per_microbatch),
        master_weights: cfg.model.master_weights,
        activation_checkpointing: l.activation_checkpointing,
        // The frozen reference has no optimizer state to split; under `full` its weights are
        // sliced like the trained models'.
        sharding: match l.sharding {
            Sharding::Full => Sharding::Full,
            _ => Sharding::None,
        },
        gradient_sum: l.gradient_sum,
        router_aux_loss_coef: 0.0,
        // The policy's and the reference's log-probs are those of the distribution the
        // rollouts are drawn from (the model's own for greedy ones).
        temperature: match is_greedy(cfg.rollout.temperature) {
            true => 1.0,
            false => cfg.rollout.temperature,
        },
    };
    let base = WorkerSpec {
        dtype,
        device: device.clone(),
        mesh: MeshShape::dp(dp * processes),
        threads,
        worker,
        ..WorkerSpec::new(&cfg.model.path)
    };
    let dispatch = Dispatch::new(false);
    let trained = WorkerConfig { sharding: l.sharding, ..base.worker.clone() };
    let policy = WorkerConfig {
        lora: lora_config(&cfg.model),
        router_aux_loss_coef: cfg.train.router_aux_loss_coef,
        ..trained.clone()
    };
    dispatch.create_model(POLICY, &WorkerSpec { worker: policy, ..base.clone() })?;
    if cfg.needs_reference() {
        dispatch.create_model(REFERENCE, &base)?;
    }
    if cfg.needs_critic() {
        let critic = WorkerConfig { critic: true, ..trained };
        dispatch.create_model(CRITIC, &WorkerSpec { worker: critic, ..base.clone() })?;
    }

    // The envs work in text: the tokenizer is required (for stop strings, and its EOS ids).
    let tokenizer = Tokenizer::from_dir(&cfg.model.path)
        .map_err(|e| Error::input(format!("model.path: an RL run needs the model's tokenizer: {e}")))?;
    let mut eos_token_ids = tokenizer.eos_token_ids().to_vec();
    let tokenizer = Arc::new(tokenizer);
    let job = world::job_engines();
    if !job.is_empty() && !l.remote_engines.is_empty() {
        return Err(Error::input(
            "launch.remote_engines is set and the MPI job has engine processes of its own: use one or the other",
        ));
    }
    if !l.remote_engines.is_empty() || !job.is_empty() {
        let engines = if job.is_empty() {
            remote_engines(cfg, &l.remote_engines, None)?
        } else {
            remote_engines(cfg, job, world::engine_link())?
        };
        engines.update_weights(&dispatch.sampler_weights(POLICY)?).wait()?;
        return Ok((dispatch, engines));
    }
    let max_batch = (cfg.train.prompts_per_step * cfg.rollout.n_samples).max(64);
    let mut engines = Vec::with_capacity(l.engines.max(1));
    for _ in 0..l.engines.max(1) {
        let model = Transformer::load(&cfg.model.path, dtype, &device)?;
        if eos_token_ids.is_empty() {
            eos_token_ids = model.config.eos_token_ids.clone();
        }
        let config = EngineConfig {
            max_batch,
            kv_cache_tokens: None,
            eos_token_ids: eos_token_ids.clone(),
            tokenizer: Some(tokenizer.clone()),
            threads: l.engine_threads.max(1),
        };
        engines.push(Engine::start(model, config)?);
    }
    Ok((dispatch, EngineClient::new(engines)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_local_rank_comes_from_the_first_launcher_variable_set() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |v: &str| pairs.iter().find(|(k, _)| *k == v).map(|(_, x)| x.to_string())
        };
        assert_eq!(node_local_rank(env(&[])), None);
        assert_eq!(node_local_rank(env(&[("SLURM_LOCALID", "3")])), Some(3));
        assert_eq!(node_local_rank(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("SLURM_LOCALID", "3")])), Some(1));
        assert_eq!(node_local_rank(env(&[("LOCAL_RANK", "2"), ("MPI_LOCALRANKID", "5")])), Some(2));
        assert_eq!(node_local_rank(env(&[("LOCAL_RANK", "x"), ("MPI_LOCALRANKID", "5")])), Some(5));
    }
}
