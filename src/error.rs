//! The crate's error type: every variant names the file, field or tensor at fault; and the
//! "did you mean" rule for unknown names and keys ([`nearest_name`], [`did_you_mean`]), used by every
//! such error.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    ConfigField { path: PathBuf, field: String, message: String },
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor { path: PathBuf, tensor: String, message: String },
    #[error("invalid input: {0}")]
    Input(String),
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// An engine that cannot be reached: it died or stopped answering (the engine client
    /// routes around it).
    #[error("{0}")]
    EngineDown(String),
    /// The user's Python code (a reward function or an environment) raised, timed out, returned
    /// the wrong type or lost its worker: the run stops with this message after a checkpoint.
    #[error("{0}")]
    UserCode(String),
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn file(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        Error::File { path: path.into(), message: message.to_string() }
    }
    pub fn field(path: impl Into<PathBuf>, field: &str, message: impl std::fmt::Display) -> Self {
        Error::ConfigField { path: path.into(), field: field.to_string(), message: message.to_string() }
    }
    pub fn tensor(path: impl Into<PathBuf>, tensor: &str, message: impl std::fmt::Display) -> Self {
        Error::Tensor { path: path.into(), tensor: tensor.to_string(), message: message.to_string() }
    }
    pub fn input(message: impl std::fmt::Display) -> Self {
        Error::Input(message.to_string())
    }
}

/// The candidate `word` was most likely meant to be, if one is near enough to be a typo: the
/// nearest by [`edit_distance`] within a budget of a third of the word's length (at least 1
/// edit), else the first that contains the word (an abbreviation: `clip_low` for
/// `clip_low_threshold`; words of 3 chars or more, as shorter ones are in too many names).
/// Ties go to the first candidate.
/// `; did you mean `candidate`?`: the one wording of every suggestion in oxrl's messages.
pub fn did_you_mean(candidate: &str) -> String {
    format!("; did you mean `{candidate}`?")
}

/// The message for a name (of a `kind` such as "mode") that is not one of `valid`: the nearest
/// valid name ([`nearest_name`]) and every valid one.
pub fn unknown_name_message(kind: &str, name: &str, valid: &[&str]) -> String {
    let hint = nearest_name(name, valid).map(did_you_mean).unwrap_or_default();
    format!("unknown {kind} `{name}`{hint} (valid: {})", valid.join(", "))
}

pub fn nearest_name<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let budget = (word.chars().count() / 3).max(1);
    let nearest = candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(distance, _)| *distance <= budget)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, c)| c);
    nearest.or_else(|| candidates.iter().copied().find(|c| word.chars().count() >= 3 && c.contains(word)))
}

/// Edit distance between two strings, in chars: insertions, deletions, substitutions and
/// swaps of two adjacent chars each cost 1 (optimal string alignment), since a swap
/// (`rnak` for `rank`) is as common a typo as a wrong letter.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}
