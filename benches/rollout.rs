//! `cargo bench --bench rollout`: the sampling engine's decode throughput and weight-swap time.
//!
//! Model: qwen3-shaped, hidden 256, 4 layers, 4 heads of 64 (2 kv heads), MLP 1024, vocab 4096,
//! f32 on CPU (as benches/model.rs). Measures (median of several runs):
//! - decoding with the engine at 1, 16 and 64 concurrent requests (prompt 16 tokens, 32 new
//!   tokens each, greedy, continuous batching: requests admitted in the first step), against
//!   recomputing the full forward of the whole sequence at every step (no cache), same run;
//! - taking a `SamplerWeights` snapshot (the private copy engines get) of full weights and of
//!   LoRA adapters (rank 8, all linear projections);
//! - swapping weights in a running engine: a full update and a LoRA-only update, on the core and
//!   through the engine thread (pause keep + update + resume, each a handle waited on).
//!
//! Threads: set RAYON_NUM_THREADS (candle's CPU matmul uses it; the engine thread's pool is
//! sized by rayon's default, which follows it).

mod common;

use oxrl::bench::workloads::{self, NEW_TOKENS as NEW, PROMPT_LEN as PROMPT};
use oxrl::model::lora::{self, LoraConfig};
use oxrl::model::{SamplerWeights, Transformer};
use oxrl::rollout::{Engine, EngineConfig, EngineCore, PauseMode, WeightUpdate};

use common::{d256_model as model, time};

fn prompt(r: usize) -> Vec<u32> {
    workloads::prompt(r, PROMPT, 4096)
}

/// The decoding workload of `oxrl bench decode` (`oxrl::bench::workloads::decode`).
fn engine_decode(m: &Transformer, c: usize) {
    let greedy = oxrl::rollout::SamplingParams { temperature: 0.0, ..Default::default() };
    assert_eq!(workloads::decode(m, c, PROMPT, NEW, &greedy).unwrap().tokens, c * NEW);
}

/// Greedy decoding that recomputes the whole sequence each step.
fn uncached_decode(m: &Transformer, c: usize) {
    let mut ids: Vec<Vec<u32>> = (0..c).map(prompt).collect();
    for _ in 0..NEW {
        let n = ids[0].len();
        let pos: Vec<Vec<u32>> = (0..c).map(|_| (0..n as u32).collect()).collect();
        let logits = m.forward(&ids, &pos, &vec![vec![1; n]; c], None).unwrap();
        let next: Vec<u32> =
            logits.narrow(1, n - 1, 1).unwrap().squeeze(1).unwrap().argmax(1).unwrap().to_vec1().unwrap();
        for (row, x) in ids.iter_mut().zip(next) {
            row.push(x);
        }
    }
}

fn main() {
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into());
    let m = model(0);
    for c in workloads::CONCURRENCY {
        let cached = time(3, || engine_decode(&m, c));
        let uncached = time(1, || uncached_decode(&m, c));
        let toks = (c * NEW) as f64;
        println!(
            "threads={threads} decode {c:>2} concurrent: engine {:.0} tokens/s, no cache {:.0} tokens/s ({:.1}x)",
            toks / cached,
            toks / uncached,
            uncached / cached
        );
    }

    let new = model(1);
    let mut with = new.clone();
    let cfg = LoraConfig::new(8, 16.0, &["all-linear"]);
    lora::attach_new(&mut with, &cfg, 3).unwrap();
    let t_full = time(5, || drop(SamplerWeights::snapshot(&new, None, 1).unwrap()));
    let t_lora = time(5, || drop(SamplerWeights::snapshot(&with, Some(&cfg), 1).unwrap()));
    println!("threads={threads} snapshot (private copy): full {:.2} ms, lora r8 {:.2} ms", t_full * 1e3, t_lora * 1e3);
    let full_weights = SamplerWeights::snapshot(&new, None, 1).unwrap();
    let lora_weights = SamplerWeights::snapshot(&with, Some(&cfg), 1).unwrap();
    let (full, lora_update): (&WeightUpdate, &WeightUpdate) = (full_weights.update(), lora_weights.update());
    let mut e = EngineCore::new(m.clone(), EngineConfig::default()).unwrap();
    let mut v = 0;
    for (name, u) in [("full", full), ("lora r8", lora_update)] {
        let t = time(10, || {
            v += 1;
            e.update_weights(u, v).unwrap()
        });
        println!("threads={threads} weight swap ({name}) on the core: {:.2} ms", t * 1e3);
    }
    let engine = Engine::start(m.clone(), EngineConfig { threads: 0, ..Default::default() }).unwrap();
    let t = time(10, || {
        engine.pause(PauseMode::Keep).wait().unwrap();
        engine.update_weights(&full_weights).wait().unwrap();
        engine.resume().wait().unwrap();
    });
    println!(
        "threads={threads} weight swap (full) through the engine thread, pause keep + update + resume: {:.2} ms",
        t * 1e3
    );
    let params: usize = m.named_params().iter().map(|(_, t)| t.elem_count()).sum();
    println!("(model: {:.1} M parameters, {:.1} MB in f32)", params as f64 / 1e6, params as f64 * 4.0 / 1e6);
}
