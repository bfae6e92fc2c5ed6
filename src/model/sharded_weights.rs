//! A model whose weights live in slices across data-parallel ranks (ZeRO-3, FSDP's FULL_SHARD).
//!
//! Each base weight has one owning rank, which keeps it; on the others its storage is released
//! (emptied in place: the tensor keeps its id, shape and dtype, so gradients, optimizer state and
//! names still find it, but it holds no elements). The model is cut into units, visited in a
//! fixed order by every forward and backward:
//!
//! ```text
//! forward    Embed, Layer(0), …, Layer(L−1), Head        (Head: the final norm and the LM head)
//! backward   Head, Layer(L−1), …, Layer(0)               (the embedding's gradient reads no weight)
//! ```
//! Just before a unit is read, [`UnitGather::gather`] makes its weights whole on every rank (each
//! owner sends its tensors); just after, [`UnitGather::release`] frees the ones this rank does not
//! own. The gathered tensors are the owners' bits, so every product is the unsharded one.
//! Every rank of the group must visit the same units in the same order (a gather is a
//! collective): a rank with nothing to compute walks the order without computing
//! ([`walk`]), and a rank that fails aborts the group instead of leaving the others waiting.
//!
//! A tied LM head is the embedding tensor: the Head unit gathers it too.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Layout, Tensor};

use super::transformer::Transformer;
use crate::{Error, Result};

/// A part of the model gathered as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    Embed,
    Layer(usize),
    Head,
}

/// What makes a sharded model's units whole and frees them again (the worker serves it over its
/// data-parallel group). Every rank calls each method at the same point of the same walk.
pub trait UnitGather: Send + Sync {
    /// Makes every weight of `unit` whole on this rank.
    fn gather(&self, unit: Unit) -> Result<()>;
    /// Frees the weights of `unit` that this rank does not own.
    fn release(&self, unit: Unit) -> Result<()>;
    /// Wakes the other ranks with an error: this rank will not reach the next gather.
    fn abort(&self, reason: &str);
}

/// A model's [`UnitGather`], carried by the model ([`Transformer::weight_gate`]) so that its
/// forward and backward, wherever they run, gather what they read.
#[derive(Clone)]
pub struct WeightGate(pub Arc<dyn UnitGather>);

impl std::fmt::Debug for WeightGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeightGate")
    }
}

/// The units a forward visits, in order.
pub fn forward_units(layers: usize) -> Vec<Unit> {
    std::iter::once(Unit::Embed).chain((0..layers).map(Unit::Layer)).chain([Unit::Head]).collect()
}

/// The units a backward visits, in order.
pub fn backward_units(layers: usize) -> Vec<Unit> {
    std::iter::once(Unit::Head).chain((0..layers).rev().map(Unit::Layer)).collect()
}

/// The units whose gradients a backward produces, in order: the backward's walk, then the
/// embedding (its gradient is a scatter of the first layer's, reading no weight).
pub fn gradient_units(layers: usize) -> Vec<Unit> {
    backward_units(layers).into_iter().chain([Unit::Embed]).collect()
}

/// Gathers and releases each of `units` without reading them: the part a rank with no data plays
/// in the others' forward or backward.
pub fn walk(gate: &dyn UnitGather, units: &[Unit]) -> Result<()> {
    for &u in units {
        gate.gather(u)?;
        gate.release(u)?;
    }
    Ok(())
}

/// The unit a base weight belongs to, by its HF name.
pub fn unit_of(name: &str) -> Unit {
    if name.starts_with("model.embed_tokens.") {
        return Unit::Embed;
    }
    let layer = name.strip_prefix("model.layers.").and_then(|rest| rest.split('.').next()?.parse().ok());
    match layer {
        Some(i) => Unit::Layer(i),
        None => Unit::Head,
    }
}

impl Transformer {
    /// Every base weight by HF name with its unit; a tied LM head's embedding is listed again
    /// under the Head unit.
    pub fn weight_units(&self) -> Vec<(String, Unit, Tensor)> {
        let mut out: Vec<(String, Unit, Tensor)> =
            self.named_params().into_iter().map(|(name, t)| (name.clone(), unit_of(&name), t)).collect();
        if self.lm_head.weight.id() == self.embed_tokens.id() {
            out.push(("model.embed_tokens.weight".into(), Unit::Head, self.embed_tokens.clone()));
        }
        out
    }

    /// Gathers `unit` when the model is sharded (nothing otherwise).
    pub fn gather_unit(&self, unit: Unit) -> Result<()> {
        match &self.weight_gate {
            Some(g) => g.0.gather(unit),
            None => Ok(()),
        }
    }

