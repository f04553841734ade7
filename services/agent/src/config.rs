//! How an agent is configured: where the control plane is, how the host joins
//! it, what the host offers, and the timings of its control loops.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::container::{DEFAULT_PIDS_LIMIT, OciRuntime, UidRange};
use crate::egress::{EgressIsolation, ProxyTiming};
use crate::host::Capacity;
use crate::microvm::MicroVmConfig;
use crate::node_ports::NodePorts;

/// The first wait after a failed call to the control plane.
/// How long compute may be held in custody before the agent warns about it, by default.
pub const DEFAULT_CUSTODY_WARNING: Duration = Duration::from_secs(300);

pub const DEFAULT_RETRY_INITIAL: Duration = Duration::from_millis(500);

/// The longest wait between retries: an agent that lost the control plane
/// notices it is back within this long.
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(30);

/// How long one Join or Heartbeat call may take before it counts as failed.
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest heartbeat interval the agent accepts from the server, so a
/// zero or tiny interval can never make it spin.
pub const DEFAULT_MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(100);

/// The longest heartbeat interval the agent accepts from the server.
pub const DEFAULT_MAX_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5 * 60);

/// How often leases are renewed until the leases service has said what its
/// TTL is (after that, a third of it).
pub const DEFAULT_RENEW_INTERVAL: Duration = Duration::from_secs(5);

/// How often the node compares what it runs with its open leases.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// How long a finished instance's logs and working directory are kept.
pub const DEFAULT_RETAIN_FINISHED: Duration = Duration::from_secs(60 * 60);

/// How long a memory decrease waits, by default, for a workload to use less
/// than its new limit before it is deferred.
pub(crate) const DEFAULT_RESIZE_SETTLE: Duration = Duration::from_secs(10);

/// How often a followed log is read for new output.
pub const DEFAULT_LOG_POLL: Duration = Duration::from_millis(250);

/// How much disk the bundle cache may use before it evicts bundles no lease
/// holds: the bundle cache's own default.
pub const DEFAULT_BUNDLE_CACHE_BUDGET: u64 = berth_bundle::DEFAULT_CACHE_BUDGET_BYTES;

/// The timings of the lease runner. Production uses [`Default`]; tests
/// shrink them to milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How often leases are renewed until the leases service's TTL is known.
    pub renew_interval: Duration,
    /// How often the node reconciles what it runs with its open leases.
    pub sweep_interval: Duration,
    /// Between SIGTERM and SIGKILL when a workload is destroyed.
    pub stop_grace: Duration,
    /// How often a workload adopted after a restart is looked for in `/proc`.
    pub exit_poll: Duration,
    /// How often a followed log is read for new output.
    pub log_poll: Duration,
    /// How long a finished instance's logs and directory are kept.
    pub retain_finished: Duration,
    /// How long a memory decrease waits for a workload to use less than its
    /// new limit before it is deferred.
    pub resize_settle: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        Self {
            renew_interval: DEFAULT_RENEW_INTERVAL,
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
            stop_grace: crate::provider::DEFAULT_STOP_GRACE,
            exit_poll: crate::provider::DEFAULT_EXIT_POLL,
            log_poll: DEFAULT_LOG_POLL,
            retain_finished: DEFAULT_RETAIN_FINISHED,
            resize_settle: DEFAULT_RESIZE_SETTLE,
        }
    }
}

/// What runs the node's workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadRuntime {
    /// The process runtime: each workload contained by the agent itself
    /// (namespaces, cgroups, its own user), without a runtime binary.
    Process,
    /// Containers through this OCI runtime binary.
    Oci(OciRuntime),
    /// Each workload in a microVM of its own (see [`crate::MicroVmProvider`]).
    MicroVm,
    /// Plain host processes as the agent's user, contained by nothing:
    /// only with `allow_uncontained`.
    Uncontained,
}

impl WorkloadRuntime {
    /// From the agent's `--runtime` (`process`, `oci` or `microvm`) and `--oci-runtime`.
    pub fn from_flags(runtime: &str, oci: OciRuntime) -> Result<Self, String> {
        match runtime {
            "process" => Ok(WorkloadRuntime::Process),
            "oci" => Ok(WorkloadRuntime::Oci(oci)),
            "microvm" => Ok(WorkloadRuntime::MicroVm),
            other => Err(format!("unknown runtime '{other}': expected process, oci or microvm")),
        }
    }

