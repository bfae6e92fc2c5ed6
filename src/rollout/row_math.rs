//! Passes over one row of logits for the sampler: the maximum (NaN-aware), the first index of
//! the maximum, Σ exp((z − max) / t), and those terms themselves.
//!
//! Greedy decoding samples every row of every step with these, and with libm's scalar `expf`
//! the sum alone was a tenth of a 64-row decode run. The maximum runs 16 lanes at a time on CPUs
//! with AVX-512F (plain loops elsewhere); the sum is the vectorised exp of
//! [`crate::model::ops::exp`].

/// The maximum, or None when the row has a NaN (or is empty).
pub fn max_checked(z: &[f32]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // Safety: AVX-512F was detected.
        return unsafe { avx512::max_checked(z) };
    }
    if z.is_empty() || z.iter().any(|x| x.is_nan()) {
        return None;
    }
    Some(z.iter().copied().fold(f32::NEG_INFINITY, f32::max))
}

/// The first index holding `max` (which must occur in `z`).
pub fn first_index_of(z: &[f32], max: f32) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // Safety: AVX-512F was detected.
        if let Some(i) = unsafe { avx512::first_index_of(z, max) } {
            return i;
        }
    }
    z.iter().position(|&x| x == max).expect("the maximum occurs in the row")
}

/// Σ exp((z − max) · inv_t) in f64 (the vectorised exp of [`crate::model::ops::exp`]).
pub fn sum_exp(z: &[f32], max: f32, inv_t: f32) -> f64 {
    crate::model::ops::exp::sum_exp_scaled_f32(z, max, inv_t)
}

/// out ← exp((z − max) · inv_t) (the vectorised exp); returns Σ out, equal to
/// `sum_exp(z, max, inv_t)`.
pub fn exp_scaled(out: &mut [f32], z: &[f32], max: f32, inv_t: f32) -> f64 {
    crate::model::ops::exp::exp_scaled_f32_into(out, z, max, inv_t)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn max_checked(z: &[f32]) -> Option<f32> {
        if z.is_empty() {
            return None;
        }
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut nan: __mmask16 = 0;
        for block in z.chunks(16) {
            let mask = ((1u32 << block.len()) - 1) as u16;
            let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask, block.as_ptr());
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            max = _mm512_max_ps(max, x);
        }
        (nan == 0).then(|| _mm512_reduce_max_ps(max))
    }

    /// The first index of an element equal to `x`, 16 compares at a time.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn first_index_of(z: &[f32], x: f32) -> Option<usize> {
        let want = _mm512_set1_ps(x);
        for (c, block) in z.chunks(16).enumerate() {
            let mask = ((1u32 << block.len()) - 1) as u16;
            let v = _mm512_maskz_loadu_ps(mask, block.as_ptr());
            let hit = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(mask, v, want);
            if hit != 0 {
                return Some(c * 16 + hit.trailing_zeros() as usize);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agree_with_scalar_definitions() {
        // Lengths around the 16-lane blocks and the 256-term partials; values spread from 0 to
        // far below the maximum (where exp underflows).
        for len in [1, 5, 16, 17, 255, 256, 300, 4096] {
            let mut z: Vec<f32> = (0..len).map(|i| ((i * 7919 % 1013) as f32 - 500.0) * 0.37).collect();
            if len > 5 {
                z[3] = f32::NEG_INFINITY;
            }
            let max = max_checked(&z).unwrap();
            assert_eq!(max, z.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            assert_eq!(first_index_of(&z, max), z.iter().position(|&x| x == max).unwrap());
            // Ties: the first of equal elements, wherever it sits in a 16-lane block.
            for at in [0, len / 2, len - 1] {
                let mut tied = z.clone();
                tied[at] = max;
                assert_eq!(first_index_of(&tied, max), tied.iter().position(|&x| x == max).unwrap());
            }
            for t in [1.0f32, 0.7, 0.01] {
                let want: f64 = z.iter().map(|&x| ((x as f64 - max as f64) * (1.0 / t) as f64).exp()).sum();
                let got = sum_exp(&z, max, 1.0 / t);
                assert!((got - want).abs() <= 1e-6 * want, "len {len} t {t}: {got} vs {want}");
            }
        }
        let mut z = vec![0.5f32; 40];
        z[33] = f32::NAN;
        assert_eq!(max_checked(&z), None);
        assert_eq!(max_checked(&[]), None);
    }
}
