//! What every end-to-end test of the `berth` binary needs: free ports, a
//! real `berth dev` started on them, and the CLI run as a user runs it, its
//! outcome read back.

#![allow(dead_code, reason = "each test binary uses a different part of it")]
#![allow(clippy::disallowed_methods, reason = "these helpers drive processes from plain threads, not a runtime")]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long `berth dev` may take to print its banner.
const BANNER_DEADLINE: Duration = Duration::from_secs(60);

/// How many times a start is tried again on other ports when something else
/// took one of the chosen ports between the probe and `berth dev`'s bind.
const PORT_TRIES: usize = 5;

/// A port base whose seven ports are free right now, drawn at random below
/// the kernel's ephemeral range so that no outgoing connection of another
/// test is handed one of them while `berth dev` starts.
pub(crate) fn free_port_base() -> u16 {
    berth_testkit::free_ports(7)
}

/// Stops a `berth dev` on `dir` as Ctrl-C does (SIGTERM: it stops its node's
/// workloads first), SIGKILL if it has not exited within a few seconds, then
/// destroys any container its node left, so no test leaves one behind.
#[allow(clippy::disallowed_methods, reason = "called from Drop and plain tests, outside any runtime")]
pub(crate) fn stop_dev(child: &mut Child, dir: &Path) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    }
    for _ in 0..200 {
        if matches!(child.try_wait(), Ok(Some(_))) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    berth_agent::destroy_containers(&dir.join("agent"));
}

/// Starts `berth dev` on `dir` on free ports and waits for its banner; the
/// caller owns (and stops, with [`stop_dev`]) the process. Its port base is
/// the second half.
pub(crate) fn spawn_dev(dir: &Path) -> (Child, u16) {
    spawn_dev_with(dir, &[])
}

/// Like [`spawn_dev`], with `extra` flags for `berth dev`. A start that
/// fails because another process took one of its ports first is tried again
/// on other ports; any other failure panics with what `berth dev` printed.
pub(crate) fn spawn_dev_with(dir: &Path, extra: &[&str]) -> (Child, u16) {
    for _ in 1..PORT_TRIES {
        let base = free_port_base();
        match try_spawn_dev(dir, base, extra) {
            Ok(child) => return (child, base),
            Err(stderr) if stderr.contains("Address already in use") => continue,
            Err(stderr) => panic!("berth dev printed no banner: {stderr}"),
        }
    }
    let base = free_port_base();
    let child =
        try_spawn_dev(dir, base, extra).unwrap_or_else(|stderr| panic!("berth dev printed no banner: {stderr}"));
    (child, base)
}

/// Starts `berth dev` on `base` and waits for its banner; on failure, what
/// it printed on stderr (which is passed through to the test's stderr too).
fn try_spawn_dev(dir: &Path, base: u16, extra: &[&str]) -> Result<Child, String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["dev", "--data-dir"])
        .arg(dir)
        .args(["--port-base", &base.to_string()])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("berth binary runs");
    let stdout = child.stdout.take().expect("a piped stdout");
    let stderr = child.stderr.take().expect("a piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("berth dev is running") {
                let _ = tx.send(());
            }
        }
    });
    let printed = std::thread::spawn(move || {
        let mut kept = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if kept.len() < 64 * 1024 {
                kept.push_str(&line);
                kept.push('\n');
            }
        }
        kept
    });
    match rx.recv_timeout(BANNER_DEADLINE) {
        Ok(()) => Ok(child),
        Err(waited) => {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = printed.join().unwrap_or_default();
            Err(format!("{waited}; stderr: {stderr}"))
        }
    }
}

/// A running `berth dev` on its own data directory and free ports, stopped
/// with [`stop_dev`] on drop. Each test binary adds the ways it drives it.
#[derive(Debug)]
pub(crate) struct DevProcess {
    child: Child,
    /// Its data directory, which holds the admin credentials.
    pub(crate) dir: PathBuf,
    /// Identity's address; revisions is one port above it, leases two.
    pub(crate) server: String,
}

impl DevProcess {
    /// Starts `berth dev` on `dir` and waits for its banner.
    pub(crate) fn start(dir: &Path) -> DevProcess {
        DevProcess::start_with(dir, &[])
    }

