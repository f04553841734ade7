//! Flags shared by the service binaries, each with a `BERTH_*` environment
//! fallback.

use std::path::PathBuf;
use std::time::Duration;

use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_store::ElectionTiming;

use crate::StartError;

/// The certificate a process serves and dials with, and the CA bundle it trusts.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// PEM certificate chain of this process (leaf first).
    #[arg(long, env = "BERTH_TLS_CERT", value_name = "FILE")]
    pub tls_cert: PathBuf,
    /// PEM private key of this process.
    #[arg(long, env = "BERTH_TLS_KEY", value_name = "FILE")]
    pub tls_key: PathBuf,
    /// PEM bundle of the CAs whose certificates this process accepts.
    #[arg(long, env = "BERTH_CA_FILE", value_name = "FILE")]
    pub ca_file: PathBuf,
}

impl TlsArgs {
    /// Loads the three files into live credentials.
    pub fn load(&self) -> Result<TlsCredentials, StartError> {
        let material =
            TlsMaterial::from_files(&self.tls_cert, &self.tls_key, &self.ca_file).map_err(StartError::Tls)?;
        TlsCredentials::new(material).map_err(StartError::Tls)
    }
}

/// Where a control-plane service keeps its state.
#[derive(Debug, Clone, clap::Args)]
pub struct StateArgs {
    /// `postgres://user@host:5432/db` (production; the service uses its own
    /// schema) or `sqlite://PATH` (a single replica).
    #[arg(long, env = "BERTH_DATABASE_URL", value_name = "URL")]
    pub database_url: String,
    /// `redis://host:6379` for the shared bus, or `memory://` for an
    /// in-process one (a single replica only).
    #[arg(long, env = "BERTH_REDIS_URL", value_name = "URL", default_value = "memory://")]
    pub redis_url: String,
    /// How long the leader of an elected loop (identity's monitor, leases'
    /// reaper, revisions' deployer, egress's full pass) holds the lead
    /// without renewing it: how long that loop stands still when its leader
    /// dies. Renewed, and tried by the other replicas, every third of it.
    #[arg(long, env = "BERTH_LEADER_TTL", value_name = "DURATION", default_value = "15s",
          value_parser = parse_leader_ttl)]
    pub leader_ttl: Duration,
}

impl StateArgs {
    /// The election timing `--leader-ttl` makes.
    pub fn election(&self) -> ElectionTiming {
        ElectionTiming::from_ttl(self.leader_ttl)
    }
}

/// The shortest `--leader-ttl`: a third of it must leave room for a
/// database round trip under load.
const MIN_LEADER_TTL: Duration = Duration::from_secs(3);

fn parse_leader_ttl(text: &str) -> Result<Duration, String> {
    let ttl = crate::parse_duration(text)?;
    if ttl < MIN_LEADER_TTL {
        return Err(format!("{text} is too short: a leader's lease must be at least {MIN_LEADER_TTL:?}"));
    }
    Ok(ttl)
}

/// Logging and tracing.
#[derive(Debug, Clone, clap::Args)]
pub struct TelemetryArgs {
    /// Log format on stderr: `text` or `json`.
    #[arg(long, env = "BERTH_LOG_FORMAT", value_name = "FORMAT", default_value = "text")]
    pub log_format: String,
    /// OTLP/gRPC collector to export traces to; unset, traces are not exported.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// The log filter when `RUST_LOG` is unset (`info` when this is unset):
    /// a command-line tool keeps its output clean with `warn`.
    #[arg(skip)]
    pub default_log_filter: Option<&'static str>,
    /// Resource attributes on every span this process exports, on top of
    /// `service.name` and `host.name`, e.g. the node an agent runs.
    #[arg(skip)]
    pub resource: Vec<(String, String)>,
}

/// Where the rest of the mesh is.
#[derive(Debug, Clone, clap::Args)]
pub struct MeshArgs {
    /// The identity service (`host:port`), followed for node revocations.
    /// Unset, this service refuses revoked nodes only when their
    /// certificates expire.
    #[arg(long, env = "BERTH_IDENTITY_ADDR", value_name = "HOST:PORT")]
    pub identity_addr: Option<String>,
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Flags {
        #[command(flatten)]
        state: StateArgs,
    }

    fn state(extra: &[&str]) -> Result<StateArgs, clap::Error> {
        let args = [&["flags", "--database-url", "sqlite://x.db"], extra].concat();
        Flags::try_parse_from(args).map(|flags| flags.state)
    }

    #[test]
    fn the_leader_ttl_sets_every_election_and_refuses_a_lease_too_short_to_renew() {
        let default = state(&[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(default.election().ttl, Duration::from_secs(15));
        let short = state(&["--leader-ttl", "6s"]).unwrap_or_else(|e| panic!("{e}"));
        let election = short.election();
        assert_eq!(
            (election.ttl, election.renew_every, election.retry_every),
            (Duration::from_secs(6), Duration::from_secs(2), Duration::from_secs(2))
        );
        let refused = state(&["--leader-ttl", "2s"]).map(|_| ()).unwrap_err().to_string();
        assert!(refused.contains("2s is too short"), "{refused}");
    }
}
