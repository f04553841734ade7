//! [`NodesApiError`]: why a `Nodes` call failed, and the status it answers
//! with. A leaf, so the node handlers and the upgrade rollouts (whose calls
//! are `Nodes` calls too) share it without importing each other.

use berth_store::StoreError;

/// Why a `Nodes` call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NodesApiError {
    /// A request field is missing or malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The request field.
        field: &'static str,
        /// What it must be instead.
        reason: String,
    },
    /// No node has this id (never joined, or forgotten).
    #[error("node {0} not found")]
    NotFound(String),
    /// The node is revoked, which is final.
    #[error("node {0} revoked; a revoked node cannot be drained")]
    Revoked(String),
    /// The node is revoked, which is final.
    #[error("node {0} revoked; a revoked node cannot be upgraded")]
    RevokedNotUpgraded(String),
    /// The agent artifact could not be resolved to a digest.
    #[error("cannot resolve the agent artifact '{reference}': {reason}")]
    Unresolvable {
        /// The reference as asked for.
        reference: String,
        /// Why.
        reason: String,
    },
    /// No such upgrade.
    #[error("{0}")]
    NoUpgrade(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(NodesApiError, |error| match error {
    NodesApiError::InvalidArgument { .. } => tonic::Status::invalid_argument(error.to_string()),
    NodesApiError::NotFound(_) => tonic::Status::not_found(error.to_string()),
    NodesApiError::Revoked(_) | NodesApiError::RevokedNotUpgraded(_) | NodesApiError::Unresolvable { .. } => {
        tonic::Status::failed_precondition(error.to_string())
    }
    NodesApiError::NoUpgrade(_) => tonic::Status::not_found(error.to_string()),
    NodesApiError::Store(error) => error.into(),
});
