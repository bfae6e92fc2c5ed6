//! Tenants sharing one `oxrl serve` process (a real one): a key that saturates sampling does not
//! make another key's small request wait behind its queue, nor ride its batch's steps.

use crate::common;
use crate::server_hostile::serve;
use crate::server_protocol::{post_as, result_as};

use std::time::{Duration, Instant};

use serde_json::{json, Value};

fn sample_body(samples: usize, max_tokens: usize, seed: u64) -> Value {
    json!({
        "base_model": "tiny",
        "num_samples": samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [72, 105, 33, 32]}]},
        // `stop: []`: no stop at EOS, so every sample runs to max_tokens.
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stop": []}
    })
}

/// One sampling request of `key`, awaited: its latency.
fn sample(port: u16, key: &str, body: Value) -> Duration {
    let t = Instant::now();
    let r = post_as(port, key, "asample", body);
    assert_eq!(r.status, 200, "{}", r.body);
    let out = result_as(port, key, r.body["request_id"].as_str().unwrap());
    assert!(out.get("error").is_none(), "{out}");
    t.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Key A saturates the engine (8 concurrent requests of 64 samples × 254 tokens) while key B
/// samples 8 tokens: B's request goes to the engine's priority lane, whose steps take turns with
/// A's batch by time, so its tokens cost its own small steps rather than A's. The bound, from
/// the issue, is B's median latency beside A within twice its median alone plus one decode step
/// of the saturated engine (A's time over its decode steps), all measured here; it holds on a
/// quiet machine, but B's HTTP path shares the cores with A's engine thread, and on a loaded
/// one (the suite's tests side by side) it takes up to two steps more: asserted with a margin
/// of three steps. (Riding A's batch, B took 8 of A's steps and more; waiting behind A's queue,
/// hundreds.)
#[test]
fn a_saturating_tenant_does_not_delay_a_small_one() {
    let dir = tempfile::tempdir().unwrap();
    common::tiny_byte_model(&dir.path().join("tiny"), 64, 512, 7);
    let server = serve(dir.path(), &[]);
    let port = server.port;
    let small = |i: u64| sample_body(1, 8, i);
    sample(port, "k2", small(0)); // the engine is loaded at the first sample
    let solo = median((1..=9).map(|i| sample(port, "k2", small(i))).collect());

    let (requests, samples, tokens) = (8u64, 64usize, 254usize);
    let start = Instant::now();
    let a: Vec<String> = (0..requests)
        .map(|i| {
            let r = post_as(port, "k1", "asample", sample_body(samples, tokens, 100 + i));
            assert_eq!(r.status, 200, "{}", r.body);
            r.body["request_id"].as_str().unwrap().to_string()
        })
        .collect();
    let a_done = std::thread::spawn(move || {
        for id in &a {
            let out = result_as(port, "k1", id);
            assert!(out.get("error").is_none(), "{out}");
        }
        start.elapsed()
    });
    std::thread::sleep(Duration::from_millis(500));
    let loaded: Vec<Duration> = (1..=9).map(|i| sample(port, "k2", small(10 + i))).collect();
    let b_end = start.elapsed();
    let a_time = a_done.join().unwrap();
    assert!(b_end < a_time, "A finished ({a_time:?}) before B's samples did ({b_end:?}): A did not saturate");
    // A's requests run one after the other (one key holds at most --max-samples rows): its
    // decode steps are its requests × tokens (its time also holds B's lane steps: a step so
    // measured is, if anything, longer than A's).
    let step = a_time / (requests as u32 * tokens as u32);
    let loaded = median(loaded);
    let steps_over = (loaded.as_secs_f64() - 2.0 * solo.as_secs_f64()) / step.as_secs_f64();
    println!(
        "fairness: B alone {solo:?}, B beside A {loaded:?} (ratio {:.2}); A {a_time:?} = {step:?} per decode step; \
         B beside A = 2 × alone + {steps_over:.2} steps (the issue's bound: 1)",
        loaded.as_secs_f64() / solo.as_secs_f64()
    );
    assert!(steps_over <= 4.0, "B beside A took {loaded:?}, over 2 × {solo:?} + 4 steps of {step:?}");
    assert!(loaded * 10 < a_time, "B beside A took {loaded:?}, a tenth of A's {a_time:?} or more");
}
