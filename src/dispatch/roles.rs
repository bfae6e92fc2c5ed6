//! [`Dispatch`]: the worker groups of every role, and colocation between them.
//!
//! The trainer calls `dispatch.forward_backward(Role::Policy, ...)` and never sees a mesh. When
//! the roles are colocated (they share one device), each call first applies the moves of the
//! [`Residency`] state machine: the other roles are offloaded, the parts this call needs are
//! brought back (a forward needs the model; training needs model and optimizer).

use std::collections::BTreeMap;

use serde_json::Value;

use super::group::{BuildWorker, WorkerGroup};
use super::mesh::MeshShape;
use super::residency::{Move, Parts, Residency};
use super::{lcm_dp_size, Role};
use crate::worker::{AdamParams, Datum, ForwardBackwardOutput};
use crate::{Error, Result};

#[derive(Default)]
pub struct Dispatch {
    groups: BTreeMap<Role, WorkerGroup>,
    /// All roles share one device and take turns on it.
    pub colocated: bool,
    residency: Residency,
}

impl Dispatch {
    pub fn new(colocated: bool) -> Self {
        Dispatch { groups: BTreeMap::new(), colocated, residency: Residency::default() }
    }

    /// Creates the worker group of `role`; with colocation only this role stays resident.
    pub fn init_model(&mut self, role: Role, mesh: MeshShape, build: BuildWorker) -> Result<()> {
        if self.groups.contains_key(&role) {
            return Err(Error::input(format!("role {role:?} is already initialised")));
        }
        if self.colocated {
            let moves = self.residency.init_model(role);
            self.apply(&moves)?;
        }
        self.groups.insert(role, WorkerGroup::new(role, mesh, build)?);
        Ok(())
    }

    pub fn group(&self, role: Role) -> Result<&WorkerGroup> {
        self.groups
            .get(&role)
            .ok_or_else(|| Error::input(format!("role {role:?} has no workers (call init_model first)")))
    }

    pub fn group_mut(&mut self, role: Role) -> Result<&mut WorkerGroup> {
        self.groups
            .get_mut(&role)
            .ok_or_else(|| Error::input(format!("role {role:?} has no workers (call init_model first)")))
    }

    /// The batch-size multiple every role can split evenly.
    pub fn lcm_dp_size(&self) -> usize {
        lcm_dp_size(&self.groups.values().map(|g| g.dp_size()).collect::<Vec<_>>())
    }

    pub fn residency(&self) -> &Residency {
        &self.residency
    }

    fn apply(&self, moves: &[Move]) -> Result<()> {
        for m in moves {
            match *m {
                Move::Offload(r, parts) => self.group(r)?.offload(parts)?,
                Move::Backload(r, parts) => self.group(r)?.backload(parts)?,
            }
        }
        Ok(())
    }

    fn prepare(&mut self, role: Role, needs: Parts) -> Result<&WorkerGroup> {
        self.group(role)?;
        if self.colocated {
            let moves = self.residency.prepare(role, needs);
            self.apply(&moves)?;
        }
        self.group(role)
    }

    pub fn forward_backward(
        &mut self,
        role: Role,
        batch: &[Datum],
        loss_fn: &str,
        config: &Value,
        per_token: bool,
    ) -> Result<ForwardBackwardOutput> {
        self.prepare(role, Parts::ALL)?.forward_backward(batch, loss_fn, config, per_token)
    }

    pub fn forward(
        &mut self,
        role: Role,
        batch: &[Datum],
        loss_fn: Option<(&str, &Value)>,
    ) -> Result<ForwardBackwardOutput> {
        self.prepare(role, Parts::MODEL)?.forward(batch, loss_fn)
    }

    pub fn stage(&mut self, role: Role, minibatches: &[Vec<Datum>]) -> Result<()> {
        self.group_mut(role)?.stage(minibatches)
    }

    pub fn forward_backward_staged(
        &mut self,
        role: Role,
        index: usize,
        loss_fn: &str,
        config: &Value,
        per_token: bool,
    ) -> Result<ForwardBackwardOutput> {
        self.prepare(role, Parts::ALL)?.forward_backward_staged(index, loss_fn, config, per_token)
    }

    pub fn optim_step(&mut self, role: Role, params: &AdamParams) -> Result<f64> {
        self.prepare(role, Parts::ALL)?.optim_step(params)
    }

    pub fn save_state(&mut self, role: Role, dir: &std::path::Path) -> Result<()> {
        self.prepare(role, Parts::ALL)?.save_state(dir)
    }

    pub fn load_state(&mut self, role: Role, dir: &std::path::Path) -> Result<()> {
        self.prepare(role, Parts::ALL)?.load_state(dir)
    }

    pub fn export(&mut self, role: Role, dir: &std::path::Path, merge_lora: bool) -> Result<()> {
        self.prepare(role, Parts::MODEL)?.export(dir, merge_lora)
    }
}
