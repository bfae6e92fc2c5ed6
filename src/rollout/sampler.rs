//! Drawing one token from a row of logits: temperature, top-k, top-p, greedy.
//!
//! The distribution drawn from is p ∝ exp(z / T) restricted to the k most likely tokens and then
//! to the smallest prefix (by decreasing probability) whose mass reaches top_p, renormalised.
//! The returned log-prob is log p(token) under exactly that distribution. Without truncation it
//! is computed by the trainer's function of the logits scaled by 1/T (each z · (1/T) in f32, as
//! the trainer's head scales them when its temperature is T): the same bits as the trainer's
//! forward at that temperature gives for the token; greedy (T = 0, argmax, ties to the lowest
//! id) reports the model's own log-prob, as the trainer at temperature 1. The weights drawn from
//! are exp((z − max) / T) in f32, the logits' precision, from the vectorised exp; with top-k /
//! top-p, the reported log-prob is theirs (sums and the log in f64).

use rand::{rngs::StdRng, Rng};

use super::{radix_sort, row_math};
use crate::model::ops::logprob_lse;

use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// Number of new tokens at most.
    pub max_tokens: usize,
    /// 0 = greedy. Default 1.
    pub temperature: f64,
    /// Keep the k most likely tokens; 0 = all. Default 0.
    pub top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = all. Default 1.
    pub top_p: f64,
    /// Seed of the per-sequence random stream; None draws one from the OS.
    pub seed: Option<u64>,
    /// Token ids that end generation (in addition to the model's EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation once the decoded completion contains one (the token that
    /// completed it is kept). Needs an engine with a tokenizer.
    pub stop_strings: Vec<String>,
    /// Do not stop at the model's EOS ids.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            stop_token_ids: vec![],
            stop_strings: vec![],
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::input(format!("temperature must be finite and >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::input(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if self.stop_strings.iter().any(|s| s.is_empty()) {
            return Err(Error::input("a stop string is empty"));
        }
        Ok(())
    }
}

/// Whether `temperature` samples greedily: 0, or so small that 1/T overflows f32 (the limit of
/// sampling as T → 0 is the greedy choice; 1e-40 is not a reason to return NaN).
pub(crate) fn is_greedy(temperature: f64) -> bool {
    temperature == 0.0 || !((1.0 / temperature) as f32).is_finite()
}

/// The unnormalised mass top-p is measured against: the top-k tokens' (the first `keep_k` of
/// `keys`, see [`key`]), or, without top-k, the row's `total`.
fn top_mass(keys: &[u64], keep_k: usize, total: f64) -> f64 {
    if keep_k < keys.len() {
        keys[..keep_k].iter().map(|&k| weight(k)).sum()
    } else {
        total
    }
}

/// Candidates sorted first for top-k / top-p (see [`sample`]).
const TOP_CANDIDATES: usize = 1024;

