//! `berth-bench`: load scenarios against real service processes over real
//! mTLS, whose figures BENCHMARKS.md records (`make bench` runs them all).
//!
//! # What a scenario measures
//! The service under test runs as a process of its own, started from the
//! binary beside `berth-bench` on state made for the run, so its memory is
//! its own; the clients run here. Each load is compared with a baseline taken in
//! the same run, against the same process, over as many connections, and
//! every figure is reported whether or not it meets its target.

mod cache;
mod deploy;
mod dev;
mod dns;
mod egress;
mod egress_push;
mod heartbeats;
mod identity_process;
mod launch;
mod leases;
mod leases_process;
mod load;
mod microvm;
mod mirror;
mod nodes;
mod output;
mod procfs;
mod report;
mod router;
mod runtime_launch;
mod svids;

mod process;

use std::process::ExitCode;

use berth_runtime::{StartError, TelemetryArgs, run_main};
use clap::Parser;

/// berth-bench: measure a berth service under load against a real process
/// of it, e.g. `berth-bench heartbeats --nodes 10000`.
#[derive(Debug, Parser)]
#[command(name = "berth-bench", version)]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

#[derive(Debug, Clone, clap::Subcommand)]
enum Scenario {
    /// Simulated nodes joining and heartbeating one identity replica over
    /// mTLS, beside an empty mTLS RPC on the same stack; reports rates,
    /// latencies and identity's memory.
    Heartbeats(heartbeats::HeartbeatArgs),
    /// Leases placed on simulated nodes by one leases replica on PostgreSQL
    /// and Redis, beside pgbench's `FOR UPDATE SKIP LOCKED` claim rate in the
    /// same database; reports placements/s and latencies.
    Leases(leases::LeasesArgs),
    /// Leases launched as processes by a real agent, one at a time: request
    /// to RUNNING latency, the agent's memory idle and loaded, and the
    /// ledger's memory with many leases on record.
    Launch(launch::LaunchArgs),
    /// Services applied to revisions and leases on PostgreSQL and Redis and
    /// run by a real node: apply to RUNNING latency with the bundle on the
    /// node and pulled from a registry, and how fast applies mint revisions.
    Deploy(deploy::DeployArgs),
    /// The egress compile of one tenant (10,000 services, 1,000 gateways,
    /// 10,000 routes by default), at half, full and double size: its time
    /// and growth rate; then the node proxy's added latency on an allowed
    /// request, plain and through CONNECT, against a direct request.
    Egress(egress::EgressArgs),
    /// Route edits on a real `berth dev` whose node hosts the tenant: how
    /// long until the node has each edit in force, beside an empty mTLS RPC.
    EgressPush(egress_push::EgressPushArgs),
    /// Requests through a `berth-router` process and the node's agent to a
    /// replica on a real `berth dev`, beside the same requests straight to
    /// the replica, in HTTP/1.1 and HTTP/2; how long a route change takes
    /// to be served by every router; the router's memory.
    Router(router::RouterArgs),
    /// Workload certificates signed on a real `berth dev`, each against a
    /// fresh launch registration as a node gets a launch's first, beside an
    /// empty mTLS RPC; reports signings/s and latencies.
    Svids(svids::SvidArgs),
    /// A tenant's resolver inside its network namespace (needs root): an
    /// internal service name and a forwarded name from the workload's side,
    /// beside the same query straight to the upstream.
    Dns(dns::DnsArgs),
    /// A tag resolved and a bundle pulled from a real registry through a
    /// mirror that refuses connections and one that never answers, beside
    /// the same pull with no mirror.
    Mirror(mirror::MirrorArgs),
    /// A cache volume's view mounted for a launch, beside the same launch
    /// without one, under a real runtime (needs root); a view's publish
    /// beside a seal of every byte; placement's share of a key's leases
    /// put beside its head on simulated nodes.
    Cache(cache::CacheArgs),
    /// A lease's workload booted in a QEMU microVM beside the same workload
    /// as a runc container (needs root): request to running, the VMM's
    /// memory, and many VMs launched at once.
    Microvm(microvm::MicroVmArgs),
    /// The HTTP server the router scenario deploys (run by the node).
    #[command(hide = true)]
    EchoServer,
    /// A byte relay, the router scenario's floor (run by the scenario).
    #[command(hide = true)]
    Relay(router::RelayArgs),
}

fn main() -> ExitCode {
    // `berth-bench launch` runs the process runtime from this executable:
    // invoked as its monitor or init, nothing else runs.
    if let Some(code) = berth_agent::runtime_main_if_invoked() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let mut cli = Cli::parse();
    // Reports on stdout; progress and problems on stderr.
    cli.telemetry.default_log_filter = Some("warn");
    run_main("berth-bench", &cli.telemetry, || cli.scenario.run())
}

impl Scenario {
    /// Runs the chosen scenario and prints its report.
    async fn run(self) -> Result<(), StartError> {
        let outcome = match self {
            Scenario::Heartbeats(args) => heartbeats::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Leases(args) => leases::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Launch(args) => launch::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Deploy(args) => deploy::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Egress(args) => egress::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::EgressPush(args) => egress_push::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Router(args) => router::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Svids(args) => svids::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Dns(args) => dns::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Mirror(args) => mirror::run(args).await.map_err(|error| berth_runtime::chain(&error)),
            Scenario::Cache(args) => cache::run(args).await,
            Scenario::Microvm(args) => microvm::run(args).await,
            Scenario::EchoServer => router::echo_server().await,
            Scenario::Relay(args) => router::relay(args).await,
        };
        outcome.map_err(StartError::Invalid)
    }
}
