//! The asynchronous source of groups (after SkyRL's fully-async trainer and AReaL): generation
//! never waits for training, training never waits for the slowest sample.
//!
//! ```text
//! generation workers (max_concurrent threads), each:
//!     loop: wait until staleness.capacity() > 0                   (staleness.rs)
//!           k = stream.take(); start_step = cur                    (prompt_stream.rs)
//!           the group of prompt k on the engines, identity (k / per_step, 0, k mod per_step)
//!           staleness.finish(); send it to the trainer
//! next_groups (the trainer's step):
//!     take finished groups as they finish; one without signal is filtered (its capacity
//!         released, its id recorded) and the stream's next group takes its place
//!     until staleness.pick(held, running) gives prompts_per_step of them: oldest first,
//!         waiting for a straggler only if it would otherwise grow staler than max_staleness
//!     the step's groups in k order
//! trained: stream.consume(the step's ks); staleness.step_done(step) → more groups may start
//! ```
//! The loop pushes weights in flight (`keep`: requests freeze, weights swap, caches are
//! recomputed, decoding continues; `abort`: requests end and continue on the new weights). A
//! group's staleness is the step that trains it minus the step during which it started; the
//! staleness manager keeps it at most `max_staleness`. Every sampled token carries the weight
//! version that produced it; the losses that correct for the behaviour policy (`rollout_is`,
//! `cispo` with `anchor = "rollout"`, PPO with token or sequence TIS in `algorithm.off_policy`)
//! are the ones to choose in this mode.
//!
//! Group k is the synchronous trainer's group `(k / prompts_per_step, 0, k mod prompts_per_step)`
//! with that group's seed, and a step's groups are trained in k order: with `max_staleness = 0`
//! this source yields what the synchronous one does, so the runs are equal (a filtered group is
//! replaced here by the stream's next one, where the sync source samples a new round). What
//! stays non-deterministic with `max_staleness > 0`: which groups finish first, and so which
//! step trains them. A checkpoint holds the consumed and filtered ids and the staleness control;
//! on resume, groups that were running or waiting for the trainer are generated again, no
//! consumed group is handed out twice, and `max_staleness` must be the checkpoint's.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::Scope;
use std::time::{Duration, Instant};

use super::step_metrics::AsyncMetrics;

use super::config::RlConfig;
use super::group::GroupSampler;
use super::group::{Group, GroupFilter, GroupId};
use super::group_source::GroupSource;
use super::prompt_stream::PromptStream;
use super::rollout_stats::RolloutStats;
use super::staleness::Staleness;
use super::state::{expect_position, DataPosition, RlState, StreamPosition};
use crate::env::PromptRow;
use crate::rollout::PauseMode;
use crate::trainer::run_dir::TrainerState;
use crate::{Error, Result};

/// What the workers and the trainer share.
struct GenerationState {
    staleness: Staleness,
    stream: PromptStream,
    /// Start steps of the groups the trainer has not received yet (running, or in the channel),
    /// by id. The trainer removes a group when it receives it, so that [`Staleness::pick`] never
    /// misses one in transit.
    running: BTreeMap<u64, u64>,
    /// Seconds the workers waited for capacity since the trainer last read it (summed over
    /// workers; the metric is the mean per worker).
    capacity_wait_s: f64,
    stop: bool,
}

struct SharedGeneration {
    state: Mutex<GenerationState>,
    changed: Condvar,
}

impl SharedGeneration {
    fn lock(&self) -> MutexGuard<'_, GenerationState> {
        crate::locks::lock(&self.state)
    }

    /// Applies `f` under the lock and wakes the waiting workers.
    fn update<R>(&self, f: impl FnOnce(&mut GenerationState) -> R) -> R {
        let r = f(&mut self.lock());
        self.changed.notify_all();
        r
    }
}

/// What a generation worker samples from.
struct Prompts<'a> {
    sampler: &'a GroupSampler<'a>,
    train: &'a [PromptRow],
    per_step: usize,
}

/// One generation worker: groups one after another while capacity allows, until stopped.
fn generation_worker(shared: &SharedGeneration, prompts: &Prompts, finished: Sender<Result<(u64, Group)>>) {
    loop {
        let (k, index, start_step) = {
            let mut g = shared.lock();
            let waited = Instant::now();
            let start_step = loop {
                if g.stop {
                    return;
                }
                if let Some(step) = g.staleness.try_start() {
                    break step;
                }
                g = shared.changed.wait(g).unwrap_or_else(|p| p.into_inner());
            };
            g.capacity_wait_s += waited.elapsed().as_secs_f64();
            let (k, index) = g.stream.take();
            g.running.insert(k, start_step);
            (k, index, start_step)
        };
        let id = GroupId::of_stream(k, prompts.per_step);
        let result = prompts.sampler.sample(std::slice::from_ref(&prompts.train[index]), &[id], start_step);
        let sent = shared.update(|g| {
            match &result {
                Ok(_) => g.staleness.finish(),
                Err(_) => {
                    g.running.remove(&k);
                    g.staleness.cancel();
                    g.stream.release(k);
                }
            }
            finished.send(result.map(|mut groups| (k, groups.remove(0))))
        });
        if sent.is_err() {
            return; // the trainer is gone
        }
    }
}

/// The asynchronous source; its workers stop when it is dropped.
pub struct AsyncGroups {
    shared: Arc<SharedGeneration>,
    finished: Receiver<Result<(u64, Group)>>,
    /// Finished groups with signal not trained yet, in finish order.
    held: Vec<(u64, Group)>,
    filter: GroupFilter,
    pause: PauseMode,
    concurrency: u64,
    /// Seconds the last step waited for its groups; the workers' capacity wait since the step
    /// before (mean per worker).
    wait_data_s: f64,
    wait_capacity_s: f64,
}

