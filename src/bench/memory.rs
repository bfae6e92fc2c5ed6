//! What one data-parallel rank holds while it trains, predicted from the model's config: the
//! formula `oxrl bench memory` prints beside the measured peak.
//!
//! For full fine-tuning of a model stored in `dtype` (bytes per element `s`), with P parameters:
//! - parameters: P·s (every rank holds the whole model);
//! - gradients: P in the accumulators' dtype (f32 for a bf16/f16 model with master weights, else
//!   the model's own);
//! - optimizer state: two AdamW moments per parameter in the state dtype (f64 for an f64 model,
//!   else f32), and the f32 master weights of a bf16/f16 model that keeps them;
//! - activations, in the compute dtype (f64 for an f64 model, else f32: the tape widens), for a
//!   micro-batch of B rows of T tokens (N = B·T): what the tape keeps for the backward. A layer
//!   keeps N·(4·hidden + 2·H·D + 2·KV·D + 3·intermediate) (its input, the two normed inputs, the
//!   residual, q, attention output, k, v, gate, up and their product; Qwen3's head norms add
//!   N·(H·D + KV·D) for q and k before them) and B·H·T² attention probabilities. Without
//!   checkpointing every layer keeps all of it; with checkpointing each layer keeps its input
//!   (N·hidden) and one layer's worth is alive again while its backward recomputes it. The head
//!   keeps the final hidden states before and after the norm (2·N·hidden) and the logits of the
//!   rows the loss reads (N·V; checkpointed, one chunk of them at most, recomputed in the
//!   backward: [`crate::model::tape::CHUNK_LOGITS`] elements).
//!
//! Under sharding ([`RankMemory::sharded`]) the optimizer state is split over the ranks, and
//! under `full` the parameters too (plus, while a layer is in use, that layer whole), and the
//! gradients when they are summed during the backward (a step of one micro-batch a rank, or
//! `gradient_sum = "micro_batch"`).
//!
//! Temporaries of the backward (one layer's gradients in flight) and the allocator's slack are
//! not counted: the measured peak is above the prediction by about them.

use crate::model::ModelConfig;
use crate::worker::{GradientSum, Sharding};

/// Predicted bytes of one rank, by kind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankMemory {
    pub params: f64,
    pub grads: f64,
    /// AdamW moments and master weights.
    pub optimizer: f64,
    pub activations: f64,
}

impl RankMemory {
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer + self.activations
    }

    /// The same rank as one of `ranks` under `sharding`, running `micro_batches` micro-batches
    /// a step whose gradients are summed as `gradient_sum` says: every mode but `none` keeps
    /// 1/ranks of the optimizer state, and `full` 1/ranks of the parameters. The gradients:
    /// - `full`, summed during the backward (one micro-batch a step, or each micro-batch's
    ///   summed as it comes: `worker::unit_reduce`): 1/ranks;
    /// - summed after each of several micro-batches in another mode: the sums the rank keeps
    ///   (1/ranks sharded, all of them under `none`) beside one micro-batch's whole gradients;
    /// - otherwise whole: each rank's backwards fill every accumulator before the step's sum
    ///   (`gradients` keeps only the owned part of the sum, which is transient here).
    pub fn sharded(self, sharding: Sharding, ranks: usize, micro_batches: usize, gradient_sum: GradientSum) -> Self {
        let share = if sharding.is_sharded() { 1.0 / ranks.max(1) as f64 } else { 1.0 };
        let full = sharding == Sharding::Full;
        let each = gradient_sum == GradientSum::MicroBatch;
        let params = if full { self.params * share } else { self.params };
        let grads = match (full && (micro_batches <= 1 || each), each && micro_batches > 1) {
            (true, _) => self.grads * share,
            (false, true) => self.grads * (1.0 + share),
            (false, false) => self.grads,
        };
        RankMemory { optimizer: self.optimizer * share, params, grads, ..self }
    }
}

/// The number of parameters the config describes.
pub fn param_count(c: &ModelConfig) -> usize {
    let (hd, d, h, kv, im) =
        (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size);
    let bias = |on: bool, n: usize| if on { n } else { 0 };
    let attention =
        hd * h * d + 2 * hd * kv * d + h * d * hd + bias(c.qkv_bias, h * d + 2 * kv * d) + bias(c.o_bias, hd);
    let mlp = 3 * hd * im + bias(c.mlp_bias, 2 * im + hd);
    let norms = 2 * hd + bias(c.qk_norm, 2 * d);
    let head = if c.tie_word_embeddings { 0 } else { c.vocab_size * hd };
    c.vocab_size * hd + c.num_hidden_layers * (attention + mlp + norms) + hd + head
}

