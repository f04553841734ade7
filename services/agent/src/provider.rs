//! What runs a lease's workload on the host. [`Provider`] is the seam: the
//! process provider runs bare commands today; containers and microVMs fit
//! behind the same trait.
//!
//! # Invariants
//! - A provider records what it starts durably before it reports it
//!   started, so an agent restarted on the same data directory lists it
//!   again through [`Provider::recover`] and can adopt it.
//! - Stopping the agent never stops a workload: only
//!   [`destroy`](Provider::destroy) does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use berth_bundle::ImageUser;

use tokio::sync::watch;

/// The `PATH` a workload gets unless its lease sets one.
pub(crate) const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The variable naming where the workload sees its bundle.
pub(crate) const BUNDLE_DIR_VAR: &str = "BERTH_BUNDLE_DIR";

/// The variable naming where the workload sees its identity directory.
pub(crate) const IDENTITY_DIR_VAR: &str = "BERTH_IDENTITY_DIR";

/// The variable standard SPIFFE clients find the Workload API by.
pub(crate) const SPIFFE_SOCKET_VAR: &str = "SPIFFE_ENDPOINT_SOCKET";

/// What to start for a lease: a program in a root, with the lease's
/// resources and its tenant's network. The provider decides how the root is
/// shown to the workload (the host's own paths, or a container's mounts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// The lease the workload runs for; names its working directory.
    pub lease_id: String,
    /// The epoch the node holds the lease at.
    pub epoch: u64,
    /// The node the workload runs on.
    pub node_id: String,
    /// The files it runs from.
    pub root: WorkloadRoot,
    /// The program.
    pub program: Program,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its environment, on top of what the provider always sets.
    pub env: BTreeMap<String, String>,
    /// The names of the ports it listens on. The provider gives each a free
    /// port on the host (`BERTH_PORT_<NAME>`), the first one also as
    /// `PORT`; with none named it still gets a `PORT`.
    pub ports: Vec<String>,
    /// The compute the lease reserves: a containing provider's limits.
    pub resources: Resources,
    /// The tenant's network namespace, when the node isolates egress.
    pub network: Option<NetworkAttachment>,
    /// What the agent API shows about it.
    pub meta: InstanceMeta,
    /// For a container image, what the lease sets in place of its config.
    pub image: ImageOverrides,
    /// The workload's identity directory on the host (its SVID, key, trust
    /// bundle and Workload API socket; see `svids`), when it has one: the
    /// provider shows it to the workload read-only, and only to it.
    pub identity: Option<PathBuf>,
    /// Its cache volumes' views: each a directory on the host (an overlay
    /// private to the lease) the provider shows read-write at a path inside
    /// the workload's root, given to the workload's user. A provider with no
    /// root of the workload's own refuses a launch that has any.
    pub caches: Vec<CacheBind>,
}

/// One cache volume view shown to a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheBind {
    /// The view on the host.
    pub host: PathBuf,
    /// Where the workload sees it: an absolute path inside its root.
    pub inside: PathBuf,
}

/// What a lease sets in place of its container image's config; empty keeps
/// the image's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageOverrides {
    /// An absolute directory inside the image, for its `WorkingDir`.
    pub working_dir: String,
    /// An account of the image, for its `User`.
    pub user: String,
}

/// The files a workload runs from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum WorkloadRoot {
    /// Nothing of its own: a bare command from the host's files.
    #[default]
    Host,
    /// A verified, extracted bundle.
    Bundle {
        /// Where it is extracted on the host.
        dir: PathBuf,
        /// Its manifest digest.
        digest: String,
    },
    /// A container image's unpacked root filesystem, shared by every lease
    /// of its digest: the workload's whole view, which the provider gives it
    /// copy-on-write so it never changes what another lease sees.
    Image {
        /// Where it is unpacked on the host.
        dir: PathBuf,
        /// Its manifest (or index) digest.
        digest: String,
        /// The working directory inside it; empty means `/`.
        working_dir: String,
        /// The image's `User`, when not root: what the image gives it, which
        /// the provider gives the workload's own ids in the lease's view.
        account: Option<Arc<ImageUser>>,
    },
}

