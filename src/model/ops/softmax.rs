//! Fused attention softmax: p = softmax(scale · s + bias) over the last dimension.
//!
//! s are raw scores [B, G, T, S] (G = every query head, grouped or not), bias an additive mask
//! [B, T, S] shared by the heads (0 or a large negative number). Forward: one pass per row
//! (max, exp, normalise). The backward uses the saved p: ds = scale · p · (g − Σ g·p), one pass
//! (the mixed-dtype kernels compute p again instead, from the scores and each row's max and sum).
//! The primitive graph took six nodes (scale, add bias, max, subtract, exp, sum, divide), each a
//! [B, G, T, S] buffer, and twice as many in the backward.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{Shape, Tensor, D};

#[cfg(feature = "cuda")]
use super::cuda::{self, launch};
use super::custom_op::cpu_refused;
#[cfg(feature = "cuda")]
use super::custom_op::Cuda;
use super::custom_op::{Cpu, FusedOp, Op};
use super::node_output::SideOutput;
use super::{dot, fused, max, par_rows, Real};
use crate::{Error, Result};

struct MaskedSoftmax {
    scale: f64,
}

/// out = softmax(scale · x + bias) for one row: [`shifted_row`], exp, [`normalise_row`].
/// Inlined, so that it is compiled with the caller's target features (the cached attention's
/// AVX-512 kernel); the same operations in the same order everywhere, so the same numbers.
#[inline(always)]
pub(crate) fn forward_row<T: Real>(out: &mut [T], x: &[T], bias: &[T], scale: f64) {
    shifted_row(out, x, bias, scale);
    T::exp_in_place(out);
    normalise_row(out);
}

/// out = scale · x + bias − max(scale · x + bias): the first step of [`forward_row`] (a caller
/// with several rows at hand can exponentiate them in one call, then normalise each).
#[inline(always)]
pub(crate) fn shifted_row<T: Real>(out: &mut [T], x: &[T], bias: &[T], scale: f64) {
    let scale = T::of(scale);
    for ((o, &v), &c) in out.iter_mut().zip(x).zip(bias) {
        *o = v * scale + c;
    }
    let m = max(out);
    for o in out.iter_mut() {
        *o -= m;
    }
}

/// out /= Σ out: the last step of [`forward_row`]. The sum runs left to right, one add per key:
/// masked keys (exactly 0) change nothing wherever they sit, so a query's probabilities do not
/// depend on how much padding or how many future keys its row carries (a decode step over the
/// cache and the trainer's whole causal row give the same bits).
#[inline(always)]
pub(crate) fn normalise_row<T: Real>(out: &mut [T]) {
    normalise_rows::<T, 1>(out, out.len());
}

/// [`normalise_row`] for the N rows of `out` (each `s` long), their sums side by side (N
/// independent chains of adds instead of one).
#[inline(always)]
pub(crate) fn normalise_rows<T: Real, const N: usize>(out: &mut [T], s: usize) {
    if s == 0 {
        return;
    }
    let mut total = [T::of(0.0); N];
    for j in 0..s {
        for (r, t) in total.iter_mut().enumerate() {
            *t += out[r * s + j];
        }
    }
    for (row, t) in out.chunks_exact_mut(s).zip(total) {
        let inv = T::of(1.0) / t;
        for o in row.iter_mut() {
            *o *= inv;
        }
    }
}

/// out = scale · p · (g − Σ g·p): the gradient of the row's scores from the saved p and the
/// output gradient g.
pub(crate) fn backward_row<T: Real>(out: &mut [T], p: &[T], g: &[T], scale: f64) {
    let scale = T::of(scale);
    let dot = dot(p, g);
    for ((o, &a), &b) in out.iter_mut().zip(p).zip(g) {
        *o = scale * a * (b - dot);
    }
}

