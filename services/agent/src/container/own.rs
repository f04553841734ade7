//! The process runtime: the agent's own launcher for the runtime spec the
//! container provider writes, so a contained workload starts as fast as a
//! process can be spawned into namespaces, without a runtime binary.
//!
//! It speaks the part of runc's command line the provider uses (`run`,
//! `state`, `kill`, `delete`, `list`, `events --stats`), so the provider,
//! its records, adoption and the contract suites are the same for every
//! runtime; only `run` is a process of its own (the workload's monitor),
//! the others run inside the agent ([`command`]).
//!
//! # How a workload is started (`run`)
//! The agent's own executable, invoked as [`ARG0`] (both `berth-agent` and
//! `berth` dispatch on that name before anything else runs, so the process
//! is single-threaded, as `unshare` and `setns` need):
//! 1. **The monitor** unshares a PID namespace and creates the lease's
//!    cgroup with its limits (v1 per controller on hybrid hosts, the unified
//!    tree on v2). On v1 it steps into the cgroup itself, spawns the init
//!    there and steps back out: a single thread moving itself through a
//!    hierarchy's `tasks` file takes none of the kernel-wide lock that
//!    moving another process takes, whose writer waits out an RCU grace
//!    period (5 to 25 ms each launch, unless the host's cgroup2 mount has
//!    `favordynmods`). On v2 it spawns the init first and moves it in while
//!    the init sets up. Either way the monitor itself ends outside the
//!    cgroup. It writes the init's host pid and lets it go on (a byte on a
//!    pipe), then waits for it and exits with its status (128 + the signal
//!    for a signal), as runc does.
//! 2. **The init** is the PID namespace's first process. It enters the
//!    tenant's network namespace, unshares mount, IPC and UTS namespaces,
//!    makes every mount private, mounts what the spec lists into the root
//!    (each destination resolved inside the root, so a link in an image
//!    never sends a mount outside it), masks and write-protects the `/proc`
//!    paths the spec names, pivots into the root and detaches the host's,
//!    sets the host name, drops every capability from the bounding set and
//!    sets `no_new_privs`. Then it waits for the monitor's word, unshares
//!    a cgroup namespace (rooted at the lease's cgroup, where it now is) and
//!    execs the spec's program as the spec's user with no supplementary
//!    groups (which clears the permitted and effective sets).
//!
//! # Invariants
//! - Nothing of a workload runs before its cgroup holds it: the init execs
//!   the workload only on the monitor's word, and the monitor kills it if
//!   the cgroup cannot hold it.
//! - A mount destination never leaves the root (links are resolved inside
//!   it); a failed mount fails the start, nothing runs half-contained.
//! - `kill --all` and `delete` reach every process of the workload: SIGKILL
//!   to a PID namespace's first process ends every process in it, and every
//!   pid in the cgroup is signalled too.
//! - State lives in `ROOT/<id>/state.json` (the init's pid, its start time,
//!   the cgroup); a pid whose start time differs is not the workload.
//!
//! What it does not do that runc does: seccomp filters, the device cgroup
//! (the workload sees only `/dev`'s standard nodes, bound from the host,
//! and cannot create others without `CAP_MKNOD`), rlimits, AppArmor and
//! SELinux labels, user namespaces. The README's table says so.

use std::collections::BTreeSet;
use std::ffi::{CString, OsStr};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::DirBuilderExt as _;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use oci_spec::runtime::{LinuxNamespaceType, Mount, Spec};
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};

use crate::procfs::{self, PROC_ROOT};

/// The name the agent's executable is invoked by to act as this runtime.
pub(crate) const ARG0: &str = "berth-runtime";

/// The executable the monitor and init are: the running binary itself.
const SELF_EXE: &str = "/proc/self/exe";

const STATE_FILE: &str = "state.json";
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The v1 hierarchies a workload is held in: its memory, CPU (and CPU
/// accounting, its stats), and process count.
const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "cpuacct", "pids"];

/// How long `delete` waits for a killed workload's processes to go.
const DELETE_WAIT: Duration = Duration::from_secs(5);

/// Host device nodes every workload sees in its `/dev`, as runc gives them.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// Runs this runtime when the process was invoked as [`ARG0`]: returns the
/// exit code to end with, or `None` for any other name. Call it first in
/// `main`, before any thread or async runtime starts.
pub fn main_if_invoked() -> Option<i32> {
    let arg0 = std::env::args_os().next()?;
    if Path::new(&arg0).file_name() != Some(OsStr::new(ARG0)) {
        return None;
    }
    Some(main())
}

/// Runs this runtime whatever the process was invoked as (the
/// `berth-runtime` executable): returns the exit code to end with. Call it
/// first in `main`, before any thread or async runtime starts.
pub fn main() -> i32 {
    let args: Vec<String> = std::env::args_os().skip(1).map(|arg| arg.to_string_lossy().into_owned()).collect();
    dispatch(&args)
}

fn dispatch(args: &[String]) -> i32 {
    let (root, rest) = match args {
        [flag, root, rest @ ..] if flag == "--root" => (PathBuf::from(root), rest),
        _ => return fail("usage: berth-runtime --root DIR COMMAND ..."),
    };
    match rest.first().map(String::as_str) {
        Some("run") => {
            let (mut bundle, mut pid_file, mut id) = (None, None, None);
            let mut words = rest[1..].iter();
            while let Some(word) = words.next() {
                match word.as_str() {
                    "--keep" => {}
                    "--bundle" => bundle = words.next().map(PathBuf::from),
                    "--pid-file" => pid_file = words.next().map(PathBuf::from),
                    other => id = Some(other.to_string()),
                }
            }
            match (bundle, pid_file, id) {
                (Some(bundle), Some(pid_file), Some(id)) => monitor(&root, &bundle, &pid_file, &id),
                _ => fail("usage: berth-runtime --root DIR run --bundle DIR --pid-file FILE ID"),
            }
        }
        Some("init") => match rest.get(1..) {
            Some([flag, bundle]) if flag == "--bundle" => init(Path::new(bundle)),
            _ => fail("usage: berth-runtime --root DIR init --bundle DIR"),
        },
        _ => {
            let words: Vec<&str> = rest.iter().map(String::as_str).collect();
            match command(&root, &words) {
                Ok(out) => {
                    let _ = std::io::stdout().write_all(&out);
                    0
                }
                Err(error) => fail(&error),
            }
        }
    }
}

