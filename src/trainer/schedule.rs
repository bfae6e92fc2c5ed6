//! The learning-rate schedule: linear warmup from 0, then constant, linear or cosine decay to
//! `min_lr_ratio × lr` at the last step.
//!
//! With `w` warmup steps and `T` total steps, step `s` (0-based, the step about to be taken):
//! - `s < w`: `lr × (s + 1) / w` (the first step is not wasted at lr 0);
//! - after: progress `p = (s − w) / max(1, T − 1 − w)` clamped to [0, 1], and
//!   `lr × (m + (1 − m) × f(p))` with `f = 1` (constant), `1 − p` (linear) or
//!   `(1 + cos πp) / 2` (cosine), so the last step runs at exactly `m × lr`.

use super::config::{ScheduleKind, ScheduleSection};

/// The learning rate of 0-based step `step` of `total_steps`.
pub fn lr_at(schedule: &ScheduleSection, peak_lr: f64, step: usize, total_steps: usize) -> f64 {
    let w = schedule.warmup_steps;
    if step < w {
        return peak_lr * (step + 1) as f64 / w as f64;
    }
    let span = total_steps.saturating_sub(1).saturating_sub(w).max(1);
    let p = ((step - w) as f64 / span as f64).clamp(0.0, 1.0);
    let f = match schedule.kind {
        ScheduleKind::Constant => 1.0,
        ScheduleKind::Linear => 1.0 - p,
        ScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
    };
    let m = schedule.min_lr_ratio;
    peak_lr * (m + (1.0 - m) * f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay_ends_at_min() {
        let s = ScheduleSection { kind: ScheduleKind::Cosine, warmup_steps: 2, min_lr_ratio: 0.1 };
        assert_eq!(lr_at(&s, 1.0, 0, 10), 0.5);
        assert_eq!(lr_at(&s, 1.0, 1, 10), 1.0);
        assert_eq!(lr_at(&s, 1.0, 2, 10), 1.0);
        assert!((lr_at(&s, 1.0, 9, 10) - 0.1).abs() < 1e-12);
        let l = ScheduleSection { kind: ScheduleKind::Linear, warmup_steps: 0, min_lr_ratio: 0.0 };
        assert_eq!(lr_at(&l, 2.0, 0, 5), 2.0);
        assert_eq!(lr_at(&l, 2.0, 2, 5), 1.0);
        assert_eq!(lr_at(&l, 2.0, 4, 5), 0.0);
        let c = ScheduleSection { kind: ScheduleKind::Constant, warmup_steps: 0, min_lr_ratio: 0.0 };
        assert_eq!(lr_at(&c, 3.0, 7, 8), 3.0);
    }
}
