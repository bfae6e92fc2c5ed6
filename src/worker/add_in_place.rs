//! `acc += g` on an accumulator's own storage: the sum `acc + g` would allocate a third tensor
//! beside the two (for a tied embedding at Qwen's vocabulary, hundreds of megabytes at the peak
//! of the backward). Each element is `a + g` in the dtype's own addition (half's for bf16 and
//! f16, widened and rounded), the arithmetic of candle's `add`, so the bits are the same.

use candle_core::{CpuStorage, DType, Layout, Tensor};

use crate::Result;

/// Adds `g` into `acc` in place when both are CPU tensors of one float dtype and shape,
/// contiguous from offset 0; returns whether it did (else the caller adds out of place). `acc`
/// must own its storage: every tensor sharing it changes too.
pub fn add_in_place(acc: &Tensor, g: &Tensor) -> Result<bool> {
    let plain = |t: &Tensor| {
        t.device().is_cpu()
            && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
            && t.layout().is_contiguous()
            && t.layout().start_offset() == 0
    };
    if !(plain(acc) && plain(g)) || acc.dtype() != g.dtype() || acc.dims() != g.dims() {
        return Ok(false);
    }
    acc.inplace_op2(g, &AddInto)?;
    Ok(true)
}

struct AddInto;

impl candle_core::InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(&self, acc: &mut CpuStorage, la: &Layout, g: &CpuStorage, lg: &Layout) -> candle_core::Result<()> {
        fn add<T: Copy + std::ops::Add<Output = T>>(acc: &mut [T], g: &[T]) {
            acc.iter_mut().zip(g).for_each(|(a, &g)| *a = *a + g);
        }
        let (n, m) = (la.shape().elem_count(), lg.shape().elem_count());
        match (acc, g) {
            (CpuStorage::F32(a), CpuStorage::F32(g)) => add(&mut a[..n], &g[..m]),
            (CpuStorage::F64(a), CpuStorage::F64(g)) => add(&mut a[..n], &g[..m]),
            (CpuStorage::BF16(a), CpuStorage::BF16(g)) => add(&mut a[..n], &g[..m]),
            (CpuStorage::F16(a), CpuStorage::F16(g)) => add(&mut a[..n], &g[..m]),
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
}
