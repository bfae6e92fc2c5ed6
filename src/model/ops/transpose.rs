//! A matrix's transpose written out: x [..., m, n] → [..., n, m] contiguous, the values of
//! `x.t()?.contiguous()` (a copy: the same bits).
//!
//! The backward of a projection computes dW as (xᵀ · dy)ᵀ, the chain's order, and stores it
//! contiguous. candle's strided copy on CUDA gives each thread one output element, read from
//! the transposed view a row apart from its neighbour's: a memory transaction per element, and
//! the tied LM head's gradient alone is 136 M of them. On CUDA (oxrl's kernels on) the copy is
//! `cuda/transpose.cu`'s tiled kernel instead; elsewhere it is candle's.
//!
//! [`heads_swapped`]: x [A, B, C, D] → [A, C, B, D] contiguous, the values of
//! `x.transpose(1, 2)?.contiguous()` — attention's output and its gradient between the heads'
//! layout [B, H, T, D] and the projections' [B, T, H, D]. candle's strided copy moves an element
//! a thread with the index arithmetic of a strided view; the kernel moves 16 bytes of a D-row a
//! thread, whole memory lines on both sides.

use candle_core::{CustomOp1, Tensor};
#[cfg(feature = "cuda")]
use candle_core::{Layout, Shape};

use super::custom_op::cpu_refused;
use super::fused;
use crate::Result;

/// x [..., m, n] transposed in its last two dimensions, contiguous.
pub fn transposed(x: &Tensor) -> Result<Tensor> {
    if x.rank() < 2 || !x.device().is_cuda() || !fused(x) || x.elem_count() == 0 {
        return Ok(x.t()?.contiguous()?);
    }
    Ok(x.contiguous()?.apply_op1_no_bwd(&Transpose)?)
}

/// x [A, B, C, D] with dimensions 1 and 2 swapped, contiguous.
pub fn heads_swapped(x: &Tensor) -> Result<Tensor> {
    if x.rank() != 4 || !x.device().is_cuda() || !fused(x) || x.elem_count() == 0 {
        return Ok(x.transpose(1, 2)?.contiguous()?);
    }
    Ok(x.contiguous()?.apply_op1_no_bwd(&SwapHeads)?)
}

/// The CUDA kernel (use [`transposed`]).
struct Transpose;

impl CustomOp1 for Transpose {
    fn name(&self) -> &'static str {
        "transpose"
    }

    cpu_refused!(1);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::cuda_backend::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use super::cuda::{self, launch};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let dims = l.dims();
        let (m, n) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let batches = l.shape().elem_count() / (m * n);
        let mut out_dims = dims.to_vec();
        out_dims.swap(dims.len() - 2, dims.len() - 1);
        let (grid_y, grid_z) = (m.div_ceil(32), batches);
        if grid_y > 65_535 || grid_z > 65_535 {
            return Err(candle_core::Error::Msg(format!("transpose: {dims:?} has more tiles than a grid holds")));
        }
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(32) as u32, grid_y as u32, grid_z as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let [mi, ni] = [m, n].map(|v| v as i64);
        cuda::dispatch_cuda!(s, T => {
            let x = cuda::view::<T>(s, l)?;
            let out = cuda::output::<T>(s, x.len())?;
            launch!(s.device, cuda::TRANSPOSE, cuda::entry::<T>("transpose"), cfg; &x, &out, &mi, &ni);
            Ok((cuda::storage(s, out), Shape::from(out_dims)))
        })
    }
}

/// The CUDA kernel (use [`heads_swapped`]).
struct SwapHeads;

impl CustomOp1 for SwapHeads {
    fn name(&self) -> &'static str {
        "swap-heads"
    }

    cpu_refused!(1);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::cuda_backend::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use super::cuda::{self, launch};
        let &[a, b, c, d] = l.dims() else {
            return Err(candle_core::Error::Msg(format!("swap-heads: {:?} is not [A, B, C, D]", l.dims())));
        };
        let total = a * b * c * d;
        let [bi, ci, di, ti] = [b, c, d, total].map(|v| v as i64);
        cuda::dispatch_cuda!(s, T => {
            let x = cuda::view::<T>(s, l)?;
            let out = cuda::output::<T>(s, total)?;
            launch!(s.device, cuda::TRANSPOSE, cuda::entry::<T>("swap_heads"), cuda::elementwise(total);
                &x, &out, &bi, &ci, &di, &ti);
            Ok((cuda::storage(s, out), Shape::from((a, c, b, d))))
        })
    }
}
