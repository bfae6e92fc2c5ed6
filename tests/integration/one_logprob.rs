//! One log-prob, one set of bits: for a sequence under given weights, `oxrl score`'s function
//! (`model::sequence_logprobs`, alone or in a batch of mixed lengths), the Tinker `forward` (the
//! worker's), the engine's prompt log-probs (what `echo` and `oxrl serve` report) and the log-probs
//! the engine sampled tokens with are the same bits — every fixture family, full and LoRA (the
//! adapter merged into the engine's weights, or registered by name beside other rows); and a
//! token found among the top log-probs has its log-prob's bits there. Through a real `oxrl
//! serve`: a sampler's prompt log-probs are its Tinker `forward`'s bits.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device};
use common::*;
use oxrl::model::lora::LoraConfig;
use oxrl::model::row_adapters::Adapter;
use oxrl::model::sequence_logprobs::sequence_logprobs;
use oxrl::model::Transformer;
use oxrl::rollout::{EngineConfig, EngineCore, Request, RequestOutput, SamplingParams};
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::{json, Value};

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

/// Sequences of 1 to 30 tokens over the fixtures' vocabulary.
fn sequences() -> Vec<Vec<u32>> {
    [1usize, 2, 5, 13, 30, 9]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| ((i * 37 + j * 11) % 250 + 3) as u32).collect())
        .collect()
}

fn datum(seq: &[u32]) -> Datum {
    let n = seq.len() - 1;
    Datum::supervised(seq[..n].to_vec(), seq[1..].to_vec(), vec![1.0; n])
}

/// A worker whose weights (the base's, or LoRA adapters') moved off their start by two steps.
fn trained_worker(arch: &str, lora: Option<LoraConfig>) -> Worker {
    let mut w = Worker::new(load(arch), WorkerConfig { lora, seed: 3, ..Default::default() }).unwrap();
    let data: Vec<Datum> = sequences().iter().filter(|s| s.len() > 1).map(|s| datum(s)).collect();
    for _ in 0..2 {
        w.forward_backward(&data, Some(&common::loss("cross_entropy", &json!({}))), true).unwrap();
        w.optim_step(&AdamParams { learning_rate: 5e-2, ..Default::default() }).unwrap();
    }
    w
}

fn run_all(e: &mut EngineCore, reqs: Vec<Request>) -> Vec<RequestOutput> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add_request(r).unwrap()).collect();
    let mut outs = e.run_until_idle().unwrap();
    outs.sort_by_key(|(id, _)| ids.iter().position(|i| i == id).unwrap());
    outs.into_iter().map(|(_, o)| o).collect()
}

fn one_set_of_bits(arch: &str, lora: Option<LoraConfig>) {
    let what = format!("{arch} {}", if lora.is_some() { "LoRA" } else { "full" });
    let mut w = trained_worker(arch, lora.clone());
    let model = w.model().clone();
    let seqs = sequences();
    let score = sequence_logprobs(&model, &seqs).unwrap();
    for (i, s) in seqs.iter().enumerate() {
        assert_eq!(score[i].len(), s.len() - 1, "{what}: sequence {i}");
        let alone = sequence_logprobs(&model, std::slice::from_ref(s)).unwrap();
        assert_eq!(bits(&alone[0]), bits(&score[i]), "{what}: sequence {i} alone vs in a batch");
    }
    // The Tinker forward: the worker's own forward of the same tokens.
    let scored: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].len() > 1).collect();
    let data: Vec<Datum> = scored.iter().map(|&i| datum(&seqs[i])).collect();
    let forward = w.forward(&data, None, true).unwrap();
    for (o, &i) in forward.loss_fn_outputs.iter().zip(&scored) {
        assert_eq!(bits(&o.logprobs), bits(&score[i]), "{what}: Tinker forward of sequence {i}");
    }
    // The engine: the trainer's weights pushed whole (LoRA merged by the engine as it applies
    // them), and, for LoRA, the adapter registered by name on the bare base beside bare rows.
    let mut engines = vec![];
    let mut pushed = EngineCore::new(load(arch), EngineConfig { max_batch: 16, ..Default::default() }).unwrap();
    pushed.update_weights(w.sampler_weights().unwrap().update(), 1).unwrap();
    engines.push((pushed, None));
    if let Some(cfg) = &lora {
        let mut named = EngineCore::new(load(arch), EngineConfig { max_batch: 16, ..Default::default() }).unwrap();
        named.add_adapter("a", Arc::new(Adapter::from_model(&model, cfg.clone()).unwrap()));
        engines.push((named, Some("a".to_string())));
    }
    for (mut e, adapter) in engines {
        let params = SamplingParams { max_tokens: 4, temperature: 0.0, ignore_eos: true, ..Default::default() };
        let mut reqs: Vec<Request> = seqs
            .iter()
            .map(|s| Request {
                prompt_logprobs: true,
                prompt_topk: 1,
                sample_topk: 1,
                adapter: adapter.clone(),
                ..Request::new(s.clone(), params.clone())
            })
            .collect();
        if adapter.is_some() {
            // A bare row decoding in the same batches.
            reqs.push(Request::new(seqs[4].clone(), params.clone()));
        }
        let outs = run_all(&mut e, reqs);
        let via = if adapter.is_some() { "adapter by name" } else { "pushed weights" };
        for (i, (s, out)) in seqs.iter().zip(&outs).enumerate() {
            let prompt = out.prompt_logprobs.as_ref().unwrap();
            assert_eq!(bits(prompt), bits(&score[i]), "{what} ({via}): prompt log-probs of sequence {i}");
            for (p, top) in out.prompt_topk.as_ref().unwrap().iter().enumerate() {
                if top[0].0 == s[p + 1] {
                    assert_eq!(top[0].1.to_bits(), prompt[p].to_bits(), "{what} ({via}): top-1 at {p} of {i}");
                }
            }
            let g = &out.samples[0];
            let full: Vec<u32> = s.iter().chain(&g.tokens).copied().collect();
            let rescored = &sequence_logprobs(&model, &[full]).unwrap()[0][s.len() - 1..];
            assert_eq!(bits(&g.logprobs), bits(rescored), "{what} ({via}): sampled log-probs of sequence {i}");
            for (k, top) in g.topk.iter().enumerate() {
                assert_eq!((top[0].0, top[0].1.to_bits()), (g.tokens[k], g.logprobs[k].to_bits()), "{what}: greedy");
            }
        }
    }
}

