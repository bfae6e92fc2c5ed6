//! The core API the trainers and the server stand on: weight sync from a trained policy to the
//! engines (trainer ≡ sampler, snapshots that later steps do not touch), handles in flight on
//! one model (order, equality with blocking calls, awaiting), models by id (LoRA models over one
//! shared base that train independently, create/drop at run time), and cancelling a request.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::{fixture_dir, loss};
use oxrl::dispatch::mesh::MeshShape;
use oxrl::dispatch::{Dispatch, WorkerSpec};
use oxrl::model::lora::{self, LoraConfig};
use oxrl::model::Transformer;
use oxrl::rollout::{Engine, EngineClient, EngineConfig, PauseMode, Request, SamplingParams, StopReason};
use oxrl::worker::{AdamParams, Datum, WorkerConfig};
use serde_json::json;

const ARCH: &str = "qwen3";

fn spec(lora: Option<LoraConfig>, dtype: DType, seed: u64) -> WorkerSpec {
    WorkerSpec {
        dtype,
        worker: WorkerConfig { lora, seed, ..Default::default() },
        ..WorkerSpec::new(fixture_dir(ARCH))
    }
}

fn lora_cfg() -> LoraConfig {
    LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "up_proj", "lm_head"])
}

/// A supervised batch over pseudo-random sequences (`salt` changes them).
fn batch(salt: usize) -> Vec<Datum> {
    [9usize, 14, 6]
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            let seq: Vec<u32> = (0..n).map(|i| ((r * 31 + i * 17 + salt * 7 + 3) % 290) as u32 + 5).collect();
            let targets = seq[1..].iter().copied().chain([0]).collect();
            let mut w = vec![0.05; n];
            w[n - 1] = 0.0;
            Datum::supervised(seq, targets, w)
        })
        .collect()
}

fn adam() -> AdamParams {
    AdamParams { learning_rate: 2e-2, ..Default::default() }
}

/// `steps` optimizer steps of cross-entropy on model `id`.
fn train(d: &Dispatch, id: &str, steps: usize, salt: usize) {
    let ce = loss("cross_entropy", &json!({}));
    for s in 0..steps {
        d.forward_backward(id, &batch(salt + s), Some(&ce), false).unwrap();
        d.optim_step(id, &adam()).unwrap();
    }
}

fn engine_for(dtype: DType) -> Engine {
    let base = Transformer::load(&fixture_dir(ARCH), dtype, &Device::Cpu).unwrap();
    Engine::start(base, EngineConfig::default()).unwrap()
}

fn sampled(prompt: Vec<u32>, seed: u64) -> Request {
    Request {
        num_samples: 2,
        ..Request::new(
            prompt,
            SamplingParams {
                max_tokens: 12,
                temperature: 1.0,
                seed: Some(seed),
                ignore_eos: true,
                ..Default::default()
            },
        )
    }
}

/// Largest |sampler log-prob − trainer log-prob| over every sampled token, after a weight sync
/// that followed real optimizer steps; also checks the versions the engine stamped.
fn trainer_vs_sampler(lora: Option<LoraConfig>, dtype: DType) -> f32 {
    let d = Dispatch::new(false);
    d.create_model("policy", &spec(lora, dtype, 3)).unwrap();
    assert_eq!(d.model("policy").unwrap().inspect(|w| w.model().dtype).unwrap(), vec![dtype]);
    train(&d, "policy", 3, 0);
    let weights = d.sampler_weights("policy").unwrap();
    assert_eq!(weights.version(), 3);
    let engine = engine_for(dtype);
    engine.update_weights(&weights).wait().unwrap();

    let prompts: Vec<Vec<u32>> = vec![vec![5, 17, 40, 2, 99], vec![7, 8], vec![150, 151, 152, 153, 154, 155, 156]];
    let handles: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| engine.submit(sampled(p.clone(), 11 + i as u64))).collect();
    let mut datums = vec![];
    let mut expected = vec![];
    for (p, h) in prompts.iter().zip(handles) {
        for g in h.wait().unwrap().samples {
            assert!(g.versions.iter().all(|&v| v == 3), "tokens not stamped with the synced version");
            let seq: Vec<u32> = p.iter().chain(&g.tokens).copied().collect();
            let n = seq.len() - 1;
            datums.push(Datum::supervised(seq[..n].to_vec(), seq[1..].to_vec(), vec![1.0; n]));
            expected.push((p.len() - 1, g.logprobs));
        }
    }
    let out = d.forward("policy", &datums, None, true).unwrap();
    let mut worst = 0f32;
    for (rec, (from, want)) in out.loss_fn_outputs.iter().zip(expected) {
        for (k, w) in want.iter().enumerate() {
            worst = worst.max((rec.logprobs[from + k] - w).abs());
        }
    }
    worst
}

