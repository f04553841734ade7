//! What every berth binary does before and around serving: the shared flags
//! (listen address, certificates, database, bus, telemetry), the crypto
//! provider, the tokio runtime, telemetry, opening the store and the bus,
//! watching certificate files for renewal, and turning a startup failure into
//! one clear line and a non-zero exit.

mod args;
mod controller;
mod deadlines;
mod duration;
mod elected;
mod follow;
mod loops;
mod reload;
mod renew;
mod replica;
mod service;
mod startup;
mod workload_trust;

pub use args::{MeshArgs, StateArgs, TelemetryArgs, TlsArgs};
/// For [`replica_server!`]: the builder it starts from.
pub use berth_rpc::ServerBuilder;
pub use controller::{
    Action, Coalesce, ControllerConfig, DecodeTrigger, Reconciler, Trigger, Triggers, run_controller,
};
pub use deadlines::DeadlineKeeper;
pub use duration::{parse_duration, parse_size};
pub use elected::{Election, Leader, spawn_elected};
pub use follow::{NodeDirectory, NodeSnapshot, follow_nodes};
pub use loops::{LOOPS_GRACE, close_with, spawn_loop};
pub use reload::{CERT_POLL_INTERVAL, watch_cert_files};
pub use renew::{RENEW_CHECK_INTERVAL, RenewError, renew_if_due, renew_service_certificate};
pub use replica::{replica_id, wall_clock_ms};
pub use service::{
    HeldLoops, ServiceContext, ServiceFlags, ServiceReplica, ServiceSpec, Started, bind, serve_replica, start_service,
    store_readiness,
};
pub use startup::{StartError, chain, open_bus, open_store, run_main, wait_for_bus, wait_for_store, with_causes};
pub use workload_trust::follow_workload_bundle;
