//! `berth-agent`: the node agent binary.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use berth_agent::{AgentConfig, AgentError, Capacity, Containment, EgressIsolation, UidRange};
use berth_runtime::{StartError, TelemetryArgs, parse_duration, parse_size, run_main};
use clap::{CommandFactory as _, FromArgMatches as _, Parser};

/// Where Linux keeps the host name.
const HOSTNAME_FILE: &str = "/proc/sys/kernel/hostname";

/// The berth node agent: joins this host to the control plane, heartbeats,
/// keeps its certificate renewed, runs the leases assigned to the host, and
/// serves the agent API.
///
/// The first start joins with --join-token and keeps the node identity in
/// --data-dir; later starts resume it without a token. The agent exits
/// non-zero when an operator revokes the node.
#[derive(Debug, Parser)]
#[command(name = "berth-agent", version)]
struct Args {
    /// The identity service to join and heartbeat to. Several replicas as
    /// host:port,host:port: the fleet spreads over them (each node prefers
    /// the one its id hashes to), and a node whose replica fails moves on to
    /// the next. A DNS name that resolves to several addresses spreads too.
    #[arg(long, env = "BERTH_SERVER", value_name = "HOST:PORT[,HOST:PORT…]")]
    server: String,
    /// PEM bundle of the CA that identity's certificate must chain to. Needed
    /// to join; a joined node keeps the bundle current by itself.
    #[arg(long, env = "BERTH_CA_FILE", value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// The join token an operator created (`berth token create`). Needed to
    /// join the first time, and to rejoin when the node certificate cannot
    /// (expired, or the node was forgotten).
    #[arg(long, env = "BERTH_JOIN_TOKEN", value_name = "TOKEN", hide_env_values = true)]
    join_token: Option<String>,
    /// A file holding the join token (a mounted Secret), read again at every
    /// join and rejoin, so a rotated token is picked up without a restart;
    /// used before --join-token while it holds one.
    #[arg(long, env = "BERTH_JOIN_TOKEN_FILE", value_name = "FILE")]
    join_token_file: Option<PathBuf>,
    /// Where the node identity (key, certificate, CA bundle, node id) is kept
    /// across restarts. One agent per directory.
    #[arg(long, env = "BERTH_DATA_DIR", value_name = "DIR", default_value = "/var/lib/berth/agent")]
    data_dir: PathBuf,
    /// Where the control plane reaches this agent's API; its host is written
    /// into the node certificate. An IPv6 host may come without brackets
    /// (`$(POD_IP):7447` on an IPv6 cluster).
    #[arg(long, env = "BERTH_ADVERTISE_ADDR", value_name = "HOST:PORT",
          value_parser = |value: &str| Ok::<_, String>(berth_core::bracket_ipv6(value)))]
    advertise_addr: String,
    /// Address to serve the agent API (mTLS gRPC) on.
    #[arg(long, env = "BERTH_LISTEN", value_name = "ADDR", default_value = "0.0.0.0:7447")]
    listen: SocketAddr,
    /// The tier to join, e.g. "gpu"; empty takes the join token's tier.
    #[arg(long, env = "BERTH_TIER", value_name = "TIER", default_value = "")]
    tier: String,
    /// The host's name for operators [default: the host name].
    #[arg(long, env = "BERTH_NODE_NAME", value_name = "NAME")]
    name: Option<String>,
    /// Extra node labels, KEY=VALUE (repeat, or comma separated); the join
    /// token's labels win on conflict.
    #[arg(long = "label", env = "BERTH_LABELS", value_name = "KEY=VALUE", value_delimiter = ',', value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// CPU offered to leases, in thousandths of a core [default: every CPU
    /// this process may use, times 1000].
    #[arg(long, env = "BERTH_CPU_MILLIS", value_name = "MILLIS")]
    cpu_millis: Option<u64>,
    /// Memory offered to leases, in bytes [default: MemTotal].
    #[arg(long, env = "BERTH_MEMORY_BYTES", value_name = "BYTES")]
    memory_bytes: Option<u64>,
    /// The leases service to take assignments from. Without it the node
    /// runs no leases.
    #[arg(long, env = "BERTH_LEASES_ADDR", value_name = "HOST:PORT")]
    leases_addr: Option<String>,
    /// The revisions service, asked for the registry credentials of a
    /// lease whose bundle names some. Without it, such bundles are pulled
    /// anonymously.
    #[arg(long, env = "BERTH_REVISIONS_ADDR", value_name = "HOST:PORT")]
    revisions_addr: Option<String>,
    /// The egress service to follow the node's egress plans from. With it,
    /// every replica reaches the network only through its tenant's egress
    /// proxy; without it, replicas are not held to any egress plan.
    #[arg(long, env = "BERTH_EGRESS_ADDR", value_name = "HOST:PORT")]
    egress_addr: Option<String>,
    /// Whether replicas run in their tenant's network namespace, whose only
    /// way out is the tenant's egress proxy: `auto` where the host allows it
    /// (root on Linux, with `ip`), `required` to refuse to start otherwise,
    /// `off` to only point replicas at the proxy. Without isolation the node
    /// reports its egress enforcement as advisory.
    #[arg(long, env = "BERTH_EGRESS_ISOLATION", value_name = "MODE", default_value = "auto",
        value_parser = str::parse::<EgressIsolation>)]
    egress_isolation: EgressIsolation,
    /// The router's cleartext HTTP listener as this node reaches it: with
    /// it, an isolated replica resolves `<service>.<project>.berth.internal`
    /// (through its tenant's resolver) and reaches the service through the
    /// router; without it those names are refused.
    #[arg(long, env = "BERTH_ROUTER_ADDR", value_name = "HOST:PORT")]
    router_addr: Option<String>,
    /// Whether every workload gets a credential of its own before it starts:
    /// an X.509-SVID naming its lease, signed by identity's workload
    /// authority, as files at $BERTH_IDENTITY_DIR and over the SPIFFE
    /// Workload API at $SPIFFE_ENDPOINT_SOCKET. A launch whose credential
    /// cannot be minted fails with reason IdentityUnavailable.
    #[arg(long, env = "BERTH_WORKLOAD_IDENTITY", value_name = "BOOL", default_value_t = true,
        action = clap::ArgAction::Set)]
    workload_identity: bool,
    /// How long a workload may run in custody (after the node's session
    /// ended, or after a restart, until the leases service confirms it)
    /// before it is destroyed, e.g. 10m. Unset holds it until the leases
    /// service decides.
    #[arg(long, env = "BERTH_MAX_CUSTODY", value_name = "DURATION", value_parser = parse_duration)]
    max_custody: Option<Duration>,
    /// Warn, every sweep, once compute has been held in custody this long
    /// (it runs, but the node cannot account for it yet), e.g. 5m.
    #[arg(long, env = "BERTH_CUSTODY_WARNING", value_name = "DURATION", value_parser = parse_duration,
          default_value = "5m")]
    custody_warning: Duration,
    /// Stop every workload once lease renewals have failed this long,
    /// counted from the last renewal that went through, e.g. 8s (Nomad's
    /// stop_after_client_disconnect). The leases service gives an unrenewed
    /// lease to another node after its TTL (30s by default); renewals are
    /// retried at least every third of it and a workload has --stop-grace to
    /// exit, so a bound under two thirds of the TTL less the stop grace has
    /// the work gone before a replacement starts. Unset keeps it running,
    /// whatever the outage, until the leases service is reached again.
    #[arg(long, env = "BERTH_STOP_AFTER_DISCONNECT", value_name = "DURATION", value_parser = parse_duration)]
    stop_after_disconnect: Option<Duration>,
    /// Where the host's tooling writes an interruption notice (a spot
    /// interruption, maintenance): the node drains itself with the deadline
    /// the file holds (`2m`; empty means --interruption-deadline). SIGUSR1
    /// is a notice too [default: DATA_DIR/interruption-notice].
    #[arg(long, env = "BERTH_INTERRUPTION_FILE", value_name = "PATH")]
    interruption_file: Option<PathBuf>,
    /// How long an interruption notice that names no deadline gives the node.
    #[arg(long, env = "BERTH_INTERRUPTION_DEADLINE", value_name = "DURATION", value_parser = parse_duration,
          default_value = "2m")]
    interruption_deadline: Duration,
    /// How long a workload has to exit after SIGTERM before SIGKILL.
    #[arg(long, env = "BERTH_STOP_GRACE", value_name = "DURATION", value_parser = parse_duration, default_value = "10s")]
    stop_grace: Duration,
    /// How often what the node runs is reconciled with its open leases.
    #[arg(long, env = "BERTH_SWEEP_INTERVAL", value_name = "DURATION", value_parser = parse_duration, default_value = "30s")]
    sweep_interval: Duration,
    /// Disk the bundle cache (under --data-dir) may use before it evicts
    /// bundles no lease runs: bytes, or a number with KiB, MiB, GiB, TiB
    /// (or KB, MB, GB, TB in powers of 1000), e.g. 10GiB.
    #[arg(long, env = "BERTH_BUNDLE_CACHE_BUDGET", value_name = "SIZE", value_parser = parse_size, default_value = "20GiB")]
    bundle_cache_budget: u64,
    /// The most output one stream (stdout or stderr) of one workload keeps:
    /// past it the file is rotated, one earlier generation kept beside it.
    #[arg(long, env = "BERTH_LOG_MAX_BYTES", value_name = "SIZE", value_parser = parse_size, default_value = "16MiB")]
    log_max_bytes: u64,
    #[command(flatten)]
    registries: berth_bundle::RegistryArgs,
    #[command(flatten)]
    runtime: berth_agent::RuntimeArgs,
    /// The guest kernel's directory under --runtime microvm (a `vmlinuz`
    /// and the modules the guest loads; scripts/microvm-deps.sh lays it out
    /// from Debian's cloud kernel).
    #[arg(long, env = "BERTH_MICROVM_KERNEL", value_name = "DIR", default_value = "/opt/berth/microvm/kernel")]
    microvm_kernel: PathBuf,
    /// The QEMU binary under --runtime microvm.
    #[arg(long, env = "BERTH_QEMU", value_name = "PATH", default_value = "qemu-system-x86_64")]
    qemu: PathBuf,
    /// The host uids (and gids) workloads run as, FIRST-LAST: each running
    /// workload takes one of its own (a microVM's, for the directories it
    /// shares with the node). Must hold neither 0 nor the agent's uid.
    #[arg(long, env = "BERTH_WORKLOAD_UIDS", value_name = "FIRST-LAST", default_value = "200000-299999",
        value_parser = str::parse::<UidRange>)]
    workload_uids: UidRange,
    /// The host ports workloads are given, FIRST-LAST (each port a workload
    /// declares takes one). Keep it outside the host's ephemeral range
    /// (net.ipv4.ip_local_port_range), which outgoing connections take
    /// their local ports from; the agent warns at start where they overlap.
    #[arg(long, env = "BERTH_NODE_PORTS", value_name = "FIRST-LAST", default_value = "61000-65535",
        value_parser = str::parse::<berth_agent::NodePorts>)]
    node_ports: berth_agent::NodePorts,
    /// How many processes one workload may have at once.
    #[arg(long, env = "BERTH_WORKLOAD_PIDS_LIMIT", value_name = "N", default_value_t = berth_agent::DEFAULT_PIDS_LIMIT)]
    workload_pids_limit: i64,
    /// Run workloads uncontained (as the agent's user, seeing the host)
    /// where the node cannot contain them, instead of refusing to start.
    /// The node then says so in its `berth.contained` label and its logs.
    #[arg(long, env = "BERTH_ALLOW_UNCONTAINED")]
    allow_uncontained: bool,
    /// Turn on the host's cgroup2 `favordynmods` mount option (kernel 6.0+)
    /// so moving a workload into its cgroup does not wait for an RCU grace
    /// period (5-25 ms a launch): the moves of runc, crun and runsc, of the
    /// process runtime on cgroup v2, and of a microVM's QEMU. The process
    /// runtime on v1 and hybrid hosts starts each workload inside its cgroup
    /// and never waits. It is kernel-wide (forks and exits get slightly
    /// slower) and lasts until reboot.
    #[arg(long, env = "BERTH_CGROUP_FAVORDYNMODS")]
    cgroup_favordynmods: bool,
    /// The systemd unit this agent runs as (the shipped unit sets it): a
    /// fleet upgrade's updater restarts the agent with `systemctl restart`.
    /// Without it the updater stops this process and starts the new binary
    /// with this command line.
    #[arg(long, env = "BERTH_SYSTEMD_UNIT", value_name = "UNIT")]
    systemd_unit: Option<String>,
    /// How long a new agent installed by a fleet upgrade has to report in
    /// before the updater puts this one back.
    #[arg(long, env = "BERTH_UPGRADE_DEADLINE", value_name = "DURATION", value_parser = parse_duration,
          default_value = "60s")]
    upgrade_deadline: Duration,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => Ok((key.trim().to_string(), value.trim().to_string())),
        _ => Err(format!("expected KEY=VALUE, got '{text}'")),
    }
}

