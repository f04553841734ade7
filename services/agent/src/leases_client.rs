//! The agent's side of `berth.leases.v1.NodeLeases`, behind a small trait so
//! the runner can be driven by a fake leases service in unit tests.
//!
//! # Failures
//! Every unary call is bounded by the agent's RPC timeout. A status whose
//! code says "not now" (see [`is_transient`]) is worth retrying; any other
//! is the leases service's answer about the lease, and retrying the same
//! call would get the same answer.

use std::pin::Pin;
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_proto::leases::v1::{
    AssignmentEvent, AssumeCustodyRequest, Lease, ReconcileNodeRequest, ReconcileNodeResponse, RenewLeasesRequest,
    RenewLeasesResponse, ReportPhaseRequest, WatchAssignmentsRequest, node_leases_client::NodeLeasesClient,
};
use berth_rpc::{Channel, FollowingChannel};
use tokio_stream::Stream;

/// The node's assignments, as the leases service streams them.
pub(crate) type AssignmentStream = Pin<Box<dyn Stream<Item = Result<AssignmentEvent, tonic::Status>> + Send>>;

/// What the runner asks of the leases service.
#[async_trait::async_trait]
pub(crate) trait NodeLeasesApi: Send + Sync + std::fmt::Debug {
    /// Opens the node's assignment stream, resuming after `resume_cursor`
    /// when it is not 0.
    async fn watch_assignments(&self, node_id: &str, resume_cursor: u64) -> Result<AssignmentStream, tonic::Status>;
    /// Reports a phase; returns the lease as it is now.
    async fn report_phase(&self, request: ReportPhaseRequest) -> Result<Lease, tonic::Status>;
    /// Renews the node's leases in one batch.
    async fn renew_leases(&self, request: RenewLeasesRequest) -> Result<RenewLeasesResponse, tonic::Status>;
    /// Compares what the node runs with its open leases.
    async fn reconcile_node(&self, request: ReconcileNodeRequest) -> Result<ReconcileNodeResponse, tonic::Status>;
    /// Takes a lease whose workload the node runs into its custody; returns
    /// the lease at its new epoch.
    async fn assume_custody(&self, request: AssumeCustodyRequest) -> Result<Lease, tonic::Status>;
    /// Drops the open connection, so the next call presents the node's
    /// current certificate (after a rejoin the node id in it changes).
    fn reconnect(&self);
}

/// Whether a call that failed with `status` may succeed if tried again.
pub(crate) fn is_transient(status: &tonic::Status) -> bool {
    crate::rpc_status::is_transient_code(status.code())
}

/// The leases service over mTLS gRPC, presenting the node certificate.
pub(crate) struct GrpcNodeLeases {
    channel: FollowingChannel,
    timeout: Duration,
}

impl std::fmt::Debug for GrpcNodeLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcNodeLeases")
            .field("addr", &self.channel.addr())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl GrpcNodeLeases {
    /// A client of the leases service at `addr` (`host:port`).
    pub(crate) fn new(
        addr: &str,
        credentials: TlsCredentials,
        timeout: Duration,
    ) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self { channel: FollowingChannel::new(addr, credentials)?, timeout })
    }

    fn client(&self) -> NodeLeasesClient<Channel> {
        NodeLeasesClient::new(self.channel.channel())
    }

    /// Runs one unary call under the timeout.
    async fn call<T, F>(&self, request: F) -> Result<T, tonic::Status>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(result) => result.map(tonic::Response::into_inner),
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "leases at {} did not answer within {:?}",
                self.channel.addr(),
                self.timeout
            ))),
        }
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }
}

#[async_trait::async_trait]
impl NodeLeasesApi for GrpcNodeLeases {
    async fn watch_assignments(&self, node_id: &str, resume_cursor: u64) -> Result<AssignmentStream, tonic::Status> {
        let request = WatchAssignmentsRequest { node_id: node_id.to_string(), resume_cursor };
        // The stream lives as long as the node's session: no deadline on
        // it, only on opening it.
        let stream = self.call(self.client().watch_assignments(request)).await?;
        Ok(Box::pin(stream))
    }

    async fn report_phase(&self, request: ReportPhaseRequest) -> Result<Lease, tonic::Status> {
        let response = self.call(self.client().report_phase(self.request(request))).await?;
        response
            .lease
            .ok_or_else(|| tonic::Status::internal("the leases service answered ReportPhase without the lease"))
    }

    async fn renew_leases(&self, request: RenewLeasesRequest) -> Result<RenewLeasesResponse, tonic::Status> {
        self.call(self.client().renew_leases(self.request(request))).await
    }

    async fn reconcile_node(&self, request: ReconcileNodeRequest) -> Result<ReconcileNodeResponse, tonic::Status> {
        self.call(self.client().reconcile_node(self.request(request))).await
    }

    async fn assume_custody(&self, request: AssumeCustodyRequest) -> Result<Lease, tonic::Status> {
        let response = self.call(self.client().assume_custody(self.request(request))).await?;
        response
            .lease
            .ok_or_else(|| tonic::Status::internal("the leases service answered AssumeCustody without the lease"))
    }

    fn reconnect(&self) {
        self.channel.reconnect();
    }
}
