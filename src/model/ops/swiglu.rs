//! Fused SwiGLU: y = silu(g) · u = g · σ(g) · u, the gated MLP activation.
//!
//! One pass forward. The backward recomputes σ(g) and writes both input gradients in one pass:
//!   dg = dy · u · σ(g) · (1 + g · (1 − σ(g))),   du = dy · g · σ(g)
//! (into one [2, N] buffer whose halves are returned as views). The primitive graph kept silu(g)
//! and built silu's derivative from five elementwise nodes.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{Shape, Tensor};

#[cfg(feature = "cuda")]
use super::cuda::{self, launch};
#[cfg(feature = "cuda")]
use super::custom_op::Cuda;
use super::custom_op::{grad_for, Cpu, FusedOp, Op};
use super::exp::exp_f32;
use super::{fused, Real};
use crate::{Error, Result};

/// Rows per rayon task: elementwise work is cheap, so tasks are large.
const CHUNK: usize = 16_384;

/// out = σ(x) = 1 / (1 + exp(−x)) for x as long as out.
fn sigmoid_into<T: Real>(out: &mut [T], x: &[T]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = T::of(0.0) - v;
    }
    T::exp_in_place(out);
    for o in out.iter_mut() {
        *o = T::of(1.0) / (T::of(1.0) + *o);
    }
}

/// out ← silu(g) · u = σ(g) · (g · u), σ as [`sigmoid_into`] computes it: the generic form
/// (f64, and f32 on CPUs without AVX2).
pub(crate) fn silu_mul_plain<T: Real>(out: &mut [T], g: &[T], u: &[T]) {
    sigmoid_into(out, g);
    for ((o, &a), &b) in out.iter_mut().zip(g).zip(u) {
        *o *= a * b;
    }
}

