//! What a server refuses of a node, whatever its certificate says: the
//! node entirely once revoked, and every certificate of it issued before its
//! floor.
//!
//! A node certificate stays cryptographically valid until it expires;
//! revocation and superseding are enforced by every server checking this
//! set before the handler runs. Identity owns the truth; every other
//! service follows it through `Nodes/WatchNodes`, so a revocation or a new
//! floor reaches all of them within the stream's latency.
//!
//! # Why a floor on the issue time, not a fingerprint
//! Identity is the only issuer of node certificates, so a node's
//! certificates are ordered by when they were issued (their notBefore). A
//! floor refuses every certificate before the node's current one — an
//! earlier incarnation's, one a renewal superseded, a leaked copy of either
//! — with one number per node, and it admits a renewed certificate the
//! moment the node presents it, before identity has heard of it: a renewal
//! whose reply was lost leaves the node on its old certificate, so the
//! floor follows what the node *presents* on its heartbeats, never what was
//! last issued. A fingerprint pin would refuse that renewed certificate on
//! every other service until the pin had propagated.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Which of a node's certificates are still its own: those issued at or
/// after the floor in force.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CertificateFloor {
    /// Seconds since the Unix epoch; 0 refuses nothing.
    pub floor_s: i64,
    /// The floor from `moves_at_ms` on; 0 when none is pending.
    pub next_s: i64,
    /// When `next_s` takes over, milliseconds since the Unix epoch.
    pub moves_at_ms: i64,
}

impl CertificateFloor {
    /// The floor of a node whose newest certificate was issued at `issued_s`.
    pub fn at_issue(issued_s: i64) -> Self {
        Self { floor_s: issued_s, next_s: 0, moves_at_ms: 0 }
    }

    /// The floor in force at `now_ms`.
    pub fn in_force(&self, now_ms: i64) -> i64 {
        if self.next_s > 0 && now_ms >= self.moves_at_ms { self.floor_s.max(self.next_s) } else { self.floor_s }
    }

    /// The issue time of the newest certificate the node has presented.
    pub fn newest(&self) -> i64 {
        self.floor_s.max(self.next_s)
    }

    /// The floor after the node presented a certificate issued at
    /// `issued_s` at `now_ms`: when it is newer than any it presented, the
    /// certificates before it are refused from `overlap` on. `None` when
    /// nothing changes.
    pub fn presented(&self, issued_s: i64, now_ms: i64, overlap: Duration) -> Option<Self> {
        if issued_s <= self.newest() {
            return None;
        }
        let overlap_ms = berth_core::millis(overlap);
        Some(Self { floor_s: self.in_force(now_ms), next_s: issued_s, moves_at_ms: now_ms.saturating_add(overlap_ms) })
    }
}

/// A shared set of revoked node ids and of every node's certificate floor;
/// cheap to clone, every clone sees every change.
#[derive(Debug, Clone, Default)]
pub struct Revocations {
    revoked: Arc<RwLock<HashSet<String>>>,
    floors: Arc<RwLock<HashMap<String, CertificateFloor>>>,
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

    /// Sets `node_id`'s certificate floor.
    pub fn set_floor(&self, node_id: &str, floor: CertificateFloor) {
        let mut floors = self.floors.write().unwrap_or_else(|e| e.into_inner());
        if floor == CertificateFloor::default() {
            floors.remove(node_id);
        } else {
            floors.insert(node_id.to_string(), floor);
        }
    }

    /// Replaces every floor (after a full resync).
    pub fn replace_floors(&self, floors: HashMap<String, CertificateFloor>) {
        *self.floors.write().unwrap_or_else(|e| e.into_inner()) = floors;
    }

    /// Why a certificate of `node_id` issued at `issued_s` is refused: it
    /// was issued before the node's floor. `None` when it is the node's.
    pub fn superseded(&self, node_id: &str, issued_s: i64) -> Option<String> {
        let floor = *self.floors.read().unwrap_or_else(|e| e.into_inner()).get(node_id)?;
        let now_ms = berth_core::wall_clock_ms();
        let in_force = floor.in_force(now_ms);
        (issued_s < in_force).then(|| {
            format!(
                "node '{node_id}' presented a certificate superseded by a newer one (issued at {issued_s}, the \
                 node's current certificates from {in_force}, seconds since the Unix epoch): a certificate of an \
                 earlier incarnation, or one a renewal replaced, is refused; rejoin with a join token"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OVERLAP: Duration = Duration::from_secs(60);

    #[test]
    fn a_floor_follows_what_the_node_presents_and_lets_the_old_certificate_finish() {
        let joined = CertificateFloor::at_issue(1_000);
        assert_eq!(joined.in_force(0), 1_000);
        // The certificate it joined with again: nothing changes.
        assert_eq!(joined.presented(1_000, 5_000_000, OVERLAP), None);
        // A renewal issued at 2,000 presented at t = 3,000 s: the old one
        // stays good for the overlap, then only the new one is.
        let renewed = joined.presented(2_000, 3_000_000, OVERLAP).unwrap();
        assert_eq!(renewed.in_force(3_000_000), 1_000);
        assert_eq!(renewed.in_force(3_059_999), 1_000);
        assert_eq!(renewed.in_force(3_060_000), 2_000);
        assert_eq!(renewed.newest(), 2_000);
        // An older certificate presented afterwards moves nothing.
        assert_eq!(renewed.presented(1_500, 3_100_000, OVERLAP), None);
        // Two renewals in a row: the floor in force when the second is
        // presented is kept, never one older.
        let again = renewed.presented(4_000, 3_100_000, OVERLAP).unwrap();
        assert_eq!(again.in_force(3_100_000), 2_000);
        assert_eq!(again.in_force(3_160_000), 4_000);
    }

    #[test]
    fn a_certificate_before_the_floor_is_refused_and_says_why() {
        let revocations = Revocations::new();
        assert_eq!(revocations.superseded("n1", 10), None, "no floor, nothing refused");
        revocations.set_floor("n1", CertificateFloor::at_issue(1_000));
        let refused = revocations.superseded("n1", 999).unwrap();
        assert!(refused.contains("node 'n1'") && refused.contains("superseded"), "{refused}");
        assert_eq!(revocations.superseded("n1", 1_000), None);
        assert_eq!(revocations.superseded("n1", 5_000), None, "a renewal not yet seen is the node's");
        assert_eq!(revocations.superseded("n2", 1), None);
        revocations.replace_floors(HashMap::new());
        assert_eq!(revocations.superseded("n1", 999), None);
    }
}
