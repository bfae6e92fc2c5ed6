//! The TensorBoard backend: event files written by oxrl, no TensorFlow.
//!
//! One file per process start, `RUN_DIR/tensorboard/events.out.tfevents.<secs>.<host>.<pid>.<n>`
//! (TensorFlow's name; `n` keeps two starts in one second apart): TFRecords ([`super::tfrecord`])
//! of `Event` messages, the first `file_version = "brain.Event:2"`, then one per metrics line,
//! holding every scalar as a `simple_value` (f32) tagged with its key, flushed at once.
//!
//! Before its first line a file says where its session starts: a `SessionLog` START event at
//! that line's step, as TensorFlow writes at a restart. TensorBoard reads a directory's files in
//! name order and, at a START, drops what it had from that step on. A resumed run replays the
//! kept lines into its new file (starting at the first step), and a new run in a directory
//! that already had event files starts at step 1: either way TensorBoard shows this process's
//! value of every step, none of a run that died after its last checkpoint.
//!
//! The messages are TensorFlow's `event.proto` and `summary.proto`, the fields used here, as
//! hand-written prost structs (no protoc); field numbers and types follow those files.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use super::tfrecord::write_record;
use crate::error::{Error, Result};

/// The folder of the event files in a run directory.
pub const TENSORBOARD_DIR: &str = "tensorboard";
/// The first event of a file: the format version TensorBoard expects.
pub const FILE_VERSION: &str = "brain.Event:2";

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "event::What", tags = "3, 5, 7")]
    pub what: Option<event::What>,
}

pub mod event {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum What {
        /// `brain.Event:2`, in the first event of a file.
        #[prost(string, tag = "3")]
        FileVersion(String),
        #[prost(message, tag = "5")]
        Summary(super::Summary),
        #[prost(message, tag = "7")]
        SessionLog(super::SessionLog),
    }
}

/// `tensorflow.SessionLog`, its status alone (`SessionStatus`, an enum, as its number).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `SessionLog.SessionStatus.START`: a session (re)starts at the event's step.
pub const SESSION_START: i32 = 1;

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    /// A member of the oneof `value` in TensorFlow: written even when 0 (a plain proto3 float
    /// would leave a 0 out, and TensorBoard would see no value).
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// One process's event file.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
    /// Whether the session's START is written (before the first scalars).
    started: bool,
}

impl EventWriter {
    /// A new event file in `dir` (created if needed), with its version event written.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let stem = format!("events.out.tfevents.{secs:010}.{}.{}", hostname(), std::process::id());
        let mut n = 0;
        let (path, file) = loop {
            let path = dir.join(format!("{stem}.{n}"));
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => n += 1,
                Err(e) => return Err(Error::file(&path, format!("cannot create: {e}"))),
            }
        };
        let mut writer = EventWriter { path, file: BufWriter::new(file), started: false };
        writer.write(&Event {
            wall_time: now(),
            step: 0,
            what: Some(event::What::FileVersion(FILE_VERSION.into())),
        })?;
        Ok(writer)
    }

    /// Writes one step's scalars as one event (each as f32, TensorBoard's `simple_value`) and
    /// flushes it; the first time, after the session's START at this step.
    pub fn write_scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> Result<()> {
        let step = i64::try_from(step).map_err(|_| Error::file(&self.path, format!("step {step} beyond int64")))?;
        if !self.started {
            let start = SessionLog { status: SESSION_START };
            self.write(&Event { wall_time: now(), step, what: Some(event::What::SessionLog(start)) })?;
            self.started = true;
        }
        let value = scalars
            .iter()
            .map(|&(tag, x)| SummaryValue { tag: tag.to_string(), simple_value: Some(x as f32) })
            .collect();
        self.write(&Event { wall_time: now(), step, what: Some(event::What::Summary(Summary { value })) })
    }

    fn write(&mut self, event: &Event) -> Result<()> {
        write_record(&mut self.file, &event.encode_to_vec())
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::file(&self.path, format!("cannot write: {e}")))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name, as TensorFlow puts it in event file names (`localhost` if unknown).
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..len]).replace(['/', '\\'], "_");
    if ok && !name.is_empty() {
        name
    } else {
        "localhost".into()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tfrecord::read_records;
    use super::*;

    /// Bytes of the same events serialised by TensorFlow's own protobuf classes (tensorboard's
    /// `event_pb2`).
    const SUMMARY_EVENT: &str = "09000000000000f83f10072a0d0a0b0a046c6f7373150000803e";
    const VERSION_EVENT: &str = "09000000000000f83f1a0d627261696e2e4576656e743a32";
    const START_EVENT: &str = "09000000000000f83f10033a020801";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn events_encode_as_tensorflow_does_and_decode_back() {
        let summary = Event {
            wall_time: 1.5,
            step: 7,
            what: Some(event::What::Summary(Summary {
                value: vec![SummaryValue { tag: "loss".into(), simple_value: Some(0.25) }],
            })),
        };
        assert_eq!(hex(&summary.encode_to_vec()), SUMMARY_EVENT);
        assert_eq!(Event::decode(summary.encode_to_vec().as_slice()).unwrap(), summary);
        let version = Event { wall_time: 1.5, step: 0, what: Some(event::What::FileVersion(FILE_VERSION.into())) };
        assert_eq!(hex(&version.encode_to_vec()), VERSION_EVENT);
        assert_eq!(Event::decode(version.encode_to_vec().as_slice()).unwrap(), version);
        let start = Event {
            wall_time: 1.5,
            step: 3,
            what: Some(event::What::SessionLog(SessionLog { status: SESSION_START })),
        };
        assert_eq!(hex(&start.encode_to_vec()), START_EVENT);
        assert_eq!(Event::decode(start.encode_to_vec().as_slice()).unwrap(), start);
        // A zero is written, not left out.
        let zero = SummaryValue { tag: "x".into(), simple_value: Some(0.0) };
        assert_eq!(hex(&zero.encode_to_vec()), "0a01781500000000");
    }

    #[test]
    fn a_file_holds_the_version_the_start_then_one_event_per_step() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.write_scalars(1, &[("loss", 2.5), ("lr", 1e-3)]).unwrap();
        w.write_scalars(2, &[("loss", 0.1)]).unwrap();
        // Flushed per step: the file is complete while the writer is open.
        let records = read_records(&std::fs::read(w.path()).unwrap()).unwrap();
        let mut events: Vec<Event> = records.iter().map(|r| Event::decode(r.as_slice()).unwrap()).collect();
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].what, Some(event::What::FileVersion("brain.Event:2".into())));
        let start = events.remove(1);
        assert_eq!((start.step, start.what), (1, Some(event::What::SessionLog(SessionLog { status: 1 }))));
        let scalars = |e: &Event| match &e.what {
            Some(event::What::Summary(s)) => {
                (e.step, s.value.iter().map(|v| (v.tag.clone(), v.simple_value.unwrap())).collect::<Vec<_>>())
            }
            other => panic!("not a summary: {other:?}"),
        };
        assert_eq!(scalars(&events[1]), (1, vec![("loss".into(), 2.5), ("lr".into(), 1e-3f64 as f32)]));
        assert_eq!(scalars(&events[2]), (2, vec![("loss".into(), 0.1f64 as f32)]));

        // A second file in the same second gets its own name.
        let w2 = EventWriter::create(dir.path()).unwrap();
        assert_ne!(w2.path(), w.path());
        let name = w.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(
            name.starts_with("events.out.tfevents.") && name.ends_with(&format!(".{}.0", std::process::id())),
            "{name}"
        );
    }
}
