//! Attention of a few new queries over the KV cache (decoding), fused, inference only.
//!
//! q [B, H, T, D] (rotated), k and v [B, KV, S, D], bias [B, T, S] (additive: 0 or a large
//! negative number), scale. Per (batch row b, kv head g), for each of the rep = H / KV query heads
//! h sharing g and each query row i:
//! ```text
//! s_j = q[b,h,i] · k[b,g,j]                       (j < S)
//! p   = softmax(scale · s + bias[b,i])            (softmax::forward_row's steps, as masked_softmax)
//! out[b, i, h·D .. (h+1)·D] = Σ_j p_j · v[b,g,j]   (keys with p_j = 0, masked ones, skipped)
//! ```
//! The output is [B, T, H·D], o_proj's input layout, written in place (no transpose copy). k and
//! v are read through their layout (start offset and strides; the last dimension must be
//! contiguous): the cache hands out `narrow` views of its spare-column buffers, which are never
//! copied here.
//!
//! The candle path ([`reference()`]) runs this as two batched matmuls over B·KV matrices of
//! [rep·T, D] × [D, S] (a `gemm` call per matrix), a softmax, dtype casts and a transpose copy.
//! Here one task per (b, g) takes the rep·T query rows sharing the kv head in groups of up to
//! `GROUP`: each key row read serves the whole group's dot products, each value row its
//! weighted sums. The weighted sums keep the group's output columns in registers over the keys
//! (16-lane blocks, vectorised by LLVM; compiled for AVX-512 and for AVX2 + FMA, chosen at run
//! time). The dot products are 16-lane accumulators too; for f32 on AVX-512 they are written
//! with intrinsics, because the horizontal sum that ends each one is where LLVM fails (see
//! `dots_f32_avx512`). Scratch: a few rows of S per task, nothing per query. Tasks are split
//! over the rayon pool only when the call is worth a hand-off ([`MIN_PARALLEL_WORK`]).
//!
//! Measured (`cargo bench --bench kernels attention`, BENCHMARKS.md): faster than the candle path for decode
//! steps at every batch and for short prefills. The candle path was the better one for query blocks of 32 and more after a long cache (gemm's blocking
//! pays), but it sums in gemm's order: every cached forward takes this op now, and the trainer's
//! forward runs the same rows (`forward_slices`), so a token's log-prob is one set of bits
//! however it was computed. The normaliser of each softmax is summed key by key
//! (`softmax::normalise_rows`), the weighted sums add key by key: padding and masked keys,
//! exactly zero, change nothing wherever they sit.
//!
//! No backward through the op: nothing trains through a cached forward (the callers with a cache are the
//! rollout engine's decode steps and its prompt prefill, `rollout::engine_core` and
//! `rollout::prefill`, whose outputs are sampled or scored, never differentiated; training runs
//! the tape or the uncached candle graph). The op is applied with `apply_op3` all the same, so
//! that a backward through it fails loudly (candle's `BackwardNotSupported`) instead of
//! silently cutting the gradient.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use super::cuda::{self, launch};
#[cfg(feature = "cuda")]
use super::custom_op::Cuda;
use super::custom_op::{Cpu, FusedOp, Op};
use super::{data, dot, fused, norm_dtype, softmax, Real};
use crate::{Error, Result};

/// Multiply-adds of one product (B·H·T·S·D) from which the tasks are split over the rayon
/// pool: about 30 µs on one core (below it a pool of 2 gained nothing: BENCHMARKS.md).
pub const MIN_PARALLEL_WORK: usize = 1 << 17;

/// Lanes of the vectorised dot products and weighted sums.
const LANES: usize = 16;

/// The op (holds the bias, converted to the queries' dtype and contiguous).
struct CachedAttention {
    bias: Tensor,
    scale: f64,
    /// Whether f32 may take the AVX-512 dot products (false: the portable kernel, for tests).
    simd: bool,
}

/// A [B, KV, S, D] tensor read in place: rows of D at `start + b·strides[0] + g·strides[1] +
/// j·strides[2]`.
#[derive(Clone, Copy)]
struct Heads<'a, T> {
    data: &'a [T],
    start: usize,
    strides: [usize; 3],
    d: usize,
}

impl<'a, T: WithDType> Heads<'a, T> {
    fn new(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<Self> {
        let err = |m: String| candle_core::Error::Msg(format!("cached-attention: {what} {m}"));
        let (dims, st) = (l.dims(), l.stride());
        if dims.len() != 4 {
            return Err(err(format!("has shape {dims:?}, expected [B, KV, S, D]")));
        }
        if dims[3] > 1 && st[3] != 1 {
            return Err(err(format!("has strides {st:?}: the last dimension must be contiguous")));
        }
        let data = s.as_slice::<T>()?;
        if dims.iter().all(|&n| n > 0) {
            let last = l.start_offset() + (0..3).map(|i| (dims[i] - 1) * st[i]).sum::<usize>() + dims[3];
            if last > data.len() {
                return Err(err(format!("layout {l:?} reaches past its storage ({})", data.len())));
            }
        }
        Ok(Heads { data, start: l.start_offset(), strides: [st[0], st[1], st[2]], d: dims[3] })
    }

    #[inline(always)]
    fn row(&self, b: usize, g: usize, j: usize) -> &'a [T] {
        let o = self.start + b * self.strides[0] + g * self.strides[1] + j * self.strides[2];
        &self.data[o..o + self.d]
    }
}

