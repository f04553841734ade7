//! Joining the control plane: a fresh key and CSR exchanged at identity's
//! `Join` for a node certificate whose node id the server chose.
//!
//! # Two ways in
//! - With a join token, over TLS without a client certificate; the server is
//!   verified against the CA bundle the operator gave (or the one the agent
//!   keeps). This is how a host first joins.
//! - With the node's own still-valid certificate, over mTLS and without a
//!   token: the server rejoins it as the same node with the next incarnation.
//!   This is how a fenced node comes back without spending a token use.
//!
//! Either way the key never leaves the host: only its CSR is sent.

use std::time::{Duration, SystemTime};

use berth_mtls::{TlsCredentials, TlsMaterial, generate_csr, verify_chain};
use berth_proto::identity::v1::{JoinRequest, join_client::JoinClient};
use berth_rpc::Channel;
use tokio_util::sync::CancellationToken;

use crate::config::AgentConfig;
use crate::identity_dir::NodeIdentity;
use crate::rpc_status::{is_transient_code, status_text};
use berth_core::backoff::Backoff;

/// The common name put in CSRs; the authority ignores it and names the node
/// id it chose.
const CSR_COMMON_NAME: &str = "berth-node";

/// Why a join did not produce an identity.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The node key or its CSR could not be generated.
    #[error("cannot generate the node key: {0}")]
    Key(#[source] berth_mtls::MtlsError),
    /// The channel to identity could not be built (bad address or CA bundle).
    #[error(transparent)]
    Client(#[from] berth_rpc::ClientError),
    /// Identity could not be reached, or answered with an error worth retrying.
    #[error("identity at {server} is unavailable: {message}")]
    Unavailable {
        /// The identity address.
        server: String,
        /// What the transport or server said.
        message: String,
        /// How long the server asked the caller to wait (a rate limit).
        retry_after: Option<Duration>,
    },
    /// Identity refused the join; retrying the same request will not help.
    #[error("identity refused the join ({code:?}): {message}")]
    Refused {
        /// The status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// Identity's answer does not hold together (a certificate for another
    /// node, or one that does not match the key).
    #[error("identity sent an unusable join response: {0}")]
    BadResponse(String),
    /// The agent was shut down before the join finished.
    #[error("stopped before the join finished")]
    Cancelled,
}

impl JoinError {
    /// Whether the same join may succeed later.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(self, JoinError::Unavailable { .. })
    }

    /// How long to wait before trying again: the backoff's next delay, or
    /// the server's own hint when that is longer (never past the backoff cap).
    pub(crate) fn retry_delay(&self, backoff: &mut Backoff) -> Duration {
        let delay = backoff.next_delay();
        match self {
            JoinError::Unavailable { retry_after: Some(hint), .. } => delay.max((*hint).min(backoff.cap())),
            _ => delay,
        }
    }
}

/// The metadata key identity puts a rate-limited caller's wait in, in milliseconds.
const RETRY_AFTER_MS: &str = "retry-after-ms";

fn retry_after(status: &tonic::Status) -> Option<Duration> {
    let millis = status.metadata().get(RETRY_AFTER_MS)?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_millis(millis))
}

/// Joins with `token`, verifying identity against `ca_bundle_pem`.
pub(crate) async fn join_with_token(
    config: &AgentConfig,
    token: &str,
    ca_bundle_pem: &str,
) -> Result<NodeIdentity, JoinError> {
    each_replica(config, |server| async move {
        let channel = berth_rpc::connect_anonymous(&server, ca_bundle_pem)?;
        join(channel, &server, config, token, ca_bundle_pem).await
    })
    .await
}

/// Rejoins as the node `credentials` name, authenticated by its certificate.
pub(crate) async fn rejoin_with_certificate(
    config: &AgentConfig,
    credentials: &TlsCredentials,
) -> Result<NodeIdentity, JoinError> {
    let bundle = credentials.material().ca_bundle_pem;
    let bundle = bundle.as_str();
    each_replica(config, |server| async move {
        let channel = berth_rpc::connect(&server, credentials.clone())?;
        join(channel, &server, config, "", bundle).await
    })
    .await
}

/// Tries `attempt` on each identity replica, from a random one, until one
/// answers with anything but unavailable; else the last replica's error.
async fn each_replica<F, Fut>(config: &AgentConfig, mut attempt: F) -> Result<NodeIdentity, JoinError>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<NodeIdentity, JoinError>>,
{
    let servers = config.identity_servers();
    let mut last = None;
    for server in crate::identity_servers::join_order(&servers) {
        match attempt(server.to_string()).await {
            Err(error) if error.is_transient() => {
                if servers.len() > 1 {
                    tracing::warn!(%error, "identity replica unavailable for the join; trying the next");
                }
                last = Some(error);
            }
            outcome => return outcome,
        }
    }
    Err(last.unwrap_or_else(|| JoinError::Unavailable {
        server: config.server.clone(),
        message: "no identity address given".into(),
        retry_after: None,
    }))
}

