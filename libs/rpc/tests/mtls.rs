//! The mTLS listener and access layer as a client sees them: who gets in,
//! with which status, and whether a rotated server certificate is served
//! without a restart.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use berth_core::{CallerKind, Identity};
use berth_mtls::{CertificateAuthority, TlsCredentials, TlsMaterial, certs_from_pem, fingerprint};
use berth_proto::identity::v1::{CreateJoinTokenRequest, join_tokens_client::JoinTokensClient, join_tokens_server};
use berth_rpc::{AccessPolicy, Listener, Revocations, ServerBuilder};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

const TTL: Duration = Duration::from_secs(600);

fn material(ca: &CertificateAuthority, id: &Identity) -> TlsMaterial {
    let (cert, key) = ca.issue(id, &["localhost".into(), "127.0.0.1".into()], TTL).unwrap();
    TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem: key, ca_bundle_pem: ca.cert_pem().to_string() }
}

fn creds(ca: &CertificateAuthority, id: &Identity) -> TlsCredentials {
    TlsCredentials::new(material(ca, id)).unwrap()
}

/// A JoinTokens server whose RPCs are not built: the access layer decides,
/// then the stub answers UNIMPLEMENTED.
#[derive(Debug, Clone)]
struct Stub;

#[tonic::async_trait]
impl join_tokens_server::JoinTokens for Stub {}

struct Running {
    addr: SocketAddr,
    server_creds: TlsCredentials,
    revocations: Revocations,
    stop: CancellationToken,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Reflection is admin-only under this policy, so that an admin-only RPC
/// that does succeed can be called.
fn reflection_admin_only(path: &str) -> Option<&'static [CallerKind]> {
    if path.starts_with("/grpc.reflection.") { Some(&[CallerKind::Admin]) } else { berth_proto::access::allowed(path) }
}

async fn serve(ca: &CertificateAuthority) -> Running {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server_creds = creds(ca, &Identity::service("identity").unwrap());
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), server_creds.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let revocations = Revocations::new();
    let server = ServerBuilder::new()
        .with_policy(AccessPolicy::from_fn(reflection_admin_only))
        .with_revocations(revocations.clone())
        .add_service(join_tokens_server::JoinTokensServer::new(Stub));
    tokio::spawn(server.serve(listener, stop.clone()));
    Running { addr, server_creds, revocations, stop }
}

fn ca() -> CertificateAuthority {
    CertificateAuthority::generate("test CA", Duration::from_secs(3600)).unwrap()
}

async fn create_token(channel: berth_rpc::Channel) -> Result<(), tonic::Status> {
    JoinTokensClient::new(channel).create_join_token(CreateJoinTokenRequest::default()).await.map(|_| ())
}

async fn health(channel: berth_rpc::Channel) -> Result<i32, tonic::Status> {
    let resp = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await?;
    Ok(resp.into_inner().status)
}

/// A health watch on `channel`, once it said the server is serving: a
/// stream that stays open as long as the server does.
async fn health_watch(channel: &berth_rpc::Channel) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let mut stream = HealthClient::new(channel.clone())
        .watch(HealthCheckRequest { service: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().status, ServingStatus::Serving as i32);
    stream
}

/// Lists services through reflection v1, an RPC admitted to admins only here.
async fn reflection_list(channel: berth_rpc::Channel) -> Result<Vec<String>, tonic::Status> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream =
        ServerReflectionClient::new(channel).server_reflection_info(tokio_stream::iter(vec![req])).await?.into_inner();
    let msg = stream.message().await?.expect("one response");
    match msg.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => Ok(list.service.into_iter().map(|s| s.name).collect()),
        other => panic!("unexpected reflection response {other:?}"),
    }
}

#[tokio::test]
async fn admin_cert_is_admitted_to_admin_only_rpc() {
    let ca = ca();
    let server = serve(&ca).await;
    let admin = berth_rpc::connect(&server.addr.to_string(), creds(&ca, &Identity::admin("ops").unwrap())).unwrap();
    let services = reflection_list(admin.clone()).await.unwrap();
    assert!(services.contains(&"berth.identity.v1.JoinTokens".to_string()), "{services:?}");
    assert!(services.contains(&"grpc.health.v1.Health".to_string()), "{services:?}");
    // Past the access layer, the unbuilt RPC says so honestly.
    assert_eq!(create_token(admin).await.unwrap_err().code(), Code::Unimplemented);
}

