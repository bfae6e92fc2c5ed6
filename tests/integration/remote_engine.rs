//! An engine in a process of its own (`oxrl engine`, spawned by this test binary) samples what
//! an engine in this process does, bit for bit — before and after full and LoRA weight pushes —
//! and sync and async RL on it train what RL on an engine here does.

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};

use candle_core::{DType, Device};
use oxrl::model::weight_update::WeightUpdate;
use oxrl::model::{lora, tokenizer::Tokenizer, NamedTensors, SamplerWeights, Transformer};
use oxrl::rollout::{Engine, EngineClient, EngineConfig, RemoteEngine, Request, RequestOutput, SamplingParams};
use oxrl::trainer::rl::run_rl;
use oxrl::trainer::{RlConfig, RunOptions};

/// `oxrl engine` on a free port, killed when dropped.
pub struct EngineProcess {
    child: Child,
    pub url: String,
}

impl EngineProcess {
    pub fn start(model: &Path, extra: &[&str]) -> EngineProcess {
        Self::start_at(model, "127.0.0.1:0", extra)
    }

    /// On `listen` (`host:port`).
    pub fn start_at(model: &Path, listen: &str, extra: &[&str]) -> EngineProcess {
        let mut child = common::oxrl_command()
            .arg("engine")
            .arg("--model")
            .arg(model)
            .args(["--listen", listen])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().expect("oxrl engine ended before listening").unwrap();
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        // Keep draining its stderr so that it never blocks on a full pipe; the test's output
        // (shown when it fails) keeps it.
        std::thread::spawn(move || lines.map_while(|l| l.ok()).for_each(|l| eprintln!("oxrl engine: {l}")));
        EngineProcess { child, url }
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn local_engine(model: &Path) -> EngineClient {
    let tok = Tokenizer::from_dir(model).unwrap();
    let config = EngineConfig {
        eos_token_ids: tok.eos_token_ids().to_vec(),
        tokenizer: Some(std::sync::Arc::new(tok)),
        ..EngineConfig::default()
    };
    EngineClient::new(vec![Engine::start(Transformer::load(model, DType::F32, &Device::Cpu).unwrap(), config).unwrap()])
        .unwrap()
}

fn remote(url: &str) -> EngineClient {
    EngineClient::over(vec![Box::new(RemoteEngine::connect(url, None).unwrap().0)]).unwrap()
}

/// Seeded requests of several prompts, each with 3 samples, prompt log-probs and top-2 lists,
/// run one after another (each alone in the engine: the same batches on both sides).
fn sample_all(engines: &EngineClient, tok: &Tokenizer) -> Vec<RequestOutput> {
    ["Hello", "The quick brown fox", "1 + 1 =", "def add(a, b):"]
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let params = SamplingParams { max_tokens: 12, seed: Some(100 + i as u64), ..SamplingParams::default() };
            let mut req = Request::new(tok.encode(text, false).unwrap(), params);
            req.num_samples = 3;
            req.prompt_logprobs = true;
            req.sample_topk = 2;
            engines.generate(req).unwrap()
        })
        .collect()
}

fn versions(outs: &[RequestOutput]) -> Vec<u64> {
    outs.iter().flat_map(|o| &o.samples).flat_map(|g| g.versions.iter().copied()).collect()
}

