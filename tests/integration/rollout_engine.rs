//! The sampling engine: golden greedy tokens, log-probs equal to the trainer's, the sampled
//! distributions (chi-square), stop ids and strings, continuous batching (64 mixed requests
//! each equal to its solo run), cancelling a request, and bad requests refused with a clear
//! error.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::model_config::{Arch, ModelConfig, ModelShape};
use oxrl::model::tokenizer::Tokenizer;
use oxrl::model::{init, logprobs::target_logprobs, Transformer};
use oxrl::rollout::sampler::sample;
use oxrl::rollout::{
    Engine, EngineConfig, EngineCore, Generation, PauseMode, Request, RequestOutput, SamplingParams, StopReason,
};
use rand::{rngs::StdRng, SeedableRng};

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn core(m: &Transformer, max_batch: usize) -> EngineCore {
    EngineCore::new(m.clone(), EngineConfig { max_batch, eos_token_ids: vec![2], ..Default::default() }).unwrap()
}

fn params(max_tokens: usize, temperature: f64, seed: u64) -> SamplingParams {
    SamplingParams { max_tokens, temperature, seed: Some(seed), ignore_eos: true, ..Default::default() }
}

/// Runs one request alone on a fresh engine.
fn solo(m: &Transformer, req: Request) -> RequestOutput {
    let mut e = core(m, 64);
    e.add_request(req).unwrap();
    e.run_until_idle().unwrap().pop().unwrap().1
}