    /// The OCI runtime the container provider drives for it, if any.
    pub fn container_runtime(self) -> Option<OciRuntime> {
        match self {
            WorkloadRuntime::Process => Some(OciRuntime::Own),
            WorkloadRuntime::Oci(oci) => Some(oci),
            WorkloadRuntime::MicroVm | WorkloadRuntime::Uncontained => None,
        }
    }

    /// Whether it contains its workloads.
    pub fn contained(self) -> bool {
        self != WorkloadRuntime::Uncontained
    }

    /// The memory, in bytes, each workload holds beyond its lease's size,
    /// and the least it holds whatever the lease asks: a microVM's VMM
    /// allowance and its smallest guest; none for the others, whose
    /// workloads hold what their cgroups allow.
    pub fn memory_overhead(self) -> (u64, u64) {
        match self {
            // The guest is the workload's memory and a reserve (at least the smallest
            // guest); QEMU's allowance is beside it.
            WorkloadRuntime::MicroVm => {
                let reserve = u64::from(crate::microvm::GUEST_RESERVE_MIB) << 20;
                let smallest = u64::from(berth_microvm::vmm::MIN_MEMORY_MIB) << 20;
                (crate::microvm::VMM_ALLOWANCE + reserve, smallest.saturating_sub(reserve))
            }
            _ => (0, 0),
        }
    }

    /// Its name in the node's `berth.runtime` label.
    pub fn label(self) -> &'static str {
        match self {
            WorkloadRuntime::MicroVm => "microvm",
            other => other.container_runtime().unwrap_or(OciRuntime::Own).name(),
        }
    }
}

impl std::fmt::Display for WorkloadRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkloadRuntime::Process => f.write_str("process (contained by the agent)"),
            WorkloadRuntime::Oci(runtime) => write!(f, "oci ({runtime})"),
            WorkloadRuntime::MicroVm => f.write_str("microvm (a VM of its own per workload)"),
            WorkloadRuntime::Uncontained => f.write_str("process (uncontained)"),
        }
    }
}

/// How the node contains its workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Containment {
    /// What runs them.
    pub runtime: WorkloadRuntime,
    /// The users they run as.
    pub uids: UidRange,
    /// How many processes each may have at once.
    pub pids_limit: i64,
    /// Whether the agent may run workloads uncontained (the process
    /// runtime, or a host where the OCI runtime cannot run) instead of
    /// refusing to start.
    pub allow_uncontained: bool,
    /// Whether the agent turns on the host's cgroup2 `favordynmods` option
    /// when it contains workloads, so each launch's move into its cgroup
    /// does not wait for an RCU grace period (see
    /// [`crate::favor_cgroup_migrations`]).
    pub favor_cgroup_migrations: bool,
    /// The host ports workloads are given.
    pub node_ports: NodePorts,
}

impl Default for Containment {
    /// Containers through runc, and no start without them.
    fn default() -> Self {
        Self {
            runtime: WorkloadRuntime::Oci(OciRuntime::for_host()),
            uids: UidRange::default(),
            pids_limit: DEFAULT_PIDS_LIMIT,
            allow_uncontained: false,
            favor_cgroup_migrations: false,
            node_ports: NodePorts::default(),
        }
    }
}

impl Containment {
    /// Plain host processes, as the agent's own user: for tests of what is
    /// not containment, and hosts where an operator chose it.
    pub fn uncontained() -> Self {
        Self { runtime: WorkloadRuntime::Uncontained, allow_uncontained: true, ..Self::default() }
    }
}

/// The timings of the agent's calls to the control plane. Production uses
/// [`Default`]; tests shrink them to milliseconds.
#[derive(Debug, Clone)]
pub struct AgentTiming {
    /// The first wait after a failed call; it doubles up to `retry_max`.
    pub retry_initial: Duration,
    /// The longest wait between retries.
    pub retry_max: Duration,
    /// How long one call may take.
    pub rpc_timeout: Duration,
    /// The heartbeat interval the server gives is raised to at least this.
    pub min_heartbeat_interval: Duration,
    /// The heartbeat interval the server gives is lowered to at most this.
    pub max_heartbeat_interval: Duration,
}

impl Default for AgentTiming {
    fn default() -> Self {
        Self {
            retry_initial: DEFAULT_RETRY_INITIAL,
            retry_max: DEFAULT_RETRY_MAX,
            rpc_timeout: DEFAULT_RPC_TIMEOUT,
            min_heartbeat_interval: DEFAULT_MIN_HEARTBEAT_INTERVAL,
            max_heartbeat_interval: DEFAULT_MAX_HEARTBEAT_INTERVAL,
        }
    }
}

