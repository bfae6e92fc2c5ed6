//! Fused rotary embedding with the head transpose: x [B, T, H, D] → rope(x) as [B, H, T, D].
//!
//! (Callers pass the [B, H, T, D] transposed view of the projection output; see [`rope`].)
//!
//! The projections give [B, T, H·D]; attention wants [B, H, T, D]. The primitive graph
//! transposed, copied, split the halves, took four products, a sum, a difference and a concat.
//! Here one pass reads each head vector once and writes it rotated at its transposed place:
//!   out[.., :D/2] = x1·cos − x2·sin,  out[.., D/2:] = x2·cos + x1·sin
//! with cos/sin [B, T, D/2] per row and position. The backward is the inverse rotation
//! (transpose of an orthogonal map), written back to the [B, T, H, D] layout:
//!   dx1 = g1·cos + g2·sin,  dx2 = g2·cos − g1·sin.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::CudaStorage;
use candle_core::WithDType as _;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use rayon::prelude::*;

use super::{data, dispatch_real, fused, Real};
use crate::Result;

/// Rotation direction: forward (x → out, [B,T,H,D] → [B,H,T,D]) or backward (g → dx, the
/// inverse rotation, [B,H,T,D] → [B,T,H,D]).
struct Rope {
    backward: bool,
}

/// Forward: x [B, T, H, D] → [B, H, T, D]; one task per (batch row, head), whose T vectors
/// are contiguous in the output.
pub(crate) fn forward_kernel<T: Real>(x: &[T], cos: &[T], sin: &[T], (t, h, d): (usize, usize, usize)) -> Vec<T> {
    let half = d / 2;
    let mut out = vec![T::of(0.0); x.len()];
    out.par_chunks_mut(t * d).with_min_len((4096 / (t * d).max(1)).max(1)).enumerate().for_each(|(bh, chunk)| {
        let (bi, hi) = (bh / h, bh % h);
        for (ti, dst) in chunk.chunks_mut(d).enumerate() {
            let tab = (bi * t + ti) * half;
            let (c, s) = (&cos[tab..tab + half], &sin[tab..tab + half]);
            let (x1, x2) = x[((bi * t + ti) * h + hi) * d..][..d].split_at(half);
            let (o1, o2) = dst.split_at_mut(half);
            for i in 0..half {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    });
    out
}

/// Backward: g [B, H, T, D] → dx [B, T, H, D]; one task per (batch row, position).
pub(crate) fn backward_kernel<T: Real>(g: &[T], cos: &[T], sin: &[T], (t, h, d): (usize, usize, usize)) -> Vec<T> {
    let half = d / 2;
    let mut dx = vec![T::of(0.0); g.len()];
    dx.par_chunks_mut(h * d).with_min_len((4096 / (h * d).max(1)).max(1)).enumerate().for_each(|(bt, chunk)| {
        let (bi, ti) = (bt / t, bt % t);
        let tab = bt * half;
        let (c, s) = (&cos[tab..tab + half], &sin[tab..tab + half]);
        for (hi, dst) in chunk.chunks_mut(d).enumerate() {
            let (g1, g2) = g[((bi * h + hi) * t + ti) * d..][..d].split_at(half);
            let (o1, o2) = dst.split_at_mut(half);
            for i in 0..half {
                o1[i] = g1[i] * c[i] + g2[i] * s[i];
                o2[i] = g2[i] * c[i] - g1[i] * s[i];
            }
        }
    });
    dx
}

impl Rope {
    /// (B, T, H, D) and the output's shape, from the input's layout and the tables'.
    fn dims(&self, x: &Layout, cos: &Layout, sin: &Layout) -> candle_core::Result<RopeDims> {
        let (d0, d1, d2, d) = x.shape().dims4()?;
        // [B, T, H, D] dims whichever way we go.
        let (b, t, h) = if self.backward { (d0, d2, d1) } else { (d0, d1, d2) };
        let out_shape = if self.backward { (b, t, h, d) } else { (b, h, t, d) };
        let table = b * t * d / 2;
        if d % 2 != 0 || cos.shape().elem_count() != table || sin.shape().elem_count() != table {
            return Err(candle_core::Error::Msg(format!("rope: tables do not match x {:?}", x.dims())));
        }
        Ok((b, t, h, d, out_shape))
    }
}

type RopeDims = (usize, usize, usize, usize, (usize, usize, usize, usize));

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        if self.backward {
            "rope-bwd"
        } else {
            "rope"
        }
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
        let (_, t, h, d, out_shape) = self.dims(l1, l2, l3)?;
        dispatch_real!(s1, T => {
            let (x, cos, sin) = (data::<T>(s1, l1)?, data::<T>(s2, l2)?, data::<T>(s3, l3)?);
            let out = if self.backward {
                backward_kernel(x, cos, sin, (t, h, d))
            } else {
                forward_kernel(x, cos, sin, (t, h, d))
            };
            Ok((T::to_cpu_storage_owned(out), Shape::from(out_shape)))
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
        let (b, t, h, d, out_shape) = self.dims(l1, l2, l3)?;
        dispatch_cuda!(s1, T => {
            let (x, cos, sin) = (cuda::view::<T>(s1, l1)?, cuda::view::<T>(s2, l2)?, cuda::view::<T>(s3, l3)?);
            let out = cuda::output::<T>(s1, x.len())?;
            let [bi, ti, hi, di] = [b, t, h, d].map(|v| v as i64);
            let backward = i32::from(self.backward);
            launch!(s1.device, cuda::ROPE, cuda::entry::<T>("rope"), cuda::elementwise(x.len() / 2);
                &x, &cos, &sin, &out, &bi, &ti, &hi, &di, &backward);
            Ok((cuda::storage(s1, out), Shape::from(out_shape)))
        })
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = g.contiguous()?.apply_op3_no_bwd(cos, sin, &Rope { backward: true })?;
        Ok((Some(dx), None, None))
    }
}

/// Rotates x [B, H, T, D] with cos/sin tables [B, 1, T, D/2] (as [`crate::model::rope::Rope::tables`]
/// gives them) and returns it contiguous. The fused pass reads x in the [B, T, H, D] layout the
/// projections write (x is usually that layout's transposed view, so reading it is free).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !fused(x) || cos.dtype() != x.dtype() || sin.dtype() != x.dtype() {
        return reference(x, cos, sin);
    }
    let (b, _, t, d) = x.dims4()?;
    let table = |c: &Tensor| -> Result<Tensor> { Ok(c.reshape((b, t, d / 2))?.contiguous()?) };
    Ok(x.transpose(1, 2)?.contiguous()?.apply_op3(&table(cos)?, &table(sin)?, Rope { backward: false })?)
}

