//! y = x · Wᵀ, W in PyTorch's [out, in] layout, f32: the projection of every forward that a
//! sampler or a trainer runs, in one summation order whatever the batch.
//!
//! **The order.** Every output is one chain of fused multiply-adds over k, from zero, in order:
//! ```text
//! y[i, j] = fma(x[i, K−1], W[j, K−1], … fma(x[i, 1], W[j, 1], fma(x[i, 0], W[j, 0], 0)) …)
//! ```
//! (`(0..K).fold(0.0, |a, k| x[i,k].mul_add(W[j,k], a))`, [`reference_order`]). It does not
//! depend on how many rows share the call, where the row sits among them, how the columns are
//! split over threads or which kernel runs: a token's logits are the same bits alone, in a batch
//! of 64, in a prefill or in the trainer's forward. Every kernel keeps an output in
//! one vector lane and carries its partial sum over k blocks, so each computes exactly this:
//! - an engine's weights packed once per weight version ([`Packed`], lanes = outputs): below
//!   [`matmul_panel::MIN_ROWS`] rows one load and one FMA per 16 outputs and row (decoding at
//!   batch 1 reads W at memory speed, bf16 weights at half the bytes), from there tiles of 6 rows
//!   × 64 outputs;
//! - weights that are not packed (a trainer's variables, LoRA factors): from
//!   [`matmul_panel::MIN_ROWS`] rows [`matmul_panel`]'s outer products (lanes = x rows), below it
//!   [`small_rows`] (blocks of 16 weight rows transposed in registers, lanes = outputs);
//! - without AVX-512F, a portable kernel with lanes over x rows (compiled for AVX2 + FMA where
//!   the CPU has them).
//!
//! Simplification: one chain per output is 4-cycle-latency bound only per output; the kernels
//! keep 16 to 24 independent chains in flight, which is what a blocked GEMM does too. gemm's own
//! order (partial sums per k block, added) depends on its blocking, so gemm is not used for the
//! forward any more; it still runs the backward ([`super::matmul`]).

use candle_core::{Shape, Tensor};

use super::custom_op::{grad_for, Cpu, FusedOp, Op};
use super::{matmul_panel, Real};
use crate::Result;

/// The op (see [`matmul_wt`]).
struct MatmulWt;

fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The defining order, one output at a time (tests compare every kernel with it bit for bit).
pub fn reference_order(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k).fold(0f32, |a, kk| x[i * k + kk].mul_add(w[j * k + kk], a));
        }
    }
    y
}

/// y[.., cols] for fewer than 16 rows of x (R rows, R ≤ 15): per block of 16 weight rows and 16
/// columns of k, the 16 × 16 block is transposed in registers (lanes = the 16 outputs) and meets
/// each x row's 16 values as broadcasts; R accumulators + 16 weight vectors fit the 32 registers.
///
/// # Safety
/// AVX-512F; x [m, k], w [n, k], y [m, n]; m < 32 − 16; nobody else writes y's `cols`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn small_rows(
    x: &[f32],
    w: &[f32],
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    match m {
        1 => small_any::<1>(x, w, y, 1, n, k, cols),
        2 => small_any::<2>(x, w, y, 2, n, k, cols),
        3 | 4 => small_any::<4>(x, w, y, m, n, k, cols),
        5..=8 => small_any::<8>(x, w, y, m, n, k, cols),
        _ => small_any::<15>(x, w, y, m, n, k, cols),
    }
}

