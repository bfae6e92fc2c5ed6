//! The SFT run configuration: one TOML file with sections `[model]`, `[data]`, `[optimizer]`,
//! `[schedule]`, `[train]`, `[output]` and `[tracking]`, resolved by
//! [`config_file`](crate::trainer::config_file) (defaults ← file ← `--set`).
//!
//! Every field has a default, written on it. No field is an `Option` (see `config_file`): an
//! unset path is `""`, an unset limit is `0`. A relative path written in the config file is
//! relative to the file's directory; one given with `--set`, or a default, to the working
//! directory ([`ConfigPaths`]).
//!
//! `[data]` and `[train]` are SFT's own and defined here; the others are the sections the RL
//! config shares ([`crate::trainer::sections`], [`crate::trainer::tracking`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::trainer::config_file::{ConfigPaths, Sources};
use crate::trainer::sections::{ModelSection, OnBadRow, OptimizerSection, OutputSection, ScheduleSection};
use crate::trainer::tracking::TrackingSection;
use crate::worker::{GradientSum, Sharding};

/// A full SFT run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    pub model: ModelSection,
    pub data: DataSection,
    pub optimizer: OptimizerSection,
    pub schedule: ScheduleSection,
    pub train: TrainSection,
    pub output: OutputSection,
    pub tracking: TrackingSection,
}

impl ConfigPaths for SftConfig {
    const PATH_KEYS: &'static [&'static str] = &["model.path", "data.train_file", "data.eval_file", "output.run_dir"];
    const MODEL_KEYS: &'static [&'static str] = &["model.path"];
}

/// `[data]`: the SFT dataset (see [`super::data`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// Training rows, `.jsonl` or `.parquet`. Default `""`: required.
    pub train_file: PathBuf,
    /// Evaluation rows. Default `""`: hold out `eval_fraction` of the training rows instead.
    pub eval_file: PathBuf,
    /// Fraction of training rows held out for evaluation when there is no `eval_file`, chosen
    /// by `shuffle_seed`. Default 0: no evaluation.
    pub eval_fraction: f64,
    /// Longest tokenized conversation kept; longer ones are cut at the end. Default 2048.
    pub max_length: usize,
    /// Which assistant messages are trained. Default `all_assistant`.
    pub train_on: TrainOn,
    /// What a malformed row does: `error` stops the run (the default), `skip` drops it with a
    /// warning and counts it.
    pub on_bad_row: OnBadRow,
    /// Seed of the per-epoch shuffle and of the eval split. Default 0.
    pub shuffle_seed: u64,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            train_file: PathBuf::new(),
            eval_file: PathBuf::new(),
            eval_fraction: 0.0,
            max_length: 2048,
            train_on: TrainOn::AllAssistant,
            on_bad_row: OnBadRow::Error,
            shuffle_seed: 0,
        }
    }
}

/// Which assistant messages carry loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainOn {
    /// Only the last assistant message of each conversation.
    LastAssistant,
    /// Every assistant message.
    AllAssistant,
}

