//! The dispatch ids of an RL run's models, shared by the launcher (which creates them) and the
//! loop (which calls them).

/// The trained policy (the SFT trainer's id too).
pub use super::sft::POLICY;
/// The frozen reference policy of the KL penalty (only forward runs on it).
pub const REFERENCE: &str = "ref";
/// The value model of GAE.
pub const CRITIC: &str = "critic";