/// [`small_rows`] for m ≤ R rows (rows past m read row m − 1 again and are not stored).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn small_any<const R: usize>(
    x: &[f32],
    w: &[f32],
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    use std::arch::x86_64::*;
    // (Plain loops, no closures: a closure that is not inlined is compiled without AVX-512.)
    let mut xr = [x.as_ptr(); R];
    for (r, p) in xr.iter_mut().enumerate() {
        *p = x.as_ptr().add(r.min(m - 1) * k);
    }
    let tail_k = matmul_panel::lane_mask(k % 16);
    let mut j = cols.start;
    while j < cols.end {
        let nj = (cols.end - j).min(16);
        // Rows past nj repeat the last one (computed, not stored): every loop below has a fixed
        // count, so that it unrolls and the 16 weight vectors stay in registers.
        let mut wr = [w.as_ptr(); 16];
        for (c, p) in wr.iter_mut().enumerate() {
            *p = w.as_ptr().add((j + c.min(nj - 1)) * k);
        }
        let mut acc = [_mm512_setzero_ps(); R];
        let mut k0 = 0;
        while k0 + 16 <= k {
            let mut rows = [_mm512_setzero_ps(); 16];
            for c in 0..16 {
                rows[c] = _mm512_loadu_ps(wr[c].add(k0));
            }
            let wt = matmul_panel::transpose16(rows);
            for (kk, col) in wt.iter().enumerate() {
                for r in 0..R {
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(*xr[r].add(k0 + kk)), *col, acc[r]);
                }
            }
            k0 += 16;
        }
        if k0 < k {
            let mut rows = [_mm512_setzero_ps(); 16];
            for c in 0..16 {
                rows[c] = _mm512_maskz_loadu_ps(tail_k, wr[c].add(k0));
            }
            let wt = matmul_panel::transpose16(rows);
            for (kk, col) in wt.iter().enumerate().take(k - k0) {
                for r in 0..R {
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(*xr[r].add(k0 + kk)), *col, acc[r]);
                }
            }
        }
        let mask = matmul_panel::lane_mask(nj);
        for (r, a) in acc.iter().enumerate().take(m) {
            _mm512_mask_storeu_ps(y.add(r * n + j), mask, *a);
        }
        j += 16;
    }
}

/// W [n, k] laid out for `packed_rows`: per block of 16 outputs, their weights column by
/// column ([ceil(n/16)]\[k\]\[16\], zero past n), so that the 16 outputs' weights at one k are one
/// vector load. An engine packs each weight once per weight version ([`crate::model::linear`]).
/// bf16 weights stay bf16 (half the bytes to read; widened to f32 in registers, exactly).
#[derive(Debug)]
pub struct Packed {
    n: usize,
    k: usize,
    data: PackedData,
}

#[derive(Debug)]
enum PackedData {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

/// The packed layout of `w` [n, k], elements of any type.
fn pack<T: Copy + Default>(w: &[T], n: usize, k: usize) -> Vec<T> {
    assert_eq!(w.len(), n * k, "packing [{n}, {k}]");
    let mut data = vec![T::default(); n.div_ceil(16) * 16 * k];
    for (j, row) in w.chunks_exact(k.max(1)).enumerate().take(n) {
        let block = &mut data[(j / 16) * 16 * k..];
        for (kk, &v) in row.iter().enumerate() {
            block[kk * 16 + j % 16] = v;
        }
    }
    data
}

impl Packed {
    pub fn new(w: &[f32], n: usize, k: usize) -> Packed {
        Packed { n, k, data: PackedData::F32(pack(w, n, k)) }
    }

    /// From bf16 weights (their bit patterns, as `half::bf16::to_bits` gives them).
    pub fn new_bf16(w: &[u16], n: usize, k: usize) -> Packed {
        Packed { n, k, data: PackedData::Bf16(pack(w, n, k)) }
    }
}

/// y[.., cols] for the m rows of x against packed W (`cols` starting on a multiple of 16): below
/// [`matmul_panel::MIN_ROWS`] rows, per 16 outputs and per k one load and one FMA per row
/// (decoding at a few rows reads W at the speed of memory); from there [`packed_tiles`]. Both
/// are the chain of [`reference_order`].
///
/// # Safety
/// AVX-512F; x [m, k], y [m, n]; m ≤ 15; nobody else writes y's `cols`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn packed_rows(x: &[f32], p: &Packed, y: *mut f32, m: usize, cols: std::ops::Range<usize>) {
    match &p.data {
        PackedData::F32(w) => packed_rows_of(x, w.as_ptr(), p, y, m, cols),
        PackedData::Bf16(w) => packed_rows_of(x, w.as_ptr(), p, y, m, cols),
    }
}

