//! [`AgentError`]: why the agent could not start, or stopped, which the
//! agent's start-up and its heartbeat (which ends the agent when identity
//! revokes the node) both answer with. It wraps the errors of the parts
//! that start the agent; the one they share, [`FileError`](crate::files::FileError),
//! lives in the leaf [`files`](crate::files) so none of them imports this
//! module back.

use std::net::SocketAddr;

use crate::egress::EgressError;
use crate::identity_dir::IdentityDirError;
use crate::join::JoinError;
use crate::status::FenceReason;

/// Why the agent could not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is unusable; the message names the field.
    #[error("invalid agent configuration: {0}")]
    Config(String),
    /// The data directory or the identity in it could not be used.
    #[error(transparent)]
    IdentityDir(#[from] IdentityDirError),
    /// The host never joined and no join token was given.
    #[error("no node identity in {data_dir} and no join token to join with; pass --join-token")]
    NoIdentity {
        /// The data directory.
        data_dir: String,
    },
    /// The kept certificate expired and no join token was given to rejoin.
    #[error(
        "the certificate of node {node_id} in {data_dir} expired while the agent was away; pass --join-token to join again"
    )]
    CertificateExpired {
        /// The node whose certificate expired.
        node_id: String,
        /// The data directory.
        data_dir: String,
    },
    /// An operator revoked the node.
    #[error(
        "node {node_id} was revoked by an operator; to join this host again, remove {data_dir} and start with a new join token"
    )]
    Revoked {
        /// The revoked node.
        node_id: String,
        /// The data directory that records the revocation.
        data_dir: String,
    },
    /// The first join failed for good.
    #[error("cannot join: {0}")]
    Join(#[source] JoinError),
    /// The session ended and identity refused every way back in.
    #[error("node {node_id} was {reason} and cannot rejoin: {source}")]
    Rejoin {
        /// The node whose session ended.
        node_id: String,
        /// Why the session ended.
        reason: FenceReason,
        /// The last refusal.
        #[source]
        source: JoinError,
    },
    /// The session ended, the certificate cannot rejoin, and there is no
    /// token to rejoin with.
    #[error("node {node_id} was {reason} and needs a join token to rejoin; restart with --join-token")]
    RejoinNeedsToken {
        /// The node whose session ended.
        node_id: String,
        /// Why the session ended.
        reason: FenceReason,
    },
    /// The node credentials could not be loaded.
    #[error("node credentials: {0}")]
    Tls(#[source] berth_mtls::MtlsError),
    /// The channel to identity could not be built.
    #[error(transparent)]
    Client(berth_rpc::ClientError),
    /// Egress enforcement could not be set up.
    #[error("cannot start egress enforcement: {0}")]
    Egress(#[source] EgressError),
    /// The bundle cache could not be opened.
    #[error("cannot open the bundle cache: {0}")]
    BundleCache(#[source] berth_bundle::CacheError),
    /// The agent API address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The agent API server failed.
    #[error("agent api: {0}")]
    Serve(#[source] berth_rpc::RpcError),
    /// The agent was shut down before it had an identity.
    #[error("stopped before the node joined")]
    Cancelled,
    /// One of the agent's tasks panicked or was aborted.
    #[error("agent task failed: {0}")]
    Task(String),
    /// The node cannot contain its workloads, and was not allowed to run
    /// them uncontained.
    #[error("{0}; workloads would run uncontained (pass --allow-uncontained to run them so anyway)")]
    Uncontained(String),
}
