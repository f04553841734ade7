//! The revisions service: Services as users declare them, the immutable
//! revisions minted from them with their bundle tag resolved to a digest
//! once, and the deploy reconciler that rolls revisions out through leases,
//! rolls back on failure, follows traffic pins and collects old revisions.
//!
//! # Who writes what
//! - `services`, `revisions`, `deleted_services`: only this crate, through
//!   its catalog module. API handlers write declarations and pins; the
//!   elected reconciler writes observations, fenced on its term.
//! - Leases are the leases service's: the reconciler asks for them, lists
//!   them and releases them over gRPC, never reads their tables, and is
//!   woken when one of a service's leases changes by following
//!   `WatchLeases`.
//! - Registry credentials are the operator's, read from a file at start
//!   ([`RegistrySecrets`]) and never stored: templates and leases carry only
//!   their name, and a node gets them for one pull of a lease it holds.
//!
//! # Expected flow
//! A process builds a [`RevisionsService`] over its
//! [`ServiceContext`](berth_runtime::ServiceContext) (store migrated with
//! [`MIGRATIONS`]) and its [`Dependencies`] (a [`GrpcLeases`] client dialled
//! with the service's own certificate, the registry resolver), starts the
//! controller with [`RevisionsService::spawn_loops`] and serves
//! [`RevisionsService::server`]. [`SPEC`] serves without a leases client:
//! it accepts services and mints revisions, and their status says that no
//! leases address is configured.

pub use cli::binary_main;
pub use config::{
    DEFAULT_CPU_MILLIS, DEFAULT_DRAIN, DEFAULT_GC_KEEP, DEFAULT_GC_MIN_AGE, DEFAULT_MEMORY_BYTES,
    DEFAULT_PROGRESS_DEADLINE, DEFAULT_PULL_CREDENTIALS_TTL, RevisionsConfig,
};
pub use controller::DEPLOY_LOOP;
pub use leases::{GrpcLeases, LeaseCallError, LeaseClient, LeaseEvents, NoLeases};
pub use model::{BUNDLE_RESOLVED, READY, ROLLOUT_COMPLETE};
pub use resolver::{RegistryPolicy, RegistryResolver, ResolveError, TagResolver};
pub use secrets::{RegistrySecrets, SecretsError};
pub use service::{Dependencies, RevisionsService};

mod api;
mod catalog;
mod cli;
mod config;
mod controller;
mod lease_view;
mod lease_watch;
mod leases;
mod model;
mod plan;
mod pull;
mod reconciler;
mod records;
mod resolver;
mod route_acks;
mod secrets;
mod service;
mod shared;
mod signals;
mod traffic;
mod validate;
mod watch;

use berth_rpc::ServerBuilder;
use berth_runtime::{ServiceContext, ServiceReplica as _, ServiceSpec, StartError};
use berth_store::Migration;

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "revisions";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7444;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] =
    berth_store::migrations!["0001_catalog", "0002_traffic", "0003_drain", "0004_route_acks",];

/// How the runtime starts it: [`server`] with the default timings and no leases client.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// Every gRPC service of revisions over `ctx`, asking the leases service at
/// `leases_addr` (dialled with `ctx.credentials`) for replicas, with the
/// default timings, registries spoken to over plain HTTP as `policy` says,
/// the registry credentials `secrets`, and the controller running until the
/// server is dropped: what `berth dev` serves.
pub fn server_with_leases(
    ctx: &ServiceContext,
    leases_addr: &str,
    policy: RegistryPolicy,
    secrets: RegistrySecrets,
) -> Result<ServerBuilder, StartError> {
    let config = RevisionsConfig::default();
    let leases = GrpcLeases::connect(leases_addr, ctx.credentials.clone())
        .map_err(|e| StartError::Invalid(format!("revisions: leases address: {e}")))?;
    let dependencies = Dependencies::with_secrets(std::sync::Arc::new(leases), policy, secrets, &config)
        .map_err(|e| StartError::Invalid(format!("revisions: registry client: {e}")))?;
    Ok(RevisionsService::new(ctx, config, dependencies).server_holding_its_loops())
}

/// Every gRPC service of revisions over `ctx`, with no leases client (see
/// the crate docs), the controller running until the server is dropped.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    let config = RevisionsConfig::default();
    match Dependencies::without_leases(&config) {
        Ok(dependencies) => RevisionsService::new(ctx, config, dependencies).server_holding_its_loops(),
        Err(error) => {
            tracing::error!(%error, "cannot build the registry client; revisions serves nothing");
            ServerBuilder::new()
        }
    }
}
