//! The detached updater, `berth-agent host-upgrade`: replaces the running
//! agent's binary with another and makes sure the new one works, else puts
//! the old one back.
//!
//! # Why detached
//! An agent cannot replace itself and watch the result: the process that
//! would judge the new binary is the one being replaced. So the agent
//! starts this updater and goes on with its work; the updater is a session
//! and process group of its own, so the agent's exit (which it causes)
//! does not take it along, and the agent never blocks on it beyond one
//! line of acknowledgement.
//!
//! # Protocol
//! The agent starts the updater with a pipe as its fd 3 and reads one line
//! of at most [`MAX_ACK`] bytes: [`Ack::Accepted`] (`accepted`) once every
//! check passed, or [`Ack::Refused`] (`refused: <reason>`), after which
//! nothing changed. The vocabulary is defined here once, for both sides.
//!
//! # Steps, once accepted
//! 1. Install the new binary beside the old one (A/B) under
//!    `DATA_DIR/agent-bin/<sha256>/berth-agent`; the old one is kept (copied
//!    there from the running process if it was not started from that
//!    directory).
//! 2. Switch `DATA_DIR/agent-bin/current` to it, atomically (a symlink
//!    renamed over the old one).
//! 3. Restart the agent: through the service manager (`systemctl restart
//!    UNIT`) where one runs it, else by stopping the running agent (SIGTERM,
//!    then SIGKILL after a grace; its workloads keep running, as on any
//!    agent restart) and starting `current` with the agent's own arguments.
//! 4. Wait for the new agent to report the new version: an agent writes
//!    `DATA_DIR/reported-version` (`<version> <pid>`) once its first
//!    heartbeat went through, so the updater sees what identity saw. The
//!    running agent's report is removed before the restart, so whatever is
//!    read after it is the new agent's.
//! 5. If that does not happen by the deadline, switch `current` back, stop
//!    the new agent and start the old one; the upgrade failed.
//!
//! Either way the outcome is written to `DATA_DIR/upgrade-result.json`
//! (the target version, `succeeded` or `failed`, and why), which the agent
//! then running reports. Only one updater runs per data directory
//! (`DATA_DIR/upgrade.lock` names it).

#![allow(
    clippy::disallowed_methods,
    reason = "the updater is a process of its own with no async runtime: blocking is what it does"
)]

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::Digest as _;

/// The subcommand the agent's binary is invoked with to act as the updater.
pub const SUBCOMMAND: &str = "host-upgrade";

/// The longest acknowledgement line, its newline included.
pub const MAX_ACK: usize = 4096;

/// The directory under the data directory holding the installed binaries.
pub const BIN_DIR: &str = "agent-bin";

/// The link under [`BIN_DIR`] naming the binary the agent runs from.
pub const CURRENT: &str = "current";

/// The file an agent writes once its first heartbeat went through.
pub const REPORTED_VERSION: &str = "reported-version";

/// The file the updater leaves its outcome in.
pub const RESULT: &str = "upgrade-result.json";

const LOCK: &str = "upgrade.lock";
const BINARY: &str = "berth-agent";
const LOG: &str = "agent.log";

/// How often the updater looks for the new agent's report.
const POLL: Duration = Duration::from_millis(100);

/// How long a stopped agent has to exit after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// What the updater answers the agent that started it, as one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    /// Every check passed; the upgrade goes ahead.
    Accepted,
    /// Nothing was changed, for this reason.
    Refused(String),
}

impl Ack {
    /// The line written on the pipe, newline included, at most [`MAX_ACK`] bytes.
    pub fn line(&self) -> String {
        match self {
            Ack::Accepted => "accepted\n".to_string(),
            Ack::Refused(reason) => {
                let mut line = format!("refused: {}", reason.replace(['\n', '\r'], " "));
                if line.len() > MAX_ACK - 1 {
                    let mut end = MAX_ACK - 1;
                    while !line.is_char_boundary(end) {
                        end -= 1;
                    }
                    line.truncate(end);
                }
                line.push('\n');
                line
            }
        }
    }

    /// The acknowledgement a line says; an error naming what was read when
    /// it says neither.
    pub fn parse(line: &str) -> Result<Ack, String> {
        let line = line.trim_end_matches(['\n', '\r']);
        if line == "accepted" {
            return Ok(Ack::Accepted);
        }
        match line.strip_prefix("refused: ") {
            Some(reason) => Ok(Ack::Refused(reason.to_string())),
            None if line.is_empty() => Err("the updater exited without acknowledging".to_string()),
            None => Err(format!("the updater answered '{line}', neither 'accepted' nor 'refused: <reason>'")),
        }
    }
}

