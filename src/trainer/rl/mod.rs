//! The RL loop (GRPO, PPO and relatives), one for both modes: only where a step's groups come
//! from differs.
//!
//! ```text
//! for step in start..max_steps:
//!     groups   = source.next_groups()            # whole groups with signal, in identity order
//!                  sync  (sync_groups.rs):  generate this step's prompts × n on the engines
//!                  async (async_groups.rs): take groups generated in the background, staleness-bounded
//!                        (under mpirun: process 0's, handed to the others — broadcast_groups.rs)
//!     episodes = the groups' episodes, numbered by group                        (group.rs)
//!     old      = policy.forward(episodes); ref, values if needed  # the step's anchor (run.rs)
//!     advantages, corrections, KL in reward                                     (step.rs)
//!     for epoch in update_epochs: for each mini-batch (whole groups):
//!         policy.forward_backward(datums, loss); policy.optim_step(lr = schedule(step))
//!         critic.forward_backward(value datums, value loss); critic.optim_step(critic lr)
//!     engines.update_weights(policy weights)      # sync: engines idle; async: paused in flight
//!     source.trained(groups)                      # async: consumed, staleness advances
//!     metrics line; every eval_every: pass@1 and pass@n; every checkpoint_every: checkpoint
//! ```
//! An engine that falls mid-run is routed around (its requests continue on the others) and
//! named in the step's `engine_events`; the run stops only when none is left.
//! `time_generate_s` means the same in both modes: the wall seconds the loop waited for the
//! step's groups (sync: the whole generation; async: what generation did not overlap with
//! training). Interruption (Ctrl-C, `stop_after`) is checked between steps and, in async mode,
//! while waiting for groups; it always leaves a checkpoint. The loop knows models only by id on
//! a ready [`Dispatch`] and engines through an [`EngineClient`]: never a device or a
//! data-parallel size.

pub mod async_groups;
pub mod broadcast_groups;
pub mod config;
pub mod episodes;
pub mod eval;
pub mod group;
pub mod group_source;
pub mod plan;
pub mod prompt_stream;
pub mod prompts;
pub mod rollout_stats;
pub mod run;
pub mod staleness;
pub mod state;
pub mod step;
pub mod step_metrics;
pub mod sync_groups;

use std::time::Instant;

use self::async_groups::AsyncGroups;
use self::broadcast_groups::BroadcastGroups;
use self::config::{Mode, RlConfig};
use self::group::step_episodes;
use self::group::GroupSampler;
use self::group_source::GroupSource;
use self::rollout_stats::RolloutStats;
use self::run::RlRun;
use self::step_metrics::RlStepMetrics;
use self::sync_groups::SyncGroups;
use crate::dispatch::Dispatch;
use crate::env::{EnvFactory, PromptRow};
use crate::model::tokenizer::Tokenizer;
use crate::rollout::EngineClient;
use crate::trainer::run_dir::{check_resumable, RunOptions};
use crate::world::{world, Single};
use crate::{Error, Result};

pub use self::eval::{evaluate, pass_rates};
pub use self::prompts::load_rl_prompts;
pub use self::run::RlSummary;
pub use crate::trainer::run_dir::EXPORT_DIR;

/// Runs (or resumes) RL as `cfg` says, on the models of `dispatch` (`policy`, and `ref` /
/// `critic` when the config needs them) and the sampling engines of `engines`, which must hold
/// the policy's initial weights.
pub fn run_rl(cfg: &RlConfig, dispatch: &Dispatch, engines: &EngineClient, opts: &RunOptions) -> Result<RlSummary> {
    run_rl_on(cfg, &RlTask::prepare(cfg, opts)?, dispatch, engines, opts)
}

/// What a run trains on, made before any model is loaded (so that the user's code and data
/// fail fast): the environments, with the user's Python code started and checked, and the
/// prompts, every row checked against its env.
pub struct RlTask {
    pub envs: EnvFactory,
    pub train: Vec<PromptRow>,
    pub eval: Vec<PromptRow>,
}

impl RlTask {
    /// The config's environments and prompts.
    pub fn prepare(cfg: &RlConfig, opts: &RunOptions) -> Result<RlTask> {
        let envs = EnvFactory::start(cfg.env.env_config(), &cfg.reward, &cfg.env.python_modules)?;
        RlTask::with_envs(cfg, envs, opts)
    }

    /// The config's prompts for the environments of `envs` (e.g. with a library user's Rust envs
    /// registered).
    pub fn with_envs(cfg: &RlConfig, envs: EnvFactory, opts: &RunOptions) -> Result<RlTask> {
        check_resumable(&cfg.output.run_dir, opts)?; // before the prompts are read
        let (train, eval) = load_rl_prompts(cfg, &envs)?;
        if train.is_empty() {
            return Err(Error::input("the RL training set is empty"));
        }
        eprintln!("rl ({}): {} training prompts, {} eval prompts", cfg.mode, train.len(), eval.len());
        Ok(RlTask { envs, train, eval })
    }
}

