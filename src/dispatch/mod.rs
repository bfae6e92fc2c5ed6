//! Dispatch: the layer between trainers and workers (DESIGN.md, "Dispatch").
//!
//! A trainer calls a [`group::WorkerGroup`] per role as if there were one worker; the group
//! splits batches over its data-parallel mesh, runs each worker on its own thread, all-reduces
//! gradients with SUM before the optimizer step, keeps the outputs of collection ranks only, and
//! moves colocated roles between device and host. The trainer never learns the dp size; it asks
//! for the batch-size multiple it needs ([`lcm_dp_size`]).

pub mod collective;
pub mod group;
pub mod mesh;
pub mod residency;
pub mod roles;
pub mod split;

pub use group::WorkerGroup;
pub use roles::Dispatch;

/// The roles a trainer may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Policy,
    Reference,
    Critic,
}

impl Role {
    pub fn parse(name: &str) -> crate::Result<Role> {
        match name {
            "policy" => Ok(Role::Policy),
            "ref" | "reference" => Ok(Role::Reference),
            "critic" => Ok(Role::Critic),
            _ => Err(crate::Error::input(format!("unknown role `{name}` (policy, reference, critic)"))),
        }
    }
}

/// The batch-size multiple every role can split evenly: the lcm of their dp sizes.
pub fn lcm_dp_size(dp_sizes: &[usize]) -> usize {
    split::lcm(dp_sizes)
}
