//! The records every provider keeps of its instances, and the files beside
//! them: one JSON record per lease, its logs, and its working directory.
//!
//! # What is stored
//! ```text
//! DATA_DIR/leases/<lease_id>/            the workload's working directory (and HOME)
//! DATA_DIR/instances/<lease_id>.json     the record: pid, process start time, epoch,
//!                                        lease id, started_at, exit, settled, and
//!                                        what the agent API shows (ports included)
//! DATA_DIR/logs/<lease_id>/stdout.log    what it writes to standard output
//! DATA_DIR/logs/<lease_id>/stderr.log    ... and to standard error
//! ```
//!
//! # Invariants
//! - A record is replaced atomically (written whole to a temporary file,
//!   flushed, renamed over the old one), so a crash leaves the old record or
//!   the new one.
//! - Two instances of one provider never hold the same host port: a port is
//!   claimed from the moment a launch is given it until its instance is
//!   tracked, and then held by its record until it ends.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::collections::BTreeMap;

use tokio::sync::watch;

use crate::files::FileError;
use crate::node_ports::NodePorts;
use crate::provider::{Exit, ExitStatus, InstanceMeta, InstanceRecord, LaunchSpec, LogFiles, ProviderError};

pub(crate) const WORK_DIR: &str = "leases";
pub(crate) const RECORD_DIR: &str = "instances";
pub(crate) const LOG_DIR: &str = "logs";
pub(crate) const RECORD_SUFFIX: &str = ".json";
pub(crate) const TMP_SUFFIX: &str = ".tmp";
pub(crate) const STDOUT_FILE: &str = "stdout.log";
pub(crate) const STDERR_FILE: &str = "stderr.log";

/// Numbers the record writes of this process.
pub(crate) static NEXT_WRITE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A record as kept on disk.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StoredRecord {
    pub(crate) lease_id: String,
    pub(crate) epoch: u64,
    pub(crate) node_id: String,
    pub(crate) pid: Option<u32>,
    /// The process's start time in clock ticks after boot, from `/proc`.
    pub(crate) start_ticks: Option<u64>,
    pub(crate) started_at_ms: Option<u64>,
    pub(crate) exit: Option<StoredExit>,
    pub(crate) settled: bool,
    pub(crate) meta: crate::provider::InstanceMeta,
    /// The user a contained workload runs as.
    #[serde(default)]
    pub(crate) uid: Option<u32>,
    /// Whether it runs under a memory limit.
    #[serde(default)]
    pub(crate) memory_limited: bool,
    /// The phase and reason it was settled with.
    #[serde(default)]
    pub(crate) settlement: Option<crate::provider::Settlement>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StoredExit {
    pub(crate) status: ExitStatus,
    pub(crate) at_ms: u64,
}

impl StoredRecord {
    /// The record that says a start of `spec` is under way.
    pub(crate) fn starting(spec: &LaunchSpec) -> Self {
        StoredRecord {
            lease_id: spec.lease_id.clone(),
            epoch: spec.epoch,
            node_id: spec.node_id.clone(),
            pid: None,
            start_ticks: None,
            started_at_ms: None,
            exit: None,
            settled: false,
            meta: spec.meta.clone(),
            uid: None,
            memory_limited: false,
            settlement: None,
        }
    }

    pub(crate) fn to_record(&self) -> InstanceRecord {
        InstanceRecord {
            lease_id: self.lease_id.clone(),
            epoch: self.epoch,
            pid: self.pid,
            started_at: self.started_at_ms.map(from_unix_ms),
            exit: self.exit.map(|e| Exit { status: e.status, at: from_unix_ms(e.at_ms) }),
            settled: self.settled,
            settlement: self.settlement.clone(),
            meta: self.meta.clone(),
        }
    }

    pub(crate) fn exit(&self) -> Option<Exit> {
        self.exit.map(|e| Exit { status: e.status, at: from_unix_ms(e.at_ms) })
    }

    /// The process group and the leader's start time, when it started.
    pub(crate) fn group(&self) -> Option<(i32, u64)> {
        Some((i32::try_from(self.pid?).ok()?, self.start_ticks?))
    }
}

/// Where everything lives under the data directory.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub(crate) root: PathBuf,
}

