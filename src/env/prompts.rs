//! Prompt datasets for RL: rows of a JSONL or Parquet file, each checked against its env.
//!
//! - The env of a row is its `env` (or SkyRL's `env_class`) field, else the reward function's when
//!   one is configured, else the configured default ([`EnvFactory::resolve`]).
//! - The uid (stable across runs, the key of the async trainer's consumed-prompt set) is the
//!   row's `id` field (a string, or an integer written in decimal), else the row's 0-based
//!   index among the file's rows (blank JSONL lines do not count). Two rows with one uid: the
//!   second is a bad row.
//! - A row is checked by its env ([`EnvFactory::check`]: a built-in is built once), so the
//!   loader and the env agree on what a valid row is. A bad row (unreadable, unknown env, missing or
//!   mistyped field, duplicate uid) is an error at `file:line` naming the field, or with
//!   `on_bad_row = skip` a warning (the first ten) and a count.
//! - An optional `max_tokens` field (a positive integer) is the row's own per-turn token
//!   budget: its turns are sampled with at most min(`max_tokens`, `env.max_turn_tokens`) tokens
//!   ([`PromptRow::max_tokens`], applied in `trainer::rl::episodes`).

use std::collections::HashSet;
use std::path::Path;

use serde_json::Value;

use super::env_config::EnvConfig;
use super::factory::EnvFactory;
use crate::rows::{read_rows, OnBadRow};
use crate::{Error, Result};

/// Warnings printed for skipped rows before counting silently.
const MAX_WARNINGS: usize = 10;

/// One prompt: which env runs it and the row the env is built from.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptRow {
    pub uid: String,
    pub env: String,
    /// The whole row: the env's input, including what the reward needs (`answer`, ...).
    pub row: Value,
    /// Where it came from, for messages: `file:line`, or a generator's description.
    pub source: String,
}

impl PromptRow {
    /// A fresh env for one episode of this prompt.
    pub fn make_env(&self, config: &EnvConfig) -> Result<Box<dyn super::Env>> {
        super::make_env(&self.env, &self.row, config)
    }

    /// The row's own per-turn token budget (its `max_tokens` field), if it has a valid one.
    pub fn max_tokens(&self) -> Option<usize> {
        row_max_tokens(&self.row).ok().flatten()
    }
}

/// The `max_tokens` field of a row: absent (or null), or a positive integer.
fn row_max_tokens(row: &Value) -> std::result::Result<Option<usize>, String> {
    match row.get("max_tokens").filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
            _ => Err(format!("field `max_tokens`: must be a positive integer, got {v}")),
        },
    }
}

/// How to read a prompt file.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptOptions {
    /// The env of rows without an `env` field; `None` makes that field required.
    pub default_env: Option<String>,
    pub on_bad_row: OnBadRow,
    pub config: EnvConfig,
}

impl Default for PromptOptions {
    fn default() -> Self {
        PromptOptions { default_env: None, on_bad_row: OnBadRow::Error, config: EnvConfig::default() }
    }
}

/// The prompts of a file and how many rows were skipped.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptSet {
    pub rows: Vec<PromptRow>,
    pub bad_rows: usize,
}

/// Reads and checks every row of a `.jsonl` or `.parquet` prompt file (module rules) for the
/// built-in envs.
pub fn load_prompts(path: &Path, options: &PromptOptions) -> Result<PromptSet> {
    load_prompts_for(path, options, &EnvFactory::builtin(options.config.clone()))
}

/// [`load_prompts`] for the envs of `envs`.
pub fn load_prompts_for(path: &Path, options: &PromptOptions, envs: &EnvFactory) -> Result<PromptSet> {
    let mut set = PromptSet { rows: Vec::new(), bad_rows: 0 };
    let mut seen = HashSet::new();
    for (index, raw) in read_rows(path)?.into_iter().enumerate() {
        let parsed = raw.value.and_then(|row| parse_row(row, index, options, envs));
        let parsed = parsed.and_then(|p| {
            if seen.insert(p.uid.clone()) {
                Ok(p)
            } else {
                Err(format!("field `id`: duplicate uid `{}`", p.uid))
            }
        });
        match parsed {
            Ok(mut p) => {
                p.source = raw.location.to_string();
                set.rows.push(p);
            }
            Err(message) => match options.on_bad_row {
                OnBadRow::Error => {
                    return Err(Error::input(format!(
                        "{}: {message} (set on_bad_row = \"skip\" to skip such rows)",
                        raw.location
                    )))
                }
                OnBadRow::Skip => {
                    set.bad_rows += 1;
                    if set.bad_rows <= MAX_WARNINGS {
                        eprintln!("warning: {}: {message}; row skipped", raw.location);
                    } else if set.bad_rows == MAX_WARNINGS + 1 {
                        eprintln!("warning: more malformed prompt rows; counting them without printing");
                    }
                }
            },
        }
    }
    Ok(set)
}

/// One row to a prompt, or the message of why it is bad (without the location).
pub fn parse_row(
    row: Value,
    index: usize,
    options: &PromptOptions,
    envs: &EnvFactory,
) -> std::result::Result<PromptRow, String> {
    let env = envs.resolve(&row, options.default_env.as_deref())?;
    let uid = match row.get("id").filter(|v| !v.is_null()) {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(other) => return Err(format!("field `id`: must be a non-empty string or an integer, got {other}")),
        None => index.to_string(),
    };
    row_max_tokens(&row)?;
    envs.check(&env, &row)?;
    Ok(PromptRow { uid, env, row, source: String::new() })
}
