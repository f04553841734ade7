//! The `Nodes` API: reading the registry, revoking and draining nodes, and
//! `WatchNodes`, which every service's revocation follower and the lease
//! placer stream from.
//!
//! # Who writes this
//! `RevokeNode` moves a node to `REVOKED` for good (the row stays for audit)
//! and drops its deadline. `DrainNode` sets or clears the operator's drain
//! mark; a heartbeating node turns `DRAINING` or back `UP` at once, any
//! other node carries the mark into its next `UP`.
//!
//! # WatchNodes
//! Every stream on a replica is fed from that replica's one index (one bus
//! subscription, fanned out in process): the nodes of the snapshot as
//! upserts, then `SYNCED`, then each change as the index applies it. A stream
//! that falls more than the index's change buffer behind is brought level
//! from a fresh snapshot (upserts, removals of nodes it has seen that are
//! gone, `SYNCED` again) rather than cut off.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use berth_proto::identity::v1;
use berth_proto::types::v1::EventKind;
use berth_store::{StoreError, expect_one};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use crate::IdentityService;
use crate::nodes_error::NodesApiError;
use crate::registry::{self, NodeChange, NodeRecord, NodeRegistry, NodeState};

/// Events a `WatchNodes` stream buffers for a slow reader before the feeding
/// task waits on it.
const WATCH_BUFFER: usize = 256;

/// The longest revocation reason kept.
const MAX_REASON_LEN: usize = 1024;

fn require_node_id(node_id: &str) -> Result<(), NodesApiError> {
    if berth_core::is_dns_label(node_id) {
        Ok(())
    } else {
        Err(NodesApiError::InvalidArgument { field: "node_id", reason: format!("'{node_id}' is not a node id") })
    }
}

impl IdentityService {
    async fn get_node_record(&self, node_id: &str) -> Result<NodeRecord, NodesApiError> {
        require_node_id(node_id)?;
        let node_id = node_id.to_owned();
        self.store
            .read("nodes.get", move |conn| {
                let node_id = node_id.clone();
                Box::pin(async move { registry::fetch(conn, &node_id).await?.ok_or(NodesApiError::NotFound(node_id)) })
            })
            .await
    }

    async fn revoke(&self, admin: &str, node_id: &str, reason: &str) -> Result<NodeRecord, NodesApiError> {
        require_node_id(node_id)?;
        if reason.len() > MAX_REASON_LEN {
            return Err(NodesApiError::InvalidArgument {
                field: "reason",
                reason: format!("longer than {MAX_REASON_LEN} bytes"),
            });
        }
        let update = format!(
            "UPDATE nodes SET state = 'revoked', state_changed_at_ms = {now}, revoked_at_ms = {now}, \
             revoked_reason = $2, revision = revision + 1 WHERE node_id = $1 AND state <> 'revoked'",
            now = self.store.now_ms_sql()
        );
        let (id, why) = (node_id.to_owned(), format!("{reason} (by {admin})"));
        let record = self
            .store
            .tx("nodes.revoke", move |conn| {
                let (update, id, why) = (update.clone(), id.clone(), why.clone());
                Box::pin(async move {
                    sqlx::query(sqlx::AssertSqlSafe(update)).bind(&id).bind(&why).execute(&mut *conn).await?;
                    registry::fetch(conn, &id).await?.ok_or(NodesApiError::NotFound(id))
                })
            })
            .await?;
        tracing::warn!(%node_id, %admin, %reason, "node revoked");
        self.nodes.clear_deadline(node_id).await;
        Ok(self.nodes.committed(record).await.as_ref().clone())
    }

    async fn drain(
        &self,
        admin: &str,
        node_id: &str,
        undrain: bool,
        deadline: Option<Duration>,
    ) -> Result<NodeRecord, NodesApiError> {
        require_node_id(node_id)?;
        let deadline_ms = deadline.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let update = format!(
            "UPDATE nodes SET state = $3, drained_at_ms = CASE WHEN $4 = 1 THEN COALESCE(drained_at_ms, {now}) END, \
             drain_deadline_ms = CASE WHEN $4 = 1 AND $6 >= 0 THEN {now} + $6 END, \
             state_changed_at_ms = CASE WHEN state = $3 THEN state_changed_at_ms ELSE {now} END, \
             revision = revision + 1 WHERE node_id = $1 AND incarnation = $2 AND state = $5",
            now = self.store.now_ms_sql()
        );
        let id = node_id.to_owned();
        let (record, changed) = self
            .store
            .tx("nodes.drain", move |conn| {
                let (update, id) = (update.clone(), id.clone());
                Box::pin(async move {
                    let current =
                        registry::fetch(conn, &id).await?.ok_or_else(|| NodesApiError::NotFound(id.clone()))?;
                    if current.state == NodeState::Revoked {
                        return Err(NodesApiError::Revoked(id));
                    }
                    let next = match current.state {
                        NodeState::Up | NodeState::Draining if undrain => NodeState::Up,
                        NodeState::Up | NodeState::Draining => NodeState::Draining,
                        other => other,
                    };
                    // Already as asked: nothing to write or tell anyone.
                    let same_deadline = deadline_ms.is_none() && current.drain_deadline_ms.is_none();
                    if current.drained != undrain && next == current.state && (undrain || same_deadline) {
                        return Ok((current, false));
                    }
                    let done = sqlx::query(sqlx::AssertSqlSafe(update))
                        .bind(&id)
                        .bind(current.incarnation)
                        .bind(next.as_str())
                        .bind(i64::from(!undrain))
                        .bind(current.state.as_str())
                        .bind(deadline_ms.unwrap_or(-1))
                        .execute(&mut *conn)
                        .await?;
                    expect_one(done.rows_affected(), &format!("node {id} in state {}", current.state.as_str()))?;
                    let written = registry::fetch(conn, &id)
                        .await?
                        .ok_or_else(|| StoreError::internal("a drained node vanished in its own transaction"))?;
                    Ok((written, true))
                })
            })
            .await?;
        if !changed {
            return Ok(record);
        }
        tracing::info!(%node_id, %admin, drained = !undrain, state = record.state.as_str(), ?deadline,
            "node drain changed");
        Ok(self.nodes.committed(record).await.as_ref().clone())
    }
}

