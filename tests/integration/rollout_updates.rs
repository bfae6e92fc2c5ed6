//! Pause (abort / keep), resume, versioned weight updates (full and LoRA-only), the engine
//! client's routing, abort-and-continue retry and cancellation, snapshots that do not alias the
//! trainer's variables, and the chat entry point.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use common::*;
use oxrl::model::lora::{self, LoraConfig};
use oxrl::model::tokenizer::Tokenizer;
use oxrl::model::{init, NamedTensors, SamplerWeights, Transformer};
use oxrl::rollout::client::continuation;
use oxrl::rollout::{
    chat, generate, Engine, EngineClient, EngineConfig, EngineCore, Generation, PauseMode, Request, RequestOutput,
    SamplingParams, StopReason, WeightUpdate,
};
use serde_json::json;

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn core(m: &Transformer) -> EngineCore {
    EngineCore::new(m.clone(), EngineConfig::default()).unwrap()
}

fn params(max_tokens: usize, temperature: f64, seed: u64) -> SamplingParams {
    SamplingParams { max_tokens, temperature, seed: Some(seed), ignore_eos: true, ..Default::default() }
}

fn solo(m: &Transformer, req: Request) -> RequestOutput {
    let mut e = core(m);
    e.add_request(req).unwrap();
    e.run_until_idle().unwrap().pop().unwrap().1
}

fn full(m: &Transformer) -> WeightUpdate {
    WeightUpdate::full_snapshot(m).unwrap()
}

/// A versioned snapshot of every weight of `m`, as engines take them.
fn snapshot(m: &Transformer, version: u64) -> SamplerWeights {
    SamplerWeights::snapshot(m, None, version).unwrap()
}

fn full_from(tensors: Vec<(String, candle_core::Tensor)>) -> WeightUpdate {
    WeightUpdate::Full(NamedTensors::from_vec("weight update", tensors).unwrap())
}

/// Another model of the same shape.
fn other(m: &Transformer) -> Transformer {
    init::random_model(m.config.clone(), 99, DType::F32, &Device::Cpu).unwrap()
}

/// Equal log-probs, bit for bit (the kernels' order does not depend on the batch).
fn assert_same(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: {x} vs {y}");
    }
}

/// Steps `n` times, expecting nothing to finish.
fn steps(e: &mut EngineCore, n: usize) {
    for _ in 0..n {
        assert!(e.step().unwrap().is_empty());
    }
}

/// Aborts after `at[0]` steps, continues, aborts after `at[1]` more, …, then runs to the end;
/// optionally swaps in `new` weights (version 1) at the first abort.
fn interrupted(m: &Transformer, req: &Request, at: &[usize], new: Option<&WeightUpdate>) -> RequestOutput {
    let mut e = core(m);
    e.add_request(req.clone()).unwrap();
    steps(&mut e, at[0]);
    let mut out = e.pause(PauseMode::Abort).pop().unwrap().1;
    for g in &out.samples {
        assert_eq!((g.tokens.len(), g.stop_reason), (at[0], StopReason::Abort));
    }
    // Paused: nothing moves.
    assert!(e.step().unwrap().is_empty());
    if let Some(u) = new {
        e.update_weights(u, 1).unwrap();
    }
    for (i, &n) in at.iter().enumerate().skip(1) {
        e.resume();
        let ids: Vec<_> =
            out.samples.iter().enumerate().map(|(j, g)| e.add_request(continuation(req, j, g)).unwrap()).collect();
        steps(&mut e, n);
        let mut aborted = e.pause(PauseMode::Abort);
        aborted.sort_by_key(|(id, _)| *id);
        assert_eq!(aborted.iter().map(|(id, _)| *id).collect::<Vec<_>>(), ids, "pause {i}");
        for (g, (_, r)) in out.samples.iter_mut().zip(aborted) {
            g.append(r.samples.into_iter().next().unwrap());
        }
    }
    e.resume();
    for (j, g) in out.samples.clone().iter().enumerate() {
        e.add_request(continuation(req, j, g)).unwrap();
    }
    for ((_, r), g) in e.run_until_idle().unwrap().into_iter().zip(out.samples.iter_mut()) {
        g.append(r.samples.into_iter().next().unwrap());
    }
    out
}

