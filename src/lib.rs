//! oxrl: an LLM post-training engine (SFT and RL) for decoder-only transformers in the
//! Hugging Face format.
//!
//! The modules follow the layers of docs/architecture.md; each may use only the layers above it here:
//! - [`model`]: architectures, HF I/O, LoRA, training forward, KV-cache decode.
//! - [`algo`]: pure functions on tensors (losses, advantages, KL, reductions).
//! - [`worker`]: one data-parallel rank (forward_backward, optim_step, checkpoints).
//! - [`world`]: the processes of a run (one, or many under MPI): their roles, the collectives
//!   everything across processes is built on, the same-run check.
//! - [`dispatch`]: worker groups per role over a data-parallel mesh, colocation.
//! - [`rollout`]: the sampling engine, its client, weight updates (beside `dispatch`, over
//!   `world`: neither imports the other).
//! - [`env`](mod@env): RL environments and rewards (text and tokens in, rewards out; no models).
//! - [`trainer`]: the SFT loop, run configs, datasets, metrics and plots.
//! - [`launch`]: run configs → ready workers and engines (devices, meshes, thread budgets).
//! - [`server`]: the Tinker-compatible HTTP server (`oxrl serve`).
//! - [`engine_server`]: one sampling engine as a server (`oxrl engine`): oxrl's API for
//!   trainers in other processes, and OpenAI's.
//! - [`cli`]: the `oxrl` command line.
//! - [`bench`](mod@bench): the benchmark model and workloads (`oxrl bench`, `cargo bench`, the peer script).
//!
//! Beside them: [`handle`] (results of submitted calls, awaited or waited on); [`actor`]
//! (the threads that own workers and engines, each with its own tensor-math thread budget);
//! [`rows`] (JSONL / Parquet dataset rows and the `on_bad_row` policy, shared by the SFT data of
//! the trainer and the prompt sets of env); [`splitmix`] (SplitMix64, the generator of oxrl's own
//! seed streams); [`memory`] (the process's peak resident set size).

pub mod actor;
pub mod algo;
pub mod bench;
pub mod child_process;
pub mod choice;
pub mod cli;
pub mod dates;
pub mod dispatch;
pub mod engine_server;
pub mod env;
pub mod error;
pub mod failpoint;
pub mod files;
pub mod handle;
pub mod launch;
pub mod locks;
pub mod memory;
pub mod model;
pub mod rollout;
pub mod rows;
pub mod server;
pub mod splitmix;
#[cfg(test)]
mod test_support;
pub mod trainer;
pub mod worker;
pub mod world;

pub use error::{Error, Result};
