//! The prompts of the fully asynchronous trainer, handed out one group at a time.
//!
//! ```text
//! prompt k (k = 0, 1, …: the run's k-th group) = dataset[order_of(epoch k / n)[k mod n]]
//! take()     -> the smallest k not consumed, filtered, nor in flight
//! consume(k) -> trained;  filter(k) -> dropped by dynamic sampling;  release(k) -> cancelled
//! ```
//! The order is the synchronous trainer's (the data loader's per-epoch shuffle, read across
//! epochs as `DataLoader::next_items_across_epochs` does), so with no
//! group filtered and no staleness both trainers see the same prompts in the same steps.
//! A checkpoint holds the consumed and filtered sequence numbers; a resumed stream hands out the
//! groups that were in flight or finished-but-untrained again, first, and never a consumed one:
//! no prompt is trained twice and none is skipped.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::trainer::data_loader::{epoch_seed, permutation};
use crate::{Error, Result};

/// What a checkpoint keeps of the stream: every group's fate so far.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamState {
    /// Sequence numbers of trained groups, in training order.
    pub consumed: Vec<u64>,
    /// Sequence numbers of groups dropped without training.
    pub filtered: Vec<u64>,
    /// Handed out but neither trained nor filtered yet (running, or waiting for the trainer):
    /// a resumed run hands these out again. Written for the record; not read back.
    #[serde(default)]
    pub pending: Vec<u64>,
}

/// Hands out prompt sequence numbers; see the module docs.
#[derive(Clone, Debug)]
pub struct PromptStream {
    n: usize,
    seed: u64,
    shuffle: bool,
    state: StreamState,
    /// `consumed ∪ filtered ∪ in flight`, for `take`.
    taken: BTreeSet<u64>,
    /// Every k below is taken.
    cursor: u64,
    /// The cached order of one epoch: (epoch, order).
    order: (u64, Vec<usize>),
}

impl PromptStream {
    /// A stream over `n` prompts (none handed out yet, or as `state` left it: its pending groups
    /// are handed out again).
    pub fn new(n: usize, seed: u64, shuffle: bool, mut state: StreamState) -> Result<PromptStream> {
        if n == 0 {
            return Err(Error::input("the prompt set is empty"));
        }
        let mut taken = BTreeSet::new();
        for &k in state.consumed.iter().chain(&state.filtered) {
            if !taken.insert(k) {
                return Err(Error::input(format!("checkpoint: group {k} is recorded twice as consumed or filtered")));
            }
        }
        state.pending.clear();
        let mut s = PromptStream { n, seed, shuffle, state, taken, cursor: 0, order: (u64::MAX, vec![]) };
        s.advance_cursor();
        Ok(s)
    }

    /// The next group's sequence number and its prompt's index in the dataset.
    pub fn take(&mut self) -> (u64, usize) {
        let k = self.cursor;
        self.taken.insert(k);
        self.advance_cursor();
        (k, self.index_of(k))
    }

    /// The dataset index of group `k`'s prompt.
    pub fn index_of(&mut self, k: u64) -> usize {
        let (epoch, pos) = (k / self.n as u64, (k % self.n as u64) as usize);
        if !self.shuffle {
            return pos;
        }
        if self.order.0 != epoch {
            self.order = (epoch, permutation(self.n, epoch_seed(self.seed, epoch as usize)));
        }
        self.order.1[pos]
    }

    pub fn consume(&mut self, k: u64) {
        self.state.consumed.push(k);
    }

    pub fn filter(&mut self, k: u64) {
        self.state.filtered.push(k);
    }

    /// A cancelled group: its prompt is handed out again.
    pub fn release(&mut self, k: u64) {
        self.taken.remove(&k);
        self.cursor = self.cursor.min(k);
    }

    /// The state to checkpoint, with the pending groups listed.
    pub fn state(&self) -> StreamState {
        let done: BTreeSet<u64> = self.state.consumed.iter().chain(&self.state.filtered).copied().collect();
        StreamState { pending: self.taken.difference(&done).copied().collect(), ..self.state.clone() }
    }

    fn advance_cursor(&mut self) {
        while self.taken.contains(&self.cursor) {
            self.cursor += 1;
        }
    }
}
