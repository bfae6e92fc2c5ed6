//! Fused log-softmax + gather of the target token: `(log p(y), logsumexp(z))` per row of logits.
//!
//! Forward, per row z of length V with target y: m = max z, lse = m + ln Σ exp(z − m),
//! log p(y) = z_y − lse; the output is [..., 2] = (log p(y), lse). No [.., V] tensor is kept:
//! the backward recomputes p = exp(z − lse) from the logits and the saved lse, and writes
//! dz = p · (g_lse − g_lp) + g_lp · onehot(y) in one pass. (The primitive graph kept the shifted
//! logits and their exponentials, [.., V] each, plus a zero-filled buffer and an add per node in
//! the backward.)

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{Shape, Tensor, D};

#[cfg(feature = "cuda")]
use super::cuda::{self, launch};
use super::custom_op::cpu_refused;
#[cfg(feature = "cuda")]
use super::custom_op::Cuda;
use super::custom_op::{Cpu, FusedOp, Op};
use super::{fused, par_rows, Real};
use crate::{Error, Result};

struct LogprobLse;

/// (log p(y), logsumexp) of one row of logits.
pub(crate) fn row_forward<T: Real>(row: &[T], y: u32) -> (T, T) {
    let lse = row_lse(row);
    (row[y as usize] - lse, lse)
}

/// logsumexp of one row of logits, as [`row_forward`] computes it: log p(v) = row[v] − this is
/// the bits of `row_forward(row, v).0` for every v.
pub(crate) fn row_lse<T: Real>(row: &[T]) -> T {
    // The maximum in 16 lanes (the sequential fold's value; a zero maximum's sign cannot reach
    // lse = ln Σ + m, as ln Σ ≥ +0).
    let m = super::max(row);
    T::sum_exp(row, m).ln() + m
}

/// The row's logit gradient for the output gradients (g_lp, g_lse), in place of the logits z:
/// dz = p · (g_lse − g_lp) + g_lp · onehot(y), p = exp(z − lse).
pub(crate) fn row_backward<T: Real>(z: &mut [T], y: u32, lse: T, g_lp: T, g_lse: T) {
    part_backward(z, Some(y as usize), lse, g_lp, g_lse);
}

/// [`row_backward`] on a part of the row (columns of the vocabulary), `y` the target's column
/// within it when it falls there: each element's gradient reads only its own logit.
pub(crate) fn part_backward<T: Real>(z: &mut [T], y: Option<usize>, lse: T, g_lp: T, g_lse: T) {
    for x in z.iter_mut() {
        *x -= lse;
    }
    T::exp_in_place(z);
    let c = g_lse - g_lp;
    for x in z.iter_mut() {
        *x *= c;
    }
    if let Some(y) = y {
        z[y] += g_lp;
    }
}

fn forward_kernel<T: Real>(z: &[T], y: &[u32], v: usize) -> candle_core::Result<Vec<T>> {
    if let Some(bad) = y.iter().find(|&&t| t as usize >= v) {
        return Err(candle_core::Error::Msg(format!("target id {bad} is out of range for vocabulary {v}")));
    }
    let mut out = vec![T::of(0.0); 2 * y.len()];
    par_rows(&mut out, 2, |i, o| {
        let row = &z[i * v..(i + 1) * v];
        (o[0], o[1]) = row_forward(row, y[i]);
    });
    Ok(out)
}

impl FusedOp<2> for LogprobLse {
    fn name(&self) -> &'static str {
        "logprob-lse"
    }

    fn cpu<T: Real>(&self, [z, y]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        let v = *z.dims().last().expect("logits have a vocabulary dimension");
        let mut dims = y.dims().to_vec();
        dims.push(2);
        Ok((forward_kernel::<T>(z.data::<T>()?, y.data::<u32>()?, v)?, Shape::from(dims)))
    }

    /// A block per row. A target outside the vocabulary gives NaN here (checking on the host
    /// would wait for the device); the worker checks every batch's targets before it runs.
    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [zs, ys]: [Cuda<'_>; 2]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let v = *zs.dims().last().expect("logits have a vocabulary dimension");
        let mut dims = ys.dims().to_vec();
        dims.push(2);
        let (z, y) = (zs.view::<T>()?, ys.view::<u32>()?);
        let out = cuda::output::<T>(zs.storage, 2 * y.len())?;
        let vi = v as i64;
        launch!(zs.storage.device, cuda::LOGPROB_LSE, cuda::entry::<T>("logprob_lse"), cuda::per_row(y.len()); &z, &y, &out, &vi);
        Ok((out, Shape::from(dims)))
    }

    fn bwd(&self, [z, y]: [&Tensor; 2], res: &Tensor, g: &Tensor) -> candle_core::Result<[Option<Tensor>; 2]> {
        let res = res.contiguous()?;
        let g = g.contiguous()?;
        Ok([Some(backward(z, y, &Tensor::cat(&[&res, &g], D::Minus1)?)?), None])
    }
}