/// What the updater is told.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "berth-agent host-upgrade")]
pub struct UpgradeArgs {
    /// The agent's data directory.
    #[arg(long, value_name = "DIR")]
    pub data_dir: PathBuf,
    /// The new binary, as pulled and verified by the agent.
    #[arg(long, value_name = "PATH")]
    pub binary: PathBuf,
    /// The new binary's SHA-256, hex; checked again before it is used.
    #[arg(long, value_name = "HEX")]
    pub sha256: String,
    /// The version the new agent must report.
    #[arg(long, value_name = "VERSION")]
    pub version: String,
    /// The running agent's process id.
    #[arg(long, value_name = "PID")]
    pub agent_pid: u32,
    /// How long the new agent has to report its version.
    #[arg(long, value_name = "DURATION", value_parser = berth_runtime::parse_duration, default_value = "60s")]
    pub deadline: Duration,
    /// The systemd unit the agent runs as; the agent is restarted through
    /// `systemctl restart UNIT` instead of by the updater.
    #[arg(long, value_name = "UNIT")]
    pub unit: Option<String>,
    /// The agent's arguments, after `--`, to start it with again.
    #[arg(last = true, value_name = "AGENT_ARGS")]
    pub agent_args: Vec<String>,
}

/// What the updater left in `DATA_DIR/upgrade-result.json`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UpgradeResult {
    /// The version upgraded to.
    pub version: String,
    /// `succeeded` or `failed`.
    pub state: String,
    /// Why it failed; empty when it succeeded.
    pub reason: String,
}

impl UpgradeResult {
    /// The outcome an updater left in `data_dir`, if any.
    pub fn read(data_dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(data_dir.join(RESULT)).ok()?).ok()
    }
}

/// Runs the updater when the process was invoked as `berth-agent
/// host-upgrade`: returns the exit code, or `None` for any other command
/// line. Call it first in `main`, before any thread or async runtime starts.
pub fn main_if_invoked() -> Option<i32> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some(SUBCOMMAND) {
        return None;
    }
    use clap::Parser as _;
    let parsed = match UpgradeArgs::try_parse_from(std::iter::once(args[0].clone()).chain(args[2..].iter().cloned())) {
        Ok(parsed) => parsed,
        Err(error) => {
            acknowledge(&Ack::Refused(error.to_string()));
            return Some(2);
        }
    };
    Some(run(&parsed))
}

/// Writes `ack` on fd 3; the agent reads one line from it.
fn acknowledge(ack: &Ack) {
    let written = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/fd/3")
        .and_then(|mut pipe| pipe.write_all(ack.line().as_bytes()));
    if let Err(error) = written {
        eprintln!("berth-agent host-upgrade: cannot acknowledge on fd 3: {error}");
    }
}

fn run(args: &UpgradeArgs) -> i32 {
    // A session of its own, so the agent's exit does not end it.
    if let Err(error) = rustix::process::setsid() {
        eprintln!("berth-agent host-upgrade: setsid: {error}");
    }
    let lock = match check(args) {
        Ok(lock) => lock,
        Err(reason) => {
            acknowledge(&Ack::Refused(reason));
            return 1;
        }
    };
    acknowledge(&Ack::Accepted);
    let outcome = upgrade(args);
    let result = match &outcome {
        Ok(()) => UpgradeResult { version: args.version.clone(), state: "succeeded".into(), reason: String::new() },
        Err(reason) => UpgradeResult { version: args.version.clone(), state: "failed".into(), reason: reason.clone() },
    };
    eprintln!("berth-agent host-upgrade: {} {}: {}", result.version, result.state, result.reason);
    let partial = args.data_dir.join(format!(".{RESULT}.partial"));
    let written = serde_json::to_vec_pretty(&result)
        .map_err(std::io::Error::other)
        .and_then(|json| std::fs::write(&partial, json))
        .and_then(|()| std::fs::rename(&partial, args.data_dir.join(RESULT)));
    if let Err(error) = written {
        eprintln!("berth-agent host-upgrade: cannot write the outcome: {error}");
    }
    drop(lock);
    i32::from(outcome.is_err())
}