impl Layout {
    pub(crate) fn work_dir(&self, lease_id: &str) -> PathBuf {
        self.root.join(WORK_DIR).join(lease_id)
    }

    pub(crate) fn record_dir(&self) -> PathBuf {
        self.root.join(RECORD_DIR)
    }

    pub(crate) fn record(&self, lease_id: &str) -> PathBuf {
        self.record_dir().join(format!("{lease_id}{RECORD_SUFFIX}"))
    }

    pub(crate) fn log_dir(&self, lease_id: &str) -> PathBuf {
        self.root.join(LOG_DIR).join(lease_id)
    }

    pub(crate) fn logs(&self, lease_id: &str) -> LogFiles {
        let dir = self.log_dir(lease_id);
        LogFiles { stdout: dir.join(STDOUT_FILE), stderr: dir.join(STDERR_FILE) }
    }
}

/// Runs `f` on the blocking pool: file writes are flushed to disk, and
/// `/proc` scans read many files.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ProviderError> + Send + 'static,
) -> Result<T, ProviderError> {
    crate::files::on_blocking_pool(f).await
}

/// Creates the working and log directories, writes the record that says a
/// start is under way, and opens fresh log files, in append mode so that
/// `log_rotation` can empty them under the workload.
pub(crate) fn prepare(layout: &Layout, record: &StoredRecord) -> Result<(PathBuf, File, File), ProviderError> {
    let work_dir = layout.work_dir(&record.lease_id);
    let log_dir = layout.log_dir(&record.lease_id);
    for dir in [&work_dir, &log_dir, &layout.record_dir()] {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| io("create", dir, source))?;
    }
    write_record(layout, record)?;
    let logs = layout.logs(&record.lease_id);
    let open = |path: &Path| {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| io("create", path, source))?;
        file.set_len(0).map_err(|source| io("empty", path, source))?;
        Ok::<_, ProviderError>(file)
    };
    Ok((work_dir, open(&logs.stdout)?, open(&logs.stderr)?))
}

/// Replaces the record atomically: whole temporary file, flush, rename,
/// flush the directory.
pub(crate) fn write_record(layout: &Layout, record: &StoredRecord) -> Result<(), ProviderError> {
    let path = layout.record(&record.lease_id);
    // A name of its own per write, so two writes of one record never share
    // (and rename away) each other's staging file.
    let write = NEXT_WRITE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let staging = path.with_extension(format!("json.{}.{write}{TMP_SUFFIX}", std::process::id()));
    let text = serde_json::to_vec_pretty(record)
        .map_err(|e| ProviderError::Corrupt { path: path.display().to_string(), detail: e.to_string() })?;
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&staging)
        .map_err(|source| io("write", &staging, source))?;
    file.write_all(&text).map_err(|source| io("write", &staging, source))?;
    file.sync_all().map_err(|source| io("flush", &staging, source))?;
    std::fs::rename(&staging, &path).map_err(|source| io("rename", &staging, source))?;
    let dir = layout.record_dir();
    File::open(&dir).and_then(|d| d.sync_all()).map_err(|source| io("flush", &dir, source))
}

pub(crate) fn remove_path(path: &Path) -> Result<(), ProviderError> {
    let removed = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
    };
    removed.map_err(|source| io("remove", path, source))
}

/// A lease id names directories: letters, digits, `-`, `_` and `.`, not
/// starting with a dot, at most 128 characters.
pub(crate) fn validate_lease_id(lease_id: &str) -> Result<(), ProviderError> {
    let usable = !lease_id.is_empty()
        && lease_id.len() <= 128
        && !lease_id.starts_with('.')
        && lease_id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if usable { Ok(()) } else { Err(ProviderError::InvalidLeaseId(lease_id.to_string())) }
}

pub(crate) fn io(action: &'static str, path: &Path, source: std::io::Error) -> ProviderError {
    ProviderError::Io(FileError::new(action, path, source))
}

pub(crate) fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis().min(u128::from(u64::MAX)) as u64)
}

