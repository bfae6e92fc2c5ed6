//! Models by Hugging Face Hub id: `Qwen/Qwen3-0.6B` wherever a model directory is asked for.
//!
//! [`resolve_model_dir`] is the one place a model path becomes a local directory, for every entry
//! point (`model.path` of the SFT and RL configs, `--model` of every subcommand):
//!
//! - an existing local path is used as it is, whatever else the string looks like;
//! - an `owner/name` string that is not one is a Hub repo: its files are fetched at `revision`
//!   (a branch, tag or commit; default `main`) into the standard Hugging Face cache
//!   (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`) through `hf-hub`, HF's
//!   own client, and the snapshot directory `models--owner--name/snapshots/<commit>` is returned;
//! - anything else is returned unchanged, for the loader to report.
//!
//! Which files: `config.json`, the tokenizer's and the chat template's, `generation_config.json`,
//! a PEFT adapter's two files, and the safetensors weights: the shards a
//! `model.safetensors.index.json` lists, else `model.safetensors` (other `*.safetensors` in a
//! repo, such as a second copy in another layout, are not fetched). A file already in the
//! snapshot is not fetched again, and all of them come from the one commit the repo's listing
//! named, so a branch that moves meanwhile cannot mix two commits.
//!
//! The environment, as `huggingface_hub` reads it: `HF_ENDPOINT` (default
//! `https://huggingface.co`), `HF_TOKEN` (else the token file `HF_HOME/token`),
//! `HF_HUB_OFFLINE=1` (the cache alone: a snapshot missing there, or missing one of its weight
//! files, is an error naming the repo, revision and file). When the Hub cannot be reached at all,
//! a complete snapshot of the revision in the cache is used, with a note. A repo, revision or file
//! the Hub does not have is an error naming it and the endpoint.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use crate::{Error, Result};

/// The files of a model repo fetched besides the weights, when the repo has them.
const SIDE_FILES: [&str; 13] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "adapter_config.json",
    "adapter_model.safetensors",
];
const CONFIG: &str = "config.json";
const ADAPTER_CONFIG: &str = "adapter_config.json";
const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const DEFAULT_REVISION: &str = "main";
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// How long to wait for another process downloading the same file (a data-parallel job's
/// processes on one machine resolve the same model at once).
const LOCK_WAIT: Duration = Duration::from_secs(3600);

/// `path` as a local model directory: itself if it exists; else, if it reads as a Hub
/// repo id (`owner/name`), that repo's snapshot at `revision` (`""`: `main`) in the Hugging Face
/// cache, downloaded there first if need be; else `path` unchanged.
pub fn resolve_model_dir(path: &Path, revision: &str) -> Result<PathBuf> {
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    match path.to_str().filter(|s| is_repo_id(s)) {
        Some(repo_id) => Hub::from_env()?.snapshot(repo_id, revision),
        None => Ok(path.to_path_buf()),
    }
}

/// Whether `s` has the form of a Hub model id, `owner/name`: two parts of ASCII letters, digits,
/// `-`, `_` and `.`, neither starting or ending with `-` or `.`, without `--` or `..` (which the
/// Hub forbids), at most 96 characters each. `./x`, `/abs/x` and `a/b/c` are paths.
pub fn is_repo_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
            && !p.contains("--")
            && !p.contains("..")
    };
    matches!(s.split_once('/'), Some((owner, name)) if part(owner) && part(name) && !name.contains('/'))
}

/// The repo id of a snapshot directory of the Hugging Face cache
/// (`…/models--owner--name/snapshots/<commit>` → `owner/name`), the name a server shows for a
/// model given by Hub id; `None` for any other directory.
pub fn repo_id_of_snapshot(dir: &Path) -> Option<String> {
    let snapshots = dir.parent()?;
    if snapshots.file_name()? != "snapshots" {
        return None;
    }
    let folder = snapshots.parent()?.file_name()?.to_str()?;
    let id = folder.strip_prefix("models--")?.replace("--", "/");
    is_repo_id(&id).then_some(id)
}

