//! The `oxrl` binary end to end on tiny models: `init-model`, `score` and `generate`, checked
//! against the library and the transformers golden fixtures, and its errors on bad input.

use crate::common;

use std::path::Path;
use std::process::{Command, Output};

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::{logprobs::target_logprobs, lora, tokenizer::Tokenizer, Arch, Transformer};
use serde_json::{json, Value};

// ---------------------------------------------------------------- helpers

fn oxrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oxrl")).args(args).output().expect("cannot run the oxrl binary")
}

/// Runs the binary, which must succeed; returns its stdout as JSON lines.
fn ok_lines(args: &[&str]) -> Vec<Value> {
    let out = oxrl(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "oxrl {args:?} failed ({}):\n{stderr}", out.status);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("oxrl {args:?}: stdout line {l:?} is not JSON: {e}"))
        })
        .collect()
}

/// Runs the binary, which must fail with a message on stderr; returns the stderr.
fn err_text(args: &[&str]) -> String {
    let out = oxrl(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "oxrl {args:?} succeeded, expected a failure; stdout:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_ne!(out.status.code(), Some(0));
    assert!(out.status.code().is_some(), "oxrl {args:?} was killed by a signal (a crash?):\n{stderr}");
    assert!(!stderr.contains("panicked"), "oxrl {args:?} panicked:\n{stderr}");
    stderr
}

#[track_caller]
fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "stderr does not mention {p:?}:\n{msg}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn fixture(arch: &str) -> String {
    fixture_dir(arch).to_str().unwrap().to_string()
}

fn load(dir: &Path) -> Transformer {
    Transformer::load(dir, DType::F32, &Device::Cpu).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap_or_else(|| panic!("{v} is not an array")).iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

/// log p(seq[i] | seq[..i]) for i ≥ 1, computed alone (no padding, no batching).
fn score_alone(m: &Transformer, seq: &[u32]) -> Vec<f32> {
    let n = seq.len();
    let logits = m.forward(&[seq.to_vec()], &[(0..n as u32).collect()], &[vec![1; n]], None).unwrap();
    let targets = Tensor::new(&seq[1..], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    target_logprobs(&logits.narrow(1, 0, n - 1).unwrap(), &targets).unwrap().squeeze(0).unwrap().to_vec1().unwrap()
}

/// The real tokens of each golden row and the index of its first real token.
fn golden_rows(g: &Golden) -> Vec<(Vec<u32>, usize)> {
    let b = g.batch();
    b.ids
        .iter()
        .zip(&b.mask)
        .map(|(ids, mask)| {
            let start = mask.iter().position(|&m| m == 1).unwrap();
            assert!(mask[start..].iter().all(|&m| m == 1), "golden rows are left-padded");
            (ids[start..].to_vec(), start)
        })
        .collect()
}

fn chat_examples(arch: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir(arch).join("chat_examples.json")).unwrap()).unwrap()
}

fn write_lines(dir: &Path, name: &str, lines: &[String]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path.to_str().unwrap().to_string()
}

// ---------------------------------------------------------------- init-model

