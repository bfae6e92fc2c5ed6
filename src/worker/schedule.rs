//! Learning-rate schedules as pure functions of the step.
//!
//! `step` counts optimizer steps from 0. With `w` warm-up steps the rate rises linearly,
//! `lr · (step + 1) / w` for `step < w` (so the first step is not wasted at 0), then:
//! - `Constant`: `lr`;
//! - `Cosine { total_steps, min_ratio }`: with `s = (step − w) / max(total_steps − w, 1)`
//!   clamped to [0, 1], `lr · (min_ratio + (1 − min_ratio) · ½(1 + cos(π s)))` — from `lr` down
//!   to `lr · min_ratio` at `total_steps`, and flat after.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LrSchedule {
    Constant { warmup_steps: u64 },
    Cosine { warmup_steps: u64, total_steps: u64, min_ratio: f64 },
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule::Constant { warmup_steps: 0 }
    }
}

impl LrSchedule {
    /// The learning rate at `step` for the peak rate `lr`.
    pub fn lr_at(&self, lr: f64, step: u64) -> f64 {
        let warmup = match *self {
            LrSchedule::Constant { warmup_steps } | LrSchedule::Cosine { warmup_steps, .. } => warmup_steps,
        };
        if step < warmup {
            return lr * (step + 1) as f64 / warmup as f64;
        }
        match *self {
            LrSchedule::Constant { .. } => lr,
            LrSchedule::Cosine { total_steps, min_ratio, .. } => {
                let span = total_steps.saturating_sub(warmup).max(1) as f64;
                let s = ((step - warmup) as f64 / span).clamp(0.0, 1.0);
                lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * s).cos()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_min() {
        let s = LrSchedule::Cosine { warmup_steps: 4, total_steps: 14, min_ratio: 0.1 };
        let lrs: Vec<f64> = (0..16).map(|t| s.lr_at(1.0, t)).collect();
        assert_eq!(&lrs[..4], &[0.25, 0.5, 0.75, 1.0]);
        assert!((lrs[4] - 1.0).abs() < 1e-12);
        assert!((lrs[9] - 0.55).abs() < 1e-12);
        assert!((lrs[14] - 0.1).abs() < 1e-12 && (lrs[15] - 0.1).abs() < 1e-12);
        assert!(lrs[4..15].windows(2).all(|w| w[1] <= w[0]));
        assert_eq!(LrSchedule::default().lr_at(3e-4, 7), 3e-4);
        assert_eq!(LrSchedule::Constant { warmup_steps: 2 }.lr_at(1.0, 0), 0.5);
    }
}
