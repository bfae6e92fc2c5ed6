//! An external key/value cache for incremental decoding.
//!
//! Holds, per layer, the rotated keys and the values of every position seen so far
//! ([B, kv_heads, S, head_dim]), plus the host-side key mask (1 = real token, 0 = padding) that
//! the attention bias of later steps needs. The cache belongs to the caller, so a sampler can
//! keep one per batch, drop it, or rebuild it at will; the model only appends to it.
//!
//! Appending does not copy the whole cache: each layer writes into a buffer with spare columns
//! (capacity doubling, so the copies are amortised O(1) per token) and the cached keys/values
//! are views of its first S columns. A write only ever lands past the end of every view that
//! exists, so views stay valid; a clone or any row surgery starts without spare buffers, so two
//! caches never write into the same one. The first append (a prefill) keeps its tensors as they
//! are; the buffer comes with the second.
//!
//! A Gated DeltaNet layer (Qwen3.5) caches no keys and values but a fixed-size state per row
//! (its recurrent state and last conv inputs, [`super::delta_net::state_len`] floats): it does
//! not grow with the sequence, and row surgery selects, concatenates and splits it by row (a
//! row with nothing cached yet starts from zeros).
//!
//! A sliding-window layer (Gemma 3's local layers) keeps only the last columns a later query can
//! see (`KvCache::keep_last`): its keys and values are the *last* C columns of the key mask,
//! C bounded by the window whatever the sequence's length. Row surgery aligns every layer on
//! the right (the newest column); columns a windowed layer lacks are outside every window, so
//! whatever fills them (zeros when rows are joined) is masked.
//!
//! Joining rows is one copy of each layer, however many rows join: the one-row caches that
//! [`KvCache::split_rows`] hands out remember the split cache and their row in it, and
//! [`KvCache::concat_rows`] takes consecutive rows of one split cache with one gather a layer
//! (a copy a row is a kernel launch a row, layer and keys / values on a GPU: a batch of prompts
//! joined that way cost more than its prefill).

use std::sync::Arc;

use candle_core::{Tensor, D};

use super::delta_net::StateRows;

use crate::Result;

/// Columns a fresh buffer holds at least.
const MIN_CAPACITY: usize = 64;

#[derive(Debug)]
pub struct KvCache {
    /// Per layer, the cached keys and values (views of `buffers` when those exist).
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per layer, [B, kv_heads, capacity, head_dim] buffers whose first S columns are `layers`.
    buffers: Vec<Option<(Tensor, Tensor)>>,
    /// [B][S] key mask of the cached positions.
    key_mask: Vec<Vec<u8>>,
    /// Per layer, a DeltaNet layer's per-row states once it holds any.
    states: Vec<Option<StateRows>>,
    /// A one-row cache from `split_rows`, unchanged since: the cache it was split from.
    split_from: Option<SplitFrom>,
}

/// The layers of a cache that `split_rows` split (contiguous, shared by its rows) and the row a
/// one-row cache is: `layers[l]` of that row is `narrow(0, row, 1)` of the split one.
#[derive(Clone, Debug)]
struct SplitFrom {
    layers: Arc<Vec<Option<(Tensor, Tensor)>>>,
    row: usize,
}

impl Clone for KvCache {
    /// Shares the cached tensors (immutable views) but not the spare buffers.
    fn clone(&self) -> Self {
        KvCache {
            layers: self.layers.clone(),
            buffers: vec![None; self.layers.len()],
            key_mask: self.key_mask.clone(),
            states: self.states.clone(),
            split_from: self.split_from.clone(),
        }
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self::from_parts(vec![None; num_layers], vec![])
    }

    fn from_parts(layers: Vec<Option<(Tensor, Tensor)>>, key_mask: Vec<Vec<u8>>) -> Self {
        KvCache {
            buffers: vec![None; layers.len()],
            states: vec![None; layers.len()],
            layers,
            key_mask,
            split_from: None,
        }
    }

    /// Layer i's DeltaNet state slot (a row per batch row once a forward has filled it).
    pub(crate) fn state_mut(&mut self, i: usize) -> &mut Option<StateRows> {
        &mut self.states[i]
    }

    /// Layer i's DeltaNet states, once it holds any.
    pub fn state(&self, i: usize) -> Option<&StateRows> {
        self.states.get(i)?.as_ref()
    }

