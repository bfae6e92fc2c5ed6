//! Validation of loss and algorithm configs given as JSON objects.
//!
//! A config is a JSON object (or `null`, meaning empty). Every key must be one the consumer
//! knows; an unknown key is an error that names it, suggests the closest valid key and lists
//! all valid ones. Numbers must be finite. Names (of losses, estimators, …) are checked the
//! same way by [`unknown_name`].

use serde_json::{Map, Value};

use crate::error::{did_you_mean, nearest_name};
use crate::{Error, Result};

/// A validated view of one config object, for the consumer called `owner` (e.g. "loss `ppo`").
pub struct ConfigObject<'a> {
    owner: String,
    entries: Option<&'a Map<String, Value>>,
}

impl<'a> ConfigObject<'a> {
    /// Checks that `config` is an object (or null) whose keys are all in `allowed_keys`.
    pub fn new(owner: impl Into<String>, config: &'a Value, allowed_keys: &[&str]) -> Result<Self> {
        let owner = owner.into();
        let entries = match config {
            Value::Null => None,
            Value::Object(map) => Some(map),
            other => return Err(Error::input(format!("{owner}: config must be a JSON object, got {other}"))),
        };
        if let Some(map) = entries {
            for key in map.keys() {
                if !allowed_keys.contains(&key.as_str()) {
                    return Err(unknown_key(&owner, key, allowed_keys));
                }
            }
        }
        Ok(ConfigObject { owner, entries })
    }

    fn value(&self, key: &str) -> Option<&'a Value> {
        self.entries.and_then(|map| map.get(key)).filter(|v| !v.is_null())
    }

    /// A finite number, or `default` when the key is absent or null.
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        Ok(self.optional_f64(key)?.unwrap_or(default))
    }

    /// A finite number that must be present.
    pub fn required_f64(&self, key: &str) -> Result<f64> {
        self.optional_f64(key)?.ok_or_else(|| Error::input(format!("{}: config key `{key}` is required", self.owner)))
    }

    /// A finite number, or `None` when the key is absent or null.
    pub fn optional_f64(&self, key: &str) -> Result<Option<f64>> {
        let Some(value) = self.value(key) else { return Ok(None) };
        match value.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(Error::input(format!("{}: config key `{key}` must be a finite number, got {value}", self.owner))),
        }
    }

    /// A string, or `None` when the key is absent or null.
    pub fn optional_str(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(value) = self.value(key) else { return Ok(None) };
        value
            .as_str()
            .map(Some)
            .ok_or_else(|| Error::input(format!("{}: config key `{key}` must be a string, got {value}", self.owner)))
    }

    /// An error about the value of `key`, prefixed with the owner.
    pub fn invalid(&self, key: &str, message: impl std::fmt::Display) -> Error {
        Error::input(format!("{}: config key `{key}`: {message}", self.owner))
    }
}

/// The error for a config key of `owner` that is not one of `allowed_keys`.
pub fn unknown_key(owner: &str, key: &str, allowed_keys: &[&str]) -> Error {
    Error::input(format!("{owner}: unknown config key `{key}`{}", suggestion(key, allowed_keys)))
}

/// The error for a name (of a `kind` such as "loss") that is not one of `valid`.
pub fn unknown_name(kind: &str, name: &str, valid: &[&str]) -> Error {
    Error::input(format!("unknown {kind} `{name}`{}", suggestion(name, valid)))
}

fn suggestion(word: &str, valid: &[&str]) -> String {
    let hint = nearest_name(word, valid).map(did_you_mean).unwrap_or_default();
    if valid.is_empty() {
        format!("{hint} (this takes no config keys)")
    } else {
        format!("{hint} (valid: {})", valid.join(", "))
    }
}
