//! `cargo bench --bench worker`: worker training throughput and the cost of per-token outputs.
//!
//! Model: qwen3-shaped, hidden 256, 4 layers, 4 heads of 64 (2 kv heads), MLP 1024, vocab 4096,
//! f32 on CPU (as benches/model.rs). Measures:
//! - `forward_backward` (cross_entropy, weights 1/N) + `optim_step` on 8 datums × 128 tokens in
//!   one micro-batch of 8: median ms per step and tokens/s;
//! - `forward_backward` on 64 × 512 tokens (micro-batches of 8) with
//!   `return_per_token_outputs` true vs false: the time the gate saves. Few repetitions (each
//!   call is tens of seconds on 2 cores): the best of `BIG_REPS`, alternating which setting runs first.
//!
//! Threads: set RAYON_NUM_THREADS.

mod common;

use std::time::Instant;

use common::{d256_model, median};
use oxrl::algo::Loss;
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

const BIG_REPS: usize = 2;

fn batch(b: usize, t: usize, seed: u32) -> Vec<Datum> {
    let tokens = |r: usize, salt: u32| -> Vec<u32> {
        (0..t)
            .map(|i| (seed.wrapping_mul(31).wrapping_add(salt).wrapping_add((r * 977 + i * 131) as u32)) % 4096)
            .collect()
    };
    let w = 1.0 / (b * t) as f32;
    (0..b).map(|r| Datum::supervised(tokens(r, 0), tokens(r, 7), vec![w; t])).collect()
}

fn main() {
    let threads = common::threads();
    let mut w = Worker::new(d256_model(0), WorkerConfig { micro_batch_size: Some(8), ..Default::default() }).unwrap();
    // The training workload of `oxrl bench train` (`oxrl::bench::workloads`).
    let small = oxrl::bench::workloads::train_batch(8, 128, 4096);
    let params = AdamParams::default();
    let ce = Loss::parse("cross_entropy", &json!({})).unwrap();
    let mut step = || {
        let t = Instant::now();
        w.forward_backward(&small, Some(&ce), false).unwrap();
        w.optim_step(&params).unwrap();
        t.elapsed().as_secs_f64()
    };
    step(); // warm-up
    let s = median((0..5).map(|_| step()).collect());
    println!(
        "threads={threads} forward_backward+optim_step 8x128 (micro-batch 8): {:.1} ms/step, {:.0} tokens/s",
        s * 1e3,
        1024.0 / s
    );

    let big = batch(64, 512, 2);
    let mut best = [f64::INFINITY; 2];
    for rep in 0..BIG_REPS {
        // Alternate which setting runs first, so that neither always pays for a cold start.
        let order = if rep % 2 == 0 { [(0, true), (1, false)] } else { [(1, false), (0, true)] };
        for (k, outputs) in order {
            let t = Instant::now();
            let out = w.forward_backward(&big, Some(&ce), outputs).unwrap();
            best[k] = best[k].min(t.elapsed().as_secs_f64());
            assert_eq!(out.loss_fn_outputs[0].logprobs.len(), if outputs { 512 } else { 0 });
            w.zero_grad();
        }
    }
    println!(
        "threads={threads} forward_backward 64x512 (micro-batch 8, best of {BIG_REPS}): per-token outputs {:.2} s, gate off {:.2} s, saved {:.1} ms ({:.2}%), {:.0} tokens/s",
        best[0],
        best[1],
        (best[0] - best[1]) * 1e3,
        100.0 * (best[0] - best[1]) / best[0],
        (64 * 512) as f64 / best[1]
    );
}
