//! Where a node gets the registry credentials of a private bundle: revisions'
//! `GetPullCredentials`, asked with the node certificate for one lease at a
//! time. [`PullCredentials`] is the seam; [`GrpcPullCredentials`] is the
//! real one.
//!
//! # Invariants
//! - Credentials live in memory for one pull: they are fetched when a pull
//!   needs them, used before their `expires_at`, and dropped. Nothing of
//!   them is written to disk or logged ([`RegistryCredentials`] prints only
//!   the user name).
//! - They are sent only to the registry revisions says they are for, which
//!   must be the registry of the lease's reference.

use std::time::{Duration, SystemTime};

use berth_bundle::RegistryCredentials;
use berth_mtls::TlsCredentials;
use berth_proto::revisions::v1::GetPullCredentialsRequest;
use berth_proto::revisions::v1::revisions_client::RevisionsClient;
use berth_rpc::FollowingChannel;

/// Credentials handed to the node for one pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IssuedCredentials {
    /// The registry, `host[:port]`, they may be sent to.
    pub(crate) registry: String,
    /// What to send.
    pub(crate) credentials: RegistryCredentials,
    /// When they must no longer be used.
    pub(crate) expires_at: SystemTime,
}

/// Why no credentials came.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CredentialsError {
    /// Revisions refused them: the lease is not the node's, or the revision
    /// names credentials revisions does not hold.
    #[error("revisions refused the registry credentials: {0}")]
    Refused(String),
    /// Revisions could not be asked, or did not answer in time.
    #[error("cannot ask revisions for the registry credentials: {0}")]
    Unavailable(String),
    /// Revisions answered with something unusable.
    #[error("revisions answered with unusable registry credentials: {0}")]
    Invalid(String),
}

/// Fetches the registry credentials of one lease's bundle.
#[async_trait::async_trait]
pub(crate) trait PullCredentials: Send + Sync + std::fmt::Debug {
    /// The credentials for pulling lease `lease_id`'s bundle.
    async fn fetch(&self, lease_id: &str) -> Result<IssuedCredentials, CredentialsError>;
}

/// Revisions over mTLS gRPC, presenting the node certificate.
#[derive(Debug, Clone)]
pub(crate) struct GrpcPullCredentials {
    channel: std::sync::Arc<FollowingChannel>,
    timeout: Duration,
}

impl GrpcPullCredentials {
    /// A client of revisions at `addr` (`host:port`); nothing is dialled
    /// until the first fetch.
    pub(crate) fn new(
        addr: &str,
        credentials: TlsCredentials,
        timeout: Duration,
    ) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self { channel: std::sync::Arc::new(FollowingChannel::new(addr, credentials)?), timeout })
    }
}

#[async_trait::async_trait]
impl PullCredentials for GrpcPullCredentials {
    async fn fetch(&self, lease_id: &str) -> Result<IssuedCredentials, CredentialsError> {
        let mut request = tonic::Request::new(GetPullCredentialsRequest { lease_id: lease_id.to_owned() });
        request.set_timeout(self.timeout);
        let mut client = RevisionsClient::new(self.channel.channel());
        let call = client.get_pull_credentials(request);
        let answer = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(answer)) => answer.into_inner(),
            Ok(Err(status)) if crate::rpc_status::is_transient_code(status.code()) => {
                return Err(CredentialsError::Unavailable(format!("{}: {}", self.channel.addr(), status.message())));
            }
            Ok(Err(status)) => return Err(CredentialsError::Refused(status.message().to_owned())),
            Err(_) => {
                return Err(CredentialsError::Unavailable(format!(
                    "{} did not answer within {:?}",
                    self.channel.addr(),
                    self.timeout
                )));
            }
        };
        let credentials = match (answer.username, answer.password, answer.bearer_token) {
            (username, password, token) if token.is_empty() && !username.is_empty() => {
                RegistryCredentials::Basic { username, password }
            }
            (username, password, token) if !token.is_empty() && username.is_empty() && password.is_empty() => {
                RegistryCredentials::Bearer { token }
            }
            _ => return Err(CredentialsError::Invalid("neither a username nor a bearer token alone".into())),
        };
        let expires_at = answer
            .expires_at
            .and_then(|at| SystemTime::try_from(at).ok())
            .ok_or_else(|| CredentialsError::Invalid("no expiry".into()))?;
        if answer.registry.is_empty() {
            return Err(CredentialsError::Invalid("no registry".into()));
        }
        Ok(IssuedCredentials { registry: answer.registry, credentials, expires_at })
    }
}