/// A packed weight element type: 16 of them loaded as 16 f32 lanes.
#[cfg(target_arch = "x86_64")]
trait Lanes: Copy {
    /// # Safety
    /// AVX-512F; 16 elements readable at `p`.
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

#[cfg(target_arch = "x86_64")]
impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for u16 {
    /// bf16 → f32 is exact: the 16 bits become the high half of the f32.
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(halves))
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn packed_rows_of<W: Lanes>(
    x: &[f32],
    w: *const W,
    p: &Packed,
    y: *mut f32,
    m: usize,
    cols: std::ops::Range<usize>,
) {
    if m >= matmul_panel::MIN_ROWS {
        return packed_tiles::<W>(x, w, p, y, m, cols);
    }
    match m {
        1 => packed_any::<W, 1>(x, w, p, y, 1, cols),
        2 => packed_any::<W, 2>(x, w, p, y, 2, cols),
        3 | 4 => packed_any::<W, 4>(x, w, p, y, m, cols),
        5..=8 => packed_any::<W, 8>(x, w, p, y, m, cols),
        _ => packed_any::<W, 15>(x, w, p, y, m, cols),
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn packed_any<W: Lanes, const R: usize>(
    x: &[f32],
    w: *const W,
    p: &Packed,
    y: *mut f32,
    m: usize,
    cols: std::ops::Range<usize>,
) {
    use std::arch::x86_64::*;
    let (n, k) = (p.n, p.k);
    let mut xr = [x.as_ptr(); R];
    for (r, q) in xr.iter_mut().enumerate() {
        *q = x.as_ptr().add(r.min(m - 1) * k);
    }
    let mut j = cols.start;
    while j < cols.end {
        let nj = (cols.end - j).min(16);
        let block = w.add((j / 16) * 16 * k);
        let mut acc = [_mm512_setzero_ps(); R];
        for kk in 0..k {
            let wv = W::load16(block.add(kk * 16));
            for r in 0..R {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(*xr[r].add(kk)), wv, acc[r]);
            }
        }
        let mask = matmul_panel::lane_mask(nj);
        for (r, a) in acc.iter().enumerate().take(m) {
            _mm512_mask_storeu_ps(y.add(r * n + j), mask, *a);
        }
        j += 16;
    }
}

/// Rows of x per tile of [`packed_tiles`] and vectors of 16 outputs per tile: 6 × 4 = 24
/// accumulators, 4 weight vectors and a broadcast in the 32 registers.
#[cfg(target_arch = "x86_64")]
const TILE_ROWS: usize = 6;
#[cfg(target_arch = "x86_64")]
const TILE_VECS: usize = 4;
/// Columns of k per pass: a tile's 64 outputs' weights over KC columns (64 KiB in f32) stay in
/// L2 while every row tile meets them.
#[cfg(target_arch = "x86_64")]
const TILE_KC: usize = 256;

/// y[.., cols] for many rows against packed W (`cols` starting on a multiple of 16): tiles of 6
/// rows × 64 outputs, the last tile of the rows as many as are left (a 64-row batch is 10 tiles
/// of 6 and one of 4, not 11 of 6 with 2 computed for nothing); k in passes of [`TILE_KC`] with
/// the partial sums kept in y between passes (stored and reloaded exactly, so each output is
/// still one chain over k in order).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn packed_tiles<W: Lanes>(
    x: &[f32],
    w: *const W,
    p: &Packed,
    y: *mut f32,
    m: usize,
    cols: std::ops::Range<usize>,
) {
    let (n, k) = (p.n, p.k);
    let last_block = (n - 1) / 16;
    let mut j = cols.start;
    while j < cols.end {
        // The tile's vectors: past the columns they repeat the last 16-block (computed, not stored).
        let mut cols_of = TileCols { w: [w; TILE_VECS], masks: [0u16; TILE_VECS], j };
        for v in 0..TILE_VECS {
            let c = j + 16 * v;
            cols_of.w[v] = w.add((c / 16).min(last_block) * 16 * k);
            cols_of.masks[v] = matmul_panel::lane_mask(cols.end.saturating_sub(c));
        }
        let mut k0 = 0;
        while k0 < k {
            let ks = k0..(k0 + TILE_KC).min(k);
            // The next pass's weights (the next k columns, else the next column block) are
            // fetched towards L2 during the second row tile, a line per block and k column.
            let next: [*const W; TILE_VECS] = match ks.end < k {
                true => std::array::from_fn(|v| cols_of.w[v].wrapping_add(ks.end * 16)),
                false => {
                    std::array::from_fn(|v| w.wrapping_add(((j + 16 * (TILE_VECS + v)) / 16).min(last_block) * 16 * k))
                }
            };
            let fetch_next = ks.end < k || j + 16 * TILE_VECS < cols.end;
            let c = &cols_of;
            let mut i0 = 0;
            while i0 + TILE_ROWS <= m {
                match fetch_next && i0 == TILE_ROWS {
                    true => tile::<W, TILE_ROWS, true>(x, c, y, i0, n, k, ks.clone(), next),
                    false => tile::<W, TILE_ROWS, false>(x, c, y, i0, n, k, ks.clone(), next),
                }
                i0 += TILE_ROWS;
            }
            match m - i0 {
                0 => {}
                1 => tile::<W, 1, false>(x, c, y, i0, n, k, ks.clone(), next),
                2 => tile::<W, 2, false>(x, c, y, i0, n, k, ks.clone(), next),
                3 => tile::<W, 3, false>(x, c, y, i0, n, k, ks.clone(), next),
                4 => tile::<W, 4, false>(x, c, y, i0, n, k, ks.clone(), next),
                _ => tile::<W, 5, false>(x, c, y, i0, n, k, ks.clone(), next),
            }
            k0 = ks.end;
        }
        j += 16 * TILE_VECS;
    }
}

/// A column block of [`packed_tiles`]: its weight vectors, store masks, first output column.
#[cfg(target_arch = "x86_64")]
struct TileCols<W> {
    w: [*const W; TILE_VECS],
    masks: [u16; TILE_VECS],
    j: usize,
}

/// One tile of [`packed_tiles`]: rows i0..i0 + R against the block's 64 outputs over k in `ks`,
/// continuing the chains stored in y when `ks` does not start at 0; with FETCH, the weight blocks
/// at `next` (the same k offsets relative to `ks`) prefetched into L2 alongside.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)] // fixed counts over several arrays, unrolled
unsafe fn tile<W: Lanes, const R: usize, const FETCH: bool>(
    x: &[f32],
    c: &TileCols<W>,
    y: *mut f32,
    i0: usize,
    n: usize,
    k: usize,
    ks: std::ops::Range<usize>,
    next: [*const W; TILE_VECS],
) {
    use std::arch::x86_64::*;
    let mut xr = [x.as_ptr(); R];
    for r in 0..R {
        xr[r] = x.as_ptr().add((i0 + r) * k);
    }
    let mut acc = [[_mm512_setzero_ps(); TILE_VECS]; R];
    if ks.start > 0 {
        for r in 0..R {
            for v in 0..TILE_VECS {
                acc[r][v] = _mm512_maskz_loadu_ps(c.masks[v], y.wrapping_add((i0 + r) * n + c.j + 16 * v));
            }
        }
    }
    let k0 = ks.start;
    for kk in ks {
        let mut wv = [_mm512_setzero_ps(); TILE_VECS];
        for v in 0..TILE_VECS {
            wv[v] = W::load16(c.w[v].add(kk * 16));
        }
        if FETCH {
            // Past the weights' end a prefetch reads nothing (it cannot fault).
            for b in next {
                _mm_prefetch::<_MM_HINT_T1>(b.wrapping_add((kk - k0) * 16).cast());
            }
        }
        for r in 0..R {
            let b = _mm512_set1_ps(*xr[r].add(kk));
            for v in 0..TILE_VECS {
                acc[r][v] = _mm512_fmadd_ps(b, wv[v], acc[r][v]);
            }
        }
    }
    for r in 0..R {
        for v in 0..TILE_VECS {
            _mm512_mask_storeu_ps(y.wrapping_add((i0 + r) * n + c.j + 16 * v), c.masks[v], acc[r][v]);
        }
    }
}

/// y [m, n] = x [m, k] · Wᵀ for W packed, in [`reference_order`]; None where the packed kernels
/// do not run (no AVX-512F).
pub fn xwt_packed(x: &[f32], p: &Packed, m: usize) -> Option<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    if avx512() && m > 0 && p.k > 0 && x.len() == m * p.k {
        use rayon::prelude::*;
        let n = p.n;
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        struct Out(*mut f32);
        // Safety: each task writes only its own columns of y, which outlives the tasks.
        unsafe impl Sync for Out {}
        let out = Out(y.spare_capacity_mut().as_mut_ptr().cast::<f32>());
        // Split over the pool from 1 Mi multiply-adds (≈ 10 µs on one core): at 2 threads a
        // 64-row decode's k/v projections (2 Mi) and a 16-row one's q/o (1 Mi) ran on one thread
        // under the old 4 Mi (the A/B: BENCHMARKS.md).
        let threads = if m * n * p.k >= 1 << 20 { rayon::current_num_threads() } else { 1 };
        let block = n.div_ceil(threads).next_multiple_of(64).max(64);
        let out = &out;
        let run = |c: usize| {
            // Safety: AVX-512F detected; sizes as checked; column blocks are disjoint.
            unsafe { packed_rows(x, p, out.0, m, c * block..((c + 1) * block).min(n)) }
        };
        match n.div_ceil(block) {
            1 => run(0),
            blocks => (0..blocks).into_par_iter().for_each(run),
        }
        // Safety: the kernel wrote all m · n elements.
        unsafe { y.set_len(m * n) };
        return Some(y);
    }
    let _ = (x, p, m);
    None
}

