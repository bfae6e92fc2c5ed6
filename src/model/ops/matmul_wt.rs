//! y = x · Wᵀ for up to 128 rows of x (decoding), W in PyTorch's [out, in] layout, f32, AVX-512.
//!
//! candle's matmul hands `W.t()` to the `gemm` crate, which packs the whole weight into its
//! blocked layout on every call: with a handful of rows (one decode step) the packing costs
//! more than the arithmetic (47 % of a batch-1 decode run, 25 % at 64 rows). Here each output
//! is a dot product of two contiguous rows, so nothing is packed: blocks of 4 weight rows
//! (kept in L1) meet the x rows four at a time, 16 AVX-512 accumulators of 16 lanes, reduced at
//! the end of the row. From [`matmul_panel::MIN_ROWS`] rows on, those per-output reductions cost
//! as much as the products and [`matmul_panel`]'s outer-product kernel takes over (see
//! [`kernel_for`]). Column blocks are split over the rayon pool. Used for at most [`MAX_ROWS`]
//! rows of f32 on CPUs with AVX-512F; everything else (prefill and training batches, other dtypes
//! and devices) takes gemm as candle's matmul does ([`super::matmul`]), which is also the backward.

use candle_core::{Shape, Tensor};

use super::custom_op::{grad_for, Cpu, FusedOp, Op};
use super::{matmul_panel, Real};
use crate::Result;

/// Rows of x up to which the kernels beat gemm (measured on the benchmark model's shapes).
pub const MAX_ROWS: usize = 128;

/// The op (see [`matmul_wt`]).
struct MatmulWt;

fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// y[i..i+min(Q, m-i), j..j+nj] for 4 weight rows `wr` (repeats past nj) and Q x rows from i
/// (rows past m repeat the last; only real ones are stored). Inlined into [`kernel`], so it is
/// compiled with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn rows_block<const Q: usize>(
    x: &[f32],
    wr: [*const f32; 4],
    y: *mut f32,
    i: usize,
    j: usize,
    nj: usize,
    n: usize,
    k: usize,
    full: usize,
    tail: std::arch::x86_64::__mmask16,
) {
    use std::arch::x86_64::*;
    let m = x.len() / k;
    let mi = (m - i).min(Q);
    let xr: [*const f32; Q] = std::array::from_fn(|q| x.as_ptr().add((i + q.min(mi - 1)) * k));
    let mut acc = [[_mm512_setzero_ps(); 4]; Q];
    let mut kk = 0;
    while kk < full {
        let vx: [__m512; Q] = std::array::from_fn(|q| _mm512_loadu_ps(xr[q].add(kk)));
        for r in 0..4 {
            let vw = _mm512_loadu_ps(wr[r].add(kk));
            for q in 0..Q {
                acc[q][r] = _mm512_fmadd_ps(vx[q], vw, acc[q][r]);
            }
        }
        kk += 16;
    }
    if tail != 0 {
        let vx: [__m512; Q] = std::array::from_fn(|q| _mm512_maskz_loadu_ps(tail, xr[q].add(full)));
        for r in 0..4 {
            let vw = _mm512_maskz_loadu_ps(tail, wr[r].add(full));
            for q in 0..Q {
                acc[q][r] = _mm512_fmadd_ps(vx[q], vw, acc[q][r]);
            }
        }
    }
    for q in 0..mi {
        for r in 0..nj {
            *y.add((i + q) * n + j + r) = _mm512_reduce_add_ps(acc[q][r]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
/// y[i, j] for j in `cols`, all i; y is [m, n] row-major, written through a raw pointer so that
/// threads can fill disjoint column ranges.
unsafe fn kernel(x: &[f32], w: &[f32], y: *mut f32, m: usize, n: usize, k: usize, cols: std::ops::Range<usize>) {
    use std::arch::x86_64::__mmask16;
    let full = k / 16 * 16;
    let tail: __mmask16 = ((1u32 << (k - full)) - 1) as __mmask16;
    let mut j = cols.start;
    while j < cols.end {
        let nj = (cols.end - j).min(4);
        let wr: [*const f32; 4] = std::array::from_fn(|r| w.as_ptr().add((j + r.min(nj - 1)) * k));
        let mut i = 0;
        while i < m {
            // Up to 4 x rows per pass; fewer at the end (one row alone: decoding at batch 1).
            let mi = (m - i).min(4);
            match mi {
                1 => rows_block::<1>(x, wr, y, i, j, nj, n, k, full, tail),
                2 => rows_block::<2>(x, wr, y, i, j, nj, n, k, full, tail),
                _ => rows_block::<4>(x, wr, y, i, j, nj, n, k, full, tail),
            }
            i += mi;
        }
        j += 4;
    }
}

/// A kernel filling y[.., cols] (see [`kernel`]).
#[cfg(target_arch = "x86_64")]
pub type Kernel = unsafe fn(&[f32], &[f32], *mut f32, usize, usize, usize, std::ops::Range<usize>);

/// The faster kernel for m rows: dot products for a few, outer products over x panels from
/// [`matmul_panel::MIN_ROWS`] on.
#[cfg(target_arch = "x86_64")]
pub fn kernel_for(m: usize) -> Kernel {
    if m >= matmul_panel::MIN_ROWS {
        matmul_panel::kernel
    } else {
        kernel
    }
}

/// y [m, n] = x [m, k] · w [n, k]ᵀ by `kernel` (every element written), column blocks split
/// over the rayon pool when the work is worth a hand-off. AVX-512F must have been detected.
#[cfg(target_arch = "x86_64")]
pub fn run(kernel: Kernel, x: &[f32], w: &[f32], y: &mut [std::mem::MaybeUninit<f32>], m: usize, n: usize, k: usize) {
    use rayon::prelude::*;
    assert!(supported() && x.len() == m * k && w.len() == n * k && y.len() == m * n);
    struct Out(*mut f32);
    // Safety: each task writes only its own columns of y, which outlives the tasks.
    unsafe impl Sync for Out {}
    let out = Out(y.as_mut_ptr().cast::<f32>());
    // Split only work worth a hand-off (about 100 µs on one core and up).
    let threads = if m * n * k >= 1 << 23 { rayon::current_num_threads() } else { 1 };
    // Column blocks of at least 64 (a multiple of the kernels' block heights), one or more per
    // thread.
    let block = n.div_ceil(threads).next_multiple_of(48).max(64);
    let out = &out;
    let run = |c: usize| {
        let cols = c * block..((c + 1) * block).min(n);
        // Safety: AVX-512F was checked above; x, w are [m, k], [n, k]; y is [m, n].
        unsafe { kernel(x, w, out.0, m, n, k, cols) }
    };
    let blocks = n.div_ceil(block);
    if blocks == 1 {
        // No hand-off to the pool: from a thread outside it that costs tens of µs.
        run(0);
    } else {
        (0..blocks).into_par_iter().for_each(run);
    }
}

impl FusedOp<2> for MatmulWt {
    fn name(&self) -> &'static str {
        "matmul-wt"
    }

    /// f32 only: for f64, reading x as f32 is an error.
    fn cpu<T: Real>(&self, [xs, ws]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (m, k) = xs.shape().dims2()?;
        let (n, k2) = ws.shape().dims2()?;
        if k != k2 || !supported() {
            return Err(candle_core::Error::Msg(format!("matmul-wt: x {:?}, w {:?}", xs.dims(), ws.dims())));
        }
        let (x, w) = (xs.data::<f32>()?, ws.data::<f32>()?);
        // Not zero-filled: the kernels write every element.
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        #[cfg(target_arch = "x86_64")]
        {
            run(kernel_for(m), x, w, y.spare_capacity_mut(), m, n, k);
            // Safety: `run` wrote all m · n elements.
            unsafe { y.set_len(m * n) };
        }
        // T is f32 (x was read as f32): the vector moves out as it is.
        let y = (Box::new(y) as Box<dyn std::any::Any>)
            .downcast::<Vec<T>>()
            .map_err(|_| candle_core::Error::Msg("matmul-wt: f32 only".into()))?;
        Ok((*y, Shape::from((m, n))))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _res: &Tensor, g: &Tensor) -> candle_core::Result<[Option<Tensor>; 2]> {
        let dx = super::matmul::matmul(g, w).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let dw = super::matmul::matmul(&g.t()?, x).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok([grad_for(x, dx), grad_for(w, dw)])
    }
}

/// x [M, K] · w [N, K]ᵀ → [M, N].
pub fn matmul_wt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let fast = x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && w.dtype() == candle_core::DType::F32
        && x.rank() == 2
        && w.rank() == 2
        && x.dim(0)? <= MAX_ROWS
        && x.dim(1)? == w.dim(1)?
        && supported();
    if !fast {
        return reference(x, w);
    }
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Op(MatmulWt))?)
}

