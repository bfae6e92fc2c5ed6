//! Batched autoregressive generation with the KV cache: prefill the left-padded prompts, then
//! decode one token per step for every unfinished row.
//!
//! Each row has its own seeded random stream (seed + row index), so a row's tokens do not depend
//! on what else is in the batch. Finished rows keep decoding a padding token (masked out) until
//! every row is done; the continuous-batching engine of the rollout layer removes that waste.

use rand::{rngs::StdRng, SeedableRng};

use super::sampler::{sample, SamplingParams};
use crate::model::Transformer;
use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StopReason {
    /// A stop or EOS token was generated (it is included in the output).
    Stop,
    /// `max_tokens` reached.
    Length,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub stop_reason: StopReason,
}

/// Generates a continuation of each prompt; `eos_token_ids` end a row unless `ignore_eos`.
pub fn generate(model: &Transformer, prompts: &[Vec<u32>], params: &SamplingParams, eos_token_ids: &[u32]) -> Result<Vec<Generation>> {
    params.validate()?;
    if prompts.is_empty() {
        return Err(Error::input("no prompts to generate from"));
    }
    let max_len = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    if prompts.iter().any(|p| p.is_empty()) {
        return Err(Error::input("a prompt is empty"));
    }
    let limit = model.config.max_position_embeddings;
    if max_len + params.max_tokens > limit {
        return Err(Error::input(format!(
            "prompt length {max_len} + max_tokens {} exceeds max_position_embeddings {limit}",
            params.max_tokens
        )));
    }
    let mut stops: Vec<u32> = params.stop_token_ids.clone();
    if !params.ignore_eos {
        stops.extend_from_slice(eos_token_ids);
    }
    let base_seed = params.seed.unwrap_or_else(rand::random);
    let mut rngs: Vec<StdRng> = (0..prompts.len()).map(|i| StdRng::seed_from_u64(base_seed.wrapping_add(i as u64))).collect();

    // Left-pad the prompts so every row's next token is in the last column.
    let mut ids = vec![];
    let mut mask = vec![];
    let mut pos = vec![];
    for p in prompts {
        let pad = max_len - p.len();
        ids.push([vec![0u32; pad], p.clone()].concat());
        mask.push([vec![0u8; pad], vec![1u8; p.len()]].concat());
        pos.push([vec![0u32; pad], (0..p.len() as u32).collect()].concat());
    }
    let mut out: Vec<Generation> =
        prompts.iter().map(|_| Generation { tokens: vec![], logprobs: vec![], stop_reason: StopReason::Length }).collect();
    let mut done = vec![params.max_tokens == 0; prompts.len()];
    let mut next_pos: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
    let mut cache = model.new_cache();
    let mut logits = model.forward(&ids, &pos, &mask, Some(&mut cache))?;
    while done.iter().any(|d| !d) {
        let t = logits.dim(1)?;
        let last: Vec<Vec<f32>> = logits.narrow(1, t - 1, 1)?.squeeze(1)?.to_vec2()?;
        let mut step_ids = vec![];
        let mut step_mask = vec![];
        for (row, g) in out.iter_mut().enumerate() {
            if done[row] {
                step_ids.push(vec![0]);
                step_mask.push(vec![0]);
                continue;
            }
            let (tok, lp) = sample(&last[row], params, &mut rngs[row])?;
            g.tokens.push(tok);
            g.logprobs.push(lp);
            if stops.contains(&tok) {
                g.stop_reason = StopReason::Stop;
                done[row] = true;
            } else if g.tokens.len() >= params.max_tokens {
                done[row] = true;
            }
            step_ids.push(vec![tok]);
            step_mask.push(vec![1]);
        }
        if done.iter().all(|d| *d) {
            break;
        }
        let step_pos: Vec<Vec<u32>> = next_pos.iter().map(|&p| vec![p]).collect();
        for p in next_pos.iter_mut() {
            *p += 1;
        }
        logits = model.forward(&step_ids, &step_pos, &step_mask, Some(&mut cache))?;
    }
    Ok(out)
}
