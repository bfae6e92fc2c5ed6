//! `oxrl bench` end to end on the tiny qwen3 fixture: one JSON line per measurement with the
//! documented fields, mixed-precision training, and clear errors on bad arguments. Timings are
//! not checked (benchmarks are not tests); `save-model` is checked in the library (`bench::model`).

use crate::common;

use std::process::Output;

use common::*;
use serde_json::Value;

fn oxrl(args: &[&str]) -> Output {
    oxrl_command().args(args).output().expect("cannot run the oxrl binary")
}

fn lines(args: &[&str]) -> Vec<Value> {
    let out = oxrl(args);
    assert!(out.status.success(), "oxrl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn bench_train_and_decode_print_one_json_line_per_measurement() {
    let model = fixture_dir("qwen3");
    let model = model.to_str().unwrap();
    let quick = ["--model", model, "--reps", "2", "--warmup", "0"];
    for dtype in ["f32", "bf16"] {
        let train = lines(&[&["bench", "train", "--dtype", dtype, "--batch", "2", "--seq", "8"][..], &quick].concat());
        assert_eq!(train.len(), 1);
        let r = &train[0];
        assert_eq!(
            (r["bench"].as_str(), r["dtype"].as_str(), r["threads"].as_u64()),
            (Some("train"), Some(dtype), Some(1))
        );
        assert_eq!(r["master_weights"].as_bool(), Some(dtype == "bf16"));
        assert!(r["median_ms"].as_f64().unwrap() > 0.0 && r["tokens_per_s"].as_f64().unwrap() > 0.0);
        // Two AdamW steps on one batch lower its loss.
        assert!(r["last_loss"].as_f64().unwrap() < r["first_loss"].as_f64().unwrap(), "{r}");
    }
    let decode = lines(&[&["bench", "decode", "--batch", "1,3", "--new-tokens", "4"][..], &quick].concat());
    let batches: Vec<u64> = decode.iter().map(|r| r["batch"].as_u64().unwrap()).collect();
    assert_eq!(batches, [1, 3]);
    assert!(decode.iter().all(|r| r["bench"] == "decode" && r["tokens_per_s"].as_f64().unwrap() > 0.0));
    // The FLOP rates: the projections' multiply-adds × 2 per token, from the fixture's shape.
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir("qwen3").join("config.json")).unwrap()).unwrap();
    let c = |k: &str| cfg[k].as_u64().unwrap() as f64;
    let hd = cfg["head_dim"].as_u64().map_or(c("hidden_size") / c("num_attention_heads"), |d| d as f64);
    let (h, heads, kv) = (c("hidden_size"), c("num_attention_heads"), c("num_key_value_heads"));
    let per_layer = 2.0 * h * heads * hd + 2.0 * h * kv * hd + 3.0 * h * c("intermediate_size");
    let flops = 2.0 * (c("num_hidden_layers") * per_layer + h * c("vocab_size"));
    // A prefill that scores nothing: every layer but the last, and the last one's k and v.
    let prefill = 2.0 * ((c("num_hidden_layers") - 1.0) * per_layer + 2.0 * h * kv * hd);
    for r in &decode {
        let f = |k: &str| r[k].as_f64().unwrap();
        let tokens = f("batch") * 4.0;
        assert!((f("gflops") - tokens * flops / (f("median_ms") / 1e3) / 1e9).abs() < 1e-9 * f("gflops"), "{r}");
        // 16 prompt tokens (the default), 15 prefilled per request.
        let computed = (tokens * flops + f("batch") * 15.0 * prefill) / (f("median_ms") / 1e3) / 1e9;
        assert!((f("computed_gflops") - computed).abs() < 1e-9 * computed, "{r}");
        let later = (tokens - f("batch")) * flops / (f("later_steps_ms") / 1e3) / 1e9;
        assert!((f("later_steps_gflops") - later).abs() < 1e-9 * later, "{r}");
        assert!(f("first_step_ms") > 0.0 && f("first_step_ms") + f("later_steps_ms") <= f("median_ms") * 1.5, "{r}");
    }
    // Sampled with top-k and top-p: every request still generates its tokens.
    let sampled = lines(
        &[
            &[
                "bench",
                "decode",
                "--batch",
                "2",
                "--new-tokens",
                "3",
                "--temperature",
                "1",
                "--top-k",
                "5",
                "--top-p",
                "0.9",
            ][..],
            &quick,
        ]
        .concat(),
    );
    assert_eq!((sampled[0]["top_k"].as_u64(), sampled[0]["top_p"].as_f64()), (Some(5), Some(0.9)));
    // 2 requests × 3 tokens.
    let generated = sampled[0]["gflops"].as_f64().unwrap() * sampled[0]["median_ms"].as_f64().unwrap() * 1e6 / flops;
    assert!((generated - 6.0).abs() < 1e-9, "{}", sampled[0]);
    // The GEMM reference: 2·N³ FLOPs per product.
    let gemm = lines(&["bench", "gemm", "--size", "64,96", "--reps", "2"]);
    assert_eq!(gemm.iter().map(|r| r["size"].as_u64().unwrap()).collect::<Vec<_>>(), [64, 96]);
    for r in &gemm {
        let n = r["size"].as_f64().unwrap();
        let want = 2.0 * n * n * n / (r["median_ms"].as_f64().unwrap() / 1e3) / 1e9;
        assert!((r["gflops"].as_f64().unwrap() - want).abs() < 1e-9 * want, "{r}");
    }
}

