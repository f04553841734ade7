//! Malformed requests on every public RPC of a running `berth dev`: a
//! truncated body, a field of the wrong wire type, a body over the size limit
//! and an all-defaults body each get a clean gRPC status, never a dropped
//! connection or a panic, and every service keeps serving afterwards.
//!
//! The RPCs come from the descriptor set the services serve for reflection,
//! so a new RPC is covered the day it is declared.
#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

mod common;

use std::path::Path;
use std::str::FromStr as _;
use std::time::Duration;

use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_proto::identity::v1::CertificateKind;
use berth_rpc::Channel;
use bytes::{Buf as _, BufMut as _, Bytes};
use prost_reflect::{DescriptorPool, Kind, MethodDescriptor};
use tokio_stream::StreamExt as _;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::{Code, Request, Status};

/// The body size every service refuses past.
const LIMIT: usize = berth_rpc::MAX_REQUEST_BYTES;

/// How long a stream opened with an all-defaults request is watched for its
/// first answer before the test lets it go.
const STREAM_WATCH: Duration = Duration::from_secs(2);

/// Passes request and response bodies through untouched, so the test can put
/// on the wire what no generated client would.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// One way of getting a request wrong, and the body that does it.
#[derive(Debug)]
struct Malformed {
    what: &'static str,
    body: Bytes,
}

fn tag(field: u32, wire_type: u8) -> u8 {
    u8::try_from(field << 3).unwrap() | wire_type
}

/// The malformed bodies for a method's input message, built from its first
/// field so that each one is wrong for that message in particular.
fn malformed_bodies(method: &MethodDescriptor) -> Vec<Malformed> {
    let input = method.input();
    let first = input.fields().min_by_key(prost_reflect::FieldDescriptor::number);
    let mut bodies = Vec::new();
    match &first {
        Some(field) if field.number() < 16 => {
            let number = field.number();
            let length_delimited = field.is_list() && !is_packable(&field.kind())
                || matches!(field.kind(), Kind::String | Kind::Bytes | Kind::Message(_));
            // Truncated: the field starts, and the body ends inside it.
            let truncated = if length_delimited {
                vec![tag(number, 2), 100, b'x']
            } else if matches!(field.kind(), Kind::Fixed64 | Kind::Sfixed64 | Kind::Double) {
                vec![tag(number, 1), 1, 2]
            } else if matches!(field.kind(), Kind::Fixed32 | Kind::Sfixed32 | Kind::Float) {
                vec![tag(number, 5), 1]
            } else {
                vec![tag(number, 0), 0xff]
            };
            bodies.push(Malformed { what: "a truncated body", body: Bytes::from(truncated) });
            // Wrong wire type: a fixed 32-bit value where the field is anything
            // else, a 64-bit one where it is a 32-bit fixed field.
            let wrong = if matches!(field.kind(), Kind::Fixed32 | Kind::Sfixed32 | Kind::Float) {
                vec![tag(number, 1), 0, 0, 0, 0, 0, 0, 0, 0]
            } else {
                vec![tag(number, 5), 0, 0, 0, 0]
            };
            bodies.push(Malformed { what: "a field of the wrong type", body: Bytes::from(wrong) });
        }
        _ => {
            // No fields to get wrong: an unknown field that is cut short still
            // cannot be skipped.
            bodies.push(Malformed { what: "a truncated body", body: Bytes::from_static(&[0x0a, 100, b'x']) });
        }
    }
    bodies.push(Malformed { what: "a body over the size limit", body: oversized() });
    bodies
}

fn is_packable(kind: &Kind) -> bool {
    !matches!(kind, Kind::String | Kind::Bytes | Kind::Message(_))
}

/// A well-formed body (one bytes-typed unknown field) one byte over the limit.
fn oversized() -> Bytes {
    let payload = LIMIT - 5;
    let mut body = Vec::with_capacity(LIMIT + 1);
    body.push(tag(15, 2));
    let mut len = payload;
    while len >= 0x80 {
        body.push(u8::try_from(len & 0x7f).unwrap() | 0x80);
        len >>= 7;
    }
    body.push(u8::try_from(len).unwrap());
    body.resize(LIMIT + 1, b'x');
    Bytes::from(body)
}

