//! The `berth-egress` binary's flags and startup: the flags every
//! control-plane service takes (listen address, certificates, state, mesh,
//! telemetry) plus where revisions and leases are and how the full pass
//! coalesces.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use berth_runtime::{ServiceFlags, StartError, parse_duration, run_main, serve_replica, start_service};
use clap::Parser;

use crate::{DEFAULT_PORT, EgressConfig, EgressService, SPEC, Sources};

/// The berth egress service: each tenant's egress policy, compiled and
/// pushed to the nodes that host it.
#[derive(Debug, Parser)]
#[command(name = "berth-egress", version)]
struct Args {
    /// Address to serve mTLS gRPC on.
    #[arg(long, env = "BERTH_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)))]
    listen: SocketAddr,
    /// The revisions service (`host:port`), followed for each service's
    /// egress selection. Unset, plans list no services.
    #[arg(long, env = "BERTH_REVISIONS_ADDR", value_name = "HOST:PORT")]
    revisions_addr: Option<String>,
    /// The leases service (`host:port`), polled for which tenants each node
    /// hosts. Unset, no node is sent any plan.
    #[arg(long, env = "BERTH_LEASES_ADDR", value_name = "HOST:PORT")]
    leases_addr: Option<String>,
    /// How long a tenant must be quiet before its pending pass runs (e.g. 200ms).
    #[arg(long, env = "BERTH_EGRESS_DEBOUNCE", default_value = "200ms", value_name = "DURATION",
          value_parser = parse_duration)]
    debounce: Duration,
    /// The longest a tenant's pending pass waits however busy it stays (e.g. 2s).
    #[arg(long, env = "BERTH_EGRESS_MAX_DELAY", default_value = "2s", value_name = "DURATION",
          value_parser = parse_duration)]
    max_delay: Duration,
    /// How often every tenant is passed whether or not anything was heard (e.g. 60s).
    #[arg(long, env = "BERTH_EGRESS_FULL_RESYNC", default_value = "60s", value_name = "DURATION",
          value_parser = parse_duration)]
    full_resync: Duration,
    #[command(flatten)]
    service: ServiceFlags,
}

impl Args {
    fn config(&self) -> EgressConfig {
        EgressConfig {
            debounce: self.debounce,
            max_delay: self.max_delay.max(self.debounce),
            full_resync: self.full_resync,
            election: self.service.state.election(),
            ..EgressConfig::default()
        }
    }
}

/// Parses the flags and serves until SIGTERM or Ctrl-C.
pub fn binary_main() -> ExitCode {
    let args = Args::parse();
    let telemetry = args.service.telemetry.clone();
    run_main("berth-egress", &telemetry, || run(args))
}

async fn run(args: Args) -> Result<(), StartError> {
    let shutdown = berth_rpc::shutdown_signal();
    let started = start_service(SPEC, args.listen, &args.service, &shutdown).await?;
    if args.revisions_addr.is_none() {
        tracing::warn!("no --revisions-addr: plans list no services");
    }
    if args.leases_addr.is_none() {
        tracing::warn!("no --leases-addr: no node is sent any plan");
    }
    let sources = Sources::connect(&started.credentials, args.revisions_addr.as_deref(), args.leases_addr.as_deref())
        .map_err(|e| StartError::Invalid(format!("egress: {e}")))?;
    let service = EgressService::new(&started.ctx, args.config(), sources);
    serve_replica(SPEC, &service, started, shutdown).await
}

#[cfg(test)]
mod tests {
    use berth_testkit::parse_service_flags;

    use super::*;

    #[test]
    fn addresses_and_durations_parse() {
        let flags = ["--revisions-addr", "127.0.0.1:7444", "--leases-addr", "127.0.0.1:7445", "--debounce", "50ms"];
        let args: Args = parse_service_flags("berth-egress", &flags).unwrap();
        assert_eq!(args.revisions_addr.as_deref(), Some("127.0.0.1:7444"));
        assert_eq!(args.config().debounce, Duration::from_millis(50));
        assert_eq!(args.config().max_delay, crate::DEFAULT_MAX_DELAY);
        assert_eq!(args.listen.port(), DEFAULT_PORT);
    }
}
