//! The container provider: each lease's workload runs contained, through an
//! OCI runtime binary (`runc`, `crun`, or gVisor's `runsc`), in a root and
//! with limits [`spec`] describes.
//!
//! Namespaces, cgroups, capabilities and the change of user are the runtime
//! binary's work, not hand-written here: those binaries are the audited,
//! widely run implementations, and the agent's own code stays free of
//! `unsafe`. The agent writes the spec, starts the runtime, and keeps the
//! same records as every provider (see [`crate::instances`]).
//!
//! # What is stored
//! ```text
//! DATA_DIR/containers/<lease_id>/config.json   the runtime spec
//! DATA_DIR/containers/<lease_id>/rootfs/       the (read-only) root: mount points,
//!                                              links to the system directories, /etc;
//!                                              for an image, the overlay mounted there
//! DATA_DIR/containers/<lease_id>/upper/        an image lease's writes (overlay upper)
//! DATA_DIR/containers/<lease_id>/overlay/      the overlay's scratch directory
//! DATA_DIR/containers/<lease_id>/etc/          an image lease's hosts and hostname
//! DATA_DIR/containers/<lease_id>/init.pid      the workload's pid on the host
//! DATA_DIR/runtime/<runtime>/                  the runtime's own state (its `--root`)
//! ```
//! plus the record, logs and working directory every provider keeps.
//!
//! # Expected flow
//! - **Launch**: the program is looked for where the workload will see it
//!   (a missing one fails the launch, as for a process); a user is taken
//!   from the agent's range and the working directory given to it; the root
//!   and spec are written; `<runtime> run --keep` starts in its own process
//!   group as the workload's monitor (it waits for the workload, passes its
//!   output through to the log files, forwards signals, and exits with its
//!   status). The launch returns once the workload's pid is known.
//! - **End**: the monitor's exit is the workload's: a status above 128 is a
//!   signal. Before the container is deleted its cgroup is read: a workload
//!   that ended badly after the kernel's OOM killer acted in its cgroup ended
//!   [`ExitStatus::OutOfMemory`].
//! - **Restart**: a restarted agent asks the runtime for each recorded
//!   container's state; a running one is adopted and watched through `/proc`
//!   (pid and start time), an ended one is recorded and deleted, and a
//!   container of this agent's runtime root that no record names is
//!   destroyed.
//! - **Destroy**: SIGTERM to the workload, the grace, then SIGKILL to every
//!   process of the container, then the container is deleted. The PID
//!   namespace dies with its first process, so nothing escapes by `setsid`
//!   or a double fork.
//!
//! - **Images**: a lease running a container image gets the image's shared
//!   unpacked root (from the bundle cache) as the lower layer of an overlay
//!   the agent mounts at its `rootfs/` before the runtime starts, and
//!   unmounts before the directory is removed (on delete, on a relaunch of
//!   the same lease, and in [`destroy_containers`]). An adopted container
//!   keeps its mount: nothing unmounts it until the container is deleted.
//!   An image's `User` is given, in that overlay and before the runtime
//!   starts, what the image gave it (see [`account`]); `HOME` is its home.
//!
//! # Invariants
//! - The shared root of an image is never a container's root itself, only
//!   an overlay's lower layer: no lease changes what another sees.
//! - No two running workloads of this agent share a user: a uid is held by
//!   its instance's record until it ends.
//! - A workload never runs as uid 0 or as the agent's user: the range is
//!   checked when the agent starts.

use std::collections::BTreeSet;
use std::os::unix::fs::DirBuilderExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::instances::{
    Instances, PortBook, StoredRecord, blocking, from_unix_ms, io, load_records, prepare, remove_path, unix_ms,
    validate_lease_id,
};
use crate::node_ports::NodePorts;
use crate::overlay::OverlayError;
use crate::procfs::{self, PROC_ROOT};
use crate::provider::{
    ExitStatus, IdentitySeen, InstanceStats, LaunchSpec, Launched, LogFiles, ProcessTiming, Provider, ProviderError,
    ResizeAsk, Resized, Runtime, Settlement, WorkloadRoot, WorkloadSignal,
};

mod account;
mod own;
pub(crate) use own::Cgroup;
mod spec;

#[cfg(test)]
pub(crate) use self::own::ARG0 as OWN_ARG0;
pub use self::own::{favor_cgroup_migrations, main as runtime_main, main_if_invoked as runtime_main_if_invoked};

pub(crate) use self::spec::{BUNDLE_MOUNT, WORK_MOUNT};
use self::spec::{ContainerPlan, IDENTITY_MOUNT, INIT_MOUNT, ImagePlan, WORKLOAD_API_LINK, runtime_spec};

/// How long a runtime may take to start a workload before the launch fails.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a starting workload's pid file is looked for.
const START_POLL: Duration = Duration::from_millis(1);

/// How long a container may outlive SIGKILL before destroy gives up on it.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How often a stopping workload is looked at.
const STOP_POLL: Duration = Duration::from_millis(25);

/// How many processes a workload may have at once.
pub const DEFAULT_PIDS_LIMIT: i64 = 1024;

/// The smallest memory limit a container gets: the runtime's own init runs
/// in the workload's cgroup before it becomes the workload, and a lease
/// reserving less (a test's 1 MiB, say) could not start at all.
const MIN_MEMORY_LIMIT: u64 = 8 << 20;

/// What gVisor's own kernel takes inside a sandbox's cgroup, added to the
/// lease's memory so the workload itself has what its lease reserves.
const RUNSC_OVERHEAD: u64 = 64 << 20;

/// How often a memory decrease looks again at what the workload uses.
const RESIZE_POLL: Duration = Duration::from_millis(200);

/// Host directories every workload sees read-only at the same paths; those
/// the host lacks are left out, and those that are links (a merged `/usr`)
/// become the same links in the workload's root.
pub(crate) const SYSTEM_DIRS: [&str; 7] = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"];

/// Host files and directories under `/etc` a workload sees read-only: CA
/// certificates and how names are looked up.
pub(crate) const SHARED_ETC: [&str; 4] = ["/etc/ssl", "/etc/ca-certificates", "/etc/nsswitch.conf", "/etc/resolv.conf"];

/// The init every container's workload runs under, where the host has it:
/// tini, as `docker run --init` uses. The workload is not the PID
/// namespace's first process, so a signal it has no handler for still ends
/// it, and what it orphans is reaped instead of piling up as zombies. Both live under `/usr`, which
/// every workload sees.
const INITS: [&str; 2] = ["/usr/bin/tini-static", "/usr/bin/tini"];

/// Where every runtime binary is looked for.
const BINARY_DIRS: [&str; 4] = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"];

const CONTAINER_DIR: &str = "containers";
const RUNTIME_DIR: &str = "runtime";
const PID_FILE: &str = "init.pid";

/// The OCI runtimes the agent drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OciRuntime {
    /// runc: the reference runtime; cgroup v1, hybrid and v2.
    Runc,
    /// crun: a small runtime in C; cgroup v2 only.
    Crun,
    /// runsc: gVisor, a user-space kernel between the workload and the host.
    Runsc,
    /// The process runtime: the agent's own launcher for the same spec
    /// (namespaces, cgroups, a change of user, no runtime binary); see
    /// [`own`]. The node reports it as `process`.
    Own,
}

