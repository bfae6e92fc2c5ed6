//! Reading and writing the JSON files and directories of models, adapters and checkpoints,
//! with errors that name the file, and writes that never leave half a file or directory:
//! everything is written under a temporary name and renamed into place.

use std::path::{Path, PathBuf};

use serde_json::Value;

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
