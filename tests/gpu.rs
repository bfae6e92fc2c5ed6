//! The CUDA build on a GPU: the HF fixtures' log-probs, logits and gradients reproduced on
//! `cuda:0`, a worker's forward_backward + AdamW step equal to the CPU one, the engine's greedy
//! tokens equal to transformers', a short SFT and a short RL run through the library; the fused
//! ops against their reference graphs, the optimizer kernels against the CPU, and the graph
//! nodes (attention, projection, head) against the chains they replace, to the bit.
//!
//! Compiled in every build. Without `--features cuda` the GPU tests are ignored (reported as
//! such, never as passed); a CUDA build fails them when no device opens. Run them with
//! `cargo test --features cuda --test gpu -- --nocapture` on a machine with a GPU, or
//! `scripts/gpu_check.sh` (from the bundle of `scripts/gpu_bundle.sh`).

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::{logprobs::target_logprobs, Transformer};
use oxrl::rollout::{Engine, EngineConfig, EngineCore, Request, SamplingParams, StopReason};
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

/// `cuda:0`. The tests that call it are ignored in a build without `--features cuda`; in a CUDA
/// build a machine with no device fails them (a GPU suite that did not run has not passed).
fn gpu() -> Device {
    oxrl::model::weights::parse_device("cuda").unwrap_or_else(|e| panic!("no CUDA device: {e}"))
}

fn load(arch: &str, device: &Device) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, device).unwrap()
}