/// Returns (token, log-prob under the distribution drawn from).
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> Result<(u32, f32)> {
    let Some(max) = row_math::max_checked(logits) else {
        return Err(Error::Other("the model produced NaN logits (or none)".into()));
    };
    if is_greedy(p.temperature) {
        let best = row_math::first_index_of(logits, max) as u32;
        return Ok((best, model_logprob(logits, best)));
    }
    // Unnormalised probabilities exp((z − max) / T), in f32 with the vectorised exp (f64's libm
    // exp over the vocabulary was a sixth of a temperature-1 decode step at 64 rows), and their sum.
    let mut weights = vec![0f32; logits.len()];
    let inv_t = (1.0 / p.temperature) as f32;
    let total = row_math::exp_scaled(&mut weights, logits, max, inv_t);
    let truncate = p.top_k > 0 && p.top_k < logits.len() || p.top_p < 1.0;
    if !truncate {
        let (token, _) = draw(weights.iter().enumerate().map(|(i, &w)| (i as u32, w as f64)), total, rng);
        // The distribution is softmax(z / T): report its log-prob as the trainer computes it at
        // temperature T (the model's own at T = 1).
        return Ok((token, tempered_logprob(logits, inv_t, token, &mut weights)));
    }
    // Tokens by decreasing probability, ties to the lower id: a total order, so a partial
    // selection gives the same leading tokens as a full sort. Sorting a 152k vocabulary for every
    // sampled token cost more than the rest of the draw: only the leading candidates are sorted,
    // the rest only when top-p needs them. Each token is one u64 key (see [`key`]) that sorts in
    // that order as a plain integer (as (id, f64) pairs through a comparator, the nucleus of a
    // near-uniform 152k row, a sort of all of it, was the slowest part of a draw: BENCHMARKS.md).
    let mut keys: Vec<u64> = weights.iter().enumerate().map(|(i, &w)| key(i as u32, w)).collect();
    let keep_k = if p.top_k > 0 && p.top_k < keys.len() { p.top_k } else { keys.len() };
    if keep_k < keys.len() {
        keys.select_nth_unstable(keep_k - 1);
    }
    let mut sorted = keep_k.min(TOP_CANDIDATES);
    // Every weight is at most 1 (the maximum's is exp(0)): when the candidates could not hold
    // top_p of the mass even so (a flat row), all of the top-k are sorted at once below.
    let flat = p.top_p < 1.0 && keep_k > sorted && (sorted as f64) < p.top_p * top_mass(&keys, keep_k, total);
    if sorted < keep_k && !flat {
        keys[..keep_k].select_nth_unstable(sorted - 1);
    }
    keys[..sorted].sort_unstable();
    if keep_k > sorted
        && (p.top_p >= 1.0 || flat || {
            // Do the sorted candidates hold top_p of the mass? (They decide the nucleus if so.)
            let lead: f64 = keys[..sorted].iter().map(|&k| weight(k)).sum();
            lead < p.top_p * top_mass(&keys, keep_k, total)
        })
    {
        if flat && keep_k == keys.len() {
            // Still in id order (nothing selected): by weight, stably, is the full order.
            radix_sort::sort_by_high_half(&mut keys);
        } else {
            keys[..keep_k].sort_unstable();
        }
        sorted = keep_k;
    }
    // Without top-p, the top-k tokens; with it, at most the sorted ones (which hold top_p of the
    // mass, or are all of the top-k).
    let mut keep = if p.top_p < 1.0 { sorted } else { keep_k };
    if p.top_p < 1.0 {
        // The nucleus: the shortest prefix whose share of the top-k mass (of the row's, without
        // top-k) reaches top_p.
        let m = top_mass(&keys, keep_k, total);
        let mut acc = 0.0;
        for (i, &k) in keys[..sorted].iter().enumerate() {
            acc += weight(k) / m;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
    }
    keys.truncate(keep);
    let total: f64 = keys.iter().map(|&k| weight(k)).sum();
    Ok(draw(keys.into_iter().map(|k| (k as u32, weight(k))), total, rng))
}

/// Token `id` of unnormalised probability `w` (≥ 0) as one integer: the complement of w's f32
/// bits above the id. Non-negative floats order as their bits, so ascending keys are decreasing
/// probability, ties to the lower id.
fn key(id: u32, w: f32) -> u64 {
    // + 0.0 turns a −0 into +0 (whose bits would otherwise order it above +0).
    (u64::from(!(w + 0.0).to_bits()) << 32) | u64::from(id)
}

/// The probability (as f64) a [`key`] holds.
fn weight(key: u64) -> f64 {
    f64::from(f32::from_bits(!((key >> 32) as u32)))
}

/// One draw (one random number) from (id, unnormalised probability) pairs of sum `total`: the
/// first pair whose cumulative mass passes u · total (the last one if rounding leaves u past
/// the end), with its log-probability.
fn draw(probs: impl Iterator<Item = (u32, f64)>, total: f64, rng: &mut StdRng) -> (u32, f32) {
    let mut u = rng.random::<f64>() * total;
    let mut chosen = (0, 0.0);
    for x in probs {
        chosen = x;
        if u < x.1 {
            break;
        }
        u -= x.1;
    }
    (chosen.0, (chosen.1 / total).ln() as f32)
}

/// The model's log-prob of `token`: the trainer's function of the logits
/// ([`logprob_lse::row_forward`]), so that a sampled token's log-prob is the trainer's bits.
fn model_logprob(logits: &[f32], token: u32) -> f32 {
    logprob_lse::row_forward(logits, token).0
}

/// [`model_logprob`] of softmax(z · inv_t): each logit times inv_t in f32, as the trainer's
/// head scales them at temperature 1 / inv_t (`model::tape::head`), then the same row function.
/// `scratch` (the row's length) receives the scaled logits.
fn tempered_logprob(logits: &[f32], inv_t: f32, token: u32, scratch: &mut [f32]) -> f32 {
    if inv_t == 1.0 {
        return model_logprob(logits, token);
    }
    for (s, &z) in scratch.iter_mut().zip(logits) {
        *s = z * inv_t;
    }
    model_logprob(scratch, token)
}

/// log softmax(z / t)\[i\]: exponentials in f32 (the precision of the logits; f64's `exp` was a
/// tenth of a 64-row decode step), summed and logged in f64.
pub fn log_softmax_at(logits: &[f32], i: usize, t: f64) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    (logits[i] as f64 - max as f64) / t - row_math::sum_exp(logits, max, (1.0 / t) as f32).ln()
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    /// The partial sort draws what a full sort of the row draws (same nucleus definition), for
    /// rows longer than the candidates, with top-k below and above them and top-p small and large.
    #[test]
    fn partial_sort_draws_what_a_full_sort_draws() {
        fn full_sort(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> (u32, f32) {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut weights = vec![0f32; logits.len()];
            let total = row_math::exp_scaled(&mut weights, logits, max, (1.0 / p.temperature) as f32);
            let mut probs: Vec<(u32, f64)> = weights.iter().enumerate().map(|(i, &w)| (i as u32, w as f64)).collect();
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let keep_k = if p.top_k > 0 && p.top_k < probs.len() { p.top_k } else { probs.len() };
            let m = if keep_k < probs.len() { probs[..keep_k].iter().map(|x| x.1).sum() } else { total };
            let mut keep = keep_k;
            if p.top_p < 1.0 {
                let mut acc = 0.0;
                for (i, x) in probs[..keep_k].iter().enumerate() {
                    acc += x.1 / m;
                    if acc >= p.top_p {
                        keep = i + 1;
                        break;
                    }
                }
            }
            probs.truncate(keep);
            let total: f64 = probs.iter().map(|x| x.1).sum();
            draw(probs.into_iter(), total, rng)
        }
        let spread: Vec<f32> = (0..5000).map(|i| (((i * 7919) % 10007) as f32 / 10007.0 - 0.5) * 12.0).collect();
        // Near-uniform with many ties (seven values): the nucleus is most of the row.
        let flat: Vec<f32> = (0..5000).map(|i| ((i * 31) % 7) as f32 * 0.01).collect();
        for logits in [&spread, &flat] {
            for (top_k, top_p, t) in
                [(0, 0.9, 1.0), (0, 0.999, 1.0), (50, 0.8, 0.7), (2000, 0.95, 1.3), (3000, 1.0, 1.0)]
            {
                let p = SamplingParams { top_k, top_p, temperature: t, ..Default::default() };
                for seed in 0..50 {
                    let got = sample(logits, &p, &mut StdRng::seed_from_u64(seed)).unwrap();
                    let want = full_sort(logits, &p, &mut StdRng::seed_from_u64(seed));
                    assert_eq!(
                        (got.0, got.1.to_bits()),
                        (want.0, want.1.to_bits()),
                        "top_k {top_k} top_p {top_p} seed {seed}"
                    );
                }
            }
        }
    }

    /// Temperatures too small for 1/T (1e-40: subnormal) sample as greedy does, with the model's
    /// finite log-prob; small ones that still divide give the top token with log-prob 0.
    #[test]
    fn tiny_temperatures_are_the_greedy_limit() {
        let logits = [0.5f32, 2.0, -1.0, 1.5];
        let greedy =
            sample(&logits, &SamplingParams { temperature: 0.0, ..Default::default() }, &mut StdRng::seed_from_u64(1));
        let (token, lp) = greedy.unwrap();
        assert_eq!(token, 1);
        for t in [1e-40, 1e-39, f64::MIN_POSITIVE] {
            let p = SamplingParams { temperature: t, ..Default::default() };
            assert_eq!(sample(&logits, &p, &mut StdRng::seed_from_u64(1)).unwrap(), (token, lp), "T = {t}");
        }
        let p = SamplingParams { temperature: 1e-30, ..Default::default() };
        assert_eq!(sample(&logits, &p, &mut StdRng::seed_from_u64(1)).unwrap(), (1, 0.0));
    }
}