#[test]
fn init_model_writes_loadable_models() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str], Arch, bool); 3] = [
        ("qwen3", &[], Arch::Qwen3, false),
        ("llama", &["--tie"], Arch::Llama, true),
        ("qwen2", &[], Arch::Qwen2, false),
    ];
    for (arch, extra, want_arch, tied) in cases {
        let out = tmp.path().join(arch);
        let mut args = vec![
            "init-model",
            "--arch",
            arch,
            "--hidden",
            "32",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--out",
            s(&out),
        ];
        args.extend_from_slice(extra);
        let run = oxrl(&args);
        let stderr = String::from_utf8_lossy(&run.stderr).to_string();
        assert!(run.status.success(), "init-model {arch}: {stderr}");

        let m = load(&out);
        let c = &m.config;
        assert_eq!(c.arch, want_arch);
        assert_eq!(
            (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads),
            (32, 2, 4, 2),
            "{arch}"
        );
        assert_eq!((c.head_dim, c.intermediate_size, c.vocab_size), (8, 128, 259), "{arch}");
        assert_eq!(c.max_position_embeddings, 2048);
        assert_eq!(c.tie_word_embeddings, tied, "{arch}");
        assert_eq!(c.qkv_bias, arch == "qwen2", "{arch}");
        assert_eq!(c.qk_norm, arch == "qwen3", "{arch}");
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(m.layers.len(), 2);
        // The parameter count reported equals the model's.
        assert!(stderr.contains(&format!("{} parameters", m.num_params())), "{arch}: {stderr}");
        let saved = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
        assert_eq!(saved.contains_key("lm_head.weight"), !tied, "{arch}");
        assert_eq!(saved.contains_key("model.layers.0.self_attn.q_proj.bias"), arch == "qwen2", "{arch}");
        // Random init: weights ~ N(0, 0.02²), norms 1, biases 0.
        let q: Vec<f32> = m.layers[1].attention().unwrap().q_proj.weight.flatten_all().unwrap().to_vec1().unwrap();
        let mean = q.iter().sum::<f32>() / q.len() as f32;
        let std = (q.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / q.len() as f32).sqrt();
        assert!(mean.abs() < 0.003 && (std - 0.02).abs() < 0.002, "{arch}: q_proj mean {mean} std {std}");
        assert!(m.norm.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|&x| x == 1.0));
        if let Some(b) = &m.layers[0].attention().unwrap().q_proj.bias {
            assert!(b.to_vec1::<f32>().unwrap().iter().all(|&x| x == 0.0));
        }
        // The byte-level tokenizer comes with it.
        let tok = Tokenizer::from_dir(&out).unwrap();
        assert_eq!(tok.vocab_size(), 259);
        assert_eq!(tok.eos_token_ids(), &[2]);
        let ids = tok.encode("hi there", false).unwrap();
        assert_eq!(tok.decode(&ids, true).unwrap(), "hi there");

        // The fresh model serves the other commands.
        let gen = ok_lines(&[
            "generate",
            "--model",
            s(&out),
            "--prompt",
            "hello",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
        ]);
        assert_eq!(gen.len(), 1);
        let toks = u32s(&gen[0]["tokens"]);
        assert_eq!(toks.len(), 5);
        assert!(toks.iter().all(|&t| t < 259));
    }
}

#[test]
fn init_model_is_seeded() {
    let tmp = tempfile::tempdir().unwrap();
    let init = |name: &str, seed: &str| -> Vec<u8> {
        let out = tmp.path().join(name);
        let run = oxrl(&[
            "init-model",
            "--arch",
            "llama",
            "--hidden",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--seed",
            seed,
            "--out",
            s(&out),
        ]);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        std::fs::read(out.join("model.safetensors")).unwrap()
    };
    let a = init("a", "5");
    assert_eq!(a, init("b", "5"), "same seed, different weights");
    assert_ne!(a, init("c", "6"), "different seeds, same weights");
}

#[test]
fn init_model_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let o = s(&out);
    let e = err_text(&["init-model", "--arch", "gpt2", "--out", o]);
    assert_mentions(&e, &["--arch", "gpt2"]);
    let e = err_text(&["init-model", "--vocab", "100", "--out", o]);
    assert_mentions(&e, &["--vocab", "100", "259"]);
    let e = err_text(&["init-model", "--hidden", "32", "--heads", "4", "--kv-heads", "3", "--out", o]);
    assert_mentions(&e, &["config.json", "num_key_value_heads", "3"]);
    let e = err_text(&["init-model", "--hidden", "28", "--heads", "4", "--out", o]);
    assert_mentions(&e, &["head_dim", "7"]);
    let e = err_text(&["init-model", "--dtype", "int8", "--hidden", "16", "--layers", "1", "--out", o]);
    assert_mentions(&e, &["dtype", "int8"]);
    let e = err_text(&["init-model", "--heads", "0", "--out", o]);
    assert_mentions(&e, &["--heads"]);
}

// ---------------------------------------------------------------- score

