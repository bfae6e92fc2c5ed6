//! Trainers: algorithms over time, in two wings over a shared run layer.
//!
//! - [`sft`]: supervised fine-tuning — the loop, its config ([`sft::config`]: the shared
//!   sections plus `[data]` and `[train]`), its data ([`sft::data`]: rows → conversations →
//!   `{input_tokens, target_tokens, weights}` examples, truncation, bad-row policy) and the chat
//!   mask ([`sft::chat_mask`]: tokens and trained-token mask of a conversation by incremental
//!   rendering).
//! - [`rl`]: RL — one loop for both modes over a source of groups ([`rl::sync_groups`],
//!   generated each step; [`rl::async_groups`], generated in the background under staleness
//!   control, [`rl::staleness`] and [`rl::prompt_stream`]; [`rl::broadcast_groups`] across
//!   processes), a run in progress ([`rl::run`]), one step's numbers ([`rl::step`]), groups
//!   ([`rl::group`]), episodes on the engines ([`rl::episodes`]), evaluation, prompts, the RL
//!   config ([`rl::config`]: the shared sections plus `[data]`, `[env]`, `[rollout]`,
//!   `[algorithm]`, `[critic]`, `[train]`, `[async_rl]`, `[launch]`, built once into an
//!   `RlPlan`).
//!
//! What both stand on:
//! - [`run_dir`]: the run directory both trainers write — new vs resume, `config.toml`,
//!   `metrics.jsonl`, plots, checkpoints in one layout, the final export, Ctrl-C, `finish_when`.
//! - [`config_file`]: TOML run configs — defaults, file, `--set` overrides, checked keys with
//!   suggestions; generic over the config type (closed choices as enums: [`crate::choice`](mod@crate::choice)).
//! - [`sections`]: the config sections both configs have (`[model]`, `[optimizer]`,
//!   `[schedule]`, `[output]`, the `[data]` setting `on_bad_row`); [`model_ids`]: the ids of a
//!   run's models.
//! - [`eval_split`]: the one eval split of oxrl (a seeded fraction of the items held out), SFT's
//!   and RL's.
//! - [`data_loader`]: seeded per-epoch shuffled batches with a resumable position.
//! - [`metrics`]: `metrics.jsonl`, one line per step; [`plot`]: the runs' PNG plots.
//! - [`tracking`]: the same lines to TensorBoard and W&B (`[tracking]`, in both configs).
//!
//! Like every trainer, nothing here knows the data-parallel size or the device.

pub mod config_file;
pub mod data_loader;
pub mod eval_split;
pub mod metrics;
pub mod model_ids;
pub mod plot;
pub mod rl;
pub mod run_dir;
pub mod sections;
pub mod sft;
pub mod tracking;

pub use data_loader::{DataLoader, LoaderPosition};
pub use metrics::{MetricsWriter, StepMetrics};
pub use rl::config::RlConfig;
pub use run_dir::{FinishWhen, RunOptions};
pub use sft::config::SftConfig;
pub use sft::data::{load_sft_dataset, SftDataset, SftExample};
