//! Qwen3-MoE (8 experts, top-2 renormalised) against transformers 5.24 in float64
//! (tests/fixtures/hf-2026/qwen3_moe): log-probs and last logits, the tape's gradients (the
//! router's included) and loss, the router's gradient against finite differences, one AdamW
//! step, PEFT LoRA log-probs, greedy tokens; the routing's tie rule and the config's refusals.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::golden_checks::{golden_logprobs, grad_of, tape_loss_and_gradients};
use common::*;
use oxrl::model::lora;
use oxrl::model::tape::Tape;
use oxrl::model::Transformer;

const ARCH: &str = "qwen3_moe";

fn load() -> Transformer {
    Transformer::load(&fixture_dir(ARCH), DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn qwen3_moe_logprobs_and_last_logits_match_transformers() {
    let g = Golden::load(ARCH);
    let b = g.batch();
    let m = load();
    let err = max_abs_diff(&golden_logprobs(&m, &b), g.get("target_logprobs"));
    assert!(err < 1e-4, "target log-probs differ by {err}");
    let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
    let t = logits.dim(1).unwrap();
    let last = logits.narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap();
    let err = max_abs_diff(&last, g.get("logits_last"));
    assert!(err < 1e-4, "last logits differ by {err}");
}

/// The tape's loss and gradients against the fixture's (the router's, q_proj, the final norm
/// and lm_head within 1e-4 relative), and the f32 tape against the f64 one on every parameter.
#[test]
fn qwen3_moe_tape_gradients_match_transformers() {
    let g = Golden::load(ARCH);
    let (loss, grads) = tape_loss_and_gradients(ARCH, DType::F32);
    let golden_loss = g.get("loss").to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0];
    assert!((loss - golden_loss).abs() < 1e-4 * golden_loss.abs().max(1.0), "loss {loss} vs {golden_loss}");
    let mut checked = 0;
    for (name, want) in &g.tensors {
        let Some(param) = name.strip_prefix("grad.") else { continue };
        let err = rel_err(grad_of(&grads, param), want);
        assert!(err < 1e-4, "gradient of {param} off by {err} relative");
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} gradients checked");
    let router = grad_of(&grads, "model.layers.1.mlp.gate.weight");
    assert!(router.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "no router gradient");
    let (_, grads64) = tape_loss_and_gradients(ARCH, DType::F64);
    for (name, g) in &grads {
        let err = rel_err(g, grad_of(&grads64, name));
        let zero = grad_of(&grads64, name).abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap() == 0.0;
        assert!(err < 1e-4 || zero, "{name}: f32 gradient off the f64 one by {err} relative");
    }
}

/// The f64 tape's gradients of a router and of experts' weights against central finite
/// differences of its loss (the step is small enough that no token changes its experts).
#[test]
fn qwen3_moe_router_and_expert_gradients_match_finite_differences() {
    let b = Golden::load(ARCH).batch();
    let (rows, targets) = real_rows(&b);
    let t = b.ids[0].len();
    let w: Vec<f64> = rows.iter().map(|&i| b.weights[i as usize / t][i as usize % t] as f64).collect();
    let w = Tensor::new(w, &Device::Cpu).unwrap();
    let loss_of = |m: &Transformer| -> f64 {
        let mut tape = Tape::forward(m, &b.ids, &b.positions, &b.mask, false).unwrap();
        let lp = tape.logprobs(&rows, &targets).unwrap();
        (&lp * &w).unwrap().neg().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
    };
    let base = Transformer::load(&fixture_dir(ARCH), DType::F64, &Device::Cpu).unwrap();
    let (_, grads) = tape_loss_and_gradients(ARCH, DType::F64);
    let params = base.named_params();
    for (name, index) in [
        ("model.layers.0.mlp.gate.weight", 3),
        ("model.layers.0.mlp.gate.weight", 200),
        ("model.layers.1.mlp.gate.weight", 77),
        ("model.layers.1.mlp.gate.weight", 500),
        ("model.layers.0.mlp.experts.3.up_proj.weight", 40),
        ("model.layers.1.mlp.experts.5.down_proj.weight", 9),
        ("model.layers.1.mlp.experts.0.gate_proj.weight", 100),
    ] {
        let v0 = params.iter().find(|(n, _)| n == name).unwrap().1.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let eps = 1e-5;
        let at = |e: f64| {
            let mut m = base.clone();
            m.visit_params_mut(&mut |n, x| {
                if n == name {
                    let mut v = v0.clone();
                    v[index] += e;
                    *x = Tensor::from_vec(v, x.shape(), &Device::Cpu).unwrap();
                }
                Ok(())
            })
            .unwrap();
            loss_of(&m)
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * eps);
        let got = grad_of(&grads, name).flatten_all().unwrap().to_vec1::<f64>().unwrap()[index];
        let scale = grad_of(&grads, name).abs().unwrap().max_keepdim(0).unwrap();
        let scale = scale.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
        assert!((got - fd).abs() < 1e-6 * scale.max(1e-3), "{name}[{index}]: tape {got}, finite differences {fd}");
    }
}

/// PEFT's adapter (q_proj, v_proj) gives PEFT's log-probs, on the engine's
/// forward and on the tape.
#[test]
fn qwen3_moe_lora_adapter_logprobs_match_peft() {
    let g = Golden::load(ARCH);
    let b = g.batch();
    let mut m = load();
    lora::load_peft(&mut m, &fixture_dir(ARCH).join("lora"), false).unwrap();
    let err = max_abs_diff(&golden_logprobs(&m, &b), g.get("lora.target_logprobs"));
    assert!(err < 1e-4, "LoRA log-probs differ from PEFT by {err}");
    let moved = max_abs_diff(&golden_logprobs(&load(), &b), g.get("lora.target_logprobs"));
    assert!(moved > 1e-2, "the adapter changes nothing ({moved})");
    // PEFT takes the MLP names for the experts, which oxrl does not adapt: refused by name.
    let cfg = lora::LoraConfig::new(4, 8.0, &["q_proj", "up_proj"]);
    let err = lora::attach_new(&mut load(), &cfg, 1).unwrap_err().to_string();
    assert!(err.contains("`up_proj`") && err.contains("experts"), "{err}");
}

/// The engine's greedy decode (prefill, then the KV cache and the experts one token at a time)
/// gives transformers' 12 greedy tokens, in the core and on the engine
/// thread.
#[test]
fn qwen3_moe_greedy_tokens_equal_transformers() {
    golden_checks::assert_greedy_tokens(ARCH, load);
}

/// The worker's cross-entropy step on the golden rows, in f64: transformers' loss and per-token
/// log-probs, then one AdamW step to the fixture's weights (1e-5). The first AdamW step moves a
/// weight by lr·g/(|g| + eps): for gradients near eps it amplifies any noise, hence f64.
#[test]
fn qwen3_moe_worker_adamw_step_reproduces_transformers() {
    let checked = golden_checks::assert_adamw_step(ARCH, |_, _| None);
    assert!(checked >= 4, "only {checked} parameters checked");
}

/// Ties go to the lowest expert index, the chosen experts come largest first, and the weights
/// are renormalised (or not).
#[test]
fn qwen3_moe_routing_breaks_ties_by_lowest_index() {
    use oxrl::model::moe::route;
    // Experts 1, 2 and 3 tie for the top probability.
    let logits = [0.0f64, 2.0, 2.0, 2.0, 1.0];
    let r = route(&logits, 5, 2, true);
    assert_eq!(r.experts, vec![1, 2]);
    assert!((r.weights[0] - 0.5).abs() < 1e-15 && (r.weights[1] - 0.5).abs() < 1e-15);
    let r = route(&[3.0f64, 0.0, 5.0, 1.0], 4, 3, false);
    assert_eq!(r.experts, vec![2, 0, 3]);
    let p: Vec<f64> = [3.0f64, 0.0, 5.0, 1.0].iter().map(|x| x.exp()).collect();
    let total: f64 = p.iter().sum();
    assert!((r.weights[0] - p[2] / total).abs() < 1e-15, "unnormalised weight {}", r.weights[0]);
    assert_eq!(r.sorted_experts(), vec![vec![0, 2, 3]]);
}

/// A config the experts cannot follow is an error naming the field.
#[test]
fn qwen3_moe_bad_configs_are_refused_by_name() {
    use oxrl::model::ModelConfig;
    let text = std::fs::read_to_string(fixture_dir(ARCH).join("config.json")).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (field, value, says) in [
        ("num_experts_per_tok", serde_json::json!(9), "num_experts_per_tok"),
        ("num_experts_per_tok", serde_json::json!(0), "num_experts_per_tok"),
        ("moe_intermediate_size", serde_json::json!(0), "moe_intermediate_size"),
        ("decoder_sparse_step", serde_json::json!(0), "decoder_sparse_step"),
        ("mlp_only_layers", serde_json::json!("all"), "mlp_only_layers"),
    ] {
        let mut cfg = base.clone();
        cfg[field] = value;
        let err = ModelConfig::from_value(cfg, std::path::Path::new("config.json")).unwrap_err().to_string();
        assert!(err.contains(says), "{field}: {err}");
    }
    // Dense layers where mlp_only_layers says so: their weights are mlp.{gate,up,down}_proj.
    let mut cfg = base.clone();
    cfg["mlp_only_layers"] = serde_json::json!([1]);
    let c = ModelConfig::from_value(cfg, std::path::Path::new("config.json")).unwrap();
    assert!(c.is_sparse(0) && !c.is_sparse(1));
    let err = Transformer::load(&fixture_dir(ARCH), DType::F32, &Device::Cpu).map(|_| ());
    assert!(err.is_ok());
}

/// The load-balancing loss of the golden batch (its padding left out) is transformers'
/// `load_balancing_loss_func` over the rows' router logits (2.008887529373169, computed with
/// float32 counts), and its gradient, added to the loss's with a scale, is the total loss's
/// finite differences (f64 tape).
#[test]
fn qwen3_moe_router_aux_loss_matches_transformers_and_its_gradient() {
    let b = Golden::load(ARCH).batch();
    let m = Transformer::load(&fixture_dir(ARCH), DType::F64, &Device::Cpu).unwrap();
    let tape = Tape::forward(&m, &b.ids, &b.positions, &b.mask, false).unwrap();
    let aux = tape.router_aux_loss().unwrap();
    assert!((aux - 2.008887529373169).abs() < 1e-6, "aux loss {aux}");

    let (rows, targets) = real_rows(&b);
    let t = b.ids[0].len();
    let w: Vec<f64> = rows.iter().map(|&i| b.weights[i as usize / t][i as usize % t] as f64).collect();
    let w = Tensor::new(w, &Device::Cpu).unwrap();
    let scale = 0.5;
    let total = |m: &Transformer| -> f64 {
        let mut tape = Tape::forward(m, &b.ids, &b.positions, &b.mask, false).unwrap();
        let lp = tape.logprobs(&rows, &targets).unwrap();
        let ce = (&lp * &w).unwrap().neg().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        ce + scale * tape.router_aux_loss().unwrap()
    };
    let mut trained = m.clone();
    let vars = trained.make_trainable().unwrap();
    let mut tape = Tape::forward(&trained, &b.ids, &b.positions, &b.mask, true).unwrap();
    tape.set_router_aux_scale(scale);
    let lp = tape.logprobs(&rows, &targets).unwrap();
    let loss = (&lp * &w).unwrap().neg().unwrap().sum_all().unwrap();
    let grads = tape.backward(&loss.backward().unwrap()).unwrap();
    let params = m.named_params();
    for (name, index) in [("model.layers.0.mlp.gate.weight", 5), ("model.layers.1.mlp.gate.weight", 300)] {
        let var = &vars.iter().find(|(n, _)| n == name).unwrap().1;
        let g = grads.iter().find(|(p, _)| p.id() == var.as_tensor().id()).unwrap().1.clone();
        let got = g.flatten_all().unwrap().to_vec1::<f64>().unwrap()[index];
        let v0 = params.iter().find(|(n, _)| n == name).unwrap().1.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let at = |e: f64| {
            let mut p = m.clone();
            p.visit_params_mut(&mut |n, x| {
                if n == name {
                    let mut v = v0.clone();
                    v[index] += e;
                    *x = Tensor::from_vec(v, x.shape(), &Device::Cpu).unwrap();
                }
                Ok(())
            })
            .unwrap();
            total(&p)
        };
        let fd = (at(1e-5) - at(-1e-5)) / 2e-5;
        assert!((got - fd).abs() < 1e-6 * fd.abs().max(1e-2), "{name}[{index}]: tape {got}, finite differences {fd}");
    }
}

/// The worker adds the load-balancing loss when asked (its metric, a different gradient)
/// and refuses the option for a model without experts.
#[test]
fn qwen3_moe_worker_router_aux_loss_option() {
    use oxrl::worker::{Datum, Worker, WorkerConfig};
    let data: Vec<Datum> = (0..3)
        .map(|r| {
            let tok = |i: usize| ((r * 977 + i * 131) % 300) as u32;
            Datum::supervised((0..12).map(tok).collect(), (1..=12).map(tok).collect(), vec![0.1; 12])
        })
        .collect();
    let ce = common::loss("cross_entropy", &serde_json::json!({}));
    // The loss's metric and the gradient norm (only the routers' gradients change).
    let step = |coef: f64| {
        let cfg = WorkerConfig { router_aux_loss_coef: coef, ..Default::default() };
        let mut w = Worker::new(load(), cfg).unwrap();
        let out = w.forward_backward(&data, Some(&ce), false).unwrap();
        let norm = w.optim_step(&oxrl::worker::AdamParams::default()).unwrap();
        (out.metrics.value("router_aux_loss:sum"), out.metrics.value("loss:sum").unwrap(), norm)
    };
    let (none, loss0, norm0) = step(0.0);
    let (aux, loss1, norm1) = step(0.01);
    assert_eq!(none, None);
    assert_eq!(loss0, loss1, "loss:sum is the loss function's alone");
    // coef × aux × Σ weights (3.6), aux between 1 (balanced) × k = 2 and E = 8.
    let aux = aux.unwrap();
    assert!(aux > 0.01 * 3.6 * 1.9 && aux < 0.01 * 3.6 * 8.0, "router_aux_loss:sum {aux}");
    assert!((norm0 - norm1).abs() > 1e-9 * norm0, "the aux loss changed no gradient ({norm0} vs {norm1})");
    let dense = Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu).unwrap();
    let err = Worker::new(dense, WorkerConfig { router_aux_loss_coef: 0.01, ..Default::default() }).err().unwrap();
    assert!(err.to_string().contains("router_aux_loss_coef"), "{err}");
}

