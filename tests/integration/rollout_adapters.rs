//! Many LoRA adapters over one base in one engine batch: per-row adapter logits equal
//! the logits of the model with that adapter attached; requests of three adapters and of the bare
//! base, decoded together, each give the tokens and log-probs of their run alone with the adapter
//! attached to the model; unknown adapters are clear errors and removing an adapter leaves the
//! requests that use it alone.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::lora::{self, LoraConfig};
use oxrl::model::row_adapters::{Adapter, RowAdapters};
use oxrl::model::Transformer;
use oxrl::rollout::{Engine, EngineConfig, EngineCore, Request, RequestOutput, SamplingParams};

fn base() -> Transformer {
    Transformer::load(&fixture_dir("qwen2"), DType::F32, &Device::Cpu).unwrap()
}

/// The base with a random adapter attached (B random too, so that it changes the model).
fn adapted(base: &Transformer, cfg: &LoraConfig, seed: u64) -> Transformer {
    let mut m = base.clone();
    lora::attach_new(&mut m, cfg, seed).unwrap();
    for (i, (_, lin)) in m.linears_mut().into_iter().enumerate() {
        if let Some(l) = lin.lora.as_mut() {
            l.b = (Tensor::randn(0f32, 1.0, l.b.dims(), &Device::Cpu).unwrap() * (0.05 + 0.01 * i as f64)).unwrap();
        }
    }
    m
}

/// Three different adapters (targets, ranks, scales), each as an attached model and detached.
fn adapters(base: &Transformer) -> Vec<(Transformer, Arc<Adapter>)> {
    let cfgs = [
        LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]),
        LoraConfig::new(8, 16.0, &["all-linear"]),
        LoraConfig::new(2, 4.0, &["up_proj", "lm_head"]),
    ];
    cfgs.iter()
        .enumerate()
        .map(|(k, cfg)| {
            let m = adapted(base, cfg, 10 + k as u64);
            let a = Arc::new(Adapter::from_model(&m, cfg.clone()).unwrap());
            (m, a)
        })
        .collect()
}

fn name(k: usize) -> String {
    format!("adapter-{k}")
}

fn core(m: &Transformer, max_batch: usize) -> EngineCore {
    EngineCore::new(m.clone(), EngineConfig { max_batch, eos_token_ids: vec![2], ..Default::default() }).unwrap()
}

fn same(got: &RequestOutput, want: &RequestOutput, what: &str) {
    assert_eq!(got.samples.len(), want.samples.len(), "{what}");
    for (a, b) in got.samples.iter().zip(&want.samples) {
        assert_eq!(a.tokens, b.tokens, "{what}");
        assert_eq!(a.stop_reason, b.stop_reason, "{what}");
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-5, "{what}: {x} vs {y}");
        }
    }
    match (&got.prompt_logprobs, &want.prompt_logprobs) {
        (Some(a), Some(b)) => {
            assert_eq!(a.len(), b.len(), "{what}");
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() < 1e-5, "{what}: prompt {x} vs {y}");
            }
        }
        (a, b) => assert_eq!(a.is_some(), b.is_some(), "{what}"),
    }
}