impl OciRuntime {
    /// The binary's name.
    pub fn name(self) -> &'static str {
        match self {
            OciRuntime::Runc => "runc",
            OciRuntime::Crun => "crun",
            OciRuntime::Runsc => "runsc",
            OciRuntime::Own => "process",
        }
    }

    /// Where its binary is on this host, if it is installed. The process
    /// runtime is `berth-runtime` where it is installed beside the running
    /// executable (it starts faster than the whole agent), else the running
    /// executable itself (`berth-agent` and `berth` both act as it when
    /// invoked by its name).
    pub fn binary(self) -> Option<PathBuf> {
        if self == OciRuntime::Own {
            let beside = std::env::current_exe()
                .ok()
                .and_then(|exe| Some(exe.parent()?.join(own::ARG0)))
                .filter(|path| path.is_file());
            return Some(beside.unwrap_or_else(|| PathBuf::from("/proc/self/exe")));
        }
        BINARY_DIRS.iter().map(|dir| Path::new(dir).join(self.name())).find(|path| path.is_file())
    }

    /// The runtime for a host whose cgroups are as they are now: runc, which
    /// works with every cgroup layout.
    pub fn for_host() -> Self {
        OciRuntime::Runc
    }
}

impl std::str::FromStr for OciRuntime {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "runc" => Ok(OciRuntime::Runc),
            "crun" => Ok(OciRuntime::Crun),
            "runsc" => Ok(OciRuntime::Runsc),
            other => Err(format!("unknown OCI runtime '{other}': expected runc, crun or runsc")),
        }
    }
}

impl std::fmt::Display for OciRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The users workloads run as: `first..first + count` on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// The first uid (and gid) of the range.
    pub first: u32,
    /// How many there are.
    pub count: u32,
}

impl Default for UidRange {
    fn default() -> Self {
        Self { first: 200_000, count: 100_000 }
    }
}

impl std::str::FromStr for UidRange {
    type Err = String;

    /// `FIRST-LAST`, both included.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (first, last) = crate::node_ports::first_last::<u32>(s)
            .map_err(|_| format!("'{s}' is not a uid range: expected FIRST-LAST, e.g. 200000-299999"))?;
        Ok(Self { first, count: last - first + 1 })
    }
}

impl UidRange {
    /// Whether the range holds uid 0 or the agent's own uid: workloads may
    /// never run as either.
    pub fn check(&self, agent_uid: u32) -> Result<(), String> {
        let holds = |uid: u32| uid >= self.first && uid - self.first < self.count;
        if self.count == 0 {
            return Err("the workload uid range is empty".into());
        }
        if holds(0) {
            return Err("the workload uid range holds uid 0 (root)".into());
        }
        if holds(agent_uid) {
            return Err(format!("the workload uid range holds the agent's own uid {agent_uid}"));
        }
        Ok(())
    }
}

/// The uids of a [`UidRange`] a provider hands its workloads: one a
/// running workload, or a launch under way, holds is never handed out again.
#[derive(Debug)]
pub(crate) struct UidPool {
    range: UidRange,
    /// Uids handed to launches whose instance is not tracked yet.
    claimed: Mutex<BTreeSet<u32>>,
}

/// A uid a launch holds until its instance is tracked (then the
/// instance's record holds it); given back when dropped.
#[derive(Debug)]
pub(crate) struct UidClaim<'a> {
    pool: &'a UidPool,
    pub(crate) uid: u32,
}

impl Drop for UidClaim<'_> {
    fn drop(&mut self) {
        self.pool.claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&self.uid);
    }
}

impl UidPool {
    pub(crate) fn new(range: UidRange) -> Self {
        Self { range, claimed: Mutex::new(BTreeSet::new()) }
    }

    /// A uid no running workload of `instances` holds and no other launch
    /// has claimed. The uids held are read with the claims locked (claims
    /// first, then instances, as the node's ports are): a claim is given back
    /// only once its instance is tracked, so each uid in use is seen either
    /// claimed or held, never neither.
    pub(crate) fn claim(&self, instances: &Instances, lease_id: &str) -> Result<UidClaim<'_>, ProviderError> {
        let mut claimed = self.claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let held: BTreeSet<u32> =
            instances.lock().values().filter(|t| t.stored.exit.is_none()).filter_map(|t| t.stored.uid).collect();
        let uid = (0..self.range.count)
            .map(|offset| self.range.first + offset)
            .find(|uid| !held.contains(uid) && !claimed.contains(uid))
            .ok_or_else(|| {
                ProviderError::Unsupported(format!(
                    "lease {lease_id} cannot start: every uid of the workload range ({} of them) is in use",
                    self.range.count
                ))
            })?;
        claimed.insert(uid);
        Ok(UidClaim { pool: self, uid })
    }
}

/// How the container provider runs workloads.
#[derive(Debug, Clone)]
pub struct ContainerSettings {
    /// The runtime.
    pub runtime: OciRuntime,
    /// Its binary.
    pub binary: PathBuf,
    /// The users workloads run as.
    pub uids: UidRange,
    /// How many processes a workload may have at once.
    pub pids_limit: i64,
    /// Stop grace and how often an adopted workload is looked for.
    pub timing: ProcessTiming,
    /// The host ports workloads are given.
    pub node_ports: NodePorts,
}

impl ContainerSettings {
    /// Workloads of `runtime` (run by `binary`) as users of `uids`, with
    /// `timing`, the default process limit and the default node ports.
    pub fn new(runtime: OciRuntime, binary: PathBuf, uids: UidRange, timing: ProcessTiming) -> Self {
        Self { runtime, binary, uids, pids_limit: DEFAULT_PIDS_LIMIT, timing, node_ports: NodePorts::default() }
    }
}

/// Runs each lease's workload in a container; see the module docs.
#[derive(Debug, Clone)]
pub struct ContainerProvider {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    instances: Arc<Instances>,
    settings: ContainerSettings,
    /// The runtime's `--root`: only this agent's containers are in it.
    state_root: PathBuf,
    /// Names this agent's cgroups apart from another agent's on the host.
    cgroup_parent: String,
    ports: Arc<PortBook>,
    uids: UidPool,
    /// Leases being destroyed: their end is not an out-of-memory kill.
    destroying: Mutex<BTreeSet<String>>,
    shutdown: CancellationToken,
}

impl Inner {
    fn container_dir(&self, lease_id: &str) -> PathBuf {
        self.instances.layout.root.join(CONTAINER_DIR).join(lease_id)
    }

    fn cgroup(&self, lease_id: &str) -> String {
        format!("/{}/{lease_id}", self.cgroup_parent)
    }

    /// The runtime's name for a lease's container: some runtimes (runsc)
    /// name host-wide resources by it, so it carries this agent's mark.
    fn container_id(&self, lease_id: &str) -> String {
        format!("{}-{lease_id}", self.cgroup_parent)
    }