#[tokio::test]
async fn node_cert_calling_admin_only_rpc_is_permission_denied() {
    let ca = ca();
    let server = serve(&ca).await;
    let node = berth_rpc::connect(&server.addr.to_string(), creds(&ca, &Identity::node("n1").unwrap())).unwrap();
    let status = create_token(node.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("node 'n1'"), "{}", status.message());
    assert_eq!(reflection_list(node).await.unwrap_err().code(), Code::PermissionDenied);
}

#[tokio::test]
async fn client_without_cert_is_unauthenticated_but_may_ask_health() {
    let ca = ca();
    let server = serve(&ca).await;
    let anon = berth_rpc::connect_anonymous(&server.addr.to_string(), ca.cert_pem()).unwrap();
    assert_eq!(create_token(anon.clone()).await.unwrap_err().code(), Code::Unauthenticated);
    assert_eq!(reflection_list(anon.clone()).await.unwrap_err().code(), Code::Unauthenticated);
    assert_eq!(health(anon).await.unwrap(), ServingStatus::Serving as i32);
}

#[tokio::test]
async fn cert_from_another_ca_is_refused_at_the_handshake() {
    let ca = ca();
    let server = serve(&ca).await;
    let rogue = CertificateAuthority::generate("rogue CA", Duration::from_secs(3600)).unwrap();
    // The rogue client trusts the real CA, so only its own certificate is wrong.
    let mut m = material(&rogue, &Identity::admin("ops").unwrap());
    m.ca_bundle_pem = ca.cert_pem().to_string();
    let client = berth_rpc::connect(&server.addr.to_string(), TlsCredentials::new(m).unwrap()).unwrap();
    let status = health(client).await.unwrap_err();
    // TLS 1.3 finishes the client's side first; the server's verdict comes
    // back as an alert on the first read.
    assert!(format!("{status:?}").contains("UnknownCA"), "{status:?}");
}

#[tokio::test]
async fn expired_cert_is_refused_at_the_handshake() {
    let ca = ca();
    let server = serve(&ca).await;
    let now = time::OffsetDateTime::now_utc();
    let (cert, key) = ca
        .issue_with_validity(
            &Identity::admin("ops").unwrap(),
            &[],
            now - time::Duration::hours(2),
            now - time::Duration::hours(1),
        )
        .unwrap();
    let m = TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem: key, ca_bundle_pem: ca.cert_pem().to_string() };
    let client = berth_rpc::connect(&server.addr.to_string(), TlsCredentials::new(m).unwrap()).unwrap();
    let status = health(client).await.unwrap_err();
    assert!(format!("{status:?}").contains("CertificateExpired"), "{status:?}");
}

#[tokio::test]
async fn a_connection_is_closed_once_its_clients_certificate_expired_and_cannot_come_back_with_it() {
    let ca = ca();
    let server = serve(&ca).await;
    let now = time::OffsetDateTime::now_utc();
    let not_after = now + time::Duration::seconds(3);
    let (cert, key) = ca
        .issue_with_validity(&Identity::admin("ops").unwrap(), &[], now - time::Duration::minutes(1), not_after)
        .unwrap();
    let m = TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem: key, ca_bundle_pem: ca.cert_pem().to_string() };
    let client = berth_rpc::connect(&server.addr.to_string(), TlsCredentials::new(m).unwrap()).unwrap();

    // A stream held open on the connection, as a watch or a heartbeat is.
    let mut watch = health_watch(&client).await;
    let held =
        tokio::time::timeout(Duration::from_secs(30), async { while let Ok(Some(_)) = watch.message().await {} }).await;
    assert!(held.is_ok(), "the connection outlived its client's certificate by 30 s");
    let ended = time::OffsetDateTime::now_utc();
    assert!(ended > not_after, "the stream ended at {ended}, before the certificate expired at {not_after}");

    // The same channel dials again, and the expired certificate is refused.
    let status = health(client).await.unwrap_err();
    assert!(format!("{status:?}").contains("CertificateExpired"), "{status:?}");
}

