//! The heartbeater: the task that keeps the node's session alive. It
//! heartbeats on the interval identity gives, renews the node certificate
//! past half its life, takes in every new CA bundle, and rejoins when the
//! session ends under it.
//!
//! # Expected flow
//! Each heartbeat reports the incarnation, capacity, usage and version, and
//! carries a renewal CSR (for a key made fresh for it) once the certificate
//! is past half its life. A returned certificate or a changed CA bundle is
//! checked, written to the data directory, and only then swapped into the
//! [`TlsCredentials`] that the agent API listener and the client channel
//! read on every handshake.
//!
//! # Failures
//! - Unreachable identity, timeouts and any other error that a later try may
//!   not meet: retried with jittered exponential backoff, never faster.
//!   Given several identity replicas, each failure moves the node on to the
//!   next one, and it goes back to its own later (`identity_servers`).
//! - `fenced`, `NOT_FOUND` (forgotten) or an expired certificate: the session
//!   is over. A [`Fence`] is published first, so the work under it is held
//!   in custody before anything else happens, then the agent rejoins: with
//!   its still-valid certificate (same node, next incarnation, no token
//!   spent), else with the join token.
//! - `PERMISSION_DENIED` saying revoked: the heartbeater records it in the
//!   data directory and ends with [`AgentError::Revoked`]; it never rejoins on
//!   its own, since that would undo the operator's decision.

use std::sync::Arc;
use std::time::SystemTime;

use berth_mtls::{TlsCredentials, generate_csr, verify_chain};
use berth_proto::identity::v1::{HeartbeatRequest, HeartbeatResponse, node_session_client::NodeSessionClient};
use berth_rpc::Channel;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::AgentConfig;
use crate::error::AgentError;
use crate::host::UsageSampler;
use crate::identity_dir::{IdentityDir, NodeIdentity};
use crate::identity_servers::IdentityServers;
use crate::join::{self, JoinError};
use crate::rpc_status::{is_transient_code, status_text};
use crate::status::{AgentStatus, Fence, FenceReason, NodeSession};
use crate::upgrades::Upgrades;
use berth_core::backoff::Backoff;

/// The common name put in renewal CSRs; the authority ignores it.
const CSR_COMMON_NAME: &str = "berth-node";

/// A key made for a renewal, waiting for its certificate.
struct PendingRenewal {
    csr_pem: String,
    key_pem: String,
}

/// What one heartbeat came to.
#[derive(Debug)]
enum Beat {
    /// Identity answered; the response may still say `fenced`.
    Answered(HeartbeatResponse),
    /// Worth retrying later.
    Failed(String),
    /// Identity no longer knows this node.
    Forgotten(String),
    /// An operator revoked this node.
    Revoked(String),
    /// The node's certificate was superseded by a newer one of the node.
    Superseded(String),
}

/// How a node whose CA bundle no longer verifies identity recovers.
pub(crate) const UNTRUSTED_IDENTITY: &str = "identity's certificate does not verify against this node's CA \
    bundle: a CA rotation was activated while this node was away. Restart the agent with the current bundle as \
    --ca-file (berth-identity --ca-bundle-out writes it); the agent trusts it beside its own and takes identity's \
    bundle in on its first heartbeat";

/// What every service says of a node certificate issued before the node's
/// floor (see `berth_rpc::Revocations::superseded`).
const SUPERSEDED: &str = "presented a certificate superseded";

fn classify(result: Result<HeartbeatResponse, tonic::Status>) -> Beat {
    match result {
        Ok(response) => Beat::Answered(response),
        Err(status) if status.code() == tonic::Code::NotFound => Beat::Forgotten(status.message().to_string()),
        Err(status)
            if status.code() == tonic::Code::PermissionDenied
                && status.message().to_ascii_lowercase().contains("revoked") =>
        {
            Beat::Revoked(status.message().to_string())
        }
        Err(status) if status.code() == tonic::Code::PermissionDenied && status.message().contains(SUPERSEDED) => {
            Beat::Superseded(status.message().to_string())
        }
        Err(status) => {
            let text = status_text(&status);
            if text.contains("invalid peer certificate") {
                // What a node sees when identity's certificate comes from a
                // CA it never received: it was away through a rotation.
                return Beat::Failed(format!("{text}: {UNTRUSTED_IDENTITY}"));
            }
            if is_transient_code(status.code()) {
                Beat::Failed(text)
            } else {
                // Refusals like a duplicate advertise address can clear up
                // when the other node goes away: retried, but said loudly.
                Beat::Failed(format!("{:?}: {text}", status.code()))
            }
        }
    }
}

