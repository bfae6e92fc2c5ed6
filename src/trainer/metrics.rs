//! Training metrics: one JSON object per optimizer step, appended to `RUN_DIR/metrics.jsonl`.
//!
//! Any trainer's records are lines of the file: [`MetricsWriter::write_line`] takes anything
//! serialisable to a JSON object with a `step` key, and [`read_metric_lines`] reads every line
//! back as a JSON object. SFT writes [`StepMetrics`]: step, epoch, train loss, learning rate,
//! pre-clip gradient norm, token counts and throughput, the eval loss on steps that evaluated,
//! the process's peak resident set size, and any extra metrics (e.g. the worker's `name:reduction` keys) flattened in. Every line is
//! flushed as it is written, so a crash loses at most the step in flight. Non-finite numbers are
//! written as `null` (JSON has no NaN; serde_json writes every non-finite float so) and read
//! back into [`StepMetrics`] as NaN.
//!
//! Resuming from step `s` drops the lines after `s` ([`MetricsWriter::resume`]), whatever kind
//! of records they are, so a run that crashed after its last checkpoint does not log those steps
//! twice.
//!
//! Every line written also goes to the run's tracking backends (TensorBoard, W&B: a
//! [`Tracker`], [`super::tracking`]); a resumed writer sends them the kept lines first, so each
//! process start's backends hold the run's whole history.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use super::tracking::Tracker;
use crate::error::{Error, Result};

pub const METRICS_FILE: &str = "metrics.jsonl";

/// One optimizer step's metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps taken, 1 for the first.
    pub step: usize,
    /// Epoch of the step's batch (0-based).
    pub epoch: usize,
    /// Training loss of the step: trained-token mean of the negative log-likelihood.
    #[serde(serialize_with = "finite_or_null", deserialize_with = "null_as_nan")]
    pub loss: f64,
    /// Learning rate used by the step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    #[serde(serialize_with = "finite_or_null", deserialize_with = "null_as_nan")]
    pub grad_norm: f64,
    /// Trained (weight > 0) target tokens in the step.
    pub trained_tokens: usize,
    /// All input tokens in the step.
    pub tokens: usize,
    /// Input tokens per second of wall time for the step.
    pub tokens_per_s: f64,
    /// Seconds since the run (or the resume) started.
    pub elapsed_s: f64,
    /// Eval loss (trained-token mean over the eval set), on steps that evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Peak resident set size of the process writing the line, in GB (10⁹ bytes), since it
    /// started ([`crate::memory`]); null where the system does not report it.
    #[serde(default = "unknown", serialize_with = "finite_or_null", deserialize_with = "null_as_nan")]
    pub peak_rss_gb: f64,
    /// Anything else, written as top-level keys.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Appends metrics lines (any serialisable record, one JSON object a line) to
/// `RUN_DIR/metrics.jsonl`, and sends them to the run's tracking backends.
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
    tracker: Tracker,
}

impl MetricsWriter {
    /// Starts a fresh `metrics.jsonl` in `run_dir` (created if needed), replacing an old one.
    pub fn create(run_dir: &Path) -> Result<Self> {
        Self::create_tracked(run_dir, Tracker::none())
    }

    /// [`create`](Self::create), every line also sent to `tracker`'s backends.
    pub fn create_tracked(run_dir: &Path, tracker: Tracker) -> Result<Self> {
        std::fs::create_dir_all(run_dir)
            .map_err(|e| Error::file(run_dir, format!("cannot create run directory: {e}")))?;
        let path = run_dir.join(METRICS_FILE);
        let file = File::create(&path).map_err(|e| Error::file(&path, format!("cannot create: {e}")))?;
        Ok(MetricsWriter { path, file, tracker })
    }

    /// Reopens `run_dir/metrics.jsonl` for a run resumed after `step`: lines with a larger
    /// `step` are dropped, the rest kept as they were, and new lines appended. Works for any
    /// kind of record; a line without an integer `step` is an error.
    pub fn resume(run_dir: &Path, step: usize) -> Result<Self> {
        Self::resume_tracked(run_dir, step, Tracker::none())
    }