#[test]
fn trainer_and_sampler_agree_after_sync_full_and_lora() {
    let full = trainer_vs_sampler(None, DType::F32);
    let lora = trainer_vs_sampler(Some(lora_cfg()), DType::F32);
    let full_bf16 = trainer_vs_sampler(None, DType::BF16);
    eprintln!("max |sampler − trainer| log-prob: f32 full {full:.2e}, f32 LoRA {lora:.2e}, bf16 full {full_bf16:.2e}");
    assert!(full < 1e-5, "full fine-tuning: sampler and trainer differ by {full}");
    assert!(lora < 1e-5, "LoRA: sampler and trainer differ by {lora}");
    assert!(full_bf16 < 0.1, "bf16: sampler and trainer differ by {full_bf16}");
}

/// The engine's tensors by name: every base parameter, or the adapters.
fn engine_tensors(engine: &Engine, lora: bool) -> Vec<(String, Vec<f32>)> {
    engine
        .inspect(move |m| {
            let named: Vec<(String, Tensor)> =
                if lora { lora::adapter_tensors(m).unwrap().into_iter().collect() } else { m.named_params() };
            named.into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
        })
        .wait()
        .unwrap()
}

fn worker_tensors(d: &Dispatch) -> Vec<(String, Vec<f32>)> {
    let mut p = d
        .model("policy")
        .unwrap()
        .inspect(|w| {
            w.params()
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                .collect::<Vec<_>>()
        })
        .unwrap()
        .remove(0);
    p.sort_by(|a, b| a.0.cmp(&b.0));
    p
}

#[test]
fn synced_engine_holds_the_workers_weights_and_later_steps_do_not_touch_them() {
    for lora in [None, Some(lora_cfg())] {
        let is_lora = lora.is_some();
        let d = Dispatch::new(false);
        d.create_model("policy", &spec(lora, DType::F32, 5)).unwrap();
        train(&d, "policy", 2, 1);
        let engine = engine_for(DType::F32);
        let weights = d.sampler_weights("policy").unwrap();
        engine.update_weights(&weights).wait().unwrap();
        assert_eq!(engine.health().stats.unwrap().version, 2);
        let at_sync = worker_tensors(&d);
        let mut on_engine = engine_tensors(&engine, is_lora);
        on_engine.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(on_engine, at_sync, "lora={is_lora}: the engine does not hold the worker's weights at version 2");

        train(&d, "policy", 1, 9);
        let after = worker_tensors(&d);
        assert_ne!(after, at_sync, "the third step changed nothing");
        let mut still = engine_tensors(&engine, is_lora);
        still.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(still, at_sync, "lora={is_lora}: an optimizer step changed what the engine holds");
        assert_eq!(weights.version(), 2);
    }
}

