//! The supervised fine-tuning loop.
//!
//! ```text
//! for step in start..total:
//!     batch   = loader.next_batch()                       # seeded per-epoch shuffle
//!     weights = trained-token mask / (trained tokens in the batch)   # token mean as weights
//!     forward_backward(batch, cross_entropy)              # a plain sum; per-token outputs off
//!     optim_step(AdamW, lr = schedule(step))
//!     every eval_every: eval loss = Σ −log p / Σ trained tokens over the eval set
//!     every checkpoint_every: checkpoint (worker state + loader position + step)
//! export the model (HF layout, or PEFT for LoRA) beside a final checkpoint
//! ```
//! Because the loss is a token mean expressed in the weights and the worker only sums,
//! micro-batching and data parallelism change nothing but float rounding. A resumed run restores
//! the parameters, AdamW moments, worker RNG, the loader position and the step, so it ends
//! bit-for-bit where the uninterrupted run ends. Interruption (Ctrl-C, or `stop_after` in tests)
//! is checked between steps and always leaves a checkpoint.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::SftConfig;
use super::data_loader::{DataLoader, LoaderPosition};
use super::metrics::{MetricsWriter, StepMetrics};
use super::plot::{plot_run, PlotConfig};
use super::sft_data::{load_sft_dataset, token_mean_datums, SftExample};
use crate::algo::Loss;
use crate::dispatch::Dispatch;
use crate::files::{read_json, write_dir_atomically, write_json};
use crate::model::tokenizer::Tokenizer;
use crate::{Error, Result};

/// The id of the trained model in the dispatch.
pub const POLICY: &str = "policy";
/// Checkpoints of a run: `RUN_DIR/checkpoints/step_N/`, complete once `trainer_state.json` is in.
pub(super) const CHECKPOINTS: &str = "checkpoints";
pub(super) const TRAINER_STATE: &str = "trainer_state.json";
const WORKER_DIR: &str = "worker";
/// Where the trained model is exported at the end of a run.
pub const EXPORT_DIR: &str = "final";
/// Tokenizer files copied next to an exported model so that it loads on its own.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// How to run, beyond the config.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Continue from the latest checkpoint in the run directory.
    pub resume: bool,
    /// Stop (with a checkpoint) once this many steps are done, as an interruption would.
    pub stop_after: Option<usize>,
    /// Set asynchronously (Ctrl-C) to stop after the current step with a checkpoint.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// Draw a progress bar on stderr (only when it is a terminal).
    pub progress: bool,
    /// Asked after each step; `true` ends the run there as finished (exported), e.g. once an
    /// evaluation reaches a target.
    pub finish_when: Option<FinishWhen>,
}

/// `(steps done, dispatch) → finish now?`
pub type FinishCheck = dyn Fn(usize, &Dispatch) -> Result<bool> + Send + Sync;

/// A check after each step: `(steps done, dispatch) → finish now?`.
#[derive(Clone)]
pub struct FinishWhen(pub Arc<FinishCheck>);

impl std::fmt::Debug for FinishWhen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FinishWhen(..)")
    }
}

impl RunOptions {
    /// Whether the run should end as finished after `step` steps.
    pub(super) fn finish_now(&self, step: usize, dispatch: &Dispatch) -> Result<bool> {
        self.finish_when.as_ref().map_or(Ok(false), |f| (f.0)(step, dispatch))
    }
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct SftSummary {
    /// Steps done in total (including those before a resume).
    pub steps: usize,
    pub total_steps: usize,
    pub final_loss: f64,
    pub eval_losses: Vec<(usize, f64)>,
    pub interrupted: bool,
    pub run_dir: PathBuf,
    /// The exported model (None when interrupted).
    pub export_dir: Option<PathBuf>,
}

/// What a checkpoint holds besides the worker state.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TrainerState {
    step: usize,
    loader: LoaderPosition,
}

/// Trained-token mean of the negative log-likelihood over `examples`.
pub fn eval_loss(dispatch: &Dispatch, examples: &[SftExample], batch_size: usize) -> Result<f64> {
    let cross_entropy = Loss::parse("cross_entropy", &Value::Null)?;
    let (mut loss, mut tokens) = (0.0, 0.0);
    for chunk in examples.chunks(batch_size.max(1)) {
        let datums: Vec<_> = chunk.iter().map(SftExample::to_datum).collect();
        let out = dispatch.forward(POLICY, &datums, Some(&cross_entropy), false)?;
        loss += out.metrics.value("loss:sum").unwrap_or(0.0);
        tokens += out.metrics.value("ntokens:sum").unwrap_or(0.0);
    }
    Ok(if tokens > 0.0 { loss / tokens } else { f64::NAN })
}