    /// Floats of one row's state in layer i (0 before any).
    fn state_width(&self, i: usize) -> usize {
        match (&self.states[i], self.num_rows()) {
            (Some(s), rows) if rows > 0 => s.num_rows(1) / rows,
            _ => 0,
        }
    }

    /// Number of cached positions.
    pub fn seq_len(&self) -> usize {
        self.key_mask.first().map_or(0, |r| r.len())
    }

    pub fn key_mask(&self) -> &[Vec<u8>] {
        &self.key_mask
    }

    /// Layer i's keys and values, [rows, kv_heads, S, head_dim] each, once it holds any.
    pub fn layer(&self, i: usize) -> Option<&(Tensor, Tensor)> {
        self.layers.get(i)?.as_ref()
    }

    pub(crate) fn extend_mask(&mut self, new: &[Vec<u8>]) {
        if self.key_mask.is_empty() {
            self.key_mask = new.to_vec();
        } else {
            for (row, add) in self.key_mask.iter_mut().zip(new) {
                row.extend_from_slice(add);
            }
        }
    }

    /// Cuts layer `layer` to its last `cols` columns (a sliding-window layer), once it holds
    /// `cols` + max(`cols`, [`MIN_CAPACITY`]) or more: the kept columns are copied into a fresh
    /// buffer with that much room, so a cut costs `cols` columns once per as many appended
    /// tokens, and the layer never holds more than about twice its window.
    pub(crate) fn keep_last(&mut self, layer: usize, cols: usize) -> Result<()> {
        let Some((k, v)) = &self.layers[layer] else { return Ok(()) };
        let len = k.dim(D::Minus2)?;
        let room = cols.max(MIN_CAPACITY);
        if cols == 0 || len < cols + room {
            return Ok(());
        }
        self.split_from = None;
        let (b, kvh, _, d) = k.dims4()?;
        let bk = Tensor::zeros((b, kvh, cols + room, d), k.dtype(), k.device())?;
        let bv = Tensor::zeros((b, kvh, cols + room, d), v.dtype(), v.device())?;
        bk.slice_set(&k.narrow(2, len - cols, cols)?.contiguous()?, 2, 0)?;
        bv.slice_set(&v.narrow(2, len - cols, cols)?.contiguous()?, 2, 0)?;
        self.layers[layer] = Some((bk.narrow(2, 0, cols)?, bv.narrow(2, 0, cols)?));
        self.buffers[layer] = Some((bk, bv));
        Ok(())
    }

    /// Appends this step's keys and values for `layer` and returns the full cached ones.
    pub(crate) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        self.split_from = None;
        let len = self.layers[layer].as_ref().map_or(0, |(pk, _)| pk.dim(D::Minus2).unwrap_or(0));
        if len == 0 {
            // The first append (usually a prefill, whose rows are then cut out and merged into
            // another cache) keeps the tensors as they are: a buffer with spare columns would
            // cost a zero-filled allocation and a copy, and be copied out again at once.
            self.buffers[layer] = None;
            self.layers[layer] = Some((k.clone(), v.clone()));
            return Ok((k, v));
        }
        let new_len = len + k.dim(D::Minus2)?;
        let fits = self.buffers[layer].as_ref().is_some_and(|(bk, _)| {
            bk.dim(D::Minus2).is_ok_and(|cap| cap >= new_len) && bk.dim(0).ok() == k.dim(0).ok()
        });
        if !fits {
            // A new buffer with room to grow; the cached columns are copied once.
            let (b, kvh, _, d) = k.dims4()?;
            let cap = (2 * new_len).max(MIN_CAPACITY);
            let bk = Tensor::zeros((b, kvh, cap, d), k.dtype(), k.device())?;
            let bv = Tensor::zeros((b, kvh, cap, d), v.dtype(), v.device())?;
            if let Some((pk, pv)) = &self.layers[layer] {
                bk.slice_set(&pk.contiguous()?, 2, 0)?;
                bv.slice_set(&pv.contiguous()?, 2, 0)?;
            }
            self.buffers[layer] = Some((bk, bv));
        }
        let (bk, bv) = self.buffers[layer].as_ref().expect("buffer ensured above");
        bk.slice_set(&k, 2, len)?;
        bv.slice_set(&v, 2, len)?;
        let out = (bk.narrow(2, 0, new_len)?, bv.narrow(2, 0, new_len)?);
        self.layers[layer] = Some(out.clone());
        Ok(out)
    }
}

