//! Which env runs a row, and each episode's env built from it.
//!
//! A row's env, first rule that applies:
//! 1. its `env` field (oxrl's rows), else its `env_class` field (SkyRL's rows), names it;
//! 2. else the user's reward function (`reward.custom_function`) scores it, when one is set;
//! 3. else the configured default env (`data.env`).
//!
//! A name is looked up among the Python env classes of `env.python_modules`, then the Rust envs
//! a library user registered ([`EnvFactory::register`]), then the built-ins; an unknown name is
//! an error with a "did you mean" over all of them. The factory starts the Python worker pool
//! once, when the config asks for Python (a missing file, function or module is an error then,
//! before any model is loaded), and every env it builds shares it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::env_config::EnvConfig;
use super::prompts::PromptRow;
use super::protocol::Env;
use super::python::{PoolSpec, PythonPool, PythonTextEnv, RewardFnEnv, UserCode};
use super::registry::{try_make_env, EnvError, ENV_NAMES};
use super::reward_config::RewardConfig;
use crate::error::unknown_name_message;
use crate::{Error, Result};

/// The env name of rows the reward function scores.
pub const REWARD_FUNCTION: &str = "custom_function";

/// Builds a Rust env from a row (a library user's own env).
pub type EnvBuilder = Arc<dyn Fn(&Value, &EnvConfig) -> Result<Box<dyn Env>> + Send + Sync>;

pub struct EnvFactory {
    pub config: EnvConfig,
    python: Option<Arc<UserCode>>,
    python_classes: Vec<String>,
    rust: BTreeMap<String, EnvBuilder>,
}

impl EnvFactory {
    /// The built-in envs only.
    pub fn builtin(config: EnvConfig) -> EnvFactory {
        EnvFactory { config, python: None, python_classes: vec![], rust: BTreeMap::new() }
    }

    /// The envs a run's config asks for: the built-ins, and the Python pool when `reward` names a
    /// function or `python_modules` lists env modules.
    pub fn start(config: EnvConfig, reward: &RewardConfig, python_modules: &[String]) -> Result<EnvFactory> {
        let mut factory = EnvFactory::builtin(config);
        if reward.function().is_none() && python_modules.is_empty() {
            return Ok(factory);
        }
        let spec = PoolSpec {
            python: reward.python.clone(),
            workers: reward.workers,
            timeout: Duration::from_secs_f64(reward.timeout_s),
            start_timeout: Duration::from_secs_f64(reward.timeout_s.max(120.0)),
            reward: reward.function().map(|f| (f.path.clone(), f.name.clone())),
            env_modules: python_modules.to_vec(),
        };
        let pool = PythonPool::start(spec)?;
        factory.python_classes = pool.ready().env_classes.clone();
        factory.python =
            Some(Arc::new(UserCode::new(pool, reward.on_error, reward.function().cloned(), reward.timeout_s)));
        Ok(factory)
    }

    /// Adds a Rust env by name (library users: an env without forking oxrl).
    pub fn register(mut self, name: &str, builder: EnvBuilder) -> EnvFactory {
        self.rust.insert(name.to_string(), builder);
        self
    }

    /// Whether rows without an env go to the reward function.
    pub fn has_reward_function(&self) -> bool {
        self.python.as_ref().is_some_and(|p| p.function.is_some())
    }

    /// Every name a row may give, for messages.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.python_classes.iter().map(String::as_str).collect();
        names.extend(self.rust.keys().map(String::as_str));
        names.extend(ENV_NAMES);
        names
    }

    /// The env of a row (module rules), or why it has none.
    pub fn resolve(&self, row: &Value, default_env: Option<&str>) -> std::result::Result<String, String> {
        for field in ["env", "env_class"] {
            match row.get(field).filter(|v| !v.is_null()) {
                Some(Value::String(name)) => return Ok(name.clone()),
                Some(other) => return Err(format!("field `{field}`: must be a string, got {other}")),
                None => {}
            }
        }
        if self.has_reward_function() {
            return Ok(REWARD_FUNCTION.to_string());
        }
        default_env
            .map(str::to_string)
            .ok_or_else(|| "field `env`: missing, and no default env is configured".to_string())
    }

    /// Whether `row` is a valid row of env `name` (without calling Python): the message of why
    /// not, without the location.
    pub fn check(&self, name: &str, row: &Value) -> std::result::Result<(), String> {
        if name == REWARD_FUNCTION && self.has_reward_function() {
            return RewardFnEnv::check_row(row).map_err(|e| e.to_string());
        }
        if self.python_classes.iter().any(|c| c == name) {
            return PythonTextEnv::check_row(row).map_err(|e| e.to_string());
        }
        if let Some(build) = self.rust.get(name) {
            return build(row, &self.config).map(|_| ()).map_err(|e| e.to_string());
        }
        match try_make_env(name, row, &self.config) {
            Err(EnvError::UnknownName(n)) => Err(unknown_name_message("env", &n, &self.names())),
            other => other.map(|_| ()).map_err(|e| e.message()),
        }
    }

    /// A fresh env for one episode of `prompt`.
    pub fn make(&self, prompt: &PromptRow) -> Result<Box<dyn Env>> {
        let (name, row, source) = (prompt.env.as_str(), &prompt.row, prompt.source.as_str());
        let field_error = |e: super::fields::FieldError| Error::input(format!("{source}: env `{name}`: {e}"));
        if let Some(code) = &self.python {
            if name == REWARD_FUNCTION && code.function.is_some() {
                return Ok(Box::new(
                    RewardFnEnv::from_row(code.clone(), row, source, &self.config).map_err(field_error)?,
                ));
            }
            if self.python_classes.iter().any(|c| c == name) {
                return Ok(Box::new(PythonTextEnv::start(code.clone(), name, row, source, &self.config)?));
            }
        }
        if let Some(build) = self.rust.get(name) {
            return build(row, &self.config);
        }
        try_make_env(name, row, &self.config).map_err(|e| match e {
            EnvError::UnknownName(n) => Error::input(unknown_name_message("env", &n, &self.names())),
            EnvError::Field(f) => field_error(f),
        })
    }
}
