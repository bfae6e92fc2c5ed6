//! Tensors that each belong to one rank, moved between processes: the gradient sum delivered
//! to each tensor's owner alone (the reduce-scatter of `sharding = "gradients"`) and the
//! owners' tensors gathered (the parameters after a sharded step; the optimizer state to rank 0
//! for a checkpoint).
//!
//! ```text
//! a tensor of more than BUCKET elements cut into flat pieces of at most BUCKET (the sum is
//! elementwise, so the pieces add as the whole does); the pieces cut into buckets of whole pieces,
//! at most BUCKET elements, so that no message, hence no receiver's copy, holds more
//! reduce_to_owners, per bucket:
//!     all_to_all:  process q receives every rank's copy of the bucket's tensors that q's ranks own
//!                  and adds them in global rank order (the in-process sum, so the same bits)
//! gather, per bucket:
//!     all_gather (every process) or all_to_all to the root's process: each owner's tensors
//! ```
//! Tensors cross as safetensors bytes (dtype and shape exactly), one bucket's messages at a
//! time; a cut tensor's summed pieces are written over the owner's own copy as they arrive, its
//! gathered pieces appended to one buffer. Global rank `p·L + i` is local rank i of process p
//! (L ranks per process).

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{CpuStorage, DType, Device, Shape, Tensor};

use super::collective::sum_in_rank_order;
use crate::worker::in_place::write_at;
use crate::world::World;
use crate::{Error, Result};

/// Elements per bucket (16 MiB of f32). An owner receives every process's copy of a bucket at
/// once, and decodes them beside the bytes: about 2·W buckets at the peak of a reduce.
const BUCKET: usize = 1 << 22;

