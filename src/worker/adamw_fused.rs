//! AdamW in one pass on the CPU: the update of [`super::adamw::update`] for f32/f64 parameters.
//!
//! The primitive version runs about twelve elementwise candle ops per parameter (each a full
//! pass and a fresh buffer); this updates m, v and p in place (three passes, no allocation), with the
//! same arithmetic in the same order (so results agree with it to rounding):
//! ```text
//! g ← g · clip;  p ← p · (1 − lr·wd);  m ← β1 m + (1 − β1) g;  v ← β2 v + (1 − β2) g²
//! p ← p − (lr / (1 − β1^t)) · m / (sqrt(v · 1/(1 − β2^t)) + eps)
//! ```
//! The parameter is written in place, as `Var::set` would. On CUDA (f32) the update is one kernel
//! (`ops/cuda/adamw.cu`, each element's m, v and p in turn), rounding each operation in f32 in
//! the same order: the same bits as candle's primitive ops there.
//!
//! The gradient norm's Σ g² is one pass too: on the CPU in chunks summed in chunk order, on
//! CUDA per block, the blocks' sums then added by one block (candle's `sum_all` is a single
//! block over the whole tensor).

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::adamw::{AdamParams, Moments};
#[cfg(feature = "cuda")]
use crate::model::ops::cuda::{self, launch};
use crate::model::ops::custom_op::cpu_refused;
use crate::model::ops::{cuda_kernels, data, dispatch_real};
use crate::Result;

/// Scalars of one step, in the order the kernel uses them.
#[derive(Clone, Copy)]
struct Step {
    clip: f64,
    decay: f64,
    beta1: f64,
    beta2: f64,
    lr_over_bias1: f64,
    inv_bias2: f64,
    eps: f64,
}

/// m ← β1 m + (1 − β1) g (`second == false`) or v ← β2 v + (1 − β2) g² in place, from the
/// gradient (times the clip coefficient).
struct Moment {
    step: Step,
    second: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        let (a, b) =
            l1.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("adamw: moment is not contiguous".into()))?;
        let st = self.step;
        let second = self.second;
        macro_rules! run {
            ($m:expr, $T:ty) => {{
                let g = data::<$T>(s2, l2)?;
                let c = |x: f64| x as $T;
                let (clip, beta) = (c(st.clip), c(if second { st.beta2 } else { st.beta1 }));
                let one_beta = c(1.0 - if second { st.beta2 } else { st.beta1 });
                $m[a..b].par_chunks_mut(CHUNK).enumerate().for_each(|(k, m)| {
                    let g = &g[k * CHUNK..];
                    for i in 0..m.len() {
                        let gj = g[i] * clip;
                        m[i] = if second { m[i] * beta + gj * gj * one_beta } else { m[i] * beta + gj * one_beta };
                    }
                });
                Ok(())
            }};
        }
        match s1 {
            CpuStorage::F32(m) => run!(m, f32),
            CpuStorage::F64(m) => run!(m, f64),
            _ => Err(candle_core::Error::Msg("adamw: f32 or f64 only".into())),
        }
    }
}

/// The start and end of a contiguous in-place operand, or an error naming it.
#[cfg(feature = "cuda")]
fn contiguous(l: &Layout, what: &str) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("adamw: the {what} is not contiguous")))
}

/// p ← p · decay − lr/bias1 · m' / (sqrt(v' / bias2) + eps), in place, from m' and v'.
impl InplaceOp3 for Step {
    fn name(&self) -> &'static str {
        "adamw-param"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let (a, b) = l1
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("adamw: parameter is not contiguous".into()))?;
        let c = *self;
        macro_rules! run {
            ($p:expr, $T:ty) => {{
                let (m, v) = (data::<$T>(s2, l2)?, data::<$T>(s3, l3)?);
                let k = |x: f64| x as $T;
                let (decay, lr_b1, inv_b2, eps) = (k(c.decay), k(c.lr_over_bias1), k(c.inv_bias2), k(c.eps));
                $p[a..b].par_chunks_mut(CHUNK).enumerate().for_each(|(j, p)| {
                    let at = j * CHUNK;
                    for i in 0..p.len() {
                        let denom = (v[at + i] * inv_b2).sqrt() + eps;
                        p[i] = p[i] * decay - m[at + i] * lr_b1 / denom;
                    }
                });
                Ok(())
            }};
        }
        match s1 {
            CpuStorage::F32(p) => run!(p, f32),
            CpuStorage::F64(p) => run!(p, f64),
            _ => Err(candle_core::Error::Msg("adamw: f32 or f64 only".into())),
        }
    }
}

