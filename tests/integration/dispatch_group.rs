//! Worker groups over a data-parallel mesh: equivalence with one rank, ordering, staging,
//! collection ranks, colocation of models by id and bad calls.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device};
use common::fixture_dir;
use oxrl::algo::Loss;
use oxrl::dispatch::mesh::MeshShape;
use oxrl::dispatch::residency::Parts;
use oxrl::dispatch::worker_group::BuildWorker;
use oxrl::dispatch::{Dispatch, WorkerGroup, WorkerSpec};
use oxrl::model::Transformer;
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

fn builder(micro_batch_size: Option<usize>) -> BuildWorker {
    Arc::new(move |_coord| {
        let model = Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu)?;
        Worker::new(model, WorkerConfig { micro_batch_size, ..Default::default() })
    })
}

/// A group of `dp` ranks (one tensor-math thread each) over the qwen3 fixture.
fn group(shape: MeshShape, micro_batch_size: Option<usize>) -> WorkerGroup {
    WorkerGroup::new("policy", shape, 1, builder(micro_batch_size)).unwrap()
}

/// The qwen3 fixture as a model of `dp` ranks.
fn spec(dp: usize) -> WorkerSpec {
    WorkerSpec { mesh: MeshShape::dp(dp), ..WorkerSpec::new(fixture_dir("qwen3")) }
}

