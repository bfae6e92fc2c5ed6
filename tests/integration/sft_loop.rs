//! The SFT loop end to end on the tiny fixture model: the loss against a hand computation,
//! bit-exact resume, exported models (HF and PEFT) that score like the in-memory one, bad input.

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::fixture_dir;
use oxrl::launch::sft_dispatch;
use oxrl::model::{logprobs::target_logprobs, lora, tokenizer::Tokenizer, Transformer};
use oxrl::trainer::metrics::read_metrics;
use oxrl::trainer::run_dir::EXPORT_DIR;
use oxrl::trainer::sft::SftSummary;
use oxrl::trainer::RunOptions;
use oxrl::trainer::SftConfig;
use oxrl::worker::{Datum, Worker, WorkerConfig};
use serde_json::json;

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hello, world!"},{"role":"assistant","content":"the answer is 42"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"def add(a, b)"},{"role":"assistant","content":"return a + b"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
];

fn write_data(dir: &Path, rows: &[&str]) -> PathBuf {
    let p = dir.join("data.jsonl");
    std::fs::write(&p, rows.join("\n") + "\n").unwrap();
    p
}

/// One run as the CLI does it: a fresh dispatch built from the config (one tensor-math thread
/// per rank), then the loop.
fn run_sft(cfg: &SftConfig, opts: &RunOptions) -> oxrl::Result<SftSummary> {
    let dispatch = sft_dispatch(cfg, Some(1))?;
    oxrl::trainer::sft::run_sft(cfg, &dispatch, opts)
}

fn config(dir: &Path, data: &Path, run: &str, extra: &[&str]) -> SftConfig {
    let mut extra = extra.to_vec();
    let run_dir = format!("output.run_dir={:?}", dir.join(run).display().to_string());
    extra.push(&run_dir);
    config_with_model(dir, data, &fixture_dir("qwen3"), &extra)
}

fn config_with_model(dir: &Path, data: &Path, model: &Path, extra: &[&str]) -> SftConfig {
    let mut sets: Vec<String> = vec![
        format!("model.path={:?}", model.display().to_string()),
        format!("data.train_file={:?}", data.display().to_string()),
        format!("output.run_dir={:?}", dir.join("run").display().to_string()),
        "optimizer.lr=0.01".into(),
        "train.batch_size=2".into(),
        "train.micro_batch_size=1".into(),
        "train.eval_every=0".into(),
        "schedule.warmup_steps=1".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    SftConfig::load(None, &sets).unwrap()
}

#[test]
fn first_step_loss_equals_a_hand_computation() {
    let dir = tempfile::tempdir().unwrap();
    let data = write_data(dir.path(), &ROWS[..2]);
    let cfg = config(dir.path(), &data, "run", &["train.max_steps=1", "data.shuffle_seed=3"]);
    run_sft(&cfg, &RunOptions::default()).unwrap();
    let logged = read_metrics(&dir.path().join("run/metrics.jsonl")).unwrap()[0].loss;

    // By hand: render each conversation, train on the assistant reply and its <|im_end|>.
    let tok = Tokenizer::from_dir(&fixture_dir("qwen3")).unwrap();
    let model = Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu).unwrap();
    let (mut nll, mut n) = (0.0f64, 0usize);
    for row in &ROWS[..2] {
        let v: serde_json::Value = serde_json::from_str(row).unwrap();
        let msgs = v["messages"].as_array().unwrap().clone();
        let full = tok.encode_chat(&msgs, false, None).unwrap();
        let prompt = tok.encode_chat(&msgs[..msgs.len() - 1], true, None).unwrap();
        let reply = tok.encode(msgs.last().unwrap()["content"].as_str().unwrap(), false).unwrap();
        assert_eq!(&full[..prompt.len()], &prompt[..]);
        let trained = prompt.len()..prompt.len() + reply.len() + 1; // reply + <|im_end|>
        assert_eq!(full[trained.end - 1], 2, "<|im_end|> is trained");
        let t = full.len();
        let logits =
            model.forward(std::slice::from_ref(&full), &[(0..t as u32).collect()], &[vec![1; t]], None).unwrap();
        let targets = Tensor::new(&full[1..], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let lp: Vec<f32> = target_logprobs(&logits.narrow(1, 0, t - 1).unwrap(), &targets)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        for pos in trained {
            nll -= lp[pos - 1] as f64; // token `pos` is predicted at position pos - 1
            n += 1;
        }
    }
    let want = nll / n as f64;
    assert!((logged - want).abs() < 1e-5, "logged loss {logged} vs hand computation {want}");
}

fn file_bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn interrupted_and_resumed_run_ends_bit_identical() {
    for lora in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let data = write_data(dir.path(), ROWS);
        let mut extra = vec!["train.max_steps=7", "train.data_parallel=2", "train.checkpoint_every=2"];
        if lora {
            extra.extend(["model.lora.rank=4", "model.lora.alpha=8"]);
        }
        let whole = config(dir.path(), &data, "whole", &extra);
        let s = run_sft(&whole, &RunOptions::default()).unwrap();
        assert_eq!((s.steps, s.interrupted), (7, false));

        let parts = config(dir.path(), &data, "parts", &extra);
        let s = run_sft(&parts, &RunOptions { stop_after: Some(3), ..Default::default() }).unwrap();
        assert_eq!((s.steps, s.interrupted, s.export_dir.is_none()), (3, true, true));
        let err = run_sft(&parts, &RunOptions::default()).unwrap_err().to_string();
        assert!(err.contains("--resume"), "{err}");
        let s = run_sft(&parts, &RunOptions { resume: true, ..Default::default() }).unwrap();
        assert_eq!(s.steps, 7);

        let file = if lora { "adapter_model.safetensors" } else { "model.safetensors" };
        let a = file_bytes(&dir.path().join("whole").join(EXPORT_DIR).join(file));
        let b = file_bytes(&dir.path().join("parts").join(EXPORT_DIR).join(file));
        assert!(a == b, "lora={lora}: resumed run differs from the uninterrupted one");
        // The run did train: the export differs from the start.
        let m = read_metrics(&dir.path().join("parts/metrics.jsonl")).unwrap();
        assert_eq!(m.iter().map(|x| x.step).collect::<Vec<_>>(), (1..=7).collect::<Vec<_>>());
        assert!(m[6].loss < m[0].loss, "lora={lora}: loss did not fall: {} -> {}", m[0].loss, m[6].loss);
    }
}

