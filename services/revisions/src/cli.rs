//! The `berth-revisions` binary's flags and startup: the flags every
//! control-plane service takes (listen address, certificates, state, mesh,
//! telemetry) plus where leases is, which registries may be spoken to over
//! plain HTTP and with which credentials, the rollout deadline and the
//! revision GC policy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use berth_runtime::{ServiceFlags, StartError, parse_duration, run_main, serve_replica, start_service};
use clap::Parser;

use crate::{
    DEFAULT_PORT, Dependencies, GrpcLeases, LeaseClient, NoLeases, RegistryPolicy, RegistrySecrets, RevisionsConfig,
    RevisionsService, SPEC,
};

/// The berth revisions service: services, their immutable revisions, rollout
/// and rollback.
#[derive(Debug, Parser)]
#[command(name = "berth-revisions", version)]
struct Args {
    /// Address to serve mTLS gRPC on.
    #[arg(long, env = "BERTH_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)))]
    listen: SocketAddr,
    /// The leases service (`host:port`), asked for every replica. Unset,
    /// services are accepted and revisions minted but nothing runs.
    #[arg(long, env = "BERTH_LEASES_ADDR", value_name = "HOST:PORT")]
    leases_addr: Option<String>,
    #[command(flatten)]
    registries: berth_bundle::RegistryArgs,
    /// A JSON file of named registry credentials, which templates name with
    /// `bundle.secret`: `{"NAME": {"registry": "HOST", "username": "U",
    /// "password": "P"}}` or `{"NAME": {"token": "T"}}`. Revisions resolves
    /// tags with them and hands them to nodes for their leases' pulls.
    #[arg(long, env = "BERTH_REGISTRY_CREDENTIALS", value_name = "FILE")]
    registry_credentials: Option<PathBuf>,
    /// Let templates name `oci:DIR:TAG` layout directories; only for meshes
    /// whose control plane and every node share that directory.
    #[arg(long, env = "BERTH_ALLOW_OCI_LAYOUTS")]
    allow_oci_layouts: bool,
    /// How long a new revision's replicas have to all run before it is failed
    /// and the live revision keeps serving (e.g. 90s, 5m).
    #[arg(long, env = "BERTH_PROGRESS_DEADLINE", default_value = "5m", value_name = "DURATION",
          value_parser = parse_duration)]
    progress_deadline: Duration,
    /// The longest a revision that stopped taking traffic keeps its replicas
    /// waiting for every live router to stop sending to it and the requests
    /// it sent to finish (e.g. 30s).
    #[arg(long, env = "BERTH_DRAIN", default_value = "30s", value_name = "DURATION", value_parser = parse_duration)]
    drain: Duration,
    /// How many non-live revisions of each service are kept.
    #[arg(long, env = "BERTH_REVISIONS_KEEP", default_value_t = crate::DEFAULT_GC_KEEP, value_name = "N")]
    revisions_keep: usize,
    /// How old a revision must be before it may be collected (e.g. 1h).
    #[arg(long, env = "BERTH_REVISIONS_MIN_AGE", default_value = "1h", value_name = "DURATION",
          value_parser = parse_duration)]
    revisions_min_age: Duration,
    #[command(flatten)]
    service: ServiceFlags,
}

impl Args {
    fn config(&self) -> RevisionsConfig {
        RevisionsConfig {
            progress_deadline: self.progress_deadline,
            drain: self.drain,
            gc_keep: self.revisions_keep,
            gc_min_age: self.revisions_min_age,
            election: self.service.state.election(),
            ..RevisionsConfig::default()
        }
    }
}

/// Parses the flags and serves until SIGTERM or Ctrl-C.
pub fn binary_main() -> ExitCode {
    let args = Args::parse();
    let telemetry = args.service.telemetry.clone();
    run_main("berth-revisions", &telemetry, || run(args))
}

async fn run(args: Args) -> Result<(), StartError> {
    let shutdown = berth_rpc::shutdown_signal();
    let started = start_service(SPEC, args.listen, &args.service, &shutdown).await?;
    let leases: Arc<dyn LeaseClient> = match &args.leases_addr {
        Some(addr) => Arc::new(
            GrpcLeases::connect(addr, started.credentials.clone())
                .map_err(|e| StartError::Invalid(format!("--leases-addr: {e}")))?,
        ),
        None => {
            tracing::warn!("no --leases-addr: services are accepted but none of their replicas runs");
            Arc::new(NoLeases)
        }
    };
    let config = args.config();
    let ca_pem = args.registries.ca_pem().map_err(|e| {
        let path = args.registries.registry_ca.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
        StartError::Invalid(format!("--registry-ca: cannot read {path}: {e}"))
    })?;
    let policy = RegistryPolicy {
        insecure_registries: args.registries.insecure_registries(),
        ca_pem,
        allow_layouts: args.allow_oci_layouts,
        mirrors: args.registries.registry_mirrors.clone(),
    };
    let secrets = match &args.registry_credentials {
        Some(path) => {
            RegistrySecrets::from_file(path).map_err(|e| StartError::Invalid(format!("--registry-credentials: {e}")))?
        }
        None => RegistrySecrets::none(),
    };
    tracing::info!(names = ?secrets.names(), "registry credentials loaded");
    let dependencies = Dependencies::with_secrets(leases, policy, secrets, &config)
        .map_err(|e| StartError::Invalid(format!("registry client: {e}")))?;
    let service = RevisionsService::new(&started.ctx, config, dependencies);
    serve_replica(SPEC, &service, started, shutdown).await
}

#[cfg(test)]
mod tests {
    use berth_testkit::parse_service_flags;

    use super::*;

    #[test]
    fn insecure_registries_repeat_and_durations_parse() {
        let flags = [
            "--leases-addr",
            "127.0.0.1:7445",
            "--insecure-registry",
            "registry.lan",
            "--insecure-registry",
            "cache.lan:5000",
            "--progress-deadline",
            "90s",
        ];
        let args: Args = parse_service_flags("berth-revisions", &flags).unwrap();
        assert_eq!(args.registries.insecure_registries(), ["registry.lan", "cache.lan:5000"]);
        assert_eq!(args.config().progress_deadline, Duration::from_secs(90));
        assert_eq!(args.config().gc_keep, crate::DEFAULT_GC_KEEP);
        assert_eq!(args.leases_addr.as_deref(), Some("127.0.0.1:7445"));
        assert_eq!(args.listen.port(), DEFAULT_PORT);
    }

    #[test]
    fn registry_mirrors_repeat_in_order_and_a_bad_one_names_the_form() {
        let flags = [
            "--registry-mirror",
            "docker.io=mirror.lan:5000",
            "--registry-mirror",
            "docker.io=backup.lan:5000,credentials ghcr.io=mirror.lan:5000",
        ];
        let args: Args = parse_service_flags("berth-revisions", &flags).unwrap();
        let shown: Vec<String> = args.registries.registry_mirrors.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            ["docker.io=mirror.lan:5000", "docker.io=backup.lan:5000,credentials", "ghcr.io=mirror.lan:5000"]
        );
        let bad =
            parse_service_flags::<Args>("berth-revisions", &["--registry-mirror", "mirror.lan:5000"]).unwrap_err();
        assert!(bad.to_string().contains("ORIGIN=MIRROR"), "{bad}");
    }
}