impl WorkloadRoot {
    /// The bundle's directory on the host, when there is one.
    pub fn bundle_dir(&self) -> Option<&Path> {
        match self {
            WorkloadRoot::Host | WorkloadRoot::Image { .. } => None,
            WorkloadRoot::Bundle { dir, .. } => Some(dir),
        }
    }

    /// The image's unpacked root on the host, when it runs one.
    pub fn image_dir(&self) -> Option<&Path> {
        match self {
            WorkloadRoot::Image { dir, .. } => Some(dir),
            WorkloadRoot::Host | WorkloadRoot::Bundle { .. } => None,
        }
    }
}

/// The program a lease runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// The bundle's own entrypoint: what a lease that names no program runs,
    /// until its bundle is known.
    Entrypoint,
    /// A file inside the bundle, relative to its root.
    Bundled(PathBuf),
    /// An absolute path, or a bare name looked up in the workload's `PATH`.
    Command(String),
}

impl Program {
    /// The program a lease names: empty means the bundle's entrypoint.
    pub fn of_lease(command: &str) -> Self {
        if command.is_empty() { Program::Entrypoint } else { Program::Command(command.to_string()) }
    }
}

impl std::fmt::Display for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Program::Entrypoint => f.write_str("the bundle's entrypoint"),
            Program::Bundled(path) => write!(f, "{} in the bundle", path.display()),
            Program::Command(command) => f.write_str(command),
        }
    }
}

/// The compute a lease reserves; zero means not reserved (no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    /// CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
}

/// A change of a running workload's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizeAsk {
    /// What it is limited to now.
    pub from: Resources,
    /// What to limit it to.
    pub to: Resources,
    /// How long a memory decrease may wait for the workload to use less.
    pub settle: Duration,
}

/// How a resize went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resized {
    /// The new limits hold.
    Applied,
    /// Nothing changed; the workload keeps its old limits.
    Deferred {
        /// Why, one CamelCase word: `MemoryInUse`, `Unsupported`.
        reason: &'static str,
        /// A person-readable account.
        message: String,
    },
}

impl Resized {
    /// The answer of a runtime that cannot change a running workload's limits.
    pub fn unsupported(runtime: &str) -> Self {
        Resized::Deferred {
            reason: "Unsupported",
            message: format!("the {runtime} runtime cannot change a running workload's limits"),
        }
    }
}

/// The tenant's network namespace a workload joins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkAttachment {
    /// The namespace's file, e.g. `/run/netns/<name>`.
    pub namespace: PathBuf,
    /// A command line prefix that runs a host program inside it (for a
    /// provider that starts host processes), e.g. `ip netns exec <name>`.
    pub enter: Vec<String>,
    /// The tenant's `resolv.conf` on the host, naming its resolver inside
    /// the namespace: what a contained workload sees at `/etc/resolv.conf`.
    pub resolv_conf: Option<PathBuf>,
}

/// The variable naming a workload's lease in its environment.
pub(crate) const LEASE_ID_ENV: &str = "BERTH_LEASE_ID";

impl LaunchSpec {
    /// The program as the workload sees it, with its bundle at
    /// `bundle_seen_at`.
    pub(crate) fn program_path(&self, bundle_seen_at: Option<&Path>) -> Result<String, ProviderError> {
        match (&self.program, bundle_seen_at) {
            (Program::Command(command), _) if !command.trim().is_empty() => Ok(command.clone()),
            (Program::Bundled(path), Some(bundle)) => Ok(bundle.join(path).display().to_string()),
            _ => Err(ProviderError::Unsupported(format!(
                "lease {} names no program this node can run ({})",
                self.lease_id, self.program
            ))),
        }
    }

