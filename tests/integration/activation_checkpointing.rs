//! Activation checkpointing (the tape keeps each layer's input and recomputes the layer in the
//! backward) against keeping every activation: the same bits, for every fixture family (Llama
//! with tied embeddings, Qwen2 with q/k/v biases, Qwen3 with head norms), full fine-tuning and
//! LoRA on every projection including lm_head, in f32, f64 and bf16; on the tape itself (both
//! cuts, with and without entropies) and through a worker's forward_backward + AdamW steps with
//! micro-batches. Candle's graph (the path off the tape, a GPU's) checkpointed by
//! `GraphCheckpoint`, run on the CPU: the bits of its backward of the whole graph.

use crate::common;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use common::*;
use oxrl::model::lora::LoraConfig;
use oxrl::model::tape::{Keep, Tape};
use oxrl::model::Transformer;
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

fn bits(t: &Tensor) -> Vec<u64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// The tape's gradients by parameter id, in the order it produced them.
fn taped_bits(taped: &[(Tensor, Tensor)]) -> Vec<(candle_core::TensorId, Vec<u64>)> {
    taped.iter().map(|(p, g)| (p.id(), bits(g))).collect()
}

/// What one recorded forward and its backward give: the output's bits and the gradients'.
type Run = (Vec<u64>, Vec<(candle_core::TensorId, Vec<u64>)>, Vec<Option<Vec<u64>>>);

/// One forward keeping `keep`, cut at the hidden states (`head` false) or at the log-probs with
/// the entropies, a fixed linear loss on the cut, and the backward.
fn run(arch: &str, m: &Transformer, vars: &[(String, Var)], keep: Keep, head: bool) -> Run {
    let b = Golden::load(arch).batch();
    let (rows, targets) = real_rows(&Golden::load(arch).batch());
    let (rows, targets) = (rows.as_slice(), targets.as_slice());
    let mut tape = Tape::forward_keeping(m, &b.ids, &b.positions, &b.mask, keep).unwrap();
    let (out, store): (Tensor, GradStore) = if head {
        let (lp, h) = tape.logprobs_and_entropy(rows, targets).unwrap();
        let w = Tensor::from_vec(values(lp.elem_count(), 5), lp.shape(), &Device::Cpu).unwrap().to_dtype(lp.dtype());
        let loss =
            ((&lp * w.as_ref().unwrap()).unwrap().sum_all().unwrap() + (&h * 0.3).unwrap().sum_all().unwrap()).unwrap();
        (lp, loss.backward().unwrap())
    } else {
        let hidden = tape.hidden().unwrap();
        let w = Tensor::from_vec(values(hidden.elem_count(), 3), hidden.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(hidden.dtype())
            .unwrap();
        let store = (&hidden * &w).unwrap().sum_all().unwrap().backward().unwrap();
        (hidden, store)
    };
    let out_bits = bits(&out);
    let taped = tape.backward(&store).unwrap();
    let candle_side = vars.iter().map(|(_, v)| store.get(v.as_tensor()).map(bits)).collect();
    (out_bits, taped_bits(&taped), candle_side)
}

#[test]
fn checkpointed_tape_gradients_are_bit_identical() {
    for arch in ARCHS {
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            for lora_rank in [0, 3] {
                let (m, vars) = trainable(arch, dtype, lora_rank);
                for head in [false, true] {
                    let what = format!("{arch} {dtype:?} lora {lora_rank} head cut {head}");
                    let all = run(arch, &m, &vars, Keep::Everything, head);
                    let ckpt = run(arch, &m, &vars, Keep::LayerInputs, head);
                    assert_eq!(all.0, ckpt.0, "{what}: outputs");
                    assert_eq!(all.1.len(), ckpt.1.len(), "{what}: gradient count");
                    assert!(all.1.len() >= 9, "{what}: only {} gradients", all.1.len());
                    for (i, (a, c)) in all.1.iter().zip(&ckpt.1).enumerate() {
                        assert_eq!(a.0, c.0, "{what}: gradient {i} is of another tensor");
                        assert!(a.1 == c.1, "{what}: gradient {i} differs");
                        assert!(a.1.iter().any(|&x| x != 0), "{what}: gradient {i} is zero");
                    }
                    assert_eq!(all.2, ckpt.2, "{what}: candle's side");
                }
            }
        }
    }
}