/// [`run_rl`] on a prepared task.
pub fn run_rl_on(
    cfg: &RlConfig,
    task: &RlTask,
    dispatch: &Dispatch,
    engines: &EngineClient,
    opts: &RunOptions,
) -> Result<RlSummary> {
    check_resumable(&cfg.output.run_dir, opts)?;
    let tok = Tokenizer::from_dir(&cfg.model.path)?;
    let (envs, train, eval) = (&task.envs, &task.train, &task.eval);
    let world = world()?;
    let (run, resumed) = RlRun::open(cfg, envs, dispatch, world, engines, &tok, eval, opts)?;
    let sampler = GroupSampler {
        world,
        engines,
        tok: &tok,
        envs,
        params: cfg.sampling_params(false),
        n: cfg.rollout.n_samples,
        train_seed: cfg.train.seed,
    };
    // Async over several processes: process 0 generates (sharing no groups out), the others
    // train on what it hands them.
    let alone = GroupSampler { world: &Single, params: sampler.params.clone(), ..sampler };
    match cfg.mode {
        Mode::Sync => train_loop(run, SyncGroups::new(cfg, &sampler, train, resumed.as_ref())?),
        Mode::Async if world.size() == 1 => std::thread::scope(|scope| {
            let source = AsyncGroups::start(scope, cfg, &sampler, train, resumed.as_ref())?;
            train_loop(run, source)
        }),
        Mode::Async => std::thread::scope(|scope| {
            let source = match world.rank() {
                0 => Some(AsyncGroups::start(scope, cfg, &alone, train, resumed.as_ref())?),
                _ => None,
            };
            train_loop(run, BroadcastGroups::new(world, source, Some(cfg.async_rl.pause_mode())))
        }),
    }
}

/// The loop of the module docs over any source of groups.
fn train_loop(mut run: RlRun, mut source: impl GroupSource) -> Result<RlSummary> {
    let total = run.cfg.train.max_steps;
    let mut reward_mean = f64::NAN;
    let interrupted = loop {
        if run.step >= total {
            break false;
        }
        if run.should_stop()? {
            break true;
        }
        // The step's groups.
        let t0 = Instant::now();
        let mut rollouts = RolloutStats::default();
        let stop = || run.dir.should_stop(run.step);
        let before = source.position();
        let groups = match source.next_groups(run.step, &mut rollouts, &stop) {
            Ok(Some(groups)) => groups,
            Ok(None) => break true,
            // No engine left, or the user's code failed: keep what was trained, to resume once
            // an engine is up again or the code is fixed.
            Err(e @ (Error::EngineDown(_) | Error::UserCode(_))) => {
                let step = run.step;
                drop(source);
                run.finish(true, reward_mean, before)?;
                return Err(match e {
                    Error::EngineDown(why) => Error::EngineDown(format!(
                        "{why}; checkpoint at step {step}: start an engine and resume with --resume"
                    )),
                    Error::UserCode(why) => Error::UserCode(format!(
                        "{why}\ncheckpoint at step {step}: fix the code and resume with --resume"
                    )),
                    other => other,
                });
            }
            Err(e) => return Err(e),
        };
        let time_generate = t0.elapsed().as_secs_f64();
        reward_mean = rollouts.reward_mean();

        // Train on them, then send the new weights to the engines.
        let episodes = step_episodes(&groups);
        let trained = run.train_step(&episodes)?;
        let (time_sync, version) = if episodes.is_empty() {
            (0.0, None)
        } else {
            run.push_weights(source.pause_mode()).map(|(t, v)| (t, Some(v)))?
        };
        let this_step = run.step as u64 + 1;
        source.trained(&groups, this_step);

        // Metrics, evaluation, checkpoint.
        let elapsed = time_generate + trained.time_reference + trained.time_train + time_sync;
        // Engines that fell (their requests went to the others) or rejoined during the step.
        let engine_events = run.engines.take_events();
        for e in &engine_events {
            run.dir.progress().println(format!("step {this_step}: {e}"));
        }
        let line = RlStepMetrics {
            time_generate_s: time_generate,
            time_sync_s: time_sync,
            samples_per_s: rollouts.generated as f64 / elapsed.max(1e-9),
            weight_version: version,
            source: source.describe(&groups, this_step),
            engine_events,
            ..Default::default()
        };
        run.end_step(line, &rollouts, &trained, || source.position())?;
        if run.dir.finish_now(run.step, run.dispatch)? {
            run.dir.progress().println(format!("finished early at step {}", run.step));
            break false;
        }
    };
    let position = source.position();
    drop(source); // async: the generation workers stop
    run.finish(interrupted, reward_mean, position)
}