/// The watch channels the agent's handle reads.
#[derive(Debug)]
pub(crate) struct Watches {
    pub(crate) status: watch::Sender<AgentStatus>,
    pub(crate) session: watch::Sender<NodeSession>,
    pub(crate) fences: watch::Sender<Option<Fence>>,
}

/// The heartbeat task's state; [`Heartbeater::run`] owns it until shutdown.
pub(crate) struct Heartbeater {
    config: Arc<AgentConfig>,
    dir: IdentityDir,
    identity: NodeIdentity,
    credentials: TlsCredentials,
    /// The identity replica the channel goes to, and where to go next.
    servers: IdentityServers,
    channel: Channel,
    renewal: Option<PendingRenewal>,
    /// After identity refused a renewal CSR, none is sent until then.
    renewal_held_until: Option<Instant>,
    usage: UsageSampler,
    backoff: Backoff,
    failing_since: Option<SystemTime>,
    /// Whether this process recorded that identity took one of its
    /// heartbeats (for an updater waiting on it).
    reported: bool,
    watches: Watches,
    /// Fleet upgrades: what each beat reports, and what an answer asks for.
    upgrades: Upgrades,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for Heartbeater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeater")
            .field("identity", &self.identity)
            .field("renewal_pending", &self.renewal.is_some())
            .finish_non_exhaustive()
    }
}

impl Heartbeater {
    pub(crate) fn new(
        config: Arc<AgentConfig>,
        dir: IdentityDir,
        identity: NodeIdentity,
        credentials: TlsCredentials,
        watches: Watches,
        upgrades: Upgrades,
        shutdown: CancellationToken,
    ) -> Result<Self, AgentError> {
        let servers = IdentityServers::new(config.identity_servers(), &identity.node_id);
        let channel = berth_rpc::connect(servers.current(), credentials.clone()).map_err(AgentError::Client)?;
        let backoff = Backoff::new(config.timing.retry_initial, config.timing.retry_max);
        Ok(Self {
            config,
            dir,
            identity,
            credentials,
            servers,
            channel,
            renewal: None,
            renewal_held_until: None,
            usage: UsageSampler::new(),
            backoff,
            failing_since: None,
            reported: false,
            watches,
            upgrades,
            shutdown,
        })
    }

    fn session(&self) -> NodeSession {
        NodeSession { node_id: self.identity.node_id.clone(), incarnation: self.identity.incarnation }
    }

    fn set_status(&self, status: AgentStatus) {
        self.watches.status.send_replace(status);
    }

    /// Heartbeats until shutdown (`Ok`) or until the session cannot go on
    /// (`Err`: revoked, or a rejoin that was refused).
    pub(crate) async fn run(mut self) -> Result<(), AgentError> {
        let result = self.beat_until_stopped().await;
        if !matches!(result, Err(AgentError::Revoked { .. })) {
            self.set_status(AgentStatus::Stopped);
        }
        result
    }

