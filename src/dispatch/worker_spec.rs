//! [`WorkerSpec`]: how to build the workers of one model — the launcher's choices (CLI, server),
//! kept out of trainers.

use std::path::PathBuf;

use candle_core::{DType, Device};

use super::mesh::MeshShape;
use crate::worker::WorkerConfig;

#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// The Hugging Face model directory. Required.
    pub model_dir: PathBuf,
    /// Parameter dtype. Default f32.
    pub dtype: DType,
    /// The device of every rank. Default CPU.
    pub device: Device,
    /// Ranks as a (dp, tp, sp, pp) mesh. Default dp = 1.
    pub mesh: MeshShape,
    /// Tensor-math threads of each rank (its own rayon pool); 0 = one per core. Default 1.
    pub threads: usize,
    /// LoRA (None: full fine-tuning), seed, critic head, micro-batching. Default: full
    /// fine-tuning, seed 0, no critic, one micro-batch.
    pub worker: WorkerConfig,
}

impl WorkerSpec {
    /// The defaults above for the model in `model_dir`.
    pub fn new(model_dir: impl Into<PathBuf>) -> Self {
        WorkerSpec {
            model_dir: model_dir.into(),
            dtype: DType::F32,
            device: Device::Cpu,
            mesh: MeshShape::dp(1),
            threads: 1,
            worker: WorkerConfig::default(),
        }
    }
}