/// The trainer's log p(seq[i] | seq[..i]) for i ≥ 1, with logits divided by `t`.
fn trainer_logprobs(m: &Transformer, seq: &[u32], t: f64) -> Vec<f32> {
    let n = seq.len();
    let logits = m.forward(&[seq.to_vec()], &[(0..n as u32).collect()], &[vec![1; n]], None).unwrap();
    let logits = (logits.narrow(1, 0, n - 1).unwrap() / t).unwrap();
    let targets = Tensor::new(&seq[1..], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    target_logprobs(&logits, &targets).unwrap().squeeze(0).unwrap().to_vec1().unwrap()
}

fn tiny_model(vocab: usize, seed: u64) -> Transformer {
    let shape = ModelShape {
        vocab_size: vocab,
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        rope_theta: 10000.0,
        max_position_embeddings: 128,
        tie_word_embeddings: false,
    };
    let cfg = ModelConfig::from_value(ModelConfig::new_json(Arch::Qwen3, &shape), "tiny".as_ref()).unwrap();
    let mut m = init::random_model(cfg, seed, DType::F32, &Device::Cpu).unwrap();
    // Scale the head so the next-token distribution is far from uniform (a sharper test).
    m.lm_head.weight = (m.lm_head.weight.clone() * 12.0).unwrap();
    m
}

#[test]
fn greedy_tokens_equal_transformers() {
    for arch in ARCHS {
        let g = Golden::load(arch);
        let (prompt, want) = g.greedy();
        let m = load(arch);
        let out = solo(&m, Request::new(prompt.clone(), params(want.len(), 0.0, 0)));
        assert_eq!(out.samples[0].tokens, want, "{arch}: engine core");
        assert_eq!(out.samples[0].stop_reason, StopReason::Length);
        assert_eq!(out.samples[0].versions, vec![0; want.len()]);
        // The same through the engine thread.
        let e = Engine::start(m, EngineConfig::default()).unwrap();
        let out = e.generate(Request::new(prompt, params(want.len(), 0.0, 0))).unwrap();
        assert_eq!(out.samples[0].tokens, want, "{arch}: engine thread");
    }
}

#[test]
fn logprobs_equal_trainer_logprobs_at_any_temperature() {
    let m = load("qwen3");
    let prompt = vec![5, 6, 7, 8, 9, 10];
    for (t, seed) in [(1.0, 3), (0.7, 4), (1.6, 5), (0.0, 0)] {
        let out = solo(&m, Request::new(prompt.clone(), params(20, t, seed)));
        let g = &out.samples[0];
        assert_eq!(g.tokens.len(), 20);
        let seq: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
        // Greedy reports the model's own (untempered) log-probs.
        let want = trainer_logprobs(&m, &seq, if t == 0.0 { 1.0 } else { t });
        for (i, &x) in g.logprobs.iter().enumerate() {
            let y = want[prompt.len() - 1 + i];
            assert!((x - y).abs() < 1e-5, "T={t} token {i}: engine {x} vs trainer {y}");
        }
    }
}

#[test]
fn prompt_logprobs_equal_trainer_logprobs() {
    let m = load("llama");
    let prompt: Vec<u32> = vec![11, 3, 250, 17, 40, 41, 99];
    let out =
        solo(&m, Request { prompt_logprobs: true, num_samples: 2, ..Request::new(prompt.clone(), params(3, 1.0, 1)) });
    let lp = out.prompt_logprobs.unwrap();
    let want = trainer_logprobs(&m, &prompt, 1.0);
    assert_eq!(lp.len(), prompt.len() - 1);
    for (x, y) in lp.iter().zip(&want) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
    let one = solo(&m, Request { prompt_logprobs: true, ..Request::new(vec![7], params(2, 0.0, 0)) });
    assert_eq!(one.prompt_logprobs, Some(vec![]));
    assert_eq!(one.samples[0].tokens.len(), 2);
    assert_eq!(solo(&m, Request::new(prompt, params(3, 1.0, 1))).prompt_logprobs, None);
}

/// Pearson's chi-square statistic of `counts` against probabilities `p` (cells with p = 0 must
/// have no counts).
fn chi_square(counts: &[usize], p: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let mut stat = 0.0;
    let mut cells = 0;
    for (&c, &q) in counts.iter().zip(p) {
        if q == 0.0 {
            assert_eq!(c, 0, "a token outside the support was sampled");
            continue;
        }
        let e = q * n as f64;
        stat += (c as f64 - e).powi(2) / e;
        cells += 1;
    }
    (stat, cells - 1)
}

/// The 99.9% quantile of chi-square with `df` degrees of freedom (Wilson–Hilferty).
fn chi_square_critical(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.0902;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// The intended distribution, written independently of the sampler: softmax(z / T), keep the
/// top k, then the smallest prefix with mass ≥ top_p, renormalised.
fn intended(z: &[f32], t: f64, top_k: usize, top_p: f64) -> Vec<f64> {
    let max = z.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let e: Vec<f64> = z.iter().map(|&x| ((x as f64 - max) / t).exp()).collect();
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
    let k = if top_k == 0 { z.len() } else { top_k.min(z.len()) };
    let kept = &order[..k];
    let total: f64 = kept.iter().map(|&i| e[i]).sum();
    let mut acc = 0.0;
    let mut support = vec![];
    for &i in kept {
        support.push(i);
        acc += e[i] / total;
        if acc >= top_p {
            break;
        }
    }
    let mass: f64 = support.iter().map(|&i| e[i]).sum();
    let mut p = vec![0.0; z.len()];
    for i in support {
        p[i] = e[i] / mass;
    }
    p
}

const CASES: [(f64, usize, f64); 5] = [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 4, 1.0), (1.0, 0, 0.8), (0.8, 5, 0.9)];

#[test]
fn sampler_distribution_matches_intended() {
    let z: Vec<f32> = vec![2.0, 1.5, 1.2, 0.5, 0.0, -0.3, -1.0, -2.5];
    for (t, top_k, top_p) in CASES {
        let p = SamplingParams { temperature: t, top_k, top_p, ..Default::default() };
        let want = intended(&z, t, top_k, top_p);
        let mut rng = StdRng::seed_from_u64(42);
        let mut counts = vec![0usize; z.len()];
        for _ in 0..20_000 {
            let (tok, lp) = sample(&z, &p, &mut rng).unwrap();
            counts[tok as usize] += 1;
            assert!(
                (lp as f64 - want[tok as usize].ln()).abs() < 1e-5,
                "log-prob is not that of the distribution drawn from"
            );
        }
        let (stat, df) = chi_square(&counts, &want);
        assert!(
            stat < chi_square_critical(df),
            "T={t} k={top_k} p={top_p}: chi-square {stat:.1} (df {df}), counts {counts:?}, want {want:?}"
        );
    }
}

/// A vocabulary-sized row (the vectorised weights in blocks of 16 and groups of 256, with a
/// tail): every draw's log-prob is that of the intended distribution, and the frequencies of the
/// likeliest tokens and of the rest match it (chi-square over those bins).
#[test]
fn sampler_on_a_long_row_matches_intended() {
    let z: Vec<f32> = (0..4099)
        .map(|i| if i % 1000 == 7 { 3.0 - (i / 1000) as f32 * 0.4 } else { -((i * 37 % 101) as f32) * 0.05 })
        .collect();
    for t in [1.0, 0.7] {
        let p = SamplingParams { temperature: t, ..Default::default() };
        let want = intended(&z, t, 0, 1.0);
        let top: Vec<usize> = (0..5).map(|k| k * 1000 + 7).collect();
        let mut rng = StdRng::seed_from_u64(7);
        let mut counts = vec![0usize; top.len() + 1];
        for _ in 0..20_000 {
            let (tok, lp) = sample(&z, &p, &mut rng).unwrap();
            assert!((lp as f64 - want[tok as usize].ln()).abs() < 1e-5, "T={t}: token {tok}: log-prob {lp}");
            counts[top.iter().position(|&i| i == tok as usize).unwrap_or(top.len())] += 1;
        }
        let mut bins: Vec<f64> = top.iter().map(|&i| want[i]).collect();
        bins.push(1.0 - bins.iter().sum::<f64>());
        let (stat, df) = chi_square(&counts, &bins);
        assert!(
            stat < chi_square_critical(df),
            "T={t}: chi-square {stat:.1} (df {df}), counts {counts:?}, want {bins:?}"
        );
    }
}

#[test]
fn engine_distribution_matches_intended() {
    let vocab = 12;
    let m = tiny_model(vocab, 7);
    let prompt = vec![1u32, 2, 3];
    let logits = m.forward(std::slice::from_ref(&prompt), &[vec![0, 1, 2]], &[vec![1; 3]], None).unwrap();
    let z: Vec<f32> = logits.squeeze(0).unwrap().get(2).unwrap().to_vec1().unwrap();
    for (t, top_k, top_p) in CASES {
        let want = intended(&z, t, top_k, top_p);
        let mut e = EngineCore::new(m.clone(), EngineConfig { max_batch: 64, ..Default::default() }).unwrap();
        let (requests, n) = (48, 64);
        for r in 0..requests {
            let p = SamplingParams {
                max_tokens: 1,
                temperature: t,
                top_k,
                top_p,
                seed: Some((r * n) as u64),
                ..Default::default()
            };
            e.add_request(Request { num_samples: n, ..Request::new(prompt.clone(), p) }).unwrap();
        }
        let mut counts = vec![0usize; vocab];
        for (_, out) in e.run_until_idle().unwrap() {
            for g in out.samples {
                counts[g.tokens[0] as usize] += 1;
                assert!((g.logprobs[0] as f64 - want[g.tokens[0] as usize].ln()).abs() < 1e-4);
            }
        }
        let (stat, df) = chi_square(&counts, &want);
        assert!(df >= 2, "T={t} k={top_k} p={top_p}: the distribution is too sharp to test: {want:?}");
        assert!(
            stat < chi_square_critical(df),
            "T={t} k={top_k} p={top_p}: chi-square {stat:.1} (df {df}), counts {counts:?}, want {want:?}"
        );
    }
}

#[test]
fn stop_ids_and_stop_strings_end_generation_with_the_stop_included() {
    let m = load("qwen3");
    let tok = Arc::new(Tokenizer::from_dir(&fixture_dir("qwen3")).unwrap());
    let prompt = vec![20u32, 21, 22];
    let free = solo(&m, Request::new(prompt.clone(), params(40, 1.0, 9))).samples.remove(0);
    // A stop id: the first token that has not appeared before it, past position 3.
    let k = (3..40).find(|&k| !free.tokens[..k].contains(&free.tokens[k])).unwrap();
    let stop_id = free.tokens[k];
    let p = SamplingParams { stop_token_ids: vec![stop_id], ..params(40, 1.0, 9) };
    let g = solo(&m, Request::new(prompt.clone(), p)).samples.remove(0);
    assert_eq!(g.tokens, free.tokens[..=k].to_vec());
    assert_eq!(g.stop_reason, StopReason::Stop);
    assert_eq!(g.logprobs, free.logprobs[..=k].to_vec());
    // The model's EOS ends generation too, unless ignore_eos.
    let mut e =
        EngineCore::new(m.clone(), EngineConfig { eos_token_ids: vec![stop_id], ..Default::default() }).unwrap();
    e.add_request(Request::new(prompt.clone(), SamplingParams { ignore_eos: false, ..params(40, 1.0, 9) })).unwrap();
    e.add_request(Request::new(prompt.clone(), params(40, 1.0, 9))).unwrap();
    let outs = e.run_until_idle().unwrap();
    assert_eq!(outs[0].1.samples[0].tokens, free.tokens[..=k].to_vec());
    assert_eq!(outs[0].1.samples[0].stop_reason, StopReason::Stop);
    assert_eq!(outs[1].1.samples[0].tokens, free.tokens);

    // A stop string: a piece of the text that first appears with token k.
    let text = |n: usize| tok.decode(&free.tokens[..n], false).unwrap();
    let (k, stop) = (4..40)
        .find_map(|k| {
            let (before, now) = (text(k), text(k + 1));
            let chars: Vec<char> = now.chars().collect();
            (1..=chars.len().min(4))
                .map(|l| chars[chars.len() - l..].iter().collect::<String>())
                .find(|s| !before.contains(s.as_str()))
                .map(|s| (k, s))
        })
        .unwrap();
    let p = SamplingParams { stop_strings: vec![stop.clone()], ..params(40, 1.0, 9) };
    let mut e =
        EngineCore::new(m.clone(), EngineConfig { tokenizer: Some(tok.clone()), ..Default::default() }).unwrap();
    e.add_request(Request::new(prompt.clone(), p)).unwrap();
    let g = e.run_until_idle().unwrap().pop().unwrap().1.samples.remove(0);
    assert_eq!(g.tokens, free.tokens[..=k].to_vec(), "stop string {stop:?}");
    assert_eq!(g.stop_reason, StopReason::Stop);
    assert!(tok.decode(&g.tokens, false).unwrap().contains(&stop));
}

/// 64 requests with mixed prompts, lengths, temperatures, truncations, sample counts and stops,
/// through an engine that holds 16 rows at once (so requests queue, join and leave): each
/// equals its solo run. Then the same through the engine thread, submitted all at once.
#[test]
fn sixty_four_mixed_requests_each_equal_their_solo_run() {
    let m = load("qwen2");
    let reqs: Vec<Request> = (0..64u64)
        .map(|i| {
            let len = 1 + (i as usize * 7) % 19;
            let prompt: Vec<u32> = (0..len).map(|j| ((i as usize * 31 + j * 17) % 299 + 1) as u32).collect();
            let p = SamplingParams {
                max_tokens: 1 + (i as usize * 5) % 24,
                temperature: [0.0, 0.7, 1.0, 1.3][i as usize % 4],
                top_k: [0, 5, 50][i as usize % 3],
                top_p: [1.0, 0.9][i as usize % 2],
                seed: Some(1000 + i),
                stop_token_ids: if i % 5 == 0 { vec![(i * 13 % 300) as u32, 7, 11] } else { vec![] },
                ignore_eos: i % 3 != 0,
                ..Default::default()
            };
            Request { num_samples: 1 + (i as usize % 3), prompt_logprobs: i % 4 == 1, ..Request::new(prompt, p) }
        })
        .collect();
    let want: Vec<RequestOutput> = reqs.iter().map(|r| solo(&m, r.clone())).collect();
    let same = |got: &RequestOutput, want: &RequestOutput, what: &str| {
        assert_eq!(got.samples.len(), want.samples.len());
        for (a, b) in got.samples.iter().zip(&want.samples) {
            assert_eq!(a.tokens, b.tokens, "{what}");
            assert_eq!(a.stop_reason, b.stop_reason, "{what}");
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert_eq!(x.to_bits(), y.to_bits(), "{what}: {x} vs {y}");
            }
        }
        assert_eq!(got.prompt_logprobs.is_some(), want.prompt_logprobs.is_some());
    };

    let mut e = core(&m, 16);
    for r in &reqs {
        e.add_request(r.clone()).unwrap();
    }
    let mut max_rows = 0;
    let mut outs = vec![];
    while e.has_work() {
        outs.extend(e.step().unwrap());
        max_rows = max_rows.max(e.stats().running_rows);
    }
    assert!((10..=16).contains(&max_rows), "rows in flight: {max_rows}");
    outs.sort_by_key(|(id, _)| *id);
    assert_eq!(outs.len(), 64);
    for (i, (_, out)) in outs.iter().enumerate() {
        same(out, &want[i], &format!("core, request {i}"));
    }

    let engine =
        Engine::start(m.clone(), EngineConfig { max_batch: 24, eos_token_ids: vec![2], ..Default::default() }).unwrap();
    let pending: Vec<_> = reqs.iter().map(|r| engine.submit(r.clone())).collect();
    for (i, handle) in pending.into_iter().enumerate() {
        same(&handle.wait().unwrap(), &want[i], &format!("thread, request {i}"));
    }
    let h = engine.health();
    assert!(h.alive);
    assert_eq!(h.completed_requests, 64);
    assert_eq!(h.stats.unwrap().running_rows, 0);
}

