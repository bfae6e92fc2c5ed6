//! The k most likely tokens of a next-token distribution with their log-probs: Tinker's
//! `topk_prompt_logprobs` (per prompt position) and `topk_sample_logprobs` (per sampled token).
//!
//! log softmax(z / t) over the whole vocabulary, the k largest, most likely first (ties by token
//! id). t = 1 for prompt positions; for sampled tokens the request's temperature (1 when greedy).
//! At t = 1 each value is z_v − lse with the normaliser of the trainer's log-prob function
//! (`logprob_lse`), so a token found among them has exactly the bits of its prompt log-prob or
//! sampled log-prob (clients such as lm-evaluation-harness compare the two to tell whether a
//! continuation is greedy); at other temperatures the normaliser is summed in f64. k larger than
//! the vocabulary gives the whole vocabulary.

use crate::model::ops::logprob_lse::row_lse;

/// The top `k` (token, log-prob) of softmax(logits / t).
pub fn top_logprobs(logits: &[f32], k: usize, t: f64) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return vec![];
    }
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_by(order);
    if t == 1.0 {
        let lse = row_lse(logits);
        return ids.into_iter().map(|i| (i, logits[i as usize] - lse)).collect();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&z| ((z as f64 - max) / t).exp()).sum::<f64>().ln();
    ids.into_iter().map(|i| (i, ((logits[i as usize] as f64 - max) / t - lse) as f32)).collect()
}
