//! A data loader over an in-memory dataset: batches in a seeded order that is reshuffled every
//! epoch, with a serialisable position for exact resume.
//!
//! Epoch `e` visits the items in `permutation(n, mix(seed, e))` order — a Fisher–Yates shuffle
//! driven by SplitMix64 ([`crate::splitmix`]), oxrl's own rather than `rand`'s, so that the
//! order is a property of oxrl (a `rand` upgrade may change `StdRng`'s stream, and with it every
//! resumed run). The position is `(epoch, index)`: the epoch, and how many of its items have been
//! yielded. The order of an epoch is a pure function of `(seed, epoch)`, so restoring a position
//! and asking for the next batch yields exactly what the uninterrupted run would have.
//!
//! Batches never straddle epochs: the last batch of an epoch holds the remainder
//! (`n mod batch_size` items, when that is not 0), so every item is seen once per epoch and
//! `steps_per_epoch = ceil(n / batch_size)`. The loader is endless; the loop decides when to stop.
//! RL takes [`DataLoader::next_items_across_epochs`] instead: always `batch_size` items, the
//! epochs' orders read as one endless sequence (the async trainer's prompt stream, so that
//! both RL modes cut their steps alike).

use serde::{Deserialize, Serialize};

use crate::splitmix;

/// Where a loader is: `index` items of epoch `epoch`'s order have been yielded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    pub epoch: usize,
    pub index: usize,
}

/// A batch and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch<T> {
    /// The epoch the items belong to.
    pub epoch: usize,
    /// Indices of the items in the dataset.
    pub indices: Vec<usize>,
    pub items: Vec<T>,
}

/// Seeded, per-epoch shuffled batches over `items`.
#[derive(Clone, Debug)]
pub struct DataLoader<T> {
    items: Vec<T>,
    batch_size: usize,
    seed: u64,
    shuffle: bool,
    position: LoaderPosition,
    /// The current epoch's order, cached; always `order_of(position.epoch)`.
    order: Vec<usize>,
}

