//! The deploy reconciler's view of the leases service: ask for a lease,
//! list a service's leases, give one back, resize one in place; and one lease by id, to check
//! that a node asking for pull credentials holds it. [`LeaseClient`] is the seam;
//! [`GrpcLeases`] speaks `berth.leases.v1.Leases` over mTLS with this
//! service's certificate.
//!
//! # Observing phases
//! Lease phases are followed through one `WatchLeases` stream
//! ([`crate::lease_watch`]), resumed from its cursor when it breaks; a
//! reconcile that must fill a slot, or runs while the stream is not synced,
//! lists the service's leases (one `ListLeases` by owner) instead.

use std::fmt;

use berth_mtls::TlsCredentials;
use berth_proto::leases::v1;
use berth_rpc::Channel;
use tonic::Code;

/// Why a call to leases failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseCallError {
    /// No node has room for the lease; leases keeps no queue, so ask again later.
    #[error("no room: {0}")]
    NoRoom(String),
    /// Leases could not be reached or could not serve the call now.
    #[error("leases is unavailable: {0}")]
    Unavailable(String),
    /// Leases refused the call (a bug on one side, or a lease that is gone).
    #[error("leases refused the call ({code:?}): {message}")]
    Refused {
        /// The status code.
        code: Code,
        /// What leases said.
        message: String,
    },
}

impl From<tonic::Status> for LeaseCallError {
    fn from(status: tonic::Status) -> Self {
        let message = status.message().to_owned();
        match status.code() {
            Code::ResourceExhausted => Self::NoRoom(message),
            Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Unknown | Code::Cancelled => {
                Self::Unavailable(message)
            }
            code => Self::Refused { code, message },
        }
    }
}

/// The events of a `WatchLeases` stream.
pub type LeaseEvents = tonic::codegen::BoxStream<v1::LeaseEvent>;

/// What the deploy reconciler asks of the leases service.
#[tonic::async_trait]
pub trait LeaseClient: fmt::Debug + Send + Sync + 'static {
    /// Asks for a lease; idempotent on the request's key.
    async fn request(&self, request: v1::RequestLeaseRequest) -> Result<v1::Lease, LeaseCallError>;
    /// Every lease of `owner` in `project`, open or recently final.
    async fn list(&self, project: &str, owner: &str) -> Result<Vec<v1::Lease>, LeaseCallError>;
    /// One lease by id; `None` when leases knows none by that id (never
    /// existed, or forgotten after its retention).
    async fn get(&self, lease_id: &str) -> Result<Option<v1::Lease>, LeaseCallError>;
    /// Follows every lease, in every project, whose owner starts with
    /// `owner_prefix` (`WatchLeases`), resumed from `resume_cursor` (0:
    /// afresh): the open set or what changed since, `SYNCED`, then each change.
    /// A client that cannot follow says so, and the reconciler polls alone.
    async fn watch(&self, owner_prefix: &str, resume_cursor: u64) -> Result<LeaseEvents, LeaseCallError> {
        let _ = (owner_prefix, resume_cursor);
        Err(LeaseCallError::Unavailable("this leases client cannot follow leases".to_owned()))
    }
    /// Gives a lease back with `reason`; a lease already final stays as it is.
    async fn release(&self, lease_id: &str, reason: &str) -> Result<(), LeaseCallError>;
    /// Asks for the lease, held at `epoch`, to be resized to `resources`
    /// (`ResizeLease`): the lease as it is after the ask, its resize
    /// pending until its node applies it. `NoRoom` when its node cannot fit it.
    async fn resize(
        &self,
        lease_id: &str,
        epoch: u64,
        resources: berth_proto::types::v1::Capacity,
    ) -> Result<v1::Lease, LeaseCallError>;
}

/// The leases service over gRPC.
#[derive(Debug, Clone)]
pub struct GrpcLeases {
    client: v1::leases_client::LeasesClient<Channel>,
}

impl GrpcLeases {
    /// A client of the leases service at `addr` (`host:port`), dialling with
    /// `credentials` (this service's certificate).
    pub fn connect(addr: &str, credentials: TlsCredentials) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self { client: v1::leases_client::LeasesClient::new(berth_rpc::connect(addr, credentials)?) })
    }
}

