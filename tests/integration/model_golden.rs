//! The model against Hugging Face transformers: log-probs, logits, gradients, greedy tokens.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::{logprobs::target_logprobs, Transformer};

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn target_logprobs_and_last_logits_match_transformers() {
    for arch in ARCHS {
        let g = Golden::load(arch);
        let b = g.batch();
        let m = load(arch);
        let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
        let targets = Tensor::new(b.targets.concat(), &Device::Cpu).unwrap().reshape((3, ())).unwrap();
        let lp = target_logprobs(&logits, &targets).unwrap();
        let err = max_abs_diff(&masked(&lp, &b.valid), g.get("target_logprobs"));
        assert!(err < 1e-4, "{arch}: target log-probs differ by {err}");
        // Left padding: each row's last position is the last column.
        let t = logits.dim(1).unwrap();
        let last = logits.narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap();
        let err = max_abs_diff(&last, g.get("logits_last"));
        assert!(err < 1e-4, "{arch}: last logits differ by {err}");
    }
}

#[test]
fn gradients_of_golden_loss_match_transformers() {
    for arch in ARCHS {
        let g = Golden::load(arch);
        let b = g.batch();
        let mut m = load(arch);
        let vars = m.make_trainable().unwrap();
        let logits = m.forward(&b.ids, &b.positions, &b.mask, None).unwrap();
        let targets = Tensor::new(b.targets.concat(), &Device::Cpu).unwrap().reshape((3, ())).unwrap();
        let lp = target_logprobs(&logits, &targets).unwrap();
        let w = Tensor::new(b.weights.concat(), &Device::Cpu).unwrap().reshape((3, ())).unwrap();
        let loss = (lp * w).unwrap().neg().unwrap().sum_all().unwrap();
        let golden_loss = g.get("loss").to_vec1::<f32>().unwrap()[0];
        let got = loss.to_scalar::<f32>().unwrap();
        assert!((got - golden_loss).abs() < 1e-4 * golden_loss.abs().max(1.0), "{arch}: loss {got} vs {golden_loss}");
        let grads = loss.backward().unwrap();
        let mut checked = 0;
        for (name, t) in &g.tensors {
            let Some(param) = name.strip_prefix("grad.") else { continue };
            let var = &vars.iter().find(|(n, _)| n == param).unwrap_or_else(|| panic!("{arch}: no param {param}")).1;
            let grad = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{arch}: no gradient for {param}"));
            let err = rel_err(grad, t);
            assert!(err < 1e-4, "{arch}: gradient of {param} off by {err} relative");
            checked += 1;
        }
        assert!(checked >= 4, "{arch}: only {checked} gradients checked");
        // Every parameter receives a gradient.
        for (name, var) in &vars {
            assert!(grads.get(var.as_tensor()).is_some(), "{arch}: {name} got no gradient");
        }
    }
}