/// Elements per rayon task.
const CHUNK: usize = 8192;

/// Σ x² in f64, one pass (the global gradient norm's terms).
struct SumSquares;

impl candle_core::CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        dispatch_real!(s, T => {
            let x = data::<T>(s, l)?;
            // Eight partial sums per chunk: one chained f64 sum is bound by the add latency.
            // The chunks' sums are added in chunk order (not by rayon's reduction tree, which
            // follows work stealing), so the norm is the same bits at any thread count and on
            // whichever rank computes it.
            let partials: Vec<f64> = x
                .par_chunks(CHUNK)
                .map(|c| {
                    let mut acc = [0f64; 8];
                    let mut lanes = c.chunks_exact(8);
                    for l in &mut lanes {
                        for i in 0..8 {
                            let v = l[i].to_f64();
                            acc[i] += v * v;
                        }
                    }
                    let tail: f64 = lanes.remainder().iter().map(|&v| v.to_f64() * v.to_f64()).sum();
                    acc.iter().sum::<f64>() + tail
                })
                .collect();
            let total: f64 = partials.iter().sum();
            Ok((CpuStorage::F64(vec![total]), Shape::from(1)))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let n = l.shape().elem_count();
        // The grid an elementwise kernel takes: each block's partial sum, then one block adds them.
        let grid = cuda::elementwise(n);
        let blocks = grid.grid_dim.0 as usize;
        // Safety: each kernel writes every element of its output (a partial per block; the total).
        let partials = unsafe { s.device.alloc::<f64>(blocks) }?;
        let total = unsafe { s.device.alloc::<f64>(1) }?;
        let ni = n as i64;
        cuda::dispatch_cuda!(s, T => {
            let x = cuda::view::<T>(s, l)?;
            launch!(s.device, cuda::ADAMW, cuda::entry::<T>("sum_squares"), grid; &x, &partials, &ni);
            Ok::<(), candle_core::Error>(())
        })?;
        let one_block = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let bi = blocks as i64;
        launch!(s.device, cuda::ADAMW, "sum_partials", one_block; &partials, &total, &bi);
        Ok((CudaStorage::wrap_cuda_slice(total, s.device.clone()), Shape::from(1)))
    }
}

/// Σ x² of `t` as a one-element f64 tensor: f32/f64 on the CPU, f32/bf16/f16 on CUDA (with
/// oxrl's kernels on); None where it does not apply.
pub fn sum_squares(t: &Tensor) -> Result<Option<Tensor>> {
    let served = match t.device() {
        candle_core::Device::Cpu => matches!(t.dtype(), DType::F32 | DType::F64),
        candle_core::Device::Cuda(_) => cuda_kernels() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16),
        _ => false,
    };
    if !served {
        return Ok(None);
    }
    Ok(Some(t.contiguous()?.apply_op1_no_bwd(&SumSquares)?))
}

/// Whether the one-pass update serves this parameter: f32/f64 on the CPU, f32 on CUDA (with
/// oxrl's kernels on), with moments of its dtype.
pub fn applies(param: &Tensor, state: &Moments) -> bool {
    let served = match param.device() {
        candle_core::Device::Cpu => matches!(param.dtype(), DType::F32 | DType::F64),
        candle_core::Device::Cuda(_) => cuda_kernels() && param.dtype() == DType::F32,
        _ => false,
    };
    served && state.exp_avg.dtype() == param.dtype()
}

