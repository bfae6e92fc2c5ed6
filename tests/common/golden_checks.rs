//! Checks every 2026 model family runs against its transformers fixture in the same way: the
//! golden batch's log-probs, the tape's loss and gradients, the engine's greedy tokens, and the
//! worker's cross-entropy step followed by one AdamW step.

use candle_core::{DType, Device, Tensor};
use oxrl::model::logprobs::target_logprobs;
use oxrl::model::tape::Tape;
use oxrl::model::Transformer;

use super::{fixture_dir, masked, max_abs_diff, real_rows, Batch, Golden};

/// Target log-probs [3, T] of the golden batch, 0 where not valid.
pub fn golden_logprobs(m: &Transformer, b: &Batch) -> Tensor {
    let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
    let targets = Tensor::new(b.targets.concat(), &Device::Cpu).unwrap().reshape((3, ())).unwrap();
    masked(&target_logprobs(&logits, &targets).unwrap(), &b.valid)
}

/// The golden loss Σ −log p · w of `arch`'s fixture through the tape in `dtype`: the loss and
/// every parameter's gradient by name (a tied embedding's two parts, the head's and the
/// gather's, summed).
pub fn tape_loss_and_gradients(arch: &str, dtype: DType) -> (f64, Vec<(String, Tensor)>) {
    let b = Golden::load(arch).batch();
    let mut m = Transformer::load(&fixture_dir(arch), dtype, &Device::Cpu).unwrap();
    let vars = m.make_trainable().unwrap();
    let (rows, targets) = real_rows(&b);
    let mut tape = Tape::forward(&m, &b.ids, &b.positions, &b.mask, true).unwrap();
    let lp = tape.logprobs(&rows, &targets).unwrap();
    let t = b.ids[0].len();
    let w: Vec<f64> = rows.iter().map(|&i| b.weights[i as usize / t][i as usize % t] as f64).collect();
    let w = Tensor::new(w, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    let loss = (&lp * &w).unwrap().neg().unwrap().sum_all().unwrap();
    let grads = tape.backward(&loss.backward().unwrap()).unwrap();
    let named = vars
        .iter()
        .map(|(name, var)| {
            let parts: Vec<&Tensor> =
                grads.iter().filter(|(p, _)| p.id() == var.as_tensor().id()).map(|(_, g)| g).collect();
            assert!(!parts.is_empty(), "no gradient for {name}");
            let sum = parts[1..].iter().fold(parts[0].clone(), |a, g| (a + *g).unwrap());
            (name.clone(), sum)
        })
        .collect();
    (loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), named)
}

/// The gradient of parameter `name` in [`tape_loss_and_gradients`]'s list.
pub fn grad_of<'a>(grads: &'a [(String, Tensor)], name: &str) -> &'a Tensor {
    &grads.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no param {name}")).1
}

/// The engine's greedy decode of `arch`'s fixture model (`load`: a fresh copy) gives
/// transformers' 12 greedy tokens, in the core and on the engine thread.
pub fn assert_greedy_tokens(arch: &str, load: impl Fn() -> Transformer) {
    use oxrl::rollout::{Engine, EngineConfig, EngineCore, Request, SamplingParams, StopReason};
    let (prompt, want) = Golden::load(arch).greedy();
    let params = SamplingParams { max_tokens: want.len(), temperature: 0.0, ignore_eos: true, ..Default::default() };
    let mut e = EngineCore::new(load(), EngineConfig { eos_token_ids: vec![2], ..Default::default() }).unwrap();
    e.add_request(Request::new(prompt.clone(), params.clone())).unwrap();
    let out = e.run_until_idle().unwrap().pop().unwrap().1;
    assert_eq!(out.samples[0].tokens, want, "{arch}: engine core");
    assert_eq!(out.samples[0].stop_reason, StopReason::Length);
    let e = Engine::start(load(), EngineConfig::default()).unwrap();
    let out = e.generate(Request::new(prompt, params)).unwrap();
    assert_eq!(out.samples[0].tokens, want, "{arch}: engine thread");
}

/// The worker's cross-entropy step on `arch`'s golden rows, in f64: transformers' loss and
/// per-token log-probs (1e-4), then one AdamW step to the fixture's weights (1e-5). The first
/// AdamW step moves a weight by lr·g/(|g| + eps): for gradients near eps it amplifies any noise
/// (in f32, an lm_head element of 1e-7 moves 8e-5 off), hence f64. `compared(param, golden)`:
/// the elements of a parameter to compare (`None`: all). Returns how many parameters it checked.
pub fn assert_adamw_step(arch: &str, compared: impl Fn(&str, &Golden) -> Option<Vec<u32>>) -> usize {
    use oxrl::worker::{Datum, Worker, WorkerConfig};
    let g = Golden::load(arch);
    let b = g.batch();
    let datums: Vec<Datum> = (0..b.ids.len())
        .map(|r| {
            let start = b.mask[r].iter().position(|&m| m == 1).unwrap();
            let tokens = &b.ids[r][start..];
            let n = tokens.len() - 1;
            Datum::supervised(tokens[..n].to_vec(), tokens[1..].to_vec(), b.weights[r][start..start + n].to_vec())
        })
        .collect();
    let m = Transformer::load(&fixture_dir(arch), DType::F64, &Device::Cpu).unwrap();
    let mut w = Worker::new(m, WorkerConfig::default()).unwrap();
    let ce = super::loss("cross_entropy", &serde_json::json!({}));
    let out = w.forward_backward(&datums, Some(&ce), true).unwrap();
    let golden_loss = g.get("loss").to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
    let loss = out.metrics.value("loss:sum").unwrap();
    assert!((loss - golden_loss).abs() < 1e-4 * golden_loss.abs().max(1.0), "{arch}: loss {loss} vs {golden_loss}");
    let golden_lp = g.f32_2d("target_logprobs");
    for (r, rec) in out.loss_fn_outputs.iter().enumerate() {
        let start = b.mask[r].iter().position(|&m| m == 1).unwrap();
        for (t, &lp) in rec.logprobs.iter().enumerate() {
            if b.valid[r][start + t] != 0.0 {
                assert!((lp - golden_lp[r][start + t]).abs() < 1e-4, "{arch}: row {r} token {t}: {lp}");
            }
        }
    }
    let params = g.adamw();
    w.optim_step(&params).unwrap();
    let mut checked = 0;
    for (name, want) in &g.tensors {
        let Some(param) = name.strip_prefix("adamw.") else { continue };
        let got = w.params().iter().find(|(n, _)| n == param).unwrap().1.as_tensor().clone();
        let (got, want) = (got.to_dtype(DType::F32).unwrap().flatten_all().unwrap(), want.flatten_all().unwrap());
        let (got, want) = match compared(param, &g) {
            Some(idx) => {
                let idx = Tensor::new(idx.as_slice(), &Device::Cpu).unwrap();
                (got.index_select(&idx, 0).unwrap(), want.index_select(&idx, 0).unwrap())
            }
            None => (got, want),
        };
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-5, "{arch}: {param} after AdamW off by {err}");
        checked += 1;
    }
    checked
}
