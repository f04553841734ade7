//! The process provider: each lease's command runs as a plain process in its
//! own process group and working directory, recorded on disk so that a
//! restarted agent finds it again.
//!
//! Records, logs and working directories are kept as [`crate::instances`]
//! says. The workload owns its working directory; the agent's own files live
//! beside it, where the workload cannot overwrite them by accident.
//!
//! # Containment
//! None: the workload runs as the agent's user, in the host's mount, PID and
//! (unless egress isolation puts it in its tenant's network namespace)
//! network namespaces, with no limit on its memory, CPU or processes. The
//! agent runs this provider only when told `--allow-uncontained` (or, for
//! `berth dev`, when it is not root), and says so in its node labels.
//!
//! # Processes
//! - The workload gets its own process group (`process_group(0)`), so a
//!   signal to the group reaches everything it started. Destroying it sends
//!   SIGTERM to the group, waits for the grace, then SIGKILL.
//! - Its environment is not the agent's: see [`LaunchSpec::environment`].
//! - In its tenant's network namespace, it is started through the
//!   attachment's `enter` prefix (`ip netns exec`), which keeps its pid.
//! - A process is named by its pid and its start time from
//!   `/proc/<pid>/stat`, so a recycled pid is never adopted or signalled.
//! - When the leader of a workload exits, whatever it left running in its
//!   group is killed: a finished lease leaves nothing behind.
//!
//! # Ports
//! A process shares the host's network, so a port it declares cannot be
//! mapped: instead each of its named ports gets a free port on the host,
//! passed as `BERTH_PORT_<NAME>` (the name upper-cased, `-` as `_`), and the
//! first one (or one of its own, with none named) as `PORT`, which the
//! workload listens on. A free port is one the kernel hands out for
//! `0.0.0.0:0` and that no other instance of this provider holds, so two
//! replicas on one host never get the same one. They are kept in the record,
//! so an adopted instance keeps its port. Between the probe and the
//! workload's own bind another process may take the port; the workload then
//! fails to listen and its lease fails with its exit.
//!
//! # Exit status after a restart
//! A process this agent spawned is waited for, and its exit code or signal
//! recorded. A process adopted after an agent restart is not this agent's
//! child, so `wait` cannot see its status: its end is detected by polling
//! `/proc` (the pid is gone, is a zombie, or started at another time), and
//! recorded as [`ExitStatus::Unknown`].
//!
//! # Window
//! The record is written before the process is spawned and again with its
//! pid right after; an agent killed between the spawn and the second write
//! leaves a record with no pid, which a restart reports as never started,
//! and a process it cannot find.

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustix::process::{Pid, Signal, kill_process_group};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::instances::{
    Instances, PortBook, StoredRecord, blocking, from_unix_ms, load_records, prepare, unix_ms, validate_lease_id,
};
use crate::node_ports::NodePorts;
use crate::procfs::{self, PROC_ROOT};
use crate::provider::{
    ExitStatus, InstanceStats, LEASE_ID_ENV, LaunchSpec, Launched, LogFiles, ProcessTiming, Provider, ProviderError,
    ResizeAsk, Resized, Runtime, Settlement, WorkloadRoot, WorkloadSignal,
};

/// How often a stopping group is looked at.
const STOP_POLL: Duration = Duration::from_millis(25);

/// Runs each lease's command as a process group; see the module docs.
#[derive(Debug, Clone)]
pub struct ProcessProvider {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    instances: Arc<Instances>,
    proc_root: PathBuf,
    timing: ProcessTiming,
    /// Ports handed to launches whose instance is not tracked yet.
    ports: Arc<PortBook>,
    /// Stops the tasks that wait for processes; never the processes.
    shutdown: CancellationToken,
}

impl ProcessProvider {
    /// A provider keeping its state under `data_dir`; its waiting tasks stop
    /// on `shutdown` (the processes keep running).
    pub fn new(data_dir: &Path, timing: ProcessTiming, shutdown: CancellationToken) -> Self {
        Self::with_ports(data_dir, timing, NodePorts::default(), shutdown)
    }

