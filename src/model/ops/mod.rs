//! Fused kernels with a backward, for the training forward and decoding.
//!
//! Each op lives in its own file as a candle `CustomOp` whose `cpu_fwd` runs one pass over
//! contiguous f32/f64 data (rows split over the current rayon pool) and whose `bwd` is another
//! fused pass, so that the autograd graph holds one node where the primitive graph held five to
//! ten (each of which costs candle's backward a zero-filled buffer and an add). With
//! `--features cuda` each also has a `cuda_fwd`: the CUDA kernels of `cuda/*.cu` (launched by
//! `cuda.rs`), for f32, bf16 and f16. Each file also keeps `reference`, the candle-primitive
//! graph the op replaces: it is what runs for the other dtypes (bf16/f16 on the CPU, f64 on a
//! GPU), and what the tests compare values and gradients against.
//!
//! Three files are graph nodes over candle operations rather than kernels: [`attention`],
//! [`linear`] and [`head_logprobs`] run a chain of candle operations on detached inputs and
//! write its backward out, operation by operation, so that the chain's many edges (each a
//! zero-filled buffer and an add in candle's backward) become one node with its chain's bits.

pub mod add;
pub mod attention;
pub mod cached_attention;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod custom_op;
pub mod embedding;
pub mod exp;
pub mod flash_attention;
pub mod gelu_tanh;
pub mod head_logprobs;
pub mod linear;
pub mod logprob_lse;
pub mod matmul;
pub mod matmul_panel;
pub mod matmul_wt;
mod node_output;
mod reduce;
pub mod rms_norm;
pub mod rope;
#[cfg(feature = "cuda")]
pub mod sample_rows;
pub mod softmax;
pub mod swiglu;
pub mod transpose;

pub(crate) use reduce::{dot, dot3, max};

use candle_core::{CpuStorage, DType, Device, Layout, Tensor, WithDType};
use rayon::prelude::*;

/// Whether the fused kernels serve `t`: on the CPU in f32 or f64; on a GPU (a build with
/// `--features cuda`) in f32, bf16 or f16 when [`cuda_kernels`] is on.
pub fn fused(t: &Tensor) -> bool {
    match t.device() {
        Device::Cpu => matches!(t.dtype(), DType::F32 | DType::F64),
        Device::Cuda(_) => cuda_kernels() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16),
        _ => false,
    }
}

/// Whether CUDA tensors take oxrl's kernels (`cuda/*.cu`, the engine's device sampler among
/// them) rather than candle's primitive graphs. On unless `OXRL_CUDA_KERNELS=0` (read once) or
/// [`set_cuda_kernels`]`(false)`: the GPU suite passes either way (`scripts/gpu_check.sh` runs
/// it both ways), and the switch is there to measure one against the other.
pub fn cuda_kernels() -> bool {
    cfg!(feature = "cuda") && cuda_switch().load(std::sync::atomic::Ordering::Relaxed)
}

/// Turns the CUDA kernels on or off for the whole process (see [`cuda_kernels`]).
pub fn set_cuda_kernels(on: bool) {
    cuda_switch().store(on, std::sync::atomic::Ordering::Relaxed);
}

fn cuda_switch() -> &'static std::sync::atomic::AtomicBool {
    static ON: std::sync::OnceLock<std::sync::atomic::AtomicBool> = std::sync::OnceLock::new();
    ON.get_or_init(|| std::sync::atomic::AtomicBool::new(std::env::var("OXRL_CUDA_KERNELS").as_deref() != Ok("0")))
}

