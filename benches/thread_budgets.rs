//! Thread budgets per workload in one process: a sampling engine on its own 1-thread pool and a
//! trainer (one worker rank) on its own 1-thread pool, first alone, then side by side on the
//! two cores; and, as the contrast, both on 2-thread pools (oversubscribed) side by side.
//!
//! `cargo bench --bench thread_budgets` (leave RAYON_NUM_THREADS unset: the pools decide).

mod common;

use std::time::Instant;

use candle_core::DType;
use common::d256_model;
use oxrl::dispatch::{Dispatch, WorkerSpec};
use oxrl::rollout::{Engine, EngineConfig, Request, SamplingParams};
use oxrl::worker::{AdamParams, Datum};

const ROWS: usize = 16;
const NEW_TOKENS: usize = 64;
const STEPS: usize = 5;

/// Tokens per second of one generation round: ROWS requests of NEW_TOKENS each.
fn generate_round(engine: &Engine, seed: u64) -> f64 {
    let t = Instant::now();
    let handles: Vec<_> = (0..ROWS)
        .map(|i| {
            let params = SamplingParams {
                max_tokens: NEW_TOKENS,
                temperature: 1.0,
                seed: Some(seed + i as u64),
                ignore_eos: true,
                ..Default::default()
            };
            engine.submit(Request::new((1..17).map(|x| (x * 7 + i as u32) % 4000 + 1).collect(), params))
        })
        .collect();
    for h in handles {
        h.wait().unwrap();
    }
    (ROWS * NEW_TOKENS) as f64 / t.elapsed().as_secs_f64()
}

/// Seconds per training step (forward_backward 8 × 128 + AdamW).
fn train_steps(d: &Dispatch, n: usize) -> f64 {
    let ce = oxrl::algo::Loss::parse("cross_entropy", &serde_json::Value::Null).unwrap();
    let batch: Vec<Datum> = (0..8)
        .map(|r| {
            let seq: Vec<u32> = (0..128).map(|i| ((r * 131 + i * 17) % 4000) as u32 + 1).collect();
            Datum::supervised(seq.clone(), seq[1..].iter().copied().chain([0]).collect(), vec![1.0 / 1024.0; 128])
        })
        .collect();
    let t = Instant::now();
    for _ in 0..n {
        d.forward_backward("policy", &batch, Some(&ce), false).unwrap();
        d.optim_step("policy", &AdamParams::default()).unwrap();
    }
    t.elapsed().as_secs_f64() / n as f64
}

fn setup(threads: usize, dir: &std::path::Path) -> (Engine, Dispatch) {
    let model = d256_model(0);
    let engine = Engine::start(model, EngineConfig { threads, ..Default::default() }).unwrap();
    let d = Dispatch::new(false);
    d.create_model("policy", &WorkerSpec { threads, ..WorkerSpec::new(dir) }).unwrap();
    (engine, d)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    d256_model(0).save(dir.path(), DType::F32).unwrap();
    println!("| pools | engine alone | trainer alone | engine beside trainer | trainer beside engine |");
    println!("|---|---|---|---|---|");
    for threads in [1, 2] {
        let (engine, d) = setup(threads, dir.path());
        generate_round(&engine, 0);
        train_steps(&d, 1);
        let gen_alone = (0..3).map(|k| generate_round(&engine, k)).fold(0.0, f64::max);
        let train_alone = train_steps(&d, STEPS);
        // Side by side: the engine generates rounds for as long as the trainer trains.
        let done = std::sync::atomic::AtomicBool::new(false);
        let (gen_beside, train_beside) = std::thread::scope(|s| {
            let gen = s.spawn(|| {
                let mut rates = vec![];
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    rates.push(generate_round(&engine, 100 + rates.len() as u64));
                }
                rates.iter().sum::<f64>() / rates.len() as f64
            });
            let train = train_steps(&d, STEPS);
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            (gen.join().unwrap(), train)
        });
        println!(
            "| {threads} thread{} each | {gen_alone:.0} tokens/s | {:.0} ms/step | {gen_beside:.0} tokens/s ({:.2}×) | {:.0} ms/step ({:.2}×) |",
            if threads > 1 { "s" } else { "" },
            train_alone * 1e3,
            gen_beside / gen_alone,
            train_beside * 1e3,
            train_alone / train_beside,
        );
    }
}
