//! Pure functions on tensors: log-probs, losses, advantage and KL estimators, reductions.