pub(crate) fn from_unix_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// Reads every record under `layout`; unreadable ones are skipped with a
/// warning, and staging files a crash left behind are removed.
pub(crate) fn load_records(layout: &Layout) -> Result<Vec<StoredRecord>, ProviderError> {
    let dir = layout.record_dir();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(io("read", &dir, source)),
    };
    let mut records = Vec::new();
    for entry in entries {
        let path = entry.map_err(|source| io("read", &dir, source))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if name.ends_with(TMP_SUFFIX) {
            // A write the agent did not finish; the record it replaced is in force.
            let _ = std::fs::remove_file(&path);
            continue;
        }
        if !name.ends_with(RECORD_SUFFIX) {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|source| io("read", &path, source))?;
        match serde_json::from_str::<StoredRecord>(&text) {
            Ok(record) if validate_lease_id(&record.lease_id).is_ok() => records.push(record),
            Ok(record) => {
                tracing::warn!(path = %path.display(), lease_id = %record.lease_id, "ignoring a record with an unusable lease id")
            }
            Err(e) => {
                let error = ProviderError::Corrupt { path: path.display().to_string(), detail: e.to_string() };
                tracing::warn!(%error, "ignoring an unreadable instance record");
            }
        }
    }
    Ok(records)
}

/// The node's port range, and the ports of it handed to launches whose
/// instance is not tracked yet.
#[derive(Debug)]
pub(crate) struct PortBook {
    range: NodePorts,
    claimed: Mutex<BTreeSet<u16>>,
    /// Where in the range the next walk starts: just past the last port
    /// given, from a random place at first.
    next: AtomicUsize,
}

impl PortBook {
    /// A book handing out ports of `range`.
    pub(crate) fn new(range: NodePorts) -> Self {
        Self { range, claimed: Mutex::default(), next: AtomicUsize::new(rand::random_range(0..range.len())) }
    }

    fn claimed(&self) -> MutexGuard<'_, BTreeSet<u16>> {
        self.claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Finds a free port of the node's range for each of `names` (one, with
    /// none) that is neither in `taken` (the ports running instances hold)
    /// nor claimed by another launch, nor bound by anything on the host:
    /// the first is `PORT`. Each walk goes on from where the last one
    /// stopped, which began at a random place: a port is given again only
    /// once the whole range was, and agents sharing a host rarely reach for
    /// the same port at once.
    ///
    /// `taken` is called with the claims locked. A launch gives its claim
    /// back only once its instance is tracked, and giving it back waits for
    /// that lock: so each port another launch was given is either still
    /// claimed here or already in what `taken` reads. Read before the lock,
    /// a port could move from claimed to held in between and be in neither.
    pub(crate) fn allocate(
        self: &Arc<Self>,
        lease_id: &str,
        names: &[String],
        taken: impl FnOnce() -> BTreeSet<u16>,
    ) -> Result<(Vec<u16>, PortClaim), ProviderError> {
        let wanted = names.len().max(1);
        let mut claimed = self.claimed();
        let mut taken = taken();
        taken.extend(claimed.iter().copied());
        let start = self.next.load(Ordering::Relaxed);
        // Every probe stays bound until the end, so nothing else on the host
        // binds a port this launch was given while it looks for the next.
        let mut probes = Vec::new();
        let mut ports = Vec::new();
        for index in 0..self.range.len() {
            if ports.len() == wanted {
                break;
            }
            let port = self.range.nth_from(start, index);
            // Port 0 would be the kernel's choice, not the range's.
            if port == 0 || taken.contains(&port) {
                continue;
            }
            if let Ok(probe) = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)) {
                ports.push(port);
                probes.push(probe);
                self.next.store((start + index + 1) % self.range.len(), Ordering::Relaxed);
            }
        }
        if ports.len() < wanted {
            let held = taken.iter().filter(|port| (self.range.first..=self.range.last).contains(*port)).count();
            return Err(ProviderError::NoFreePort {
                lease_id: lease_id.to_string(),
                detail: format!(
                    "{wanted} wanted, {} free in the node's port range {} ({held} held by its workloads, the rest \
                     bound by something else on the host)",
                    ports.len(),
                    self.range
                ),
            });
        }
        claimed.extend(ports.iter().copied());
        drop(claimed);
        Ok((ports.clone(), PortClaim { book: self.clone(), ports }))
    }
}