/// What a malformed body may be answered with: the decoder's refusal
/// (`INTERNAL`, as gRPC specifies for a request that does not parse), a
/// validation error, or the size limit.
fn clean_refusal(status: &Status) -> bool {
    let said_why = !status.message().is_empty();
    match status.code() {
        Code::Internal => status.message().contains("decode") || status.message().contains("buffer"),
        Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted => said_why,
        _ => false,
    }
}

/// What an all-defaults body may not be answered with: a failure of the
/// server itself or of the connection.
fn server_failure(code: Code) -> bool {
    matches!(code, Code::Unknown | Code::Internal | Code::Unavailable | Code::Cancelled | Code::DataLoss)
}

/// A router identity, issued by identity at `identity_addr` at the admin's
/// request, as `berth cert issue --kind router` would.
async fn issued_credentials(
    dir: &Path,
    identity_addr: &str,
    admin: &TlsCredentials,
    kind: berth_proto::identity::v1::CertificateKind,
    name: &str,
) -> TlsCredentials {
    use berth_proto::identity::v1 as identity;
    let (csr_pem, key_pem) = berth_mtls::generate_csr(name).unwrap();
    let request =
        identity::IssueCertificateRequest { kind: kind as i32, name: name.into(), csr_pem, ..Default::default() };
    let channel = berth_rpc::connect(identity_addr, admin.clone()).unwrap();
    let issued = identity::authority_client::AuthorityClient::new(channel)
        .issue_certificate(request)
        .await
        .unwrap()
        .into_inner();
    let ca_bundle_pem = std::fs::read_to_string(dir.join("ca.pem")).unwrap();
    TlsCredentials::new(TlsMaterial { cert_chain_pem: issued.certificate_pem, key_pem, ca_bundle_pem }).unwrap()
}

fn credentials(dir: &Path, cert: &str, key: &str) -> TlsCredentials {
    TlsCredentials::new(TlsMaterial::from_files(dir.join(cert), dir.join(key), dir.join("ca.pem")).unwrap()).unwrap()
}

/// The port offset of the service a method belongs to, as `berth dev` lays
/// them out.
fn port_offset(method: &MethodDescriptor) -> u16 {
    match method.parent_service().package_name() {
        "berth.identity.v1" => 0,
        "berth.revisions.v1" => 1,
        "berth.leases.v1" => 2,
        "berth.egress.v1" => 3,
        "berth.agent.v1" => 4,
        other => panic!("no berth dev port for package {other}"),
    }
}

/// The methods of every berth service, with their full paths.
fn every_method() -> Vec<(String, MethodDescriptor)> {
    let pool = DescriptorPool::decode(berth_proto::FILE_DESCRIPTOR_SET).unwrap();
    let mut methods: Vec<_> = pool
        .services()
        .filter(|service| service.full_name().starts_with("berth."))
        .flat_map(|service| service.methods().collect::<Vec<_>>())
        .map(|method| (format!("/{}/{}", method.parent_service().full_name(), method.name()), method))
        .collect();
    methods.sort_by(|a, b| a.0.cmp(&b.0));
    methods
}

/// Sends `body` to `path`: the status it ended with, or OK with nothing more
/// said within [`STREAM_WATCH`] for a stream.
async fn call(channel: &Channel, path: &str, streaming: bool, body: Bytes) -> Status {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    if let Err(error) = grpc.ready().await {
        return Status::unavailable(format!("channel not ready: {error}"));
    }
    let path = PathAndQuery::from_str(path).unwrap();
    if streaming {
        match grpc.server_streaming(Request::new(body), path, RawCodec).await {
            Err(status) => status,
            Ok(response) => {
                let mut stream = response.into_inner();
                match tokio::time::timeout(STREAM_WATCH, stream.next()).await {
                    Ok(Some(Err(status))) => status,
                    Ok(Some(Ok(_))) | Ok(None) | Err(_) => Status::ok(""),
                }
            }
        }
    } else {
        match grpc.unary(Request::new(body), path, RawCodec).await {
            Ok(_) => Status::ok(""),
            Err(status) => status,
        }
    }
}