/// The op of [`matmul_wt_packed`]: inference only (no backward).
struct MatmulWtPacked(std::sync::Arc<Packed>);

impl candle_core::CustomOp1 for MatmulWtPacked {
    fn name(&self) -> &'static str {
        "matmul-wt-packed"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        let x = super::data::<f32>(s, l)?;
        match (k == self.0.k).then(|| xwt_packed(x, &self.0, m)).flatten() {
            Some(y) => Ok((candle_core::CpuStorage::F32(y), Shape::from((m, self.0.n)))),
            None => Err(candle_core::Error::Msg(format!(
                "matmul-wt-packed: x {:?} against [{}, {}]",
                l.dims(),
                self.0.n,
                self.0.k
            ))),
        }
    }
}

/// x [M, K] · Wᵀ with W packed ([`Packed`]), for an inference forward; None where the packed
/// kernels do not serve (the caller takes [`matmul_wt`]). Same bits as [`matmul_wt`].
pub fn matmul_wt_packed(x: &Tensor, p: &std::sync::Arc<Packed>) -> Result<Option<Tensor>> {
    let serves = avx512()
        && x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && x.rank() == 2
        && x.dim(1)? == p.k
        && !x.track_op();
    if !serves {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op1_no_bwd(&MatmulWtPacked(p.clone()))?))
}

