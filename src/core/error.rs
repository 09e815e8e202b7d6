//! One error enum for the core; every variant names the tensor or file it is about.

use std::path::PathBuf;

/// Errors raised by the core. Each maps to one Python exception class in the bindings.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A delta file or blob is corrupt, truncated or malformed.
    #[error("{source_name}: {message}")]
    Format { source_name: String, message: String },
    /// The target (or the previous state) does not match the delta: names, shapes or dtypes.
    #[error("{message}")]
    BaseMismatch { message: String },
    /// The caller's input is unusable (unsupported dtype, bad option, bad name).
    #[error("{message}")]
    InvalidInput { message: String },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn format(source_name: &str, message: impl Into<String>) -> Self {
        Error::Format { source_name: source_name.to_owned(), message: message.into() }
    }
    pub fn mismatch(message: impl Into<String>) -> Self {
        Error::BaseMismatch { message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidInput { message: message.into() }
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