impl AsyncGroups {
    /// Starts `max_concurrent` generation workers in `scope` over `train` (resumed: from the
    /// checkpoint's stream).
    pub fn start<'scope, 'env>(
        scope: &'scope Scope<'scope, 'env>,
        cfg: &RlConfig,
        sampler: &'env GroupSampler<'env>,
        train: &'env [PromptRow],
        resumed: Option<&TrainerState<RlState>>,
    ) -> Result<AsyncGroups> {
        let (a, per_step) = (&cfg.async_rl, cfg.train.prompts_per_step);
        let concurrency = a.concurrency(per_step);
        let (mut stream_state, mut next_step) = (Default::default(), 1);
        if let Some(state) = resumed {
            if let DataPosition::Stream(p) = expect_position(state, true)? {
                if p.staleness.max_staleness != a.max_staleness {
                    return Err(Error::input(format!(
                        "async_rl.max_staleness = {} but the checkpoint at step {} was made with {}: resume with that value",
                        a.max_staleness, state.step, p.staleness.max_staleness
                    )));
                }
                stream_state = p.stream.clone();
            }
            next_step = state.step as u64 + 1;
        }
        let staleness = Staleness::resumed(a.max_staleness, concurrency, per_step as u64, next_step)?;
        let stream = PromptStream::new(train.len(), cfg.data.shuffle_seed, true, stream_state)?;
        let shared = Arc::new(SharedGeneration {
            state: Mutex::new(GenerationState {
                staleness,
                stream,
                running: BTreeMap::new(),
                capacity_wait_s: 0.0,
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let (tx, finished) = channel();
        for _ in 0..concurrency {
            let (tx, shared) = (tx.clone(), shared.clone());
            let prompts = Prompts { sampler, train, per_step };
            scope.spawn(move || generation_worker(&shared, &prompts, tx));
        }
        Ok(AsyncGroups {
            shared,
            finished,
            held: vec![],
            filter: cfg.group_filter(),
            pause: a.pause_mode(),
            concurrency,
            wait_data_s: 0.0,
            wait_capacity_s: 0.0,
        })
    }
}

impl GroupSource for AsyncGroups {
    fn next_groups(
        &mut self,
        _steps_done: usize,
        rollouts: &mut RolloutStats,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<Group>>> {
        let waited = Instant::now();
        // Take finished groups until the staleness manager picks the step's groups.
        let mut picked = loop {
            let starts: Vec<u64> = self.held.iter().map(|(_, g)| g.start_step).collect();
            let picked = {
                let g = self.shared.lock();
                g.staleness.pick(&starts, &g.running.values().copied().collect::<Vec<_>>())
            };
            if let Some(picked) = picked {
                break picked;
            }
            let (k, group) = match self.finished.recv_timeout(Duration::from_millis(200)) {
                Ok(group) => group?,
                // Interrupted while waiting: the groups held are generated again after a resume.
                Err(RecvTimeoutError::Timeout) if stop() => return Ok(None),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Other("every generation worker has stopped".into()))
                }
            };
            let keep = self.filter.keeps(&group.episodes);
            if !keep {
                rollouts.add(&group.episodes);
            }
            self.shared.update(|g| {
                g.running.remove(&k);
                if !keep {
                    g.staleness.filter();
                    g.stream.filter(k);
                }
            });
            if keep {
                self.held.push((k, group));
            }
        };
        picked.sort_unstable_by(|a, b| b.cmp(a));
        let mut groups: Vec<(u64, Group)> = picked.into_iter().map(|i| self.held.remove(i)).collect();
        groups.sort_by_key(|(k, _)| *k);
        for (_, g) in &groups {
            rollouts.add(&g.episodes);
        }
        self.wait_data_s = waited.elapsed().as_secs_f64();
        Ok(Some(groups.into_iter().map(|(_, g)| g).collect()))
    }

    fn pause_mode(&self) -> Option<PauseMode> {
        Some(self.pause)
    }

    fn trained(&mut self, groups: &[Group], step: u64) {
        let per_step = self.shared.lock().staleness.groups_per_step;
        self.wait_capacity_s = self.shared.update(|g| {
            for group in groups {
                g.stream.consume(group.id.step as u64 * per_step + group.id.index as u64);
            }
            g.staleness.step_done(step);
            std::mem::take(&mut g.capacity_wait_s) / self.concurrency as f64
        });
    }

    fn describe(&self, groups: &[Group], step: u64) -> Option<AsyncMetrics> {
        let staleness: Vec<f64> = groups.iter().map(|g| (step - g.start_step) as f64).collect();
        Some(AsyncMetrics {
            time_wait_data_s: self.wait_data_s,
            time_wait_capacity_s: self.wait_capacity_s,
            staleness_mean: staleness.iter().sum::<f64>() / staleness.len().max(1) as f64,
            staleness_max: staleness.iter().copied().fold(0.0, f64::max),
            episodes_mixed_versions: groups
                .iter()
                .flat_map(|g| &g.episodes)
                .filter(|e| e.versions.windows(2).any(|w| w[0] != w[1]))
                .count(),
        })
    }

    fn position(&self) -> DataPosition {
        let g = self.shared.lock();
        DataPosition::Stream(StreamPosition { stream: g.stream.state(), staleness: g.staleness.clone() })
    }
}

impl Drop for AsyncGroups {
    /// The workers stop after their current group.
    fn drop(&mut self) {
        self.shared.update(|g| g.stop = true);
    }
}
