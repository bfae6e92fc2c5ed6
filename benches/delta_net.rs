//! `cargo bench --bench delta_net [-- --threads N --reps R --batch B --seq T]`: one Gated
//! DeltaNet layer of Qwen3.5-0.8B's shape (16 key and 16 value heads of 128, conv kernel 4), f32,
//! on B × T tokens (default 4 × 512): the layer's kernels between its projections as training
//! runs them (`delta_net::forward` recorded, `delta_net::backward`), and the recurrence alone,
//! forward and backward, token by token (`delta_net::recurrence` and `recurrence_backward`, the
//! order training and decoding use) against the chunked WY form (`delta_net_chunked`), a rayon
//! task per (row, value head) for both.
//! Repetitions alternate between the two orders, so a load change on a shared machine falls on
//! both; prints one JSON line per measure (milliseconds, min and median).

use std::time::Instant;

use oxrl::model::delta_net::{self, Dims, Params};
use oxrl::model::delta_net_chunked;
use oxrl::model::model_config::DeltaNetConfig;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().expect("a number"))
}

fn stats(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(|a, b| a.total_cmp(b));
    (ms[0], ms[ms.len() / 2])
}

fn main() {
    let (threads, reps, rows, t) = (arg("--threads", 2), arg("--reps", 3), arg("--batch", 4), arg("--seq", 512));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
    pool.install(|| run(threads, reps, rows, t));
}

