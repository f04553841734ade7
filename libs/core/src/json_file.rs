//! Why a JSON file given to a berth binary (an egress spec, a registry
//! credentials file) was refused. Every message names the file and, when one
//! field is at fault, that field's path, so an operator can go straight to it.

use serde_json::Value;

/// Why a JSON file was refused.
#[derive(Debug, thiserror::Error)]
pub enum JsonFileError {
    /// The file (or stdin) could not be read.
    #[error("cannot read {file}: {source}")]
    Read {
        /// The file, or "stdin".
        file: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not JSON.
    #[error("{file} is not JSON: {source}")]
    Syntax {
        /// The file, or "stdin".
        file: String,
        /// Where the parser stopped.
        #[source]
        source: serde_json::Error,
    },
    /// A field is unknown, missing or holds a value it may not hold.
    #[error("{file}: {path}: {problem}")]
    Field {
        /// The file, or "stdin".
        file: String,
        /// The field's path, e.g. `listeners[1].port`.
        path: String,
        /// What is wrong with it.
        problem: String,
    },
}

impl JsonFileError {
    /// `text`, read from `file`, as JSON.
    pub fn parse(file: &str, text: &str) -> Result<Value, Self> {
        serde_json::from_str(text).map_err(|source| Self::Syntax { file: file.to_owned(), source })
    }
}

/// Writes `value` as JSON to `path` whole or not at all: a temporary file
/// beside it, synced, renamed over it, and the directory synced, so a
/// crash leaves the old file or the new one, never a part.
pub fn write_json_atomically<T: serde::Serialize>(path: &std::path::Path, value: &T) -> std::io::Result<()> {
    use std::io::Write as _;
    let name = path.file_name().and_then(|name| name.to_str()).unwrap_or("file");
    let partial = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    let json = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    let mut file = std::fs::File::create(&partial)?;
    file.write_all(&json)?;
    file.sync_all()?;
    std::fs::rename(&partial, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}
