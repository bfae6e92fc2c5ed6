//! Sampling from a model.

pub mod generate;
pub mod sampler;

pub use generate::{generate, Generation, StopReason};
pub use sampler::SamplingParams;
