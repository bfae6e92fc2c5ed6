//! The gradient sum across processes: a reduce-scatter then an all-gather, in which every
//! element is added in global rank order, so the result is the bits of the same ranks as
//! threads of one process — whatever the MPI library's own reduction order.
//!
//! ```text
//! the tensors, as one flat vector of N elements (f32; f64 tensors in a vector of their own)
//! for each bucket of at most BUCKET elements, cut into W chunks:
//!     all_to_all:  process q receives chunk q of every rank of every process      (W·L slices)
//!                  and adds them in global rank order: ((r0 + r1) + r2) + …         (IEEE adds)
//!     all_gather:  every process receives every summed chunk of the bucket
//! ```
//! Each process sends and receives about 2·N·L elements whatever W is (a gather of every rank's
//! gradients would receive W·L·N), and beyond the sum it builds holds one bucket's messages at a
//! time. Half precision travels and is summed as f32 and is rounded once, at the end, as in one
//! process.

use candle_core::{DType, Device, Tensor, WithDType};

use crate::world::World;
use crate::{Error, Result};

/// Elements summed per round of messages (64 MiB of f32).
const BUCKET: usize = 1 << 24;

/// The sum over every rank of every process of `world`, given this process's ranks' tensors
/// (`local[i]` = local rank i's, all ranks the same shapes in the same order). Every process
/// gets the whole sum, each tensor in its own dtype and on its own device.
pub fn sum_across(world: &dyn World, local: &[Vec<Tensor>]) -> Result<Vec<Tensor>> {
    sum_in_buckets(world, local, BUCKET)
}

fn sum_in_buckets(world: &dyn World, local: &[Vec<Tensor>], bucket: usize) -> Result<Vec<Tensor>> {
    let template = local.first().ok_or_else(|| Error::Other("all_reduce: no local ranks".into()))?;
    for (r, tensors) in local.iter().enumerate() {
        if tensors.len() != template.len() || tensors.iter().zip(template).any(|(a, b)| a.dims() != b.dims()) {
            return Err(Error::Other(format!("all_reduce: local rank {r} passed other shapes than local rank 0")));
        }
    }
    let mut out: Vec<Option<Tensor>> = vec![None; template.len()];
    let f64s: Vec<usize> = (0..template.len()).filter(|&i| template[i].dtype() == DType::F64).collect();
    let others: Vec<usize> = (0..template.len()).filter(|&i| template[i].dtype() != DType::F64).collect();
    sum_class::<f32>(world, local, &others, bucket, &mut out)?;
    sum_class::<f64>(world, local, &f64s, bucket, &mut out)?;
    Ok(out.into_iter().map(|t| t.expect("every tensor is in one class")).collect())
}

/// Sums the tensors `which` of every rank as elements of type `T`, into `out[i]`.
fn sum_class<T: WithDType + bytemuck::Pod + std::ops::AddAssign>(
    world: &dyn World,
    local: &[Vec<Tensor>],
    which: &[usize],
    bucket_len: usize,
    out: &mut [Option<Tensor>],
) -> Result<()> {
    let (w, me) = (world.size(), world.rank());
    // Each rank's tensors of the class, flat, as T (a view when they already are).
    let flats: Vec<Vec<Tensor>> = local
        .iter()
        .map(|ts| which.iter().map(|&i| ts[i].flatten_all()?.to_dtype(T::DTYPE)).collect())
        .collect::<candle_core::Result<_>>()?;
    let lens: Vec<usize> = flats[0].iter().map(|t| t.elem_count()).collect();
    let n: usize = lens.iter().sum();
    let mut sums: Vec<Vec<T>> = lens.iter().map(|&l| Vec::with_capacity(l)).collect();
    for lo in (0..n).step_by(bucket_len) {
        let m = bucket_len.min(n - lo);
        // Reduce-scatter: chunk q of the bucket, of every local rank, goes to process q.
        let parts: Vec<Vec<u8>> = (0..w)
            .map(|q| {
                let c = chunk(m, q, w);
                let mut bytes = Vec::with_capacity(local.len() * c.len() * T::DTYPE.size_in_bytes());
                for rank in &flats {
                    bytes.extend_from_slice(bytemuck::cast_slice(&read::<T>(rank, &lens, lo + c.start, lo + c.end)?));
                }
                Ok(bytes)
            })
            .collect::<Result<_>>()?;
        let received = world.all_to_all(parts)?;
        let mine = chunk(m, me, w).len();
        let mut acc: Option<Vec<T>> = None;
        for (p, bytes) in received.iter().enumerate() {
            let per_rank = mine * T::DTYPE.size_in_bytes();
            if bytes.len() != local.len() * per_rank {
                return Err(Error::Other(format!(
                    "all_reduce: process {p} sent {} bytes where {} ranks of these tensors make {}",
                    bytes.len(),
                    local.len(),
                    local.len() * per_rank
                )));
            }
            for slice in bytes.chunks_exact(per_rank.max(1)).take(local.len()) {
                let x: Vec<T> = bytemuck::pod_collect_to_vec(slice);
                match &mut acc {
                    None => acc = Some(x),
                    Some(a) => a.iter_mut().zip(x).for_each(|(a, b)| *a += b),
                }
            }
        }
        // All-gather the bucket's summed chunks, in process order: the bucket's sum.
        let summed: Vec<u8> = bytemuck::cast_slice(&acc.unwrap_or_default()).to_vec();
        let mut bucket: Vec<T> = Vec::with_capacity(m);
        for (p, bytes) in world.all_gather(&summed)?.iter().enumerate() {
            if bytes.len() != chunk(m, p, w).len() * T::DTYPE.size_in_bytes() {
                return Err(Error::Other(format!("all_reduce: process {p}'s summed chunk has {} bytes", bytes.len())));
            }
            bucket.extend(bytemuck::pod_collect_to_vec::<u8, T>(bytes));
        }
        scatter_into(&mut sums, &lens, lo, bucket);
    }
    for ((&i, sum), len) in which.iter().zip(sums).zip(lens) {
        let t = &local[0][i];
        debug_assert_eq!(sum.len(), len);
        let s = Tensor::from_vec(sum, t.dims(), &Device::Cpu)?.to_dtype(t.dtype())?;
        out[i] = Some(s.to_device(t.device())?);
    }
    Ok(())
}