/// The lock file, removed when the updater is done.
struct Lock(PathBuf);

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Everything that refuses an upgrade before anything changes.
fn check(args: &UpgradeArgs) -> Result<Lock, String> {
    if !args.data_dir.is_dir() {
        return Err(format!("no data directory at {}", args.data_dir.display()));
    }
    let actual = sha256_of(&args.binary).map_err(|e| format!("cannot read {}: {e}", args.binary.display()))?;
    if !actual.eq_ignore_ascii_case(&args.sha256) {
        return Err(format!("{} has SHA-256 {actual}, not {}", args.binary.display(), args.sha256));
    }
    announced_version(&args.binary, &args.version)?;
    if args.unit.is_none() && !alive(args.agent_pid) {
        return Err(format!("no agent runs as pid {}", args.agent_pid));
    }
    let lock = args.data_dir.join(LOCK);
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&lock) {
        Ok(mut file) => {
            let _ = writeln!(file, "{}", std::process::id());
            Ok(Lock(lock))
        }
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
            let holder = std::fs::read_to_string(&lock).unwrap_or_default();
            let holder: u32 = holder.trim().parse().unwrap_or(0);
            if holder != 0 && alive(holder) {
                return Err(format!("an upgrade is already in progress (updater pid {holder})"));
            }
            // Left by an updater that died: take it over.
            std::fs::write(&lock, format!("{}\n", std::process::id()))
                .map_err(|e| format!("cannot take {}: {e}", lock.display()))?;
            Ok(Lock(lock))
        }
        Err(error) => Err(format!("cannot create {}: {error}", lock.display())),
    }
}

/// How long `BINARY --version` may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);

/// Checks that `binary` runs on this host and says it is `version` (its
/// `--version` names it as a word), so a binary built for another machine,
/// or another release than announced, is refused before anything changes.
fn announced_version(binary: &Path, version: &str) -> Result<(), String> {
    let mut child = Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{} does not run on this host: {e}", binary.display()))?;
    let deadline = Instant::now() + VERSION_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{} --version did not answer within {VERSION_TIMEOUT:?}", binary.display()));
            }
        }
    };
    let mut said = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = out.take(4096).read_to_string(&mut said);
    }
    if status.success() && said.split_whitespace().any(|word| word == version) {
        Ok(())
    } else {
        Err(format!("{} --version says '{}' ({status}), not {version}", binary.display(), said.trim()))
    }
}

/// Installs, switches, restarts and waits; on a missed deadline, rolls back.
fn upgrade(args: &UpgradeArgs) -> Result<(), String> {
    let bin = args.data_dir.join(BIN_DIR);
    let previous = previous_binary(&bin, args.agent_pid)?;
    let installed = install(&bin, &args.binary, &args.sha256.to_ascii_lowercase())?;
    switch(&bin, &installed)?;
    // What the running agent reported goes first, so what is read after the
    // restart is the new agent's. (A file's time is no guide: the kernel
    // stamps it from a clock coarser than the one read here, so a report
    // written at once can look older than the restart.) The running agent
    // reports once, when it comes up, so nothing of it comes back.
    let report = args.data_dir.join(REPORTED_VERSION);
    if let Err(error) = std::fs::remove_file(&report)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        return Err(format!("cannot clear {}: {error}", report.display()));
    }
    let mut child = match restart(args, None) {
        Ok(child) => child,
        Err(why) => {
            // The old agent may be stopped already: bring it back.
            switch(&bin, &previous)?;
            restart(args, None)?;
            return Err(format!("{why}; rolled back to {}", previous.display()));
        }
    };
    if reported(&args.data_dir, &args.version, args.deadline, child.as_mut()) {
        if let Some(child) = child {
            // Its own process now; the updater does not wait for it.
            drop(child);
        }
        return Ok(());
    }
    let why = match child.as_mut().map(Child::try_wait) {
        Some(Ok(Some(status))) => format!("the new agent exited ({status}) before reporting version {}", args.version),
        _ => format!("the new agent did not report version {} within {:?}", args.version, args.deadline),
    };
    switch(&bin, &previous)?;
    let new_pid = child.as_ref().map(Child::id);
    restart(args, new_pid)?;
    Err(format!("{why}; rolled back to {}", previous.display()))
}