    /// The workload's environment: a default `PATH`, `HOME`, the lease's
    /// own variables, then what names it and which the lease cannot
    /// override: `BERTH_LEASE_ID`, `BERTH_NODE_ID`, `BERTH_SERVICE` and
    /// `BERTH_REVISION` (when it has them), `BERTH_BUNDLE_DIR` (with a
    /// bundle), `BERTH_IDENTITY_DIR` and `SPIFFE_ENDPOINT_SOCKET` (with an
    /// identity, seen at `identity_seen_at`), `PORT` and `BERTH_PORT_<NAME>`.
    /// Nothing of the agent's own environment (a join token, for one) is in
    /// it.
    pub(crate) fn environment(
        &self,
        home: &Path,
        bundle_seen_at: Option<&Path>,
        identity_seen_at: Option<IdentitySeen<'_>>,
    ) -> BTreeMap<String, String> {
        let mut env = BTreeMap::from([
            ("PATH".to_string(), DEFAULT_PATH.to_string()),
            ("HOME".to_string(), home.display().to_string()),
        ]);
        env.extend(self.env.clone());
        env.insert(LEASE_ID_ENV.into(), self.lease_id.clone());
        env.insert("BERTH_NODE_ID".into(), self.node_id.clone());
        for (variable, value) in [("BERTH_SERVICE", &self.meta.service), ("BERTH_REVISION", &self.meta.revision)] {
            if !value.is_empty() {
                env.insert(variable.into(), value.clone());
            }
        }
        if let Some(bundle) = bundle_seen_at {
            env.insert(BUNDLE_DIR_VAR.into(), bundle.display().to_string());
        }
        if let Some(identity) = identity_seen_at.filter(|_| self.identity.is_some()) {
            env.insert(IDENTITY_DIR_VAR.into(), identity.dir.display().to_string());
            env.insert(SPIFFE_SOCKET_VAR.into(), format!("unix:{}", identity.socket.display()));
        }
        env.insert("PORT".into(), self.meta.port.to_string());
        env.extend(self.meta.ports.iter().map(|(name, port)| (port_variable(name), port.to_string())));
        env
    }
}

/// Where a workload sees its identity directory and its Workload API
/// socket.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IdentitySeen<'a> {
    /// The directory (`$BERTH_IDENTITY_DIR`).
    pub(crate) dir: &'a Path,
    /// The socket (`$SPIFFE_ENDPOINT_SOCKET`).
    pub(crate) socket: &'a Path,
}

/// `BERTH_PORT_<NAME>` for a port's name: upper case, anything but a letter
/// or digit as `_`.
pub(crate) fn port_variable(name: &str) -> String {
    let name: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect();
    format!("BERTH_PORT_{name}")
}

/// What the agent API shows about an instance besides its process: kept
/// with the instance so a restarted agent can show it before the leases
/// service has said anything.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InstanceMeta {
    /// The tenant; empty means "default".
    pub project: String,
    /// The service it belongs to; empty for a bare lease.
    pub service: String,
    /// The revision it runs; empty for a bare lease.
    pub revision: String,
    /// The bundle digest; empty for a bare command.
    pub digest: String,
    /// The port on the host it was given as `PORT`; 0 before it started.
    pub port: u32,
    /// The port on the host of each of its named ports.
    #[serde(default)]
    pub ports: BTreeMap<String, u32>,
}

/// How a workload ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ExitStatus {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
    /// The kernel killed it for going past its memory limit.
    OutOfMemory,
    /// It ended while no one could wait for it (it was adopted after an
    /// agent restart, so its parent is not this agent): it is known to be
    /// gone, not how it went.
    Unknown,
}

impl ExitStatus {
    /// Whether the workload ended well: exit code 0 and nothing else.
    pub fn success(self) -> bool {
        self == ExitStatus::Code(0)
    }

    /// The exit code, when there is one.
    pub fn code(self) -> Option<i32> {
        match self {
            ExitStatus::Code(code) => Some(code),
            ExitStatus::Signal(_) | ExitStatus::OutOfMemory | ExitStatus::Unknown => None,
        }
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Code(code) => write!(f, "exited with code {code}"),
            ExitStatus::Signal(signal) => match signal_name(*signal) {
                Some(name) => write!(f, "killed by signal {signal} ({name})"),
                None => write!(f, "killed by signal {signal}"),
            },
            ExitStatus::OutOfMemory => f.write_str("killed for going past its memory limit"),
            ExitStatus::Unknown => {
                f.write_str("ended while the agent could not wait for it; its exit status is unknown")
            }
        }
    }
}

fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => return None,
    })
}

