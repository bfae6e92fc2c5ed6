//! One data-parallel rank: parameters, optimizer state, gradient accumulators.
