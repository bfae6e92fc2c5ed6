//! The memory settings end to end (`train.activation_checkpointing` for SFT,
//! `launch.activation_checkpointing` for RL): a run with them ends with the same exported weights,
//! byte for byte, and the same metrics (every key but the timings and the memory) as the run
//! without, on 2 in-process data-parallel ranks; and the metrics lines report `peak_rss_gb`.
//! `train.sharding` / `launch.sharding`: `optimizer`, `gradients` and `full` end with the weights and
//! metrics of `none`, bit for bit, at 2 and 3 ranks, each rank holding about 1/N of the optimizer
//! state (and under `full` of the parameters); checkpoints resume under another sharding; an
//! unknown name gets the nearest one (`full` off the CPU is refused: `worker::sharding`'s tests).

use crate::common;

use std::path::Path;

use common::fixture_dir;
use oxrl::dispatch::Dispatch;
use oxrl::launch::{rl_runtime, sft_dispatch};
use oxrl::trainer::model_ids::POLICY;
use oxrl::trainer::rl::run_rl;
use oxrl::trainer::run_dir::EXPORT_DIR;
use oxrl::trainer::{RlConfig, RunOptions, SftConfig};
use serde_json::Value;

const ROWS: &[&str] = &[
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    r#"{"instruction":"Reverse the word","input":"fox","output":"xof"}"#,
    r#"{"messages":[{"role":"user","content":"def add(a, b)"},{"role":"assistant","content":"return a + b"}]}"#,
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
];

/// Keys that measure the machine rather than the training.
fn measured(key: &str) -> bool {
    key.starts_with("time_") || key.ends_with("_per_s") || key == "elapsed_s" || key == "peak_rss_gb"
}

/// The run's metrics lines without the measured keys, and its exported weights.
fn outcome(run: &Path, weights: &str) -> (Vec<Value>, Vec<u8>) {
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines = lines
        .lines()
        .map(|l| {
            let mut v: serde_json::Map<String, Value> = serde_json::from_str(l).unwrap();
            let rss = v.get("peak_rss_gb").and_then(Value::as_f64);
            assert!(rss.is_some_and(|g| g > 0.0), "peak_rss_gb missing or not positive: {l}");
            v.retain(|k, _| !measured(k));
            Value::Object(v)
        })
        .collect();
    (lines, std::fs::read(run.join(EXPORT_DIR).join(weights)).unwrap())
}

fn sft(dir: &Path, name: &str, lora: bool, extra: &[&str]) -> (Vec<Value>, Vec<u8>) {
    sft_with(dir, name, lora, extra, &RunOptions::default()).0
}

/// An SFT run of 3 steps on 2 in-process ranks (unless `extra` says otherwise): its outcome
/// and its dispatch (the workers as they ended).
fn sft_with(
    dir: &Path,
    name: &str,
    lora: bool,
    extra: &[&str],
    opts: &RunOptions,
) -> ((Vec<Value>, Vec<u8>), Dispatch) {
    let data = dir.join("data.jsonl");
    std::fs::write(&data, ROWS.join("\n") + "\n").unwrap();
    let run = dir.join(name);
    let mut sets: Vec<String> = vec![
        format!("model.path={:?}", fixture_dir("qwen3").display().to_string()),
        format!("data.train_file={:?}", data.display().to_string()),
        format!("output.run_dir={:?}", run.display().to_string()),
        "optimizer.lr=0.01".into(),
        "train.batch_size=4".into(),
        "train.micro_batch_size=1".into(),
        "train.eval_every=0".into(),
        "train.max_steps=3".into(),
        "train.data_parallel=2".into(),
    ];
    if lora {
        sets.extend(["model.lora.rank=4".into(), "model.lora.alpha=8".into()]);
    }
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = SftConfig::load(None, &sets).unwrap();
    let dispatch = sft_dispatch(&cfg, Some(1)).unwrap();
    oxrl::trainer::sft::run_sft(&cfg, &dispatch, opts).unwrap();
    if opts.stop_after.is_some() {
        return ((vec![], vec![]), dispatch);
    }
    (outcome(&run, if lora { "adapter_model.safetensors" } else { "model.safetensors" }), dispatch)
}