/// Everything one task reads.
struct Inputs<'a, T> {
    q: &'a [T],
    k: Heads<'a, T>,
    v: Heads<'a, T>,
    bias: &'a [T],
    /// (H, KV, T, S, D).
    dims: (usize, usize, usize, usize, usize),
    scale: f64,
    /// T is f32 and the CPU has AVX-512F: the dot products take [`dots_f32_avx512`].
    avx512_f32: bool,
    /// Where the probabilities go when the caller keeps them ([B, H, T, S]: the tape's
    /// backward), or None.
    probs_out: Option<OutPtr<T>>,
}

/// A buffer the tasks fill in disjoint parts.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// Safety: the tasks write disjoint rows (see `rows`), and the buffer outlives them.
unsafe impl<T> Sync for OutPtr<T> {}
unsafe impl<T> Send for OutPtr<T> {}

/// Query rows processed together: each key row read serves all of them.
const GROUP: usize = 4;

/// Key rows prefetched ahead of the one whose products run ([`dots_f32_avx512`]).
const AHEAD: usize = 8;

/// Key and value rows of the next task prefetched before a task runs ([`prefetch_task`]): all
/// of a long cache's rows at once overran the fetches in flight (slower decode steps after long
/// prompts than with this and [`AHEAD`]: BENCHMARKS.md).
const BULK: usize = 32;

/// scores[r·S + j] = q_r·k_j for the N query rows `q` (N·D, contiguous) and the keys j < `keys`,
/// 0 for the rest (keys no row sees: [`visible_keys`]): the portable kernel ([`super::dot`], 16
/// lanes).
#[inline(always)]
fn dots<T: Real, const N: usize>(q: &[T], k: &Heads<T>, b: usize, g: usize, keys: usize, scores: &mut [T]) {
    let (d, s) = (k.d, scores.len() / N);
    for (r, scores) in scores.chunks_exact_mut(s).enumerate() {
        let q = &q[r * d..(r + 1) * d];
        for (j, sj) in scores.iter_mut().enumerate() {
            *sj = if j < keys { dot(q, k.row(b, g, j)) } else { T::of(0.0) };
        }
    }
}

/// A bias at or below this masks its key: the score added to it rounds away (any |score · scale|
/// below 10²¹ leaves −10³⁰, the model's mask, as it is) and its probability is exactly 0.
const MASK_BIAS: f64 = -1e29;

/// 1 + the last key that any of the `rows` bias rows (each S long) leaves visible: in a causal
/// forward the keys after the group's last query are masked for all of it, and their dot
/// products (half of a whole sequence's) need not run. A masked key's shifted score is its bias
/// whatever the product, so the probabilities are the same bits (for finite scores below 10²¹).
#[inline(always)]
fn visible_keys<T: Real>(rows: impl Iterator<Item = usize>, bias: &[T], s: usize) -> usize {
    let masked = T::of(MASK_BIAS);
    // Visible: above the mask, or NaN (not comparable: the product runs as before).
    let visible = |c: &T| !matches!(c.partial_cmp(&masked), Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal));
    rows.map(|i| bias[i * s..(i + 1) * s].iter().rposition(visible).map_or(0, |j| j + 1)).max().unwrap_or(s)
}

/// [`dots`] for f32 with AVX-512F: each key row loaded once for the N query rows, one
/// 16-lane accumulator per row (a masked load for the tail of D), summed by the shuffle tree
/// of `_mm512_reduce_add_ps`. LLVM does not find that tree for portable lanes (it narrows the
/// loop or sums the lanes one by one: 8–12 ns per query and key instead of 3.5 here).
///
/// Safety: AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_f32_avx512<const N: usize>(
    q: &[f32],
    k: &Heads<f32>,
    v: &Heads<f32>,
    b: usize,
    g: usize,
    keys: usize,
    scores: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (d, s) = (k.d, scores.len() / N);
    assert!(q.len() >= N * d);
    for r in 0..N {
        scores[r * s + keys.min(s)..(r + 1) * s].fill(0.0);
    }
    let full = d / LANES * LANES;
    let tail = ((1u32 << (d - full)) - 1) as __mmask16;
    for j in 0..keys.min(s) {
        let kr = k.row(b, g, j).as_ptr();
        // This key's value row (the weighted sums read it next) and the key row AHEAD on, a
        // line at a time while this key's products run (past the cache's end a prefetch reads
        // nothing, hence the wrapping pointer).
        let (vr, ka) = (v.row(b, g, j).as_ptr(), kr.wrapping_add(AHEAD * k.strides[2]));
        for c in (0..d).step_by(16) {
            _mm_prefetch::<_MM_HINT_T0>(vr.add(c).cast());
            _mm_prefetch::<_MM_HINT_T0>(ka.wrapping_add(c).cast());
        }
        let mut acc = [_mm512_setzero_ps(); N];
        let mut c = 0;
        while c < full {
            let y = _mm512_loadu_ps(kr.add(c));
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.as_ptr().add(r * d + c)), y, *acc);
            }
            c += LANES;
        }
        if tail != 0 {
            let y = _mm512_maskz_loadu_ps(tail, kr.add(full));
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q.as_ptr().add(r * d + full)), y, *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            scores[r * s + j] = _mm512_reduce_add_ps(*acc);
        }
    }
}

