//! exp over slices, vectorised for f32 (the kernels' softmaxes and sigmoids, and the sampler's
//! normaliser, spent a measurable share of training and decoding in libm's scalar `expf`:
//! BENCHMARKS.md).
//!
//! exp(x) = 2ⁿ · e^r with n = round(x / ln 2), r = x − n·ln 2 (ln 2 in two parts, Cody–Waite),
//! e^r by Cephes' degree-6 polynomial on |r| ≤ ln 2 / 2 (relative error ≈ 1 ulp), and 2ⁿ built
//! from exponent bits in two halves so that results down to the subnormals are exact in
//! range. x < −104 gives 0, x > 88.73 gives +∞, NaN stays NaN. The loop is plain arithmetic
//! that the compiler vectorises: compiled for AVX-512 and for AVX2 + FMA, chosen at run time.
//! f64 keeps libm's exp.

/// e^x for one f32, branch-free (see the module docs).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-104.0, 89.0);
    let t = xc * LOG2E + MAGIC;
    let nf = t - MAGIC;
    let n = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let r = xc - nf * LN2_HI - nf * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let n1 = n >> 1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n - n1 + 127) as u32) << 23);
    let v = y * s1 * s2;
    let v = if x < -104.0 { 0.0 } else { v };
    let v = if x > 88.73 { f32::INFINITY } else { v };
    if x.is_nan() {
        x
    } else {
        v
    }
}

/// The tail shorter than 16 goes through a padded 16-element buffer, so that it takes the
/// vector code too (a row of 17 to 31 elements spent most of its time in the scalar tail).
#[inline(always)]
fn exp_loop(xs: &mut [f32]) {
    let mut chunks = xs.chunks_exact_mut(16);
    for c in &mut chunks {
        for x in c {
            *x = exp_f32(*x);
        }
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mut buf = [0f32; 16];
        buf[..tail.len()].copy_from_slice(tail);
        for x in buf.iter_mut() {
            *x = exp_f32(*x);
        }
        tail.copy_from_slice(&buf[..tail.len()]);
    }
}

