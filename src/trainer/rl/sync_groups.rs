//! The synchronous source of groups: each step generates its own, on engines that are idle
//! while the trainer trains.
//!
//! ```text
//! for round in 0..rounds (1, or max_sampling_rounds with dynamic_sampling = "replace"):
//!     prompts = the loader's next prompts_per_step prompts   # seeded per-epoch shuffle, resumable;
//!                                                             # a step may span two epochs
//!     groups  = n samples of each prompt, group (step, round, i) seeded by its identity
//!     keep the groups with signal (group filter) until the step has prompts_per_step of them
//! ```
//! A resumed run restores the loader position, so it samples what an uninterrupted run does.

use super::step_metrics::AsyncMetrics;

use super::config::{DynamicSampling, RlConfig};
use super::group::GroupSampler;
use super::group::{Group, GroupFilter, GroupId};
use super::group_source::GroupSource;
use super::rollout_stats::RolloutStats;
use super::state::{expect_position, DataPosition, RlState};
use crate::env::PromptRow;
use crate::rollout::PauseMode;
use crate::trainer::data_loader::DataLoader;
use crate::trainer::run_dir::TrainerState;
use crate::{Error, Result};

pub struct SyncGroups<'a> {
    sampler: &'a GroupSampler<'a>,
    loader: DataLoader<PromptRow>,
    per_step: usize,
    rounds: usize,
    filter: GroupFilter,
}

impl<'a> SyncGroups<'a> {
    /// The source of a run over `train` (at the resumed run's loader position, if any).
    pub fn new(
        cfg: &RlConfig,
        sampler: &'a GroupSampler<'a>,
        train: &[PromptRow],
        resumed: Option<&TrainerState<RlState>>,
    ) -> Result<Self> {
        let per_step = cfg.train.prompts_per_step;
        let mut loader = DataLoader::new(train.to_vec(), per_step, cfg.data.shuffle_seed, true);
        if let Some(state) = resumed {
            if let DataPosition::Loader(position) = expect_position(state, false)? {
                loader.set_position(*position)?;
            }
        }
        let a = &cfg.algorithm;
        let rounds = if a.dynamic_sampling == DynamicSampling::Replace { a.max_sampling_rounds.max(1) } else { 1 };
        Ok(SyncGroups { sampler, loader, per_step, rounds, filter: cfg.group_filter() })
    }
}

impl GroupSource for SyncGroups<'_> {
    fn next_groups(
        &mut self,
        steps_done: usize,
        rollouts: &mut RolloutStats,
        _stop: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<Group>>> {
        let mut groups = vec![];
        for round in 0..self.rounds {
            let prompts =
                self.loader.next_items_across_epochs().ok_or_else(|| Error::input("the training set is empty"))?;
            let ids: Vec<GroupId> =
                (0..prompts.len()).map(|index| GroupId { step: steps_done, round, index }).collect();
            for group in self.sampler.sample(&prompts, &ids, steps_done as u64 + 1)? {
                rollouts.add(&group.episodes);
                if self.filter.keeps(&group.episodes) && groups.len() < self.per_step {
                    groups.push(group);
                }
            }
            if groups.len() >= self.per_step {
                break;
            }
        }
        Ok(Some(groups))
    }

    fn pause_mode(&self) -> Option<PauseMode> {
        None
    }

    fn trained(&mut self, _groups: &[Group], _step: u64) {}

    fn describe(&self, _groups: &[Group], _step: u64) -> Option<AsyncMetrics> {
        None
    }

    fn position(&self) -> DataPosition {
        DataPosition::Loader(self.loader.position())
    }
}
