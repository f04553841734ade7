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
pub static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "ledger",
        postgres: include_str!("../migrations/postgres/0001_ledger.sql"),
        sqlite: include_str!("../migrations/sqlite/0001_ledger.sql"),
    },
    Migration {
        version: 2,
        name: "traceparent",
        postgres: include_str!("../migrations/postgres/0002_traceparent.sql"),
        sqlite: include_str!("../migrations/sqlite/0002_traceparent.sql"),
    },
    Migration {
        version: 3,
        name: "changes",
        postgres: include_str!("../migrations/postgres/0003_changes.sql"),
        sqlite: include_str!("../migrations/sqlite/0003_changes.sql"),
    },
    Migration {
        version: 4,
        name: "ports",
        postgres: include_str!("../migrations/postgres/0004_ports.sql"),
        sqlite: include_str!("../migrations/sqlite/0004_ports.sql"),
    },
    Migration {
        version: 5,
        name: "launch_registrations",
        postgres: include_str!("../migrations/postgres/0005_launch_registrations.sql"),
        sqlite: include_str!("../migrations/sqlite/0005_launch_registrations.sql"),
    },
    Migration {
        version: 6,
        name: "resize",
        postgres: include_str!("../migrations/postgres/0006_resize.sql"),
        sqlite: include_str!("../migrations/sqlite/0006_resize.sql"),
    },
    Migration {
        version: 7,
        name: "caches",
        postgres: include_str!("../migrations/postgres/0007_caches.sql"),
        sqlite: include_str!("../migrations/sqlite/0007_caches.sql"),
    },
    Migration {
        version: 8,
        name: "cache_artifacts",
        postgres: include_str!("../migrations/postgres/0008_cache_artifacts.sql"),
        sqlite: include_str!("../migrations/sqlite/0008_cache_artifacts.sql"),
    },
    Migration {
        version: 9,
        name: "cache_followers",
        postgres: include_str!("../migrations/postgres/0009_cache_followers.sql"),
        sqlite: include_str!("../migrations/sqlite/0009_cache_followers.sql"),
    },
    Migration {
        version: 10,
        name: "memory_overhead",
        postgres: include_str!("../migrations/postgres/0010_memory_overhead.sql"),
        sqlite: include_str!("../migrations/sqlite/0010_memory_overhead.sql"),
    },
];

/// How the runtime starts it: [`server`] with the default timings.
pub const SPEC: ServiceSpec = ServiceSpec { name: NAME, migrations: MIGRATIONS, build: server };

/// Every gRPC service of leases over `ctx`, with its loops running (default
/// timings) until the server built from it is dropped.
pub fn server(ctx: &ServiceContext) -> ServerBuilder {
    LeasesService::new(ctx, LeasesConfig::default()).server_holding_its_loops()
}
