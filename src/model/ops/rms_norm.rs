//! Fused RMSNorm over the last dimension: y = x · r · w, r = 1 / sqrt(mean(x²) + eps).
//!
//! One pass per row forward. The backward recomputes r from x (cheaper than keeping it) and,
//! with x̂ = x · r and gy the output gradient, writes in one pass per row
//!   dx = r · (w·gy − x̂ · mean(w·gy·x̂)),   dw = Σ_rows gy · x̂
//! (dw summed per thread chunk, then over chunks). The computation runs in the input's dtype
//! (f32 or f64), as the reference does for those; on the CPU bf16/f16 go to the reference, which
//! normalises in f32. The CUDA kernels (f32, bf16, f16) compute in f32 and sum dw over chunks of
//! rows in a fixed order.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{Shape, Tensor, D};
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use super::cuda::{self, launch};
use super::custom_op::cpu_refused;
#[cfg(feature = "cuda")]
use super::custom_op::Cuda;
use super::custom_op::{grad_for, Cpu, FusedOp, Op};
use super::node_output::SideOutput;
use super::{dot, dot3, fused, norm_dtype, par_rows, Real};
use crate::Result;

struct RmsNorm {
    eps: f64,
}

fn inv_rms<T: Real>(row: &[T], eps: f64) -> T {
    T::of(1.0) / (dot(row, row) / T::of(row.len() as f64) + T::of(eps)).sqrt()
}

/// y = x · r · w for each row of x (rows of w.len()), rows split over the rayon pool.
pub(crate) fn forward<T: Real>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let mut y = vec![T::of(0.0); x.len()];
    par_rows(&mut y, d, |i, out| {
        let row = &x[i * d..(i + 1) * d];
        let r = inv_rms(row, eps);
        for ((o, &xi), &wi) in out.iter_mut().zip(row).zip(w) {
            *o = xi * r * wi;
        }
    });
    y
}

/// Rows per partial sum of the weight gradient (see [`backward`]).
const DW_CHUNK_ROWS: usize = 64;