    /// Releases `unit` when the model is sharded (nothing otherwise).
    pub fn release_unit(&self, unit: Unit) -> Result<()> {
        match &self.weight_gate {
            Some(g) => g.0.release(unit),
            None => Ok(()),
        }
    }

    /// An error when the model's weights are sharded: only the tape gathers them.
    pub fn check_whole(&self, what: &str) -> Result<()> {
        match self.weight_gate {
            Some(_) => Err(Error::input(format!(
                "{what}: this model's weights are sharded across ranks (sharding = \"full\"); only the CPU \
                 training path gathers them"
            ))),
            None => Ok(()),
        }
    }
}

/// Frees `t`'s elements in place: the tensor keeps its id, shape and dtype and holds nothing
/// until [`fill`]. CPU tensors of a float dtype, contiguous from offset 0.
pub fn release(t: &Tensor) -> Result<()> {
    check_whole_storage(t)?;
    t.inplace_op1(&Release)?;
    Ok(())
}

/// Gives a released (or whole) `t` the elements of `from` (same shape and dtype).
pub fn fill(t: &Tensor, from: &Tensor) -> Result<()> {
    check_whole_storage(t)?;
    if from.dims() != t.dims() || from.dtype() != t.dtype() {
        return Err(Error::Other(format!(
            "a gathered weight is {:?} {:?}, its slot {:?} {:?}",
            from.dims(),
            from.dtype(),
            t.dims(),
            t.dtype()
        )));
    }
    let storage = cpu_storage(&from.flatten_all()?)?;
    t.inplace_op1(&Fill(std::sync::Mutex::new(Some(storage))))?;
    Ok(())
}

/// [`fill`] with `from`'s own storage when it holds exactly its elements, contiguous from offset
/// 0 (else copied): a gathered weight then takes the buffer it arrived in instead of a copy
/// beside it (at Qwen's vocabulary, 0.55 GB more at the embedding's gather). `from` must be
/// held by nothing else: it is left empty.
pub fn fill_taking(t: &Tensor, from: Tensor) -> Result<()> {
    let whole = from.layout().is_contiguous() && from.layout().start_offset() == 0;
    if !whole || from.dims() != t.dims() || from.dtype() != t.dtype() {
        return fill(t, &from);
    }
    check_whole_storage(t)?;
    let taken = Take(std::sync::Mutex::new(None), from.elem_count());
    from.inplace_op1(&taken)?;
    let storage = taken.0.into_inner().map_err(|_| Error::Other("fill: poisoned".into()))?;
    match storage {
        Some(storage) => t.inplace_op1(&Fill(std::sync::Mutex::new(Some(storage))))?,
        None => return fill(t, &from),
    }
    Ok(())
}

/// Whether `t`'s elements have been released.
pub fn is_released(t: &Tensor) -> bool {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(c) => storage_len(c) == 0 && t.elem_count() > 0,
        _ => false,
    }
}

/// Bytes of `t`'s elements this rank holds (0 once released).
pub fn held_bytes(t: &Tensor) -> usize {
    if is_released(t) {
        0
    } else {
        t.elem_count() * t.dtype().size_in_bytes()
    }
}

fn check_whole_storage(t: &Tensor) -> Result<()> {
    let ok = t.device().is_cpu()
        && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
        && t.layout().is_contiguous()
        && t.layout().start_offset() == 0;
    match ok {
        true => Ok(()),
        false => Err(Error::input(format!(
            "sharding = \"full\" keeps slices of contiguous float weights in host memory; a {:?} weight on {:?} \
             cannot be released",
            t.dtype(),
            t.device().location()
        ))),
    }
}

fn storage_len(c: &CpuStorage) -> usize {
    match c {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        _ => usize::MAX,
    }
}

/// A contiguous tensor's elements as storage of its own.
fn cpu_storage(t: &Tensor) -> Result<CpuStorage> {
    Ok(match t.dtype() {
        DType::F32 => CpuStorage::F32(t.to_vec1()?),
        DType::F64 => CpuStorage::F64(t.to_vec1()?),
        DType::BF16 => CpuStorage::BF16(t.to_vec1()?),
        DType::F16 => CpuStorage::F16(t.to_vec1()?),
        d => return Err(Error::Other(format!("a {d:?} weight cannot be gathered"))),
    })
}

