//! `Heartbeat`: a node's liveness, its reported compute, certificate renewal
//! and the fencing of an agent that outlived its incarnation.
//!
//! # Expected flow
//! 1. The caller must be the node it names ([`berth_rpc::require_own_node`]).
//! 2. From the index (the database for a node not indexed yet): an unknown
//!    node is told to join again (`NOT_FOUND`), a revoked one is refused
//!    (`PERMISSION_DENIED`), and one whose incarnation is not the stored one
//!    is answered `fenced = true` with an OK status, and nothing is written.
//! 3. A node already `UP`/`DRAINING` that reports the same capacity and
//!    version and asks no renewal: its bus deadline moves, and when its
//!    bookkeeping (last heartbeat, usage) was last written `persist_every`
//!    ago it is handed to the batch writer ([`crate::bookkeeping`]); the
//!    answer never waits for the database. Anything else (or bookkeeping the
//!    writer cannot take) is one transaction that re-reads the row, fences on
//!    its incarnation and state, and writes: `JOINING`/`DOWN` become `UP`
//!    (`DRAINING` when drained) unless another live node holds the same
//!    (tier, advertise address).
//! 4. A renewal CSR gets a new certificate; the CA bundle rides every answer.
//! 5. Fleet upgrades ([`crate::upgrades`]): while the node's upgrade mark is
//!    `started` the answer names the artifact; what the node reports of that
//!    upgrade is written onto the mark (a change like any other, so it takes
//!    the transaction). A beat saying `upgrading` moves the node's deadline
//!    `upgrade_grace` further, since its agent is about to be replaced.
//!
//! # Invariants
//! - Incarnation 0 is never fenced: agents that predate incarnations.
//! - Any other incarnation that differs from the stored one is fenced: older
//!   means the node was reaped or rejoined from elsewhere; newer means the
//!   registry went back in time (a restore). Either way the agent must stop
//!   what it runs and rejoin.
//! - Liveness is the bus deadline, not the row: the row's last heartbeat and
//!   usage are as of the last write, at most `persist_every` (plus one
//!   bookkeeping batch) old, which is why the monitor never judges liveness
//!   from them.

use std::sync::Arc;

use berth_mtls::IssuedCertificate;
use berth_proto::identity::v1;
use berth_store::{StoreError, expect_one};

use crate::bookkeeping::Beat;
use crate::config::millis;
use crate::registry::{self, NodeRecord, NodeState, NodeUpgradeState, timestamp, to_column};
use crate::upgrades::MAX_UPGRADE_REASON;
use crate::{AuthorityError, IdentityService};

/// What a node reported of its upgrade, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
struct UpgradeReport {
    upgrade_id: String,
    state: NodeUpgradeState,
    reason: String,
    version: String,
}

impl UpgradeReport {
    /// Checks the report a heartbeat carries; `None` when it carries none.
    fn parse(report: Option<&v1::NodeUpgradeReport>) -> Result<Option<Self>, HeartbeatError> {
        let Some(report) = report else { return Ok(None) };
        let invalid = |reason: &str| HeartbeatError::InvalidArgument { field: "upgrade", reason: reason.to_owned() };
        if !berth_core::is_dns_label(&report.upgrade_id) {
            return Err(invalid("upgrade_id must be the id the heartbeat answer named"));
        }
        let state = NodeUpgradeState::reported(report.state)
            .ok_or_else(|| invalid("state must be UPGRADING, SUCCEEDED or FAILED"))?;
        if report.version.len() > MAX_VERSION_LEN || report.version.chars().any(char::is_control) {
            return Err(invalid(&format!("version must be at most {MAX_VERSION_LEN} printable characters")));
        }
        // A node's reason is kept, cut to size, never refused: it is the only
        // account of what went wrong there.
        let mut reason: String = report.reason.chars().filter(|c| !c.is_control()).collect();
        if reason.len() > MAX_UPGRADE_REASON {
            let mut end = MAX_UPGRADE_REASON;
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            reason.truncate(end);
        }
        Ok(Some(Self { upgrade_id: report.upgrade_id.clone(), state, reason, version: report.version.clone() }))
    }

