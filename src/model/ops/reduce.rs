//! Sums and maxima over a row in [`LANES`] interleaved partial results.
//!
//! A single running sum is a chain of dependent adds (4 cycles each) that the compiler may not
//! reorder, so a 256-wide RMSNorm row took 1,000 cycles; with independent lanes the adds
//! vectorise. The lanes are added up at the end, then the remainder past the last full chunk:
//! a fixed order, so results are deterministic (they differ from a left-to-right sum in the last
//! bits, as any reordering does).

use super::Real;

/// Partial sums per row: one AVX-512 vector of f32 (two of f64).
const LANES: usize = 16;

/// Σ f(chunks of a, chunks of b, ...) for one to three equally long slices.
// j indexes K slices at once, which no iterator over one of them expresses.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn lanes<T: Real, const K: usize>(xs: [&[T]; K], f: impl Fn([T; K]) -> T) -> T {
    let n = xs.iter().map(|x| x.len()).min().unwrap_or(0);
    let full = n / LANES * LANES;
    let mut acc = [T::of(0.0); LANES];
    for c in (0..full).step_by(LANES) {
        let chunks: [&[T]; K] = std::array::from_fn(|i| &xs[i][c..c + LANES]);
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(std::array::from_fn(|i| chunks[i][l]));
        }
    }
    let mut s = T::of(0.0);
    for a in acc {
        s += a;
    }
    for j in full..n {
        s += f(std::array::from_fn(|i| xs[i][j]));
    }
    s
}

/// Σ a·b over the shorter length.
#[inline(always)]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    lanes([a, b], |[a, b]| a * b)
}

/// Σ a·b·c over the shortest length.
#[inline(always)]
pub(crate) fn dot3<T: Real>(a: &[T], b: &[T], c: &[T]) -> T {
    lanes([a, b, c], |[a, b, c]| a * b * c)
}

/// The largest element (−∞ for none), in 16 lanes folded pairwise, so that it vectorises and
/// has no long chain of dependent comparisons: a maximum does not depend on the order, so this
/// is the sequential fold's value (up to the sign of a zero maximum, which x − m and exp do not
/// see).
#[inline(always)]
pub(crate) fn max<T: Real>(xs: &[T]) -> T {
    let mut lanes = [T::neg_infinity(); LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            lanes[l] = lanes[l].fmax(c[l]);
        }
    }
    for (m, &x) in lanes.iter_mut().zip(tail) {
        *m = m.fmax(x);
    }
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            lanes[l] = lanes[l].fmax(lanes[l + w]);
        }
        w /= 2;
    }
    lanes[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_equal_plain_sums_at_every_length() {
        // Lengths around the lane width, so that full chunks and remainders both count.
        for n in [0, 1, 15, 16, 17, 31, 64, 100] {
            let a: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin()).collect();
            let b: Vec<f64> = (0..n).map(|i| (i as f64 * 0.11).cos() + 0.5).collect();
            let c: Vec<f64> = (0..n).map(|i| 1.0 + i as f64 / 7.0).collect();
            let plain = |f: &dyn Fn(usize) -> f64| (0..n).map(f).sum::<f64>();
            assert!((dot(&a, &b) - plain(&|i| a[i] * b[i])).abs() < 1e-12, "dot of {n}");
            assert!((dot3(&a, &b, &c) - plain(&|i| a[i] * b[i] * c[i])).abs() < 1e-12, "dot3 of {n}");
        }
        // The shorter length counts.
        assert_eq!(dot(&[1.0f32, 2.0, 3.0], &[1.0, 1.0]), 3.0);
    }

    #[test]
    fn lane_max_is_the_sequential_max() {
        for n in [1, 7, 15, 16, 17, 33, 48, 100] {
            for seed in 0..4 {
                let mut xs = super::super::testing::values(n, seed, 50.0);
                // Masked entries and the largest one in the remainder or the last chunk.
                xs.iter_mut().step_by(3).for_each(|x| *x = -1e30);
                xs[(seed as usize * 5) % n] = 1e3;
                let want = xs.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                assert_eq!(max(&xs), want, "n {n}");
                let xs32: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
                assert_eq!(max(&xs32), want as f32, "n {n}");
            }
        }
        assert_eq!(max::<f32>(&[]), f32::NEG_INFINITY);
    }
}