/// One AdamW step of `param` (a parameter's storage, or its master copy), in place, with
/// `grad · clip`; advances `state.step`. Call when [`applies`].
pub fn update(param: &Tensor, grad: &Tensor, clip: f64, state: &mut Moments, p: &AdamParams) -> Result<()> {
    state.step += 1;
    let t = state.step as i32;
    let step = Step {
        clip,
        decay: 1.0 - p.learning_rate * p.weight_decay,
        beta1: p.beta1,
        beta2: p.beta2,
        lr_over_bias1: p.learning_rate / (1.0 - p.beta1.powi(t)),
        inv_bias2: 1.0 / (1.0 - p.beta2.powi(t)),
        eps: p.eps,
    };
    let flat = |x: &Tensor| -> Result<Tensor> { Ok(x.to_dtype(param.dtype())?.contiguous()?.flatten_all()?) };
    let g = flat(grad)?;
    // The moments are updated in place: they are the worker's own (fresh zeros, a checkpoint's
    // load or an offload's copy), and a step allocates nothing.
    let (m, v) = (flat(&state.exp_avg)?, flat(&state.exp_avg_sq)?);
    if param.device().is_cuda() {
        // One kernel: g, m, v and p read once (the passes below read g and the moments twice).
        return Ok(param.inplace_op3(&m, &v, &Fused { step, grad: g })?);
    }
    m.inplace_op2(&g, &Moment { step, second: false })?;
    v.inplace_op2(&g, &Moment { step, second: true })?;
    param.inplace_op3(&m, &v, &step)?;
    Ok(())
}

/// The whole update on CUDA in one pass: p in place, m and v (the op's inputs) written in place
/// by the kernel too, from the gradient it holds. The same operations per element as the three
/// passes, in the same order: the same bits.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Fused {
    step: Step,
    grad: Tensor,
}

impl InplaceOp3 for Fused {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    cpu_refused!(inplace 3);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let c = self.step;
        let n = l1.shape().elem_count();
        let (gs, gl) = self.grad.storage_and_layout();
        let candle_core::Storage::Cuda(gs) = &*gs else {
            return Err(candle_core::Error::Msg("adamw-step: the gradient is not on CUDA".into()));
        };
        if [l2, l3, gl].iter().any(|l| l.shape().elem_count() != n) {
            return Err(candle_core::Error::Msg("adamw-step: parameter, moments and gradient differ in size".into()));
        }
        let g = cuda::view::<f32>(gs, gl)?;
        // The moments are written through their views: the kernel updates them in place, as the
        // passes' in-place ops do (they are the worker's own, shared with no other tensor).
        let (m, v) = (cuda::view::<f32>(s2, l2)?, cuda::view::<f32>(s3, l3)?);
        let dev = s1.device.clone();
        let (a, b) = contiguous(l1, "parameter")?;
        let mut p = s1.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
        let f = |x: f64| x as f32;
        let (clip, beta1, one_beta1) = (f(c.clip), f(c.beta1), f(1.0 - c.beta1));
        let (beta2, one_beta2) = (f(c.beta2), f(1.0 - c.beta2));
        let (decay, lr_b1, inv_b2, eps) = (f(c.decay), f(c.lr_over_bias1), f(c.inv_bias2), f(c.eps));
        let ni = n as i64;
        launch!(dev, cuda::ADAMW, "adamw_step", cuda::elementwise(n);
            &mut p, &m, &v, &g, &clip, &beta1, &one_beta1, &beta2, &one_beta2, &decay, &lr_b1, &inv_b2, &eps, &ni);
        Ok(())
    }
}

/// A half-precision parameter set in place to its f32 master, rounded (on CUDA with oxrl's
/// kernels on: one pass; elsewhere the cast and `Var::set`'s copy). The same values either way.
pub fn round_into(param: &candle_core::Var, master: &Tensor) -> Result<()> {
    let kernel = param.device().is_cuda()
        && cuda_kernels()
        && master.dtype() == DType::F32
        && matches!(param.dtype(), DType::BF16 | DType::F16)
        && param.dims() == master.dims();
    if !kernel {
        return Ok(param.set(&master.to_dtype(param.dtype())?)?);
    }
    Ok(param.as_tensor().inplace_op2(&master.contiguous()?, &RoundInto)?)
}

