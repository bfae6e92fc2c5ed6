//! Reading and writing the JSON files and directories of models, adapters and checkpoints,
//! with errors that name the file, and writes that never leave half a file or directory:
//! everything is written under a temporary name and renamed into place. [`JsonFields`] reads
//! typed fields out of such a file, with errors that name the file and the field.

use std::fmt::Display;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::{Error, Result};

/// Parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    serde_json::from_str(&text).map_err(|e| Error::file(path, format!("invalid JSON: {e}")))
}

/// Writes pretty JSON through a temporary file renamed into place.
pub fn write_json(path: &Path, value: &Value) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::file(path, e))?;
    std::fs::write(&tmp, text + "\n").map_err(|e| Error::file(&tmp, format!("cannot write: {e}")))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::file(path, format!("cannot rename into place: {e}")))?;
    Ok(())
}

/// Fills a directory through `write(tmp)` into a hidden sibling, then renames it into place.
/// An existing directory of the same name is first renamed aside and removed after the swap, so
/// a crash leaves either the old or the new complete directory (in the worst case under the
/// aside name `.NAME.old-PID`), never a half one.
pub fn write_dir_atomically(dir: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = dir.file_name().ok_or_else(|| Error::file(dir, "not a directory name"))?.to_string_lossy().to_string();
    let parent = dir.parent().map(Path::to_path_buf).unwrap_or_default();
    let parent = if parent.as_os_str().is_empty() { PathBuf::from(".") } else { parent };
    std::fs::create_dir_all(&parent).map_err(|e| Error::file(&parent, format!("cannot create: {e}")))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let aside = parent.join(format!(".{name}.old-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| Error::file(&tmp, format!("cannot create: {e}")))?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let existed = dir.exists();
    if existed {
        std::fs::rename(dir, &aside).map_err(|e| Error::file(dir, format!("cannot move the old one aside: {e}")))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| Error::file(dir, format!("cannot rename into place: {e}")))?;
    if existed {
        let _ = std::fs::remove_dir_all(&aside);
    }
    Ok(())
}

/// Finishes what interrupted [`write_dir_atomically`] calls left anywhere under `root` (a
/// process killed mid-save), for a writer that owns `root` alone and has just started: a
/// half-written `.NAME.tmp-PID` is removed; an old directory moved aside (`.NAME.old-PID`) is
/// removed when `NAME` is in place, and put back when the kill came between the two renames.
/// Returns what it removed or restored.
pub fn sweep_interrupted_writes(root: &Path) -> Result<Vec<PathBuf>> {
    let mut done = vec![];
    let Ok(entries) = std::fs::read_dir(root) else { return Ok(done) };
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        let name = entry.file_name().to_string_lossy().to_string();
        let left = |tag: &str| {
            let rest = name.strip_prefix('.')?;
            let (target, pid) = rest.rsplit_once(tag)?;
            pid.chars().all(|c| c.is_ascii_digit()).then(|| target.to_string())
        };
        if left(".tmp-").is_some() {
            std::fs::remove_dir_all(&path).map_err(|e| Error::file(&path, format!("cannot remove: {e}")))?;
            done.push(path);
        } else if let Some(target) = left(".old-") {
            let target = root.join(target);
            if target.exists() {
                std::fs::remove_dir_all(&path).map_err(|e| Error::file(&path, format!("cannot remove: {e}")))?;
            } else {
                std::fs::rename(&path, &target).map_err(|e| Error::file(&path, format!("cannot restore: {e}")))?;
            }
            done.push(path);
        } else {
            done.extend(sweep_interrupted_writes(&path)?);
        }
    }
    Ok(done)
}

/// Typed, checked reads of the fields of one JSON object from the file `path` (used only in
/// errors, which name the file and the field). A field set to `null` counts as absent, as
/// Hugging Face files write `null` for "unset". Reads of an `opt_` kind give `None` when the
/// field is absent; the others require it ("missing (required)").
#[derive(Clone, Copy)]
pub struct JsonFields<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

impl<'a> JsonFields<'a> {
    /// The fields of `value`, which must be an object.
    pub fn new(path: &'a Path, value: &'a Value) -> Result<Self> {
        let map = value.as_object().ok_or_else(|| Error::file(path, "expected a JSON object"))?;
        Ok(JsonFields { path, map })
    }

    /// The fields of an object already taken apart.
    pub fn of_map(path: &'a Path, map: &'a Map<String, Value>) -> Self {
        JsonFields { path, map }
    }

    /// An error about `field` of this file.
    pub fn err(&self, field: &str, message: impl Display) -> Error {
        Error::field(self.path, field, message)
    }

    /// The field's value, `None` when absent or null.
    pub fn get(&self, field: &str) -> Option<&'a Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    fn required<T>(&self, field: &str, value: Option<T>) -> Result<T> {
        value.ok_or_else(|| self.err(field, "missing (required)"))
    }

    /// A non-negative integer.
    pub fn opt_u64(&self, field: &str) -> Result<Option<u64>> {
        self.get(field)
            .map(|v| v.as_u64().ok_or_else(|| self.err(field, format!("expected a non-negative integer, got {v}"))))
            .transpose()
    }

    pub fn u64(&self, field: &str) -> Result<u64> {
        self.required(field, self.opt_u64(field)?)
    }

    /// A non-negative integer that fits a `usize`.
    pub fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        self.opt_u64(field)?
            .map(|x| usize::try_from(x).map_err(|_| self.err(field, format!("{x} is too large"))))
            .transpose()
    }

    pub fn usize(&self, field: &str) -> Result<usize> {
        self.required(field, self.opt_usize(field)?)
    }

    /// A finite number.
    pub fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        self.get(field)
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| self.err(field, format!("expected a finite number, got {v}")))
            })
            .transpose()
    }

    pub fn f64(&self, field: &str) -> Result<f64> {
        self.required(field, self.opt_f64(field)?)
    }

    pub fn opt_str(&self, field: &str) -> Result<Option<&'a str>> {
        self.get(field)
            .map(|v| v.as_str().ok_or_else(|| self.err(field, format!("expected a string, got {v}"))))
            .transpose()
    }

    pub fn str(&self, field: &str) -> Result<&'a str> {
        self.required(field, self.opt_str(field)?)
    }

    pub fn opt_bool(&self, field: &str) -> Result<Option<bool>> {
        self.get(field)
            .map(|v| v.as_bool().ok_or_else(|| self.err(field, format!("expected true or false, got {v}"))))
            .transpose()
    }

    /// A boolean, `default` when absent.
    pub fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        Ok(self.opt_bool(field)?.unwrap_or(default))
    }

    /// Token ids written as one id or a list of ids (as `eos_token_id` is); empty when absent.
    pub fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        let one = |x: &Value| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| self.err(field, format!("expected a token id (a non-negative 32-bit integer), got {x}")))
        };
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(list)) => list.iter().map(one).collect(),
            Some(x) => Ok(vec![one(x)?]),
        }
    }
}

#[cfg(test)]
mod sweep_tests {
    use super::*;

    /// A killed save's leftovers are removed or put back; everything else stays as it was.
    #[test]
    fn interrupted_writes_are_finished_and_nothing_else_is_touched() {
        let root = tempfile::tempdir().unwrap();
        let dir = |p: &str| {
            let path = root.path().join(p);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::write(path.join("f"), p).unwrap();
            path
        };
        let half = dir("a/.ck.tmp-123");
        let (new, aside) = (dir("b/ck2"), dir("b/.ck2.old-9"));
        let lone_aside = dir("c/.ck3.old-9");
        let kept = [dir("d/keep"), dir("d/.hidden-normal"), dir("d/.x.tmp-12a")];
        let done = sweep_interrupted_writes(root.path()).unwrap();
        assert_eq!(done.len(), 3, "{done:?}");
        assert!(!half.exists() && !aside.exists() && !lone_aside.exists());
        assert_eq!(std::fs::read_to_string(new.join("f")).unwrap(), "b/ck2");
        assert_eq!(std::fs::read_to_string(root.path().join("c/ck3/f")).unwrap(), "c/.ck3.old-9", "not put back");
        assert!(kept.iter().all(|k| k.join("f").exists()));
    }
}