fn fail(message: &str) -> i32 {
    let _ = writeln!(std::io::stderr(), "{ARG0}: {message}");
    1
}

/// What the runtime keeps of a started workload.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct State {
    /// The init's pid on the host.
    pid: u32,
    /// Its start time, in clock ticks after boot.
    start_ticks: u64,
    /// Its cgroup, relative to each hierarchy's root.
    cgroup: String,
}

impl State {
    fn load(root: &Path, id: &str) -> Result<Self, String> {
        let path = container_dir(root, id)?.join(STATE_FILE);
        let text = std::fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!("container {id} does not exist"),
            _ => format!("cannot read {}: {e}", path.display()),
        })?;
        serde_json::from_slice(&text).map_err(|e| format!("{} is corrupt: {e}", path.display()))
    }

    fn running(&self) -> bool {
        self.pid != 0 && procfs::is_running(Path::new(PROC_ROOT), self.pid, self.start_ticks)
    }
}

/// `ROOT/<id>`, refusing an id that is not a plain name.
fn container_dir(root: &Path, id: &str) -> Result<PathBuf, String> {
    let plain = !id.is_empty() && Path::new(id).components().all(|c| matches!(c, Component::Normal(_)));
    if !plain || id.contains('/') {
        return Err(format!("'{id}' is not a container id"));
    }
    Ok(root.join(id))
}

/// The runtime's commands other than `run`, run in the caller's process:
/// `state ID`, `kill [--all] ID SIGNAL`, `delete [--force] ID`,
/// `list [--quiet]`, `events --stats ID`, `update FLAGS ID`. Returns what runc would print.
pub(crate) fn command(root: &Path, args: &[&str]) -> Result<Vec<u8>, String> {
    let plain: Vec<&str> = args.iter().copied().filter(|a| !matches!(*a, "--force" | "--quiet" | "--stats")).collect();
    match plain.as_slice() {
        ["state", id] => {
            let state = State::load(root, id)?;
            let status = if state.running() { "running" } else { "stopped" };
            Ok(serde_json::json!({ "id": id, "status": status, "pid": state.pid }).to_string().into_bytes())
        }
        ["kill", "--all", id, signal] => {
            let state = State::load(root, id)?;
            let signal = parse_signal(signal)?;
            kill_all(&state, signal);
            Ok(Vec::new())
        }
        ["kill", id, signal] => {
            let state = State::load(root, id)?;
            let signal = parse_signal(signal)?;
            if !state.running() {
                return Err(format!("container {id} is not running"));
            }
            rustix::process::kill_process(pid(state.pid)?, signal).map_err(|e| format!("cannot signal {id}: {e}"))?;
            Ok(Vec::new())
        }
        ["delete", id] => {
            let dir = container_dir(root, id)?;
            match State::load(root, id) {
                Ok(state) => {
                    kill_all(&state, rustix::process::Signal::KILL);
                    let deadline = Instant::now() + DELETE_WAIT;
                    let cgroup = Cgroup::new(&state.cgroup);
                    while cgroup.holds_processes() && Instant::now() < deadline {
                        wait_a_little();
                    }
                    cgroup.remove();
                }
                Err(error) if !dir.exists() => return Err(error),
                // A start that failed before its state was written.
                Err(_) => {}
            }
            std::fs::remove_dir_all(&dir).map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
            Ok(Vec::new())
        }
        ["list"] => {
            let mut ids: Vec<String> = std::fs::read_dir(root)
                .into_iter()
                .flatten()
                .filter_map(Result::ok)
                .filter_map(|entry| entry.file_name().into_string().ok())
                .collect();
            ids.sort();
            Ok(ids.into_iter().map(|id| id + "\n").collect::<String>().into_bytes())
        }
        ["events", id] => {
            let state = State::load(root, id)?;
            if !state.running() {
                return Err(format!("container {id} is not running"));
            }
            let cgroup = Cgroup::new(&state.cgroup);
            let stats = serde_json::json!({
                "type": "stats",
                "id": id,
                "data": {
                    "cpu": { "usage": { "total": cgroup.cpu_nanos() } },
                    "memory": { "usage": { "usage": cgroup.memory_bytes() } },
                },
            });
            Ok(stats.to_string().into_bytes())
        }
        ["update", rest @ ..] => {
            let (id, flags) = rest.split_last().ok_or("update needs a container id")?;
            let update = Update::parse(flags)?;
            let state = State::load(root, id)?;
            if !state.running() {
                return Err(format!("container {id} is not running"));
            }
            Cgroup::new(&state.cgroup).update(&update)?;
            Ok(Vec::new())
        }
        _ => Err(format!("unknown command: {}", args.join(" "))),
    }
}

/// The limits `update` changes, with `runc update`'s flags: `--memory`,
/// `--memory-swap`, `--memory-reservation`, `--cpu-quota`, `--cpu-period`,
/// each a number of bytes or microseconds (-1 lifts a limit).
#[derive(Debug, Default, PartialEq, Eq)]
struct Update {
    memory: Option<i64>,
    memory_swap: Option<i64>,
    memory_reservation: Option<i64>,
    cpu_quota: Option<i64>,
    cpu_period: Option<u64>,
}