#[test]
fn bad_requests_are_clear_errors() {
    let m = load("qwen3");
    let mut e =
        EngineCore::new(m.clone(), EngineConfig { max_batch: 4, kv_cache_tokens: Some(100), ..Default::default() })
            .unwrap();
    let ok = params(4, 0.0, 0);
    let err = |e: &mut EngineCore, r: Request| -> String { e.add_request(r).unwrap_err().to_string() };
    let mentions = |msg: String, words: &[&str]| {
        for w in words {
            assert!(msg.contains(w), "error {msg:?} does not mention {w:?}");
        }
    };
    mentions(err(&mut e, Request::new(vec![], ok.clone())), &["prompt is empty"]);
    mentions(err(&mut e, Request::new(vec![5, 300, 7], ok.clone())), &["token id 300", "position 1", "vocab_size 300"]);
    mentions(
        err(&mut e, Request::new(vec![5, 6], params(255, 0.0, 0))),
        &["prompt length 2", "max_tokens 255", "max_position_embeddings 256"],
    );
    mentions(
        err(&mut e, Request::new(vec![5; 60], params(60, 0.0, 0))),
        &["needs 120 KV-cache slots", "budget is 100", "never fit"],
    );
    mentions(
        err(&mut e, Request { num_samples: 3, ..Request::new(vec![5; 20], params(20, 0.0, 0)) }),
        &["needs 120", "never fit"],
    );
    mentions(
        err(&mut e, Request { num_samples: 5, ..Request::new(vec![5], ok.clone()) }),
        &["num_samples 5", "max_batch 4"],
    );
    mentions(err(&mut e, Request { num_samples: 0, ..Request::new(vec![5], ok.clone()) }), &["num_samples"]);
    for top_p in [0.0, 1.5, f64::NAN, -0.1] {
        mentions(err(&mut e, Request::new(vec![5], SamplingParams { top_p, ..ok.clone() })), &["top_p"]);
    }
    for temperature in [-1.0, f64::INFINITY, f64::NAN] {
        mentions(err(&mut e, Request::new(vec![5], SamplingParams { temperature, ..ok.clone() })), &["temperature"]);
    }
    mentions(
        err(&mut e, Request::new(vec![5], SamplingParams { stop_strings: vec!["x".into()], ..ok.clone() })),
        &["stop strings", "tokenizer"],
    );
    mentions(
        err(&mut e, Request::new(vec![5], SamplingParams { stop_strings: vec!["".into()], ..ok.clone() })),
        &["stop string is empty"],
    );
    // Nothing was queued; a good request still runs; max_tokens 0 gives an empty completion.
    assert!(!e.has_work());
    e.add_request(Request::new(vec![5, 6], ok.clone())).unwrap();
    e.add_request(Request::new(vec![5, 6], params(0, 0.0, 0))).unwrap();
    let outs = e.run_until_idle().unwrap();
    assert_eq!(outs[0].1.samples[0].tokens.len(), 4);
    assert_eq!(outs[1].1.samples[0], Generation::empty());
    assert!(EngineCore::new(m.clone(), EngineConfig { max_batch: 0, ..Default::default() }).is_err());

    // Through the engine thread: the error comes back, the engine lives on.
    let engine =
        Engine::start(m, EngineConfig { max_batch: 4, kv_cache_tokens: Some(100), ..Default::default() }).unwrap();
    let msg = engine.generate(Request::new(vec![5; 60], params(60, 0.0, 0))).unwrap_err().to_string();
    assert!(msg.contains("never fit"), "{msg}");
    assert!(engine.generate(Request::new(vec![], ok.clone())).is_err());
    assert_eq!(engine.generate(Request::new(vec![5, 6], ok)).unwrap().samples[0].tokens.len(), 4);
    assert!(engine.health().alive);
}