/// A gradient as f32, its accumulator's dtype (a bf16/f16 one on CUDA with oxrl's kernels on: a
/// kernel that moves four elements a load; anything else candle's cast). The same values.
pub fn widened(g: &Tensor) -> Result<Tensor> {
    let kernel = g.device().is_cuda() && cuda_kernels() && matches!(g.dtype(), DType::BF16 | DType::F16);
    if !kernel {
        return Ok(g.to_dtype(DType::F32)?);
    }
    Ok(g.contiguous()?.apply_op1_no_bwd(&Widen)?)
}

/// The kernel of [`widened`].
struct Widen;

impl candle_core::CustomOp1 for Widen {
    fn name(&self) -> &'static str {
        "widen"
    }

    cpu_refused!(1);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let n = l.shape().elem_count();
        let out = cuda::output::<f32>(s, n)?;
        let ni = n as i64;
        cuda::dispatch_cuda!(s, T => {
            let x = cuda::view::<T>(s, l)?;
            launch!(s.device, cuda::ADAMW, cuda::entry::<T>("widen"), cuda::elementwise(n); &x, &out, &ni);
            Ok::<(), candle_core::Error>(())
        })?;
        Ok((CudaStorage::wrap_cuda_slice(out, s.device.clone()), l.shape().clone()))
    }
}

/// The kernel of [`round_into`].
struct RoundInto;

impl InplaceOp2 for RoundInto {
    fn name(&self) -> &'static str {
        "round-into"
    }

    cpu_refused!(inplace 2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> candle_core::Result<()> {
        let n = l1.shape().elem_count();
        let p = cuda::view::<f32>(s2, l2)?;
        let dev = s1.device.clone();
        let (a, b) = contiguous(l1, "parameter")?;
        let ni = n as i64;
        match &mut s1.slice {
            candle_core::cuda_backend::CudaStorageSlice::BF16(w) => {
                let mut w = w.slice_mut(a..b);
                launch!(dev, cuda::ADAMW, "round_into_bf16", cuda::elementwise(n); &mut w, &p, &ni);
            }
            candle_core::cuda_backend::CudaStorageSlice::F16(w) => {
                let mut w = w.slice_mut(a..b);
                launch!(dev, cuda::ADAMW, "round_into_f16", cuda::elementwise(n); &mut w, &p, &ni);
            }
            _ => return Err(candle_core::Error::Msg("round-into: a bf16 or f16 parameter only".into())),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::adamw::update_reference;
    use candle_core::{Device, Var};

    #[test]
    fn fused_step_equals_the_primitive_step() {
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-14)] {
            let init: Vec<f64> = (0..1000).map(|i| ((i * 37 % 101) as f64 - 50.0) / 25.0).collect();
            let p0 = Tensor::from_vec(init, (10, 100), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let (a, b) = (Var::from_tensor(&p0).unwrap(), Var::from_tensor(&p0).unwrap());
            let (mut sa, mut sb) = (Moments::zeros(&p0).unwrap(), Moments::zeros(&p0).unwrap());
            let params = AdamParams { learning_rate: 1e-2, weight_decay: 0.1, eps: 1e-8, ..Default::default() };
            for step in 0..3 {
                let g = ((a.as_tensor() * (0.3 + step as f64)).unwrap().sin().unwrap() * 0.01).unwrap();
                update(a.as_tensor(), &g, 1.0, &mut sa, &params).unwrap();
                update_reference(&b, &g, &mut sb, &params).unwrap();
            }
            for (x, y) in [(a.as_tensor(), b.as_tensor()), (&sa.exp_avg, &sb.exp_avg), (&sa.exp_avg_sq, &sb.exp_avg_sq)]
            {
                let d = (x - y)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                assert!(d < tol, "{dtype:?}: {d}");
            }
            assert_eq!(sa.step, sb.step);
        }
    }
}
