//! The identity service: the mesh root of trust and host register: CA, join tokens, node join and heartbeats, the node registry and revocation.
//!
//! Its RPCs answer `UNIMPLEMENTED` until they are built; the access layer
//! already admits each only to the caller kinds its proto declares.

use berth_proto::identity::v1;
use berth_rpc::{MAX_REQUEST_BYTES, ServerBuilder};
use berth_runtime::{ServiceContext, ServiceSpec};
use berth_store::Migration;

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "identity";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7443;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] = &[];

/// How the runtime starts it.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// The handlers' shared state.
#[derive(Debug, Clone)]
pub struct IdentityService {
    #[allow(dead_code, reason = "read by the handlers as they are built")]
    ctx: ServiceContext,
}

/// Every gRPC service of identity, ready to serve.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    let svc = IdentityService { ctx: ctx.clone() };
    ServerBuilder::new()
        .add_service(
            v1::join_tokens_server::JoinTokensServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .add_service(v1::join_server::JoinServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(
            v1::node_session_server::NodeSessionServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .add_service(v1::nodes_server::NodesServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(
            v1::authority_server::AuthorityServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
}

#[tonic::async_trait]
impl v1::join_tokens_server::JoinTokens for IdentityService {}

#[tonic::async_trait]
impl v1::join_server::Join for IdentityService {}

#[tonic::async_trait]
impl v1::node_session_server::NodeSession for IdentityService {}

#[tonic::async_trait]
impl v1::nodes_server::Nodes for IdentityService {}

#[tonic::async_trait]
impl v1::authority_server::Authority for IdentityService {}
