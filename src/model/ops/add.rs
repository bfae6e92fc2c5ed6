//! Adds with candle's bits and without its overheads on CUDA: two tensors of one shape
//! ([`add`]: the residual sums, and the gradients candle's backward adds up, through
//! [`gradient_add`]) and a bias added to every row ([`bias_add`]: y [..., n] + b [n]).
//!
//! candle's CUDA add copies the operands' dims and strides to the device at every call (a
//! host-to-device copy beside the launch) and moves one element a thread; a broadcast add walks
//! those strides for every element. On CUDA with oxrl's kernels on, for contiguous operands of
//! one dtype, the adds are `cuda/add.cu`'s kernels instead (the elementwise one four elements a
//! load): the same sums, rounded once, so the same bits. Elsewhere they are candle's. Their
//! backward is what candle's is: the gradient passes to both operands; a bias's is the
//! gradient summed over the rows by candle's `sum_keepdim`, as its broadcast's backward does.

use candle_core::{CustomOp2, Tensor};
#[cfg(feature = "cuda")]
use candle_core::{Layout, Shape};

use super::custom_op::{cpu_refused, grad_for};
use super::fused;
use crate::Result;

/// Whether the kernels serve a and b: on CUDA with oxrl's kernels on, one dtype, both contiguous.
fn served(a: &Tensor, b: &Tensor) -> bool {
    a.device().is_cuda() && fused(a) && b.dtype() == a.dtype() && a.is_contiguous() && b.is_contiguous()
}

/// a + b, of one shape.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !(served(a, b) && a.dims() == b.dims() && a.elem_count() > 0) {
        return Ok((a + b)?);
    }
    Ok(match a.track_op() || b.track_op() {
        true => a.apply_op2(b, Add)?,
        false => a.apply_op2_no_bwd(b, &Add)?,
    })
}

/// candle's backward's sum of two gradients of one tensor (`candle_core::backprop::
/// set_gradient_add`): [`add`] where the kernels serve, None (candle's add) elsewhere.
pub fn gradient_add(sum: &Tensor, grad: &Tensor) -> Option<candle_core::Result<Tensor>> {
    if !(served(sum, grad) && sum.dims() == grad.dims() && sum.elem_count() > 0) {
        return None;
    }
    Some(sum.apply_op2_no_bwd(grad, &Add))
}

/// y [..., n] + b [n].
pub fn bias_add(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    let n = y.dims().last().copied().unwrap_or(0);
    if !(served(y, b) && b.dims() == [n] && n > 0) {
        return Ok(y.broadcast_add(b)?);
    }
    Ok(match y.track_op() || b.track_op() {
        true => y.apply_op2(b, BiasAdd)?,
        false => y.apply_op2_no_bwd(b, &BiasAdd)?,
    })
}

/// The elementwise kernel (use [`add`]).
struct Add;

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "add"
    }

    cpu_refused!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::cuda_backend::CudaStorage,
        l: &Layout,
        bs: &candle_core::cuda_backend::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use super::cuda::{self, launch};
        let total = l.shape().elem_count();
        if bl.shape().elem_count() != total {
            return Err(candle_core::Error::Msg(format!("add: shapes {:?} and {:?}", l.dims(), bl.dims())));
        }
        let ti = total as i64;
        cuda::dispatch_cuda!(s, T => {
            let a = cuda::view::<T>(s, l)?;
            let b = cuda::view::<T>(bs, bl)?;
            let out = cuda::output::<T>(s, total)?;
            launch!(s.device, cuda::ADD, cuda::entry::<T>("add"), cuda::elementwise(total.div_ceil(4)); &a, &b, &out, &ti);
            Ok((cuda::storage(s, out), l.shape().clone()))
        })
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((grad_for(a, grad.clone()), grad_for(b, grad.clone())))
    }
}

/// The bias kernel (use [`bias_add`]).
struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias-add"
    }

    cpu_refused!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::cuda_backend::CudaStorage,
        l: &Layout,
        bs: &candle_core::cuda_backend::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use super::cuda::{self, launch};
        let total = l.shape().elem_count();
        let n = bl.shape().elem_count();
        let [ti, ni] = [total, n].map(|v| v as i64);
        cuda::dispatch_cuda!(s, T => {
            let x = cuda::view::<T>(s, l)?;
            let b = cuda::view::<T>(bs, bl)?;
            let out = cuda::output::<T>(s, total)?;
            launch!(s.device, cuda::ADD, cuda::entry::<T>("bias_add"), cuda::elementwise(total); &x, &b, &out, &ti, &ni);
            Ok((cuda::storage(s, out), l.shape().clone()))
        })
    }

    /// As candle's broadcast add: y's gradient is the output's; b's is it summed over every
    /// leading dimension (its broadcast's backward: `sum_keepdim` of those dims).
    fn bwd(
        &self,
        y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let leading: Vec<usize> = (0..grad.rank() - 1).collect();
        let db = grad.sum_keepdim(leading)?.reshape(b.shape())?;
        Ok((grad_for(y, grad.clone()), grad_for(b, db)))
    }
}
