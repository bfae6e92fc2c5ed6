//! The fully asynchronous RL loop (after SkyRL's fully-async trainer and AReaL): generation
//! never waits for training, training never waits for the slowest sample.
//!
//! ```text
//! generation workers (max_concurrent threads), each:
//!     loop: wait until staleness.capacity() > 0                   (staleness.rs)
//!           k = stream.take(); start_step = cur                    (prompt_stream.rs)
//!           episodes = n samples of prompt k on the engines, seed group_seed(k)
//!           staleness.finish(); send (k, start_step, episodes) to the trainer
//! trainer, for step in start..max_steps:
//!     take finished groups as they finish; one without signal is filtered (its capacity
//!         released, its id recorded); the others are held
//!     until staleness.pick(held, running) gives prompts_per_step of them: oldest first,
//!         waiting for a straggler only if it would otherwise grow staler than max_staleness
//!     order the step's groups by k; train them as the synchronous trainer does  (rl_run.rs)
//!     push the weights in flight (keep: requests freeze, weights swap, caches are recomputed,
//!         decoding continues; abort: requests end and continue on the new weights)
//!     stream.consume(the step's ks); staleness.step_done(step)  → more groups may start
//!     metrics (+ staleness of the step's groups, weight version, waits), eval, checkpoint
//! ```
//! A group's staleness is the step that trains it minus the step during which it started; the
//! staleness manager keeps it at most `max_staleness`. Every sampled token carries the weight
//! version that produced it (an update can land mid-sequence); the losses that correct for the
//! behaviour policy (`rollout_is`, `cispo` with `anchor = "rollout"`, PPO with token or sequence
//! TIS in `algorithm.off_policy`) are the ones to choose in this mode.
//!
//! Prompt k is the synchronous trainer's prompt `k mod prompts_per_step` of step
//! `k / prompts_per_step` with that prompt's seed, and a step's groups are trained in k order:
//! with `max_staleness = 0` and no group filtered, this loop computes what the synchronous one
//! does. A checkpoint holds the consumed and filtered ids: on resume, groups that were running or
//! waiting for the trainer are generated again, and no consumed group is handed out twice.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Map};

use super::prompt_stream::PromptStream;
use super::rl::renumber;
use super::rl_config::RlConfig;
use super::rl_run::{group_seed, keep_group, RlRun, RlSummary, RolloutStats, TrainerState};
use super::rollouts::{generate_groups, Episode};
use super::sft::RunOptions;
use super::staleness::Staleness;
use crate::dispatch::Dispatch;
use crate::env::{EnvConfig, PromptRow};
use crate::model::tokenizer::Tokenizer;
use crate::rollout::{EngineClient, SamplingParams};
use crate::{Error, Result};

/// A group the generation workers finished.
struct FinishedGroup {
    k: u64,
    /// The training step being worked on when its generation started.
    start_step: u64,
    /// Seconds its generation took.
    seconds: f64,
    episodes: Vec<Episode>,
}

/// What the workers and the trainer share.
struct Generation {
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

struct Shared {
    state: Mutex<Generation>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Generation> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `f` under the lock and wakes the waiting workers.
    fn update<R>(&self, f: impl FnOnce(&mut Generation) -> R) -> R {
        let r = f(&mut self.lock());
        self.changed.notify_all();
        r
    }
}

/// What a generation worker needs to sample one group.
struct GroupSampler<'a> {
    engines: &'a EngineClient,
    tok: &'a Tokenizer,
    train: &'a [PromptRow],
    env_config: EnvConfig,
    params: SamplingParams,
    n: usize,
    seed: u64,
    prompts_per_step: u64,
}

impl GroupSampler<'_> {
    fn sample(&self, k: u64, index: usize) -> Result<Vec<Episode>> {
        let (step, i) = ((k / self.prompts_per_step) as usize, (k % self.prompts_per_step) as usize);
        let seeds = [group_seed(self.seed, step, 0, i)];
        let prompt = std::slice::from_ref(&self.train[index]);
        generate_groups(self.engines, self.tok, prompt, &seeds, &self.env_config, &self.params, self.n)
    }
}

/// One generation worker: groups one after another while capacity allows, until stopped.
fn generation_worker(shared: &Shared, sampler: &GroupSampler, finished: Sender<Result<FinishedGroup>>) {
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
        let started = Instant::now();
        let result = sampler.sample(k, index);
        let seconds = started.elapsed().as_secs_f64();
        let sent = shared.update(|g| {
            match &result {
                Ok(_) => g.staleness.finish(),
                Err(_) => {
                    g.running.remove(&k);
                    g.staleness.cancel();
                    g.stream.release(k);
                }
            }
            finished.send(result.map(|episodes| FinishedGroup { k, start_step, seconds, episodes }))
        });
        if sent.is_err() {
            return; // the trainer is gone
        }
    }
}

