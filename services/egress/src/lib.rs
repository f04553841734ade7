//! The egress service: each tenant's outbound traffic policy. Admins declare
//! gateways (the listeners of a tenant's egress proxy) and routes (which
//! destinations may, or may not, leave through them); services select a
//! gateway in their template. One elected full pass compiles each tenant's
//! plan, writes every status, and decides what each node is sent; every
//! replica streams each node the whole plan of every tenant it hosts.
//!
//! # Who writes what
//! - `gateways`, `routes` (declarations): the API handlers.
//! - Statuses, `plans`, `nodes` and `node_plans` (what each node is sent):
//!   only the elected full pass ([`EGRESS_LOOP`]), fenced on its term.
//! - Acknowledgements: `AckEgress`, for the calling node's own rows.
//! - Services and leases are revisions' and leases': egress follows them
//!   over gRPC with its own certificate, never reads their tables (see the
//!   `sources` module: `WatchServices` plus `GetRevision` for live
//!   revisions, and `ListLeases` polled for placement, leases having no
//!   watch for requesters).
//!
//! # Expected flow
//! A process builds an [`EgressService`] over its
//! [`ServiceContext`](berth_runtime::ServiceContext) (store migrated with
//! [`MIGRATIONS`]) and its [`Sources`], starts its loops with
//! [`EgressService::spawn_loops`] and serves [`EgressService::server`].
//! [`server_with_sources`] does that for `berth dev`; [`SPEC`] serves with
//! no sources (plans list no services and reach no node).
//!
//! # The compile
//! [`compile`] is pure and public, so the benchmark and tests drive it
//! directly; its module documents the rules (listener protocols, wildcards,
//! TCP routes, conditions).

pub use cli::binary_main;
pub use compile::{
    CompiledPlan, Destination, Destinations, EgressReadiness, GatewayOutcome, GatewaySpec, ListenerOutcome,
    ListenerSpec, ParentOutcome, ParentSpec, ParentVerdict, PlanInputs, RouteOutcome, RouteSpec, ServiceInput,
    ServicePlan, compile,
};
pub use config::{DEFAULT_DEBOUNCE, DEFAULT_FULL_RESYNC, DEFAULT_MAX_DELAY, DEFAULT_PLACEMENT_POLL, EgressConfig};
pub use model::{
    ACCEPTED, CONFLICTED, DEFAULT_GATEWAY, DEFAULT_NDOTS, DEFAULT_PROJECT, EGRESS_READY, HostPattern, HostPatternError,
    Protocol, READY, RouteAction, Selection, reason,
};
pub use pass::EGRESS_LOOP;
pub use service::EgressService;
pub use sources::{SourceError, Sources};
pub use validate::{MAX_HOSTNAMES, MAX_LISTENERS, MAX_NDOTS, MAX_PARENT_REFS, MAX_PORTS, MAX_SEARCH, MAX_UPSTREAMS};

mod api;
mod catalog;
mod cli;
mod compile;
mod config;
mod model;
mod pass;
mod push;
mod queue;
mod records;
mod render;
mod service;
mod shared;
mod sources;
mod validate;
mod world;

use berth_rpc::ServerBuilder;
use berth_runtime::{ServiceContext, ServiceReplica as _, ServiceSpec, StartError};
use berth_store::Migration;

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "egress";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7446;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] = berth_store::migrations!["0001_policy", "0002_dns",];

/// How the runtime starts it: [`server`], with no sources.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// Every gRPC service of egress over `ctx` with the default timings and no
/// sources, its loops running until the server is dropped.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    EgressService::new(ctx, EgressConfig::default(), Sources::none()).server_holding_its_loops()
}

/// Every gRPC service of egress over `ctx`, following revisions at
/// `revisions_addr` and leases at `leases_addr` (dialled with
/// `ctx.credentials`), with the default timings and its loops running until
/// the server is dropped: what `berth dev` serves.
pub fn server_with_sources(
    ctx: &ServiceContext,
    revisions_addr: &str,
    leases_addr: &str,
) -> Result<ServerBuilder, StartError> {
    let sources = Sources::connect(&ctx.credentials, Some(revisions_addr), Some(leases_addr))
        .map_err(|e| StartError::Invalid(format!("egress: {e}")))?;
    Ok(EgressService::new(ctx, EgressConfig::default(), sources).server_holding_its_loops())
}