/// `bench memory`: the measured peak of each process and the per-rank prediction, which
/// activation checkpointing lowers only in its activations, sharding in its optimizer state, and
/// `full` in its parameters (and, a rank's step being one micro-batch or its micro-batches summed
/// as they come, its gradients) too.
#[test]
fn bench_memory_prints_the_peak_beside_the_prediction() {
    let model = fixture_dir("qwen3");
    let run = |extra: &[&str]| {
        let base =
            ["bench", "memory", "--model", model.to_str().unwrap(), "--batch", "2", "--seq", "16", "--reps", "1"];
        let out = lines(&[&base[..], extra].concat());
        assert_eq!(out.len(), 1);
        out[0].clone()
    };
    let (all, ckpt) = (run(&["--ranks", "2"]), run(&["--ranks", "2", "--activation-checkpointing"]));
    for r in [&all, &ckpt] {
        assert_eq!((r["bench"].as_str(), r["ranks_per_process"].as_u64()), (Some("memory"), Some(2)), "{r}");
        let m = &r["measured_per_process"][0];
        assert!(m["peak_rss_gb"].as_f64().unwrap() >= m["rss_loaded_gb"].as_f64().unwrap(), "{r}");
        let p = &r["predicted_per_rank_gb"];
        let sum: f64 = ["params", "grads", "optimizer", "activations"].iter().map(|k| p[k].as_f64().unwrap()).sum();
        assert!((p["total"].as_f64().unwrap() - sum).abs() < 1e-12, "{r}");
        assert!((r["predicted_per_process_gb"].as_f64().unwrap() - 2.0 * sum).abs() < 1e-12, "{r}");
        // Fixed seed and tokens: both settings train the same loss.
        assert_eq!(r["last_loss"], all["last_loss"]);
    }
    let (pa, pc) = (&all["predicted_per_rank_gb"], &ckpt["predicted_per_rank_gb"]);
    assert_eq!((&pa["params"], &pa["optimizer"]), (&pc["params"], &pc["optimizer"]));
    assert!(pc["activations"].as_f64().unwrap() < pa["activations"].as_f64().unwrap());
    // Sharded, each rank holds (and is predicted) half of the optimizer state; the same loss.
    let sharded = run(&["--ranks", "2", "--sharding", "gradients"]);
    assert_eq!(sharded["last_loss"], all["last_loss"]);
    let held = |r: &serde_json::Value| -> Vec<f64> {
        r["measured_per_process"][0]["optimizer_gb_per_rank"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g.as_f64().unwrap())
            .collect()
    };
    let (whole, halves) = (held(&all), held(&sharded));
    assert_eq!((whole.len(), halves.len()), (2, 2));
    assert!(whole[0] > 0.0 && whole[0] == whole[1], "{all}");
    assert!((halves[0] + halves[1] - whole[0]).abs() < 1e-12 * whole[0].max(1.0), "{sharded}");
    assert!(halves.iter().all(|h| (h / (whole[0] / 2.0) - 1.0).abs() < 0.1), "{sharded}");
    let ps = &sharded["predicted_per_rank_gb"];
    assert_eq!(ps["optimizer"].as_f64().unwrap(), pa["optimizer"].as_f64().unwrap() / 2.0);
    // `full`: the parameters too, measured and predicted.
    let full = run(&["--ranks", "2", "--sharding", "full"]);
    assert_eq!(full["last_loss"], all["last_loss"]);
    let params = |r: &serde_json::Value| -> Vec<f64> {
        let per_rank = r["measured_per_process"][0]["param_gb_per_rank"].as_array().unwrap();
        per_rank.iter().map(|g| g.as_f64().unwrap()).collect()
    };
    let (whole, halves) = (params(&all), params(&full));
    assert!(whole[0] > 0.0 && whole[0] == whole[1], "{all}");
    assert!((halves[0] + halves[1] - whole[0]).abs() < 1e-12 * whole[0], "{full}");
    assert!(halves.iter().all(|h| (h / (whole[0] / 2.0) - 1.0).abs() < 0.1), "{full}");
    assert_eq!(params(&sharded), whole, "{sharded}");
    let pf = &full["predicted_per_rank_gb"];
    assert_eq!(pf["params"].as_f64().unwrap(), pa["params"].as_f64().unwrap() / 2.0);
    // One micro-batch a rank: the gradients are summed to their owners during the backward.
    assert_eq!(pf["grads"].as_f64().unwrap(), pa["grads"].as_f64().unwrap() / 2.0);
    assert_eq!(ps["grads"], pa["grads"], "{sharded}");
    // Two micro-batches a rank: summed at the step, every gradient is whole until then; summed
    // after each micro-batch, `full` keeps its half; the loss is the same to rounding.
    let two = ["--ranks", "2", "--sharding", "full", "--micro-batch-size", "1"];
    let (at_step, each) = (run(&two), run(&[&two[..], &["--gradient-sum", "micro_batch"]].concat()));
    assert_eq!(
        (at_step["micro_batches_per_rank"].as_u64(), each["gradient_sum"].as_str()),
        (Some(2), Some("micro_batch"))
    );
    let grads = |r: &serde_json::Value| r["predicted_per_rank_gb"]["grads"].as_f64().unwrap();
    assert_eq!(grads(&at_step), grads(&all), "{at_step}");
    assert_eq!(grads(&each), grads(&all) / 2.0, "{each}");
    let (l0, l1) = (at_step["last_loss"].as_f64().unwrap(), each["last_loss"].as_f64().unwrap());
    assert!((l0 - l1).abs() <= 1e-6 * l0.abs(), "{l0} against {l1}");
}

#[test]
fn bench_rejects_bad_arguments_clearly() {
    for (args, needle) in [
        (&["bench", "train", "--dtype", "fp8"][..], "--dtype `fp8`: expected f32 or bf16"),
        (&["bench", "train", "--pure-bf16"][..], "--pure-bf16 needs --dtype bf16"),
        (&["bench", "decode", "--model", "/nonexistent/model"][..], "/nonexistent/model"),
        (&["bench", "decode", "--top-p", "0"][..], "top_p must be in (0, 1]"),
        (&["bench", "gemm", "--size", "0"][..], "--size must be at least 1"),
        (&["bench", "memory", "--model", "m", "--sharding", "optimiser"][..], "did you mean `optimizer`?"),
        (&["bench", "memory", "--model", "m", "--ranks", "0"][..], "must be positive"),
        (&["bench", "memory", "--model", "m", "--gradient-sum", "microbatch"][..], "did you mean `micro_batch`?"),
    ] {
        let out = oxrl(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(needle) && !stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
