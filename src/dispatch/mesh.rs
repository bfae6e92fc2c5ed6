//! Mesh coordinates of the workers of a group, and each worker's own registration of them.
//!
//! A mesh of shape (dp, tp, sp, pp) numbers its workers in row-major order with pp fastest:
//! rank = ((dp·TP + tp)·SP + sp)·PP + pp. A worker is a *collection rank* of a mesh when
//! tp = 0, sp = 0 and it is the last pipeline stage: only its outputs are kept, so tensor- or
//! sequence-parallel replicas never duplicate a datum or a metric. Registration is state of the
//! worker instance ([`MeshRegistry`] lives inside each worker), never a global: two groups in one
//! process cannot see each other's registrations.

use std::collections::BTreeMap;

use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape {
    pub dp: usize,
    pub tp: usize,
    pub sp: usize,
    pub pp: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MeshCoord {
    pub dp: usize,
    pub tp: usize,
    pub sp: usize,
    pub pp: usize,
}

impl MeshShape {
    /// Data parallelism only.
    pub fn dp(dp: usize) -> Self {
        MeshShape { dp, tp: 1, sp: 1, pp: 1 }
    }

    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 || self.sp == 0 || self.pp == 0 {
            return Err(Error::input(format!("mesh sizes must be positive, got {self:?}")));
        }
        Ok(())
    }

    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.sp * self.pp
    }

    /// The coordinate of each global rank, in rank order.
    pub fn coords(&self) -> Vec<MeshCoord> {
        let mut out = Vec::with_capacity(self.world_size());
        for dp in 0..self.dp {
            for tp in 0..self.tp {
                for sp in 0..self.sp {
                    for pp in 0..self.pp {
                        out.push(MeshCoord { dp, tp, sp, pp });
                    }
                }
            }
        }
        out
    }

    pub fn is_collection(&self, c: &MeshCoord) -> bool {
        c.tp == 0 && c.sp == 0 && c.pp == self.pp - 1
    }
}

/// What a worker knows about itself in one mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshInfo {
    pub coord: MeshCoord,
    pub dp_rank: usize,
    pub dp_size: usize,
    pub collect: bool,
}

/// A worker's registrations, by mesh name.
#[derive(Debug, Default, Clone)]
pub struct MeshRegistry {
    meshes: BTreeMap<String, MeshInfo>,
}

impl MeshRegistry {
    pub fn register(&mut self, name: &str, shape: &MeshShape, coord: MeshCoord) -> Result<MeshInfo> {
        shape.validate()?;
        if self.meshes.contains_key(name) {
            return Err(Error::input(format!("mesh `{name}` is already registered on this worker")));
        }
        if coord.dp >= shape.dp || coord.tp >= shape.tp || coord.sp >= shape.sp || coord.pp >= shape.pp {
            return Err(Error::input(format!("coordinate {coord:?} is outside mesh {shape:?}")));
        }
        let info = MeshInfo { coord, dp_rank: coord.dp, dp_size: shape.dp, collect: shape.is_collection(&coord) };
        self.meshes.insert(name.to_string(), info);
        Ok(info)
    }

    pub fn get(&self, name: &str) -> Result<MeshInfo> {
        self.meshes
            .get(name)
            .copied()
            .ok_or_else(|| Error::input(format!("mesh `{name}` is not registered on this worker")))
    }
}
