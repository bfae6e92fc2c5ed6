//! Which parts of which models are resident on a shared device (colocation).
//!
//! Models (policy, reference, critic, …, by id) colocated on one device take turns. Rules:
//! - before a model runs, every *other* model is offloaded entirely (model and optimizer) and the
//!   parts this call needs are brought back (a forward needs the model; a training step needs
//!   the model and the optimizer state);
//! - creating a model leaves only that model resident; a dropped model is forgotten.
//!
//! This module is the pure state machine; [`super::worker_group`] applies its decisions to workers.

use std::collections::BTreeMap;

/// The parts of a model that can be resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Parts {
    pub model: bool,
    pub optimizer: bool,
}

impl Parts {
    pub const NONE: Parts = Parts { model: false, optimizer: false };
    pub const MODEL: Parts = Parts { model: true, optimizer: false };
    pub const ALL: Parts = Parts { model: true, optimizer: true };
}

/// One move the caller must carry out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Move {
    Offload(String, Parts),
    Backload(String, Parts),
}

#[derive(Debug, Default, Clone)]
pub struct Residency {
    resident: BTreeMap<String, Parts>,
}

impl Residency {
    pub fn resident(&self, id: &str) -> Parts {
        self.resident.get(id).copied().unwrap_or(Parts::NONE)
    }

    /// A model was dropped.
    pub fn forget(&mut self, id: &str) {
        self.resident.remove(id);
    }

    /// A model was just created on the device (everything resident); others go to the host.
    pub fn init_model(&mut self, id: &str) -> Vec<Move> {
        let mut moves = self.offload_others(id);
        self.resident.insert(id.to_string(), Parts::ALL);
        moves.retain(|m| !matches!(m, Move::Offload(_, p) if *p == Parts::NONE));
        moves
    }

    /// The moves that make `needs` of model `id` resident and nothing of any other model.
    pub fn prepare(&mut self, id: &str, needs: Parts) -> Vec<Move> {
        let mut moves = self.offload_others(id);
        let have = self.resident(id);
        let missing = Parts { model: needs.model && !have.model, optimizer: needs.optimizer && !have.optimizer };
        if missing != Parts::NONE {
            moves.push(Move::Backload(id.to_string(), missing));
        }
        self.resident.insert(
            id.to_string(),
            Parts { model: have.model || needs.model, optimizer: have.optimizer || needs.optimizer },
        );
        moves
    }

    fn offload_others(&mut self, id: &str) -> Vec<Move> {
        let mut moves = vec![];
        for (other, parts) in self.resident.iter_mut() {
            if other != id && *parts != Parts::NONE {
                moves.push(Move::Offload(other.clone(), *parts));
                *parts = Parts::NONE;
            }
        }
        moves
    }
}
