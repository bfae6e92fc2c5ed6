//! Which parts of which roles are resident on a shared device (colocation).
//!
//! Roles (policy, reference, critic) colocated on one device take turns. Rules:
//! - before a role runs, every *other* role is offloaded entirely (model and optimizer) and the
//!   parts this call needs are brought back (a forward needs the model; a training step needs
//!   the model and the optimizer state);
//! - `init_model` of a role leaves only that role resident.
//!
//! This module is the pure state machine; [`super::group`] applies its decisions to workers.

use std::collections::BTreeMap;

use super::Role;

/// The parts of a role that can be resident.
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    Offload(Role, Parts),
    Backload(Role, Parts),
}

#[derive(Debug, Default, Clone)]
pub struct Residency {
    resident: BTreeMap<Role, Parts>,
}

impl Residency {
    pub fn resident(&self, role: Role) -> Parts {
        self.resident.get(&role).copied().unwrap_or(Parts::NONE)
    }

    /// A role was just created on the device (everything resident); others go to the host.
    pub fn init_model(&mut self, role: Role) -> Vec<Move> {
        let mut moves = self.offload_others(role);
        self.resident.insert(role, Parts::ALL);
        moves.retain(|m| !matches!(m, Move::Offload(_, p) if *p == Parts::NONE));
        moves
    }

    /// The moves that make `needs` of `role` resident and nothing of any other role.
    pub fn prepare(&mut self, role: Role, needs: Parts) -> Vec<Move> {
        let mut moves = self.offload_others(role);
        let have = self.resident(role);
        let missing = Parts { model: needs.model && !have.model, optimizer: needs.optimizer && !have.optimizer };
        if missing != Parts::NONE {
            moves.push(Move::Backload(role, missing));
        }
        self.resident
            .insert(role, Parts { model: have.model || needs.model, optimizer: have.optimizer || needs.optimizer });
        moves
    }

    fn offload_others(&mut self, role: Role) -> Vec<Move> {
        let mut moves = vec![];
        for (&r, parts) in self.resident.iter_mut() {
            if r != role && *parts != Parts::NONE {
                moves.push(Move::Offload(r, *parts));
                *parts = Parts::NONE;
            }
        }
        moves
    }
}