#[test]
fn per_row_adapter_logits_equal_the_attached_models() {
    let base = base();
    let ads = adapters(&base);
    let rows: Vec<Vec<u32>> = (0..5u32).map(|r| (0..7).map(|j| (r * 37 + j * 11) % 290 + 3).collect()).collect();
    // Row r uses adapter r % 4 (3 = none); rows 0 and 4 share adapter 0.
    let which = |r: usize| (r % 4 < 3).then_some(r % 4);
    let per_row: Vec<Option<&Arc<Adapter>>> = (0..rows.len()).map(|r| which(r).map(|k| &ads[k].1)).collect();
    let ra = RowAdapters::new(&per_row, &Device::Cpu).unwrap();
    let n = rows[0].len();
    let pos = vec![(0..n as u32).collect::<Vec<_>>(); rows.len()];
    let mask = vec![vec![1u8; n]; rows.len()];
    let h = base.forward_hidden_adapted(&rows, &pos, &mask, None, ra.as_ref()).unwrap();
    let got = base.logits_adapted(&h, ra.as_ref()).unwrap();
    for (r, row) in rows.iter().enumerate() {
        let model = which(r).map_or(&base, |k| &ads[k].0);
        let want = model.forward(std::slice::from_ref(row), &pos[..1], &mask[..1], None).unwrap();
        let got_r = got.narrow(0, r, 1).unwrap();
        let d = max_abs_diff(&got_r, &want);
        assert!(d < 1e-5, "row {r}: max |Δ| {d}");
        // The adapters matter: the bare base differs.
        if which(r).is_some() {
            let bare = base.forward(std::slice::from_ref(row), &pos[..1], &mask[..1], None).unwrap();
            assert!(max_abs_diff(&got_r, &bare) > 1e-3, "row {r}: adapter had no effect");
        }
    }
    // A batch of one adapter computes exactly what the attached adapter computes.
    let all = vec![Some(&ads[1].1); rows.len()];
    let ra = RowAdapters::new(&all, &Device::Cpu).unwrap();
    let h = base.forward_hidden_adapted(&rows, &pos, &mask, None, ra.as_ref()).unwrap();
    let got = base.logits_adapted(&h, ra.as_ref()).unwrap();
    assert_eq!(max_abs_diff(&got, &ads[1].0.forward(&rows, &pos, &mask, None).unwrap()), 0.0);
}

/// Sixteen requests: adapters 0, 1, 2 and the bare base in turn, mixed lengths, temperatures,
/// samples and prompt log-probs.
fn requests() -> Vec<(Option<usize>, Request)> {
    (0..16u64)
        .map(|i| {
            let k = (i % 4 < 3).then_some(i as usize % 4);
            let len = 2 + (i as usize * 5) % 11;
            let prompt: Vec<u32> = (0..len).map(|j| ((i as usize * 29 + j * 13) % 290 + 3) as u32).collect();
            let p = SamplingParams {
                max_tokens: 3 + (i as usize * 7) % 14,
                temperature: [0.0, 0.8, 1.0][i as usize % 3],
                top_k: [0, 20][i as usize % 2],
                seed: Some(500 + i),
                ignore_eos: true,
                ..Default::default()
            };
            let req = Request {
                num_samples: 1 + (i as usize % 2),
                prompt_logprobs: i % 3 == 1,
                adapter: k.map(name),
                ..Request::new(prompt, p)
            };
            (k, req)
        })
        .collect()
}

#[test]
fn adapters_in_one_batch_each_equal_their_run_alone() {
    let base = base();
    let ads = adapters(&base);
    let reqs = requests();
    // Alone: a fresh engine over the model with the adapter attached, no adapter named.
    let want: Vec<RequestOutput> = reqs
        .iter()
        .map(|(k, r)| {
            let model = k.map_or(&base, |k| &ads[k].0);
            let mut e = core(model, 64);
            e.add_request(Request { adapter: None, ..r.clone() }).unwrap();
            e.run_until_idle().unwrap().pop().unwrap().1
        })
        .collect();

    let mut e = core(&base, 32);
    for (k, (_, a)) in ads.iter().enumerate() {
        e.add_adapter(&name(k), a.clone());
    }
    for (_, r) in &reqs {
        e.add_request(r.clone()).unwrap();
    }
    let mut most = 0;
    let mut outs = vec![];
    while e.has_work() {
        outs.extend(e.step().unwrap());
        most = most.max(e.stats().running_rows);
    }
    assert!(most >= 16, "rows decoded together at most: {most}");
    outs.sort_by_key(|(id, _)| *id);
    assert_eq!(outs.len(), reqs.len());
    for (i, (_, out)) in outs.iter().enumerate() {
        same(out, &want[i], &format!("one batch, request {i} (adapter {:?})", reqs[i].0));
    }

    // The engine thread: adapters registered through `Engine`, requests submitted at once.
    let engine = Engine::start(base.clone(), EngineConfig { eos_token_ids: vec![2], ..Default::default() }).unwrap();
    for (k, (_, a)) in ads.iter().enumerate() {
        engine.add_adapter(&name(k), a.clone()).wait().unwrap();
    }
    let pending: Vec<_> = reqs.iter().map(|(_, r)| engine.submit(r.clone())).collect();
    for (i, h) in pending.into_iter().enumerate() {
        same(&h.wait().unwrap(), &want[i], &format!("engine thread, request {i}"));
    }
}