fn ce() -> Loss {
    common::loss("cross_entropy", &json!({}))
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

/// Parameters after `steps` steps, and the pre-clip gradient norm of each step. `pipelined`:
/// every call is submitted before any is waited on (calls on one group run in submission order).
fn train(g: &WorkerGroup, steps: usize, pipelined: bool) -> (Vec<f64>, Vec<f64>) {
    let adam = AdamParams { learning_rate: 1e-2, ..Default::default() };
    let mut norms = vec![];
    let mut pending = vec![];
    for _ in 0..steps {
        let fb = g.submit_forward_backward(&batch(), Some(&ce()), false);
        if pipelined {
            pending.push((fb, g.submit_optim_step(adam)));
        } else {
            fb.wait().unwrap();
            norms.push(g.submit_optim_step(adam).wait().unwrap());
        }
    }
    for (fb, step) in pending {
        fb.wait().unwrap();
        norms.push(step.wait().unwrap());
    }
    (params_of(g), norms)
}

#[test]
fn parameters_after_three_steps_do_not_depend_on_dp_or_micro_batch_size() {
    let (reference, ref_norms) = train(&group(MeshShape::dp(1), None), 3, false);
    let initial = params_of(&group(MeshShape::dp(1), None));
    assert!(rel(&reference, &initial) > 1e-3, "training moved nothing");
    for dp in [1usize, 2, 4] {
        for micro_batch in [Some(1), Some(2), None] {
            let g = group(MeshShape::dp(dp), micro_batch);
            let (got, norms) = train(&g, 3, true);
            let err = rel(&got, &reference);
            assert!(err < 1e-5, "dp {dp} micro-batch {micro_batch:?}: parameters differ by {err} relative");
            // AdamW is blind to a gradient's scale; the norm is not (SUM, not mean, over ranks).
            for (a, b) in norms.iter().zip(&ref_norms) {
                assert!((a - b).abs() < 1e-5 * b, "dp {dp} micro-batch {micro_batch:?}: grad norm {a} vs {b}");
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
    let single = group(MeshShape::dp(1), None);
    let want = single.submit_forward_backward(&batch(), Some(&ce()), true).wait().unwrap();
    assert_eq!(want.loss_fn_outputs.len(), 5);
    for (d, o) in batch().iter().zip(&want.loss_fn_outputs) {
        assert_eq!(o.logprobs.len(), d.input_tokens.len());
    }
    let g = group(MeshShape::dp(4), Some(1));
    let direct = g.submit_forward_backward(&batch(), Some(&ce()), true).wait().unwrap();
    g.stage(&[batch()[..3].to_vec(), batch()]).wait().unwrap();
    let staged = g.submit_forward_backward_staged(1, &ce(), true).wait().unwrap();
    assert_eq!(direct.loss_fn_outputs.len(), 5);
    assert_eq!(staged.loss_fn_outputs, direct.loss_fn_outputs, "staged and direct differ");
    assert_eq!(staged.metrics.reduce(), direct.metrics.reduce());
    for (a, b) in direct.loss_fn_outputs.iter().zip(&want.loss_fn_outputs) {
        assert_eq!(a.logprobs.len(), b.logprobs.len());
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-5);
        }
    }
    let small = g.submit_forward_backward_staged(0, &ce(), true).wait().unwrap();
    assert_eq!(small.loss_fn_outputs.len(), 3);
    let err = g.submit_forward_backward_staged(2, &ce(), true).wait().unwrap_err().to_string();
    assert!(err.contains("index 2") && err.contains("out of range"), "{err}");
}

#[test]
fn tensor_parallel_replicas_are_collected_once() {
    let single = group(MeshShape::dp(1), None);
    let one = single.submit_forward_backward(&batch(), Some(&ce()), true).wait().unwrap().metrics.reduce();
    let g = group(MeshShape { dp: 2, tp: 2, sp: 1, pp: 1 }, None);
    let out = g.submit_forward_backward(&batch(), Some(&ce()), true).wait().unwrap();
    let m = out.metrics.reduce();
    assert_eq!(out.loss_fn_outputs.len(), 5);
    assert!((m["loss:sum"] - one["loss:sum"]).abs() < 1e-6, "{} vs {}", m["loss:sum"], one["loss:sum"]);
    assert_eq!(m["ntokens:sum"], one["ntokens:sum"]);
    // Each chunk really ran on both tp replicas: all four ranks hold gradients.
    let has_grads = g.inspect(|w| w.gradients().iter().all(|(_, gr)| gr.is_some())).unwrap();
    assert_eq!(has_grads, vec![true; 4]);
    // The all-reduce runs per tp index: after a step all four replicas agree with dp = 1.
    let adam = AdamParams { learning_rate: 1e-2, ..Default::default() };
    g.submit_optim_step(adam).wait().unwrap();
    single.submit_optim_step(adam).wait().unwrap();
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

/// The parts of model `id` resident on each rank, as its workers see them: the model unless
/// offloaded; the optimizer when the first parameter's moments are on the device (models that
/// have taken a step).
fn resident(d: &Dispatch, id: &str) -> Vec<Parts> {
    d.model(id)
        .unwrap()
        .inspect(|w| Parts { model: !w.is_offloaded(), optimizer: w.moments(&w.params()[0].0).is_some() })
        .unwrap()
}

#[test]
fn colocated_models_offload_and_backload_bit_exactly() {
    let d = Dispatch::new(true);
    d.create_model("policy", &spec(2)).unwrap();
    let adam = AdamParams { learning_rate: 1e-2, ..Default::default() };
    d.forward_backward("policy", &batch(), Some(&ce()), false).unwrap();
    d.optim_step("policy", &adam).unwrap();
    let snapshot = |d: &Dispatch| {
        d.model("policy")
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
    assert_eq!(resident(&d, "policy"), vec![Parts::ALL; 2]);
    // A reference model joins: the policy is offloaded entirely.
    d.create_model("ref", &spec(1)).unwrap();
    assert_eq!(resident(&d, "policy"), vec![Parts::NONE; 2], "moments and parameters left the device");
    d.forward("ref", &batch(), None, true).unwrap();
    // The policy's forward brings back its model only; the step brings the optimizer.
    d.forward("policy", &batch(), None, true).unwrap();
    assert_eq!(resident(&d, "policy"), vec![Parts::MODEL; 2]);
    assert!(resident(&d, "ref").iter().all(|p| !p.model), "the reference stayed on the device");
    d.forward_backward("policy", &batch(), Some(&ce()), false).unwrap();
    assert_eq!(resident(&d, "policy"), vec![Parts::ALL; 2]);
    let after = snapshot(&d);
    assert_eq!(before, after, "offload + backload changed parameters or moments");
    assert_eq!(d.batch_multiple(), 2);
    // Dropping the reference forgets it; the policy carries on.
    d.drop_model("ref").unwrap();
    assert_eq!(d.ids(), vec!["policy".to_string()]);
    d.forward("policy", &batch(), None, false).unwrap();
    assert_eq!(resident(&d, "policy"), vec![Parts::ALL; 2]);
}

#[test]
fn bad_calls_are_clear_errors() {
    let d = Dispatch::new(false);
    let err = d.forward("critic", &batch(), None, true).unwrap_err().to_string();
    assert!(err.contains("critic") && err.contains("no model"), "{err}");
    d.create_model("policy", &spec(2)).unwrap();
    let err = d.forward_backward("policy", &[], Some(&ce()), true).unwrap_err().to_string();
    assert!(err.contains("empty batch"), "{err}");
    let err = oxrl::algo::Loss::parse("nope", &json!({})).unwrap_err().to_string();
    assert!(err.contains("nope"), "{err}");
    let err = d.forward_backward("policy", &batch(), None, true).unwrap_err().to_string();
    assert!(err.contains("needs a loss"), "{err}");
    assert!(d.create_model("policy", &spec(1)).unwrap_err().to_string().contains("already"));
    let err = d.submit_forward_backward_staged("policy", 0, &ce(), true).wait().unwrap_err().to_string();
    assert!(err.contains("out of range"), "{err}");
    let err = d.drop_model("ref").unwrap_err().to_string();
    assert!(err.contains("ref") && err.contains("policy"), "{err}");
    // A model directory that does not exist is reported, and no model is added.
    let missing = WorkerSpec::new(fixture_dir("no-such-arch"));
    assert!(d.create_model("critic", &missing).is_err());
    assert_eq!(d.ids(), vec!["policy".to_string()]);
    // A failing builder is reported, not a hang.
    let failing: BuildWorker = Arc::new(|_| Err(oxrl::Error::input("no such model")));
    let err = WorkerGroup::new("critic", MeshShape::dp(2), 1, failing).err().unwrap().to_string();
    assert!(err.contains("no such model"), "{err}");
}
