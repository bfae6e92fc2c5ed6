//! Drawing one token from a row of logits: temperature, top-k, top-p, greedy.
//!
//! The distribution drawn from is p ∝ exp(z / T) restricted to the k most likely tokens and then
//! to the smallest prefix (by decreasing probability) whose mass reaches top_p, renormalised.
//! The returned log-prob is log p(token) under exactly that distribution. With T = 1 and no
//! truncation, and when greedy (T = 0, argmax, ties to the lowest id), that is the model's own
//! log-prob, computed by the trainer's function of the logits: the same bits as the trainer's
//! forward gives for the token (issue 26). Otherwise the weights exp((z − max) / T) are f32,
//! the logits' precision, from the vectorised exp; sums and the log in f64.

use rand::{rngs::StdRng, Rng};

use super::row_math;
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
fn is_greedy(temperature: f64) -> bool {
    temperature == 0.0 || !((1.0 / temperature) as f32).is_finite()
}

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
    let total = row_math::exp_scaled(&mut weights, logits, max, (1.0 / p.temperature) as f32);
    let truncate = p.top_k > 0 && p.top_k < logits.len() || p.top_p < 1.0;
    if !truncate {
        let (token, lp) = draw(weights.iter().enumerate().map(|(i, &w)| (i as u32, w as f64)), total, rng);
        // At T = 1 the distribution is the model's: report its log-prob as the trainer computes it.
        return Ok((token, if p.temperature == 1.0 { model_logprob(logits, token) } else { lp }));
    }
    // (id, unnormalised probability) sorted by decreasing probability.
    let mut probs: Vec<(u32, f64)> = weights.iter().enumerate().map(|(i, &w)| (i as u32, w as f64)).collect();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 && p.top_k < probs.len() {
        probs.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let total: f64 = probs.iter().map(|x| x.1).sum();
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, x) in probs.iter().enumerate() {
            acc += x.1 / total;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().map(|x| x.1).sum();
    Ok(draw(probs.into_iter(), total, rng))
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

/// log softmax(z / t)[i]: exponentials in f32 (the precision of the logits; f64's `exp` was a
/// tenth of a 64-row decode step), summed and logged in f64.
pub fn log_softmax_at(logits: &[f32], i: usize, t: f64) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    (logits[i] as f64 - max as f64) / t - row_math::sum_exp(logits, max, (1.0 / t) as f32).ln()
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

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
