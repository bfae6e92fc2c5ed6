//! Dispatch: the layer between trainers and workers (docs/architecture.md, "Dispatch").
//!
//! A trainer calls a model by id ([`Dispatch`]) as if there were one worker; its
//! [`WorkerGroup`] splits batches over the data-parallel mesh, runs each worker as an actor on
//! its own thread and thread budget, all-reduces gradients with SUM before the optimizer step
//! (or, under sharding, delivers each sum to the rank that owns the parameter and gathers the
//! updated parameters after it),
//! keeps the outputs of collection ranks only, and moves colocated models between device and
//! host. Launchers build the models from [`WorkerSpec`]s; the trainer never learns the device or
//! the dp size; it asks for the batch-size multiple it needs ([`Dispatch::batch_multiple`]).

pub mod base_models;
pub mod collective;
#[allow(clippy::module_inception)]
pub mod dispatch;
pub mod mesh;
pub mod owned_across;
pub mod residency;
pub mod split;
pub mod sum_across;
pub mod worker_group;
pub mod worker_spec;

pub use dispatch::Dispatch;
pub use mesh::MeshShape;
pub use worker_group::WorkerGroup;
pub use worker_spec::WorkerSpec;