/// The binary the running agent was started from, kept under `bin` for a
/// rollback: where `current` points, else a copy of the running one.
fn previous_binary(bin: &Path, agent_pid: u32) -> Result<PathBuf, String> {
    if let Ok(target) = std::fs::read_link(bin.join(CURRENT)) {
        return Ok(bin.join(target));
    }
    let running = std::fs::read_link(format!("/proc/{agent_pid}/exe"))
        .map_err(|e| format!("cannot find the running agent's binary: {e}"))?;
    let digest = sha256_of(&running).map_err(|e| format!("cannot read {}: {e}", running.display()))?;
    install(bin, &running, &digest)
}

/// Copies `binary` to `bin/<sha256>/berth-agent` (whole or not at all);
/// returns where.
fn install(bin: &Path, binary: &Path, sha256: &str) -> Result<PathBuf, String> {
    let dir = bin.join(sha256);
    let target = dir.join(BINARY);
    if target.is_file() && sha256_of(&target).is_ok_and(|d| d == sha256) {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let partial = dir.join(format!(".{BINARY}.partial"));
    std::fs::copy(binary, &partial).map_err(|e| format!("cannot copy {} in: {e}", binary.display()))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))
        .and_then(|()| std::fs::File::open(&partial)?.sync_all())
        .and_then(|()| std::fs::rename(&partial, &target))
        .map_err(|e| format!("cannot install {}: {e}", target.display()))?;
    Ok(target)
}

/// Points `bin/current` at `binary`, atomically.
fn switch(bin: &Path, binary: &Path) -> Result<(), String> {
    let relative = binary.strip_prefix(bin).unwrap_or(binary);
    let staged = bin.join(format!(".{CURRENT}.next"));
    let _ = std::fs::remove_file(&staged);
    std::os::unix::fs::symlink(relative, &staged)
        .and_then(|()| std::fs::rename(&staged, bin.join(CURRENT)))
        .map_err(|e| format!("cannot switch {} to {}: {e}", bin.join(CURRENT).display(), binary.display()))
}

/// Restarts the agent from `current`: through systemd when it runs the
/// agent, else by stopping `stop` (the running agent, or a new one being
/// rolled back) and starting `current` with the agent's arguments.
fn restart(args: &UpgradeArgs, stop: Option<u32>) -> Result<Option<Child>, String> {
    if let Some(unit) = &args.unit {
        let status = Command::new("systemctl")
            .args(["restart", unit])
            .status()
            .map_err(|e| format!("cannot run systemctl restart {unit}: {e}"))?;
        return if status.success() { Ok(None) } else { Err(format!("systemctl restart {unit}: {status}")) };
    }
    stop_process(stop.unwrap_or(args.agent_pid));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(args.data_dir.join(LOG))
        .map_err(|e| format!("cannot open {}: {e}", args.data_dir.join(LOG).display()))?;
    let errors = log.try_clone().map_err(|e| format!("cannot open the agent's log: {e}"))?;
    // The agent must not inherit the acknowledgement pipe: the shell closes
    // fd 3 before it becomes the agent.
    let current = args.data_dir.join(BIN_DIR).join(CURRENT);
    use std::os::unix::process::CommandExt as _;
    Command::new("/bin/sh")
        .arg("-c")
        .arg("exec 3>&-; exec \"$@\"")
        .arg("berth-agent")
        .arg(&current)
        .args(&args.agent_args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(errors)
        .process_group(0)
        .spawn()
        .map(Some)
        .map_err(|e| format!("cannot start {}: {e}", current.display()))
}

/// Stops `pid` (and the process group it leads, if any): SIGTERM, then
/// SIGKILL after [`STOP_GRACE`]; returns once it is gone.
fn stop_process(pid: u32) {
    let Some(target) = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap_or(0)) else { return };
    let _ = rustix::process::kill_process(target, rustix::process::Signal::TERM);
    let deadline = Instant::now() + STOP_GRACE;
    while alive(pid) && Instant::now() < deadline {
        reap(pid);
        std::thread::sleep(POLL);
    }
    if alive(pid) {
        let _ = rustix::process::kill_process(target, rustix::process::Signal::KILL);
        while alive(pid) {
            reap(pid);
            std::thread::sleep(POLL);
        }
    }
}

