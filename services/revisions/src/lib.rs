//! The revisions service: services and their immutable revisions: tag-to-digest resolution, rollout and rollback, revision GC.
//!
//! Its RPCs answer `UNIMPLEMENTED` until they are built; the access layer
//! already admits each only to the caller kinds its proto declares.

use berth_proto::revisions::v1;
use berth_rpc::{MAX_REQUEST_BYTES, ServerBuilder};
use berth_runtime::{ServiceContext, ServiceSpec};
use berth_store::Migration;

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "revisions";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7444;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] = &[];

/// How the runtime starts it.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// The handlers' shared state.
#[derive(Debug, Clone)]
pub struct RevisionsService {
    #[allow(dead_code, reason = "read by the handlers as they are built")]
    ctx: ServiceContext,
}

/// Every gRPC service of revisions, ready to serve.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    let svc = RevisionsService { ctx: ctx.clone() };
    ServerBuilder::new()
        .add_service(v1::services_server::ServicesServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(
            v1::revisions_server::RevisionsServer::new(svc.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
}

#[tonic::async_trait]
impl v1::services_server::Services for RevisionsService {}

#[tonic::async_trait]
impl v1::revisions_server::Revisions for RevisionsService {}
