//! Dataset rows from JSONL and Parquet files, as JSON objects that remember where they came from.
//!
//! - `.jsonl`: one JSON object per line; blank lines are skipped. A line that is not valid JSON,
//!   or not an object, is a bad row at its 1-based line number.
//! - `.parquet`: each row through the parquet crate's record reader, converted to JSON
//!   (groups → objects, lists → arrays, strings stay strings, binary → base64). A chat dataset's
//!   `messages` column may be a list of structs or a JSON string; both reach the row parser as
//!   whatever JSON they are (the row parser decodes a string `messages`). Rows are 0-based.
//!
//! A file that cannot be opened or decoded at all is an error; a single bad row is returned as
//! such, so that the caller can apply its `on_bad_row` policy ([`OnBadRow`]).
//!
//! SFT datasets (`trainer::sft::data`) and RL prompt sets (`env::prompts`) share this reader and
//! this policy; it sits beside the layers so that neither has to reach into the other.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// What a malformed dataset row does (`on_bad_row` in the SFT `[data]` and RL configs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRow {
    /// Drop the row, warn, count it.
    Skip,
    /// Stop with an error naming the file and line (row for Parquet).
    Error,
}

/// Where a row is: a file and a line (JSONL, 1-based) or row index (Parquet, 0-based).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowLocation {
    pub path: PathBuf,
    pub position: RowPosition,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowPosition {
    /// 1-based line of a JSONL file.
    Line(usize),
    /// 0-based row of a Parquet file.
    Row(usize),
}

impl fmt::Display for RowLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            RowPosition::Line(n) => write!(f, "{}:{n}", self.path.display()),
            RowPosition::Row(n) => write!(f, "{}: row {n}", self.path.display()),
        }
    }
}

/// A row as read: its location and its JSON object, or why it could not be read.
#[derive(Clone, Debug)]
pub struct RawRow {
    pub location: RowLocation,
    pub value: std::result::Result<Value, String>,
}

/// Every row of a `.jsonl` or `.parquet` file, in file order.
pub fn read_rows(path: &Path) -> Result<Vec<RawRow>> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl") => read_jsonl(path),
        Some("parquet") => read_parquet(path),
        _ => Err(Error::file(path, "unsupported dataset format: expected a .jsonl or .parquet file")),
    }
}

fn read_jsonl(path: &Path) -> Result<Vec<RawRow>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let location = RowLocation { path: path.to_path_buf(), position: RowPosition::Line(i + 1) };
        let value = match serde_json::from_str::<Value>(line) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err("expected a JSON object".to_string()),
            Err(e) => Err(format!("invalid JSON: {e}")),
        };
        rows.push(RawRow { location, value });
    }
    Ok(rows)
}

fn read_parquet(path: &Path) -> Result<Vec<RawRow>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = std::fs::File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
    let reader =
        SerializedFileReader::new(file).map_err(|e| Error::file(path, format!("not a readable Parquet file: {e}")))?;
    let iter = reader.get_row_iter(None).map_err(|e| Error::file(path, format!("cannot read Parquet rows: {e}")))?;
    let mut rows = Vec::new();
    for (i, row) in iter.enumerate() {
        let location = RowLocation { path: path.to_path_buf(), position: RowPosition::Row(i) };
        // A decoding error mid-file leaves the reader in an unknown state: stop, don't skip.
        let row = row.map_err(|e| Error::file(path, format!("row {i}: cannot decode: {e}")))?;
        rows.push(RawRow { location, value: Ok(row.to_json_value()) });
    }
    Ok(rows)
}