#[test]
fn abort_twice_then_continue_equals_uninterrupted() {
    let m = load("qwen3");
    let prompt = vec![3u32, 14, 15, 92, 65];
    for (t, n) in [(0.0, 1), (1.0, 2), (0.8, 3)] {
        let req = Request { num_samples: n, ..Request::new(prompt.clone(), params(40, t, 21)) };
        let whole = solo(&m, req.clone());
        let got = interrupted(&m, &req, &[5, 9], None);
        for (j, (a, b)) in got.samples.iter().zip(&whole.samples).enumerate() {
            assert_eq!(a.tokens, b.tokens, "T={t} sample {j}");
            assert_eq!(a.stop_reason, StopReason::Length);
            assert_eq!(a.versions, vec![0; 40]);
            assert_same(&a.logprobs, &b.logprobs, "abort-continue log-probs");
        }
    }
}

#[test]
fn abort_with_new_weights_continues_on_them_with_the_new_version() {
    let m = load("qwen3");
    let b = other(&m);
    let prompt = vec![3u32, 14, 15, 92, 65];
    let req = Request::new(prompt.clone(), params(30, 0.0, 0));
    let whole = solo(&m, req.clone()).samples.remove(0);
    let got = interrupted(&m, &req, &[6], Some(&full(&b))).samples.remove(0);
    assert_eq!(got.tokens[..6], whole.tokens[..6]);
    assert_eq!(got.versions, [vec![0; 6], vec![1; 24]].concat());
    // After the update it is model B's greedy continuation of prompt + the first 6 tokens.
    let prefix: Vec<u32> = prompt.iter().chain(&whole.tokens[..6]).copied().collect();
    let on_b = solo(&b, Request::new(prefix, params(24, 0.0, 0))).samples.remove(0);
    assert_eq!(got.tokens[6..], on_b.tokens[..]);
    assert_ne!(got.tokens, whole.tokens);
}

#[test]
fn keep_mode_freezes_then_continues_with_the_cache() {
    let m = load("llama");
    let prompt = vec![7u32, 8, 9, 10];
    for (t, n) in [(0.0, 1), (1.0, 2)] {
        let req = Request { num_samples: n, ..Request::new(prompt.clone(), params(30, t, 4)) };
        let whole = solo(&m, req.clone());
        // Unchanged weights under a new version: the same tokens; versions switch at the update.
        let mut e = core(&m);
        e.add_request(req.clone()).unwrap();
        steps(&mut e, 7);
        assert!(e.pause(PauseMode::Keep).is_empty());
        let before = e.stats();
        assert!(e.step().unwrap().is_empty());
        assert_eq!(e.stats(), before, "a paused engine moved");
        e.update_weights(&full(&m), 1).unwrap();
        e.resume();
        let got = e.run_until_idle().unwrap().pop().unwrap().1;
        for (a, b) in got.samples.iter().zip(&whole.samples) {
            assert_eq!(a.tokens, b.tokens, "T={t}");
            assert_same(&a.logprobs, &b.logprobs, "keep log-probs");
            assert_eq!(a.versions, [vec![0; 7], vec![1; 23]].concat());
        }
    }
    // Changed weights: the first 7 tokens stand, the rest come from the new weights.
    let req = Request::new(prompt.clone(), params(30, 1.0, 0));
    let whole = solo(&m, req.clone()).samples.remove(0);
    let mut e = core(&m);
    e.add_request(req).unwrap();
    steps(&mut e, 7);
    e.pause(PauseMode::Keep);
    e.update_weights(&full(&other(&m)), 5).unwrap();
    assert_eq!(e.version(), 5);
    e.resume();
    let got = e.run_until_idle().unwrap().pop().unwrap().1.samples.remove(0);
    assert_eq!(got.tokens[..7], whole.tokens[..7]);
    assert_ne!(got.tokens, whole.tokens);
    assert_eq!(got.versions, [vec![0; 7], vec![5; 23]].concat());
}

fn adapter(arch: &str) -> WeightUpdate {
    let dir = fixture_dir(arch).join("lora");
    let config = LoraConfig::from_file(&dir.join(lora::CONFIG_FILE)).unwrap();
    let tensors = NamedTensors::load_file(&dir.join(lora::WEIGHTS_FILE), &Device::Cpu).unwrap();
    WeightUpdate::Lora { config, tensors }
}