/// Activation checkpointing on candle's graph (the path of a model off the tape, a GPU's), run on
/// the CPU: `GraphCheckpoint`'s forward and, after a fixed loss on the head's logits, its
/// backward give every gradient the bits of candle's backward of the whole graph (a tied
/// embedding's included), for the dense families, Qwen3-MoE and Gemma 3,
/// full fine-tuning and LoRA, in f32, f64 and bf16.
#[test]
fn checkpointed_graph_gradients_are_bit_identical() {
    use oxrl::model::graph_checkpoint::GraphCheckpoint;
    for arch in ARCHS.iter().copied().chain(["qwen3_moe", "gemma3"]) {
        let b = Golden::load(arch).batch();
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            for lora_rank in [0, 3] {
                let what = format!("{arch} {dtype:?} lora {lora_rank}");
                let (m, vars) = trainable(arch, dtype, lora_rank);
                let loss = |hidden: &Tensor| {
                    let logits = m.lm_head.forward(hidden).unwrap();
                    let w = Tensor::from_vec(values(logits.elem_count(), 9), logits.shape(), &Device::Cpu).unwrap();
                    let w = w.to_dtype(logits.dtype()).unwrap();
                    (&logits * &w).unwrap().sum_all().unwrap().backward().unwrap()
                };
                let hidden = m.forward_hidden(&b.ids, &b.positions, &b.mask, None).unwrap();
                let store = loss(&hidden);
                let whole: Vec<Option<Vec<u64>>> =
                    vars.iter().map(|(_, v)| store.get(v.as_tensor()).map(bits)).collect();
                let (hidden_ckpt, ckpt) = GraphCheckpoint::forward(&m, &b.ids, &b.positions, &b.mask).unwrap();
                assert!(bits(&hidden) == bits(&hidden_ckpt), "{what}: hidden states");
                let store = loss(&hidden_ckpt);
                let params: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().clone()).collect();
                let parts = ckpt.backward(&store, &params).unwrap();
                let checkpointed: Vec<Option<Vec<u64>>> = vars
                    .iter()
                    .map(|(_, v)| {
                        let mut of_v = parts.iter().filter(|(p, _)| p.id() == v.as_tensor().id());
                        let g = of_v.next().map(|(_, g)| bits(g));
                        assert!(of_v.next().is_none(), "{what}: two gradients of one parameter");
                        g
                    })
                    .collect();
                let reached = whole.iter().flatten().filter(|g| g.iter().any(|&x| x != 0)).count();
                assert!(reached >= 9, "{what}: only {reached} non-zero gradients");
                for (i, ((name, _), (a, c))) in vars.iter().zip(whole.iter().zip(&checkpointed)).enumerate() {
                    assert!(a == c, "{what}: gradient {i} ({name}) differs");
                }
            }
        }
    }
}

/// 4 sequences of 8..20 tokens (ragged, so micro-batches pad).
fn batch() -> Vec<Datum> {
    (0..4)
        .map(|r| {
            let t = 8 + 4 * r;
            let tok = |i: usize| ((r * 977 + i * 131) % 300) as u32;
            Datum::supervised((0..t).map(tok).collect(), (1..=t).map(tok).collect(), vec![0.02; t])
        })
        .collect()
}

fn param_bits(w: &Worker) -> Vec<Vec<u64>> {
    w.params().iter().map(|(_, v)| bits(v.as_tensor())).collect()
}