fn cpu(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap()
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn golden_logprobs_logits_and_gradients_on_cuda() {
    let dev = gpu();
    for arch in ARCHS {
        let g = Golden::load(arch);
        let b = g.batch();
        let mut m = load(arch, &dev);
        let vars = m.make_trainable().unwrap();
        let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
        assert!(logits.device().is_cuda(), "{arch}: logits not on the GPU");
        let targets = Tensor::new(b.targets.concat(), &dev).unwrap().reshape((3, ())).unwrap();
        let lp = target_logprobs(&logits, &targets).unwrap();
        let err = max_abs_diff(&masked(&cpu(&lp), &b.valid), g.get("target_logprobs"));
        println!("{arch}: target log-probs max |diff| {err:.2e}");
        assert!(err < 1e-4, "{arch}: target log-probs differ by {err}");
        let t = logits.dim(1).unwrap();
        let last = cpu(&logits.narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap());
        let err = max_abs_diff(&last, g.get("logits_last"));
        println!("{arch}: last logits max |diff| {err:.2e}");
        assert!(err < 1e-4, "{arch}: last logits differ by {err}");

        let w = Tensor::new(b.weights.concat(), &dev).unwrap().reshape((3, ())).unwrap();
        let loss = (lp * w).unwrap().neg().unwrap().sum_all().unwrap();
        let golden_loss = g.get("loss").to_vec1::<f32>().unwrap()[0];
        let got = loss.to_scalar::<f32>().unwrap();
        assert!((got - golden_loss).abs() < 1e-4 * golden_loss.abs().max(1.0), "{arch}: loss {got} vs {golden_loss}");
        let grads = loss.backward().unwrap();
        let mut worst = 0f64;
        for (name, t) in &g.tensors {
            let Some(param) = name.strip_prefix("grad.") else { continue };
            let var = &vars.iter().find(|(n, _)| n == param).unwrap().1;
            let grad = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{arch}: no gradient for {param}"));
            let err = rel_err(&cpu(grad), t);
            worst = worst.max(err);
            assert!(err < 1e-4, "{arch}: gradient of {param} off by {err} relative");
        }
        println!("{arch}: gradients worst relative error {worst:.2e}");
    }
}

/// The golden batch as datums (as in worker_exactness.rs).
fn golden_datums(g: &Golden) -> Vec<Datum> {
    let b = g.batch();
    (0..b.ids.len())
        .map(|r| {
            let start = b.mask[r].iter().position(|&m| m == 1).unwrap();
            let tokens = &b.ids[r][start..];
            let n = tokens.len() - 1;
            Datum::supervised(tokens[..n].to_vec(), tokens[1..].to_vec(), b.weights[r][start..start + n].to_vec())
        })
        .collect()
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn worker_step_on_cuda_equals_cpu() {
    let dev = gpu();
    let loss = common::loss("cross_entropy", &json!({}));
    let ppo = common::loss("ppo", &json!({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}));
    let params = AdamParams { learning_rate: 1e-2, weight_decay: 0.01, grad_clip_norm: 1.0, ..Default::default() };
    for arch in ARCHS {
        let g = Golden::load(arch);
        let data = golden_datums(&g);
        // RL inputs too, so that the PPO loss runs on the device.
        let mut rl = data.clone();
        for d in &mut rl {
            let n = d.input_tokens.len();
            d.loss_fn_inputs.logprobs = Some((0..n).map(|i| -5.5 - 0.05 * i as f32).collect());
            d.loss_fn_inputs.advantages = Some((0..n).map(|i| if i % 2 == 0 { 1.0 } else { -0.5 }).collect());
        }
        let run = |device: &Device| {
            let cfg = WorkerConfig { micro_batch_size: Some(2), ..Default::default() };
            let mut w = Worker::new(load(arch, device), cfg).unwrap();
            let a = w.forward_backward(&data, Some(&loss), true).unwrap();
            let b = w.forward_backward(&rl, Some(&ppo), true).unwrap();
            let grads: Vec<(String, Tensor)> =
                w.gradients().into_iter().map(|(n, g)| (n.to_string(), cpu(g.expect("a gradient")))).collect();
            let norm = w.optim_step(&params).unwrap();
            let after: Vec<Tensor> = w.params().iter().map(|(_, v)| cpu(v.as_tensor())).collect();
            (a, b, grads, norm, after)
        };
        let (ca, cb, cgrads, cnorm, cafter) = run(&Device::Cpu);
        let (ga, gb, ggrads, gnorm, gafter) = run(&dev);
        for (what, c, g) in [("cross_entropy", &ca, &ga), ("ppo", &cb, &gb)] {
            let (rc, rg) = (c.metrics.reduce(), g.metrics.reduce());
            for (k, vc) in &rc {
                let vg = rg[k];
                assert!((vc - vg).abs() <= 1e-4 * vc.abs().max(1.0), "{arch} {what}: metric {k} cpu {vc} cuda {vg}");
            }
            for (rc, rg) in c.loss_fn_outputs.iter().zip(&g.loss_fn_outputs) {
                for (x, y) in rc.logprobs.iter().zip(&rg.logprobs) {
                    assert!((x - y).abs() < 1e-4, "{arch} {what}: log-prob cpu {x} cuda {y}");
                }
            }
        }
        let mut worst = 0f64;
        for ((name, c), (_, g)) in cgrads.iter().zip(&ggrads) {
            let err = rel_err(g, c);
            worst = worst.max(err);
            assert!(err < 1e-4, "{arch}: gradient of {name} cpu vs cuda {err} relative");
        }
        assert!((cnorm - gnorm).abs() < 1e-4 * cnorm.max(1.0), "{arch}: grad norm cpu {cnorm} cuda {gnorm}");
        let diff = cafter.iter().zip(&gafter).map(|(c, g)| max_abs_diff(c, g)).fold(0f32, f32::max);
        println!(
            "{arch}: gradients cpu vs cuda worst relative {worst:.2e}; parameters after AdamW max |diff| {diff:.2e}"
        );
        assert!(diff < 1e-4, "{arch}: parameters after the step differ by {diff}");
    }
}

/// Activation checkpointing on candle's graph (the device's path): a worker's gradients, metrics
/// and stepped weights with it are the bits of the same worker without it, on the GPU.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn checkpointed_worker_on_cuda_trains_the_same_bits() {
    let dev = gpu();
    let loss = common::loss("cross_entropy", &json!({}));
    let params = AdamParams { learning_rate: 1e-2, weight_decay: 0.01, ..Default::default() };
    for arch in ARCHS {
        let data = golden_datums(&Golden::load(arch));
        let run = |activation_checkpointing: bool| {
            let cfg = WorkerConfig { micro_batch_size: Some(2), activation_checkpointing, ..Default::default() };
            let mut w = Worker::new(load(arch, &dev), cfg).unwrap();
            let out = w.forward_backward(&data, Some(&loss), true).unwrap();
            let grads: Vec<Vec<f32>> = w
                .gradients()
                .into_iter()
                .map(|(_, g)| cpu(g.expect("a gradient")).flatten_all().unwrap().to_vec1().unwrap())
                .collect();
            let norm = w.optim_step(&params).unwrap();
            let after: Vec<Vec<f32>> =
                w.params().iter().map(|(_, v)| cpu(v.as_tensor()).flatten_all().unwrap().to_vec1().unwrap()).collect();
            (out.metrics.value("loss:sum").unwrap().to_bits(), grads, norm.to_bits(), after)
        };
        let (kept, ckpt) = (run(false), run(true));
        assert!(kept == ckpt, "{arch}: checkpointing on the GPU changed a bit");
    }
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn engine_greedy_tokens_on_cuda_equal_transformers() {
    let dev = gpu();
    let params = |n: usize| SamplingParams {
        max_tokens: n,
        temperature: 0.0,
        seed: Some(0),
        ignore_eos: true,
        ..Default::default()
    };
    for arch in ARCHS {
        let g = Golden::load(arch);
        let (prompt, want) = g.greedy();
        let m = load(arch, &dev);
        let mut core =
            EngineCore::new(m.clone(), EngineConfig { max_batch: 64, eos_token_ids: vec![2], ..Default::default() })
                .unwrap();
        core.add_request(Request::new(prompt.clone(), params(want.len()))).unwrap();
        let out = core.run_until_idle().unwrap().pop().unwrap().1;
        assert_eq!(out.samples[0].tokens, want, "{arch}: engine core on cuda");
        assert_eq!(out.samples[0].stop_reason, StopReason::Length);
        // Through the engine thread, with several requests batched together.
        let e = Engine::start(m, EngineConfig::default()).unwrap();
        let handles: Vec<_> = (0..4).map(|_| e.submit(Request::new(prompt.clone(), params(want.len())))).collect();
        for h in handles {
            assert_eq!(h.wait().unwrap().samples[0].tokens, want, "{arch}: engine thread on cuda");
        }
        println!("{arch}: greedy tokens on cuda = transformers' ({} tokens)", want.len());
    }
}

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    r#"{"messages":[{"role":"user","content":"quick brown"},{"role":"assistant","content":"fox jumps over"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
];

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn sft_on_cuda_loss_falls_and_matches_cpu() {
    gpu();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, ROWS.join("\n") + "\n").unwrap();
    let run = |device: &str| {
        let sets: Vec<String> = vec![
            format!("model.path={:?}", fixture_dir("qwen3").display().to_string()),
            format!("model.device={device:?}"),
            format!("data.train_file={:?}", data.display().to_string()),
            format!("output.run_dir={:?}", dir.path().join(device.replace(':', "_")).display().to_string()),
            "optimizer.lr=0.01".into(),
            "train.batch_size=4".into(),
            "train.micro_batch_size=2".into(),
            "train.eval_every=0".into(),
            "train.max_steps=12".into(),
            "schedule.warmup_steps=1".into(),
        ];
        let cfg = oxrl::trainer::SftConfig::load(None, &sets).unwrap();
        let dispatch = oxrl::launch::sft_dispatch(&cfg, Some(1)).unwrap();
        let s = oxrl::trainer::sft::run_sft(&cfg, &dispatch, &Default::default()).unwrap();
        let m = oxrl::trainer::metrics::read_metrics(&s.run_dir.join("metrics.jsonl")).unwrap();
        m.iter().map(|r| r.loss).collect::<Vec<f64>>()
    };
    let on_gpu = run("cuda");
    let on_cpu = run("cpu");
    println!("sft losses on cuda: {on_gpu:.4?}");
    println!("sft losses on cpu:  {on_cpu:.4?}");
    assert_eq!(on_gpu.len(), 12);
    assert!(on_gpu[11] < 0.7 * on_gpu[0], "the loss did not fall: {on_gpu:?}");
    // The same run: the first step's loss to float rounding, later ones close.
    assert!((on_gpu[0] - on_cpu[0]).abs() < 1e-4 * on_cpu[0].abs().max(1.0), "{on_gpu:?} vs {on_cpu:?}");
    for (g, c) in on_gpu.iter().zip(&on_cpu) {
        assert!((g - c).abs() < 1e-2 * c.abs().max(1.0), "{on_gpu:?} vs {on_cpu:?}");
    }
}

/// Sync GRPO on the GPU, sampling at temperature 1 and at 0.7: finite metrics, and the
/// sampler's log-probs within 1e-3 of the trainer's (f32; the engine's kernels are not the
/// trainer's, so not bits), which at 0.7 needs the trainer at the rollout temperature.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn rl_on_cuda_runs_steps() {
    gpu();
    for temperature in [1.0, 0.7] {
        rl_on_cuda_at(temperature);
    }
}

