//! Run configuration files: one TOML file per run, layered over documented defaults, with
//! `--set section.key=value` overrides and checked keys.
//!
//! A config type `T: Serialize + DeserializeOwned + Default` (the SFT config today, the RL
//! config later) is resolved in three layers, each overriding the one before:
//!
//! 1. the defaults, `T::default()` serialised to a TOML table;
//! 2. the file, if any;
//! 3. every `--set a.b.c=value`, in command-line order. The value is parsed as a TOML value
//!    (`2e-5`, `true`, `"text"`, `[0.9, 0.95]`); anything that does not parse as one is taken
//!    as a bare string, so `--set model.path=runs/tiny` needs no quotes.
//!
//! The serialised defaults are the schema. Config types therefore have no `Option` fields
//! (TOML has no null; a `None` would vanish from the schema and from `oxrl config show`):
//! "unset" is a documented sentinel such as `""` or `0`. With every key present in the
//! defaults, a key absent from them is unknown, and a value whose TOML type differs from the
//! default's is a type error; both errors name the full dotted key, and an unknown key comes with
//! the nearest valid key by edit distance. An integer where the default is a float is accepted
//! (`lr = 1` means 1.0). What the schema walk cannot see (enum variants, array elements, value
//! ranges) is checked by serde and by the config's own `validate`.
//!
//! Paths: a relative path written in the file is relative to the file's directory, so a config
//! means the same from any working directory; the config type lists its path keys
//! ([`ConfigPaths`]). A `--set` path, typed on the command line, and a default stay relative to
//! the working directory. A model path that names nothing next to the file but reads as a
//! Hub repo id (`Qwen/Qwen3-0.6B`) is kept as written, for [`crate::model::hub`].
//!
//! Open tables: a config type may declare free-form tables ([`ConfigPaths::OPEN_KEYS`], e.g. a
//! loss's own config), whose contents are not in the schema. Any key below one is accepted as
//! written (file and `--set` layers overlay key by key); whoever consumes the table checks it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;
use toml::{Table, Value};

use crate::error::{did_you_mean, nearest_name, Error, Result};

/// The path fields of a config type, which a config file gives relative to itself.
pub trait ConfigPaths {
    /// Dotted keys of the fields that hold a path (`model.path`, ...).
    const PATH_KEYS: &'static [&'static str] = &[];
    /// Those of `PATH_KEYS` that may name a Hugging Face Hub repo instead (`model.path`).
    const MODEL_KEYS: &'static [&'static str] = &[];
    /// Dotted keys of free-form tables (`algorithm.loss_config`, ...): their default is an
    /// empty table, and the keys and values below them are not schema-checked (the consumer
    /// of the table checks them).
    const OPEN_KEYS: &'static [&'static str] = &[];
}

/// Where each key's value came from, so that an error about a value points at the file or the
/// `--set` argument that gave it.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    file: Option<PathBuf>,
    /// Dotted key → the `--set` argument that last set it (or a table above it).
    sets: HashMap<String, String>,
}

impl Sources {
    /// No file and no overrides: errors name the key only.
    pub fn none() -> Self {
        Sources::default()
    }

    /// Sources for a config read from `file` alone.
    pub fn file(path: &Path) -> Self {
        Sources { file: Some(path.to_path_buf()), sets: HashMap::new() }
    }

    /// An error about the value at dotted `key`, naming where that value came from: the
    /// `--set` argument, else the file, else the key alone (a default).
    pub fn error(&self, key: &str, message: impl std::fmt::Display) -> Error {
        // The nearest `--set` at or above the key: `--set a={b=1}` sets `a.b` too, and
        // `--set a=[1, 2]` sets `a[1]`.
        let plain = key.split('[').next().unwrap_or(key);
        let mut k = plain;
        loop {
            if let Some(arg) = self.sets.get(k) {
                return Origin::Set(arg).error(key, message);
            }
            match k.rsplit_once('.') {
                Some((parent, _)) => k = parent,
                None => break,
            }
        }
        match &self.file {
            Some(path) => Origin::File(path).error(key, message),
            None => Error::input(format!("config key `{key}`: {message}")),
        }
    }
}