impl AgentTiming {
    /// The server's heartbeat interval, held within the accepted bounds.
    pub(crate) fn heartbeat_interval(&self, server_ms: u32) -> Duration {
        let max = self.max_heartbeat_interval.max(self.min_heartbeat_interval);
        Duration::from_millis(u64::from(server_ms)).clamp(self.min_heartbeat_interval, max)
    }
}

/// Everything an agent needs to join (or resume) and run.
#[derive(Clone)]
pub struct AgentConfig {
    /// The identity service, `host:port`; several replicas as
    /// `host:port,host:port`, which the node spreads over and moves between
    /// (see the agent's `identity_servers` module).
    pub server: String,
    /// The CA bundle (PEM) that the identity service's certificate must chain
    /// to when joining. Only needed to join: a resumed agent trusts the bundle
    /// it keeps in its data directory, which heartbeats keep current. May be
    /// empty when the data directory already holds an identity.
    pub ca_bundle_pem: String,
    /// The join token; needed to join the first time, and to rejoin when the
    /// node's own certificate can no longer do it (expired, or the node was
    /// forgotten).
    pub join_token: Option<String>,
    /// A file holding the join token, read at every join and rejoin, so a
    /// mounted Secret that is updated in place (a rotated token) is used
    /// without a restart. Takes precedence over `join_token` while it holds
    /// one.
    pub join_token_file: Option<PathBuf>,
    /// Where the node's identity is kept across restarts.
    pub data_dir: PathBuf,
    /// `host:port` where the control plane reaches this agent's API; its host
    /// is written into the node certificate.
    pub advertise_addr: String,
    /// Where the agent API listens (port 0 picks a free one).
    pub listen: SocketAddr,
    /// The tier the host asks for; empty takes the token's.
    pub tier: String,
    /// The host's name for operators.
    pub name: String,
    /// Extra labels for the node; the token's labels win on conflict.
    pub labels: BTreeMap<String, String>,
    /// The compute the node offers to leases.
    pub capacity: Capacity,
    /// The agent's version, reported at join and on every heartbeat.
    pub version: String,
    /// Retry and heartbeat timings.
    pub timing: AgentTiming,
    /// The leases service, `host:port`; with none, the node runs no leases.
    pub leases: Option<String>,
    /// The revisions service, `host:port`, asked for the registry
    /// credentials of leases whose bundle names some; with none, such
    /// bundles are pulled anonymously.
    pub revisions: Option<String>,
    /// The lease runner's timings.
    pub lease_timing: LeaseTiming,
    /// How long compute may be held in custody (after the node's session
    /// ended, or at start, until the leases service confirms it) before it
    /// is destroyed; `None` holds it until the leases service decides.
    pub max_custody: Option<Duration>,
    /// How long compute may be held in custody before the agent warns, every
    /// sweep, that it holds compute it cannot account for.
    pub custody_warning: Duration,
    /// How long lease renewals may fail (counted from the last one that
    /// went through) before the node stops everything it runs; `None` keeps
    /// it running until the leases service can be reached.
    pub stop_after_disconnect: Option<Duration>,
    /// Where the host's tooling writes an interruption notice (see the
    /// agent's `interruption` module); `None` is `DATA_DIR/interruption-notice`.
    pub interruption_file: Option<PathBuf>,
    /// How long an interruption notice that names no deadline gives the node.
    pub interruption_deadline: Duration,
    /// Disk the bundle cache (`DATA_DIR/bundles`) may use before it evicts
    /// bundles no lease holds.
    pub bundle_cache_budget: u64,
    /// The most output one stream of one workload keeps before it is
    /// rotated (see `log_rotation`).
    pub log_max_bytes: u64,
    /// Registries bundles are pulled from over plain HTTP, `host` or
    /// `host:port`; loopback registries always are.
    pub insecure_registries: Vec<String>,
    /// Mirrors asked, in order, before the registries they mirror.
    pub registry_mirrors: Vec<berth_bundle::RegistryMirror>,
    /// PEM certificates of a private registry's CA, trusted beside the
    /// system roots.
    pub registry_ca_pem: Option<String>,
    /// The egress service, `host:port`; with it every replica reaches the
    /// network only through its tenant's egress proxy, and with none
    /// replicas are not held to any egress plan.
    pub egress: Option<String>,
    /// Whether replicas run in their tenant's network namespace (with an
    /// egress service configured).
    pub egress_isolation: EgressIsolation,
    /// The router's cleartext HTTP listener, `host:port`, as the node
    /// reaches it: with it an isolated replica resolves
    /// `<service>.<project>.berth.internal` and reaches the service through
    /// the router; with none those names are refused.
    pub router: Option<String>,
    /// The egress proxy's timings.
    pub proxy_timing: ProxyTiming,
    /// What runs workloads, and how they are contained.
    pub containment: Containment,
    /// Where the microVM runtime finds QEMU, the guest kernel and the guest
    /// init, and how guest code runs.
    pub microvm: MicroVmConfig,
    /// The executable that acts as the process runtime (`berth-runtime`,
    /// `berth-agent` or `berth`); `None` is `berth-runtime` beside the
    /// running one, else the running one itself. Set where the agent runs
    /// inside another program, as a test's.
    pub process_runtime_exe: Option<PathBuf>,
    /// Whether every workload gets a credential of its own (an X.509-SVID
    /// naming its lease, and the SPIFFE Workload API) before it starts; a
    /// launch whose credential cannot be minted fails.
    pub workload_identity: bool,
    /// How the agent is restarted into a new binary by a fleet upgrade.
    pub upgrades: crate::upgrades::UpgradeSettings,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("server", &self.server)
            .field("join_token", &self.join_token.as_ref().map(|_| "<redacted>"))
            .field("data_dir", &self.data_dir)
            .field("advertise_addr", &self.advertise_addr)
            .field("listen", &self.listen)
            .field("tier", &self.tier)
            .field("name", &self.name)
            .field("labels", &self.labels)
            .field("capacity", &self.capacity)
            .field("version", &self.version)
            .field("timing", &self.timing)
            .field("leases", &self.leases)
            .field("revisions", &self.revisions)
            .field("lease_timing", &self.lease_timing)
            .field("max_custody", &self.max_custody)
            .field("custody_warning", &self.custody_warning)
            .field("stop_after_disconnect", &self.stop_after_disconnect)
            .field("interruption_file", &self.interruption_file)
            .field("interruption_deadline", &self.interruption_deadline)
            .field("bundle_cache_budget", &self.bundle_cache_budget)
            .field("log_max_bytes", &self.log_max_bytes)
            .field("insecure_registries", &self.insecure_registries)
            .field("registry_mirrors", &self.registry_mirrors)
            .field("egress", &self.egress)
            .field("egress_isolation", &self.egress_isolation)
            .field("router", &self.router)
            .field("proxy_timing", &self.proxy_timing)
            .field("containment", &self.containment)
            .field("workload_identity", &self.workload_identity)
            .field("upgrades", &self.upgrades)
            .finish_non_exhaustive()
    }
}

