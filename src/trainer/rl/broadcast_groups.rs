//! Async RL across processes (`mpirun -np N`): process 0 runs the asynchronous source of groups
//! (generation in the background, on the engines) and hands each step's groups to the other
//! processes, which train on them as its data-parallel peers.
//!
//! ```text
//! process 0:      outcome = async_source.next_groups()   # the step's groups, stopped, or why not
//! every process:  outcome = broadcast(0, outcome)        # with the step's rollout statistics
//! ```
//! Process 0 alone pauses, updates and resumes shared engines (the engine client's sharing),
//! and alone writes the run directory, so its data position is the run's; the others keep the
//! last one it sent (they write no checkpoint). Simplification: with engines in every process
//! (no remote or job engines), only process 0's generate.

use super::step_metrics::AsyncMetrics;
use serde::{Deserialize, Serialize};

use super::group::Group;
use super::group_source::GroupSource;
use super::rollout_stats::RolloutStats;
use super::state::DataPosition;
use crate::rollout::PauseMode;
use crate::world::{decode, encode, World};
use crate::{Error, Result};

/// Process 0's source of groups, seen by every process.
pub struct BroadcastGroups<'w, S> {
    world: &'w dyn World,
    /// `Some` on process 0.
    source: Option<S>,
    pause: Option<PauseMode>,
    last_position: Option<DataPosition>,
}

/// What process 0's source gave for a step.
#[derive(Serialize, Deserialize)]
enum Outcome {
    Groups { groups: Vec<Group>, rollouts: RolloutStats, position: Box<DataPosition> },
    Stopped,
    EngineDown(String),
    Failed(String),
}

impl<'w, S: GroupSource> BroadcastGroups<'w, S> {
    /// `source` on process 0 (`None` elsewhere); `pause`: how the engines take weights in flight.
    pub fn new(world: &'w dyn World, source: Option<S>, pause: Option<PauseMode>) -> Self {
        BroadcastGroups { world, source, pause, last_position: None }
    }
}

impl<S: GroupSource> GroupSource for BroadcastGroups<'_, S> {
    fn next_groups(
        &mut self,
        steps_done: usize,
        rollouts: &mut RolloutStats,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<Group>>> {
        let mut bytes = match &mut self.source {
            Some(source) => {
                let mut stats = RolloutStats::default();
                let outcome = match source.next_groups(steps_done, &mut stats, stop) {
                    Ok(Some(groups)) => {
                        Outcome::Groups { groups, rollouts: stats, position: Box::new(source.position()) }
                    }
                    Ok(None) => Outcome::Stopped,
                    Err(Error::EngineDown(why)) => Outcome::EngineDown(why),
                    Err(e) => Outcome::Failed(e.to_string()),
                };
                encode(&outcome)?
            }
            None => vec![],
        };
        self.world.broadcast(0, &mut bytes)?;
        match decode(&bytes)? {
            Outcome::Groups { groups, rollouts: stats, position } => {
                *rollouts = stats;
                self.last_position = Some(*position);
                Ok(Some(groups))
            }
            Outcome::Stopped => Ok(None),
            Outcome::EngineDown(why) => Err(Error::EngineDown(why)),
            Outcome::Failed(why) => Err(Error::Other(format!("process 0: {why}"))),
        }
    }

    fn pause_mode(&self) -> Option<PauseMode> {
        self.pause
    }

    fn trained(&mut self, groups: &[Group], step: u64) {
        if let Some(source) = &mut self.source {
            source.trained(groups, step);
        }
    }

    fn describe(&self, groups: &[Group], step: u64) -> Option<AsyncMetrics> {
        self.source.as_ref().and_then(|source| source.describe(groups, step))
    }

    fn position(&self) -> DataPosition {
        match (&self.source, &self.last_position) {
            (Some(source), _) => source.position(),
            (None, Some(p)) => p.clone(),
            // Before the first step; never written (followers write no checkpoint).
            (None, None) => DataPosition::Loader(Default::default()),
        }
    }
}