async fn still_serving(base: u16, admin: &TlsCredentials, admin_identity: Channel) {
    for offset in 0..5u16 {
        let addr = format!("127.0.0.1:{}", base + offset);
        let channel = berth_rpc::connect(&addr, admin.clone()).unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let answer = health
            .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
            .await
            .unwrap_or_else(|status| panic!("health on {addr} after the malformed requests: {status}"));
        assert_eq!(
            answer.into_inner().status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{addr} stopped serving"
        );
    }
    // And a real call still works on the connection that carried them.
    let mut nodes = berth_proto::identity::v1::nodes_client::NodesClient::new(admin_identity);
    let listed = nodes.list_nodes(berth_proto::identity::v1::ListNodesRequest::default()).await.unwrap();
    assert_eq!(listed.into_inner().nodes.len(), 1, "the dev node is still listed");
}

#[test]
fn every_public_rpc_refuses_malformed_requests_cleanly_and_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, base) = common::spawn_dev(dir.path());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();

    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(async {
            let admin_credentials = credentials(dir.path(), "admin.pem", "admin-key.pem");
            let node_credentials = credentials(dir.path(), "agent/identity/node.pem", "agent/identity/node.key");
            let identity_addr = format!("127.0.0.1:{base}");
            let issue = |kind, name| issued_credentials(dir.path(), &identity_addr, &admin_credentials, kind, name);
            let router_credentials = issue(CertificateKind::Router, "bad-input").await;
            // What only a service may call is called as identity, the one
            // service some of those RPCs serve.
            let service_credentials = issue(CertificateKind::Service, "identity").await;
            let methods = every_method();
            assert!(methods.len() >= 40, "only {} RPCs found in the descriptor set", methods.len());

            let mut failures = Vec::new();
            let mut channels = std::collections::HashMap::new();
            for (path, method) in &methods {
                let kinds = berth_proto::access::allowed(path).unwrap_or_else(|| panic!("{path} declares no callers"));
                // Each RPC is called as a kind it admits: admin, else router,
                // else service, else node.
                let caller =
                    [berth_core::CallerKind::Admin, berth_core::CallerKind::Router, berth_core::CallerKind::Service]
                        .into_iter()
                        .find(|kind| kinds.contains(kind))
                        .unwrap_or(berth_core::CallerKind::Node);
                let offset = port_offset(method);
                let channel = channels
                    .entry((offset, caller))
                    .or_insert_with(|| {
                        let addr = format!("127.0.0.1:{}", base + offset);
                        let creds = match caller {
                            berth_core::CallerKind::Admin => admin_credentials.clone(),
                            berth_core::CallerKind::Router => router_credentials.clone(),
                            berth_core::CallerKind::Service => service_credentials.clone(),
                            _ => node_credentials.clone(),
                        };
                        berth_rpc::connect(&addr, creds).unwrap()
                    })
                    .clone();
                let streaming = method.is_server_streaming();
                for malformed in malformed_bodies(method) {
                    let status = call(&channel, path, streaming, malformed.body).await;
                    if !clean_refusal(&status) {
                        failures.push(format!(
                            "{path} answered {} with {:?}: {}",
                            malformed.what,
                            status.code(),
                            status.message()
                        ));
                    }
                }
                let status = call(&channel, path, streaming, Bytes::new()).await;
                if server_failure(status.code()) {
                    failures.push(format!(
                        "{path} answered an all-defaults request with {:?}: {}",
                        status.code(),
                        status.message()
                    ));
                }
            }
            assert!(failures.is_empty(), "unclean answers:\n{}", failures.join("\n"));
            still_serving(base, &admin_credentials, channels[&(0, berth_core::CallerKind::Admin)].clone()).await;
        });
    }));
    common::stop_dev(&mut dev, dir.path());
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