#[test]
fn worker_with_checkpointing_trains_the_same_bits() {
    let ce = loss("cross_entropy", &json!({}));
    let p = AdamParams { learning_rate: 1e-2, weight_decay: 0.01, ..Default::default() };
    // Every family the tape trains: the dense ones, Qwen3.5's DeltaNet layers, Qwen3-MoE's experts,
    // Gemma 3's sliding windows and sandwich norms.
    for arch in ARCHS.iter().copied().chain(["qwen3_5", "qwen3_moe", "gemma3"]) {
        for lora in [None, Some(LoraConfig::new(4, 8.0, &["all-linear"]))] {
            let trained = |activation_checkpointing: bool| {
                let model = Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap();
                let cfg = WorkerConfig {
                    lora: lora.clone(),
                    seed: 5,
                    micro_batch_size: Some(2),
                    activation_checkpointing,
                    ..Default::default()
                };
                let mut w = Worker::new(model, cfg).unwrap();
                let mut metrics = vec![];
                for _ in 0..3 {
                    let out = w.forward_backward(&batch(), Some(&ce), true).unwrap();
                    let norm = w.optim_step(&p).unwrap();
                    let lp: Vec<u32> =
                        out.loss_fn_outputs.iter().flat_map(|o| o.logprobs.iter().map(|x| x.to_bits())).collect();
                    metrics.push((out.metrics.value("loss:sum").unwrap().to_bits(), norm.to_bits(), lp));
                }
                (metrics, param_bits(&w))
            };
            let what = format!("{arch} lora {}", lora.is_some());
            let (m_all, p_all) = trained(false);
            let (m_ckpt, p_ckpt) = trained(true);
            assert_eq!(m_all, m_ckpt, "{what}: losses, grad norms, log-probs");
            assert!(p_all == p_ckpt, "{what}: parameters after 3 steps");
        }
    }
}

/// A head whose logits take several chunks (a 40,000-token vocabulary, tied, over 1,800 rows):
/// checkpointed, the worker recomputes them chunk by chunk in the backward, and every gradient is
/// the bits of keeping them.
#[test]
fn a_head_of_several_chunks_recomputes_its_logits_to_the_same_bits() {
    use oxrl::model::model_config::{Arch, ModelShape};
    let dir = tempfile::tempdir().unwrap();
    let vocab = 40_000;
    let shape = ModelShape {
        vocab_size: vocab,
        hidden_size: 16,
        intermediate_size: 32,
        num_layers: 1,
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 16,
        rope_theta: 1e4,
        max_position_embeddings: 512,
        tie_word_embeddings: true,
    };
    oxrl::model::init::write_random_model(dir.path(), Arch::Qwen3, &shape, 5, DType::F32).unwrap();
    let batch: Vec<Datum> = (0..4)
        .map(|k| {
            let t: Vec<u32> = (0..=450).map(|j| ((k * 7919 + j * 104_729) % vocab) as u32).collect();
            Datum::supervised(t[..450].to_vec(), t[1..].to_vec(), vec![1.0; 450])
        })
        .collect();
    assert!(1800 * vocab > 2 * oxrl::model::tape::CHUNK_LOGITS, "the head must take several chunks");
    let loss = loss("cross_entropy", &json!({}));
    let gradients = |activation_checkpointing: bool| -> Vec<(String, Vec<u64>)> {
        let model = Transformer::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
        let config = WorkerConfig { activation_checkpointing, ..Default::default() };
        let mut w = Worker::new(model, config).unwrap();
        w.forward_backward(&batch, Some(&loss), false).unwrap();
        w.gradients().into_iter().map(|(n, g)| (n.to_string(), bits(g.expect("every weight trains")))).collect()
    };
    let kept = gradients(false);
    assert!(kept.iter().any(|(n, g)| n == "model.embed_tokens.weight" && g.iter().any(|&b| b != 0)));
    assert_eq!(gradients(true), kept, "recomputing the head's logits changed a gradient");
}
