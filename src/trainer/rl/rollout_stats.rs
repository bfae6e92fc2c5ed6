//! What a step generated, trained or filtered: the rollout half of its metrics line.

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
}

impl RolloutStats {
    pub fn add(&mut self, episodes: &[Episode]) {
        self.generated += episodes.len();
        for e in episodes {
            self.rewards.push(e.reward);
            self.lengths.push(e.response_tokens as f64);
            self.correct.push(e.correct as u8 as f64);
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
            entropy_mean: if self.entropy.1 > 0.0 { self.entropy.0 / self.entropy.1 } else { f64::NAN },
            episodes_generated: self.generated,
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