fn grpo(dir: &Path, name: &str, extra: &[&str]) -> (Vec<Value>, Vec<u8>) {
    let model = dir.join("model");
    if !model.exists() {
        common::tiny_byte_model(&model, 32, 256, 7);
    }
    let run = dir.join(name);
    let mut sets: Vec<String> = vec![
        format!("model.path={}", model.display()),
        format!("output.run_dir={}", run.display()),
        "data.synthetic_train=40".into(),
        "rollout.n_samples=4".into(),
        "env.max_turn_tokens=4".into(),
        "train.prompts_per_step=4".into(),
        "train.max_steps=2".into(),
        "train.eval_every=0".into(),
        "optimizer.lr=1e-3".into(),
        "algorithm.kl.coef=0.05".into(),
        "launch.data_parallel=2".into(),
        "launch.micro_batch_size=2".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = RlConfig::load(None, &sets).unwrap();
    let (dispatch, engines) = rl_runtime(&cfg, Some(1)).unwrap();
    run_rl(&cfg, &dispatch, &engines, &RunOptions::default()).unwrap();
    let lora = extra.iter().any(|s| s.starts_with("model.lora"));
    outcome(&run, if lora { "adapter_model.safetensors" } else { "model.safetensors" })
}

#[test]
fn sft_with_activation_checkpointing_ends_bit_identical() {
    for lora in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (m0, w0) = sft(dir.path(), "plain", lora, &[]);
        let (m1, w1) = sft(dir.path(), "ckpt", lora, &["train.activation_checkpointing=true"]);
        assert_eq!(m0.len(), 3);
        assert_eq!(m0, m1, "lora {lora}: metrics");
        assert!(w0 == w1, "lora {lora}: exported weights differ");
    }
}

#[test]
fn grpo_with_activation_checkpointing_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (m0, w0) = grpo(dir.path(), "plain", &[]);
    let (m1, w1) = grpo(dir.path(), "ckpt", &["launch.activation_checkpointing=true"]);
    assert_eq!(m0.len(), 2);
    assert_eq!(m0, m1, "metrics");
    assert!(w0 == w1, "exported weights differ");
}

/// Every sharding mode ends where `none` does, bit for bit: full fine-tuning and LoRA in f32,
/// and a bf16 model (sliced f32 masters), with the gradient norm clipped (so the norm, gathered
/// from the owners, decides every update); 2 and 3 ranks; with activation checkpointing.
#[test]
fn sft_sharded_ends_bit_identical() {
    let cases: &[(bool, &[&str])] = &[
        (false, &["optimizer.grad_clip_norm=0.05"]),
        (true, &["optimizer.grad_clip_norm=0.05"]),
        (false, &["model.dtype=\"bf16\"", "optimizer.grad_clip_norm=0.05"]),
        (false, &["train.data_parallel=3", "optimizer.grad_clip_norm=0.05"]),
        // Layers recomputed in the backward (gathered once more).
        (false, &["train.activation_checkpointing=true"]),
        // One micro-batch per rank: `full` sums each weight's gradient during the backward.
        (false, &["train.micro_batch_size=2", "optimizer.grad_clip_norm=0.05"]),
        (false, &["train.micro_batch_size=2", "model.dtype=\"bf16\"", "optimizer.grad_clip_norm=0.05"]),
        (false, &["train.micro_batch_size=2", "train.data_parallel=3", "train.activation_checkpointing=true"]),
        // Two micro-batches a rank, summed across the ranks after each (`full`: unit by unit).
        (false, &["train.gradient_sum=\"micro_batch\"", "optimizer.grad_clip_norm=0.05"]),
        (true, &["train.gradient_sum=\"micro_batch\"", "optimizer.grad_clip_norm=0.05"]),
        (false, &["train.gradient_sum=\"micro_batch\"", "model.dtype=\"bf16\"", "optimizer.grad_clip_norm=0.05"]),
        (
            false,
            &["train.gradient_sum=\"micro_batch\"", "train.data_parallel=3", "train.activation_checkpointing=true"],
        ),
    ];
    for (lora, extra) in cases {
        let dir = tempfile::tempdir().unwrap();
        let (m0, w0) = sft(dir.path(), "none", *lora, extra);
        assert_eq!(m0.len(), 3);
        for mode in ["optimizer", "gradients", "full"] {
            let setting = format!("train.sharding=\"{mode}\"");
            let sets: Vec<&str> = extra.iter().copied().chain([setting.as_str()]).collect();
            let (m1, w1) = sft(dir.path(), mode, *lora, &sets);
            assert_eq!(m0, m1, "{mode}, lora {lora}, {extra:?}: metrics");
            assert!(w0 == w1, "{mode}, lora {lora}, {extra:?}: exported weights differ");
        }
    }
}