/// Where a layer of configuration came from, for error messages.
enum Origin<'a> {
    File(&'a Path),
    Set(&'a str),
}

impl Origin<'_> {
    fn error(&self, key: &str, message: impl std::fmt::Display) -> Error {
        match self {
            Origin::File(path) => Error::field(*path, key, message),
            Origin::Set(arg) => Error::input(format!("--set {arg}: key `{key}`: {message}")),
        }
    }
}

/// Resolves a config: defaults, then `file`, then each `--set KEY=VALUE` of `sets` in order.
pub fn resolve<T>(file: Option<&Path>, sets: &[String]) -> Result<T>
where
    T: Serialize + DeserializeOwned + Default + ConfigPaths,
{
    resolve_with_sources(file, sets).map(|(config, _)| config)
}

/// [`resolve`], also returning where each value came from (for the config's own validation).
pub fn resolve_with_sources<T>(file: Option<&Path>, sets: &[String]) -> Result<(T, Sources)>
where
    T: Serialize + DeserializeOwned + Default + ConfigPaths,
{
    let (table, sources) = resolve_table::<T>(file, sets)?;
    let config = serde_path_to_error::deserialize(Value::Table(table)).map_err(|e| {
        let key = e.path().to_string();
        let message = e.into_inner().message().trim().to_string();
        sources.error(&key, message)
    })?;
    Ok((config, sources))
}

/// [`resolve`] before deserialisation: the merged TOML table and the sources of its values.
pub fn resolve_table<T>(file: Option<&Path>, sets: &[String]) -> Result<(Table, Sources)>
where
    T: Serialize + Default + ConfigPaths,
{
    let mut table = defaults_table(&T::default())?;
    let mut valid = Vec::new();
    collect_keys(&table, "", &mut valid);
    let mut sources = Sources { file: file.map(Path::to_path_buf), sets: HashMap::new() };
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, format!("cannot read config: {e}")))?;
        let mut user: Table = toml::from_str(&text).map_err(|e| Error::file(path, format!("invalid TOML: {e}")))?;
        relative_to_file(&mut user, T::PATH_KEYS, T::MODEL_KEYS, path)?;
        merge(&mut table, user, "", &valid, T::OPEN_KEYS, &Origin::File(path))?;
    }
    for arg in sets {
        let (key, mut value) = parse_set(arg)?;
        // A string key keeps the text as typed: `--set model.path=1e3` is the path "1e3".
        if matches!(lookup(&table, &key), Some(Value::String(_)))
            && !matches!(value, Value::String(_) | Value::Array(_) | Value::Table(_))
        {
            let raw = arg.split_once('=').map(|(_, v)| v.trim()).unwrap_or_default();
            value = Value::String(raw.to_string());
        }
        let mut layer = Table::new();
        insert_dotted(&mut layer, &key, value);
        merge(&mut table, layer, "", &valid, T::OPEN_KEYS, &Origin::Set(arg))?;
        // A later --set of the same key wins; one of a key below stays more specific.
        sources.sets.retain(|k, _| !(k == &key || k.starts_with(&format!("{key}."))));
        sources.sets.insert(key, arg.clone());
    }
    Ok((table, sources))
}

/// The config as a TOML document (what `oxrl config show` prints).
pub fn to_toml_string<T: Serialize>(config: &T) -> Result<String> {
    toml::to_string(config).map_err(|e| Error::Other(format!("cannot write config as TOML: {e}")))
}

/// Splits `KEY=VALUE` and parses VALUE as a TOML value, or a bare string if it is not one.
pub fn parse_set(arg: &str) -> Result<(String, Value)> {
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| Error::input(format!("--set {arg}: expected KEY=VALUE, e.g. optimizer.lr=2e-5")))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(|part| part.is_empty()) {
        return Err(Error::input(format!("--set {arg}: `{key}` is not a dotted key like optimizer.lr")));
    }
    let raw = raw.trim();
    // Parse through a one-key document so every TOML value form works (strings, arrays, ...).
    let value = match toml::from_str::<Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").expect("the document has key v"),
        Err(_) => Value::String(raw.to_string()),
    };
    Ok((key.to_string(), value))
}

