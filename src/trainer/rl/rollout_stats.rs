//! What a step generated, trained or filtered: the rollout half of its metrics line.

use serde_json::{json, Map, Value};

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

    /// `reward_mean`, `correct_mean`, `response_length_mean`, `entropy_mean`, `episodes_generated`.
    pub fn write(&self, line: &mut Map<String, Value>) {
        line.insert("reward_mean".into(), json!(self.reward_mean()));
        line.insert("correct_mean".into(), json!(mean(self.correct.iter().copied())));
        line.insert("response_length_mean".into(), json!(mean(self.lengths.iter().copied())));
        let entropy = if self.entropy.1 > 0.0 { self.entropy.0 / self.entropy.1 } else { f64::NAN };
        line.insert("entropy_mean".into(), json!(entropy));
        line.insert("episodes_generated".into(), json!(self.generated));
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
