//! `berth`: the operator's binary. `berth dev` runs the whole mesh in one
//! process; the other subcommands are the admin CLI (tokens, nodes,
//! certificates, leases, services, revisions, bundles). The benchmarks are
//! a binary of their own, `berth-bench`.

mod bundle_cmd;
mod cli;
mod dev;

use std::process::ExitCode;

use berth_runtime::{TelemetryArgs, run_main};
use clap::{Parser, Subcommand};

/// berth: a compute control plane. Join hosts, declare services, and let
/// berth run them.
#[derive(Debug, Parser)]
#[command(name = "berth", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the whole mesh (identity, revisions, leases, egress, one node
    /// agent and the router) in this process, on embedded state in a data
    /// directory.
    Dev(dev::DevArgs),
    /// Create, list and revoke join tokens.
    Token(cli::TokenArgs),
    /// List, inspect, drain and revoke nodes.
    Node(cli::NodeArgs),
    /// Issue admin, service and router certificates.
    Cert(cli::CertArgs),
    /// Make a mesh's CA (in identity's database) and write its CA bundle,
    /// an admin, the service and any router certificates, before the
    /// services first start.
    Bootstrap(cli::BootstrapArgs),
    /// Ask one berth process whether it serves (grpc.health.v1 over TLS);
    /// exit 0 when it does: for container health checks and exec probes.
    Health(cli::HealthArgs),
    /// Ask for compute to run a command, and list, inspect and release leases.
    Lease(cli::LeaseArgs),
    /// Show what each node offers to leases and how much of it is reserved.
    Capacity(cli::CapacityArgs),
    /// List and steer cache volumes: roll a volume back, pin a generation,
    /// delete one, turn a project's off: `berth cache rollback KEY --to 3`.
    Cache(cli::CacheArgs),
    /// Declare services and show them, pin their traffic, redeploy them:
    /// `berth service apply -f service.json --name hello --wait`.
    Service(cli::ServiceArgs),
    /// Declare each tenant's egress gateways and routes, and show the plan
    /// compiled from them: `berth egress route apply -f route.json`.
    Egress(cli::EgressArgs),
    /// List and show the revisions minted from a service.
    Revision(cli::RevisionArgs),
    /// Print a lease's output, fetched from its node; `-f` follows it.
    Logs(cli::LogsArgs),
    /// Build and push bundles (`push DIR REF`) and show what a reference holds
    /// (`inspect REF`), in a registry or an `oci:DIR:TAG` layout directory.
    Bundle(bundle_cmd::BundleArgs),
}

fn main() -> ExitCode {
    // `berth dev` runs the process runtime from this executable: invoked as
    // its monitor or init, nothing else runs.
    if let Some(code) = berth_agent::runtime_main_if_invoked() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let mut cli = Cli::parse();
    if !matches!(cli.command, Command::Dev(_)) {
        // Tables and JSON on stdout; only problems on stderr.
        cli.telemetry.default_log_filter = Some("warn");
    }
    if matches!(cli.command, Command::Health(_)) {
        // A probe every few seconds exports no traces of itself.
        cli.telemetry.otlp_endpoint = None;
    }
    run_main("berth", &cli.telemetry, || async {
        match cli.command {
            Command::Dev(args) => dev::run(args).await,
            Command::Token(args) => Ok(args.run().await?),
            Command::Node(args) => Ok(args.run().await?),
            Command::Cert(args) => Ok(args.run().await?),
            Command::Bootstrap(args) => Ok(args.run().await?),
            Command::Health(args) => Ok(args.run().await?),
            Command::Lease(args) => Ok(args.run().await?),
            Command::Capacity(args) => Ok(args.run().await?),
            Command::Cache(args) => Ok(args.run().await?),
            Command::Service(args) => Ok(args.run().await?),
            Command::Revision(args) => Ok(args.run().await?),
            Command::Egress(args) => Ok(args.run().await?),
            Command::Logs(args) => Ok(args.run().await?),
            Command::Bundle(args) => Ok(args.run().await?),
        }
    })
}