/// Every dotted key of a config's schema, tables included (`model`, `model.lora`, ...).
pub fn schema_keys<T: Serialize + Default>() -> Result<Vec<String>> {
    let mut keys = Vec::new();
    collect_keys(&defaults_table(&T::default())?, "", &mut keys);
    Ok(keys)
}

pub use crate::error::edit_distance;

/// The valid key nearest to the unknown dotted key `key`, if one is near enough to be a typo
/// (by [`nearest_name`] on the last part of the key).
///
/// Siblings in the same table are preferred (`optimizer.lrr` → `optimizer.lr`); otherwise a key
/// whose last part matches or nearly matches anywhere in the schema (`lr` → `optimizer.lr`,
/// `data.lr` → `optimizer.lr`), the one nearest the whole key if several share that part.
pub fn suggest(key: &str, valid: &[String]) -> Option<String> {
    let split = |k: &'_ str| -> (String, String) {
        match k.rsplit_once('.') {
            Some((p, l)) => (p.to_string(), l.to_string()),
            None => (String::new(), k.to_string()),
        }
    };
    let (parent, leaf) = split(key);
    let leaves: Vec<(String, String)> = valid.iter().map(|v| split(v)).collect();
    let siblings: Vec<&str> = leaves.iter().filter(|(p, _)| *p == parent).map(|(_, l)| l.as_str()).collect();
    if let Some(sibling) = nearest_name(&leaf, &siblings) {
        return Some(join(&parent, sibling));
    }
    let all: Vec<&str> = leaves.iter().map(|(_, l)| l.as_str()).collect();
    let best = nearest_name(&leaf, &all)?;
    valid
        .iter()
        .zip(&leaves)
        .filter(|(_, (_, l))| l == best)
        .map(|(v, _)| v)
        .min_by_key(|v| edit_distance(key, v))
        .cloned()
}

fn defaults_table<T: Serialize>(defaults: &T) -> Result<Table> {
    Table::try_from(defaults).map_err(|e| Error::Other(format!("cannot serialise the config defaults: {e}")))
}

fn collect_keys(table: &Table, prefix: &str, out: &mut Vec<String>) {
    for (k, v) in table {
        let full = join(prefix, k);
        out.push(full.clone());
        if let Value::Table(t) = v {
            collect_keys(t, &full, out);
        }
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// The value at dotted `key`, if there is one.
fn lookup<'a>(table: &'a Table, key: &str) -> Option<&'a Value> {
    match key.split_once('.') {
        None => table.get(key),
        Some((head, rest)) => match table.get(head) {
            Some(Value::Table(t)) => lookup(t, rest),
            _ => None,
        },
    }
}

/// Rewrites each relative path among `keys` in `table` (read from `file`) as `DIR/path`, DIR the
/// file's directory as given (so still relative to the working directory if `file` is); a path of
/// `model_keys` that names nothing there but reads as a Hub repo id stays as written.
fn relative_to_file(table: &mut Table, keys: &[&str], model_keys: &[&str], file: &Path) -> Result<()> {
    let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) else { return Ok(()) };
    for key in keys {
        // An empty path means "unset"; a value of the wrong type is reported by the merge.
        if let Some(Value::String(p)) = lookup_mut(table, key) {
            if !p.is_empty() && Path::new(p.as_str()).is_relative() {
                let joined = dir.join(p.as_str());
                if model_keys.contains(key) && !joined.exists() && crate::model::hub::is_repo_id(p) {
                    continue;
                }
                *p = joined
                    .to_str()
                    .ok_or_else(|| Error::file(file, "the directory of the config file is not valid UTF-8"))?
                    .to_string();
            }
        }
    }
    Ok(())
}