#[test]
fn handles_in_flight_complete_in_submission_order_and_equal_blocking_calls() {
    let ce = loss("cross_entropy", &json!({}));
    let probe = batch(40);
    // Blocking reference: forward, then (fb, step, forward) × 4.
    let reference = Dispatch::new(false);
    reference.create_model("policy", &spec(None, DType::F32, 1)).unwrap();
    let mut want = vec![reference.forward("policy", &probe, None, true).unwrap()];
    let mut want_norms = vec![];
    for s in 0..4 {
        reference.forward_backward("policy", &batch(s), Some(&ce), false).unwrap();
        want_norms.push(reference.optim_step("policy", &adam()).unwrap());
        want.push(reference.forward("policy", &probe, None, true).unwrap());
    }

    // Everything submitted at once on a two-rank model; nothing waited for until the end.
    let d = Dispatch::new(false);
    d.create_model("policy", &WorkerSpec { mesh: MeshShape::dp(2), ..spec(None, DType::F32, 1) }).unwrap();
    let mut forwards = vec![d.submit_forward("policy", &probe, None, true)];
    let (mut steps, mut backwards) = (vec![], vec![]);
    for s in 0..4 {
        backwards.push(d.submit_forward_backward("policy", &batch(s), Some(&ce), false));
        steps.push(d.submit_optim_step("policy", &adam()));
        forwards.push(d.submit_forward("policy", &probe, None, true));
    }
    // The last call done means every earlier one is done: they ran in order.
    let last = forwards.pop().unwrap().wait().unwrap();
    let mut got: Vec<_> = forwards
        .iter_mut()
        .map(|h| h.try_wait().expect("an earlier forward is still pending after the last one finished").unwrap())
        .collect();
    got.push(last);
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        for (a, b) in g.loss_fn_outputs.iter().zip(&w.loss_fn_outputs) {
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-5, "forward {k}: {x} vs blocking {y}");
            }
        }
    }
    for h in backwards {
        assert!(h.wait().unwrap().metrics.value("loss:sum").unwrap().is_finite());
    }
    for (h, w) in steps.into_iter().zip(want_norms) {
        let n = h.wait().unwrap();
        assert!((n - w).abs() < 1e-5 * w.max(1.0), "grad norm {n} vs blocking {w}");
    }
}

#[test]
fn handles_can_be_awaited_from_async_code() {
    let d = Dispatch::new(false);
    d.create_model("policy", &spec(None, DType::F32, 2)).unwrap();
    let ce = loss("cross_entropy", &json!({}));
    let blocking = d.forward("policy", &batch(3), Some(&ce), true).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let (a, b) = rt.block_on(async {
        let a = d.submit_forward("policy", &batch(3), Some(&ce), true);
        let b = d.submit_forward("policy", &batch(3), Some(&ce), true);
        (a.await.unwrap(), b.await.unwrap())
    });
    for out in [a, b] {
        assert_eq!(out.metrics.value("loss:sum"), blocking.metrics.value("loss:sum"));
        assert_eq!(out.loss_fn_outputs, blocking.loss_fn_outputs);
    }
}

#[test]
fn lora_models_over_one_base_share_it_and_train_independently() {
    let alone = |seed: u64, salt: usize| {
        let d = Dispatch::new(false);
        d.create_model("m", &spec(Some(lora_cfg()), DType::F32, seed)).unwrap();
        train(&d, "m", 3, salt);
        let mut p = d.model("m").unwrap().inspect(|w| w.params().to_vec()).unwrap().remove(0);
        p.sort_by(|a, b| a.0.cmp(&b.0));
        p.into_iter()
            .map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect::<Vec<_>>()
    };
    let want_a = alone(10, 0);
    let want_b = alone(20, 50);

    let d = Dispatch::new(false);
    d.create_model("a", &spec(Some(lora_cfg()), DType::F32, 10)).unwrap();
    d.create_model("b", &spec(Some(lora_cfg()), DType::F32, 20)).unwrap();
    assert_eq!(d.shared_bases(), 1, "two LoRA models over one base must share it");
    let embed_id = |id: &str| d.model(id).unwrap().inspect(|w| w.model().embed_tokens.id()).unwrap().remove(0);
    assert_eq!(embed_id("a"), embed_id("b"), "the base weights are not the same tensors");
    let ce = loss("cross_entropy", &json!({}));
    for s in 0..3 {
        // Interleaved: a's gradient is pending while b trains.
        d.forward_backward("a", &batch(s), Some(&ce), false).unwrap();
        d.forward_backward("b", &batch(50 + s), Some(&ce), false).unwrap();
        d.optim_step("b", &adam()).unwrap();
        d.optim_step("a", &adam()).unwrap();
    }
    for (id, want) in [("a", want_a), ("b", want_b)] {
        let mut p = d.model(id).unwrap().inspect(|w| w.params().to_vec()).unwrap().remove(0);
        p.sort_by(|a, b| a.0.cmp(&b.0));
        let got: Vec<_> =
            p.into_iter().map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
        assert_eq!(got, want, "model {id} differs from the same model trained alone");
    }
    d.drop_model("a").unwrap();
    assert_eq!(d.shared_bases(), 1);
    d.drop_model("b").unwrap();
    assert_eq!(d.shared_bases(), 0, "the base outlived its last user");
    assert!(d.model("a").err().unwrap().to_string().contains("no model `a`"));
    assert!(d.forward("b", &batch(0), None, true).unwrap_err().to_string().contains("no model `b`"));
    // Ids are free again; a duplicate is refused.
    d.create_model("a", &spec(None, DType::F32, 0)).unwrap();
    assert!(d.create_model("a", &spec(None, DType::F32, 0)).unwrap_err().to_string().contains("already exists"));
}

