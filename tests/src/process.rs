//! Child processes the harness starts and controls: a [`ProcessSpec`] says
//! how to start one (program, arguments, environment, the network
//! namespace and user it runs in, where its output goes), and the
//! [`ManagedProcess`] it spawns can be signalled, killed, suspended and
//! waited for. A spec is kept, so a killed process is started again the
//! same way.
//!
//! # Invariants
//! - stdout and stderr go to the spec's log file, appended to, so a
//!   process restarted under one spec keeps one log with every life in it.
//! - Dropping a [`ManagedProcess`] that still runs kills it (SIGCONT, then
//!   SIGKILL): a failed test leaves no control-plane process behind. What a
//!   process started itself (an agent's workloads) is not its to kill; see
//!   [`crate::workloads`].
//! - A process is addressed by its pid only while its waiter has not seen
//!   it exit, so a recycled pid is never signalled.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use rustix::process::{Pid, Signal, kill_process};
use tokio::sync::watch;

/// How long a killed process may take to be reaped.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// How a process is started.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    name: String,
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    clear_env: bool,
    netns: Option<String>,
    user: Option<(u32, u32)>,
    current_dir: Option<PathBuf>,
    log: PathBuf,
}

impl ProcessSpec {
    /// Runs `program`, named `name` in messages, writing its output to `log`.
    pub fn new(name: impl Into<String>, program: impl Into<PathBuf>, log: impl Into<PathBuf>) -> Self {
        Self {
            name: name.into(),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            clear_env: false,
            netns: None,
            user: None,
            current_dir: None,
            log: log.into(),
        }
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable (on top of the test's own environment).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Starts the program with only the variables set here (and `PATH`),
    /// not the test's own environment nor a default `RUST_LOG`, as a
    /// container starts.
    pub fn env_clear(mut self) -> Self {
        self.clear_env = true;
        self
    }

    /// Runs the program inside network namespace `netns` (`ip netns exec`,
    /// which execs it: the pid is the program's own).
    pub fn in_netns(mut self, netns: impl Into<String>) -> Self {
        self.netns = Some(netns.into());
        self
    }

    /// Runs the program as `uid`:`gid`.
    pub fn as_user(mut self, uid: u32, gid: u32) -> Self {
        self.user = Some((uid, gid));
        self
    }

    /// Runs the program in `dir`.
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.current_dir = Some(dir.into());
        self
    }

    /// The name used in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the output goes.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Starts the process; its exit is watched from then on. Must be called
    /// inside a tokio runtime.
    pub fn spawn(&self) -> anyhow::Result<ManagedProcess> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("cannot open the log of {} at {}", self.name, self.log.display()))?;
        let log_copy = log.try_clone().with_context(|| format!("cannot open the log of {}", self.name))?;
        let mut command = match &self.netns {
            // Only the network namespace: `ip netns exec` would also give the
            // process a mount namespace with a fresh /sys, hiding the cgroup
            // filesystem an agent contains its workloads with.
            Some(netns) => {
                let mut command = tokio::process::Command::new("nsenter");
                command.arg(format!("--net=/run/netns/{netns}")).arg("--").arg(&self.program);
                command
            }
            None => tokio::process::Command::new(&self.program),
        };
        command.args(&self.args).stdin(Stdio::null()).stdout(Stdio::from(log_copy)).stderr(Stdio::from(log));
        if self.clear_env {
            command.env_clear();
            if let Some(path) = std::env::var_os("PATH") {
                command.env("PATH", path);
            }
        }
        if !self.clear_env && std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "info");
        }
        for (key, value) in &self.env {
            command.env(key, value);
        }
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        if let Some(dir) = &self.current_dir {
            command.current_dir(dir);
        }
        command.kill_on_drop(true);
        let mut child =
            command.spawn().with_context(|| format!("cannot start {} ({})", self.name, self.program.display()))?;
        let pid = child.id().with_context(|| format!("{} exited before its pid was read", self.name))?;
        let (exited_tx, exited) = watch::channel(None);
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(status) => status.to_string(),
                Err(error) => format!("unknown ({error})"),
            };
            let _ = exited_tx.send(Some(status));
        });
        Ok(ManagedProcess { spec: self.clone(), pid, exited })
    }
}