/// `full` with ranks whose chunks pack into different micro-batch counts (short rows on rank 0,
/// long ones on rank 1, under a token budget): rank 0 takes part in rank 1's extra gathers
/// without computing, and the weights after two steps are the bits of `none`, exported or as
/// an engine receives them; one rank alone cannot read them.
#[test]
fn full_sharding_keeps_ranks_in_lockstep_over_uneven_micro_batches() {
    use oxrl::dispatch::{MeshShape, WorkerSpec};
    use oxrl::worker::packing::plan_micro_batches;
    use oxrl::worker::{AdamParams, Datum, WorkerConfig};
    let seq = |n: usize, k: usize| -> Datum {
        let t: Vec<u32> = (0..=n).map(|j| ((k * 37 + j * 11) % 250 + 3) as u32).collect();
        Datum::supervised(t[..n].to_vec(), t[1..].to_vec(), vec![1.0; n])
    };
    let batch = vec![seq(8, 0), seq(9, 1), seq(40, 2), seq(38, 3)];
    let budget = Some(48);
    let counts: Vec<usize> =
        [[8, 9], [40, 38]].iter().map(|l| plan_micro_batches(l, Some(2), budget).unwrap().len()).collect();
    assert_eq!(counts, vec![1, 2], "the chunks must pack unevenly for this test to mean anything");
    let loss = common::loss("cross_entropy", &serde_json::json!({}));
    let weights = |mode: &str| -> (Vec<u8>, Vec<u8>) {
        let sharding = oxrl::worker::Sharding::from_name(mode).unwrap();
        let worker = WorkerConfig {
            micro_batch_size: Some(2),
            max_tokens_per_microbatch: budget,
            sharding,
            ..Default::default()
        };
        let spec = WorkerSpec { mesh: MeshShape::dp(2), threads: 1, worker, ..WorkerSpec::new(fixture_dir("qwen3")) };
        let d = Dispatch::new(false);
        d.create_model(POLICY, &spec).unwrap();
        for _ in 0..2 {
            d.forward_backward(POLICY, &batch, Some(&loss), false).unwrap();
            d.optim_step(POLICY, &AdamParams { learning_rate: 1e-2, ..Default::default() }).unwrap();
        }
        if mode == "full" {
            // A rank alone cannot read the weights: they are gathered by the group.
            let alone = d.model(POLICY).unwrap().inspect(|w| w.sampler_weights().map(drop)).unwrap();
            for e in alone {
                let e = e.unwrap_err().to_string();
                assert!(e.contains("holds only its slice of the weights"), "{e}");
            }
        }
        let dir = tempfile::tempdir().unwrap();
        d.export(POLICY, dir.path(), false).unwrap();
        let sampled = d.sampler_weights(POLICY).unwrap().to_safetensors().unwrap();
        (std::fs::read(dir.path().join("model.safetensors")).unwrap(), sampled)
    };
    let (none, full) = (weights("none"), weights("full"));
    assert!(none.0 == full.0, "full's export differs from none over uneven micro-batches");
    // (The safetensors metadata is a map: compare the tensors, by name, bit for bit.)
    let tensors = |bytes: &[u8]| -> Vec<(String, Vec<u32>)> {
        let map = candle_core::safetensors::load_buffer(bytes, &candle_core::Device::Cpu).unwrap();
        let mut all: Vec<(String, Vec<u32>)> = map
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()))
            .collect();
        all.sort();
        all
    };
    assert_eq!(tensors(&none.1).len(), 25);
    assert!(tensors(&none.1) == tensors(&full.1), "full's engine weights (gathered unit by unit) differ from none's");
}

