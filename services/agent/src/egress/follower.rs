//! The agent's side of `berth.egress.v1.NodeEgress`: follows the node's
//! egress state, applies each one whole to the proxies, and acknowledges it.
//!
//! # Expected flow
//! `WatchEgress` with the node's own id, on the node certificate. Every
//! [`NodeEgressState`] is applied whole ([`EgressProxies::apply`]), then
//! acknowledged with its generation, the error text when it could not be
//! applied, and how the node enforces egress. A broken stream is opened
//! again after a jittered backoff; a new session (a rejoin that changed the
//! node id or its certificate) reopens it at once on a new connection.
//!
//! # Failures
//! An egress service that does not answer, or answers `UNIMPLEMENTED` (it
//! does not serve node egress yet), is retried quietly: one line when it
//! starts failing, then only at debug level, until it answers. Proxies keep
//! the rules they have meanwhile. An acknowledgement that fails is retried
//! a few times; the next state is acknowledged in any case, and the egress
//! service sends the whole state again when the stream reopens.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_proto::egress::v1::{
    AckEgressRequest, NodeEgressState, WatchEgressRequest, node_egress_client::NodeEgressClient,
};
use berth_rpc::Channel;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;

use super::proxies::EgressProxies;
use crate::node_channel::NodeChannel;
use crate::rpc_status::{is_transient_code, status_text};
use crate::status::NodeSession;
use berth_core::backoff::Backoff;

/// How many times one acknowledgement is tried.
const ACK_ATTEMPTS: u32 = 5;

/// The largest node egress state the node takes. A state holds the whole
/// plan of every tenant the node hosts, so it outgrows gRPC's 4 MiB default
/// long before anything else the node receives (a tenant of 10,000 routes
/// is several MiB); a state over this is refused and the node keeps the
/// rules in force.
const MAX_NODE_STATE_BYTES: usize = 64 * 1024 * 1024;

/// The node's egress states, as the egress service streams them.
pub(crate) type EgressStream = Pin<Box<dyn Stream<Item = Result<NodeEgressState, tonic::Status>> + Send>>;

/// What the follower asks of the egress service.
#[async_trait::async_trait]
pub(crate) trait NodeEgressApi: Send + Sync + std::fmt::Debug {
    /// Opens the node's egress stream.
    async fn watch_egress(&self, node_id: &str) -> Result<EgressStream, tonic::Status>;
    /// Acknowledges a state.
    async fn ack_egress(&self, request: AckEgressRequest) -> Result<(), tonic::Status>;
    /// Drops the open connection, so the next call presents the node's
    /// current certificate.
    fn reconnect(&self);
}

/// The egress service over mTLS gRPC, presenting the node certificate.
#[derive(Debug)]
pub(crate) struct GrpcNodeEgress {
    channel: NodeChannel,
}

impl GrpcNodeEgress {
    /// A client of the egress service at `addr` (`host:port`).
    pub(crate) fn new(
        addr: &str,
        credentials: TlsCredentials,
        timeout: Duration,
    ) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self { channel: NodeChannel::new("egress", addr, credentials, timeout)? })
    }

    fn client(&self) -> NodeEgressClient<Channel> {
        NodeEgressClient::new(self.channel.channel()).max_decoding_message_size(MAX_NODE_STATE_BYTES)
    }
}

#[async_trait::async_trait]
impl NodeEgressApi for GrpcNodeEgress {
    async fn watch_egress(&self, node_id: &str) -> Result<EgressStream, tonic::Status> {
        let request = WatchEgressRequest { node_id: node_id.to_string() };
        // The stream lives as long as the node's session: only opening it has a deadline.
        let stream = self.channel.call(self.client().watch_egress(request)).await?;
        Ok(Box::pin(stream))
    }

    async fn ack_egress(&self, request: AckEgressRequest) -> Result<(), tonic::Status> {
        self.channel.call(self.client().ack_egress(self.channel.request(request))).await.map(|_| ())
    }

    fn reconnect(&self) {
        self.channel.reconnect();
    }
}

