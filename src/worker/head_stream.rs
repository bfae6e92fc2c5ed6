//! The head weight's gradient summed to its owner block by block during the backward
//! (`sharding = "full"`, a step of one backward each: `unit_reduce.rs`).
//!
//! A head of Qwen's 152k vocabulary has a gradient as large as the embedding (0.55 GB at a width
//! of 896), and the head's backward also holds the weight gathered whole: summed only after the
//! head, the two would be a rank's peak. Instead the tape hands the gradient over in blocks of
//! vocabulary rows ([`HeadSink`]), and each block is summed to the owner at once:
//!
//! ```text
//! tied head: hot = ∪ over ranks of the batch's tokens   (all-gather)
//! for each block v of rows (every rank, in order; zeros from a rank with none):
//!     owner's sum[v] = Σ_ranks dW_r[v]                  (reduce to the owner)
//! tied head, at the embedding's backward:
//!     owner's sum[hot] = Σ_ranks (dW_r[hot] + the rank's gathered rows)
//! ```
//!
//! The bits are those of the whole gradient summed after the backward: a row outside `hot` gets
//! nothing from any rank's embedding, and a hot row is summed again, with its rows added in the
//! tape's order, over the head-only sum. The owner holds its sum (its own gradient, as before);
//! every other rank holds one block and the hot rows. Summing each micro-batch
//! (`gradient_sum.rs`), from the second on the owner adds each block into its running sum
//! instead of writing a new one, and sets a hot row to its running sum from before the
//! backward plus the hot sum: the bits of adding the whole sum after the backward.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use super::in_place::{add_at, write_at, write_rows};
use super::weight_slices::WeightSlices;
use crate::locks::lock;
use crate::model::tape::{vocab_blocks, HeadSink, VOCAB_BLOCK};
use crate::world::{decode, encode};
use crate::{Error, Result};

/// One step's head gradient, summed block by block (see the module documentation).
pub(super) struct HeadStream {
    slices: Arc<WeightSlices>,
    /// The weight's owner; its shape; the accumulators' dtype.
    owner: usize,
    vocab: usize,
    width: usize,
    dtype: DType,
    tied: bool,
    /// Every rank's hot rows, once agreed (a tied head).
    hot: Option<Vec<u32>>,
    /// The first row of the next block to sum.
    next_row: usize,
    hot_summed: bool,
    /// The owner's sum, written block by block.
    sum: Option<Tensor>,
    /// The owner's running sum that this backward's is added into instead (the gradients summed
    /// after each micro-batch, from the second on: `gradient_sum.rs`), and its hot rows as they
    /// were before this backward's blocks were added.
    into: Option<Tensor>,
    hot_before: Option<Tensor>,
}

impl HeadStream {
    /// `into`: on the owner, a running sum to add this backward's to (see [`HeadStream::into`]).
    pub(super) fn new(
        slices: Arc<WeightSlices>,
        owner: usize,
        (vocab, width): (usize, usize),
        dtype: DType,
        tied: bool,
        into: Option<Tensor>,
    ) -> Self {
        HeadStream {
            slices,
            owner,
            vocab,
            width,
            dtype,
            tied,
            hot: None,
            next_row: 0,
            hot_summed: false,
            sum: None,
            into,
            hot_before: None,
        }
    }

    /// After the head unit's backward: the blocks this rank made none of (no batch, or a loss
    /// that did not reach the head) summed as zeros, so that every rank takes part in every sum.
    pub(super) fn finish_blocks(&mut self) -> Result<()> {
        if self.tied && self.hot.is_none() {
            self.hot_rows(vec![])?;
        }
        for rows in vocab_blocks(self.vocab, VOCAB_BLOCK) {
            if rows.start >= self.next_row {
                let zeros = Tensor::zeros((rows.len(), self.width), self.dtype, &Device::Cpu)?;
                self.sum_block(rows.start, zeros)?;
            }
        }
        Ok(())
    }

    /// After the embedding's backward (a tied head): the hot rows summed as zeros where this
    /// rank made none; then the owner's sum (`None` on the other ranks, and where it was added
    /// into a running sum).
    pub(super) fn finish(&mut self) -> Result<Option<Tensor>> {
        if self.tied && !self.hot_summed {
            let count = self.hot.as_ref().map_or(0, Vec::len);
            self.sum_hot(Tensor::zeros((count, self.width), self.dtype, &Device::Cpu)?)?;
        }
        Ok(self.sum.take())
    }