/// Runs `attempt` until it succeeds, fails for good, or `shutdown` fires,
/// waiting out `backoff` between transient failures.
pub(crate) async fn retrying<F, Fut>(
    what: &str,
    backoff: &mut Backoff,
    shutdown: &CancellationToken,
    mut attempt: F,
) -> Result<NodeIdentity, JoinError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<NodeIdentity, JoinError>>,
{
    loop {
        let outcome = tokio::select! {
            _ = shutdown.cancelled() => return Err(JoinError::Cancelled),
            outcome = attempt() => outcome,
        };
        match outcome {
            Ok(identity) => {
                backoff.reset();
                return Ok(identity);
            }
            Err(error) if error.is_transient() => {
                let delay = error.retry_delay(backoff);
                tracing::warn!(%error, attempt = backoff.failures(), retry_in = ?delay, "{what} failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(JoinError::Cancelled),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(error) => return Err(error),
        }
    }
}

async fn join(
    channel: Channel,
    server: &str,
    config: &AgentConfig,
    token: &str,
    fallback_bundle_pem: &str,
) -> Result<NodeIdentity, JoinError> {
    let (csr_pem, key_pem) = generate_csr(CSR_COMMON_NAME).map_err(JoinError::Key)?;
    let timeout = config.timing.rpc_timeout;
    let mut request = tonic::Request::new(JoinRequest {
        token: token.to_string(),
        csr_pem,
        name: config.name.clone(),
        advertise_addr: config.advertise_addr.clone(),
        tier: config.tier.clone(),
        version: config.version.clone(),
        capacity: Some(config.capacity.to_proto()),
        labels: config.labels.clone().into_iter().collect(),
    });
    request.set_timeout(timeout);
    let unavailable = |message: String, retry_after: Option<Duration>| JoinError::Unavailable {
        server: server.to_string(),
        message,
        retry_after,
    };
    let mut client = JoinClient::new(channel);
    let response = match tokio::time::timeout(timeout, client.join(request)).await {
        Err(_) => return Err(unavailable(format!("no answer within {timeout:?}"), None)),
        Ok(Err(status)) if is_transient_code(status.code()) => {
            return Err(unavailable(status_text(&status), retry_after(&status)));
        }
        Ok(Err(status)) => {
            return Err(JoinError::Refused { code: status.code(), message: status.message().to_string() });
        }
        Ok(Ok(response)) => response.into_inner(),
    };
    let ca_bundle_pem =
        if response.ca_bundle_pem.trim().is_empty() { fallback_bundle_pem.to_string() } else { response.ca_bundle_pem };
    let material = TlsMaterial { cert_chain_pem: response.certificate_pem, key_pem, ca_bundle_pem };
    let bad = |e: String| JoinError::BadResponse(e);
    // The key must match the certificate, and the certificate must chain to
    // the bundle the node will present it against.
    TlsCredentials::new(material.clone()).map_err(|e| bad(e.to_string()))?;
    verify_chain(&material.cert_chain_pem, &material.ca_bundle_pem).map_err(|e| bad(e.to_string()))?;
    let interval = config.timing.heartbeat_interval(response.heartbeat_interval_ms);
    NodeIdentity::new(response.node_id, response.incarnation, interval, material, SystemTime::now()).map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate_limited(wait_ms: &str) -> JoinError {
        let mut status = tonic::Status::resource_exhausted("too many join attempts");
        status.metadata_mut().insert(RETRY_AFTER_MS, wait_ms.parse().unwrap());
        assert!(is_transient_code(status.code()));
        JoinError::Unavailable {
            server: "identity:7443".into(),
            message: status_text(&status),
            retry_after: retry_after(&status),
        }
    }

    #[test]
    fn a_rate_limit_hint_lengthens_the_wait_but_not_past_the_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));
        assert!(rate_limited("300").retry_delay(&mut backoff) >= Duration::from_millis(300));
        assert_eq!(rate_limited("60000").retry_delay(&mut backoff), Duration::from_secs(1));
        let unparsable = rate_limited("soon");
        assert!(unparsable.retry_delay(&mut backoff) < Duration::from_millis(300));
    }

    #[test]
    fn refusals_are_final_and_outages_are_not() {
        assert!(rate_limited("1").is_transient());
        let refused = JoinError::Refused { code: tonic::Code::Unauthenticated, message: "invalid join token".into() };
        assert!(!refused.is_transient());
        for code in [tonic::Code::InvalidArgument, tonic::Code::Unauthenticated, tonic::Code::PermissionDenied] {
            assert!(!is_transient_code(code), "{code:?}");
        }
    }
}