impl Update {
    fn parse(flags: &[&str]) -> Result<Self, String> {
        let mut update = Update::default();
        let mut flags = flags.iter();
        while let Some(flag) = flags.next() {
            let value = flags.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let number = || value.parse::<i64>().map_err(|_| format!("{flag}: '{value}' is not a number"));
            match *flag {
                "--memory" => update.memory = Some(number()?),
                "--memory-swap" => update.memory_swap = Some(number()?),
                "--memory-reservation" => update.memory_reservation = Some(number()?),
                "--cpu-quota" => update.cpu_quota = Some(number()?),
                "--cpu-period" => {
                    update.cpu_period = Some(value.parse().map_err(|_| format!("{flag}: '{value}' is not a number"))?);
                }
                other => return Err(format!("update: unknown flag {other}")),
            }
        }
        Ok(update)
    }
}

#[allow(clippy::disallowed_methods)] // a blocking runtime command, off the agent's async threads
fn wait_a_little() {
    std::thread::sleep(Duration::from_millis(10));
}

fn pid(raw: u32) -> Result<rustix::process::Pid, String> {
    i32::try_from(raw).ok().and_then(rustix::process::Pid::from_raw).ok_or_else(|| format!("{raw} is not a pid"))
}

fn parse_signal(name: &str) -> Result<rustix::process::Signal, String> {
    use rustix::process::Signal;
    Ok(match name.trim_start_matches("SIG") {
        "TERM" | "15" => Signal::TERM,
        "KILL" | "9" => Signal::KILL,
        "INT" | "2" => Signal::INT,
        "HUP" | "1" => Signal::HUP,
        "USR1" | "10" => Signal::USR1,
        "USR2" | "12" => Signal::USR2,
        "QUIT" | "3" => Signal::QUIT,
        other => return Err(format!("unknown signal '{other}'")),
    })
}

/// Sends `signal` to the init (which, for SIGKILL, ends its whole PID
/// namespace) and to every process the workload's cgroup holds.
fn kill_all(state: &State, signal: rustix::process::Signal) {
    if state.running()
        && let Ok(init) = pid(state.pid)
    {
        let _ = rustix::process::kill_process(init, signal);
    }
    for member in Cgroup::new(&state.cgroup).processes() {
        if let Ok(member) = pid(member) {
            let _ = rustix::process::kill_process(member, signal);
        }
    }
}

/// A workload's cgroup in every hierarchy that holds it (a container's,
/// or a microVM's VMM's).
pub(crate) struct Cgroup {
    /// Its directory in each hierarchy (one on v2).
    dirs: Vec<PathBuf>,
    /// Which of `dirs` each controller is in (v1; empty on v2).
    controllers: Vec<(&'static str, usize)>,
    /// Whether the host's cgroups are v2 (unified).
    unified: bool,
}

impl Cgroup {
    /// The cgroup at `path` under the host's cgroup root.
    pub(crate) fn new(path: &str) -> Self {
        let root = Path::new(CGROUP_ROOT);
        let relative = path.trim_start_matches('/');
        if root.join("cgroup.controllers").exists() {
            return Self { dirs: vec![root.join(relative)], controllers: Vec::new(), unified: true };
        }
        // `cpu` and `cpuacct` are often one hierarchy under two names.
        let (mut dirs, mut controllers, mut hierarchies) = (Vec::new(), Vec::new(), Vec::<PathBuf>::new());
        for controller in V1_CONTROLLERS {
            let Ok(real) = std::fs::canonicalize(root.join(controller)) else { continue };
            let index = hierarchies.iter().position(|seen| *seen == real).unwrap_or_else(|| {
                hierarchies.push(real);
                dirs.push(root.join(controller).join(relative));
                dirs.len() - 1
            });
            controllers.push((controller, index));
        }
        Self { dirs, controllers, unified: false }
    }

    /// The directory holding `controller`'s files.
    fn dir(&self, controller: &str) -> Option<&Path> {
        if self.unified {
            return self.dirs.first().map(PathBuf::as_path);
        }
        let (_, index) = self.controllers.iter().find(|(name, _)| *name == controller)?;
        self.dirs.get(*index).map(PathBuf::as_path)
    }

    /// Creates the cgroup with the spec's limits.
    fn create(&self, spec: &Spec) -> Result<(), String> {
        let resources = spec.linux().as_ref().and_then(|linux| linux.resources().clone());
        let memory = resources.as_ref().and_then(|r| r.memory().as_ref().map(|m| (m.limit(), m.swap())));
        let cpu = resources.as_ref().and_then(|r| r.cpu().as_ref().map(|c| (c.quota(), c.period())));
        let pids = resources.as_ref().and_then(|r| r.pids().as_ref().map(|p| p.limit()));
        self.create_with(memory, cpu, pids)
    }

    /// Creates the cgroup with a memory limit (and swap limit), a CPU quota
    /// per period (µs) and a process limit, each where given.
    pub(crate) fn create_with(
        &self,
        memory: Option<(Option<i64>, Option<i64>)>,
        cpu: Option<(Option<i64>, Option<u64>)>,
        pids: Option<i64>,
    ) -> Result<(), String> {
        if self.unified {
            self.enable_controllers()?;
        }
        for dir in &self.dirs {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| format!("cannot create cgroup {}: {e}", dir.display()))?;
        }
        if let Some((Some(limit), swap)) = memory {
            self.set_memory(limit, swap)?;
        }
        if let Some((Some(quota), period)) = cpu {
            self.set_cpu(quota, period.unwrap_or(100_000))?;
        }
        if let Some(limit) = pids.filter(|limit| *limit > 0) {
            self.write("pids", "pids.max", limit.to_string(), true)?;
        }
        Ok(())
    }

    /// Changes a running workload's limits, as `runc update` does: each
    /// `Some` is set, the rest left alone.
    fn update(&self, update: &Update) -> Result<(), String> {
        if let Some(reservation) = update.memory_reservation {
            self.set_memory_reservation(reservation)?;
        }
        if let Some(limit) = update.memory {
            self.set_memory(limit, update.memory_swap)?;
        }
        if let Some(quota) = update.cpu_quota {
            self.set_cpu(quota, update.cpu_period.unwrap_or(100_000))?;
        }
        Ok(())
    }