fn rl_on_cuda_at(temperature: f64) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let sets: Vec<String> = vec![
        format!("model.path={}", model.display()),
        "model.device=\"cuda\"".into(),
        format!("rollout.temperature={temperature}"),
        format!("output.run_dir={}", tmp.path().join("run").display()),
        "data.synthetic_train=40".into(),
        "data.synthetic_eval=8".into(),
        "rollout.n_samples=4".into(),
        "rollout.eval_samples=2".into(),
        "env.max_turn_tokens=4".into(),
        "train.prompts_per_step=4".into(),
        "train.max_steps=3".into(),
        "train.eval_every=2".into(),
        "optimizer.lr=1e-3".into(),
        "algorithm.kl.coef=0.05".into(),
    ];
    let cfg = oxrl::trainer::RlConfig::load(None, &sets).unwrap();
    let (d, engines) = oxrl::launch::rl_runtime(&cfg, Some(1)).unwrap();
    let s = oxrl::trainer::rl::run_rl(&cfg, &d, &engines, &Default::default()).unwrap();
    assert_eq!(s.steps, 3);
    let text = std::fs::read_to_string(tmp.path().join("run/metrics.jsonl")).unwrap();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for k in ["reward_mean", "kl_mean", "grad_norm"] {
            assert!(v[k].as_f64().is_some_and(f64::is_finite), "{k} in {line}");
        }
        let mismatch = v["logprob_mismatch_max"].as_f64().unwrap_or(f64::NAN);
        assert!(mismatch < 1e-3, "T = {temperature}: the sampler's log-probs are not the trainer's: {line}");
    }
    println!("rl on cuda at T = {temperature}: {} steps, last metrics {}", s.steps, text.lines().last().unwrap());
}

/// Runs in every build: device names, and a CPU-only build refusing `cuda` with an error that
/// names the feature (never a panic).
#[test]
fn device_names_and_cpu_builds_refusing_cuda() {
    use oxrl::model::weights::{check_device_name, device_name, parse_device};
    assert!(parse_device("cpu").unwrap().is_cpu());
    assert_eq!(device_name(&Device::Cpu), "cpu");
    for bad in ["tpu", "cuda:", "cuda:x", "CUDA", "cuda0"] {
        let e = parse_device(bad).unwrap_err().to_string();
        assert!(e.contains("unknown device") && e.contains("cuda:N"), "{bad}: {e}");
    }
    let sets = |device: &str| {
        vec![format!("model.path={:?}", fixture_dir("qwen3").display().to_string()), format!("model.device={device:?}")]
    };
    let e = oxrl::trainer::SftConfig::load(None, &sets("gpu")).unwrap_err().to_string();
    assert!(e.contains("model.device"), "{e}");
    if cfg!(feature = "cuda") {
        assert!(check_device_name("cuda:1").is_ok());
        return;
    }
    for name in ["cuda", "cuda:0", "cuda:3"] {
        let e = parse_device(name).unwrap_err().to_string();
        assert!(e.contains("--features cuda"), "{name}: {e}");
    }
    let e = oxrl::trainer::SftConfig::load(None, &sets("cuda")).unwrap_err().to_string();
    assert!(e.contains("model.device") && e.contains("--features cuda"), "{e}");
    let e = oxrl::trainer::RlConfig::load(None, &sets("cuda:1")).unwrap_err().to_string();
    assert!(e.contains("model.device") && e.contains("--features cuda"), "{e}");
}

/// Deterministic values in [-scale, scale) as a tensor of `shape` on `dev`.
/// oxrl's CUDA kernels on while it lives, then as they were (also when a test fails).
struct KernelsOn(bool);

impl KernelsOn {
    fn new() -> Self {
        let before = oxrl::model::ops::cuda_kernels();
        oxrl::model::ops::set_cuda_kernels(true);
        KernelsOn(before)
    }
}

impl Drop for KernelsOn {
    fn drop(&mut self) {
        oxrl::model::ops::set_cuda_kernels(self.0);
    }
}

fn random(shape: &[usize], seed: u64, scale: f64, dtype: DType, dev: &Device) -> Tensor {
    let v: Vec<f32> = values(shape.iter().product(), seed).into_iter().map(|x| (x * scale) as f32).collect();
    Tensor::from_vec(v, shape, dev).unwrap().to_dtype(dtype).unwrap()
}

/// Largest |a − b| / (1 + |b|).
fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let f = |t: &Tensor| cpu(t).to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    f(a).iter().zip(f(b)).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f64::max)
}

/// The fused op (the CUDA kernel) against the op's reference graph (candle's CUDA kernels): the
/// values, and the gradients of Σ out · w for a fixed random w with respect to `vars`.
fn check_op(
    what: &str,
    vars: &[candle_core::Var],
    fused: impl Fn() -> Tensor,
    reference: impl Fn() -> Tensor,
    tol: f64,
) {
    let (a, b) = (fused(), reference());
    assert!(a.device().is_cuda(), "{what}: not on the GPU");
    let e = max_rel(&a, &b);
    println!("{what}: values max relative difference {e:.2e}");
    assert!(e < tol, "{what}: values differ by {e}");
    let w = random(a.dims(), 99, 1.0, a.dtype(), a.device());
    let ga = (&a * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gb = (&b * &w).unwrap().sum_all().unwrap().backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let (x, y) =
            (ga.get(v.as_tensor()).expect("fused gradient"), gb.get(v.as_tensor()).expect("reference gradient"));
        let e = max_rel(x, y);
        println!("{what}: gradient {i} max relative difference {e:.2e}");
        assert!(e < tol, "{what}: gradient of input {i} differs by {e}");
    }
}

