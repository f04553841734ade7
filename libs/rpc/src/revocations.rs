//! The revoked nodes a server refuses, whatever their certificate says.
//!
//! A node certificate stays cryptographically valid until it expires;
//! revocation is enforced by every server checking this set before the
//! handler runs. Identity owns the truth; every other service follows it
//! through `Nodes/WatchNodes`, so a revocation reaches all of them within
//! the stream's latency.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};

/// A shared set of revoked node ids; cheap to clone, every clone sees
/// every change.
#[derive(Debug, Clone, Default)]
pub struct Revocations {
    revoked: Arc<RwLock<HashSet<String>>>,
}

impl Revocations {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuses `node_id` from now on.
    pub fn revoke(&self, node_id: &str) {
        self.revoked.write().unwrap_or_else(|e| e.into_inner()).insert(node_id.to_string());
    }

    /// Replaces the whole set (after a full resync).
    pub fn replace(&self, node_ids: HashSet<String>) {
        *self.revoked.write().unwrap_or_else(|e| e.into_inner()) = node_ids;
    }

    /// Whether `node_id` is refused.
    pub fn is_revoked(&self, node_id: &str) -> bool {
        self.revoked.read().unwrap_or_else(|e| e.into_inner()).contains(node_id)
    }

    /// How many nodes are refused.
    pub fn len(&self) -> usize {
        self.revoked.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no node is refused.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