    /// Writes `value` to `controller`'s `file`; a controller or file the
    /// host lacks is an error only when `required`.
    fn write(&self, controller: &str, file: &str, value: String, required: bool) -> Result<(), String> {
        let Some(dir) = self.dir(controller) else {
            return if required { Err(format!("no {controller} cgroup controller on this host")) } else { Ok(()) };
        };
        let path = dir.join(file);
        match std::fs::write(&path, &value) {
            Ok(()) => Ok(()),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("cannot write {value} to {}: {e}", path.display())),
        }
    }

    /// Sets the hard memory limit and, with `swap` (memory plus swap, as the
    /// OCI spec counts it), the swap limit. On v1 the memory-plus-swap limit
    /// may never be below the memory limit, so a growing limit moves it
    /// first and a shrinking one after. A shrink below what the workload
    /// uses is refused by the kernel (v1: `EBUSY` once reclaim fails), and
    /// nothing changes.
    fn set_memory(&self, limit: i64, swap: Option<i64>) -> Result<(), String> {
        if self.unified {
            self.write("memory", "memory.max", limit.to_string(), true)?;
            let swap = swap.map_or(0, |swap| swap.saturating_sub(limit).max(0));
            return self.write("memory", "memory.swap.max", swap.to_string(), false);
        }
        let current = self.read_number("memory", "memory.limit_in_bytes");
        let growing = u64::try_from(limit).is_ok_and(|limit| limit >= current);
        // Absent where the kernel does not account swap.
        let set_swap =
            || swap.map_or(Ok(()), |swap| self.write("memory", "memory.memsw.limit_in_bytes", swap.to_string(), false));
        if growing {
            set_swap()?;
        }
        self.write("memory", "memory.limit_in_bytes", limit.to_string(), true)?;
        if !growing {
            set_swap()?;
        }
        Ok(())
    }

    /// Sets the soft memory limit the kernel reclaims towards: v1's
    /// `memory.soft_limit_in_bytes`, v2's `memory.high` (which also
    /// throttles the workload's allocations above it). -1 lifts it.
    fn set_memory_reservation(&self, reservation: i64) -> Result<(), String> {
        let value = match (self.unified, reservation) {
            (true, ..0) => "max".to_string(),
            (false, ..0) => "-1".to_string(),
            (_, bytes) => bytes.to_string(),
        };
        self.write("memory", if self.unified { "memory.high" } else { "memory.soft_limit_in_bytes" }, value, true)
    }

    /// Sets the CPU quota per period, in microseconds; a negative quota lifts it.
    pub(crate) fn set_cpu(&self, quota: i64, period: u64) -> Result<(), String> {
        if self.unified {
            let quota = if quota < 0 { "max".to_string() } else { quota.to_string() };
            return self.write("cpu", "cpu.max", format!("{quota} {period}"), true);
        }
        self.write("cpu", "cpu.cfs_period_us", period.to_string(), true)?;
        self.write("cpu", "cpu.cfs_quota_us", quota.to_string(), true)
    }

    /// On v2, lets the cgroup's ancestors hand it the controllers it is
    /// limited by.
    fn enable_controllers(&self) -> Result<(), String> {
        let root = Path::new(CGROUP_ROOT);
        let Some(dir) = self.dirs.first() else { return Ok(()) };
        let mut ancestors: Vec<&Path> = dir
            .ancestors()
            .skip(1)
            .take_while(|a| a.starts_with(root) && a.as_os_str().len() >= root.as_os_str().len())
            .collect();
        ancestors.reverse();
        for ancestor in ancestors {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(ancestor)
                .map_err(|e| format!("cannot create cgroup {}: {e}", ancestor.display()))?;
            let control = ancestor.join("cgroup.subtree_control");
            for controller in ["+memory", "+cpu", "+pids"] {
                // Already enabled, or not there to enable: the limit write says which.
                let _ = std::fs::write(&control, controller);
            }
        }
        Ok(())
    }

    /// Where the calling process is now, in each of this cgroup's v1
    /// hierarchies (as `/proc/self/cgroup` says).
    fn current_v1(&self) -> Result<Vec<PathBuf>, String> {
        let text =
            std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let root = Path::new(CGROUP_ROOT);
        (0..self.dirs.len())
            .map(|index| {
                let (controller, _) = self.controllers.iter().find(|(_, at)| *at == index).ok_or("no controller")?;
                text.lines()
                    .filter_map(|line| {
                        let mut fields = line.splitn(3, ':').skip(1);
                        fields.next().zip(fields.next())
                    })
                    .find(|(controllers, _)| controllers.split(',').any(|c| c == *controller))
                    .map(|(_, path)| root.join(controller).join(path.trim_start_matches('/')))
                    .ok_or_else(|| format!("/proc/self/cgroup names no {controller} cgroup"))
            })
            .collect()
    }

    /// Moves the calling thread into each of `dirs` (v1). A thread moving
    /// itself through `tasks` takes none of the kernel-wide lock a move
    /// through `cgroup.procs` takes, whose writer waits out an RCU grace
    /// period (5 to 25 ms) on hosts without `favordynmods`.
    fn move_self(dirs: &[PathBuf]) -> Result<(), String> {
        for dir in dirs {
            let tasks = dir.join("tasks");
            std::fs::write(&tasks, "0").map_err(|e| format!("cannot move into {}: {e}", tasks.display()))?;
        }
        Ok(())
    }

    /// Moves `pid` (and so everything it will start) into the cgroup.
    /// The command line prefix that puts the process it starts in this
    /// cgroup before it runs what follows: `/bin/sh` writes its own pid to
    /// each hierarchy's `cgroup.procs`, then execs the rest (same pid), so
    /// everything the program allocates is charged here from its first
    /// page. The shell exits 125 when a write is refused, before the
    /// program runs.
    pub(crate) fn enter_prefix(&self) -> Vec<String> {
        let mut prefix = vec![
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            r#"n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n - 1)); done; exec "$@""#
                .to_owned(),
            "berth-cgroup-enter".to_owned(),
            self.dirs.len().to_string(),
        ];
        prefix.extend(self.dirs.iter().map(|dir| dir.join("cgroup.procs").display().to_string()));
        prefix
    }

    pub(crate) fn join(&self, pid: u32) -> Result<(), String> {
        for dir in &self.dirs {
            let procs = dir.join("cgroup.procs");
            std::fs::write(&procs, pid.to_string())
                .map_err(|e| format!("cannot move into {}: {e}", procs.display()))?;
        }
        Ok(())
    }

    /// Every process in the cgroup, across its hierarchies.
    pub(crate) fn processes(&self) -> BTreeSet<u32> {
        self.dirs
            .iter()
            .filter_map(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
            .flat_map(|text| text.lines().filter_map(|line| line.trim().parse().ok()).collect::<Vec<u32>>())
            .collect()
    }

    fn holds_processes(&self) -> bool {
        !self.processes().is_empty()
    }

    /// Removes the cgroup from every hierarchy; the kernel refuses while a
    /// process is still in it.
    pub(crate) fn remove(&self) {
        for dir in &self.dirs {
            let _ = std::fs::remove_dir(dir);
        }
    }

    fn cpu_nanos(&self) -> u64 {
        if self.unified {
            let text = self.dir("cpu").and_then(|dir| std::fs::read_to_string(dir.join("cpu.stat")).ok());
            return text
                .and_then(|text| {
                    text.lines().find_map(|line| line.strip_prefix("usage_usec ").and_then(|v| v.trim().parse().ok()))
                })
                .map_or(0, |usec: u64| usec.saturating_mul(1000));
        }
        self.read_number("cpuacct", "cpuacct.usage")
    }

    /// What the cgroup's processes hold in memory now.
    pub(crate) fn memory_bytes(&self) -> u64 {
        self.read_number("memory", if self.unified { "memory.current" } else { "memory.usage_in_bytes" })
    }

    /// A number `controller`'s `file` holds; 0 where it cannot be read.
    pub(crate) fn read_number(&self, controller: &str, file: &str) -> u64 {
        self.dir(controller)
            .and_then(|dir| std::fs::read_to_string(dir.join(file)).ok())
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// Turns on `favordynmods` on the host's cgroup2 mount (`/sys/fs/cgroup`
/// on v2 hosts, `/sys/fs/cgroup/unified` on hybrid ones), keeping its other
/// options, and returns the mount point.
///
/// Moving a process into a cgroup through `cgroup.procs` takes a
/// kernel-wide lock whose write side waits for an RCU grace period unless
/// this option is on: 5 to 25 ms a move (BENCHMARKS.md). Every launch that
/// moves its workload in waits for it: runc's, crun's and runsc's, the
/// process runtime's on cgroup v2, and a microVM's QEMU. The process
/// runtime on v1 and hybrid hosts does not: its single-threaded monitor
/// moves itself in through `tasks` to spawn the init (see the module's
/// docs). The option is kernel-wide (every hierarchy's migrations get fast;
/// forks and exits get slightly slower) and lasts until reboot, so the
/// agent sets it only when told to.
pub fn favor_cgroup_migrations() -> Result<PathBuf, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    // `ID PARENT DEV ROOT POINT OPTIONS [TAGS...] - TYPE SOURCE SUPER_OPTIONS`
    let (point, options) = mountinfo
        .lines()
        .filter_map(|line| {
            let (head, tail) = line.split_once(" - ")?;
            let mut tail = tail.split_whitespace();
            (tail.next()? == "cgroup2").then_some(())?;
            let options = tail.nth(1).unwrap_or_default().to_string();
            Some((head.split_whitespace().nth(4)?.to_string(), options))
        })
        .find(|(point, _)| point == CGROUP_ROOT || point == "/sys/fs/cgroup/unified")
        .ok_or("no cgroup2 filesystem is mounted at /sys/fs/cgroup or /sys/fs/cgroup/unified")?;
    let mut wanted: Vec<&str> = options.split(',').filter(|o| !o.is_empty() && *o != "rw" && *o != "ro").collect();
    if wanted.contains(&"favordynmods") {
        return Ok(PathBuf::from(point));
    }
    wanted.push("favordynmods");
    let data = CString::new(wanted.join(",")).map_err(|_| "a cgroup2 mount option holds a NUL".to_string())?;
    rustix::mount::mount_remount(point.as_str(), MountFlags::empty(), data.as_c_str())
        .map_err(|e| format!("cannot remount {point} with favordynmods (kernel 6.0 or later has it): {e}"))?;
    Ok(PathBuf::from(point))
}

fn load_spec(bundle: &Path) -> Result<Spec, String> {
    let config = bundle.join("config.json");
    Spec::load(&config).map_err(|e| format!("cannot read {}: {e}", config.display()))
}

fn cgroup_path(spec: &Spec, id: &str) -> String {
    spec.linux()
        .as_ref()
        .and_then(|linux| linux.cgroups_path().as_ref())
        .map_or_else(|| format!("/berth-runtime/{id}"), |path| path.display().to_string())
}

/// `run`: the workload's monitor. Returns its exit code.
fn monitor(root: &Path, bundle: &Path, pid_file: &Path, id: &str) -> i32 {
    match start(root, bundle, pid_file, id) {
        Ok(mut init) => match init.wait() {
            Ok(status) => status.code().or_else(|| status.signal().map(|signal| 128 + signal)).unwrap_or(1),
            Err(error) => fail(&format!("cannot wait for the workload: {error}")),
        },
        Err(error) => fail(&error),
    }
}

/// Everything of `run` until the init goes on; returns the init.
fn start(root: &Path, bundle: &Path, pid_file: &Path, id: &str) -> Result<std::process::Child, String> {
    let spec = load_spec(bundle)?;
    let dir = container_dir(root, id)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(|e| format!("cannot create {}: {e}", root.display()))?;
    std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => format!("container {id} already exists"),
        _ => format!("cannot create {}: {e}", dir.display()),
    })?;
    let cgroup_path = cgroup_path(&spec, id);
    let cgroup = Cgroup::new(&cgroup_path);
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID)
        .map_err(|e| format!("cannot make a PID namespace: {e}"))?;
    // On v1 the init is born in its cgroup: this (single-threaded) monitor
    // steps into it to spawn the init and back out, each step a thread's
    // move of itself. On v2 the init sets up the workload's root while its
    // cgroup is made, and is moved into it.
    let born_inside = !cgroup.unified;
    if born_inside {
        let home = cgroup.current_v1()?;
        cgroup.create(&spec)?;
        if let Err(error) = Cgroup::move_self(&cgroup.dirs) {
            let _ = Cgroup::move_self(&home);
            cgroup.remove();
            return Err(error);
        }
        let spawned = spawn_init(root, bundle);
        let back = Cgroup::move_self(&home);
        let init = match (spawned, back) {
            (Ok(init), Ok(())) => init,
            (spawned, back) => {
                if let Ok(mut init) = spawned {
                    let _ = init.kill();
                    let _ = init.wait();
                }
                cgroup.remove();
                return Err(back.err().unwrap_or_else(|| "cannot start the workload's init".into()));
            }
        };
        return place(init, &cgroup, &cgroup_path, &dir, pid_file, |_| Ok(()));
    }
    let init = spawn_init(root, bundle)?;
    place(init, &cgroup, &cgroup_path, &dir, pid_file, |init| {
        cgroup.create(&spec)?;
        cgroup.join(init)
    })
}