/// router_mismatch: 0 on the fixture (the engine's prefill and the tape choose the same
/// experts), and the count takes the weighted tokens whose experts differ in any layer.
#[test]
fn qwen3_moe_router_mismatch_counts_tokens_routed_otherwise() {
    use oxrl::model::moe::{count_mismatches, router_mismatch};
    let b = Golden::load(ARCH).batch();
    let weights: Vec<Vec<f32>> = b.mask.iter().map(|r| r.iter().map(|&m| m as f32).collect()).collect();
    assert_eq!(router_mismatch(&load(), &b.ids, &b.positions, &b.mask, &weights).unwrap(), 0);
    // Two layers over a batch of 2 rows × 2 tokens.
    let same = vec![vec![vec![0, 1], vec![2, 3], vec![1, 4], vec![5, 6]]; 2];
    let mut other = same.clone();
    other[1][1] = vec![2, 7]; // row 0, token 1, second layer
    other[0][3] = vec![0, 6]; // row 1, token 1, first layer
    let all = vec![vec![1.0, 1.0], vec![1.0, 1.0]];
    assert_eq!(count_mismatches(&same, &other, &all, 2).unwrap(), 2);
    assert_eq!(count_mismatches(&same, &other, &[vec![1.0, 0.0], vec![1.0, 1.0]], 2).unwrap(), 1);
    assert_eq!(count_mismatches(&same, &same, &all, 2).unwrap(), 0);
    assert!(count_mismatches(&same, &same[..1], &all, 2).is_err());
}