#[test]
fn a_remote_engine_samples_what_an_engine_here_does() {
    let model = common::fixture_dir("qwen3");
    let tok = Tokenizer::from_dir(&model).unwrap();
    let rank =
        lora::load_peft(&mut Transformer::load(&model, DType::F32, &Device::Cpu).unwrap(), &model.join("lora"), false)
            .unwrap()
            .0
            .rank;
    let process = EngineProcess::start(&model, &["--lora-rank", &rank.to_string()]);
    let (here, there) = (local_engine(&model), remote(&process.url));

    let base = sample_all(&here, &tok);
    // Float fields compare exactly (==): the same tokens, log-probs and top-k lists.
    assert_eq!(sample_all(&there, &tok), base, "the initial weights");

    // Full weights, version 1: every parameter scaled.
    let m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
    let scaled: Vec<(String, candle_core::Tensor)> =
        m.named_params().into_iter().map(|(n, t)| (n, (t * 1.05).unwrap())).collect();
    let full = SamplerWeights::new(1, WeightUpdate::Full(NamedTensors::from_vec("test", scaled).unwrap()));
    here.update_weights(&full).wait().unwrap();
    there.update_weights(&full).wait().unwrap();
    let after_full = sample_all(&here, &tok);
    assert_ne!(after_full, base, "the update changed nothing");
    assert_eq!(sample_all(&there, &tok), after_full, "after a full update");
    assert!(versions(&after_full).iter().all(|&v| v == 1));

    // LoRA adapters, version 2 (on the base weights: an adapter update replaces only adapters).
    let fresh = |engines: &EngineClient| {
        let base = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
        engines.update_weights(&SamplerWeights::snapshot(&base, None, 1).unwrap()).wait().unwrap();
    };
    fresh(&here);
    fresh(&there);
    let mut peft = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
    let (config, _) = lora::load_peft(&mut peft, &model.join("lora"), false).unwrap();
    let adapters = SamplerWeights::snapshot(&peft, Some(&config), 2).unwrap();
    here.update_weights(&adapters).wait().unwrap();
    there.update_weights(&adapters).wait().unwrap();
    let after_lora = sample_all(&here, &tok);
    assert_ne!(after_lora, base, "the adapters changed nothing");
    assert_eq!(sample_all(&there, &tok), after_lora, "after a LoRA update");
    assert!(versions(&after_lora).iter().all(|&v| v == 2));
}

#[test]
fn a_refused_push_leaves_the_old_weights_serving() {
    let model = common::fixture_dir("qwen3");
    let tok = Tokenizer::from_dir(&model).unwrap();
    let process = EngineProcess::start(&model, &[]);
    let there = remote(&process.url);
    let before = sample_all(&there, &tok);
    // A tensor of the wrong shape: refused whole, with the reason.
    let m = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
    let mut params = m.named_params();
    params[0].1 = candle_core::Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    let bad = SamplerWeights::new(7, WeightUpdate::Full(NamedTensors::from_vec("test", params).unwrap()));
    let err = there.update_weights(&bad).wait().unwrap_err().to_string();
    assert!(err.contains("shape"), "{err}");
    // Adapters to an engine started without --lora-rank: refused.
    let mut peft = Transformer::load(&model, DType::F32, &Device::Cpu).unwrap();
    let (config, _) = lora::load_peft(&mut peft, &model.join("lora"), false).unwrap();
    let err = there.update_weights(&SamplerWeights::snapshot(&peft, Some(&config), 8).unwrap()).wait().unwrap_err();
    assert!(err.to_string().contains("--lora-rank 0"), "{err}");
    let after = sample_all(&there, &tok);
    assert_eq!(after, before);
    assert!(versions(&after).iter().all(|&v| v == 0));
}

/// Sync RL on a remote engine, and async RL with `max_staleness = 0` on it (weights pushed in
/// flight, `keep` mode, over HTTP), train what sync RL on an engine here does, bit for bit.
#[test]
fn rl_on_a_remote_engine_trains_what_it_does_here() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let process = EngineProcess::start(&model, &[]);
    let completed = || RemoteEngine::connect(&process.url, None).unwrap().1.health.completed_requests;
    let run = |name: &str, extra: &[String]| {
        let cfg = rl_config(&model, &dir.path().join(name), 3, extra);
        let (dispatch, engines) = oxrl::launch::rl_runtime(&cfg, Some(1)).unwrap();
        run_rl(&cfg, &dispatch, &engines, &RunOptions::default()).unwrap();
        std::fs::read(dir.path().join(name).join("final/model.safetensors")).unwrap()
    };
    let remote = format!("launch.remote_engines=[\"{}\"]", process.url);
    let here = run("here", &[]);
    let before = completed();
    let there = run("there", std::slice::from_ref(&remote));
    // 3 steps of 4 groups and 3 evaluations of 3 prompts: one request each.
    assert_eq!(completed() - before, 3 * 4 + 3 * 3, "the remote engine did not sample the run");
    assert_eq!(RemoteEngine::connect(&process.url, None).unwrap().1.version, 6, "3 steps × 2 mini-batches");
    assert!(here == there, "sync RL on the remote engine differs from RL on an engine here");
    let asynchronous = run("async", &[remote, "mode=\"async\"".into(), "async_rl.max_staleness=0".into()]);
    assert!(here == asynchronous, "async RL (max_staleness 0) on the remote engine differs from sync RL here");
    let initial = dir.path().join("model/model.safetensors");
    assert!(
        common::file_max_diff(&dir.path().join("there/final/model.safetensors"), &initial) > 1e-3,
        "nothing trained"
    );
}