/// The name a model directory is served under: a Hub snapshot's repo id, else the directory's
/// name (what `oxrl engine` reports and a trainer checks its remote engines against).
pub fn served_name(dir: &Path) -> Option<String> {
    repo_id_of_snapshot(dir).or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned()))
}

/// Where and how to reach the Hub, from the environment.
struct Hub {
    endpoint: String,
    /// The `hub` cache directory (`HF_HOME/hub`).
    cache: PathBuf,
    token: Option<String>,
    offline: bool,
}

impl Hub {
    fn from_env() -> Result<Hub> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let home = || -> Result<PathBuf> {
            if let Some(h) = var("HF_HOME") {
                return Ok(PathBuf::from(h));
            }
            let cache =
                var("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache")));
            cache.map(|c| c.join("huggingface")).ok_or_else(|| {
                Error::Other("a Hub model needs a cache directory: set HF_HOME (neither it nor HOME is set)".into())
            })
        };
        let cache = match var("HF_HUB_CACHE") {
            Some(c) => PathBuf::from(c),
            None => home()?.join("hub"),
        };
        let token = match var("HF_TOKEN") {
            Some(t) => Some(t.trim().to_string()),
            None => {
                let file = match var("HF_TOKEN_PATH") {
                    Some(p) => Some(PathBuf::from(p)),
                    None => home().ok().map(|h| h.join("token")),
                };
                file.and_then(|f| std::fs::read_to_string(f).ok())
                    .map(|t| t.trim().to_string())
                    .filter(|t| !t.is_empty())
            }
        };
        let offline = var("HF_HUB_OFFLINE")
            .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()).trim_end_matches('/').to_string();
        Ok(Hub { endpoint, cache, token, offline })
    }

    /// The snapshot of `repo_id` at `revision` in the cache, fetched first unless offline.
    fn snapshot(&self, repo_id: &str, revision: &str) -> Result<PathBuf> {
        let revision = if revision.is_empty() { DEFAULT_REVISION } else { revision };
        let at = format!("{repo_id} (revision {revision})");
        if self.offline {
            return self.cached(repo_id, revision).map_err(|missing| {
                Error::Other(format!(
                    "HF_HUB_OFFLINE is set and {at} is not in the Hugging Face cache {}: {missing}",
                    self.cache.display()
                ))
            });
        }
        let api = ApiBuilder::from_cache(Cache::new(self.cache.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(std::io::stderr().is_terminal())
            .build()
            .map_err(|e| Error::Other(format!("cannot set up the Hub client for {at}: {e}")))?;
        let listing = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string());
        let info = match api.repo(listing).info() {
            Ok(info) => info,
            Err(e) if unreachable(&e) => {
                return match self.cached(repo_id, revision) {
                    Ok(dir) => {
                        eprintln!(
                            "note: {} cannot be reached ({e}); using {at} from the cache: {}",
                            self.endpoint,
                            dir.display()
                        );
                        Ok(dir)
                    }
                    Err(missing) => Err(Error::Other(format!(
                        "cannot reach {} to download {at}: {e}; nor is it in the Hugging Face cache {} ({missing})",
                        self.endpoint,
                        self.cache.display()
                    ))),
                };
            }
            Err(e) => return Err(self.request_error(&e, &at, None)),
        };
        let commit = info.sha.clone();
        let names: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
        if !names.contains(&CONFIG) && !names.contains(&ADAPTER_CONFIG) {
            return Err(Error::Other(format!(
                "{at} on {} has no {CONFIG}: not a model in the Hugging Face layout",
                self.endpoint
            )));
        }
        let snapshot = self.repo_dir(repo_id).join("snapshots").join(&commit);
        // Every file from the listed commit: a branch that moves during the download cannot mix two.
        let repo = api.repo(Repo::with_revision(repo_id.to_string(), RepoType::Model, commit.clone()));
        let mut fetcher = Fetcher { hub: self, repo: &repo, snapshot: &snapshot, at: &at, announced: false };
        for name in SIDE_FILES.iter().filter(|f| names.contains(f)) {
            fetcher.fetch(name)?;
        }
        if names.contains(&ADAPTER_CONFIG) && !names.contains(&CONFIG) {
            // A PEFT adapter repo: its two files are all there is.
        } else if names.contains(&weight_files::INDEX) {
            let index = fetcher.fetch(weight_files::INDEX)?;
            for shard in weight_files::shards(&index)? {
                if !names.contains(&shard.as_str()) {
                    return Err(Error::Other(format!(
                        "{at} on {}: {} lists {shard}, which the repo does not have",
                        self.endpoint,
                        weight_files::INDEX
                    )));
                }
                fetcher.fetch(&shard)?;
            }
        } else if names.contains(&weight_files::SINGLE) {
            fetcher.fetch(weight_files::SINGLE)?;
        } else {
            return Err(Error::Other(format!(
                "{at} on {} has neither {} nor {}: oxrl reads safetensors weights only",
                self.endpoint,
                weight_files::SINGLE,
                weight_files::INDEX
            )));
        }
        // The revision now names this commit in the cache (what the offline mode reads); the
        // downloads recorded the commit as a ref to itself, which the cache does not keep.
        Cache::new(self.cache.clone())
            .repo(Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string()))
            .create_ref(&commit)
            .map_err(|e| Error::file(self.repo_dir(repo_id).join("refs").join(revision), e))?;
        if revision != commit {
            let _ = std::fs::remove_file(self.repo_dir(repo_id).join("refs").join(&commit));
        }
        Ok(snapshot)
    }

    /// `models--owner--name` in the cache.
    fn repo_dir(&self, repo_id: &str) -> PathBuf {
        self.cache.join(Repo::model(repo_id.to_string()).folder_name())
    }

    /// The cached snapshot of `repo_id` at `revision` if it is complete (its config and every
    /// weight file); else what is missing, named.
    fn cached(&self, repo_id: &str, revision: &str) -> std::result::Result<PathBuf, String> {
        let repo_dir = self.repo_dir(repo_id);
        let is_commit = revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit());
        let commit = if is_commit && repo_dir.join("snapshots").join(revision).is_dir() {
            revision.to_string()
        } else {
            let r = repo_dir.join("refs").join(revision);
            match std::fs::read_to_string(&r) {
                Ok(c) => c.trim().to_string(),
                Err(_) => return Err(format!("no snapshot of revision {revision} ({} is missing)", r.display())),
            }
        };
        let dir = repo_dir.join("snapshots").join(&commit);
        let has = |f: &str| dir.join(f).is_file();
        let missing = |f: &str| format!("{f} of commit {commit} is missing from {}", dir.display());
        if !has(CONFIG) {
            return match has(ADAPTER_CONFIG) && has(ADAPTER_WEIGHTS) {
                true => Ok(dir),
                false => Err(missing(CONFIG)),
            };
        }
        if has(weight_files::INDEX) {
            let shards = weight_files::shards(&dir.join(weight_files::INDEX)).map_err(|e| e.to_string())?;
            if let Some(s) = shards.iter().find(|s| !has(s)) {
                return Err(missing(s));
            }
        } else if !has(weight_files::SINGLE) {
            return Err(missing(weight_files::SINGLE));
        }
        Ok(dir)
    }

    /// A failed request as an error naming what was asked for: the repo (`file` None) or a file.
    fn request_error(&self, e: &ApiError, at: &str, file: Option<&str>) -> Error {
        let what = match file {
            Some(f) => format!("file {f} of {at}"),
            None => at.to_string(),
        };
        let ApiError::RequestError(req) = e else {
            return Error::Other(format!("cannot download {what} from {}: {e}", self.endpoint));
        };
        let ureq2::Error::Status(code, response) = req.as_ref() else {
            return Error::Other(format!("cannot download {what} from {}: {e}", self.endpoint));
        };
        // The Hub says which of repo, revision and file it lacks.
        let hub_code = response.header("x-error-code").unwrap_or_default();
        let endpoint = &self.endpoint;
        let message = match (*code, hub_code, file) {
            (_, "RevisionNotFound", _) => format!("no such revision of {at} on {endpoint}"),
            (404, "EntryNotFound", Some(f)) | (404, "", Some(f)) => format!("no such file {f} in {at} on {endpoint}"),
            (404, _, _) => format!("no such repo {at} on {endpoint} (and no local directory of that name)"),
            (401, _, _) if self.token.is_none() => format!(
                "{what} on {endpoint}: 401 Unauthorized: no such repo, or a private one (set HF_TOKEN to a token \
                 that can read it)"
            ),
            (401 | 403, _, _) => format!(
                "{what} on {endpoint}: {code}: access refused (a gated repo's terms must be accepted on the Hub by the \
                 HF_TOKEN's account, and the token must be able to read it)"
            ),
            _ => format!("cannot download {what} from {endpoint}: HTTP {code}"),
        };
        Error::Other(message)
    }
}

