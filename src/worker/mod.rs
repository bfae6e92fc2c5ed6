//! One data-parallel rank: parameters, optimizer state, gradient accumulators.
//!
//! A [`Worker`] owns a model whose trainable parameters are either every base weight (full
//! fine-tuning) or fresh LoRA adapters, optionally a critic's value head, one gradient
//! accumulator per trainable parameter and AdamW moments. Its calls follow the worker contract
//! of docs/architecture.md:
//! - [`Worker::forward_backward`]: micro-batches ([`packing`]) are right-padded, run, and the loss
//!   ([`loss_fn`]) is the plain sum `Σ_datums Σ_t loss_t · w_t`; gradients are added to the
//!   accumulators; metrics merge exactly; one record per datum comes back in input order.
//! - [`Worker::forward_backward_for_step`]: the same when the optimizer step comes next, which
//!   lets `full` sharding sum each gradient to its owner during the backward (`unit_reduce.rs`).
//!   Under `gradient_sum = "micro_batch"` every backward sums each micro-batch's gradients
//!   across the ranks as it goes ([`gradient_sum`]).
//! - [`Worker::forward`]: the same without gradients.
//! - [`Worker::optim_step`]: AdamW ([`adamw`]) with optional global-norm clipping.
//! - [`Worker::save_state`] / [`Worker::load_state`] / [`Worker::export`]: [`checkpoint`].
//!
//! A bf16 / f16 model trains in mixed precision by default ([`mixed_precision`]): f32 master
//! weights and moments, bf16 forward and backward.
//!
//! Simplifications: one device, one thread of control; the learning-rate schedule ([`schedule`]) is a pure
//! function the caller applies when it builds [`AdamParams`].

pub mod adamw;
mod adamw_fused;
pub mod batch;
pub mod checkpoint;
pub mod gradient_sum;
mod head_stream;
pub(crate) mod in_place;
pub mod loss_fn;
mod micro_batch;
pub mod mixed_precision;
pub mod packing;
pub mod placement;
pub mod rng;
pub mod schedule;
mod sharded_step;
pub mod sharding;
mod unit_reduce;
pub mod value_head;
mod weight_slices;
#[allow(clippy::module_inception)] // `Worker` in worker.rs: the file named for what it holds
mod worker;
pub mod worker_config;

pub use adamw::AdamParams;
pub use batch::{Datum, LossFnInputs, LossFnOutput};
pub use gradient_sum::GradientSum;
pub use schedule::LrSchedule;
pub use sharded_step::RankExchange;
pub use sharding::{ShardPlan, Sharding};
pub use worker::{ForwardBackwardOutput, Worker};
pub use worker_config::WorkerConfig;