#[test]
fn lora_only_and_full_updates_and_bad_updates() {
    for arch in ARCHS {
        let base = load(arch);
        let mut with = load(arch);
        lora::load_peft(&mut with, &fixture_dir(arch).join("lora"), false).unwrap();
        let prompt = vec![vec![5u32, 6, 7, 8]];
        let p = params(12, 1.0, 0);
        let want_base = generate(&base, &prompt, &p, &[]).unwrap().remove(0).tokens;
        let want_lora = generate(&with, &prompt, &p, &[]).unwrap().remove(0).tokens;
        assert_ne!(want_base, want_lora, "{arch}: the adapter changes nothing");

        let mut e = core(&base);
        let run = |e: &mut EngineCore| -> Generation {
            e.add_request(Request::new(prompt[0].clone(), p.clone())).unwrap();
            e.run_until_idle().unwrap().pop().unwrap().1.samples.remove(0)
        };
        e.update_weights(&adapter(arch), 3).unwrap();
        let g = run(&mut e);
        assert_eq!(g.tokens, want_lora, "{arch}: LoRA-only update");
        assert_eq!(g.versions, vec![3; 12]);

        // Refused updates leave weights and version as they were.
        let mut missing = base.named_params();
        missing.pop();
        let mut wrong = base.named_params();
        wrong[0].1 = wrong[0].1.narrow(0, 0, 1).unwrap();
        let mut extra = base.named_params();
        extra.push(("model.layers.9.mlp.up_proj.weight".into(), extra[0].1.clone()));
        let WeightUpdate::Lora { config, mut tensors } = adapter(arch) else { unreachable!() };
        let first = tensors.names().next().unwrap().to_string();
        tensors.remove(&first).unwrap();
        let bad_lora = WeightUpdate::Lora { config, tensors };
        for (bad, words) in [
            (full_from(missing), "missing"),
            (full_from(wrong), "shape"),
            (full_from(extra), "not a parameter"),
            (bad_lora, "missing"),
        ] {
            let msg = e.update_weights(&bad, 4).unwrap_err().to_string();
            assert!(msg.contains(words), "{arch}: {msg}");
        }
        assert_eq!(e.version(), 3);
        assert_eq!(run(&mut e).tokens, want_lora, "{arch}: a refused update changed the weights");

        // A full update with the base weights (the adapters stay attached) and then with the
        // adapters merged in.
        let mut merged = with.clone();
        lora::merge(&mut merged).unwrap();
        let mut e = core(&base);
        e.update_weights(&full(&merged), 8).unwrap();
        let g = run(&mut e);
        assert_eq!(g.tokens, want_lora, "{arch}: full update with the merged weights");
        assert_eq!(g.versions, vec![8; 12]);
    }
}

#[test]
fn updates_do_not_alias_the_trainers_tensors() {
    // The trainer updates its variables in place (`Var::set`); an engine must keep sampling
    // with the weights of the snapshot it was given.
    let m = load("qwen2");
    let prompt = vec![4u32, 5, 6];
    let before = solo(&m, Request::new(prompt.clone(), params(10, 0.0, 0))).samples.remove(0).tokens;

    // Full weights: a snapshot sent to an engine thread, then every variable zeroed in place.
    let mut trainer = m.clone();
    let vars = trainer.make_trainable().unwrap();
    let weights = snapshot(&trainer, 1);
    assert!(!weights.is_lora() && weights.num_bytes() > 0);
    let engine = Engine::start(m.clone(), EngineConfig::default()).unwrap();
    engine.update_weights(&weights).wait().unwrap();
    for (_, v) in &vars {
        v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
    }
    let got = engine.generate(Request::new(prompt.clone(), params(10, 0.0, 0))).unwrap().samples.remove(0);
    assert_eq!(got.tokens, before, "the snapshot changed with the trainer's variables");
    assert_eq!(got.versions, vec![1; 10]);
    // The snapshot itself did not move either: another engine given it later agrees.
    let late = Engine::start(other(&m), EngineConfig::default()).unwrap();
    late.update_weights(&weights).wait().unwrap();
    assert_eq!(late.generate(Request::new(prompt.clone(), params(10, 0.0, 0))).unwrap().samples[0].tokens, before);

    // LoRA adapters only: the engine holds the base, the snapshot the adapters.
    let arch = "qwen2";
    let mut with = load(arch);
    lora::load_peft(&mut with, &fixture_dir(arch).join("lora"), false).unwrap();
    let want_lora = solo(&with, Request::new(prompt.clone(), params(10, 0.0, 0))).samples.remove(0).tokens;
    let mut trainer = load(arch);
    let (config, adapters) = lora::load_peft(&mut trainer, &fixture_dir(arch).join("lora"), true).unwrap();
    assert!(!adapters.is_empty());
    let weights = SamplerWeights::snapshot(&trainer, Some(&config), 2).unwrap();
    assert!(weights.is_lora());
    let engine = Engine::start(m.clone(), EngineConfig::default()).unwrap();
    engine.update_weights(&weights).wait().unwrap();
    for (_, v) in &adapters {
        v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
    }
    let got = engine.generate(Request::new(prompt.clone(), params(10, 0.0, 0))).unwrap().samples.remove(0);
    assert_eq!(got.tokens, want_lora, "the LoRA snapshot changed with the trainer's adapters");
    assert_eq!(got.versions, vec![2; 10]);

    // The safety net for hand-built updates: a variable's own tensor passed straight through is
    // copied by the engine.
    let mut trainer = m.clone();
    let vars = trainer.make_trainable().unwrap();
    let mut e = core(&m);
    e.update_weights(&full_from(vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect()), 1).unwrap();
    for (_, v) in &vars {
        v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
    }
    e.add_request(Request::new(prompt, params(10, 0.0, 0))).unwrap();
    assert_eq!(e.run_until_idle().unwrap().pop().unwrap().1.samples.remove(0).tokens, before);
}