/// Log-probs of `seq` under a worker built from a checkpoint (the in-memory model of the run).
fn worker_logprobs(run: &Path, lora_rank: usize, seq: &[u32]) -> Vec<f32> {
    let model = Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu).unwrap();
    let lora = (lora_rank > 0).then(|| lora::LoraConfig::new(lora_rank, 8.0, &["q_proj", "v_proj"]));
    let mut w = Worker::new(model, WorkerConfig { lora, ..Default::default() }).unwrap();
    let (_, ckpt) = oxrl::trainer::run_dir::latest_checkpoint(run).unwrap().unwrap();
    w.load_state(&ckpt.join("policy")).unwrap();
    let targets: Vec<u32> = seq[1..].iter().copied().chain([0]).collect();
    let out = w.forward(&[Datum::supervised(seq.to_vec(), targets, vec![1.0; seq.len()])], None, true).unwrap();
    out.loss_fn_outputs[0].logprobs[..seq.len() - 1].to_vec()
}

fn oxrl_score(model: &Path, lora: Option<&Path>, seq: &[u32]) -> Vec<f32> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, json!({ "tokens": seq }).to_string()).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_oxrl"));
    cmd.args(["score", "--model"]).arg(model).arg("--input").arg(&input);
    if let Some(l) = lora {
        cmd.arg("--lora").arg(l);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["logprobs"].as_array().unwrap()[1..].iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

#[test]
fn exported_models_score_like_the_in_memory_one() {
    let seq: Vec<u32> = vec![1, 275, 262, 201, 89, 74, 292, 282, 223, 287, 2, 201];
    for lora_rank in [0usize, 4] {
        let dir = tempfile::tempdir().unwrap();
        let data = write_data(dir.path(), ROWS);
        let mut extra = vec!["train.max_steps=3".to_string()];
        if lora_rank > 0 {
            extra.extend([
                "model.lora.rank=4".into(),
                "model.lora.alpha=8".into(),
                r#"model.lora.targets=["q_proj","v_proj"]"#.into(),
            ]);
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let cfg = config(dir.path(), &data, "run", &extra);
        let s = run_sft(&cfg, &RunOptions::default()).unwrap();
        let export = s.export_dir.unwrap();
        let in_memory = worker_logprobs(&s.run_dir, lora_rank, &seq);
        let scored = if lora_rank > 0 {
            // A PEFT adapter: config fields as PEFT writes them, loadable onto the base.
            let c: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(export.join("adapter_config.json")).unwrap()).unwrap();
            assert_eq!(
                (c["peft_type"].as_str(), c["r"].as_u64(), c["lora_alpha"].as_f64()),
                (Some("LORA"), Some(4), Some(8.0))
            );
            oxrl_score(&fixture_dir("qwen3"), Some(&export), &seq)
        } else {
            // A full model in the HF layout, with its tokenizer beside it.
            assert!(export.join("tokenizer.json").exists() && export.join("config.json").exists());
            oxrl_score(&export, None, &seq)
        };
        // The worker's forward (the tape) and `oxrl score` (the candle graph) sum in different
        // orders: equal to float rounding.
        assert_eq!(scored.len(), in_memory.len());
        for (a, b) in scored.iter().zip(&in_memory) {
            assert!((a - b).abs() < 1e-5, "lora rank {lora_rank}: exported model scores differently: {a} vs {b}");
        }
        let base = oxrl_score(&fixture_dir("qwen3"), None, &seq);
        assert_ne!(scored, base, "training changed nothing");
    }
}

#[test]
fn bad_rows_and_bad_configs_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let data = write_data(
        dir.path(),
        &[ROWS[0], "{not json", ROWS[1], r#"{"messages":[{"role":"wizard","content":"x"}]}"#, ROWS[2]],
    );
    let cfg = config(dir.path(), &data, "run", &["train.max_steps=1"]);
    let err = run_sft(&cfg, &RunOptions::default()).unwrap_err().to_string();
    assert!(err.contains("data.jsonl:2"), "{err}");
    let cfg = config(dir.path(), &data, "run2", &["train.max_steps=1", "data.on_bad_row=\"skip\""]);
    let s = run_sft(&cfg, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 1);
    let sets = vec!["optimizer.learning_rate=1e-3".to_string()];
    let err = SftConfig::load(None, &sets).unwrap_err().to_string();
    assert!(err.contains("optimizer.learning_rate") && err.contains("valid keys here") && err.contains("lr"), "{err}");
    let err = SftConfig::load(None, &["optimizer.lrr=1e-3".to_string()]).unwrap_err().to_string();
    assert!(err.contains("optimizer.lrr") && err.contains("did you mean `optimizer.lr`"), "{err}");
}

#[test]
fn ctrl_c_saves_a_checkpoint_that_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let data = write_data(dir.path(), ROWS);
    let cfg_path = dir.path().join("sft.toml");
    let run = dir.path().join("run");
    std::fs::write(
        &cfg_path,
        format!(
            "[model]\npath = {:?}\n[data]\ntrain_file = {:?}\n[train]\nbatch_size = 2\nmicro_batch_size = 1\nmax_steps = 100000\neval_every = 0\n[output]\nrun_dir = {:?}\n",
            fixture_dir("qwen3").display().to_string(),
            data.display().to_string(),
            run.display().to_string()
        ),
    )
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_oxrl");
    let child = std::process::Command::new(bin)
        .args(["sft", "--config"])
        .arg(&cfg_path)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a few steps, then interrupt as Ctrl-C would.
    let metrics = run.join("metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(&metrics).map(|s| s.lines().count()).unwrap_or(0) < 3 {
        assert!(std::time::Instant::now() < deadline, "no progress within 60 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let status = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an interrupted run exits non-zero");
    assert!(stderr.contains("interrupted at step"), "{stderr}");
    let (step, _) = oxrl::trainer::run_dir::latest_checkpoint(&run).unwrap().expect("a checkpoint");
    let lines = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert!(step >= 3 && step == lines, "checkpoint at step {step}, {lines} metric lines");
    // It resumes from there (a shorter max_steps ends the run at once) and exports.
    let out = std::process::Command::new(bin)
        .args(["sft", "--resume", "--config"])
        .arg(&cfg_path)
        .args(["--set", &format!("train.max_steps={}", step + 1)])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("resumed from"));
    assert!(run.join(EXPORT_DIR).join("model.safetensors").exists());
}