/// `x` as a slice of U when T is U.
fn same<T: 'static, U: 'static>(x: &[T]) -> Option<&[U]> {
    // Safety: T and U are one type.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>())
        .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<U>(), x.len()) })
}

/// W columns of a row, held in registers.
#[derive(Clone, Copy)]
struct Block<T, const W: usize>([T; W]);

/// out_r[c..c + W] = Σ_j p_rj · v_j[c..c + W] for the N rows (probabilities p_r = probs[r·S..]),
/// the N·W sums held in registers over all keys (each value row read once for the N rows, N·W/16
/// independent chains of adds); keys no row sees are skipped.
///
/// Safety: each of `outs` points to a row of at least c + W elements that nothing else accesses
/// meanwhile.
#[inline(always)]
unsafe fn weighted_sum<T: Real, const N: usize, const W: usize>(
    outs: &[*mut T; N],
    c: usize,
    probs: &[T],
    v: &Heads<T>,
    b: usize,
    g: usize,
) {
    let zero = T::of(0.0);
    let s = probs.len() / N;
    let mut acc = [Block([zero; W]); N];
    for j in 0..s {
        let mut p = [zero; N];
        for (r, p) in p.iter_mut().enumerate() {
            *p = probs[r * s + j];
        }
        let mut seen = false;
        for &p in &p {
            seen |= p != zero;
        }
        if !seen {
            continue;
        }
        let x: &[T; W] = v.row(b, g, j)[c..c + W].try_into().expect("W columns");
        for (acc, &p) in acc.iter_mut().zip(&p) {
            *acc = Block(std::array::from_fn(|l| acc.0[l] + p * x[l]));
        }
    }
    for (acc, &o) in acc.iter().zip(outs) {
        std::ptr::copy_nonoverlapping(acc.0.as_ptr(), o.add(c), W);
    }
}

/// The N query rows r0 .. r0 + N of task (b, g) (row r is query i = r mod T of head
/// g·rep + r / T): scores, softmax ([`softmax::forward_row`]'s steps, the exponentials of the
/// N rows in one call), weighted sum of values into `out`.
///
/// Safety: as [`task`].
#[inline(always)]
unsafe fn rows<T: Real, const N: usize>(
    x: &Inputs<T>,
    b: usize,
    g: usize,
    r0: usize,
    sc: &mut Scratch<T>,
    out: *mut T,
) {
    let (h, kvh, t, s, d) = x.dims;
    let rep = h / kvh;
    // The rep·T rows of the heads sharing kv head g are contiguous in q [B, H, T, D].
    let q = &x.q[((b * h + g * rep) * t + r0) * d..][..N * d];
    let (scores, probs) = (&mut sc.scores[..N * s], &mut sc.probs[..N * s]);
    let keys = visible_keys((0..N).map(|r| b * t + (r0 + r) % t), x.bias, s);
    match (x.avx512_f32, same::<T, f32>(q), same::<T, f32>(x.k.data), same::<T, f32>(x.v.data)) {
        #[cfg(target_arch = "x86_64")]
        (true, Some(q), Some(kd), Some(vd)) => {
            let k = Heads { data: kd, start: x.k.start, strides: x.k.strides, d };
            let v = Heads { data: vd, start: x.v.start, strides: x.v.strides, d };
            // Safety: T is f32, and AVX-512F was detected.
            let scores = std::slice::from_raw_parts_mut(scores.as_mut_ptr().cast::<f32>(), N * s);
            dots_f32_avx512::<N>(q, &k, &v, b, g, keys, scores);
        }
        _ => dots::<T, N>(q, &x.k, b, g, keys, scores),
    }
    // (Plain loops: a closure, as in array::from_fn, may not be inlined, and is then compiled
    // without the caller's target features.)
    let mut outs = [out; N];
    for (r, o) in outs.iter_mut().enumerate() {
        let (hi, i) = (g * rep + (r0 + r) / t, (r0 + r) % t);
        softmax::shifted_row(&mut probs[r * s..][..s], &scores[r * s..][..s], &x.bias[(b * t + i) * s..][..s], x.scale);
        // In bounds: out is [B, T, H·D].
        *o = out.add(((b * t + i) * h + hi) * d);
    }
    T::exp_in_place(probs);
    softmax::normalise_rows::<T, N>(probs, s);
    if let Some(p) = x.probs_out {
        for r in 0..N {
            let (hi, i) = (g * rep + (r0 + r) / t, (r0 + r) % t);
            // In bounds: probs_out is [B, H, T, S]; row (b, hi, i) is this task's alone.
            std::ptr::copy_nonoverlapping(probs[r * s..].as_ptr(), p.0.add(((b * h + hi) * t + i) * s), s);
        }
    }
    let mut c = 0;
    while c + 2 * LANES <= d {
        weighted_sum::<T, N, { 2 * LANES }>(&outs, c, probs, &x.v, b, g);
        c += 2 * LANES;
    }
    while c + LANES <= d {
        weighted_sum::<T, N, LANES>(&outs, c, probs, &x.v, b, g);
        c += LANES;
    }
    while c < d {
        weighted_sum::<T, N, 1>(&outs, c, probs, &x.v, b, g);
        c += 1;
    }
}