/// Waits until `f` holds (or `deadline` passes); returns whether it held.
fn wait_for(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    false
}

fn running(client: &EngineClient) -> bool {
    client.health().iter().any(|h| h.stats.as_ref().is_some_and(|s| s.running_rows > 0))
}

#[test]
fn client_abort_and_continue_across_real_pauses() {
    // The benchmark model (6 M parameters): its 200 tokens take tens of milliseconds, so both
    // pauses land mid-generation (the fixtures' finished before the second under load).
    let m = oxrl::bench::model::build(0, DType::F32, &Device::Cpu).unwrap();
    let req = Request::new(vec![9u32, 8, 7, 6], params(200, 0.0, 0));
    let whole = solo(&m, req.clone()).samples.remove(0);
    let client = EngineClient::new(vec![Engine::start(m.clone(), EngineConfig::default()).unwrap()]).unwrap();
    let got = std::thread::scope(|s| {
        let h = s.spawn(|| client.generate(req.clone()).unwrap());
        for _ in 0..2 {
            assert!(wait_for(Duration::from_secs(20), || running(&client) || h.is_finished()));
            client.pause(PauseMode::Abort).wait().unwrap();
            client.update_weights(&snapshot(&m, 1)).wait().unwrap();
            client.resume().wait().unwrap();
        }
        h.join().unwrap()
    });
    let g = &got.samples[0];
    assert_eq!(g.tokens, whole.tokens);
    assert_eq!(g.stop_reason, StopReason::Length);
    assert_same(&g.logprobs, &whole.logprobs, "client abort-continue");
    // Both pauses landed mid-generation: three calls, and versions 0 then 1.
    assert_eq!(client.health()[0].completed_requests, 3, "the pauses did not interrupt the generation");
    assert_eq!(g.versions[0], 0);
    assert_eq!(*g.versions.last().unwrap(), 1);
    assert!(g.versions.windows(2).all(|w| w[0] <= w[1]));
}

#[test]
fn client_keep_mode_update_in_flight() {
    let m = load("qwen3");
    let req = Request::new(vec![9u32, 8, 7, 6], params(200, 0.0, 0));
    let whole = solo(&m, req.clone()).samples.remove(0);
    let client = EngineClient::new(vec![Engine::start(m.clone(), EngineConfig::default()).unwrap()]).unwrap();
    let got = std::thread::scope(|s| {
        let h = s.spawn(|| client.generate(req.clone()).unwrap());
        assert!(wait_for(Duration::from_secs(20), || running(&client)));
        client.pause(PauseMode::Keep).wait().unwrap();
        client.update_weights(&snapshot(&m, 2)).wait().unwrap();
        client.resume().wait().unwrap();
        h.join().unwrap()
    });
    let g = &got.samples[0];
    assert_eq!(g.tokens, whole.tokens);
    assert_eq!(client.health()[0].completed_requests, 1, "keep mode must not abort");
    assert_eq!(g.versions[0], 0);
    assert_eq!(*g.versions.last().unwrap(), 2);
}