impl<T: Clone> DataLoader<T> {
    /// A loader at epoch 0, index 0. `shuffle = false` keeps dataset order (for evaluation).
    pub fn new(items: Vec<T>, batch_size: usize, seed: u64, shuffle: bool) -> Self {
        assert!(batch_size > 0, "batch_size must be positive");
        let mut loader =
            DataLoader { items, batch_size, seed, shuffle, position: LoaderPosition::default(), order: Vec::new() };
        loader.order = loader.order_of(0);
        loader
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn items(&self) -> &[T] {
        &self.items
    }

    /// Optimizer steps in one epoch: `ceil(n / batch_size)`.
    pub fn steps_per_epoch(&self) -> usize {
        self.items.len().div_ceil(self.batch_size)
    }

    pub fn position(&self) -> LoaderPosition {
        self.position
    }

    /// Moves to a saved position. An index past the end of the dataset (no position of a loader
    /// over the same dataset has one: the checkpoint belongs to other data) is an error.
    pub fn set_position(&mut self, position: LoaderPosition) -> crate::Result<()> {
        if position.index > self.items.len() {
            return Err(crate::Error::input(format!(
                "loader position {position:?} is past the dataset's {} items: was the checkpoint made with other data?",
                self.items.len()
            )));
        }
        if position.epoch != self.position.epoch {
            self.order = self.order_of(position.epoch);
        }
        self.position = position;
        self.normalise();
        Ok(())
    }

    /// The next batch; `None` only for an empty dataset.
    pub fn next_batch(&mut self) -> Option<Batch<T>> {
        if self.items.is_empty() {
            return None;
        }
        let start = self.position.index;
        let end = (start + self.batch_size).min(self.items.len());
        let indices = self.order[start..end].to_vec();
        let items = indices.iter().map(|&i| self.items[i].clone()).collect();
        let batch = Batch { epoch: self.position.epoch, indices, items };
        self.position.index = end;
        self.normalise();
        Some(batch)
    }

    /// The next `batch_size` items of the endless sequence of epoch orders: a batch that reaches
    /// the end of an epoch continues with the next epoch's first items. `None` only for an
    /// empty dataset.
    pub fn next_items_across_epochs(&mut self) -> Option<Vec<T>> {
        if self.items.is_empty() {
            return None;
        }
        let mut items = Vec::with_capacity(self.batch_size);
        while items.len() < self.batch_size {
            let start = self.position.index;
            let end = (start + self.batch_size - items.len()).min(self.items.len());
            items.extend(self.order[start..end].iter().map(|&i| self.items[i].clone()));
            self.position.index = end;
            self.normalise();
        }
        Some(items)
    }

    /// The item order of `epoch`.
    pub fn order_of(&self, epoch: usize) -> Vec<usize> {
        if self.shuffle {
            permutation(self.items.len(), epoch_seed(self.seed, epoch))
        } else {
            (0..self.items.len()).collect()
        }
    }

    /// An exhausted epoch becomes the start of the next, so positions are canonical.
    fn normalise(&mut self) {
        if !self.items.is_empty() && self.position.index == self.items.len() {
            self.position = LoaderPosition { epoch: self.position.epoch + 1, index: 0 };
            self.order = self.order_of(self.position.epoch);
        }
    }
}

/// The seed of one epoch's shuffle.
pub fn epoch_seed(seed: u64, epoch: usize) -> u64 {
    let mut s = seed ^ (epoch as u64).wrapping_mul(splitmix::GOLDEN);
    splitmix::next(&mut s)
}

/// A uniformly random permutation of `0..n` determined by `seed` (Fisher–Yates on SplitMix64).
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed;
    for i in (1..n).rev() {
        // Lemire's multiply-shift: an index in 0..=i; the bias for i < 2^32 is below 2^-32.
        let j = ((splitmix::next(&mut state) as u128 * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_and_permutations_are_those_of_resumable_runs() {
        // Computed before the shuffle moved onto `crate::splitmix`: a resumed run reshuffles
        // from (seed, epoch), so these must never change.
        assert_eq!(epoch_seed(0, 0), 0xe220a8397b1dcdaf);
        assert_eq!(epoch_seed(0, 1), 0x6e789e6aa1b965f4);
        assert_eq!(epoch_seed(7, 3), 0x28ceb6e1eddad0c2);
        assert_eq!(epoch_seed(42, 2), 0x5fd30d2fcbef75e3);
        assert_eq!(epoch_seed(u64::MAX, 5), 0x13e723632ca239f9);
        assert_eq!(permutation(10, 0), [4, 9, 2, 5, 1, 7, 6, 0, 3, 8]);
        assert_eq!(permutation(10, 42), [8, 3, 6, 5, 4, 0, 9, 2, 1, 7]);
        assert_eq!(permutation(10, 7), [9, 5, 8, 6, 1, 2, 4, 7, 0, 3]);
        assert_eq!(permutation(5, 3), [3, 4, 1, 2, 0]);
    }

    /// Across epochs, batches are the epochs' orders concatenated and cut every `batch_size`
    /// items, from any position a checkpoint can hold.
    #[test]
    fn batches_across_epochs_cut_the_concatenated_orders() {
        let (n, b, seed) = (10, 4, 3);
        let mut loader = DataLoader::new((0..n).collect::<Vec<usize>>(), b, seed, true);
        let endless: Vec<usize> = (0..4).flat_map(|e| permutation(n, epoch_seed(seed, e))).collect();
        for step in 0..9 {
            assert_eq!(loader.next_items_across_epochs().unwrap(), endless[step * b..(step + 1) * b], "step {step}");
            let mut resumed = DataLoader::new((0..n).collect::<Vec<usize>>(), b, seed, true);
            resumed.set_position(loader.position()).unwrap();
            let (mut a, mut c) = (loader.clone(), resumed);
            assert_eq!(a.next_items_across_epochs(), c.next_items_across_epochs(), "resumed after step {step}");
        }
        assert_eq!(loader.position(), LoaderPosition { epoch: 3, index: 6 });
    }
}
