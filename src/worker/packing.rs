//! Splitting a batch into micro-batches, by count and by a padded-token budget.
//!
//! Each micro-batch is right-padded to its longest datum, so its cost is `B × T_max` tokens.
//! Planning is first-fit decreasing: datums sorted by length, longest first (ties in input
//! order), each placed in the first micro-batch where it still fits — at most
//! `micro_batch_size` datums and `(B + 1) × T_max ≤ max_tokens_per_microbatch` (the first
//! datum of a micro-batch is its longest, so `T_max` never grows). With only a count limit this
//! is consecutive chunks of the sorted order; with neither, one micro-batch.
//!
//! A datum longer than the token budget is an error naming it (rather than a micro-batch of its
//! own that breaks the budget: the budget is a memory bound).
//! Grouping changes only float rounding: the worker's loss is a plain sum over datums.

use crate::{Error, Result};

/// Datum indices per micro-batch, each micro-batch longest first.
pub fn plan_micro_batches(
    lengths: &[usize],
    micro_batch_size: Option<usize>,
    max_tokens_per_microbatch: Option<usize>,
) -> Result<Vec<Vec<usize>>> {
    let max_count = micro_batch_size.unwrap_or(usize::MAX);
    let budget = max_tokens_per_microbatch.unwrap_or(usize::MAX);
    if max_count == 0 || budget == 0 {
        return Err(Error::input("micro_batch_size and max_tokens_per_microbatch must be positive"));
    }
    if let Some(i) = lengths.iter().position(|&n| n > budget) {
        return Err(Error::input(format!(
            "datum {i} has {} tokens, more than max_tokens_per_microbatch = {budget}",
            lengths[i]
        )));
    }
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for i in order {
        let fits =
            |bin: &Vec<usize>| bin.len() < max_count && (bin.len() + 1).saturating_mul(lengths[bin[0]]) <= budget;
        match bins.iter_mut().find(|bin| fits(bin)) {
            Some(bin) => bin.push(i),
            None => bins.push(vec![i]),
        }
    }
    Ok(bins)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_and_count_are_respected() {
        let lengths = [5, 9, 3, 9, 1, 4, 7];
        let bins = plan_micro_batches(&lengths, Some(3), Some(20)).unwrap();
        let mut seen: Vec<usize> = bins.concat();
        seen.sort();
        assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        for bin in &bins {
            let t_max = bin.iter().map(|&i| lengths[i]).max().unwrap();
            assert!(bin.len() <= 3 && bin.len() * t_max <= 20, "{bin:?}");
        }
        assert_eq!(plan_micro_batches(&lengths, None, None).unwrap().len(), 1);
        assert_eq!(
            plan_micro_batches(&lengths, Some(2), None).unwrap(),
            vec![vec![1, 3], vec![6, 0], vec![5, 2], vec![4]]
        );
        let err = plan_micro_batches(&lengths, None, Some(8)).unwrap_err().to_string();
        assert!(err.contains("datum 1"), "{err}");
    }
}
