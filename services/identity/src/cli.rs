//! The identity binary's flags and startup.
//!
//! Identity holds the CA, so it needs no certificate files: it issues its
//! own serving certificate (`identity.svc.berth.internal` plus
//! `--advertise-names`) and renews it, and can mirror the CA bundle to a
//! file for agents and operators to pin.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use berth_core::Identity;
use berth_runtime::{
    StartError, StateArgs, TelemetryArgs, bind, open_store, parse_duration, run_main, wait_for_bus, wait_for_store,
};
use clap::Parser;

use crate::authority::{AUTH_SECRET_MIN_LEN, AuthorityTiming};
use crate::keeper::{KeptIdentity, spawn_keeper};
use crate::{
    Endpoints, GrpcLaunchLedger, IdentityConfig, IdentityService, LaunchLedger, MIGRATIONS, NAME, NodeTiming,
    WORKLOAD_CERT_TTL_RANGE, WorkloadSettings, parse_trust_domain,
};

/// How long identity's own serving certificate lives; renewed at half.
const SERVING_CERT_TTL: Duration = Duration::from_secs(24 * 3600);

/// The berth identity service: the CA, join tokens, node join and
/// heartbeats, the node registry and revocation.
#[derive(Debug, Parser)]
#[command(
    name = "berth-identity",
    version,
    after_help = "`berth-identity reseal --help`: re-seal the CA keys under a new auth secret."
)]
struct Args {
    /// Address to serve mTLS gRPC on.
    #[arg(long, env = "BERTH_LISTEN", default_value = "0.0.0.0:7443")]
    listen: SocketAddr,
    /// Secret the CA private key is sealed under (at least 32 characters).
    /// Every replica needs the same one; losing it loses the CA.
    #[arg(
        long,
        env = "BERTH_AUTH_SECRET",
        hide_env_values = true,
        required_unless_present = "auth_secret_file",
        conflicts_with = "auth_secret_file"
    )]
    auth_secret: Option<String>,
    /// A file holding the auth secret instead: read again whenever the
    /// stored CA key no longer opens under the secret in memory, so a
    /// replica follows `berth-identity reseal` without a restart.
    #[arg(long, env = "BERTH_AUTH_SECRET_FILE", value_name = "FILE")]
    auth_secret_file: Option<PathBuf>,
    /// Host names and IPs clients dial identity by, written into the
    /// certificate identity issues itself (comma separated).
    #[arg(long, env = "BERTH_ADVERTISE_NAMES", value_delimiter = ',', default_value = "localhost,127.0.0.1")]
    advertise_names: Vec<String>,
    /// Where a service of the mesh is reached, as `NAME=HOST:PORT`, told to
    /// every client that asks (`Mesh/GetEndpoints`), so the CLI needs only
    /// identity's address; `NAME=:PORT` is at the host the client reached
    /// identity by (repeat, or comma separate: revisions, leases, egress,
    /// router).
    #[arg(long = "endpoint", env = "BERTH_ENDPOINTS", value_delimiter = ',', value_name = "NAME=HOST:PORT")]
    endpoints: Vec<String>,
    /// The leases service (`host:port`), asked whether a lease is open on a
    /// node before identity signs its workload's certificate. Unset, no
    /// workload certificate is signed.
    #[arg(long, env = "BERTH_LEASES_ADDR", value_name = "HOST:PORT")]
    leases_addr: Option<String>,
    /// The SPIFFE trust domain workload certificates name
    /// (`spiffe://<trust-domain>/ns/<project>/...`).
    #[arg(long, env = "BERTH_TRUST_DOMAIN", default_value = berth_core::TRUST_DOMAIN, value_parser = parse_trust_domain)]
    trust_domain: String,
    /// How long a workload certificate lives; nodes renew it at half.
    #[arg(long, env = "BERTH_WORKLOAD_CERT_TTL", default_value = "15m", value_parser = parse_workload_cert_ttl)]
    workload_cert_ttl: Duration,
    /// Write the CA bundle here on start and whenever it changes (for agents
    /// and clients to pin).
    #[arg(long, env = "BERTH_CA_BUNDLE_OUT", value_name = "FILE")]
    ca_bundle_out: Option<PathBuf>,
    /// Lifetime of node certificates, in seconds; agents renew past half.
    #[arg(long, env = "BERTH_NODE_CERT_TTL", default_value_t = 3600, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(10..=30 * 24 * 3600))]
    node_cert_ttl: u64,
    /// How often nodes heartbeat (handed to them at join and on every beat).
    #[arg(long, env = "BERTH_HEARTBEAT_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    heartbeat_interval: Duration,
    /// A node silent this long is marked DOWN.
    #[arg(long, env = "BERTH_DOWN_AFTER", default_value = "15s", value_parser = parse_duration)]
    down_after: Duration,
    /// A node DOWN this long is reaped: its incarnation moves on and it must rejoin.
    #[arg(long, env = "BERTH_REAP_AFTER", default_value = "5m", value_parser = parse_duration)]
    reap_after: Duration,
    /// A reaped node's row is forgotten after this long (revoked rows are kept for audit).
    #[arg(long, env = "BERTH_FORGET_AFTER", default_value = "7d", value_parser = parse_duration)]
    forget_after: Duration,
    /// How agent artifacts named by `UpgradeNodes` are resolved.
    #[command(flatten)]
    registries: berth_bundle::RegistryArgs,
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

