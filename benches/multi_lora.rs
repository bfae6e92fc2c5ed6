//! `cargo bench --bench multi_lora`: decoding with many LoRA adapters over one base.
//!
//! Model: the benchmark model of benches/common (qwen3-shaped, hidden 256, 4 layers, vocab 4096,
//! f32 on CPU). Workload: 64 requests (prompt 16, 32 new tokens, temperature 1, seeded), the rows
//! spread evenly over A adapters (rank 8 on every projection and lm_head), A = 1, 4, 16, all in
//! one engine (per-row adapters, one batch); baselines in the same run: the bare base model (no
//! adapter), and one engine per adapter with the adapter attached, run one after the other (what
//! the server did before: the same total work without cross-adapter batching). Tokens/s, median of
//! 3 runs after a warm-up, one thread unless RAYON_NUM_THREADS says otherwise.

mod common;

use std::sync::Arc;

use candle_core::Tensor;
use common::{d256_model, time};
use oxrl::model::lora::{self, LoraConfig};
use oxrl::model::row_adapters::Adapter;
use oxrl::model::Transformer;
use oxrl::rollout::{EngineConfig, EngineCore, Request, SamplingParams};

const REQUESTS: usize = 64;
const PROMPT: usize = 16;
const NEW: usize = 32;

fn request(r: usize, adapter: Option<String>) -> Request {
    let prompt = (0..PROMPT).map(|i| ((r * 977 + i * 131 + 7) % 4096) as u32).collect();
    let p = SamplingParams {
        max_tokens: NEW,
        temperature: 1.0,
        seed: Some(r as u64),
        ignore_eos: true,
        ..Default::default()
    };
    Request { adapter, ..Request::new(prompt, p) }
}

fn adapted(base: &Transformer, seed: u64) -> (Transformer, Arc<Adapter>) {
    let cfg = LoraConfig::new(8, 16.0, &["all-linear", "lm_head"]);
    let mut m = base.clone();
    lora::attach_new(&mut m, &cfg, seed).unwrap();
    for (_, lin) in m.linears_mut() {
        if let Some(l) = lin.lora.as_mut() {
            l.b = (Tensor::randn(0f32, 1.0, l.b.dims(), l.b.device()).unwrap() * 0.02).unwrap();
        }
    }
    let a = Arc::new(Adapter::from_model(&m, cfg).unwrap());
    (m, a)
}

fn run(e: &mut EngineCore, reqs: impl Iterator<Item = Request>) {
    for r in reqs {
        e.add_request(r).unwrap();
    }
    e.run_until_idle().unwrap();
}

fn main() {
    let base = d256_model(0);
    let cfg = EngineConfig { max_batch: REQUESTS, ..Default::default() };
    let tokens = (REQUESTS * NEW) as f64;
    let s = time(3, || {
        run(&mut EngineCore::new(base.clone(), cfg.clone()).unwrap(), (0..REQUESTS).map(|r| request(r, None)))
    });
    println!("base model, no adapter: {:.0} tokens/s", tokens / s);
    for n in [1, 4, 16] {
        let ads: Vec<_> = (0..n).map(|k| adapted(&base, k as u64)).collect();
        let one_batch = time(3, || {
            let mut e = EngineCore::new(base.clone(), cfg.clone()).unwrap();
            for (k, (_, a)) in ads.iter().enumerate() {
                e.add_adapter(&k.to_string(), a.clone());
            }
            run(&mut e, (0..REQUESTS).map(|r| request(r, Some((r % n).to_string()))));
        });
        let per_engine = time(3, || {
            for (k, (m, _)) in ads.iter().enumerate() {
                let mut e = EngineCore::new(m.clone(), cfg.clone()).unwrap();
                run(&mut e, (0..REQUESTS).filter(|r| r % n == k).map(|r| request(r, None)));
            }
        });
        println!(
            "{n:2} adapters: one batch {:.0} tokens/s, one engine per adapter {:.0} tokens/s ({:.2}x)",
            tokens / one_batch,
            tokens / per_engine,
            per_engine / one_batch
        );
    }
}