/// Downloads the files of one snapshot, skipping those already in it.
struct Fetcher<'a> {
    hub: &'a Hub,
    repo: &'a ApiRepo,
    snapshot: &'a Path,
    at: &'a str,
    announced: bool,
}

impl Fetcher<'_> {
    /// The local path of `name` in the snapshot, downloaded if it is not there yet.
    fn fetch(&mut self, name: &str) -> Result<PathBuf> {
        let local = self.snapshot.join(name);
        if local.is_file() {
            return Ok(local);
        }
        if !self.announced {
            eprintln!("downloading {} from {} into {}", self.at, self.hub.endpoint, self.snapshot.display());
            self.announced = true;
        }
        let start = Instant::now();
        loop {
            match self.repo.download(name) {
                Ok(path) if path == local => return Ok(path),
                // The Hub answered for another commit than the one asked for.
                Ok(path) => {
                    return Err(Error::Other(format!(
                        "{name} of {} came as {}, not of the commit listed ({})",
                        self.at,
                        path.display(),
                        local.display()
                    )))
                }
                // Another process holds the file's lock: it is downloading the same file.
                Err(ApiError::LockAcquisition(_)) if start.elapsed() < LOCK_WAIT => {
                    if local.is_file() {
                        return Ok(local);
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
                Err(e) => return Err(self.hub.request_error(&e, self.at, Some(name))),
            }
        }
    }
}

/// Whether a request failed before any answer from the Hub (no route, refused, DNS, TLS).
fn unreachable(e: &ApiError) -> bool {
    matches!(e, ApiError::RequestError(r) if matches!(r.as_ref(), ureq2::Error::Transport(_)))
}

/// The safetensors layout of a model's weights, as [`super::weights`] reads it.
mod weight_files {
    use std::path::Path;

    use crate::{Error, Result};

    pub const SINGLE: &str = super::super::weights::SINGLE_FILE;
    pub const INDEX: &str = super::super::weights::INDEX_FILE;

    /// The shard files an index's `weight_map` names, each once, in order.
    pub fn shards(index: &Path) -> Result<Vec<String>> {
        let text = std::fs::read_to_string(index).map_err(|e| Error::file(index, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::file(index, format!("invalid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::field(index, "weight_map", "missing or not an object"))?;
        let mut files: Vec<String> = vec![];
        for f in map.values() {
            let f = f.as_str().ok_or_else(|| Error::field(index, "weight_map", "a value is not a file name"))?;
            if !files.iter().any(|x| x == f) {
                files.push(f.to_string());
            }
        }
        files.sort();
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths() {
        for id in ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B", "a/b", "org_x/model.v2"] {
            assert!(is_repo_id(id), "{id}");
        }
        for p in ["", "gpt2", "./a/b", "/abs/x", "a/b/c", "a/", "/b", "a/-b", "a/b.", "a--b/c", "a/b..c", "runs/x y"] {
            assert!(!is_repo_id(p), "{p}");
        }
    }

    #[test]
    fn snapshot_dirs_name_their_repo() {
        let d = Path::new("/c/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd");
        assert_eq!(repo_id_of_snapshot(d).as_deref(), Some("Qwen/Qwen3-0.6B"));
        assert_eq!(repo_id_of_snapshot(Path::new("/c/models/qwen3")), None);
        assert_eq!(repo_id_of_snapshot(Path::new("/c/hub/datasets--a--b/snapshots/0")), None);
    }
}