pub(super) fn checkpoint_dir(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join(CHECKPOINTS).join(format!("step_{step:06}"))
}

/// The latest complete checkpoint of a run directory, by step.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<(usize, PathBuf)>> {
    let root = run_dir.join(CHECKPOINTS);
    if !root.exists() {
        return Ok(None);
    }
    let mut best = None;
    for entry in std::fs::read_dir(&root).map_err(|e| Error::file(&root, e))? {
        let entry = entry.map_err(|e| Error::file(&root, e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(step) = name.strip_prefix("step_").and_then(|s| s.parse::<usize>().ok()) else { continue };
        if entry.path().join(TRAINER_STATE).exists() && best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, entry.path()));
        }
    }
    Ok(best)
}

/// Writes worker state and trainer state together, atomically (a half checkpoint never exists).
fn save_checkpoint(dispatch: &Dispatch, run_dir: &Path, state: &TrainerState) -> Result<PathBuf> {
    let dir = checkpoint_dir(run_dir, state.step);
    write_dir_atomically(&dir, |tmp| {
        dispatch.save_state(POLICY, &tmp.join(WORKER_DIR))?;
        let json = serde_json::to_value(state).map_err(|e| Error::Other(e.to_string()))?;
        write_json(&tmp.join(TRAINER_STATE), &json)
    })?;
    Ok(dir)
}

fn load_checkpoint(dispatch: &Dispatch, dir: &Path) -> Result<TrainerState> {
    let path = dir.join(TRAINER_STATE);
    let state: TrainerState =
        serde_json::from_value(read_json(&path)?).map_err(|e| Error::file(&path, format!("invalid: {e}")))?;
    dispatch.load_state(POLICY, &dir.join(WORKER_DIR))?;
    Ok(state)
}

/// Exports model `id` to `dir` (HF layout, or PEFT for LoRA) and, for a full model, copies the
/// tokenizer files of its base `model_path` next to it, so that it loads on its own.
pub fn export_model(dispatch: &Dispatch, id: &str, model_path: &Path, lora: bool, dir: &Path) -> Result<()> {
    dispatch.export(id, dir, false)?;
    if !lora {
        for f in TOKENIZER_FILES {
            let src = model_path.join(f);
            if src.exists() {
                std::fs::copy(&src, dir.join(f)).map_err(|e| Error::file(&src, format!("cannot copy: {e}")))?;
            }
        }
    }
    Ok(())
}

/// A step progress bar on stderr (hidden unless `enabled`).
pub fn progress_bar(total: usize, start: usize, enabled: bool) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(total as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed} < {eta}]")
            .expect("valid template"),
    );
    pb.set_position(start as u64);
    pb
}

