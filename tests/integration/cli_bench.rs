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
}

#[test]
fn bench_rejects_bad_arguments_clearly() {
    for (args, needle) in [
        (&["bench", "train", "--dtype", "fp8"][..], "--dtype `fp8`: expected f32 or bf16"),
        (&["bench", "train", "--pure-bf16"][..], "--pure-bf16 needs --dtype bf16"),
        (&["bench", "decode", "--model", "/nonexistent/model"][..], "/nonexistent/model"),
    ] {
        let out = oxrl(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(needle) && !stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
