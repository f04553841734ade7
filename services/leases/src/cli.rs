//! The `berth-leases` binary's flags and startup: the flags every
//! control-plane service takes (listen address, certificates, state, mesh,
//! telemetry) plus the lease TTL.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use berth_runtime::{ServiceFlags, StartError, run_main, serve_replica, start_service};
use clap::Parser;

use crate::{CacheRegistryConfig, DEFAULT_PORT, LeasesConfig, LeasesService, SPEC};

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
    /// The most bytes the cache generations of one project may hold in all
    /// (e.g. 50GiB): past it, its oldest generations that are neither a
    /// volume's head nor pinned are collected. No budget without it.
    #[arg(long, env = "BERTH_CACHE_PROJECT_BUDGET", value_name = "SIZE", value_parser = berth_runtime::parse_size)]
    cache_project_budget: Option<u64>,
    /// The registry repository cache generations are pushed to and pulled
    /// from (`host[:port]/path`; each project gets `PATH/PROJECT`, each volume
    /// its key as the tag), so a node that does not hold a volume's head
    /// fetches it. Without it a generation stays on the node that sealed it.
    #[arg(long, env = "BERTH_CACHE_REGISTRY", value_name = "REPOSITORY")]
    cache_registry: Option<String>,
    /// The user nodes give the cache registry; anonymous without it.
    #[arg(long, env = "BERTH_CACHE_REGISTRY_USERNAME", value_name = "USER", requires = "cache_registry")]
    cache_registry_username: Option<String>,
    /// A file holding that user's password.
    #[arg(long, env = "BERTH_CACHE_REGISTRY_PASSWORD_FILE", value_name = "PATH", requires = "cache_registry_username")]
    cache_registry_password_file: Option<std::path::PathBuf>,
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
    let cache_registry = cache_registry(&args)?;
    let started = start_service(SPEC, args.listen, &args.service, &shutdown).await?;
    let service = LeasesService::new(
        &started.ctx,
        LeasesConfig {
            election: args.service.state.election(),
            cache_keep: args.cache_keep,
            cache_registry,
            cache_project_budget: args.cache_project_budget,
            ..LeasesConfig::with_lease_ttl(Duration::from_secs(args.lease_ttl))
        },
    );
    serve_replica(SPEC, &service, started, shutdown).await
}

/// The cache registry the flags name, its password read from its file.
fn cache_registry(args: &Args) -> Result<Option<CacheRegistryConfig>, StartError> {
    let Some(repository) = args.cache_registry.clone() else { return Ok(None) };
    if let Some(problem) = berth_core::cache_repository_problem(&repository) {
        return Err(StartError::Invalid(format!("--cache-registry {repository}: {problem}")));
    }
    let password = match &args.cache_registry_password_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| StartError::Invalid(format!("--cache-registry-password-file {}: {e}", path.display())))?
            .trim_end_matches(['\r', '\n'])
            .to_owned(),
        None => String::new(),
    };
    let username = args.cache_registry_username.clone().unwrap_or_default();
    Ok(Some(CacheRegistryConfig { repository, username, password }))
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