/// A cancelled request completes at once with the tokens it has (a prefix of its full run),
/// stop reason `cancelled`; cancelling a finished request changes nothing; the engine carries on.
#[test]
fn a_cancelled_request_ends_with_what_it_has() {
    let m = load("qwen3");
    let prompt = vec![20u32, 21, 22];
    let req = Request { num_samples: 2, ..Request::new(prompt.clone(), params(240, 1.0, 9)) };
    let full = solo(&m, req.clone());
    let engine = Engine::start(m, EngineConfig::default()).unwrap();
    let handle = engine.submit(req.clone());
    handle.cancel();
    let out = handle.wait().unwrap();
    assert_eq!(out.samples.len(), 2);
    for (g, f) in out.samples.iter().zip(&full.samples) {
        assert_eq!(g.stop_reason, StopReason::Cancelled);
        assert!(g.tokens.len() < 240, "the request ran to its end");
        assert_eq!(g.tokens, f.tokens[..g.tokens.len()].to_vec());
        assert_eq!(g.logprobs, f.logprobs[..g.tokens.len()].to_vec());
    }
    // Cancelled while waiting (the engine paused): nothing sampled.
    engine.pause(PauseMode::Keep).wait().unwrap();
    let handle = engine.submit(req.clone());
    handle.cancel();
    let out = handle.wait().unwrap();
    assert!(out.samples.iter().all(|g| g.tokens.is_empty() && g.stop_reason == StopReason::Cancelled), "{out:?}");
    engine.resume().wait().unwrap();
    // A finished request: cancelling it is a no-op.
    let short = Request::new(prompt, params(5, 1.0, 9));
    let mut handle = engine.submit(short.clone());
    let done = loop {
        if let Some(r) = handle.try_wait() {
            break r.unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    handle.cancel();
    assert_eq!(done.samples[0].stop_reason, StopReason::Length);
    assert_eq!(done.samples[0].tokens.len(), 5);
    assert_eq!(engine.generate(short).unwrap().samples, done.samples);
    let h = engine.health();
    assert!(h.alive && h.last_error.is_none(), "{h:?}");
    assert_eq!(h.stats.unwrap().running_rows, 0);
}

/// Requests that fit the KV budget only one at a time wait for room instead of failing.
#[test]
fn kv_budget_admits_requests_as_room_frees_up() {
    let m = load("llama");
    let mut e =
        EngineCore::new(m.clone(), EngineConfig { max_batch: 8, kv_cache_tokens: Some(60), ..Default::default() })
            .unwrap();
    for i in 0..4 {
        e.add_request(Request::new(vec![5 + i; 10], params(20, 0.0, 0))).unwrap();
    }
    let mut outs = vec![];
    while e.has_work() {
        outs.extend(e.step().unwrap());
        let s = e.stats();
        assert!(s.running_rows <= 2, "{s:?}");
        assert!(s.running_rows * s.cached_positions <= 60, "{s:?}");
    }
    assert_eq!(outs.len(), 4);
    outs.sort_by_key(|(id, _)| *id);
    for (i, (_, o)) in outs.iter().enumerate() {
        let want = solo(&m, Request::new(vec![5 + i as u32; 10], params(20, 0.0, 0)));
        assert_eq!(o.samples[0].tokens, want.samples[0].tokens);
    }
}

/// A priority request beside a running batch decodes in the lane: it finishes within its own
/// steps plus the main batch's turns (never more main steps than its own), its tokens and
/// log-probs equal its solo run bit for bit, as do the main batch's; one cancelled in the lane
/// ends with what it has and the main batch carries on unchanged.
#[test]
fn a_priority_request_takes_turns_with_the_main_batch_and_equals_its_solo_run() {
    let m = tiny_model(64, 3);
    let big = Request { num_samples: 16, ..Request::new(vec![5, 6, 7], params(40, 1.0, 11)) };
    let small = Request { priority: true, ..Request::new(vec![9, 8], params(6, 1.0, 12)) };
    let mut e = core(&m, 64);
    let big_id = e.add_request(big.clone()).unwrap();
    // The main batch runs a while, then the small request comes.
    let mut done = vec![];
    for _ in 0..3 {
        done.extend(e.step().unwrap());
    }
    let small_id = e.add_request(small.clone()).unwrap();
    let mut steps = 0;
    while !done.iter().any(|(id, _)| *id == small_id) {
        done.extend(e.step().unwrap());
        steps += 1;
    }
    assert!(steps <= 2 * 6, "the priority request took {steps} steps for 6 tokens");
    assert!(!done.iter().any(|(id, _)| *id == big_id), "the main batch finished first");
    done.extend(e.run_until_idle().unwrap());
    let out = |id| &done.iter().find(|(i, _)| *i == id).unwrap().1;
    let sample_bits = |o: &RequestOutput| {
        o.samples
            .iter()
            .map(|g| (g.tokens.clone(), g.logprobs.iter().map(|l| l.to_bits()).collect::<Vec<_>>()))
            .collect::<Vec<_>>()
    };
    assert_eq!(sample_bits(out(small_id)), sample_bits(&solo(&m, Request { priority: false, ..small.clone() })));
    assert_eq!(sample_bits(out(big_id)), sample_bits(&solo(&m, big.clone())));
    // A lane request cancelled midway ends with what it has; the main batch carries on.
    let mut e = core(&m, 64);
    let big_id = e.add_request(big.clone()).unwrap();
    e.step().unwrap();
    let small_id = e.add_request(Request { params: params(30, 1.0, 12), ..small.clone() }).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    let cancelled = e.abort(small_id).unwrap().unwrap();
    assert!(cancelled.samples[0].tokens.len() < 30);
    assert_eq!(e.stats().running_rows, 16);
    let rest = e.run_until_idle().unwrap();
    assert_eq!(sample_bits(&rest.iter().find(|(i, _)| *i == big_id).unwrap().1), sample_bits(&solo(&m, big)));
}
