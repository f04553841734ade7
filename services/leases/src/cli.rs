//! The `berth-leases` binary's flags and startup: the flags every
//! control-plane service takes (listen address, certificates, state, mesh,
//! telemetry) plus the lease TTL.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use berth_runtime::{ServiceFlags, StartError, run_main, serve_replica, start_service};
use clap::Parser;

use crate::{DEFAULT_PORT, LeasesConfig, LeasesService, SPEC};

/// The berth leases service: the capacity ledger, placement and the lease
/// lifecycle.
#[derive(Debug, Parser)]
#[command(name = "berth-leases", version)]
struct Args {
    /// Address to serve mTLS gRPC on.
    #[arg(long, env = "BERTH_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)))]
    listen: SocketAddr,
    /// How long a lease lives past its placement or last renewal, in
    /// seconds; nodes renew every third of it. Every replica needs the same.
    #[arg(long, env = "BERTH_LEASE_TTL", default_value_t = 30, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(3..=3600))]
    lease_ttl: u64,
    /// How many generations of each cache volume to keep beside its head and
    /// the pinned ones; older ones are collected as new ones are published.
    #[arg(long, env = "BERTH_CACHE_KEEP", default_value_t = crate::config::DEFAULT_CACHE_KEEP, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    cache_keep: u32,
    #[command(flatten)]
    service: ServiceFlags,
}

/// Parses the flags and runs the ledger until SIGTERM or Ctrl-C.
pub fn binary_main() -> ExitCode {
    let args = Args::parse();
    let telemetry = args.service.telemetry.clone();
    run_main("berth-leases", &telemetry, || run(args))
}

async fn run(args: Args) -> Result<(), StartError> {
    let shutdown = berth_rpc::shutdown_signal();
    if args.service.mesh.identity_addr.is_none() {
        tracing::warn!("no --identity-addr: the ledger learns of no node, so it places no lease");
    }
    let started = start_service(SPEC, args.listen, &args.service, &shutdown).await?;
    let service = LeasesService::new(
        &started.ctx,
        LeasesConfig {
            election: args.service.state.election(),
            cache_keep: args.cache_keep,
            ..LeasesConfig::with_lease_ttl(Duration::from_secs(args.lease_ttl))
        },
    );
    serve_replica(SPEC, &service, started, shutdown).await
}

#[cfg(test)]
mod tests {
    use berth_testkit::parse_service_flags;

    use super::*;

    #[test]
    fn a_lease_ttl_too_short_to_renew_in_is_refused() {
        assert!(parse_service_flags::<Args>("berth-leases", &["--lease-ttl", "1"]).is_err());
        let args: Args = parse_service_flags("berth-leases", &["--lease-ttl", "60"]).unwrap();
        assert_eq!(args.lease_ttl, 60);
        assert_eq!(args.listen.port(), DEFAULT_PORT);
    }
}