/// When the first two or more of `parts` are rows of one split cache that holds layer `l`: that
/// layer and their rows in it.
fn split_run<'a>(parts: &[&'a KvCache], l: usize) -> Option<(&'a (Tensor, Tensor), Vec<u32>)> {
    let first = parts.first()?.split_from.as_ref()?;
    let layer = first.layers[l].as_ref()?;
    let rows: Vec<u32> = parts
        .iter()
        .map_while(|p| p.split_from.as_ref().filter(|s| Arc::ptr_eq(&s.layers, &first.layers)).map(|s| s.row as u32))
        .collect();
    (rows.len() > 1).then_some((layer, rows))
}

/// Row surgery for continuous batching: rows leave the batch, join it, or fan out from one
/// prefilled prompt. Every row's newest position stays in the last column (left padding), so one
/// batched decode step appends one column for all rows.
impl KvCache {
    /// A cache of `rows` rows with nothing cached yet (a prompt of one token has no prefix).
    pub fn with_empty_rows(num_layers: usize, rows: usize) -> Self {
        Self::from_parts(vec![None; num_layers], vec![vec![]; rows])
    }

    /// Number of rows (0 before the first forward).
    pub fn num_rows(&self) -> usize {
        self.key_mask.len()
    }

    /// The cache of `rows` only, in that order; a row may repeat (one prompt, n samples).
    /// Leading columns that are padding in every kept row are dropped.
    pub fn select_rows(&self, rows: &[usize]) -> Result<KvCache> {
        if rows.is_empty() {
            return Ok(KvCache::new(self.layers.len()));
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                None => None,
                Some((k, v)) => {
                    let idx =
                        Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), k.device())?;
                    Some((k.contiguous()?.index_select(&idx, 0)?, v.contiguous()?.index_select(&idx, 0)?))
                }
            });
        }
        let key_mask = rows.iter().map(|&r| self.key_mask[r].clone()).collect();
        let mut out = Self::from_parts(layers, key_mask);
        for (l, slot) in out.states.iter_mut().enumerate() {
            if let Some(s) = &self.states[l] {
                *slot = Some(s.select(rows, self.state_width(l)));
            }
        }
        out.trim_left()?;
        Ok(out)
    }

    /// Appends the rows of `other` after ours, left-padding whichever side is shorter.
    pub fn append_rows(&mut self, other: &KvCache) -> Result<()> {
        if other.num_rows() > 0 {
            *self = KvCache::concat_rows(&[self, other])?;
        }
        Ok(())
    }

    /// The rows of every part, in order, left-padded to the longest: one copy of each layer
    /// (merging them two at a time would copy the growing cache once per part).
    pub fn concat_rows(parts: &[&KvCache]) -> Result<KvCache> {
        let Some(first) = parts.first() else {
            return Err(crate::Error::Other("concat_rows: no caches".into()));
        };
        let num_layers = first.layers.len();
        let parts: Vec<&KvCache> = parts.iter().copied().filter(|p| p.num_rows() > 0).collect();
        match parts.as_slice() {
            [] => return Ok(KvCache::new(num_layers)),
            [one] => return Ok((*one).clone()),
            _ => {}
        }
        let len = parts.iter().map(|p| p.seq_len()).max().unwrap_or(0);
        // Left-pads one part's `t` [rows, kvh, n, d] to `cols` columns (`len` but for a
        // windowed layer); a missing layer (nothing cached) becomes zeros shaped like another
        // part's.
        let pad = |t: Option<&Tensor>, like: &Tensor, p: &KvCache, cols: usize| -> Result<Tensor> {
            Ok(match t {
                Some(t) if t.dim(2)? < cols => t.pad_with_zeros(2, cols - t.dim(2)?, 0)?,
                Some(t) => t.clone(),
                None => {
                    let (_, kvh, _, d) = like.dims4()?;
                    Tensor::zeros((p.num_rows(), kvh, cols, d), like.dtype(), like.device())?
                }
            })
        };
        let mut layers = Vec::with_capacity(num_layers);
        for l in 0..num_layers {
            let Some(like) = parts.iter().find_map(|p| p.layers[l].as_ref()) else {
                layers.push(None);
                continue;
            };
            // Every part's layer ends at its newest column: the widest one sets the columns.
            let mut cols = 0;
            for p in &parts {
                if let Some((k, _)) = &p.layers[l] {
                    cols = cols.max(k.dim(2)?);
                }
            }
            let mut ks = Vec::with_capacity(parts.len());
            let mut vs = Vec::with_capacity(parts.len());
            let mut i = 0;
            while i < parts.len() {
                if let Some(((k, v), rows)) = split_run(&parts[i..], l) {
                    // Rows of one split cache: one gather of its layer, then padded once.
                    i += rows.len();
                    let idx = Tensor::from_vec(rows.clone(), rows.len(), k.device())?;
                    let part = |t: &Tensor| -> Result<Tensor> {
                        let t = t.index_select(&idx, 0)?;
                        Ok(match t.dim(2)? < cols {
                            true => t.pad_with_zeros(2, cols - t.dim(2)?, 0)?,
                            false => t,
                        })
                    };
                    ks.push(part(k)?);
                    vs.push(part(v)?);
                } else {
                    let (p, kv) = (parts[i], parts[i].layers[l].as_ref());
                    ks.push(pad(kv.map(|x| &x.0), &like.0, p, cols)?);
                    vs.push(pad(kv.map(|x| &x.1), &like.1, p, cols)?);
                    i += 1;
                }
            }
            let join = |ts: Vec<Tensor>| -> Result<Tensor> {
                Ok(match ts.len() {
                    1 => ts.into_iter().next().expect("one"),
                    _ => Tensor::cat(&ts, 0)?,
                })
            };
            layers.push(Some((join(ks)?, join(vs)?)));
        }
        let mut key_mask = Vec::with_capacity(parts.iter().map(|p| p.num_rows()).sum());
        for p in &parts {
            for row in &p.key_mask {
                key_mask.push([vec![0u8; len - p.seq_len()], row.clone()].concat());
            }
        }
        let mut out = Self::from_parts(layers, key_mask);
        for l in 0..num_layers {
            let Some((like, width)) = parts.iter().find_map(|p| Some((p.states[l].as_ref()?, p.state_width(l)))) else {
                continue;
            };
            let mut rows = Vec::with_capacity(parts.len());
            for p in &parts {
                rows.push(match &p.states[l] {
                    Some(s) => s.clone(),
                    // Nothing cached for these rows yet: the zero state they start from.
                    None => StateRows::zeros_like(like, p.num_rows(), width),
                });
            }
            out.states[l] = Some(StateRows::concat(&rows)?);
        }
        Ok(out)
    }

    /// Every row as a cache of its own, in order (leading padding dropped): one contiguous copy
    /// of each layer at most, of which the rows are views.
    pub fn split_rows(&self) -> Result<Vec<KvCache>> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                Some((k, v)) => Some((k.contiguous()?, v.contiguous()?)),
                None => None,
            });
        }
        let layers = Arc::new(layers);
        let mut out = Vec::with_capacity(self.num_rows());
        for (r, mask) in self.key_mask.iter().enumerate() {
            let mut row = Vec::with_capacity(layers.len());
            for l in layers.iter() {
                row.push(match l {
                    Some((k, v)) => Some((k.narrow(0, r, 1)?, v.narrow(0, r, 1)?)),
                    None => None,
                });
            }
            let mut one = Self::from_parts(row, vec![mask.clone()]);
            one.split_from = Some(SplitFrom { layers: layers.clone(), row: r });
            for (l, slot) in one.states.iter_mut().enumerate() {
                if let Some(s) = &self.states[l] {
                    *slot = Some(s.select(&[r], self.state_width(l)));
                }
            }
            // A row with leading padding is cut: it no longer has the split cache's columns.
            one.trim_left()?;
            out.push(one);
        }
        Ok(out)
    }

    /// Drops the leading columns that are padding in every row (they were the prefix of rows
    /// that have left the batch).
    pub fn trim_left(&mut self) -> Result<()> {
        let s = self.seq_len();
        let drop = (0..s).take_while(|&j| self.key_mask.iter().all(|r| r[j] == 0)).count();
        if drop == 0 {
            return Ok(());
        }
        self.split_from = None;
        self.buffers.iter_mut().for_each(|b| *b = None);
        for slot in self.layers.iter_mut() {
            *slot = match slot.take() {
                Some((k, v)) if drop < s => {
                    // A windowed layer holds the last `n` columns: it loses the dropped ones it has.
                    let n = k.dim(2)?;
                    let cut = drop.saturating_sub(s - n);
                    Some((k.narrow(2, cut, n - cut)?, v.narrow(2, cut, n - cut)?))
                }
                _ => None,
            };
        }
        for r in self.key_mask.iter_mut() {
            r.drain(..drop);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::bits;
    use candle_core::Device;

    fn kv(rows: usize, cols: usize, seed: f32) -> (Tensor, Tensor) {
        let n = rows * 2 * cols * 3;
        let t = |s: f32| Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap().affine(0.37, s as f64).unwrap();
        let shape = (rows, 2, cols, 3);
        (t(seed).sin().unwrap().reshape(shape).unwrap(), t(seed + 1.0).cos().unwrap().reshape(shape).unwrap())
    }

    /// Rows of split caches joined by a gather a layer (repeated rows, two split caches, a
    /// longer batch before them so that they are padded, a padded row cut on its split) are the
    /// bits of joining the same rows one copy each.
    #[test]
    fn joining_split_rows_gathers_the_bits_of_a_copy_a_row() {
        let prompts = KvCache::from_parts(
            vec![Some(kv(4, 5, 0.0)), None, Some(kv(4, 5, 2.0))],
            vec![vec![1; 5], vec![1; 5], vec![0, 0, 1, 1, 1], vec![1; 5]],
        );
        let others = KvCache::from_parts(vec![Some(kv(2, 4, 4.0)), None, Some(kv(2, 4, 6.0))], vec![vec![1; 4]; 2]);
        let batch =
            KvCache::from_parts(vec![Some(kv(2, 7, 8.0)), None, Some(kv(2, 7, 10.0))], vec![vec![1; 7], vec![1; 7]]);
        let (a, b) = (prompts.split_rows().unwrap(), others.split_rows().unwrap());
        assert!(a[2].split_from.is_none() && a[2].seq_len() == 3, "the padded row is cut and no longer a split row");
        let parts = [&batch, &a[0], &a[0], &a[1], &a[2], &a[3], &b[1], &b[0]];
        let rows = |from: usize, l: usize| split_run(&parts[from..], l).map(|(_, rows)| rows);
        assert_eq!(rows(1, 0), Some(vec![0, 0, 1]));
        assert_eq!(rows(6, 2), Some(vec![1, 0]));
        assert_eq!(rows(1, 1), None, "a layer the split cache lacks is not gathered");
        assert_eq!(rows(5, 0), None, "one row is not a run");
        let joined = KvCache::concat_rows(&parts).unwrap();
        let copies: Vec<KvCache> = parts
            .iter()
            .map(|p| {
                let mut c = (*p).clone();
                c.split_from = None;
                c
            })
            .collect();
        let reference = KvCache::concat_rows(&copies.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(joined.key_mask(), reference.key_mask());
        assert_eq!(joined.num_rows(), 9);
        assert!(joined.layer(1).is_none());
        for l in [0, 2] {
            let (jk, jv) = joined.layer(l).unwrap();
            let (rk, rv) = reference.layer(l).unwrap();
            assert_eq!(jk.dims(), [9, 2, 7, 3]);
            assert_eq!((bits(jk), bits(jv)), (bits(rk), bits(rv)), "layer {l}");
        }
        // Row 2 of the join is prompt row 0, left-padded by two zero columns.
        let row = joined.layer(0).unwrap().0.narrow(0, 2, 1).unwrap();
        assert_eq!(bits(&row.narrow(2, 2, 5).unwrap()), bits(&kv(4, 5, 0.0).0.narrow(0, 0, 1).unwrap()));
        assert!(bits(&row.narrow(2, 0, 2).unwrap()).iter().all(|&b| b == 0), "the padding is +0");
        // A split row that is appended to is a cache of its own again.
        let mut grown = a[0].clone();
        let (k, v) = kv(1, 1, 12.0);
        grown.append(0, &k, &v).unwrap();
        assert!(grown.split_from.is_none());
    }
}
