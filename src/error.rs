//! The crate's error type: every variant names the file, field or tensor at fault.

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