/// Each rank keeps the moments and masters of about 1/N of the parameters (N = 2, 3), and all
/// of them together are exactly the unsharded rank's; under `full` the same holds for the
/// parameters themselves (between steps every rank holds only its own).
#[test]
fn sharded_ranks_hold_their_share_of_the_optimizer_state() {
    let moment_bytes =
        |d: &Dispatch| -> Vec<usize> { d.model(POLICY).unwrap().inspect(|w| w.optimizer_bytes()).unwrap() };
    let param_bytes = |d: &Dispatch| -> Vec<usize> { d.model(POLICY).unwrap().inspect(|w| w.param_bytes()).unwrap() };
    let share = |what: &str, per_rank: &[usize], whole: usize| {
        let n = per_rank.len();
        assert_eq!(per_rank.iter().sum::<usize>(), whole, "{what}: the slices do not add up");
        for (r, b) in per_rank.iter().enumerate() {
            let share = *b as f64 / (whole as f64 / n as f64);
            assert!((0.9..=1.1).contains(&share), "{what}: rank {r} holds {share:.3} of its 1/N share");
        }
    };
    let dir = tempfile::tempdir().unwrap();
    // bf16: the f32 masters are optimizer state too.
    let bf16 = "model.dtype=\"bf16\"";
    let (_, none) = sft_with(dir.path(), "none", false, &["train.max_steps=1", bf16], &RunOptions::default());
    let whole = moment_bytes(&none)[0];
    assert!(moment_bytes(&none).iter().all(|&b| b == whole) && whole > 0);
    let whole_params = param_bytes(&none)[0];
    assert!(param_bytes(&none).iter().all(|&b| b == whole_params) && whole_params > 0);
    for n in [2, 3] {
        for mode in ["optimizer", "gradients", "full"] {
            let sets = [
                format!("train.data_parallel={n}"),
                format!("train.sharding=\"{mode}\""),
                "train.max_steps=1".into(),
                bf16.into(),
            ];
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let (_, d) = sft_with(dir.path(), &format!("{mode}{n}"), false, &sets, &RunOptions::default());
            let per_rank = moment_bytes(&d);
            assert_eq!(per_rank.len(), n);
            share(&format!("{mode} at {n}, optimizer state"), &per_rank, whole);
            let params = param_bytes(&d);
            match mode {
                "full" => share(&format!("full at {n}, parameters"), &params, whole_params),
                _ => assert!(params.iter().all(|&b| b == whole_params), "{mode} at {n}: {params:?}"),
            }
        }
        // A LoRA model's frozen base is sliced too; its adapters stay whole.
        let sets = [format!("train.data_parallel={n}"), "train.sharding=\"full\"".into(), "train.max_steps=1".into()];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let (_, lora) = sft_with(dir.path(), &format!("lora{n}"), true, &sets, &RunOptions::default());
        let base = lora.model(POLICY).unwrap().inspect(|w| w.weight_bytes()).unwrap();
        // (In f32: twice the bf16 model's bytes.)
        share(&format!("LoRA under full at {n}, the frozen base"), &base, whole_params * 2);
        let adapters = param_bytes(&lora);
        assert!(adapters.iter().all(|&b| b == adapters[0] && b > 0), "LoRA under full at {n}: {adapters:?}");
    }
}