/// The elements `[q·n/w, (q+1)·n/w)`: chunk `q` of `w`.
fn chunk(n: usize, q: usize, w: usize) -> std::ops::Range<usize> {
    q * n / w..(q + 1) * n / w
}

/// Elements `[lo, hi)` of the concatenation of `flats` (flat tensors of lengths `lens`).
fn read<T: WithDType>(flats: &[Tensor], lens: &[usize], lo: usize, hi: usize) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(hi - lo);
    let mut start = 0;
    for (t, &len) in flats.iter().zip(lens) {
        let (a, b) = (lo.max(start), hi.min(start + len));
        if a < b {
            out.extend(t.narrow(0, a - start, b - a)?.to_vec1::<T>()?);
        }
        start += len;
    }
    Ok(out)
}

/// Appends `bucket` (elements from `lo` on of the concatenation) to the per-tensor sums.
fn scatter_into<T>(sums: &mut [Vec<T>], lens: &[usize], lo: usize, bucket: Vec<T>) {
    let (mut start, mut values) = (0, bucket.into_iter());
    let hi = lo + values.len();
    for (sum, &len) in sums.iter_mut().zip(lens) {
        let (a, b) = (lo.max(start), hi.min(start + len));
        if a < b {
            sum.extend(values.by_ref().take(b - a));
        }
        start += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{bits, rank_gradients as grads};
    use crate::world::ThreadWorld;

    /// The sum the way one process adds its threads' tensors: widened, rank after rank.
    fn expected(ranks: usize) -> Vec<Tensor> {
        let wide = |t: Tensor| if t.dtype() == DType::BF16 { t.to_dtype(DType::F32).unwrap() } else { t };
        let mut acc: Vec<Tensor> = grads(0).into_iter().map(wide).collect();
        for r in 1..ranks {
            acc = acc.iter().zip(grads(r)).map(|(a, b)| (a + wide(b)).unwrap()).collect();
        }
        acc.into_iter().zip(grads(0)).map(|(s, t)| s.to_dtype(t.dtype()).unwrap()).collect()
    }

    /// 3 processes × 2 ranks, with buckets that cut tensors (and chunks smaller than the world):
    /// the bits of the six ranks added in order, dtypes and shapes kept.
    #[test]
    fn buckets_of_any_size_give_the_sum_in_rank_order() {
        let (processes, local) = (3, 2);
        let want = expected(processes * local);
        for bucket in [1, 2, 7, 10, 1 << 24] {
            let worlds = ThreadWorld::world(processes);
            let got: Vec<Vec<Tensor>> = std::thread::scope(|s| {
                let hs: Vec<_> = (worlds.iter().enumerate())
                    .map(|(p, w)| {
                        s.spawn(move || {
                            let mine: Vec<Vec<Tensor>> = (0..local).map(|i| grads(p * local + i)).collect();
                            sum_in_buckets(w, &mine, bucket).unwrap()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (p, sum) in got.iter().enumerate() {
                for (i, (a, b)) in sum.iter().zip(&want).enumerate() {
                    assert_eq!(
                        (a.dtype(), a.dims()),
                        (b.dtype(), b.dims()),
                        "bucket {bucket}, process {p}, tensor {i}"
                    );
                    assert_eq!(bits(a), bits(b), "bucket {bucket}, process {p}, tensor {i}");
                }
            }
        }
    }
}
