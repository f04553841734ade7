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
    AssignmentEvent, AssumeCustodyRequest, CommitCacheRequest, CommitCacheResponse, FollowCachesRequest,
    FollowCachesResponse, Lease, OpenCacheRequest, OpenCacheResponse, ReconcileNodeRequest, ReconcileNodeResponse,
    RenewLeasesRequest, RenewLeasesResponse, ReportPhaseRequest, ReportResizeRequest, WatchAssignmentsRequest,
    node_leases_client::NodeLeasesClient,
};
use berth_rpc::Channel;
use tokio_stream::Stream;

use crate::node_channel::NodeChannel;

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
    /// Reports how the node dealt with a lease's pending resize; returns the
    /// lease as it is now.
    async fn report_resize(&self, request: ReportResizeRequest) -> Result<Lease, tonic::Status>;
    /// Opens one of a lease's cache volumes: the head its view starts from.
    async fn open_cache(&self, request: OpenCacheRequest) -> Result<OpenCacheResponse, tonic::Status>;
    /// Publishes a lease's sealed view of a volume, or records why not.
    async fn commit_cache(&self, request: CommitCacheRequest) -> Result<CommitCacheResponse, tonic::Status>;
    /// Reports the cache generations the node holds; answers the heads it
    /// is asked to hold too.
    async fn follow_caches(&self, request: FollowCachesRequest) -> Result<FollowCachesResponse, tonic::Status>;
    /// Drops the open connection, so the next call presents the node's
    /// current certificate (after a rejoin the node id in it changes).
    fn reconnect(&self);
}

/// Whether a call that failed with `status` may succeed if tried again.
pub(crate) fn is_transient(status: &tonic::Status) -> bool {
    crate::rpc_status::is_transient_code(status.code())
}

/// The leases service over mTLS gRPC, presenting the node certificate.
#[derive(Debug)]
pub(crate) struct GrpcNodeLeases {
    channel: NodeChannel,
}

impl GrpcNodeLeases {
    /// A client of the leases service at `addr` (`host:port`).
    pub(crate) fn new(
        addr: &str,
        credentials: TlsCredentials,
        timeout: Duration,
    ) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self { channel: NodeChannel::new("leases", addr, credentials, timeout)? })
    }

    fn client(&self) -> NodeLeasesClient<Channel> {
        NodeLeasesClient::new(self.channel.channel())
    }
}

#[async_trait::async_trait]
impl NodeLeasesApi for GrpcNodeLeases {
    async fn watch_assignments(&self, node_id: &str, resume_cursor: u64) -> Result<AssignmentStream, tonic::Status> {
        let request = WatchAssignmentsRequest { node_id: node_id.to_string(), resume_cursor };
        // The stream lives as long as the node's session: no deadline on
        // it, only on opening it.
        let stream = self.channel.call(self.client().watch_assignments(request)).await?;
        Ok(Box::pin(stream))
    }

    async fn report_phase(&self, request: ReportPhaseRequest) -> Result<Lease, tonic::Status> {
        let response = self.channel.call(self.client().report_phase(self.channel.request(request))).await?;
        response
            .lease
            .ok_or_else(|| tonic::Status::internal("the leases service answered ReportPhase without the lease"))
    }

    async fn renew_leases(&self, request: RenewLeasesRequest) -> Result<RenewLeasesResponse, tonic::Status> {
        self.channel.call(self.client().renew_leases(self.channel.request(request))).await
    }

    async fn reconcile_node(&self, request: ReconcileNodeRequest) -> Result<ReconcileNodeResponse, tonic::Status> {
        self.channel.call(self.client().reconcile_node(self.channel.request(request))).await
    }

    async fn assume_custody(&self, request: AssumeCustodyRequest) -> Result<Lease, tonic::Status> {
        let response = self.channel.call(self.client().assume_custody(self.channel.request(request))).await?;
        response
            .lease
            .ok_or_else(|| tonic::Status::internal("the leases service answered AssumeCustody without the lease"))
    }

    async fn report_resize(&self, request: ReportResizeRequest) -> Result<Lease, tonic::Status> {
        let response = self.channel.call(self.client().report_resize(self.channel.request(request))).await?;
        response
            .lease
            .ok_or_else(|| tonic::Status::internal("the leases service answered ReportResize without the lease"))
    }

    async fn open_cache(&self, request: OpenCacheRequest) -> Result<OpenCacheResponse, tonic::Status> {
        self.channel.call(self.client().open_cache(self.channel.request(request))).await
    }

    async fn commit_cache(&self, request: CommitCacheRequest) -> Result<CommitCacheResponse, tonic::Status> {
        self.channel.call(self.client().commit_cache(self.channel.request(request))).await
    }

    async fn follow_caches(&self, request: FollowCachesRequest) -> Result<FollowCachesResponse, tonic::Status> {
        self.channel.call(self.client().follow_caches(self.channel.request(request))).await
    }

    fn reconnect(&self) {
        self.channel.reconnect();
    }
}