/// Collects `pid` if it is this process's exited child.
fn reap(pid: u32) {
    if let Some(pid) = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap_or(0)) {
        let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG);
    }
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// Waits until the restarted agent reported `version` (the report file
/// was cleared before the restart), or the deadline passed, or the child
/// it waits for exited; whether it reported.
fn reported(data_dir: &Path, version: &str, deadline: Duration, mut child: Option<&mut Child>) -> bool {
    let file = data_dir.join(REPORTED_VERSION);
    let until = Instant::now() + deadline;
    while Instant::now() < until {
        let says = std::fs::read_to_string(&file).unwrap_or_default();
        if says.split_whitespace().next() == Some(version) {
            return true;
        }
        if let Some(child) = child.as_deref_mut()
            && matches!(child.try_wait(), Ok(Some(_)))
        {
            return false;
        }
        std::thread::sleep(POLL);
    }
    false
}

/// The SHA-256 of a file, hex.
pub fn sha256_of(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// How long the updater has to acknowledge.
const ACK_TIMEOUT: Duration = Duration::from_secs(30);

impl UpgradeArgs {
    /// The command line that asks for this upgrade, after the subcommand.
    fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--data-dir".to_string(),
            self.data_dir.display().to_string(),
            "--binary".into(),
            self.binary.display().to_string(),
            "--sha256".into(),
            self.sha256.clone(),
            "--version".into(),
            self.version.clone(),
            "--agent-pid".into(),
            self.agent_pid.to_string(),
            "--deadline".into(),
            format!("{}ms", self.deadline.as_millis()),
        ];
        if let Some(unit) = &self.unit {
            args.extend(["--unit".to_string(), unit.clone()]);
        }
        args.push("--".into());
        args.extend(self.agent_args.iter().cloned());
        args
    }
}

/// Starts `exe` (an agent binary) as the detached updater for `upgrade`
/// and returns its acknowledgement, without waiting for the upgrade: the
/// updater's fd 3 is a pipe this reads one line of at most [`MAX_ACK`]
/// bytes from. Its error output goes to `DATA_DIR/updater.log`.
pub async fn start(exe: &Path, upgrade: &UpgradeArgs) -> Result<Ack, String> {
    use tokio::io::AsyncReadExt as _;
    let log_path = upgrade.data_dir.join("updater.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
    // The shell hands the pipe (its stdout) to the updater as fd 3.
    let mut child = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg("exec 3>&1 1>/dev/null; exec \"$@\"")
        .arg("berth-agent")
        .arg(exe)
        .arg(SUBCOMMAND)
        .args(upgrade.to_args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start the updater {}: {e}", exe.display()))?;
    let mut pipe = child.stdout.take().ok_or("the updater's pipe was not opened")?;
    let mut line = Vec::new();
    let read = tokio::time::timeout(ACK_TIMEOUT, async {
        let mut byte = [0u8; 1];
        while line.len() < MAX_ACK && pipe.read(&mut byte).await? == 1 {
            line.push(byte[0]);
            if byte[0] == b'\n' {
                break;
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    // The updater outlives this call; its exit is collected whenever it comes.
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    match read {
        Err(_) => Err(format!("the updater did not acknowledge within {ACK_TIMEOUT:?}")),
        Ok(Err(error)) => Err(format!("cannot read the updater's acknowledgement: {error}")),
        Ok(Ok(())) => Ack::parse(&String::from_utf8_lossy(&line)),
    }
}

/// Records that this agent's first heartbeat went through, for an updater
/// waiting on it: `<version> <pid>` in `DATA_DIR/reported-version`.
pub(crate) fn record_reported_version(data_dir: &Path, version: &str) {
    let line = format!("{version} {}\n", std::process::id());
    let partial = data_dir.join(format!(".{REPORTED_VERSION}.partial"));
    let written =
        std::fs::write(&partial, line).and_then(|()| std::fs::rename(&partial, data_dir.join(REPORTED_VERSION)));
    if let Err(error) = written {
        tracing::warn!(%error, "cannot record the version this agent reported");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acknowledgements_are_one_bounded_line_each_way() {
        assert_eq!(Ack::Accepted.line(), "accepted\n");
        assert_eq!(Ack::parse("accepted\n"), Ok(Ack::Accepted));
        let refused = Ack::Refused("no agent runs\nas pid 7".into());
        assert_eq!(refused.line(), "refused: no agent runs as pid 7\n");
        assert_eq!(Ack::parse(&refused.line()), Ok(Ack::Refused("no agent runs as pid 7".into())));
        let long = Ack::Refused("é".repeat(5000)).line();
        assert!(long.len() <= MAX_ACK && long.ends_with('\n'), "{}", long.len());
        assert!(Ack::parse("").unwrap_err().contains("without acknowledging"));
        assert!(Ack::parse("maybe").unwrap_err().contains("'maybe'"));
    }
}
