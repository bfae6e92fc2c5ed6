//! Batched prefill: the prompts admitted in one engine step, run as few forwards as possible.
//!
//! Prompts of equal length share a forward of up to [`PREFILL_TOKENS`] tokens (rows of the same
//! length need no padding, so each row computes exactly what it would alone: the kernels' order
//! does not depend on the batch), whatever LoRA adapter each uses (per-row adapters,
//! [`RowAdapters`]); the cache of each prompt is then cut out as a one-row cache. Admitting 64
//! prompts of 16 tokens was 64 forwards of 15 tokens (small matmuls, a third of a 64-request
//! decode run); it is now one of 64 × 15. For each prompt the cache covers prompt[..L-1] (the last prompt
//! token is fed by the first decode step) and, if asked, the prompt's scores come back too:
//! log-probs of its tokens and the top k tokens at each position. Identical (adapter, prompt) pairs
//! are prefilled once. A weight update's cache rebuild goes through here too (prompt = prompt +
//! tokens so far).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::request::{Request, TopLogprobs};
use super::top_logprobs::top_logprobs;
use crate::model::logprobs::target_logprobs;
use crate::model::row_adapters::{Adapter, RowAdapters};
use crate::model::{KvCache, Transformer};
use crate::Result;

/// What a prefill scored on a prompt (positions 1..L), when asked.
#[derive(Clone, Default)]
pub struct PromptScores {
    pub logprobs: Option<Vec<f32>>,
    /// (k, the top k at each position).
    pub topk: Option<(usize, Vec<TopLogprobs>)>,
}

impl PromptScores {
    /// The scores `req` asked for.
    pub fn for_request(&self, req: &Request) -> PromptScores {
        let topk = match (&self.topk, req.prompt_topk) {
            (Some((_, rows)), k) if k > 0 => {
                Some((k, rows.iter().map(|r| r.iter().take(k).copied().collect()).collect()))
            }
            _ => None,
        };
        PromptScores { logprobs: self.logprobs.clone().filter(|_| req.prompt_logprobs), topk }
    }
}

/// A prompt to prefill: its tokens, its adapter (registered name and weights), and the scores
/// wanted.
#[derive(Clone, Copy)]
pub struct PrefillItem<'a> {
    pub prompt: &'a [u32],
    pub adapter: Option<(&'a str, &'a Arc<Adapter>)>,
    pub logprobs: bool,
    pub topk: usize,
}

impl<'a> PrefillItem<'a> {
    /// What request `req` (with its resolved adapter) needs prefilled.
    pub fn of(req: &'a Request, adapter: Option<&'a Arc<Adapter>>) -> Self {
        let adapter = req.adapter.as_deref().zip(adapter);
        PrefillItem { prompt: &req.prompt, adapter, logprobs: req.prompt_logprobs, topk: req.prompt_topk }
    }

    fn key(&self) -> PrefillKey {
        (self.adapter.map(|a| a.0.to_string()), self.prompt.to_vec())
    }
}

/// (adapter name, prompt): what identifies a prefill.
pub type PrefillKey = (Option<String>, Vec<u32>);

/// Prefilled caches (one row each) and prompt scores, by (adapter name, prompt).
pub type Prefilled = HashMap<PrefillKey, (KvCache, PromptScores)>;

/// Prompt tokens per prefill forward, at most (a single longer prompt runs alone): 64 prompts of
/// 400 tokens in one forward held activations of 100 MiB each (the MLP's) and ran slower than in
/// forwards of this size (BENCHMARKS.md). Rows are independent in every kernel, so how
/// prompts are grouped changes no bit.
pub const PREFILL_TOKENS: usize = 4096;

/// Prefills every distinct (adapter, prompt) of `items`, grouping prompts of one length into
/// forwards of up to [`PREFILL_TOKENS`] tokens; a prompt asked for several times gets every
/// score any of them wants.
pub fn prefill_batch(model: &Transformer, items: &[PrefillItem]) -> Result<Prefilled> {
    prefill_batch_in(model, items, PREFILL_TOKENS)
}

/// [`prefill_batch`] with forwards of up to `max_tokens` prompt tokens.
fn prefill_batch_in(model: &Transformer, items: &[PrefillItem], max_tokens: usize) -> Result<Prefilled> {
    let mut wanted: HashMap<PrefillKey, PrefillItem> = HashMap::new();
    for it in items {
        let w = wanted.entry(it.key()).or_insert(*it);
        w.logprobs |= it.logprobs;
        w.topk = w.topk.max(it.topk);
    }
    let mut by_len: BTreeMap<usize, Vec<(PrefillKey, PrefillItem)>> = BTreeMap::new();
    for (key, it) in wanted {
        by_len.entry(it.prompt.len()).or_default().push((key, it));
    }
    let layers = model.config.num_hidden_layers;
    let mut out = Prefilled::new();
    for (len, mut group) in by_len {
        // Fixed row order (HashMap order is random), so that runs are reproducible.
        group.sort_by(|a, b| a.0.cmp(&b.0));
        let n = len - 1;
        if n == 0 {
            for (key, it) in group {
                let scores = PromptScores {
                    logprobs: it.logprobs.then(Vec::new),
                    topk: (it.topk > 0).then(|| (it.topk, Vec::new())),
                };
                out.insert(key, (KvCache::with_empty_rows(layers, 1), scores));
            }
            continue;
        }
        let rows = (max_tokens / n).max(1);
        let mut rest = group.into_iter();
        loop {
            let chunk: Vec<_> = rest.by_ref().take(rows).collect();
            if chunk.is_empty() {
                break;
            }
            prefill_group(model, chunk, n, &mut out)?;
        }
    }
    Ok(out)
}

