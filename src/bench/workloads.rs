//! The workloads, as oxrl runs them.
//!
//! - Training step: `forward_backward` (cross-entropy, weights 1/N, so the loss is the token
//!   mean) + `optim_step` (AdamW: lr 1e-4, β 0.9 / 0.95, ε 1e-12, no weight decay, no clipping) of
//!   a [`Worker`] on 8 sequences × 128 tokens in one micro-batch — what `oxrl sft` does per step.
//! - Decoding: `c` concurrent requests, greedy, prompt 16 tokens, 32 new tokens each (EOS
//!   ignored), admitted together into a fresh [`EngineCore`] and run until idle (prefill
//!   included).
//!
//! Tokens are a fixed arithmetic pattern (no randomness to seed, the same in every process and
//! in the peers, which read them from the file [`super::model::write`] makes).

use serde_json::json;

use crate::algo::Loss;
use crate::model::Transformer;
use crate::rollout::{EngineConfig, EngineCore, Request, SamplingParams};
use crate::worker::{AdamParams, Datum, Worker, WorkerConfig};
use crate::{Error, Result};

pub const TRAIN_BATCH: usize = 8;
pub const TRAIN_SEQ: usize = 128;
pub const PROMPT_LEN: usize = 16;
pub const NEW_TOKENS: usize = 32;
/// The concurrent-request counts of the decoding benchmark.
pub const CONCURRENCY: [usize; 3] = [1, 16, 64];
/// Offset of the target pattern from the input pattern.
pub const TARGET_SALT: usize = 7;

/// Row `row` of a token pattern: `(31 + salt + 977·row + 131·i) mod vocab`.
pub fn tokens(row: usize, len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| ((31 + salt + row * 977 + i * 131) % vocab) as u32).collect()
}

/// The prompt of request `r`: `(7 + 977·r + 131·i) mod vocab`.
pub fn prompt(r: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| ((r * 977 + i * 131 + 7) % vocab) as u32).collect()
}

/// The training batch: `batch` datums of `seq` tokens, token-mean weights.
pub fn train_batch(batch: usize, seq: usize, vocab: usize) -> Vec<Datum> {
    let w = 1.0 / (batch * seq) as f32;
    (0..batch)
        .map(|r| Datum::supervised(tokens(r, seq, 0, vocab), tokens(r, seq, TARGET_SALT, vocab), vec![w; seq]))
        .collect()
}

/// The optimizer settings of the training benchmark (the peers use the same).
pub fn adam_params() -> AdamParams {
    AdamParams { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0.0, grad_clip_norm: 0.0 }
}

/// A worker training the model on one fixed batch, step after step.
pub struct TrainBench {
    worker: Worker,
    batch: Vec<Datum>,
    loss: Loss,
    params: AdamParams,
}

impl TrainBench {
    /// `master_weights` applies to a bf16 / f16 model (mixed precision, the default) and is
    /// ignored for f32.
    pub fn new(model: Transformer, batch: usize, seq: usize, master_weights: bool) -> Result<Self> {
        if batch == 0 || seq == 0 {
            return Err(Error::input("the training benchmark needs a batch and a sequence length of at least 1"));
        }
        let vocab = model.config.vocab_size;
        let worker = Worker::new(model, WorkerConfig { master_weights, ..Default::default() })?;
        let loss = Loss::parse("cross_entropy", &json!({}))?;
        Ok(TrainBench { worker, batch: train_batch(batch, seq, vocab), loss, params: adam_params() })
    }

    /// One training step; returns the loss before it (the token mean).
    pub fn step(&mut self) -> Result<f64> {
        let out = self.worker.forward_backward(&self.batch, Some(&self.loss), false)?;
        self.worker.optim_step(&self.params)?;
        out.metrics.value("loss:sum").ok_or_else(|| Error::Other("cross_entropy returned no loss:sum".into()))
    }

    pub fn tokens_per_step(&self) -> usize {
        self.batch.iter().map(Datum::len).sum()
    }
}

/// What one decoding run gave: the tokens generated, and how long its first engine step (every
/// prompt's prefill and the first token) and the later steps (each one token of every row) took.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRun {
    pub tokens: usize,
    pub first_step_ms: f64,
    pub later_steps_ms: f64,
}

/// Decoding of `concurrent` requests through a fresh engine, greedy at temperature 0 (the issue's
/// workload) or sampled as `sampling` says (temperature, top-k, top-p; as RL rollouts are;
/// request r seeded with r), `new_tokens` each, EOS ignored.
pub fn decode(
    model: &Transformer,
    concurrent: usize,
    prompt_len: usize,
    new_tokens: usize,
    sampling: &SamplingParams,
) -> Result<DecodeRun> {
    if concurrent == 0 || prompt_len == 0 {
        return Err(Error::input("the decoding benchmark needs at least one request and one prompt token"));
    }
    let vocab = model.config.vocab_size;
    let mut engine = EngineCore::new(model.clone(), EngineConfig { max_batch: concurrent, ..Default::default() })?;
    for r in 0..concurrent {
        let p = SamplingParams { max_tokens: new_tokens, ignore_eos: true, seed: Some(r as u64), ..sampling.clone() };
        engine.add_request(Request::new(prompt(r, prompt_len, vocab), p))?;
    }
    let t = std::time::Instant::now();
    let mut outs = engine.step()?;
    let first_step_ms = t.elapsed().as_secs_f64() * 1e3;
    outs.extend(engine.run_until_idle()?);
    let later_steps_ms = t.elapsed().as_secs_f64() * 1e3 - first_step_ms;
    let tokens = outs.iter().map(|(_, o)| o.samples.iter().map(|s| s.tokens.len()).sum::<usize>()).sum();
    Ok(DecodeRun { tokens, first_step_ms, later_steps_ms })
}

/// Multiply-adds × 2 of the model's projections for one token: q, k, v, o and the MLP of every
/// layer, and the LM head (attention's own products and the embedding are not counted). The
/// FLOPs a decoded token costs at least, for comparing decoding with a GEMM's speed.
pub fn flops_per_token(config: &crate::model::ModelConfig) -> f64 {
    let (layer, _, head) = projection_macs(config);
    2.0 * (config.num_hidden_layers * layer + head) as f64
}

/// Multiply-adds × 2 of the projections a prompt prefill computes per prompt token: every layer
/// but the last, and the last one's k and v (a prefill that scores nothing fills the cache and
/// skips the rest, `Transformer::fill_cache_adapted`; no LM head).
pub fn prefill_flops_per_token(config: &crate::model::ModelConfig) -> f64 {
    let (layer, kv, _) = projection_macs(config);
    2.0 * (config.num_hidden_layers.saturating_sub(1) * layer + kv) as f64
}

/// Multiply-adds per token of (one layer's projections, one layer's k and v, the LM head).
fn projection_macs(config: &crate::model::ModelConfig) -> (usize, usize, usize) {
    let (h, q, kv) = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads);
    let hd = config.head_dim;
    let kv_macs = h * kv * hd * 2;
    (h * q * hd * 2 + kv_macs + 3 * h * config.intermediate_size, kv_macs, h * config.vocab_size)
}
