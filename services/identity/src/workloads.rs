//! `Workloads`: X.509-SVIDs for the workloads of open leases.
//!
//! A node makes each workload's key and asks here for its certificate:
//! first against a single-use launch registration it took from leases for
//! that lease and epoch (`NodeLeases/RegisterLaunch`), which leases spends
//! for the signing, then, for renewals, while leases still holds the lease
//! open on that node at that epoch. Identity asks leases every time: the
//! ledger is the only judge of whether a lease is open where and when the
//! node says.
//!
//! # Invariants
//! - Every SVID is signed by the workload authority ([`Purpose::Workload`]),
//!   whose root no berth endpoint trusts for the mesh, and names its lease by
//!   a SPIFFE ID only (no DNS name), built here from what leases answered,
//!   never from the request.
//! - A first certificate needs a registration leases spent for this call:
//!   a replay is refused by leases and logged here with the lease and node.
//! - A renewal needs the lease open on the caller at the epoch it names, so a
//!   released, expired or moved lease's credential is never renewed.
//!
//! [`Purpose::Workload`]: crate::authority::Purpose::Workload

use std::sync::Arc;
use std::time::Duration;

use berth_core::WorkloadId;
use berth_mtls::{IssuedCertificate, TlsCredentials};
use berth_proto::identity::v1;
use berth_proto::leases::v1 as leases;
use berth_rpc::Channel;
use tonic::{Code, Request, Response, Status};

use crate::IdentityService;

/// How long a workload certificate lives unless configured otherwise.
pub const DEFAULT_WORKLOAD_CERT_TTL: Duration = Duration::from_secs(15 * 60);

/// How long a JWT-SVID lives: the most the SPIFFE profile's short-lived
/// tokens should, since nothing revokes one.
pub(crate) const WORKLOAD_JWT_TTL: Duration = Duration::from_secs(5 * 60);

/// The JWK set of `bundle_pem`.
fn jwks(bundle_pem: &str) -> Result<String, Status> {
    berth_mtls::jwks(bundle_pem)
        .map_err(|e| Status::internal(format!("cannot publish the workload bundle's keys: {e}")))
}

/// The shortest and longest lifetime a workload certificate may be given.
pub const WORKLOAD_CERT_TTL_RANGE: (Duration, Duration) = (Duration::from_secs(60), Duration::from_secs(24 * 3600));

/// The project leases records for a lease asked for without one.
const DEFAULT_PROJECT: &str = "default";

/// What identity asks leases about a workload's lease.
#[tonic::async_trait]
pub trait LaunchLedger: Send + Sync + std::fmt::Debug {
    /// Spends `registration` for `node_id`: the lease it was taken for, open
    /// on that node at its epoch, or why not.
    async fn redeem(&self, registration: &str, node_id: &str) -> Result<leases::Lease, Status>;
    /// The lease `lease_id` as the ledger holds it now.
    async fn lease(&self, lease_id: &str) -> Result<leases::Lease, Status>;
}

/// [`LaunchLedger`] over the leases service's gRPC API.
#[derive(Debug, Clone)]
pub struct GrpcLaunchLedger {
    client: leases::leases_client::LeasesClient<Channel>,
}

impl GrpcLaunchLedger {
    /// A client of the leases service at `addr` (`host:port`), dialling with
    /// `credentials` (identity's own certificate).
    pub fn connect(addr: &str, credentials: TlsCredentials) -> Result<Self, berth_rpc::ClientError> {
        Ok(Self { client: leases::leases_client::LeasesClient::new(berth_rpc::connect(addr, credentials)?) })
    }
}

#[tonic::async_trait]
impl LaunchLedger for GrpcLaunchLedger {
    async fn redeem(&self, registration: &str, node_id: &str) -> Result<leases::Lease, Status> {
        let request = leases::RedeemLaunchRegistrationRequest {
            registration: registration.to_owned(),
            node_id: node_id.to_owned(),
        };
        let response = self.client.clone().redeem_launch_registration(request).await.map_err(from_leases)?;
        response.into_inner().lease.ok_or_else(|| Status::internal("leases answered without the lease"))
    }

    async fn lease(&self, lease_id: &str) -> Result<leases::Lease, Status> {
        let request = leases::GetLeaseRequest { lease_id: lease_id.to_owned() };
        let response = self.client.clone().get_lease(request).await.map_err(from_leases)?;
        response.into_inner().lease.ok_or_else(|| Status::internal("leases answered without the lease"))
    }
}