/// Under `full`, when every rank runs one micro-batch of a step, each weight's gradient is summed
/// to its owner during the backward: between the backward and the step a rank holds the
/// gradients of its own slice (about 1/N of them), where a plain forward_backward, or two
/// micro-batches a rank, keep every gradient until the step. Every way ends on `none`'s bits,
/// and a second backward before the step is refused.
#[test]
fn full_sharding_sums_gradients_during_the_backward() {
    use oxrl::dispatch::{MeshShape, WorkerSpec};
    use oxrl::worker::{AdamParams, Datum, WorkerConfig};
    let seq = |n: usize, k: usize| -> Datum {
        let t: Vec<u32> = (0..=n).map(|j| ((k * 37 + j * 11) % 250 + 3) as u32).collect();
        Datum::supervised(t[..n].to_vec(), t[1..].to_vec(), vec![1.0; n])
    };
    let batch = vec![seq(8, 0), seq(9, 1), seq(12, 2), seq(5, 3)];
    let loss = common::loss("cross_entropy", &serde_json::json!({}));
    let adam = AdamParams { learning_rate: 1e-2, grad_clip_norm: 0.05, ..Default::default() };
    // (exported weights, gradient bytes per rank before each step)
    let run = |mode: &str, micro: usize, for_step: bool| -> (Vec<u8>, Vec<Vec<usize>>) {
        let sharding = oxrl::worker::Sharding::from_name(mode).unwrap();
        let worker = WorkerConfig { micro_batch_size: Some(micro), sharding, ..Default::default() };
        let spec = WorkerSpec { mesh: MeshShape::dp(2), threads: 1, worker, ..WorkerSpec::new(fixture_dir("qwen3")) };
        let d = Dispatch::new(false);
        d.create_model(POLICY, &spec).unwrap();
        let grad_bytes = || d.model(POLICY).unwrap().inspect(|w| w.gradient_bytes()).unwrap();
        let mut held = vec![];
        for _ in 0..2 {
            let fb = match for_step {
                true => d.model(POLICY).unwrap().submit_forward_backward_for_step(&batch, Some(&loss), false),
                false => d.model(POLICY).unwrap().submit_forward_backward(&batch, Some(&loss), false),
            };
            fb.wait().unwrap();
            held.push(grad_bytes());
            d.optim_step(POLICY, &adam).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        d.export(POLICY, dir.path(), false).unwrap();
        (std::fs::read(dir.path().join("model.safetensors")).unwrap(), held)
    };
    let (none, whole) = run("none", 2, false);
    let all = whole[0][0];
    assert!(all > 0 && whole.iter().flatten().all(|&b| b == all), "{whole:?}");
    // (Micro-batches of one datum add the gradients in another order: their own `none`.)
    let none_by_one = run("none", 1, false).0;
    for (micro, for_step) in [(2, true), (2, false), (1, true)] {
        let (weights, held) = run("full", micro, for_step);
        let none = if micro == 1 { &none_by_one } else { &none };
        assert!(weights == *none, "full, {micro} a micro-batch, for_step {for_step}: the weights differ from none's");
        for per_rank in held {
            if micro == 2 && for_step {
                assert_eq!(per_rank.iter().sum::<usize>(), all, "the owners' sums make one whole set: {per_rank:?}");
                for b in &per_rank {
                    let share = *b as f64 / (all as f64 / 2.0);
                    assert!((0.8..=1.2).contains(&share), "a rank holds {share:.3} of its half: {per_rank:?}");
                }
            } else {
                assert!(per_rank.iter().all(|&b| b == all), "{micro}, {for_step}: every gradient kept: {per_rank:?}");
            }
        }
    }
    // A second backward before the step would add to sums already made.
    let worker =
        WorkerConfig { micro_batch_size: Some(2), sharding: oxrl::worker::Sharding::Full, ..Default::default() };
    let spec = WorkerSpec { mesh: MeshShape::dp(2), threads: 1, worker, ..WorkerSpec::new(fixture_dir("qwen3")) };
    let d = Dispatch::new(false);
    d.create_model(POLICY, &spec).unwrap();
    let group = d.model(POLICY).unwrap();
    group.submit_forward_backward_for_step(&batch, Some(&loss), false).wait().unwrap();
    let e = d.forward_backward(POLICY, &batch, Some(&loss), false).unwrap_err().to_string();
    assert!(e.contains("optimizer step must come before another forward_backward"), "{e}");
}

/// `gradient_sum = "micro_batch"` sums each round of micro-batches across the ranks and adds the
/// rounds, `step` adds each rank's micro-batches and sums the ranks: with 2 ranks of 2 one-datum
/// micro-batches (d0 d1 | d2 d3) the accumulators hold (g0 + g2) + (g1 + g3) and g0 + g1 (rank
/// 0; g2 + g3 on rank 1), where gk is datum k's gradient computed alone by the same rank. Under
/// `full` each rank holds only the sums it owns (about half), every mode ends on `none`'s weights
/// under the same setting, and a worker alone adds its micro-batches' gradients in order.
#[test]
fn gradient_sum_micro_batch_sums_each_round_across_ranks() {
    use candle_core::Tensor;
    use oxrl::dispatch::{MeshShape, WorkerSpec};
    use oxrl::worker::{AdamParams, Datum, GradientSum, Sharding, WorkerConfig};
    let seq = |n: usize, k: usize| -> Datum {
        let t: Vec<u32> = (0..=n).map(|j| ((k * 37 + j * 11) % 250 + 3) as u32).collect();
        Datum::supervised(t[..n].to_vec(), t[1..].to_vec(), vec![1.0; n])
    };
    // (A rank runs its micro-batches longest first: the rounds are d0 d2, then d1 d3.)
    let d: Vec<Datum> = [9, 8, 12, 5].iter().enumerate().map(|(k, &n)| seq(n, k)).collect();
    let loss = common::loss("cross_entropy", &serde_json::json!({}));
    let group = |sharding: Sharding, gradient_sum: GradientSum| -> Dispatch {
        let worker = WorkerConfig { micro_batch_size: Some(1), sharding, gradient_sum, ..Default::default() };
        let spec = WorkerSpec { mesh: MeshShape::dp(2), threads: 1, worker, ..WorkerSpec::new(fixture_dir("qwen3")) };
        let dispatch = Dispatch::new(false);
        dispatch.create_model(POLICY, &spec).unwrap();
        dispatch
    };
    // Each rank's accumulators after one forward_backward of `batch`, by parameter name.
    let held = |dispatch: &Dispatch, batch: &[Datum]| -> Vec<Vec<(String, Option<Tensor>)>> {
        dispatch.forward_backward(POLICY, batch, Some(&loss), false).unwrap();
        let read = |w: &oxrl::worker::Worker| -> Vec<(String, Option<Tensor>)> {
            w.gradients().into_iter().map(|(n, g)| (n.to_string(), g.cloned())).collect()
        };
        dispatch.model(POLICY).unwrap().inspect(read).unwrap()
    };
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    // gk on the rank that runs it in the grouped calls: d0, d1 on rank 0, d2, d3 on rank 1.
    let first = held(&group(Sharding::None, GradientSum::Step), &[d[0].clone(), d[2].clone()]);
    let second = held(&group(Sharding::None, GradientSum::Step), &[d[1].clone(), d[3].clone()]);
    let all = d.clone();
    let each = held(&group(Sharding::None, GradientSum::MicroBatch), &all);
    let step = held(&group(Sharding::None, GradientSum::Step), &all);
    let mut differ = 0;
    for (i, (name, _)) in first[0].iter().enumerate() {
        let g = |ranks: &[Vec<(String, Option<Tensor>)>], r: usize| ranks[r][i].1.clone().unwrap();
        let (g0, g2, g1, g3) = (g(&first, 0), g(&first, 1), g(&second, 0), g(&second, 1));
        let rounds = ((&g0 + &g2).unwrap() + (&g1 + &g3).unwrap()).unwrap();
        for r in 0..2 {
            assert!(bits(&g(&each, r)) == bits(&rounds), "{name}, rank {r}: not (g0 + g2) + (g1 + g3)");
            assert!(each[r][i].0 == *name && each[r][i].0 == step[r][i].0);
        }
        assert!(bits(&g(&step, 0)) == bits(&(&g0 + &g1).unwrap()), "{name}: step's rank 0 holds not g0 + g1");
        assert!(bits(&g(&step, 1)) == bits(&(&g2 + &g3).unwrap()), "{name}: step's rank 1 holds not g2 + g3");
        let summed_at_step = (g(&step, 0) + g(&step, 1)).unwrap();
        differ += usize::from(bits(&summed_at_step) != bits(&rounds));
    }
    assert!(differ > 0, "the two orders gave the same bits everywhere: this test cannot tell them apart");

    // Under `full` a rank keeps the sums it owns; the step applies them.
    let full = group(Sharding::Full, GradientSum::MicroBatch);
    let per_rank = held(&full, &all);
    let bytes = full.model(POLICY).unwrap().inspect(|w| w.gradient_bytes()).unwrap();
    let whole: usize = each[0].iter().map(|(_, g)| g.as_ref().unwrap().elem_count() * 4).sum();
    assert_eq!(bytes.iter().sum::<usize>(), whole, "the owners' sums make one whole set: {bytes:?}");
    for b in &bytes {
        let share = *b as f64 / (whole as f64 / 2.0);
        assert!((0.8..=1.2).contains(&share), "a rank holds {share:.3} of its half: {bytes:?}");
    }
    for (i, (name, _)) in each[0].iter().enumerate() {
        let owner: Vec<&Tensor> = per_rank.iter().filter_map(|r| r[i].1.as_ref()).collect();
        assert_eq!(owner.len(), 1, "{name}: one owner keeps the sum");
        assert!(bits(owner[0]) == bits(each[0][i].1.as_ref().unwrap()), "{name}: the owner's sum is not none's");
    }
    let adam = AdamParams { learning_rate: 1e-2, grad_clip_norm: 0.05, ..Default::default() };
    let export = |dispatch: &Dispatch| -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        dispatch.export(POLICY, dir.path(), false).unwrap();
        std::fs::read(dir.path().join("model.safetensors")).unwrap()
    };
    let none = group(Sharding::None, GradientSum::MicroBatch);
    held(&none, &all);
    for dispatch in [&none, &full] {
        dispatch.optim_step(POLICY, &adam).unwrap();
        // A second step of two calls, each of two rounds, summed as they come.
        held(dispatch, &all[..2]);
        held(dispatch, &all[2..]);
        dispatch.optim_step(POLICY, &adam).unwrap();
    }
    assert!(export(&none) == export(&full), "full's weights differ from none's under micro_batch");

    // A worker alone: its micro-batches' gradients are its sums, added in order (for this
    // untied model, the bits of `step`, which adds a tied embedding's two parts one by one).
    let alone = |gradient_sum: GradientSum| -> Vec<Vec<u32>> {
        let model =
            oxrl::model::Transformer::load(&fixture_dir("qwen3"), candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap();
        let config = WorkerConfig { micro_batch_size: Some(1), gradient_sum, ..Default::default() };
        let mut worker = oxrl::worker::Worker::new(model, config).unwrap();
        worker.forward_backward(&all, Some(&loss), false).unwrap();
        assert_eq!(worker.gradients_summed(), gradient_sum == GradientSum::MicroBatch);
        worker.gradients().iter().map(|(_, g)| bits(g.unwrap())).collect()
    };
    assert!(
        alone(GradientSum::MicroBatch) == alone(GradientSum::Step),
        "a worker alone adds its micro-batches otherwise"
    );
}

/// Summing each micro-batch, a rank whose batch is refused (a token past the vocabulary) makes
/// every rank fail with its reason before any collective, unsharded and under `full`, and the
/// group then trains on a good batch.
#[test]
fn gradient_sum_micro_batch_refused_batch_fails_every_rank() {
    use oxrl::dispatch::{MeshShape, WorkerSpec};
    use oxrl::worker::{Datum, GradientSum, Sharding, WorkerConfig};
    let good = Datum::supervised(vec![5, 6, 7], vec![6, 7, 8], vec![1.0; 3]);
    let bad = Datum::supervised(vec![5, 6, 7], vec![6, 7, 1_000_000], vec![1.0; 3]);
    let loss = common::loss("cross_entropy", &serde_json::json!({}));
    for sharding in [Sharding::None, Sharding::Full] {
        let worker = WorkerConfig {
            micro_batch_size: Some(1),
            sharding,
            gradient_sum: GradientSum::MicroBatch,
            ..Default::default()
        };
        let spec = WorkerSpec { mesh: MeshShape::dp(2), threads: 1, worker, ..WorkerSpec::new(fixture_dir("qwen3")) };
        let d = Dispatch::new(false);
        d.create_model(POLICY, &spec).unwrap();
        let e = d.forward_backward(POLICY, &[good.clone(), bad.clone()], Some(&loss), false).unwrap_err().to_string();
        assert!(
            e.contains("data-parallel rank 1 refused its batch") && e.contains("token id 1000000"),
            "{sharding}: {e}"
        );
        let out = d.forward_backward(POLICY, &[good.clone(), good.clone()], Some(&loss), false).unwrap();
        assert!(out.metrics.value("loss:sum").is_some_and(f64::is_finite), "{sharding}");
    }
}

/// A head of several vocabulary blocks (40,000 tokens, tied and untied) under `full`: its gradient
/// is summed to its owner block by block during the backward, a tied head's hot rows (the tokens
/// of every rank's batch, shared between ranks here) once more at the embedding, and the
/// weights end on `none`'s bits at 2 and 3 ranks, one of the 3 without a datum; the same with
/// every micro-batch summed (`gradient_sum = "micro_batch"`, the owner adding each block and
/// hot row into its running sum).
#[test]
fn full_sharding_sums_a_head_of_several_blocks_to_none_bits() {
    use oxrl::dispatch::{MeshShape, WorkerSpec};
    use oxrl::model::model_config::{Arch, ModelShape};
    use oxrl::worker::{AdamParams, Datum, GradientSum, WorkerConfig};
    let vocab = 40_000;
    assert!(oxrl::model::tape::vocab_blocks(vocab, oxrl::model::tape::VOCAB_BLOCK).len() >= 3);
    let seq = |k: usize| -> Datum {
        // Every datum shares the tokens j < 10; the rest are its own.
        let t: Vec<u32> =
            (0..=40).map(|j| if j < 10 { j * 3_989 } else { (k * 7_919 + j * 104_729) % vocab } as u32).collect();
        Datum::supervised(t[..40].to_vec(), t[1..].to_vec(), vec![1.0; 40])
    };
    let loss = common::loss("cross_entropy", &serde_json::json!({}));
    let adam = AdamParams { learning_rate: 1e-2, grad_clip_norm: 0.05, ..Default::default() };
    for tied in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let shape = ModelShape {
            vocab_size: vocab,
            hidden_size: 16,
            intermediate_size: 32,
            num_layers: 2,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            rope_theta: 1e4,
            max_position_embeddings: 512,
            tie_word_embeddings: tied,
        };
        oxrl::model::init::write_random_model(dir.path(), Arch::Qwen3, &shape, 11, candle_core::DType::F32).unwrap();
        let run = |mode: &str, ranks: usize, batch: &[Datum], gradient_sum: GradientSum| -> Vec<u8> {
            let sharding = oxrl::worker::Sharding::from_name(mode).unwrap();
            // Summing each micro-batch, a rank runs several, the head's sums added into the
            // owner's running sum from the second on.
            let micro_batch_size = Some(if gradient_sum == GradientSum::Step { 4 } else { 1 });
            let worker = WorkerConfig { micro_batch_size, sharding, gradient_sum, ..Default::default() };
            let spec = WorkerSpec { mesh: MeshShape::dp(ranks), threads: 1, worker, ..WorkerSpec::new(dir.path()) };
            let d = Dispatch::new(false);
            d.create_model(POLICY, &spec).unwrap();
            for _ in 0..2 {
                d.model(POLICY).unwrap().submit_forward_backward_for_step(batch, Some(&loss), false).wait().unwrap();
                d.optim_step(POLICY, &adam).unwrap();
            }
            let out = tempfile::tempdir().unwrap();
            d.export(POLICY, out.path(), false).unwrap();
            std::fs::read(out.path().join("model.safetensors")).unwrap()
        };
        let cases = [
            (2, 4, GradientSum::Step),
            (3, 2, GradientSum::Step),
            (2, 4, GradientSum::MicroBatch),
            (3, 5, GradientSum::MicroBatch),
        ];
        for (ranks, datums, sum) in cases {
            let batch: Vec<Datum> = (0..datums).map(seq).collect();
            let none = run("none", ranks, &batch, sum);
            assert!(
                run("full", ranks, &batch, sum) == none,
                "tied {tied}, {ranks} ranks, {sum}: full's weights differ from none's"
            );
        }
    }
}