/// The portable kernel: x transposed to [k, m], then per output column one chain per row, the m
/// rows side by side (LLVM vectorises the inner loop over rows; `mul_add` is a fused multiply-add
/// with FMA, and correctly rounded in software without).
#[inline(always)]
fn portable_body(x: &[f32], w: &[f32], y: &mut [f32], m: usize, n: usize, k: usize) {
    let mut xt = vec![0f32; k * m];
    for i in 0..m {
        for kk in 0..k {
            xt[kk * m + i] = x[i * k + kk];
        }
    }
    let mut acc = vec![0f32; m];
    for j in 0..n {
        acc.iter_mut().for_each(|a| *a = 0.0);
        let wj = &w[j * k..(j + 1) * k];
        for (kk, &wv) in wj.iter().enumerate() {
            for (a, &xv) in acc.iter_mut().zip(&xt[kk * m..(kk + 1) * m]) {
                *a = xv.mul_add(wv, *a);
            }
        }
        for (i, &a) in acc.iter().enumerate() {
            y[i * n + j] = a;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn portable_fma(x: &[f32], w: &[f32], y: &mut [f32], m: usize, n: usize, k: usize) {
    portable_body(x, w, y, m, n, k)
}

fn portable(x: &[f32], w: &[f32], y: &mut [f32], m: usize, n: usize, k: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // Safety: the features were detected.
        return unsafe { portable_fma(x, w, y, m, n, k) };
    }
    portable_body(x, w, y, m, n, k)
}

/// A kernel filling y[.., cols] (see [`small_rows`]).
#[cfg(target_arch = "x86_64")]
pub type Kernel = unsafe fn(&[f32], &[f32], *mut f32, usize, usize, usize, std::ops::Range<usize>);

/// The kernel for m rows (AVX-512F): transposed weight blocks below
/// [`matmul_panel::MIN_ROWS`], x panels from there on. Both compute [`reference_order`].
#[cfg(target_arch = "x86_64")]
pub fn kernel_for(m: usize) -> Kernel {
    if m >= matmul_panel::MIN_ROWS {
        matmul_panel::kernel
    } else {
        small_rows
    }
}

/// y [m, n] = x [m, k] · w [n, k]ᵀ by `kernel` (every element written), column blocks split
/// over the rayon pool when the work is worth a hand-off. AVX-512F must have been detected.
#[cfg(target_arch = "x86_64")]
pub fn run(kernel: Kernel, x: &[f32], w: &[f32], y: &mut [std::mem::MaybeUninit<f32>], m: usize, n: usize, k: usize) {
    use rayon::prelude::*;
    assert!(avx512() && x.len() == m * k && w.len() == n * k && y.len() == m * n);
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

/// y [m, n] = x [m, k] · w [n, k]ᵀ in [`reference_order`], on the current rayon pool.
pub fn xwt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert!(x.len() == m * k && w.len() == n * k, "xwt: x {} and w {} for [{m}, {k}] · [{n}, {k}]ᵀ", x.len(), w.len());
    if m == 0 || n == 0 {
        return vec![0f32; m * n];
    }
    if k == 0 {
        return vec![0f32; m * n];
    }
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // Not zero-filled: the kernels write every element.
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        run(kernel_for(m), x, w, y.spare_capacity_mut(), m, n, k);
        // Safety: `run` wrote all m · n elements.
        unsafe { y.set_len(m * n) };
        return y;
    }
    let mut y = vec![0f32; m * n];
    portable(x, w, &mut y, m, n, k);
    y
}

/// [`xwt`] for the tape's element type: f32 takes the fixed order; f64 (tests, HF parity) gemm.
pub fn xwt_real<T: Real>(x: &[T], w: &[T], m: usize, n: usize, k: usize) -> Option<Vec<T>> {
    let (x, w) = (same::<T, f32>(x)?, same::<T, f32>(w)?);
    let y = xwt(x, w, m, n, k);
    // T is f32: the vector moves out as it is.
    (Box::new(y) as Box<dyn std::any::Any>).downcast::<Vec<T>>().ok().map(|b| *b)
}

/// `x` as a slice of U when T is U.
fn same<T: 'static, U: 'static>(x: &[T]) -> Option<&[U]> {
    // Safety: T and U are one type.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>())
        .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<U>(), x.len()) })
}

