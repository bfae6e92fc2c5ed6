//! The user's Python code as the environments see it: the worker pool, the failure policy
//! (`reward.on_error`) and the wording of every failure, which names the function or class, the
//! row (`file:line`) and what went wrong (the Python traceback, the limit, the bad value).

use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;

use super::pool::{CallResult, PythonPool};
use crate::env::reward_config::{CustomFunction, OnError};
use crate::{Error, Result};

/// Failures printed as warnings under `on_error = "zero"` before they are only counted.
const MAX_WARNINGS: usize = 5;

pub struct UserCode {
    pub pool: PythonPool,
    pub on_error: OnError,
    pub function: Option<CustomFunction>,
    pub timeout_s: f64,
    warned: AtomicUsize,
}

/// A call's value, or why the user's code failed on a row whose failures score 0.
pub type Answer = std::result::Result<Value, String>;

impl UserCode {
    pub fn new(pool: PythonPool, on_error: OnError, function: Option<CustomFunction>, timeout_s: f64) -> UserCode {
        UserCode { pool, on_error, function, timeout_s, warned: AtomicUsize::new(0) }
    }

    /// `reward.custom_function `compute_score` (reward.py)`: the reward function, for messages.
    pub fn function_label(&self) -> String {
        match &self.function {
            Some(f) => format!("reward.custom_function `{}` ({})", f.name, f.path),
            None => "reward.custom_function".into(),
        }
    }

    /// A finished call as its value, a failure scored 0 (`on_error = "zero"`), or the error that
    /// stops the run. A wrong return type is always an error: it is a bug in the code, not a
    /// case of the data.
    pub fn answer(&self, who: &str, source: &str, result: Result<CallResult>) -> Result<Answer> {
        let why = match result? {
            CallResult::Ok(v) => return Ok(Ok(v)),
            CallResult::BadReturn(what) => {
                return Err(Error::UserCode(format!("{who} returned a bad value for row {source}: {what}")))
            }
            CallResult::Raised(traceback) => format!("{who} raised on row {source}:\n{traceback}"),
            CallResult::TimedOut(limit) => format!(
                "{who} ran longer than reward.timeout_s ({} s) on row {source}; its worker was restarted",
                limit.as_secs_f64()
            ),
            CallResult::Died(why) => format!("{who} failed on row {source}: {why}"),
        };
        match self.on_error {
            OnError::Raise => Err(Error::UserCode(why)),
            OnError::Zero => {
                let n = self.warned.fetch_add(1, Ordering::Relaxed);
                if n < MAX_WARNINGS {
                    eprintln!("warning: {why}\n(scored 0: reward.on_error = \"zero\")");
                } else if n == MAX_WARNINGS {
                    eprintln!("warning: more failures of user code; counting them in reward_errors without printing");
                }
                Ok(Err(why))
            }
        }
    }
}