/// Ports a launch was given, kept from other launches until its instance is
/// tracked (which then keeps them) or the launch failed.
#[derive(Debug)]
pub(crate) struct PortClaim {
    book: Arc<PortBook>,
    ports: Vec<u16>,
}

impl Drop for PortClaim {
    fn drop(&mut self) {
        let mut claimed = self.book.claimed();
        for port in &self.ports {
            claimed.remove(port);
        }
    }
}

/// The host ports an instance holds.
pub(crate) fn host_ports(meta: &InstanceMeta) -> impl Iterator<Item = u16> + '_ {
    std::iter::once(meta.port).chain(meta.ports.values().copied()).filter_map(|port| u16::try_from(port).ok())
}

/// Gives the spec's meta the host ports a launch was given.
fn assign_ports(meta: &mut InstanceMeta, names: &[String], ports: &[u16]) {
    meta.port = ports.first().copied().map(u32::from).unwrap_or_default();
    meta.ports = names.iter().cloned().zip(ports.iter().map(|port| u32::from(*port))).collect();
}

/// An instance a provider tracks: its record, and the watch its end is told on.
#[derive(Debug)]
pub(crate) struct Tracked {
    pub(crate) stored: StoredRecord,
    pub(crate) exit: watch::Sender<Option<Exit>>,
}

/// Every instance one provider tracks, and where their files are; each
/// record change is written through to disk.
#[derive(Debug)]
pub(crate) struct Instances {
    pub(crate) layout: Layout,
    map: Mutex<BTreeMap<String, Tracked>>,
}

