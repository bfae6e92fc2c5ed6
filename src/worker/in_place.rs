//! Writes into a gradient's own storage, where a fresh tensor would sit beside the old one (for a
//! tied embedding at Qwen's vocabulary, hundreds of megabytes at the peak of a step):
//! - [`add_in_place`]: `acc += g`, each element `a + g` in the dtype's own addition (half's for
//!   bf16 and f16, widened and rounded), the arithmetic of candle's `add`, so the same bits;
//!   [`add_at`] the same into a range, `acc[offset..offset + n] += g`;
//! - [`write_at`]: `dst[offset..offset + n] = src`, a sum that arrives in pieces written over the
//!   gradient it is the sum of;
//! - [`write_rows`]: `dst[rows[k]] = src[k]`, rows summed apart written into their places.
//!
//! Each needs the written tensor to own its storage: every tensor sharing it changes too.

use candle_core::{CpuStorage, DType, Layout, Tensor};

use crate::Result;

/// Whether `t` is a CPU tensor of a float dtype, contiguous from offset 0.
fn plain(t: &Tensor) -> bool {
    t.device().is_cpu()
        && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
        && t.layout().is_contiguous()
        && t.layout().start_offset() == 0
}

/// Adds `g` into `acc` in place when both are [`plain`] tensors of one dtype and shape; returns
/// whether it did (else the caller adds out of place).
pub fn add_in_place(acc: &Tensor, g: &Tensor) -> Result<bool> {
    if acc.dims() != g.dims() {
        return Ok(false);
    }
    add_at(acc, 0, g)
}

/// Adds `src` into `src.elem_count()` elements of `acc`, flat from `offset`, with
/// [`add_in_place`]'s arithmetic, when both are [`plain`] tensors of one dtype and it fits;
/// returns whether it did.
pub fn add_at(acc: &Tensor, offset: usize, src: &Tensor) -> Result<bool> {
    if !(plain(acc) && plain(src)) || acc.dtype() != src.dtype() || offset + src.elem_count() > acc.elem_count() {
        return Ok(false);
    }
    acc.inplace_op2(src, &AddInto(offset))?;
    Ok(true)
}

/// Overwrites `src.elem_count()` elements of `dst`, flat from `offset`, with `src`'s when both
/// are [`plain`] tensors of one dtype and they fit; returns whether it did.
pub fn write_at(dst: &Tensor, offset: usize, src: &Tensor) -> Result<bool> {
    if !(plain(dst) && plain(src)) || dst.dtype() != src.dtype() || offset + src.elem_count() > dst.elem_count() {
        return Ok(false);
    }
    dst.inplace_op2(src, &WriteAt(offset))?;
    Ok(true)
}

/// Overwrites row `rows[k]` of `dst` [.., width] with row k of `src` [rows.len(), width] when both
/// are [`plain`] tensors of one dtype and every row fits; returns whether it did.
pub fn write_rows(dst: &Tensor, rows: &[u32], src: &Tensor) -> Result<bool> {
    let width = dst.dims().last().copied().unwrap_or(0);
    let fits = rows.iter().all(|&r| (r as usize + 1) * width <= dst.elem_count());
    if !(plain(dst) && plain(src)) || dst.dtype() != src.dtype() || !fits || src.elem_count() != rows.len() * width {
        return Ok(false);
    }
    dst.inplace_op2(src, &WriteRows(rows, width))?;
    Ok(true)
}

struct WriteRows<'a>(&'a [u32], usize);

impl candle_core::InplaceOp2 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "write-rows"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, _: &Layout, src: &CpuStorage, _: &Layout) -> candle_core::Result<()> {
        fn rows<T: Copy>(d: &mut [T], s: &[T], rows: &[u32], w: usize) {
            for (k, &r) in rows.iter().enumerate() {
                d[r as usize * w..(r as usize + 1) * w].copy_from_slice(&s[k * w..(k + 1) * w]);
            }
        }
        let (r, w) = (self.0, self.1);
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => rows(d, s, r, w),
            (CpuStorage::F64(d), CpuStorage::F64(s)) => rows(d, s, r, w),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => rows(d, s, r, w),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => rows(d, s, r, w),
            _ => candle_core::bail!("write-rows: the tensors differ in dtype"),
        }
        Ok(())
    }
}

struct WriteAt(usize);

impl candle_core::InplaceOp2 for WriteAt {
    fn name(&self) -> &'static str {
        "write-at"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, _: &Layout, src: &CpuStorage, ls: &Layout) -> candle_core::Result<()> {
        let (at, n) = (self.0, ls.shape().elem_count());
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => d[at..at + n].copy_from_slice(&s[..n]),
            (CpuStorage::F64(d), CpuStorage::F64(s)) => d[at..at + n].copy_from_slice(&s[..n]),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => d[at..at + n].copy_from_slice(&s[..n]),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => d[at..at + n].copy_from_slice(&s[..n]),
            _ => candle_core::bail!("write-at: the tensors differ in dtype"),
        }
        Ok(())
    }
}

