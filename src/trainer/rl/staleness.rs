//! Staleness control of the fully asynchronous trainer (algorithms.md, after SkyRL / AReaL).
//!
//! ```text
//! counters: submitted, accepted, running, filtered      submitted = accepted + filtered + running
//! cur      = the training step being worked on (from 1); groups_per_step (written `mbs` in checkpoints)
//! capacity = min(max_concurrent − running, (max_staleness + cur) · groups_per_step − (accepted + running))
//! start  (capacity > 0): submitted += 1, running += 1
//! finish:                accepted += 1, running −= 1
//! filter (after finish): accepted −= 1, filtered += 1
//! cancel:                submitted −= 1, running −= 1
//! after step s trains:   cur = s + 1
//! resume at step g:      cur = g, accepted = submitted = (g − 1) · groups_per_step, running = filtered = 0
//! ```
//! The capacity alone does not bound staleness when groups are trained in finish order: a
//! straggler started in step 1 can finish after younger groups have filled steps 2, 3, … (the
//! property test found this). So the trainer also picks each step's groups with
//! [`Staleness::pick`]: oldest first, and waiting for a straggler when the groups left behind
//! could not all be trained by their deadlines (start step + `max_staleness`). With both rules a group's staleness (trainer step − start step) is
//! at most `max_staleness`; with `max_staleness = 0` a step's groups all start after the previous
//! step's weights reached the engines: the synchronous trainer.
//!
//! Deviation from algorithms.md: a cancel also takes one from `submitted` (the spec lists only
//! `running −= 1`, which would break its own invariant).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The group counters; `submitted = accepted + filtered + running` at every moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupCounters {
    pub submitted: u64,
    pub accepted: u64,
    pub running: u64,
    pub filtered: u64,
}

/// Bounds how far the policy that starts a group may lag the one that trains it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staleness {
    pub max_staleness: u64,
    pub max_concurrent: u64,
    /// Groups per training step.
    #[serde(rename = "mbs")]
    pub groups_per_step: u64,
    /// The training step being worked on (1-based).
    pub cur: u64,
    pub counters: GroupCounters,
}

impl Staleness {
    /// A fresh run: step 1, nothing submitted.
    pub fn new(max_staleness: u64, max_concurrent: u64, groups_per_step: u64) -> Result<Staleness> {
        if groups_per_step == 0 || max_concurrent == 0 {
            return Err(Error::input(format!(
                "staleness control needs groups per step ({groups_per_step}) and max_concurrent ({max_concurrent}) above 0"
            )));
        }
        Ok(Staleness { max_staleness, max_concurrent, groups_per_step, cur: 1, counters: GroupCounters::default() })
    }

    /// A run resumed before step `g` (1-based): the groups of steps 1..g are accepted.
    pub fn resumed(max_staleness: u64, max_concurrent: u64, groups_per_step: u64, g: u64) -> Result<Staleness> {
        let mut s = Staleness::new(max_staleness, max_concurrent, groups_per_step)?;
        s.cur = g.max(1);
        let done = (s.cur - 1) * groups_per_step;
        s.counters = GroupCounters { submitted: done, accepted: done, running: 0, filtered: 0 };
        Ok(s)
    }

    /// How many more groups may start now (≤ 0: none).
    pub fn capacity(&self) -> i64 {
        let c = &self.counters;
        let by_concurrency = self.max_concurrent as i64 - c.running as i64;
        let by_staleness =
            ((self.max_staleness + self.cur) * self.groups_per_step) as i64 - (c.accepted + c.running) as i64;
        by_concurrency.min(by_staleness)
    }

    /// Starts a group if there is capacity; returns the step it starts in.
    pub fn try_start(&mut self) -> Option<u64> {
        if self.capacity() <= 0 {
            return None;
        }
        self.counters.submitted += 1;
        self.counters.running += 1;
        Some(self.cur)
    }

    /// A running group finished.
    pub fn finish(&mut self) {
        debug_assert!(self.counters.running > 0);
        self.counters.running = self.counters.running.saturating_sub(1);
        self.counters.accepted += 1;
    }

    /// A finished group was dropped by the trainer (dynamic sampling, zero variance).
    pub fn filter(&mut self) {
        debug_assert!(self.counters.accepted > 0);
        self.counters.accepted = self.counters.accepted.saturating_sub(1);
        self.counters.filtered += 1;
    }

    /// A running group was cancelled (its capacity is released).
    pub fn cancel(&mut self) {
        debug_assert!(self.counters.running > 0);
        self.counters.running = self.counters.running.saturating_sub(1);
        self.counters.submitted = self.counters.submitted.saturating_sub(1);
    }

    /// Step `step` has trained (and its weights reached the engines).
    pub fn step_done(&mut self, step: u64) {
        self.cur = step + 1;
    }

    /// The groups step `cur` trains, as indices into `finished` (the start steps of finished,
    /// untrained groups, in finish order), or `None` while the step must wait. `running` holds
    /// the start steps of running groups.
    ///
    /// Each group must be trained by its deadline, step `start + max_staleness`. The step takes
    /// finished groups oldest first (finish order among equals), and waits while a running group
    /// is due now, while fewer than `groups_per_step` groups have finished, or while the groups it would
    /// leave could not all meet their deadlines (more than `(d − cur) · groups_per_step` of them due by some
    /// step `d`): then a straggler must be waited for, because no other choice does better than
    /// oldest-first.
    pub fn pick(&self, finished: &[u64], running: &[u64]) -> Option<Vec<usize>> {
        let deadline = |start: u64| start + self.max_staleness;
        if running.iter().any(|&s| deadline(s) <= self.cur) {
            return None;
        }
        let mut order: Vec<usize> = (0..finished.len()).collect();
        order.sort_by_key(|&i| finished[i]); // stable: finish order among equal starts
        if (order.len() as u64) < self.groups_per_step {
            return None;
        }
        let (picked, left) = order.split_at(self.groups_per_step as usize);
        let mut deadlines: Vec<u64> = left.iter().map(|&i| deadline(finished[i])).collect();
        deadlines.extend(running.iter().map(|&s| deadline(s)));
        deadlines.sort_unstable();
        // The k-th earliest remaining deadline (1-based) needs a slot in steps cur+1..=deadline.
        let feasible = deadlines
            .iter()
            .enumerate()
            .all(|(k, &d)| d > self.cur && (k as u64) < (d - self.cur) * self.groups_per_step);
        feasible.then(|| picked.to_vec())
    }

    /// `submitted = accepted + filtered + running`.
    pub fn balanced(&self) -> bool {
        let c = &self.counters;
        c.submitted == c.accepted + c.filtered + c.running
    }
}
