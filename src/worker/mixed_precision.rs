//! Mixed precision: bf16 (or f16) compute with f32 master weights and f32 optimizer state.
//!
//! A worker whose model runs in bf16 / f16 keeps, by default ([`WorkerConfig::master_weights`]),
//! an f32 copy of every trainable parameter — the *master* — and:
//! - runs forward and backward in the model's dtype, on parameters that are always the master
//!   rounded to that dtype (so activations, the autograd graph and the matmuls are bf16);
//! - casts each gradient to f32 as it is accumulated (micro-batches, calls and the data-parallel
//!   all-reduce add in f32, not in bf16);
//! - applies AdamW to the master in f32 with f32 moments, then rounds the master into the
//!   parameter (`Var::set`, same storage, so the model and any shared views see it).
//!
//! Without masters a bf16 parameter is updated in f32 and rounded back at every step: an update
//! smaller than half a bf16 ulp of the weight (about 2⁻⁹ of it) is lost, so small learning rates
//! stall; the master accumulates such updates until they change the rounded value.
//!
//! Checkpoints keep the masters (`master_weights.safetensors`, f32, by parameter name) beside the
//! parameters in the model's dtype, so a resumed run continues bit-for-bit; exported weights are in
//! the model's dtype (the master rounded).
//!
//! Simplification: the masters start from the parameters as the worker receives them, i.e. already
//! rounded to bf16 when the model was loaded in bf16 (the low bits of an f32 checkpoint are lost
//! once, at load; most published checkpoints are stored in bf16 anyway). `load_state` of a checkpoint
//! without masters (an f32 run's, say) reads the stored parameters in f32 as the masters.
//!
//! [`WorkerConfig::master_weights`]: super::WorkerConfig::master_weights

use candle_core::{DType, Tensor, Var};

use super::worker_config::WorkerConfig;
use crate::Result;

/// The checkpoint file of the f32 masters.
pub const MASTER_FILE: &str = "master_weights.safetensors";

/// A half-precision parameter set to its master, rounded, and a half-precision gradient
/// widened to its f32 accumulator (one kernel each on CUDA).
pub use super::adamw_fused::{round_into, widened};

/// The dtype of master weights and of the gradient accumulators that feed them.
pub const MASTER_DTYPE: DType = DType::F32;

/// Whether a worker of `config` training a model of `dtype` keeps f32 masters: only for a
/// half-precision model (bf16, f16) with `master_weights` on.
pub fn keeps_masters(dtype: DType, config: &WorkerConfig) -> bool {
    config.master_weights && matches!(dtype, DType::BF16 | DType::F16)
}

/// Fresh f32 masters of `params` (copies: later updates of a master never alias the parameter).
pub fn masters_of(params: &[(String, Var)]) -> Result<Vec<Tensor>> {
    params.iter().map(|(_, v)| Ok(v.as_tensor().detach().to_dtype(MASTER_DTYPE)?.copy()?)).collect()
}
