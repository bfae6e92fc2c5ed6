//! How the data-parallel ranks of a model share its training state (ZeRO stages): `none` (every
//! rank holds the whole model, its gradients and both AdamW moments), `optimizer` (each rank
//! keeps the moments and master weights of its slice and updates only it, then the parameters
//! are all-gathered), `gradients` (also only its slice of the summed gradients), `full` (also
//! only its slice of the parameters, gathered per layer for the forward and backward).
//!
//! The names are a closed choice (`train.sharding`, `launch.sharding`, `oxrl bench memory
//! --sharding`): an unknown one is an error with the nearest name. Only `none` is served yet;
//! [`Sharding::check_served`] refuses the others with an error saying what is missing, at
//! config load, before any model is built.

use crate::{Error, Result};

crate::choice! {
    /// What each data-parallel rank keeps of a model's training state.
    #[derive(Default)]
    pub enum Sharding("sharding") {
        /// Everything, on every rank.
        #[default]
        None = "none",
        /// ZeRO-1: a slice of the optimizer state.
        Optimizer = "optimizer",
        /// ZeRO-2: a slice of the optimizer state and of the summed gradients.
        Gradients = "gradients",
        /// ZeRO-3: a slice of the optimizer state, the gradients and the parameters.
        Full = "full",
    }
}

impl Sharding {
    /// Ok for a mode the workers can run; else an error naming what it would need.
    pub fn check_served(self) -> Result<()> {
        let missing = match self {
            Sharding::None => return Ok(()),
            Sharding::Optimizer => {
                "the workers do not yet split AdamW's moments and master weights by rank, update a \
                 slice and all-gather the parameters"
            }
            Sharding::Gradients => {
                "the gradient sum does not yet keep only each rank's slice of its reduce-scatter, and \
                 the optimizer state is not sliced either (`optimizer`)"
            }
            Sharding::Full => {
                "the forward and backward do not yet gather each layer's parameters from the ranks' \
                 slices (and free them after), and the gradients and optimizer state are not sliced \
                 either (`gradients`, `optimizer`)"
            }
        };
        Err(Error::input(format!("sharding = \"{self}\" is not available yet: {missing}; use \"none\"")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_what_is_served() {
        assert_eq!(Sharding::default(), Sharding::None);
        assert!(Sharding::None.check_served().is_ok());
        for s in [Sharding::Optimizer, Sharding::Gradients, Sharding::Full] {
            let e = s.check_served().unwrap_err().to_string();
            assert!(e.contains(&format!("\"{s}\"")) && e.contains("not available yet"), "{e}");
        }
        let e = Sharding::from_name("optimiser").unwrap_err();
        assert!(e.contains("did you mean `optimizer`"), "{e}");
    }
}
