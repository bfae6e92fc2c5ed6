//! Thread budgets per workload in one process: a sampling engine on its own 1-thread pool and a
//! trainer (one worker rank) on its own 1-thread pool, first alone, then side by side on the
//! two cores; and, as the contrast, both on 2-thread pools (oversubscribed) side by side.
//!
//! What "the hardware explains" is measured in the same run: the same two workloads side by side
//! in two separate processes (one thread each), where no thread budget is needed to keep them
//! apart. One process with two 1-thread pools should match that.
//!
//! `CANDLE_NUM_THREADS=1 cargo bench --bench thread_budgets` (leave RAYON_NUM_THREADS unset: the
//! pools decide; CANDLE_NUM_THREADS=1 keeps candle's process-wide elementwise pool out of it).

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

/// A child process of this benchmark running one workload alone (the hardware baseline).
fn child(role: &str, dir: &std::path::Path) {
    let (engine, d) = setup(1, dir);
    match role {
        "engine" => {
            generate_round(&engine, 0);
            let mut rates = vec![];
            loop {
                rates.push(generate_round(&engine, 100 + rates.len() as u64));
                println!("{}", rates.iter().sum::<f64>() / rates.len() as f64);
            }
        }
        _ => {
            train_steps(&d, 1);
            println!("{}", train_steps(&d, STEPS));
        }
    }
}

/// Both workloads in two processes at once: (engine tokens/s, trainer s/step).
fn separate_processes(dir: &std::path::Path) -> (f64, f64) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let spawn = |role: &str| {
        Command::new(std::env::current_exe().unwrap())
            .env("OXRL_BENCH_ROLE", role)
            .env("OXRL_BENCH_DIR", dir)
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut engine = spawn("engine");
    let trainer = spawn("trainer");
    let out = trainer.wait_with_output().unwrap();
    let train: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    engine.kill().unwrap();
    let lines: Vec<String> = BufReader::new(engine.stdout.take().unwrap()).lines().map_while(|l| l.ok()).collect();
    engine.wait().unwrap();
    (lines.last().and_then(|l| l.parse().ok()).unwrap_or(f64::NAN), train)
}

fn main() {
    if let (Ok(role), Ok(dir)) = (std::env::var("OXRL_BENCH_ROLE"), std::env::var("OXRL_BENCH_DIR")) {
        return child(&role, dir.as_ref());
    }
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
        if threads == 1 {
            let (gen_sep, train_sep) = separate_processes(dir.path());
            println!(
                "| two processes, 1 thread each (hardware baseline) | {gen_alone:.0} tokens/s | {:.0} ms/step | {gen_sep:.0} tokens/s ({:.2}×) | {:.0} ms/step ({:.2}×) |",
                train_alone * 1e3,
                gen_sep / gen_alone,
                train_sep * 1e3,
                train_alone / train_sep,
            );
        }
    }
}