/// The optimizer's kernels: three AdamW steps of an f32 parameter on CUDA are the CPU's bits
/// (both one pass, each operation rounded in f32 in the same order), and Σ g² (the gradient
/// norm's terms) is the CPU's f64 sum to 1e-12 in f32 and bf16, on a tensor of many blocks.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn optimizer_kernels_on_cuda_equal_the_cpu() {
    use candle_core::Var;
    use oxrl::worker::adamw::{square_sums, update, Moments};
    let dev = gpu();
    let _kernels = KernelsOn::new();
    let params = AdamParams { learning_rate: 1e-2, weight_decay: 0.1, eps: 1e-8, ..Default::default() };
    let p0 = random(&[300, 1000], 31, 1.0, DType::F32, &Device::Cpu);
    let (on_gpu, on_cpu) = (Var::from_tensor(&p0.to_device(&dev).unwrap()).unwrap(), Var::from_tensor(&p0).unwrap());
    let (mut sg, mut sc) = (Moments::zeros(on_gpu.as_tensor()).unwrap(), Moments::zeros(&p0).unwrap());
    for step in 0..3 {
        let g = random(&[300, 1000], 40 + step, 0.01, DType::F32, &Device::Cpu);
        update(&on_gpu, &g.to_device(&dev).unwrap(), &mut sg, &params).unwrap();
        update(&on_cpu, &g, &mut sc, &params).unwrap();
    }
    let bits = |t: &Tensor| cpu(t).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (what, a, b) in [
        ("parameter", on_gpu.as_tensor(), on_cpu.as_tensor()),
        ("first moment", &sg.exp_avg, &sc.exp_avg),
        ("second moment", &sg.exp_avg_sq, &sc.exp_avg_sq),
    ] {
        assert!(a.device().is_cuda(), "{what} left the GPU");
        assert_eq!(bits(a), bits(b), "AdamW on CUDA: the {what} differs from the CPU's");
    }
    for dtype in [DType::F32, DType::BF16] {
        let g = random(&[3000, 1000], 50, 1.0, dtype, &Device::Cpu);
        let want = g.to_dtype(DType::F64).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let got = square_sums(&[&g.to_device(&dev).unwrap()]).unwrap()[0];
        println!("sum of squares {dtype:?}: {got} against the CPU's {want}");
        assert!((got - want).abs() <= 1e-12 * want, "{dtype:?}: Σ g² {got}, the CPU's {want}");
    }
}

/// Attention as one graph node (its backward written out; in bf16 the softmax's mixed kernels)
/// gives the reference graph's values and gradients to the bit on CUDA, in f32 and bf16, with
/// kv heads shared by three query heads and left padding.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn attention_node_on_cuda_gives_the_reference_bits() {
    use candle_core::Var;
    use oxrl::model::ops::{attention::attention, cached_attention::reference};
    let dev = gpu();
    // The nodes run oxrl's kernels (the suite's run with them off would test the fallback).
    let _kernels = KernelsOn::new();
    for dtype in [DType::F32, DType::BF16] {
        let (b, h, kvh, t, d) = (2, 6, 2, 33, 16);
        let var = |shape: &[usize], seed| Var::from_tensor(&random(shape, seed, 1.0, dtype, &dev)).unwrap();
        let (q, k, v) = (var(&[b, h, t, d], 61), var(&[b, kvh, t, d], 62), var(&[b, kvh, t, d], 63));
        let mask = vec![vec![1u8; t], [vec![0u8; 4], vec![1u8; t - 4]].concat()];
        let bias = oxrl::model::transformer::attention_bias(&mask, 0, t, &dev).unwrap();
        let w = random(&[b, t, h * d], 64, 1.0, dtype, &dev);
        let run = |out: Tensor| {
            let grads = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let bits =
                |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            [
                bits(&out),
                bits(grads.get(q.as_tensor()).unwrap()),
                bits(grads.get(k.as_tensor()).unwrap()),
                bits(grads.get(v.as_tensor()).unwrap()),
            ]
        };
        let node = run(attention(&q, &k, &v, &bias, 0.25).unwrap());
        let graph = run(reference(&q, &k, &v, &bias, 0.25).unwrap());
        for (i, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
            assert_eq!(node[i], graph[i], "{dtype:?}: the attention node's {what} differs from the reference graph's");
        }
        println!("attention node {dtype:?}: output and gradients equal the reference graph's bits");
    }
}

/// Flash attention inside a model (Qwen2's layout, heads of 64, bf16, a left-padded row): the
/// target log-probs and every parameter's gradient against the same model with the unfused
/// attention node, within bf16's rounding.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn flash_attention_in_a_model_matches_the_unfused_node() {
    use oxrl::model::init::random_model;
    use oxrl::model::model_config::{Arch, ModelConfig, ModelShape};
    use oxrl::model::ops::flash_attention::set_flash_attention;
    let dev = gpu();
    let _kernels = KernelsOn::new();
    let shape = ModelShape {
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        rope_theta: 10000.0,
        max_position_embeddings: 512,
        tie_word_embeddings: true,
    };
    let (rows, t, pad) = (2usize, 150usize, 7usize);
    let ids: Vec<Vec<u32>> = (0..rows).map(|r| (0..t).map(|i| ((i * 37 + r * 11) % 300) as u32).collect()).collect();
    let mask: Vec<Vec<u8>> = (0..rows).map(|r| (0..t).map(|i| u8::from(r == 0 || i >= pad)).collect()).collect();
    let positions: Vec<Vec<u32>> = (0..rows)
        .map(|r| (0..t).map(|i| if r == 0 { i as u32 } else { i.saturating_sub(pad) as u32 }).collect())
        .collect();
    let targets = Tensor::new(ids.iter().map(|r| [&r[1..], &r[..1]].concat()).collect::<Vec<_>>(), &dev).unwrap();
    let valid = Tensor::new(mask.clone(), &dev).unwrap().to_dtype(DType::F32).unwrap();
    let run = |flash: bool| {
        set_flash_attention(flash);
        let config =
            ModelConfig::from_value(ModelConfig::new_json(Arch::Qwen2, &shape), "config.json".as_ref()).unwrap();
        let mut m = random_model(config, 5, DType::BF16, &dev).unwrap();
        let vars = m.make_trainable().unwrap();
        let logits = m.forward(&ids, &positions, &mask, None).unwrap();
        let lp = target_logprobs(&logits, &targets).unwrap().to_dtype(DType::F32).unwrap();
        let lp = (lp * &valid).unwrap();
        let grads = lp.sum_all().unwrap().neg().unwrap().backward().unwrap();
        let grads: Vec<(String, Tensor)> = vars
            .iter()
            .map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).unwrap().to_dtype(DType::F32).unwrap()))
            .collect();
        (lp, grads)
    };
    let (lp, grads) = run(true);
    let (lp_unfused, grads_unfused) = run(false);
    set_flash_attention(true);
    let e = max_rel(&lp, &lp_unfused);
    println!("flash attention in a bf16 model: log-probs max relative difference {e:.2e}");
    assert!(e < 3e-2, "log-probs differ by {e}");
    for ((name, g), (_, want)) in grads.iter().zip(&grads_unfused) {
        // Two bf16 computations, each rounding its probabilities and score gradients in its own
        // order: a few 1e-3 apart per element.
        let e = rel_err(g, want);
        assert!(e < 5e-2, "the gradient of {name} differs by {e} (relative norm)");
    }
}

