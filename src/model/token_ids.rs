//! The one check of token ids against a model's vocabulary, for every entry point that takes
//! ids from outside (the model's forward, worker batches, rollout requests, `oxrl score`): an
//! id ≥ `vocab_size` would index past the embedding table.

use std::fmt::Display;

use crate::{Error, Result};

/// Checks that every id is below `vocab_size`. The error starts with `what` (the sequence's
/// name, e.g. `datum 3: input_tokens`) and names the first bad id and its position.
pub fn check_token_ids(ids: &[u32], vocab_size: usize, what: impl Display) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab_size) {
        Some(pos) => Err(Error::input(format!(
            "{what}: token id {} at position {pos} is out of range for vocab_size {vocab_size}",
            ids[pos]
        ))),
        None => Ok(()),
    }
}