/// A workload's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// How it ended.
    pub status: ExitStatus,
    /// When the provider saw it end.
    pub at: SystemTime,
}

/// Resolves to `Some` once the workload has ended.
pub type ExitWatch = watch::Receiver<Option<Exit>>;

/// A workload as the provider records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceRecord {
    /// The lease it runs for.
    pub lease_id: String,
    /// The epoch the node holds the lease at.
    pub epoch: u64,
    /// The process id (for the process provider, also its process group);
    /// `None` when it never started.
    pub pid: Option<u32>,
    /// When it started.
    pub started_at: Option<SystemTime>,
    /// How it ended, once it did.
    pub exit: Option<Exit>,
    /// Whether the agent has told the leases service how it ended (or the
    /// lease was taken away); such an instance is kept only for its logs.
    pub settled: bool,
    /// The phase and reason the agent left it in, once settled; `None` for
    /// an instance settled before records kept them.
    pub settlement: Option<Settlement>,
    /// What the agent API shows about it.
    pub meta: InstanceMeta,
}

/// How the agent left a lease it is done with, kept with the instance so a
/// restarted agent shows the same phase and reason as before the restart.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Settlement {
    /// The lease phase, by its proto name (`LEASE_PHASE_DONE`).
    pub phase: String,
    /// Why, one CamelCase word; may be empty.
    pub reason: String,
}

/// A started or adopted workload: its record, and a watch on its end.
#[derive(Debug)]
pub struct Launched {
    /// The record as written.
    pub record: InstanceRecord,
    /// Fires when it ends.
    pub exit: ExitWatch,
}

/// An instance's resource use, sampled now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceStats {
    /// CPU time used, user and system, of every process of the workload.
    pub cpu_time: Duration,
    /// Resident memory of every process of the workload, in bytes.
    pub memory_bytes: u64,
    /// How long since it started.
    pub uptime: Duration,
}

/// Where an instance's output is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFiles {
    /// Standard output.
    pub stdout: std::path::PathBuf,
    /// Standard error.
    pub stderr: std::path::PathBuf,
}

/// The signals the agent API may send to a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadSignal {
    /// SIGTERM.
    Term,
    /// SIGKILL.
    Kill,
    /// SIGINT.
    Int,
    /// SIGHUP.
    Hup,
    /// SIGUSR1.
    Usr1,
    /// SIGUSR2.
    Usr2,
    /// SIGQUIT.
    Quit,
}