/// A task's scratch, reused for every group of rows: the scores and the probabilities of the
/// group's rows.
struct Scratch<T> {
    scores: Vec<T>,
    probs: Vec<T>,
}

impl<T: Real> Scratch<T> {
    fn new(s: usize) -> Self {
        Scratch { scores: vec![T::of(0.0); GROUP * s], probs: vec![T::of(0.0); GROUP * s] }
    }
}

/// The task (b, g): the rep·T query rows of the heads sharing kv head g, in groups of up to
/// [`GROUP`], into `out` ([B, T, H·D]).
///
/// Safety: `out` points to B·T·H·D elements; no other task writes the columns of heads
/// g·rep .. (g+1)·rep of batch row b.
#[inline(always)]
unsafe fn task<T: Real>(x: &Inputs<T>, b: usize, g: usize, scratch: &mut Scratch<T>, out: *mut T) {
    let (h, kvh, t, _, _) = x.dims;
    let n = h / kvh * t;
    let mut r0 = 0;
    while r0 < n {
        match n - r0 {
            1 => rows::<T, 1>(x, b, g, r0, scratch, out),
            2 => rows::<T, 2>(x, b, g, r0, scratch, out),
            3 => rows::<T, 3>(x, b, g, r0, scratch, out),
            _ => rows::<T, GROUP>(x, b, g, r0, scratch, out),
        }
        r0 += (n - r0).min(GROUP);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn task_avx512<T: Real>(x: &Inputs<T>, b: usize, g: usize, scratch: &mut Scratch<T>, out: *mut T) {
    task(x, b, g, scratch, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<T: Real>(x: &Inputs<T>, b: usize, g: usize, scratch: &mut Scratch<T>, out: *mut T) {
    task(x, b, g, scratch, out)
}

unsafe fn task_plain<T: Real>(x: &Inputs<T>, b: usize, g: usize, scratch: &mut Scratch<T>, out: *mut T) {
    task(x, b, g, scratch, out)
}

type Task<T> = unsafe fn(&Inputs<T>, usize, usize, &mut Scratch<T>, *mut T);

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

/// The fastest compiled [`task`] this CPU runs.
fn task_for<T: Real>() -> Task<T> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return task_avx512::<T>;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return task_avx2::<T>;
        }
    }
    task_plain::<T>
}

/// Asks for task i's first [`BULK`] key and value rows, every cache line, to be fetched into L2
/// while task i − 1 runs (the dot products fetch the rest as they go). A task's rows are a few
/// KiB of the cache each, tens of KiB apart: the hardware prefetchers start over at every one,
/// so without this the reads waited on L3 at every task.
#[inline(always)]
fn prefetch_task<T: Real>(x: &Inputs<T>, i: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let (_, kvh, _, s, d) = x.dims;
        let line = 64 / std::mem::size_of::<T>();
        for heads in [&x.k, &x.v] {
            for j in 0..s.min(BULK) {
                let row = heads.row(i / kvh, i % kvh, j);
                for c in (0..d).step_by(line) {
                    // Safety: a prefetch of an address inside the row; it reads nothing.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(row[c..].as_ptr().cast())
                    };
                }
            }
        }
    }
}

/// out [B, T, H·D] (zero-filled) from `x`, tasks over (b, g) on the rayon pool when the work is
/// worth it.
fn run<T: Real>(x: &Inputs<T>, b: usize, out: &mut [T]) {
    let (h, kvh, t, s, d) = x.dims;
    assert_eq!(out.len(), b * t * h * d);
    struct Out<T>(*mut T);
    // Safety: each task writes only its own heads' columns of out, which outlives the tasks.
    unsafe impl<T> Sync for Out<T> {}
    let out = Out(out.as_mut_ptr());
    let kernel = task_for::<T>();
    let tasks = b * kvh;
    let work = b * h * t * s * d;
    if tasks > 1 && work >= MIN_PARALLEL_WORK && rayon::current_num_threads() > 1 {
        let out = &out;
        (0..tasks).into_par_iter().for_each_init(
            || Scratch::new(s),
            |scratch, i| {
                // Safety: task i = (b, g) owns its columns; `kernel` runs on this CPU.
                unsafe { kernel(x, i / kvh, i % kvh, scratch, out.0) }
            },
        );
    } else {
        // No hand-off to the pool (at one thread, or for decode-sized work).
        let mut scratch = Scratch::new(s);
        for i in 0..tasks {
            if i + 1 < tasks {
                prefetch_task(x, i + 1);
            }
            // Safety: as above, one task at a time.
            unsafe { kernel(x, i / kvh, i % kvh, &mut scratch, out.0) }
        }
    }
}