#[test]
fn score_matches_forward_and_golden() {
    let arch = "qwen3";
    let g = Golden::load(arch);
    let rows = golden_rows(&g);
    let golden_lp = g.f32_2d("target_logprobs");
    let text = "the quick brown fox";
    let text_ids: Vec<u32> = chat_examples(arch)["encode"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["text"] == text)
        .map(|e| u32s(&e["input_ids"]))
        .unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let seqs: Vec<Vec<u32>> =
        vec![rows[0].0.clone(), text_ids.clone(), vec![5], rows[2].0.clone(), vec![7, 8], rows[1].0.clone()];
    let lines = vec![
        json!({"tokens": rows[0].0}).to_string(),
        json!({"text": text}).to_string(),
        json!({"tokens": [5]}).to_string(),
        String::new(),
        json!({"tokens": rows[2].0}).to_string(),
        json!({"tokens": [7, 8]}).to_string(),
        json!({"tokens": rows[1].0}).to_string(),
    ];
    let input = write_lines(tmp.path(), "in.jsonl", &lines);
    let fix = fixture(arch);
    // Batches of 2 pad rows of different lengths together.
    let out = ok_lines(&["score", "--model", &fix, "--input", &input, "--batch-size", "2"]);
    assert_eq!(out.len(), seqs.len(), "one output line per non-blank input line");

    let m = load(&fixture_dir(arch));
    for (i, (line, seq)) in out.iter().zip(&seqs).enumerate() {
        assert_eq!(&u32s(&line["tokens"]), seq, "line {i}: tokens out of order or mis-encoded");
        let lp = line["logprobs"].as_array().unwrap();
        assert_eq!(lp.len(), seq.len(), "line {i}");
        assert!(lp[0].is_null(), "line {i}: first log-prob must be null");
        if seq.len() < 2 {
            continue;
        }
        let want = score_alone(&m, seq);
        for (j, w) in want.iter().enumerate() {
            let got =
                lp[j + 1].as_f64().unwrap_or_else(|| panic!("line {i}: logprob {} is {}", j + 1, lp[j + 1])) as f32;
            assert!(got < 0.0);
            assert!((got - w).abs() < 1e-5, "line {i}, token {}: {got} vs forward {w}", j + 1);
        }
    }
    // Golden rows against transformers.
    for (line, r) in [(0usize, 0usize), (3, 2), (5, 1)] {
        let (toks, start) = &rows[r];
        let lp = out[line]["logprobs"].as_array().unwrap();
        for j in 1..toks.len() {
            let want = golden_lp[r][start + j - 1];
            let got = lp[j].as_f64().unwrap() as f32;
            assert!((got - want).abs() < 1e-4, "golden row {r}, token {j}: {got} vs transformers {want}");
        }
    }

    // The batch size changes nothing.
    let one = ok_lines(&["score", "--model", &fix, "--input", &input, "--batch-size", "1"]);
    for (a, b) in one.iter().zip(&out) {
        assert_eq!(a["tokens"], b["tokens"]);
        for (x, y) in a["logprobs"].as_array().unwrap().iter().zip(b["logprobs"].as_array().unwrap()) {
            match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => assert!((x - y).abs() < 1e-5),
                _ => assert!(x.is_null() && y.is_null()),
            }
        }
    }
}

#[test]
fn score_reads_stdin() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["score", "--model", &fixture("llama"), "--input", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"{\"tokens\": [10, 20, 30]}\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let v: Value = serde_json::from_str(String::from_utf8(out.stdout).unwrap().trim()).unwrap();
    let want = score_alone(&load(&fixture_dir("llama")), &[10, 20, 30]);
    let lp = v["logprobs"].as_array().unwrap();
    assert!(lp[0].is_null());
    for j in 0..2 {
        assert!((lp[j + 1].as_f64().unwrap() as f32 - want[j]).abs() < 1e-5);
    }
}

