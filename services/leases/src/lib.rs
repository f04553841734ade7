//! The leases service: the capacity ledger. It places leases on the nodes
//! identity knows, fences every write about a lease with its epoch, expires
//! leases their nodes stop renewing, streams each node its assignments, and
//! streams requesters the leases they follow (`WatchLeases`).
//!
//! # Who writes what
//! - `leases` and `node_ledger`: only this crate, through its ledger module;
//!   node capacity is never stored here, it is identity's and is followed
//!   through `Nodes/WatchNodes` into the runtime's node directory.
//! - The reaper alone expires and forgets leases, one replica at a time.
//!
//! # No pending queue
//! A request no node has room for is refused (`RESOURCE_EXHAUSTED`, naming
//! the shortage) rather than kept `PENDING`: requesters are reconcilers that
//! ask again, so the ledger keeps no queue that could outlive the intent
//! behind it, and every lease it holds has a node.
//!
//! # Expected flow
//! A process serving the ledger builds a [`LeasesService`] over its
//! [`ServiceContext`](berth_runtime::ServiceContext) (store migrated with
//! [`MIGRATIONS`], node directory followed from identity), starts its loops
//! with [`LeasesService::spawn_loops`] and serves [`LeasesService::server`].
//! [`SPEC`] does all of that with the default timings for callers that only
//! take a server, the loops then living as long as the server's handlers.

pub use cli::binary_main;
pub use config::{CacheRegistryConfig, DEFAULT_CACHE_KEEP, DEFAULT_LEASE_TTL, LeasesConfig};
pub use ledger::REAPER_LOOP;
pub use model::{Memory, Resources};
pub use placement::{Placement, PlacementNode, PlacementPlan, PlacementRequest, Shortage, place};
pub use service::LeasesService;

mod api;
mod assignments;
mod caches;
mod cli;
mod config;
mod ledger;
mod logs;
mod model;
mod placement;
mod placer;
mod reaper;
mod records;
mod redeemer;
mod service;
mod shared;
mod signals;
mod validate;
mod watch;

use berth_rpc::ServerBuilder;
use berth_runtime::{ServiceContext, ServiceReplica as _, ServiceSpec};
use berth_store::Migration;

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "leases";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7445;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] = berth_store::migrations![
    "0001_ledger",
    "0002_traceparent",
    "0003_changes",
    "0004_ports",
    "0005_launch_registrations",
    "0006_resize",
    "0007_caches",
    "0008_cache_artifacts",
    "0009_cache_followers",
    "0010_memory_overhead",
];

/// How the runtime starts it: [`server`] with the default timings.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// Every gRPC service of leases over `ctx`, with its loops running (default
/// timings) until the server built from it is dropped.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    LeasesService::new(ctx, LeasesConfig::default()).server_holding_its_loops()
}