#[test]
fn score_forward_prompt_and_sampled_logprobs_are_one_set_of_bits_full() {
    for arch in ["llama", "qwen2", "qwen3", "qwen3_5"] {
        one_set_of_bits(arch, None);
    }
}

#[test]
fn score_forward_prompt_and_sampled_logprobs_are_one_set_of_bits_lora() {
    for arch in ["llama", "qwen2", "qwen3", "qwen3_5"] {
        one_set_of_bits(arch, Some(LoraConfig::new(4, 8.0, &["all-linear"])));
    }
}

/// `oxrl serve`, end to end: a sampler's prompt log-probs are the bits of the same server's Tinker
/// `forward` of those tokens (a LoRA model after an optimizer step, its weights saved for the
/// sampler), and on the base model the bits of `sequence_logprobs`.
#[test]
fn oxrl_serve_prompt_logprobs_are_its_forward_bits() {
    use super::server_protocol::{fwdbwd_body, lora_model, post, result, ModelCalls};
    let dir = tempfile::tempdir().unwrap();
    let server = common::ServeProcess::start(dir.path(), (32, 64, 3), &["k1"], &[], &[]);
    let port = server.port;
    let (session, model_id) =
        lora_model(port, json!({"rank": 4, "train_attn": true, "train_mlp": true, "train_unembed": true}));
    let mut calls = ModelCalls::new(port, "k1", &model_id);
    let datum = fwdbwd_body("", 0, "cross_entropy")["forward_backward_input"].clone();
    calls.call("forward_backward", json!({"forward_backward_input": datum}));
    calls.call("optim_step", json!({"adam_params": {"learning_rate": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}}));
    let forward = calls.call("forward", json!({"forward_input": datum}));
    let path = calls.call("save_weights_for_sampler", json!({"path": "s"}))["path"].as_str().unwrap().to_string();
    let body = json!({"session_id": session, "sampling_session_seq_id": 0, "model_path": path});
    let sampler = post(port, "create_sampling_session", body).body["sampling_session_id"].as_str().unwrap().to_string();
    // The datum's whole sequence: its inputs and the last target.
    let inputs = datum["data"][0]["model_input"]["chunks"][0]["tokens"].as_array().unwrap().clone();
    let last = datum["data"][0]["loss_fn_inputs"]["target_tokens"]["data"].as_array().unwrap().last().unwrap().clone();
    let tokens: Vec<Value> = inputs.into_iter().chain([last]).collect();
    let prompt_logprobs = |target: Value| -> Vec<u32> {
        let mut body = json!({
            "seq_id": 0, "num_samples": 1, "prompt_logprobs": true,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "stop": []}
        });
        body.as_object_mut().unwrap().extend(target.as_object().unwrap().clone());
        let r = post(port, "asample", body);
        assert_eq!(r.status, 200, "{}", r.body);
        let lps = result(port, r.body["request_id"].as_str().unwrap())["prompt_logprobs"].clone();
        let lps = lps.as_array().unwrap();
        assert!(lps[0].is_null());
        lps[1..].iter().map(|v| (v.as_f64().unwrap() as f32).to_bits()).collect()
    };
    let trained: Vec<u32> = forward["loss_fn_outputs"][0]["logprobs"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v.as_f64().unwrap() as f32).to_bits())
        .collect();
    assert_eq!(trained.len(), tokens.len() - 1);
    assert_eq!(prompt_logprobs(json!({"sampling_session_id": sampler})), trained, "sampler vs Tinker forward");
    let base = Transformer::load(&dir.path().join("tiny"), DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = tokens.iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let scored = bits(&sequence_logprobs(&base, &[ids]).unwrap()[0]);
    assert_eq!(prompt_logprobs(json!({"base_model": "tiny"})), scored, "base sampler vs sequence_logprobs");
    assert_ne!(scored, trained);
}
