//! A run directory: what every trainer (SFT, sync and async RL) writes and reads back, in one
//! layout.
//!
//! ```text
//! RUN_DIR/config.toml                      the resolved config (absolute paths)
//! RUN_DIR/metrics.jsonl                    one line per step (metrics.rs)
//! RUN_DIR/tensorboard/, RUN_DIR/wandb/     the same lines, for the `[tracking]` backends
//! RUN_DIR/*.png                            plots of the metrics (plot.rs)
//! RUN_DIR/checkpoints/step_NNNNNN/<model>/ each trained model's worker state (policy, critic)
//! RUN_DIR/checkpoints/step_NNNNNN/trainer_state.json   the step and the trainer's own state
//! RUN_DIR/final/                           the exported policy (HF layout, or PEFT for LoRA)
//! ```
//! A run opens new (the directory must hold no checkpoint) or resumed (from its latest complete
//! checkpoint: the models' states are loaded, `metrics.jsonl` is cut back to that step). The
//! tracking backends of the config's `[tracking]` table start as it opens (one that cannot is
//! an error before training) and end in [`RunDir::finish`]. A
//! checkpoint is written atomically (a half checkpoint never exists) and is complete once
//! `trainer_state.json` is in. Between steps the trainer asks [`RunDir::should_stop`] (Ctrl-C,
//! `stop_after`) and [`RunDir::finish_now`] (`finish_when`); [`RunDir::finish`] always leaves a
//! checkpoint, and exports the policy unless the run was interrupted. What a trainer keeps of its
//! own in `trainer_state.json` (its data position, evaluations, …) is a type of that trainer's
//! ([`TrainerState`]'s `S`), saved and loaded here without being known.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::metrics::MetricsWriter;
use super::sections::ModelSection;
use super::tracking::Tracker;
use crate::dispatch::Dispatch;
use crate::files::{read_json, write_dir_atomically, write_json};
use crate::world::{check_same_run, is_writer};
use crate::{Error, Result};

/// Checkpoints of a run: `RUN_DIR/checkpoints/step_N/`.
const CHECKPOINTS: &str = "checkpoints";
/// A checkpoint is complete once this file is in.
pub const TRAINER_STATE: &str = "trainer_state.json";
/// Where the trained policy is exported at the end of a run.
pub const EXPORT_DIR: &str = "final";
/// The resolved config of a run.
pub const CONFIG_FILE: &str = "config.toml";
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

/// What a checkpoint holds besides the models' states (`trainer_state.json`): the steps done,
/// and beside them (flattened into the same JSON object) the trainer's own state `S`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState<S> {
    /// Steps done.
    pub step: usize,
    #[serde(flatten)]
    pub trainer: S,
}

/// What a trainer writes its run with: the directory, its metrics, the progress bar, the
/// dispatch models its checkpoints hold.
pub struct RunDir {
    root: PathBuf,
    opts: RunOptions,
    /// Dispatch models saved in (and restored from) every checkpoint, in `<model>/`.
    models: Vec<&'static str>,
    /// `None` in the processes other than process 0, which write nothing here.
    metrics: Option<MetricsWriter>,
    pb: indicatif::ProgressBar,
    /// Writes the run's plots from its metrics.
    plot: fn(&Path) -> Result<()>,
}

impl RunDir {
    /// Opens `root` for a run of `total_steps`: new (no checkpoint may be there), or resumed
    /// from its latest checkpoint when `opts.resume` (the models' states loaded into
    /// `dispatch`). Writes `config_toml()` as `config.toml` (called once the directory exists,
    /// so that paths in it can be made absolute) and starts the tracking backends of its
    /// `[tracking]` table. Returns the resumed trainer state.
    pub fn open<S: DeserializeOwned>(
        root: &Path,
        config_toml: impl FnOnce() -> Result<String>,
        models: Vec<&'static str>,
        plot: fn(&Path) -> Result<()>,
        total_steps: usize,
        dispatch: &Dispatch,
        opts: &RunOptions,
    ) -> Result<(RunDir, Option<TrainerState<S>>)> {
        check_resumable(root, opts)?;
        let existing = latest_checkpoint(root)?;
        let writer = is_writer();
        if writer {
            std::fs::create_dir_all(root).map_err(|e| Error::file(root, format!("cannot create: {e}")))?;
        }
        let config_text = config_toml()?;
        // Every process of a multi-process run checks it runs what process 0 runs.
        check_same_run(&config_text)?;
        if writer {
            let config_path = root.join(CONFIG_FILE);
            std::fs::write(&config_path, &config_text).map_err(|e| Error::file(&config_path, e))?;
        }
        // Process 0 alone tracks, as it alone writes metrics.jsonl.
        let tracker = if writer { Tracker::start_for_config(&config_text, root)? } else { Tracker::none() };
        let mut resumed = None;
        if let (true, Some((_, dir))) = (opts.resume, &existing) {
            let path = dir.join(TRAINER_STATE);
            let state: TrainerState<S> =
                serde_json::from_value(read_json(&path)?).map_err(|e| Error::file(&path, format!("invalid: {e}")))?;
            for id in &models {
                dispatch.load_state(id, &dir.join(id))?;
            }
            if writer {
                eprintln!("resumed from {} (step {})", dir.display(), state.step);
            }
            resumed = Some(state);
        }
        let step = resumed.as_ref().map_or(0, |s| s.step);
        let metrics = match (writer, step > 0) {
            (false, _) => None,
            (true, true) => Some(MetricsWriter::resume_tracked(root, step, tracker)?),
            (true, false) => Some(MetricsWriter::create_tracked(root, tracker)?),
        };
        let pb = progress_bar(total_steps, step, opts.progress && writer);
        Ok((RunDir { root: root.to_path_buf(), opts: opts.clone(), models, metrics, pb, plot }, resumed))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The progress bar (hidden unless asked for); print through it while it is drawn.
    pub fn progress(&self) -> &indicatif::ProgressBar {
        &self.pb
    }

    /// Whether to stop before the step after `step` as interrupted (Ctrl-C, `stop_after`).
    pub fn should_stop(&self, step: usize) -> bool {
        let o = &self.opts;
        o.interrupt.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) || o.stop_after.is_some_and(|k| step >= k)
    }