/// A refusal of leases' passes through as it is; a failure to reach it, or
/// an answer identity should never get, is identity's caller's
/// `UNAVAILABLE`, naming leases.
fn from_leases(status: Status) -> Status {
    match status.code() {
        Code::FailedPrecondition | Code::NotFound | Code::PermissionDenied | Code::InvalidArgument => status,
        _ => Status::unavailable(format!("identity cannot check the lease with leases: {}", status.message())),
    }
}

/// How identity signs workload certificates.
#[derive(Debug, Clone)]
pub struct WorkloadSettings {
    /// The SPIFFE trust domain every workload's ID is under.
    pub trust_domain: String,
    /// How long a workload certificate lives.
    pub cert_ttl: Duration,
    /// Leases, asked about every launch and renewal; none refuses them all.
    pub ledger: Option<Arc<dyn LaunchLedger>>,
}

impl Default for WorkloadSettings {
    fn default() -> Self {
        Self { trust_domain: berth_core::TRUST_DOMAIN.to_owned(), cert_ttl: DEFAULT_WORKLOAD_CERT_TTL, ledger: None }
    }
}

/// Checks a SPIFFE trust domain name: lowercase letters, digits, `.`, `-`
/// and `_`, at most 255 bytes.
pub fn parse_trust_domain(name: &str) -> Result<String, String> {
    if berth_core::is_trust_domain(name) {
        Ok(name.to_owned())
    } else {
        Err(format!("'{name}' is not a trust domain: use lowercase letters, digits, '.', '-' and '_'"))
    }
}

/// The SPIFFE ID of `lease`'s workload under `trust_domain`.
pub fn spiffe_id(trust_domain: &str, lease: &leases::Lease) -> Result<WorkloadId, Status> {
    let project = if lease.project.is_empty() { DEFAULT_PROJECT } else { lease.project.as_str() };
    let workload = lease.workload.as_ref();
    let service = workload.map(|w| w.service.as_str()).unwrap_or_default();
    let revision = workload.map(|w| w.revision.as_str()).unwrap_or_default();
    WorkloadId::new(trust_domain, project, service, revision, &lease.lease_id)
        .map_err(|e| Status::failed_precondition(format!("lease {} names no workload: {e}", lease.lease_id)))
}

impl IdentityService {
    fn launch_ledger(&self) -> Result<&Arc<dyn LaunchLedger>, Status> {
        self.workload_settings().ledger.as_ref().ok_or_else(|| {
            Status::failed_precondition(
                "identity was started without --leases-addr, so it cannot check a lease and signs no workload \
                 certificate",
            )
        })
    }

    /// The lease `lease_id` when it is open and placed on `node_id` at
    /// `epoch`: what a launched workload's credential is signed against.
    /// `refused` says what is not done otherwise.
    async fn launched_lease(
        &self,
        node_id: &str,
        lease_id: &str,
        epoch: u64,
        refused: &str,
    ) -> Result<leases::Lease, Status> {
        if lease_id.is_empty() {
            return Err(Status::invalid_argument("lease_id is required"));
        }
        let lease = self.launch_ledger()?.lease(lease_id).await?;
        if lease.node_id != node_id {
            return Err(Status::permission_denied(format!("lease {lease_id} is not placed on node {node_id}")));
        }
        if !lease.phase().is_open() {
            tracing::info!(%lease_id, %node_id, "refused: the lease is over");
            return Err(Status::failed_precondition(format!(
                "lease {lease_id} is {}, so its workload's {refused}",
                lease.phase().as_str_name()
            )));
        }
        if lease.epoch != epoch {
            return Err(Status::failed_precondition(format!(
                "lease {lease_id} is at epoch {}; epoch {epoch} is stale",
                lease.epoch
            )));
        }
        Ok(lease)
    }

    /// Signs `csr_pem` for `lease`'s workload.
    async fn sign_workload(
        &self,
        lease: &leases::Lease,
        csr_pem: &str,
    ) -> Result<v1::SignWorkloadCertificateResponse, Status> {
        let settings = self.workload_settings();
        let spiffe_id = spiffe_id(&settings.trust_domain, lease)?;
        let (cert, bundle_pem): (IssuedCertificate, String) =
            self.workload_authority().sign_svid(csr_pem, &spiffe_id, settings.cert_ttl).await?;
        let jwks_json = jwks(&bundle_pem)?;
        Ok(v1::SignWorkloadCertificateResponse {
            spiffe_id: spiffe_id.uri().to_owned(),
            certificate_pem: cert.cert_pem,
            bundle_pem,
            not_before: Some(prost_types::Timestamp { seconds: cert.not_before, nanos: 0 }),
            not_after: Some(prost_types::Timestamp { seconds: cert.not_after, nanos: 0 }),
            lease_id: lease.lease_id.clone(),
            epoch: lease.epoch,
            jwks_json,
        })
    }
}

