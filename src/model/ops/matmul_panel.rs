//! y = x · Wᵀ for tens of rows of x (batched decoding), W in PyTorch's [out, in] layout, f32,
//! AVX-512, without packing W: the kernel [`super::matmul_wt`] uses from [`MIN_ROWS`] rows on.
//! Each output is one lane of an accumulator carried over all of k: [`super::matmul_wt`]'s order.
//!
//! ```text
//! xt = each panel of up to 64 rows of x transposed, [K, 16·V] (V = vectors of 16 rows)
//! for each block of W's rows (256 KiB, kept in L2), for each panel:
//!     for each block of kc(V) columns of k, for each block of R rows j..j+R of W:
//!         acc[r][v] += Σ_k broadcast(W[j+r, k]) · xt[k, 16v..16v+16]     (R·V = 24 registers)
//!         yt[j..j+R] = acc                                    (partial sums, [block, 16·V])
//!     y[panel rows, block] = ytᵀ
//! ```
//! Why not the dot-product kernel of matmul_wt: each of its outputs ends in a horizontal sum of
//! 16 lanes (shuffles on the port the second FMA unit uses), which at 64 rows costs about as much
//! as the products. Here every output stays a lane of an accumulator, every weight is read once
//! per panel as a broadcast (nothing packed), and only the small x panel and the outputs are
//! rearranged. The outputs go through yt because storing a tile's transpose straight into y
//! touches 32 rows of y at once, which at n ≥ 1024 (rows 4 KiB apart) all fall in one L1 set:
//! that halved the speed. Panels of 64 rows (V = 4, R = 6) rather than 32 (V = 2, R = 12): one
//! broadcast feeds four FMAs instead of two (10 loads per 24 FMAs, not 14), and at 64 rows W is
//! read once per call, not twice; with the panel 64-byte aligned that made the 64-row kernel
//! faster with W in L2 and in L3 alike (`cargo bench --bench kernels matmul`; figures in BENCHMARKS.md).

/// Rows from which this kernel takes over from the small-rows one.
pub const MIN_ROWS: usize = 16;

/// Rows of x per panel: 4 vectors of 16 (24 accumulators for 6 weight rows).
const PANEL: usize = 64;

/// Columns of x (k) per pass for a panel of V vectors: a [KC, 16·V] block of the panel is at
/// most 32 KiB, so that it stays in L1 while every weight block meets it.
const fn kc(v: usize) -> usize {
    (32 << 10) / (64 * v) / 16 * 16
}

/// `acc` plus R·V accumulators for R weight rows and V vectors of x rows over `kc` columns: `wr`
/// are the R weight rows and `xt` the panel, both from the first of those columns. Meanwhile the
/// same columns of the next R rows (from `next`, rows `stride` apart) are fetched into L2: the
/// hardware prefetchers do not follow 12 to 16 streams that each advance 4 bytes per step, and
/// without this a W from L3 ran the kernel at a third of its speed. Inlined into [`kernel`], so
/// compiled with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<const V: usize, const R: usize>(
    mut acc: [[std::arch::x86_64::__m512; V]; R],
    xt: *const f32,
    wr: &[*const f32; R],
    kc: usize,
    next: *const f32,
    stride: usize,
) -> [[std::arch::x86_64::__m512; V]; R] {
    use std::arch::x86_64::*;
    let mut kk = 0;
    while kk < kc {
        // One line of each next row per 16 columns.
        for r in 0..R {
            _mm_prefetch::<_MM_HINT_T1>(next.add(r * stride + kk).cast());
        }
        let step = |acc: &mut [[__m512; V]; R], kk: usize| {
            let vx: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(xt.add((kk * V + v) * 16)));
            for r in 0..R {
                let b = _mm512_set1_ps(*wr[r].add(kk));
                for v in 0..V {
                    acc[r][v] = _mm512_fmadd_ps(vx[v], b, acc[r][v]);
                }
            }
        };
        if kk + 16 <= kc {
            // A fixed count, unrolled: no loop counter between the FMAs.
            for u in 0..16 {
                step(&mut acc, kk + u);
            }
        } else {
            for kk in kk..kc {
                step(&mut acc, kk);
            }
        }
        kk += 16;
    }
    acc
}

