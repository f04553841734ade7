//! `Join`: how a host becomes a node, and how a node whose agent was fenced
//! or restarted rejoins as itself.
//!
//! # Expected flow
//! A caller without a certificate: its peer address is rate-limited, the
//! request checked, the token verified (secret first), the CSR signed for a
//! node id chosen here, and then one transaction takes a token use and
//! inserts the row (`JOINING`, incarnation 1). The node's deadline is set so
//! the monitor marks it down if its first heartbeat never comes.
//!
//! A caller with its own still-valid node certificate rejoins: same node id,
//! incarnation + 1, `JOINING` again, its reap mark cleared, its tier and
//! labels kept; no token use is taken and any token sent is ignored. A node
//! that was forgotten cannot rejoin as itself: with a token in the request it
//! joins afresh under a new node id, without one it is told to (`NOT_FOUND`).
//! A revoked node's certificate is refused by the access layer before this
//! runs (and here too, should the layer's set lag): a host whose node was
//! revoked joins afresh without that certificate, with a new token.
//!
//! # Invariants
//! - The token is never logged; refusals are logged with the peer address
//!   and the token id.
//! - Nothing is consumed for a request that fails validation or signing: the
//!   token use and the row are written together, after the certificate exists.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use berth_core::Identity;
use berth_mtls::IssuedCertificate;
use berth_proto::identity::v1;
use berth_proto::types::v1::Capacity;
use berth_rpc::PeerInfo;
use berth_store::{StoreError, TxError, expect_one};
use tonic::metadata::MetadataValue;

use crate::config::millis;
use crate::registry::{self, NodeRecord, NodeState, advertise_host, labels_json, timestamp, to_column};
use crate::tokens::{PresentedToken, TokenError, TokenGrant, check_labels, check_tier, random_hex};
use crate::{AuthorityError, IdentityService};

/// Random bytes in a node id (`n-` and 12 hex digits).
const NODE_ID_BYTES: usize = 6;

/// How many fresh node ids are tried when one collides.
const ID_ATTEMPTS: usize = 3;

/// The longest host name kept for a node.
const MAX_NAME_LEN: usize = 253;

/// The longest agent version string kept.
const MAX_VERSION_LEN: usize = 64;

/// Metadata key carrying how long a rate-limited caller should wait, in milliseconds.
pub const RETRY_AFTER_MS_HEADER: &str = "retry-after-ms";

