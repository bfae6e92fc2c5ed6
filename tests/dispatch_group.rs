//! Worker groups over a data-parallel mesh: equivalence with one rank, ordering, staging,
//! collection ranks, colocation and bad calls.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device};
use common::fixture_dir;
use oxrl::dispatch::group::BuildWorker;
use oxrl::dispatch::mesh::MeshShape;
use oxrl::dispatch::residency::Parts;
use oxrl::dispatch::{Dispatch, Role, WorkerGroup};
use oxrl::model::Transformer;
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

fn builder(micro_batch_size: Option<usize>) -> BuildWorker {
    Arc::new(move |_coord| {
        let model = Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu)?;
        Worker::new(model, WorkerConfig { micro_batch_size, ..Default::default() })
    })
}

/// Five datums of different lengths, token-mean weights over the whole batch.
fn batch() -> Vec<Datum> {
    let lens = [7usize, 12, 4, 9, 15];
    let total: usize = lens.iter().map(|l| l - 1).sum();
    lens.iter()
        .enumerate()
        .map(|(r, &n)| {
            let seq: Vec<u32> = (0..n).map(|i| ((r * 37 + i * 11 + 5) % 290) as u32 + 3).collect();
            let mut w = vec![1.0 / total as f32; n];
            w[n - 1] = 0.0; // the last position has no next token
            let targets: Vec<u32> = seq[1..].iter().copied().chain([0]).collect();
            Datum::supervised(seq, targets, w)
        })
        .collect()
}

/// Every trainable parameter of the first rank, flattened.
fn params_of(g: &WorkerGroup) -> Vec<f64> {
    g.inspect(|w| {
        w.params()
            .iter()
            .flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .map(|x| x as f64)
            .collect()
    })
    .unwrap()
    .remove(0)
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    num / den
}

/// Parameters after `steps` steps, and the pre-clip gradient norm of each step.
fn train(g: &WorkerGroup, steps: usize) -> (Vec<f64>, Vec<f64>) {
    let adam = AdamParams { learning_rate: 1e-2, ..Default::default() };
    let mut norms = vec![];
    for _ in 0..steps {
        g.forward_backward(&batch(), "cross_entropy", &json!({}), false).unwrap();
        norms.push(g.optim_step(&adam).unwrap());
    }
    (params_of(g), norms)
}

#[test]
fn parameters_after_three_steps_do_not_depend_on_dp_or_micro_batch_size() {
    let (reference, ref_norms) = train(&WorkerGroup::new(Role::Policy, MeshShape::dp(1), builder(None)).unwrap(), 3);
    let initial = params_of(&WorkerGroup::new(Role::Policy, MeshShape::dp(1), builder(None)).unwrap());
    assert!(rel(&reference, &initial) > 1e-3, "training moved nothing");
    for dp in [1usize, 2, 4] {
        for mbs in [Some(1), Some(2), None] {
            let g = WorkerGroup::new(Role::Policy, MeshShape::dp(dp), builder(mbs)).unwrap();
            let (got, norms) = train(&g, 3);
            let err = rel(&got, &reference);
            assert!(err < 1e-5, "dp {dp} micro-batch {mbs:?}: parameters differ by {err} relative");
            // AdamW is blind to a gradient's scale; the norm is not (SUM, not mean, over ranks).
            for (a, b) in norms.iter().zip(&ref_norms) {
                assert!((a - b).abs() < 1e-5 * b, "dp {dp} micro-batch {mbs:?}: grad norm {a} vs {b}");
            }
            // Every replica holds the same parameters.
            let all =
                g.inspect(|w| w.params()[0].1.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()).unwrap();
            assert!(all.iter().all(|p| p == &all[0]), "dp {dp}: replicas diverged");
        }
    }
}

#[test]
fn outputs_come_back_in_input_order_for_direct_and_staged_calls() {
    let single = WorkerGroup::new(Role::Policy, MeshShape::dp(1), builder(None)).unwrap();
    let want = single.forward_backward(&batch(), "cross_entropy", &json!({}), true).unwrap();
    assert_eq!(want.loss_fn_outputs.len(), 5);
    for (d, o) in batch().iter().zip(&want.loss_fn_outputs) {
        assert_eq!(o.logprobs.len(), d.input_tokens.len());
    }
    let mut g = WorkerGroup::new(Role::Policy, MeshShape::dp(4), builder(Some(1))).unwrap();
    let direct = g.forward_backward(&batch(), "cross_entropy", &json!({}), true).unwrap();
    g.stage(&[batch()[..3].to_vec(), batch()]).unwrap();
    let staged = g.forward_backward_staged(1, "cross_entropy", &json!({}), true).unwrap();
    assert_eq!(direct.loss_fn_outputs.len(), 5);
    assert_eq!(staged.loss_fn_outputs, direct.loss_fn_outputs, "staged and direct differ");
    assert_eq!(staged.metrics.reduce(), direct.metrics.reduce());
    for (a, b) in direct.loss_fn_outputs.iter().zip(&want.loss_fn_outputs) {
        assert_eq!(a.logprobs.len(), b.logprobs.len());
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-5);
        }
    }
    let small = g.forward_backward_staged(0, "cross_entropy", &json!({}), true).unwrap();
    assert_eq!(small.loss_fn_outputs.len(), 3);
    let err = g.forward_backward_staged(2, "cross_entropy", &json!({}), true).unwrap_err().to_string();
    assert!(err.contains("index 2") && err.contains("out of range"), "{err}");
}

