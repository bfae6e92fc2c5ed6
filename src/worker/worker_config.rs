//! [`WorkerConfig`]: how one worker trains (every weight or LoRA adapters, its seed, a critic
//! head, micro-batch limits, master weights, activation checkpointing, sharding and when the
//! ranks' gradients are summed, the temperature of its log-probs), with its defaults.

use super::gradient_sum::GradientSum;
use super::sharding::Sharding;
use crate::model::lora::LoraConfig;

/// How a [`super::Worker`] trains. `Default`: full fine-tuning, seed 0, no critic head, the
/// whole batch in one micro-batch, f32 master weights for a bf16/f16 model, every activation kept.
#[derive(Clone, Debug, PartialEq)]
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
    /// Mixed precision for a bf16 / f16 model: keep f32 master weights (and f32 gradient
    /// accumulators) that AdamW updates, and compute forward/backward on their rounding
    /// ([`super::mixed_precision`]). `false`: the parameters are updated in place in their own
    /// dtype (pure bf16). Ignored for f32 / f64 models. Default `true`.
    pub master_weights: bool,
    /// Activation checkpointing: the forward keeps only each decoder layer's input and the
    /// backward recomputes the layer from it ([`crate::model::tape::Keep::LayerInputs`] on the
    /// CPU tape, [`crate::model::graph_checkpoint`] on candle's graph elsewhere); the gradients
    /// are the same bits. Default `false`.
    pub activation_checkpointing: bool,
    /// What this worker keeps of the training state when it is one of several data-parallel
    /// ranks ([`Sharding`]); dispatch gives it its [`super::ShardPlan`]. Default `none`.
    pub sharding: Sharding,
    /// When the data-parallel ranks' gradients are summed ([`GradientSum`]): at the optimizer
    /// step (the default), or after every micro-batch, so that under `full` a rank keeps only its
    /// slice of the gradients however many micro-batches it runs. Default `step`.
    pub gradient_sum: GradientSum,
    /// Weight of the load-balancing loss of a model with experts (transformers'
    /// `router_aux_loss_coef`), added per micro-batch as coef × aux × Σ of the micro-batch's
    /// loss weights (with token-mean weights and one micro-batch, transformers' term); its
    /// gradient reaches the routers. 0 (the default): off.
    pub router_aux_loss_coef: f64,
    /// The temperature T of the policy's log-probs and entropies: they are those of
    /// softmax(logits / T), the distribution a sampler at T draws from, so that an RL run
    /// sampling at T trains on its sampler's probabilities (verl's, SkyRL's and TRL's
    /// `temperature`). RL sets its rollout temperature (1 for greedy rollouts); finite and
    /// positive. Default 1.
    pub temperature: f64,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            lora: None,
            seed: 0,
            critic: false,
            micro_batch_size: None,
            max_tokens_per_microbatch: None,
            master_weights: true,
            activation_checkpointing: false,
            sharding: Sharding::None,
            gradient_sum: GradientSum::Step,
            router_aux_loss_coef: 0.0,
            temperature: 1.0,
        }
    }
}