    async fn beat_until_stopped(&mut self) -> Result<(), AgentError> {
        // The first heartbeat goes out at once, so a joined node is UP as
        // soon as identity hears from it.
        let mut next = Instant::now();
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep_until(next) => {}
                () = self.upgrades.beat_wanted() => {}
            }
            let started = Instant::now();
            if self.identity.expired_at(SystemTime::now()) {
                self.end_session(FenceReason::CertificateExpired);
                self.rejoin(FenceReason::CertificateExpired).await?;
                next = Instant::now();
                continue;
            }
            let shutdown = self.shutdown.clone();
            let beat = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                beat = self.beat() => beat,
            };
            match beat {
                Beat::Answered(response) if response.fenced => {
                    tracing::warn!(node_id = %self.identity.node_id, incarnation = self.identity.incarnation,
                        "identity fenced this incarnation (the node was reaped while out of reach); rejoining");
                    self.end_session(FenceReason::Fenced);
                    self.rejoin(FenceReason::Fenced).await?;
                    next = Instant::now();
                }
                Beat::Answered(response) => {
                    if !self.reported {
                        crate::updater::record_reported_version(self.dir.root(), &self.config.version);
                        self.reported = true;
                    }
                    if self.failing_since.take().is_some() {
                        tracing::info!(node_id = %self.identity.node_id, "identity answers heartbeats again");
                    }
                    self.backoff.reset();
                    if self.servers.answered(Instant::now()) {
                        tracing::info!(
                            server = self.servers.current(),
                            "going back to this node's own identity replica"
                        );
                        self.reconnect();
                    }
                    if let Some(target) = &response.upgrade {
                        self.upgrades.offer(target, &self.config.version);
                    }
                    self.upgrades.answered();
                    self.apply(response);
                    self.set_status(AgentStatus::Up { session: self.session(), last_heartbeat: SystemTime::now() });
                    next = started + self.identity.heartbeat_interval;
                }
                Beat::Failed(error) => {
                    let delay = self.backoff.next_delay();
                    let since = *self.failing_since.get_or_insert_with(SystemTime::now);
                    tracing::warn!(node_id = %self.identity.node_id, %error, failures = self.backoff.failures(),
                        retry_in = ?delay, "heartbeat failed");
                    self.set_status(AgentStatus::Retrying {
                        session: self.session(),
                        since,
                        failures: self.backoff.failures(),
                        last_error: error,
                    });
                    if self.servers.failed(Instant::now()) {
                        tracing::info!(server = self.servers.current(), "moving on to the next identity replica");
                        self.reconnect();
                    }
                    next = Instant::now() + delay;
                }
                Beat::Forgotten(message) => {
                    tracing::warn!(node_id = %self.identity.node_id, %message, "identity no longer knows this node; rejoining");
                    self.end_session(FenceReason::Forgotten);
                    self.rejoin(FenceReason::Forgotten).await?;
                    next = Instant::now();
                }
                Beat::Revoked(message) => return Err(self.revoked(&message)),
                Beat::Superseded(message) => {
                    tracing::warn!(node_id = %self.identity.node_id, %message,
                        "every service refuses this node's certificate; rejoining with the join token");
                    self.end_session(FenceReason::CertificateSuperseded);
                    self.rejoin(FenceReason::CertificateSuperseded).await?;
                    next = Instant::now();
                }
            }
        }
    }

    /// Ends the session for good after an operator revoked the node.
    fn revoked(&mut self, message: &str) -> AgentError {
        let session = self.session();
        tracing::error!(node_id = %session.node_id, %message,
            "this node was revoked by an operator: heartbeats stop and the agent exits; \
             to bring the host back, clear its data directory and join with a new token");
        self.end_session(FenceReason::Revoked);
        if let Err(error) = self.dir.record_revocation(&session.node_id) {
            tracing::error!(%error, "cannot record the revocation in the data directory");
        }
        self.set_status(AgentStatus::Revoked { session: session.clone() });
        AgentError::Revoked { node_id: session.node_id, data_dir: self.dir.root().display().to_string() }
    }

    /// Sends one heartbeat, with a renewal CSR once the certificate is past
    /// half its life.
    async fn beat(&mut self) -> Beat {
        let renewal_allowed = self.renewal_held_until.is_none_or(|until| Instant::now() >= until);
        if self.renewal.is_none() && renewal_allowed && SystemTime::now() >= self.identity.renew_after() {
            match generate_csr(CSR_COMMON_NAME) {
                Ok((csr_pem, key_pem)) => self.renewal = Some(PendingRenewal { csr_pem, key_pem }),
                Err(error) => tracing::warn!(%error, "cannot generate a key for certificate renewal; will retry"),
            }
        }
        let timeout = self.config.timing.rpc_timeout;
        let (upgrading, upgrade) = self.upgrades.report();
        let mut request = tonic::Request::new(HeartbeatRequest {
            node_id: self.identity.node_id.clone(),
            incarnation: self.identity.incarnation,
            usage: Some(self.usage.sample().to_proto()),
            capacity: Some(self.config.capacity.to_proto()),
            version: self.config.version.clone(),
            renewal_csr_pem: match &self.renewal {
                Some(renewal) if renewal_allowed => renewal.csr_pem.clone(),
                _ => String::new(),
            },
            // What the node trusts now, so identity activates a new CA only
            // once every node has it.
            ca_bundle_sha256: berth_bundle::Digest::of(self.identity.ca_bundle_pem.as_bytes()).hex().to_owned(),
            upgrading,
            upgrade,
        });
        let sent_renewal = !request.get_ref().renewal_csr_pem.is_empty();
        request.set_timeout(timeout);
        let mut client = NodeSessionClient::new(self.channel.clone());
        let result = match tokio::time::timeout(timeout, client.heartbeat(request)).await {
            Err(_) => return Beat::Failed(format!("no answer within {timeout:?}")),
            Ok(result) => result.map(tonic::Response::into_inner),
        };
        if let Err(status) = &result
            && sent_renewal
            && status.code() == tonic::Code::InvalidArgument
        {
            // A refused CSR must not cost the node its liveness: beat
            // without one for a while, then try a fresh key.
            tracing::warn!(error = %status.message(), "identity refused the renewal CSR; heartbeating without one for now");
            self.renewal = None;
            self.renewal_held_until = Some(Instant::now() + self.config.timing.retry_max);
        }
        classify(result)
    }

    /// Takes in a renewed certificate, a new CA bundle and a new interval.
    /// Anything that does not check out, or cannot be written to the data
    /// directory, is dropped with a warning: the next heartbeat asks again.
    fn apply(&mut self, response: HeartbeatResponse) {
        let mut material = self.identity.material();
        let mut received_at = self.identity.cert_received_at;
        let mut renewed = false;
        if !response.certificate_pem.trim().is_empty() {
            match self.renewal.take() {
                Some(pending) => {
                    material.cert_chain_pem = response.certificate_pem;
                    material.key_pem = pending.key_pem;
                    received_at = SystemTime::now();
                    renewed = true;
                }
                None => tracing::warn!("identity sent a certificate this agent did not ask for; ignoring it"),
            }
        }
        let bundle_changed =
            !response.ca_bundle_pem.trim().is_empty() && response.ca_bundle_pem != material.ca_bundle_pem;
        if bundle_changed {
            material.ca_bundle_pem = response.ca_bundle_pem;
        }
        let interval = if response.heartbeat_interval_ms > 0 {
            self.config.timing.heartbeat_interval(response.heartbeat_interval_ms)
        } else {
            self.identity.heartbeat_interval
        };
        if !renewed && !bundle_changed && interval == self.identity.heartbeat_interval {
            return;
        }

        let checked = NodeIdentity::new(
            self.identity.node_id.clone(),
            self.identity.incarnation,
            interval,
            material.clone(),
            received_at,
        )
        .and_then(|candidate| {
            TlsCredentials::new(material.clone()).map_err(|e| e.to_string())?;
            verify_chain(&material.cert_chain_pem, &material.ca_bundle_pem).map_err(|e| e.to_string())?;
            Ok(candidate)
        });
        let candidate = match checked {
            Ok(candidate) => candidate,
            Err(error) => {
                tracing::warn!(%error, renewed, bundle_changed, "identity's new credentials do not check out; keeping the current ones");
                return;
            }
        };
        if let Err(error) = self.dir.save(&candidate) {
            tracing::warn!(%error, "cannot write the node identity; keeping the current one and asking again");
            return;
        }
        if renewed || bundle_changed {
            if let Err(error) = self.credentials.reload(candidate.material()) {
                tracing::warn!(%error, "cannot load the new credentials; keeping the current ones");
                return;
            }
            self.reconnect();
        }
        if renewed {
            tracing::info!(node_id = %candidate.node_id, not_after = ?candidate.cert_not_after, "renewed the node certificate");
        }
        if bundle_changed {
            tracing::info!(node_id = %candidate.node_id, "took in a new CA bundle");
        }
        self.identity = candidate;
    }

    /// A fresh channel, so the next handshake presents the current
    /// certificate instead of the one the open connection was made with.
    fn reconnect(&mut self) {
        match berth_rpc::connect(self.servers.current(), self.credentials.clone()) {
            Ok(channel) => self.channel = channel,
            Err(error) => tracing::warn!(%error, "cannot rebuild the channel to identity; keeping the current one"),
        }
    }

    /// Announces that the current session is over, before anything else
    /// happens, so the work under it is held in custody first.
    fn end_session(&mut self, reason: FenceReason) {
        let session = self.session();
        self.renewal = None;
        self.failing_since = None;
        self.watches.fences.send_replace(Some(Fence { session: session.clone(), reason, at: SystemTime::now() }));
        self.set_status(AgentStatus::Fenced { session, reason });
    }

    /// Tells the runner the node will never rejoin: what it holds in custody
    /// can never be accounted for again, and goes after the stop grace.
    fn rejoin_refused(&mut self, old: &NodeSession) {
        let fence = Fence { session: old.clone(), reason: FenceReason::RejoinRefused, at: SystemTime::now() };
        self.watches.fences.send_replace(Some(fence));
    }

    /// Rejoins after the session ended: with the node's certificate while it
    /// is valid, else with the join token. Returns `Ok` with the new session
    /// in force, or `Ok` unchanged on shutdown.
    async fn rejoin(&mut self, reason: FenceReason) -> Result<(), AgentError> {
        self.set_status(AgentStatus::Joining);
        let old = self.session();
        let mut with_certificate =
            !matches!(reason, FenceReason::CertificateExpired | FenceReason::CertificateSuperseded);
        let shutdown = self.shutdown.clone();
        loop {
            if with_certificate && self.identity.expired_at(SystemTime::now()) {
                with_certificate = false;
            }
            if !with_certificate && self.config.token().is_none() {
                self.rejoin_refused(&old);
                return Err(AgentError::RejoinNeedsToken { node_id: old.node_id, reason });
            }
            let attempt = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                attempt = self.try_rejoin(with_certificate) => attempt,
            };
            match attempt {
                Ok(identity) => {
                    self.adopt(identity)?;
                    return Ok(());
                }
                Err(error) if error.is_transient() => {
                    let delay = error.retry_delay(&mut self.backoff);
                    tracing::warn!(%error, retry_in = ?delay, "rejoin failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Err(JoinError::Refused { code: tonic::Code::PermissionDenied, message })
                    if message.to_ascii_lowercase().contains("revoked") =>
                {
                    // Bringing a revoked node back is the operator's call, not the token's.
                    return Err(self.revoked(&message));
                }
                Err(error) if with_certificate => {
                    tracing::warn!(%error, "identity refused a rejoin with the node certificate; trying the join token");
                    with_certificate = false;
                }
                Err(source) => {
                    self.rejoin_refused(&old);
                    return Err(AgentError::Rejoin { node_id: old.node_id, reason, source });
                }
            }
        }
    }

    async fn try_rejoin(&self, with_certificate: bool) -> Result<NodeIdentity, JoinError> {
        match self.config.token() {
            _ if with_certificate => join::rejoin_with_certificate(&self.config, &self.credentials).await,
            Some(token) => {
                let bundle = trust_union(&self.identity.ca_bundle_pem, &self.config.ca_bundle_pem);
                join::join_with_token(&self.config, &token, &bundle).await
            }
            None => Err(JoinError::Refused {
                code: tonic::Code::Unauthenticated,
                message: "no join token to rejoin with".into(),
            }),
        }
    }

    /// Makes a freshly joined identity the node's: on disk, in the
    /// credentials, and in the session everyone watches.
    fn adopt(&mut self, identity: NodeIdentity) -> Result<(), AgentError> {
        if let Err(error) = self.dir.save(&identity) {
            // The node runs on in memory; after a restart the old identity is
            // fenced and the node rejoins again.
            tracing::error!(%error, "cannot write the new node identity; running on without it");
        }
        self.credentials.reload(identity.material()).map_err(AgentError::Tls)?;
        // A new node id may prefer another replica.
        self.servers = IdentityServers::new(self.config.identity_servers(), &identity.node_id);
        self.identity = identity;
        self.backoff.reset();
        self.reconnect();
        let session = self.session();
        tracing::info!(node_id = %session.node_id, incarnation = session.incarnation, "rejoined");
        self.watches.session.send_replace(session.clone());
        self.set_status(AgentStatus::Joined { session });
        Ok(())
    }
}