/// The certificate the server presents on a fresh handshake.
async fn served_fingerprint(addr: SocketAddr, ca: &CertificateAuthority) -> String {
    let config = berth_mtls::anonymous_client_config(ca.cert_pem()).unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::clone(&config)).connect(name, tcp).await.unwrap();
    fingerprint(&tls.get_ref().1.peer_certificates().unwrap()[0])
}

#[tokio::test]
async fn rotated_server_cert_is_served_on_the_next_handshake() {
    let ca = ca();
    let server = serve(&ca).await;
    let before = served_fingerprint(server.addr, &ca).await;
    let next = material(&ca, &Identity::service("identity").unwrap());
    let expected = fingerprint(&certs_from_pem("certificate", &next.cert_chain_pem).unwrap()[0]);
    assert_ne!(before, expected);
    server.server_creds.reload(next).unwrap();
    assert_eq!(served_fingerprint(server.addr, &ca).await, expected);

    // The server still serves mTLS clients after the swap.
    let admin = berth_rpc::connect(&server.addr.to_string(), creds(&ca, &Identity::admin("ops").unwrap())).unwrap();
    assert_eq!(health(admin).await.unwrap(), ServingStatus::Serving as i32);
}

#[tokio::test]
async fn revoked_node_is_refused_on_its_open_connection() {
    let ca = ca();
    let server = serve(&ca).await;
    let node = berth_rpc::connect(&server.addr.to_string(), creds(&ca, &Identity::node("n7").unwrap())).unwrap();
    let other = berth_rpc::connect(&server.addr.to_string(), creds(&ca, &Identity::node("n8").unwrap())).unwrap();
    assert_eq!(health(node.clone()).await.unwrap(), ServingStatus::Serving as i32);
    server.revocations.revoke("n7");
    let status = health(node).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("node 'n7' is revoked"), "{}", status.message());
    assert_eq!(health(other).await.unwrap(), ServingStatus::Serving as i32, "other nodes are unaffected");
}

const WORKLOAD: &str = "spiffe://berth.internal/ns/shop/svc/web/rev/web-00001/lease/l-1";

/// Credentials presenting an X.509-SVID for [`WORKLOAD`] signed by
/// `signer`, trusting `mesh` for the server.
fn svid_creds(signer: &CertificateAuthority, mesh: &CertificateAuthority) -> TlsCredentials {
    let (csr, key_pem) = berth_mtls::generate_csr("l-1").unwrap();
    let id = berth_core::WorkloadId::parse(WORKLOAD).unwrap();
    let cert = signer.sign_svid_csr(&csr, &id, TTL).unwrap();
    let material = TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem, ca_bundle_pem: mesh.cert_pem().to_string() };
    let creds = TlsCredentials::new(material).unwrap();
    assert_eq!(creds.identity(), Some(Identity::Workload(id)));
    creds
}

#[tokio::test]
async fn a_workload_svid_is_admitted_once_the_server_trusts_the_workload_bundle_and_only_as_a_workload() {
    let mesh = ca();
    let workloads = CertificateAuthority::generate("workload CA", Duration::from_secs(3600)).unwrap();
    let server = serve(&mesh).await;
    let dial = || berth_rpc::connect(&server.addr.to_string(), svid_creds(&workloads, &mesh)).unwrap();
    let status = health(dial()).await.unwrap_err();
    assert!(format!("{status:?}").contains("UnknownCA"), "no workload is trusted yet: {status:?}");

    server.server_creds.trust_workloads(Some(workloads.cert_pem().to_string())).unwrap();
    assert_eq!(health(dial()).await.unwrap(), ServingStatus::Serving as i32);
    let denied = create_token(dial()).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(denied.message().contains(&format!("workload '{WORKLOAD}' may not call")), "{}", denied.message());

    // The mesh CA's signature on an SVID, or the workload authority's on a
    // mesh identity, is worth nothing.
    let status = health(berth_rpc::connect(&server.addr.to_string(), svid_creds(&mesh, &mesh)).unwrap()).await;
    assert!(format!("{:?}", status.unwrap_err()).contains("UnknownCA"));
    let mut forged = material(&workloads, &Identity::admin("ops").unwrap());
    forged.ca_bundle_pem = mesh.cert_pem().to_string();
    let forged = berth_rpc::connect(&server.addr.to_string(), TlsCredentials::new(forged).unwrap()).unwrap();
    assert!(format!("{:?}", create_token(forged).await.unwrap_err()).contains("UnknownCA"));

    // Trust withdrawn: refused again from the next handshake.
    server.server_creds.trust_workloads(None).unwrap();
    assert!(format!("{:?}", health(dial()).await.unwrap_err()).contains("UnknownCA"));
}