/// `acc[offset..offset + n] += g`.
struct AddInto(usize);

impl candle_core::InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(&self, acc: &mut CpuStorage, _: &Layout, g: &CpuStorage, lg: &Layout) -> candle_core::Result<()> {
        fn add<T: Copy + std::ops::Add<Output = T>>(acc: &mut [T], g: &[T]) {
            acc.iter_mut().zip(g).for_each(|(a, &g)| *a = *a + g);
        }
        let (at, m) = (self.0, lg.shape().elem_count());
        match (acc, g) {
            (CpuStorage::F32(a), CpuStorage::F32(g)) => add(&mut a[at..at + m], &g[..m]),
            (CpuStorage::F64(a), CpuStorage::F64(g)) => add(&mut a[at..at + m], &g[..m]),
            (CpuStorage::BF16(a), CpuStorage::BF16(g)) => add(&mut a[at..at + m], &g[..m]),
            (CpuStorage::F16(a), CpuStorage::F16(g)) => add(&mut a[at..at + m], &g[..m]),
            _ => candle_core::bail!("add-into: the accumulator and the gradient differ in dtype"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The same bits as candle's out-of-place add, in every float dtype; a view is refused.
    #[test]
    fn adds_with_the_bits_of_candle_add() {
        let a: Vec<f32> = (0..97).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let b: Vec<f32> = (0..97).map(|i| (i as f32 * 1.91).cos() * 1e-3).collect();
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let x = Tensor::new(&a[..], &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let y = Tensor::new(&b[..], &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let want = (&x + &y).unwrap();
            let acc = x.copy().unwrap();
            assert!(add_in_place(&acc, &y).unwrap(), "{dtype:?}");
            let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(bits(&acc), bits(&want), "{dtype:?}");
            assert_ne!(bits(&acc), bits(&x), "{dtype:?}: nothing was added");
        }
        let m = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(!add_in_place(&m.t().unwrap(), &m).unwrap(), "a transposed view is not added in place");
    }

    /// A range takes candle's add of its elements and the source; the rest keeps its own; a
    /// source that would run past the end is refused.
    #[test]
    fn adds_a_range_and_nothing_else() {
        let a: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let b: Vec<f32> = (0..5).map(|i| (i as f32 * 1.91).cos() * 1e-3).collect();
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let x = Tensor::new(&a[..], &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let y = Tensor::new(&b[..], &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let acc = x.copy().unwrap();
            assert!(add_at(&acc, 6, &y).unwrap(), "{dtype:?}");
            let want = Tensor::cat(
                &[x.narrow(0, 0, 6).unwrap(), (x.narrow(0, 6, 5).unwrap() + &y).unwrap(), x.narrow(0, 11, 1).unwrap()],
                0,
            )
            .unwrap();
            let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(bits(&acc), bits(&want), "{dtype:?}");
            assert!(!add_at(&acc, 8, &y).unwrap(), "{dtype:?}: past the end");
        }
    }

    /// The written range takes the source's bits and the rest keeps its own; a source that would
    /// run past the end, or of another dtype, is refused.
    #[test]
    fn writes_a_range_and_nothing_else() {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let dst =
                Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((3, 4)).unwrap().to_dtype(dtype).unwrap();
            let src = Tensor::new(&[-1f32, -2., -3., -4., -5.], &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            assert!(write_at(&dst, 6, &src).unwrap(), "{dtype:?}");
            let got = dst.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(got, [0., 1., 2., 3., 4., 5., -1., -2., -3., -4., -5., 11.], "{dtype:?}");
            assert!(!write_at(&dst, 8, &src).unwrap(), "{dtype:?}: past the end");
        }
        let dst = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
        assert!(!write_at(&dst, 0, &Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap()).unwrap());
    }

    #[test]
    fn writes_rows_and_nothing_else() {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let dst =
                Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((4, 3)).unwrap().to_dtype(dtype).unwrap();
            let src =
                Tensor::new(&[[-1f32, -2., -3.], [-4., -5., -6.]], &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            assert!(write_rows(&dst, &[3, 1], &src).unwrap(), "{dtype:?}");
            let got = dst.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(got, [0., 1., 2., -4., -5., -6., 6., 7., 8., -1., -2., -3.], "{dtype:?}");
            assert!(!write_rows(&dst, &[4, 1], &src).unwrap(), "{dtype:?}: a row past the end");
            assert!(!write_rows(&dst, &[1], &src).unwrap(), "{dtype:?}: rows and source differ");
        }
    }
}