    /// Whether it changes the mark `node` holds: a report of another upgrade
    /// than the mark's (a late one) changes nothing.
    fn changes(&self, node: &NodeRecord) -> bool {
        node.upgrade.as_deref().is_some_and(|mark| {
            mark.upgrade_id == self.upgrade_id
                && (mark.state != self.state || mark.reason != self.reason || mark.version != self.version)
        })
    }
}

/// The upgrade a node's heartbeat answer names: its mark while `started`.
fn upgrade_target(node: &NodeRecord) -> Option<v1::NodeUpgradeTarget> {
    let mark = node.upgrade.as_deref().filter(|m| m.state == NodeUpgradeState::Started)?;
    Some(v1::NodeUpgradeTarget { upgrade_id: mark.upgrade_id.clone(), artifact: mark.artifact.clone() })
}

/// The longest agent version string kept.
const MAX_VERSION_LEN: usize = 64;

/// Why a heartbeat was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HeartbeatError {
    /// A request field is malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The request field.
        field: &'static str,
        /// What it must be instead.
        reason: String,
    },
    /// The node is not registered (never joined, or forgotten after a long absence).
    #[error("node {0} is not registered; join again with a join token")]
    NotFound(String),
    /// An operator revoked the node.
    #[error("node revoked")]
    Revoked,
    /// Another live node already holds the node's (tier, advertise address).
    #[error(
        "advertise address {addr} in tier '{tier}' is held by live node {other}; stop that node's agent or revoke it"
    )]
    AddressTaken {
        /// The contested address.
        addr: String,
        /// The tier both nodes are in.
        tier: String,
        /// The node that holds it.
        other: String,
    },
    /// The renewal CSR was refused, or signing failed.
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(HeartbeatError, |error| match error {
    HeartbeatError::InvalidArgument { .. } => tonic::Status::invalid_argument(error.to_string()),
    HeartbeatError::NotFound(_) => tonic::Status::not_found(error.to_string()),
    HeartbeatError::Revoked => tonic::Status::permission_denied(error.to_string()),
    HeartbeatError::AddressTaken { .. } => tonic::Status::failed_precondition(error.to_string()),
    HeartbeatError::Authority(error) => error.into(),
    HeartbeatError::Store(error) => error.into(),
});

/// Whether a heartbeat carrying `reported` comes from an agent the registry
/// no longer recognises at `stored`.
fn is_fenced(reported: u64, stored: i64) -> bool {
    reported != 0 && i64::try_from(reported) != Ok(stored)
}

/// What the transaction of a heartbeat found and did.
#[derive(Debug)]
enum Outcome {
    /// The row was written; it is the committed row.
    Written(NodeRecord),
    /// The incarnation is stale; the row as it stands.
    Fenced(NodeRecord),
}