/// Why a provider could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The lease id cannot name a directory.
    #[error("lease id '{0}' is not usable as a directory name")]
    InvalidLeaseId(String),
    /// The workload asks for something this provider cannot run.
    #[error("{0}")]
    Unsupported(String),
    /// No free port could be found on the host for the workload.
    #[error("cannot find a free port for lease {lease_id}: {detail}")]
    NoFreePort {
        /// The lease.
        lease_id: String,
        /// Why.
        detail: String,
    },
    /// The replica's egress (its tenant's proxy, its network namespace)
    /// could not be prepared.
    #[error("cannot prepare egress for lease {lease_id}: {detail}")]
    Egress {
        /// The lease.
        lease_id: String,
        /// Why.
        detail: String,
    },
    /// The program could not be started.
    #[error("cannot start '{command}': {source}")]
    Spawn {
        /// The program.
        command: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The provider has no instance for the lease.
    #[error("no instance for lease {0} on this node")]
    NotFound(String),
    /// The instance exists but does not run.
    #[error("the instance of lease {0} is not running")]
    NotRunning(String),
    /// A workload already runs for the lease.
    #[error("an instance of lease {0} is already running")]
    AlreadyRunning(String),
    /// The workload survived SIGKILL for longer than the provider waits.
    #[error("the instance of lease {lease_id} did not stop: {detail}")]
    Stuck {
        /// The lease.
        lease_id: String,
        /// What still runs.
        detail: String,
    },
    /// A workload's limits could not be changed.
    #[error("cannot resize the instance of lease {lease_id}: {detail}")]
    Resize {
        /// The lease.
        lease_id: String,
        /// Why.
        detail: String,
    },
    /// A signal could not be sent.
    #[error("cannot signal the instance of lease {lease_id}: {source}")]
    Signal {
        /// The lease.
        lease_id: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file of the provider's state could not be read or written.
    #[error(transparent)]
    Io(#[from] crate::files::FileError),
    /// A record on disk does not parse.
    #[error("instance record {path} is unreadable: {detail}")]
    Corrupt {
        /// The record.
        path: String,
        /// What is wrong.
        detail: String,
    },
}

impl ProviderError {
    /// The lease phase reason (one CamelCase word) for a workload that could
    /// not be started because of this error.
    pub fn start_reason(&self) -> &'static str {
        match self {
            ProviderError::Unsupported(_) => "Unsupported",
            ProviderError::InvalidLeaseId(_) => "InvalidLease",
            ProviderError::Spawn { .. } => "StartFailed",
            ProviderError::Egress { .. } => "EgressUnavailable",
            _ => "NodeError",
        }
    }
}

/// Runs workloads for leases.
///
/// Every method returns promptly except [`destroy`](Self::destroy), which
/// waits for the workload to end (up to the provider's grace, then harder).
#[async_trait::async_trait]
pub trait Provider: Send + Sync + std::fmt::Debug {
    /// Starts the workload for `spec.lease_id`.
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, ProviderError>;

    /// Every instance recorded on this host, after a restart: running ones
    /// with a watch that fires when they end, ended ones with their exit
    /// already in the watch.
    async fn recover(&self) -> Result<Vec<Launched>, ProviderError>;

    /// Records that the lease is now held at `epoch` (after custody moved it).
    async fn set_epoch(&self, lease_id: &str, epoch: u64) -> Result<(), ProviderError>;

    /// Records that the instance needs nothing more from the agent but
    /// keeping its logs a while.
    async fn settle(&self, lease_id: &str, settlement: Settlement) -> Result<(), ProviderError>;

    /// Stops the workload and everything it started. Stopping one that
    /// already ended is not an error.
    async fn destroy(&self, lease_id: &str) -> Result<(), ProviderError>;

    /// Forgets the instance: its record, its logs and its working directory.
    async fn remove(&self, lease_id: &str) -> Result<(), ProviderError>;

    /// Sends `signal` to the workload and everything it started.
    async fn signal(&self, lease_id: &str, signal: WorkloadSignal) -> Result<(), ProviderError>;

    /// Samples the workload's resource use.
    async fn stats(&self, lease_id: &str) -> Result<InstanceStats, ProviderError>;

    /// Changes a running workload's limits in place, without restarting
    /// it: increases at once; a memory decrease lowers the soft limit first
    /// and the hard limit only once the workload uses less than it, within
    /// `ask.settle`, else leaves every limit as it was and answers
    /// [`Resized::Deferred`]. A runtime that cannot change a running
    /// workload's limits answers `Deferred` with reason `Unsupported`.
    async fn resize(&self, lease_id: &str, ask: ResizeAsk) -> Result<Resized, ProviderError>;

    /// Where the workload's output goes.
    fn log_files(&self, lease_id: &str) -> Result<LogFiles, ProviderError>;

    /// Whether something listens on the workload's host port `port` where
    /// it runs, for a runtime whose ports accept connections before its
    /// workload does (a VMM's user-mode forwards accept for a guest still
    /// booting); `None` where a connection to the port tells that itself.
    /// Required, not defaulted: a provider that wraps another must pass its
    /// answer on, or a wrapped microVM would be ready while it boots.
    fn listens(&self, lease_id: &str, port: u16) -> Option<bool>;

    /// What runs the workloads, for the node's labels and logs.
    fn runtime(&self) -> Runtime;

    /// The leases whose workloads this provider runs now, as it tracks them:
    /// no side effects, unlike [`Provider::recover`], so a steady sweep may
    /// ask at any time.
    fn running(&self) -> Vec<String>;
}

/// Implements [`Provider`] for a provider that wraps another: the methods
/// given, then every method that reads or touches a running workload
/// (`signal`, `stats`, `resize`, `log_files`, `listens`, `runtime`,
/// `running`) passed to the wrapped one, `|this| this.inner` naming it.
/// The wrapper writes the six that start, adopt, record and end workloads
/// itself, so none of them passes on by accident.
macro_rules! wrapping_provider {
    ($wrapper:ty, |$this:ident| $inner:expr, { $($own:tt)* }) => {
        #[async_trait::async_trait]
        impl $crate::provider::Provider for $wrapper {
            $($own)*

            async fn signal(
                &self,
                lease_id: &str,
                signal: $crate::provider::WorkloadSignal,
            ) -> Result<(), $crate::provider::ProviderError> {
                let $this = self;
                $inner.signal(lease_id, signal).await
            }

            async fn stats(
                &self,
                lease_id: &str,
            ) -> Result<$crate::provider::InstanceStats, $crate::provider::ProviderError> {
                let $this = self;
                $inner.stats(lease_id).await
            }

            async fn resize(
                &self,
                lease_id: &str,
                ask: $crate::provider::ResizeAsk,
            ) -> Result<$crate::provider::Resized, $crate::provider::ProviderError> {
                let $this = self;
                $inner.resize(lease_id, ask).await
            }

            fn log_files(
                &self,
                lease_id: &str,
            ) -> Result<$crate::provider::LogFiles, $crate::provider::ProviderError> {
                let $this = self;
                $inner.log_files(lease_id)
            }

            fn listens(&self, lease_id: &str, port: u16) -> Option<bool> {
                let $this = self;
                $inner.listens(lease_id, port)
            }

            fn runtime(&self) -> $crate::provider::Runtime {
                let $this = self;
                $inner.runtime()
            }

            fn running(&self) -> Vec<String> {
                let $this = self;
                $inner.running()
            }
        }
    };
}
pub(crate) use wrapping_provider;

/// How long a workload has to stop after SIGTERM before it gets SIGKILL.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);

/// How often an adopted process is looked for in `/proc`.
pub const DEFAULT_EXIT_POLL: Duration = Duration::from_secs(1);

/// How a provider stops and watches the processes it runs (the process
/// provider's groups, a container runtime's, a microVM's VMM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessTiming {
    /// Between SIGTERM and SIGKILL when destroying.
    pub stop_grace: Duration,
    /// How often an adopted process is looked for.
    pub exit_poll: Duration,
}