    /// `<runtime> --root STATE ARGS…`.
    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.settings.binary);
        command.arg("--root").arg(&self.state_root).args(args).stdin(std::process::Stdio::null()).kill_on_drop(true);
        command
    }

    /// The command that runs a container as its workload's monitor.
    fn run_command(&self) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.settings.binary);
        command.arg("--root").arg(&self.state_root);
        match self.settings.runtime {
            OciRuntime::Runsc => {
                // The sandbox starts in the namespace the spec names (the
                // tenant's, when egress is isolated) and gVisor passes its
                // sockets through to that namespace's network: the tenant's
                // routes hold as under runc. Its own netstack
                // (`--network=sandbox`) refuses to start on kernels where it
                // takes the tenant's namespace for the root one.
                command.arg("--network=host");
                // The workload dials its Workload API, a host socket in its
                // identity directory: only opening host sockets is allowed,
                // never creating one.
                command.arg("--host-uds=open");
                // runsc keeps no stopped container to read afterwards.
                command.arg("run");
            }
            OciRuntime::Runc | OciRuntime::Crun => {
                command.args(["run", "--keep"]);
            }
            OciRuntime::Own => {
                command.arg0(own::ARG0).args(["run", "--keep"]);
            }
        }
        command.stdin(std::process::Stdio::null());
        command
    }

    /// Runs the runtime to the end; its error output is the error. The
    /// process runtime's commands other than `run` are the agent's own code
    /// and run in it.
    async fn run(&self, args: &[&str]) -> Result<Vec<u8>, String> {
        if self.settings.runtime == OciRuntime::Own {
            let root = self.state_root.clone();
            let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
            return tokio::task::spawn_blocking(move || {
                own::command(&root, &args.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .await
            .unwrap_or_else(|e| Err(format!("the runtime command failed: {e}")));
        }
        let output = self.command(args).output().await.map_err(|e| format!("cannot run {}: {e}", self.name()))?;
        if output.status.success() {
            Ok(output.stdout)
        } else {
            Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
        }
    }

    fn name(&self) -> &'static str {
        self.settings.runtime.name()
    }

    /// The runtime's view of a container: its status and pid; `None` when
    /// it has no such container.
    async fn state(&self, lease_id: &str) -> Option<(String, u32)> {
        let out = self.run(&["state", &self.container_id(lease_id)]).await.ok()?;
        let state: serde_json::Value = serde_json::from_slice(&out).ok()?;
        let status = state["status"].as_str()?.to_string();
        let pid = state["pid"].as_u64().and_then(|p| u32::try_from(p).ok()).unwrap_or(0);
        Some((status, pid))
    }

    /// Whether the kernel's OOM killer acted in the lease's cgroup.
    fn oom_killed(&self, lease_id: &str) -> bool {
        let cgroup = self.cgroup(lease_id);
        let root = Path::new("/sys/fs/cgroup");
        let (file, key) = if root.join("cgroup.controllers").exists() {
            (root.join(cgroup.trim_start_matches('/')).join("memory.events"), "oom_kill")
        } else {
            (root.join("memory").join(cgroup.trim_start_matches('/')).join("memory.oom_control"), "oom_kill")
        };
        std::fs::read_to_string(file).ok().is_some_and(|text| {
            text.lines().any(|line| {
                line.split_once(' ')
                    .is_some_and(|(name, count)| name == key && count.trim().parse().unwrap_or(0u64) > 0)
            })
        })
    }

    /// Kills every monitor a stopped agent left starting `lease_id`'s
    /// container, with its process group, and waits for them to be gone. A
    /// launch interrupted before its pid was recorded leaves a monitor that
    /// may still be creating the container: were it let be, the container
    /// would come up after the restarted agent had settled the lease, and
    /// run with no agent tracking it. The monitor is found by what its
    /// command line names (this agent's state root and the container id),
    /// since nothing recorded its pid.
    async fn stop_orphaned_monitors(&self, lease_id: &str) {
        let (root, id) = (self.state_root.display().to_string(), self.container_id(lease_id));
        let found = blocking(move || Ok(procfs::with_args(Path::new(PROC_ROOT), &["--root", &root, &id])))
            .await
            .unwrap_or_default();
        if found.is_empty() {
            return;
        }
        tracing::warn!(%lease_id, monitors = ?found.iter().map(|m| m.pid).collect::<Vec<_>>(),
            "stopping what an interrupted launch left starting the container");
        crate::procfs::kill_found(&found).await;
    }

    /// Deletes the container and its root; a container already gone is
    /// what deleting it was for.
    async fn delete(&self, lease_id: &str) {
        if let Err(error) = self.run(&["delete", "--force", &self.container_id(lease_id)]).await
            && !error.contains("not exist")
            && !error.contains("does not exist")
        {
            tracing::warn!(%lease_id, %error, "cannot delete the container");
        }
        let dir = self.container_dir(lease_id);
        let parent = self.cgroup_parent.clone();
        let _ = blocking(move || {
            unmount_root(&dir);
            remove_empty_cgroups(&parent);
            remove_path(&dir)
        })
        .await;
    }
}

impl ContainerProvider {
    /// A provider keeping its state under `data_dir`; its waiting tasks stop
    /// on `shutdown` (the workloads keep running).
    pub fn new(data_dir: &Path, settings: ContainerSettings, shutdown: CancellationToken) -> Self {
        let state_root = data_dir.join(RUNTIME_DIR).join(settings.runtime.name());
        let cgroup_parent = cgroup_parent(data_dir);
        let uids = UidPool::new(settings.uids);
        let ports = Arc::new(PortBook::new(settings.node_ports));
        Self {
            inner: Arc::new(Inner {
                instances: Arc::new(Instances::new(data_dir)),
                settings,
                state_root,
                cgroup_parent,
                ports,
                uids,
                destroying: Mutex::new(BTreeSet::new()),
                shutdown,
            }),
        }
    }

    fn is_running(&self, pid: u32, ticks: u64) -> bool {
        procfs::is_running(Path::new(PROC_ROOT), pid, ticks)
    }

    /// Records how `lease_id` ended, deletes its container, and tells
    /// whoever watches.
    async fn ended(&self, lease_id: &str, status: ExitStatus) {
        let destroyed =
            self.inner.destroying.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(lease_id);
        let status = if !destroyed && !status.success() && self.out_of_memory(lease_id, status) {
            ExitStatus::OutOfMemory
        } else {
            status
        };
        self.inner.delete(lease_id).await;
        self.inner.instances.ended(lease_id, status).await;
    }

    /// Whether a workload that ended with `status` was killed for its memory.
    fn out_of_memory(&self, lease_id: &str, status: ExitStatus) -> bool {
        if self.inner.oom_killed(lease_id) {
            return true;
        }
        // gVisor's kernel runs inside the cgroup and the host's OOM killer
        // ends the whole sandbox, whose cgroup goes with it: a sandbox
        // killed by SIGKILL that the agent did not kill, under a memory
        // limit, is the only evidence there is.
        self.inner.settings.runtime == OciRuntime::Runsc
            && status == ExitStatus::Signal(9)
            && self.inner.instances.stored(lease_id).is_ok_and(|record| record.memory_limited)
    }

    /// Waits for the monitor this agent started.
    fn wait_for_monitor(&self, lease_id: String, mut monitor: tokio::process::Child) {
        let provider = self.clone();
        tokio::spawn(async move {
            let status = tokio::select! {
                // The agent stops; the workload runs on and the next agent adopts it.
                _ = provider.inner.shutdown.cancelled() => return,
                status = monitor.wait() => status,
            };
            let status = match status {
                Ok(status) => match (status.code(), status.signal()) {
                    // The runtime passes a signal on as 128 + its number.
                    (Some(code), _) if (129..=192).contains(&code) => ExitStatus::Signal(code - 128),
                    (Some(code), _) => ExitStatus::Code(code),
                    (None, Some(signal)) => ExitStatus::Signal(signal),
                    (None, None) => ExitStatus::Unknown,
                },
                Err(error) => {
                    tracing::warn!(%lease_id, %error, "cannot wait for the workload's monitor");
                    ExitStatus::Unknown
                }
            };
            provider.ended(&lease_id, status).await;
        });
    }

    /// Polls `/proc` for a workload adopted after a restart until it is gone.
    fn watch_adopted(&self, lease_id: String, pid: u32, start_ticks: u64) {
        let provider = self.clone();
        tokio::spawn(async move {
            let every = provider.inner.settings.timing.exit_poll.max(Duration::from_millis(1));
            loop {
                tokio::select! {
                    _ = provider.inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                if !provider.is_running(pid, start_ticks) {
                    break;
                }
            }
            provider.ended(&lease_id, ExitStatus::Unknown).await;
        });
    }

    /// Waits until the workload's first process is gone, up to `within`.
    async fn gone(&self, pid: u32, ticks: u64, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if !self.is_running(pid, ticks) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(STOP_POLL).await;
        }
    }

    /// The running workload's pid and start time.
    fn running(&self, lease_id: &str) -> Result<(StoredRecord, Option<(u32, u64)>), ProviderError> {
        let stored = self.inner.instances.stored(lease_id)?;
        let running = stored
            .pid
            .zip(stored.start_ticks)
            .filter(|(pid, ticks)| stored.exit.is_none() && self.is_running(*pid, *ticks));
        Ok((stored, running))
    }

    /// Writes the container's root and spec; returns the bundle directory.
    /// For an image (`lower`, its shared unpacked root) the root is an
    /// overlay of it private to the lease.
    fn write_bundle(
        &self,
        lease_id: &str,
        plan: &mut ContainerPlan,
        lower: Option<&Path>,
    ) -> Result<PathBuf, ProviderError> {
        let dir = self.inner.container_dir(lease_id);
        unmount_root(&dir);
        remove_path(&dir)?;
        let rootfs = dir.join("rootfs");
        if let (Some(lower), Some(image)) = (lower, plan.image.as_mut()) {
            let owned = image.account.as_ref().is_some_and(|account| !account.owned.is_empty());
            mount_image_root(&dir, lower, owned)?;
            shadow_runtime_links(&rootfs)?;
            if let Some(account) = &image.account {
                account::give(&rootfs, account, plan.uid)?;
            }
            image.etc = image_etc(&dir, &plan.hostname)?;
            link_workload_api(&rootfs, plan)?;
            return self.write_spec(&dir, plan);
        }
        let create = |path: &Path| {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(path)
                .map_err(|source| io("create", path, source))
        };
        create(&rootfs.join("etc"))?;
        for dir in SYSTEM_DIRS {
            let host = Path::new(dir);
            if let Ok(target) = std::fs::read_link(host) {
                let link = rootfs.join(dir.trim_start_matches('/'));
                std::os::unix::fs::symlink(&target, &link).map_err(|source| io("link", &link, source))?;
            }
        }
        let etc = rootfs.join("etc");
        let files = [
            (
                "passwd",
                format!(
                    "root:x:0:0:root:/root:/bin/sh\nberth:x:{0}:{0}:berth workload:{WORK_MOUNT}:/bin/sh\n",
                    plan.uid
                ),
            ),
            ("group", format!("root:x:0:\nberth:x:{}:\n", plan.uid)),
            ("hosts", format!("127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{}\n", plan.hostname)),
            ("hostname", format!("{}\n", plan.hostname)),
        ];
        for (name, text) in files {
            let path = etc.join(name);
            std::fs::write(&path, text).map_err(|source| io("write", &path, source))?;
        }
        link_workload_api(&rootfs, plan)?;
        self.write_spec(&dir, plan)
    }

    /// Writes `config.json` for `plan` into `dir`, whose `rootfs` is ready.
    fn write_spec(&self, dir: &Path, plan: &ContainerPlan) -> Result<PathBuf, ProviderError> {
        let rootfs = dir.join("rootfs");
        let spec = runtime_spec(plan, &rootfs).map_err(|e| ProviderError::Corrupt {
            path: dir.join("config.json").display().to_string(),
            detail: e.to_string(),
        })?;
        let config = dir.join("config.json");
        let text = serde_json::to_vec_pretty(&spec)
            .map_err(|e| ProviderError::Corrupt { path: config.display().to_string(), detail: e.to_string() })?;
        std::fs::write(&config, text).map_err(|source| io("write", &config, source))?;
        Ok(dir.to_path_buf())
    }
}

/// Links [`WORKLOAD_API_LINK`] at the top of the workload's root to the
/// Workload API socket in its identity directory, when it has one.
///
/// Standard gRPC clients built on gRPC's C core (Python, C++, Ruby) send a
/// Unix socket's path, percent-encoded, as the request's `:authority`, and
/// the HTTP/2 server refuses an authority holding `%` as malformed. A path
/// of one component encodes to itself, so clients dial the link; the link
/// names the socket through the directory mount, so a socket made again
/// (after an agent restart) is the one reached.
fn link_workload_api(rootfs: &Path, plan: &ContainerPlan) -> Result<(), ProviderError> {
    if plan.identity.is_none() {
        return Ok(());
    }
    let link = rootfs.join(WORKLOAD_API_LINK.trim_start_matches('/'));
    let _ = std::fs::remove_file(&link);
    let target = Path::new(IDENTITY_MOUNT).join(crate::svids::SOCKET_FILE);
    std::os::unix::fs::symlink(&target, &link).map_err(|source| io("link", &link, source))
}

/// Gives the workload's user (`uid`, `gid`) what it alone reads or
/// writes: its identity directory, whole, and the root of each cache view.
/// A cache view's files come sealed open to every user (the view is the
/// lease's alone): only its root is given, so nothing under it is copied
/// up before the workload writes.
pub(crate) fn give_workload(
    identity: Option<&Path>,
    views: &[PathBuf],
    uid: u32,
    gid: u32,
) -> Result<(), ProviderError> {
    if let Some(identity) = identity {
        give_tree(identity, uid)?;
    }
    for view in views {
        std::os::unix::fs::lchown(view, Some(uid), Some(gid))
            .map_err(|source| io("give the workload", view, source))?;
    }
    Ok(())
}

/// Gives `root` and everything under it (symlinks themselves, not what
/// they name) to the workload's user `uid`: its identity directory, which
/// no other user may enter.
fn give_tree(root: &Path, uid: u32) -> Result<(), ProviderError> {
    let give = |path: &Path| {
        std::os::unix::fs::lchown(path, Some(uid), Some(uid)).map_err(|source| io("give the workload", path, source))
    };
    give(root)?;
    for entry in std::fs::read_dir(root).map_err(|source| io("read", root, source))? {
        let path = entry.map_err(|source| io("read", root, source))?.path();
        let meta = std::fs::symlink_metadata(&path).map_err(|source| io("read", &path, source))?;
        if meta.is_dir() { give_tree(&path, uid)? } else { give(&path)? }
    }
    Ok(())
}

/// Mounts `dir/rootfs` as an overlay of an image's shared root `lower`, its
/// writes going to `dir/upper`: the lease's own copy-on-write view. With
/// `owned` (the lease is given entries of the image), a change of owner
/// copies up metadata alone where the kernel can (`metacopy=on`), not
/// whole files.
fn mount_image_root(dir: &Path, lower: &Path, owned: bool) -> Result<(), ProviderError> {
    let (rootfs, upper, scratch) = (dir.join("rootfs"), dir.join("upper"), dir.join("overlay"));
    for path in [&rootfs, &upper, &scratch] {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(path)
            .map_err(|source| io("create", path, source))?;
    }
    crate::overlay::mount(&rootfs, lower, &upper, &scratch, owned).map_err(|error| match error {
        OverlayError::Layer(_) => ProviderError::Unsupported(error.to_string()),
        OverlayError::Mount(source) => io("mount the image overlay on", &rootfs, source),
    })
}

/// The directories of a root the runtime itself fills (`/dev` with its
/// nodes and links, the kernel's filesystems, a tmpfs).
const RUNTIME_DIRS: [&str; 4] = ["dev", "proc", "sys", "tmp"];

/// Replaces, in a lease's own overlay, any of [`RUNTIME_DIRS`] that the image
/// has as a link with an empty directory. A runtime writes into these by
/// joining paths (runc 1.1 makes `/dev/fd`, `/dev/stdin`... that way), so an
/// image whose `/dev` links to a host path would have it write there; the
/// shared image is untouched (the link's removal is a whiteout in the
/// lease's upper layer), and the runtime mounts over these directories anyway.
fn shadow_runtime_links(rootfs: &Path) -> Result<(), ProviderError> {
    for name in RUNTIME_DIRS {
        let path = rootfs.join(name);
        let is_link = std::fs::symlink_metadata(&path).is_ok_and(|meta| meta.file_type().is_symlink());
        if is_link {
            tracing::info!(path = %path.display(), "the image has a link where the runtime mounts; the lease gets a directory there");
            std::fs::remove_file(&path).map_err(|source| io("remove the image's link", &path, source))?;
            std::fs::DirBuilder::new().mode(0o755).create(&path).map_err(|source| io("create", &path, source))?;
            // As an image has it: runc gives a tmpfs the mode of the directory under it.
            let mode = if name == "tmp" { 0o1777 } else { 0o755 };
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .map_err(|source| io("open up", &path, source))?;
        }
    }
    Ok(())
}

/// Unmounts a container directory's image overlay, if it has one.
fn unmount_root(dir: &Path) {
    let rootfs = dir.join("rootfs");
    if let Err(error) = crate::overlay::unmount(&rootfs) {
        tracing::warn!(path = %rootfs.display(), %error, "cannot unmount the image overlay");
    }
}

/// Writes the `/etc` files an image's workload gets from the node (its host
/// name and the node's resolver) and says where each is bound.
fn image_etc(dir: &Path, hostname: &str) -> Result<Vec<(PathBuf, PathBuf)>, ProviderError> {
    let etc = dir.join("etc");
    std::fs::create_dir_all(&etc).map_err(|source| io("create", &etc, source))?;
    let mut bound = Vec::new();
    for (name, text) in [
        ("hosts", format!("127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{hostname}\n")),
        ("hostname", format!("{hostname}\n")),
    ] {
        let path = etc.join(name);
        std::fs::write(&path, text).map_err(|source| io("write", &path, source))?;
        bound.push((path, PathBuf::from("/etc").join(name)));
    }
    let resolv = Path::new("/etc/resolv.conf");
    if resolv.is_file() {
        bound.push((resolv.to_path_buf(), resolv.to_path_buf()));
    }
    Ok(bound)
}

/// Whether `program` is in the image at `root`, as the workload will look
/// for it from `working_dir` with `PATH`; links count as found (the runtime
/// resolves them inside the root).
fn findable_in_image(program: &str, path_var: &str, root: &Path, working_dir: &str) -> bool {
    let exists = |inside: &Path| {
        let relative: PathBuf = inside.components().filter(|c| matches!(c, std::path::Component::Normal(_))).collect();
        std::fs::symlink_metadata(root.join(relative)).is_ok()
    };
    if program.starts_with('/') {
        return exists(Path::new(program));
    }
    if program.contains('/') {
        return exists(&Path::new("/").join(working_dir).join(program));
    }
    path_var.split(':').filter(|dir| dir.starts_with('/')).any(|dir| exists(&Path::new(dir).join(program)))
}

/// The cgroup memory limit for a lease reserving `reserved` bytes (0: none).
fn memory_limit(runtime: OciRuntime, reserved: u64) -> u64 {
    match (runtime, reserved) {
        (_, 0) => 0,
        (OciRuntime::Runsc, reserved) => reserved.saturating_add(RUNSC_OVERHEAD),
        (OciRuntime::Runc | OciRuntime::Crun | OciRuntime::Own, reserved) => reserved.max(MIN_MEMORY_LIMIT),
    }
}

/// How many containers an agent on `data_dir` has in its runtimes' state
/// directories: the ones it runs, and the ones it is still destroying.
pub fn containers_left(data_dir: &Path) -> usize {
    let runtimes = data_dir.join(RUNTIME_DIR);
    [OciRuntime::Own, OciRuntime::Runc, OciRuntime::Crun, OciRuntime::Runsc]
        .into_iter()
        .map(|runtime| std::fs::read_dir(runtimes.join(runtime.name())).map_or(0, |entries| entries.count()))
        .sum()
}

/// Destroys every container an agent on `data_dir` left, through the runtime
/// that runs it, and returns how many there were: for tearing down a data
/// directory whose agent is gone (a test's, a bench's), where no agent will
/// adopt them.
pub(crate) fn destroy_containers(data_dir: &Path) -> usize {
    let mut destroyed = 0;
    let own_root = data_dir.join(RUNTIME_DIR).join(OciRuntime::Own.name());
    for id in std::fs::read_dir(&own_root).into_iter().flatten().filter_map(Result::ok) {
        let Ok(id) = id.file_name().into_string() else { continue };
        let _ = own::command(&own_root, &["kill", "--all", &id, "KILL"]);
        let _ = own::command(&own_root, &["delete", "--force", &id]);
        destroyed += 1;
    }
    for runtime in [OciRuntime::Runc, OciRuntime::Crun, OciRuntime::Runsc] {
        let state_root = data_dir.join(RUNTIME_DIR).join(runtime.name());
        let (Some(binary), Ok(entries)) = (runtime.binary(), std::fs::read_dir(&state_root)) else { continue };
        for id in entries.filter_map(Result::ok).filter_map(|e| e.file_name().into_string().ok()) {
            for args in [vec!["kill", "--all", &id, "KILL"], vec!["delete", "--force", &id]] {
                let _ = std::process::Command::new(&binary)
                    .arg("--root")
                    .arg(&state_root)
                    .args(&args)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status();
            }
            destroyed += 1;
        }
    }
    if let Ok(entries) = std::fs::read_dir(data_dir.join(CONTAINER_DIR)) {
        for entry in entries.filter_map(Result::ok) {
            unmount_root(&entry.path());
        }
    }
    // No agent runs here to launch into them: a container's own cgroup its
    // runtime left behind goes too (one that still holds a process stays).
    let parent = cgroup_parent(data_dir);
    for hierarchy in std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().filter_map(Result::ok) {
        for child in std::fs::read_dir(hierarchy.path().join(&parent)).into_iter().flatten().filter_map(Result::ok) {
            if child.file_type().is_ok_and(|kind| kind.is_dir()) {
                let _ = std::fs::remove_dir(child.path());
            }
        }
    }
    remove_empty_cgroups(&parent);
    destroyed
}

/// The cgroup directory, in every hierarchy, holding the containers of the
/// agent on `data_dir`: one per data directory, so two agents on one host
/// never share one.
pub(crate) fn cgroup_parent(data_dir: &Path) -> String {
    format!("berth-{:08x}", crate::egress::fnv32(data_dir.as_os_str().as_encoded_bytes()))
}

/// Removes this agent's cgroup directory `name` from every hierarchy where
/// it holds no container any more (the runtime removes each container's
/// own); one that still does stays, as the kernel refuses to remove it.
fn remove_empty_cgroups(name: &str) {
    let root = Path::new("/sys/fs/cgroup");
    let _ = std::fs::remove_dir(root.join(name));
    for hierarchy in std::fs::read_dir(root).into_iter().flatten().filter_map(Result::ok) {
        let _ = std::fs::remove_dir(hierarchy.path().join(name));
    }
}

/// Host paths under `/etc` every workload sees, those the host has.
fn shared_files() -> Vec<PathBuf> {
    SHARED_ETC.iter().map(PathBuf::from).filter(|path| path.exists()).collect()
}

/// System directories bound into every root (links are made as links).
pub(crate) fn system_dirs() -> Vec<PathBuf> {
    SYSTEM_DIRS
        .iter()
        .map(PathBuf::from)
        .filter(|path| std::fs::symlink_metadata(path).is_ok_and(|meta| meta.is_dir()))
        .collect()
}

/// Where `path`, as the workload sees it, is on the host.
fn host_path(path: &Path, bundle: Option<&Path>, work_dir: &Path) -> Option<PathBuf> {
    let mapped = |inside: &str, host: &Path| path.strip_prefix(inside).ok().map(|rest| host.join(rest));
    if let Some(found) = bundle.and_then(|bundle| mapped(BUNDLE_MOUNT, bundle)) {
        return Some(found);
    }
    if let Some(found) = mapped(WORK_MOUNT, work_dir) {
        return Some(found);
    }
    SYSTEM_DIRS.iter().any(|dir| path.starts_with(dir)).then(|| path.to_path_buf())
}

/// Whether the workload will find `program`: an absolute path is looked up
/// where it is mounted from, a bare name in each of `PATH`'s directories.
fn findable(program: &str, path_var: &str, bundle: Option<&Path>, work_dir: &Path) -> bool {
    let exists = |inside: &Path| host_path(inside, bundle, work_dir).is_some_and(|host| host.is_file());
    if program.contains('/') {
        return exists(Path::new(program));
    }
    path_var.split(':').filter(|dir| dir.starts_with('/')).any(|dir| exists(&Path::new(dir).join(program)))
}

/// Reads the pid the runtime wrote, waiting for it; `None` if the monitor
/// ended first or it took too long.
async fn started_pid(pid_file: &Path, monitor: &mut tokio::process::Child) -> Option<u32> {
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    loop {
        // A few bytes of a local file, read on this task: a hop to the
        // blocking pool every poll would wake a second thread beside a
        // runtime busy starting the container.
        if let Ok(text) = std::fs::read_to_string(pid_file)
            && let Ok(pid) = text.trim().parse::<u32>()
        {
            return Some(pid);
        }
        if matches!(monitor.try_wait(), Ok(Some(_))) || tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(START_POLL).await;
    }
}

#[async_trait::async_trait]
impl Provider for ContainerProvider {
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, ProviderError> {
        validate_lease_id(&spec.lease_id)?;
        let bundle = spec.root.bundle_dir().map(Path::to_path_buf);
        let program = spec.program_path(bundle.as_ref().map(|_| Path::new(BUNDLE_MOUNT)))?;
        let mut spec = spec;
        let _claim = self.inner.instances.prepare_launch(&mut spec, &self.inner.ports)?;
        let uid = self.inner.uids.claim(&self.inner.instances, &spec.lease_id)?;
        self.start(spec, program, bundle, uid.uid).await
    }

    async fn recover(&self) -> Result<Vec<Launched>, ProviderError> {
        let layout = self.inner.instances.layout.clone();
        let loaded = blocking(move || load_records(&layout)).await?;
        let mut recovered = Vec::new();
        let mut known = BTreeSet::new();
        for stored in loaded {
            let lease_id = stored.lease_id.clone();
            known.insert(lease_id.clone());
            if let Some(tracked) = self.inner.instances.lock().get(&lease_id) {
                recovered.push(Launched { record: tracked.stored.to_record(), exit: tracked.exit.subscribe() });
                continue;
            }
            if stored.exit.is_none() && stored.pid.is_none() {
                // A launch the last agent stopped in before it knew the pid.
                self.inner.stop_orphaned_monitors(&lease_id).await;
            }
            let running = if stored.exit.is_none() {
                let state = self.inner.state(&lease_id).await;
                let alive = matches!(&state, Some((status, _)) if status != "stopped");
                stored.pid.zip(stored.start_ticks).filter(|(pid, ticks)| alive && self.is_running(*pid, *ticks))
            } else {
                None
            };
            let ended_unwatched = running.is_none() && stored.exit.is_none();
            let mut launched = self.inner.instances.recovered(stored);
            if let Some((pid, ticks)) = running {
                tracing::info!(%lease_id, pid, runtime = self.inner.name(), "found a container still running from before the restart");
                self.watch_adopted(lease_id, pid, ticks);
            } else if ended_unwatched {
                // Ended (or never started) while no agent watched it.
                self.ended(&lease_id, ExitStatus::Unknown).await;
                launched.record = self.inner.instances.stored(&lease_id)?.to_record();
            }
            recovered.push(launched);
        }
        // Containers of this agent's runtime root that no record names: an
        // agent stopped between starting one and recording it.
        if let Ok(listed) = self.inner.run(&["list", "--quiet"]).await {
            let prefix = self.inner.container_id("");
            for id in String::from_utf8_lossy(&listed).lines().map(str::trim).filter(|id| !id.is_empty()) {
                let lease_id = id.strip_prefix(&prefix).unwrap_or(id);
                if !known.contains(lease_id) {
                    tracing::warn!(container = %id, "destroying a container no record names");
                    let _ = self.inner.run(&["kill", "--all", id, "KILL"]).await;
                    let _ = self.inner.run(&["delete", "--force", id]).await;
                }
            }
        }
        Ok(recovered)
    }

    async fn set_epoch(&self, lease_id: &str, epoch: u64) -> Result<(), ProviderError> {
        self.inner.instances.update(lease_id, move |record| record.epoch = epoch).await
    }

    async fn settle(&self, lease_id: &str, settlement: Settlement) -> Result<(), ProviderError> {
        self.inner.instances.settle(lease_id, settlement).await
    }

    async fn destroy(&self, lease_id: &str) -> Result<(), ProviderError> {
        let (_, running) = self.running(lease_id)?;
        let Some((pid, ticks)) = running else {
            self.inner.delete(lease_id).await;
            return Ok(());
        };
        self.inner.destroying.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(lease_id.to_string());
        tracing::info!(%lease_id, pid, grace = ?self.inner.settings.timing.stop_grace, "stopping the container");
        let id = self.inner.container_id(lease_id);
        let _ = self.inner.run(&["kill", &id, "TERM"]).await;
        if !self.gone(pid, ticks, self.inner.settings.timing.stop_grace).await {
            tracing::warn!(%lease_id, pid, "the workload outlived its grace; killing its container");
            let _ = self.inner.run(&["kill", "--all", &id, "KILL"]).await;
            if !self.gone(pid, ticks, KILL_WAIT).await {
                return Err(ProviderError::Stuck {
                    lease_id: lease_id.into(),
                    detail: format!("pid {pid} survived SIGKILL"),
                });
            }
        }
        Ok(())
    }

    async fn remove(&self, lease_id: &str) -> Result<(), ProviderError> {
        validate_lease_id(lease_id)?;
        if let Ok((_, Some(_))) = self.running(lease_id) {
            return Err(ProviderError::AlreadyRunning(lease_id.to_string()));
        }
        self.inner.delete(lease_id).await;
        self.inner.destroying.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(lease_id);
        self.inner.instances.forget(lease_id).await
    }

    async fn signal(&self, lease_id: &str, signal: WorkloadSignal) -> Result<(), ProviderError> {
        let (_, running) = self.running(lease_id)?;
        if running.is_none() {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        }
        self.inner.run(&["kill", &self.inner.container_id(lease_id), signal_name(signal)]).await.map(|_| ()).map_err(
            |detail| ProviderError::Signal { lease_id: lease_id.to_string(), source: std::io::Error::other(detail) },
        )
    }

    async fn stats(&self, lease_id: &str) -> Result<InstanceStats, ProviderError> {
        let (stored, running) = self.running(lease_id)?;
        if running.is_none() {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        }
        let out = self
            .inner
            .run(&["events", "--stats", &self.inner.container_id(lease_id)])
            .await
            .map_err(|_| ProviderError::NotRunning(lease_id.to_string()))?;
        let stats: serde_json::Value = serde_json::from_slice(&out).map_err(|e| ProviderError::Corrupt {
            path: format!("{} events", self.inner.name()),
            detail: e.to_string(),
        })?;
        let data = &stats["data"];
        let started = stored.started_at_ms.map(from_unix_ms).unwrap_or_else(SystemTime::now);
        Ok(InstanceStats {
            cpu_time: Duration::from_nanos(data["cpu"]["usage"]["total"].as_u64().unwrap_or(0)),
            memory_bytes: data["memory"]["usage"]["usage"].as_u64().unwrap_or(0),
            uptime: SystemTime::now().duration_since(started).unwrap_or_default(),
        })
    }

    /// Through the runtime's `update` (the process runtime's own, which
    /// writes the cgroup as it did at the start). Memory goes first, being
    /// the part that may have to wait, so a deferred resize changes nothing.
    /// gVisor's sandbox cannot be resized (runsc has no `update`).
    async fn resize(&self, lease_id: &str, ask: ResizeAsk) -> Result<Resized, ProviderError> {
        let runtime = self.inner.settings.runtime;
        if self.running(lease_id)?.1.is_none() {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        }
        if runtime == OciRuntime::Runsc {
            return Ok(Resized::unsupported(runtime.name()));
        }
        let (from, to) = (memory_limit(runtime, ask.from.memory_bytes), memory_limit(runtime, ask.to.memory_bytes));
        if to != 0 && (from == 0 || to < from) {
            if let Some(deferred) = self.lower_memory(lease_id, to, ask.settle).await? {
                return Ok(deferred);
            }
        } else if to != from {
            let limit = if to == 0 { "-1".to_string() } else { to.to_string() };
            self.update(lease_id, &["--memory-swap", &limit, "--memory", &limit]).await?;
        }
        if ask.to.cpu_millis != ask.from.cpu_millis {
            let quota = if ask.to.cpu_millis == 0 { -1 } else { spec::cpu_quota(ask.to.cpu_millis) };
            let (quota, period) = (quota.to_string(), spec::CPU_PERIOD_US.to_string());
            self.update(lease_id, &["--cpu-quota", &quota, "--cpu-period", &period]).await?;
        }
        Ok(Resized::Applied)
    }

    fn log_files(&self, lease_id: &str) -> Result<LogFiles, ProviderError> {
        self.inner.instances.stored(lease_id)?;
        Ok(self.inner.instances.layout.logs(lease_id))
    }

    fn listens(&self, _lease_id: &str, _port: u16) -> Option<bool> {
        None
    }

    fn runtime(&self) -> Runtime {
        Runtime { name: self.inner.name().into(), contained: true }
    }

    fn running(&self) -> Vec<String> {
        self.inner.instances.running()
    }
}

impl ContainerProvider {
    /// Runs the runtime's `update` on the lease's container with `flags`.
    async fn update(&self, lease_id: &str, flags: &[&str]) -> Result<(), ProviderError> {
        let id = self.inner.container_id(lease_id);
        let args: Vec<&str> = std::iter::once("update").chain(flags.iter().copied()).chain([id.as_str()]).collect();
        self.inner.run(&args).await.map(drop).map_err(|detail| ProviderError::Resize {
            lease_id: lease_id.to_string(),
            detail: format!("{} update: {detail}", self.inner.name()),
        })
    }

    /// Lowers the memory limit to `limit` bytes: the soft limit first, so
    /// the kernel reclaims towards it, then the hard limit once the workload
    /// uses no more than it, trying until `settle` has passed. On v1 the
    /// hard limit is tried whatever the usage says (the kernel reclaims
    /// page cache to meet it, and refuses rather than kill); on v2 only once
    /// usage is under it, since there a limit below usage summons the OOM
    /// killer. Answers the deferral when it could not, the soft limit lifted
    /// again.
    async fn lower_memory(
        &self,
        lease_id: &str,
        limit: u64,
        settle: Duration,
    ) -> Result<Option<Resized>, ProviderError> {
        let target = limit.to_string();
        self.update(lease_id, &["--memory-reservation", &target]).await?;
        let unified = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        let deadline = tokio::time::Instant::now() + settle;
        let mut refused = String::new();
        loop {
            let used = self.stats(lease_id).await?.memory_bytes;
            if used <= limit || !unified {
                match self.update(lease_id, &["--memory", &target, "--memory-swap", &target]).await {
                    Ok(()) => return Ok(None),
                    Err(error) => refused = error.to_string(),
                }
            }
            if tokio::time::Instant::now() >= deadline {
                if let Err(error) = self.update(lease_id, &["--memory-reservation", "-1"]).await {
                    tracing::warn!(%lease_id, %error, "cannot lift the soft memory limit of a deferred resize");
                }
                let mut message = format!(
                    "the workload uses {} MiB of memory, more than the new limit of {} MiB, after {settle:?}; \
                     it keeps its limit",
                    used >> 20,
                    limit >> 20
                );
                if !refused.is_empty() {
                    message.push_str(&format!(" ({refused})"));
                }
                return Ok(Some(Resized::Deferred { reason: "MemoryInUse", message }));
            }
            tokio::time::sleep(RESIZE_POLL).await;
        }
    }

    /// Everything of a launch after its ports and user are taken.
    async fn start(
        &self,
        spec: LaunchSpec,
        program: String,
        bundle: Option<PathBuf>,
        uid: u32,
    ) -> Result<Launched, ProviderError> {
        let lease_id = spec.lease_id.clone();
        let mut first = StoredRecord::starting(&spec);
        first.uid = Some(uid);
        first.memory_limited = spec.resources.memory_bytes > 0;
        let layout = self.inner.instances.layout.clone();
        let (work_dir, stdout, stderr) = {
            let first = first.clone();
            let identity = spec.identity.clone();
            let caches: Vec<PathBuf> = spec.caches.iter().map(|cache| cache.host.clone()).collect();
            blocking(move || {
                let prepared = prepare(&layout, &first)?;
                let work_dir = &prepared.0;
                rustix::fs::chown(work_dir, Some(rustix::fs::Uid::from_raw(uid)), Some(rustix::fs::Gid::from_raw(uid)))
                    .map_err(|e| io("give the workload", work_dir, e.into()))?;
                give_workload(identity.as_deref(), &caches, uid, uid)?;
                Ok(prepared)
            })
            .await?
        };
        let account = match &spec.root {
            WorkloadRoot::Image { account, .. } => account.clone(),
            _ => None,
        };
        let home = account.as_ref().and_then(|account| account.home.as_deref()).unwrap_or(WORK_MOUNT);
        let identity = IdentitySeen { dir: Path::new(IDENTITY_MOUNT), socket: Path::new(WORKLOAD_API_LINK) };
        let env = spec.environment(Path::new(home), bundle.as_ref().map(|_| Path::new(BUNDLE_MOUNT)), Some(identity));
        let path_var = env.get("PATH").cloned().unwrap_or_default();
        let found = match &spec.root {
            WorkloadRoot::Image { dir, working_dir, .. } => findable_in_image(&program, &path_var, dir, working_dir),
            _ => findable(&program, &path_var, bundle.as_deref(), &work_dir),
        };
        if !found {
            self.inner.instances.never_started(first).await;
            let source = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file in the workload's root");
            return Err(ProviderError::Spawn { command: program, source });
        }
        let init = INITS.iter().map(Path::new).find(|init| init.is_file());
        let image = match &spec.root {
            WorkloadRoot::Image { dir, working_dir, .. } => Some((
                dir.clone(),
                ImagePlan {
                    working_dir: working_dir.clone(),
                    init: init.map(Path::to_path_buf),
                    etc: Vec::new(),
                    account: account.clone(),
                },
            )),
            _ => None,
        };
        let mut args: Vec<String> = match (init, &image) {
            (Some(_), Some(_)) => vec![INIT_MOUNT.to_string(), "--".into()],
            (Some(init), None) => vec![init.display().to_string(), "--".into()],
            (None, _) => Vec::new(),
        };
        args.push(program.clone());
        args.extend(spec.args.iter().cloned());
        let plan = ContainerPlan {
            args,
            env: env.iter().map(|(name, value)| format!("{name}={value}")).collect(),
            uid,
            system_dirs: if image.is_some() { Vec::new() } else { system_dirs() },
            shared_files: if image.is_some() { Vec::new() } else { shared_files() },
            bundle: bundle.clone(),
            work_dir: work_dir.clone(),
            identity: spec.identity.clone(),
            caches: spec.caches.iter().map(|cache| (cache.host.clone(), cache.inside.clone())).collect(),
            network: spec.network.as_ref().map(|network| network.namespace.clone()),
            resolv_conf: spec.network.as_ref().and_then(|network| network.resolv_conf.clone()),
            cgroup: self.inner.cgroup(&lease_id),
            memory_bytes: memory_limit(self.inner.settings.runtime, spec.resources.memory_bytes),
            cpu_millis: spec.resources.cpu_millis,
            pids: self.inner.settings.pids_limit,
            hostname: lease_id.chars().take(63).collect(),
            image: None,
        };
        let dir = {
            let provider = self.clone();
            let lease_id = lease_id.clone();
            let lower = image.as_ref().map(|(dir, _)| dir.clone());
            let mut plan = plan;
            plan.image = image.map(|(_, image)| image);
            let written = blocking(move || provider.write_bundle(&lease_id, &mut plan, lower.as_deref())).await;
            match written {
                Ok(dir) => dir,
                Err(error) => {
                    self.inner.instances.never_started(first).await;
                    return Err(error);
                }
            }
        };
        // A container of that name left by an earlier try is in the way.
        self.inner.delete_state_only(&lease_id).await;
        let pid_file = dir.join(PID_FILE);
        let mut command = self.inner.run_command();
        command
            .arg("--bundle")
            .arg(&dir)
            .arg("--pid-file")
            .arg(&pid_file)
            .arg(self.inner.container_id(&lease_id))
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        let (exit_tx, exit_rx) = watch::channel(None);
        let mut monitor = match command.spawn() {
            Ok(monitor) => monitor,
            Err(source) => {
                self.inner.instances.never_started(first).await;
                let command = self.inner.settings.binary.display().to_string();
                return Err(ProviderError::Spawn { command, source });
            }
        };
        let pid = started_pid(&pid_file, &mut monitor).await;
        let start_ticks = pid.and_then(|pid| procfs::read_stat(Path::new(PROC_ROOT), pid)).map(|s| s.start_ticks);
        let started = StoredRecord { pid, start_ticks, started_at_ms: Some(unix_ms(SystemTime::now())), ..first };
        self.inner.instances.track(started.clone(), exit_tx).await?;
        tracing::info!(%lease_id, epoch = spec.epoch, ?pid, uid, %program, runtime = self.inner.name(), "workload started");
        self.wait_for_monitor(lease_id, monitor);
        Ok(Launched { record: started.to_record(), exit: exit_rx })
    }
}

impl Inner {
    /// Forgets a container the runtime still keeps under a lease's name,
    /// without touching the root the launch just wrote. The runtime keeps
    /// each container's state in a directory of its name under its root, so
    /// a launch with none there (every first launch) asks the runtime
    /// nothing.
    async fn delete_state_only(&self, lease_id: &str) {
        let id = self.container_id(lease_id);
        if tokio::fs::try_exists(self.state_root.join(&id)).await.unwrap_or(true) {
            let _ = self.run(&["delete", "--force", &id]).await;
        }
    }
}

fn signal_name(signal: WorkloadSignal) -> &'static str {
    match signal {
        WorkloadSignal::Term => "TERM",
        WorkloadSignal::Kill => "KILL",
        WorkloadSignal::Int => "INT",
        WorkloadSignal::Hup => "HUP",
        WorkloadSignal::Usr1 => "USR1",
        WorkloadSignal::Usr2 => "USR2",
        WorkloadSignal::Quit => "QUIT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_ranges_read_as_operators_write_them_and_never_hold_root_or_the_agent() {
        let range: UidRange = "200000-299999".parse().unwrap();
        assert_eq!(range, UidRange { first: 200_000, count: 100_000 });
        assert!(range.check(0).is_ok());
        assert!("0-10".parse::<UidRange>().unwrap().check(1000).unwrap_err().contains("uid 0"));
        assert!("900-1100".parse::<UidRange>().unwrap().check(1000).unwrap_err().contains("agent's own uid 1000"));
        for bad in ["200000", "b-c", "10-5"] {
            assert!(bad.parse::<UidRange>().unwrap_err().contains("FIRST-LAST"), "{bad}");
        }
    }

    #[test]
    fn a_lease_memory_becomes_a_limit_the_runtime_can_start_in() {
        assert_eq!(memory_limit(OciRuntime::Runc, 0), 0, "no reservation, no limit");
        assert_eq!(memory_limit(OciRuntime::Runc, 1 << 20), MIN_MEMORY_LIMIT);
        assert_eq!(memory_limit(OciRuntime::Runc, 256 << 20), 256 << 20);
        assert_eq!(memory_limit(OciRuntime::Runsc, 256 << 20), (256 << 20) + RUNSC_OVERHEAD);
    }

    #[test]
    fn a_program_is_looked_for_where_the_workload_will_see_it() {
        let bundle = tempfile::tempdir().unwrap();
        std::fs::create_dir(bundle.path().join("bin")).unwrap();
        std::fs::write(bundle.path().join("bin/app"), "").unwrap();
        let work = tempfile::tempdir().unwrap();
        let path = "/usr/bin:/bin";
        assert!(findable("/berth/bundle/bin/app", path, Some(bundle.path()), work.path()));
        assert!(!findable("/berth/bundle/bin/nope", path, Some(bundle.path()), work.path()));
        assert!(findable("sh", path, None, work.path()));
        assert!(!findable("no-such-program-anywhere", path, None, work.path()));
        // The agent's own files are not in the workload's root.
        assert!(!findable("/root/.bashrc", path, None, work.path()));
        assert!(!findable("/etc/passwd", path, None, work.path()));
    }
}