/// Answers a join-token request with the name of the thread that served it.
#[derive(Debug, Clone)]
struct ThreadName;

#[tonic::async_trait]
impl join_tokens_server::JoinTokens for ThreadName {
    async fn create_join_token(
        &self,
        _request: tonic::Request<CreateJoinTokenRequest>,
    ) -> Result<tonic::Response<berth_proto::identity::v1::CreateJoinTokenResponse>, tonic::Status> {
        let name = std::thread::current().name().unwrap_or_default().to_string();
        Ok(tonic::Response::new(berth_proto::identity::v1::CreateJoinTokenResponse {
            token: name,
            ..Default::default()
        }))
    }
}

#[tokio::test]
async fn a_server_on_serving_threads_answers_each_connection_on_the_thread_it_was_dealt_and_admits_as_before() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = ca();
    let server_creds = creds(&ca, &Identity::service("identity").unwrap());
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), server_creds).await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let threads = berth_rpc::threads::ServingThreads::start("test-serve", 2).unwrap();
    let server = ServerBuilder::new()
        .with_serving_threads(threads)
        .add_service(join_tokens_server::JoinTokensServer::new(ThreadName));
    let serving = tokio::spawn(server.serve(listener, stop.clone()));

    // Each connection in turn goes to the next thread, and every call on it is answered there.
    let mut served = Vec::new();
    for _ in 0..4 {
        let admin = berth_rpc::connect(&addr, creds(&ca, &Identity::admin("ops").unwrap())).unwrap();
        let mut client = JoinTokensClient::new(admin);
        let first = client.create_join_token(CreateJoinTokenRequest::default()).await.unwrap().into_inner().token;
        let second = client.create_join_token(CreateJoinTokenRequest::default()).await.unwrap().into_inner().token;
        assert_eq!(first, second, "one connection, one thread");
        served.push(first);
    }
    assert_eq!(served, ["test-serve-0", "test-serve-1", "test-serve-0", "test-serve-1"]);

    // The access layer still decides, and health still answers.
    let node = berth_rpc::connect(&addr, creds(&ca, &Identity::node("n1").unwrap())).unwrap();
    assert_eq!(create_token(node.clone()).await.unwrap_err().code(), Code::PermissionDenied);
    assert_eq!(health(node).await.unwrap(), ServingStatus::Serving as i32);

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(15), serving).await.unwrap().unwrap().unwrap();
}

#[tokio::test]
async fn a_connection_holds_at_most_the_servers_streams_open_and_the_next_call_waits_for_one_to_end() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = ca();
    let listener =
        Listener::bind("127.0.0.1:0".parse().unwrap(), creds(&ca, &Identity::service("agent").unwrap())).await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let server = ServerBuilder::new().with_max_streams(2).add_service(join_tokens_server::JoinTokensServer::new(Stub));
    tokio::spawn(server.serve(listener, stop.clone()));
    let channel = berth_rpc::connect(&addr, creds(&ca, &Identity::admin("ops").unwrap())).unwrap();

    let first = health_watch(&channel).await;
    let _second = health_watch(&channel).await;
    let third = tokio::spawn(health(channel.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!third.is_finished(), "a third call ran beside two streams held open");
    drop(first);
    let answered = tokio::time::timeout(Duration::from_secs(10), third).await;
    assert_eq!(answered.unwrap().unwrap().unwrap(), ServingStatus::Serving as i32, "it runs once one ended");
    stop.cancel();
}