impl Instances {
    /// The instances kept under `data_dir` (none tracked yet).
    pub(crate) fn new(data_dir: &Path) -> Self {
        Self { layout: Layout { root: data_dir.to_path_buf() }, map: Mutex::new(BTreeMap::new()) }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Tracked>> {
        // A panic while holding the lock left a map that is still whole.
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The record of `lease_id`, as tracked.
    pub(crate) fn stored(&self, lease_id: &str) -> Result<StoredRecord, ProviderError> {
        self.lock().get(lease_id).map(|t| t.stored.clone()).ok_or_else(|| ProviderError::NotFound(lease_id.to_string()))
    }

    /// The leases whose workloads this provider started or adopted and that
    /// have neither ended nor been settled; reads memory only.
    pub(crate) fn running(&self) -> Vec<String> {
        self.lock()
            .values()
            .filter(|t| t.stored.pid.is_some() && t.stored.exit.is_none() && !t.stored.settled)
            .map(|t| t.stored.lease_id.clone())
            .collect()
    }

    /// Tracks a record found at recovery, with a watch that already holds
    /// its end if it has one; what recovery reports of it.
    pub(crate) fn recovered(&self, stored: StoredRecord) -> crate::provider::Launched {
        let (exit_tx, exit_rx) = watch::channel(stored.exit());
        let record = stored.to_record();
        self.lock().insert(stored.lease_id.clone(), Tracked { stored, exit: exit_tx });
        crate::provider::Launched { record, exit: exit_rx }
    }

    /// Records on disk that `stored` ended with `status` while no agent
    /// watched it, as recovery finds it.
    pub(crate) async fn ended_unwatched(
        &self,
        stored: &mut StoredRecord,
        status: ExitStatus,
    ) -> Result<(), ProviderError> {
        stored.exit = Some(StoredExit { status, at_ms: unix_ms(SystemTime::now()) });
        let (layout, ended) = (self.layout.clone(), stored.clone());
        blocking(move || write_record(&layout, &ended)).await
    }

    /// Records that the agent is done with `lease_id`, and how it left it.
    pub(crate) async fn settle(
        self: &Arc<Self>,
        lease_id: &str,
        settlement: crate::provider::Settlement,
    ) -> Result<(), ProviderError> {
        self.update(lease_id, move |record| {
            record.settled = true;
            record.settlement = Some(settlement);
        })
        .await
    }

    /// Readies `spec` to launch: refuses it while the workload of its lease
    /// still runs, then gives it host ports from `book`. The claim keeps the
    /// ports from other launches; hold it until the instance is tracked or
    /// the launch failed.
    pub(crate) fn prepare_launch(
        &self,
        spec: &mut LaunchSpec,
        book: &Arc<PortBook>,
    ) -> Result<PortClaim, ProviderError> {
        if let Ok(stored) = self.stored(&spec.lease_id)
            && stored.exit.is_none()
            && stored.pid.is_some()
        {
            return Err(ProviderError::AlreadyRunning(spec.lease_id.clone()));
        }
        let (ports, claim) = book.allocate(&spec.lease_id, &spec.ports, || self.ports_taken())?;
        assign_ports(&mut spec.meta, &spec.ports, &ports);
        Ok(claim)
    }

    /// The host ports running instances hold. Takes the instances' lock
    /// while [`PortBook::allocate`] holds its claims': never the other way
    /// round (a claim is given back with no instances' lock held).
    fn ports_taken(&self) -> BTreeSet<u16> {
        self.lock().values().filter(|t| t.stored.exit.is_none()).flat_map(|t| host_ports(&t.stored.meta)).collect()
    }

    /// Runs `f` over the record of `lease_id` on the blocking pool, writing
    /// it back when `f` changed it.
    pub(crate) async fn update<T: Send + 'static>(
        self: &Arc<Self>,
        lease_id: &str,
        f: impl FnOnce(&mut StoredRecord) -> T + Send + 'static,
    ) -> Result<T, ProviderError> {
        let instances = self.clone();
        let lease_id = lease_id.to_string();
        blocking(move || {
            let mut map = instances.lock();
            let tracked = map.get_mut(&lease_id).ok_or_else(|| ProviderError::NotFound(lease_id.clone()))?;
            let before = tracked.stored.clone();
            let out = f(&mut tracked.stored);
            if tracked.stored != before {
                write_record(&instances.layout, &tracked.stored)?;
            }
            Ok(out)
        })
        .await
    }

    /// Tracks a started instance and writes its record.
    pub(crate) async fn track(
        self: &Arc<Self>,
        stored: StoredRecord,
        exit: watch::Sender<Option<Exit>>,
    ) -> Result<(), ProviderError> {
        let instances = self.clone();
        blocking(move || {
            instances.lock().insert(stored.lease_id.clone(), Tracked { stored: stored.clone(), exit });
            write_record(&instances.layout, &stored)
        })
        .await
    }

    /// Writes the record of a launch that never started: it ended at once,
    /// how unknown.
    pub(crate) async fn never_started(self: &Arc<Self>, first: StoredRecord) {
        let failed = StoredRecord {
            exit: Some(StoredExit { status: ExitStatus::Unknown, at_ms: unix_ms(SystemTime::now()) }),
            ..first
        };
        let instances = self.clone();
        let _ = blocking(move || write_record(&instances.layout, &failed)).await;
    }

    /// Records how `lease_id` ended (the first end told is kept) and tells
    /// whoever watches.
    pub(crate) async fn ended(self: &Arc<Self>, lease_id: &str, status: ExitStatus) {
        let exit = Exit { status, at: SystemTime::now() };
        let stored = StoredExit { status, at_ms: unix_ms(exit.at) };
        let recorded = self
            .update(lease_id, move |record| {
                if record.exit.is_none() {
                    record.exit = Some(stored);
                }
            })
            .await;
        if let Err(error) = recorded {
            tracing::warn!(%lease_id, %error, "cannot record how the workload ended");
        }
        tracing::info!(%lease_id, %status, "workload ended");
        if let Some(tracked) = self.lock().get(lease_id) {
            tracked.exit.send_replace(Some(exit));
        }
    }

    /// Forgets `lease_id`: its record, its logs and its working directory.
    pub(crate) async fn forget(self: &Arc<Self>, lease_id: &str) -> Result<(), ProviderError> {
        let instances = self.clone();
        let lease_id = lease_id.to_string();
        blocking(move || {
            instances.lock().remove(&lease_id);
            let layout = &instances.layout;
            remove_path(&layout.record(&lease_id))?;
            remove_path(&layout.log_dir(&lease_id))?;
            remove_path(&layout.work_dir(&lease_id))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_the_nodes_range_and_none_held_bound_or_claimed_is_given_twice() {
        let first = berth_testkit::free_ports(4);
        let book = Arc::new(PortBook::new(NodePorts { first, last: first + 3 }));
        // Something else on the host listens on the first; a running
        // workload holds the second.
        let _other = TcpListener::bind((Ipv4Addr::UNSPECIFIED, first)).unwrap();
        let held = BTreeSet::from([first + 1]);
        let names = ["http".to_string(), "admin".to_string()];
        let (given, claim) = book.allocate("l-1", &names, || held.clone()).unwrap();
        let mut sorted = given.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [first + 2, first + 3], "{given:?}");

        // While the launch has not tracked its instance, its ports stay its own.
        let error = book.allocate("l-2", &[], || held.clone()).unwrap_err().to_string();
        let range = format!("{first}-{}", first + 3);
        assert!(error.contains("lease l-2") && error.contains(&range) && error.contains("1 wanted, 0 free"), "{error}");
        drop(claim);
        let (again, _claim) = book.allocate("l-2", &[], || held).unwrap();
        assert!(again.len() == 1 && given.contains(&again[0]), "{again:?} after {given:?} came back");
    }

    /// Regression: the ports running instances hold were read before the
    /// claims were locked, so a port another launch moved from claimed to
    /// held in between (its instance tracked, then its claim given back)
    /// was in neither set, and given twice. Read under the lock, the move
    /// waits for the read.
    #[test]
    fn a_port_moving_from_claimed_to_held_is_never_missed_by_a_launch_looking_for_one() {
        let first = berth_testkit::free_ports(2);
        let book = Arc::new(PortBook::new(NodePorts { first, last: first + 1 }));
        let (given, claim) = book.allocate("l-1", &[], BTreeSet::new).unwrap();
        let (held, tracked) = (Arc::new(Mutex::new(BTreeSet::new())), given.clone());
        let (again, _claim) = book
            .allocate("l-2", &[], || {
                // l-1's instance is tracked and its claim given back right
                // now, on another thread: the claim cannot go before l-2
                // has its port, so l-2 sees the port claimed.
                let (moved, moved_seen) = std::sync::mpsc::channel();
                {
                    let held = held.clone();
                    std::thread::spawn(move || {
                        held.lock().unwrap().extend(tracked);
                        drop(claim);
                        let _ = moved.send(());
                    });
                }
                let early = moved_seen.recv_timeout(Duration::from_millis(50));
                assert!(early.is_err(), "a claim was given back while a launch read what is held");
                assert!(book.claimed.try_lock().is_err(), "the claims are locked while what is held is read");
                held.lock().unwrap().clone()
            })
            .unwrap();
        assert_ne!(again, given, "port {given:?} given twice");
    }

    #[test]
    fn a_port_is_given_again_only_once_every_port_of_the_range_was() {
        let first = berth_testkit::free_ports(3);
        let book = Arc::new(PortBook::new(NodePorts { first, last: first + 2 }));
        let mut given = BTreeSet::new();
        for lease in ["l-1", "l-2", "l-3"] {
            // Each launch's workload ended before the next: nothing holds a port.
            let (ports, _claim) = book.allocate(lease, &[], BTreeSet::new).unwrap();
            assert!(given.insert(ports[0]), "port {} given twice within the range's first walk", ports[0]);
        }
        assert_eq!(given, BTreeSet::from([first, first + 1, first + 2]));
    }

    #[test]
    fn a_range_built_by_hand_never_gives_port_zero_nor_panics_the_wrong_way_round() {
        let zero = Arc::new(PortBook::new(NodePorts { first: 0, last: 0 }));
        let error = zero.allocate("l-1", &[], BTreeSet::new).unwrap_err().to_string();
        assert!(error.contains("1 wanted, 0 free"), "{error}");
        let backwards = NodePorts { first: 61_010, last: 61_000 };
        assert_eq!((backwards.len(), backwards.nth_from(5, 3)), (1, 61_010));
    }
}