fn run(threads: usize, reps: usize, rows: usize, t: usize) {
    let cfg = DeltaNetConfig {
        num_key_heads: 16,
        num_value_heads: 16,
        key_head_dim: 128,
        value_head_dim: 128,
        conv_kernel: 4,
    };
    let (cd, vd, nv, dk, dv, kk) =
        (cfg.conv_dim(), cfg.value_dim(), cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, cfg.conv_kernel);
    let mut rng = StdRng::seed_from_u64(7);
    let mut rand = |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| rng.random_range(-scale..scale)).collect() };
    let n = rows * t;
    let (qkv, z, a, b) = (rand(n * cd, 1.0), rand(n * vd, 1.0), rand(n * nv, 1.0), rand(n * nv, 1.0));
    let (conv, a_log, dt_bias, norm) = (rand(cd * kk, 0.5), rand(nv, 0.5), rand(nv, 0.5), rand(dv, 1.0));
    let d_out = rand(n * vd, 1.0);
    let p = Params { conv: &conv, a_log: &a_log, dt_bias: &dt_bias, norm: &norm, eps: 1e-6 };
    let mask = vec![vec![1u8; t]; rows];
    let dims = Dims { b: rows, t, cfg };

    // The recurrence's inputs per (row, value head), contiguous: unit-norm q (·1/√dk) and k,
    // g ≤ 0, β in (0, 1), as the layer's gates make them.
    let heads: Vec<[Vec<f32>; 5]> = (0..rows * nv)
        .map(|_| {
            let mut unit = |scale: f32| -> Vec<f32> {
                (0..t)
                    .flat_map(|_| {
                        let x = rand(dk, 1.0);
                        let r = x.iter().map(|v| v * v).sum::<f32>().sqrt();
                        x.into_iter().map(move |v| v / r * scale)
                    })
                    .collect()
            };
            let (q, k) = (unit(1.0 / (dk as f32).sqrt()), unit(1.0));
            let v = rand(t * dv, 1.0);
            let g = rand(t, 0.25).into_iter().map(|x| x - 0.25).collect();
            let beta = rand(t, 0.45).into_iter().map(|x| x + 0.5).collect();
            [q, k, v, g, beta]
        })
        .collect();
    // One order's forward (keeping the state every 64 tokens, what its backward reads) and
    // backward over every (row, value head); the milliseconds of each and a checksum.
    let recurrence = |chunked: bool| -> (f64, f64, f32) {
        let start = Instant::now();
        let fwd: Vec<(Vec<f32>, f32)> = heads
            .par_iter()
            .map(|[q, k, v, g, beta]| {
                let (mut s, mut o, mut kept) = (vec![0.0f32; dk * dv], vec![0.0f32; t * dv], vec![]);
                if chunked {
                    delta_net_chunked::forward_kept(&mut s, q, k, v, g, beta, &mut o, Some(&mut kept));
                } else {
                    for st in (0..t).step_by(64) {
                        let e = (st + 64).min(t);
                        kept.extend_from_slice(&s);
                        let (qs, ks, vs) = (&q[st * dk..e * dk], &k[st * dk..e * dk], &v[st * dv..e * dv]);
                        delta_net::recurrence(&mut s, qs, ks, vs, &g[st..e], &beta[st..e], &mut o[st * dv..e * dv]);
                    }
                }
                (kept, o.iter().sum::<f32>())
            })
            .collect();
        let forward_ms = start.elapsed().as_secs_f64() * 1e3;
        let start = Instant::now();
        let sums: Vec<f32> = heads
            .par_iter()
            .zip(&fwd)
            .map(|([q, k, v, g, beta], (kept, o_sum))| {
                let d_o = &v[..]; // any [t, dv] gradient; the same for both orders
                let dq = if chunked {
                    let mut d_s = vec![0.0f32; dk * dv];
                    delta_net_chunked::backward(kept, q, k, v, g, beta, d_o, &mut d_s).q
                } else {
                    delta_net::recurrence_backward(kept, q, k, v, g, beta, d_o).0
                };
                o_sum + dq.iter().sum::<f32>()
            })
            .collect();
        (forward_ms, start.elapsed().as_secs_f64() * 1e3, sums.iter().sum())
    };

    let (mut fwd, mut bwd) = (vec![], vec![]);
    let (mut tok_f, mut tok_b, mut chk_f, mut chk_b) = (vec![], vec![], vec![], vec![]);
    let (mut sum_tok, mut sum_chk) = (0.0, 0.0);
    // One untimed pass of each warms the allocator and the caches.
    recurrence(false);
    recurrence(true);
    for _ in 0..reps {
        let start = Instant::now();
        let mut state = vec![0.0f32; rows * delta_net::state_len(&cfg)];
        let (_, rec) = delta_net::forward(&qkv, &z, &a, &b, &p, &mask, &mut state, dims, true);
        fwd.push(start.elapsed().as_secs_f64() * 1e3);
        let rec = rec.expect("recorded");
        let start = Instant::now();
        let g = delta_net::backward(&qkv, &z, &a, &b, &p, &rec, &d_out, dims);
        bwd.push(start.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(g);
        let (f, b, s) = recurrence(false);
        tok_f.push(f);
        tok_b.push(b);
        sum_tok = s;
        let (f, b, s) = recurrence(true);
        chk_f.push(f);
        chk_b.push(b);
        sum_chk = s;
    }
    let line = |name: &str, ms: Vec<f64>| {
        let (min, median) = stats(ms);
        println!(
            "{{\"bench\":\"delta_net\",\"measure\":\"{name}\",\"batch\":{rows},\"seq\":{t},\"threads\":{threads},\
             \"reps\":{reps},\"min_ms\":{min:.1},\"median_ms\":{median:.1}}}"
        );
        median
    };
    let f = line("layer_forward_recorded", fwd);
    let bk = line("layer_backward", bwd);
    let (tf, tb) =
        (line("recurrence_token_by_token_forward", tok_f), line("recurrence_token_by_token_backward", tok_b));
    let (cf, cb) = (line("recurrence_chunked_forward", chk_f), line("recurrence_chunked_backward", chk_b));
    eprintln!(
        "medians: token by token / chunked = {:.2}x forward, {:.2}x backward, {:.2}x both; the token-by-token \
         recurrence = {:.0} % of the layer's forward + backward ({:.0} ms); checksums {sum_tok:.3} / {sum_chk:.3}",
        tf / cf,
        tb / cb,
        (tf + tb) / (cf + cb),
        100.0 * (tf + tb) / (f + bk),
        f + bk
    );
}
