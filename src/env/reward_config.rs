//! The `[reward]` section of an RL config: the user's Python reward function (verl's
//! `custom_reward_function`) and the pool of Python workers that runs user code (the reward
//! function and the environments of `env.python_modules`).
//!
//! Every key is optional; unknown keys are rejected.

use serde::{Deserialize, Serialize};

crate::choice! {
    /// What a failure of the user's code (an exception, a timeout, a worker that died twice)
    /// does to the run.
    pub enum OnError("on_error") {
        /// Stop the run with the traceback and the row, after a checkpoint of the finished steps.
        Raise = "raise",
        /// Score the episode 0 and count it in the step's `reward_errors`.
        Zero = "zero",
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    /// `{ path = "reward.py", name = "compute_score" }`: called for every row that names no env
    /// as `name(data_source=, solution_str=, ground_truth=, extra_info=)`. Default: no path,
    /// none.
    pub custom_function: CustomFunction,
    /// Python worker processes (each process of a run has its own pool). Default 1.
    pub workers: usize,
    /// The interpreter that runs user code: the user's own, so their venv and packages work.
    /// Default `python3`.
    pub python: String,
    /// Longest one call of user code may run, in seconds. Default 60.
    pub timeout_s: f64,
    /// `raise` (default) or `zero`.
    pub on_error: OnError,
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig {
            custom_function: CustomFunction::default(),
            workers: 1,
            python: "python3".into(),
            timeout_s: 60.0,
            on_error: OnError::Raise,
        }
    }
}

impl RewardConfig {
    /// The reward function, when a path is set.
    pub fn function(&self) -> Option<&CustomFunction> {
        (!self.custom_function.path.is_empty()).then_some(&self.custom_function)
    }
}

/// A reward function: a Python file and the function's name in it (`compute_score` by default).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomFunction {
    pub path: String,
    pub name: String,
}

impl Default for CustomFunction {
    fn default() -> Self {
        CustomFunction { path: String::new(), name: "compute_score".into() }
    }
}