/// The primitive graph: the rotate-half formula, then a contiguous copy.
pub fn reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Ok(crate::model::rope::apply(x, cos, sin)?.contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, var};
    use super::*;
    use candle_core::DType;

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            let x = var(&[2, 5, 3, 8], 1, 2.0, dtype);
            let angles = super::super::testing::values(2 * 5 * 4, 7, 3.0);
            let t = |f: fn(f64) -> f64| {
                let v: Vec<f64> = angles.iter().map(|&a| f(a)).collect();
                Tensor::from_vec(v, (2, 1, 5, 4), &candle_core::Device::Cpu).unwrap().to_dtype(dtype).unwrap()
            };
            let (cos, sin) = (t(f64::cos), t(f64::sin));
            // [B, T, H, D] seen as [B, H, T, D], as the projections give it; and a contiguous one.
            let xt = x.as_tensor().transpose(1, 2).unwrap();
            let xc = x.as_tensor().transpose(1, 2).unwrap().contiguous().unwrap();
            check(
                std::slice::from_ref(&x),
                || rope(&xc, &cos, &sin).unwrap(),
                || reference(&xc, &cos, &sin).unwrap(),
                tol,
                "contiguous",
            );
            check(
                std::slice::from_ref(&x),
                || rope(&xt, &cos, &sin).unwrap(),
                || reference(&xt, &cos, &sin).unwrap(),
                tol,
                &format!("{dtype:?}"),
            );
        }
    }
}