    /// [`ProcessProvider::new`], giving workloads ports of `node_ports`.
    pub fn with_ports(
        data_dir: &Path,
        timing: ProcessTiming,
        node_ports: NodePorts,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                instances: Arc::new(Instances::new(data_dir)),
                proc_root: PathBuf::from(PROC_ROOT),
                timing,
                ports: Arc::new(PortBook::new(node_ports)),
                shutdown,
            }),
        }
    }

    /// Waits for a child this provider spawned, records how it ended, and
    /// kills what it left in its group.
    fn wait_for_child(&self, lease_id: String, mut child: tokio::process::Child, group: Option<(i32, u64)>) {
        let provider = self.clone();
        tokio::spawn(async move {
            let status = tokio::select! {
                // The agent stops; the process runs on and the next agent adopts it.
                _ = provider.inner.shutdown.cancelled() => return,
                status = child.wait() => status,
            };
            let status = match status {
                Ok(status) => match (status.code(), status.signal()) {
                    (Some(code), _) => ExitStatus::Code(code),
                    (None, Some(signal)) => ExitStatus::Signal(signal),
                    (None, None) => ExitStatus::Unknown,
                },
                Err(error) => {
                    tracing::warn!(%lease_id, %error, "cannot wait for the workload; its exit status is unknown");
                    ExitStatus::Unknown
                }
            };
            provider.ended(&lease_id, status, group).await;
        });
    }

    /// Polls `/proc` for a process adopted after a restart until it is gone.
    fn watch_adopted(&self, lease_id: String, pid: u32, start_ticks: u64) {
        let provider = self.clone();
        tokio::spawn(async move {
            let every = provider.inner.timing.exit_poll.max(Duration::from_millis(1));
            loop {
                tokio::select! {
                    _ = provider.inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                if !procfs::is_running(&provider.inner.proc_root, pid, start_ticks) {
                    break;
                }
            }
            let group = i32::try_from(pid).ok().map(|pgid| (pgid, start_ticks));
            provider.ended(&lease_id, ExitStatus::Unknown, group).await;
        });
    }

    /// Records the end of the leader of `lease_id`'s group and tells
    /// whoever watches.
    async fn ended(&self, lease_id: &str, status: ExitStatus, group: Option<(i32, u64)>) {
        if let Some((pgid, _)) = group {
            let proc_root = self.inner.proc_root.clone();
            let leftovers = blocking(move || Ok(procfs::group_members(&proc_root, pgid))).await.unwrap_or_default();
            if !leftovers.is_empty() {
                tracing::info!(%lease_id, leftovers = leftovers.len(), "the workload exited; killing what it left running");
                let _ = signal_group(pgid, Signal::KILL);
            }
        }
        self.inner.instances.ended(lease_id, status).await;
    }

    fn group_of(&self, lease_id: &str) -> Result<(StoredRecord, Option<(i32, u64)>), ProviderError> {
        let stored = self.inner.instances.stored(lease_id)?;
        let group = stored.group().filter(|(pgid, ticks)| procfs::owns_group(&self.inner.proc_root, *pgid, *ticks));
        Ok((stored, group))
    }

    /// Waits until the group has no live member, up to `within`.
    async fn group_gone(&self, pgid: i32, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let proc_root = self.inner.proc_root.clone();
            let members = blocking(move || Ok(procfs::group_members(&proc_root, pgid))).await.unwrap_or_default();
            if members.is_empty() {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(STOP_POLL).await;
        }
    }

    /// Kills a workload of `lease_id` that runs with no pid recorded: an
    /// agent stopped (or killed) between starting it and recording it left
    /// it running, and once its lease is settled nothing would ever stop
    /// it. It is found by the lease id its environment carries.
    async fn stop_unrecorded(&self, lease_id: &str) {
        let (proc_root, entry) = (self.inner.proc_root.clone(), format!("{LEASE_ID_ENV}={lease_id}"));
        let found = blocking(move || Ok(procfs::with_env(&proc_root, &entry))).await.unwrap_or_default();
        if found.is_empty() {
            return;
        }
        tracing::warn!(%lease_id, pids = ?found.iter().map(|p| p.pid).collect::<Vec<_>>(),
            "stopping a workload an interrupted launch left running unrecorded");
        procfs::kill_found(&found).await;
    }
}