impl FusedOp<2> for MatmulWt {
    fn name(&self) -> &'static str {
        "matmul-wt"
    }

    /// f32 only: for f64, reading x as f32 is an error.
    fn cpu<T: Real>(&self, [xs, ws]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (m, k) = xs.shape().dims2()?;
        let (n, k2) = ws.shape().dims2()?;
        if k != k2 {
            return Err(candle_core::Error::Msg(format!("matmul-wt: x {:?}, w {:?}", xs.dims(), ws.dims())));
        }
        let y = xwt_real::<T>(xs.data::<T>()?, ws.data::<T>()?, m, n, k)
            .ok_or_else(|| candle_core::Error::Msg("matmul-wt: f32 only".into()))?;
        Ok((y, Shape::from((m, n))))
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
        && x.dim(1)? == w.dim(1)?;
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

    fn values(n: usize, seed: u64) -> Vec<f32> {
        super::super::testing::values(n, seed, 1.0).into_iter().map(|v| v as f32).collect()
    }

    /// Every kernel, every row count (both sides of the small-rows / panel switch and of a
    /// panel), k with a tail and without, column splits over threads: the defining order's
    /// bits, and each row equal to itself computed alone.
    #[test]
    fn every_row_count_gives_the_reference_orders_bits() {
        // k = 600: the packed tiles run k in passes of 256 (partial sums stored and reloaded).
        for (k, n) in [(37, 29), (64, 130), (256, 1100), (600, 140), (5, 3)] {
            let w = values(n * k, 2);
            let x = values(70 * k, 1);
            let alone: Vec<Vec<f32>> = (0..70).map(|i| xwt(&x[i * k..(i + 1) * k], &w, 1, n, k)).collect();
            for m in [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 20, 31, 33, 64, 65, 66, 70] {
                let want = reference_order(&x[..m * k], &w, m, n, k);
                let mut y = vec![0f32; m * n];
                portable(&x[..m * k], &w, &mut y, m, n, k);
                assert_eq!(y, want, "portable {m}x{k}x{n}");
                for threads in [1, 2, 3] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let got = pool.install(|| xwt(&x[..m * k], &w, m, n, k));
                    assert_eq!(got, want, "{m}x{k}x{n} at {threads} threads");
                }
                for i in 0..m {
                    assert_eq!(&want[i * n..(i + 1) * n], &alone[i][..], "row {i} of {m} differs from alone");
                }
                let packed = Packed::new(&w, n, k);
                if let Some(got) = xwt_packed(&x[..m * k], &packed, m) {
                    assert_eq!(got, want, "packed {m}x{k}x{n}");
                }
                // bf16 weights: the order on the widened values.
                let w16: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
                let wide: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
                let bits: Vec<u16> = w16.iter().map(|v| v.to_bits()).collect();
                if let Some(got) = xwt_packed(&x[..m * k], &Packed::new_bf16(&bits, n, k), m) {
                    assert_eq!(got, reference_order(&x[..m * k], &wide, m, n, k), "packed bf16 {m}x{k}x{n}");
                }
            }
        }
    }

    #[test]
    fn fused_equals_reference_in_value_and_gradient() {
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
