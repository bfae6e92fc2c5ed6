//! `cargo bench --bench kernels [matmul|attention|sampler]`: the CPU kernels one at a time, on
//! one thread (figures in BENCHMARKS.md).
//!
//! - matmul: GFLOP/s of candle's matmul and of `matmul_wt`'s small-rows, panel and packed kernels
//!   on the benchmark model's shapes; "cold W": the weights read from beyond L2, as in a decode
//!   step (32 MiB of weights in turn). Needs AVX-512.
//! - attention: µs per call of the candle path and the fused `cached_attention` on the benchmark
//!   model's attention (H 4, KV 2, D 64), for query blocks of T after `past` cached positions
//!   (past 0: a prefill), k and v views of [B, KV, capacity, D] buffers as the cache hands out;
//!   "hot": one cache read again and again, "cold": 32 MiB of caches in turn.
//! - sampler: µs per sampled token over a 152k vocabulary, a flat row (a random model's: the
//!   nucleus is most of the row) and a peaked one (a trained model's), greedy and at T = 1 with
//!   top-k / top-p.

use candle_core::{Device, Tensor};
use oxrl::model::ops::cached_attention::{cached_attention, reference as attention_reference};
use oxrl::model::ops::matmul_panel;
use oxrl::model::ops::matmul_wt::{reference as matmul_reference, run, small_rows, xwt_packed, Packed};
use oxrl::model::transformer::attention_bias;
use oxrl::rollout::sampler::{sample, SamplingParams};
use rand::{rngs::StdRng, SeedableRng};

fn main() {
    let which: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let wanted = |name: &str| which.is_empty() || which.iter().any(|w| w == name);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a thread pool");
    pool.install(|| {
        if wanted("matmul") {
            matmul();
        }
        if wanted("attention") {
            attention();
        }
        if wanted("sampler") {
            sampler();
        }
    });
}

fn matmul() {
    if !std::arch::is_x86_feature_detected!("avx512f") {
        println!("matmul: skipped (no AVX-512)");
        return;
    }
    for m in [1, 8, 16, 32, 64, 128, 960] {
        for (n, k) in [(256, 256), (1024, 256), (256, 1024), (4096, 256)] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            let (xv, wv) = (
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let reps = (200_000_000 / (m * n * k)).max(3);
            let time = |f: &mut dyn FnMut()| {
                f();
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    f();
                }
                2.0 * (m * n * k) as f64 * reps as f64 / t.elapsed().as_secs_f64() / 1e9
            };
            let g = time(&mut || {
                matmul_reference(&x, &w).unwrap();
            });
            let mut y: Vec<f32> = Vec::with_capacity(m * n);
            // The small-rows kernel takes at most 15 rows (NaN: not run).
            let small = m < matmul_panel::MIN_ROWS;
            let mut d = f64::NAN;
            if small {
                d = time(&mut || run(small_rows, &xv, &wv, y.spare_capacity_mut(), m, n, k));
            }
            let p = time(&mut || run(matmul_panel::kernel, &xv, &wv, y.spare_capacity_mut(), m, n, k));
            let packed = Packed::new(&wv, n, k);
            let pk = time(&mut || {
                xwt_packed(&xv, &packed, m).unwrap();
            });
            // As in a decode step: W comes from L3 or memory (32 MiB of weights in turn).
            let cold: Vec<Vec<f32>> = (0..(8 << 20) / (n * k) + 1).map(|_| wv.clone()).collect();
            let mut c = 0;
            let pc = time(&mut || {
                c = (c + 1) % cold.len();
                run(matmul_panel::kernel, &xv, &cold[c], y.spare_capacity_mut(), m, n, k)
            });
            let mut dc = f64::NAN;
            if small {
                dc = time(&mut || {
                    c = (c + 1) % cold.len();
                    run(small_rows, &xv, &cold[c], y.spare_capacity_mut(), m, n, k)
                });
            }
            let cold_packed: Vec<Packed> = cold.iter().map(|w| Packed::new(w, n, k)).collect();
            let pkc = time(&mut || {
                c = (c + 1) % cold.len();
                xwt_packed(&xv, &cold_packed[c], m).unwrap();
            });
            println!(
                "m {m:4} n {n:4} k {k:4}: gemm {g:6.1}  small {d:6.1} (cold W {dc:6.1})  panel {p:6.1} \
                 (cold W {pc:6.1})  packed {pk:6.1} (cold W {pkc:6.1}) GFLOP/s"
            );
        }
    }
}

