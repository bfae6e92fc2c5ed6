//! What the benchmarks share: the reference model shape and a timing helper.
#![allow(dead_code)]

use std::time::Instant;

use candle_core::{DType, Device};
use oxrl::model::config::{Arch, ModelConfig, ModelShape};
use oxrl::model::{init, Transformer};

/// The benchmark model of the issues: qwen3-shaped, hidden 256, 4 layers, 4 heads of 64
/// (2 kv heads), MLP 1024, vocab 4096, f32 on CPU (or on [`device`]).
pub fn d256_config() -> ModelConfig {
    let shape = ModelShape {
        vocab_size: 4096,
        hidden_size: 256,
        intermediate_size: 1024,
        num_layers: 4,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        rope_theta: 10000.0,
        max_position_embeddings: 1024,
        tie_word_embeddings: false,
    };
    ModelConfig::from_value(ModelConfig::new_json(Arch::Qwen3, &shape), "bench".as_ref()).unwrap()
}

pub fn d256_model(seed: u64) -> Transformer {
    init::random_model(d256_config(), seed, DType::F32, &device()).unwrap()
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
