//! Matrix products on slices, through the `gemm` crate (the kernels candle's CPU matmul uses).
//!
//! A [`Mat`] is a read-only view: `rows × cols` elements with a row and a column stride, so a
//! transpose or a head's columns inside a wider row are views, never copies. [`matmul`] writes
//! (or adds into) a row-major destination with its own row stride.

use gemm::Parallelism;

use crate::model::ops::Real;

/// A strided matrix view into a slice.
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// Row-major `rows × cols` at the start of `data`.
    pub fn of(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols)
    }

    /// `rows × cols` whose row i starts at `data[i · row_stride]` (columns contiguous).
    pub fn strided(data: &'a [T], rows: usize, cols: usize, row_stride: usize) -> Self {
        let m = Mat { data, rows, cols, rs: row_stride, cs: 1 };
        m.check();
        m
    }

    /// The transposed view.
    pub fn t(self) -> Self {
        Mat { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }

    fn check(&self) {
        if self.rows > 0 && self.cols > 0 {
            let last = (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(last < self.data.len(), "matrix view past the end of its slice");
        }
    }
}

/// c = a · b, or c += a · b with `accumulate`; c is row-major `a.rows × b.cols` with row stride
/// `ldc`. `parallel` splits the product over the current rayon pool (gemm decides whether the
/// size pays); a caller already inside a parallel loop passes false.
pub fn matmul<T: Real>(c: &mut [T], ldc: usize, a: Mat<T>, b: Mat<T>, accumulate: bool, parallel: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(k, b.rows, "matmul: inner dimensions differ");
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * ldc + n <= c.len(), "matmul: destination too small");
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(T::of(0.0));
            }
        }
        return;
    }
    let par = if parallel { Parallelism::Rayon(0) } else { Parallelism::None };
    // SAFETY: every view was bounds-checked against its slice (Mat::check, the assert on c),
    // c is borrowed mutably and so cannot alias a or b, and T is f32 or f64 (Real), which gemm
    // supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::of(1.0),
            T::of(1.0),
            false,
            false,
            false,
            par,
        )
    }
}

/// a · b in a new row-major buffer, written once by the product (never zero-filled first).
pub fn product<T: Real>(a: Mat<T>, b: Mat<T>, parallel: bool) -> Vec<T> {
    let (m, n) = (a.rows, b.cols);
    let mut out: Vec<std::mem::MaybeUninit<T>> = Vec::with_capacity(m * n);
    // SAFETY: MaybeUninit needs no initialisation; the product below writes all m·n elements
    // (gemm with read_dst = false stores every destination element and reads none; with k = 0,
    // matmul fills zeros), after which the buffer is a Vec<T> of the same layout.
    unsafe {
        out.set_len(m * n);
        let c = std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut T, m * n);
        matmul(c, n, a, b, false, parallel);
        let mut out = std::mem::ManuallyDrop::new(out);
        Vec::from_raw_parts(out.as_mut_ptr() as *mut T, m * n, out.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain triple loop.
    fn naive(a: &[f64], (m, k): (usize, usize), b: &[f64], n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn products_of_views_equal_the_triple_loop() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.91).cos()).collect();
        let want = naive(&a, (m, k), &b, n);
        // Plain, and through transposed copies read as views.
        let c = product(Mat::of(&a, m, k), Mat::of(&b, k, n), true);
        let at: Vec<f64> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let bt: Vec<f64> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let mut c2 = vec![0.0; m * n];
        matmul(&mut c2, n, Mat::of(&at, k, m).t(), Mat::of(&bt, n, k).t(), false, false);
        // Accumulating into a strided destination (columns 1..1+n of a wider matrix).
        let mut wide = vec![1.0; m * (n + 2)];
        matmul(&mut wide[1..], n + 2, Mat::of(&a, m, k), Mat::of(&b, k, n), true, false);
        for i in 0..m {
            for j in 0..n {
                let w = want[i * n + j];
                assert!((c[i * n + j] - w).abs() < 1e-12 && (c2[i * n + j] - w).abs() < 1e-12);
                assert!((wide[i * (n + 2) + 1 + j] - (w + 1.0)).abs() < 1e-12);
            }
            assert_eq!((wide[i * (n + 2)], wide[i * (n + 2) + n + 1]), (1.0, 1.0));
        }
        // A strided left operand: rows 2 apart.
        let a2: Vec<f64> = a.chunks(k).flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(9.0, 2))).collect();
        let mut c3 = vec![0.0; m * n];
        matmul(&mut c3, n, Mat::strided(&a2, m, k, k + 2), Mat::of(&b, k, n), false, false);
        assert!(c3.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-12));
    }
}