/// Why a join was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JoinError {
    /// A request field is missing or malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The request field.
        field: &'static str,
        /// What it must be instead.
        reason: String,
    },
    /// The peer made too many join attempts in the current window.
    #[error("too many join attempts from {peer}; retry in {} ms", retry_after.as_millis())]
    RateLimited {
        /// The peer's address.
        peer: IpAddr,
        /// When the window resets.
        retry_after: Duration,
    },
    /// The join token was refused.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The calling node was revoked and sent no token to join afresh with.
    #[error("node {0} revoked; join with a new join token")]
    NodeRevoked(String),
    /// The calling node is no longer registered and sent no token to join afresh with.
    #[error("node {0} is not registered (forgotten after a long absence); join with a join token")]
    NodeUnknown(String),
    /// The CSR was refused, or signing failed.
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl TxError for JoinError {
    fn store_error(&self) -> Option<&StoreError> {
        match self {
            Self::Store(error) | Self::Token(TokenError::Store(error)) => Some(error),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for JoinError {
    fn from(error: sqlx::Error) -> Self {
        Self::Store(error.into())
    }
}

impl From<JoinError> for tonic::Status {
    fn from(error: JoinError) -> Self {
        match error {
            JoinError::InvalidArgument { .. } => tonic::Status::invalid_argument(error.to_string()),
            JoinError::RateLimited { retry_after, .. } => {
                let mut status = tonic::Status::resource_exhausted(error.to_string());
                if let Ok(value) = MetadataValue::try_from(retry_after.as_millis().to_string()) {
                    status.metadata_mut().insert(RETRY_AFTER_MS_HEADER, value);
                }
                status
            }
            JoinError::Token(error) => error.into(),
            JoinError::NodeRevoked(_) => tonic::Status::permission_denied(error.to_string()),
            JoinError::NodeUnknown(_) => tonic::Status::not_found(error.to_string()),
            JoinError::Authority(error) => error.into(),
            JoinError::Store(error) => error.into(),
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> JoinError {
    JoinError::InvalidArgument { field, reason: reason.into() }
}

/// A checked `JoinRequest`, the token aside.
#[derive(Debug)]
struct Applicant {
    csr_pem: String,
    name: String,
    advertise_addr: String,
    tier: String,
    version: String,
    capacity: Capacity,
    labels: BTreeMap<String, String>,
}

impl Applicant {
    fn from_request(request: &v1::JoinRequest) -> Result<Self, JoinError> {
        if request.csr_pem.trim().is_empty() {
            return Err(invalid("csr_pem", "a PEM certificate signing request is required"));
        }
        if request.name.len() > MAX_NAME_LEN || request.name.chars().any(char::is_control) {
            return Err(invalid("name", format!("at most {MAX_NAME_LEN} printable characters")));
        }
        check_advertise_addr(&request.advertise_addr).map_err(|reason| invalid("advertise_addr", reason))?;
        check_tier(&request.tier).map_err(|reason| invalid("tier", reason))?;
        if request.version.len() > MAX_VERSION_LEN || request.version.chars().any(char::is_control) {
            return Err(invalid("version", format!("at most {MAX_VERSION_LEN} printable characters")));
        }
        check_labels(&request.labels).map_err(|reason| invalid("labels", reason))?;
        Ok(Self {
            csr_pem: request.csr_pem.clone(),
            name: request.name.clone(),
            advertise_addr: request.advertise_addr.clone(),
            tier: request.tier.clone(),
            version: request.version.clone(),
            capacity: request.capacity.unwrap_or_default(),
            labels: request.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        })
    }
}

/// Checks `host:port`: a port from 1 to 65535 and a host that is an IP
/// address (IPv6 in brackets) or a DNS name, since it goes into the node's
/// certificate.
pub(crate) fn check_advertise_addr(addr: &str) -> Result<(), String> {
    let usage = || format!("'{addr}' is not host:port (e.g. 10.0.0.7:7450 or [fd00::7]:7450)");
    let (host, port) = addr.rsplit_once(':').ok_or_else(usage)?;
    if port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(usage());
    }
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return inner.parse::<std::net::Ipv6Addr>().map(drop).map_err(|_| usage());
    }
    if host.parse::<Ipv4Addr>().is_ok() {
        return Ok(());
    }
    let dns_ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if dns_ok { Ok(()) } else { Err(usage()) }
}

impl IdentityService {
    async fn join_node(
        &self,
        peer: Option<&PeerInfo>,
        request: &v1::JoinRequest,
    ) -> Result<v1::JoinResponse, JoinError> {
        let peer_ip = peer.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.remote_addr.ip());
        self.admit_join_attempt(peer_ip).await?;
        let applicant = Applicant::from_request(request)?;
        let caller_node = peer.and_then(|p| p.identity.as_ref()).and_then(Identity::node_id);
        if let Some(node_id) = caller_node {
            let current = self.nodes.refresh(node_id).await?;
            match current {
                Some(node) if node.state != NodeState::Revoked => return self.rejoin(&node, applicant).await,
                _ if !request.token.is_empty() => {}
                Some(_) => return Err(JoinError::NodeRevoked(node_id.to_owned())),
                None => return Err(JoinError::NodeUnknown(node_id.to_owned())),
            }
        }
        let token = PresentedToken::parse(&request.token).ok_or(TokenError::Invalid)?;
        let grant = crate::tokens::verify(&self.store, &token).await?;
        if !grant.tier.is_empty() && !applicant.tier.is_empty() && grant.tier != applicant.tier {
            return Err(invalid(
                "tier",
                format!("'{}' does not match the join token's tier '{}'", applicant.tier, grant.tier),
            ));
        }
        self.join_fresh(grant, applicant).await
    }

    /// Counts one attempt from `peer`; refuses once its window is full.
    async fn admit_join_attempt(&self, peer: IpAddr) -> Result<(), JoinError> {
        let timing = self.nodes.timing();
        match self.nodes.bus().rate_limit(&format!("join:{peer}"), timing.join_attempts, timing.join_window).await {
            Ok(decision) if decision.allowed => Ok(()),
            Ok(decision) => Err(JoinError::RateLimited { peer, retry_after: decision.retry_after }),
            Err(error) => {
                // The limit guards 256-bit secrets; joins go on while the bus is away.
                tracing::warn!(%peer, %error, "join rate limit unavailable; admitting the attempt");
                Ok(())
            }
        }
    }

    async fn sign(&self, node_id: &str, applicant: &Applicant) -> Result<IssuedCertificate, JoinError> {
        let sans = [advertise_host(&applicant.advertise_addr)];
        Ok(self.authority.sign_node(&applicant.csr_pem, node_id, &sans, self.config.node_cert_ttl).await?)
    }

    async fn join_fresh(&self, grant: TokenGrant, applicant: Applicant) -> Result<v1::JoinResponse, JoinError> {
        let tier = if grant.tier.is_empty() { applicant.tier.clone() } else { grant.tier.clone() };
        let mut labels = applicant.labels.clone();
        labels.extend(grant.labels.clone());
        let labels = labels_json(&labels)?;
        let now = self.store.now_ms_sql();
        let insert = format!(
            "INSERT INTO nodes (node_id, name, tier, advertise_addr, state, incarnation, revision, labels_json, \
             version, capacity_cpu_millis, capacity_memory_bytes, usage_cpu_millis, usage_memory_bytes, \
             join_token_id, joined_at_ms, state_changed_at_ms, certificate_expires_at_ms, certificate_floor_s) \
             VALUES ($1, $2, $3, $4, 'joining', 1, 1, $5, $6, $7, $8, 0, 0, $9, {now}, {now}, $10, $11)"
        );
        for attempt in 1..=ID_ATTEMPTS {
            let node_id = format!("n-{}", random_hex::<NODE_ID_BYTES>());
            let certificate = self.sign(&node_id, &applicant).await?;
            let row = NewRow {
                node_id: node_id.clone(),
                name: applicant.name.clone(),
                tier: tier.clone(),
                advertise_addr: applicant.advertise_addr.clone(),
                labels_json: labels.clone(),
                version: applicant.version.clone(),
                capacity: applicant.capacity,
                token_id: grant.token_id.clone(),
                certificate_expires_at_ms: certificate.not_after.saturating_mul(1000),
                certificate_floor_s: certificate.not_before,
            };
            let (insert, now) = (insert.clone(), now.to_owned());
            let inserted = self
                .store
                .tx("nodes.join", move |conn| {
                    let (insert, row, now) = (insert.clone(), row.clone(), now.clone());
                    Box::pin(async move {
                        crate::tokens::consume(conn, &now, &row.token_id).await?;
                        sqlx::query(sqlx::AssertSqlSafe(insert))
                            .bind(&row.node_id)
                            .bind(&row.name)
                            .bind(&row.tier)
                            .bind(&row.advertise_addr)
                            .bind(&row.labels_json)
                            .bind(&row.version)
                            .bind(to_column(row.capacity.cpu_millis))
                            .bind(to_column(row.capacity.memory_bytes))
                            .bind(&row.token_id)
                            .bind(row.certificate_expires_at_ms)
                            .bind(row.certificate_floor_s)
                            .execute(&mut *conn)
                            .await?;
                        registry::fetch(conn, &row.node_id).await?.ok_or_else(|| {
                            JoinError::Store(StoreError::internal("a joined node vanished in its own transaction"))
                        })
                    })
                })
                .await;
            match inserted {
                Ok(record) => {
                    tracing::info!(%node_id, name = %record.name, tier = %record.tier, token_id = %grant.token_id, "node joined");
                    return self.admitted(record, certificate).await;
                }
                Err(JoinError::Store(StoreError::AlreadyExists { .. })) if attempt < ID_ATTEMPTS => continue,
                Err(error) => return Err(error),
            }
        }
        Err(StoreError::internal("no free node id").into())
    }

    async fn rejoin(&self, node: &NodeRecord, applicant: Applicant) -> Result<v1::JoinResponse, JoinError> {
        if !applicant.tier.is_empty() && applicant.tier != node.tier {
            return Err(invalid(
                "tier",
                format!("node {} is in tier '{}'; a rejoin keeps it", node.node_id, node.tier),
            ));
        }
        let certificate = self.sign(&node.node_id, &applicant).await?;
        let update = format!(
            "UPDATE nodes SET incarnation = incarnation + 1, revision = revision + 1, state = 'joining', \
             state_changed_at_ms = {}, reaped_at_ms = NULL, name = $3, advertise_addr = $4, version = $5, \
             capacity_cpu_millis = $6, capacity_memory_bytes = $7, certificate_expires_at_ms = $8, \
             certificate_floor_s = $9, certificate_next_floor_s = 0, certificate_floor_moves_at_ms = 0 \
             WHERE node_id = $1 AND incarnation = $2 AND state <> 'revoked'",
            self.store.now_ms_sql()
        );
        let node_id = node.node_id.clone();
        let certificate_expires_at_ms = certificate.not_after.saturating_mul(1000);
        // Every certificate of earlier incarnations is refused from now on.
        let certificate_floor_s = certificate.not_before;
        let (name, advertise_addr, version, capacity) =
            (applicant.name.clone(), applicant.advertise_addr.clone(), applicant.version.clone(), applicant.capacity);
        let record = self
            .store
            .tx("nodes.rejoin", move |conn| {
                let (update, node_id) = (update.clone(), node_id.clone());
                let (name, advertise_addr, version) = (name.clone(), advertise_addr.clone(), version.clone());
                Box::pin(async move {
                    let current = registry::fetch(conn, &node_id).await?;
                    let current = match current {
                        Some(current) if current.state != NodeState::Revoked => current,
                        Some(_) => return Err(JoinError::NodeRevoked(node_id)),
                        None => return Err(JoinError::NodeUnknown(node_id)),
                    };
                    let done = sqlx::query(sqlx::AssertSqlSafe(update))
                        .bind(&node_id)
                        .bind(current.incarnation)
                        .bind(&name)
                        .bind(&advertise_addr)
                        .bind(&version)
                        .bind(to_column(capacity.cpu_millis))
                        .bind(to_column(capacity.memory_bytes))
                        .bind(certificate_expires_at_ms)
                        .bind(certificate_floor_s)
                        .execute(&mut *conn)
                        .await?;
                    expect_one(
                        done.rows_affected(),
                        &format!("node {node_id} at incarnation {}", current.incarnation),
                    )?;
                    registry::fetch(conn, &node_id).await?.ok_or_else(|| {
                        JoinError::Store(StoreError::internal("a rejoined node vanished in its own transaction"))
                    })
                })
            })
            .await?;
        tracing::info!(node_id = %record.node_id, incarnation = record.incarnation, "node rejoined");
        self.admitted(record, certificate).await
    }

    /// Publishes a joined or rejoined node and answers it.
    async fn admitted(
        &self,
        record: NodeRecord,
        certificate: IssuedCertificate,
    ) -> Result<v1::JoinResponse, JoinError> {
        let timing = self.nodes.timing();
        self.nodes.set_deadline(&record.node_id, self.nodes.now_ms() + millis(timing.down_after)).await;
        let record = self.nodes.committed(record).await;
        Ok(v1::JoinResponse {
            node_id: record.node_id.clone(),
            certificate_pem: certificate.cert_pem,
            ca_bundle_pem: self.authority.bundle_pem().await?,
            incarnation: u64::try_from(record.incarnation).unwrap_or_default(),
            heartbeat_interval_ms: u32::try_from(timing.heartbeat_interval.as_millis()).unwrap_or(u32::MAX),
            certificate_expires_at: Some(timestamp(record.certificate_expires_at_ms)),
        })
    }
}

/// The values of a new `nodes` row, moved into the join transaction.
#[derive(Debug, Clone)]
struct NewRow {
    node_id: String,
    name: String,
    tier: String,
    advertise_addr: String,
    labels_json: String,
    version: String,
    capacity: Capacity,
    token_id: String,
    certificate_expires_at_ms: i64,
    certificate_floor_s: i64,
}

#[tonic::async_trait]
impl v1::join_server::Join for IdentityService {
    async fn join(
        &self,
        request: tonic::Request<v1::JoinRequest>,
    ) -> Result<tonic::Response<v1::JoinResponse>, tonic::Status> {
        let peer = request.extensions().get::<PeerInfo>().cloned();
        let body = request.into_inner();
        match self.join_node(peer.as_ref(), &body).await {
            Ok(response) => Ok(tonic::Response::new(response)),
            Err(error) => {
                let token_id = PresentedToken::parse(&body.token).map(|t| t.token_id);
                tracing::info!(
                    peer = %peer.as_ref().map_or_else(|| "unknown".to_owned(), |p| p.remote_addr.to_string()),
                    caller = %peer.as_ref().and_then(|p| p.identity.as_ref()).map_or_else(|| "anonymous".to_owned(), ToString::to_string),
                    token_id = token_id.as_deref().unwrap_or(if body.token.is_empty() { "none" } else { "malformed" }),
                    %error,
                    "join refused"
                );
                Err(error.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertise_addresses_must_be_host_and_port() {
        for good in ["10.0.0.7:7450", "host-a.example.com:1", "[fd00::7]:7450", "localhost:65535"] {
            assert!(check_advertise_addr(good).is_ok(), "{good}");
        }
        for bad in ["", "10.0.0.7", "10.0.0.7:0", "10.0.0.7:70000", ":7450", "fd00::7:7450", "a b:1", "-x:1", "[zz]:1"]
        {
            assert!(check_advertise_addr(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rate_limit_refusal_says_when_to_retry() {
        let error =
            JoinError::RateLimited { peer: IpAddr::V4(Ipv4Addr::LOCALHOST), retry_after: Duration::from_millis(1500) };
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("retry in 1500 ms"), "{}", status.message());
        assert_eq!(status.metadata().get(RETRY_AFTER_MS_HEADER).unwrap(), "1500");
    }

    #[test]
    fn every_token_refusal_is_unauthenticated() {
        for error in [TokenError::Invalid, TokenError::Expired, TokenError::UsedUp, TokenError::Revoked] {
            let status = tonic::Status::from(JoinError::Token(error));
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
        }
    }
}