/// Flash attention against the reference graph in f32 on the same (rounded) inputs: output and
/// gradients within the 16-bit type's rounding, in bf16 and f16, head dimensions 64 and 128, kv
/// heads shared by two query heads, left padding, queries after a prefix of keys, rows past a
/// tile; and the same bits on a second run (each gradient element summed by one block).
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn flash_attention_on_cuda_matches_the_reference_graph() {
    use candle_core::Var;
    use oxrl::model::ops::{cached_attention::reference, flash_attention::flash_attention};
    let dev = gpu();
    let _kernels = KernelsOn::new();
    for (dtype, d, t, past, tol) in
        [(DType::BF16, 64, 200, 0, 1.5e-2), (DType::F16, 64, 70, 0, 3e-3), (DType::BF16, 128, 40, 90, 1.5e-2)]
    {
        let (b, h, kvh, s) = (2, 4, 2, past + t);
        let input = |shape: &[usize], seed| random(shape, seed, 1.5, dtype, &dev);
        let (q, k, v) = (input(&[b, h, t, d], 71), input(&[b, kvh, s, d], 72), input(&[b, kvh, s, d], 73));
        let mask = vec![vec![1u8; s], [vec![0u8; 5], vec![1u8; s - 5]].concat()];
        let bias = oxrl::model::transformer::attention_bias(&mask, past, t, &dev).unwrap();
        let w = random(&[b, t, h * d], 74, 1.0, dtype, &dev);
        let scale = 1.0 / (d as f64).sqrt();
        let run = |dtype: DType, attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor| {
            let vars = [&q, &k, &v].map(|x| Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap());
            let out = attend(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor());
            let loss = (out.to_dtype(DType::F32).unwrap() * w.to_dtype(DType::F32).unwrap()).unwrap();
            let grads = loss.sum_all().unwrap().backward().unwrap();
            let grad = |x: &Var| grads.get(x.as_tensor()).unwrap().to_dtype(DType::F32).unwrap();
            [out.to_dtype(DType::F32).unwrap(), grad(&vars[0]), grad(&vars[1]), grad(&vars[2])]
        };
        let flash = run(dtype, &|q, k, v| flash_attention(q, k, v, &bias, scale).unwrap());
        let again = run(dtype, &|q, k, v| flash_attention(q, k, v, &bias, scale).unwrap());
        let graph = run(DType::F32, &|q, k, v| reference(q, k, v, &bias, scale).unwrap());
        for (i, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
            let e = max_rel(&flash[i], &graph[i]);
            println!("flash attention {dtype:?} d={d} t={t} past={past}: {what} max relative difference {e:.2e}");
            assert!(e < tol, "flash attention {dtype:?} d={d}: {what} differs from the f32 reference by {e}");
            assert_eq!(max_rel(&flash[i], &again[i]), 0.0, "flash attention {dtype:?}: {what} differs between runs");
        }
    }
}

/// A matrix's transpose written out by the tiled kernel is candle's strided copy of the
/// transposed view, bit for bit, in every element type, for shapes over and under a tile and a
/// batch of matrices, and so is the heads' transpose [A, B, C, D] → [A, C, B, D] (16 bytes a
/// thread or an element a thread); a bf16/f16 parameter set from its f32 master in one pass holds the
/// master cast, as `Var::set` of the cast would leave it; a bf16/f16 gradient widened to f32 is
/// candle's cast.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn transpose_and_mixed_precision_casts_on_cuda_are_candles() {
    use oxrl::model::ops::transpose::transposed;
    let dev = gpu();
    let _kernels = KernelsOn::new();
    let bits = |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for shape in [vec![70, 33], vec![3, 5, 100], vec![896, 4867], vec![2, 4, 64, 1000]] {
            let x = random(&shape, 91, 3.0, dtype, &dev);
            let (got, want) = (transposed(&x).unwrap(), x.t().unwrap().contiguous().unwrap());
            assert_eq!(got.dims(), want.dims(), "{dtype:?} {shape:?}");
            assert_eq!(bits(&got), bits(&want), "{dtype:?} {shape:?}: the transpose moved an element wrongly");
        }
    }
    // The heads' transpose: 16 bytes a thread (rows of 64), an element a thread (rows of 3, and
    // rows of 64 read from one element past an aligned start).
    use oxrl::model::ops::transpose::heads_swapped;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for shape in [[8, 14, 1024, 64], [2, 5, 7, 3]] {
            let x = random(&shape, 96, 3.0, dtype, &dev);
            let want = x.transpose(1, 2).unwrap().contiguous().unwrap();
            assert_eq!(bits(&heads_swapped(&x).unwrap()), bits(&want), "{dtype:?} {shape:?}: heads swapped");
        }
        let n = 3 * 4 * 5 * 64;
        let x = random(&[n + 1], 97, 3.0, dtype, &dev).narrow(0, 1, n).unwrap().reshape((3, 4, 5, 64)).unwrap();
        let want = x.transpose(1, 2).unwrap().contiguous().unwrap();
        assert_eq!(bits(&heads_swapped(&x).unwrap()), bits(&want), "{dtype:?}: heads swapped from an odd start");
    }
    for dtype in [DType::BF16, DType::F16] {
        let master = random(&[300, 1001], 92, 5.0, DType::F32, &dev);
        let param = candle_core::Var::from_tensor(&Tensor::zeros((300, 1001), dtype, &dev).unwrap()).unwrap();
        oxrl::worker::mixed_precision::round_into(&param, &master).unwrap();
        assert_eq!(bits(param.as_tensor()), bits(&master.to_dtype(dtype).unwrap()), "{dtype:?}: the master rounded");
        // A gradient widened to its f32 accumulator (four at a time, and an odd length).
        for n in [1000 * 301, 1000 * 301 - 1] {
            let g = random(&[n], 93, 2.0, dtype, &dev);
            let wide = oxrl::worker::mixed_precision::widened(&g).unwrap();
            assert_eq!(wide.dtype(), DType::F32);
            assert_eq!(bits(&wide), bits(&g.to_dtype(DType::F32).unwrap()), "{dtype:?}: {n} elements widened");
        }
    }
    println!("transpose, heads' transpose and master rounding: candle's bits");
}