#[tonic::async_trait]
impl v1::workloads_server::Workloads for IdentityService {
    async fn sign_workload_certificate(
        &self,
        request: Request<v1::SignWorkloadCertificateRequest>,
    ) -> Result<Response<v1::SignWorkloadCertificateResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let request = request.into_inner();
        if request.registration.is_empty() {
            return Err(Status::invalid_argument("registration is required: take one with NodeLeases/RegisterLaunch"));
        }
        let lease = self.launch_ledger()?.redeem(&request.registration, &node_id).await.inspect_err(|status| {
            tracing::warn!(%node_id, code = ?status.code(), reason = status.message(), "launch registration refused");
        })?;
        let signed = self.sign_workload(&lease, &request.csr_pem).await?;
        tracing::info!(lease_id = %lease.lease_id, epoch = lease.epoch, %node_id, spiffe_id = %signed.spiffe_id,
            "signed a workload's first certificate");
        Ok(Response::new(signed))
    }

    async fn renew_workload_certificate(
        &self,
        request: Request<v1::RenewWorkloadCertificateRequest>,
    ) -> Result<Response<v1::SignWorkloadCertificateResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let request = request.into_inner();
        let lease =
            self.launched_lease(&node_id, &request.lease_id, request.epoch, "certificate is not renewed").await?;
        Ok(Response::new(self.sign_workload(&lease, &request.csr_pem).await?))
    }

    async fn sign_workload_jwt(
        &self,
        request: Request<v1::SignWorkloadJwtRequest>,
    ) -> Result<Response<v1::SignWorkloadJwtResponse>, Status> {
        let node_id = request.get_ref().node_id.clone();
        berth_rpc::require_own_node(&request, &node_id)?;
        let request = request.into_inner();
        if request.audience.is_empty() || request.audience.iter().any(|a| a.trim().is_empty()) {
            return Err(Status::invalid_argument("audience: at least one, and no empty one, is required"));
        }
        let lease = self.launched_lease(&node_id, &request.lease_id, request.epoch, "JWT-SVID is not signed").await?;
        let spiffe_id = spiffe_id(&self.workload_settings().trust_domain, &lease)?;
        let (token, claims, jwks_json) =
            self.workload_authority().sign_jwt_svid(spiffe_id.uri(), &request.audience, WORKLOAD_JWT_TTL).await?;
        Ok(Response::new(v1::SignWorkloadJwtResponse {
            spiffe_id: spiffe_id.uri().to_owned(),
            token,
            expires_at: Some(prost_types::Timestamp { seconds: claims.exp, nanos: 0 }),
            jwks_json,
        }))
    }

    async fn get_workload_bundle(
        &self,
        _request: Request<v1::GetWorkloadBundleRequest>,
    ) -> Result<Response<v1::GetWorkloadBundleResponse>, Status> {
        let bundle_pem = self.workload_authority().bundle_pem().await?;
        Ok(Response::new(v1::GetWorkloadBundleResponse {
            jwks_json: jwks(&bundle_pem)?,
            bundle_pem,
            trust_domain: self.workload_settings().trust_domain.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(project: &str, service: &str, revision: &str) -> leases::Lease {
        leases::Lease {
            lease_id: "l-7".into(),
            project: project.into(),
            workload: Some(leases::Workload {
                service: service.into(),
                revision: revision.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_spiffe_id_names_the_project_service_revision_and_lease_it_has() {
        let td = "example.org";
        let id = |lease| spiffe_id(td, &lease).unwrap().uri().to_owned();
        assert_eq!(
            id(lease("shop", "web", "web-00003")),
            "spiffe://example.org/ns/shop/svc/web/rev/web-00003/lease/l-7"
        );
        assert_eq!(id(lease("", "", "")), "spiffe://example.org/ns/default/lease/l-7");
        assert_eq!(id(lease("shop", "web", "")), "spiffe://example.org/ns/shop/svc/web/lease/l-7");
    }

    #[test]
    fn trust_domains_are_lowercase_names() {
        assert_eq!(parse_trust_domain("prod.example.org").unwrap(), "prod.example.org");
        for bad in ["", "Prod", "a/b", "spiffe://x", &"a".repeat(256)] {
            assert!(parse_trust_domain(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_refusal_of_leases_passes_and_anything_else_is_unavailable() {
        assert_eq!(from_leases(Status::failed_precondition("spent")).code(), Code::FailedPrecondition);
        let down = from_leases(Status::unavailable("connection refused"));
        assert_eq!(down.code(), Code::Unavailable);
        assert!(down.message().contains("leases"), "{}", down.message());
        assert_eq!(from_leases(Status::internal("bug")).code(), Code::Unavailable);
    }
}
