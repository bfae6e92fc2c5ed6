//! The CUDA side of the fused ops (`--features cuda`): the PTX that build.rs compiled from
//! `ops/cuda/*.cu` (a module per op), and what every op's `cuda_fwd` needs to launch it on
//! candle's storages.
//!
//! Kernels exist for f32, bf16 and f16 (entry points `<kernel>_f32`, `_bf16`, `_f16`); each
//! computes in f32 and rounds once when it writes. Inputs are contiguous (the wrappers make
//! them so) and read from their layout's start offset. Row kernels take a block of
//! [`ROW_THREADS`] per row (the attention softmax's short rows a warp each); elementwise
//! kernels a grid-stride loop. The kernels' logic is
//! tested on the CPU by `tests/cuda_emulation` (every build) and against each op's `reference`
//! on a GPU by `tests/gpu.rs`.

use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};

/// A PTX module: its name in candle's cache of loaded modules, and its text.
pub(crate) struct Module {
    pub name: &'static str,
    pub ptx: &'static str,
}

macro_rules! module {
    ($file:literal) => {
        Module { name: concat!("oxrl_", $file), ptx: include_str!(concat!(env!("OUT_DIR"), "/", $file, ".ptx")) }
    };
}

pub(crate) const RMS_NORM: Module = module!("rms_norm");
pub(crate) const ROPE: Module = module!("rope");
pub(crate) const SWIGLU: Module = module!("swiglu");
pub(crate) const LOGPROB_LSE: Module = module!("logprob_lse");
pub(crate) const SOFTMAX: Module = module!("softmax");
pub(crate) const CACHED_ATTENTION: Module = module!("cached_attention");
pub(crate) const SAMPLE_ROWS: Module = module!("sample_rows");
pub(crate) const ADAMW: Module = module!("adamw");
pub(crate) const TRANSPOSE: Module = module!("transpose");
pub(crate) const EMBEDDING: Module = module!("embedding");
pub(crate) const ADD: Module = module!("add");
pub(crate) const FLASH_ATTENTION: Module = module!("flash_attention");

/// Threads per block of a row kernel (a block per row; any multiple of 32 up to 1024 works).
pub(crate) const ROW_THREADS: u32 = 256;

/// Threads per block of an elementwise kernel, and the most blocks its grid-stride loop takes.
const ELEMENTWISE_THREADS: u32 = 256;
const ELEMENTWISE_MAX_BLOCKS: usize = 4096;

/// The element types with kernels, and the suffix of their entry points.
pub(crate) trait Elem: candle_core::cuda_backend::CudaDType + DeviceRepr {
    const SUFFIX: &'static str;
}
impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
}
impl Elem for half::bf16 {
    const SUFFIX: &'static str = "bf16";
}
impl Elem for half::f16 {
    const SUFFIX: &'static str = "f16";
}

/// The entry point of `kernel` for T.
pub(crate) fn entry<T: Elem>(kernel: &str) -> String {
    format!("{kernel}_{}", T::SUFFIX)
}

/// The contiguous data of a kernel input (from its start offset), as `T` (an [`Elem`], or u32
/// for token ids).
pub(crate) fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let (a, b) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("fused op: input is not contiguous".into()))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// The CUDA storage of a tensor an op holds (not one of the inputs candle hands it), for
/// [`view`]; an error naming the op and the tensor where it is elsewhere.
pub(crate) fn held<'a>(storage: &'a candle_core::Storage, op: &str, what: &str) -> Result<&'a CudaStorage> {
    match storage {
        candle_core::Storage::Cuda(s) => Ok(s),
        _ => Err(candle_core::Error::Msg(format!("{op}: the {what} is not on the GPU"))),
    }
}

/// A block of [`ROW_THREADS`] for each of `rows` rows.
pub(crate) fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Rows of a warp each, [`ROW_THREADS`] / 32 rows to a block.
pub(crate) fn per_warp_row(rows: usize) -> LaunchConfig {
    let blocks = rows.div_ceil(ROW_THREADS as usize / 32);
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// A grid-stride launch over n elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEMENTWISE_THREADS as usize).clamp(1, ELEMENTWISE_MAX_BLOCKS);
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (ELEMENTWISE_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Runs `$body` with `$T` bound to the storage's element type (f32, bf16 or f16).
macro_rules! dispatch_cuda {
    ($storage:expr, $T:ident => $body:expr) => {
        match &$storage.slice {
            candle_core::cuda_backend::CudaStorageSlice::F32(_) => {
                type $T = f32;
                $body
            }
            candle_core::cuda_backend::CudaStorageSlice::BF16(_) => {
                type $T = half::bf16;
                $body
            }
            candle_core::cuda_backend::CudaStorageSlice::F16(_) => {
                type $T = half::f16;
                $body
            }
            _ => Err(candle_core::Error::Msg("fused op on CUDA: f32, bf16 or f16 only".into())),
        }
    };
}
pub(crate) use dispatch_cuda;

/// Launches entry point `$entry` of `$module` on `$dev`'s stream with `$cfg` and the arguments
/// (references to device views or to plain values, in the kernel's order). A grid with no
/// blocks in some dimension (no rows) launches nothing.
macro_rules! launch {
    ($dev:expr, $module:expr, $entry:expr, $cfg:expr; $($arg:expr),+ $(,)?) => {{
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg as _;
        use candle_core::cuda_backend::WrapErr as _;
        let cfg: candle_core::cuda_backend::cudarc::driver::LaunchConfig = $cfg;
        if cfg.grid_dim.0 > 0 && cfg.grid_dim.1 > 0 && cfg.grid_dim.2 > 0 {
            let func = $dev.get_or_load_custom_func(&$entry, $module.name, $module.ptx)?;
            let mut builder = func.builder();
            $(builder.arg($arg);)+
            // Safety: the arguments are the kernel's parameters, in order and of their types
            // (the .cu file's PARAMS macro), and every view is as long as the kernel reads.
            unsafe { builder.launch(cfg) }.w()?;
        }
    }};
}
pub(crate) use launch;

/// A new device buffer of n elements, to be written whole by a kernel.
pub(crate) fn output<T: Elem>(
    s: &CudaStorage,
    n: usize,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
    // Safety: every caller's kernel writes all n elements before anything reads them. (At
    // least one element: no zero-byte allocation reaches the driver.)
    unsafe { s.device.alloc::<T>(n.max(1)) }
}

/// Wraps a kernel's output as a storage of `s`'s device.
pub(crate) fn storage<T: Elem>(
    s: &CudaStorage,
    out: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(out, s.device.clone())
}