/// [`common::tiny_grpo_sets`] into `run_dir`, at learning rate 5e-3, with `extra` sets.
fn rl_config(model: &Path, run_dir: &Path, steps: usize, extra: &[String]) -> RlConfig {
    let mut sets = common::tiny_grpo_sets(model, steps, 5e-3);
    sets.push(format!("output.run_dir={}", run_dir.display()));
    sets.extend(extra.iter().cloned());
    RlConfig::load(None, &sets).unwrap()
}

fn metric_lines(run: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Waits until `run` has `n` metrics lines.
fn wait_for_steps(run: &Path, n: usize) {
    let t = std::time::Instant::now();
    while metric_lines(run).len() < n {
        assert!(t.elapsed() < std::time::Duration::from_secs(120), "the run never reached step {n}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// One of two engines is killed mid-run and later started again at its address: the run
/// finishes, trains exactly what a run on one engine here trains (no group lost or trained
/// twice: the lost calls were sent again from where their samples were), names the engine that
/// fell in its step's `engine_events`, and the restarted engine rejoins at the current weights.
#[test]
fn a_run_goes_on_when_an_engine_dies_and_takes_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let steps = 40;
    let here = rl_config(&model, &dir.path().join("here"), steps, &[]);
    let (d, e) = oxrl::launch::rl_runtime(&here, Some(1)).unwrap();
    run_rl(&here, &d, &e, &RunOptions::default()).unwrap();

    let (a, mut b) = (EngineProcess::start(&model, &[]), Some(EngineProcess::start(&model, &[])));
    let b_url = b.as_ref().unwrap().url.clone();
    let urls = format!("launch.remote_engines=[\"{}\", \"{b_url}\"]", a.url);
    let there = rl_config(&model, &dir.path().join("there"), steps, &[urls]);
    let (d, e) = oxrl::launch::rl_runtime(&there, Some(1)).unwrap();
    let run_dir = dir.path().join("there");
    let restarted = std::thread::scope(|s| {
        let chaos = s.spawn(|| {
            wait_for_steps(&run_dir, 2);
            drop(b.take()); // SIGKILL
            wait_for_steps(&run_dir, 6);
            EngineProcess::start_at(&model, b_url.trim_start_matches("http://"), &[])
        });
        run_rl(&there, &d, &e, &RunOptions::default()).unwrap();
        chaos.join().unwrap()
    });
    let final_of = |run: &str| std::fs::read(dir.path().join(run).join("final/model.safetensors")).unwrap();
    assert!(final_of("here") == final_of("there"), "the run that lost an engine trained something else");
    let lines = metric_lines(&run_dir);
    assert_eq!(lines.len(), steps);
    assert!(lines.iter().all(|l| l["episodes_trained"] == 16), "a step trained other than its 4 groups of 4");
    let events: Vec<String> = lines
        .iter()
        .flat_map(|l| l["engine_events"].as_array().cloned().unwrap_or_default())
        .map(|v| v.to_string())
        .collect();
    assert!(events.iter().any(|e| e.contains(&b_url) && e.contains("fell")), "{events:?}");
    assert!(events.iter().any(|e| e.contains(&b_url) && e.contains("rejoined")), "{events:?}");
    let (_, info) = RemoteEngine::connect(&restarted.url, None).unwrap();
    assert!(info.health.completed_requests > 0, "the restarted engine got no request");
    assert_eq!(info.version, 2 * steps as u64, "the restarted engine is not at the run's last version");
}

/// With its only engine dead, a run stops with an error saying so, and a checkpoint of the
/// steps it finished from which it resumes on a new engine, ending where an unbroken run ends.
#[test]
fn a_run_with_no_engine_left_stops_with_a_checkpoint_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let steps = 30;
    let here = rl_config(&model, &dir.path().join("here"), steps, &[]);
    let (d, e) = oxrl::launch::rl_runtime(&here, Some(1)).unwrap();
    run_rl(&here, &d, &e, &RunOptions::default()).unwrap();

    let mut engine = Some(EngineProcess::start(&model, &[]));
    let url = engine.as_ref().unwrap().url.clone();
    let run_dir = dir.path().join("there");
    let cfg = rl_config(&model, &run_dir, steps, &[format!("launch.remote_engines=[\"{url}\"]")]);
    let (d, e) = oxrl::launch::rl_runtime(&cfg, Some(1)).unwrap();
    let err = std::thread::scope(|s| {
        s.spawn(|| {
            wait_for_steps(&run_dir, 2);
            drop(engine.take());
        });
        run_rl(&cfg, &d, &e, &RunOptions::default()).unwrap_err().to_string()
    });
    assert!(err.contains("every sampling engine is down") && err.contains("--resume"), "{err}");
    assert!(std::fs::read_dir(run_dir.join("checkpoints")).unwrap().count() > 0, "no checkpoint");
    let _engine = EngineProcess::start_at(&model, url.trim_start_matches("http://"), &[]);
    let (d, e) = oxrl::launch::rl_runtime(&cfg, Some(1)).unwrap();
    run_rl(&cfg, &d, &e, &RunOptions { resume: true, ..Default::default() }).unwrap();
    let final_of = |run: &str| std::fs::read(dir.path().join(run).join("final/model.safetensors")).unwrap();
    assert!(final_of("here") == final_of("there"), "the resumed run differs from the unbroken one");
}

/// One of two engines stops answering without closing its connections (SIGSTOP) mid-run: the
/// watchdog takes it for down after `remote_timeout_s`, its requests go to the other engine, and
/// the run trains what a run on one engine here trains; the step names the engine.
#[test]
fn a_run_goes_on_when_an_engine_stops_answering() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let steps = 20;
    let here = rl_config(&model, &dir.path().join("here"), steps, &[]);
    let (d, e) = oxrl::launch::rl_runtime(&here, Some(1)).unwrap();
    run_rl(&here, &d, &e, &RunOptions::default()).unwrap();

    let (a, b) = (EngineProcess::start(&model, &[]), EngineProcess::start(&model, &[]));
    let sets =
        [format!("launch.remote_engines=[\"{}\", \"{}\"]", a.url, b.url), "launch.remote_timeout_s=3".to_string()];
    let run_dir = dir.path().join("there");
    let cfg = rl_config(&model, &run_dir, steps, &sets);
    let (d, e) = oxrl::launch::rl_runtime(&cfg, Some(1)).unwrap();
    let pid = b.child.id().to_string();
    std::thread::scope(|s| {
        s.spawn(|| {
            wait_for_steps(&run_dir, 2);
            assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
        });
        run_rl(&cfg, &d, &e, &RunOptions::default()).unwrap();
    });
    let _ = std::process::Command::new("kill").args(["-CONT", &pid]).status();
    let final_of = |run: &str| std::fs::read(dir.path().join(run).join("final/model.safetensors")).unwrap();
    assert!(final_of("here") == final_of("there"), "the run whose engine stopped trained something else");
    let events: Vec<String> = metric_lines(&run_dir)
        .iter()
        .flat_map(|l| l["engine_events"].as_array().cloned().unwrap_or_default())
        .map(|v| v.to_string())
        .collect();
    // Stopped while it decoded: the watchdog's "stopped answering"; while idle: the next
    // weight push timed out ("is down").
    let fell = |e: &String| e.contains(&b.url) && e.contains("fell");
    assert!(events.iter().any(|e| fell(e) && (e.contains("stopped answering") || e.contains("is down"))), "{events:?}");
}

/// The engine's calls keep their connection for the next when a body arrives after its headers
/// (see [`common::late_bodies_keep_the_connection`]).
#[test]
fn every_call_keeps_its_connection_for_the_next() {
    let dir = tempfile::tempdir().unwrap();
    common::tiny_byte_model(dir.path(), 32, 256, 7);
    let process = EngineProcess::start(dir.path(), &[]);
    // msgpack bodies: "abort" (a pause mode), nil, and a ticket no request holds.
    let calls: [(&str, &[u8]); 3] =
        [("/oxrl/v1/pause", b"\xa5abort"), ("/oxrl/v1/resume", b"\xc0"), ("/oxrl/v1/cancel", b"\x07")];
    common::late_bodies_keep_the_connection(&process.url, "content-type: application/msgpack\r\n", &calls, "/health");
}