impl Args {
    fn config(self) -> Result<AgentConfig, StartError> {
        let host = |e: berth_agent::HostError| StartError::Invalid(e.to_string());
        let capacity = Capacity {
            cpu_millis: match self.cpu_millis {
                Some(millis) => millis,
                None => berth_agent::detect_cpu_millis().map_err(host)?,
            },
            memory_bytes: match self.memory_bytes {
                Some(bytes) => bytes,
                None => berth_agent::detect_memory_bytes().map_err(host)?,
            },
        };
        let ca_bundle_pem = match &self.ca_file {
            Some(path) => {
                let pem = std::fs::read_to_string(path).map_err(|source| StartError::Io {
                    what: "cannot read the CA file",
                    path: path.display().to_string(),
                    source,
                })?;
                berth_mtls::certs_from_pem("CA bundle", &pem)
                    .map_err(|e| StartError::Invalid(format!("--ca-file {}: {e}", path.display())))?;
                pem
            }
            None => String::new(),
        };
        let name = self.name.filter(|n| !n.trim().is_empty()).unwrap_or_else(host_name);
        let mut config = AgentConfig::new(self.server, self.data_dir, self.advertise_addr, self.listen, capacity);
        config.ca_bundle_pem = ca_bundle_pem;
        config.join_token = self.join_token;
        config.join_token_file = self.join_token_file;
        config.tier = self.tier;
        config.name = name;
        config.labels = self.labels.into_iter().collect::<BTreeMap<_, _>>();
        config.leases = self.leases_addr.filter(|addr| !addr.trim().is_empty());
        config.revisions = self.revisions_addr.filter(|addr| !addr.trim().is_empty());
        config.egress = self.egress_addr.filter(|addr| !addr.trim().is_empty());
        config.egress_isolation = self.egress_isolation;
        config.router = self.router_addr.filter(|addr| !addr.trim().is_empty());
        config.workload_identity = self.workload_identity;
        config.max_custody = self.max_custody;
        config.custody_warning = self.custody_warning;
        config.stop_after_disconnect = self.stop_after_disconnect;
        config.interruption_file = self.interruption_file.clone();
        config.interruption_deadline = self.interruption_deadline;
        config.lease_timing.stop_grace = self.stop_grace;
        config.lease_timing.sweep_interval = self.sweep_interval;
        config.bundle_cache_budget = self.bundle_cache_budget;
        config.log_max_bytes = self.log_max_bytes;
        config.upgrades = berth_agent::UpgradeSettings {
            systemd_unit: self.systemd_unit.clone().filter(|unit| !unit.trim().is_empty()),
            agent_args: std::env::args().skip(1).collect(),
            deadline: self.upgrade_deadline,
        };
        config.microvm = berth_agent::MicroVmConfig {
            qemu: self.qemu.clone(),
            kernel_dir: self.microvm_kernel.clone(),
            init: None,
            accel: self.runtime.microvm_accel,
        };
        config.containment = Containment {
            runtime: self.runtime.workload_runtime().map_err(StartError::Invalid)?,
            uids: self.workload_uids,
            pids_limit: self.workload_pids_limit,
            allow_uncontained: self.allow_uncontained,
            favor_cgroup_migrations: self.cgroup_favordynmods,
            node_ports: self.node_ports,
        };
        config.insecure_registries = self.registries.insecure_registries();
        config.registry_mirrors = self.registries.registry_mirrors.clone();
        config.registry_ca_pem = self.registries.ca_pem().map_err(|source| StartError::Io {
            what: "cannot read the registry CA file",
            path: self.registries.registry_ca.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            source,
        })?;
        Ok(config)
    }
}