/// The product with the transposed view, through gemm as candle's matmul ([`super::matmul`]).
pub fn reference(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    super::matmul::matmul(x, &w.t()?)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, var};
    use super::*;
    use candle_core::DType;

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
        // Odd sizes: a row without a partner, a partial column block, a k tail; both kernels
        // (the panel one from 16 rows), and column ranges split over threads (m·n·k ≥ 2²³).
        for (m, k, n) in [(1, 256, 1024), (3, 37, 7), (32, 64, 130), (5, 16, 3), (40, 300, 1100), (17, 256, 2048)] {
            let x = var(&[m, k], 1, 1.0, DType::F32);
            let w = var(&[n, k], 2, 1.0, DType::F32);
            let (xt, wt) = (x.as_tensor(), w.as_tensor());
            check(
                &[x.clone(), w.clone()],
                || matmul_wt(xt, wt).unwrap(),
                || reference(xt, wt).unwrap(),
                1e-5,
                &format!("{m}x{k}x{n}"),
            );
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod timing {
    use super::*;
    use candle_core::Device;

    /// `cargo test --release --lib matmul_wt::timing -- --ignored --nocapture`: GFLOP/s of
    /// candle's matmul, the dot-product kernel and the panel kernel on the benchmark model's
    /// shapes, one thread.
    #[test]
    #[ignore]
    fn kernels_gflops() {
        if !supported() {
            return;
        }
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        pool.install(|| {
            for m in [1, 8, 16, 32, 64, 128, 960] {
                for (n, k) in [(256, 256), (1024, 256), (256, 1024), (4096, 256)] {
                    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
                    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
                    let (xv, wv) = (
                        x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    );
                    let reps = (200_000_000 / (m * n * k)).max(3);
                    let time = |f: &mut dyn FnMut()| {
                        f();
                        let t = std::time::Instant::now();
                        for _ in 0..reps {
                            f();
                        }
                        2.0 * (m * n * k) as f64 * reps as f64 / t.elapsed().as_secs_f64() / 1e9
                    };
                    let g = time(&mut || {
                        reference(&x, &w).unwrap();
                    });
                    let mut y: Vec<f32> = Vec::with_capacity(m * n);
                    let d = time(&mut || run(kernel, &xv, &wv, y.spare_capacity_mut(), m, n, k));
                    let p = time(&mut || run(matmul_panel::kernel, &xv, &wv, y.spare_capacity_mut(), m, n, k));
                    // As in a decode step: W comes from L3 or memory (32 MiB of weights in turn).
                    let cold: Vec<Vec<f32>> = (0..(8 << 20) / (n * k) + 1).map(|_| wv.clone()).collect();
                    let mut c = 0;
                    let pc = time(&mut || {
                        c = (c + 1) % cold.len();
                        run(matmul_panel::kernel, &xv, &cold[c], y.spare_capacity_mut(), m, n, k)
                    });
                    let dc = time(&mut || {
                        c = (c + 1) % cold.len();
                        run(kernel, &xv, &cold[c], y.spare_capacity_mut(), m, n, k)
                    });
                    println!("m {m:4} n {n:4} k {k:4}: gemm {g:6.1}  dot {d:6.1} (cold W {dc:6.1})  panel {p:6.1} (cold W {pc:6.1}) GFLOP/s");
                }
            }
        });
    }
}