/// Starts the init, which waits for a byte on its stdin before it execs the
/// workload.
fn spawn_init(root: &Path, bundle: &Path) -> Result<std::process::Child, String> {
    std::process::Command::new(SELF_EXE)
        .arg0(ARG0)
        .arg("--root")
        .arg(root)
        .arg("init")
        .arg("--bundle")
        .arg(bundle)
        .stdin(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the workload's init: {e}"))
}

/// Puts `init` in its cgroup (`contain`, given its pid), records it, and lets
/// it go on; on any failure kills it and removes the cgroup.
fn place(
    mut init: std::process::Child,
    cgroup: &Cgroup,
    cgroup_path: &str,
    dir: &Path,
    pid_file: &Path,
    contain: impl FnOnce(u32) -> Result<(), String>,
) -> Result<std::process::Child, String> {
    let go = init.stdin.take();
    let placed = (|| {
        contain(init.id())?;
        let start_ticks = procfs::read_stat(Path::new(PROC_ROOT), init.id())
            .map(|stat| stat.start_ticks)
            .ok_or_else(|| "the workload's init ended before it started".to_string())?;
        let state = State { pid: init.id(), start_ticks, cgroup: cgroup_path.to_owned() };
        write_atomically(&dir.join(STATE_FILE), &serde_json::to_vec(&state).unwrap_or_default())?;
        write_atomically(pid_file, init.id().to_string().as_bytes())
    })();
    match (placed, go) {
        (Ok(()), Some(mut go)) => {
            // The init goes on; a failed write means it already ended, and
            // its status says why.
            let _ = go.write_all(b"1");
            Ok(init)
        }
        (placed, _) => {
            let _ = init.kill();
            let _ = init.wait();
            cgroup.remove();
            Err(placed.err().unwrap_or_else(|| "cannot talk to the workload's init".into()))
        }
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes)
        .and_then(|()| std::fs::rename(&partial, path))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The init: sets up the workload's namespaces and root while the monitor
/// places it in its cgroup, waits for the monitor's word, then becomes the
/// workload's program. Returns only on failure.
fn init(bundle: &Path) -> i32 {
    let mut program = match contain(bundle) {
        Ok(program) => program,
        Err(error) => return fail(&error),
    };
    let mut go = [0u8; 1];
    if !matches!(std::io::stdin().read(&mut go), Ok(1)) {
        // The monitor could not place this process in its cgroup.
        return 1;
    }
    // Now in its cgroup: that is the root of the workload's cgroup namespace.
    if let Err(error) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWCGROUP) {
        return fail(&format!("cannot make the workload's cgroup namespace: {error}"));
    }
    let error = program.exec();
    fail(&format!("cannot start {:?}: {error}", program.get_program()))
}

/// Everything the init does before it waits for its cgroup: the network
/// namespace, the mount, IPC and UTS namespaces, the root, and dropping
/// what the workload may not keep; returns the command to exec.
fn contain(bundle: &Path) -> Result<std::process::Command, String> {
    use nix::sched::CloneFlags;
    let spec = load_spec(bundle)?;
    let linux = spec.linux().clone().unwrap_or_default();
    let namespaces = linux.namespaces().clone().unwrap_or_default();
    let network = namespaces.iter().find(|ns| ns.typ() == LinuxNamespaceType::Network).and_then(|ns| ns.path().clone());
    if let Some(path) = network {
        let file = std::fs::File::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&file),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(|e| format!("cannot enter the network namespace {}: {e}", path.display()))?;
    }
    nix::sched::unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS)
        .map_err(|e| format!("cannot make the workload's namespaces: {e}"))?;
    rustix::mount::mount_change("/", MountPropagationFlags::PRIVATE | MountPropagationFlags::REC)
        .map_err(|e| format!("cannot make the mounts private: {e}"))?;

    let root_spec = spec.root().clone().ok_or("the spec names no root")?;
    let rootfs = root_spec.path().clone();
    rustix::mount::mount_bind_recursive(&rootfs, &rootfs)
        .map_err(|e| format!("cannot bind the root {}: {e}", rootfs.display()))?;
    for mount in spec.mounts().clone().unwrap_or_default() {
        mount_into(&rootfs, &mount)?;
    }
    populate_dev(&rootfs)?;
    for masked in linux.masked_paths().clone().unwrap_or_default() {
        mask(&rootfs, &masked)?;
    }
    for protected in linux.readonly_paths().clone().unwrap_or_default() {
        protect(&rootfs, &protected)?;
    }
    if let Some(hostname) = spec.hostname() {
        rustix::system::sethostname(hostname.as_bytes()).map_err(|e| format!("cannot set the host name: {e}"))?;
    }
    enter_root(&rootfs, root_spec.readonly().unwrap_or(false))?;
    drop_privileges()?;

    let process = spec.process().clone().ok_or("the spec names no process")?;
    let args = process.args().clone().unwrap_or_default();
    let (program, rest) = args.split_first().ok_or("the spec names no program")?;
    let mut command = std::process::Command::new(program);
    command.args(rest).env_clear().current_dir(process.cwd()).stdin(Stdio::null());
    for pair in process.env().clone().unwrap_or_default() {
        if let Some((name, value)) = pair.split_once('=') {
            command.env(name, value);
        }
    }
    command.uid(process.user().uid()).gid(process.user().gid());
    Ok(command)
}

