//! Launching: the one place that turns a run's config into ready workers — devices, meshes and
//! thread budgets are chosen here, so trainers receive a built [`Dispatch`] and never name them.

use crate::dispatch::mesh::MeshShape;
use crate::dispatch::{Dispatch, WorkerSpec};
use crate::model::lora::LoraConfig;
use crate::model::weights;
use crate::trainer::sft::POLICY;
use crate::trainer::SftConfig;
use crate::worker::WorkerConfig;
use crate::Result;

/// Cores available to this process.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The policy of an SFT run: `train.data_parallel` ranks on the CPU, each with
/// `threads_per_rank` tensor-math threads (default: the cores shared evenly among the ranks).
pub fn sft_dispatch(cfg: &SftConfig, threads_per_rank: Option<usize>) -> Result<Dispatch> {
    let dp = cfg.train.data_parallel.max(1);
    let lora = (cfg.model.lora.rank > 0).then(|| {
        let targets: Vec<&str> = cfg.model.lora.targets.iter().map(String::as_str).collect();
        LoraConfig::new(cfg.model.lora.rank, cfg.model.lora.alpha, &targets)
    });
    let spec = WorkerSpec {
        dtype: weights::parse_dtype(&cfg.model.dtype)?,
        mesh: MeshShape::dp(dp),
        threads: threads_per_rank.unwrap_or((cores() / dp).max(1)),
        worker: WorkerConfig {
            lora,
            seed: cfg.train.seed,
            critic: false,
            micro_batch_size: Some(cfg.train.micro_batch_size),
            max_tokens_per_microbatch: (cfg.train.max_tokens_per_microbatch > 0)
                .then_some(cfg.train.max_tokens_per_microbatch),
        },
        ..WorkerSpec::new(&cfg.model.path)
    };
    let dispatch = Dispatch::new(false);
    dispatch.create_model(POLICY, &spec)?;
    Ok(dispatch)
}
