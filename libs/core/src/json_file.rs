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
