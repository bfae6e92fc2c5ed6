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
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{Layout, Shape, Tensor, D};

use rayon::prelude::*;

#[cfg(feature = "cuda")]
use super::cuda::{self, launch};
use super::custom_op::cpu_refused;
#[cfg(feature = "cuda")]
use super::custom_op::Cuda;
use super::custom_op::{Cpu, FusedOp, Op};
use super::node_output::SideOutput;
use super::{fused, Real};
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

impl FusedOp<3> for Rope {
    fn name(&self) -> &'static str {
        if self.backward {
            "rope-bwd"
        } else {
            "rope"
        }
    }

    fn cpu<T: Real>(&self, [x, cos, sin]: [Cpu<'_>; 3]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (_, t, h, d, out_shape) = self.dims(x.layout, cos.layout, sin.layout)?;
        let (x, cos, sin) = (x.data::<T>()?, cos.data::<T>()?, sin.data::<T>()?);
        let out = if self.backward {
            backward_kernel(x, cos, sin, (t, h, d))
        } else {
            forward_kernel(x, cos, sin, (t, h, d))
        };
        Ok((out, Shape::from(out_shape)))
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [xs, coss, sins]: [Cuda<'_>; 3]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let (b, t, h, d, out_shape) = self.dims(xs.layout, coss.layout, sins.layout)?;
        let (x, cos, sin) = (xs.view::<T>()?, coss.view::<T>()?, sins.view::<T>()?);
        let out = cuda::output::<T>(xs.storage, x.len())?;
        let [bi, ti, hi, di] = [b, t, h, d].map(|v| v as i64);
        let backward = i32::from(self.backward);
        launch!(xs.storage.device, cuda::ROPE, cuda::entry::<T>("rope"), cuda::elementwise(x.len() / 2);
            &x, &cos, &sin, &out, &bi, &ti, &hi, &di, &backward);
        Ok((out, Shape::from(out_shape)))
    }

    fn bwd(&self, [_x, cos, sin]: [&Tensor; 3], _res: &Tensor, g: &Tensor) -> candle_core::Result<[Option<Tensor>; 3]> {
        let dx = g.contiguous()?.apply_op3_no_bwd(cos, sin, &Op(Rope { backward: true }))?;
        Ok([Some(dx), None, None])
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
    Ok(x.transpose(1, 2)?.contiguous()?.apply_op3(&table(cos)?, &table(sin)?, Op(Rope { backward: false }))?)
}

/// q [B, T, HQ·D] and k [B, T, HK·D] (projection outputs, before their biases `q_bias` /
/// `k_bias` [H·D]) → (rope(q + q_bias), rope(k + k_bias)), [B, H, T, D] each, for a step that
/// differentiates nothing. On CUDA with oxrl's kernels on, one kernel adds both biases (rounded
/// as the bias add writes them) and rotates both, where a decode step ran two bias adds and two
/// rotations a layer: the same bits. Elsewhere [`super::add::bias_add`] and [`rope`].
pub fn rope_pair(
    q: &Tensor,
    q_bias: Option<&Tensor>,
    k: &Tensor,
    k_bias: Option<&Tensor>,
    (hq, hk): (usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (b, t, _) = q.dims3()?;
    let d = q.dim(2)? / hq.max(1);
    // A bias the kernel reads: q's dtype, one value per output column, nothing differentiated.
    let plain =
        |x: Option<&Tensor>, h: usize| x.is_none_or(|x| x.dtype() == q.dtype() && x.dims() == [h * d] && !x.track_op());
    let served = q.device().is_cuda()
        && fused(q)
        && !q.track_op()
        && !k.track_op()
        && k.dtype() == q.dtype()
        && plain(q_bias, hq)
        && plain(k_bias, hk)
        && cos.dtype() == q.dtype()
        && sin.dtype() == q.dtype()
        && hq * d == q.dim(2)?
        && k.dims3()? == (b, t, hk * d)
        && d % 2 == 0;
    if !served {
        let heads = |y: &Tensor, bias: Option<&Tensor>, h: usize| -> Result<Tensor> {
            let y = match bias {
                Some(bias) => super::add::bias_add(y, bias)?,
                None => y.clone(),
            };
            rope(&y.reshape((b, t, h, d))?.transpose(1, 2)?, cos, sin)
        };
        return Ok((heads(q, q_bias, hq)?, heads(k, k_bias, hk)?));
    }
    let table = |c: &Tensor| -> Result<Tensor> { Ok(c.reshape((b, t, d / 2))?.contiguous()?) };
    let bias = |x: Option<&Tensor>| -> Result<Option<Tensor>> { Ok(x.map(|x| x.contiguous()).transpose()?) };
    let op = RopePair {
        q_bias: bias(q_bias)?,
        k_bias: bias(k_bias)?,
        cos: table(cos)?,
        sin: table(sin)?,
        heads: (hq, hk),
        keys: Default::default(),
    };
    let q_out = q.contiguous()?.apply_op2_no_bwd(&k.contiguous()?, &op)?;
    Ok((q_out, op.keys.take("rope-pair", (b, hk, t, d))?))
}

/// The kernel of [`rope_pair`]: q's rotation its output, k's its second.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RopePair {
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    cos: Tensor,
    sin: Tensor,
    heads: (usize, usize),
    keys: SideOutput,
}

impl candle_core::CustomOp2 for RopePair {
    fn name(&self) -> &'static str {
        "rope-pair"
    }

    cpu_refused!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::cuda_backend::CudaStorage,
        ql: &Layout,
        ks: &candle_core::cuda_backend::CudaStorage,
        kl: &Layout,
    ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use candle_core::cuda_backend::CudaStorage;
        let (hq, hk) = self.heads;
        let (b, t, qw) = ql.shape().dims3()?;
        let d = qw / hq;
        fn on_cuda(x: &Tensor) -> candle_core::Result<(candle_core::StorageRef<'_>, Layout)> {
            let (s, l) = x.storage_and_layout();
            let l = l.clone();
            cuda_of(&s)?;
            Ok((s, l))
        }
        fn cuda_of(s: &candle_core::Storage) -> candle_core::Result<&CudaStorage> {
            match s {
                candle_core::Storage::Cuda(c) => Ok(c),
                _ => Err(candle_core::Error::Msg("rope-pair: an input is not on CUDA".into())),
            }
        }
        let (cos_s, cos_l) = on_cuda(&self.cos)?;
        let (sin_s, sin_l) = on_cuda(&self.sin)?;
        let qb = self.q_bias.as_ref().map(on_cuda).transpose()?;
        let kb = self.k_bias.as_ref().map(on_cuda).transpose()?;
        let [bi, ti, hqi, hki, di] = [b, t, hq, hk, d].map(|v| v as i64);
        let (q_biased, k_biased) = (i32::from(qb.is_some()), i32::from(kb.is_some()));
        let threads = b * (hq + hk) * t * d / 2;
        cuda::dispatch_cuda!(qs, T => {
            let q = cuda::view::<T>(qs, ql)?;
            let k = cuda::view::<T>(ks, kl)?;
            let (cos, sin) = (cuda::view::<T>(cuda_of(&cos_s)?, &cos_l)?, cuda::view::<T>(cuda_of(&sin_s)?, &sin_l)?);
            // An absent bias is never read (its flag is 0): its input stands in for the pointer.
            let qb = match &qb { Some((s, l)) => cuda::view::<T>(cuda_of(s)?, l)?, None => cuda::view::<T>(qs, ql)? };
            let kb = match &kb { Some((s, l)) => cuda::view::<T>(cuda_of(s)?, l)?, None => cuda::view::<T>(ks, kl)? };
            let qo = cuda::output::<T>(qs, q.len())?;
            let ko = cuda::output::<T>(ks, k.len())?;
            launch!(qs.device, cuda::ROPE, cuda::entry::<T>("rope_pair"), cuda::elementwise(threads);
                &q, &qb, &k, &kb, &cos, &sin, &qo, &ko, &bi, &ti, &hqi, &hki, &di, &q_biased, &k_biased);
            self.keys.put(cuda::storage(ks, ko));
            Ok((cuda::storage(qs, qo), Shape::from((b, hq, t, d))))
        })
    }
}

/// The primitive graph: the rotate-half formula (from differentiable primitives: narrow, mul,
/// cat), then a contiguous copy.
pub fn reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Ok(Tensor::cat(&[a, b], D::Minus1)?.contiguous()?)
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