/// Runs (or resumes) asynchronous RL; see the module docs. Called by [`super::rl::run_rl`] for
/// `mode = "async"`.
pub fn run_rl_async(
    cfg: &RlConfig,
    dispatch: &Dispatch,
    engines: &EngineClient,
    opts: &RunOptions,
) -> Result<RlSummary> {
    let mut run = RlRun::open(cfg, dispatch, engines, opts)?;
    let t = &cfg.train;
    let (a, mbs) = (&cfg.async_rl, t.prompts_per_step as u64);
    let concurrency = a.concurrency(t.prompts_per_step);
    let resumed_stream = run.resumed.as_ref().and_then(|s| s.stream.clone()).unwrap_or_default();
    let staleness = Staleness::resumed(a.max_staleness, concurrency, mbs, run.step as u64 + 1)?;
    let stream = PromptStream::new(run.train.len(), cfg.data.shuffle_seed, true, resumed_stream)?;
    let shared = Shared {
        state: Mutex::new(Generation {
            staleness,
            stream,
            running: BTreeMap::new(),
            capacity_wait_s: 0.0,
            stop: false,
        }),
        changed: Condvar::new(),
    };
    let (train, tok) = (run.train.clone(), run.tok.clone());
    let sampler = GroupSampler {
        engines,
        tok: &tok,
        train: &train,
        env_config: cfg.env.env_config(),
        params: cfg.sampling_params(false),
        n: cfg.rollout.n_samples,
        seed: t.seed,
        prompts_per_step: mbs,
    };
    let state = |run: &RlRun, g: &Generation| TrainerState {
        step: run.step,
        kl_coef: run.kl.coef(),
        evals: run.evals.clone(),
        stream: Some(g.stream.state()),
        staleness: Some(g.staleness.clone()),
        ..Default::default()
    };
    let (tx, finished) = channel::<Result<FinishedGroup>>();
    let mut reward_mean = f64::NAN;

    let outcome = std::thread::scope(|scope| -> Result<(bool, TrainerState)> {
        for _ in 0..concurrency {
            let (tx, shared, sampler) = (tx.clone(), &shared, &sampler);
            scope.spawn(move || generation_worker(shared, sampler, tx));
        }
        drop(tx);
        // Whatever ends the loop (an error too), the workers stop after their current group.
        let _stop = StopOnDrop(&shared);
        // Finished groups with signal not trained yet, in finish order.
        let mut held: Vec<FinishedGroup> = vec![];
        let interrupted = loop {
            if let (true, interrupted) = run.should_stop() {
                break interrupted;
            }
            // Take finished groups until the staleness manager picks the step's groups.
            let waited = Instant::now();
            let mut rollouts = RolloutStats::default();
            let picked = loop {
                let starts: Vec<u64> = held.iter().map(|g| g.start_step).collect();
                let picked = {
                    let g = shared.lock();
                    g.staleness.pick(&starts, &g.running.values().copied().collect::<Vec<_>>())
                };
                if let Some(picked) = picked {
                    break Some(picked);
                }
                let group = match finished.recv_timeout(Duration::from_millis(200)) {
                    Ok(group) => group?,
                    Err(RecvTimeoutError::Timeout) if run.should_stop().1 => break None,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(Error::Other("every generation worker has stopped".into()))
                    }
                };
                let keep = keep_group(cfg, &group.episodes);
                if !keep {
                    rollouts.add(&group.episodes);
                }
                shared.update(|g| {
                    g.running.remove(&group.k);
                    if !keep {
                        g.staleness.filter();
                        g.stream.filter(group.k);
                    }
                });
                if keep {
                    held.push(group);
                }
            };
            // Interrupted while waiting: the groups held are generated again after a resume.
            let Some(mut picked) = picked else { break true };
            picked.sort_unstable_by(|a, b| b.cmp(a));
            let mut groups: Vec<FinishedGroup> = picked.into_iter().map(|i| held.remove(i)).collect();
            let time_wait_data = waited.elapsed().as_secs_f64();
            // The step's rollout metrics: its groups, and the groups filtered while it waited.
            for g in &groups {
                rollouts.add(&g.episodes);
            }
            reward_mean = rollouts.reward_mean();

            // Train on the step's groups in id order (deterministic, and the sync trainer's).
            groups.sort_by_key(|g| g.k);
            let this_step = run.step as u64 + 1;
            let staleness: Vec<f64> = groups.iter().map(|g| (this_step - g.start_step) as f64).collect();
            let mut episodes: Vec<Episode> = vec![];
            for (i, g) in groups.iter().enumerate() {
                episodes.extend(g.episodes.iter().cloned().map(|e| Episode { group: i, ..e }));
            }
            renumber(&mut episodes);
            let trained = run.train_step(&episodes)?;
            let (time_sync, version) = run.push_weights(Some(a.pause_mode()))?;
            let capacity_wait = shared.update(|g| {
                for group in &groups {
                    g.stream.consume(group.k);
                }
                g.staleness.step_done(this_step);
                std::mem::take(&mut g.capacity_wait_s) / concurrency as f64
            });

            let mut line = Map::new();
            let generate = groups.iter().map(|g| g.seconds).sum::<f64>() / groups.len() as f64;
            line.insert("time_generate_s".into(), json!(generate));
            line.insert("time_wait_data_s".into(), json!(time_wait_data));
            line.insert("time_wait_capacity_s".into(), json!(capacity_wait));
            line.insert("time_sync_s".into(), json!(time_sync));
            let elapsed = time_wait_data + trained.time_reference + trained.time_train + time_sync;
            line.insert("samples_per_s".into(), json!(rollouts.generated as f64 / elapsed.max(1e-9)));
            line.insert("staleness_mean".into(), json!(staleness.iter().sum::<f64>() / staleness.len() as f64));
            line.insert("staleness_max".into(), json!(staleness.iter().copied().fold(0.0, f64::max)));
            line.insert("weight_version".into(), json!(version));
            let mixed = episodes.iter().filter(|e| e.versions.windows(2).any(|w| w[0] != w[1])).count();
            line.insert("episodes_mixed_versions".into(), json!(mixed));
            run.end_step(line, &rollouts, &trained, |run| state(run, &shared.lock()))?;
        };
        let last = state(&run, &shared.lock()); // the guard must be gone before `_stop` locks
        Ok((interrupted, last))
    });
    let (interrupted, last) = outcome?;
    run.finish(interrupted, reward_mean, last)
}

/// Tells the generation workers to stop when dropped.
struct StopOnDrop<'a>(&'a Shared);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.update(|g| g.stop = true);
    }
}
