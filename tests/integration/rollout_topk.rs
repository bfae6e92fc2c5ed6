//! Top-k log-probs from the sampling engine (Tinker's `topk_prompt_logprobs` and
//! `topk_sample_logprobs`): equal to the k largest entries of log softmax of the trainer's
//! logits at each prompt position, and of the sampling distribution (logits / T) at each sampled
//! token; a sampled token found among them has the log-prob the engine reported for it.

use crate::common;

use candle_core::{DType, Device};
use common::*;
use oxrl::model::Transformer;
use oxrl::rollout::top_logprobs::top_logprobs;
use oxrl::rollout::{EngineConfig, EngineCore, Request, SamplingParams};

fn model() -> Transformer {
    Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu).unwrap()
}

/// log softmax(z / t) of the trainer's logits at every position of `seq`, sorted (most likely
/// first, ties by id): an independent computation through candle.
fn trainer_sorted(m: &Transformer, seq: &[u32], t: f64) -> Vec<Vec<(u32, f32)>> {
    let n = seq.len();
    let logits = m.forward(&[seq.to_vec()], &[(0..n as u32).collect()], &[vec![1; n]], None).unwrap();
    let x = (logits / t).unwrap();
    let lp = x.broadcast_sub(&x.exp().unwrap().sum_keepdim(2).unwrap().log().unwrap()).unwrap();
    let rows: Vec<Vec<f32>> = lp.squeeze(0).unwrap().to_vec2().unwrap();
    rows.into_iter()
        .map(|r| {
            let mut v: Vec<(u32, f32)> = r.into_iter().enumerate().map(|(i, x)| (i as u32, x)).collect();
            v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            v
        })
        .collect()
}

fn close(got: &[(u32, f32)], want: &[(u32, f32)], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.0, w.0, "{what}: {got:?} vs {want:?}");
        assert!((g.1 - w.1).abs() < 1e-5, "{what}: {got:?} vs {want:?}");
    }
}

#[test]
fn prompt_and_sample_topk_equal_the_trainers() {
    let m = model();
    let mut e = EngineCore::new(m.clone(), EngineConfig::default()).unwrap();
    let prompt: Vec<u32> = vec![12, 45, 7, 200, 31, 9];
    let (k, t) = (5, 0.7);
    let p = SamplingParams { max_tokens: 6, temperature: t, seed: Some(4), ignore_eos: true, ..Default::default() };
    let req = Request { prompt_logprobs: true, prompt_topk: k, sample_topk: k, ..Request::new(prompt.clone(), p) };
    e.add_request(req).unwrap();
    let out = e.run_until_idle().unwrap().pop().unwrap().1;

    // Prompt: position i ≥ 1 is scored by the logits at i − 1.
    let topk = out.prompt_topk.unwrap();
    assert_eq!(topk.len(), prompt.len() - 1);
    let want = trainer_sorted(&m, &prompt, 1.0);
    let plp = out.prompt_logprobs.unwrap();
    for (i, row) in topk.iter().enumerate() {
        close(row, &want[i][..k], &format!("prompt position {}", i + 1));
        if let Some(&(_, lp)) = row.iter().find(|(id, _)| *id == prompt[i + 1]) {
            assert!((lp - plp[i]).abs() < 1e-5, "position {}: {lp} vs {}", i + 1, plp[i]);
        }
    }

    // Samples: the distribution at each sampled position is softmax(logits / T).
    let g = &out.samples[0];
    assert_eq!(g.topk.len(), g.tokens.len());
    let seq: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
    let want = trainer_sorted(&m, &seq, t);
    let mut found = 0;
    for (j, row) in g.topk.iter().enumerate() {
        close(row, &want[prompt.len() - 1 + j][..k], &format!("sampled token {j}"));
        if let Some(&(_, lp)) = row.iter().find(|(id, _)| *id == g.tokens[j]) {
            assert!((lp - g.logprobs[j]).abs() < 1e-5, "token {j}: {lp} vs {}", g.logprobs[j]);
            found += 1;
        }
    }
    assert!(found > 0, "no sampled token among the top {k}");
}

#[test]
fn top_logprobs_by_hand() {
    // softmax([2, 0, 1, 2]) at t = 1: lse = ln(2e² + e⁰ + e¹).
    let z = [2.0f32, 0.0, 1.0, 2.0];
    let lse = (2.0 * 2f64.exp() + 1.0 + 1f64.exp()).ln();
    let want = [(0u32, 2.0 - lse), (3, 2.0 - lse), (2, 1.0 - lse)];
    let got = top_logprobs(&z, 3, 1.0);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.0, w.0);
        assert!((g.1 as f64 - w.1).abs() < 1e-6);
    }
    assert_eq!(top_logprobs(&z, 10, 1.0).len(), 4, "k beyond the vocabulary gives it all");
    assert!(top_logprobs(&z, 0, 1.0).is_empty());
    // Temperature 0.5 doubles the logits.
    let lse2 = (2.0 * 4f64.exp() + 1.0 + 2f64.exp()).ln();
    assert!((top_logprobs(&z, 1, 0.5)[0].1 as f64 - (4.0 - lse2)).abs() < 1e-6);
}
