//! Environments by name: [`make_env`] builds one from a dataset row.
//!
//! The row is the env's whole input (prompt and whatever the reward needs); a missing or
//! mistyped field is an error naming it. An unknown name is an error with a "did you mean".

use serde_json::Value;

use super::arithmetic::ArithmeticEnv;
use super::calculator::CalculatorEnv;
use super::countdown::CountdownEnv;
use super::env_config::EnvConfig;
use super::fields::FieldError;
use super::math::MathEnv;
use super::protocol::Env;
use crate::error::unknown_name_message;
use crate::{Error, Result};

/// The built-in environments.
pub const ENV_NAMES: &[&str] = &["arithmetic", "math", "countdown", "calculator"];

/// Why an env could not be built: an unknown name, or a bad row field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvError {
    UnknownName(String),
    Field(FieldError),
}

impl From<FieldError> for EnvError {
    fn from(e: FieldError) -> Self {
        EnvError::Field(e)
    }
}

impl EnvError {
    /// The message without the env name (row loaders prefix it with `file:line`).
    pub fn message(&self) -> String {
        match self {
            EnvError::UnknownName(name) => unknown_name_message("env", name, ENV_NAMES),
            EnvError::Field(e) => e.to_string(),
        }
    }
}

/// The env `name` for one row.
pub fn make_env(name: &str, row: &Value, config: &EnvConfig) -> Result<Box<dyn Env>> {
    try_make_env(name, row, config).map_err(|e| match e {
        EnvError::UnknownName(n) => Error::input(unknown_name_message("env", &n, ENV_NAMES)),
        EnvError::Field(f) => Error::input(format!("env `{name}`: {f}")),
    })
}

/// [`make_env`] with the error kept structured.
pub fn try_make_env(name: &str, row: &Value, config: &EnvConfig) -> std::result::Result<Box<dyn Env>, EnvError> {
    Ok(match name {
        "arithmetic" => Box::new(ArithmeticEnv::from_row(row, config)?),
        "math" => Box::new(MathEnv::from_row(row, config)?),
        "countdown" => Box::new(CountdownEnv::from_row(row, config)?),
        "calculator" => Box::new(CalculatorEnv::from_row(row, config)?),
        other => return Err(EnvError::UnknownName(other.to_string())),
    })
}
