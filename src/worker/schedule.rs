//! Learning-rate schedules as pure functions of the step.
//!
//! With `w` warm-up steps and `T` total steps, step `s` (0-based, the step about to be taken):
//! - `s < w`: `lr × (s + 1) / w` (linear warm-up; the first step is not wasted at lr 0);
//! - after: progress `p = (s − w) / max(1, T − 1 − w)` clamped to [0, 1], and
//!   `lr × (m + (1 − m) × f(p))` with `f = 1` (constant), `1 − p` (linear) or
//!   `(1 + cos πp) / 2` (cosine), so the last step runs at exactly `m × lr` and later steps stay
//!   there.

use serde::{Deserialize, Serialize};

/// Shape of the decay after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    Constant,
    Linear,
    Cosine,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub warmup_steps: usize,
    /// Steps of the whole run (only the decaying kinds use it).
    pub total_steps: usize,
    /// The rate at the last step, as a fraction of the peak rate `m`.
    pub min_lr_ratio: f64,
}

impl Default for LrSchedule {
    /// Constant, no warm-up.
    fn default() -> Self {
        LrSchedule { kind: ScheduleKind::Constant, warmup_steps: 0, total_steps: 0, min_lr_ratio: 0.0 }
    }
}

impl LrSchedule {
    /// The learning rate of 0-based `step` for the peak rate `lr`.
    pub fn lr_at(&self, lr: f64, step: usize) -> f64 {
        let w = self.warmup_steps;
        if step < w {
            return lr * (step + 1) as f64 / w as f64;
        }
        let span = self.total_steps.saturating_sub(1).saturating_sub(w).max(1);
        let p = ((step - w) as f64 / span as f64).clamp(0.0, 1.0);
        let f = match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => 1.0 - p,
            ScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
        };
        let m = self.min_lr_ratio;
        lr * (m + (1.0 - m) * f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(kind: ScheduleKind, warmup_steps: usize, total_steps: usize, min_lr_ratio: f64) -> LrSchedule {
        LrSchedule { kind, warmup_steps, total_steps, min_lr_ratio }
    }

    #[test]
    fn warmup_then_decay_ends_at_min() {
        let c = s(ScheduleKind::Cosine, 2, 10, 0.1);
        assert_eq!(c.lr_at(1.0, 0), 0.5);
        assert_eq!(c.lr_at(1.0, 1), 1.0);
        assert_eq!(c.lr_at(1.0, 2), 1.0);
        assert!((c.lr_at(1.0, 9) - 0.1).abs() < 1e-12 && (c.lr_at(1.0, 12) - 0.1).abs() < 1e-12);
        let lrs: Vec<f64> = (2..10).map(|t| c.lr_at(1.0, t)).collect();
        assert!(lrs.windows(2).all(|w| w[1] <= w[0]));
        // Cosine midpoint: p = 0.5 gives the mean of peak and floor.
        let mid = s(ScheduleKind::Cosine, 0, 11, 0.0);
        assert!((mid.lr_at(1.0, 5) - 0.5).abs() < 1e-12);
        let l = s(ScheduleKind::Linear, 0, 5, 0.0);
        assert_eq!((l.lr_at(2.0, 0), l.lr_at(2.0, 2), l.lr_at(2.0, 4)), (2.0, 1.0, 0.0));
        assert_eq!(s(ScheduleKind::Constant, 0, 8, 0.0).lr_at(3.0, 7), 3.0);
        assert_eq!(LrSchedule::default().lr_at(3e-4, 7), 3e-4);
        assert_eq!(s(ScheduleKind::Constant, 2, 0, 0.0).lr_at(1.0, 0), 0.5);
    }
}
