//! What the synchronous and the fully asynchronous RL trainers share: a run's set-up and
//! resume, the training half of a step, pushing weights to the engines, the step's metrics line,
//! evaluation, checkpoints and the end of the run.
//!
//! ```text
//! open:   prompts, run dir, config.toml; on resume: worker states, trainer state, weights → engines
//! train:  old = policy.forward(episodes); ref, values if needed          # the step's anchor
//!         advantages, KL, corrections                                    (rl_step.rs)
//!         for epoch: for mini-batch (whole groups): forward_backward + optim_step (policy, critic)
//! push:   engines.update_weights(policy.sampler_weights())                # version = optimizer steps
//! end:    metrics line, eval every eval_every, checkpoint every checkpoint_every
//! ```
//! The trainers differ only in where a step's episodes come from and when weights are pushed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::data_loader::LoaderPosition;
use super::metrics::MetricsWriter;
use super::prompt_stream::StreamState;
use super::rl_config::RlConfig;
use super::rl_ids::{CRITIC, POLICY, REFERENCE};
use super::rl_step::{critic_datums, minibatches, policy_datums, prepare, StepRecipe};
use super::rollouts::{generate_episodes, Episode};
use super::sft::{checkpoint_dir, export_model, latest_checkpoint, progress_bar, RunOptions, TRAINER_STATE};
use super::staleness::Staleness;
use crate::algo::{KlController, Loss, Metrics};
use crate::dispatch::Dispatch;
use crate::env::{generate_arithmetic, load_prompts, sample_arithmetic, PromptOptions, PromptRow};
use crate::files::{read_json, write_dir_atomically, write_json};
use crate::model::tokenizer::Tokenizer;
use crate::rollout::{EngineClient, PauseMode};
use crate::worker::{AdamParams, Datum, LrSchedule};
use crate::{Error, Result};

/// Where the trained policy is exported at the end of a run.
pub const EXPORT_DIR: &str = "final";

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

/// What a checkpoint holds besides the worker states.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: usize,
    /// The synchronous trainer's prompt loader.
    pub loader: LoaderPosition,
    pub kl_coef: f64,
    pub evals: Vec<(usize, f64, f64)>,
    /// The asynchronous trainer's prompts: consumed, filtered and in-flight groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamState>,
    /// The asynchronous trainer's staleness counters when the checkpoint was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness: Option<Staleness>,
}

/// Accuracy of a set of episodes, `n` per prompt: pass@1 = mean correctness, pass@n = share of
/// prompts with at least one correct episode.
pub fn pass_rates(episodes: &[Episode]) -> (f64, f64) {
    if episodes.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let pass1 = episodes.iter().filter(|e| e.correct).count() as f64 / episodes.len() as f64;
    let mut groups: Vec<(usize, bool)> = vec![];
    for e in episodes {
        match groups.iter_mut().find(|(g, _)| *g == e.group) {
            Some((_, any)) => *any |= e.correct,
            None => groups.push((e.group, e.correct)),
        }
    }
    let passn = groups.iter().filter(|(_, any)| *any).count() as f64 / groups.len() as f64;
    (pass1, passn)
}

/// The train and eval prompts of a run.
pub fn load_rl_prompts(cfg: &RlConfig) -> Result<(Vec<PromptRow>, Vec<PromptRow>)> {
    let d = &cfg.data;
    let options =
        PromptOptions { default_env: Some(d.env.clone()), on_bad_row: d.on_bad_row, config: cfg.env.env_config() };
    if d.is_synthetic() {
        let generate = if d.synthetic_eval_disjoint { generate_arithmetic } else { sample_arithmetic };
        return generate(&d.arithmetic_spec(), d.synthetic_train, d.synthetic_eval, d.shuffle_seed);
    }
    let train = load_prompts(&d.train_file, &options)?.rows;
    if !d.eval_file.as_os_str().is_empty() {
        return Ok((train, load_prompts(&d.eval_file, &options)?.rows));
    }
    let held = ((train.len() as f64) * d.eval_fraction).round() as usize;
    let order = super::data_loader::permutation(train.len(), d.shuffle_seed);
    let (mut kept, mut eval) = (vec![], vec![]);
    for (k, &i) in order.iter().enumerate() {
        if k < held {
            eval.push(train[i].clone())
        } else {
            kept.push(train[i].clone())
        }
    }
    Ok((kept, eval))
}

