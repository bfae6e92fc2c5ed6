//! `cargo bench --bench model`: training-step and decoding throughput of a 4-layer d256 model.
//!
//! Model: qwen3-shaped, hidden 256, 4 layers, 4 heads of 64 (2 kv heads), MLP 1024, vocab 4096,
//! f32 on CPU. Measures (median of several runs):
//! - forward + backward of Σ −log p · w on a batch of 8 × 128 tokens;
//! - greedy decoding with the KV cache at batch 1 and 16 (prefill 16 tokens, then 64 steps), and
//!   the same decode without a cache (full forward every step) as a baseline in the same run.
//!
//! Threads: set RAYON_NUM_THREADS (candle's CPU matmul uses it); the figures in BENCHMARKS.md
//! name the count used.

mod common;

use candle_core::{Device, Tensor};
use common::{d256_model, threads, time};
use oxrl::model::{logprobs::target_logprobs, Transformer};

fn batch(b: usize, t: usize, seed: u32) -> Vec<Vec<u32>> {
    (0..b)
        .map(|r| (0..t).map(|i| (seed.wrapping_mul(31).wrapping_add((r * 977 + i * 131) as u32)) % 4096).collect())
        .collect()
}

fn train_step(m: &Transformer, vars: &[(String, candle_core::Var)]) {
    let (b, t) = (8, 128);
    let ids = batch(b, t, 1);
    let pos: Vec<Vec<u32>> = (0..b).map(|_| (0..t as u32).collect()).collect();
    let mask = vec![vec![1u8; t]; b];
    let logits = m.forward(&ids, &pos, &mask, None).unwrap();
    let targets = Tensor::new(batch(b, t, 2).concat(), &Device::Cpu).unwrap().reshape((b, t)).unwrap();
    let loss = (target_logprobs(&logits, &targets).unwrap().sum_all().unwrap() * (-1.0 / (b * t) as f64)).unwrap();
    let grads = loss.backward().unwrap();
    assert!(grads.get(vars[0].1.as_tensor()).is_some());
}

fn decode(m: &Transformer, b: usize, steps: usize, use_cache: bool) {
    let prompt = 16;
    let mut ids = batch(b, prompt, 3);
    let mut cache = m.new_cache();
    let pos =
        |from: usize, to: usize| -> Vec<Vec<u32>> { (0..b).map(|_| (from as u32..to as u32).collect()).collect() };
    let mut logits = m.forward(&ids, &pos(0, prompt), &vec![vec![1; prompt]; b], Some(&mut cache)).unwrap();
    for s in 0..steps {
        let t = logits.dim(1).unwrap();
        let next: Vec<u32> =
            logits.narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap().argmax(1).unwrap().to_vec1().unwrap();
        let n = prompt + s;
        if use_cache {
            let step: Vec<Vec<u32>> = next.iter().map(|&x| vec![x]).collect();
            logits = m.forward(&step, &pos(n, n + 1), &vec![vec![1]; b], Some(&mut cache)).unwrap();
        } else {
            for (row, &x) in ids.iter_mut().zip(&next) {
                row.push(x);
            }
            logits = m.forward(&ids, &pos(0, n + 1), &vec![vec![1; n + 1]; b], None).unwrap();
        }
    }
}

fn main() {
    let threads = threads();
    let mut m = d256_model(0);
    let vars = m.make_trainable().unwrap();
    let step = time(5, || train_step(&m, &vars));
    println!("threads={threads} train fwd+bwd 8x128: {:.1} ms/step, {:.0} tokens/s", step * 1e3, 1024.0 / step);
    let inf = d256_model(0);
    let steps = 64;
    for b in [1, 16] {
        let cached = time(3, || decode(&inf, b, steps, true));
        let uncached = time(1, || decode(&inf, b, steps, false));
        println!(
            "threads={threads} decode batch {b}: KV cache {:.0} tokens/s, no cache {:.0} tokens/s ({:.1}x)",
            (b * steps) as f64 / cached,
            (b * steps) as f64 / uncached,
            uncached / cached
        );
    }
}
