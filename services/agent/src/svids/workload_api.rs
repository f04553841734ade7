//! The SPIFFE Workload API one workload reaches on its own socket
//! (`$SPIFFE_ENDPOINT_SOCKET`), so standard SPIFFE clients fetch its
//! X.509-SVID and trust bundle, and every renewal, and JWT-SVIDs for the
//! audiences they name, unchanged.
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
//! - A JWT-SVID is signed by identity for the lease at the epoch the node
//!   holds it, when asked: a lease that is over gets none. Tokens are
//!   validated here, against the JWK set the workload's bundle carries.

use std::path::Path;
use std::sync::Arc;

use berth_proto::spiffe_workload as api;
use berth_proto::spiffe_workload::spiffe_workload_api_server::{SpiffeWorkloadApi, SpiffeWorkloadApiServer};
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use berth_proto::identity::v1::{SignWorkloadJwtRequest, SignWorkloadJwtResponse};

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
    signer: JwtSigner,
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
    let service = SpiffeWorkloadApiServer::new(WorkloadApi { current, signer });
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
    signer: JwtSigner,
}

/// How the Workload API has a JWT-SVID signed: by identity, for the lease
/// as the node holds it now.
#[derive(Debug, Clone)]
pub(crate) struct JwtSigner {
    pub(crate) api: Arc<dyn super::WorkloadsApi>,
    pub(crate) lease: super::LeaseWatch,
}

impl JwtSigner {
    async fn sign(&self, audience: Vec<String>) -> Result<SignWorkloadJwtResponse, Status> {
        let Some(node_id) = self.lease.node.borrow().clone() else {
            return Err(Status::unavailable("the node is reconnecting to the control plane; try again"));
        };
        let request = SignWorkloadJwtRequest {
            node_id,
            lease_id: self.lease.lease_id.clone(),
            epoch: *self.lease.epoch.borrow(),
            audience,
        };
        self.api.sign_jwt(request).await.map_err(|status| {
            if crate::leases_client::is_transient(&status) {
                Status::unavailable(format!("identity cannot sign a JWT-SVID now: {}", status.message()))
            } else {
                Status::permission_denied(format!("no JWT-SVID for this workload: {}", status.message()))
            }
        })
    }
}

/// A JSON value as a protobuf `Value`, for the claims of a validated token.
fn proto_value(value: serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(items) => {
            Kind::ListValue(prost_types::ListValue { values: items.into_iter().map(proto_value).collect() })
        }
        serde_json::Value::Object(fields) => Kind::StructValue(proto_struct(fields)),
    };
    prost_types::Value { kind: Some(kind) }
}

fn proto_struct(fields: serde_json::Map<String, serde_json::Value>) -> prost_types::Struct {
    prost_types::Struct { fields: fields.into_iter().map(|(name, value)| (name, proto_value(value))).collect() }
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

fn jwt_bundles(svid: &Svid) -> Result<api::JwtBundlesResponse, Status> {
    if svid.jwks_json.is_empty() {
        return Err(Status::unavailable("the node holds no JWT bundle for this workload yet"));
    }
    Ok(api::JwtBundlesResponse { bundles: [(svid.trust_domain(), svid.jwks_json.clone().into_bytes())].into() })
}

fn x509_bundles(svid: &Svid) -> Result<api::X509BundlesResponse, Status> {
    Ok(api::X509BundlesResponse {
        crl: Vec::new(),
        bundles: [(svid.trust_domain(), der_chain("workload bundle", &svid.bundle_pem)?)].into(),
    })
}

impl WorkloadApi {
    /// For a request that carries the security header, `answer` of the
    /// credential now and after every renewal.
    fn follow<T: Send + 'static, R>(
        &self,
        request: &Request<R>,
        answer: fn(&Svid) -> Result<T, Status>,
    ) -> Result<Response<Answers<T>>, Status> {
        check(request)?;
        Ok(Response::new(Box::pin(WatchStream::new(self.current.clone()).map(move |svid| answer(&svid)))))
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
        self.follow(&request, x509_svid)
    }

    async fn fetch_x509_bundles(
        &self,
        request: Request<api::X509BundlesRequest>,
    ) -> Result<Response<Self::FetchX509BundlesStream>, Status> {
        self.follow(&request, x509_bundles)
    }

    async fn fetch_jwtsvid(
        &self,
        request: Request<api::JwtsvidRequest>,
    ) -> Result<Response<api::JwtsvidResponse>, Status> {
        check(&request)?;
        let request = request.into_inner();
        if request.audience.is_empty() || request.audience.iter().any(|a| a.is_empty()) {
            return Err(Status::invalid_argument("audience must be specified"));
        }
        let own = self.current.borrow().spiffe_id.clone();
        if !request.spiffe_id.is_empty() && request.spiffe_id != own {
            return Err(Status::permission_denied(format!("this workload is {own}, not {}", request.spiffe_id)));
        }
        let signed = self.signer.sign(request.audience).await?;
        Ok(Response::new(api::JwtsvidResponse {
            svids: vec![api::Jwtsvid { spiffe_id: signed.spiffe_id, svid: signed.token, hint: String::new() }],
        }))
    }

    async fn fetch_jwt_bundles(
        &self,
        request: Request<api::JwtBundlesRequest>,
    ) -> Result<Response<Self::FetchJWTBundlesStream>, Status> {
        self.follow(&request, jwt_bundles)
    }

    async fn validate_jwtsvid(
        &self,
        request: Request<api::ValidateJwtsvidRequest>,
    ) -> Result<Response<api::ValidateJwtsvidResponse>, Status> {
        check(&request)?;
        let request = request.into_inner();
        if request.audience.is_empty() {
            return Err(Status::invalid_argument("audience must be specified"));
        }
        if request.svid.is_empty() {
            return Err(Status::invalid_argument("svid must be specified"));
        }
        let jwks = self.current.borrow().jwks_json.clone();
        let claims = berth_mtls::verify_jwt_svid(&request.svid, &jwks, &request.audience)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let fields = match serde_json::to_value(&claims) {
            Ok(serde_json::Value::Object(fields)) => fields,
            _ => serde_json::Map::new(),
        };
        Ok(Response::new(api::ValidateJwtsvidResponse { spiffe_id: claims.sub, claims: Some(proto_struct(fields)) }))
    }
}
