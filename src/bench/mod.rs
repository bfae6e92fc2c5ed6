//! The benchmark model and workloads, shared by `oxrl bench`, `cargo bench` and the peer script
//! (`benches/peers/`), so that every figure in BENCHMARKS.md measures one definition.
//!
//! - [`model`]: the benchmark model (qwen3-shaped, hidden 256, 4 layers, vocab 4096, 6.0 M
//!   parameters, seeded random init) and writing it, with its workloads' tokens, as a Hugging Face
//!   directory the peers load;
//! - [`workloads`]: the two workloads, a training step (forward + backward + AdamW on
//!   8 × 128 tokens through a [`crate::worker::Worker`]) and greedy decoding (prompt 16, 32 new
//!   tokens, 1 / 16 / 64 concurrent requests through [`crate::rollout::EngineCore`]);
//! - [`memory`]: what one training rank holds (parameters, gradients, optimizer state,
//!   activations), predicted from the model's config;
//! - [`timing`]: medians of repeated runs and the one-JSON-line-per-measurement record.
//!
//! Benchmarks are not tests: nothing here runs in `cargo test` beyond a smoke test of the CLI.

pub mod memory;
pub mod model;
pub mod timing;
pub mod workloads;
