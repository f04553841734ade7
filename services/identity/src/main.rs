//! `berth-identity`: the identity service binary.

use std::net::SocketAddr;
use std::process::ExitCode;

use berth_runtime::{StateArgs, TelemetryArgs, TlsArgs, run_main, run_service};
use clap::Parser;

/// The berth identity service: the mesh root of trust and host register: CA, join tokens, node join and heartbeats, the node registry and revocation.
#[derive(Debug, Parser)]
#[command(name = "berth-identity", version)]
struct Args {
    /// Address to serve mTLS gRPC on.
    #[arg(long, env = "BERTH_LISTEN", default_value = "0.0.0.0:7443")]
    listen: SocketAddr,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_main("berth-identity", &args.telemetry, || async {
        let shutdown = berth_rpc::shutdown_signal();
        run_service(berth_identity::SPEC, args.listen, &args.tls, &args.state, shutdown).await
    })
}