/// The adds by oxrl's kernels (no dims copied to the device) are candle's, bit for bit, in f32,
/// bf16 and f16: a bias added to every row (biases of the rows' size and far smaller, where the
/// rounding of the sum decides); two tensors elementwise (four elements a load, and one at a time
/// where the size is not a multiple of four) and the backward's sum of two gradients; and,
/// differentiated, the gradients of both adds.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn adds_on_cuda_are_candles() {
    use candle_core::Var;
    use oxrl::model::ops::add::{add, bias_add, gradient_add};
    let dev = gpu();
    let _kernels = KernelsOn::new();
    let bits = |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (shape, scale) in [(vec![7, 1, 896], 3.0), (vec![4096, 128], 3e-3), (vec![3, 5], 1.0)] {
            let y = random(&shape, 94, 3.0, dtype, &dev);
            let b = random(&[*shape.last().unwrap()], 95, scale, dtype, &dev);
            let (got, want) = (bias_add(&y, &b).unwrap(), y.broadcast_add(&b).unwrap());
            assert_eq!(got.dims(), want.dims());
            assert_eq!(bits(&got), bits(&want), "bias add {dtype:?} {shape:?}, bias scale {scale}");
            let other = random(&shape, 96, scale, dtype, &dev);
            let want = (&y + &other).unwrap();
            assert_eq!(bits(&add(&y, &other).unwrap()), bits(&want), "add {dtype:?} {shape:?}, scale {scale}");
            let summed = gradient_add(&y, &other).expect("served").unwrap();
            assert_eq!(bits(&summed), bits(&want), "gradient add {dtype:?} {shape:?}");
        }
        // Differentiated: y + b per row, then + z, weighted.
        let var = |shape: &[usize], seed| Var::from_tensor(&random(shape, seed, 1.0, dtype, &dev)).unwrap();
        let (y, b, z) = (var(&[6, 5, 896], 97), var(&[896], 98), var(&[6, 5, 896], 99));
        let w = random(&[6, 5, 896], 100, 1.0, dtype, &dev);
        let grads = |out: Tensor| {
            let g = (out * &w).unwrap().sum_all().unwrap().backward().unwrap();
            [&y, &b, &z].map(|v| bits(g.get(v.as_tensor()).expect("a gradient")))
        };
        let ours = grads(add(&bias_add(&y, &b).unwrap(), &z).unwrap());
        let candles = grads((y.broadcast_add(&b).unwrap() + z.as_tensor()).unwrap());
        for (i, what) in ["y", "the bias", "z"].iter().enumerate() {
            assert_eq!(ours[i], candles[i], "{dtype:?}: the gradient of {what}");
        }
    }
    println!("adds: candle's bits, values and gradients");
}

/// A residual sum and its RMSNorm in one kernel (a step that differentiates nothing) give the
/// bits of candle's add and the norm kernel, in f32, bf16 and f16.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn add_rms_norm_on_cuda_is_the_add_and_the_norm() {
    use oxrl::model::ops::rms_norm::{add_rms_norm, rms_norm};
    let dev = gpu();
    let _kernels = KernelsOn::new();
    let bits = |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for shape in [vec![7, 1, 896], vec![2, 33, 300]] {
            let h = random(&shape, 111, 3.0, dtype, &dev);
            let a = random(&shape, 112, 3.0, dtype, &dev);
            let w = random(&[*shape.last().unwrap()], 113, 1.0, dtype, &dev);
            let (sum, normed) = add_rms_norm(&h, &a, &w, 1e-6).unwrap();
            let want_sum = (&h + &a).unwrap();
            assert_eq!(bits(&sum), bits(&want_sum), "{dtype:?} {shape:?}: the sum");
            assert_eq!(bits(&normed), bits(&rms_norm(&want_sum, &w, 1e-6).unwrap()), "{dtype:?} {shape:?}: the norm");
        }
    }
    println!("add + rms norm: the add's and the norm's bits");
}

/// q's and k's biases and rotations in one kernel (a step that differentiates nothing) give the
/// bits of the bias adds and the rope kernel, with and without biases, in f32, bf16 and f16.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn rope_pair_on_cuda_is_the_bias_adds_and_rotations() {
    use oxrl::model::ops::{add::bias_add, rope};
    let dev = gpu();
    let _kernels = KernelsOn::new();
    let bits = |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (b, t, hq, hk, d) = (3, 5, 14, 2, 64);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let q = random(&[b, t, hq * d], 101, 3.0, dtype, &dev);
        let k = random(&[b, t, hk * d], 102, 3.0, dtype, &dev);
        let (qb, kb) = (random(&[hq * d], 103, 1.0, dtype, &dev), random(&[hk * d], 104, 1.0, dtype, &dev));
        let cos = random(&[b, 1, t, d / 2], 105, 1.0, dtype, &dev);
        let sin = random(&[b, 1, t, d / 2], 106, 1.0, dtype, &dev);
        for biased in [true, false] {
            let (qbias, kbias) = if biased { (Some(&qb), Some(&kb)) } else { (None, None) };
            let (gq, gk) = rope::rope_pair(&q, qbias, &k, kbias, (hq, hk), &cos, &sin).unwrap();
            let one = |x: &Tensor, bias: Option<&Tensor>, h: usize| {
                let x = bias.map_or_else(|| x.clone(), |bias| bias_add(x, bias).unwrap());
                rope::rope(&x.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap(), &cos, &sin).unwrap()
            };
            let (wq, wk) = (one(&q, qbias, hq), one(&k, kbias, hk));
            assert_eq!((gq.dims(), gk.dims()), (wq.dims(), wk.dims()));
            assert_eq!(bits(&gq), bits(&wq), "{dtype:?}, biases {biased}: q");
            assert_eq!(bits(&gk), bits(&wk), "{dtype:?}, biases {biased}: k");
        }
    }
    println!("rope pair: the bias adds' and rotations' bits");
}

/// The embedding as one graph node gives candle's gather and, through its kernel, candle's
/// `index_add` table gradient to the bit on CUDA (tokens repeated, in any order, some never
/// seen), in f32 and bf16; the table gradient written alone is the same.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn embedding_node_on_cuda_gives_candles_bits() {
    use candle_core::Var;
    use oxrl::model::ops::embedding::{embedding, table_gradient};
    let dev = gpu();
    let _kernels = KernelsOn::new();
    let bits = |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let table = Var::from_tensor(&random(&[1000, 96], 101, 1.0, dtype, &dev)).unwrap();
        let ids: Vec<u32> = (0..777u32).map(|i| (i * 37 + i * i) % 600).collect();
        let c = random(&[777, 96], 102, 1.0, dtype, &dev);
        let node = embedding(table.as_tensor(), &ids).unwrap();
        let index = Tensor::from_slice(&ids, ids.len(), &dev).unwrap();
        let chain = table.as_tensor().index_select(&index, 0).unwrap();
        assert_eq!(bits(&node), bits(&chain), "{dtype:?}: rows");
        let g = (&node * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let want = (&chain * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let want = want.get(table.as_tensor()).unwrap();
        assert_eq!(bits(g.get(table.as_tensor()).unwrap()), bits(want), "{dtype:?}: the table's gradient");
        assert_eq!(bits(&table_gradient(table.as_tensor(), &ids, &c).unwrap()), bits(want), "{dtype:?}: alone");
    }
    println!("embedding node: candle's gather and index_add bits");
}