/// yt[j, 16·V] = Σ_k W[c0 + j, k] · xt[k, ..] for the columns `cols` (c0 = their start), in blocks
/// of R weight rows (the last block repeats its last row; only real ones are stored) and KC
/// columns of k; yt holds the partial sums between k blocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn panel<const V: usize, const R: usize>(
    xt: &[f32],
    w: &[f32],
    yt: &mut [f32],
    k: usize,
    cols: std::ops::Range<usize>,
) {
    use std::arch::x86_64::*;
    let width = V * 16;
    let mut k0 = 0;
    while k0 < k {
        let kc = (k - k0).min(kc(V));
        let mut j = cols.start;
        while j < cols.end {
            let nj = (cols.end - j).min(R);
            let wr: [*const f32; R] = std::array::from_fn(|r| w.as_ptr().add((j + r.min(nj - 1)) * k + k0));
            let out = yt.as_mut_ptr().add((j - cols.start) * width);
            let acc = if k0 == 0 {
                [[_mm512_setzero_ps(); V]; R]
            } else {
                std::array::from_fn(|r| {
                    std::array::from_fn(|v| _mm512_loadu_ps(out.add(r.min(nj - 1) * width + v * 16)))
                })
            };
            // The next block's rows, or past the last one the first rows of the next k block
            // (wrapping_add: only ever a prefetch address, which may point past W).
            let next = match j + R < cols.end {
                true => w.as_ptr().wrapping_add((j + R) * k + k0),
                false => w.as_ptr().wrapping_add(cols.start * k + k0 + kc),
            };
            let acc = tile::<V, R>(acc, xt.as_ptr().add(k0 * width), &wr, kc, next, k);
            for (r, a) in acc.iter().enumerate().take(nj) {
                for (v, &lanes) in a.iter().enumerate() {
                    _mm512_storeu_ps(out.add(r * width + v * 16), lanes);
                }
            }
            j += R;
        }
        k0 += kc;
    }
}

/// The 16 × 16 block `rows` transposed in registers (unpack pairs, then quads, then 128-bit
/// lanes twice): 64 shuffles where element-wise copies would take 256 loads and stores.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // fixed counts over several arrays, unrolled
pub(super) unsafe fn transpose16(r: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // Plain loops with fixed counts, no closures: a closure that LLVM does not inline is compiled
    // without the caller's AVX-512 and turns every intrinsic into a call (it did so from
    // matmul_wt's small-rows kernel, many times slower).
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..16 {
        let (a, b) = (r[i & !1], r[i | 1]);
        t[i] = if i % 2 == 0 { _mm512_unpacklo_ps(a, b) } else { _mm512_unpackhi_ps(a, b) };
    }
    // u[4g + h]: from t[4g + (h / 2)] and t[4g + 2 + (h / 2)], low or high pairs of floats.
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..16 {
        let (g, h) = (i / 4, i % 4);
        let (a, b) = (_mm512_castps_pd(t[4 * g + h / 2]), _mm512_castps_pd(t[4 * g + 2 + h / 2]));
        u[i] = _mm512_castpd_ps(if h % 2 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) });
    }
    // v[8g + h]: 128-bit lanes 0, 2 (0x88) or 1, 3 (0xdd) of u[8g + h % 4] and u[8g + 4 + h % 4].
    let mut v = [_mm512_setzero_ps(); 16];
    for i in 0..16 {
        let (g, h) = (i / 8, i % 8);
        let (a, b) = (u[8 * g + h % 4], u[8 * g + 4 + h % 4]);
        v[i] = if h < 4 { _mm512_shuffle_f32x4::<0x88>(a, b) } else { _mm512_shuffle_f32x4::<0xdd>(a, b) };
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for i in 0..16 {
        let (a, b) = (v[i % 8], v[8 + i % 8]);
        out[i] = if i < 8 { _mm512_shuffle_f32x4::<0x88>(a, b) } else { _mm512_shuffle_f32x4::<0xdd>(a, b) };
    }
    out
}

/// The mask of the first `count` lanes of 16 (all of them from 16 on).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn lane_mask(count: usize) -> u16 {
    ((1u32 << count.min(16)) - 1) as u16
}

/// Bytes of W per column block: the block stays in L2 while every panel meets it, so that W
/// comes from memory (or L3) once per call however many panels there are.
const W_BLOCK_BYTES: usize = 256 << 10;