#[test]
fn score_with_lora_changes_the_scores() {
    let arch = "qwen3";
    let tmp = tempfile::tempdir().unwrap();
    let seq: Vec<u32> = (0..16).map(|i| (i * 37 + 11) % 300).collect();
    let input = write_lines(tmp.path(), "in.jsonl", &[json!({"tokens": seq}).to_string()]);
    let fix = fixture(arch);
    let lora_dir = fixture_dir(arch).join("lora");
    let base = ok_lines(&["score", "--model", &fix, "--input", &input]);
    let with = ok_lines(&["score", "--model", &fix, "--lora", s(&lora_dir), "--input", &input]);

    let mut m = load(&fixture_dir(arch));
    lora::load_peft(&mut m, &lora_dir, false).unwrap();
    let want = score_alone(&m, &seq);
    let (b, w) = (base[0]["logprobs"].as_array().unwrap(), with[0]["logprobs"].as_array().unwrap());
    assert!(w[0].is_null());
    let mut max_change = 0f64;
    for j in 1..seq.len() {
        let (bj, wj) = (b[j].as_f64().unwrap(), w[j].as_f64().unwrap());
        max_change = max_change.max((bj - wj).abs());
        assert!((wj as f32 - want[j - 1]).abs() < 1e-5, "token {j}: {wj} vs forward with adapter {}", want[j - 1]);
    }
    assert!(max_change > 1e-3, "the adapter changed the scores by only {max_change}");
}

#[test]
fn score_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let fix = fixture("qwen3");
    let bad_json = write_lines(tmp.path(), "a.jsonl", &["{\"tokens\": [1, 2]}".into(), "{\"tokens\": [1, 2".into()]);
    let e = err_text(&["score", "--model", &fix, "--input", &bad_json]);
    assert_mentions(&e, &["line 2", "invalid JSON", &bad_json]);

    let no_field =
        write_lines(tmp.path(), "b.jsonl", &["".into(), "{\"tokens\": [4]}".into(), "{\"ids\": [1, 2]}".into()]);
    assert_mentions(&err_text(&["score", "--model", &fix, "--input", &no_field]), &["line 3", "tokens", "text"]);

    let bad_ids = write_lines(tmp.path(), "c.jsonl", &["{\"tokens\": [1, -2]}".into()]);
    assert_mentions(&err_text(&["score", "--model", &fix, "--input", &bad_ids]), &["line 1", "tokens"]);

    let empty = write_lines(tmp.path(), "d.jsonl", &["{\"tokens\": []}".into()]);
    assert_mentions(&err_text(&["score", "--model", &fix, "--input", &empty]), &["line 1", "empty"]);

    let out_of_range =
        write_lines(tmp.path(), "e.jsonl", &["{\"tokens\": [3, 4]}".into(), "{\"tokens\": [5, 300, 6]}".into()]);
    assert_mentions(
        &err_text(&["score", "--model", &fix, "--input", &out_of_range]),
        &["line 2", "token id 300", "vocab_size 300"],
    );

    let long: Vec<u32> = vec![5; 257];
    let too_long = write_lines(tmp.path(), "f.jsonl", &[json!({"tokens": long}).to_string()]);
    assert_mentions(
        &err_text(&["score", "--model", &fix, "--input", &too_long]),
        &["line 1", "257", "max_position_embeddings"],
    );

    let missing_input = tmp.path().join("nope.jsonl");
    assert_mentions(
        &err_text(&["score", "--model", &fix, "--input", s(&missing_input)]),
        &[s(&missing_input), "cannot open"],
    );

    let ok_input = write_lines(tmp.path(), "g.jsonl", &["{\"tokens\": [3, 4]}".into()]);
    let missing_model = tmp.path().join("no-model");
    assert_mentions(
        &err_text(&["score", "--model", s(&missing_model), "--input", &ok_input]),
        &[s(&missing_model), "config.json"],
    );

    let missing_lora = tmp.path().join("no-lora");
    assert_mentions(
        &err_text(&["score", "--model", &fix, "--lora", s(&missing_lora), "--input", &ok_input]),
        &[s(&missing_lora), "adapter_config.json"],
    );
    assert_mentions(
        &err_text(&["score", "--model", &fix, "--input", &ok_input, "--dtype", "int4"]),
        &["dtype", "int4"],
    );
    assert_mentions(
        &err_text(&["score", "--model", &fix, "--input", &ok_input, "--batch-size", "0"]),
        &["--batch-size"],
    );
}

// ---------------------------------------------------------------- generate