impl FusedOp<2> for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu<T: Real>(&self, [x, bias]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (_, g, t, s) = x.shape().dims4()?;
        let shape = x.shape().clone();
        let (x, bias) = (x.data::<T>()?, bias.data::<T>()?);
        let mut p = vec![T::of(0.0); x.len()];
        par_rows(&mut p, s, |r, out| {
            // Row r is query (r mod t) of head ((r / t) mod g) of batch row r / (g·t).
            let (bi, ti) = (r / (g * t), r % t);
            let bias = &bias[(bi * t + ti) * s..(bi * t + ti + 1) * s];
            forward_row(out, &x[r * s..(r + 1) * s], bias, self.scale);
        });
        Ok((p, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [xs, biass]: [Cuda<'_>; 2]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let (b, g, t, s) = xs.shape().dims4()?;
        let (x, bias) = (xs.view::<T>()?, biass.view::<T>()?);
        let p = cuda::output::<T>(xs.storage, x.len())?;
        let [ri, gi, ti, si] = [b * g * t, g, t, s].map(|v| v as i64);
        let scale = self.scale as f32;
        launch!(xs.storage.device, cuda::SOFTMAX, cuda::entry::<T>("masked_softmax"), cuda::per_warp_row(b * g * t);
            &x, &bias, &p, &ri, &gi, &ti, &si, &scale);
        Ok((p, xs.shape().clone()))
    }

    fn bwd(&self, _inputs: [&Tensor; 2], p: &Tensor, g: &Tensor) -> candle_core::Result<[Option<Tensor>; 2]> {
        Ok([Some(backward(p, g, self.scale).map_err(|e| candle_core::Error::Msg(e.to_string()))?), None])
    }
}

/// ds = scale · p · (g − Σ g·p) per row, from (p, g).
struct SoftmaxBwd {
    scale: f64,
}

impl FusedOp<2> for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "masked-softmax-bwd"
    }

    fn cpu<T: Real>(&self, [p, g]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        let s = *p.dims().last().expect("softmax has a last dimension");
        let shape = p.shape().clone();
        let (p, g) = (p.data::<T>()?, g.data::<T>()?);
        let mut ds = vec![T::of(0.0); p.len()];
        par_rows(&mut ds, s, |r, out| {
            backward_row(out, &p[r * s..(r + 1) * s], &g[r * s..(r + 1) * s], self.scale);
        });
        Ok((ds, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [ps, gs]: [Cuda<'_>; 2]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let s = *ps.dims().last().expect("softmax has a last dimension");
        let (p, g) = (ps.view::<T>()?, gs.view::<T>()?);
        let ds = cuda::output::<T>(ps.storage, p.len())?;
        let (si, scale) = (s as i64, self.scale as f32);
        let rows = p.len().checked_div(s).unwrap_or(0);
        let ri = rows as i64;
        launch!(ps.storage.device, cuda::SOFTMAX, cuda::entry::<T>("masked_softmax_bwd"), cuda::per_warp_row(rows);
            &p, &g, &ds, &ri, &si, &scale);
        Ok((ds, ps.shape().clone()))
    }
}

/// The scores' gradient ds = scale · p · (g − Σ g·p) per row, from the fused op's output `p`
/// and its gradient `g` (the op's backward, for ops that run it themselves).
pub(crate) fn backward(p: &Tensor, g: &Tensor, scale: f64) -> Result<Tensor> {
    Ok(p.apply_op2_no_bwd(&g.contiguous()?, &Op(SoftmaxBwd { scale }))?)
}

/// [`masked_softmax`] of bf16/f16 `scores` [B, G, T, S] in f32, with an f32 bias [B, T, S]: the
/// f32 op's values on the scores cast to f32, without the cast (CUDA's mixed kernel; no
/// gradient: for ops that run the backward themselves, with [`backward_mixed`]). Returns p
/// rounded to the scores' dtype and each row's (max, 1 / sum) [B·G·T, 2] in f32, from which
/// [`backward_mixed`] computes the f32 p again (the same values): the f32 p is neither written
/// nor kept.
pub(crate) fn masked_softmax_mixed(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<(Tensor, Tensor)> {
    let (b, _, t, s) = scores.dims4()?;
    if bias.dims() != [b, t, s] {
        return Err(Error::input(format!("bias {:?} does not match scores {:?}", bias.dims(), scores.dims())));
    }
    let bias = bias.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let op = MixedForward { scale, stats: Default::default() };
    let p = scores.contiguous()?.apply_op2_no_bwd(&bias, &op)?;
    let stats = op.stats.take("masked-softmax-mixed", (scores.elem_count() / s.max(1), 2))?;
    Ok((p, stats))
}

/// [`backward`] of [`masked_softmax_mixed`] for the scores' gradient-to-be `g` (bf16/f16): ds
/// in g's dtype, the f32 op's values on g cast to f32 rounded once, p computed again from the
/// scores, the bias and the forward's `stats` (CUDA's mixed kernel).
pub(crate) fn backward_mixed(scores: &Tensor, bias: &Tensor, stats: &Tensor, g: &Tensor, scale: f64) -> Result<Tensor> {
    let bias = bias.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let op = MixedBackward { scale, stats: stats.contiguous()? };
    Ok(scores.contiguous()?.apply_op3_no_bwd(&bias, &g.contiguous()?, &op)?)
}

/// The mixed forward kernel (x: bf16/f16 scores, bias f32) → p in x's dtype, the rows' stats
/// its second output. CUDA only: the CPU computes activations in f32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct MixedForward {
    scale: f64,
    stats: SideOutput,
}

impl candle_core::CustomOp2 for MixedForward {
    fn name(&self) -> &'static str {
        "masked-softmax-mixed"
    }

    cpu_refused!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::cuda_backend::CudaStorage,
        xl: &candle_core::Layout,
        b: &candle_core::cuda_backend::CudaStorage,
        bl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use candle_core::cuda_backend::CudaStorage;
        let shape = xl.shape().clone();
        let (_, g, t, s) = shape.dims4()?;
        let n = shape.elem_count();
        let rows = n.checked_div(s).unwrap_or(0);
        let [ri, gi, ti, si] = [rows, g, t, s].map(|v| v as i64);
        let scale = self.scale as f32;
        let bias = cuda::view::<f32>(b, bl)?;
        let stats = cuda::output::<f32>(x, 2 * rows)?;
        let p = cuda::dispatch_cuda!(x, T => {
            let xs = cuda::view::<T>(x, xl)?;
            let px = cuda::output::<T>(x, n)?;
            launch!(x.device, cuda::SOFTMAX, cuda::entry::<T>("masked_softmax_mixed"), cuda::per_warp_row(rows);
                &xs, &bias, &px, &stats, &ri, &gi, &ti, &si, &scale);
            Ok::<CudaStorage, candle_core::Error>(cuda::storage(x, px))
        })?;
        self.stats.put(CudaStorage::wrap_cuda_slice(stats, x.device.clone()));
        Ok((p, shape))
    }
}

/// The mixed backward kernel: (scores, bias, g) with the forward's row stats → ds of g's dtype.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct MixedBackward {
    scale: f64,
    stats: Tensor,
}