impl IdentityService {
    async fn heartbeat_node(
        &self,
        node_id: &str,
        beat: v1::HeartbeatRequest,
        presented: Option<i64>,
    ) -> Result<v1::HeartbeatResponse, HeartbeatError> {
        if beat.version.len() > MAX_VERSION_LEN || beat.version.chars().any(char::is_control) {
            return Err(HeartbeatError::InvalidArgument {
                field: "version",
                reason: format!("at most {MAX_VERSION_LEN} printable characters"),
            });
        }
        let digest = beat.ca_bundle_sha256.as_str();
        if !digest.is_empty() && (digest.len() != 64 || !digest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        {
            return Err(HeartbeatError::InvalidArgument {
                field: "ca_bundle_sha256",
                reason: "64 lowercase hex digits, or empty".to_owned(),
            });
        }
        let report = UpgradeReport::parse(beat.upgrade.as_ref())?;
        let indexed = self.nodes.lookup(node_id).await?.ok_or_else(|| HeartbeatError::NotFound(node_id.to_owned()))?;
        if indexed.state == NodeState::Revoked {
            return Err(HeartbeatError::Revoked);
        }
        if is_fenced(beat.incarnation, indexed.incarnation) {
            return Box::pin(self.fenced(&indexed, beat.incarnation)).await;
        }
        if !beat.ca_bundle_sha256.is_empty()
            && let Err(error) = self.authority.acknowledge(node_id, &beat.ca_bundle_sha256).await
        {
            // Bookkeeping for CA activation must never cost a node its
            // liveness: the next heartbeat records it.
            tracing::warn!(%node_id, %error, "cannot record the CA bundle the node trusts; retried next heartbeat");
        }
        let unchanged = beat.capacity.is_none_or(|c| c == indexed.capacity)
            && (beat.version.is_empty() || beat.version == indexed.version)
            && report.as_ref().is_none_or(|r| !r.changes(&indexed));
        let wants_renewal = !beat.renewal_csr_pem.trim().is_empty();
        let timing = self.nodes.timing();
        let grace = if beat.upgrading { timing.down_after + timing.upgrade_grace } else { timing.down_after };
        // A renewed certificate presented for the first time moves the floor.
        let floor_moves = presented.is_some_and(|issued| {
            indexed.certificate_floor.presented(issued, self.nodes.now_ms(), timing.certificate_overlap).is_some()
        });
        if indexed.state.is_live() && unchanged && !wants_renewal && !floor_moves {
            let now_ms = self.nodes.now_ms();
            let steady = !self.nodes.persist_due(node_id)
                || self.nodes.queue_bookkeeping(Beat {
                    node_id: node_id.to_owned(),
                    incarnation: indexed.incarnation,
                    usage: beat.usage,
                    at_ms: now_ms,
                });
            if steady {
                self.nodes.queue_deadline(node_id, now_ms + millis(grace)).await;
                return self.answer(indexed.state, None, upgrade_target(&indexed)).await;
            }
        }
        // Boxed: the written path (signing, a transaction) needs a future
        // several times the steady path's, and every call in flight would
        // otherwise carry room for it.
        Box::pin(self.write_heartbeat(node_id, beat, report, presented, indexed, wants_renewal, grace)).await
    }

    /// A heartbeat that changes the row or renews the certificate: written in
    /// a transaction, then published.
    #[expect(clippy::too_many_arguments, reason = "the parts of one heartbeat, checked by its caller")]
    async fn write_heartbeat(
        &self,
        node_id: &str,
        beat: v1::HeartbeatRequest,
        report: Option<UpgradeReport>,
        presented: Option<i64>,
        indexed: Arc<NodeRecord>,
        wants_renewal: bool,
        grace: std::time::Duration,
    ) -> Result<v1::HeartbeatResponse, HeartbeatError> {
        let certificate = if wants_renewal {
            let sans = [indexed.advertise_host()];
            Some(self.authority.sign_node(&beat.renewal_csr_pem, node_id, &sans, self.config.node_cert_ttl).await?)
        } else {
            None
        };
        let outcome =
            match self.record_heartbeat(node_id, &beat, report.as_ref(), presented, certificate.as_ref()).await {
                Ok(outcome) => outcome,
                Err(error) => {
                    // The node beat: while the database is away its liveness,
                    // kept in the bus, must not lapse with the write, or every
                    // node whose bookkeeping fell due in the outage is marked
                    // down once the database is back.
                    if indexed.state.is_live() {
                        self.nodes.queue_deadline(node_id, self.nodes.now_ms() + millis(grace)).await;
                    }
                    return Err(error);
                }
            };
        let record = match outcome {
            Outcome::Fenced(record) => {
                let record = self.nodes.remember(record);
                return self.fenced(&record, beat.incarnation).await;
            }
            Outcome::Written(record) => record,
        };
        self.nodes.mark_persisted(node_id);
        self.nodes.set_deadline(node_id, self.nodes.now_ms() + millis(grace)).await;
        let noteworthy = record.state != indexed.state
            || record.upgrade != indexed.upgrade
            || record.capacity != indexed.capacity
            || record.version != indexed.version
            || record.certificate_expires_at_ms != indexed.certificate_expires_at_ms
            || record.certificate_floor != indexed.certificate_floor;
        if record.state != indexed.state {
            tracing::info!(%node_id, from = indexed.state.as_str(), to = record.state.as_str(), "node heard from");
        }
        let (state, target) = (record.state, upgrade_target(&record));
        if noteworthy {
            self.nodes.committed(record).await;
        } else {
            // Bookkeeping alone: the other replicas pick it up at their next resync.
            self.nodes.remember(record);
        }
        self.answer(state, certificate, target).await
    }

    /// Writes a heartbeat in one transaction fenced on the row it read.
    async fn record_heartbeat(
        &self,
        node_id: &str,
        beat: &v1::HeartbeatRequest,
        report: Option<&UpgradeReport>,
        presented: Option<i64>,
        certificate: Option<&IssuedCertificate>,
    ) -> Result<Outcome, HeartbeatError> {
        let update = format!(
            "UPDATE nodes SET state = $3, \
             upgrade_state = CASE WHEN upgrade_id = $14 AND upgrade_id <> '' THEN $15 ELSE upgrade_state END, \
             upgrade_reason = CASE WHEN upgrade_id = $14 AND upgrade_id <> '' THEN $16 ELSE upgrade_reason END, \
             upgrade_version = CASE WHEN upgrade_id = $14 AND upgrade_id <> '' THEN $17 ELSE upgrade_version END, \
             state_changed_at_ms = CASE WHEN state = $3 THEN state_changed_at_ms ELSE {now} END, \
             last_heartbeat_at_ms = {now}, reaped_at_ms = NULL, revision = revision + 1, \
             capacity_cpu_millis = $4, capacity_memory_bytes = $5, usage_cpu_millis = $6, usage_memory_bytes = $7, \
             version = $8, certificate_expires_at_ms = $9, certificate_floor_s = $11, \
             certificate_next_floor_s = $12, certificate_floor_moves_at_ms = $13 \
             WHERE node_id = $1 AND incarnation = $2 AND state = $10",
            now = self.store.now_ms_sql()
        );
        let node_id = node_id.to_owned();
        let reported_incarnation = beat.incarnation;
        let (capacity, usage, version) = (beat.capacity, beat.usage, beat.version.clone());
        // No report matches no mark: the empty id is never a mark's.
        let report = report.cloned().unwrap_or(UpgradeReport {
            upgrade_id: String::new(),
            state: NodeUpgradeState::Pending,
            reason: String::new(),
            version: String::new(),
        });
        let renewed_until_ms = certificate.map(|c| c.not_after.saturating_mul(1000));
        let (now_ms, overlap) = (self.nodes.now_ms(), self.nodes.timing().certificate_overlap);
        let owned_node_id = node_id.clone();
        let result = self
            .store
            .tx("nodes.heartbeat", move |conn| {
                let (update, node_id, version, report) =
                    (update.clone(), node_id.clone(), version.clone(), report.clone());
                Box::pin(async move {
                    let current = registry::fetch(conn, &node_id)
                        .await?
                        .ok_or_else(|| HeartbeatError::NotFound(node_id.clone()))?;
                    if current.state == NodeState::Revoked {
                        return Err(HeartbeatError::Revoked);
                    }
                    if is_fenced(reported_incarnation, current.incarnation) {
                        return Ok(Outcome::Fenced(current));
                    }
                    let next = if current.drained { NodeState::Draining } else { NodeState::Up };
                    // No read of other nodes' rows here: under SERIALIZABLE such a
                    // predicate read makes concurrent first heartbeats abort each
                    // other. The partial unique index on live (tier, address)
                    // refuses a duplicate, and the holder is named afterwards.
                    let capacity = capacity.unwrap_or(current.capacity);
                    let usage = usage.unwrap_or(current.usage);
                    let version = if version.is_empty() { current.version.clone() } else { version };
                    let floor = presented
                        .and_then(|issued| current.certificate_floor.presented(issued, now_ms, overlap))
                        .unwrap_or(current.certificate_floor);
                    let done = sqlx::query(sqlx::AssertSqlSafe(update))
                        .bind(&node_id)
                        .bind(current.incarnation)
                        .bind(next.as_str())
                        .bind(to_column(capacity.cpu_millis))
                        .bind(to_column(capacity.memory_bytes))
                        .bind(to_column(usage.cpu_millis))
                        .bind(to_column(usage.memory_bytes))
                        .bind(&version)
                        .bind(renewed_until_ms.unwrap_or(current.certificate_expires_at_ms))
                        .bind(current.state.as_str())
                        .bind(floor.floor_s)
                        .bind(floor.next_s)
                        .bind(floor.moves_at_ms)
                        .bind(&report.upgrade_id)
                        .bind(report.state.as_str())
                        .bind(&report.reason)
                        .bind(&report.version)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| taken_on_unique_violation(e.into(), &current))?;
                    let what = format!(
                        "node {node_id} at incarnation {} in state {}",
                        current.incarnation,
                        current.state.as_str()
                    );
                    expect_one(done.rows_affected(), &what)?;
                    let written = registry::fetch(conn, &node_id)
                        .await?
                        .ok_or_else(|| StoreError::internal("a heartbeating node vanished in its own transaction"))?;
                    Ok(Outcome::Written(written))
                })
            })
            .await;
        match result {
            Err(HeartbeatError::AddressTaken { addr, tier, .. }) => {
                let other: Option<String> = sqlx::query_scalar(
                    "SELECT node_id FROM nodes WHERE tier = $1 AND advertise_addr = $2 AND node_id <> $3 \
                     AND state IN ('up', 'draining') ORDER BY node_id LIMIT 1",
                )
                .bind(&tier)
                .bind(&addr)
                .bind(&owned_node_id)
                .fetch_optional(self.store.pool())
                .await
                .map_err(StoreError::from)?;
                Err(HeartbeatError::AddressTaken {
                    addr,
                    tier,
                    other: other.unwrap_or_else(|| "another node".to_owned()),
                })
            }
            other => other,
        }
    }