/// Whether a group has signal: not all rewards equal (`zero_variance_filter`), not all
/// episodes correct or all wrong (`dynamic_sampling`).
pub fn keep_group(cfg: &RlConfig, group: &[Episode]) -> bool {
    let same_reward = group.windows(2).all(|w| w[0].reward == w[1].reward);
    let same_verdict = group.windows(2).all(|w| w[0].correct == w[1].correct);
    let drop_for_reward = cfg.algorithm.zero_variance_filter && same_reward;
    let drop_for_verdict = cfg.algorithm.dynamic_sampling != "none" && same_verdict;
    !drop_for_reward && !drop_for_verdict
}

/// The sampling seed of a step's prompt `index` (`step` counted from 0, `round` of dynamic
/// sampling): the same for both trainers, so that they sample the same episodes.
pub fn group_seed(train_seed: u64, step: usize, round: usize, index: usize) -> u64 {
    let step_seed = train_seed.wrapping_mul(1_000_003).wrapping_add(step as u64);
    super::rollouts::prompt_seed(step_seed.wrapping_mul(31).wrapping_add(round as u64), index)
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut n) = (0.0, 0.0);
    for x in xs {
        s += x;
        n += 1.0;
    }
    if n > 0.0 {
        s / n
    } else {
        f64::NAN
    }
}

/// Evaluates the policy on the engines: (pass@1, pass@n).
pub fn evaluate(
    cfg: &RlConfig,
    engines: &EngineClient,
    tok: &Tokenizer,
    prompts: &[PromptRow],
    seed: u64,
) -> Result<(f64, f64)> {
    let episodes = generate_episodes(
        engines,
        tok,
        prompts,
        &cfg.env.env_config(),
        &cfg.sampling_params(true),
        cfg.rollout.eval_samples,
        seed,
    )?;
    Ok(pass_rates(&episodes))
}

/// Everything generated in a step (trained or filtered): rewards, lengths, entropy.
#[derive(Clone, Debug, Default)]
pub struct RolloutStats {
    pub generated: usize,
    rewards: Vec<f64>,
    lengths: Vec<f64>,
    correct: Vec<f64>,
    /// Σ −log p(sampled token), tokens.
    entropy: (f64, f64),
}

impl RolloutStats {
    pub fn add(&mut self, episodes: &[Episode]) {
        self.generated += episodes.len();
        for e in episodes {
            self.rewards.push(e.reward);
            self.lengths.push(e.response_tokens as f64);
            self.correct.push(e.correct as u8 as f64);
            for (&lp, &m) in e.sequence.logprobs.iter().zip(&e.sequence.mask) {
                if m != 0.0 {
                    self.entropy.0 -= lp as f64;
                    self.entropy.1 += 1.0;
                }
            }
        }
    }

    pub fn reward_mean(&self) -> f64 {
        mean(self.rewards.iter().copied())
    }

    fn write(&self, line: &mut Map<String, Value>) {
        line.insert("reward_mean".into(), json!(self.reward_mean()));
        line.insert("correct_mean".into(), json!(mean(self.correct.iter().copied())));
        line.insert("response_length_mean".into(), json!(mean(self.lengths.iter().copied())));
        let entropy = if self.entropy.1 > 0.0 { self.entropy.0 / self.entropy.1 } else { f64::NAN };
        line.insert("entropy_mean".into(), json!(entropy));
        line.insert("episodes_generated".into(), json!(self.generated));
    }
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
}

