//! Fused GELU-tanh gate: y = gelu_tanh(g) · u, Gemma's MLP activation (`gelu_pytorch_tanh`).
//!
//! gelu_tanh(x) = ½·x·(1 + tanh(z)), z = √(2/π)·(x + 0.044715·x³), computed as x·σ(2z)
//! (the same function: 1 + tanh(z) = 2·σ(2z)) with σ(w) = 1 − 1/(1 + exp(w)), which stays
//! finite at both ends (exp overflowing to ∞ gives 1, underflowing to 0 gives 0).
//! Backward, with s = σ(2z):
//!   dg = dy · u · (s + x·s·(1 − s)·2√(2/π)·(1 + 3·0.044715·x²)),   du = dy · x · s.
//! The tape and the candle op call the same slice functions, so training and decoding share bits.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{Shape, Tensor};

#[cfg(feature = "cuda")]
use super::cuda;
#[cfg(feature = "cuda")]
use super::custom_op::Cuda;
use super::custom_op::{grad_for, Cpu, FusedOp, Op};
use super::{fused, Real};
use crate::{Error, Result};

/// Elements per rayon task.
const CHUNK: usize = 16_384;

/// √(2/π), as PyTorch spells it (M_SQRT2 · M_2_SQRTPI · ½).
const BETA: f64 = std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5;
const KAPPA: f64 = 0.044715;

/// s ← σ(2z(x)) for x as long as s.
fn gate_sigmoid<T: Real>(s: &mut [T], x: &[T]) {
    let (two_beta, kappa) = (T::of(2.0 * BETA), T::of(KAPPA));
    for (o, &v) in s.iter_mut().zip(x) {
        *o = two_beta * (v + kappa * v * v * v);
    }
    T::exp_in_place(s);
    for o in s.iter_mut() {
        *o = T::of(1.0) - T::of(1.0) / (T::of(1.0) + *o);
    }
}

/// y = gelu_tanh(g) · u elementwise, in large chunks over the rayon pool.
pub(crate) fn forward<T: Real>(g: &[T], u: &[T]) -> Vec<T> {
    use rayon::prelude::*;
    let mut y = vec![T::of(0.0); g.len()];
    y.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let (g, u) = (&g[c * CHUNK..][..out.len()], &u[c * CHUNK..][..out.len()]);
        gate_sigmoid(out, g);
        for ((o, &x), &v) in out.iter_mut().zip(g).zip(u) {
            *o = x * *o * v;
        }
    });
    y
}

/// The backward of [`forward`] for the output gradient dy: writes dg and du.
pub(crate) fn backward<T: Real>(g: &[T], u: &[T], dy: &[T], dg: &mut [T], du: &mut [T]) {
    use rayon::prelude::*;
    let (two_beta, three_kappa) = (T::of(2.0 * BETA), T::of(3.0 * KAPPA));
    dg.par_chunks_mut(CHUNK).zip(du.par_chunks_mut(CHUNK)).enumerate().for_each(|(c, (dg, du))| {
        let (g, u, dy) = (&g[c * CHUNK..], &u[c * CHUNK..], &dy[c * CHUNK..]);
        gate_sigmoid(du, &g[..du.len()]);
        for i in 0..dg.len() {
            let (s, x) = (du[i], g[i]);
            let slope = s + x * s * (T::of(1.0) - s) * two_beta * (T::of(1.0) + three_kappa * x * x);
            dg[i] = dy[i] * u[i] * slope;
            du[i] = dy[i] * x * s;
        }
    });
}

struct GeluTanhMul;

