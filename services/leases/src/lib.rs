//! The leases service: the capacity ledger: placement, the lease lifecycle with epochs, the reaper, and per-node assignment streams.
//!
//! Its RPCs answer `UNIMPLEMENTED` until they are built; the access layer
//! already admits each only to the caller kinds its proto declares.

use berth_proto::leases::v1;
use berth_rpc::{MAX_REQUEST_BYTES, ServerBuilder};
use berth_runtime::{ServiceContext, ServiceSpec};
use berth_store::Migration;

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "leases";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7445;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] = &[];

/// How the runtime starts it.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// The handlers' shared state.
#[derive(Debug, Clone)]
pub struct LeasesService {
    #[allow(dead_code, reason = "read by the handlers as they are built")]
    ctx: ServiceContext,
}

/// Every gRPC service of leases, ready to serve.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    let svc = LeasesService { ctx: ctx.clone() };
    ServerBuilder::new()
        .add_service(v1::leases_server::LeasesServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(v1::capacity_server::CapacityServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(
            v1::node_leases_server::NodeLeasesServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
}

#[tonic::async_trait]
impl v1::leases_server::Leases for LeasesService {}

#[tonic::async_trait]
impl v1::capacity_server::Capacity for LeasesService {}

#[tonic::async_trait]
impl v1::node_leases_server::NodeLeases for LeasesService {}
