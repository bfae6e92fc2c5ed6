//! AdamW (Loshchilov & Hutter) with bias correction, in PyTorch's order, and global-norm clipping.
//!
//! For each parameter p with gradient g, at its step t (1-based):
//! ```text
//! p ← p · (1 − lr · wd)                         decoupled weight decay
//! m ← β1 m + (1 − β1) g
//! v ← β2 v + (1 − β2) g²
//! p ← p − lr · (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + eps)
//! ```
//! Before the update the gradients may be scaled by `min(1, clip / (‖g‖ + 1e-6))`, ‖g‖ the
//! global L2 norm over all parameters (torch's `clip_grad_norm_`). A parameter that received no
//! gradient since the last step is skipped entirely (no decay, no moment update, its step count
//! unchanged), as torch skips parameters whose `.grad` is None. Moments are kept in f32 (f64 for
//! an f64 model). A bf16/f16 parameter is updated in f32: on its f32 master copy when the worker
//! keeps one (mixed precision, [`super::mixed_precision`]: [`step_value`] on the master, then the
//! parameter is the master rounded), else on its own value, rounded back after every step.

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Hyper-parameters of one step.
///
/// The defaults are the crate's one table of AdamW defaults, Tinker's `AdamParams`:
/// learning rate 1e-4, β1 0.9, β2 0.95, ε 1e-12, no weight decay, no gradient clipping. The SFT
/// config's `[optimizer]` section takes its defaults from here too
/// (`trainer::sections::OptimizerSection`), so a Tinker client that leaves a field out and an
/// `oxrl sft` run that does get the same step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamParams {
    pub learning_rate: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay (0 = off).
    pub weight_decay: f64,
    /// Global gradient-norm clip (0 = off).
    pub grad_clip_norm: f64,
}

impl Default for AdamParams {
    fn default() -> Self {
        AdamParams { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0.0, grad_clip_norm: 0.0 }
    }
}

impl AdamParams {
    pub fn validate(&self) -> Result<()> {
        let all = [self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay, self.grad_clip_norm];
        if all.iter().any(|x| !x.is_finite()) {
            return Err(Error::input(format!("AdamParams must be finite: {self:?}")));
        }
        if self.learning_rate < 0.0 || self.eps < 0.0 || self.weight_decay < 0.0 || self.grad_clip_norm < 0.0 {
            return Err(Error::input(format!(
                "AdamParams: learning_rate, eps, weight_decay, grad_clip_norm must be ≥ 0: {self:?}"
            )));
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return Err(Error::input(format!("AdamParams: beta1 and beta2 must be in [0, 1): {self:?}")));
        }
        Ok(())
    }
}

/// The optimizer state of one parameter.
#[derive(Clone, Debug)]
pub struct Moments {
    /// First moment m.
    pub exp_avg: Tensor,
    /// Second moment v.
    pub exp_avg_sq: Tensor,
    /// Steps applied to this parameter.
    pub step: u64,
}

/// The dtype moments and the update are computed in for parameters of `dtype`.
pub fn state_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl Moments {
    pub fn zeros(param: &Tensor) -> Result<Self> {
        // Two buffers: the fused step updates each moment in place.
        let z = || Tensor::zeros(param.shape(), state_dtype(param.dtype()), param.device());
        Ok(Moments { exp_avg: z()?, exp_avg_sq: z()?, step: 0 })
    }
}

/// Global L2 norm of the gradients, in f64.
pub fn global_norm(grads: &[&Tensor]) -> Result<f64> {
    Ok(norm_of_squares(&square_sums(grads)?))
}

/// Σ g² of each gradient, in f64 (one host transfer for all of them).
pub fn square_sums(grads: &[&Tensor]) -> Result<Vec<f64>> {
    if grads.is_empty() {
        return Ok(vec![]);
    }
    let square_sum = |g: &Tensor| -> Result<Tensor> {
        match super::adamw_fused::sum_squares(g)? {
            Some(s) => Ok(s.reshape(())?),
            None => Ok(g.to_dtype(DType::F64)?.sqr()?.sum_all()?),
        }
    };
    let squares = grads.iter().map(|g| square_sum(g)).collect::<Result<Vec<_>>>()?;
    Ok(Tensor::stack(&squares, 0)?.to_vec1::<f64>()?)
}

/// The L2 norm from the gradients' [`square_sums`], added in parameter order.
pub fn norm_of_squares(squares: &[f64]) -> f64 {
    if squares.is_empty() {
        return 0.0;
    }
    squares.iter().sum::<f64>().sqrt()
}

/// The factor torch's `clip_grad_norm_` multiplies the gradients by.
pub fn clip_coefficient(norm: f64, clip: f64) -> f64 {
    if clip > 0.0 {
        (clip / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

/// One AdamW update of `var` with gradient `grad` (already clipped), computed in the moments'
/// dtype and rounded to the parameter's; advances `state.step`.
pub fn update(var: &Var, grad: &Tensor, state: &mut Moments, p: &AdamParams) -> Result<()> {
    let param = var.as_tensor();
    if super::adamw_fused::applies(param, state) {
        return super::adamw_fused::update(param, grad, 1.0, state, p);
    }
    update_reference(var, grad, state, p)
}

/// The update as candle primitives: other devices and dtypes, and the fused kernel's reference.
pub(crate) fn update_reference(var: &Var, grad: &Tensor, state: &mut Moments, p: &AdamParams) -> Result<()> {
    let param = var.as_tensor();
    let x = param.to_dtype(state.exp_avg.dtype())?;
    var.set(&step_value(&x, grad, state, p)?.to_dtype(param.dtype())?)?;
    Ok(())
}

/// The AdamW update of the value `x` (in the moments' dtype: an f32 master copy, or a
/// parameter already cast) with gradient `grad` (any float dtype, already clipped): returns the
/// new value in the moments' dtype and advances `state.step`.
pub fn step_value(x: &Tensor, grad: &Tensor, state: &mut Moments, p: &AdamParams) -> Result<Tensor> {
    let dtype = state.exp_avg.dtype();
    let g = grad.to_dtype(dtype)?;
    state.step += 1;
    let t = state.step as i32;
    let bias1 = 1.0 - p.beta1.powi(t);
    let bias2 = 1.0 - p.beta2.powi(t);
    let mut x = x.to_dtype(dtype)?;
    if p.weight_decay != 0.0 {
        x = (x * (1.0 - p.learning_rate * p.weight_decay))?;
    }
    state.exp_avg = ((&state.exp_avg * p.beta1)? + (&g * (1.0 - p.beta1))?)?;
    state.exp_avg_sq = ((&state.exp_avg_sq * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
    let denom = ((&state.exp_avg_sq * (1.0 / bias2))?.sqrt()? + p.eps)?;
    let step = ((&state.exp_avg * (p.learning_rate / bias1))? / denom)?;
    Ok((x - step)?)
}