/// Cancelling a client request ends it with what it has (stop reason `cancelled`), whether
/// its sample is in an engine or parked by an abort pause; a cancelled sample is never
/// continued.
#[test]
fn client_cancel_in_flight_and_while_parked() {
    let m = load("qwen3");
    let req = Request::new(vec![9u32, 8, 7, 6], params(200, 0.0, 0));
    let whole = solo(&m, req.clone()).samples.remove(0);
    let client = EngineClient::new(vec![Engine::start(m.clone(), EngineConfig::default()).unwrap()]).unwrap();
    let is_prefix = |g: &Generation| {
        assert!(g.tokens.len() < 200, "the request ran to its end");
        assert_eq!(g.tokens, whole.tokens[..g.tokens.len()].to_vec());
        assert_same(&g.logprobs, &whole.logprobs[..g.tokens.len()], "cancelled log-probs");
    };

    // In flight.
    let handle = client.submit(req.clone());
    assert!(wait_for(Duration::from_secs(20), || running(&client)));
    handle.cancel();
    let g = handle.wait().unwrap().samples.remove(0);
    assert_eq!(g.stop_reason, StopReason::Cancelled);
    is_prefix(&g);
    assert_eq!(client.health()[0].completed_requests, 1);

    // Parked: the abort pause leaves the sample waiting for `resume`; cancelling ends it there.
    let handle = client.submit(req.clone());
    assert!(wait_for(Duration::from_secs(20), || running(&client)));
    client.pause(PauseMode::Abort).wait().unwrap();
    handle.cancel();
    let g = handle.wait().unwrap().samples.remove(0);
    assert_eq!(g.stop_reason, StopReason::Cancelled);
    is_prefix(&g);
    client.resume().wait().unwrap();
    // Nothing was continued after the resume: no engine call runs, none more completed.
    std::thread::sleep(Duration::from_millis(50));
    assert!(!running(&client));
    assert_eq!(client.health()[0].completed_requests, 2);
    assert_eq!(client.load(), vec![0]);
    // The client carries on.
    let out = client.generate(Request::new(vec![9u32, 8, 7, 6], params(20, 0.0, 0))).unwrap();
    assert_eq!(out.samples[0].tokens, whole.tokens[..20].to_vec());
}

#[test]
fn client_routes_by_load_and_route_key_and_reports_health() {
    let m = load("qwen2");
    let engines = (0..2)
        .map(|_| Engine::start(m.clone(), EngineConfig { max_batch: 8, ..Default::default() }).unwrap())
        .collect();
    let client = EngineClient::new(engines).unwrap();
    let g = client.route(Some(77));
    assert_eq!(client.route(Some(77)), g);
    let reqs: Vec<Request> = (0..24u64)
        .map(|i| Request {
            route_key: (i % 2 == 0).then_some(i / 4),
            ..Request::new(vec![1 + i as u32, 2, 3], params(20, 1.0, i))
        })
        .collect();
    let outs: Vec<RequestOutput> = std::thread::scope(|s| {
        let hs: Vec<_> = reqs.iter().map(|r| s.spawn(|| client.generate(r.clone()).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, o) in reqs.iter().zip(&outs) {
        assert_eq!(o.samples[0].tokens, solo(&m, r.clone()).samples[0].tokens);
    }
    let health = client.health();
    assert_eq!(health.len(), 2);
    assert!(health.iter().all(|h| h.alive && h.failed_steps == 0));
    assert_eq!(health.iter().map(|h| h.completed_requests).sum::<u64>(), 24);
    assert!(health.iter().all(|h| h.completed_requests > 0), "one engine got nothing: {health:?}");
    assert_eq!(client.load(), vec![0, 0]);
    assert!(EngineClient::new(vec![]).is_err());
}

#[test]
fn chat_replies_with_the_tokens_the_trainer_needs() {
    let arch = "qwen3";
    let m = load(arch);
    let tok = Tokenizer::from_dir(&fixture_dir(arch)).unwrap();
    let config = EngineConfig {
        eos_token_ids: tok.eos_token_ids().to_vec(),
        tokenizer: Some(Arc::new(tok.clone())),
        ..Default::default()
    };
    let client = EngineClient::new(vec![Engine::start(m.clone(), config).unwrap()]).unwrap();
    let mut messages = vec![json!({"role": "user", "content": "hello there"})];
    let p = SamplingParams { ignore_eos: false, ..params(8, 0.0, 0) };
    for turn in 0..2 {
        let reply = chat(&client, &tok, &messages, p.clone(), 2).unwrap();
        assert_eq!(reply.len(), 2);
        let r = &reply[0];
        assert_eq!(r.prompt_tokens, tok.encode_chat(&messages, true, None).unwrap(), "turn {turn}");
        let want = generate(&m, std::slice::from_ref(&r.prompt_tokens), &p, tok.eos_token_ids()).unwrap().remove(0);
        assert_eq!(r.tokens, want.tokens);
        assert_same(&r.logprobs, &want.logprobs, "chat log-probs");
        assert_eq!(r.versions.len(), r.tokens.len());
        assert_eq!(r.text, tok.decode(&r.tokens, true).unwrap());
        assert_eq!(reply[1].tokens, r.tokens, "greedy samples agree");
        messages.push(r.message());
        messages.push(json!({"role": "user", "content": format!("and turn {turn}?")}));
    }
}