#[test]
fn generate_greedy_equals_transformers() {
    for arch in ARCHS {
        let (prompt, want) = Golden::load(arch).greedy();
        assert_eq!(want.len(), 12);
        let p = ids_arg(&prompt);
        let out = ok_lines(&[
            "generate",
            "--model",
            &fixture(arch),
            "--prompt-tokens",
            &p,
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--ignore-eos",
        ]);
        assert_eq!(out.len(), 1, "{arch}");
        assert_eq!(u32s(&out[0]["tokens"]), want, "{arch}: greedy tokens differ from transformers");
        assert_eq!(out[0]["stop_reason"], "length", "{arch}");
        // Greedy log-probs are the model's own.
        let m = load(&fixture_dir(arch));
        let seq: Vec<u32> = prompt.iter().chain(&want).copied().collect();
        let lp = score_alone(&m, &seq);
        let got = out[0]["logprobs"].as_array().unwrap();
        assert_eq!(got.len(), 12);
        for (i, x) in got.iter().enumerate() {
            let w = lp[prompt.len() - 1 + i];
            assert!((x.as_f64().unwrap() as f32 - w).abs() < 1e-4, "{arch}: greedy logprob {i}: {x} vs {w}");
        }
        // The text is the tokenizer's decoding of the tokens.
        let tok = Tokenizer::from_dir(&fixture_dir(arch)).unwrap();
        assert_eq!(out[0]["text"], tok.decode(&want, true).unwrap());
    }
}

#[test]
fn generate_sampling_is_seeded() {
    let fix = fixture("qwen2");
    let args = |seed: &str, n: &str| -> Vec<Value> {
        ok_lines(&[
            "generate",
            "--model",
            &fix,
            "--prompt-tokens",
            "10,20,30",
            "--max-tokens",
            "10",
            "--temperature",
            "0.9",
            "--top-k",
            "50",
            "--top-p",
            "0.95",
            "--seed",
            seed,
            "--n",
            n,
            "--ignore-eos",
        ])
    };
    let a = args("7", "1");
    assert_eq!(a, args("7", "1"), "same seed, different output");
    assert_eq!(a.len(), 1);
    assert_eq!(u32s(&a[0]["tokens"]).len(), 10);
    let b = args("8", "1");
    assert_ne!(a[0]["tokens"], b[0]["tokens"], "seeds 7 and 8 gave the same tokens");

    let three = args("7", "3");
    assert_eq!(three.len(), 3, "--n 3 prints 3 lines");
    for line in &three {
        assert_eq!(u32s(&line["tokens"]).len(), 10);
        assert_eq!(line["logprobs"].as_array().unwrap().len(), 10);
        assert_eq!(line["stop_reason"], "length");
        assert!(line["logprobs"].as_array().unwrap().iter().all(|x| x.as_f64().unwrap() <= 0.0));
    }
    // Row i draws from seed + i, whatever else is in the batch.
    assert_eq!(three[0]["tokens"], a[0]["tokens"]);
    assert_eq!(three[1]["tokens"], b[0]["tokens"]);
    assert_ne!(three[1]["tokens"], three[2]["tokens"]);
}

#[test]
fn generate_from_text_and_chat_prompts() {
    let arch = "qwen3";
    let fix = fixture(arch);
    let ex = chat_examples(arch);
    let greedy = |extra: &[&str]| -> Value {
        let mut args = vec!["generate", "--model", &fix, "--max-tokens", "6", "--temperature", "0", "--ignore-eos"];
        args.extend_from_slice(extra);
        let out = ok_lines(&args);
        assert_eq!(out.len(), 1);
        assert_eq!(u32s(&out[0]["tokens"]).len(), 6);
        out[0].clone()
    };
    // --chat renders the user message with the generation prompt.
    let chat = ex["chat"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["add_generation_prompt"] == true && c["messages"].as_array().unwrap().len() == 1)
        .unwrap();
    let content = chat["messages"][0]["content"].as_str().unwrap();
    let with_chat = greedy(&["--prompt", content, "--chat"]);
    let by_ids = greedy(&["--prompt-tokens", &ids_arg(&u32s(&chat["input_ids"]))]);
    assert_eq!(with_chat, by_ids);
    // Plain --prompt encodes the text as the tokenizer does.
    let enc = &ex["encode"][0];
    let plain = greedy(&["--prompt", enc["text"].as_str().unwrap()]);
    assert_eq!(plain, greedy(&["--prompt-tokens", &ids_arg(&u32s(&enc["input_ids"]))]));
    assert_ne!(plain["tokens"], with_chat["tokens"]);
}

