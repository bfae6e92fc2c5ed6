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
//! Sampling seeds derive from `train.seed` and the step, and every request of a step is
//! submitted in the same order, so a resumed run reproduces an uninterrupted one: it restores
//! parameters, optimizer moments, the loader position and the KL coefficient, and pushes the
//! restored weights to the engines before its first step. Interruption (Ctrl-C, `stop_after`)
//! is checked between steps and always leaves a checkpoint.
//!
//! The trainer knows models only by id (`policy`, `ref`, `critic`) on a ready [`Dispatch`] and
//! engines through an [`EngineClient`]: it never names a device or a data-parallel size.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::data_loader::{DataLoader, LoaderPosition};
use super::metrics::MetricsWriter;
use super::rl_config::RlConfig;
use super::rl_ids::{CRITIC, POLICY, REFERENCE};
use super::rl_step::{critic_datums, minibatches, policy_datums, prepare, StepRecipe};
use super::rollouts::{generate_episodes, Episode};
use super::sft::{checkpoint_dir, export_model, latest_checkpoint, progress_bar, RunOptions, TRAINER_STATE};
use crate::algo::KlController;
use crate::dispatch::Dispatch;
use crate::env::{generate_arithmetic, load_prompts, sample_arithmetic, PromptOptions, PromptRow};
use crate::files::{read_json, write_dir_atomically, write_json};
use crate::model::tokenizer::Tokenizer;
use crate::rollout::EngineClient;
use crate::worker::{AdamParams, Datum};
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
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TrainerState {
    step: usize,
    loader: LoaderPosition,
    kl_coef: f64,
    evals: Vec<(usize, f64, f64)>,
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

fn save_checkpoint(dispatch: &Dispatch, cfg: &RlConfig, run_dir: &Path, state: &TrainerState) -> Result<PathBuf> {
    let dir = checkpoint_dir(run_dir, state.step);
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

fn load_checkpoint(
    dispatch: &Dispatch,
    cfg: &RlConfig,
    dir: &Path,
    loader: &DataLoader<PromptRow>,
) -> Result<TrainerState> {
    let path = dir.join(TRAINER_STATE);
    let state: TrainerState =
        serde_json::from_value(read_json(&path)?).map_err(|e| Error::file(&path, format!("invalid: {e}")))?;
    if state.loader.index > loader.len() {
        return Err(Error::file(
            &path,
            format!("loader position {:?} is past the {} prompts", state.loader, loader.len()),
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

/// The step's groups without signal dropped: all rewards equal (`zero_variance_filter`), or
/// all episodes correct / all wrong (`dynamic_sampling`).
fn keep_group(cfg: &RlConfig, group: &[&Episode]) -> bool {
    let same_reward = group.windows(2).all(|w| w[0].reward == w[1].reward);
    let same_verdict = group.windows(2).all(|w| w[0].correct == w[1].correct);
    let drop_for_reward = cfg.algorithm.zero_variance_filter && same_reward;
    let drop_for_verdict = cfg.algorithm.dynamic_sampling != "none" && same_verdict;
    !drop_for_reward && !drop_for_verdict
}

/// Renumbers the groups of `episodes` 0, 1, … in order (after filtering).
fn renumber(episodes: &mut [Episode]) {
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

/// Runs (or resumes) RL as `cfg` says, on the models of `dispatch` (`policy`, and `ref` /
/// `critic` when the config needs them) and the sampling engines of `engines`, which must hold
/// the policy's initial weights.
pub fn run_rl(cfg: &RlConfig, dispatch: &Dispatch, engines: &EngineClient, opts: &RunOptions) -> Result<RlSummary> {
    let run_dir = cfg.output.run_dir.clone();
    let existing = latest_checkpoint(&run_dir)?;
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
    eprintln!("rl: {} training prompts, {} eval prompts", train.len(), eval.len());
    std::fs::create_dir_all(&run_dir).map_err(|e| Error::file(&run_dir, format!("cannot create: {e}")))?;
    std::fs::write(run_dir.join("config.toml"), cfg.to_toml()?).map_err(|e| Error::file(&run_dir, e))?;

    let t = &cfg.train;
    let recipe = StepRecipe {
        advantage: cfg.advantage()?,
        reduction: cfg.reduction()?,
        kl_coef: cfg.algorithm.kl.coef,
        kl_estimator: cfg.kl_estimator()?,
        kl_in_reward: cfg.algorithm.kl.in_reward,
        off_policy: cfg.off_policy()?,
    };
    let value_loss = cfg.value_loss()?;
    let mut loader = DataLoader::new(train, t.prompts_per_step, cfg.data.shuffle_seed, true);
    let total = t.max_steps;
    let mut step = 0;
    let mut kl = cfg.kl_controller()?;
    let mut evals = vec![];
    if let (true, Some((_, dir))) = (opts.resume, &existing) {
        let state = load_checkpoint(dispatch, cfg, dir, &loader)?;
        loader.set_position(state.loader);
        step = state.step;
        evals = state.evals;
        if let KlController::Adaptive(a) = &mut kl {
            a.coef = state.kl_coef;
        }
        engines.update_weights(&dispatch.sampler_weights(POLICY)?).wait()?;
        eprintln!("resumed from {} (step {step})", dir.display());
    }
    let mut metrics = if step > 0 { MetricsWriter::resume(&run_dir, step)? } else { MetricsWriter::create(&run_dir)? };
    let schedule = cfg.schedule.schedule(total);
    let pb = progress_bar(total, step, opts.progress);
    let (mut reward_mean, mut interrupted) = (f64::NAN, false);
    let env_config = cfg.env.env_config();
    let params = cfg.sampling_params(false);

    while step < total {
        if opts.interrupt.as_ref().is_some_and(|f| f.load(Ordering::SeqCst))
            || opts.stop_after.is_some_and(|k| step >= k)
        {
            interrupted = true;
            break;
        }
        let step_seed = t.seed.wrapping_mul(1_000_003).wrapping_add(step as u64);

        // Generate: n episodes per prompt; groups without signal dropped or replaced.
        let t0 = Instant::now();
        let mut episodes: Vec<Episode> = vec![];
        let (mut generated, mut all_rewards, mut all_lengths, mut all_correct) = (0usize, vec![], vec![], vec![]);
        let mut entropy_terms = (0.0f64, 0.0f64);
        let rounds =
            if cfg.algorithm.dynamic_sampling == "replace" { cfg.algorithm.max_sampling_rounds.max(1) } else { 1 };
        for round in 0..rounds {
            let batch = loader.next_batch().ok_or_else(|| Error::input("the training set is empty"))?;
            let seed = step_seed.wrapping_mul(31).wrapping_add(round as u64);
            let fresh =
                generate_episodes(engines, &tok, &batch.items, &env_config, &params, cfg.rollout.n_samples, seed)?;
            generated += fresh.len();
            for e in &fresh {
                all_rewards.push(e.reward);
                all_lengths.push(e.response_tokens as f64);
                all_correct.push(e.correct as u8 as f64);
                for (&lp, &m) in e.sequence.logprobs.iter().zip(&e.sequence.mask) {
                    if m != 0.0 {
                        entropy_terms.0 -= lp as f64;
                        entropy_terms.1 += 1.0;
                    }
                }
            }
            let offset = episodes.last().map_or(0, |e| e.group + 1);
            let mut by_group: Vec<Vec<Episode>> = vec![];
            for mut e in fresh {
                e.group += offset;
                match by_group.last_mut() {
                    Some(g) if g[0].group == e.group => g.push(e),
                    _ => by_group.push(vec![e]),
                }
            }
            for g in by_group {
                if keep_group(cfg, &g.iter().collect::<Vec<_>>())
                    && episodes.len() / cfg.rollout.n_samples < t.prompts_per_step
                {
                    episodes.extend(g);
                }
            }
            if episodes.len() / cfg.rollout.n_samples >= t.prompts_per_step {
                break;
            }
        }
        renumber(&mut episodes);
        let time_generate = t0.elapsed().as_secs_f64();
        reward_mean = mean(all_rewards.iter().copied());

        let mut line = Map::new();
        let (mut time_reference, mut time_train, mut time_sync) = (0.0, 0.0, 0.0);
        let mut step_metrics = crate::algo::Metrics::new();
        let mut grad_norm = f64::NAN;
        let lr = schedule.lr_at(cfg.optimizer.lr, step);
        if !episodes.is_empty() {
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
            time_reference = t1.elapsed().as_secs_f64();
            // The KL coefficient of this step (adaptive: the controller's current one).
            let mut step_recipe = recipe.clone();
            step_recipe.kl_coef = kl.coef();
            let loss = cfg.loss_with_kl_coef(kl.coef())?;
            let prep = prepare(&step_recipe, &episodes, old, reference, values)?;
            step_metrics.merge(&prep.metrics);

            // Train: epochs × mini-batches of whole groups.
            let t2 = Instant::now();
            let adam = cfg.optimizer.adam_params(lr);
            let critic_adam = AdamParams { learning_rate: cfg.critic.lr, ..adam };
            for _ in 0..t.update_epochs {
                for members in minibatches(&episodes, t.mini_batches) {
                    let datums = policy_datums(&step_recipe, &episodes, &prep, &members)?;
                    let out = dispatch.forward_backward(POLICY, &datums, Some(&loss), false)?;
                    step_metrics.merge(&out.metrics);
                    grad_norm = dispatch.optim_step(POLICY, &adam)?;
                    if cfg.needs_critic() {
                        let datums = critic_datums(&step_recipe, &episodes, &prep, &members)?;
                        dispatch.forward_backward(CRITIC, &datums, Some(&value_loss), false)?;
                        dispatch.optim_step(CRITIC, &critic_adam)?;
                    }
                }
            }
            time_train = t2.elapsed().as_secs_f64();

            // Sync: the engines sample the next step with the new weights.
            let t3 = Instant::now();
            engines.update_weights(&dispatch.sampler_weights(POLICY)?).wait()?;
            time_sync = t3.elapsed().as_secs_f64();
            if let Some(kl_value) = prep.metrics.value("kl:mean") {
                kl.update(kl_value, episodes.len());
            }
        }
        step += 1;

        let reduced = step_metrics.reduce();
        let metric = |name: &str| reduced.get(name).copied().unwrap_or(f64::NAN);
        let elapsed = time_generate + time_reference + time_train + time_sync;
        line.insert("step".into(), json!(step));
        line.insert("reward_mean".into(), json!(reward_mean));
        line.insert("correct_mean".into(), json!(mean(all_correct.iter().copied())));
        line.insert("response_length_mean".into(), json!(mean(all_lengths.iter().copied())));
        line.insert("kl_mean".into(), json!(metric("kl:mean")));
        line.insert("kl_coef".into(), json!(kl.coef()));
        line.insert(
            "entropy_mean".into(),
            json!(if entropy_terms.1 > 0.0 { entropy_terms.0 / entropy_terms.1 } else { f64::NAN }),
        );
        line.insert("clip_fraction".into(), json!(metric("clip_fraction:mean")));
        line.insert("loss".into(), json!(metric("loss:sum")));
        line.insert("grad_norm".into(), json!(grad_norm));
        line.insert("lr".into(), json!(lr));
        line.insert("episodes_generated".into(), json!(generated));
        line.insert("episodes_trained".into(), json!(episodes.len()));
        line.insert("time_generate_s".into(), json!(time_generate));
        line.insert("time_reference_s".into(), json!(time_reference));
        line.insert("time_train_s".into(), json!(time_train));
        line.insert("time_sync_s".into(), json!(time_sync));
        line.insert("samples_per_s".into(), json!(generated as f64 / elapsed.max(1e-9)));
        let eval_now = !eval.is_empty() && ((t.eval_every > 0 && step % t.eval_every == 0) || step == total);
        if eval_now {
            let (p1, pn) = evaluate(cfg, engines, &tok, &eval, t.seed ^ 0xE7A1)?;
            line.insert("eval_pass_at_1".into(), json!(p1));
            line.insert("eval_pass_at_n".into(), json!(pn));
            evals.push((step, p1, pn));
            pb.println(format!(
                "step {step}: reward {reward_mean:.3}, eval pass@1 {p1:.3}, pass@{} {pn:.3}",
                cfg.rollout.eval_samples
            ));
        }
        metrics.write_line(&Value::Object(line))?;
        pb.set_position(step as u64);
        pb.set_message(format!("reward {reward_mean:.3} kl {:.4}", metric("kl:mean")));
        if eval_now {
            super::plot::plot_rl_run(&run_dir, &super::plot::PlotConfig::default())?;
        }
        if t.checkpoint_every > 0 && step % t.checkpoint_every == 0 && step < total {
            let state = TrainerState { step, loader: loader.position(), kl_coef: kl.coef(), evals: evals.clone() };
            save_checkpoint(dispatch, cfg, &run_dir, &state)?;
        }
    }
    pb.finish_and_clear();
    let state = TrainerState { step, loader: loader.position(), kl_coef: kl.coef(), evals: evals.clone() };
    let ckpt = save_checkpoint(dispatch, cfg, &run_dir, &state)?;
    super::plot::plot_rl_run(&run_dir, &super::plot::PlotConfig::default())?;
    let export_dir = if interrupted {
        eprintln!("interrupted at step {step}/{total}: checkpoint in {} (continue with --resume)", ckpt.display());
        None
    } else {
        let dir = run_dir.join(EXPORT_DIR);
        export_model(dispatch, POLICY, &cfg.model.path, cfg.model.lora.rank > 0, &dir)?;
        Some(dir)
    };
    Ok(RlSummary { steps: step, total_steps: total, reward_mean, evals, interrupted, run_dir, export_dir })
}
