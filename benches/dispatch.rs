//! `cargo bench --bench dispatch`: forward_backward throughput at dp = 2 against dp = 1, same
//! global batch (16 × 128 tokens), qwen3-shaped 4-layer d256 model (as in benches/model.rs).
//! Each data-parallel rank is an actor thread with its own tensor-math pool of RAYON_NUM_THREADS
//! threads (rayon's default when unset: one per core); run with RAYON_NUM_THREADS=1 so each
//! rank's matmuls use one core (dp = 2 then uses both cores), and with 2 to compare against
//! dp = 1 using both cores inside its matmuls.

use std::sync::Arc;
use std::time::Instant;

mod common;

use oxrl::algo::Loss;
use oxrl::dispatch::mesh::MeshShape;
use oxrl::dispatch::WorkerGroup;
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

fn build_worker() -> oxrl::Result<Worker> {
    Worker::new(common::d256_model(0), WorkerConfig { micro_batch_size: Some(8), ..Default::default() })
}

fn batch(n: usize, t: usize) -> Vec<Datum> {
    (0..n)
        .map(|r| {
            let seq: Vec<u32> = (0..t).map(|i| ((r * 977 + i * 131) % 4096) as u32).collect();
            let targets: Vec<u32> = seq[1..].iter().copied().chain([0]).collect();
            Datum::supervised(seq, targets, vec![1.0 / (n * t) as f32; t])
        })
        .collect()
}

fn main() {
    let threads = common::threads();
    let data = batch(16, 128);
    let tokens = (16 * 128) as f64;
    let ce = Loss::parse("cross_entropy", &json!({})).unwrap();
    let mut base = None;
    for dp in [1usize, 2] {
        // Threads per rank 0: rayon's default for each rank's pool (RAYON_NUM_THREADS if set).
        let g = WorkerGroup::new("policy", MeshShape::dp(dp), 0, Arc::new(|_| build_worker())).unwrap();
        let run = || {
            let fb = g.submit_forward_backward(&data, Some(&ce), false);
            let step = g.submit_optim_step(AdamParams::default());
            fb.wait().unwrap();
            step.wait().unwrap();
        };
        run(); // warm-up
        let mut times: Vec<f64> = (0..3)
            .map(|_| {
                let t = Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(|a, b| a.total_cmp(b));
        let t = times[1];
        let speedup = base.map(|b: f64| b / t).unwrap_or(1.0);
        base.get_or_insert(t);
        println!("threads={threads} dp={dp}: {:.0} ms per step (fwd+bwd+adam, 16x128), {:.0} tokens/s, {speedup:.2}x vs dp=1", t * 1e3, tokens / t);
    }
}
