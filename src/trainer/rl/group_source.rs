//! What the RL loop ([`super`]) takes a step's groups from: the synchronous step
//! ([`super::sync_groups`]) or the asynchronous stream ([`super::async_groups`]).

use super::group::Group;
use super::rollout_stats::RolloutStats;
use super::state::DataPosition;
use super::step_metrics::AsyncMetrics;
use crate::rollout::PauseMode;
use crate::Result;

/// Where the loop's groups come from.
pub trait GroupSource {
    /// The next step's groups (step `steps_done + 1`): whole groups with signal, in identity
    /// order. Every episode generated for it, filtered or not, goes into `rollouts`. `None`:
    /// `stop()` turned true while waiting.
    fn next_groups(
        &mut self,
        steps_done: usize,
        rollouts: &mut RolloutStats,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<Group>>>;
    /// How the engines take the step's new weights: `None` when they are idle.
    fn pause_mode(&self) -> Option<PauseMode>;
    /// The step `step` (from 1) trained `groups` and its weights reached the engines.
    fn trained(&mut self, groups: &[Group], step: u64);
    /// The source's own keys of the step's metrics line (the asynchronous source's).
    fn describe(&self, groups: &[Group], step: u64) -> Option<AsyncMetrics>;
    /// Where the source is in the prompts, for a checkpoint.
    fn position(&self) -> DataPosition;
}