/// Every CA in both bundles: the one the agent keeps (current after
/// rotations) and the one the operator gave.
pub(crate) fn trust_union(kept: &str, given: &str) -> String {
    match (kept.trim().is_empty(), given.trim().is_empty()) {
        (false, false) if kept != given => format!("{}\n{}", kept.trim_end(), given),
        (false, _) => kept.to_string(),
        (true, _) => given.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use tonic::{Code, Status};

    use super::*;

    #[test]
    fn a_stale_incarnation_is_read_from_an_ok_answer() {
        let beat = classify(Ok(HeartbeatResponse { fenced: true, ..Default::default() }));
        assert!(matches!(beat, Beat::Answered(HeartbeatResponse { fenced: true, .. })), "{beat:?}");
    }

    #[test]
    fn revoked_and_forgotten_are_told_apart_from_failures() {
        assert!(matches!(classify(Err(Status::permission_denied("node revoked"))), Beat::Revoked(_)));
        assert!(matches!(classify(Err(Status::not_found("unknown node; rejoin"))), Beat::Forgotten(_)));
        // Permission denied for another reason is not a revocation: the
        // agent keeps trying rather than giving its identity up.
        assert!(matches!(classify(Err(Status::permission_denied("node 'a' may not act for 'b'"))), Beat::Failed(_)));
        for code in [Code::Unavailable, Code::DeadlineExceeded, Code::ResourceExhausted, Code::FailedPrecondition] {
            assert!(matches!(classify(Err(Status::new(code, "x"))), Beat::Failed(_)), "{code:?}");
        }
    }

    #[test]
    fn the_trust_union_keeps_both_bundles_once() {
        assert_eq!(trust_union("A\n", "B\n"), "A\nB\n");
        assert_eq!(trust_union("A\n", "A\n"), "A\n");
        assert_eq!(trust_union("", "B"), "B");
        assert_eq!(trust_union("A", ""), "A");
    }
}
