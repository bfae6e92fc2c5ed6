//! Engines of their own that the trainer's processes share (remote, or processes of its MPI
//! job): process 0 alone pauses, resumes and updates them — over the job's engine link when they
//! are its processes, else over their APIs — and every process waits at an update until process 0
//! tells how it went, so that none samples the next step on the old weights.

use super::weight_broadcast;
use crate::model::SamplerWeights;
use crate::world::{decode, encode, World};
use crate::{Error, Result};

/// Who leads the shared engines, and how process 0 reaches them.
pub(super) struct Sharing {
    world: &'static dyn World,
    /// The job's engine link and the engines' URLs (its ranks 1, 2, …).
    link: Option<(&'static dyn World, Vec<String>)>,
}

/// How an update went, as process 0 tells the others.
#[derive(serde::Serialize, serde::Deserialize)]
enum Verdict {
    Applied,
    Down(String),
    Failed(String),
}

impl Sharing {
    /// The sharing of engines by the processes of `world` (none when one process uses engines
    /// that are not the job's).
    pub fn new(world: &'static dyn World, link: Option<(&'static dyn World, Vec<String>)>) -> Option<Sharing> {
        (world.size() > 1 || link.is_some()).then_some(Sharing { world, link })
    }

    /// Whether this process leaves pause, resume and updates to process 0.
    pub fn follower(&self) -> bool {
        self.world.rank() != 0
    }

    /// An update of the shared engines, in every process at once: process 0 sends `weights` over
    /// the engine link, or applies them with `own` (its engine client's update) when the engines
    /// are not the job's processes, then tells every process the outcome, which each returns.
    pub fn update(&self, weights: &SamplerWeights, own: impl FnOnce() -> Result<()>) -> Result<()> {
        let mine = match (self.world.rank(), &self.link) {
            (0, Some((link, urls))) => weight_broadcast::send_weights(*link, urls, weights),
            (0, None) => own(),
            _ => Ok(()),
        };
        let verdict = match mine {
            Ok(()) => Verdict::Applied,
            Err(Error::EngineDown(why)) => Verdict::Down(why),
            Err(e) => Verdict::Failed(e.to_string()),
        };
        let mut bytes = encode(&verdict)?;
        self.world.broadcast(0, &mut bytes)?;
        match decode(&bytes)? {
            Verdict::Applied => Ok(()),
            Verdict::Down(why) => Err(Error::EngineDown(why)),
            Verdict::Failed(why) => Err(Error::Other(why)),
        }
    }
}