/// The task that follows the node's egress state; see the module docs.
#[derive(Debug)]
pub(crate) struct EgressFollower {
    pub(crate) api: Arc<dyn NodeEgressApi>,
    pub(crate) proxies: EgressProxies,
    pub(crate) session: watch::Receiver<NodeSession>,
    pub(crate) backoff: Backoff,
    pub(crate) shutdown: CancellationToken,
}

/// How one open stream ended.
enum StreamEnd {
    /// It broke or the service ended it: open it again after the backoff.
    Broken,
    /// The session changed: open it again at once.
    NewSession,
    /// The agent is stopping.
    Stopped,
}

impl EgressFollower {
    /// Runs until shutdown.
    pub(crate) async fn run(mut self) {
        let mut unanswered = false;
        loop {
            let node_id = self.session.borrow_and_update().node_id.clone();
            let opened = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                changed = self.session.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    self.api.reconnect();
                    continue;
                }
                opened = self.api.watch_egress(&node_id) => opened,
            };
            match opened {
                Ok(stream) => {
                    if std::mem::take(&mut unanswered) {
                        tracing::info!("the egress service answers; following the node's egress state");
                    }
                    match self.follow(&node_id, stream).await {
                        StreamEnd::Stopped => return,
                        StreamEnd::NewSession => {
                            self.api.reconnect();
                            continue;
                        }
                        StreamEnd::Broken => {}
                    }
                }
                Err(status) => {
                    let error = status_text(&status);
                    if !std::mem::replace(&mut unanswered, true) {
                        tracing::info!(code = ?status.code(), %error,
                            "the egress service does not serve node egress yet; retrying quietly");
                    } else {
                        tracing::debug!(code = ?status.code(), %error, "the egress service still does not answer");
                    }
                }
            }
            let delay = self.backoff.next_delay();
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                changed = self.session.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    self.api.reconnect();
                }
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    async fn follow(&mut self, node_id: &str, mut stream: EgressStream) -> StreamEnd {
        loop {
            let next = tokio::select! {
                _ = self.shutdown.cancelled() => return StreamEnd::Stopped,
                changed = self.session.changed() => {
                    return if changed.is_ok() { StreamEnd::NewSession } else { StreamEnd::Stopped };
                }
                next = stream.next() => next,
            };
            match next {
                Some(Ok(state)) => {
                    self.backoff.reset();
                    if !self.apply_and_ack(node_id, state).await {
                        return StreamEnd::Stopped;
                    }
                }
                Some(Err(status)) => {
                    tracing::warn!(error = %status_text(&status), "the egress stream broke");
                    return StreamEnd::Broken;
                }
                None => {
                    tracing::info!("the egress service ended the egress stream");
                    return StreamEnd::Broken;
                }
            }
        }
    }

    /// Applies `state` and acknowledges it; `false` when the agent stopped meanwhile.
    async fn apply_and_ack(&mut self, node_id: &str, state: NodeEgressState) -> bool {
        let generation = state.generation;
        let error = match self.proxies.apply(&state).await {
            Ok(()) => {
                tracing::info!(generation, tenants = state.plans.len(), "applied the node's egress state");
                String::new()
            }
            Err(error) => {
                tracing::warn!(generation, %error, "cannot apply the node's egress state; the previous rules hold");
                error.to_string()
            }
        };
        let request = AckEgressRequest {
            node_id: node_id.to_string(),
            generation,
            error,
            enforcement: self.proxies.enforcement().to_proto() as i32,
        };
        let mut backoff = self.backoff.clone();
        backoff.reset();
        for attempt in 1..=ACK_ATTEMPTS {
            let acked = tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                acked = self.api.ack_egress(request.clone()) => acked,
            };
            match acked {
                Ok(()) => return true,
                Err(status) if is_transient_code(status.code()) && attempt < ACK_ATTEMPTS => {
                    let delay = backoff.next_delay();
                    tracing::debug!(generation, error = %status_text(&status), retry_in = ?delay, "cannot acknowledge; retrying");
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return false,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Err(status) => {
                    tracing::warn!(generation, error = %status_text(&status), "cannot acknowledge the egress state");
                    return true;
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests;