/// Runs (or resumes) SFT as `cfg` says, training model [`POLICY`] of `dispatch` (built by the
/// launcher from the config: see `cli::launch::sft_dispatch`).
pub fn run_sft(cfg: &SftConfig, dispatch: &Dispatch, opts: &RunOptions) -> Result<SftSummary> {
    let run_dir = cfg.output.run_dir.clone();
    let existing = latest_checkpoint(&run_dir)?;
    if existing.is_some() && !opts.resume {
        return Err(Error::input(format!(
            "{} already holds checkpoints: pass --resume to continue that run, or set output.run_dir to a new directory",
            run_dir.display()
        )));
    }
    let model_config = crate::model::ModelConfig::from_dir(&cfg.model.path)?;
    let tokenizer = Tokenizer::from_dir(&cfg.model.path)?;
    let mut data_cfg = cfg.data.clone();
    if data_cfg.max_length > model_config.max_position_embeddings {
        eprintln!(
            "data.max_length {} is beyond the model's max_position_embeddings; truncating at {}",
            data_cfg.max_length, model_config.max_position_embeddings
        );
        data_cfg.max_length = model_config.max_position_embeddings;
    }
    let data = load_sft_dataset(&data_cfg, &tokenizer)?;
    eprintln!("train: {}", data.train_stats);
    if !data.eval.is_empty() {
        eprintln!("eval:  {}", data.eval_stats);
    }
    std::fs::create_dir_all(&run_dir).map_err(|e| Error::file(&run_dir, format!("cannot create: {e}")))?;
    // Absolute paths: the saved copy means the same config when loaded from the run directory.
    let saved = super::config_file::absolutize(cfg)?.to_toml()?;
    std::fs::write(run_dir.join("config.toml"), saved).map_err(|e| Error::file(&run_dir, e))?;

    let cross_entropy = Loss::parse("cross_entropy", &Value::Null)?;
    let eval_set = data.eval;
    let mut loader = DataLoader::new(data.train, cfg.train.batch_size, cfg.data.shuffle_seed, true);
    let total = if cfg.train.max_steps > 0 { cfg.train.max_steps } else { cfg.train.epochs * loader.steps_per_epoch() };

    let mut step = 0;
    if let (true, Some((_, dir))) = (opts.resume, &existing) {
        let state = load_checkpoint(dispatch, dir)?;
        loader.set_position(state.loader).map_err(|e| Error::file(dir.join(TRAINER_STATE), e))?;
        step = state.step;
        eprintln!("resumed from {} (step {step})", dir.display());
    }
    let mut metrics = if step > 0 { MetricsWriter::resume(&run_dir, step)? } else { MetricsWriter::create(&run_dir)? };
    let plot_cfg = PlotConfig::default();
    let schedule = cfg.schedule.schedule(total);
    let pb = progress_bar(total, step, opts.progress);
    let started = Instant::now();
    let (mut final_loss, mut eval_losses, mut interrupted) = (f64::NAN, vec![], false);
    let o = &cfg.optimizer;

    while step < total {
        if opts.interrupt.as_ref().is_some_and(|f| f.load(Ordering::SeqCst))
            || opts.stop_after.is_some_and(|k| step >= k)
        {
            interrupted = true;
            break;
        }
        let t0 = Instant::now();
        let batch = loader.next_batch().ok_or_else(|| Error::input("the training set is empty"))?;
        let datums = token_mean_datums(&batch.items);
        let out = dispatch.forward_backward(POLICY, &datums, Some(&cross_entropy), false)?;
        let lr = schedule.lr_at(o.lr, step);
        let adam = o.adam_params(lr);
        let grad_norm = dispatch.optim_step(POLICY, &adam)?;
        step += 1;
        final_loss = out.metrics.value("loss:sum").unwrap_or(f64::NAN);
        let tokens: usize = batch.items.iter().map(|e| e.input_tokens.len()).sum();
        let secs = t0.elapsed().as_secs_f64();

        let eval_now =
            !eval_set.is_empty() && ((cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0) || step == total);
        let eval_loss = if eval_now { Some(eval_loss(dispatch, &eval_set, cfg.train.batch_size)?) } else { None };
        if let Some(e) = eval_loss {
            eval_losses.push((step, e));
        }
        metrics.write(&StepMetrics {
            step,
            epoch: batch.epoch,
            loss: final_loss,
            lr,
            grad_norm,
            trained_tokens: batch.items.iter().map(SftExample::num_trained).sum(),
            tokens,
            tokens_per_s: tokens as f64 / secs,
            elapsed_s: started.elapsed().as_secs_f64(),
            eval_loss,
            extra: Default::default(),
        })?;
        pb.set_position(step as u64);
        pb.set_message(format!("loss {final_loss:.4} lr {lr:.2e} {:.0} tok/s", tokens as f64 / secs));
        if let Some(e) = eval_loss {
            pb.println(format!("step {step}: train loss {final_loss:.4}, eval loss {e:.4}"));
            plot_run(&run_dir, &plot_cfg)?;
        }
        if cfg.train.checkpoint_every > 0 && step % cfg.train.checkpoint_every == 0 && step < total {
            save_checkpoint(dispatch, &run_dir, &TrainerState { step, loader: loader.position() })?;
        }
        if opts.finish_now(step, dispatch)? {
            pb.println(format!("finished early at step {step}"));
            break;
        }
    }
    pb.finish_and_clear();
    let ckpt = save_checkpoint(dispatch, &run_dir, &TrainerState { step, loader: loader.position() })?;
    plot_run(&run_dir, &plot_cfg)?;
    let export_dir = if interrupted {
        eprintln!("interrupted at step {step}/{total}: checkpoint in {} (continue with --resume)", ckpt.display());
        None
    } else {
        let dir = cfg.output.run_dir.join(EXPORT_DIR);
        export_model(dispatch, POLICY, &cfg.model.path, cfg.model.lora.rank > 0, &dir)?;
        Some(dir)
    };
    Ok(SftSummary { steps: step, total_steps: total, final_loss, eval_losses, interrupted, run_dir, export_dir })
}