    async fn fenced(&self, record: &NodeRecord, reported: u64) -> Result<v1::HeartbeatResponse, HeartbeatError> {
        tracing::warn!(
            node_id = %record.node_id,
            reported_incarnation = reported,
            incarnation = record.incarnation,
            "fenced a heartbeat from a stale incarnation; the agent must rejoin"
        );
        let mut response = self.answer(record.state, None, None).await?;
        response.fenced = true;
        Ok(response)
    }

    async fn answer(
        &self,
        state: NodeState,
        certificate: Option<IssuedCertificate>,
        upgrade: Option<v1::NodeUpgradeTarget>,
    ) -> Result<v1::HeartbeatResponse, HeartbeatError> {
        let interval = self.nodes.timing().heartbeat_interval;
        Ok(v1::HeartbeatResponse {
            certificate_expires_at: certificate.as_ref().map(|c| timestamp(c.not_after.saturating_mul(1000))),
            certificate_pem: certificate.map(|c| c.cert_pem).unwrap_or_default(),
            ca_bundle_pem: self.authority.bundle_pem().await?,
            heartbeat_interval_ms: u32::try_from(interval.as_millis()).unwrap_or(u32::MAX),
            fenced: false,
            state: state.to_proto() as i32,
            upgrade,
        })
    }
}

