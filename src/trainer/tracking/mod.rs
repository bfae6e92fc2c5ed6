//! Experiment tracking: every metrics line a run writes to `metrics.jsonl` also goes to the
//! backends of its `[tracking]` section ([`TrackingSection`]): TensorBoard event files
//! ([`tensorboard`], written by oxrl) and Weights & Biases ([`wandb`], through a Python worker
//! running `wandb`).
//!
//! A [`Tracker`] holds the backends of one run. It is started with the run directory (its
//! resolved config's `[tracking]` table, the whole config as W&B's run config), so a backend
//! that cannot start is an error before training; only the process that writes the run
//! directory (process 0 under MPI) has one. Each line goes out as its numeric keys, each a
//! scalar under its key at the line's `step`; strings, nulls (non-finite values), booleans and
//! nested values are left out. [`Tracker::close`] ends the backends at the end of a run;
//! dropped without it (an error), the W&B run ends as failed.

pub mod section;
pub mod tensorboard;
pub mod tfrecord;
pub mod wandb;

use std::path::Path;

use serde_json::{Map, Value};

pub use section::{Backend, TrackingSection};
use tensorboard::{EventWriter, TENSORBOARD_DIR};
use wandb::{WandbInit, WandbWorker, START_TIMEOUT};

use crate::error::{Error, Result};

/// The backends of one run beside `metrics.jsonl`.
#[derive(Default)]
pub struct Tracker {
    tensorboard: Option<EventWriter>,
    wandb: Option<WandbWorker>,
}

impl Tracker {
    /// No backend: `metrics.jsonl` alone.
    pub fn none() -> Self {
        Tracker::default()
    }

    /// Starts the backends of `section` for the run in `run_dir`; `config` (a JSON object) is
    /// the run's resolved config, W&B's run config.
    pub fn start(section: &TrackingSection, run_dir: &Path, config: &Value) -> Result<Self> {
        let mut tracker = Tracker::none();
        if section.has(Backend::Tensorboard) {
            tracker.tensorboard = Some(EventWriter::create(&run_dir.join(TENSORBOARD_DIR))?);
        }
        if section.has(Backend::Wandb) {
            let dir_name = run_dir.file_name().map(|n| n.to_string_lossy().to_string());
            let name = match section.run_name.as_str() {
                "" => dir_name.unwrap_or_else(|| "oxrl".into()),
                name => name.to_string(),
            };
            let init = WandbInit { project: &section.project, name: &name, dir: run_dir, config };
            tracker.wandb = Some(WandbWorker::start(&section.python, &init, START_TIMEOUT)?);
        }
        Ok(tracker)
    }

    /// Starts the backends of a resolved config given as the TOML text a run directory saves
    /// (`config.toml`): its `[tracking]` table (none: `metrics.jsonl` alone), and the whole as
    /// W&B's run config.
    pub fn start_for_config(config_toml: &str, run_dir: &Path) -> Result<Self> {
        let invalid = |e: &dyn std::fmt::Display| Error::Other(format!("the resolved config is not valid TOML: {e}"));
        let table: toml::Table = toml::from_str(config_toml).map_err(|e| invalid(&e))?;
        let section: TrackingSection = match table.get("tracking") {
            Some(t) => t.clone().try_into().map_err(|e| invalid(&e))?,
            None => TrackingSection::default(),
        };
        if section.backends.iter().all(|&b| b == Backend::Jsonl) {
            return Ok(Tracker::none());
        }
        let config = serde_json::to_value(&table).map_err(|e| invalid(&e))?;
        Tracker::start(&section, run_dir, &config)
    }

    /// Whether any backend is on.
    pub fn is_on(&self) -> bool {
        self.tensorboard.is_some() || self.wandb.is_some()
    }

    /// Sends one metrics line (a JSON object with an integer `step`) to every backend.
    pub fn log(&mut self, line: &Value) -> Result<()> {
        if !self.is_on() {
            return Ok(());
        }
        let Some((step, metrics)) = scalars(line) else {
            return Err(Error::Other(format!("tracking: a metrics line without an integer `step`: {line}")));
        };
        if let Some(tb) = &mut self.tensorboard {
            let values: Vec<(&str, f64)> =
                metrics.iter().map(|(k, v)| (k.as_str(), v.as_f64().unwrap_or(f64::NAN))).collect();
            tb.write_scalars(step, &values)?;
        }
        if let Some(w) = &mut self.wandb {
            w.log(step, &metrics)?;
        }
        Ok(())
    }

    /// Ends every backend: the W&B run finishes (its worker waited for); an error names the
    /// backend.
    pub fn close(mut self) -> Result<()> {
        self.tensorboard = None;
        match self.wandb.take() {
            Some(w) => w.close(),
            None => Ok(()),
        }
    }
}

/// The `step` of a metrics line and its numeric keys other than `step`, in line order; `None`
/// without an integer `step`.
pub fn scalars(line: &Value) -> Option<(u64, Map<String, Value>)> {
    let object = line.as_object()?;
    let step = object.get("step")?.as_u64()?;
    let metrics = object.iter().filter(|(k, v)| *k != "step" && v.is_number()).map(|(k, v)| (k.clone(), v.clone()));
    Some((step, metrics.collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_numbers_are_scalars() {
        let line = json!({"step": 3, "loss": 0.5, "tokens": 12, "name": "x", "eval": null, "ok": true,
                          "nested": {"a": 1}, "list": [1.0], "lr": -1e-4});
        let (step, m) = scalars(&line).unwrap();
        assert_eq!(step, 3);
        assert_eq!(Value::Object(m), json!({"loss": 0.5, "tokens": 12, "lr": -1e-4}));
        assert_eq!(scalars(&json!({"loss": 1.0})), None);
        assert_eq!(scalars(&json!({"step": -1})), None);
        assert_eq!(scalars(&json!({"step": 1.5})), None);
    }

    #[test]
    fn tensorboard_from_a_resolved_config() {
        let dir = tempfile::tempdir().unwrap();
        let none = Tracker::start_for_config("[output]\nrun_dir = \"x\"\n", dir.path()).unwrap();
        assert!(!none.is_on());
        let mut t =
            Tracker::start_for_config("[tracking]\nbackends = [\"jsonl\", \"tensorboard\"]\n", dir.path()).unwrap();
        assert!(t.is_on());
        t.log(&json!({"step": 1, "loss": 0.5})).unwrap();
        let e = t.log(&json!({"loss": 0.5})).unwrap_err().to_string();
        assert!(e.contains("without an integer `step`"), "{e}");
        t.close().unwrap();
        let files: Vec<_> = std::fs::read_dir(dir.path().join(TENSORBOARD_DIR)).unwrap().collect();
        assert_eq!(files.len(), 1);
    }
}