#[test]
fn generate_stops_at_eos() {
    let fix = fixture("qwen3");
    let run = |ignore: bool| -> Vec<Value> {
        let mut args = vec![
            "generate",
            "--model",
            &fix,
            "--prompt-tokens",
            "5,6,7",
            "--max-tokens",
            "60",
            "--seed",
            "1",
            "--n",
            "16",
        ];
        if ignore {
            args.push("--ignore-eos");
        }
        ok_lines(&args)
    };
    let stopping = run(false);
    let ignoring = run(true);
    assert_eq!(stopping.len(), 16);
    let mut stopped = 0;
    for (row, (a, b)) in stopping.iter().zip(&ignoring).enumerate() {
        let toks = u32s(&a["tokens"]);
        let full = u32s(&b["tokens"]);
        assert_eq!(b["stop_reason"], "length");
        assert_eq!(full.len(), 60);
        match a["stop_reason"].as_str().unwrap() {
            "stop" => {
                stopped += 1;
                assert_eq!(*toks.last().unwrap(), 2, "row {row}: stopped without EOS");
                assert!(!toks[..toks.len() - 1].contains(&2), "row {row}: EOS before the end");
                assert!(toks.len() < 60);
            }
            "length" => {
                assert_eq!(toks.len(), 60, "row {row}");
                assert!(!toks.contains(&2), "row {row}: EOS generated but not stopped at");
            }
            other => panic!("row {row}: stop_reason {other}"),
        }
        // The same draws up to the stop; --ignore-eos goes on past it.
        assert_eq!(&full[..toks.len()], &toks[..], "row {row}");
        assert_eq!(a["logprobs"].as_array().unwrap().len(), toks.len());
    }
    assert!(stopped > 0 && stopped < 16, "this seed should stop some rows and not others; {stopped} of 16 stopped");
}

#[test]
fn generate_errors() {
    let fix = fixture("qwen3");
    let g = |extra: &[&str]| -> String {
        let mut args = vec!["generate", "--model", &fix, "--max-tokens", "4"];
        args.extend_from_slice(extra);
        err_text(&args)
    };
    assert_mentions(&g(&["--prompt-tokens", "5,300,7"]), &["token id 300", "vocab_size 300"]);
    assert_mentions(&g(&["--prompt-tokens", "5,6", "--temperature", "-1"]), &["temperature", "-1"]);
    assert_mentions(&g(&["--prompt-tokens", "5,6", "--temperature=-0.5"]), &["temperature", "-0.5"]);
    assert_mentions(&g(&["--prompt-tokens", "5,6", "--top-p", "0"]), &["top_p"]);
    assert_mentions(&g(&["--prompt-tokens", "5,6", "--n", "0"]), &["--n"]);
    assert_mentions(&g(&["--prompt-tokens", "5,x"]), &["--prompt-tokens", "x"]);
    assert_mentions(&g(&[]), &["--prompt"]);
    assert_mentions(
        &err_text(&["generate", "--model", &fix, "--prompt-tokens", "5,6", "--max-tokens", "255"]),
        &["prompt length 2", "max_tokens 255", "max_position_embeddings 256"],
    );

    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing-model");
    assert_mentions(
        &err_text(&["generate", "--model", s(&missing), "--prompt-tokens", "5"]),
        &[s(&missing), "config.json"],
    );

    // A model without a tokenizer cannot take a text prompt, and says why.
    let bare = tmp.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir("qwen3").join(f), bare.join(f)).unwrap();
    }
    assert_mentions(&err_text(&["generate", "--model", s(&bare), "--prompt", "hi"]), &["--prompt", "tokenizer.json"]);
    // ... but token ids work, stopping at config.json's EOS.
    let out = ok_lines(&[
        "generate",
        "--model",
        s(&bare),
        "--prompt-tokens",
        "5,6",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
    ]);
    assert_eq!(out.len(), 1);
}

#[test]
fn generate_reports_a_corrupt_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer_config.json"] {
        std::fs::copy(fixture_dir("qwen3").join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("tokenizer.json"), "{ not json").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["generate", "--model"])
        .arg(dir.path())
        .args(["--prompt-tokens", "5,6", "--max-tokens", "2", "--temperature", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("tokenizer.json"), "{stderr}");
}