#[test]
fn unknown_and_removed_adapters() {
    let base = base();
    let ads = adapters(&base);
    let mut e = core(&base, 8);
    let p = SamplingParams { max_tokens: 6, temperature: 1.0, seed: Some(3), ignore_eos: true, ..Default::default() };
    let req = Request { adapter: Some("nope".into()), ..Request::new(vec![5, 6, 7], p.clone()) };
    let err = e.add_request(req).unwrap_err().to_string();
    assert!(err.contains("unknown LoRA adapter `nope`"), "{err}");

    // Removed after a request was admitted: that request still samples with it.
    e.add_adapter("a", ads[1].1.clone());
    let req = Request { adapter: Some("a".into()), ..Request::new(vec![5, 6, 7], p.clone()) };
    e.add_request(req.clone()).unwrap();
    let mut outs = e.step().unwrap();
    assert!(e.remove_adapter("a"));
    assert!(!e.remove_adapter("a"));
    while e.has_work() {
        outs.extend(e.step().unwrap());
    }
    let mut alone = core(&ads[1].0, 8);
    alone.add_request(Request { adapter: None, ..req.clone() }).unwrap();
    same(&outs.pop().unwrap().1, &alone.run_until_idle().unwrap().pop().unwrap().1, "removed while running");
    let err = e.add_request(req).unwrap_err().to_string();
    assert!(err.contains("unknown LoRA adapter `a`"), "{err}");
}

/// An engine owns its weights: the variables of the model and of the adapter it was built from
/// (a trainer's, updated in place by optimizer steps) are copied, so training them changes
/// nothing the engine samples until a versioned weight update. Controls: an engine and an
/// adapter built after the in-place change do sample differently.
#[test]
fn an_engine_owns_its_weights_and_adapters() {
    let mut m = base();
    let vars = m.make_trainable().unwrap();
    let cfg = LoraConfig::new(4, 8.0, &["all-linear"]);
    let adapter_vars = lora::attach_new(&mut m, &cfg, 3).unwrap();
    let mut plain = m.without_variables().unwrap();
    for (_, lin) in plain.linears_mut() {
        lin.lora = None;
    }
    let req = |adapter: Option<&str>| Request {
        adapter: adapter.map(str::to_string),
        ..Request::new(
            vec![1, 5, 9, 14],
            SamplingParams { max_tokens: 6, temperature: 1.0, seed: Some(4), ignore_eos: true, ..Default::default() },
        )
    };
    let run = |e: &mut EngineCore, adapter: Option<&str>| {
        e.add_request(req(adapter)).unwrap();
        e.run_until_idle().unwrap().pop().unwrap().1
    };
    let mut e = core(&m, 8);
    let mut on_plain = core(&plain, 8);
    on_plain.add_adapter("a", Arc::new(Adapter::from_model(&m, cfg.clone()).unwrap()));
    let (before, before_adapter) = (run(&mut e, None), run(&mut on_plain, Some("a")));

    // In place, as an optimizer step would: every base weight scaled, every B made nonzero.
    for (_, v) in &vars {
        v.set(&(v.as_tensor() * 1.5).unwrap()).unwrap();
    }
    for (name, v) in &adapter_vars {
        if name.contains("lora_B") {
            v.set(&(Tensor::ones(v.dims(), DType::F32, &Device::Cpu).unwrap() * 0.1).unwrap()).unwrap();
        }
    }
    same(&run(&mut e, None), &before, "engine after the in-place change");
    same(&run(&mut on_plain, Some("a")), &before_adapter, "adapter after the in-place change");

    let after = run(&mut core(&m, 8), None);
    assert_ne!(after.samples[0].logprobs, before.samples[0].logprobs, "control: the change matters");
    let mut fresh = core(&plain, 8);
    fresh.add_adapter("a", Arc::new(Adapter::from_model(&m, cfg).unwrap()));
    let after_adapter = run(&mut fresh, Some("a"));
    assert_ne!(after_adapter.samples[0].logprobs, before_adapter.samples[0].logprobs, "control: adapter");
}
