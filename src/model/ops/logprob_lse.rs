//! Fused log-softmax + gather of the target token: `(log p(y), logsumexp(z))` per row of logits.
//!
//! Forward, per row z of length V with target y: m = max z, lse = m + ln Σ exp(z − m),
//! log p(y) = z_y − lse; the output is [..., 2] = (log p(y), lse). No [.., V] tensor is kept:
//! the backward recomputes p = exp(z − lse) from the logits and the saved lse, and writes
//! dz = p · (g_lse − g_lp) + g_lp · onehot(y) in one pass. (The primitive graph kept the shifted
//! logits and their exponentials, [.., V] each, plus a zero-filled buffer and an add per node in
//! the backward.)

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::CudaStorage;
use candle_core::WithDType as _;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, D};

use super::{data, dispatch_real, fused, par_rows, Real};
use crate::model::logprobs::logsumexp_keepdim;
use crate::{Error, Result};

struct LogprobLse;

/// (log p(y), logsumexp) of one row of logits.
pub(crate) fn row_forward<T: Real>(row: &[T], y: u32) -> (T, T) {
    let m = row.iter().fold(T::neg_infinity(), |a, &b| a.fmax(b));
    let lse = T::sum_exp(row, m).ln() + m;
    (row[y as usize] - lse, lse)
}

/// The row's logit gradient for the output gradients (g_lp, g_lse), in place of the logits z:
/// dz = p · (g_lse − g_lp) + g_lp · onehot(y), p = exp(z − lse).
pub(crate) fn row_backward<T: Real>(z: &mut [T], y: u32, lse: T, g_lp: T, g_lse: T) {
    for x in z.iter_mut() {
        *x -= lse;
    }
    T::exp_in_place(z);
    let c = g_lse - g_lp;
    for x in z.iter_mut() {
        *x *= c;
    }
    z[y as usize] += g_lp;
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

impl CustomOp2 for LogprobLse {
    fn name(&self) -> &'static str {
        "logprob-lse"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = *l1.dims().last().expect("logits have a vocabulary dimension");
        let y = data::<u32>(s2, l2)?;
        let mut dims = l2.dims().to_vec();
        dims.push(2);
        dispatch_real!(s1, T => {
            let out = forward_kernel::<T>(data::<T>(s1, l1)?, y, v)?;
            Ok((T::to_cpu_storage_owned(out), Shape::from(dims)))
        })
    }

    /// A block per row. A target outside the vocabulary gives NaN here (checking on the host
    /// would wait for the device); the worker checks every batch's targets before it runs.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        use super::cuda::{self, dispatch_cuda, launch};
        let v = *l1.dims().last().expect("logits have a vocabulary dimension");
        let mut dims = l2.dims().to_vec();
        dims.push(2);
        let y = cuda::view::<u32>(s2, l2)?;
        dispatch_cuda!(s1, T => {
            let z = cuda::view::<T>(s1, l1)?;
            let out = cuda::output::<T>(s1, 2 * y.len())?;
            let vi = v as i64;
            launch!(s1.device, cuda::LOGPROB_LSE, cuda::entry::<T>("logprob_lse"), cuda::per_row(y.len()); &z, &y, &out, &vi);
            Ok((cuda::storage(s1, out), Shape::from(dims)))
        })
    }

    fn bwd(
        &self,
        z: &Tensor,
        y: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let res = res.contiguous()?;
        let g = g.contiguous()?;
        let dz = z.apply_op3_no_bwd(y, &Tensor::cat(&[&res, &g], candle_core::D::Minus1)?, &LogprobLseBwd)?;
        Ok((Some(dz), None))
    }
}

/// dz from (z, y, [res | g]) with res = (lp, lse) and g = (g_lp, g_lse): [..., 4].
struct LogprobLseBwd;

impl candle_core::CustomOp3 for LogprobLseBwd {
    fn name(&self) -> &'static str {
        "logprob-lse-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = *l1.dims().last().expect("logits have a vocabulary dimension");
        let y = data::<u32>(s2, l2)?;
        dispatch_real!(s1, T => {
            let z = data::<T>(s1, l1)?;
            let rg = data::<T>(s3, l3)?;
            let mut dz = vec![T::of(0.0); z.len()];
            par_rows(&mut dz, v, |i, out| {
                let (lse, g_lp, g_lse) = (rg[4 * i + 1], rg[4 * i + 2], rg[4 * i + 3]);
                out.copy_from_slice(&z[i * v..(i + 1) * v]);
                row_backward(out, y[i], lse, g_lp, g_lse);
            });
            Ok((T::to_cpu_storage_owned(dz), l1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        use super::cuda::{self, dispatch_cuda, launch};
        let v = *l1.dims().last().expect("logits have a vocabulary dimension");
        let y = cuda::view::<u32>(s2, l2)?;
        dispatch_cuda!(s1, T => {
            let (z, rg) = (cuda::view::<T>(s1, l1)?, cuda::view::<T>(s3, l3)?);
            let dz = cuda::output::<T>(s1, z.len())?;
            let vi = v as i64;
            launch!(s1.device, cuda::LOGPROB_LSE, cuda::entry::<T>("logprob_lse_bwd"), cuda::per_row(y.len());
                &z, &y, &rg, &dz, &vi);
            Ok((cuda::storage(s1, dz), l1.shape().clone()))
        })
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
    let out = logits.contiguous()?.apply_op2(&targets.contiguous()?, LogprobLse)?;
    Ok((out.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?, out.narrow(D::Minus1, 1, 1)?))
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
