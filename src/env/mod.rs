//! Environments and rewards for RL: prompts as chat messages, model turns as text, rewards.
//!
//! This layer knows text, tokens and rewards; it does not know models, engines, devices or
//! training. The trainer samples turns with the engine and drives an [`Env`] per episode:
//! - [`protocol`]: the [`Env`] trait ([`Step`], [`Outcome`], [`Message`]) and [`run_episode`].
//! - [`sequence`]: an episode's token segments to input/target tokens and a loss mask that
//!   covers only model-generated tokens.
//! - [`registry`]: [`make_env`], the built-in envs by name from a dataset row.
//! - [`factory`]: [`EnvFactory`], which env runs a row (built-in, the user's Python reward
//!   function or env class, a library user's Rust env) and each episode's env.
//! - [`python`]: the user's Python code in a pool of worker processes; [`reward_config`] its
//!   `[reward]` section.
//! - [`prompts`]: prompt datasets (JSONL / Parquet) checked against their envs.
//! - built-ins: [`arithmetic`] (with a seeded generator), [`math`], [`countdown`],
//!   [`calculator`] (multi-turn tool use); shared checkers in [`answer`] and [`expr`].
//!
//! Prompt files are read with the row reader of [`crate::rows`] and its `on_bad_row` policy
//! ([`crate::rows::OnBadRow`]), so SFT and RL data share one reader and one policy.

pub mod answer;
pub mod arithmetic;
pub mod calculator;
pub mod countdown;
pub mod env_config;
pub mod expr;
pub mod factory;
pub mod fields;
pub mod math;
pub mod prompts;
pub mod protocol;
pub mod python;
pub mod registry;
pub mod reward_config;
pub mod sequence;

pub use arithmetic::{generate_arithmetic, sample_arithmetic, ArithmeticSpec};
pub use env_config::EnvConfig;
pub use factory::{EnvBuilder, EnvFactory, REWARD_FUNCTION};
pub use prompts::{load_prompts, load_prompts_for, PromptOptions, PromptRow, PromptSet};
pub use protocol::{messages_to_json, run_episode, Env, Message, Outcome, PendingStep, Step, Transcript};
pub use registry::{make_env, try_make_env, EnvError, ENV_NAMES};
pub use reward_config::{CustomFunction, OnError, RewardConfig};
pub use sequence::{build_sequence, Segment, Source, TrainingSequence};
