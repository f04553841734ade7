//! A control-plane service as the node calls it: one connection presenting
//! the node certificate, and the agent's RPC timeout on every call. The
//! leases and egress clients share it, so both bound their calls and name a
//! service that does not answer in the same way.

use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_rpc::{Channel, FollowingChannel};

/// The connection to one service and the deadline of each call to it.
#[derive(Debug)]
pub(crate) struct NodeChannel {
    /// The service, as a deadline error names it (`leases`, `egress`).
    service: &'static str,
    channel: FollowingChannel,
    timeout: Duration,
}

impl NodeChannel {
    /// A connection to `service` at `addr` (`host:port`); nothing is dialled
    /// until the first call.
    pub(crate) fn new(
        service: &'static str,
        addr: &str,
        credentials: TlsCredentials,
        timeout: Duration,
    ) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self { service, channel: FollowingChannel::new(addr, credentials)?, timeout })
    }

    /// The channel a generated client is built on.
    pub(crate) fn channel(&self) -> Channel {
        self.channel.channel()
    }

    /// Runs one call (or opens one stream) under the timeout, answering
    /// `DEADLINE_EXCEEDED` when the service does not answer in time.
    pub(crate) async fn call<T, F>(&self, request: F) -> Result<T, tonic::Status>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(result) => result.map(tonic::Response::into_inner),
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "{} at {} did not answer within {:?}",
                self.service,
                self.channel.addr(),
                self.timeout
            ))),
        }
    }

    /// `message` as a request whose deadline the server is told too.
    pub(crate) fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// Drops the open connection, so the next call presents the node's
    /// current certificate.
    pub(crate) fn reconnect(&self) {
        self.channel.reconnect();
    }
}