/// Flags and filesystem data of a spec mount's options.
fn mount_options(options: &[String]) -> (MountFlags, Vec<String>, bool) {
    let (mut flags, mut data, mut readonly) = (MountFlags::empty(), Vec::new(), false);
    for option in options {
        match option.as_str() {
            "ro" => readonly = true,
            "rw" | "bind" | "rbind" | "private" | "rprivate" => {}
            "nosuid" => flags |= MountFlags::NOSUID,
            "nodev" => flags |= MountFlags::NODEV,
            "noexec" => flags |= MountFlags::NOEXEC,
            "strictatime" => flags |= MountFlags::STRICTATIME,
            "relatime" => flags |= MountFlags::RELATIME,
            "noatime" => flags |= MountFlags::NOATIME,
            other => data.push(other.to_string()),
        }
    }
    (flags, data, readonly)
}

/// Mounts one of the spec's mounts at its destination inside `rootfs`.
fn mount_into(rootfs: &Path, mount: &Mount) -> Result<(), String> {
    let destination = mount.destination();
    let target = resolve_in_root(rootfs, destination)?;
    let typ = mount.typ().clone().unwrap_or_default();
    let (flags, data, readonly) = mount_options(mount.options().as_deref().unwrap_or_default());
    let failed = |e: rustix::io::Errno| format!("cannot mount {typ} at {}: {e}", destination.display());
    if typ == "bind" {
        let source =
            mount.source().clone().ok_or_else(|| format!("the bind at {} has no source", destination.display()))?;
        let is_dir = std::fs::metadata(&source).map_err(|e| format!("cannot bind {}: {e}", source.display()))?.is_dir();
        make_mount_point(&target, is_dir)?;
        rustix::mount::mount_bind_recursive(&source, &target).map_err(failed)?;
        let mut remount = flags | MountFlags::BIND;
        if readonly {
            remount |= MountFlags::RDONLY;
        }
        rustix::mount::mount_remount(&target, remount, c"").map_err(failed)?;
        return Ok(());
    }
    make_mount_point(&target, true)?;
    let source = mount.source().as_ref().map_or_else(|| typ.clone(), |s| s.display().to_string());
    let mut flags = flags;
    if readonly {
        flags |= MountFlags::RDONLY;
    }
    let data =
        CString::new(data.join(",")).map_err(|_| format!("the options of {} hold a NUL", destination.display()))?;
    let data = (!data.is_empty()).then_some(data.as_c_str());
    rustix::mount::mount(source.as_str(), &target, typ.as_str(), flags, data).map_err(failed)
}

