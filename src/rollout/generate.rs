//! Generation in one call: every prompt through a private [`EngineCore`] until all are done.
//!
//! Prompt i samples from the stream seeded with `seed + i`, so a row's tokens do not depend on
//! what else is in the batch (and `oxrl generate --n k` equals k single runs with seeds
//! seed, seed + 1, …).

use super::engine_core::{EngineConfig, EngineCore};
use super::request::{Generation, Request};
use super::sampler::SamplingParams;
use crate::model::Transformer;
use crate::{Error, Result};

/// Generates a continuation of each prompt; `eos_token_ids` end a row unless `ignore_eos`.
pub fn generate(
    model: &Transformer,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    eos_token_ids: &[u32],
) -> Result<Vec<Generation>> {
    if prompts.is_empty() {
        return Err(Error::input("no prompts to generate from"));
    }
    let config = EngineConfig { max_batch: prompts.len(), eos_token_ids: eos_token_ids.to_vec(), ..Default::default() };
    let mut engine = EngineCore::new(model.clone(), config)?;
    let base = params.seed.unwrap_or_else(rand::random);
    for (i, p) in prompts.iter().enumerate() {
        let params = SamplingParams { seed: Some(base.wrapping_add(i as u64)), ..params.clone() };
        engine.add_request(Request::new(p.clone(), params))?;
    }
    Ok(engine.run_until_idle()?.into_iter().map(|(_, mut out)| out.samples.remove(0)).collect())
}
