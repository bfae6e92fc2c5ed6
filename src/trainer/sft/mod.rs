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
//! is checked between steps and always leaves a checkpoint. The run directory (config, metrics,
//! checkpoints, export) is [`crate::trainer::run_dir`]'s, shared with the RL trainers.

pub mod chat_mask;
pub mod config;
pub mod data;
pub mod state;

use std::path::PathBuf;
use std::time::Instant;

use serde_json::Value;

use self::config::SftConfig;
use self::data::{load_sft_dataset, token_mean_datums, SftExample};
use self::state::SftState;
use crate::algo::Loss;
use crate::dispatch::Dispatch;
use crate::model::tokenizer::Tokenizer;
use crate::trainer::data_loader::DataLoader;
use crate::trainer::metrics::StepMetrics;
use crate::trainer::model_ids::POLICY;
use crate::trainer::plot::{plot_run, PlotConfig};
use crate::trainer::run_dir::{check_resumable, RunDir, RunOptions, TrainerState};
use crate::{Error, Result};

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

fn plot_sft(run_dir: &std::path::Path) -> Result<()> {
    plot_run(run_dir, &PlotConfig::default()).map(|_| ())
}

/// Runs (or resumes) SFT as `cfg` says, training model [`POLICY`] of `dispatch` (built by the
/// launcher from the config: see `launch::sft_dispatch`).
pub fn run_sft(cfg: &SftConfig, dispatch: &Dispatch, opts: &RunOptions) -> Result<SftSummary> {
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
    check_resumable(&cfg.output.run_dir, opts)?; // before the dataset is read
    let data = load_sft_dataset(&data_cfg, &tokenizer)?;
    eprintln!("train: {}", data.train_stats);
    if !data.eval.is_empty() {
        eprintln!("eval:  {}", data.eval_stats);
    }
    let cross_entropy = Loss::parse("cross_entropy", &Value::Null)?;
    let eval_set = data.eval;
    let mut loader = DataLoader::new(data.train, cfg.train.batch_size, cfg.data.shuffle_seed, true);
    let total = if cfg.train.max_steps > 0 { cfg.train.max_steps } else { cfg.train.epochs * loader.steps_per_epoch() };
    // Absolute paths: the saved copy means the same config when loaded from the run directory.
    let saved = || crate::trainer::config_file::absolutize(cfg)?.to_toml();
    let (mut run, resumed): (RunDir, Option<TrainerState<SftState>>) =
        RunDir::open(&cfg.output.run_dir, saved, vec![POLICY], plot_sft, total, dispatch, opts)?;

    let (mut step, mut evals) = (0, vec![]);
    if let Some(state) = resumed {
        loader.set_position(state.trainer.loader)?;
        (step, evals) = (state.step, state.trainer.evals);
    }
    let schedule = cfg.schedule.schedule(total);
    let started = Instant::now();
    let (mut final_loss, mut interrupted) = (f64::NAN, false);
    let o = &cfg.optimizer;

    while step < total {
        if run.should_stop(step) {
            interrupted = true;
            break;
        }
        let t0 = Instant::now();
        let batch = loader.next_batch().ok_or_else(|| Error::input("the training set is empty"))?;
        let datums = token_mean_datums(&batch.items);
        let lr = schedule.lr_at(o.lr, step);
        let (out, grad_norm) =
            dispatch.forward_backward_step(POLICY, &datums, &cross_entropy, false, &o.adam_params(lr))?;
        step += 1;
        final_loss = out.metrics.value("loss:sum").unwrap_or(f64::NAN);
        let tokens: usize = batch.items.iter().map(|e| e.input_tokens.len()).sum();
        let secs = t0.elapsed().as_secs_f64();

        let eval_now =
            !eval_set.is_empty() && ((cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0) || step == total);
        let eval_loss = if eval_now { Some(eval_loss(dispatch, &eval_set, cfg.train.batch_size)?) } else { None };
        if let Some(e) = eval_loss {
            evals.push((step, vec![e]));
        }
        run.write_metrics(&StepMetrics {
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
            peak_rss_gb: crate::memory::peak_rss_gb(),
            // On a GPU, the most device memory in use at once (absent on the CPU).
            extra: crate::memory::device_peak_gb().map(|gb| ("peak_device_gb".into(), gb.into())).into_iter().collect(),
        })?;
        let pb = run.progress();
        pb.set_position(step as u64);
        pb.set_message(format!("loss {final_loss:.4} lr {lr:.2e} {:.0} tok/s", tokens as f64 / secs));
        if let Some(e) = eval_loss {
            pb.println(format!("step {step}: train loss {final_loss:.4}, eval loss {e:.4}"));
            run.plot()?;
        }
        let state = || TrainerState { step, trainer: SftState { loader: loader.position(), evals: evals.clone() } };
        run.checkpoint_if_due(dispatch, cfg.train.checkpoint_every, total, &state())?;
        if run.finish_now(step, dispatch)? {
            run.progress().println(format!("finished early at step {step}"));
            break;
        }
    }
    let state = TrainerState { step, trainer: SftState { loader: loader.position(), evals } };
    let run_dir = run.root().to_path_buf();
    let export_dir = run.finish(dispatch, &state, total, interrupted, &cfg.model)?;
    let eval_losses = state.trainer.evals.iter().map(|(s, v)| (*s, v.first().copied().unwrap_or(f64::NAN))).collect();
    Ok(SftSummary { steps: step, total_steps: total, final_loss, eval_losses, interrupted, run_dir, export_dir })
}
