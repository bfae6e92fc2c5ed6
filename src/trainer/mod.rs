//! Trainers: algorithms over time. Supervised fine-tuning ([`sft`]: the loop) and RL ([`rl`]:
//! one loop for both modes over a source of groups — [`sync_groups`], generated each step, or
//! [`async_groups`], generated in the background under staleness control), and what they stand
//! on:
//!
//! - [`broadcast_groups`]: async RL across processes (process 0's source, every process's groups).
//! - [`run_dir`]: the run directory both trainers write — new vs resume, `config.toml`,
//!   `metrics.jsonl`, plots, checkpoints in one layout, the final export, Ctrl-C, `finish_when`.
//! - [`rl_run`]: an RL run in progress (the training half of a step, weight pushes, the metrics
//!   line, evaluation, checkpoints); [`rl_step`]: one step's numbers; [`group`]: a group of
//!   episodes, its identity, seed and filter; [`rollouts`]: episodes on the engines;
//!   [`rollout_stats`], [`rl_eval`], [`rl_prompts`]; [`staleness`] and [`prompt_stream`]: the
//!   async source's staleness control and its resumable prompt ids.
//! - [`config_file`]: TOML run configs — defaults, file, `--set` overrides, checked keys with
//!   suggestions; generic over the config type. [`choice`]: closed choices as enums.
//! - [`config`]: the SFT config (`[model]`, `[data]`, `[optimizer]`, `[schedule]`, `[train]`,
//!   `[output]`); [`rl_config`]: the RL config (the SFT sections plus `[env]`, `[rollout]`,
//!   `[algorithm]`, `[critic]`, `[async_rl]`, `[launch]`), built once into an `RlPlan`;
//!   [`model_ids`]: the ids of a run's models.
//! - [`chat_mask`]: tokens and trained-token mask of a conversation by incremental rendering.
//! - [`sft_data`]: rows → conversations → `{input_tokens, target_tokens, weights}` examples,
//!   truncation, eval split, bad-row policy (rows are read by [`crate::rows`]).
//! - [`eval_split`]: the one eval split of oxrl (a seeded fraction of the items held out), SFT's
//!   and RL's.
//! - [`data_loader`]: seeded per-epoch shuffled batches with a resumable position.
//! - [`metrics`]: `metrics.jsonl`, one line per step; [`plot`]: the runs' PNG plots.
//!
//! Like every trainer, nothing here knows the data-parallel size or the device.

pub mod async_groups;
pub mod broadcast_groups;
pub mod chat_mask;
pub mod choice;
pub mod config;
pub mod config_file;
pub mod data_loader;
pub mod eval_split;
pub mod group;
pub mod group_source;
pub mod metrics;
pub mod model_ids;
pub mod plot;
pub mod prompt_stream;
pub mod rl;
pub mod rl_config;
pub mod rl_eval;
pub mod rl_prompts;
pub mod rl_run;
pub mod rl_step;
pub mod rollout_stats;
pub mod rollouts;
pub mod run_dir;
pub mod sft;
pub mod sft_data;
pub mod staleness;
pub mod sync_groups;

pub use config::SftConfig;
pub use data_loader::{DataLoader, LoaderPosition};
pub use metrics::{MetricsWriter, StepMetrics};
pub use rl_config::RlConfig;
pub use run_dir::{FinishWhen, RunOptions};
pub use sft_data::{load_sft_dataset, SftDataset, SftExample};