    pub(super) fn tied(&self) -> bool {
        self.tied
    }

    fn sum_block(&mut self, first: usize, grad: Tensor) -> Result<()> {
        let rows = grad.dim(0)?;
        if first != self.next_row || first + rows > self.vocab {
            return Err(Error::Other(format!(
                "the head's gradient rows {first}..{} arrived where rows from {} were due",
                first + rows,
                self.next_row
            )));
        }
        self.next_row = first + rows;
        let Some(summed) =
            self.slices.reduce_to_owners(vec![grad.to_dtype(self.dtype)?], &[self.owner])?.pop().flatten()
        else {
            return Ok(());
        };
        let written = match &self.into {
            Some(into) => add_at(into, first * self.width, &summed)?,
            None => write_at(&self.owner_sum()?, first * self.width, &summed)?,
        };
        if !written {
            return Err(Error::Other("the head's summed gradient block could not be written in place".into()));
        }
        Ok(())
    }

    fn sum_hot(&mut self, grad: Tensor) -> Result<()> {
        self.hot_summed = true;
        if grad.dim(0)? == 0 {
            return Ok(()); // no rank had a batch: nothing to sum
        }
        let Some(summed) =
            self.slices.reduce_to_owners(vec![grad.to_dtype(self.dtype)?], &[self.owner])?.pop().flatten()
        else {
            return Ok(());
        };
        let hot = self.hot.clone().ok_or_else(|| Error::Other("hot rows summed before they were agreed".into()))?;
        // Added into a running sum, the blocks added the hot rows' head part alone: those rows
        // are the running sum's before them plus this backward's whole sum.
        let written = match (&self.into, &self.hot_before) {
            (Some(into), Some(before)) => write_rows(into, &hot, &(before + &summed)?)?,
            (Some(_), None) => return Err(Error::Other("the hot rows' running sums were not kept".into())),
            (None, _) => write_rows(&self.owner_sum()?, &hot, &summed)?,
        };
        if !written {
            return Err(Error::Other("the head's summed hot rows could not be written in place".into()));
        }
        Ok(())
    }

    /// The owner's sum, made at its first block.
    fn owner_sum(&mut self) -> Result<Tensor> {
        if self.sum.is_none() {
            self.sum = Some(Tensor::zeros((self.vocab, self.width), self.dtype, &Device::Cpu)?);
        }
        Ok(self.sum.clone().expect("just made"))
    }
}

impl HeadSink for HeadStream {
    fn hot_rows(&mut self, mine: Vec<u32>) -> Result<Vec<u32>> {
        let mut all = vec![];
        for bytes in self.slices.all_gather_bytes(encode(&mine)?)? {
            all.extend(decode::<Vec<u32>>(&bytes)?);
        }
        all.sort_unstable();
        all.dedup();
        if let Some(into) = &self.into {
            let rows = Tensor::from_vec(all.clone(), all.len(), &Device::Cpu)?;
            self.hot_before = Some(into.index_select(&rows, 0)?);
        }
        self.hot = Some(all.clone());
        Ok(all)
    }

    fn rows(&mut self, first: usize, grad: Tensor) -> Result<()> {
        self.sum_block(first, grad)
    }

    fn hot(&mut self, grad: Tensor) -> Result<()> {
        self.sum_hot(grad)
    }
}

/// The stream shared by the worker's unit callbacks and the tape's backward, locked per call.
pub(super) struct SharedHeadStream(pub(super) Arc<Mutex<HeadStream>>);

impl HeadSink for SharedHeadStream {
    fn hot_rows(&mut self, mine: Vec<u32>) -> Result<Vec<u32>> {
        lock(&self.0).hot_rows(mine)
    }

    fn rows(&mut self, first: usize, grad: Tensor) -> Result<()> {
        lock(&self.0).rows(first, grad)
    }

    fn hot(&mut self, grad: Tensor) -> Result<()> {
        lock(&self.0).hot(grad)
    }
}