/// The live-address index refused the write: another node won a race to the
/// same (tier, advertise address).
fn taken_on_unique_violation(error: StoreError, node: &NodeRecord) -> HeartbeatError {
    match error {
        StoreError::AlreadyExists { .. } => HeartbeatError::AddressTaken {
            addr: node.advertise_addr.clone(),
            tier: node.tier.clone(),
            other: "another node".to_owned(),
        },
        other => HeartbeatError::Store(other),
    }
}

#[tonic::async_trait]
impl v1::node_session_server::NodeSession for IdentityService {
    async fn heartbeat(
        &self,
        request: tonic::Request<v1::HeartbeatRequest>,
    ) -> Result<tonic::Response<v1::HeartbeatResponse>, tonic::Status> {
        let node_id = berth_rpc::require_own_node(&request, &request.get_ref().node_id)?.to_owned();
        let presented = request.extensions().get::<berth_rpc::PeerInfo>().and_then(|peer| peer.issued_at);
        match self.heartbeat_node(&node_id, request.into_inner(), presented).await {
            Ok(response) => Ok(tonic::Response::new(response)),
            Err(error) => {
                tracing::info!(%node_id, %error, "heartbeat refused");
                Err(error.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incarnation_zero_is_never_fenced() {
        assert!(!is_fenced(0, 1));
        assert!(!is_fenced(0, 7));
    }

    #[test]
    fn any_other_incarnation_than_the_stored_one_is_fenced() {
        assert!(!is_fenced(3, 3));
        assert!(is_fenced(2, 3), "older: reaped or rejoined elsewhere");
        assert!(is_fenced(4, 3), "newer: the registry went back in time");
        assert!(is_fenced(u64::MAX, 3));
    }

    #[test]
    fn a_lost_race_for_an_address_is_reported_as_taken() {
        let status = tonic::Status::from(HeartbeatError::AddressTaken {
            addr: "10.0.0.7:7450".into(),
            tier: "gpu".into(),
            other: "n-000000000001".into(),
        });
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert!(status.message().contains("n-000000000001"), "{}", status.message());
    }
}