/// A checkpoint does not depend on the layout that wrote it: a run stopped at step 2 under one
/// sharding and resumed under another ends where the uninterrupted `none` run does.
#[test]
fn checkpoints_resume_across_shardings() {
    let dir = tempfile::tempdir().unwrap();
    let every = ["train.checkpoint_every=1", "model.dtype=\"bf16\""];
    let (m0, w0) = sft(dir.path(), "straight", false, &every);
    for (first, then) in
        [("gradients", "none"), ("none", "optimizer"), ("optimizer", "gradients"), ("full", "none"), ("none", "full")]
    {
        let name = format!("{first}-{then}");
        let with = |mode: &str| -> Vec<String> {
            every.iter().map(|s| s.to_string()).chain([format!("train.sharding=\"{mode}\"")]).collect()
        };
        let (a, b) = (with(first), with(then));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let b: Vec<&str> = b.iter().map(String::as_str).collect();
        sft_with(dir.path(), &name, false, &a, &RunOptions { stop_after: Some(2), ..Default::default() });
        let ((m1, w1), _) = sft_with(dir.path(), &name, false, &b, &RunOptions { resume: true, ..Default::default() });
        assert_eq!(m0[2], m1[m1.len() - 1], "{first} then {then}: the last step's metrics");
        assert!(w0 == w1, "{first} then {then}: the resumed run's weights differ");
    }
}