#[async_trait::async_trait]
impl Provider for ProcessProvider {
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, ProviderError> {
        validate_lease_id(&spec.lease_id)?;
        if let WorkloadRoot::Image { digest, .. } = &spec.root {
            return Err(ProviderError::Unsupported(format!(
                "lease {} runs container image {digest}, and this node runs workloads uncontained: \
                 images run only on nodes that contain their workloads (--runtime process or oci)",
                spec.lease_id
            )));
        }
        if let Some(cache) = spec.caches.first() {
            return Err(ProviderError::Unsupported(format!(
                "lease {} mounts a cache volume at {}, and this node runs workloads uncontained, with no root                  of their own to mount it in: cache volumes run only on nodes that contain their workloads",
                spec.lease_id,
                cache.inside.display()
            )));
        }
        let bundle = spec.root.bundle_dir().map(Path::to_path_buf);
        let program = spec.program_path(bundle.as_deref())?;
        let mut spec = spec;
        let _claim = self.inner.instances.prepare_launch(&mut spec, &self.inner.ports)?;

        let layout = self.inner.instances.layout.clone();
        let first = StoredRecord::starting(&spec);
        let (work_dir, stdout, stderr) = {
            let first = first.clone();
            blocking(move || prepare(&layout, &first)).await?
        };
        let socket = spec.identity.as_ref().map(|dir| dir.join(crate::svids::SOCKET_FILE));
        let identity = spec
            .identity
            .as_deref()
            .zip(socket.as_deref())
            .map(|(dir, socket)| crate::provider::IdentitySeen { dir, socket });
        let env = spec.environment(&work_dir, bundle.as_deref(), identity);
        let mut line = spec.network.as_ref().map(|network| network.enter.clone()).unwrap_or_default();
        if !line.is_empty() {
            // The namespace's tool would start and then fail to find the
            // program; a path that is not there fails the launch as it would
            // without it.
            let path = Path::new(&program);
            if path.is_absolute() && !path.exists() {
                let source = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
                return Err(ProviderError::Spawn { command: program, source });
            }
        }
        line.push(program.clone());
        line.extend(spec.args.iter().cloned());
        let mut command = tokio::process::Command::new(&line[0]);
        command
            .args(&line[1..])
            .env_clear()
            .envs(&env)
            .current_dir(&work_dir)
            .stdin(std::process::Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        let (exit_tx, exit_rx) = watch::channel(None);
        let child = match command.spawn() {
            Ok(child) => child,
            Err(source) => {
                self.inner.instances.never_started(first).await;
                return Err(ProviderError::Spawn { command: program, source });
            }
        };
        let pid = child.id();
        let start_ticks = pid.and_then(|pid| procfs::read_stat(&self.inner.proc_root, pid)).map(|s| s.start_ticks);
        let started = StoredRecord { pid, start_ticks, started_at_ms: Some(unix_ms(SystemTime::now())), ..first };
        let group = started.group();
        self.inner.instances.track(started.clone(), exit_tx).await?;
        tracing::info!(lease_id = %spec.lease_id, epoch = spec.epoch, ?pid, %program, "workload started");
        self.wait_for_child(spec.lease_id, child, group);
        Ok(Launched { record: started.to_record(), exit: exit_rx })
    }

    async fn recover(&self) -> Result<Vec<Launched>, ProviderError> {
        let provider = self.clone();
        let loaded = blocking(move || load_records(&provider.inner.instances.layout)).await?;
        let mut recovered = Vec::new();
        for stored in loaded {
            let lease_id = stored.lease_id.clone();
            if let Some(tracked) = self.inner.instances.lock().get(&lease_id) {
                recovered.push(Launched { record: tracked.stored.to_record(), exit: tracked.exit.subscribe() });
                continue;
            }
            let running = stored.pid.zip(stored.start_ticks).filter(|(pid, ticks)| {
                stored.exit.is_none() && procfs::is_running(&self.inner.proc_root, *pid, *ticks)
            });
            if stored.pid.is_none() && stored.exit.is_none() {
                self.stop_unrecorded(&lease_id).await;
            }
            let mut stored = stored;
            if running.is_none() && stored.exit.is_none() {
                // Ended (or never started) while no agent watched it.
                self.inner.instances.ended_unwatched(&mut stored, ExitStatus::Unknown).await?;
            }
            if running.is_none()
                && let Some((pgid, ticks)) = stored.group()
                && procfs::owns_group(&self.inner.proc_root, pgid, ticks)
            {
                // Its leader ended unwatched and left processes behind.
                tracing::info!(%lease_id, pgid, "killing what an ended workload left running");
                let _ = signal_group(pgid, Signal::KILL);
            }
            recovered.push(self.inner.instances.recovered(stored));
            if let Some((pid, ticks)) = running {
                tracing::info!(%lease_id, pid, "found a workload still running from before the restart");
                self.watch_adopted(lease_id, pid, ticks);
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
        let (_, group) = self.group_of(lease_id)?;
        let Some((pgid, _)) = group else { return Ok(()) };
        tracing::info!(%lease_id, pgid, grace = ?self.inner.timing.stop_grace, "stopping the workload");
        stop_group(lease_id, pgid, Signal::TERM)?;
        if self.group_gone(pgid, self.inner.timing.stop_grace).await {
            return Ok(());
        }
        tracing::warn!(%lease_id, pgid, "the workload outlived its grace; killing it");
        stop_group(lease_id, pgid, Signal::KILL)?;
        if self.group_gone(pgid, procfs::KILL_WAIT).await {
            return Ok(());
        }
        let proc_root = self.inner.proc_root.clone();
        let left = blocking(move || Ok(procfs::group_members(&proc_root, pgid))).await.unwrap_or_default();
        let pids: Vec<u32> = left.iter().map(|s| s.pid).collect();
        Err(ProviderError::Stuck { lease_id: lease_id.into(), detail: format!("pids {pids:?} survived SIGKILL") })
    }

    async fn remove(&self, lease_id: &str) -> Result<(), ProviderError> {
        validate_lease_id(lease_id)?;
        if let Ok((_, Some(_))) = self.group_of(lease_id) {
            return Err(ProviderError::AlreadyRunning(lease_id.to_string()));
        }
        self.inner.instances.forget(lease_id).await
    }

    async fn signal(&self, lease_id: &str, signal: WorkloadSignal) -> Result<(), ProviderError> {
        let (stored, group) = self.group_of(lease_id)?;
        let Some((pgid, _)) = group.filter(|_| stored.exit.is_none()) else {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        };
        match signal_group(pgid, rustix_signal(signal)) {
            Ok(()) => Ok(()),
            Err(rustix::io::Errno::SRCH) => Err(ProviderError::NotRunning(lease_id.to_string())),
            Err(errno) => Err(ProviderError::Signal { lease_id: lease_id.to_string(), source: errno.into() }),
        }
    }

    async fn stats(&self, lease_id: &str) -> Result<InstanceStats, ProviderError> {
        let (stored, group) = self.group_of(lease_id)?;
        let Some((pgid, _)) = group.filter(|_| stored.exit.is_none()) else {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        };
        let proc_root = self.inner.proc_root.clone();
        let members = blocking(move || Ok(procfs::group_members(&proc_root, pgid))).await?;
        if members.is_empty() {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        }
        let ticks: u64 = members.iter().map(|m| m.cpu_ticks()).sum();
        let pages: u64 = members.iter().map(|m| m.rss_pages).sum();
        let per_second = rustix::param::clock_ticks_per_second().max(1);
        let started = stored.started_at_ms.map(from_unix_ms).unwrap_or_else(SystemTime::now);
        Ok(InstanceStats {
            cpu_time: Duration::from_millis(ticks.saturating_mul(1000) / per_second),
            memory_bytes: pages.saturating_mul(rustix::param::page_size() as u64),
            uptime: SystemTime::now().duration_since(started).unwrap_or_default(),
        })
    }

    /// An uncontained workload has no limits to change: its lease's size is
    /// the ledger's bookkeeping alone, so a resize of a running one holds at once.
    async fn resize(&self, lease_id: &str, _ask: ResizeAsk) -> Result<Resized, ProviderError> {
        let (stored, group) = self.group_of(lease_id)?;
        if group.is_none() || stored.exit.is_some() {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
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
        Runtime { name: "process".into(), contained: false }
    }

    fn running(&self) -> Vec<String> {
        self.inner.instances.running()
    }
}

/// Signals every process in group `pgid`.
fn signal_group(pgid: i32, signal: Signal) -> Result<(), rustix::io::Errno> {
    let pid = Pid::from_raw(pgid).ok_or(rustix::io::Errno::INVAL)?;
    kill_process_group(pid, signal)
}

/// Signals group `pgid` to stop it; a group already gone is what stopping
/// it was for.
fn stop_group(lease_id: &str, pgid: i32, signal: Signal) -> Result<(), ProviderError> {
    match signal_group(pgid, signal) {
        Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
        Err(errno) => Err(ProviderError::Signal { lease_id: lease_id.to_string(), source: errno.into() }),
    }
}

fn rustix_signal(signal: WorkloadSignal) -> Signal {
    match signal {
        WorkloadSignal::Term => Signal::TERM,
        WorkloadSignal::Kill => Signal::KILL,
        WorkloadSignal::Int => Signal::INT,
        WorkloadSignal::Hup => Signal::HUP,
        WorkloadSignal::Usr1 => Signal::USR1,
        WorkloadSignal::Usr2 => Signal::USR2,
        WorkloadSignal::Quit => Signal::QUIT,
    }
}

#[cfg(test)]
mod tests {

    use berth_testkit::{PATIENCE, eventually};

    use super::*;
    use crate::instances::write_record;
    use crate::provider::{Exit, ExitWatch};
    use crate::testdir::TestDir;

    fn timing() -> ProcessTiming {
        ProcessTiming { stop_grace: Duration::from_secs(5), exit_poll: Duration::from_millis(20) }
    }

    fn spec(lease_id: &str, script: &str) -> LaunchSpec {
        LaunchSpec::for_test(lease_id, script)
    }

    async fn ended(watch: &mut ExitWatch) -> Exit {
        let exit =
            tokio::time::timeout(PATIENCE, watch.wait_for(Option::is_some)).await.expect("the workload never ended");
        exit.unwrap().unwrap()
    }

    fn record_on_disk(root: &Path, lease_id: &str) -> StoredRecord {
        let text =
            std::fs::read_to_string(root.join(crate::instances::RECORD_DIR).join(format!("{lease_id}.json"))).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn proc_root() -> &'static Path {
        Path::new(PROC_ROOT)
    }

    /// Waits until the number of processes in group `pgid` is as `count`
    /// wants it; `what` names the wait.
    async fn group_until(what: &str, pgid: i32, count: impl Fn(usize) -> bool) {
        eventually(what, PATIENCE, || async {
            let members = procfs::group_members(proc_root(), pgid);
            if count(members.len()) { Ok(()) } else { Err(members) }
        })
        .await;
    }

    #[tokio::test]
    async fn a_command_runs_in_its_own_directory_with_its_own_environment_and_its_exit_code_is_kept() {
        let tmp = TestDir::new();
        let provider = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        let script = "pwd; env | sort; echo oops >&2; exit 3";
        let mut launched = provider.launch(spec("lease-a", script)).await.unwrap();
        assert!(launched.record.pid.is_some());
        let exit = ended(&mut launched.exit).await;
        assert_eq!(exit.status, ExitStatus::Code(3));

        let logs = provider.log_files("lease-a").unwrap();
        let stdout = std::fs::read_to_string(&logs.stdout).unwrap();
        let work_dir = tmp.path().join("leases/lease-a");
        assert!(stdout.starts_with(&format!("{}\n", work_dir.display())), "{stdout}");
        for expected in ["BERTH_LEASE_ID=lease-a", "BERTH_NODE_ID=n-1", "GREETING=hello", "PATH=/usr/local/sbin"] {
            assert!(stdout.contains(expected), "{expected} missing from:\n{stdout}");
        }
        // Cargo runs tests with CARGO_* set: none of the agent's own
        // environment reaches the workload.
        assert!(!stdout.contains("CARGO"), "{stdout}");
        assert_eq!(std::fs::read_to_string(&logs.stderr).unwrap(), "oops\n");

        let kept = record_on_disk(tmp.path(), "lease-a");
        assert_eq!(kept.exit.unwrap().status, ExitStatus::Code(3));
        assert_eq!(kept.pid, launched.record.pid);
        assert!(kept.start_ticks.is_some());
    }

    #[tokio::test]
    async fn destroy_reaches_the_grandchildren_of_the_workload() {
        let tmp = TestDir::new();
        let provider = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        let mut launched = provider.launch(spec("lease-b", "sleep 1000 & sleep 1000")).await.unwrap();
        let pgid = i32::try_from(launched.record.pid.unwrap()).unwrap();
        group_until("three processes to be in the group", pgid, |n| n == 3).await;

        provider.destroy("lease-b").await.unwrap();
        assert!(procfs::group_members(proc_root(), pgid).is_empty(), "the backgrounded sleep survived");
        assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Signal(15));
        // Destroying again finds nothing to stop.
        provider.destroy("lease-b").await.unwrap();
        let err = provider.signal("lease-b", WorkloadSignal::Term).await.unwrap_err();
        assert!(matches!(err, ProviderError::NotRunning(_)), "{err}");
    }

    #[tokio::test]
    async fn a_workload_that_ignores_sigterm_is_killed_after_the_grace() {
        let tmp = TestDir::new();
        let timing = ProcessTiming { stop_grace: Duration::from_millis(300), ..timing() };
        let provider = ProcessProvider::new(tmp.path(), timing, CancellationToken::new());
        // An ignored signal stays ignored across exec: the sleep ignores it too.
        let mut launched = provider.launch(spec("lease-c", "trap '' TERM; sleep 1000")).await.unwrap();
        let pgid = i32::try_from(launched.record.pid.unwrap()).unwrap();
        group_until("the sleep to start", pgid, |n| n == 2).await;
        let started = tokio::time::Instant::now();
        provider.destroy("lease-c").await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(300), "SIGKILL came before the grace ran out");
        assert!(procfs::group_members(proc_root(), pgid).is_empty());
        assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Signal(9));
    }

    #[tokio::test]
    async fn a_new_provider_on_the_same_directory_adopts_the_running_process() {
        let tmp = TestDir::new();
        let first_stop = CancellationToken::new();
        let first = ProcessProvider::new(tmp.path(), timing(), first_stop.clone());
        let mut spec = spec("lease-d", "echo started; exec sleep 1000");
        spec.epoch = 7;
        spec.meta.project = "tenant".into();
        let launched = first.launch(spec).await.unwrap();
        let pid = launched.record.pid.unwrap();
        // The agent goes away without cleaning anything up.
        first_stop.cancel();
        drop(first);

        let second = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        let mut recovered = second.recover().await.unwrap();
        assert_eq!(recovered.len(), 1);
        let mut adopted = recovered.remove(0);
        assert_eq!(adopted.record.pid, Some(pid), "the same process, not a new one");
        assert_eq!(adopted.record.epoch, 7);
        assert_eq!(adopted.record.meta.project, "tenant");
        assert_eq!(adopted.record.started_at, launched.record.started_at);
        assert!(adopted.exit.borrow().is_none(), "it still runs");
        second.set_epoch("lease-d", 8).await.unwrap();
        assert_eq!(record_on_disk(tmp.path(), "lease-d").epoch, 8);
        let stats = second.stats("lease-d").await.unwrap();
        assert!(stats.memory_bytes > 0, "{stats:?}");

        second.destroy("lease-d").await.unwrap();
        let exit = ended(&mut adopted.exit).await;
        assert_eq!(exit.status, ExitStatus::Unknown, "an adopted process cannot be waited for");
        assert_eq!(record_on_disk(tmp.path(), "lease-d").exit.unwrap().status, ExitStatus::Unknown);
        let logs = second.log_files("lease-d").unwrap();
        assert_eq!(std::fs::read_to_string(logs.stdout).unwrap(), "started\n", "the logs survive the restart");

        second.settle("lease-d", Settlement::default()).await.unwrap();
        second.remove("lease-d").await.unwrap();
        assert!(!tmp.path().join("leases/lease-d").exists());
        assert!(!tmp.path().join("logs/lease-d").exists());
        assert!(second.recover().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn each_workload_is_given_free_ports_of_its_own_and_an_adopted_one_keeps_them() {
        let tmp = TestDir::new();
        let first_stop = CancellationToken::new();
        let first = ProcessProvider::new(tmp.path(), timing(), first_stop.clone());
        let script = "echo $PORT $BERTH_PORT_HTTP $BERTH_PORT_ADMIN_API; exec sleep 1000";
        let mut web = spec("lease-p", script);
        web.ports = vec!["http".into(), "admin-api".into()];
        // The lease cannot choose its own port.
        web.env.insert("PORT".into(), "1".into());
        let web = first.launch(web).await.unwrap();
        let meta = web.record.meta.clone();
        assert_ne!(meta.port, 0);
        assert_eq!(meta.ports["http"], meta.port, "the first named port is PORT");
        assert_ne!(meta.ports["admin-api"], meta.port);
        let expected = format!("{} {} {}\n", meta.port, meta.port, meta.ports["admin-api"]);
        let logs = first.log_files("lease-p").unwrap();
        eventually("the ports to be echoed", PATIENCE, || async {
            let stdout = std::fs::read_to_string(&logs.stdout).unwrap_or_default();
            if stdout == expected { Ok(()) } else { Err(stdout) }
        })
        .await;
        let unnamed = first.launch(spec("lease-q", "exec sleep 1000")).await.unwrap();
        assert_ne!(unnamed.record.meta.port, 0, "a workload with no named port still gets PORT");
        assert!(!meta.ports.values().any(|port| *port == unnamed.record.meta.port), "two replicas share a port");
        assert_eq!(record_on_disk(tmp.path(), "lease-p").meta, meta, "the ports are recorded");
        first_stop.cancel();
        drop(first);

        let second = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        let recovered = second.recover().await.unwrap();
        let adopted = recovered.iter().find(|l| l.record.lease_id == "lease-p").unwrap();
        assert!(adopted.exit.borrow().is_none(), "it still runs");
        assert_eq!(adopted.record.meta, meta, "an adopted workload keeps its ports");
        for lease_id in ["lease-p", "lease-q"] {
            second.destroy(lease_id).await.unwrap();
        }
    }

    #[test]
    fn port_names_become_variable_names() {
        assert_eq!(crate::provider::port_variable("http"), "BERTH_PORT_HTTP");
        assert_eq!(crate::provider::port_variable("admin-api"), "BERTH_PORT_ADMIN_API");
        assert_eq!(crate::provider::port_variable("a=b\0"), "BERTH_PORT_A_B_");
    }

    /// A first agent's provider, the workload it launched for `lease_id`
    /// once two processes of its group run, and that workload's group.
    async fn launched_by_a_first_agent(
        tmp: &TestDir,
        lease_id: &str,
        script: &str,
    ) -> (ProcessProvider, CancellationToken, Launched, i32) {
        let stop = CancellationToken::new();
        let first = ProcessProvider::new(tmp.path(), timing(), stop.clone());
        let launched = first.launch(spec(lease_id, script)).await.unwrap();
        let pgid = i32::try_from(launched.record.pid.unwrap()).unwrap();
        group_until("two processes of the workload to start", pgid, |n| n >= 2).await;
        (first, stop, launched, pgid)
    }

    /// A second agent's recovery: the workload ended unknown, and nothing
    /// of its group `pgid` is left.
    async fn a_second_agent_ends_it_unknown_and_kills_its_group(tmp: &TestDir, pgid: i32, what: &str) {
        let second = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        let recovered = second.recover().await.unwrap();
        assert_eq!(recovered[0].exit.borrow().map(|e| e.status), Some(ExitStatus::Unknown));
        group_until(what, pgid, |n| n == 0).await;
    }

    #[tokio::test]
    async fn what_a_workload_left_behind_while_no_agent_watched_is_killed_at_recovery() {
        let tmp = TestDir::new();
        let (first, first_stop, launched, pgid) =
            launched_by_a_first_agent(&tmp, "lease-j", "sleep 1000 & sleep 0.3").await;
        first_stop.cancel();
        drop(first);
        // The leader exits with no agent watching; its background sleep stays.
        let pid = launched.record.pid.unwrap();
        let ticks = record_on_disk(tmp.path(), "lease-j").start_ticks.unwrap();
        eventually("the leader to exit", PATIENCE, || async {
            if procfs::is_running(proc_root(), pid, ticks) { Err(format!("{pid} still runs")) } else { Ok(()) }
        })
        .await;
        assert!(!procfs::group_members(proc_root(), pgid).is_empty(), "nothing was left behind to test with");
        a_second_agent_ends_it_unknown_and_kills_its_group(&tmp, pgid, "the leftover to be killed").await;
    }

    #[tokio::test]
    async fn a_workload_started_but_never_recorded_is_killed_at_recovery() {
        let tmp = TestDir::new();
        let (first, first_stop, _launched, pgid) =
            launched_by_a_first_agent(&tmp, "lease-unrecorded", "sleep 1000 & sleep 1000").await;
        // The record as it is when an agent stops between starting the
        // workload and recording its pid.
        let mut unrecorded = record_on_disk(tmp.path(), "lease-unrecorded");
        (unrecorded.pid, unrecorded.start_ticks, unrecorded.started_at_ms) = (None, None, None);
        write_record(&first.inner.instances.layout, &unrecorded).unwrap();
        first_stop.cancel();
        drop(first);
        a_second_agent_ends_it_unknown_and_kills_its_group(&tmp, pgid, "the unrecorded workload to be killed").await;
    }

    #[tokio::test]
    async fn signals_reach_the_workload() {
        let tmp = TestDir::new();
        let provider = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        let script = "trap 'echo reloaded' HUP; trap 'exit 0' TERM; while true; do sleep 0.05; done";
        let mut launched = provider.launch(spec("lease-f", script)).await.unwrap();
        let logs = provider.log_files("lease-f").unwrap();
        let pgid = i32::try_from(launched.record.pid.unwrap()).unwrap();
        group_until("the traps to be set", pgid, |n| n >= 2).await;
        provider.signal("lease-f", WorkloadSignal::Hup).await.unwrap();
        eventually("the workload to echo reloaded", PATIENCE, || async {
            let stdout = std::fs::read_to_string(&logs.stdout).unwrap_or_default();
            if stdout.contains("reloaded") { Ok(()) } else { Err(stdout) }
        })
        .await;
        provider.signal("lease-f", WorkloadSignal::Term).await.unwrap();
        assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(0));
    }

    #[tokio::test]
    async fn unusable_leases_are_refused_before_anything_starts() {
        let tmp = TestDir::new();
        let provider = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        for bad in ["", "../escape", ".hidden", "a/b", &"x".repeat(129)] {
            let err = provider.launch(spec(bad, "exit 0")).await.unwrap_err();
            assert!(matches!(err, ProviderError::InvalidLeaseId(_)), "{bad}: {err}");
        }
        let mut bundle = spec("lease-g", "");
        bundle.program = crate::provider::Program::Entrypoint;
        let err = provider.launch(bundle).await.unwrap_err();
        assert_eq!(err.start_reason(), "Unsupported", "{err}");
        let mut missing = spec("lease-h", "");
        missing.program = crate::provider::Program::Command("/nonexistent/program".into());
        let err = provider.launch(missing).await.unwrap_err();
        assert_eq!(err.start_reason(), "StartFailed", "{err}");
        assert!(err.to_string().contains("/nonexistent/program"), "{err}");
        assert!(!tmp.path().join("escape").exists());
    }

    #[tokio::test]
    async fn a_second_launch_of_a_running_lease_is_refused() {
        let tmp = TestDir::new();
        let provider = ProcessProvider::new(tmp.path(), timing(), CancellationToken::new());
        provider.launch(spec("lease-i", "exec sleep 1000")).await.unwrap();
        let err = provider.launch(spec("lease-i", "exit 0")).await.unwrap_err();
        assert!(matches!(err, ProviderError::AlreadyRunning(_)), "{err}");
        let err = provider.remove("lease-i").await.unwrap_err();
        assert!(matches!(err, ProviderError::AlreadyRunning(_)), "{err}");
        provider.destroy("lease-i").await.unwrap();
    }
}
