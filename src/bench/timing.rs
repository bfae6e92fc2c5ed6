//! Timing: the median of repeated runs after warm-up runs, in milliseconds.
//!
//! Why the median: on a shared machine a run is slowed by others far more often than it is
//! sped up, and one slow outlier should not move the figure.

use std::time::Instant;

use crate::Result;

/// The median of `xs` (the upper one for an even count); NaN for none.
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// Runs `f` `warmup` times untimed, then `reps` times; returns each timed run's milliseconds.
pub fn measure_ms(warmup: usize, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f()?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        })
        .collect()
}
