//! Sampling from a model.