#[test]
fn max_length_beyond_the_model_context_truncates_at_the_context() {
    let dir = tempfile::tempdir().unwrap();
    // The qwen3 fixture with a 24-position context: most rendered rows are longer.
    let model = dir.path().join("short");
    std::fs::create_dir(&model).unwrap();
    for f in std::fs::read_dir(fixture_dir("qwen3")).unwrap() {
        let f = f.unwrap();
        if f.file_type().unwrap().is_file() {
            std::fs::copy(f.path(), model.join(f.file_name())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(24);
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let data = write_data(dir.path(), ROWS);
    let mut cfg = config_with_model(dir.path(), &data, &model, &["train.max_steps=2", "data.max_length=4096"]);
    cfg.data.eval_fraction = 0.0;
    let s = run_sft(&cfg, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 2);
    assert!(s.final_loss.is_finite());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// A checkpoint written before each trainer kept its own part of `trainer_state.json`
/// (`tests/fixtures/checkpoints/sft_lora_step3`: these settings with LoRA and max_steps 3, written by
/// `oxrl sft` on 2026-11-26; its state still holds the `kl_coef` the run directory then wrote for
/// every trainer) resumes to 7 steps exactly as a checkpoint written now does.
#[test]
fn a_checkpoint_written_before_the_state_split_resumes_as_one_written_now() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoints/sft_lora_step3");
    let old_state: serde_json::Value =
        serde_json::from_slice(&file_bytes(&fixture.join("checkpoints/step_000003/trainer_state.json"))).unwrap();
    assert_eq!(old_state["kl_coef"], json!(0.0), "the fixture is not in the old format");
    let dir = tempfile::tempdir().unwrap();
    let data = write_data(dir.path(), ROWS);
    let settings = |steps: &'static str| {
        vec![steps, "train.data_parallel=2", "train.checkpoint_every=2", "model.lora.rank=4", "model.lora.alpha=8"]
    };
    // Now: 3 steps, then resumed to 7.
    run_sft(&config(dir.path(), &data, "now", &settings("train.max_steps=3")), &RunOptions::default()).unwrap();
    let now_ckpt = dir.path().join("now/checkpoints/step_000003");
    for f in ["policy/adapter_model.safetensors", "policy/optimizer.safetensors"] {
        assert!(file_bytes(&now_ckpt.join(f)) == file_bytes(&fixture.join("checkpoints/step_000003").join(f)), "{f}");
    }
    let new_state: serde_json::Value =
        serde_json::from_slice(&file_bytes(&now_ckpt.join("trainer_state.json"))).unwrap();
    assert_eq!((&new_state["step"], &new_state["loader"]), (&old_state["step"], &old_state["loader"]));
    assert!(new_state.get("kl_coef").is_none(), "SFT's state has no KL coefficient: {new_state}");
    std::fs::remove_dir_all(dir.path().join("now").join(EXPORT_DIR)).unwrap();
    let resume = RunOptions { resume: true, ..Default::default() };
    run_sft(&config(dir.path(), &data, "now", &settings("train.max_steps=7")), &resume).unwrap();
    // Before: the fixture's checkpoint, resumed to 7.
    copy_dir(&fixture, &dir.path().join("before"));
    let s = run_sft(&config(dir.path(), &data, "before", &settings("train.max_steps=7")), &resume).unwrap();
    assert_eq!((s.steps, s.interrupted), (7, false));
    let export = |run: &str| file_bytes(&dir.path().join(run).join(EXPORT_DIR).join("adapter_model.safetensors"));
    assert!(export("before") == export("now"), "the old checkpoint resumed differently");
    let m = read_metrics(&dir.path().join("before/metrics.jsonl")).unwrap();
    assert_eq!(m.iter().map(|x| x.step).collect::<Vec<_>>(), (1..=7).collect::<Vec<_>>());
}