/// One rank's predicted memory for full fine-tuning of a model stored with `param_bytes` bytes
/// per element (`master_weights`: a bf16/f16 model keeps f32 masters) on `batch` × `seq` tokens.
pub fn predict(
    c: &ModelConfig,
    param_bytes: usize,
    master_weights: bool,
    batch: usize,
    seq: usize,
    checkpointing: bool,
) -> RankMemory {
    let p = param_count(c) as f64;
    let half = param_bytes < 4;
    let wide = if param_bytes == 8 { 8.0 } else { 4.0 };
    let masters = half && master_weights;
    let grads = p * if masters { 4.0 } else { param_bytes as f64 };
    let optimizer = p * (2.0 * wide + if masters { 4.0 } else { 0.0 });
    let (hd, d, h, kv, im) =
        (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size);
    let n = batch * seq;
    let qk_norm = if c.qk_norm { h * d + kv * d } else { 0 };
    let layer = n * (4 * hd + 2 * h * d + 2 * kv * d + 3 * im + qk_norm) + batch * h * seq * seq;
    let layers = c.num_hidden_layers;
    let kept = if checkpointing { layers * n * hd + layer } else { layers * layer };
    // Checkpointed, the head recomputes its logits chunk by chunk in the backward.
    let logits = n * c.vocab_size;
    let logits = if checkpointing { logits.min(crate::model::tape::CHUNK_LOGITS) } else { logits };
    let head = 2 * n * hd + logits;
    RankMemory { params: p * param_bytes as f64, grads, optimizer, activations: (kept + head) as f64 * wide }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::init::write_random_model;
    use crate::model::model_config::{Arch, ModelShape};
    use crate::model::Transformer;
    use candle_core::{DType, Device};

    /// The count is the loaded model's, for each family, tied or not.
    #[test]
    fn param_count_is_the_models() {
        for (arch, tie) in [(Arch::Llama, true), (Arch::Qwen2, false), (Arch::Qwen3, false)] {
            let dir = tempfile::tempdir().unwrap();
            let shape = ModelShape {
                vocab_size: 300,
                hidden_size: 32,
                intermediate_size: 48,
                num_layers: 2,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 8,
                rope_theta: 1e4,
                max_position_embeddings: 64,
                tie_word_embeddings: tie,
            };
            write_random_model(dir.path(), arch, &shape, 0, DType::F32).unwrap();
            let m = Transformer::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
            assert_eq!(param_count(&m.config), m.num_params(), "{arch:?}");
        }
    }

    /// Checkpointing keeps one layer's input per layer plus one layer: on a deep model with long
    /// rows, far less than every layer.
    #[test]
    fn checkpointing_keeps_less() {
        let dir = tempfile::tempdir().unwrap();
        let shape = ModelShape {
            vocab_size: 300,
            hidden_size: 64,
            intermediate_size: 256,
            num_layers: 12,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            rope_theta: 1e4,
            max_position_embeddings: 512,
            tie_word_embeddings: true,
        };
        write_random_model(dir.path(), Arch::Qwen2, &shape, 0, DType::F32).unwrap();
        let c = ModelConfig::from_dir(dir.path()).unwrap();
        let (all, ckpt) = (predict(&c, 4, true, 4, 256, false), predict(&c, 4, true, 4, 256, true));
        assert_eq!((all.params, all.grads, all.optimizer), (ckpt.params, ckpt.grads, ckpt.optimizer));
        assert!(ckpt.activations * 3.0 < all.activations, "{ckpt:?} vs {all:?}");
        let bf16 = predict(&c, 2, true, 1, 1, false);
        assert_eq!((bf16.grads, bf16.optimizer), (all.grads, all.optimizer + all.params));
    }

    /// Each layout's share of a rank's 4-byte parameters, gradients and moments, by hand.
    #[test]
    fn shares_by_layout() {
        use GradientSum::{MicroBatch, Step};
        let whole = RankMemory { params: 4.0, grads: 4.0, optimizer: 8.0, activations: 1.0 };
        let at = |s: Sharding, micro_batches: usize, sum: GradientSum| {
            let m = whole.sharded(s, 4, micro_batches, sum);
            assert_eq!(m.activations, 1.0);
            (m.params, m.grads, m.optimizer)
        };
        assert_eq!(at(Sharding::None, 3, Step), (4.0, 4.0, 8.0));
        assert_eq!(at(Sharding::None, 3, MicroBatch), (4.0, 8.0, 8.0)); // the sums and one round
        assert_eq!(at(Sharding::None, 1, MicroBatch), (4.0, 4.0, 8.0));
        assert_eq!(at(Sharding::Gradients, 3, Step), (4.0, 4.0, 2.0));
        assert_eq!(at(Sharding::Gradients, 3, MicroBatch), (4.0, 5.0, 2.0));
        assert_eq!(at(Sharding::Full, 1, Step), (1.0, 1.0, 2.0));
        assert_eq!(at(Sharding::Full, 3, Step), (1.0, 4.0, 2.0));
        assert_eq!(at(Sharding::Full, 3, MicroBatch), (1.0, 1.0, 2.0));
    }
}
