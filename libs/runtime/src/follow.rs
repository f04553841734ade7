//! Following identity's node registry for revocations: every control-plane
//! service other than identity keeps a [`Revocations`] set current from
//! `berth.identity.v1.Nodes/WatchNodes`, so a revoked node is refused
//! everywhere within the stream's latency.
//!
//! # Expected flow
//! Each (re)connection receives the whole registry, then `SYNCED`; the set
//! is replaced at `SYNCED` (level-triggered: whatever was missed while
//! disconnected is healed), then updated event by event. While identity is
//! unreachable the last known set stays in force and the follower retries
//! with jittered backoff.

use std::collections::HashSet;
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_proto::identity::v1::{NodeState, WatchNodesRequest, nodes_client::NodesClient};
use berth_proto::types::v1::EventKind;
use berth_rpc::Revocations;
use tokio_util::sync::CancellationToken;

/// First retry delay after the stream breaks; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);

/// Longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Follows identity at `identity_addr` until `stop`.
pub fn follow_revocations(
    identity_addr: String,
    credentials: TlsCredentials,
    revocations: Revocations,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        let mut backoff = MIN_BACKOFF;
        loop {
            let result = tokio::select! {
                _ = stop.cancelled() => return,
                result = follow_once(&identity_addr, &credentials, &revocations, &mut backoff) => result,
            };
            if let Err(status) = result {
                tracing::warn!(identity = %identity_addr, code = ?status.code(), message = status.message(),
                    "revocation stream broke; retrying");
            }
            let jitter = backoff.mul_f64(rand::random::<f64>() * 0.5);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(backoff + jitter) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    });
}

async fn follow_once(
    addr: &str,
    credentials: &TlsCredentials,
    revocations: &Revocations,
    backoff: &mut Duration,
) -> Result<(), tonic::Status> {
    let channel =
        berth_rpc::connect(addr, credentials.clone()).map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut stream =
        NodesClient::new(channel).watch_nodes(WatchNodesRequest { tier: String::new() }).await?.into_inner();
    let mut initial: Option<HashSet<String>> = Some(HashSet::new());
    while let Some(event) = stream.message().await? {
        let kind = EventKind::try_from(event.kind).unwrap_or(EventKind::Unspecified);
        match (kind, event.node, initial.as_mut()) {
            (EventKind::Synced, _, Some(_)) => {
                if let Some(set) = initial.take() {
                    tracing::debug!(revoked = set.len(), "revocations in sync with identity");
                    revocations.replace(set);
                }
                *backoff = MIN_BACKOFF;
            }
            (EventKind::Upsert, Some(node), Some(set)) if node.state == NodeState::Revoked as i32 => {
                set.insert(node.node_id);
            }
            (EventKind::Upsert, Some(node), None) if node.state == NodeState::Revoked as i32 => {
                tracing::info!(node = %node.node_id, "node revoked");
                revocations.revoke(&node.node_id);
            }
            _ => {}
        }
    }
    Err(tonic::Status::unavailable("identity closed the node stream"))
}