/// Binds the host's standard device nodes into the new `/dev` and links
/// the usual names, as runc does.
fn populate_dev(rootfs: &Path) -> Result<(), String> {
    let dev = resolve_in_root(rootfs, Path::new("/dev"))?;
    if !dev.is_dir() {
        return Ok(());
    }
    for name in DEVICES {
        let host = Path::new("/dev").join(name);
        if !host.exists() {
            continue;
        }
        let target = dev.join(name);
        make_mount_point(&target, false)?;
        rustix::mount::mount_bind(&host, &target).map_err(|e| format!("cannot bind {}: {e}", host.display()))?;
    }
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let path = dev.join(link);
        if std::fs::symlink_metadata(&path).is_err() {
            std::os::unix::fs::symlink(to, &path).map_err(|e| format!("cannot link {}: {e}", path.display()))?;
        }
    }
    Ok(())
}

/// Hides a `/proc` or `/sys` path: an empty read-only directory over a
/// directory, `/dev/null` over a file. A path the host lacks is skipped.
fn mask(rootfs: &Path, path: &str) -> Result<(), String> {
    let target = resolve_in_root(rootfs, Path::new(path))?;
    let Ok(meta) = std::fs::metadata(&target) else { return Ok(()) };
    let result = if meta.is_dir() {
        rustix::mount::mount("tmpfs", &target, "tmpfs", MountFlags::RDONLY, None::<&std::ffi::CStr>)
    } else {
        rustix::mount::mount_bind("/dev/null", &target)
    };
    result.map_err(|e| format!("cannot mask {path}: {e}"))
}

/// Makes a `/proc` path read-only.
fn protect(rootfs: &Path, path: &str) -> Result<(), String> {
    let target = resolve_in_root(rootfs, Path::new(path))?;
    if std::fs::symlink_metadata(&target).is_err() {
        return Ok(());
    }
    rustix::mount::mount_bind_recursive(&target, &target)
        .and_then(|()| {
            rustix::mount::mount_remount(
                &target,
                MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
                c"",
            )
        })
        .map_err(|e| format!("cannot make {path} read-only: {e}"))
}

/// Pivots into `rootfs` and detaches the host's root from this namespace.
fn enter_root(rootfs: &Path, readonly: bool) -> Result<(), String> {
    rustix::process::chdir(rootfs).map_err(|e| format!("cannot enter {}: {e}", rootfs.display()))?;
    rustix::process::pivot_root(".", ".").map_err(|e| format!("cannot pivot into {}: {e}", rootfs.display()))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH).map_err(|e| format!("cannot detach the host's root: {e}"))?;
    rustix::process::chdir("/").map_err(|e| format!("cannot enter the new root: {e}"))?;
    if readonly {
        rustix::mount::mount_remount("/", MountFlags::BIND | MountFlags::RDONLY, c"")
            .map_err(|e| format!("cannot make the root read-only: {e}"))?;
    }
    Ok(())
}