fn host_name() -> String {
    std::fs::read_to_string(HOSTNAME_FILE)
        .ok()
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "node".to_string())
}

/// This build's version: the crate's, with the first 12 hex digits of the
/// running executable's SHA-256 as build metadata (`0.1.0+92697f94dcfc`),
/// so two builds of one release are told apart on every node and a fleet
/// upgrade knows when a node runs the binary it was given.
fn build_version() -> String {
    let base = env!("CARGO_PKG_VERSION");
    match std::env::current_exe().and_then(|exe| berth_agent::updater::sha256_of(&exe)) {
        Ok(sha) => format!("{base}+{}", &sha[..12]),
        Err(_) => base.to_owned(),
    }
}

/// The error and its causes on one line, each cause once.
fn agent_error(error: AgentError) -> StartError {
    StartError::Invalid(berth_runtime::chain(&error))
}

fn main() -> ExitCode {
    // Invoked as the process runtime's monitor or init: nothing else runs.
    if let Some(code) = berth_agent::runtime_main_if_invoked() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    // Invoked as the detached updater (`berth-agent host-upgrade`).
    if let Some(code) = berth_agent::updater::main_if_invoked() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let version = build_version();
    // One string for the process's life: clap's version is a static str.
    let shown: &'static str = Box::leak(version.clone().into_boxed_str());
    let matches = Args::command().version(shown).get_matches();
    let args = match Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(error) => error.exit(),
    };
    let mut telemetry = args.telemetry.clone();
    if let Some(name) = &args.name {
        telemetry.resource.push(("berth.node.name".to_owned(), name.clone()));
    }
    run_main("berth-agent", &telemetry, || async move {
        let shutdown = berth_rpc::shutdown_signal();
        let mut config = args.config()?;
        config.version = version;
        let agent = match berth_agent::start(config, shutdown).await {
            Ok(agent) => agent,
            // Interrupted while joining: the operator asked for it.
            Err(AgentError::Cancelled) => return Ok(()),
            Err(error) => return Err(agent_error(error)),
        };
        tracing::info!(node_id = %agent.node_id(), addr = %agent.local_addr(), "agent running");
        agent.wait().await.map_err(agent_error)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_with_binary_and_decimal_units() {
        assert_eq!(parse_size("1234"), Ok(1234));
        assert_eq!(parse_size("10GiB"), Ok(10 << 30));
        assert_eq!(parse_size("20GiB"), Ok(berth_agent::DEFAULT_BUNDLE_CACHE_BUDGET), "the --help default");
        assert_eq!(parse_size("500 mib"), Ok(500 << 20));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert!(parse_size("10 parsecs").unwrap_err().contains("unknown size unit"));
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999TiB").unwrap_err().contains("64 bits"));
    }
}
