//! End-to-end tests of berth as production runs it: the mesh as separate
//! processes, against real PostgreSQL and Redis, with node agents, so a
//! test can break any part of it and check what every other part does.
//!
//! # The harness
//! - [`Mesh`]: every control-plane service as several replicas of its real
//!   binary, each service behind a [`Front`] (a TCP proxy, as a load
//!   balancer would be), a [`PrivatePostgres`] and a [`PrivateRedis`] of
//!   the test's own (restart and `FLUSHALL` them at will; never the shared
//!   ones), and [`AgentProcess`]es, each in a network namespace of its own
//!   where root allows ([`NodeNetwork`]). Replicas can be killed and
//!   restarted, agents killed, restarted, frozen or cut off.
//! - [`workloads`]: what really runs, read from `/proc`.
//! - [`Load`]: synthetic nodes heartbeating, applies and lease requests,
//!   through the real gRPC clients, remembering what was acknowledged.
//! - [`invariants`]: the promises checked against every service's schema
//!   and `/proc`; [`report`]: the table a fault run prints.
//!
//! # Leftovers
//! A run that dies without its destructors (killed by a timeout) leaves
//! processes, namespaces and its directory behind; the next [`Mesh`]
//! removes them first ([`stale`]).
//!
//! # Running
//! The binaries are not built by `cargo test` for this crate: build them
//! first (`make test-faults` does), see [`binaries`]. Suites that need a
//! machine to themselves are `#[ignore]`d and run with `--ignored`.
//!
//! # Errors
//! The harness is test code: its functions return `anyhow` errors with the
//! context a failed test needs (which process, the end of its log).

pub mod agent;
pub mod binaries;
pub mod bundles;
pub mod front;
pub mod invariants;
pub mod load;
pub mod mesh;
pub mod netns;
pub mod ports;
pub mod postgres;
pub mod process;
pub mod redis;
pub mod report;
pub mod stale;
pub mod synthetic;
pub mod workloads;

pub use agent::{AgentProcess, Cut};
pub use front::Front;
pub use load::{Acks, Load, LoadOptions, Op, Snapshot};
pub use mesh::{Isolation, Mesh, MeshOptions, MeshTimings, NodeRow, Replica, ServiceKind};
pub use netns::{NodeNamespace, NodeNetwork};
pub use postgres::PrivatePostgres;
pub use process::{ManagedProcess, ProcessSpec};
pub use redis::PrivateRedis;
pub use report::FaultRow;
pub use synthetic::SyntheticNode;
pub use workloads::{RUN_MARKER_ENV, Workload};