/// The dtype softmax and RMSNorm run in: f32, or f64 for an f64 model (so that f64 runs,
/// e.g. finite-difference checks, are f64 throughout).
pub fn norm_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The floats the kernels run in: the few operations they need, for f32 and f64.
pub trait Real:
    WithDType + Copy + Send + Sync + PartialOrd + std::ops::AddAssign + std::ops::SubAssign + std::ops::MulAssign + 'static
{
    fn of(x: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn neg_infinity() -> Self;
    fn fmax(self, other: Self) -> Self;
    /// xs ← exp(xs) (vectorised for f32, see [`exp`]).
    fn exp_in_place(xs: &mut [Self]);
    /// Σ exp(x − shift) over xs.
    fn sum_exp(xs: &[Self], shift: Self) -> Self;
    /// out ← silu(g) · u (vectorised for f32, see [`swiglu`]).
    fn silu_mul(out: &mut [Self], g: &[Self], u: &[Self]);
}

macro_rules! real {
    ($t:ty, $exp_in_place:path, $sum_exp:path, $silu_mul:path) => {
        impl Real for $t {
            fn of(x: f64) -> Self {
                x as $t
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn neg_infinity() -> Self {
                <$t>::NEG_INFINITY
            }
            fn fmax(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            fn exp_in_place(xs: &mut [Self]) {
                $exp_in_place(xs)
            }
            fn sum_exp(xs: &[Self], shift: Self) -> Self {
                $sum_exp(xs, shift)
            }
            fn silu_mul(out: &mut [Self], g: &[Self], u: &[Self]) {
                $silu_mul(out, g, u)
            }
        }
    };
}
real!(f32, exp::exp_f32_in_place, exp::sum_exp_f32, swiglu::silu_mul_f32);
real!(f64, exp::exp_f64_in_place, exp::sum_exp_f64, swiglu::silu_mul_plain);

/// The contiguous data of a kernel input (the wrappers make every input contiguous first).
pub(crate) fn data<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => Err(candle_core::Error::Msg("fused op: input is not contiguous".into())),
    }
}

/// Rows of `out` (each `width` long) filled by `f(row index, row)` on the current rayon pool,
/// in chunks large enough that the split pays.
pub(crate) fn par_rows<T: Send>(out: &mut [T], width: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if width == 0 {
        return; // rows of nothing: nothing to fill (and no chunks of size 0)
    }
    let rows_per_task = (16_384 / width.max(1)).max(1);
    out.par_chunks_mut(width).with_min_len(rows_per_task).enumerate().for_each(|(i, row)| f(i, row));
}

/// Runs `$body` with `$T` bound to the storage's float type; other dtypes are an error (the
/// wrappers only call the fused ops for f32 and f64).
macro_rules! dispatch_real {
    ($storage:expr, $T:ident => $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32(_) => {
                type $T = f32;
                $body
            }
            candle_core::CpuStorage::F64(_) => {
                type $T = f64;
                $body
            }
            _ => Err(candle_core::Error::Msg("fused op: f32 or f64 only".into())),
        }
    };
}
pub(crate) use dispatch_real;

#[cfg(test)]
pub(crate) mod testing {
    //! Comparing a fused op with its reference graph: values and gradients.
    use candle_core::{DType, Device, Tensor, Var};

    /// Deterministic pseudo-random values in [-scale, scale).
    pub fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    pub fn var(shape: &[usize], seed: u64, scale: f64, dtype: DType) -> Var {
        let n = shape.iter().product();
        let t = Tensor::from_vec(values(n, seed, scale), shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        Var::from_tensor(&t).unwrap()
    }

    /// Largest |a − b| / (1 + |b|) over the elements.
    pub fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.dims(), b.dims());
        let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        a.iter().zip(&b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f64::max)
    }

    /// Checks that `fused` and `reference` (functions of the same variables) agree in value and
    /// in the gradient of Σ out · w for a fixed random w, to `tol`.
    pub fn check(vars: &[Var], fused: impl Fn() -> Tensor, reference: impl Fn() -> Tensor, tol: f64, what: &str) {
        let (a, b) = (fused(), reference());
        let e = max_rel(&a, &b);
        assert!(e < tol, "{what}: values differ by {e}");
        let w = Tensor::from_vec(values(a.elem_count(), 99, 1.0), a.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(a.dtype())
            .unwrap();
        let ga = (&a * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (&b * &w).unwrap().sum_all().unwrap().backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            let (x, y) = (ga.get(v.as_tensor()).expect("fused grad"), gb.get(v.as_tensor()).expect("reference grad"));
            let e = max_rel(x, y);
            assert!(e < tol, "{what}: gradient of input {i} differs by {e}");
        }
    }
}
