//! a · b as candle's [`Tensor::matmul`], with the threads of the current rayon pool.
//!
//! candle's CPU matmul decides whether to split a product over threads from the environment:
//! it reads `RAYON_NUM_THREADS` on every call (and without it counts the physical cores anew,
//! reading `/proc/cpuinfo`: about 30 µs a call), then hands `Parallelism::Rayon(n)` to the
//! `gemm` crate, which runs the split on whatever pool the caller is in. So a process-wide
//! variable, not the caller's thread budget, chose the kernel's threading. This op makes the
//! same `gemm` calls (same arguments, the same batch folding) with the split decided by the pool
//! the caller runs in: [`rayon::current_num_threads`] threads, none when it is one. Each actor
//! (worker rank, engine) runs inside its own pool of its budget (see [`crate::actor`]), so the
//! budget is the one given where the actor started.
//!
//! Numerics: gemm splits a product over output tiles, never over K, so every element is summed
//! in the same order at any thread count; the result equals candle's bit for bit (a test pins
//! both, at 1, 2 and 3 threads). The backward is this op again (dx = g · bᵀ, db = aᵀ · g, as
//! candle's). Other dtypes and devices, and layouts candle's CPU matmul refuses, take
//! `Tensor::matmul` itself.

use candle_core::{DType, Layout, Shape, Tensor, WithDType};
use gemm::Parallelism;

use super::custom_op::{grad_for, Cpu, FusedOp, Op};
use super::Real;

use crate::Result;

/// a [.., m, k] · b [.., k, n] → [.., m, n], batch dimensions equal (as `Tensor::matmul`).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let served = a.device().is_cpu()
        && b.device().is_cpu()
        && matches!(a.dtype(), DType::F32 | DType::F64)
        && a.dtype() == b.dtype()
        && a.rank() == b.rank()
        && (2..=4).contains(&a.rank())
        && a.dims()[..a.rank() - 2] == b.dims()[..b.rank() - 2]
        && a.dims()[a.rank() - 1] == b.dims()[b.rank() - 2];
    if !served {
        return Ok(a.matmul(b)?);
    }
    // A graph node only when an input tracks gradients, as with candle's matmul.
    Ok(a.apply_op2(b, Op(PoolMatmul))?)
}

/// The op (use [`matmul`]).
struct PoolMatmul;

/// The batch step of an operand, as candle computes it (`MatMul::ab_skip`); `None` for a batch
/// layout candle refuses.
fn skip(l: &Layout, rows: usize, cols: usize) -> Option<usize> {
    let (stride, dims) = (l.stride(), l.dims());
    let rank = stride.len();
    match stride[..rank - 2] {
        [s1, s] if s1 == s * dims[1] => Some(s),
        [_, s] if dims[0] == 1 => Some(s),
        [s, _] if dims[1] == 1 => Some(s),
        [s] => Some(s),
        [] => Some(rows * cols),
        _ => None,
    }
}

/// The gemm split for the current pool: candle's rule (none at one thread) with the pool's count.
fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

fn product<T: WithDType>(a: &[T], al: &Layout, b: &[T], bl: &Layout) -> candle_core::Result<(Vec<T>, Shape)> {
    let dims = al.dims();
    let rank = dims.len();
    let (m, k, n) = (dims[rank - 2], dims[rank - 1], bl.dims()[rank - 1]);
    let batch: usize = dims[..rank - 2].iter().product();
    let mut out_dims = dims.to_vec();
    out_dims[rank - 1] = n;
    let (Some(a_skip), Some(b_skip)) = (skip(al, m, k), skip(bl, k, n)) else {
        return Err(candle_core::Error::Msg(format!("matmul: batch layout of {:?} · {:?}", al.stride(), bl.stride())));
    };
    let (a, b) = (&a[al.start_offset()..], &b[bl.start_offset()..]);
    let (a_rs, a_cs) = (al.stride()[rank - 2], al.stride()[rank - 1]);
    let (b_rs, b_cs) = (bl.stride()[rank - 2], bl.stride()[rank - 1]);
    let mut dst = vec![T::zero(); batch * m * n];
    // As candle: a batch-invariant b lets a's batches stack into the rows of one product.
    let (steps, rows) = if b_skip == 0 && a_skip == m * k { (1, batch * m) } else { (batch, m) };
    if rows == 0 || n == 0 {
        return Ok((dst, Shape::from(out_dims)));
    }
    let par = parallelism();
    for step in 0..steps {
        let (a_p, b_p) = (&a[step * a_skip..], &b[step * b_skip..]);
        let d_p = &mut dst[step * m * n..];
        // Every element a view reaches lies in its storage (candle's layouts are checked), and
        // `dst` holds rows · n elements from d_p; T is f32 or f64 (see `matmul`), which gemm
        // supports. The arguments are candle's own (alpha 0, beta 1, dst not read).
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                d_p.as_mut_ptr(),
                1,
                n as isize,
                false,
                a_p.as_ptr(),
                a_cs as isize,
                a_rs as isize,
                b_p.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                T::zero(),
                T::one(),
                false,
                false,
                false,
                par,
            )
        }
    }
    Ok((dst, Shape::from(out_dims)))
}