fn attention() {
    let (h, kvh, d) = (4usize, 2usize, 64usize);
    for (b, past) in [(1usize, 0usize), (16, 0), (64, 0), (1, 32), (16, 32), (64, 16), (64, 40), (1, 200), (4, 1000)] {
        for t in [1, 2, 4, 8, 16, 24, 32, 48, 64] {
            let s = past + t;
            let cap = (2 * s).next_power_of_two().max(64usize);
            let q = Tensor::randn(0f32, 1.0, (b, h, t, d), &Device::Cpu).unwrap();
            let bytes = 2 * b * kvh * cap * d * 4;
            let caches: Vec<(Tensor, Tensor)> = (0..(32 << 20) / bytes + 1)
                .map(|_| {
                    let kb = Tensor::randn(0f32, 1.0, (b, kvh, cap, d), &Device::Cpu).unwrap();
                    let vb = Tensor::randn(0f32, 1.0, (b, kvh, cap, d), &Device::Cpu).unwrap();
                    (kb.narrow(2, 0, s).unwrap(), vb.narrow(2, 0, s).unwrap())
                })
                .collect();
            let mask = vec![vec![1u8; s]; b];
            let bias = attention_bias(&mask, past, t, &Device::Cpu).unwrap();
            let reps = (4_000_000 / (b * h * t * s * d)).clamp(4, 500);
            // The best of 9 rounds (the machine is shared: the minimum is the stable number).
            let time = |f: &dyn Fn(&(Tensor, Tensor)) -> Tensor, cold: bool| {
                let mut i = 0;
                (0..9)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        for _ in 0..reps {
                            i = if cold { (i + 1) % caches.len() } else { 0 };
                            f(&caches[i]);
                        }
                        start.elapsed().as_secs_f64() / reps as f64 * 1e6
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let candle = |kv: &(Tensor, Tensor)| attention_reference(&q, &kv.0, &kv.1, &bias, 0.125).unwrap();
            let fused = |kv: &(Tensor, Tensor)| cached_attention(&q, &kv.0, &kv.1, &bias, 0.125).unwrap();
            let (ch, fh) = (time(&candle, false), time(&fused, false));
            let (cc, fc) = (time(&candle, true), time(&fused, true));
            println!(
                "B {b:3} past {past:4} T {t:3}: hot candle {ch:8.1} fused {fh:8.1} µs ({:.2}x)   \
                 cold candle {cc:8.1} fused {fc:8.1} µs ({:.2}x)",
                ch / fh,
                cc / fc
            );
        }
    }
}

fn sampler() {
    let v = 151_936;
    let flat: Vec<f32> = (0..v).map(|i| ((i * 7919) % 10007) as f32 / 10007.0 * 0.5).collect();
    let peaked: Vec<f32> = (0..v).map(|i| -(((i * 7919) % 10007) as f32 / 10007.0) * 3000.0).collect();
    for (name, row) in [("flat", &flat), ("peaked", &peaked)] {
        for (t, top_k, top_p) in
            [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.0, 50, 1.0), (1.0, 0, 0.9), (1.0, 50, 0.9), (0.7, 0, 0.95)]
        {
            let p = SamplingParams { temperature: t, top_k, top_p, ..Default::default() };
            let mut rng = StdRng::seed_from_u64(0);
            let reps = 200;
            let best = (0..5)
                .map(|_| {
                    let start = std::time::Instant::now();
                    for _ in 0..reps {
                        sample(row, &p, &mut rng).unwrap();
                    }
                    start.elapsed().as_secs_f64() / reps as f64 * 1e6
                })
                .fold(f64::INFINITY, f64::min);
            println!("{name:6} T {t} top_k {top_k:3} top_p {top_p}: {best:8.1} µs");
        }
    }
}