impl Default for ProcessTiming {
    fn default() -> Self {
        Self { stop_grace: DEFAULT_STOP_GRACE, exit_poll: DEFAULT_EXIT_POLL }
    }
}

/// What runs a node's workloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    /// `process`, or the OCI runtime's name (`runc`, `crun`, `runsc`).
    pub name: String,
    /// Whether each workload is contained: its own user, mount and PID
    /// namespaces, no capabilities, and its lease's resources as limits.
    pub contained: bool,
}

#[cfg(test)]
impl LaunchSpec {
    /// A lease running `sh -c script` from the host's files, with no
    /// resources reserved.
    pub(crate) fn for_test(lease_id: &str, script: &str) -> Self {
        LaunchSpec {
            lease_id: lease_id.into(),
            epoch: 1,
            node_id: "n-1".into(),
            root: WorkloadRoot::Host,
            program: Program::Command("sh".into()),
            args: vec!["-c".into(), script.into()],
            env: BTreeMap::from([("GREETING".to_string(), "hello".to_string())]),
            ports: Vec::new(),
            resources: Resources::default(),
            network: None,
            meta: InstanceMeta::default(),
            image: ImageOverrides::default(),
            identity: None,
            caches: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_read_the_way_a_person_says_them() {
        assert_eq!(ExitStatus::Code(3).to_string(), "exited with code 3");
        assert_eq!(ExitStatus::Signal(15).to_string(), "killed by signal 15 (SIGTERM)");
        assert_eq!(ExitStatus::Signal(64).to_string(), "killed by signal 64");
        assert!(ExitStatus::Unknown.to_string().contains("unknown"));
        assert!(ExitStatus::Code(0).success());
        assert!(!ExitStatus::Unknown.success() && !ExitStatus::Signal(9).success());
        assert_eq!(ExitStatus::Code(3).code(), Some(3));
        assert_eq!(ExitStatus::Signal(9).code(), None);
    }
}