/// `[train]`: the loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    /// Examples per optimizer step. Default 32.
    pub batch_size: usize,
    /// Examples per forward/backward call (gradients accumulate over the step's micro-batches;
    /// it bounds memory, not the result). Must divide `batch_size`. Default 8.
    pub micro_batch_size: usize,
    /// Passes over the training set. Default 1.
    pub epochs: usize,
    /// Stop after this many optimizer steps, whatever `epochs` says; 0 (the default) lets
    /// `epochs` decide.
    pub max_steps: usize,
    /// Evaluate every this many steps (and after the last); 0: only after the last. Default 50.
    pub eval_every: usize,
    /// Save a checkpoint every this many steps (and after the last); 0: only after the last.
    /// Default 0.
    pub checkpoint_every: usize,
    /// Seed of everything random in the run other than the data order (LoRA init, ...).
    /// Default 0.
    pub seed: u64,
    /// Data-parallel ranks (threads of this process, each with a copy of the model). The
    /// result does not depend on it. Default 1.
    pub data_parallel: usize,
    /// At most this many padded tokens per micro-batch on a rank, packed by length; 0 (the
    /// default) packs by `micro_batch_size` only.
    pub max_tokens_per_microbatch: usize,
    /// Keep only each decoder layer's input in the forward and recompute the layer in the
    /// backward: less memory for one more forward, the same gradients bit for bit. Default
    /// `false`.
    pub activation_checkpointing: bool,
    /// How the data-parallel ranks share the model's state ([`crate::worker::Sharding`]):
    /// `none` (the default), `optimizer` (ZeRO-1), `gradients` (ZeRO-2) or `full` (ZeRO-3) —
    /// the same weights and metrics bit for bit whichever.
    pub sharding: Sharding,
    /// When the ranks' gradients are summed ([`crate::worker::GradientSum`]): `step` (the
    /// default: each rank adds up its micro-batches, the step sums the ranks once) or
    /// `micro_batch` (after every micro-batch, so that under `full` a rank keeps only its slice
    /// of the gradients). The two add in different orders, so their bits differ; each gives the
    /// same bits under every sharding.
    pub gradient_sum: GradientSum,
    /// Weight of a model with experts' load-balancing loss (transformers' `router_aux_loss_coef`;
    /// Qwen3-MoE's configs suggest 0.001), added to the token-mean loss; 0 (the default): off.
    pub router_aux_loss_coef: f64,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            batch_size: 32,
            micro_batch_size: 8,
            epochs: 1,
            max_steps: 0,
            eval_every: 50,
            checkpoint_every: 0,
            seed: 0,
            data_parallel: 1,
            max_tokens_per_microbatch: 0,
            activation_checkpointing: false,
            sharding: Sharding::None,
            gradient_sum: GradientSum::Step,
            router_aux_loss_coef: 0.0,
        }
    }
}

impl SftConfig {
    /// Defaults ← `file` ← `--set` overrides, then [`validate`](Self::validate).
    pub fn load(file: Option<&Path>, sets: &[String]) -> Result<Self> {
        let (config, sources): (SftConfig, _) = crate::trainer::config_file::resolve_with_sources(file, sets)?;
        config.validate(&sources)?;
        Ok(config)
    }

    /// Checks what types cannot: required fields and value ranges. Errors name the dotted key
    /// and where its value came from (`Sources::none()` when there is no file).
    pub fn validate(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &str| sources.error(key, msg);
        self.model.validate(sources)?;
        if self.data.train_file.as_os_str().is_empty() {
            return Err(err("data.train_file", "required: a .jsonl or .parquet file"));
        }
        if !(0.0..1.0).contains(&self.data.eval_fraction) {
            return Err(err("data.eval_fraction", "must be in [0, 1)"));
        }
        if self.data.max_length < 2 {
            return Err(err("data.max_length", "must be at least 2 (one input and one target token)"));
        }
        self.optimizer.validate(sources)?;
        self.schedule.validate(sources)?;
        let t = &self.train;
        if t.batch_size == 0 {
            return Err(err("train.batch_size", "must be positive"));
        }
        if t.micro_batch_size == 0 || !t.batch_size.is_multiple_of(t.micro_batch_size) {
            return Err(err("train.micro_batch_size", "must be positive and divide train.batch_size"));
        }
        if let Err(e) = t.sharding.check_served(&self.model.device) {
            return Err(err("train.sharding", &e.to_string()));
        }
        if !(t.router_aux_loss_coef.is_finite() && t.router_aux_loss_coef >= 0.0) {
            return Err(err("train.router_aux_loss_coef", "must be finite and non-negative"));
        }
        if t.epochs == 0 && t.max_steps == 0 {
            return Err(err("train.epochs", "0 epochs and no train.max_steps: nothing to train"));
        }
        if self.output.run_dir.as_os_str().is_empty() {
            return Err(err("output.run_dir", "required"));
        }
        self.tracking.validate(sources)?;
        Ok(())
    }

    /// The resolved config as TOML, for `oxrl config show` and `RUN_DIR/config.toml`.
    pub fn to_toml(&self) -> Result<String> {
        crate::trainer::config_file::to_toml_string(self)
    }
}