    /// Like [`DevProcess::start`], with `extra` flags for `berth dev`.
    pub(crate) fn start_with(dir: &Path, extra: &[&str]) -> DevProcess {
        let (child, base) = spawn_dev_with(dir, extra);
        DevProcess { child, dir: dir.to_path_buf(), server: format!("127.0.0.1:{base}") }
    }

    /// `berth ARGS` as the dev admin against this mesh, finding it through
    /// the environment so ARGS may end in `-- COMMAND`.
    pub(crate) fn admin_command(&self, args: &[&str]) -> Command {
        let mut command = berth_command(args);
        command.env("BERTH_SERVER", &self.server).env("BERTH_DATA_DIR", &self.dir);
        command
    }

    /// Waits up to `deadline` until `berth capacity -o json` (each run
    /// allowed `command_deadline`) lists an UP node that `pick` takes; what
    /// it took.
    pub(crate) fn node_up<T>(
        &self,
        deadline: Duration,
        command_deadline: Duration,
        pick: impl Fn(&Value) -> Option<T>,
    ) -> T {
        poll(deadline, "the dev node is UP in the ledger", || {
            let listed = run(self.admin_command(&["capacity", "-o", "json"]), command_deadline);
            let parsed: Value = serde_json::from_str(&listed.stdout).map_err(|_| format!("{listed:?}"))?;
            parsed["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|n| n["state"] == "NODE_STATE_UP")
                .find_map(&pick)
                .ok_or_else(|| parsed.to_string())
        })
    }
}

impl Drop for DevProcess {
    fn drop(&mut self) {
        stop_dev(&mut self.child, &self.dir);
    }
}

#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    /// How long the command ran.
    pub(crate) took: Duration,
}

impl Outcome {
    /// The one `berth: error:` line; fails unless there is exactly one and
    /// the exit code is 1.
    pub(crate) fn error_line(&self) -> String {
        assert_eq!(self.code, Some(1), "{self:?}");
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
        let errors: Vec<&str> = self.stderr.lines().filter(|l| l.starts_with("berth: error:")).collect();
        assert_eq!(errors.len(), 1, "exactly one error line: {}", self.stderr);
        errors[0].to_string()
    }

    /// What `berth ARGS` printed; fails unless it succeeded.
    pub(crate) fn succeeded(self, args: &[&str]) -> String {
        assert_eq!(self.code, Some(0), "berth {args:?} failed: {}{}", self.stdout, self.stderr);
        self.stdout
    }
}

/// What `berth ARGS` printed with `-o json`, parsed; fails unless it is JSON.
pub(crate) fn parse_json(args: &[&str], stdout: &str) -> Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("berth {args:?} -o json printed no JSON ({e}): {stdout}"))
}

/// The real binary with `args` and no `BERTH_*` settings from the environment.
pub(crate) fn berth_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_berth"));
    command.args(args);
    for name in [
        "BERTH_SERVER",
        "BERTH_REVISIONS_SERVER",
        "BERTH_LEASES_SERVER",
        "BERTH_CA",
        "BERTH_CERT",
        "BERTH_KEY",
        "BERTH_DATA_DIR",
        "BERTH_OUTPUT",
    ] {
        command.env_remove(name);
    }
    command
}

/// Runs `command` to its end, killing it and failing the test if it takes
/// longer than `deadline`.
pub(crate) fn run(mut command: Command, deadline: Duration) -> Outcome {
    let start = Instant::now();
    let mut child = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            pipe.read_to_end(&mut bytes).unwrap();
            String::from_utf8(bytes).unwrap()
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} still ran after {deadline:?}; stderr: {}", stderr.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        code: status.code(),
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
        took: start.elapsed(),
    }
}

/// Retries `probe` every 200 ms until it yields, or fails after `deadline`
/// with what it last saw.
pub(crate) fn poll<T>(deadline: Duration, what: &str, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    loop {
        match probe() {
            Ok(value) => return value,
            Err(last) if start.elapsed() > deadline => panic!("{what} within {deadline:?}; last saw: {last}"),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// The table row whose first column is `id`, split on whitespace.
pub(crate) fn row<'a>(table: &'a str, id: &str) -> Vec<&'a str> {
    table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.first() == Some(&id))
        .unwrap_or_else(|| panic!("no row for {id} in:\n{table}"))
}