/// The backward of [`forward`] for the output gradient `gy`: adds into dx and into dw (callers
/// pass zeros for a plain gradient, or a gradient to accumulate into: a residual's).
pub(crate) fn backward<T: Real>(x: &[T], gy: &[T], w: &[T], eps: f64, dx: &mut [T], dw: &mut [T]) {
    let d = w.len();
    // Rows in chunks of a fixed size, each with its own dw partial sum, added in chunk order: dw
    // is summed in one order whatever the thread count (a chunk per thread made a run's
    // gradients depend on it).
    let chunk_rows = DW_CHUNK_ROWS;
    let partials: Vec<Vec<T>> = dx
        .par_chunks_mut(chunk_rows * d)
        .enumerate()
        .map(|(c, dx)| {
            let mut dw = vec![T::of(0.0); d];
            for (k, out) in dx.chunks_mut(d).enumerate() {
                let i = c * chunk_rows + k;
                let (row, g) = (&x[i * d..(i + 1) * d], &gy[i * d..(i + 1) * d]);
                let r = inv_rms(row, eps);
                for j in 0..d {
                    dw[j] += g[j] * row[j] * r;
                }
                let mean = dot3(w, g, row) * r / T::of(d as f64);
                for j in 0..d {
                    out[j] += r * (w[j] * g[j] - row[j] * r * mean);
                }
            }
            dw
        })
        .collect();
    for p in partials {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
}

impl FusedOp<2> for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu<T: Real>(&self, [x, w]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        Ok((forward(x.data::<T>()?, w.data::<T>()?, self.eps), x.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [xs, ws]: [Cuda<'_>; 2]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let (x, w) = (xs.view::<T>()?, ws.view::<T>()?);
        let d = w.len();
        let rows = x.len() / d;
        let y = cuda::output::<T>(xs.storage, rows * d)?;
        let (d, eps) = (d as i64, self.eps as f32);
        launch!(xs.storage.device, cuda::RMS_NORM, cuda::entry::<T>("rms_norm"), cuda::per_row(rows); &x, &w, &y, &d, &eps);
        Ok((y, xs.shape().clone()))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _res: &Tensor, gy: &Tensor) -> candle_core::Result<[Option<Tensor>; 2]> {
        let d = w.elem_count();
        let n = x.elem_count() / d;
        let both = Tensor::cat(&[x.flatten_all()?, gy.contiguous()?.flatten_all()?], 0)?;
        let out = both.apply_op2_no_bwd(w, &Op(RmsNormBwd { eps: self.eps }))?;
        let dx = out.narrow(0, 0, n * d)?.reshape(x.shape())?;
        let dw = out.narrow(0, n * d, d)?.reshape(w.shape())?;
        Ok([grad_for(x, dx), grad_for(w, dw)])
    }
}

/// From ([x | gy] flat, w): [dx | dw] flat.
struct RmsNormBwd {
    eps: f64,
}

impl FusedOp<2> for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms-norm-bwd"
    }

    fn cpu<T: Real>(&self, [xg, w]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (xg, w) = (xg.data::<T>()?, w.data::<T>()?);
        let d = w.len();
        let half = xg.len() / 2;
        let (x, gy) = xg.split_at(half);
        let mut out = vec![T::of(0.0); half + d];
        let (dx, dw) = out.split_at_mut(half);
        backward(x, gy, w, self.eps, dx, dw);
        Ok((out, Shape::from(half + d)))
    }

    /// A block per row writes dx and r; dw is summed over chunks of rows in order (no atomics,
    /// so it does not depend on timing).
    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [xgs, ws]: [Cuda<'_>; 2]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let (xg, w) = (xgs.view::<T>()?, ws.view::<T>()?);
        let d = w.len();
        let half = xg.len() / 2;
        let rows = half / d;
        let (x, gy) = (xg.slice(..half), xg.slice(half..));
        let out = cuda::output::<T>(xgs.storage, half + d)?;
        let (dx, dw) = (out.slice(..half), out.slice(half..));
        let r = cuda::output::<f32>(xgs.storage, rows)?;
        let rows_per_chunk = rows.div_ceil(65_535).max(64);
        let chunks = rows.div_ceil(rows_per_chunk);
        let partial = cuda::output::<f32>(xgs.storage, chunks * d)?;
        let dev = &xgs.storage.device;
        let (n, di, eps) = (rows as i64, d as i64, self.eps as f32);
        let (per_chunk, chunks_i) = (rows_per_chunk as i64, chunks as i64);
        launch!(dev, cuda::RMS_NORM, cuda::entry::<T>("rms_norm_bwd_rows"), cuda::per_row(rows);
            &x, &gy, &w, &dx, &r, &di, &eps);
        let columns = (d as u32).div_ceil(cuda::ROW_THREADS);
        let grid = |chunks: usize| LaunchConfig {
            grid_dim: (columns, chunks as u32, 1),
            block_dim: (cuda::ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(dev, cuda::RMS_NORM, cuda::entry::<T>("rms_norm_bwd_dw_partial"), grid(chunks);
            &x, &gy, &r, &partial, &n, &di, &per_chunk);
        // With no rows there are no chunks, and dw is their empty sum: zeros.
        launch!(dev, cuda::RMS_NORM, cuda::entry::<T>("rms_norm_bwd_dw_sum"), grid(1); &partial, &dw, &chunks_i, &di);
        Ok((out, Shape::from(half + d)))
    }
}

/// RMSNorm of x [..., D] with weight [D]; fused where [`fused`] says (x and w of one dtype).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if !fused(x) || x.dtype() != w.dtype() || w.rank() != 1 || w.elem_count() == 0 || x.dim(D::Minus1)? != w.dim(0)? {
        return reference(x, w, eps);
    }
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Op(RmsNorm { eps }))?)
}