/// The same attention on the trainer's slices, keeping the probabilities for the backward:
/// q [B, H, T, D], k [B, KV, T, D] (rotated), v in the projection layout [B·T, KV·D], bias
/// [B, T, T]. Returns (p [B, H, T, T], out [B·T, H·D]). The trainer's forward runs exactly the
/// decode kernel's arithmetic, so a token's log-prob is the same bits sampled or trained on.
pub(crate) fn forward_slices<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    bias: &[T],
    (b, h, kvh, t, d): (usize, usize, usize, usize, usize),
    scale: f64,
) -> (Vec<T>, Vec<T>) {
    assert!(q.len() == b * h * t * d && k.len() == b * kvh * t * d && v.len() == b * t * kvh * d);
    assert!(bias.len() == b * t * t && kvh > 0 && h % kvh == 0);
    let mut p = vec![T::of(0.0); b * h * t * t];
    let x = Inputs {
        q,
        k: Heads { data: k, start: 0, strides: [kvh * t * d, t * d, d], d },
        v: Heads { data: v, start: 0, strides: [t * kvh * d, d, kvh * d], d },
        bias,
        dims: (h, kvh, t, t, d),
        scale,
        avx512_f32: T::DTYPE == DType::F32 && avx512(),
        probs_out: Some(OutPtr(p.as_mut_ptr())),
    };
    let mut out = vec![T::of(0.0); b * t * h * d];
    if t > 0 {
        run(&x, b, &mut out);
    }
    (p, out)
}