    /// Whether the run should end as finished after `step` steps (`finish_when`).
    pub fn finish_now(&self, step: usize, dispatch: &Dispatch) -> Result<bool> {
        self.opts.finish_when.as_ref().map_or(Ok(false), |f| (f.0)(step, dispatch))
    }

    /// Appends one step's line to `metrics.jsonl`.
    pub fn write_metrics(&mut self, line: &impl Serialize) -> Result<()> {
        self.metrics.as_mut().map_or(Ok(()), |m| m.write_line(line))
    }

    /// Writes the run's plots.
    pub fn plot(&self) -> Result<()> {
        match self.metrics {
            Some(_) => (self.plot)(&self.root),
            None => Ok(()),
        }
    }

    /// Saves a checkpoint after `state.step` when one is due: every `every` steps (0: never),
    /// except the last step `total`, which [`finish`](Self::finish) saves.
    pub fn checkpoint_if_due<S: Serialize>(
        &self,
        dispatch: &Dispatch,
        every: usize,
        total: usize,
        state: &TrainerState<S>,
    ) -> Result<()> {
        if every > 0 && state.step.is_multiple_of(every) && state.step < total {
            self.save_checkpoint(dispatch, state)?;
        }
        Ok(())
    }

    /// Writes the models' states and the trainer state together, atomically.
    pub fn save_checkpoint<S: Serialize>(&self, dispatch: &Dispatch, state: &TrainerState<S>) -> Result<PathBuf> {
        let dir = self.root.join(CHECKPOINTS).join(format!("step_{:06}", state.step));
        if self.metrics.is_none() {
            // Process 0 writes it; the others send it their slices of a sharded model's state.
            for id in &self.models {
                dispatch.save_state(id, &dir.join(id))?;
            }
            return Ok(dir);
        }
        write_dir_atomically(&dir, |tmp| {
            for id in &self.models {
                dispatch.save_state(id, &tmp.join(id))?;
            }
            let json = serde_json::to_value(state).map_err(|e| Error::Other(e.to_string()))?;
            write_json(&tmp.join(TRAINER_STATE), &json)
        })?;
        Ok(dir)
    }

    /// Ends the run: a last checkpoint, the plots, (unless `interrupted`) the policy exported
    /// to `final/`, which is returned, and the tracking backends closed.
    pub fn finish<S: Serialize>(
        mut self,
        dispatch: &Dispatch,
        state: &TrainerState<S>,
        total: usize,
        interrupted: bool,
        model: &ModelSection,
    ) -> Result<Option<PathBuf>> {
        self.pb.finish_and_clear();
        let ckpt = self.save_checkpoint(dispatch, state)?;
        self.plot()?;
        let export = if interrupted {
            eprintln!(
                "interrupted at step {}/{total}: checkpoint in {} (continue with --resume)",
                state.step,
                ckpt.display()
            );
            None
        } else {
            let dir = self.root.join(EXPORT_DIR);
            // Every process takes part (sliced weights are gathered); process 0 writes.
            export_model(dispatch, super::model_ids::POLICY, &model.path, model.lora.rank > 0, &dir)?;
            Some(dir)
        };
        // A clean end, interrupted or not (an error before here ends the W&B run as failed).
        if let Some(metrics) = self.metrics.take() {
            metrics.close()?;
        }
        Ok(export)
    }
}

/// A run directory with checkpoints is only opened to resume it.
pub fn check_resumable(root: &Path, opts: &RunOptions) -> Result<()> {
    if !opts.resume && latest_checkpoint(root)?.is_some() {
        return Err(Error::input(format!(
            "{} already holds checkpoints: pass --resume to continue that run, or set output.run_dir to a new directory",
            root.display()
        )));
    }
    Ok(())
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

/// Exports model `id` to `dir` (HF layout, or PEFT for LoRA) and, for a full model, copies the
/// tokenizer files of its base `model_path` next to it, so that it loads on its own. Every process
/// of a run calls it; process 0 writes.
pub fn export_model(dispatch: &Dispatch, id: &str, model_path: &Path, lora: bool, dir: &Path) -> Result<()> {
    dispatch.export(id, dir, false)?;
    if !lora && crate::world::is_writer() {
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
