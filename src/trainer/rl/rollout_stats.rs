//! What a step generated, trained or filtered: the rollout half of its metrics line.
//!
//! Besides rewards, lengths and entropy: model turns per episode, failures of the user's code
//! scored 0 (`reward_errors`), and the means of what envs logged per episode (a reward
//! function's extra keys) as `reward/<key>`, and per `data_source` as `reward/<source>/score`
//! and `reward/<source>/<key>` (verl's per-source metrics).

use std::collections::BTreeMap;

use super::step_metrics::RolloutMetrics;

use super::episodes::Episode;

/// Everything generated in a step (trained or filtered): rewards, lengths, entropy.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RolloutStats {
    pub generated: usize,
    rewards: Vec<f64>,
    lengths: Vec<f64>,
    correct: Vec<f64>,
    /// Σ −log p(sampled token), tokens.
    entropy: (f64, f64),
    #[serde(default)]
    turns: Vec<f64>,
    #[serde(default)]
    user_errors: usize,
    /// `reward/...` key → (sum, count).
    #[serde(default)]
    logged: BTreeMap<String, (f64, f64)>,
}

impl RolloutStats {
    pub fn add(&mut self, episodes: &[Episode]) {
        self.generated += episodes.len();
        for e in episodes {
            self.rewards.push(e.reward);
            self.lengths.push(e.response_tokens as f64);
            self.correct.push(e.correct as u8 as f64);
            self.turns.push(e.turns as f64);
            self.user_errors += e.user_error as usize;
            let mut log = |key: String, x: f64| {
                let slot = self.logged.entry(key).or_default();
                slot.0 += x;
                slot.1 += 1.0;
            };
            for (k, &x) in &e.reward_metrics {
                log(format!("reward/{k}"), x);
            }
            if let Some(source) = &e.data_source {
                log(format!("reward/{source}/score"), e.reward);
                for (k, &x) in &e.reward_metrics {
                    log(format!("reward/{source}/{k}"), x);
                }
            }
            for (&lp, &m) in e.sequence.logprobs.iter().zip(&e.sequence.mask) {
                if m != 0.0 {
                    self.entropy.0 -= lp as f64;
                    self.entropy.1 += 1.0;
                }
            }
        }
    }

    pub fn reward_mean(&self) -> f64 {
        mean(self.rewards.iter().copied())
    }

    /// The step's rollout keys of its metrics line.
    pub fn metrics(&self) -> RolloutMetrics {
        RolloutMetrics {
            reward_mean: self.reward_mean(),
            correct_mean: mean(self.correct.iter().copied()),
            response_length_mean: mean(self.lengths.iter().copied()),
            turns_mean: mean(self.turns.iter().copied()),
            entropy_mean: if self.entropy.1 > 0.0 { self.entropy.0 / self.entropy.1 } else { f64::NAN },
            episodes_generated: self.generated,
            reward_errors: (self.user_errors > 0).then_some(self.user_errors),
            logged: self.logged.iter().map(|(k, (s, n))| (k.clone(), s / n)).collect(),
        }
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut n) = (0.0, 0.0);
    for x in xs {
        s += x;
        n += 1.0;
    }
    if n > 0.0 {
        s / n
    } else {
        f64::NAN
    }
}
