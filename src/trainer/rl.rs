//! The synchronous RL loop (GRPO, PPO and relatives).
//!
//! ```text
//! for step in start..max_steps:
//!     prompts  = loader.next_batch(prompts_per_step)               # seeded shuffle, resumable
//!     episodes = n samples per prompt on the engines, envs give rewards     (rollouts.rs)
//!     drop / replace groups without signal (zero_variance_filter, dynamic_sampling)
//!     old      = policy.forward(episodes)          # the policy the step starts from
//!     ref      = ref.forward(episodes)             # if a KL coefficient is set
//!     values   = critic.forward(episodes)          # if the estimator is gae
//!     advantages, corrections, KL in reward                             (rl_step.rs)
//!     for epoch in update_epochs: for each mini-batch (whole groups):
//!         policy.forward_backward(datums, loss); policy.optim_step(lr = schedule(step))
//!         critic.forward_backward(value datums, value loss); critic.optim_step(critic lr)
//!     engines.update_weights(policy.sampler_weights())   # versioned: version = optimizer steps
//!     every eval_every: pass@1 and pass@n on the held-out prompts
//!     every checkpoint_every: worker states + loader position + KL controller
//! ```
//! Sampling seeds derive from `train.seed`, the step and the prompt's place in it
//! ([`group_seed`]), so a resumed run reproduces an uninterrupted one: it restores parameters,
//! optimizer moments, the loader position and the KL coefficient, and pushes the restored
//! weights to the engines before its first step. Interruption (Ctrl-C, `stop_after`) is checked
//! between steps and always leaves a checkpoint. `mode = "async"` runs [`super::rl_async`].
//!
//! The trainer knows models only by id (`policy`, `ref`, `critic`) on a ready [`Dispatch`] and
//! engines through an [`EngineClient`]: it never names a device or a data-parallel size.

use std::time::Instant;

use serde_json::{json, Map};

use super::data_loader::DataLoader;
use super::rl_run::{group_seed, keep_group, RlRun, RolloutStats, TrainerState};
use super::rollouts::{generate_groups, Episode};
use super::sft::RunOptions;
use crate::dispatch::Dispatch;
use crate::rollout::EngineClient;
use crate::{Error, Result};

use super::rl_config::RlConfig;
pub use super::rl_run::{evaluate, load_rl_prompts, pass_rates, RlSummary, EXPORT_DIR};

/// Renumbers the groups of `episodes` 0, 1, … in order (after filtering).
pub(super) fn renumber(episodes: &mut [Episode]) {
    let mut next = 0;
    let mut last = None;
    for e in episodes.iter_mut() {
        if last != Some(e.group) {
            last = Some(e.group);
            next += 1;
        }
        e.group = next - 1;
    }
}

/// Runs (or resumes) RL as `cfg` says, on the models of `dispatch` (`policy`, and `ref` /
/// `critic` when the config needs them) and the sampling engines of `engines`, which must hold
/// the policy's initial weights.
pub fn run_rl(cfg: &RlConfig, dispatch: &Dispatch, engines: &EngineClient, opts: &RunOptions) -> Result<RlSummary> {
    if cfg.mode == "async" {
        return super::rl_async::run_rl_async(cfg, dispatch, engines, opts);
    }
    let mut run = RlRun::open(cfg, dispatch, engines, opts)?;
    let t = &cfg.train;
    let mut loader = DataLoader::new(run.train.clone(), t.prompts_per_step, cfg.data.shuffle_seed, true);
    if let Some(state) = &run.resumed {
        loader.set_position(state.loader)?;
    }
    let (env_config, params) = (cfg.env.env_config(), cfg.sampling_params(false));
    let n = cfg.rollout.n_samples;
    let mut reward_mean = f64::NAN;
    let state = |run: &RlRun, loader: &DataLoader<_>| TrainerState {
        step: run.step,
        loader: loader.position(),
        kl_coef: run.kl.coef(),
        evals: run.evals.clone(),
        ..Default::default()
    };

    let interrupted = loop {
        if let (true, interrupted) = run.should_stop() {
            break interrupted;
        }
        // Generate: n episodes per prompt; groups without signal dropped or replaced.
        let t0 = Instant::now();
        let mut episodes: Vec<Episode> = vec![];
        let mut rollouts = RolloutStats::default();
        let rounds =
            if cfg.algorithm.dynamic_sampling == "replace" { cfg.algorithm.max_sampling_rounds.max(1) } else { 1 };
        for round in 0..rounds {
            let batch = loader.next_batch().ok_or_else(|| Error::input("the training set is empty"))?;
            let seeds: Vec<u64> = (0..batch.items.len()).map(|i| group_seed(t.seed, run.step, round, i)).collect();
            let fresh = generate_groups(engines, &run.tok, &batch.items, &seeds, &env_config, &params, n)?;
            for group in fresh.chunks(n) {
                rollouts.add(group);
                if keep_group(cfg, group) && episodes.len() / n < t.prompts_per_step {
                    let offset = episodes.last().map_or(0, |e| e.group + 1);
                    episodes.extend(group.iter().cloned().map(|e| Episode { group: offset, ..e }));
                }
            }
            if episodes.len() / n >= t.prompts_per_step {
                break;
            }
        }
        renumber(&mut episodes);
        let time_generate = t0.elapsed().as_secs_f64();
        reward_mean = rollouts.reward_mean();

        let trained = run.train_step(&episodes)?;
        // Sync: the engines sample the next step with the new weights.
        let time_sync = if episodes.is_empty() { 0.0 } else { run.push_weights(None)?.0 };
        let elapsed = time_generate + trained.time_reference + trained.time_train + time_sync;
        let mut line = Map::new();
        line.insert("time_generate_s".into(), json!(time_generate));
        line.insert("time_sync_s".into(), json!(time_sync));
        line.insert("samples_per_s".into(), json!(rollouts.generated as f64 / elapsed.max(1e-9)));
        run.end_step(line, &rollouts, &trained, |run| state(run, &loader))?;
    };
    let last = state(&run, &loader);
    run.finish(interrupted, reward_mean, last)
}