#[test]
fn a_single_request_can_be_cancelled_on_an_engine_and_through_the_client() {
    let long = |seed| {
        Request::new(
            vec![5, 6, 7],
            SamplingParams {
                max_tokens: 200,
                temperature: 1.0,
                seed: Some(seed),
                ignore_eos: true,
                ..Default::default()
            },
        )
    };
    let engine = engine_for(DType::F32);
    let other = engine.submit(long(1));
    let doomed = engine.submit(long(2));
    doomed.cancel();
    let out = doomed.wait().unwrap();
    assert!(out.samples.iter().all(|g| g.stop_reason == StopReason::Cancelled && g.tokens.len() < 200));
    let kept = other.wait().unwrap();
    assert_eq!(kept.samples[0].tokens.len(), 200, "cancelling one request touched another");

    // Through the client: a request parked by a pause is cancelled without being continued.
    let client = EngineClient::new(vec![engine_for(DType::F32)]).unwrap();
    let h = client.submit(long(3));
    client.pause(PauseMode::Abort).wait().unwrap();
    h.cancel();
    let out = h.wait().unwrap();
    assert_eq!(out.samples[0].stop_reason, StopReason::Cancelled);
    client.resume().wait().unwrap();
    assert_eq!(client.load(), vec![0]);
}

#[test]
fn the_client_continues_many_aborted_requests_without_a_thread_each() {
    let base = Transformer::load(&fixture_dir(ARCH), DType::F32, &Device::Cpu).unwrap();
    let req = |i: u64| {
        Request::new(
            vec![3 + i as u32, 9, 27],
            SamplingParams {
                max_tokens: 20,
                temperature: 1.0,
                seed: Some(100 + i),
                ignore_eos: true,
                ..Default::default()
            },
        )
    };
    // Uninterrupted reference.
    let solo = EngineClient::new(vec![Engine::start(base.clone(), EngineConfig::default()).unwrap()]).unwrap();
    let want: Vec<_> = (0..32).map(|i| solo.generate(req(i)).unwrap()).collect();

    let client = EngineClient::new(vec![
        Engine::start(base.clone(), EngineConfig::default()).unwrap(),
        Engine::start(base, EngineConfig::default()).unwrap(),
    ])
    .unwrap();
    let handles: Vec<_> = (0..32).map(|i| client.submit(req(i))).collect();
    for _ in 0..3 {
        client.pause(PauseMode::Abort).wait().unwrap();
        client.resume().wait().unwrap();
    }
    for (h, w) in handles.into_iter().zip(want) {
        let got = h.wait().unwrap();
        assert_eq!(got.samples[0].tokens, w.samples[0].tokens);
        assert_eq!(got.samples[0].stop_reason, StopReason::Length);
        for (a, b) in got.samples[0].logprobs.iter().zip(&w.samples[0].logprobs) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
