//! `berth-agent`: the node agent binary.

use std::net::SocketAddr;
use std::process::ExitCode;

use berth_runtime::{CERT_POLL_INTERVAL, TelemetryArgs, TlsArgs, bind, run_main, watch_cert_files};
use clap::Parser;

/// The berth node agent: runs a host's share of the work and serves the
/// agent API to the control plane.
#[derive(Debug, Parser)]
#[command(name = "berth-agent", version)]
struct Args {
    /// Address to serve the agent API (mTLS gRPC) on.
    #[arg(long, env = "BERTH_LISTEN", default_value = "0.0.0.0:7447")]
    listen: SocketAddr,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_main("berth-agent", &args.telemetry, || async {
        let shutdown = berth_rpc::shutdown_signal();
        let credentials = args.tls.load()?;
        let listener = bind(args.listen, credentials.clone()).await?;
        watch_cert_files(args.tls.clone(), credentials.clone(), CERT_POLL_INTERVAL, shutdown.clone());
        berth_agent::serve(listener, credentials, shutdown).await
    })
}
