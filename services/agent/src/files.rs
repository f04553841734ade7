//! [`FileError`], the one way every part of the agent names a file of its
//! state it could not use, and the blocking pool file work runs on. A leaf:
//! it imports nothing of the agent.

use std::path::Path;

/// A file or directory of the agent's state that could not be created,
/// read or written: what was being done, to which path, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} {path}: {source}")]
pub struct FileError {
    /// What was being done ("read", "create").
    pub action: &'static str,
    /// The path, as shown.
    pub path: String,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

impl FileError {
    pub(crate) fn new(action: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self { action, path: path.display().to_string(), source }
    }
}

/// Runs `f`, file work that may block, on the blocking pool; a task that
/// could not finish (it panicked) is a [`FileError`] like any other.
pub(crate) async fn on_blocking_pool<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, E>
where
    T: Send + 'static,
    E: From<FileError> + Send + 'static,
{
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(FileError { action: "finish", path: String::new(), source: std::io::Error::other(e.to_string()) }.into())
    })
}
