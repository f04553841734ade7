//! `berth`: the operator's binary. `berth dev` runs the whole mesh in one
//! process; the other subcommands are the admin CLI.

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
    /// Run the whole mesh (identity, revisions, leases, egress and one node
    /// agent) in this process, on embedded state in a data directory.
    Dev(dev::DevArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    run_main("berth", &cli.telemetry, || async {
        match cli.command {
            Command::Dev(args) => dev::run(args).await,
        }
    })
}
