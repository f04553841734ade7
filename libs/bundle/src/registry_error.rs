//! [`RegistryError`]: every way talking to a registry or an OCI layout
//! directory fails, one variant per thing a caller decides on. A leaf below
//! [`crate::client`] and [`crate::layout`], which both answer with it.

use crate::digest::Digest;
use crate::format::FormatError;

/// What went wrong talking to a registry or layout directory.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The reference cannot be used for this operation.
    #[error("invalid reference `{reference}`: {reason}")]
    InvalidReference {
        /// The reference.
        reference: String,
        /// Why.
        reason: String,
    },
    /// The tag names no manifest in the repository.
    #[error("tag not found: {reference}")]
    TagNotFound {
        /// The reference with the tag.
        reference: String,
    },
    /// No manifest has this digest in the repository.
    #[error("manifest {digest} not found in {reference}")]
    ManifestNotFound {
        /// The repository or layout.
        reference: String,
        /// The digest asked for.
        digest: Digest,
    },
    /// A blob the manifest names is missing.
    #[error("blob {digest} not found in {reference}")]
    BlobNotFound {
        /// The repository or layout.
        reference: String,
        /// The blob's digest.
        digest: Digest,
    },
    /// The registry wants credentials, or refused the ones given.
    #[error("unauthorized at {registry}: {detail}")]
    Unauthorized {
        /// The registry.
        registry: String,
        /// What the registry said.
        detail: String,
    },
    /// The registry could not be reached, timed out or failed (5xx, 429), or the layout
    /// directory could not be read; retrying later may work.
    #[error("registry {registry} is unavailable: {detail}")]
    RegistryUnavailable {
        /// The registry or layout directory.
        registry: String,
        /// What went wrong.
        detail: String,
    },
    /// Content did not hash to the digest that names it.
    #[error("{what} does not match its digest: expected {expected}, got {actual}")]
    DigestMismatch {
        /// What was fetched, e.g. `layer sha256:…`.
        what: String,
        /// The digest that names it.
        expected: String,
        /// What the content hashed to, or how its size differed.
        actual: String,
    },
    /// Content is larger than berth reads.
    #[error("{what} is {size} bytes, more than the {limit} allowed")]
    TooLarge {
        /// What was fetched.
        what: String,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The manifest or config is not a berth bundle.
    #[error("{reference} is not a usable bundle: {source}")]
    NotABundle {
        /// The reference.
        reference: String,
        /// What is wrong with it.
        #[source]
        source: FormatError,
    },
    /// The registry refused the request for another reason.
    #[error("registry {registry} refused the request: {detail}")]
    Refused {
        /// The registry.
        registry: String,
        /// What the registry said.
        detail: String,
    },
    /// A layout directory or a download could not be written.
    #[error("cannot write {path}: {source}")]
    Layout {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The client configuration cannot be used (e.g. the CA is not PEM).
    #[error("registry client configuration: {0}")]
    Config(String),
}

impl RegistryError {
    /// Whether retrying later may succeed.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::RegistryUnavailable { .. })
    }
}
