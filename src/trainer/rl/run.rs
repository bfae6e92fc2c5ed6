//! One RL run in progress: what the RL loop (`rl.rs`) calls around the source of its groups.
//!
//! ```text
//! open:   the run directory (new, or resumed: worker states, KL coefficient, evaluations),
//!         the restored weights pushed to the engines
//! train:  old = policy.forward(episodes); ref, values if needed          # the step's anchor
//!         advantages, KL, corrections                                    (step.rs)
//!         for epoch: for mini-batch (whole groups): forward_backward + optim_step (policy, critic)
//! push:   engines.update_weights(policy.sampler_weights())                # version = optimizer steps
//! end:    metrics line, eval every eval_every, checkpoint every checkpoint_every
//! ```
//! The config was built once into an [`RlPlan`]; a step only sets the adaptive KL coefficient.

use std::path::PathBuf;
use std::time::Instant;

use super::step_metrics::RlStepMetrics;

use super::config::RlConfig;
use super::episodes::Episode;
use super::eval::evaluate;
use super::plan::RlPlan;
use super::rollout_stats::RolloutStats;
use super::state::{DataPosition, RlState};
use super::step::{critic_datums, minibatches, policy_datums, prepare, StepRecipe};
use crate::algo::{KlController, Metrics};
use crate::dispatch::Dispatch;
use crate::env::EnvFactory;
use crate::env::PromptRow;
use crate::model::tokenizer::Tokenizer;
use crate::rollout::{EngineClient, PauseMode};
use crate::trainer::model_ids::{CRITIC, POLICY, REFERENCE};
use crate::trainer::plot::{plot_rl_run, PlotConfig};
use crate::trainer::run_dir::{RunDir, RunOptions, TrainerState};
use crate::worker::{AdamParams, Datum, LrSchedule};
use crate::world::World;
use crate::Result;

/// What a run did.
#[derive(Clone, Debug)]
pub struct RlSummary {
    /// Steps done in total (including those before a resume).
    pub steps: usize,
    pub total_steps: usize,
    /// Mean reward of the last step's episodes.
    pub reward_mean: f64,
    /// (step, pass@1, pass@n) of every evaluation.
    pub evals: Vec<(usize, f64, f64)>,
    pub interrupted: bool,
    pub run_dir: PathBuf,
    pub export_dir: Option<PathBuf>,
}

/// The training half of a step.
#[derive(Debug)]
pub struct Trained {
    pub metrics: Metrics,
    pub grad_norm: f64,
    pub lr: f64,
    pub episodes: usize,
    pub time_reference: f64,
    pub time_train: f64,
    /// max |sampler log-prob − trainer log-prob| over the step's sampled tokens, the trainer's
    /// taken before the step's update (NaN without episodes). Sync RL samples and trains on the
    /// same weights, so any difference is numerics (batch invariance makes it 0).
    pub logprob_mismatch_max: f64,
    /// Sampled tokens whose experts differ between the sampler's forward and the trainer's
    /// (None for a model without experts); 0 where routing is batch invariant.
    pub router_mismatch: Option<u64>,
}

fn plot_rl(run_dir: &std::path::Path) -> Result<()> {
    plot_rl_run(run_dir, &PlotConfig::default()).map(|_| ())
}

/// One RL run in progress.
pub struct RlRun<'a> {
    pub cfg: &'a RlConfig,
    /// The environments (evaluation runs its prompts through them).
    pub envs: &'a EnvFactory,
    pub dispatch: &'a Dispatch,
    /// The run's processes: evaluation shares its prompts among them.
    pub world: &'a dyn World,
    pub engines: &'a EngineClient,
    pub tok: &'a Tokenizer,
    pub eval: &'a [PromptRow],
    pub dir: RunDir,
    /// Steps done.
    pub step: usize,
    pub evals: Vec<(usize, f64, f64)>,
    plan: RlPlan,
    schedule: LrSchedule,
}

