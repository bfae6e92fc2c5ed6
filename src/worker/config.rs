//! The worker's configuration, with its defaults.

use crate::model::lora::LoraConfig;

/// How a [`super::Worker`] trains. `Default`: full fine-tuning, seed 0, no critic head, the
/// whole batch in one micro-batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerConfig {
    /// Train fresh LoRA adapters (only they get gradients and optimizer state) instead of
    /// every weight. Default: `None` (full fine-tuning).
    pub lora: Option<LoraConfig>,
    /// Seed of the worker's random stream (LoRA and value-head initialisation). Default 0.
    pub seed: u64,
    /// A critic: a value head on the final hidden states, trained with the `value` loss.
    /// Default `false`.
    pub critic: bool,
    /// At most this many datums per micro-batch. Default `None` (no limit).
    pub micro_batch_size: Option<usize>,
    /// At most this many padded tokens (`B × T_max`) per micro-batch. Default `None` (no
    /// limit). A datum longer than this is an error.
    pub max_tokens_per_microbatch: Option<usize>,
}
