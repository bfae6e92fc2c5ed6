//! The user's own Python code as environments: reward functions (verl's `compute_score`) and
//! multi-turn text environments (SkyRL-gym's shape), run in a pool of the user's interpreter.
//!
//! - [`pool`]: the worker processes, their protocol, timeouts, restarts and clean-up.
//! - [`user_code`]: the pool as the envs share it, with `reward.on_error` and the messages.
//! - [`reward_fn`]: a single-turn row scored by the reward function.
//! - [`text_env`]: a multi-turn Python env instance per episode.
//!
//! Which rows run here is the [`super::EnvFactory`]'s choice.

pub mod pool;
pub mod reward_fn;
pub mod text_env;
pub mod user_code;

pub use pool::{CallResult, PoolSpec, PythonPool, Ready};
pub use reward_fn::RewardFnEnv;
pub use text_env::PythonTextEnv;
pub use user_code::UserCode;