/// (B, H, KV, T, S, D) from the layouts of q [B, H, T, D], k and v [B, KV, S, D] (KV dividing
/// H, S > 0) and the bias [B, T, S], or an error naming them.
fn op_dims(
    q: &Layout,
    k: &Layout,
    v: &Layout,
    bias: &Layout,
) -> candle_core::Result<(usize, usize, usize, usize, usize, usize)> {
    let (b, h, t, d) = q.shape().dims4()?;
    let (kb, kvh, s, kd) = k.shape().dims4()?;
    if k.dims() != v.dims() || kb != b || kd != d || kvh == 0 || h % kvh != 0 || s == 0 {
        return Err(candle_core::Error::Msg(format!(
            "cached-attention: q {:?}, k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    if bias.dims() != [b, t, s] {
        return Err(candle_core::Error::Msg(format!("cached-attention: bias {:?}", bias.dims())));
    }
    Ok((b, h, kvh, t, s, d))
}

impl FusedOp<3> for CachedAttention {
    fn name(&self) -> &'static str {
        "cached-attention"
    }

    fn cpu<T: Real>(&self, [q, k, v]: [Cpu<'_>; 3]) -> candle_core::Result<(Vec<T>, Shape)> {
        let (bias_storage, bias_layout) = self.bias.storage_and_layout();
        let (b, h, kvh, t, s, d) = op_dims(q.layout, k.layout, v.layout, bias_layout)?;
        let Storage::Cpu(bias_storage) = &*bias_storage else {
            return Err(candle_core::Error::Msg("cached-attention: the bias is not on the CPU".into()));
        };
        let x = Inputs {
            q: q.data::<T>()?,
            k: Heads::new(k.storage, k.layout, "k")?,
            v: Heads::new(v.storage, v.layout, "v")?,
            bias: data::<T>(bias_storage, bias_layout)?,
            dims: (h, kvh, t, s, d),
            scale: self.scale,
            avx512_f32: self.simd && T::DTYPE == DType::F32 && avx512(),
            probs_out: None,
        };
        let mut out = vec![T::of(0.0); b * t * h * d];
        run(&x, b, &mut out);
        Ok((out, Shape::from((b, t, h * d))))
    }

    /// A block of [`CUDA_THREADS`] per query row, its warps taking the keys in turn with an
    /// online softmax each (see `cuda/cached_attention.cu`); k and v read through their strides.
    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, [qs, ks, vs]: [Cuda<'_>; 3]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let (l2, l3) = (ks.layout, vs.layout);
        let (bias_storage, bias_layout) = self.bias.storage_and_layout();
        let (b, h, kvh, t, s, d) = op_dims(qs.layout, l2, l3, bias_layout)?;
        let strided_rows = |l: &Layout| d > 1 && l.stride()[3] != 1;
        if d > CUDA_MAX_HEAD_DIM || strided_rows(l2) || strided_rows(l3) {
            return Err(candle_core::Error::Msg(format!(
                "cached-attention: k {:?} / v {:?} (strides {:?} / {:?}) need rows of at most {CUDA_MAX_HEAD_DIM} contiguous values",
                l2.dims(),
                l3.dims(),
                l2.stride(),
                l3.stride()
            )));
        }
        let bias_storage = cuda::held(&bias_storage, "cached-attention", "bias")?;
        let q = qs.view::<T>()?;
        let k = ks.storage.as_cuda_slice::<T>()?.slice(l2.start_offset()..);
        let v = vs.storage.as_cuda_slice::<T>()?.slice(l3.start_offset()..);
        let bias = cuda::view::<T>(bias_storage, bias_layout)?;
        let out = cuda::output::<T>(qs.storage, b * t * h * d)?;
        let [hi, kvhi, ti, si, di] = [h, kvh, t, s, d].map(|x| x as i64);
        let [k_b, k_g, k_j] = [0, 1, 2].map(|i| l2.stride()[i] as i64);
        let [v_b, v_g, v_j] = [0, 1, 2].map(|i| l3.stride()[i] as i64);
        let scale = self.scale as f32;
        let cfg =
            LaunchConfig { grid_dim: ((b * h * t) as u32, 1, 1), block_dim: (CUDA_THREADS, 1, 1), shared_mem_bytes: 0 };
        launch!(qs.storage.device, cuda::CACHED_ATTENTION, cuda::entry::<T>("cached_attention"), cfg;
            &q, &k, &v, &bias, &out, &hi, &kvhi, &ti, &si, &di, &k_b, &k_g, &k_j, &v_b, &v_g, &v_j, &scale);
        Ok((out, Shape::from((b, t, h * d))))
    }
}

/// The largest head dimension of the CUDA kernel (its lanes hold D / 32 values each); larger
/// heads take the candle path.
pub const CUDA_MAX_HEAD_DIM: usize = 256;

/// Threads per block of the CUDA kernel: 4 warps (the kernel takes up to 8).
#[cfg(feature = "cuda")]
const CUDA_THREADS: u32 = 128;

/// Checks the shapes: q [B, H, T, D], k and v [B, KV, S, D] with KV dividing H, bias [B, T, S].
pub(crate) fn check(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Result<()> {
    let (b, h, t, d) = q.dims4()?;
    let (kb, kvh, s, kd) = k.dims4()?;
    let bad = kb != b || kd != d || v.dims() != k.dims() || kvh == 0 || h % kvh != 0 || s == 0;
    if bad {
        return Err(Error::input(format!(
            "attention: q {:?}, k {:?}, v {:?} (expected [B, H, T, D], [B, KV, S, D] twice, KV dividing H, S > 0)",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    if bias.dims() != [b, t, s] {
        return Err(Error::input(format!("attention: bias {:?}, expected [{b}, {t}, {s}]", bias.dims())));
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        return Err(Error::input(format!("attention: q {:?}, k {:?}, v {:?}", q.dtype(), k.dtype(), v.dtype())));
    }
    Ok(())
}

/// Attention output [B, T, H·D] (o_proj's input) for q [B, H, T, D], k and v [B, KV, S, D]
/// (views of the cache: read in place when their last dimension is contiguous) and the additive
/// bias [B, T, S] (any float dtype: converted to q's). Fused where [`fused`] says (on CUDA for
/// head dimensions up to [`CUDA_MAX_HEAD_DIM`]); the candle path ([`reference()`]) elsewhere. Inference only (see the module docs).
pub fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    check(q, k, v, bias)?;
    let bias = bias.to_dtype(q.dtype())?;
    if !fused(q) || (q.device().is_cuda() && q.dim(3)? > CUDA_MAX_HEAD_DIM) {
        return reference(q, k, v, &bias, scale);
    }
    // A view whose last dimension is strided (never one the cache hands out) is copied.
    let rows = |x: &Tensor| -> Result<Tensor> {
        Ok(if x.dim(3)? > 1 && x.stride()[3] != 1 { x.contiguous()? } else { x.clone() })
    };
    let op = CachedAttention { bias: bias.contiguous()?, scale, simd: true };
    Ok(q.contiguous()?.apply_op3(&rows(k)?, &rows(v)?, Op(op))?)
}

/// The candle path of `Attention::forward`: the rep query heads sharing a kv head folded into
/// the rows of one batched matmul, [`softmax::masked_softmax`] in f32 (f64 for f64), the
/// weighted sum, and the transpose to [B, T, H·D].
pub fn reference(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    check(q, k, v, bias)?;
    let (b, h, t, d) = q.dims4()?;
    let (_, kvh, s, _) = k.dims4()?;
    let rep = h / kvh;
    let dtype = q.dtype();
    let qg = q.reshape((b, kvh, rep * t, d))?;
    let scores = super::matmul::matmul(&qg, &k.t()?)?.reshape((b, h, t, s))?.to_dtype(softmax_dtype(dtype))?;
    let probs = softmax::masked_softmax(&scores, bias, scale)?.to_dtype(dtype)?.reshape((b, kvh, rep * t, s))?;
    Ok(super::matmul::matmul(&probs, v)?.reshape((b, h, t, d))?.transpose(1, 2)?.reshape((b, t, h * d))?)
}

/// The dtype the softmax runs in ([`norm_dtype`]): f64 for f64, else f32.
fn softmax_dtype(dtype: DType) -> DType {
    norm_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{max_rel, values};
    use super::*;
    use candle_core::{DType, Device};

    fn tensor(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_vec(values(n, seed, 1.5), shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    /// The bias `attention_bias` builds: query i (at `past + i`) sees key j ≤ past + i when key j
    /// is real; row r's first `pad[r]` keys are left padding.
    fn bias(pad: &[usize], past: usize, t: usize) -> Tensor {
        let s = past + t;
        let mask: Vec<Vec<u8>> = pad.iter().map(|&p| (0..s).map(|j| (j >= p) as u8).collect()).collect();
        crate::model::transformer::attention_bias(&mask, past, t, &Device::Cpu).unwrap()
    }

    /// f64 triple loop: out [B, T, H·D].
    fn naive(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Tensor {
        let (b, h, t, d) = q.dims4().unwrap();
        let (_, kvh, s, _) = k.dims4().unwrap();
        let f = |x: &Tensor| x.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let (q, k, v, bias) = (f(q), f(&k.contiguous().unwrap()), f(&v.contiguous().unwrap()), f(bias));
        let mut out = vec![0f64; b * t * h * d];
        for bi in 0..b {
            for hi in 0..h {
                let g = hi / (h / kvh);
                for i in 0..t {
                    let qr = &q[((bi * h + hi) * t + i) * d..][..d];
                    let z: Vec<f64> = (0..s)
                        .map(|j| {
                            let kr = &k[((bi * kvh + g) * s + j) * d..][..d];
                            scale * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() + bias[(bi * t + i) * s + j]
                        })
                        .collect();
                    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for j in 0..s {
                        let vr = &v[((bi * kvh + g) * s + j) * d..][..d];
                        for c in 0..d {
                            out[((bi * t + i) * h + hi) * d + c] += e[j] / sum * vr[c];
                        }
                    }
                }
            }
        }
        Tensor::from_vec(out, (b, t, h * d), &Device::Cpu).unwrap()
    }

    #[test]
    fn fused_equals_candle_path_and_naive_loop() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            // (B, H, KV, T, past, D): GQA rep 2 and rep 1, T = 1 and T = 5 after a past, D = 64
            // (four full lane chunks), 12 (remainder only) and 37 (chunks and a remainder).
            for (b, h, kvh, t, past, d) in [
                (3, 4, 2, 1, 7, 64),
                (3, 4, 2, 5, 6, 64),
                (2, 3, 3, 1, 9, 12),
                (2, 2, 2, 5, 4, 12),
                (3, 6, 2, 5, 3, 37),
                (1, 4, 1, 1, 0, 16),
            ] {
                let s = past + t;
                let what = format!("{dtype:?} B{b} H{h} KV{kvh} T{t} past{past} D{d}");
                let q = tensor(&[b, h, t, d], 1, dtype);
                // The cache's layout: [B, KV, capacity, D] buffers with spare columns, of which
                // k and v are the first S (and a trimmed cache's, starting past column 0).
                for (cap, from) in [(s, 0), (s + 11, 0), (s + 7, 3)] {
                    let kb = tensor(&[b, kvh, cap, d], 2, dtype);
                    let vb = tensor(&[b, kvh, cap, d], 3, dtype);
                    let (k, v) = (kb.narrow(2, from, s).unwrap(), vb.narrow(2, from, s).unwrap());
                    // (With one batch row and one kv head the view is contiguous all the same.)
                    assert_eq!(k.is_contiguous(), cap == s || b * kvh == 1, "{what}");
                    let (kc, vc) = (k.contiguous().unwrap(), v.contiguous().unwrap());
                    // Left padding: row 1 has 2 padded keys, row 2 all but the newest.
                    let pads: Vec<usize> = (0..b).map(|r| [0, 2, s - 1][r % 3].min(past)).collect();
                    let bias = bias(&pads, past, t);
                    let scale = 1.0 / (d as f64).sqrt();
                    let got = cached_attention(&q, &k, &v, &bias, scale).unwrap();
                    assert_eq!(got.dims(), [b, t, h * d], "{what}");
                    // The portable kernel (what f64 and CPUs without AVX-512 run) for f32 too.
                    let op = CachedAttention { bias: bias.to_dtype(dtype).unwrap(), scale, simd: false };
                    let portable = q.apply_op3(&k, &v, Op(op)).unwrap();
                    let want = reference(&q, &kc, &vc, &bias.to_dtype(dtype).unwrap(), scale).unwrap();
                    let e = max_rel(&got, &want);
                    assert!(e < tol, "{what} cap {cap} from {from}: fused vs candle path {e}");
                    let e = max_rel(&got, &naive(&q, &k, &v, &bias, scale));
                    assert!(e < tol, "{what} cap {cap} from {from}: fused vs naive loop {e}");
                    let e = max_rel(&portable, &want);
                    assert!(e < tol, "{what} cap {cap} from {from}: portable kernel vs candle path {e}");
                    // The candle path reads the views too (the transformer's fallback).
                    let e = max_rel(&reference(&q, &k, &v, &bias.to_dtype(dtype).unwrap(), scale).unwrap(), &want);
                    assert!(e < tol, "{what}: candle path on views vs contiguous {e}");
                }
            }
        }
    }

    #[test]
    fn masked_keys_do_not_count() {
        // A masked key with a huge value must not leak into the output.
        let (b, h, kvh, t, s, d) = (1, 2, 1, 1, 4, 8);
        let q = tensor(&[b, h, t, d], 1, DType::F32);
        let k = tensor(&[b, kvh, s, d], 2, DType::F32);
        let mut vv = values(b * kvh * s * d, 3, 1.0);
        vv[..d].iter_mut().for_each(|x| *x = 1e20);
        let v = Tensor::from_vec(vv, (b, kvh, s, d), &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        let bias = bias(&[1], s - 1, 1);
        let got = cached_attention(&q, &k, &v, &bias, 0.3).unwrap();
        let max = got.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(max < 2.0, "{max}");
        let want = reference(&q, &k, &v, &bias, 0.3).unwrap();
        assert!(max_rel(&got, &want) < 1e-5);
    }

    /// A causal block of queries (the keys after each one masked, and with them skipped) gives
    /// every query the bits of its decode step alone over the keys it sees; left padding too.
    #[test]
    fn causal_block_rows_are_their_decode_steps_bits() {
        let (b, h, kvh, past, t, d) = (2, 4, 2, 3, 9, 24);
        let s = past + t;
        let pad = [0, 2];
        for simd in [true, false] {
            let q = tensor(&[b, h, t, d], 1, DType::F32);
            let (k, v) = (tensor(&[b, kvh, s, d], 2, DType::F32), tensor(&[b, kvh, s, d], 3, DType::F32));
            let op = |q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor| {
                let op = CachedAttention { bias: bias.contiguous().unwrap(), scale: 0.2, simd };
                q.apply_op3(k, v, Op(op)).unwrap()
            };
            let block = op(&q, &k, &v, &bias(&pad, past, t));
            for i in 0..t {
                let seen = past + i + 1;
                let alone = op(
                    &q.narrow(2, i, 1).unwrap().contiguous().unwrap(),
                    &k.narrow(2, 0, seen).unwrap(),
                    &v.narrow(2, 0, seen).unwrap(),
                    &bias(&pad, past + i, 1),
                );
                let row = block.narrow(1, i, 1).unwrap();
                assert_eq!(
                    crate::test_support::bits(&row),
                    crate::test_support::bits(&alone),
                    "query {i}, simd {simd}"
                );
            }
        }
    }

    #[test]
    fn parallel_split_equals_one_task_at_a_time() {
        // Work above MIN_PARALLEL_WORK on a pool of 3: the tasks run on the pool.
        let (b, h, kvh, t, past, d) = (8, 4, 2, 4, 300, 64);
        assert!(b * h * t * (past + t) * d >= MIN_PARALLEL_WORK);
        let q = tensor(&[b, h, t, d], 1, DType::F32);
        let k = tensor(&[b, kvh, past + t, d], 2, DType::F32);
        let v = tensor(&[b, kvh, past + t, d], 3, DType::F32);
        let bias = bias(&[0, 5, 0, 100, 0, 0, 299, 1], past, t);
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let a = one.install(|| cached_attention(&q, &k, &v, &bias, 0.125).unwrap());
        let c = three.install(|| cached_attention(&q, &k, &v, &bias, 0.125).unwrap());
        assert_eq!(max_rel(&a, &c), 0.0);
        assert!(max_rel(&a, &reference(&q, &k, &v, &bias, 0.125).unwrap()) < 1e-5);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let f = DType::F32;
        let q = tensor(&[2, 4, 1, 8], 1, f);
        let k = tensor(&[2, 2, 5, 8], 2, f);
        let v = tensor(&[2, 2, 5, 8], 3, f);
        let bias = bias(&[0, 0], 4, 1);
        assert!(cached_attention(&q, &k, &v, &bias, 1.0).is_ok());
        let cases: Vec<(&str, Tensor, Tensor, Tensor, Tensor)> = vec![
            ("batch", q.clone(), tensor(&[3, 2, 5, 8], 2, f), tensor(&[3, 2, 5, 8], 3, f), bias.clone()),
            ("kv heads of v", q.clone(), k.clone(), tensor(&[2, 1, 5, 8], 3, f), bias.clone()),
            ("head dim", q.clone(), tensor(&[2, 2, 5, 6], 2, f), tensor(&[2, 2, 5, 6], 3, f), bias.clone()),
            ("H not a multiple of KV", tensor(&[2, 3, 1, 8], 1, f), k.clone(), v.clone(), bias.clone()),
            ("bias length", q.clone(), k.clone(), v.clone(), tensor(&[2, 1, 4], 4, f)),
            ("bias rows", q.clone(), k.clone(), v.clone(), tensor(&[2, 2, 5], 4, f)),
            ("q rank", tensor(&[2, 4, 8], 1, f), k.clone(), v.clone(), bias.clone()),
            ("no keys", q.clone(), tensor(&[2, 2, 0, 8], 2, f), tensor(&[2, 2, 0, 8], 3, f), tensor(&[2, 1, 0], 4, f)),
            ("dtype", q.clone(), tensor(&[2, 2, 5, 8], 2, DType::F64), v.clone(), bias.clone()),
        ];
        for (what, q, k, v, bias) in cases {
            assert!(cached_attention(&q, &k, &v, &bias, 1.0).is_err(), "{what}");
            assert!(reference(&q, &k, &v, &bias, 1.0).is_err(), "{what}");
        }
        // A last dimension that is not contiguous (a transposed view) is copied, not misread.
        let kt = tensor(&[2, 2, 8, 5], 2, f).transpose(2, 3).unwrap();
        let got = cached_attention(&q, &kt, &v, &bias, 1.0).unwrap();
        let want = reference(&q, &kt.contiguous().unwrap(), &v, &bias, 1.0).unwrap();
        assert!(max_rel(&got, &want) < 1e-5);
        // The op itself refuses such a layout.
        let op = CachedAttention { bias: bias.clone(), scale: 1.0, simd: true };
        assert!(q.apply_op3(&kt, &v, Op(op)).is_err());
    }

    #[test]
    fn backward_is_an_error() {
        let q = candle_core::Var::from_tensor(&tensor(&[1, 2, 1, 8], 1, DType::F32)).unwrap();
        let k = tensor(&[1, 1, 3, 8], 2, DType::F32);
        let v = tensor(&[1, 1, 3, 8], 3, DType::F32);
        let out = cached_attention(q.as_tensor(), &k, &v, &bias(&[0], 2, 1), 1.0).unwrap();
        assert!(out.sum_all().unwrap().backward().is_err());
    }
}