/// An empty storage of `s`'s float dtype.
fn emptied(s: &CpuStorage) -> Option<CpuStorage> {
    Some(match s {
        CpuStorage::F32(_) => CpuStorage::F32(Vec::new()),
        CpuStorage::F64(_) => CpuStorage::F64(Vec::new()),
        CpuStorage::BF16(_) => CpuStorage::BF16(Vec::new()),
        CpuStorage::F16(_) => CpuStorage::F16(Vec::new()),
        _ => return None,
    })
}

struct Release;

impl candle_core::InplaceOp1 for Release {
    fn name(&self) -> &'static str {
        "release"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        *s = emptied(s).ok_or_else(|| candle_core::Error::Msg("release: not a float weight".into()))?;
        Ok(())
    }
}

/// Moves a storage of exactly `.1` elements out into `.0`, leaving it empty (else leaves it).
struct Take(std::sync::Mutex<Option<CpuStorage>>, usize);

impl candle_core::InplaceOp1 for Take {
    fn name(&self) -> &'static str {
        "take"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        if storage_len(s) != self.1 {
            return Ok(());
        }
        let Some(empty) = emptied(s) else { return Ok(()) };
        let taken = std::mem::replace(s, empty);
        *self.0.lock().map_err(|_| candle_core::Error::Msg("take: poisoned".into()))? = Some(taken);
        Ok(())
    }
}

/// The storage to put in place (taken once).
struct Fill(std::sync::Mutex<Option<CpuStorage>>);

impl candle_core::InplaceOp1 for Fill {
    fn name(&self) -> &'static str {
        "fill"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        let new = self.0.lock().map_err(|_| candle_core::Error::Msg("fill: poisoned".into()))?.take();
        match new {
            Some(new) if std::mem::discriminant(&new) == std::mem::discriminant(s) => *s = new,
            _ => candle_core::bail!("fill: the gathered storage does not match the weight's dtype"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn units_by_name_and_walk_orders() {
        assert_eq!(unit_of("model.embed_tokens.weight"), Unit::Embed);
        assert_eq!(unit_of("model.layers.12.mlp.up_proj.weight"), Unit::Layer(12));
        assert_eq!(unit_of("model.norm.weight"), Unit::Head);
        assert_eq!(unit_of("lm_head.weight"), Unit::Head);
        assert_eq!(forward_units(2), vec![Unit::Embed, Unit::Layer(0), Unit::Layer(1), Unit::Head]);
        assert_eq!(backward_units(2), vec![Unit::Head, Unit::Layer(1), Unit::Layer(0)]);
    }

    /// A released variable keeps its id and shape, holds nothing, and takes its bits back.
    #[test]
    fn release_and_fill_keep_the_tensor() {
        let v = Var::from_tensor(&Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap()).unwrap();
        let (id, before) = (v.id(), v.as_tensor().to_vec2::<f32>().unwrap());
        release(v.as_tensor()).unwrap();
        assert!(is_released(v.as_tensor()));
        assert_eq!(held_bytes(v.as_tensor()), 0);
        assert_eq!(v.dims(), &[2, 2]);
        let from = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        fill(v.as_tensor(), &from).unwrap();
        assert_eq!((v.id(), v.as_tensor().to_vec2::<f32>().unwrap()), (id, before));
        assert_eq!(held_bytes(v.as_tensor()), 16);
        let wrong = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
        assert!(fill(v.as_tensor(), &wrong).unwrap_err().to_string().contains("gathered weight"));
    }

    /// Taking a whole tensor's storage leaves it empty; a view (the columns of a wider matrix)
    /// is copied and kept.
    #[test]
    fn filling_takes_a_whole_storage_and_copies_a_view() {
        let v = Var::from_tensor(&Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap()).unwrap();
        release(v.as_tensor()).unwrap();
        let from = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        fill_taking(v.as_tensor(), from.clone()).unwrap();
        assert_eq!(v.as_tensor().to_vec2::<f32>().unwrap(), [[1., 2.], [3., 4.]]);
        assert!(is_released(&from), "the storage was copied, not taken");
        release(v.as_tensor()).unwrap();
        let wide = Tensor::new(&[[1f32, 2., 9.], [3., 4., 9.]], &Device::Cpu).unwrap();
        fill_taking(v.as_tensor(), wide.narrow(1, 0, 2).unwrap()).unwrap();
        assert_eq!(v.as_tensor().to_vec2::<f32>().unwrap(), [[1., 2.], [3., 4.]]);
        assert_eq!(wide.to_vec2::<f32>().unwrap(), [[1., 2., 9.], [3., 4., 9.]]);
    }
}
