//! A reflector of identity's node registry: every control-plane service
//! other than identity follows `berth.identity.v1.Nodes/WatchNodes` into a
//! [`NodeDirectory`] (the nodes as identity last described them) and keeps
//! its [`Revocations`] set from it, so a revoked node, and a certificate a
//! node's renewal or rejoin superseded, is refused everywhere within the
//! stream's latency.
//!
//! # Expected flow
//! Each (re)connection receives the whole registry, then `SYNCED`; the
//! directory is replaced at `SYNCED` (level-triggered: whatever was missed
//! while disconnected is healed), then updated event by event. While identity
//! is unreachable the last known state stays in force and the follower
//! retries with jittered backoff. Consumers watch [`NodeDirectory::changed`]
//! and re-read the snapshot, never individual events.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_proto::identity::v1::{Node, NodeState, WatchNodesRequest, nodes_client::NodesClient};
use berth_proto::types::v1::EventKind;
use berth_rpc::{CertificateFloor, Revocations};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// First retry delay after the stream breaks; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);

/// Longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// The nodes as identity last described them, by node id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeSnapshot {
    /// Every node identity knows, by id.
    pub nodes: BTreeMap<String, Node>,
    /// Whether this is a complete picture (a `SYNCED` has been received).
    pub synced: bool,
}

/// A shared, watchable view of identity's node registry; cheap to clone.
#[derive(Debug, Clone)]
pub struct NodeDirectory {
    tx: Arc<watch::Sender<Arc<NodeSnapshot>>>,
}

impl Default for NodeDirectory {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeDirectory {
    /// An empty, not yet synced directory.
    pub fn new() -> Self {
        Self { tx: Arc::new(watch::channel(Arc::new(NodeSnapshot::default())).0) }
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<NodeSnapshot> {
        self.tx.borrow().clone()
    }

    /// A receiver that wakes on every change; read the snapshot from it.
    pub fn changed(&self) -> watch::Receiver<Arc<NodeSnapshot>> {
        self.tx.subscribe()
    }

    fn replace(&self, snapshot: NodeSnapshot) {
        self.tx.send_replace(Arc::new(snapshot));
    }

    fn upsert(&self, node: Node) {
        self.tx.send_modify(|s| {
            let mut next = (**s).clone();
            next.nodes.insert(node.node_id.clone(), node);
            *s = Arc::new(next);
        });
    }

    fn remove(&self, node_id: &str) {
        self.tx.send_modify(|s| {
            let mut next = (**s).clone();
            next.nodes.remove(node_id);
            *s = Arc::new(next);
        });
    }
}

/// Follows identity at `identity_addr` into `directory` and `revocations`
/// until `stop`.
pub fn follow_nodes(
    identity_addr: String,
    credentials: TlsCredentials,
    directory: NodeDirectory,
    revocations: Revocations,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        let mut backoff = MIN_BACKOFF;
        loop {
            let result = tokio::select! {
                _ = stop.cancelled() => return,
                result = follow_once(&identity_addr, &credentials, &directory, &revocations, &mut backoff) => result,
            };
            if let Err(status) = result {
                tracing::warn!(identity = %identity_addr, code = ?status.code(), message = status.message(),
                    "node stream from identity broke; retrying");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(berth_core::backoff::spread(backoff)) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    });
}

fn is_revoked(node: &Node) -> bool {
    node.state == NodeState::Revoked as i32
}

/// Which of the node's certificates are still its own, as identity says.
fn certificate_floor(node: &Node) -> CertificateFloor {
    let seconds = |t: &Option<prost_types::Timestamp>| t.as_ref().map_or(0, |t| t.seconds);
    let millis = |t: &Option<prost_types::Timestamp>| t.as_ref().map_or(0, berth_proto::timestamp_to_ms);
    CertificateFloor {
        floor_s: seconds(&node.certificate_floor),
        next_s: seconds(&node.certificate_next_floor),
        moves_at_ms: millis(&node.certificate_floor_moves_at),
    }
}

async fn follow_once(
    addr: &str,
    credentials: &TlsCredentials,
    directory: &NodeDirectory,
    revocations: &Revocations,
    backoff: &mut Duration,
) -> Result<(), tonic::Status> {
    let channel =
        berth_rpc::connect(addr, credentials.clone()).map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut stream =
        NodesClient::new(channel).watch_nodes(WatchNodesRequest { tier: String::new() }).await?.into_inner();
    let mut initial: Option<BTreeMap<String, Node>> = Some(BTreeMap::new());
    while let Some(event) = stream.message().await? {
        let kind = EventKind::try_from(event.kind).unwrap_or(EventKind::Unspecified);
        match (kind, event.node, initial.as_mut()) {
            (EventKind::Synced, _, Some(_)) => {
                if let Some(nodes) = initial.take() {
                    let revoked: HashSet<String> =
                        nodes.values().filter(|n| is_revoked(n)).map(|n| n.node_id.clone()).collect();
                    tracing::debug!(nodes = nodes.len(), revoked = revoked.len(), "in sync with identity's registry");
                    revocations.replace(revoked);
                    revocations.replace_floors(
                        nodes
                            .values()
                            .map(|n| (n.node_id.clone(), certificate_floor(n)))
                            .filter(|(_, floor)| *floor != CertificateFloor::default())
                            .collect(),
                    );
                    directory.replace(NodeSnapshot { nodes, synced: true });
                }
                *backoff = MIN_BACKOFF;
            }
            (EventKind::Upsert, Some(node), Some(nodes)) => {
                nodes.insert(node.node_id.clone(), node);
            }
            (EventKind::Removed, Some(node), Some(nodes)) => {
                nodes.remove(&node.node_id);
            }
            (EventKind::Upsert, Some(node), None) => {
                if is_revoked(&node) {
                    tracing::info!(node = %node.node_id, "node revoked");
                    revocations.revoke(&node.node_id);
                }
                revocations.set_floor(&node.node_id, certificate_floor(&node));
                directory.upsert(node);
            }
            (EventKind::Removed, Some(node), None) => {
                revocations.set_floor(&node.node_id, CertificateFloor::default());
                directory.remove(&node.node_id);
            }
            _ => {}
        }
    }
    Err(tonic::Status::unavailable("identity closed the node stream"))
}
