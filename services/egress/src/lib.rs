//! The egress service: each tenant's egress policy: gateways and routes, the compiled plan, its status, and per-node pushes.
//!
//! Its RPCs answer `UNIMPLEMENTED` until they are built; the access layer
//! already admits each only to the caller kinds its proto declares.

use berth_proto::egress::v1;
use berth_rpc::{MAX_REQUEST_BYTES, ServerBuilder};
use berth_runtime::{ServiceContext, ServiceSpec};
use berth_store::Migration;

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "egress";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7446;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] = &[];

/// How the runtime starts it.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// The handlers' shared state.
#[derive(Debug, Clone)]
pub struct EgressService {
    #[allow(dead_code, reason = "read by the handlers as they are built")]
    ctx: ServiceContext,
}

/// Every gRPC service of egress, ready to serve.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    let svc = EgressService { ctx: ctx.clone() };
    ServerBuilder::new()
        .add_service(v1::egress_server::EgressServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(
            v1::node_egress_server::NodeEgressServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
}

#[tonic::async_trait]
impl v1::egress_server::Egress for EgressService {}

#[tonic::async_trait]
impl v1::node_egress_server::NodeEgress for EgressService {}
