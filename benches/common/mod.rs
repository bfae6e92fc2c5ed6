//! What the benchmarks share: the reference model shape and a timing helper.
#![allow(dead_code)]

use std::time::Instant;

use candle_core::{DType, Device};
use oxrl::model::model_config::ModelConfig;
use oxrl::model::Transformer;

/// The benchmark model of the issues (`oxrl::bench::model`): qwen3-shaped, hidden 256, 4 layers,
/// 4 heads of 64 (2 kv heads), MLP 1024, vocab 4096, f32 on CPU (or on [`device`]).
pub fn d256_config() -> ModelConfig {
    oxrl::bench::model::config().unwrap()
}

pub fn d256_model(seed: u64) -> Transformer {
    oxrl::bench::model::build(seed, DType::F32, &device()).unwrap()
}

/// The benchmarks' device: `OXRL_BENCH_DEVICE` (`cpu`, `cuda`, `cuda:N`; default `cpu`). A CUDA
/// device needs a build with `--features cuda`.
pub fn device() -> Device {
    let name = std::env::var("OXRL_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into());
    oxrl::model::weights::parse_device(&name).unwrap()
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// Median seconds of `reps` runs after one warm-up run.
pub fn time<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// The RAYON_NUM_THREADS setting, for labelling figures.
pub fn threads() -> String {
    std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into())
}