#[tonic::async_trait]
impl LeaseClient for GrpcLeases {
    async fn request(&self, request: v1::RequestLeaseRequest) -> Result<v1::Lease, LeaseCallError> {
        let response = self.client.clone().request_lease(request).await?.into_inner();
        response.lease.ok_or_else(|| LeaseCallError::Refused {
            code: Code::Internal,
            message: "leases answered without the lease".to_owned(),
        })
    }

    async fn list(&self, project: &str, owner: &str) -> Result<Vec<v1::Lease>, LeaseCallError> {
        let request =
            v1::ListLeasesRequest { project: project.to_owned(), owner: owner.to_owned(), ..Default::default() };
        Ok(self.client.clone().list_leases(request).await?.into_inner().leases)
    }

    async fn get(&self, lease_id: &str) -> Result<Option<v1::Lease>, LeaseCallError> {
        let request = v1::GetLeaseRequest { lease_id: lease_id.to_owned() };
        match self.client.clone().get_lease(request).await {
            Ok(response) => Ok(response.into_inner().lease),
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(status.into()),
        }
    }

    async fn watch(&self, owner_prefix: &str, resume_cursor: u64) -> Result<LeaseEvents, LeaseCallError> {
        let request = v1::WatchLeasesRequest {
            all_projects: true,
            owner_prefix: owner_prefix.to_owned(),
            resume_cursor,
            ..Default::default()
        };
        let stream = self.client.clone().watch_leases(request).await?.into_inner();
        Ok(Box::pin(stream))
    }

    async fn release(&self, lease_id: &str, reason: &str) -> Result<(), LeaseCallError> {
        let request = v1::ReleaseLeaseRequest { lease_id: lease_id.to_owned(), reason: reason.to_owned() };
        match self.client.clone().release_lease(request).await {
            Ok(_) => Ok(()),
            // Forgotten after its retention: nothing left to release.
            Err(status) if status.code() == Code::NotFound => Ok(()),
            Err(status) => Err(status.into()),
        }
    }

    async fn resize(
        &self,
        lease_id: &str,
        epoch: u64,
        resources: berth_proto::types::v1::Capacity,
    ) -> Result<v1::Lease, LeaseCallError> {
        let request = v1::ResizeLeaseRequest { lease_id: lease_id.to_owned(), epoch, resources: Some(resources) };
        let response = self.client.clone().resize_lease(request).await?.into_inner();
        response.lease.ok_or_else(|| LeaseCallError::Refused {
            code: Code::Internal,
            message: "leases answered without the lease".to_owned(),
        })
    }
}

/// Stands in where no leases address was configured: every call fails,
/// naming the missing flag, so the service's status says why nothing runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoLeases;

const NOT_CONFIGURED: &str = "no leases address is configured (--leases-addr, BERTH_LEASES_ADDR)";

#[tonic::async_trait]
impl LeaseClient for NoLeases {
    async fn request(&self, _request: v1::RequestLeaseRequest) -> Result<v1::Lease, LeaseCallError> {
        Err(LeaseCallError::Unavailable(NOT_CONFIGURED.to_owned()))
    }

    async fn list(&self, _project: &str, _owner: &str) -> Result<Vec<v1::Lease>, LeaseCallError> {
        Err(LeaseCallError::Unavailable(NOT_CONFIGURED.to_owned()))
    }

    async fn get(&self, _lease_id: &str) -> Result<Option<v1::Lease>, LeaseCallError> {
        Err(LeaseCallError::Unavailable(NOT_CONFIGURED.to_owned()))
    }

    async fn release(&self, _lease_id: &str, _reason: &str) -> Result<(), LeaseCallError> {
        Err(LeaseCallError::Unavailable(NOT_CONFIGURED.to_owned()))
    }

    async fn resize(
        &self,
        _lease_id: &str,
        _epoch: u64,
        _resources: berth_proto::types::v1::Capacity,
    ) -> Result<v1::Lease, LeaseCallError> {
        Err(LeaseCallError::Unavailable(NOT_CONFIGURED.to_owned()))
    }
}