/// One RL run in progress: what both trainers' loops use.
pub struct RlRun<'a> {
    pub cfg: &'a RlConfig,
    pub dispatch: &'a Dispatch,
    pub engines: &'a EngineClient,
    pub opts: &'a RunOptions,
    pub tok: Tokenizer,
    pub train: Vec<PromptRow>,
    pub eval: Vec<PromptRow>,
    /// Steps done.
    pub step: usize,
    pub evals: Vec<(usize, f64, f64)>,
    pub kl: KlController,
    /// The checkpoint a resume started from.
    pub resumed: Option<TrainerState>,
    pub pb: indicatif::ProgressBar,
    recipe: StepRecipe,
    value_loss: Loss,
    schedule: LrSchedule,
    metrics: MetricsWriter,
}

impl<'a> RlRun<'a> {
    /// Sets a run up (or resumes it: worker states and trainer state restored, the restored
    /// weights pushed to the engines).
    pub fn open(
        cfg: &'a RlConfig,
        dispatch: &'a Dispatch,
        engines: &'a EngineClient,
        opts: &'a RunOptions,
    ) -> Result<RlRun<'a>> {
        let run_dir = &cfg.output.run_dir;
        let existing = latest_checkpoint(run_dir)?;
        if existing.is_some() && !opts.resume {
            return Err(Error::input(format!(
                "{} already holds checkpoints: pass --resume to continue that run, or set output.run_dir to a new directory",
                run_dir.display()
            )));
        }
        let tok = Tokenizer::from_dir(&cfg.model.path)?;
        let (train, eval) = load_rl_prompts(cfg)?;
        if train.is_empty() {
            return Err(Error::input("the RL training set is empty"));
        }
        eprintln!("rl ({}): {} training prompts, {} eval prompts", cfg.mode, train.len(), eval.len());
        std::fs::create_dir_all(run_dir).map_err(|e| Error::file(run_dir, format!("cannot create: {e}")))?;
        std::fs::write(run_dir.join("config.toml"), cfg.to_toml()?).map_err(|e| Error::file(run_dir, e))?;
        let recipe = StepRecipe {
            advantage: cfg.advantage()?,
            reduction: cfg.reduction()?,
            kl_coef: cfg.algorithm.kl.coef,
            kl_estimator: cfg.kl_estimator()?,
            kl_in_reward: cfg.algorithm.kl.in_reward,
            off_policy: cfg.off_policy()?,
        };
        let mut kl = cfg.kl_controller()?;
        let (mut step, mut evals, mut resumed) = (0, vec![], None);
        if let (true, Some((_, dir))) = (opts.resume, &existing) {
            let state = load_checkpoint(dispatch, cfg, dir)?;
            step = state.step;
            evals = state.evals.clone();
            if let KlController::Adaptive(a) = &mut kl {
                a.coef = state.kl_coef;
            }
            engines.update_weights(&dispatch.sampler_weights(POLICY)?).wait()?;
            eprintln!("resumed from {} (step {step})", dir.display());
            resumed = Some(state);
        }
        let metrics = if step > 0 { MetricsWriter::resume(run_dir, step)? } else { MetricsWriter::create(run_dir)? };
        Ok(RlRun {
            cfg,
            dispatch,
            engines,
            opts,
            tok,
            train,
            eval,
            step,
            evals,
            kl,
            resumed,
            pb: progress_bar(cfg.train.max_steps, step, opts.progress),
            recipe,
            value_loss: cfg.value_loss()?,
            schedule: cfg.schedule.schedule(cfg.train.max_steps),
            metrics,
        })
    }

    /// Whether the loop should stop before the next step (done, Ctrl-C, `stop_after`).
    pub fn should_stop(&self) -> (bool, bool) {
        let o = self.opts;
        let interrupted = o.interrupt.as_ref().is_some_and(|f| f.load(std::sync::atomic::Ordering::SeqCst))
            || o.stop_after.is_some_and(|k| self.step >= k);
        (self.step >= self.cfg.train.max_steps || interrupted, interrupted)
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
        let old = forward_rows(dispatch, POLICY, &plain, false)?;
        let reference =
            if cfg.needs_reference() { Some(forward_rows(dispatch, REFERENCE, &plain, false)?) } else { None };
        let values = if cfg.needs_critic() { Some(forward_rows(dispatch, CRITIC, &plain, true)?) } else { None };
        out.time_reference = t1.elapsed().as_secs_f64();
        // The KL coefficient of this step (adaptive: the controller's current one).
        let recipe = StepRecipe { kl_coef: self.kl.coef(), ..self.recipe.clone() };
        let loss = cfg.loss_with_kl_coef(self.kl.coef())?;
        let prep = prepare(&recipe, episodes, old, reference, values)?;
        out.metrics.merge(&prep.metrics);

        // Train: epochs × mini-batches of whole groups.
        let t2 = Instant::now();
        let adam = cfg.optimizer.adam_params(lr);
        let critic_adam = AdamParams { learning_rate: cfg.critic.lr, ..adam };
        for _ in 0..cfg.train.update_epochs {
            for members in minibatches(episodes, cfg.train.mini_batches) {
                let datums = policy_datums(&recipe, episodes, &prep, &members)?;
                let fb = dispatch.forward_backward(POLICY, &datums, Some(&loss), false)?;
                out.metrics.merge(&fb.metrics);
                out.grad_norm = dispatch.optim_step(POLICY, &adam)?;
                if cfg.needs_critic() {
                    let datums = critic_datums(&recipe, episodes, &prep, &members)?;
                    dispatch.forward_backward(CRITIC, &datums, Some(&self.value_loss), false)?;
                    dispatch.optim_step(CRITIC, &critic_adam)?;
                }
            }
        }
        out.time_train = t2.elapsed().as_secs_f64();
        if let Some(kl_value) = prep.metrics.value("kl:mean") {
            self.kl.update(kl_value, episodes.len());
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

    /// Ends the step after `self.step`: counts it, writes its metrics line (the trainer's own
    /// keys in `line`), evaluates and checkpoints when due. `state` gives the trainer's part of a
    /// checkpoint.
    pub fn end_step(
        &mut self,
        mut line: Map<String, Value>,
        rollouts: &RolloutStats,
        trained: &Trained,
        state: impl FnOnce(&Self) -> TrainerState,
    ) -> Result<()> {
        let t = &self.cfg.train;
        self.step += 1;
        let step = self.step;
        let reduced = trained.metrics.reduce();
        let metric = |name: &str| reduced.get(name).copied().unwrap_or(f64::NAN);
        line.insert("step".into(), json!(step));
        rollouts.write(&mut line);
        line.insert("kl_mean".into(), json!(metric("kl:mean")));
        line.insert("kl_coef".into(), json!(self.kl.coef()));
        line.insert("clip_fraction".into(), json!(metric("clip_fraction:mean")));
        line.insert("loss".into(), json!(metric("loss:sum")));
        line.insert("grad_norm".into(), json!(trained.grad_norm));
        line.insert("lr".into(), json!(trained.lr));
        line.insert("episodes_trained".into(), json!(trained.episodes));
        line.insert("time_reference_s".into(), json!(trained.time_reference));
        line.insert("time_train_s".into(), json!(trained.time_train));
        let eval_now =
            !self.eval.is_empty() && ((t.eval_every > 0 && step.is_multiple_of(t.eval_every)) || step == t.max_steps);
        if eval_now {
            let (p1, pn) = evaluate(self.cfg, self.engines, &self.tok, &self.eval, t.seed ^ 0xE7A1)?;
            line.insert("eval_pass_at_1".into(), json!(p1));
            line.insert("eval_pass_at_n".into(), json!(pn));
            self.evals.push((step, p1, pn));
            self.pb.println(format!(
                "step {step}: reward {:.3}, eval pass@1 {p1:.3}, pass@{} {pn:.3}",
                rollouts.reward_mean(),
                self.cfg.rollout.eval_samples
            ));
        }
        self.metrics.write_line(&Value::Object(line))?;
        self.pb.set_position(step as u64);
        self.pb.set_message(format!("reward {:.3} kl {:.4}", rollouts.reward_mean(), metric("kl:mean")));
        if eval_now {
            super::plot::plot_rl_run(&self.cfg.output.run_dir, &super::plot::PlotConfig::default())?;
        }
        if t.checkpoint_every > 0 && step.is_multiple_of(t.checkpoint_every) && step < t.max_steps {
            save_checkpoint(self.dispatch, self.cfg, &state(self))?;
        }
        Ok(())
    }

    /// Ends the run: a last checkpoint, the plots, the exported policy (unless interrupted).
    pub fn finish(self, interrupted: bool, reward_mean: f64, state: TrainerState) -> Result<RlSummary> {
        self.pb.finish_and_clear();
        let (cfg, run_dir) = (self.cfg, self.cfg.output.run_dir.clone());
        let ckpt = save_checkpoint(self.dispatch, cfg, &state)?;
        super::plot::plot_rl_run(&run_dir, &super::plot::PlotConfig::default())?;
        let total = cfg.train.max_steps;
        let export_dir = if interrupted {
            eprintln!(
                "interrupted at step {}/{total}: checkpoint in {} (continue with --resume)",
                self.step,
                ckpt.display()
            );
            None
        } else {
            let dir = run_dir.join(EXPORT_DIR);
            export_model(self.dispatch, POLICY, &cfg.model.path, cfg.model.lora.rank > 0, &dir)?;
            Some(dir)
        };
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

fn save_checkpoint(dispatch: &Dispatch, cfg: &RlConfig, state: &TrainerState) -> Result<PathBuf> {
    let dir = checkpoint_dir(&cfg.output.run_dir, state.step);
    write_dir_atomically(&dir, |tmp| {
        dispatch.save_state(POLICY, &tmp.join(POLICY))?;
        if cfg.needs_critic() {
            dispatch.save_state(CRITIC, &tmp.join(CRITIC))?;
        }
        let json = serde_json::to_value(state).map_err(|e| Error::Other(e.to_string()))?;
        write_json(&tmp.join(TRAINER_STATE), &json)
    })?;
    Ok(dir)
}

fn load_checkpoint(dispatch: &Dispatch, cfg: &RlConfig, dir: &Path) -> Result<TrainerState> {
    let path = dir.join(TRAINER_STATE);
    let state: TrainerState =
        serde_json::from_value(read_json(&path)?).map_err(|e| Error::file(&path, format!("invalid: {e}")))?;
    // The two trainers keep their prompts' place differently (a loader position, group ids).
    let made_by = if state.stream.is_some() { "async" } else { "sync" };
    if cfg.mode != made_by {
        return Err(Error::file(
            &path,
            format!("the checkpoint is a mode = \"{made_by}\" run's: resume it in that mode"),
        ));
    }
    dispatch.load_state(POLICY, &dir.join(POLICY))?;
    if cfg.needs_critic() {
        dispatch.load_state(CRITIC, &dir.join(CRITIC))?;
    }
    Ok(state)
}

/// Per-position rows of a forward pass (log-probs, or values for a critic).
fn forward_rows(dispatch: &Dispatch, id: &str, datums: &[Datum], critic: bool) -> Result<Vec<Vec<f32>>> {
    let out = dispatch.forward(id, datums, None, true)?;
    Ok(out.loss_fn_outputs.into_iter().map(|o| if critic { o.values } else { o.logprobs }).collect())
}