/// GRPO with a KL reference, PPO with GAE (a sharded critic beside the policy), the asynchronous
/// trainer (staleness 0), and a LoRA policy.
#[test]
fn rl_sharded_ends_bit_identical() {
    let gae: &[&str] = &["algorithm.advantage=\"gae\"", "algorithm.lambda=0.95", "critic.lr=1e-3"];
    let async_rl: &[&str] = &["mode=\"async\"", "async_rl.max_staleness=0"];
    // One micro-batch per rank: `full` sums the policy's and the critic's gradients during the
    // backward (the value head, not sliced, at the step).
    let gae_one: &[&str] = &[gae, &["launch.micro_batch_size=8"][..]].concat();
    // LoRA: under `full` the frozen base is sliced; the engines receive the adapters.
    let lora: &[&str] = &["model.lora.rank=4", "model.lora.alpha=8"];
    // Every micro-batch summed across the ranks: the policy's two a rank and the critic's.
    let each: &[&str] = &[gae, &["launch.gradient_sum=\"micro_batch\""][..]].concat();
    for extra in [&[][..], gae, async_rl, gae_one, lora, each] {
        let dir = tempfile::tempdir().unwrap();
        let (m0, w0) = grpo(dir.path(), "plain", extra);
        for mode in ["optimizer", "gradients", "full"] {
            let setting = format!("launch.sharding=\"{mode}\"");
            let sets: Vec<&str> = extra.iter().copied().chain([setting.as_str()]).collect();
            let (m1, w1) = grpo(dir.path(), mode, &sets);
            assert_eq!(m0, m1, "{mode}, {extra:?}: metrics");
            assert!(w0 == w1, "{mode}, {extra:?}: exported weights differ");
        }
    }
}

