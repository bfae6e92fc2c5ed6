//! The integration tests, as one test binary: one module per file, each for one part of oxrl
//! (a module docstring says which). One binary links once, where a binary per file linked the
//! whole crate and its dependencies 43 times (2.1 GB of binaries with line tables only; with full
//! debug info each was over 100 MB, and together they filled a CI machine's disk). `cargo test
//! --test integration rl_loop::` runs one file's tests.
//!
//! Two suites stay binaries of their own: `dispatch_offload` (a counting global allocator that
//! must see no other test's allocations) and `gpu` (`cargo test --features cuda --test gpu`).

#[path = "../common/mod.rs"]
mod common;

mod activation_checkpointing;
mod algo_estimators;
mod algo_gradients;
mod algo_losses;
mod candle_backward;
mod cli;
mod cli_bench;
mod cli_plot;
mod config;
mod config_saved;
mod core_api;
mod cuda_kernels_emulated;
mod dispatch_group;
mod dispatch_units;
mod engine_completions;
mod engine_lm_eval;
mod engine_openai;
mod engine_streaming;
mod engine_tools;
mod env_checkers;
mod env_episodes;
mod env_prompts;
mod exact_on_policy;
mod family_runs;
mod gemma3_runs;
mod hub_models;
mod model_errors;
mod model_features;
mod model_gemma3;
mod model_golden;
mod model_named_tensors;
mod model_qwen3_5;
mod model_qwen3_moe;
mod model_tape;
#[cfg(feature = "mpi")]
mod mpi_rl;
#[cfg(feature = "mpi")]
mod mpi_sft;
mod one_logprob;
mod png_pixels;
mod prompt_budgets;
mod python_rewards;
mod qwen3_5_runs;
mod qwen3_moe_runs;
mod remote_engine;
mod rl_async;
mod rl_async_staleness;
mod rl_config;
mod rl_library_cli;
mod rl_loop;
mod rl_plots;
mod rl_resume;
mod rl_rollouts;
mod rl_step;
mod rollout_adapters;
mod rollout_engine;
mod rollout_topk;
mod rollout_updates;
mod rollout_versions;
mod server_fairness;
mod server_fuzz;
mod server_hostile;
mod server_protocol;
mod server_sdk;
mod sft_data;
mod sft_loop;
mod sft_metrics;
mod tokenizer;
mod tracking;
mod train_memory;
mod worker_exactness;
mod worker_losses;
mod worker_mixed_precision;
mod worker_state;