/// The op's backward: dz from the logits `z`, the targets and `rg` = [(lp, lse) | (g_lp, g_lse)]
/// [..., 4], all of z's dtype.
pub(crate) fn backward(z: &Tensor, targets: &Tensor, rg: &Tensor) -> candle_core::Result<Tensor> {
    z.apply_op3_no_bwd(targets, rg, &Op(LogprobLseBwd))
}

/// dz from (z, y, [res | g]) with res = (lp, lse) and g = (g_lp, g_lse): [..., 4].
struct LogprobLseBwd;

impl FusedOp<3> for LogprobLseBwd {
    fn name(&self) -> &'static str {
        "logprob-lse-bwd"
    }

    fn cpu<T: Real>(&self, [zs, y, rg]: [Cpu<'_>; 3]) -> candle_core::Result<(Vec<T>, Shape)> {
        let v = *zs.dims().last().expect("logits have a vocabulary dimension");
        let y = y.data::<u32>()?;
        let (z, rg) = (zs.data::<T>()?, rg.data::<T>()?);
        let mut dz = vec![T::of(0.0); z.len()];
        par_rows(&mut dz, v, |i, out| {
            let (lse, g_lp, g_lse) = (rg[4 * i + 1], rg[4 * i + 2], rg[4 * i + 3]);
            out.copy_from_slice(&z[i * v..(i + 1) * v]);
            row_backward(out, y[i], lse, g_lp, g_lse);
        });
        Ok((dz, zs.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [zs, ys, rgs]: [Cuda<'_>; 3]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let v = *zs.dims().last().expect("logits have a vocabulary dimension");
        let y = ys.view::<u32>()?;
        let (z, rg) = (zs.view::<T>()?, rgs.view::<T>()?);
        let dz = cuda::output::<T>(zs.storage, z.len())?;
        let vi = v as i64;
        launch!(zs.storage.device, cuda::LOGPROB_LSE, cuda::entry::<T>("logprob_lse_bwd"), cuda::per_row(y.len());
            &z, &y, &rg, &dz, &vi);
        Ok((dz, zs.shape().clone()))
    }
}

/// `(log p(targets), logsumexp)`: logits [..., V] (fused where [`fused`] says), targets u32 [...]; log-probs of
/// the shape of `targets`, the normaliser as [..., 1].
pub fn forward(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    if !fused(logits) {
        return reference(logits, targets);
    }
    if targets.dims() != &logits.dims()[..logits.rank() - 1] {
        return Err(Error::input(format!("targets {:?} do not match logits {:?}", targets.dims(), logits.dims())));
    }
    let out = logits.contiguous()?.apply_op2(&targets.contiguous()?, Op(LogprobLse))?;
    Ok((out.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?, out.narrow(D::Minus1, 1, 1)?))
}

/// The op's output [..., 2] = (log p(y), lse) without a graph node, for ops that run the
/// backward themselves (with [`backward`]): f32/f64 logits on the CPU, CUDA's of every dtype.
pub(crate) fn forward_no_grad(z: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(z.contiguous()?.apply_op2_no_bwd(&targets.contiguous()?, &Op(LogprobLse))?)
}

/// The op's output [..., 2] = (log p(y), lse) in f32 from bf16/f16 logits `z` [..., V] times
/// `scale` (1 / temperature): the f32 op's values on the logits cast to f32 and scaled, without
/// the cast's pass (CUDA's mixed kernel; no gradient: for ops that run the backward themselves,
/// with [`backward_mixed`]).
pub(crate) fn forward_mixed(z: &Tensor, targets: &Tensor, scale: f32) -> Result<Tensor> {
    Ok(z.contiguous()?.apply_op2_no_bwd(&targets.contiguous()?, &Mixed { rg: None, scale })?)
}

/// The op's backward from bf16/f16 logits `z` and `rg` = [(lp, lse) | (g_lp, g_lse)] [..., 4] in
/// f32: dz in z's dtype, the f32 op's values rounded once (CUDA's mixed kernel); with a
/// `scale`, the gradient of [`forward_mixed`]'s scaled logits times the scale.
pub(crate) fn backward_mixed(z: &Tensor, targets: &Tensor, rg: &Tensor, scale: f32) -> Result<Tensor> {
    Ok(z.contiguous()?.apply_op2_no_bwd(&targets.contiguous()?, &Mixed { rg: Some(rg.contiguous()?), scale })?)
}

/// The mixed-dtype kernels: the forward, or (with `rg`) the backward, on the logits times
/// `scale`. CUDA only: the CPU computes in f32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Mixed {
    rg: Option<Tensor>,
    scale: f32,
}

impl candle_core::CustomOp2 for Mixed {
    fn name(&self) -> &'static str {
        "logprob-lse-mixed"
    }

    cpu_refused!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        zs: &candle_core::cuda_backend::CudaStorage,
        zl: &candle_core::Layout,
        ys: &candle_core::cuda_backend::CudaStorage,
        yl: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use candle_core::cuda_backend::CudaStorage;
        let v = *zl.dims().last().expect("logits have a vocabulary dimension");
        let y = cuda::view::<u32>(ys, yl)?;
        let rows = y.len();
        let vi = v as i64;
        let dev = zs.device.clone();
        match &self.rg {
            None => {
                let mut dims = yl.dims().to_vec();
                dims.push(2);
                let out = cuda::output::<f32>(zs, 2 * rows)?;
                cuda::dispatch_cuda!(zs, T => {
                    let z = cuda::view::<T>(zs, zl)?;
                    launch!(dev, cuda::LOGPROB_LSE, cuda::entry::<T>("logprob_lse_mixed"), cuda::per_row(rows);
                        &z, &y, &out, &vi, &self.scale);
                    Ok::<(), candle_core::Error>(())
                })?;
                Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(dims)))
            }
            Some(rg) => {
                let (rg_storage, rg_layout) = rg.storage_and_layout();
                let rgv = cuda::view::<f32>(cuda::held(&rg_storage, "logprob-lse-mixed", "rg")?, rg_layout)?;
                cuda::dispatch_cuda!(zs, T => {
                    let z = cuda::view::<T>(zs, zl)?;
                    let dz = cuda::output::<T>(zs, z.len())?;
                    launch!(dev, cuda::LOGPROB_LSE, cuda::entry::<T>("logprob_lse_bwd_mixed"), cuda::per_row(rows);
                        &z, &y, &rgv, &dz, &vi, &self.scale);
                    Ok((CudaStorage::wrap_cuda_slice(dz, dev.clone()), zl.shape().clone()))
                })
            }
        }
    }
}