#[test]
fn sharding_names_are_checked_and_unserved_modes_refused() {
    let sft = |value: &str| {
        let sets = [
            "model.path=\"m\"".to_string(),
            "data.train_file=\"d.jsonl\"".into(),
            format!("train.sharding=\"{value}\""),
        ];
        SftConfig::load(None, &sets).map(|c| c.train.sharding.name()).map_err(|e| e.to_string())
    };
    let rl = |value: &str| {
        let sets = ["model.path=\"m\"".to_string(), format!("launch.sharding=\"{value}\"")];
        RlConfig::load(None, &sets).map(|c| c.launch.sharding.name()).map_err(|e| e.to_string())
    };
    for mode in ["none", "optimizer", "gradients", "full"] {
        assert_eq!(sft(mode), Ok(mode));
        assert_eq!(rl(mode), Ok(mode));
    }
    let e = SftConfig::load(
        None,
        &["model.path=\"m\"".into(), "data.train_file=\"d.jsonl\"".into(), "train.gradient_sum=\"microbatch\"".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("train.gradient_sum") && e.contains("did you mean `micro_batch`?"), "{e}");
    let e = RlConfig::load(None, &["model.path=\"m\"".into(), "launch.gradient_sum=\"steps\"".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("launch.gradient_sum") && e.contains("did you mean `step`?"), "{e}");
    for (load, key) in
        [(&sft as &dyn Fn(&str) -> Result<&'static str, String>, "train.sharding"), (&rl, "launch.sharding")]
    {
        let e = load("optimiser").unwrap_err();
        assert!(e.contains(key) && e.contains("did you mean `optimizer`?"), "{e}");
    }
}