/// The device's peak memory (the CUDA pool's high-water mark, as `oxrl bench train` and the SFT
/// and RL metrics report it) counts a 256 MiB tensor made after a reset, and a reset starts it
/// over from what is in use.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn device_peak_memory_counts_an_allocation() {
    use oxrl::memory::{device_peak_bytes, reset_device_peak};
    let dev = gpu();
    reset_device_peak(&dev);
    let before = device_peak_bytes(&dev).expect("the device allocates from a memory pool");
    let big = Tensor::ones((64, 1 << 20), DType::F32, &dev).unwrap();
    let after = device_peak_bytes(&dev).unwrap();
    assert!(after >= before + (256 << 20), "peak {after} after a 256 MiB tensor (was {before})");
    drop(big);
    dev.synchronize().unwrap();
    reset_device_peak(&dev);
    let reset = device_peak_bytes(&dev).unwrap();
    assert!(reset < after, "the reset peak {reset} is not below {after}");
    println!("device peak: {before} → {after} bytes with a 256 MiB tensor, {reset} after a reset");
}

/// A projection as one graph node gives the chain's values and gradients to the bit on CUDA
/// (rows reshaped, the product with the weight's transpose, reshaped back), in f32 and bf16.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn linear_node_on_cuda_gives_the_chains_bits() {
    use candle_core::Var;
    use oxrl::model::ops::{linear::linear, matmul::matmul};
    let dev = gpu();
    for dtype in [DType::F32, DType::BF16] {
        let x = Var::from_tensor(&random(&[4, 77, 96], 81, 1.0, dtype, &dev)).unwrap();
        let w = Var::from_tensor(&random(&[200, 96], 82, 1.0, dtype, &dev)).unwrap();
        let c = random(&[4, 77, 200], 83, 1.0, dtype, &dev);
        let run = |y: Tensor| {
            let grads = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
            let bits =
                |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            [bits(&y), bits(grads.get(x.as_tensor()).unwrap()), bits(grads.get(w.as_tensor()).unwrap())]
        };
        let node = run(linear(x.as_tensor(), w.as_tensor()).unwrap());
        let rows = x.as_tensor().reshape(((), 96)).unwrap();
        let chain = run(matmul(&rows, &w.as_tensor().t().unwrap()).unwrap().reshape((4, 77, 200)).unwrap());
        for (i, what) in ["output", "dx", "dW"].iter().enumerate() {
            assert_eq!(node[i], chain[i], "{dtype:?}: the linear node's {what} differs from the chain's");
        }
        println!("linear node {dtype:?}: output and gradients equal the chain's bits");
    }
}

/// The LM head and the log-probs as one graph node (in bf16 the log-prob op's mixed kernels)
/// give the chain's values and gradients to the bit on CUDA (a matmul with the weight's
/// transpose, the logits cast to f32 and, at a temperature, scaled, the fused op), in f32 and
/// bf16.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn head_node_on_cuda_gives_the_chains_bits() {
    use candle_core::Var;
    use oxrl::model::ops::{head_logprobs::head_logprobs, logprob_lse, matmul::matmul};
    let dev = gpu();
    // The nodes run oxrl's kernels (the suite's run with them off would test the fallback).
    let _kernels = KernelsOn::new();
    for dtype in [DType::F32, DType::BF16] {
        let (n, h, v) = (300, 64, 5000);
        let x = Var::from_tensor(&random(&[n, h], 71, 1.0, dtype, &dev)).unwrap();
        let w = Var::from_tensor(&random(&[v, h], 72, 1.0, dtype, &dev)).unwrap();
        let targets = Tensor::from_vec((0..n as u32).map(|i| i * 37 % v as u32).collect(), n, &dev).unwrap();
        let weights = random(&[n], 73, 1.0, DType::F32, &dev);
        let run = |lp: Tensor| {
            let grads = (&lp * &weights).unwrap().sum_all().unwrap().backward().unwrap();
            let bits =
                |t: &Tensor| cpu(t).to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            [bits(&lp), bits(grads.get(x.as_tensor()).unwrap()), bits(grads.get(w.as_tensor()).unwrap())]
        };
        for s in [1.0, 1.0 / 0.7] {
            let node = run(head_logprobs(x.as_tensor(), w.as_tensor(), &targets, s).unwrap().0);
            let logits = matmul(x.as_tensor(), &w.as_tensor().t().unwrap()).unwrap().to_dtype(DType::F32).unwrap();
            let logits = if s == 1.0 { logits } else { (logits * s).unwrap() };
            let chain = run(logprob_lse::forward(&logits, &targets).unwrap().0);
            for (i, what) in ["log-probs", "dh", "dW"].iter().enumerate() {
                assert_eq!(node[i], chain[i], "{dtype:?}, 1/T = {s}: the head node's {what} differs from the chain's");
            }
        }
        println!("head node {dtype:?}: log-probs and gradients equal the chain's bits");
    }
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn fused_ops_on_cuda_equal_their_reference_graphs() {
    use candle_core::{Var, D};
    use oxrl::model::ops;
    let dev = gpu();
    // On for this test (the other tests pass either way: scripts/gpu_check.sh runs the suite
    // with OXRL_CUDA_KERNELS=0 and =1 to cover both paths), then as it was.
    let _kernels = KernelsOn::new();
    assert!(ops::fused(&Tensor::zeros(1, DType::F32, &dev).unwrap()), "the CUDA kernels did not turn on");
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 5e-2), (DType::F16, 1e-2)] {
        let var = |shape: &[usize], seed, scale| Var::from_tensor(&random(shape, seed, scale, dtype, &dev)).unwrap();
        let name = |op: &str| format!("{op} {dtype:?}");

        let (x, w) = (var(&[2, 7, 300], 1, 3.0), var(&[300], 2, 1.0));
        let (xt, wt) = (x.as_tensor(), w.as_tensor());
        check_op(
            &name("rms_norm"),
            &[x.clone(), w.clone()],
            || ops::rms_norm::rms_norm(xt, wt, 1e-6).unwrap(),
            || ops::rms_norm::reference(xt, wt, 1e-6).unwrap(),
            tol,
        );

        // [B, T, H, D] seen as [B, H, T, D], as the projections give it.
        let x = var(&[2, 5, 3, 8], 3, 2.0);
        let (cos, sin) = (random(&[2, 1, 5, 4], 4, 1.0, dtype, &dev), random(&[2, 1, 5, 4], 5, 1.0, dtype, &dev));
        let xt = x.as_tensor().transpose(1, 2).unwrap();
        check_op(
            &name("rope"),
            std::slice::from_ref(&x),
            || ops::rope::rope(&xt, &cos, &sin).unwrap(),
            || ops::rope::reference(&xt, &cos, &sin).unwrap(),
            tol,
        );

        let (g, u) = (var(&[3, 7001], 6, 6.0), var(&[3, 7001], 7, 2.0));
        let (gt, ut) = (g.as_tensor(), u.as_tensor());
        check_op(
            &name("swiglu"),
            &[g.clone(), u.clone()],
            || ops::swiglu::swiglu(gt, ut).unwrap(),
            || ops::swiglu::reference(gt, ut).unwrap(),
            tol,
        );

        let z = var(&[3, 5, 1000], 8, 8.0);
        let ids: Vec<u32> = (0..15).map(|i| (i * 337 % 1000) as u32).collect();
        let y = Tensor::from_vec(ids, (3, 5), &dev).unwrap();
        let both = |f: fn(&Tensor, &Tensor) -> oxrl::Result<(Tensor, Tensor)>| {
            let (lp, lse) = f(z.as_tensor(), &y).unwrap();
            Tensor::cat(&[lp.unsqueeze(D::Minus1).unwrap(), lse], D::Minus1).unwrap()
        };
        check_op(
            &name("logprob_lse"),
            std::slice::from_ref(&z),
            || both(ops::logprob_lse::forward),
            || both(ops::logprob_lse::reference),
            tol,
        );

        let scores = var(&[2, 3, 4, 37], 9, 4.0);
        let mask: Vec<f32> = (0..2 * 4 * 37).map(|i| if i % 5 == 1 && i % 37 != 0 { -1e30 } else { 0.0 }).collect();
        let bias = Tensor::from_vec(mask, (2, 4, 37), &dev).unwrap();
        let st = scores.as_tensor();
        check_op(
            &name("masked_softmax"),
            std::slice::from_ref(&scores),
            || ops::softmax::masked_softmax(st, &bias, 0.7).unwrap(),
            || ops::softmax::reference(st, &bias.to_dtype(dtype).unwrap(), 0.7).unwrap(),
            tol,
        );

        // Decoding: 2 new tokens over a cache of 45 positions held in buffers of 50 (k and v are
        // strided views, read in place), grouped heads, left padding in row 1.
        for d in [64, 128] {
            let q = random(&[2, 4, 2, d], 10, 1.5, dtype, &dev);
            let k = random(&[2, 2, 50, d], 11, 1.5, dtype, &dev).narrow(2, 0, 45).unwrap();
            let v = random(&[2, 2, 50, d], 12, 1.5, dtype, &dev).narrow(2, 0, 45).unwrap();
            let mask: Vec<f32> = (0..2 * 2 * 45).map(|i| if i >= 90 && i % 45 < 3 { -1e30 } else { 0.0 }).collect();
            let bias = Tensor::from_vec(mask, (2, 2, 45), &dev).unwrap();
            let scale = 1.0 / (d as f64).sqrt();
            let fused = ops::cached_attention::cached_attention(&q, &k, &v, &bias, scale).unwrap();
            let reference =
                ops::cached_attention::reference(&q, &k, &v, &bias.to_dtype(dtype).unwrap(), scale).unwrap();
            let e = max_rel(&fused, &reference);
            println!("{} d={d}: max relative difference {e:.2e}", name("cached_attention"));
            assert!(e < tol, "cached_attention {dtype:?} d={d}: differs by {e}");
        }
    }
}

