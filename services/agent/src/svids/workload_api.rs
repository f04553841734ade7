//! The SPIFFE Workload API one workload reaches on its own socket
//! (`$SPIFFE_ENDPOINT_SOCKET`), so standard SPIFFE clients fetch its
//! X.509-SVID and trust bundle, and every renewal, unchanged.
//!
//! # Invariants
//! - One socket per workload, in its own identity directory: who may
//!   connect is who may enter that directory (the workload's own user), so
//!   the API never has to tell callers apart and answers only with that
//!   workload's credential.
//! - Every request carries the metadata `workload.spiffe.io: true`, as the
//!   standard requires (INVALID_ARGUMENT otherwise), so a browser or a
//!   proxy tricked into a request cannot read a credential.
//! - The streams send the credential at once and again on every renewal.

use std::path::Path;
use std::sync::Arc;

use berth_proto::spiffe_workload as api;
use berth_proto::spiffe_workload::spiffe_workload_api_server::{SpiffeWorkloadApi, SpiffeWorkloadApiServer};
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::Svid;

/// The metadata every Workload API request carries.
const SECURITY_HEADER: &str = "workload.spiffe.io";

/// A stream of answers, as tonic serves it.
type Answers<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

/// Listens on `socket` (replacing a socket left there) and serves the
/// credential `current` holds until `stop`; the returned task ends with it.
pub(crate) async fn serve(
    socket: &Path,
    current: watch::Receiver<Arc<Svid>>,
    stop: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let listener = tokio::net::UnixListener::bind(socket)?;
    {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
        // The socket belongs to whoever owns the directory: the workload.
        let owner = std::fs::metadata(socket.parent().unwrap_or(Path::new("/")))?;
        std::os::unix::fs::lchown(socket, Some(owner.uid()), Some(owner.gid()))?;
    }
    let service = SpiffeWorkloadApiServer::new(WorkloadApi { current });
    let incoming = UnixListenerStream::new(listener);
    let socket = socket.to_path_buf();
    Ok(tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
            .await;
        if let Err(error) = served {
            tracing::warn!(socket = %socket.display(), %error, "the Workload API stopped");
        }
    }))
}

/// One workload's Workload API.
#[derive(Debug)]
struct WorkloadApi {
    current: watch::Receiver<Arc<Svid>>,
}

/// Refuses a request without the Workload API's security header.
fn check<T>(request: &Request<T>) -> Result<(), Status> {
    match request.metadata().get(SECURITY_HEADER).map(|value| value.to_str()) {
        Some(Ok("true")) => Ok(()),
        _ => Err(Status::invalid_argument(format!("security header missing from request: {SECURITY_HEADER}: true"))),
    }
}

/// Every certificate in `pem`, DER, one after the other, as the API sends
/// chains and bundles.
fn der_chain(what: &'static str, pem: &str) -> Result<Vec<u8>, Status> {
    let certs = berth_mtls::certs_from_pem(what, pem).map_err(|e| Status::unavailable(e.to_string()))?;
    Ok(certs.iter().flat_map(|cert| cert.as_ref().iter().copied()).collect())
}

fn x509_svid(svid: &Svid) -> Result<api::X509svidResponse, Status> {
    let key = berth_mtls::private_key_der(&svid.key_pem).map_err(|e| Status::unavailable(e.to_string()))?;
    Ok(api::X509svidResponse {
        svids: vec![api::X509svid {
            spiffe_id: svid.spiffe_id.clone(),
            x509_svid: der_chain("workload certificate", &svid.cert_pem)?,
            x509_svid_key: key,
            bundle: der_chain("workload bundle", &svid.bundle_pem)?,
            hint: String::new(),
        }],
        ..Default::default()
    })
}

fn x509_bundles(svid: &Svid) -> Result<api::X509BundlesResponse, Status> {
    Ok(api::X509BundlesResponse {
        crl: Vec::new(),
        bundles: [(svid.trust_domain(), der_chain("workload bundle", &svid.bundle_pem)?)].into(),
    })
}

impl WorkloadApi {
    /// `answer` of the credential now and after every renewal.
    fn follow<T: Send + 'static>(&self, answer: fn(&Svid) -> Result<T, Status>) -> Answers<T> {
        Box::pin(WatchStream::new(self.current.clone()).map(move |svid| answer(&svid)))
    }
}

#[tonic::async_trait]
impl SpiffeWorkloadApi for WorkloadApi {
    type FetchX509SVIDStream = Answers<api::X509svidResponse>;
    type FetchX509BundlesStream = Answers<api::X509BundlesResponse>;
    type FetchJWTBundlesStream = Answers<api::JwtBundlesResponse>;

    async fn fetch_x509svid(
        &self,
        request: Request<api::X509svidRequest>,
    ) -> Result<Response<Self::FetchX509SVIDStream>, Status> {
        check(&request)?;
        Ok(Response::new(self.follow(x509_svid)))
    }

    async fn fetch_x509_bundles(
        &self,
        request: Request<api::X509BundlesRequest>,
    ) -> Result<Response<Self::FetchX509BundlesStream>, Status> {
        check(&request)?;
        Ok(Response::new(self.follow(x509_bundles)))
    }

    async fn fetch_jwtsvid(
        &self,
        request: Request<api::JwtsvidRequest>,
    ) -> Result<Response<api::JwtsvidResponse>, Status> {
        check(&request)?;
        Err(Status::unimplemented("this node hands out X.509-SVIDs only"))
    }

    async fn fetch_jwt_bundles(
        &self,
        request: Request<api::JwtBundlesRequest>,
    ) -> Result<Response<Self::FetchJWTBundlesStream>, Status> {
        check(&request)?;
        Err(Status::unimplemented("this node hands out X.509-SVIDs only"))
    }

    async fn validate_jwtsvid(
        &self,
        request: Request<api::ValidateJwtsvidRequest>,
    ) -> Result<Response<api::ValidateJwtsvidResponse>, Status> {
        check(&request)?;
        Err(Status::unimplemented("this node hands out X.509-SVIDs only"))
    }
}
