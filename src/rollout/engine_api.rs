//! The HTTP API of an engine in a process of its own (`oxrl engine`), as both sides use it.
//!
//! ```text
//! GET  /health                          -> EngineInfo (JSON; no key needed)
//! POST /oxrl/v1/generate   Submit       -> RequestOutput     (MessagePack both ways)
//! POST /oxrl/v1/cancel     Ticket       -> ()
//! POST /oxrl/v1/pause      PauseMode    -> ()                 (returns once paused)
//! POST /oxrl/v1/resume                  -> ()
//! POST /oxrl/v1/weights    safetensors  -> ()                 (applied whole, or refused whole)
//! ```
//! MessagePack keeps every log-prob's bits. An error is a non-2xx status with the reason as
//! text. With API keys, every route but `/health` needs `Authorization: Bearer KEY`.

use serde::{Deserialize, Serialize};

use super::engine::{EngineHealth, Ticket};
use super::request::Request;

pub const HEALTH: &str = "/health";
pub const GENERATE: &str = "/oxrl/v1/generate";
pub const CANCEL: &str = "/oxrl/v1/cancel";
pub const PAUSE: &str = "/oxrl/v1/pause";
pub const RESUME: &str = "/oxrl/v1/resume";
pub const WEIGHTS: &str = "/oxrl/v1/weights";
pub const MSGPACK: &str = "application/msgpack";

/// A request under the caller's ticket (its name for [`CANCEL`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Submit {
    pub ticket: Ticket,
    pub request: Request,
}

/// What `/health` says.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineInfo {
    /// The served model's name (its directory's name).
    pub model: String,
    /// The compute dtype (`f32`, `bf16`).
    pub dtype: String,
    /// The weight version serving now (0 = the weights it was started with).
    pub version: u64,
    /// Adapters' rank it takes (0 = full weights only).
    pub lora_rank: usize,
    pub health: EngineHealth,
}