/// `silu_mul_plain` for f32 in one vectorised pass, with the same operations in the same
/// order (so the same bits): 1 / (1 + exp(0 − g)), times g · u. The separate passes ran their
/// arithmetic at the baseline's 4 lanes (their share of a decode run: BENCHMARKS.md).
pub fn silu_mul_f32(out: &mut [f32], g: &[f32], u: &[f32]) {
    assert!(g.len() == out.len() && u.len() == out.len(), "silu_mul: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: each variant runs only where the CPU has its features.
        if std::arch::is_x86_feature_detected!("avx512f") {
            return unsafe { silu_mul_avx512(out, g, u) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return unsafe { silu_mul_avx2(out, g, u) };
        }
    }
    silu_mul_plain(out, g, u)
}

/// One element of [`silu_mul_loop`] (a function, not a closure: a closure LLVM does not inline
/// is compiled without the caller's target features).
#[inline(always)]
fn silu_mul_one(g: f32, u: f32) -> f32 {
    1.0 / (1.0 + exp_f32(0.0 - g)) * (g * u)
}

#[inline(always)]
#[allow(clippy::needless_range_loop)] // three slices in step, 16 at a time
fn silu_mul_loop(out: &mut [f32], g: &[f32], u: &[f32]) {
    let len = out.len();
    let mut outs = out.chunks_exact_mut(16);
    for ((o, a), b) in (&mut outs).zip(g.chunks_exact(16)).zip(u.chunks_exact(16)) {
        for i in 0..16 {
            o[i] = silu_mul_one(a[i], b[i]);
        }
    }
    let tail = outs.into_remainder().len();
    for i in len - tail..len {
        out[i] = silu_mul_one(g[i], u[i]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(out: &mut [f32], g: &[f32], u: &[f32]) {
    silu_mul_loop(out, g, u)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(out: &mut [f32], g: &[f32], u: &[f32]) {
    silu_mul_loop(out, g, u)
}

/// y = silu(g) · u elementwise, in large chunks over the rayon pool.
pub(crate) fn forward<T: Real>(g: &[T], u: &[T]) -> Vec<T> {
    use rayon::prelude::*;
    let mut y = vec![T::of(0.0); g.len()];
    y.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let (g, u) = (&g[c * CHUNK..][..out.len()], &u[c * CHUNK..][..out.len()]);
        T::silu_mul(out, g, u);
    });
    y
}

/// The backward of [`forward`] for the output gradient dy: writes dg and du.
pub(crate) fn backward<T: Real>(g: &[T], u: &[T], dy: &[T], dg: &mut [T], du: &mut [T]) {
    use rayon::prelude::*;
    dg.par_chunks_mut(CHUNK).zip(du.par_chunks_mut(CHUNK)).enumerate().for_each(|(c, (dg, du))| {
        let (g, u, dy) = (&g[c * CHUNK..], &u[c * CHUNK..], &dy[c * CHUNK..]);
        sigmoid_into(du, g);
        for i in 0..dg.len() {
            let s = du[i];
            dg[i] = dy[i] * u[i] * s * (T::of(1.0) + g[i] * (T::of(1.0) - s));
            du[i] = dy[i] * g[i] * s;
        }
    });
}

struct SwiGlu;

impl FusedOp<2> for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu<T: Real>(&self, [g, u]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        Ok((forward(g.data::<T>()?, u.data::<T>()?), g.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [gs, us]: [Cuda<'_>; 2]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let (g, u) = (gs.view::<T>()?, us.view::<T>()?);
        let n = g.len();
        let y = cuda::output::<T>(gs.storage, n)?;
        let ni = n as i64;
        launch!(gs.storage.device, cuda::SWIGLU, cuda::entry::<T>("swiglu"), cuda::elementwise(n); &g, &u, &y, &ni);
        Ok((y, gs.shape().clone()))
    }

    fn bwd(&self, [g, u]: [&Tensor; 2], _res: &Tensor, dy: &Tensor) -> candle_core::Result<[Option<Tensor>; 2]> {
        let n = g.elem_count();
        let both = g.apply_op3_no_bwd(u, &dy.contiguous()?, &Op(SwiGluBwd))?;
        let dg = both.narrow(0, 0, n)?.reshape(g.shape())?;
        let du = both.narrow(0, n, n)?.reshape(u.shape())?;
        Ok([grad_for(g, dg), grad_for(u, du)])
    }
}

/// [dg | du] flat from (g, u, dy).
struct SwiGluBwd;

impl FusedOp<3> for SwiGluBwd {
    fn name(&self) -> &'static str {
        "swiglu-bwd"
    }

    fn cpu<T: Real>(&self, [g, u, dy]: [Cpu<'_>; 3]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (g, u, dy) = (g.data::<T>()?, u.data::<T>()?, dy.data::<T>()?);
        let n = g.len();
        let mut out = vec![T::of(0.0); 2 * n];
        let (dg, du) = out.split_at_mut(n);
        backward(g, u, dy, dg, du);
        Ok((out, Shape::from(2 * n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [gs, us, dys]: [Cuda<'_>; 3]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let (g, u, dy) = (gs.view::<T>()?, us.view::<T>()?, dys.view::<T>()?);
        let n = g.len();
        let out = cuda::output::<T>(gs.storage, 2 * n)?;
        let ni = n as i64;
        launch!(gs.storage.device, cuda::SWIGLU, cuda::entry::<T>("swiglu_bwd"), cuda::elementwise(n); &g, &u, &dy, &out, &ni);
        Ok((out, Shape::from(2 * n)))
    }
}

/// silu(gate) · up, for gate and up of one shape.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        return Err(Error::input(format!("swiglu: gate {:?} and up {:?} differ", gate.dims(), up.dims())));
    }
    if !fused(gate) || gate.dtype() != up.dtype() {
        return reference(gate, up);
    }
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, Op(SwiGlu))?)
}

/// The primitive graph: silu, then the product.
pub fn reference(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok((gate.silu()? * up)?)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, var};
    use super::*;
    use candle_core::DType;

    #[test]
    fn vectorised_silu_mul_gives_the_generic_bits() {
        // Every length's tail, large and tiny values, signed zeros, infinities and NaN.
        let mut g: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.731).sin() * (1.0 + (i % 97) as f32)).collect();
        g.extend([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 104.0, -104.0, 1e30, -1e30]);
        g.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 3.0]);
        let u: Vec<f32> = (0..g.len()).map(|i| ((i as f32) * 0.37).cos() * 3.0).collect();
        for n in (0..40).chain([g.len() - 14, g.len()]) {
            let (g, u) = (&g[g.len() - n..], &u[u.len() - n..]);
            let (mut fast, mut plain) = (vec![0f32; n], vec![0f32; n]);
            silu_mul_f32(&mut fast, g, u);
            silu_mul_plain(&mut plain, g, u);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&plain), "length {n}");
        }
    }

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            // Longer than one task, so the chunking is exercised.
            let g = var(&[3, 7001], 1, 6.0, dtype);
            let u = var(&[3, 7001], 2, 2.0, dtype);
            let (gt, ut) = (g.as_tensor(), u.as_tensor());
            check(
                &[g.clone(), u.clone()],
                || swiglu(gt, ut).unwrap(),
                || reference(gt, ut).unwrap(),
                tol,
                &format!("{dtype:?}"),
            );
        }
    }
}