/// One forward over prompts of one length (their first n tokens), each prompt's one-row cache
/// and scores into `out`.
fn prefill_group(
    model: &Transformer,
    group: Vec<(PrefillKey, PrefillItem)>,
    n: usize,
    out: &mut Prefilled,
) -> Result<()> {
    let b = group.len();
    let mut cache = model.new_cache();
    let ids: Vec<Vec<u32>> = group.iter().map(|(_, it)| it.prompt[..n].to_vec()).collect();
    let pos = vec![(0..n as u32).collect::<Vec<_>>(); b];
    let mask = vec![vec![1u8; n]; b];
    let rows: Vec<Option<&Arc<Adapter>>> = group.iter().map(|(_, it)| it.adapter.map(|a| a.1)).collect();
    let adapters = RowAdapters::new(&rows, &model.device)?;
    // The final hidden states only when a prompt is scored: otherwise the cache is all a
    // prefill leaves, and the last block's queries, attention and MLP are skipped.
    let hidden = match group.iter().any(|(_, it)| it.logprobs || it.topk > 0) {
        true => Some(model.forward_hidden_adapted(&ids, &pos, &mask, Some(&mut cache), adapters.as_ref())?),
        false => {
            model.fill_cache_adapted(&ids, &pos, &mask, &mut cache, adapters.as_ref())?;
            None
        }
    };
    for (row, ((key, it), one)) in group.into_iter().zip(cache.split_rows()?).enumerate() {
        let scores = match &hidden {
            Some(h) => score(model, &h.narrow(0, row, 1)?, &it)?,
            None => PromptScores::default(),
        };
        out.insert(key, (one, scores));
    }
    Ok(())
}

/// The scores `it` wants from its prompt's final hidden states [1, n, hidden]. Without any the
/// lm_head (the largest matmul here) is skipped.
fn score(model: &Transformer, hidden: &Tensor, it: &PrefillItem) -> Result<PromptScores> {
    let mut scores = PromptScores::default();
    if !it.logprobs && it.topk == 0 {
        return Ok(scores);
    }
    let adapters = RowAdapters::new(&[it.adapter.map(|a| a.1)], &model.device)?;
    let logits = model.logits_adapted(hidden, adapters.as_ref())?;
    if it.logprobs {
        let targets = Tensor::new(&it.prompt[1..], &model.device)?.unsqueeze(0)?;
        scores.logprobs = Some(target_logprobs(&logits, &targets)?.squeeze(0)?.to_device(&Device::Cpu)?.to_vec1()?);
    }
    if it.topk > 0 {
        let rows: Vec<Vec<f32>> = logits.squeeze(0)?.to_device(&Device::Cpu)?.to_vec2()?;
        scores.topk = Some((it.topk, rows.iter().map(|z| top_logprobs(z, it.topk, 1.0)).collect()));
    }
    Ok(scores)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{model as bench_model, workloads};
    use crate::test_support::bits;

    /// Prompts of one length prefilled two to a forward are the bits of one forward over all of
    /// them: every layer's keys and values, the prompt log-probs and top-k, whichever prompts of a
    /// forward ask for scores (a forward without any stops the last block at its keys and values).
    #[test]
    fn prompts_split_over_forwards_are_the_bits_of_one_forward() {
        let model = bench_model::build(1, candle_core::DType::F32, &Device::Cpu).unwrap();
        let prompts: Vec<Vec<u32>> = (0..5).map(|r| workloads::prompt(r, 9, 4096)).collect();
        let items: Vec<PrefillItem> = prompts
            .iter()
            .enumerate()
            .map(|(r, p)| PrefillItem { prompt: p, adapter: None, logprobs: r == 0, topk: if r == 3 { 2 } else { 0 } })
            .collect();
        let whole = prefill_batch_in(&model, &items, 1 << 20).unwrap();
        // 8 tokens a prompt: forwards of prompts {0, 1}, {2, 3}, {4}; the last without scores.
        let split = prefill_batch_in(&model, &items, 16).unwrap();
        assert_eq!((whole.len(), split.len()), (5, 5));
        for (key, (cache, scores)) in &whole {
            let (other, other_scores) = &split[key];
            for l in 0..model.config.num_hidden_layers {
                let ((k, v), (k2, v2)) = (cache.layer(l).unwrap(), other.layer(l).unwrap());
                assert_eq!((bits(k), bits(v)), (bits(k2), bits(v2)), "layer {l} of prompt {:?}", key.1);
            }
            let lp = |s: &PromptScores| s.logprobs.as_ref().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            assert_eq!(lp(scores), lp(other_scores));
            assert_eq!(format!("{:?}", scores.topk), format!("{:?}", other_scores.topk));
        }
        assert_eq!(whole[&(None, prompts[0].clone())].1.logprobs.as_ref().map(Vec::len), Some(8));
        assert_eq!(whole[&(None, prompts[3].clone())].1.topk.as_ref().map(|t| t.1.len()), Some(8));
    }
}
