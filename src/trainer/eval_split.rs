//! The eval split of oxrl: which items of a training set are held out for evaluation when a run
//! has no eval file ([`split_eval`]). SFT uses it for its rows (`data.eval_fraction`); it is
//! meant to be the only one, so that every trainer holds out data the same way.

use super::data_loader::permutation;

/// XORed into the seed of the split, so that the split and epoch 0's shuffle (seeded with the
/// same `shuffle_seed`) are not the same permutation.
const SPLIT_SALT: u64 = 0x5eed_e7a1_5011_7700;

/// Splits `items` into `(train, eval)`, holding out `fraction` of them for evaluation.
///
/// - How many: `round(n · fraction)` of the `n` items (half away from zero); when
///   `fraction > 0` and `n ≥ 2`, at least one and at most `n − 1`, so both sides are non-empty.
///   (`n = 1` is not clamped: the one item is held out when `fraction ≥ 0.5`, else kept.)
/// - Which: the first of them in `permutation(n, seed ^ SPLIT_SALT)`, a pure function of
///   `seed` (in SFT, `data.shuffle_seed`), so the split is reproducible.
/// - Order: each side keeps the items' dataset order.
///
/// `fraction` is expected in `[0, 1)` (the configs check it).
pub fn split_eval<T>(items: Vec<T>, fraction: f64, seed: u64) -> (Vec<T>, Vec<T>) {
    let n = items.len();
    let mut n_eval = (n as f64 * fraction).round() as usize;
    if fraction > 0.0 && n >= 2 {
        n_eval = n_eval.clamp(1, n - 1);
    }
    if n_eval == 0 {
        return (items, Vec::new());
    }
    let mut is_eval = vec![false; n];
    for &i in &permutation(n, seed ^ SPLIT_SALT)[..n_eval] {
        is_eval[i] = true;
    }
    let (mut train, mut eval) = (Vec::new(), Vec::new());
    for (item, e) in items.into_iter().zip(is_eval) {
        if e {
            eval.push(item);
        } else {
            train.push(item);
        }
    }
    (train, eval)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(n: usize, fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
        split_eval((0..n).collect(), fraction, seed)
    }

    #[test]
    fn holds_out_the_first_items_of_the_salted_permutation_in_dataset_order() {
        // n = 10, fraction 0.2: two items, the first two of permutation(10, seed ^ salt),
        // computed independently (SplitMix64 + Fisher–Yates by hand in Python):
        // seed 0 → [9, 2, 5, …], seed 1 → [7, 4, 8, …], seed 7 → [5, 3, 0, …].
        for (seed, held) in [(0u64, [2usize, 9]), (1, [4, 7]), (7, [3, 5])] {
            let mut first: Vec<usize> = permutation(10, seed ^ 0x5eed_e7a1_5011_7700)[..2].to_vec();
            first.sort();
            assert_eq!(first, held, "seed {seed}");
            let (train, eval) = split(10, 0.2, seed);
            assert_eq!(eval, held, "seed {seed}");
            let rest: Vec<usize> = (0..10).filter(|i| !held.contains(i)).collect();
            assert_eq!(train, rest, "seed {seed}: the rest, in order");
        }
        // n = 7, fraction 0.3: round(2.1) = 2 items; seed 3 → [6, 4, 5, …].
        assert_eq!(split(7, 0.3, 3), (vec![0, 1, 2, 3, 5], vec![4, 6]));
    }

    #[test]
    fn counts_are_rounded_and_clamped() {
        let count = |n: usize, f: f64| split(n, f, 0).1.len();
        assert_eq!(count(10, 0.0), 0, "no fraction, no eval set");
        assert_eq!(count(10, 0.01), 1, "a positive fraction holds out at least one item");
        assert_eq!(count(10, 0.14), 1);
        assert_eq!(count(10, 0.15), 2, "rounded half away from zero");
        assert_eq!(count(10, 0.96), 9, "at least one item stays for training");
        assert_eq!(count(2, 0.9), 1);
        assert_eq!(count(0, 0.5), 0);
        assert_eq!(count(1, 0.4), 0, "n = 1: round(0.4) = 0");
        assert_eq!(count(1, 0.5), 1, "n = 1 is not clamped");
    }

    #[test]
    fn the_split_depends_on_the_seed_only() {
        assert_eq!(split(50, 0.2, 11), split(50, 0.2, 11));
        assert_ne!(split(50, 0.2, 11).1, split(50, 0.2, 12).1);
        let (train, eval) = split(50, 0.2, 11);
        let mut all = [train, eval].concat();
        all.sort();
        assert_eq!(all, (0..50).collect::<Vec<_>>(), "disjoint, and together the whole set");
    }
}