impl FusedOp<2> for GeluTanhMul {
    fn name(&self) -> &'static str {
        "gelu-tanh-mul"
    }

    fn cpu<T: Real>(&self, [g, u]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        Ok((forward(g.data::<T>()?, u.data::<T>()?), g.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, _: [Cuda<'_>; 2]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        Err(candle_core::Error::Msg("gelu-tanh-mul: CPU only (the reference graph runs on GPUs)".into()))
    }

    fn bwd(&self, [g, u]: [&Tensor; 2], _res: &Tensor, dy: &Tensor) -> candle_core::Result<[Option<Tensor>; 2]> {
        let n = g.elem_count();
        let both = g.apply_op3_no_bwd(u, &dy.contiguous()?, &Op(GeluTanhMulBwd))?;
        let dg = both.narrow(0, 0, n)?.reshape(g.shape())?;
        let du = both.narrow(0, n, n)?.reshape(u.shape())?;
        Ok([grad_for(g, dg), grad_for(u, du)])
    }
}

/// [dg | du] flat from (g, u, dy).
struct GeluTanhMulBwd;

impl FusedOp<3> for GeluTanhMulBwd {
    fn name(&self) -> &'static str {
        "gelu-tanh-mul-bwd"
    }

    fn cpu<T: Real>(&self, [g, u, dy]: [Cpu<'_>; 3]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (g, u, dy) = (g.data::<T>()?, u.data::<T>()?, dy.data::<T>()?);
        let n = g.len();
        let mut out = vec![T::of(0.0); 2 * n];
        let (dg, du) = out.split_at_mut(n);
        backward(g, u, dy, dg, du);
        Ok((out, Shape::from(2 * n)))
    }
}

/// gelu_tanh(gate) · up, for gate and up of one shape: fused on the CPU in f32/f64, the
/// primitive graph elsewhere.
pub fn gelu_tanh_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        return Err(Error::input(format!("gelu_tanh_mul: gate {:?} and up {:?} differ", gate.dims(), up.dims())));
    }
    if !gate.device().is_cpu() || !fused(gate) || gate.dtype() != up.dtype() {
        return reference(gate, up);
    }
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, Op(GeluTanhMul))?)
}

/// The primitive graph: candle's tanh-approximated GELU, then the product.
pub fn reference(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok((gate.gelu()? * up)?)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, var};
    use super::*;
    use candle_core::DType;

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
        // candle's GELU backward rounds its constants (gradients 4e-7 off in f64): 1e-6 there.
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-6)] {
            let g = var(&[3, 7001], 1, 6.0, dtype);
            let u = var(&[3, 7001], 2, 2.0, dtype);
            let (gt, ut) = (g.as_tensor(), u.as_tensor());
            check(
                &[g.clone(), u.clone()],
                || gelu_tanh_mul(gt, ut).unwrap(),
                || reference(gt, ut).unwrap(),
                tol,
                &format!("{dtype:?}"),
            );
        }
    }

    #[test]
    fn backward_equals_finite_differences_in_f64() {
        let g: Vec<f64> = (0..200).map(|i| (i as f64 - 100.0) * 0.061).collect();
        let u: Vec<f64> = (0..200).map(|i| ((i as f64) * 0.37).cos()).collect();
        let dy: Vec<f64> = (0..200).map(|i| ((i as f64) * 0.11).sin()).collect();
        let (mut dg, mut du) = (vec![0.0; 200], vec![0.0; 200]);
        backward(&g, &u, &dy, &mut dg, &mut du);
        let eps = 1e-6;
        for i in 0..200 {
            let at = |x: f64| forward(&[x], &[u[i]])[0] * dy[i];
            let fd = (at(g[i] + eps) - at(g[i] - eps)) / (2.0 * eps);
            assert!((dg[i] - fd).abs() < 1e-8, "dg[{i}] = {} vs {fd}", dg[i]);
            assert!((du[i] - forward(&[g[i]], &[dy[i]])[0]).abs() < 1e-14, "du[{i}]");
        }
    }

    #[test]
    fn finite_at_the_extremes() {
        let g = [1e30f32, -1e30, 100.0, -100.0, 0.0];
        let y = forward(&g, &[1.0; 5]);
        assert_eq!(y, vec![1e30, -0.0, 100.0, -0.0, 0.0]);
    }
}