impl candle_core::CustomOp3 for MixedBackward {
    fn name(&self) -> &'static str {
        "masked-softmax-mixed-backward"
    }

    cpu_refused!(3);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::cuda_backend::CudaStorage,
        xl: &candle_core::Layout,
        b: &candle_core::cuda_backend::CudaStorage,
        bl: &candle_core::Layout,
        gs: &candle_core::cuda_backend::CudaStorage,
        gl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        let shape = xl.shape().clone();
        let (_, heads, t, s) = shape.dims4()?;
        let n = shape.elem_count();
        let rows = n.checked_div(s).unwrap_or(0);
        if gl.shape() != xl.shape() || self.stats.dims() != [rows, 2] {
            return Err(candle_core::Error::Msg(format!(
                "masked-softmax-mixed backward: scores {:?}, gradient {:?}, stats {:?}",
                xl.dims(),
                gl.dims(),
                self.stats.dims()
            )));
        }
        let [ri, hi, ti, si] = [rows, heads, t, s].map(|v| v as i64);
        let scale = self.scale as f32;
        let bias = cuda::view::<f32>(b, bl)?;
        let (stats_storage, stats_layout) = self.stats.storage_and_layout();
        let stats_storage = cuda::held(&stats_storage, "masked-softmax-mixed backward", "stats")?;
        let stats = cuda::view::<f32>(stats_storage, stats_layout)?;
        cuda::dispatch_cuda!(x, T => {
            let xs = cuda::view::<T>(x, xl)?;
            let g = cuda::view::<T>(gs, gl)?;
            let ds = cuda::output::<T>(x, n)?;
            launch!(x.device, cuda::SOFTMAX, cuda::entry::<T>("masked_softmax_bwd_mixed"), cuda::per_warp_row(rows);
                &xs, &bias, &stats, &g, &ds, &ri, &hi, &ti, &si, &scale);
            Ok((cuda::storage(x, ds), shape.clone()))
        })
    }
}

/// softmax(scale · scores + bias) for scores [B, G, T, S] and bias [B, T, S] (any float dtype:
/// it is converted to the scores' dtype).
pub fn masked_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, _, t, s) = scores.dims4()?;
    if bias.dims() != [b, t, s] {
        return Err(Error::input(format!("bias {:?} does not match scores {:?}", bias.dims(), scores.dims())));
    }
    let bias = bias.to_dtype(scores.dtype())?;
    if !fused(scores) {
        return reference(scores, &bias, scale);
    }
    Ok(scores.contiguous()?.apply_op2(&bias.contiguous()?, Op(MaskedSoftmax { scale }))?)
}

/// The primitive graph: scale, add the bias broadcast over heads, softmax with the max
/// subtracted (detached: it cancels).
pub fn reference(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let x = (scores * scale)?.broadcast_add(&bias.unsqueeze(1)?)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, var};
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            let s = var(&[2, 3, 5, 9], 1, 4.0, dtype);
            // A causal mask with a padded first key in row 1.
            let mut bias = vec![0f32; 2 * 5 * 9];
            for b in 0..2 {
                for i in 0..5 {
                    for j in 0..9 {
                        if j > i + 4 || (b == 1 && j == 0) {
                            bias[(b * 5 + i) * 9 + j] = -1e30;
                        }
                    }
                }
            }
            let bias = Tensor::from_vec(bias, (2, 5, 9), &Device::Cpu).unwrap();
            let st = s.as_tensor();
            check(
                std::slice::from_ref(&s),
                || masked_softmax(st, &bias, 0.125).unwrap(),
                || reference(st, &bias.to_dtype(dtype).unwrap(), 0.125).unwrap(),
                tol,
                &format!("{dtype:?}"),
            );
        }
    }

    #[test]
    fn rows_of_no_keys_are_not_a_panic() {
        let s = Tensor::zeros((1, 2, 3, 0), DType::F32, &Device::Cpu).unwrap();
        let bias = Tensor::zeros((1, 3, 0), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(masked_softmax(&s, &bias, 1.0).unwrap().dims(), [1, 2, 3, 0]);
    }
}
