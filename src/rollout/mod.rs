//! Rollout: sampling engines and the client over them.
//!
//! - [`sampler`]: one token from a row of logits (temperature, top-k, top-p, greedy).
//! - `row_math`: the sampler's passes over a row (max, Σ exp), AVX-512 where available.
//! - [`request`]: what a request asks for and gets back (tokens, log-probs, weight versions).
//! - [`engine_core`]: continuous batching over the KV-cache decode, stepped by its owner;
//!   pause (`abort` / `keep`), resume, versioned weight updates.
//! - [`scheduler`]: admission — which waiting requests join the batch, FIFO, under `max_batch`
//!   and the KV-cache budget.
//! - `prefill`: the prompts admitted in one step, prefilled in one forward per length.
//! - [`engine`]: an engine core on its own thread, driven through channels.
//! - [`sampling_engine`]: what the client needs of an engine, local or remote.
//! - [`remote_engine`]: an engine in another process (`oxrl engine`), over [`engine_api`].
//! - [`weight_broadcast`]: weights to the engines of the trainer's MPI job, over MPI.
//! - [`client`]: routing over N engines, abort-and-continue retry, pause/resume/update for all;
//!   `shared_engines`: engines shared by the processes of a job, led by process 0.
//! - [`chat`](mod@chat): messages in, the assistant's reply out (with the tokens the trainer needs).
//! - [`generate`](mod@generate): every prompt through a private engine in one call (`oxrl generate`).

pub mod chat;
pub mod client;
pub mod engine;
pub mod engine_api;
pub mod engine_core;
pub mod generate;
mod prefill;
mod radix_sort;
pub mod remote_engine;
pub mod request;
mod row_math;
pub mod sampler;
pub mod sampling_engine;
pub mod scheduler;
mod shared_engines;
pub mod top_logprobs;
pub mod weight_broadcast;

pub use crate::model::weight_update::WeightUpdate;
pub use chat::{chat, ChatReply};
pub use client::EngineClient;
pub use engine::{Engine, EngineHealth};
pub use engine_core::{EngineConfig, EngineCore, EngineStats, PauseMode, RequestId};
pub use generate::generate;
pub use remote_engine::RemoteEngine;
pub use request::{Generation, Request, RequestOutput, StopReason};
pub use sampler::SamplingParams;
pub use sampling_engine::SamplingEngine;