/// logsumexp over the last dimension, keeping it (shape [..., 1]); the max is subtracted first
/// (detached: it cancels in the value and its gradient).
pub fn logsumexp_keepdim(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    Ok((logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + max)?)
}

/// The primitive graph: logsumexp with the max subtracted, gather, subtract.
pub fn reference(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let logits = logits.contiguous()?;
    let lse = logsumexp_keepdim(&logits)?;
    let picked = logits.gather(&targets.contiguous()?.unsqueeze(D::Minus1)?, D::Minus1)?;
    Ok(((picked - &lse)?.squeeze(D::Minus1)?, lse))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, var};
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            let z = var(&[3, 5, 97], 1, 8.0, dtype);
            let ids: Vec<u32> = (0..15).map(|i| (i * 37 % 97) as u32).collect();
            let y = Tensor::from_vec(ids, (3, 5), &Device::Cpu).unwrap();
            // Both outputs carry a gradient (the entropy uses the normaliser).
            let both = |f: fn(&Tensor, &Tensor) -> Result<(Tensor, Tensor)>| {
                let (lp, lse) = f(z.as_tensor(), &y).unwrap();
                Tensor::cat(&[lp.unsqueeze(D::Minus1).unwrap(), lse], D::Minus1).unwrap()
            };
            check(std::slice::from_ref(&z), || both(forward), || both(reference), tol, &format!("{dtype:?}"));
        }
    }

    #[test]
    fn out_of_range_target_is_an_error() {
        let z = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let y = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
        assert!(forward(&z, &y).is_err());
    }
}