/// (h + a, rms_norm(h + a, w)): a residual sum and its norm. Where nothing is differentiated, on
/// CUDA with oxrl's kernels on, one kernel writes both (a decode step ran an add and a norm twice
/// a layer): the bits of the add and [`rms_norm`]. Elsewhere those two.
pub fn add_rms_norm(h: &Tensor, a: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let d = h.dim(D::Minus1)?;
    let served = h.device().is_cuda()
        && fused(h)
        && !(h.track_op() || a.track_op() || w.track_op())
        && a.dtype() == h.dtype()
        && w.dtype() == h.dtype()
        && a.dims() == h.dims()
        && w.dims() == [d]
        && d > 0;
    if !served {
        let sum = super::add::add(h, a)?;
        let normed = rms_norm(&sum, w, eps)?;
        return Ok((sum, normed));
    }
    let op = AddRmsNorm { w: w.contiguous()?, eps, normed: Default::default() };
    let sum = h.contiguous()?.apply_op2_no_bwd(&a.contiguous()?, &op)?;
    let normed = op.normed.take("add-rms-norm", h.shape())?;
    Ok((sum, normed))
}

/// The kernel of [`add_rms_norm`]: the sum its output, the norm its second.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AddRmsNorm {
    w: Tensor,
    eps: f64,
    normed: SideOutput,
}

impl candle_core::CustomOp2 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    cpu_refused!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        hs: &candle_core::cuda_backend::CudaStorage,
        hl: &candle_core::Layout,
        as_: &candle_core::cuda_backend::CudaStorage,
        al: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        let (w_storage, wl) = self.w.storage_and_layout();
        let ws = cuda::held(&w_storage, "add-rms-norm", "weight")?;
        let d = wl.shape().elem_count();
        let n = hl.shape().elem_count();
        let rows = n / d;
        let (di, eps) = (d as i64, self.eps as f32);
        cuda::dispatch_cuda!(hs, T => {
            let (h, a, w) = (cuda::view::<T>(hs, hl)?, cuda::view::<T>(as_, al)?, cuda::view::<T>(ws, wl)?);
            let (sum, normed) = (cuda::output::<T>(hs, n)?, cuda::output::<T>(hs, n)?);
            launch!(hs.device, cuda::RMS_NORM, cuda::entry::<T>("add_rms_norm"), cuda::per_row(rows);
                &h, &a, &w, &sum, &normed, &di, &eps);
            self.normed.put(cuda::storage(hs, normed));
            Ok((cuda::storage(hs, sum), hl.shape().clone()))
        })
    }
}

/// The primitive graph, normalising in f32 (f64 for f64): x / sqrt(mean(x²) + eps) · w.
pub fn reference(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(norm_dtype(dtype))?;
    let inv_rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let normed = x.broadcast_mul(&inv_rms)?.to_dtype(dtype)?;
    Ok(normed.broadcast_mul(weight)?)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, var};
    use super::*;
    use candle_core::DType;

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            let x = var(&[2, 7, 64], 1, 3.0, dtype);
            let w = var(&[64], 2, 1.0, dtype);
            let (xt, wt) = (x.as_tensor(), w.as_tensor());
            check(
                &[x.clone(), w.clone()],
                || rms_norm(xt, wt, 1e-6).unwrap(),
                || reference(xt, wt, 1e-6).unwrap(),
                tol,
                &format!("{dtype:?}"),
            );
            // A non-contiguous input (heads transposed) goes through the same op.
            let xt2 = xt.transpose(0, 1).unwrap();
            check(
                &[x.clone(), w.clone()],
                || rms_norm(&xt2, wt, 1e-6).unwrap(),
                || reference(&xt2, wt, 1e-6).unwrap(),
                tol,
                "transposed",
            );
        }
    }

    #[test]
    fn rows_of_no_width_are_not_a_panic() {
        let x = candle_core::Tensor::zeros((3, 0), DType::F32, &candle_core::Device::Cpu).unwrap();
        let w = candle_core::Tensor::zeros(0, DType::F32, &candle_core::Device::Cpu).unwrap();
        assert_eq!(rms_norm(&x, &w, 1e-6).unwrap().dims(), [3, 0]);
    }
}