#[tonic::async_trait]
impl v1::nodes_server::Nodes for IdentityService {
    async fn list_nodes(
        &self,
        request: tonic::Request<v1::ListNodesRequest>,
    ) -> Result<tonic::Response<v1::ListNodesResponse>, tonic::Status> {
        let request = request.into_inner();
        let state = NodeState::from_proto(request.state).map_err(|value| NodesApiError::InvalidArgument {
            field: "state",
            reason: format!("{value} is not a node state"),
        })?;
        let tier = Some(request.tier.as_str()).filter(|t| !t.is_empty());
        let nodes = registry::list(&self.store, tier, state).await.map_err(NodesApiError::from)?;
        Ok(tonic::Response::new(v1::ListNodesResponse { nodes: nodes.iter().map(NodeRecord::to_proto).collect() }))
    }

    async fn get_node(
        &self,
        request: tonic::Request<v1::GetNodeRequest>,
    ) -> Result<tonic::Response<v1::GetNodeResponse>, tonic::Status> {
        let node = self.get_node_record(&request.get_ref().node_id).await?;
        Ok(tonic::Response::new(v1::GetNodeResponse { node: Some(node.to_proto()) }))
    }

    async fn revoke_node(
        &self,
        request: tonic::Request<v1::RevokeNodeRequest>,
    ) -> Result<tonic::Response<v1::RevokeNodeResponse>, tonic::Status> {
        let admin = berth_rpc::caller(&request)?.name().to_owned();
        let v1::RevokeNodeRequest { node_id, reason } = request.into_inner();
        let node = self.revoke(&admin, &node_id, &reason).await?;
        Ok(tonic::Response::new(v1::RevokeNodeResponse { node: Some(node.to_proto()) }))
    }

    async fn drain_node(
        &self,
        request: tonic::Request<v1::DrainNodeRequest>,
    ) -> Result<tonic::Response<v1::DrainNodeResponse>, tonic::Status> {
        let caller = berth_rpc::caller(&request)?;
        let admin = caller.name().to_owned();
        if caller.node_id().is_some() {
            berth_rpc::require_own_node(&request, &request.get_ref().node_id)?;
            if request.get_ref().undrain {
                return Err(tonic::Status::permission_denied("a node may drain itself, never lift a drain"));
            }
        }
        let v1::DrainNodeRequest { node_id, undrain, deadline } = request.into_inner();
        let deadline = match deadline {
            Some(_) if undrain => {
                return Err(NodesApiError::InvalidArgument {
                    field: "deadline",
                    reason: "a deadline is for a drain, not for lifting one".into(),
                }
                .into());
            }
            Some(deadline) => Some(Duration::try_from(deadline).ok().filter(|d| !d.is_zero()).ok_or_else(|| {
                NodesApiError::InvalidArgument { field: "deadline", reason: "must be a positive duration".into() }
            })?),
            None => None,
        };
        let node = self.drain(&admin, &node_id, undrain, deadline).await?;
        Ok(tonic::Response::new(v1::DrainNodeResponse { node: Some(node.to_proto()) }))
    }

    async fn upgrade_nodes(
        &self,
        request: tonic::Request<v1::UpgradeNodesRequest>,
    ) -> Result<tonic::Response<v1::UpgradeNodesResponse>, tonic::Status> {
        let admin = berth_rpc::caller(&request)?.name().to_owned();
        let ask = crate::upgrades::UpgradeAsk::parse(request.into_inner())?;
        let upgrade = self.upgrade_nodes(&admin, ask).await?;
        Ok(tonic::Response::new(v1::UpgradeNodesResponse { upgrade: Some(upgrade) }))
    }