thread_local! {
    /// The panels and the products, kept between calls (fresh pages each step cost page faults).
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// y[i, j] for j in `cols`, all i; x is [m, k], w [n, k], y [m, n] row-major, written through a
/// raw pointer so that threads can fill disjoint column ranges.
///
/// # Safety
/// The CPU has AVX-512F; x, w and y have those sizes; no one else writes y's `cols` meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn kernel(x: &[f32], w: &[f32], y: *mut f32, m: usize, n: usize, k: usize, cols: std::ops::Range<usize>) {
    use std::arch::x86_64::*;
    let panels = m.div_ceil(PANEL);
    // Columns per block: a multiple of every block height (16, 12, 8 and 6).
    let block = (W_BLOCK_BYTES / (4 * k)).next_multiple_of(48);
    SCRATCH.with_borrow_mut(|(xt, yt)| {
        // Every panel transposed, [K, width] each (width = its rows rounded up to 16); lanes past
        // its rows are zero (computed, never stored).
        xt.resize(panels * k * PANEL + 16, 0.0);
        // The products with 16 spare rows, which the transposition reads past a block's end.
        yt.resize((block + 16) * PANEL + 16, 0.0);
        // Both from a cache-line boundary: a vector load across two lines costs two.
        let (xa, ya) = (xt.as_ptr().align_offset(64), yt.as_ptr().align_offset(64));
        let (xt, yt) = (&mut xt[xa..], &mut yt[ya..]);
        let tail = lane_mask(k % 16);
        for p in 0..panels {
            let (i0, mi) = (p * PANEL, (m - p * PANEL).min(PANEL));
            let width = mi.div_ceil(16) * 16;
            let xt = xt[p * k * PANEL..].as_mut_ptr();
            for q0 in (0..mi).step_by(16) {
                for k0 in (0..k).step_by(16) {
                    let mask = if k0 + 16 <= k { u16::MAX } else { tail };
                    let rows = std::array::from_fn(|q| match q0 + q < mi {
                        true => _mm512_maskz_loadu_ps(mask, x.as_ptr().add((i0 + q0 + q) * k + k0)),
                        false => _mm512_setzero_ps(),
                    });
                    for (c, col) in transpose16(rows).into_iter().enumerate().take(k - k0) {
                        _mm512_storeu_ps(xt.add((k0 + c) * width + q0), col);
                    }
                }
            }
        }
        let mut c0 = cols.start;
        while c0 < cols.end {
            let c1 = (c0 + block).min(cols.end);
            for p in 0..panels {
                let (i0, mi) = (p * PANEL, (m - p * PANEL).min(PANEL));
                let width = mi.div_ceil(16) * 16;
                let (xt, products) = (&xt[p * k * PANEL..][..k * width], &mut yt[..(c1 - c0) * width]);
                // R·V ≤ 24 accumulators (+ V x vectors) of the 32 registers.
                match width {
                    16 => panel::<1, 16>(xt, w, products, k, c0..c1),
                    32 => panel::<2, 12>(xt, w, products, k, c0..c1),
                    48 => panel::<3, 8>(xt, w, products, k, c0..c1),
                    _ => panel::<4, 6>(xt, w, products, k, c0..c1),
                }
                // yt [c1 - c0, width] → y[i0.., c0..c1] by 16 × 16 blocks.
                let nb = c1 - c0;
                for jb in (0..nb).step_by(16) {
                    let cols_mask = lane_mask(nb - jb);
                    for q0 in (0..mi).step_by(16) {
                        let block = std::array::from_fn(|c| _mm512_loadu_ps(yt.as_ptr().add((jb + c) * width + q0)));
                        for (q, row) in transpose16(block).into_iter().enumerate().take(mi - q0) {
                            _mm512_mask_storeu_ps(y.add((i0 + q0 + q) * n + c0 + jb), cols_mask, row);
                        }
                    }
                }
            }
            c0 = c1;
        }
    })
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::super::testing::values;

    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|kk| x[i * k + kk] as f64 * w[j * k + kk] as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    #[test]
    fn equals_reference_on_ragged_sizes() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        // Rows past a panel and within one (each V), k not a multiple of 16, n not a multiple
        // of any block height, a column range that starts inside the matrix.
        for (m, k, n) in [(1, 5, 3), (17, 37, 7), (33, 64, 130), (50, 16, 13), (64, 256, 4096), (130, 100, 29)] {
            let x: Vec<f32> = values(m * k, 1, 1.0).into_iter().map(|v| v as f32).collect();
            let w: Vec<f32> = values(n * k, 2, 1.0).into_iter().map(|v| v as f32).collect();
            let want = reference(&x, &w, m, n, k);
            for cols in [0..n, n / 3..n] {
                let mut y = vec![f32::NAN; m * n];
                // Safety: AVX-512F detected; sizes as declared.
                unsafe { super::kernel(&x, &w, y.as_mut_ptr(), m, n, k, cols.clone()) };
                for i in 0..m {
                    for j in 0..n {
                        let got = y[i * n + j];
                        if cols.contains(&j) {
                            let e = want[i * n + j];
                            assert!((got - e).abs() <= 1e-5 * (1.0 + e.abs()), "{m}x{k}x{n} y[{i},{j}]: {got} vs {e}");
                        } else {
                            assert!(got.is_nan(), "{m}x{k}x{n}: column {j} outside {cols:?} written");
                        }
                    }
                }
            }
        }
    }
}