/// The value at dotted `key`, mutably, if there is one.
fn lookup_mut<'a>(table: &'a mut Table, key: &str) -> Option<&'a mut Value> {
    match key.split_once('.') {
        None => table.get_mut(key),
        Some((head, rest)) => match table.get_mut(head) {
            Some(Value::Table(t)) => lookup_mut(t, rest),
            _ => None,
        },
    }
}

/// `a.b.c = v` as nested tables.
fn insert_dotted(table: &mut Table, key: &str, value: Value) {
    match key.split_once('.') {
        None => {
            table.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let child = table.entry(head.to_string()).or_insert_with(|| Value::Table(Table::new()));
            if let Value::Table(t) = child {
                insert_dotted(t, rest, value);
            }
        }
    }
}

/// Overlays `over` on `base` (the schema with the values so far), checking keys and types.
fn merge(base: &mut Table, over: Table, prefix: &str, valid: &[String], open: &[&str], origin: &Origin) -> Result<()> {
    for (key, value) in over {
        let full = join(prefix, &key);
        // Below an open table anything goes, but the key itself must stay a table.
        if open.contains(&full.as_str()) {
            if let Some(slot) = base.get_mut(&key) {
                match (slot, value) {
                    (Value::Table(b), Value::Table(o)) => overlay(b, o),
                    (slot, value) => {
                        return Err(origin.error(
                            &full,
                            format!("expected {}, found {} `{value}`", type_name(slot), type_name(&value)),
                        ))
                    }
                }
                continue;
            }
        }
        let Some(slot) = base.get_mut(&key) else {
            // Suggest against the whole schema, so a key in the wrong section is found too.
            let hint = match suggest(&full, valid) {
                Some(s) => did_you_mean(&s),
                None => format!("; valid keys here: {}", base.keys().cloned().collect::<Vec<_>>().join(", ")),
            };
            return Err(origin.error(&full, format!("unknown key{hint}")));
        };
        match (slot, value) {
            (Value::Table(b), Value::Table(o)) => merge(b, o, &full, valid, open, origin)?,
            (slot @ Value::Float(_), Value::Integer(i)) => *slot = Value::Float(i as f64),
            (slot, value) if std::mem::discriminant(slot) == std::mem::discriminant(&value) => *slot = value,
            (slot, value) => {
                return Err(
                    origin.error(&full, format!("expected {}, found {} `{value}`", type_name(slot), type_name(&value)))
                )
            }
        }
    }
    Ok(())
}

/// Overlays `over` on `base` without a schema: tables merge key by key, anything else replaces.
fn overlay(base: &mut Table, over: Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(Value::Table(b)), Value::Table(o)) => overlay(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "true or false",
        Value::Datetime(_) => "a date-time",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}

/// `cfg` with every non-empty path of [`ConfigPaths::PATH_KEYS`] made absolute: canonicalised
/// where it exists, else joined to the working directory; an empty path ("unset") stays empty.
/// A run saves this as `RUN_DIR/config.toml`, so that the copy means the same config when it is
/// loaded again with `--config` (relative paths in a file are relative to the file).
pub fn absolutize<T: ConfigPaths + Serialize + DeserializeOwned>(cfg: &T) -> Result<T> {
    let mut table = Table::try_from(cfg).map_err(|e| Error::Other(format!("cannot serialise the config: {e}")))?;
    for key in T::PATH_KEYS {
        if let Some(Value::String(p)) = lookup_mut(&mut table, key) {
            if !p.is_empty() {
                let path = Path::new(p.as_str());
                let abs = std::fs::canonicalize(path)
                    .or_else(|_| std::path::absolute(path))
                    .map_err(|e| Error::input(format!("config key `{key}`: cannot make `{p}` absolute: {e}")))?;
                *p = abs
                    .to_str()
                    .ok_or_else(|| Error::input(format!("config key `{key}`: `{}` is not valid UTF-8", abs.display())))?
                    .to_string();
            }
        }
    }
    Value::Table(table).try_into().map_err(|e| Error::Other(format!("cannot read the absolutized config back: {e}")))
}