/// The device sampler (`ops::sample_rows`, what the engine draws with on a GPU) against the host
/// sampler on the same logits and random streams: greedy, temperature 1 and 0.7, f32 and bf16
/// logits over a vocabulary of 50,000 with a few peaked rows. The same tokens, and log-probs to
/// float rounding (the two sum the exponentials in different orders).
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a GPU")]
fn device_sampler_draws_the_host_samplers_tokens() {
    #[cfg(feature = "cuda")]
    {
        use oxrl::rollout::sampler::sample;
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let dev = gpu();
        let (rows, vocab) = (48, 50_000);
        for dtype in [DType::F32, DType::BF16] {
            let mut z = random(&[rows, vocab], 21, 4.0, dtype, &dev);
            // Peaked rows, as a trained model's are.
            let peak =
                Tensor::from_vec((0..rows).map(|r| if r % 3 == 0 { 12f32 } else { 0.0 }).collect(), (rows, 1), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
            let onehot =
                Tensor::from_vec((0..vocab).map(|j| if j == 777 { 1f32 } else { 0.0 }).collect(), (1, vocab), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
            z = (z + peak.broadcast_mul(&onehot).unwrap()).unwrap();
            let host: Vec<Vec<f32>> = cpu(&z).to_dtype(DType::F32).unwrap().to_vec2().unwrap();
            for temperature in [0.0, 1.0, 0.7] {
                let params = SamplingParams { temperature, ..Default::default() };
                let mut rngs: Vec<StdRng> = (0..rows).map(|r| StdRng::seed_from_u64(r as u64)).collect();
                let want: Vec<(u32, f32)> =
                    host.iter().zip(&mut rngs).map(|(row, rng)| sample(row, &params, rng).unwrap()).collect();
                let mut rngs: Vec<StdRng> = (0..rows).map(|r| StdRng::seed_from_u64(r as u64)).collect();
                let inv_t = vec![if temperature == 0.0 { 0.0 } else { (1.0 / temperature) as f32 }; rows];
                let u: Vec<f64> =
                    rngs.iter_mut().map(|rng| if temperature == 0.0 { 0.0 } else { rng.random::<f64>() }).collect();
                let got = oxrl::model::ops::sample_rows::sample_rows(&z, &inv_t, &u).unwrap();
                let worst = got.iter().zip(&want).map(|(g, w)| (g.1 - w.1).abs()).fold(0f32, f32::max);
                println!("sample_rows {dtype:?} T={temperature}: tokens equal, log-probs max |diff| {worst:.2e}");
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.0, w.0, "{dtype:?} T={temperature} row {r}: device token vs host token");
                    assert!(
                        (g.1 - w.1).abs() < 2e-5 * w.1.abs().max(1.0),
                        "{dtype:?} T={temperature} row {r}: {g:?} vs {w:?}"
                    );
                }
            }
        }
        // A NaN logit is an error naming the row, never a token.
        let mut v = vec![0f32; 2 * 100];
        v[100 + 7] = f32::NAN;
        let z = Tensor::from_vec(v, (2, 100), &dev).unwrap();
        let e = oxrl::model::ops::sample_rows::sample_rows(&z, &[0.0, 0.0], &[0.0, 0.0]).unwrap_err().to_string();
        assert!(e.contains("NaN") && e.contains("row 1"), "{e}");
    }
}
