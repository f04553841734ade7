//! `berth-revisions`: the revisions service binary.

use std::net::SocketAddr;
use std::process::ExitCode;

use berth_runtime::{MeshArgs, StateArgs, TelemetryArgs, TlsArgs, run_main, run_service};
use clap::Parser;

/// The berth revisions service: services and their immutable revisions: tag to digest resolution, rollout and rollback, revision GC.
#[derive(Debug, Parser)]
#[command(name = "berth-revisions", version)]
struct Args {
    /// Address to serve mTLS gRPC on.
    #[arg(long, env = "BERTH_LISTEN", default_value = "0.0.0.0:7444")]
    listen: SocketAddr,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    mesh: MeshArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_main("berth-revisions", &args.telemetry, || async {
        let shutdown = berth_rpc::shutdown_signal();
        run_service(berth_revisions::SPEC, args.listen, &args.tls, &args.state, &args.mesh, shutdown).await
    })
}
