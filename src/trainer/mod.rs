//! Trainers: algorithms over time. Supervised fine-tuning ([`sft`]: the loop), synchronous RL
//! ([`rl`]: the loop) and fully asynchronous RL ([`rl_async`]: generation workers and the
//! trainer), and what they are built on:
//!
//! - [`rl_run`]: what both RL loops share (set-up and resume, the training half of a step,
//!   weight pushes, metrics lines, evaluation, checkpoints); [`rl_step`]: one step's numbers;
//!   [`rollouts`]: episodes on the engines; [`staleness`] and [`prompt_stream`]: the async
//!   trainer's staleness control and its resumable prompt ids.
//! - [`config_file`]: TOML run configs — defaults, file, `--set` overrides, checked keys with
//!   suggestions; generic over the config type, so the RL config reuses it.
//! - [`config`]: the SFT config (`[model]`, `[data]`, `[optimizer]`, `[schedule]`, `[train]`,
//!   `[output]`).
//! - [`rl_config`]: the RL config (the SFT sections plus `[env]`, `[rollout]`, `[algorithm]`,
//!   `[critic]`, `[async_rl]`, `[launch]`), and [`rl_ids`], the ids of an RL run's models.
//! - [`chat_mask`]: tokens and trained-token mask of a conversation by incremental rendering.
//! - [`sft_data`]: rows → conversations → `{input_tokens, target_tokens, weights}` examples,
//!   truncation, eval split, bad-row policy (rows are read by [`crate::rows`]).
//! - [`eval_split`]: the eval split (a seeded fraction of the training items held out), used
//!   by SFT and meant for every trainer.
//! - [`data_loader`]: seeded per-epoch shuffled batches with a resumable position.
//! - [`metrics`]: `metrics.jsonl`, one line per step.
//! - [`plot`]: `loss.png`, train and eval loss against step; the RL run's curves.
//!
//! Like every trainer, nothing here knows the data-parallel size or the device.

pub mod chat_mask;
pub mod config;
pub mod config_file;
pub mod data_loader;
pub mod eval_split;
pub mod metrics;
pub mod plot;
pub mod prompt_stream;
pub mod rl;
pub mod rl_async;
pub mod rl_config;
pub mod rl_ids;
pub mod rl_run;
pub mod rl_step;
pub mod rollouts;
pub mod sft;
pub mod sft_data;
pub mod staleness;

pub use config::SftConfig;
pub use data_loader::{DataLoader, LoaderPosition};
pub use metrics::{MetricsWriter, StepMetrics};
pub use rl_config::RlConfig;
pub use sft_data::{load_sft_dataset, SftDataset, SftExample};
