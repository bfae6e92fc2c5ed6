//! Weight sync from a trained policy to a sampling engine, for the benchmark model: the
//! snapshot on the worker (`sampler_weights`: private copies) and the engine update, full
//! fine-tuning and LoRA (rank 16 on every linear).
//!
//! `cargo bench --bench weight_sync`

mod common;

use std::time::Instant;

use candle_core::DType;
use common::{d256_model, median};
use oxrl::dispatch::{Dispatch, WorkerSpec};
use oxrl::model::lora::LoraConfig;
use oxrl::rollout::{Engine, EngineConfig};
use oxrl::worker::{AdamParams, Datum, WorkerConfig};

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let model = d256_model(0);
    model.save(dir.path(), DType::F32).unwrap();
    let ce = oxrl::algo::Loss::parse("cross_entropy", &serde_json::Value::Null).unwrap();
    let datum = Datum::supervised((0..64).collect(), (1..65).collect(), vec![1.0 / 64.0; 64]);
    println!("| policy | snapshot (worker) | engine update | total | bytes moved |");
    println!("|---|---|---|---|---|");
    for lora in [None, Some(LoraConfig::new(16, 32.0, &["all-linear"]))] {
        let is_lora = lora.is_some();
        let d = Dispatch::new(false);
        let spec = WorkerSpec { worker: WorkerConfig { lora, ..Default::default() }, ..WorkerSpec::new(dir.path()) };
        d.create_model("policy", &spec).unwrap();
        let engine = Engine::start(model.clone(), EngineConfig::default()).unwrap();
        let (mut snap, mut update, mut bytes) = (vec![], vec![], 0);
        for _ in 0..6 {
            d.forward_backward("policy", std::slice::from_ref(&datum), Some(&ce), false).unwrap();
            d.optim_step("policy", &AdamParams::default()).unwrap();
            let t = Instant::now();
            let w = d.sampler_weights("policy").unwrap();
            snap.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            engine.update_weights(&w).wait().unwrap();
            update.push(t.elapsed().as_secs_f64());
            bytes = w.num_bytes();
        }
        let (s, u) = (median(snap[1..].to_vec()) * 1e3, median(update[1..].to_vec()) * 1e3);
        println!(
            "| {} | {s:.2} ms | {u:.2} ms | {:.2} ms | {:.1} MB |",
            if is_lora { "LoRA r16 all-linear" } else { "full" },
            s + u,
            bytes as f64 / 1e6
        );
    }
}
