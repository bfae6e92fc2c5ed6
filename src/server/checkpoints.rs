//! Checkpoint names and paths:
//! `tinker://{training_run_id}/{weights|sampler_weights|external_weights}/{name}`
//! (the training run id is the model id), stored under
//! `<data-dir>/checkpoints/{run}/{kind}/{name}/`. A name is one plain path segment: empty
//! names, `.`/`..`, separators, NUL and absolute paths are rejected, so nothing escapes the data
//! dir.

use std::path::{Path, PathBuf};

use super::errors::{ApiError, ApiResult};

pub const SCHEME: &str = "tinker://";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `save_state`: adapters + optimizer state.
    Weights,
    /// `save_weights_for_sampler`: what a sampler needs.
    SamplerWeights,
    /// `save_weights_external`: an export to download (possibly age-encrypted).
    ExternalWeights,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Weights => "weights",
            Kind::SamplerWeights => "sampler_weights",
            Kind::ExternalWeights => "external_weights",
        }
    }

    pub fn parse(s: &str) -> ApiResult<Kind> {
        match s {
            "weights" => Ok(Kind::Weights),
            "sampler_weights" => Ok(Kind::SamplerWeights),
            "external_weights" => Ok(Kind::ExternalWeights),
            _ => Err(ApiError::user(format!(
                "unknown checkpoint kind `{s}` (weights, sampler_weights or external_weights)"
            ))),
        }
    }
}

/// A checkpoint's address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointRef {
    pub run_id: String,
    pub kind: Kind,
    pub name: String,
}

/// Checks that `s` is one safe path segment (a checkpoint name or a run id).
pub fn check_segment(what: &str, s: &str) -> ApiResult<()> {
    let bad = s.is_empty()
        || s == "."
        || s == ".."
        || s.contains(['/', '\\', '\0'])
        || Path::new(s).is_absolute()
        || s.len() > 200;
    if bad {
        return Err(ApiError::user(format!(
            "invalid {what} `{s}`: one path segment of 1 to 200 characters without `/`, `\\`, or `..`"
        )));
    }
    Ok(())
}

impl CheckpointRef {
    pub fn new(run_id: &str, kind: Kind, name: &str) -> ApiResult<Self> {
        check_segment("training run id", run_id)?;
        check_segment("checkpoint name", name)?;
        Ok(CheckpointRef { run_id: run_id.to_string(), kind, name: name.to_string() })
    }

    /// Parses `tinker://{run}/{kind}/{name}`.
    pub fn parse(path: &str) -> ApiResult<Self> {
        let rest = path
            .strip_prefix(SCHEME)
            .ok_or_else(|| ApiError::user(format!("`{path}` is not a tinker:// checkpoint path")))?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [run, kind, name] => CheckpointRef::new(run, Kind::parse(kind)?, name),
            _ => Err(ApiError::user(format!(
                "`{path}` is not of the form tinker://RUN/KIND/NAME (KIND: weights, sampler_weights or external_weights)"
            ))),
        }
    }

    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/{}/{}", self.run_id, self.kind.as_str(), self.name)
    }

    pub fn dir(&self, data_dir: &Path) -> PathBuf {
        data_dir.join("checkpoints").join(&self.run_id).join(self.kind.as_str()).join(&self.name)
    }
}

/// `text` without the server's own paths: a checkpoint's directory (or a file in it) becomes
/// its `tinker://` path, anything else under the data dir `<data dir>/…` (error messages reach
/// every client; the server's file system is none of their business).
pub fn redact(text: &str, data_dir: &Path) -> String {
    let root = data_dir.display().to_string();
    if root.is_empty() || !text.contains(&root) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(&root) {
        out.push_str(&rest[..at]);
        let after = &rest[at + root.len()..];
        // The path runs to the first character that cannot be in one of ours.
        let end = after.find(|c: char| c.is_whitespace() || "`'\"(),;".contains(c)).unwrap_or(after.len());
        // A colon ends the path when prose follows it ("…/f.safetensors: cannot read"); run ids
        // hold colons too, but never end with one.
        let end = after[..end].trim_end_matches(':').len();
        let segments: Vec<&str> = after[..end].split('/').filter(|s| !s.is_empty()).collect();
        match segments.as_slice() {
            ["checkpoints", run, kind, name, ..] => out.push_str(&format!("{SCHEME}{run}/{kind}/{name}")),
            _ => out.push_str("<data dir>"),
        }
        if !matches!(segments.as_slice(), ["checkpoints", _, _, _, ..]) {
            out.push_str(&after[..end]);
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_texts_name_checkpoints_not_server_paths() {
        let data = Path::new("/srv/oxrl/data");
        let text = "/srv/oxrl/data/checkpoints/s:train:0/weights/step-1/adapter_model.safetensors: cannot read (`/srv/oxrl/data/ephemeral/x` too)";
        assert_eq!(redact(text, data), "tinker://s:train:0/weights/step-1: cannot read (`<data dir>/ephemeral/x` too)");
        assert_eq!(redact("nothing here", data), "nothing here");
    }

    #[test]
    fn names_cannot_escape() {
        for bad in ["", ".", "..", "a/b", "../x", "/etc", "a\\b", "x\0"] {
            assert!(CheckpointRef::new("run", Kind::Weights, bad).is_err(), "{bad:?}");
        }
        let c = CheckpointRef::parse("tinker://s:train:0/weights/step-1").unwrap();
        assert_eq!((c.run_id.as_str(), c.kind, c.name.as_str()), ("s:train:0", Kind::Weights, "step-1"));
        assert_eq!(c.uri(), "tinker://s:train:0/weights/step-1");
        assert!(CheckpointRef::parse("tinker://r/weights/../../x").is_err());
        assert!(CheckpointRef::parse("tinker://r/other/x").is_err());
        assert!(CheckpointRef::parse("/abs/path").is_err());
    }
}