impl AgentConfig {
    /// A configuration with the defaults for everything but what has none:
    /// the server, the data directory, the advertised address, where to
    /// listen, and the capacity.
    pub fn new(
        server: impl Into<String>,
        data_dir: impl Into<PathBuf>,
        advertise_addr: impl Into<String>,
        listen: SocketAddr,
        capacity: Capacity,
    ) -> Self {
        Self {
            server: server.into(),
            ca_bundle_pem: String::new(),
            join_token: None,
            join_token_file: None,
            data_dir: data_dir.into(),
            advertise_addr: advertise_addr.into(),
            listen,
            tier: String::new(),
            name: String::new(),
            labels: BTreeMap::new(),
            capacity,
            version: env!("CARGO_PKG_VERSION").to_string(),
            timing: AgentTiming::default(),
            leases: None,
            revisions: None,
            lease_timing: LeaseTiming::default(),
            max_custody: None,
            custody_warning: DEFAULT_CUSTODY_WARNING,
            stop_after_disconnect: None,
            interruption_file: None,
            interruption_deadline: crate::interruption::DEFAULT_DEADLINE,
            bundle_cache_budget: DEFAULT_BUNDLE_CACHE_BUDGET,
            log_max_bytes: crate::log_rotation::DEFAULT_LOG_MAX_BYTES,
            insecure_registries: Vec::new(),
            registry_mirrors: Vec::new(),
            registry_ca_pem: None,
            egress: None,
            egress_isolation: EgressIsolation::default(),
            router: None,
            proxy_timing: ProxyTiming::default(),
            containment: Containment::default(),
            microvm: MicroVmConfig::default(),
            process_runtime_exe: None,
            workload_identity: true,
            upgrades: crate::upgrades::UpgradeSettings {
                deadline: crate::upgrades::DEFAULT_UPGRADE_DEADLINE,
                ..crate::upgrades::UpgradeSettings::default()
            },
        }
    }