    /// [`resume`](Self::resume), the kept lines and every new one also sent to `tracker`'s
    /// backends.
    pub fn resume_tracked(run_dir: &Path, step: usize, tracker: Tracker) -> Result<Self> {
        let path = run_dir.join(METRICS_FILE);
        let mut kept = Vec::new();
        if path.is_file() {
            for (i, line) in read_metric_lines(&path)?.into_iter().enumerate() {
                let s = line
                    .get("step")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| Error::file(&path, format!("record {}: no integer `step`, cannot resume", i + 1)))?;
                if s <= step as u64 {
                    kept.push(line);
                }
            }
        }
        let mut writer = Self::create_tracked(run_dir, tracker)?;
        for line in &kept {
            writer.write_line(line)?;
        }
        Ok(writer)
    }

    /// Appends one record as one JSON line and flushes it, then sends it to the tracking
    /// backends. The record should serialise to a JSON object with an integer `step` (what
    /// [`MetricsWriter::resume`], the plots and the backends read).
    pub fn write_line(&mut self, record: &impl Serialize) -> Result<()> {
        let mut line = serde_json::to_string(record)
            .map_err(|e| Error::file(&self.path, format!("cannot serialise metrics: {e}")))?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::file(&self.path, format!("cannot write: {e}")))?;
        if self.tracker.is_on() {
            // The record as a value, not the line parsed back: serde_json's parser may be off by
            // a float's last bit, its serialiser is exact.
            let value = serde_json::to_value(record)
                .map_err(|e| Error::file(&self.path, format!("cannot serialise metrics: {e}")))?;
            self.tracker.log(&value)?;
        }
        Ok(())
    }

    /// Ends the tracking backends (at the end of a run: dropped without this, the W&B run ends
    /// as failed).
    pub fn close(self) -> Result<()> {
        self.tracker.close()
    }

    /// Appends one SFT line ([`MetricsWriter::write_line`]).
    pub fn write(&mut self, metrics: &StepMetrics) -> Result<()> {
        self.write_line(metrics)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Every record of an SFT metrics file; a malformed line is an error naming its line number.
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>> {
    read_lines(path)
}

/// Every record of a metrics file of any trainer, as JSON objects (keys in file order; a
/// non-finite number is `null`); a line that is not a JSON object is an error naming its line
/// number. Blank lines are skipped.
pub fn read_metric_lines(path: &Path) -> Result<Vec<Map<String, Value>>> {
    read_lines(path)
}

fn read_lines<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| Error::file(path, format!("line {}: not a metrics record: {e}", i + 1)))
        })
        .collect()
}

fn finite_or_null<S: Serializer>(x: &f64, s: S) -> std::result::Result<S::Ok, S::Error> {
    if x.is_finite() {
        s.serialize_f64(*x)
    } else {
        s.serialize_none()
    }
}

/// A key missing from a line (written before the key existed): unknown.
fn unknown() -> f64 {
    f64::NAN
}

fn null_as_nan<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SFT line's keys in their order (an evaluated step with one extra metric), the
    /// memory key last among the typed ones; a line written before the key reads back NaN.
    #[test]
    fn the_line_keeps_its_keys_in_their_order() {
        let mut m = StepMetrics { eval_loss: Some(1.0), peak_rss_gb: 0.5, ..Default::default() };
        m.extra.insert("clip_fraction:mean".into(), Value::from(0.25));
        let Value::Object(map) = serde_json::to_value(&m).unwrap() else { panic!("not an object") };
        let keys: Vec<&str> = map.keys().map(String::as_str).collect();
        assert_eq!(
            keys.join(","),
            "step,epoch,loss,lr,grad_norm,trained_tokens,tokens,tokens_per_s,elapsed_s,eval_loss,peak_rss_gb,\
             clip_fraction:mean"
        );
        let old = r#"{"step":1,"epoch":0,"loss":1.0,"lr":0.1,"grad_norm":1.0,"trained_tokens":1,"tokens":2,
                      "tokens_per_s":1.0,"elapsed_s":1.0}"#;
        let back: StepMetrics = serde_json::from_str(old).unwrap();
        assert!(back.peak_rss_gb.is_nan() && back.extra.is_empty(), "{back:?}");
    }
}
