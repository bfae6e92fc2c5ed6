//! The gradient sum across processes: a reduce-scatter then an all-gather, in which every
//! element is added in global rank order, so the result is the bits of the same ranks as
//! threads of one process — whatever the MPI library's own reduction order.
//!
//! ```text
//! each process: flatten its L ranks' tensors (f32; f64 stays f64), cut the N elements into W chunks
//! all_to_all:   process q receives chunk q of every rank of every process       (W·L slices)
//!               and adds them in global rank order: ((r0 + r1) + r2) + …          (IEEE adds)
//! all_gather:   every process receives every summed chunk and cuts the tensors back out
//! ```
//! Each process sends and receives about 2·N·L elements whatever W is (a gather of every rank's
//! gradients would receive W·L·N), and holds one chunk of the sum while it is built. Half
//! precision travels and is summed as f32 and is rounded once, at the end, as in one process.

use candle_core::{DType, Device, Tensor};

use super::world::World;
use crate::{Error, Result};

/// One rank's tensors flattened: the f64 tensors' elements, and every other tensor's as f32.
#[derive(Default)]
struct Flat {
    f32s: Vec<f32>,
    f64s: Vec<f64>,
}

fn flatten(tensors: &[Tensor]) -> Result<Flat> {
    let mut flat = Flat::default();
    for t in tensors {
        let t = t.flatten_all()?;
        match t.dtype() {
            DType::F64 => flat.f64s.extend(t.to_vec1::<f64>()?),
            _ => flat.f32s.extend(t.to_dtype(DType::F32)?.to_vec1::<f32>()?),
        }
    }
    Ok(flat)
}

/// The elements `[q·n/w, (q+1)·n/w)`: chunk `q` of `w`.
fn chunk(n: usize, q: usize, w: usize) -> std::ops::Range<usize> {
    q * n / w..(q + 1) * n / w
}

/// Appends `xs` as bytes (native order: the processes of a run share one; every target oxrl
/// builds for is little-endian).
fn put<T: bytemuck::Pod>(out: &mut Vec<u8>, xs: &[T]) {
    out.extend_from_slice(bytemuck::cast_slice(xs));
}

/// Reads `n` values from `bytes[*at..]`.
fn take<T: bytemuck::Pod>(bytes: &[u8], at: &mut usize, n: usize) -> Vec<T> {
    let len = n * std::mem::size_of::<T>();
    let out = bytemuck::pod_collect_to_vec(&bytes[*at..*at + len]);
    *at += len;
    out
}

/// Adds `x` into `acc` element by element (the first slice starts it).
fn add_into<T: Copy + std::ops::Add<Output = T>>(acc: &mut Option<Vec<T>>, x: Vec<T>) {
    match acc {
        None => *acc = Some(x),
        Some(a) => a.iter_mut().zip(x).for_each(|(a, b)| *a = *a + b),
    }
}

/// The sum over every rank of every process of `world`, given this process's ranks' tensors
/// (`local[i]` = local rank i's, all ranks the same shapes in the same order). Every process
/// gets the whole sum, each tensor in its own dtype.
pub fn sum_across(world: &dyn World, local: &[Vec<Tensor>]) -> Result<Vec<Tensor>> {
    let template = local.first().ok_or_else(|| Error::Other("all_reduce: no local ranks".into()))?;
    let flats: Vec<Flat> = local.iter().map(|t| flatten(t)).collect::<Result<_>>()?;
    let (n32, n64) = (flats[0].f32s.len(), flats[0].f64s.len());
    if flats.iter().any(|f| (f.f32s.len(), f.f64s.len()) != (n32, n64)) {
        return Err(Error::Other("all_reduce: local ranks passed tensors of different sizes".into()));
    }
    let (w, me) = (world.size(), world.rank());

    // Reduce-scatter: chunk q of every local rank goes to process q.
    let parts: Vec<Vec<u8>> = (0..w)
        .map(|q| {
            let mut b = vec![];
            for f in &flats {
                put(&mut b, &f.f32s[chunk(n32, q, w)]);
                put(&mut b, &f.f64s[chunk(n64, q, w)]);
            }
            b
        })
        .collect();
    drop(flats);
    let received = world.all_to_all(parts)?;
    let (c32, c64) = (chunk(n32, me, w).len(), chunk(n64, me, w).len());
    let (mut acc32, mut acc64) = (None, None);
    for (p, bytes) in received.iter().enumerate() {
        if bytes.len() != local.len() * (4 * c32 + 8 * c64) {
            return Err(Error::Other(format!(
                "all_reduce: process {p} sent {} bytes where {} ranks of these tensors make {}",
                bytes.len(),
                local.len(),
                local.len() * (4 * c32 + 8 * c64)
            )));
        }
        let mut at = 0;
        for _ in 0..local.len() {
            add_into(&mut acc32, take::<f32>(bytes, &mut at, c32));
            add_into(&mut acc64, take::<f64>(bytes, &mut at, c64));
        }
    }
    drop(received);

    // All-gather the summed chunks; every process cuts the tensors out of the whole.
    let mut mine = vec![];
    put(&mut mine, &acc32.unwrap_or_default());
    put(&mut mine, &acc64.unwrap_or_default());
    let (mut all32, mut all64) = (Vec::with_capacity(n32), Vec::with_capacity(n64));
    for (p, bytes) in world.all_gather(&mine)?.iter().enumerate() {
        let (c32, c64) = (chunk(n32, p, w).len(), chunk(n64, p, w).len());
        if bytes.len() != 4 * c32 + 8 * c64 {
            return Err(Error::Other(format!("all_reduce: process {p}'s summed chunk has {} bytes", bytes.len())));
        }
        let mut at = 0;
        all32.extend(take::<f32>(bytes, &mut at, c32));
        all64.extend(take::<f64>(bytes, &mut at, c64));
    }
    unflatten(template, all32, all64)
}

/// Tensors of `template`'s shapes, dtypes and device from the flat sums.
fn unflatten(template: &[Tensor], f32s: Vec<f32>, f64s: Vec<f64>) -> Result<Vec<Tensor>> {
    let (mut at32, mut at64) = (0, 0);
    let mut out = Vec::with_capacity(template.len());
    for t in template {
        let (n, device) = (t.elem_count(), t.device());
        let sum = if t.dtype() == DType::F64 {
            at64 += n;
            Tensor::from_slice(&f64s[at64 - n..at64], t.dims(), &Device::Cpu)?
        } else {
            at32 += n;
            Tensor::from_slice(&f32s[at32 - n..at32], t.dims(), &Device::Cpu)?.to_dtype(t.dtype())?
        };
        out.push(sum.to_device(device)?);
    }
    Ok(out)
}