    /// The join token, when one was given and is not blank: the token
    /// file's content as it is now, else `join_token`.
    pub(crate) fn token(&self) -> Option<String> {
        let from_file = self.join_token_file.as_ref().and_then(|path| match std::fs::read_to_string(path) {
            Ok(token) => Some(token),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "cannot read the join token file");
                None
            }
        });
        [from_file, self.join_token.clone()]
            .into_iter()
            .flatten()
            .map(|token| token.trim().to_owned())
            .find(|token| !token.is_empty())
    }

    /// The identity replicas in `server`, in order (checked by [`Self::validate`]).
    pub(crate) fn identity_servers(&self) -> Vec<String> {
        crate::identity_servers::parse(&self.server).unwrap_or_else(|_| vec![self.server.clone()])
    }

    /// Checks what can be checked before any I/O; the message names the field.
    pub(crate) fn validate(&self) -> Result<(), String> {
        crate::identity_servers::parse(&self.server)?;
        if self.advertise_addr.trim().is_empty() {
            return Err("advertise_addr: the host:port the control plane reaches this agent at is required".into());
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err("data_dir: a directory to keep the node identity in is required".into());
        }
        if self.leases.as_deref().is_some_and(|addr| addr.trim().is_empty()) {
            return Err("leases: the leases service address must be host:port, or not given at all".into());
        }
        if self.egress.as_deref().is_some_and(|addr| addr.trim().is_empty()) {
            return Err("egress: the egress service address must be host:port, or not given at all".into());
        }
        if self.lease_timing.sweep_interval.is_zero() || self.lease_timing.renew_interval.is_zero() {
            return Err("lease_timing: the sweep and renew intervals must be positive".into());
        }
        if self.capacity.cpu_millis == 0 || self.capacity.memory_bytes == 0 {
            return Err(format!("capacity: cpu and memory must both be positive, got {:?}", self.capacity));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_intervals_are_held_within_bounds() {
        let timing = AgentTiming::default();
        assert_eq!(timing.heartbeat_interval(0), DEFAULT_MIN_HEARTBEAT_INTERVAL, "zero would spin");
        assert_eq!(timing.heartbeat_interval(5_000), Duration::from_secs(5));
        assert_eq!(timing.heartbeat_interval(u32::MAX), DEFAULT_MAX_HEARTBEAT_INTERVAL);
    }

    /// A complete configuration for an agent of one host.
    fn sample_config() -> AgentConfig {
        AgentConfig::new(
            "identity:7443",
            "/tmp/x",
            "10.0.0.1:7447",
            "0.0.0.0:7447".parse().unwrap(),
            Capacity { cpu_millis: 1000, memory_bytes: 1 << 30 },
        )
    }

    #[test]
    fn the_join_token_never_appears_in_debug_output() {
        let mut config = sample_config();
        config.join_token = Some("berth-join.abc.s3cret".into());
        let debug = format!("{config:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
    }

    #[test]
    fn a_token_file_is_read_at_each_join_and_wins_while_it_holds_one() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        let mut config = sample_config();
        config.join_token = Some("from-the-flag".into());
        config.join_token_file = Some(file.clone());
        assert_eq!(config.token().as_deref(), Some("from-the-flag"), "no file yet: the flag");
        std::fs::write(&file, "first\n").unwrap();
        assert_eq!(config.token().as_deref(), Some("first"));
        // The Secret is updated in place: the next join reads the new token.
        std::fs::write(&file, "rotated").unwrap();
        assert_eq!(config.token().as_deref(), Some("rotated"));
        std::fs::write(&file, "  \n").unwrap();
        assert_eq!(config.token().as_deref(), Some("from-the-flag"), "a blank file is no token");
    }

    #[test]
    fn missing_fields_are_named() {
        let mut config = AgentConfig::new("", "/tmp/x", "a:1", "0.0.0.0:0".parse().unwrap(), Capacity::default());
        assert!(config.validate().unwrap_err().starts_with("server"));
        config.server = "identity:7443".into();
        assert!(config.validate().unwrap_err().starts_with("capacity"));
        config.capacity = Capacity { cpu_millis: 1, memory_bytes: 1 };
        config.join_token = Some("  ".into());
        assert_eq!(config.token(), None, "a blank token is no token");
        config.validate().unwrap();
    }
}
