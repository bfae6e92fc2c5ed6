//! A bias added to every row: y [..., n] + b [n], the values of candle's `broadcast_add`.
//!
//! On CUDA candle's broadcast add copies the operands' dims and strides to the device at every
//! call (a host-to-device copy beside the launch), which a decode step paid three times a layer
//! (Qwen2's q, k and v biases). Where nothing is differentiated, on CUDA with oxrl's kernels on,
//! the add is `cuda/bias_add.cu`'s kernel instead, which takes the row length as an argument;
//! elsewhere it is candle's.

use candle_core::{CustomOp2, Tensor};
#[cfg(feature = "cuda")]
use candle_core::{Layout, Shape};

use super::custom_op::cpu_refused;
use super::fused;
use crate::Result;

/// y [..., n] + b [n].
pub fn bias_add(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    let n = y.dims().last().copied().unwrap_or(0);
    let served = y.device().is_cuda()
        && fused(y)
        && !y.track_op()
        && !b.track_op()
        && b.dtype() == y.dtype()
        && b.dims() == [n]
        && n > 0
        && y.is_contiguous()
        && b.is_contiguous();
    if !served {
        return Ok(y.broadcast_add(b)?);
    }
    Ok(y.apply_op2_no_bwd(b, &BiasAdd)?)
}

/// The CUDA kernel (use [`bias_add`]).
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
            launch!(s.device, cuda::BIAS_ADD, cuda::entry::<T>("bias_add"), cuda::elementwise(total); &x, &b, &out, &ti, &ni);
            Ok((cuda::storage(s, out), l.shape().clone()))
        })
    }
}
