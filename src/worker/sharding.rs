//! How the data-parallel ranks of a model share its training state (ZeRO stages): `none` (every
//! rank holds the whole model, its gradients and both AdamW moments), `optimizer` (each rank
//! keeps the moments and master weights of its slice and updates only it, then the parameters
//! are all-gathered), `gradients` (also only its slice of the summed gradients), `full` (also
//! only its slice of the parameters, gathered per layer for the forward and backward).
//!
//! A rank's slice is a set of whole parameters ([`ShardPlan`]): each parameter has one owner,
//! chosen by size so the ranks hold nearly equal element counts (largest first, each to the
//! least-loaded rank). Whole parameters keep the arithmetic of the unsharded step: the owner
//! computes a parameter's update and its share of the gradient norm exactly as every rank does
//! under `none`, so the result is the same bits (see `super::sharded_step`).
//!
//! The names are a closed choice (`train.sharding`, `launch.sharding`, `oxrl bench memory
//! --sharding`): an unknown one is an error with the nearest name. [`Sharding::check_served`]
//! refuses what the workers cannot run yet, at config load, before any model is built.

use crate::{Error, Result};

crate::choice! {
    /// What each data-parallel rank keeps of a model's training state.
    #[derive(Default)]
    pub enum Sharding("sharding") {
        /// Everything, on every rank.
        #[default]
        None = "none",
        /// ZeRO-1: a slice of the optimizer state.
        Optimizer = "optimizer",
        /// ZeRO-2: a slice of the optimizer state and of the summed gradients.
        Gradients = "gradients",
        /// ZeRO-3: a slice of the optimizer state, the gradients and the parameters.
        Full = "full",
    }
}

impl Sharding {
    /// Ok for a mode the workers can run on `device` (`cpu`, `cuda:0`, …); else an error naming
    /// what it would need.
    pub fn check_served(self, device: &str) -> Result<()> {
        match self {
            Sharding::Full if device != "cpu" => Err(Error::input(format!(
                "sharding = \"full\" gathers each layer's weights on the CPU training path only, not on \
                 `{device}`: use \"gradients\" (sliced optimizer state and summed gradients)"
            ))),
            _ => Ok(()),
        }
    }

    /// Whether the ranks split the optimizer state (every mode but `none`).
    pub fn is_sharded(self) -> bool {
        self != Sharding::None
    }
}

/// Which data-parallel rank owns (updates, keeps the optimizer state of) each parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPlan {
    pub mode: Sharding,
    /// This rank, of `ranks`.
    pub rank: usize,
    pub ranks: usize,
    /// The owning rank of each parameter, in the worker's parameter order.
    pub owners: Vec<usize>,
}

impl ShardPlan {
    /// Parameters of `sizes` elements over `ranks` ranks: the largest first, each to the rank
    /// holding the fewest elements so far (the lowest such rank on a tie). Every rank computes
    /// the same plan from the same sizes.
    pub fn new(mode: Sharding, rank: usize, ranks: usize, sizes: &[usize]) -> Self {
        let ranks = ranks.max(1);
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
        let mut load = vec![0usize; ranks];
        let mut owners = vec![0; sizes.len()];
        for i in order {
            let r = (0..ranks).min_by_key(|&r| (load[r], r)).expect("at least one rank");
            owners[i] = r;
            load[r] += sizes[i];
        }
        ShardPlan { mode, rank, ranks, owners }
    }

    /// Whether this rank owns parameter `i`.
    pub fn owns(&self, i: usize) -> bool {
        self.owners[i] == self.rank
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_what_is_served() {
        assert_eq!(Sharding::default(), Sharding::None);
        for s in [Sharding::None, Sharding::Optimizer, Sharding::Gradients, Sharding::Full] {
            assert!(s.check_served("cpu").is_ok(), "{s}");
        }
        let e = Sharding::Full.check_served("cuda:0").unwrap_err().to_string();
        assert!(e.contains("\"full\"") && e.contains("cuda:0"), "{e}");
        assert!(Sharding::Gradients.check_served("cuda:0").is_ok());
        let e = Sharding::from_name("optimiser").unwrap_err();
        assert!(e.contains("did you mean `optimizer`"), "{e}");
    }

    /// Largest first to the least-loaded rank: a hand-worked case, and every rank agrees.
    #[test]
    fn plans_balance_whole_parameters() {
        let sizes = [10, 40, 30, 20, 20, 5];
        let plan = ShardPlan::new(Sharding::Optimizer, 1, 2, &sizes);
        // In order 40 (i1), 30 (i2), 20 (i3), 20 (i4), 10 (i0), 5 (i5), the loads go
        // [40,0] [40,30] [40,50] [60,50] [60,60] [65,60] (a tie goes to rank 0).
        assert_eq!(plan.owners, vec![1, 0, 1, 1, 0, 0]);
        assert!(plan.owns(2) && !plan.owns(1));
        for r in 0..2 {
            assert_eq!(ShardPlan::new(Sharding::Optimizer, r, 2, &sizes).owners, plan.owners);
        }
        // One rank owns everything.
        assert!(ShardPlan::new(Sharding::Gradients, 0, 1, &sizes).owners.iter().all(|&o| o == 0));
    }
}