/// A running (or exited) child process.
#[derive(Debug)]
pub struct ManagedProcess {
    spec: ProcessSpec,
    pid: u32,
    exited: watch::Receiver<Option<String>>,
}

impl ManagedProcess {
    /// How it was started.
    pub fn spec(&self) -> &ProcessSpec {
        &self.spec
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// How it exited, once it has.
    pub fn exit_status(&self) -> Option<String> {
        self.exited.borrow().clone()
    }

    /// Asks `ready` every `every` until it answers true. Fails, with the
    /// end of its log, when the process exits first or `timeout` passes
    /// (saying it did not `what`).
    pub async fn until_ready(
        &self,
        what: &str,
        timeout: Duration,
        every: Duration,
        mut ready: impl AsyncFnMut() -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                bail!("{} exited ({status}):\n{}", self.spec.name, self.log_tail(20));
            }
            if ready().await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("{} did not {what} within {timeout:?}:\n{}", self.spec.name, self.log_tail(20));
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Whether it has not exited yet (a suspended process still runs).
    pub fn is_running(&self) -> bool {
        self.exited.borrow().is_none()
    }

    /// Sends `signal`, unless it already exited.
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        if !self.is_running() {
            bail!("{} already exited ({})", self.spec.name, self.exit_status().unwrap_or_default());
        }
        let pid = pid_of(self.pid)?;
        kill_process(pid, signal).with_context(|| format!("cannot signal {} (pid {})", self.spec.name, self.pid))
    }

    /// Waits up to `timeout` for it to exit; how it exited, if it did.
    pub async fn wait_exit(&self, timeout: Duration) -> Option<String> {
        let mut exited = self.exited.clone();
        match tokio::time::timeout(timeout, exited.wait_for(Option::is_some)).await {
            Ok(Ok(status)) => status.clone(),
            _ => self.exit_status(),
        }
    }

    /// `kill -9`, then waits for it to be reaped.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            self.signal(Signal::KILL)?;
        }
        match self.wait_exit(KILL_WAIT).await {
            Some(_) => Ok(()),
            None => bail!("{} (pid {}) survived SIGKILL for {KILL_WAIT:?}", self.spec.name, self.pid),
        }
    }

    /// SIGTERM (after SIGCONT, in case it is suspended), then SIGKILL if it
    /// has not exited within `grace`.
    pub async fn terminate(&mut self, grace: Duration) -> anyhow::Result<()> {
        if !self.is_running() {
            return Ok(());
        }
        let _ = self.signal(Signal::CONT);
        let _ = self.signal(Signal::TERM);
        if self.wait_exit(grace).await.is_some() {
            return Ok(());
        }
        self.kill().await
    }

    /// SIGSTOP: the process stays, frozen, with every socket open.
    pub fn suspend(&self) -> anyhow::Result<()> {
        self.signal(Signal::STOP)
    }

    /// SIGCONT.
    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal(Signal::CONT)
    }

    /// The last `lines` lines of its log, indented, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.spec.log, lines)
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        if self.is_running()
            && let Ok(pid) = pid_of(self.pid)
        {
            let _ = kill_process(pid, Signal::CONT);
            let _ = kill_process(pid, Signal::KILL);
        }
    }
}

/// The last `lines` lines of the file at `path`, indented.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let tail = &all[all.len().saturating_sub(lines)..];
    if tail.is_empty() {
        return "  (nothing)".to_string();
    }
    tail.iter().map(|line| format!("  {line}")).collect::<Vec<_>>().join("\n")
}

/// `pid` as rustix takes it.
pub(crate) fn pid_of(pid: u32) -> anyhow::Result<Pid> {
    i32::try_from(pid).ok().and_then(Pid::from_raw).with_context(|| format!("{pid} is not a pid"))
}