#[test]
fn tensor_parallel_replicas_are_collected_once() {
    let single = WorkerGroup::new(Role::Policy, MeshShape::dp(1), builder(None)).unwrap();
    let one = single.forward_backward(&batch(), "cross_entropy", &json!({}), true).unwrap().metrics.reduce();
    let g = WorkerGroup::new(Role::Policy, MeshShape { dp: 2, tp: 2, sp: 1, pp: 1 }, builder(None)).unwrap();
    let out = g.forward_backward(&batch(), "cross_entropy", &json!({}), true).unwrap();
    let m = out.metrics.reduce();
    assert_eq!(out.loss_fn_outputs.len(), 5);
    assert!((m["loss:sum"] - one["loss:sum"]).abs() < 1e-6, "{} vs {}", m["loss:sum"], one["loss:sum"]);
    assert_eq!(m["ntokens:sum"], one["ntokens:sum"]);
    // Each chunk really ran on both tp replicas: all four ranks hold gradients.
    let has_grads = g.inspect(|w| w.gradients().iter().all(|(_, gr)| gr.is_some())).unwrap();
    assert_eq!(has_grads, vec![true; 4]);
    // The all-reduce runs per tp index: after a step all four replicas agree with dp = 1.
    let adam = AdamParams { learning_rate: 1e-2, ..Default::default() };
    g.optim_step(&adam).unwrap();
    single.optim_step(&adam).unwrap();
    let want = params_of(&single);
    let got = g
        .inspect(|w| {
            w.params()
                .iter()
                .flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .map(|x| x as f64)
                .collect::<Vec<_>>()
        })
        .unwrap();
    for p in got {
        assert!(rel(&p, &want) < 1e-5);
    }
}

#[test]
fn colocated_roles_offload_and_backload_bit_exactly() {
    let mut d = Dispatch::new(true);
    d.init_model(Role::Policy, MeshShape::dp(2), builder(None)).unwrap();
    let adam = AdamParams { learning_rate: 1e-2, ..Default::default() };
    d.forward_backward(Role::Policy, &batch(), "cross_entropy", &json!({}), false).unwrap();
    d.optim_step(Role::Policy, &adam).unwrap();
    let snapshot = |d: &Dispatch| {
        d.group(Role::Policy)
            .unwrap()
            .inspect(|w| {
                let p: Vec<Vec<f32>> =
                    w.params().iter().map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()).collect();
                let m: Vec<Vec<f32>> = w
                    .params()
                    .iter()
                    .filter_map(|(n, _)| w.moments(n))
                    .flat_map(|m| {
                        [
                            m.exp_avg.flatten_all().unwrap().to_vec1().unwrap(),
                            m.exp_avg_sq.flatten_all().unwrap().to_vec1().unwrap(),
                        ]
                    })
                    .collect();
                (p, m)
            })
            .unwrap()
    };
    let before = snapshot(&d);
    assert!(!before[0].1.is_empty(), "moments exist after a step");
    // A reference role joins: the policy is offloaded entirely.
    d.init_model(Role::Reference, MeshShape::dp(1), builder(None)).unwrap();
    assert_eq!(d.residency().resident(Role::Policy), Parts::NONE);
    let offloaded = d.group(Role::Policy).unwrap().inspect(|w| w.moments(&w.params()[0].0).is_some()).unwrap();
    assert_eq!(offloaded, vec![false, false], "moments left the device");
    d.forward(Role::Reference, &batch(), None).unwrap();
    // The policy's forward brings back its model only; the step brings the optimizer.
    d.forward(Role::Policy, &batch(), None).unwrap();
    assert_eq!(d.residency().resident(Role::Policy), Parts::MODEL);
    assert_eq!(d.residency().resident(Role::Reference), Parts::NONE);
    d.forward_backward(Role::Policy, &batch(), "cross_entropy", &json!({}), false).unwrap();
    assert_eq!(d.residency().resident(Role::Policy), Parts::ALL);
    let after = snapshot(&d);
    assert_eq!(before, after, "offload + backload changed parameters or moments");
    assert_eq!(d.lcm_dp_size(), 2);
}

#[test]
fn bad_calls_are_clear_errors() {
    let mut d = Dispatch::new(false);
    let err = d.forward(Role::Critic, &batch(), None).unwrap_err().to_string();
    assert!(err.contains("Critic") && err.contains("no workers"), "{err}");
    d.init_model(Role::Policy, MeshShape::dp(2), builder(None)).unwrap();
    let err = d.forward_backward(Role::Policy, &[], "cross_entropy", &json!({}), true).unwrap_err().to_string();
    assert!(err.contains("empty batch"), "{err}");
    let err = d.forward_backward(Role::Policy, &batch(), "nope", &json!({}), true).unwrap_err().to_string();
    assert!(err.contains("nope"), "{err}");
    assert!(d.init_model(Role::Policy, MeshShape::dp(1), builder(None)).unwrap_err().to_string().contains("already"));
    let err = d.forward_backward_staged(Role::Policy, 0, "cross_entropy", &json!({}), true).unwrap_err().to_string();
    assert!(err.contains("out of range"), "{err}");
    // A failing builder is reported, not a hang.
    let failing: BuildWorker = Arc::new(|_| Err(oxrl::Error::input("no such model")));
    let err = WorkerGroup::new(Role::Critic, MeshShape::dp(2), failing).err().unwrap().to_string();
    assert!(err.contains("no such model"), "{err}");
}