/// Consecutive tensors of at most `bucket` elements together (at least one tensor each).
fn buckets(sizes: &[usize], bucket: usize) -> Vec<Range<usize>> {
    let mut out = vec![];
    let (mut start, mut elements) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && elements + n > bucket {
            out.push(start..i);
            (start, elements) = (i, 0);
        }
        elements += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

fn pack(named: Vec<(String, Tensor)>) -> Result<Vec<u8>> {
    if named.is_empty() {
        return Ok(vec![]);
    }
    safetensors::serialize(named, None).map_err(|e| Error::Other(format!("packing tensors: {e}")))
}

fn unpack(bytes: &[u8], process: usize) -> Result<HashMap<String, Tensor>> {
    if bytes.is_empty() {
        return Ok(HashMap::new());
    }
    candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
        .map_err(|e| Error::Other(format!("process {process} sent unreadable tensors: {e}")))
}

/// The sum over every rank of every process of each tensor, returned (`Some`) for the tensors
/// that this process's ranks own (`owners[i]`, a global rank). `local[r]` = local rank r's
/// tensors, every rank the same shapes in the same order. The tensors are handed over: a sum cut
/// into pieces is written over local rank 0's tensor as its pieces arrive (so an owner holds one
/// tensor's worth, not its gradient, the summed pieces and their join), which must therefore own
/// its storage (`crate::worker::in_place`).
pub fn reduce_to_owners(world: &dyn World, local: Vec<Vec<Tensor>>, owners: &[usize]) -> Result<Vec<Option<Tensor>>> {
    reduce_in_pieces(world, local, owners, BUCKET)
}

/// Where each tensor's flat pieces of at most `bucket` elements lie: tensor i is pieces
/// `ranges[i]` of the piece list, a tensor of at most `bucket` elements one piece (itself).
struct Pieces {
    ranges: Vec<Range<usize>>,
    bucket: usize,
}

impl Pieces {
    fn new(sizes: &[usize], bucket: usize) -> Self {
        let mut ranges = Vec::with_capacity(sizes.len());
        let mut next = 0;
        for &n in sizes {
            let k = n.div_ceil(bucket).max(1);
            ranges.push(next..next + k);
            next += k;
        }
        Pieces { ranges, bucket }
    }

    fn count(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// Tensor i's index for each piece.
    fn tensor_of(&self) -> Vec<usize> {
        self.ranges.iter().enumerate().flat_map(|(i, r)| r.clone().map(move |_| i)).collect()
    }

    /// `t` (tensor i) as its pieces: itself when it is one, else views of its flat elements.
    fn cut(&self, i: usize, t: &Tensor) -> Result<Vec<Tensor>> {
        if self.ranges[i].len() == 1 {
            return Ok(vec![t.clone()]);
        }
        let flat = t.flatten_all()?;
        let n = flat.elem_count();
        (0..n).step_by(self.bucket).map(|s| Ok(flat.narrow(0, s, self.bucket.min(n - s))?)).collect()
    }
}

/// One tensor's pieces, in order, appended to one buffer as they arrive and each dropped, so the
/// join holds one piece beside the buffer (pieces off the CPU are kept and concatenated).
enum Join {
    Cpu(CpuStorage),
    Kept(Vec<Tensor>),
}

impl Join {
    /// A join of `n` elements whose first piece is `first`.
    fn new(first: &Tensor, n: usize) -> Self {
        let cpu = first.device().is_cpu();
        match first.dtype() {
            DType::F32 if cpu => Join::Cpu(CpuStorage::F32(Vec::with_capacity(n))),
            DType::F64 if cpu => Join::Cpu(CpuStorage::F64(Vec::with_capacity(n))),
            DType::BF16 if cpu => Join::Cpu(CpuStorage::BF16(Vec::with_capacity(n))),
            DType::F16 if cpu => Join::Cpu(CpuStorage::F16(Vec::with_capacity(n))),
            _ => Join::Kept(vec![]),
        }
    }

    fn push(&mut self, piece: Tensor) -> Result<()> {
        let piece = piece.flatten_all()?;
        let mismatch = |e: candle_core::Error| Error::Other(format!("joining a tensor's pieces: {e}"));
        match self {
            Join::Cpu(CpuStorage::F32(all)) => all.extend(piece.to_vec1::<f32>().map_err(mismatch)?),
            Join::Cpu(CpuStorage::F64(all)) => all.extend(piece.to_vec1::<f64>().map_err(mismatch)?),
            Join::Cpu(CpuStorage::BF16(all)) => all.extend(piece.to_vec1::<half::bf16>().map_err(mismatch)?),
            Join::Cpu(CpuStorage::F16(all)) => all.extend(piece.to_vec1::<half::f16>().map_err(mismatch)?),
            Join::Cpu(_) => return Err(Error::Other("joining a tensor's pieces: not a float tensor".into())),
            Join::Kept(pieces) => pieces.push(piece),
        }
        Ok(())
    }

    /// The joined tensor, of `shape`.
    fn finish(self, shape: &Shape) -> Result<Tensor> {
        let cpu = &Device::Cpu;
        Ok(match self {
            Join::Cpu(CpuStorage::F32(all)) => Tensor::from_vec(all, shape, cpu)?,
            Join::Cpu(CpuStorage::F64(all)) => Tensor::from_vec(all, shape, cpu)?,
            Join::Cpu(CpuStorage::BF16(all)) => Tensor::from_vec(all, shape, cpu)?,
            Join::Cpu(CpuStorage::F16(all)) => Tensor::from_vec(all, shape, cpu)?,
            Join::Cpu(_) => return Err(Error::Other("joining a tensor's pieces: not a float tensor".into())),
            Join::Kept(pieces) => Tensor::cat(&pieces, 0)?.reshape(shape)?,
        })
    }
}

/// The pieces of one tensor, in order, joined into a tensor of `shape`.
fn join(pieces: Vec<Tensor>, shape: &Shape) -> Result<Tensor> {
    if pieces.len() == 1 {
        return Ok(pieces.into_iter().next().expect("one piece").reshape(shape)?);
    }
    let mut pieces = pieces.into_iter();
    let first = pieces.next().ok_or_else(|| Error::Other("a tensor of no pieces".into()))?;
    let mut j = Join::new(&first, shape.elem_count());
    j.push(first)?;
    for piece in pieces {
        j.push(piece)?;
    }
    j.finish(shape)
}

/// [`reduce_to_owners`] with tensors cut into pieces of at most `bucket` elements.
fn reduce_in_pieces(
    world: &dyn World,
    local: Vec<Vec<Tensor>>,
    owners: &[usize],
    bucket: usize,
) -> Result<Vec<Option<Tensor>>> {
    let template = local.first().ok_or_else(|| Error::Other("reduce_to_owners: no local ranks".into()))?.clone();
    if owners.len() != template.len() {
        return Err(Error::Other(format!("{} owners for {} tensors", owners.len(), template.len())));
    }
    let pieces = Pieces::new(&template.iter().map(Tensor::elem_count).collect::<Vec<_>>(), bucket);
    let cut: Vec<Vec<Tensor>> = local
        .iter()
        .map(|tensors| {
            let all = tensors.iter().enumerate().map(|(i, t)| pieces.cut(i, t)).collect::<Result<Vec<_>>>()?;
            Ok(all.into_iter().flatten().collect())
        })
        .collect::<Result<_>>()?;
    drop(local);
    let tensor_of = pieces.tensor_of();
    let piece_owners: Vec<usize> = tensor_of.iter().map(|&i| owners[i]).collect();
    // Tensor i's summed pieces: written over it in place (`true`), or kept to be joined.
    let mut in_place = vec![true; template.len()];
    let mut kept: Vec<Vec<Tensor>> = vec![vec![]; template.len()];
    let mut delivered = vec![0usize; template.len()];
    reduce_in_buckets(world, &cut, &piece_owners, bucket, &mut |k, sum| {
        let i = tensor_of[k];
        let first = pieces.ranges[i].start;
        if pieces.ranges[i].len() > 1 && in_place[i] {
            // Piece k's elements of tensor i were packed for every owner before its sum came back.
            if write_at(&template[i], (k - first) * pieces.bucket, &sum)? {
                delivered[i] += 1;
                return Ok(());
            }
            if k != first {
                return Err(Error::Other(format!("reduce_to_owners: tensor {i} took part of its sum in place")));
            }
            in_place[i] = false; // not a plain CPU tensor: its pieces are joined
        }
        kept[i].push(sum);
        delivered[i] += 1;
        Ok(())
    })?;
    drop(cut);
    let mut out = Vec::with_capacity(template.len());
    for (i, range) in pieces.ranges.iter().enumerate() {
        out.push(match delivered[i] {
            0 => None,
            n if n != range.len() => {
                return Err(Error::Other(format!("reduce_to_owners: part of tensor {i}'s sum is missing")))
            }
            _ if range.len() > 1 && in_place[i] => Some(template[i].clone()),
            _ => Some(join(std::mem::take(&mut kept[i]), template[i].shape())?),
        });
    }
    Ok(out)
}

/// The sums of the tensors (pieces) of `local` that this process owns, handed to `deliver` with
/// their index as each bucket's arrive.
fn reduce_in_buckets(
    world: &dyn World,
    local: &[Vec<Tensor>],
    owners: &[usize],
    bucket: usize,
    deliver: &mut dyn FnMut(usize, Tensor) -> Result<()>,
) -> Result<()> {
    let (w, me, per) = (world.size(), world.rank(), local.len());
    let template = local.first().ok_or_else(|| Error::Other("reduce_to_owners: no local ranks".into()))?;
    if owners.len() != template.len() {
        return Err(Error::Other(format!("{} owners for {} tensors", owners.len(), template.len())));
    }
    let process_of = |i: usize| owners[i] / per;
    let sizes: Vec<usize> = template.iter().map(|t| t.elem_count()).collect();
    for range in buckets(&sizes, bucket) {
        let parts = (0..w)
            .map(|q| {
                let mut named = vec![];
                for i in range.clone().filter(|&i| process_of(i) == q) {
                    for (r, tensors) in local.iter().enumerate() {
                        named.push((format!("{i}.{r}"), tensors[i].clone()));
                    }
                }
                pack(named)
            })
            .collect::<Result<Vec<_>>>()?;
        let received: Vec<HashMap<String, Tensor>> =
            world.all_to_all(parts)?.iter().enumerate().map(|(p, b)| unpack(b, p)).collect::<Result<_>>()?;
        for i in range.filter(|&i| process_of(i) == me) {
            // Every rank's copy, global rank order: process by process, local rank by local rank.
            let mut copies = Vec::with_capacity(w * per);
            for (p, tensors) in received.iter().enumerate() {
                for r in 0..per {
                    let t = tensors.get(&format!("{i}.{r}")).ok_or_else(|| {
                        Error::Other(format!("reduce_to_owners: process {p} did not send rank {r}'s tensor {i}"))
                    })?;
                    copies.push(vec![t.clone()]);
                }
            }
            let sum = sum_in_rank_order(copies)?.pop().expect("one tensor");
            deliver(i, sum.to_device(template[i].device())?)?;
        }
    }
    Ok(())
}

/// Every process's `Some` tensors (each index on at most one process), on every process
/// (`root` `None`) or on process `root` alone (the others get `None`s). `sizes[i]`: tensor i's
/// element count, the same on every process (it cuts the buckets); `device`: where the
/// received tensors go.
pub fn gather(
    world: &dyn World,
    mine: Vec<Option<Tensor>>,
    sizes: &[usize],
    root: Option<usize>,
    device: &Device,
) -> Result<Vec<Option<Tensor>>> {
    gather_in_pieces(world, mine, sizes, root, device, BUCKET)
}

/// [`gather`] with tensors cut into pieces of at most `bucket` elements; a cut tensor's shape
/// travels beside its pieces (only its owner has it).
fn gather_in_pieces(
    world: &dyn World,
    mine: Vec<Option<Tensor>>,
    sizes: &[usize],
    root: Option<usize>,
    device: &Device,
    bucket: usize,
) -> Result<Vec<Option<Tensor>>> {
    if mine.len() != sizes.len() {
        return Err(Error::Other(format!("gather: {} tensors for {} sizes", mine.len(), sizes.len())));
    }
    let pieces = Pieces::new(sizes, bucket);
    let mut cut: Vec<Option<Tensor>> = Vec::with_capacity(pieces.count());
    let mut shapes: Vec<(usize, Vec<usize>)> = vec![];
    for (i, t) in mine.iter().enumerate() {
        match t {
            Some(t) => {
                if pieces.ranges[i].len() > 1 {
                    shapes.push((i, t.dims().to_vec()));
                }
                cut.extend(pieces.cut(i, t)?.into_iter().map(Some));
            }
            None => cut.extend(pieces.ranges[i].clone().map(|_| None)),
        }
    }
    drop(mine);
    let piece_sizes: Vec<usize> = (0..sizes.len())
        .flat_map(|i| {
            let (n, k) = (sizes[i], pieces.ranges[i].len());
            (0..k).map(move |j| if k == 1 { n } else { bucket.min(n - j * bucket) })
        })
        .collect();
    let mut shape_of: HashMap<usize, Vec<usize>> = HashMap::new();
    if shapes_needed(&pieces) {
        let all = to_all_or_root(world, crate::world::encode(&shapes)?, root)?;
        for bytes in all.iter().filter(|b| !b.is_empty()) {
            shape_of.extend(crate::world::decode::<Vec<(usize, Vec<usize>)>>(bytes)?);
        }
    }
    // Each tensor as its pieces arrive: whole (one piece), or joined piece by piece.
    let tensor_of = pieces.tensor_of();
    let mut whole: Vec<Option<Tensor>> = vec![None; sizes.len()];
    let mut joins: Vec<Option<Join>> = (0..sizes.len()).map(|_| None).collect();
    let mut arrived = vec![0usize; sizes.len()];
    gather_in_buckets(world, cut, &piece_sizes, root, device, bucket, &mut |k, t| {
        let i = tensor_of[k];
        arrived[i] += 1;
        match pieces.ranges[i].len() {
            1 => whole[i] = Some(t),
            _ => joins[i].get_or_insert_with(|| Join::new(&t, sizes[i])).push(t)?,
        }
        Ok(())
    })?;
    let mut out = Vec::with_capacity(sizes.len());
    for (i, range) in pieces.ranges.iter().enumerate() {
        out.push(match (arrived[i], joins[i].take()) {
            (0, _) => None,
            (n, _) if n != range.len() => return Err(Error::Other(format!("gather: part of tensor {i} is missing"))),
            (_, None) => whole[i].take(),
            (_, Some(j)) => {
                let dims = shape_of.get(&i).ok_or_else(|| Error::Other(format!("gather: no shape for tensor {i}")))?;
                Some(j.finish(&Shape::from(dims.clone()))?)
            }
        });
    }
    Ok(out)
}

/// Every process's `bytes`, on every process (`root` `None`) or on process `root` alone (the
/// others receive empty messages).
fn to_all_or_root(world: &dyn World, bytes: Vec<u8>, root: Option<usize>) -> Result<Vec<Vec<u8>>> {
    match root {
        None => world.all_gather(&bytes),
        Some(root) => {
            let mut parts = vec![vec![]; world.size()];
            parts[root] = bytes;
            world.all_to_all(parts)
        }
    }
}

/// Whether any tensor is cut (its shape must then travel).
fn shapes_needed(pieces: &Pieces) -> bool {
    pieces.ranges.iter().any(|r| r.len() > 1)
}

/// Every owner's tensors (pieces) of `mine`, handed to `deliver` with their index as each
/// bucket's arrive (on the root's process alone when there is a root).
fn gather_in_buckets(
    world: &dyn World,
    mut mine: Vec<Option<Tensor>>,
    sizes: &[usize],
    root: Option<usize>,
    device: &Device,
    bucket: usize,
    deliver: &mut dyn FnMut(usize, Tensor) -> Result<()>,
) -> Result<()> {
    if mine.len() != sizes.len() {
        return Err(Error::Other(format!("gather: {} tensors for {} sizes", mine.len(), sizes.len())));
    }
    let me = world.rank();
    let mut seen = vec![false; sizes.len()];
    for range in buckets(sizes, bucket) {
        let named: Vec<(String, Tensor)> =
            range.clone().filter_map(|i| Some((i.to_string(), mine[i].take()?))).collect();
        let received = to_all_or_root(world, pack(named)?, root)?;
        if root.is_some_and(|r| r != me) {
            continue;
        }
        for (p, bytes) in received.iter().enumerate() {
            for (name, t) in unpack(bytes, p)? {
                let i: usize = name.parse().map_err(|_| Error::Other(format!("gather: process {p} sent `{name}`")))?;
                if !range.contains(&i) || std::mem::replace(&mut seen[i], true) {
                    return Err(Error::Other(format!("gather: tensor {i} came twice or out of its bucket")));
                }
                deliver(i, if device.is_cpu() { t } else { t.to_device(device)? })?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{bits, rank_gradients as grads};
    use crate::world::ThreadWorld;

    #[test]
    fn large_tensors_are_cut_into_pieces_of_a_bucket_at_most() {
        let p = Pieces::new(&[3, 10, 7, 0], 4);
        assert_eq!(p.ranges, vec![0..1, 1..4, 4..6, 6..7]);
        assert_eq!(p.tensor_of(), vec![0, 1, 1, 1, 2, 2, 3]);
        let t = Tensor::arange(0f32, 10., &Device::Cpu).unwrap().reshape((2, 5)).unwrap();
        let cut = p.cut(1, &t).unwrap();
        assert_eq!(cut.iter().map(|c| c.elem_count()).collect::<Vec<_>>(), vec![4, 4, 2]);
        assert_eq!(bits(&join(cut, t.shape()).unwrap()), bits(&t));
    }

    #[test]
    fn buckets_hold_whole_tensors() {
        assert_eq!(buckets(&[3, 4, 10, 1, 1], 7), vec![0..2, 2..3, 3..5]);
        assert_eq!(buckets(&[], 7), Vec::<Range<usize>>::new());
        assert_eq!(buckets(&[9], 7), vec![0..1]);
    }

    /// 3 processes × 2 ranks, every bucket size (the smaller ones cut the tensors into pieces):
    /// each owner receives the bits of the six ranks added in order, in its tensors' shapes,
    /// nobody else anything; then the owners' sums gathered everywhere and to one root.
    #[test]
    fn owners_get_the_sum_in_rank_order_and_gathers_deliver_it() {
        let (processes, local) = (3, 2);
        let owners = [5, 1, 0, 3, 2];
        let want = sum_in_rank_order((0..processes * local).map(grads).collect()).unwrap();
        for bucket in [1, 20, 40, 1 << 24] {
            let worlds = ThreadWorld::world(processes);
            // Per process: what it owns after the reduce, the gather to all, the gather to a root.
            type Outcome = (Vec<Option<Tensor>>, Vec<Option<Tensor>>, Vec<Option<Tensor>>);
            let got: Vec<Outcome> = std::thread::scope(|s| {
                let hs: Vec<_> = (worlds.iter().enumerate())
                    .map(|(p, w)| {
                        s.spawn(move || {
                            let mine: Vec<Vec<Tensor>> = (0..local).map(|i| grads(p * local + i)).collect();
                            let sizes: Vec<usize> = mine[0].iter().map(|t| t.elem_count()).collect();
                            let owned = reduce_in_pieces(w, mine, &owners, bucket).unwrap();
                            let all = gather_in_pieces(w, owned.clone(), &sizes, None, &Device::Cpu, bucket);
                            let root = gather_in_pieces(w, owned.clone(), &sizes, Some(1), &Device::Cpu, bucket);
                            (owned, all.unwrap(), root.unwrap())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (p, (owned, all, root)) in got.iter().enumerate() {
                for (i, want) in want.iter().enumerate() {
                    let mine = owners[i] / local == p;
                    assert_eq!(owned[i].is_some(), mine, "bucket {bucket}, process {p}, tensor {i}");
                    for t in owned[i].iter().chain(all[i].iter()).chain(root[i].iter()) {
                        assert_eq!((t.dtype(), t.dims()), (want.dtype(), want.dims()));
                        assert_eq!(bits(t), bits(want), "bucket {bucket}, process {p}, tensor {i}");
                    }
                    assert!(all[i].is_some(), "bucket {bucket}: process {p} lacks tensor {i}");
                    assert_eq!(root[i].is_some(), p == 1, "bucket {bucket}: only the root gathers");
                }
            }
        }
    }
}