impl<'a> RlRun<'a> {
    /// Opens the run directory (or resumes it: worker states, step, KL coefficient and
    /// evaluations restored, the restored weights pushed to the engines). Returns the resumed
    /// trainer state, whose data position the source of groups takes up.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        cfg: &'a RlConfig,
        envs: &'a EnvFactory,
        dispatch: &'a Dispatch,
        world: &'a dyn World,
        engines: &'a EngineClient,
        tok: &'a Tokenizer,
        eval: &'a [PromptRow],
        opts: &RunOptions,
    ) -> Result<(RlRun<'a>, Option<TrainerState<RlState>>)> {
        let mut models = vec![POLICY];
        if cfg.needs_critic() {
            models.push(CRITIC);
        }
        let total = cfg.train.max_steps;
        let (dir, resumed): (RunDir, Option<TrainerState<RlState>>) = RunDir::open(
            &cfg.output.run_dir,
            || crate::trainer::config_file::absolutize(cfg)?.to_toml(),
            models,
            plot_rl,
            total,
            dispatch,
            opts,
        )?;
        let mut run = RlRun {
            cfg,
            envs,
            dispatch,
            world,
            engines,
            tok,
            eval,
            dir,
            step: 0,
            evals: vec![],
            plan: cfg.plan()?,
            schedule: cfg.schedule.schedule(total),
        };
        if let Some(state) = &resumed {
            run.step = state.step;
            run.evals = state.trainer.evals.iter().map(|(s, v)| (*s, value(v, 0), value(v, 1))).collect();
            if let KlController::Adaptive(a) = &mut run.plan.kl {
                a.coef = state.trainer.kl_coef;
            }
            engines.update_weights(&dispatch.sampler_weights(POLICY)?).wait()?;
        }
        Ok((run, resumed))
    }

    /// Whether to stop before the next step (Ctrl-C, `stop_after`), agreed by every process: one
    /// that stopped alone would leave the others waiting for it.
    pub fn should_stop(&self) -> Result<bool> {
        let mine = self.dir.should_stop(self.step);
        if self.world.size() == 1 {
            return Ok(mine);
        }
        Ok(self.world.all_gather(&[mine as u8])?.iter().any(|b| b[..] == [1]))
    }

    /// The checkpoint's trainer state after `self.step`, at data position `data`.
    pub fn state(&self, data: DataPosition) -> TrainerState<RlState> {
        TrainerState {
            step: self.step,
            trainer: RlState {
                data,
                kl_coef: self.plan.kl.coef(),
                evals: self.evals.iter().map(|&(s, p1, pn)| (s, vec![p1, pn])).collect(),
            },
        }
    }

    /// The training half of the step after `self.step`: forward passes, advantages, then
    /// `update_epochs` × mini-batches of forward_backward + optim_step. `episodes` are whole
    /// groups, numbered 0, 1, … in order.
    pub fn train_step(&mut self, episodes: &[Episode]) -> Result<Trained> {
        let (cfg, dispatch) = (self.cfg, self.dispatch);
        let lr = self.schedule.lr_at(cfg.optimizer.lr, self.step);
        let mut out = Trained {
            metrics: Metrics::new(),
            grad_norm: f64::NAN,
            lr,
            episodes: 0,
            time_reference: 0.0,
            time_train: 0.0,
            logprob_mismatch_max: f64::NAN,
            router_mismatch: None,
        };
        if episodes.is_empty() {
            return Ok(out);
        }
        out.episodes = episodes.len();
        // Forward passes: the step's anchor, the reference, the critic.
        let t1 = Instant::now();
        let plain: Vec<Datum> = episodes
            .iter()
            .map(|e| {
                Datum::supervised(
                    e.sequence.input_tokens.clone(),
                    e.sequence.target_tokens.clone(),
                    e.sequence.mask.clone(),
                )
            })
            .collect();
        let scored = dispatch.forward(POLICY, &plain, None, true)?;
        out.router_mismatch = scored.metrics.value("router_mismatch:sum").map(|n| n as u64);
        let old: Vec<Vec<f32>> = scored.loss_fn_outputs.into_iter().map(|o| o.logprobs).collect();
        out.logprob_mismatch_max = logprob_mismatch_max(episodes, &old);
        let reference =
            if cfg.needs_reference() { Some(forward_rows(dispatch, REFERENCE, &plain, false)?) } else { None };
        let values = if cfg.needs_critic() { Some(forward_rows(dispatch, CRITIC, &plain, true)?) } else { None };
        out.time_reference = t1.elapsed().as_secs_f64();
        // The KL coefficient of this step (adaptive: the controller's current one).
        let kl_coef = self.plan.kl.coef();
        let recipe = StepRecipe { kl_coef, ..self.plan.recipe.clone() };
        let loss = self.plan.loss.with_kl_coef(kl_coef);
        let prep = prepare(&recipe, episodes, old, reference, values)?;
        out.metrics.merge(&prep.metrics);

        // Train: epochs × mini-batches of whole groups.
        let t2 = Instant::now();
        let adam = cfg.optimizer.adam_params(lr);
        let critic_adam = AdamParams { learning_rate: cfg.critic.lr, ..adam };
        for _ in 0..cfg.train.update_epochs {
            for members in minibatches(episodes, cfg.train.mini_batches) {
                let datums = policy_datums(&recipe, episodes, &prep, &members)?;
                let (fb, grad_norm) = dispatch.forward_backward_step(POLICY, &datums, &loss, false, &adam)?;
                out.metrics.merge(&fb.metrics);
                out.grad_norm = grad_norm;
                if let Some(value_loss) = &self.plan.value_loss {
                    let datums = critic_datums(&recipe, episodes, &prep, &members)?;
                    dispatch.forward_backward_step(CRITIC, &datums, value_loss, false, &critic_adam)?;
                }
            }
        }
        out.time_train = t2.elapsed().as_secs_f64();
        if let Some(kl_value) = prep.metrics.value("kl:mean") {
            self.plan.kl.update(kl_value, episodes.len());
        }
        Ok(out)
    }

    /// Sends the policy's weights to the engines: directly (`None`, engines idle), or in flight
    /// under a pause of that mode. Returns (seconds, the new weight version).
    pub fn push_weights(&self, pause: Option<PauseMode>) -> Result<(f64, u64)> {
        let t = Instant::now();
        let weights = self.dispatch.sampler_weights(POLICY)?;
        match pause {
            None => self.engines.update_weights(&weights).wait()?,
            Some(mode) => {
                self.engines.pause(mode).wait()?;
                let updated = self.engines.update_weights(&weights).wait();
                self.engines.resume().wait()?;
                updated?;
            }
        }
        Ok((t.elapsed().as_secs_f64(), weights.version()))
    }

    /// Ends the step after `self.step`: counts it, writes its metrics line (the loop's and the
    /// source's keys in `line`), evaluates and checkpoints when due; `data` is the source's
    /// position for the checkpoint.
    pub fn end_step(
        &mut self,
        mut line: RlStepMetrics,
        rollouts: &RolloutStats,
        trained: &Trained,
        data: impl FnOnce() -> DataPosition,
    ) -> Result<()> {
        let t = &self.cfg.train;
        self.step += 1;
        let step = self.step;
        let reduced = trained.metrics.reduce();
        let metric = |name: &str| reduced.get(name).copied().unwrap_or(f64::NAN);
        line.step = step;
        line.rollouts = rollouts.metrics();
        line.kl_mean = metric("kl:mean");
        line.kl_coef = self.plan.kl.coef();
        line.clip_fraction = metric("clip_fraction:mean");
        line.loss = metric("loss:sum");
        line.grad_norm = trained.grad_norm;
        line.lr = trained.lr;
        line.episodes_trained = trained.episodes;
        line.time_reference_s = trained.time_reference;
        line.time_train_s = trained.time_train;
        line.logprob_mismatch_max = trained.logprob_mismatch_max;
        line.router_mismatch = trained.router_mismatch;
        let eval_now =
            !self.eval.is_empty() && ((t.eval_every > 0 && step.is_multiple_of(t.eval_every)) || step == t.max_steps);
        if eval_now {
            let (p1, pn) =
                evaluate(self.cfg, self.envs, self.world, self.engines, self.tok, self.eval, t.seed ^ 0xE7A1)?;
            (line.eval_pass_at_1, line.eval_pass_at_n) = (Some(p1), Some(pn));
            self.evals.push((step, p1, pn));
            self.dir.progress().println(format!(
                "step {step}: reward {:.3}, eval pass@1 {p1:.3}, pass@{} {pn:.3}",
                rollouts.reward_mean(),
                self.cfg.rollout.eval_samples
            ));
        }
        line.peak_rss_gb = crate::memory::peak_rss_gb();
        line.peak_device_gb = crate::memory::device_peak_gb();
        self.dir.write_metrics(&line)?;
        self.dir.progress().set_position(step as u64);
        self.dir.progress().set_message(format!("reward {:.3} kl {:.4}", rollouts.reward_mean(), metric("kl:mean")));
        if eval_now {
            self.dir.plot()?;
        }
        let every = t.checkpoint_every;
        if every > 0 && step.is_multiple_of(every) && step < t.max_steps {
            self.dir.save_checkpoint(self.dispatch, &self.state(data()))?;
        }
        Ok(())
    }

    /// Ends the run: a last checkpoint, the plots, the exported policy (unless interrupted).
    pub fn finish(self, interrupted: bool, reward_mean: f64, data: DataPosition) -> Result<RlSummary> {
        let state = self.state(data);
        let (cfg, run_dir) = (self.cfg, self.dir.root().to_path_buf());
        let total = cfg.train.max_steps;
        let export_dir = self.dir.finish(self.dispatch, &state, total, interrupted, &cfg.model)?;
        Ok(RlSummary {
            steps: self.step,
            total_steps: total,
            reward_mean,
            evals: self.evals,
            interrupted,
            run_dir,
            export_dir,
        })
    }
}