/// Σ exp((x − shift) · scale): 16 partial sums in f32 (so that the sum vectorises too) over
/// groups of 256 terms, the groups summed in f64 (terms ≤ 1 when shift is the maximum: each f32
/// partial adds at most 16 of them).
#[inline(always)]
fn sum_exp_loop(xs: &[f32], shift: f32, scale: f32) -> f64 {
    let mut total = 0f64;
    for group in xs.chunks(256) {
        let mut acc = [0f32; 16];
        let mut chunks = group.chunks_exact(16);
        for c in &mut chunks {
            for i in 0..16 {
                acc[i] += exp_f32((c[i] - shift) * scale);
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|&x| exp_f32((x - shift) * scale)).sum();
        total += (acc.iter().sum::<f32>() + tail) as f64;
    }
    total
}

/// out ← exp((x − shift) · scale), returning Σ out with [`sum_exp_loop`]'s terms and grouping
/// (so the same number `sum_exp_scaled_f32` gives).
#[inline(always)]
fn exp_scaled_loop(out: &mut [f32], xs: &[f32], shift: f32, scale: f32) -> f64 {
    let mut total = 0f64;
    for (out, group) in out.chunks_mut(256).zip(xs.chunks(256)) {
        let mut acc = [0f32; 16];
        let (mut outs, mut chunks) = (out.chunks_exact_mut(16), group.chunks_exact(16));
        for (o, c) in (&mut outs).zip(&mut chunks) {
            for i in 0..16 {
                o[i] = exp_f32((c[i] - shift) * scale);
                acc[i] += o[i];
            }
        }
        let mut tail = 0f32;
        for (o, &x) in outs.into_remainder().iter_mut().zip(chunks.remainder()) {
            *o = exp_f32((x - shift) * scale);
            tail += *o;
        }
        total += (acc.iter().sum::<f32>() + tail) as f64;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_scaled_avx512(out: &mut [f32], xs: &[f32], shift: f32, scale: f32) -> f64 {
    exp_scaled_loop(out, xs, shift, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_scaled_avx2(out: &mut [f32], xs: &[f32], shift: f32, scale: f32) -> f64 {
    exp_scaled_loop(out, xs, shift, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512(xs: &mut [f32]) {
    exp_loop(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_avx2(xs: &mut [f32]) {
    exp_loop(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_exp_avx512(xs: &[f32], shift: f32, scale: f32) -> f64 {
    sum_exp_loop(xs, shift, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_avx2(xs: &[f32], shift: f32, scale: f32) -> f64 {
    sum_exp_loop(xs, shift, scale)
}

/// xs ← exp(xs).
pub fn exp_f32_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: each variant runs only where the CPU has its features.
        if std::arch::is_x86_feature_detected!("avx512f") {
            return unsafe { exp_avx512(xs) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return unsafe { exp_avx2(xs) };
        }
    }
    exp_loop(xs)
}

/// Σ exp(x − shift) over xs.
pub fn sum_exp_f32(xs: &[f32], shift: f32) -> f32 {
    sum_exp_scaled_f32(xs, shift, 1.0) as f32
}

/// Σ exp((x − shift) · scale) over xs, in f64 (the sampler's normaliser at temperature 1/scale).
pub fn sum_exp_scaled_f32(xs: &[f32], shift: f32, scale: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: as in exp_f32_in_place.
        if std::arch::is_x86_feature_detected!("avx512f") {
            return unsafe { sum_exp_avx512(xs, shift, scale) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return unsafe { sum_exp_avx2(xs, shift, scale) };
        }
    }
    sum_exp_loop(xs, shift, scale)
}

/// out ← exp((x − shift) · scale) for xs as long as out (the sampler's unnormalised
/// probabilities at temperature 1/scale); returns Σ out, equal to [`sum_exp_scaled_f32`]'s.
pub fn exp_scaled_f32_into(out: &mut [f32], xs: &[f32], shift: f32, scale: f32) -> f64 {
    assert_eq!(out.len(), xs.len(), "exp_scaled_f32_into: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: as in exp_f32_in_place.
        if std::arch::is_x86_feature_detected!("avx512f") {
            return unsafe { exp_scaled_avx512(out, xs, shift, scale) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return unsafe { exp_scaled_avx2(out, xs, shift, scale) };
        }
    }
    exp_scaled_loop(out, xs, shift, scale)
}

/// xs ← exp(xs), libm's exp.
pub fn exp_f64_in_place(xs: &mut [f64]) {
    xs.iter_mut().for_each(|x| *x = x.exp())
}

/// Σ exp(x − shift) over xs, libm's exp.
pub fn sum_exp_f64(xs: &[f64], shift: f64) -> f64 {
    xs.iter().map(|&x| (x - shift).exp()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectorised_exp_is_within_two_ulp_of_libm_over_the_whole_range() {
        let mut xs: Vec<f32> = (0..200_001).map(|i| -103.0 + 192.0 * i as f32 / 200_000.0).collect();
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 88.7, -87.0, -103.9]);
        let mut ys = xs.clone();
        exp_f32_in_place(&mut ys);
        // The portable loop (what CPUs without AVX2 run) gives the same values.
        let mut plain = xs.clone();
        exp_loop(&mut plain);
        assert_eq!(ys, plain);
        // Every length's tail (the padded buffer) gives the one-element values.
        for n in 1..40 {
            let mut row = xs[1000..1000 + n].to_vec();
            exp_f32_in_place(&mut row);
            let one: Vec<f32> = xs[1000..1000 + n].iter().map(|&x| exp_f32(x)).collect();
            assert_eq!(row, one, "length {n}");
        }
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).exp();
            if want > f32::MAX as f64 {
                assert_eq!(y, f32::INFINITY, "exp({x})");
            } else if want < f32::MIN_POSITIVE as f64 {
                // Subnormal results: absolute error within one subnormal step.
                assert!((y as f64 - want).abs() <= 2.0 * 1.5e-45, "exp({x}) = {y}, want {want}");
            } else {
                assert!(((y as f64 - want) / want).abs() < 2.5e-7, "exp({x}) = {y}, want {want}");
            }
        }
        let mut edge = [-1e30f32, -105.0, 89.0, 1e30, f32::NAN, f32::NEG_INFINITY, f32::INFINITY];
        exp_f32_in_place(&mut edge);
        assert_eq!(&edge[..4], &[0.0, 0.0, f32::INFINITY, f32::INFINITY]);
        assert!(edge[4].is_nan());
        assert_eq!(&edge[5..], &[0.0, f32::INFINITY]);
        // The sum equals the sum of the elementwise values (up to summation order).
        let row: Vec<f32> = (0..1037).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let want: f64 = row.iter().map(|&x| ((x - 2.5) as f64).exp()).sum();
        let got = sum_exp_f32(&row, 2.5) as f64;
        assert!(((got - want) / want).abs() < 1e-6, "{got} vs {want}");
        // The terms written out: each the one-element value, their sum exactly sum_exp's.
        let mut terms = vec![0f32; row.len()];
        let total = exp_scaled_f32_into(&mut terms, &row, 2.5, 0.7);
        assert_eq!(total, sum_exp_scaled_f32(&row, 2.5, 0.7));
        for (&t, &x) in terms.iter().zip(&row) {
            assert_eq!(t, exp_f32((x - 2.5) * 0.7));
        }
    }
}