/// Empties the bounding set and sets `no_new_privs`; the change of user at
/// the exec then clears every other set.
fn drop_privileges() -> Result<(), String> {
    use rustix::thread::{CapabilitySet, CapabilitySets};
    for (name, capability) in CapabilitySet::all().iter_names() {
        match rustix::thread::remove_capability_from_bounding_set(capability) {
            // A capability this kernel does not know.
            Ok(()) | Err(rustix::io::Errno::INVAL) => {}
            Err(e) => return Err(format!("cannot drop {name}: {e}")),
        }
    }
    let current = rustix::thread::capabilities(None).map_err(|e| format!("cannot read capabilities: {e}"))?;
    rustix::thread::set_capabilities(None, CapabilitySets { inheritable: CapabilitySet::empty(), ..current })
        .map_err(|e| format!("cannot clear the inheritable capabilities: {e}"))?;
    rustix::thread::set_no_new_privs(true).map_err(|e| format!("cannot set no_new_privs: {e}"))
}

fn make_mount_point(path: &Path, dir: bool) -> Result<(), String> {
    let created = if dir {
        std::fs::DirBuilder::new().recursive(true).mode(0o755).create(path)
    } else {
        if let Some(parent) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        match std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(path) {
            Ok(_) => Ok(()),
            // A directory or a file already there is a mount point as it is.
            Err(_) if path.exists() => Ok(()),
            Err(e) => Err(e),
        }
    };
    created.map_err(|e| format!("cannot create the mount point {}: {e}", path.display()))
}

/// Where `inside`, as the workload will see it, is under `rootfs`, with
/// every link on the way resolved inside the root (an absolute link is
/// taken from the root, `..` never climbs above it).
fn resolve_in_root(rootfs: &Path, inside: &Path) -> Result<PathBuf, String> {
    const MAX_LINKS: usize = 40;
    let mut resolved = PathBuf::new();
    let mut pending: Vec<std::ffi::OsString> = inside.components().rev().filter_map(|c| component_name(c)).collect();
    let mut links = 0;
    while let Some(name) = pending.pop() {
        if name == ".." {
            resolved.pop();
            continue;
        }
        let candidate = resolved.join(&name);
        match std::fs::read_link(rootfs.join(&candidate)) {
            Ok(target) => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(format!("{} has too many links", inside.display()));
                }
                if target.is_absolute() {
                    resolved = PathBuf::new();
                }
                pending.extend(target.components().rev().filter_map(|c| component_name(c)));
            }
            Err(_) => resolved = candidate,
        }
    }
    Ok(rootfs.join(resolved))
}

fn component_name(component: Component<'_>) -> Option<std::ffi::OsString> {
    match component {
        Component::Normal(name) => Some(name.to_os_string()),
        Component::ParentDir => Some("..".into()),
        Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_reads_runcs_flags_and_names_what_it_cannot() {
        let update = Update::parse(&["--memory", "1048576", "--memory-swap", "-1", "--cpu-quota", "50000"]).unwrap();
        assert_eq!(
            update,
            Update { memory: Some(1 << 20), memory_swap: Some(-1), cpu_quota: Some(50_000), ..Update::default() }
        );
        assert_eq!(Update::parse(&["--memory"]).unwrap_err(), "--memory needs a value");
        assert_eq!(Update::parse(&["--memory", "1G"]).unwrap_err(), "--memory: '1G' is not a number");
        assert_eq!(Update::parse(&["--blkio-weight", "10"]).unwrap_err(), "update: unknown flag --blkio-weight");
    }

    #[test]
    fn mount_destinations_never_leave_the_root_whatever_links_the_image_holds() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("real/dir")).unwrap();
        std::os::unix::fs::symlink("/real", r.join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../etc", r.join("climb")).unwrap();
        std::os::unix::fs::symlink("real/dir", r.join("rel")).unwrap();
        std::os::unix::fs::symlink("loop", r.join("loop")).unwrap();
        assert_eq!(resolve_in_root(r, Path::new("/abs/x")).unwrap(), r.join("real/x"));
        assert_eq!(resolve_in_root(r, Path::new("/climb/shadow")).unwrap(), r.join("etc/shadow"));
        assert_eq!(resolve_in_root(r, Path::new("/rel/y")).unwrap(), r.join("real/dir/y"));
        assert_eq!(resolve_in_root(r, Path::new("/../../x")).unwrap(), r.join("x"));
        assert!(resolve_in_root(r, Path::new("/loop/z")).unwrap_err().contains("too many links"));
    }

    #[test]
    fn commands_name_what_is_wrong() {
        let root = tempfile::tempdir().unwrap();
        assert!(command(root.path(), &["state", "nope"]).unwrap_err().contains("does not exist"));
        assert!(command(root.path(), &["delete", "--force", "nope"]).unwrap_err().contains("does not exist"));
        assert!(command(root.path(), &["state", "../x"]).unwrap_err().contains("not a container id"));
        assert!(command(root.path(), &["kill", "a", "BOGUS"]).unwrap_err().contains("does not exist"));
        assert!(parse_signal("BOGUS").unwrap_err().contains("unknown signal"));
        assert_eq!(command(root.path(), &["list", "--quiet"]).unwrap(), b"");
        assert!(command(root.path(), &["frobnicate"]).unwrap_err().contains("unknown command"));
    }

    #[test]
    fn spec_options_become_flags_and_data() {
        let options: Vec<String> =
            ["nosuid", "nodev", "mode=1777", "size=65536k", "ro"].iter().map(|s| s.to_string()).collect();
        let (flags, data, readonly) = mount_options(&options);
        assert_eq!(flags, MountFlags::NOSUID | MountFlags::NODEV);
        assert_eq!(data, ["mode=1777", "size=65536k"]);
        assert!(readonly);
    }
}