    async fn get_upgrade(
        &self,
        request: tonic::Request<v1::GetUpgradeRequest>,
    ) -> Result<tonic::Response<v1::GetUpgradeResponse>, tonic::Status> {
        let upgrade_id = request.into_inner().upgrade_id;
        if !upgrade_id.is_empty() && !berth_core::is_dns_label(&upgrade_id) {
            return Err(NodesApiError::InvalidArgument {
                field: "upgrade_id",
                reason: format!("'{upgrade_id}' is not an upgrade id"),
            }
            .into());
        }
        let upgrade = IdentityService::get_upgrade(self, &upgrade_id).await?;
        Ok(tonic::Response::new(v1::GetUpgradeResponse { upgrade: Some(upgrade) }))
    }

    async fn watch_nodes(
        &self,
        request: tonic::Request<v1::WatchNodesRequest>,
    ) -> Result<tonic::Response<tonic::codegen::BoxStream<v1::NodeEvent>>, tonic::Status> {
        let tier = request.into_inner().tier;
        let (snapshot, changes) = self.nodes.watch().await.map_err(NodesApiError::from)?;
        let (events, stream) = mpsc::channel(WATCH_BUFFER);
        let feed = WatchFeed { registry: self.nodes.clone(), tier, events, sent: HashSet::new() };
        tokio::spawn(feed.run(snapshot, changes));
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(stream))))
    }
}

/// The task feeding one `WatchNodes` stream from the replica's index.
struct WatchFeed {
    registry: NodeRegistry,
    tier: String,
    events: mpsc::Sender<Result<v1::NodeEvent, tonic::Status>>,
    /// Nodes this stream has shown and not removed, to tell it what vanished while it lagged.
    sent: HashSet<String>,
}

/// Why a feed stops.
enum Stop {
    /// The client went away.
    Gone,
}

impl WatchFeed {
    async fn run(mut self, snapshot: Vec<Arc<NodeRecord>>, mut changes: broadcast::Receiver<NodeChange>) {
        if self.level(snapshot).await.is_err() {
            return;
        }
        loop {
            let change = tokio::select! {
                () = self.events.closed() => return,
                () = self.registry.closing().cancelled() => {
                    let _ = self.events.send(Err(tonic::Status::unavailable("identity is shutting down; watch again"))).await;
                    return;
                }
                change = changes.recv() => change,
            };
            let sent = match change {
                Ok(change) => self.forward(&change).await,
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::info!(missed, "a node watcher fell behind; bringing it level from a snapshot");
                    let (snapshot, fresh) = self.registry.snapshot();
                    changes = fresh;
                    self.level(snapshot).await
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if sent.is_err() {
                return;
            }
        }
    }

    /// Sends every node of `snapshot` in this stream's tier, removals of the
    /// ones it showed that are gone, then `SYNCED`.
    async fn level(&mut self, snapshot: Vec<Arc<NodeRecord>>) -> Result<(), Stop> {
        let mut present = HashSet::new();
        for record in snapshot.iter().filter(|r| self.wants(r)) {
            present.insert(record.node_id.clone());
            self.send(EventKind::Upsert, record).await?;
        }
        let gone: Vec<String> = self.sent.difference(&present).cloned().collect();
        for node_id in gone {
            let tombstone = v1::Node { node_id: node_id.clone(), tier: self.tier.clone(), ..Default::default() };
            self.sent.remove(&node_id);
            self.events
                .send(Ok(v1::NodeEvent { kind: EventKind::Removed as i32, node: Some(tombstone) }))
                .await
                .map_err(|_| Stop::Gone)?;
        }
        self.sent = present;
        self.events.send(Ok(v1::NodeEvent { kind: EventKind::Synced as i32, node: None })).await.map_err(|_| Stop::Gone)
    }

    async fn forward(&mut self, change: &NodeChange) -> Result<(), Stop> {
        let record = change.record();
        if !self.wants(record) {
            return Ok(());
        }
        match change {
            NodeChange::Upsert(_) => {
                self.sent.insert(record.node_id.clone());
                self.send(EventKind::Upsert, record).await
            }
            NodeChange::Removed(_) => {
                self.sent.remove(&record.node_id);
                self.send(EventKind::Removed, record).await
            }
        }
    }

    fn wants(&self, record: &NodeRecord) -> bool {
        self.tier.is_empty() || record.tier == self.tier
    }

    async fn send(&self, kind: EventKind, record: &NodeRecord) -> Result<(), Stop> {
        let event = v1::NodeEvent { kind: kind as i32, node: Some(record.to_proto()) };
        self.events.send(Ok(event)).await.map_err(|_| Stop::Gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_checked_before_any_query() {
        assert!(require_node_id("n-0123456789ab").is_ok());
        for bad in ["", "N-1", "n_1", "a.b"] {
            let status = tonic::Status::from(require_node_id(bad).unwrap_err());
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad}");
            assert!(status.message().contains("node_id"), "{bad}: {}", status.message());
        }
    }

    #[test]
    fn draining_a_revoked_node_is_a_failed_precondition() {
        let status = tonic::Status::from(NodesApiError::Revoked("n-1".into()));
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    }
}