/// Re-seal the CA keys under a new auth secret, all in one transaction,
/// with no replica stopped: replicas given --auth-secret-file take up the
/// new secret from their file; the others keep signing and must be
/// restarted with it before the next CA rotation. The old secret opens
/// nothing afterwards.
#[derive(Debug, Parser)]
#[command(name = "berth-identity reseal", version)]
struct ResealArgs {
    /// A file holding the secret the CA keys are sealed under now.
    #[arg(long, value_name = "FILE")]
    old_secret_file: PathBuf,
    /// A file holding the secret to seal them under (at least 32 characters).
    #[arg(long, value_name = "FILE")]
    new_secret_file: PathBuf,
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

/// Parses the flags and runs identity until SIGTERM or Ctrl-C, or runs
/// `berth-identity reseal`.
pub fn main() -> ExitCode {
    if std::env::args_os().nth(1).is_some_and(|first| first == "reseal") {
        let args = ResealArgs::parse_from(std::env::args_os().skip(1));
        let telemetry = args.telemetry.clone();
        return run_main("berth-identity", &telemetry, || reseal(args));
    }
    let args = Args::parse();
    let telemetry = args.telemetry.clone();
    run_main("berth-identity", &telemetry, || run(args))
}

async fn reseal(args: ResealArgs) -> Result<(), StartError> {
    let read = |path: &PathBuf| {
        crate::authority::read_secret_file(path).map_err(|error| StartError::Invalid(error.to_string()))
    };
    let (old, new) = (read(&args.old_secret_file)?, read(&args.new_secret_file)?);
    if new.len() < AUTH_SECRET_MIN_LEN {
        return Err(StartError::Invalid(format!("the new secret must be at least {AUTH_SECRET_MIN_LEN} characters")));
    }
    let store = open_store(&args.state.database_url, NAME, MIGRATIONS).await?;
    let done = crate::Authority::reseal(&store, &old, &new).await;
    store.close().await;
    let done = done.map_err(|e| StartError::Invalid(e.to_string()))?;
    println!(
        "re-sealed {} CA key(s) under the new secret ({} already were); replicas given --auth-secret-file take it up \
         from their file, every other replica needs it before its next start",
        done.resealed, done.already
    );
    Ok(())
}

async fn run(args: Args) -> Result<(), StartError> {
    if let Some(secret) = &args.auth_secret
        && secret.len() < AUTH_SECRET_MIN_LEN
    {
        return Err(StartError::Invalid(format!("--auth-secret must be at least {AUTH_SECRET_MIN_LEN} characters")));
    }
    check_timing(args.heartbeat_interval, args.down_after, args.reap_after).map_err(StartError::Invalid)?;
    let endpoints = Endpoints::parse(&args.endpoints).map_err(|e| StartError::Invalid(format!("--endpoint: {e}")))?;
    let timing = NodeTiming {
        heartbeat_interval: args.heartbeat_interval,
        down_after: args.down_after,
        reap_after: args.reap_after,
        forget_after: args.forget_after,
        election: args.state.election(),
        ..NodeTiming::default()
    };
    let shutdown = berth_rpc::shutdown_signal();
    let store = wait_for_store(&args.state.database_url, NAME, MIGRATIONS, &shutdown).await?;
    let bus = wait_for_bus(&args.state.redis_url, NAME, &shutdown).await?;
    let config = IdentityConfig {
        auth_secret: args.auth_secret.unwrap_or_default(),
        authority: AuthorityTiming::default(),
        node_cert_ttl: Duration::from_secs(args.node_cert_ttl),
    };
    let readiness = berth_runtime::store_readiness(&store);
    let service = match &args.auth_secret_file {
        Some(path) => IdentityService::open_with_secret_file(store, bus, config, path).await,
        None => IdentityService::open(store, bus, config).await,
    }
    .map_err(|e| StartError::Invalid(e.to_string()))?
    .with_node_timing(timing)
    .with_endpoints(endpoints)
    .with_agent_registry(args.registries.client().map_err(StartError::Invalid)?);
    let me = Identity::service(NAME).map_err(|e| StartError::Invalid(e.to_string()))?;
    let kept = KeptIdentity::issue(service.authority(), me, args.advertise_names, SERVING_CERT_TTL)
        .await
        .map_err(|e| StartError::Invalid(e.to_string()))?;
    let ledger = match &args.leases_addr {
        Some(addr) => Some(Arc::new(
            GrpcLaunchLedger::connect(addr, kept.credentials.clone())
                .map_err(|e| StartError::Invalid(format!("--leases-addr: {e}")))?,
        ) as Arc<dyn LaunchLedger>),
        None => {
            tracing::warn!("no --leases-addr: identity signs no workload certificate");
            None
        }
    };
    let service = service.with_workload_settings(WorkloadSettings {
        trust_domain: args.trust_domain,
        cert_ttl: args.workload_cert_ttl,
        ledger,
    });
    let listener = bind(args.listen, kept.credentials.clone()).await?;
    spawn_keeper(service.authority().clone(), vec![kept], SERVING_CERT_TTL, args.ca_bundle_out, shutdown.clone());
    service.spawn_loops(&shutdown);
    tracing::info!(addr = %args.listen, "identity serving");
    service.server().with_readiness(readiness).serve(listener, shutdown).await?;
    Ok(())
}

/// A workload certificate lifetime within [`WORKLOAD_CERT_TTL_RANGE`].
fn parse_workload_cert_ttl(value: &str) -> Result<Duration, String> {
    let ttl = parse_duration(value)?;
    let (shortest, longest) = WORKLOAD_CERT_TTL_RANGE;
    if ttl < shortest || ttl > longest {
        return Err(format!("{value} is outside {shortest:?} to {longest:?}"));
    }
    Ok(ttl)
}

/// The node timings make sense together: a node is marked DOWN only after
/// missing more than one heartbeat, and reaped some time after that
/// (`--reap-after` counts from the moment it went DOWN, so it may be
/// shorter than `--down-after`).
fn check_timing(heartbeat: Duration, down_after: Duration, reap_after: Duration) -> Result<(), String> {
    if down_after <= heartbeat {
        return Err(format!(
            "--down-after ({down_after:?}) must be longer than --heartbeat-interval ({heartbeat:?}), or every \
             node is marked DOWN between two heartbeats"
        ));
    }
    if reap_after.is_zero() {
        return Err("--reap-after must be longer than zero: it counts from the moment a node went DOWN".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaping_counts_from_down_so_it_may_be_shorter_than_down_after() {
        let s = Duration::from_secs;
        assert_eq!(check_timing(s(1), s(5), s(3)), Ok(()));
        assert_eq!(check_timing(s(5), s(15), s(300)), Ok(()));
        let refused = check_timing(s(5), s(5), s(300)).unwrap_err();
        assert!(refused.starts_with("--down-after (5s) must be longer than --heartbeat-interval (5s)"), "{refused}");
        assert!(check_timing(s(1), s(5), s(0)).unwrap_err().starts_with("--reap-after"));
    }
}
