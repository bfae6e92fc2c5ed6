//! The k most likely tokens of a next-token distribution with their log-probs: Tinker's
//! `topk_prompt_logprobs` (per prompt position) and `topk_sample_logprobs` (per sampled token).
//!
//! log softmax(z / t) over the whole vocabulary (in f64), the k largest, most likely first (ties
//! by token id). t = 1 for prompt positions; for sampled tokens the request's temperature (1 when
//! greedy), so that a sampled token found among them has the log-prob it was reported with when
//! no top-k / top-p truncation applied. k larger than the vocabulary gives the whole vocabulary.

/// The top `k` (token, log-prob) of softmax(logits / t).
pub fn top_logprobs(logits: &[f32], k: usize, t: f64) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return vec![];
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&z| ((z as f64 - max) / t).exp()).sum::<f64>().ln();
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_by(order);
    ids.into_iter().map(|i| (i, ((logits[i as usize] as f64 - max) / t - lse) as f32)).collect()
}
