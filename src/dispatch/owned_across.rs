//! Tensors that each belong to one rank, moved between processes: the gradient sum delivered
//! to each tensor's owner alone (the reduce-scatter of `sharding = "gradients"`) and the
//! owners' tensors gathered (the parameters after a sharded step; the optimizer state to rank 0
//! for a checkpoint).
//!
//! ```text
//! the tensors cut into buckets of whole tensors, at most BUCKET elements (a larger one alone)
//! reduce_to_owners, per bucket:
//!     all_to_all:  process q receives every rank's copy of the bucket's tensors that q's ranks own
//!                  and adds them in global rank order (the in-process sum, so the same bits)
//! gather, per bucket:
//!     all_gather (every process) or all_to_all to the root's process: each owner's tensors
//! ```
//! Tensors cross as safetensors bytes (dtype and shape exactly), one bucket's messages at a
//! time. Global rank `p·L + i` is local rank i of process p (L ranks per process).

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{Device, Tensor};

use super::collective::sum_in_rank_order;
use crate::world::World;
use crate::{Error, Result};

/// Elements per bucket (64 MiB of f32).
const BUCKET: usize = 1 << 24;

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
/// tensors, every rank the same shapes in the same order.
pub fn reduce_to_owners(world: &dyn World, local: &[Vec<Tensor>], owners: &[usize]) -> Result<Vec<Option<Tensor>>> {
    reduce_in_buckets(world, local, owners, BUCKET)
}

fn reduce_in_buckets(
    world: &dyn World,
    local: &[Vec<Tensor>],
    owners: &[usize],
    bucket: usize,
) -> Result<Vec<Option<Tensor>>> {
    let (w, me, per) = (world.size(), world.rank(), local.len());
    let template = local.first().ok_or_else(|| Error::Other("reduce_to_owners: no local ranks".into()))?;
    if owners.len() != template.len() {
        return Err(Error::Other(format!("{} owners for {} tensors", owners.len(), template.len())));
    }
    let process_of = |i: usize| owners[i] / per;
    let sizes: Vec<usize> = template.iter().map(|t| t.elem_count()).collect();
    let mut out: Vec<Option<Tensor>> = vec![None; template.len()];
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
            out[i] = Some(sum.to_device(template[i].device())?);
        }
    }
    Ok(out)
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
    gather_in_buckets(world, mine, sizes, root, device, BUCKET)
}

fn gather_in_buckets(
    world: &dyn World,
    mut mine: Vec<Option<Tensor>>,
    sizes: &[usize],
    root: Option<usize>,
    device: &Device,
    bucket: usize,
) -> Result<Vec<Option<Tensor>>> {
    if mine.len() != sizes.len() {
        return Err(Error::Other(format!("gather: {} tensors for {} sizes", mine.len(), sizes.len())));
    }
    let (w, me) = (world.size(), world.rank());
    let mut out: Vec<Option<Tensor>> = vec![None; sizes.len()];
    for range in buckets(sizes, bucket) {
        let named: Vec<(String, Tensor)> =
            range.clone().filter_map(|i| Some((i.to_string(), mine[i].take()?))).collect();
        let received = match root {
            None => world.all_gather(&pack(named)?)?,
            Some(root) => {
                let mut parts = vec![vec![]; w];
                parts[root] = pack(named)?;
                world.all_to_all(parts)?
            }
        };
        if root.is_some_and(|r| r != me) {
            continue;
        }
        for (p, bytes) in received.iter().enumerate() {
            for (name, t) in unpack(bytes, p)? {
                let i: usize = name.parse().map_err(|_| Error::Other(format!("gather: process {p} sent `{name}`")))?;
                if !range.contains(&i) || out[i].is_some() {
                    return Err(Error::Other(format!("gather: tensor {i} came twice or out of its bucket")));
                }
                out[i] = Some(if device.is_cpu() { t } else { t.to_device(device)? });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{bits, rank_gradients as grads};
    use crate::world::ThreadWorld;

    #[test]
    fn buckets_hold_whole_tensors() {
        assert_eq!(buckets(&[3, 4, 10, 1, 1], 7), vec![0..2, 2..3, 3..5]);
        assert_eq!(buckets(&[], 7), Vec::<Range<usize>>::new());
        assert_eq!(buckets(&[9], 7), vec![0..1]);
    }

    /// 3 processes × 2 ranks, every bucket size: each owner receives the bits of the six ranks
    /// added in order, nobody else anything; then the owners' sums gathered everywhere and to
    /// one root.
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
                            let owned = reduce_in_buckets(w, &mine, &owners, bucket).unwrap();
                            let sizes: Vec<usize> = mine[0].iter().map(|t| t.elem_count()).collect();
                            let all = gather_in_buckets(w, owned.clone(), &sizes, None, &Device::Cpu, bucket);
                            let root = gather_in_buckets(w, owned.clone(), &sizes, Some(1), &Device::Cpu, bucket);
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
