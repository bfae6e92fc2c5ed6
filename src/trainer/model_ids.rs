//! The dispatch ids of a run's models, shared by the launcher (which creates them), the loops
//! (which call them) and the run directory (which checkpoints them, one folder each).

/// The trained policy (SFT and RL).
pub const POLICY: &str = "policy";
/// The frozen reference policy of the KL penalty (only forward runs on it).
pub const REFERENCE: &str = "ref";
/// The value model of GAE.
pub const CRITIC: &str = "critic";