/// `values[i]`, NaN when absent (an evaluation record of another shape).
fn value(values: &[f64], i: usize) -> f64 {
    values.get(i).copied().unwrap_or(f64::NAN)
}

/// max |sampler − trainer| log-prob over the sampled (mask ≠ 0) tokens of `episodes`, whose
/// trainer log-probs are `trainer` (one row per episode, per target position).
fn logprob_mismatch_max(episodes: &[Episode], trainer: &[Vec<f32>]) -> f64 {
    let mut max = 0f64;
    for (e, row) in episodes.iter().zip(trainer) {
        let s = &e.sequence;
        for ((&m, &q), &lp) in s.mask.iter().zip(&s.logprobs).zip(row) {
            if m != 0.0 {
                max = max.max((q as f64 - lp as f64).abs());
            }
        }
    }
    max
}

/// Per-position rows of a forward pass (log-probs, or values for a critic).
fn forward_rows(dispatch: &Dispatch, id: &str, datums: &[Datum], critic: bool) -> Result<Vec<Vec<f32>>> {
    let out = dispatch.forward(id, datums, None, true)?;
    Ok(out.loss_fn_outputs.into_iter().map(|o| if critic { o.values } else { o.logprobs }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::TrainingSequence;

    /// Only sampled tokens (mask ≠ 0) count, and the largest absolute difference wins.
    #[test]
    fn the_mismatch_is_the_largest_over_sampled_tokens() {
        let episode = |logprobs: Vec<f32>, mask: Vec<f32>| Episode {
            group: 0,
            uid: String::new(),
            sequence: TrainingSequence {
                input_tokens: vec![0; mask.len()],
                target_tokens: vec![0; mask.len()],
                mask,
                logprobs,
                turn: vec![],
            },
            reward: 0.0,
            correct: false,
            truncated: false,
            turns: 1,
            response_tokens: 0,
            min_version: 0,
            versions: vec![],
            data_source: None,
            reward_metrics: Default::default(),
            user_error: false,
        };
        let episodes = [episode(vec![0.0, -1.0, -2.0], vec![0.0, 1.0, 1.0]), episode(vec![-0.5], vec![1.0])];
        let trainer = [vec![-9.0, -1.25, -2.0], vec![-0.375]];
        assert_eq!(logprob_mismatch_max(&episodes, &trainer), 0.25);
        assert_eq!(logprob_mismatch_max(&episodes[..1], &[vec![-9.0, -1.0, -2.0]]), 0.0);
    }
}