impl FusedOp<2> for PoolMatmul {
    fn name(&self) -> &'static str {
        "pool-matmul"
    }

    fn cpu<T: Real>(&self, [a, b]: [Cpu<'_>; 2]) -> candle_core::Result<(Vec<T>, Shape)> {
        // Strided views are read in place (as candle does): the storages whole, not `data`.
        product(a.storage.as_slice::<T>()?, a.layout, b.storage.as_slice::<T>()?, b.layout)
    }

    fn bwd(&self, [a, b]: [&Tensor; 2], _res: &Tensor, g: &Tensor) -> candle_core::Result<[Option<Tensor>; 2]> {
        let rank = a.rank();
        let t = |x: &Tensor| x.transpose(rank - 2, rank - 1);
        let da = matmul(g, &t(b)?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let db = matmul(&t(a)?, g).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok([grad_for(a, da), grad_for(b, db)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::bits;
    use candle_core::{Device, Var};

    fn tensor(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|i| ((i as f64 + seed as f64 * 0.37) * 0.731).sin()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    fn pool(n: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap()
    }

    /// Products of the shapes oxrl multiplies: weights seen transposed, decode rows, attention
    /// over a cache view, a batch-invariant right operand (folded), sizes past gemm's threading
    /// threshold.
    fn cases(dtype: DType) -> Vec<(Tensor, Tensor)> {
        let w = tensor(&[300, 256], 1, dtype);
        let q = tensor(&[2, 2, 24, 32], 3, dtype);
        let kv = tensor(&[2, 2, 40, 48], 4, dtype).narrow(3, 8, 32).unwrap();
        vec![
            (tensor(&[200, 256], 2, dtype), w.t().unwrap()),
            (tensor(&[1, 256], 5, dtype), w.t().unwrap()),
            (tensor(&[7, 256], 6, dtype), w.t().unwrap()),
            (q.clone(), kv.t().unwrap()),
            (tensor(&[2, 2, 24, 40], 7, dtype), kv.clone()),
            (
                tensor(&[3, 5, 64], 8, dtype),
                tensor(&[64, 33], 9, dtype).unsqueeze(0).unwrap().broadcast_as((3, 64, 33)).unwrap(),
            ),
            (tensor(&[0, 16], 10, dtype), tensor(&[16, 4], 11, dtype)),
            (tensor(&[3, 0], 12, dtype), tensor(&[0, 4], 13, dtype)),
        ]
    }

    #[test]
    fn equals_candles_matmul_bit_for_bit_at_any_thread_count() {
        for dtype in [DType::F32, DType::F64] {
            let cases = cases(dtype);
            let ours_at_one: Vec<Vec<u64>> =
                pool(1).install(|| cases.iter().map(|(a, b)| bits(&matmul(a, b).unwrap())).collect());
            for threads in [1, 2, 3] {
                pool(threads).install(|| {
                    for (i, (a, b)) in cases.iter().enumerate() {
                        let ours = matmul(a, b).unwrap();
                        let theirs = a.matmul(b).unwrap();
                        assert_eq!(ours.dims(), theirs.dims(), "case {i}");
                        assert_eq!(bits(&ours), bits(&theirs), "case {i}, {dtype:?}, {threads} threads: candle");
                        assert_eq!(bits(&ours), ours_at_one[i], "case {i}, {dtype:?}, {threads} threads vs 1");
                    }
                });
            }
        }
    }

    #[test]
    fn gradients_equal_candles() {
        let a = Var::from_tensor(&tensor(&[2, 5, 6], 1, DType::F64)).unwrap();
        let b = Var::from_tensor(&tensor(&[2, 6, 3], 2, DType::F64)).unwrap();
        let w = tensor(&[2, 5, 3], 3, DType::F64);
        let ours = (matmul(&a, &b).unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let theirs = (a.matmul(&b).unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&a, &b] {
            assert_eq!(bits(ours.get(v).unwrap()), bits(theirs.get(v).unwrap()));
        }
        // A forward on plain tensors builds no graph.
        assert!(!matmul(&a.as_tensor().detach(), &b.as_tensor().detach()).unwrap().track_op());
    }

    #[test]
    fn other_dtypes_and_shapes_take_candles_path() {
        let a = tensor(&[4, 8], 1, DType::BF16);
        let b = tensor(&[8, 2], 2, DType::BF16);
        assert_eq!(matmul(&a, &b).is_ok(), a.matmul(&b).is_ok());
        let bad = matmul(&tensor(&[4, 8], 1, DType::F32), &tensor(&[7, 2], 2, DType::F32));
        assert!(bad.is_err());
    }
}
