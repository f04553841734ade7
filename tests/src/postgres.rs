//! A PostgreSQL server of the test's own: initialised in a temporary
//! directory and run on a free loopback port, so it can be stopped and
//! restarted at will without touching the PostgreSQL other tests share.
//!
//! # What is stored
//! `TMP/data`: the cluster (trust authentication, superuser `postgres`),
//! removed when the server is dropped. Its unix socket lives there too.
//! The server's log goes to `PARENT/logs/postgres.log` where the parent
//! has a `logs/` directory (the mesh's, kept with it for a post-mortem),
//! else to `TMP/postgres.log`. It records every wait for a lock longer
//! than a second, naming the process that holds it, and every statement
//! that ran longer than two seconds.
//!
//! # Running as root
//! PostgreSQL refuses to run as root, so when the test is root the server
//! runs as the `postgres` user (which owns the directory); otherwise as the
//! test's own user. `fsync` is off (a test cluster need not survive the
//! machine), but commits stay synchronous: a server killed or restarted
//! keeps every transaction it acknowledged, as a production server does.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rustix::process::Signal;
use sqlx::Connection as _;

use crate::ports::free_port;
use crate::process::{ManagedProcess, ProcessSpec};

/// Overrides where `initdb` and `postgres` are looked for.
pub const PG_BIN_ENV: &str = "BERTH_E2E_PG_BIN";

/// Where Debian installs PostgreSQL, one directory per major version.
const DEBIAN_PG_ROOT: &str = "/usr/lib/postgresql";

/// How long the server may take to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a fast shutdown may take before the server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// Connections the server allows: every replica's pool and the test's.
const MAX_CONNECTIONS: u32 = 300;

/// A private PostgreSQL server.
#[derive(Debug)]
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    user: Option<(u32, u32)>,
    log: PathBuf,
    process: Option<ManagedProcess>,
}

impl PrivatePostgres {
    /// Initialises a cluster in a new temporary directory and starts it.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_in(&std::env::temp_dir()).await
    }

    /// Initialises a cluster in a new directory under `parent` (which the
    /// `postgres` user must be able to traverse when the test is root) and
    /// starts it.
    pub async fn start_in(parent: &Path) -> anyhow::Result<Self> {
        let bin = pg_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("berth-e2e-pg-")
            .tempdir_in(parent)
            .with_context(|| format!("cannot make a directory in {}", parent.display()))?;
        let user = if rustix::process::geteuid().is_root() { Some(postgres_user()?) } else { None };
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .with_context(|| format!("cannot give {} to the postgres user", dir.path().display()))?;
        }
        let data = dir.path().join("data");
        let mut initdb = ProcessSpec::new("initdb", bin.join("initdb"), dir.path().join("initdb.log"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8", "--locale=C"])
            .current_dir(dir.path());
        if let Some((uid, gid)) = user {
            initdb = initdb.as_user(uid, gid);
        }
        let init = initdb.spawn()?;
        match init.wait_exit(READY_TIMEOUT).await {
            Some(status) if status.contains("exit status: 0") => {}
            status => {
                bail!("initdb failed ({}):\n{}", status.unwrap_or_else(|| "still running".into()), init.log_tail(20))
            }
        }
        let logs = parent.join("logs");
        let log = if logs.is_dir() { logs.join("postgres.log") } else { dir.path().join("postgres.log") };
        let mut server = Self { dir, bin, port: free_port()?, user, log, process: None };
        server.start_again().await?;
        Ok(server)
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `name` on this server.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@{}:{}/{name}", Ipv4Addr::LOCALHOST, self.port)
    }

    /// Creates database `name` and returns its URL.
    pub async fn create_database(&self, name: &str) -> anyhow::Result<String> {
        let mut conn = sqlx::PgConnection::connect(&self.url("postgres")).await.context("cannot reach postgres")?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .with_context(|| format!("cannot create database {name}"))?;
        let _ = conn.close().await;
        Ok(self.url(name))
    }

    /// Whether the server process runs.
    pub fn is_running(&self) -> bool {
        self.process.as_ref().is_some_and(ManagedProcess::is_running)
    }

    /// Starts the server (again) on the same directory and port, and waits
    /// until it accepts connections.
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        let data = self.dir.path().join("data");
        let mut spec = ProcessSpec::new("postgres", self.bin.join("postgres"), self.log.clone())
            .arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(&data)
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c".to_string(), format!("max_connections={MAX_CONNECTIONS}")])
            .args(["-c", "log_lock_waits=on", "-c", "deadlock_timeout=1s", "-c", "log_min_duration_statement=2000"])
            .args(["-c", "log_line_prefix=%m [%p] %a: "])
            .current_dir(self.dir.path());
        if let Some((uid, gid)) = self.user {
            spec = spec.as_user(uid, gid);
        }
        let process = spec.spawn()?;
        let url = self.url("postgres");
        let accepts = async || {
            let connected = tokio::time::timeout(Duration::from_secs(2), sqlx::PgConnection::connect(&url)).await;
            let Ok(Ok(conn)) = connected else { return false };
            let _ = conn.close().await;
            true
        };
        process.until_ready("accept connections", READY_TIMEOUT, Duration::from_millis(100), accepts).await?;
        self.process = Some(process);
        Ok(())
    }

    /// Stops the server with a fast shutdown (clients are disconnected,
    /// what was committed stays), killing it if that takes too long.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        let Some(process) = self.process.as_mut() else { return Ok(()) };
        if process.is_running() {
            process.signal(Signal::INT)?;
            if process.wait_exit(STOP_TIMEOUT).await.is_none() {
                process.kill().await?;
            }
        }
        self.process = None;
        Ok(())
    }

    /// Stops the server, keeps it down for `down_for`, and starts it again.
    pub async fn restart(&mut self, down_for: Duration) -> anyhow::Result<()> {
        self.stop().await?;
        tokio::time::sleep(down_for).await;
        self.start_again().await
    }

    /// The server's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        // Immediate shutdown: the cluster is thrown away with its directory.
        if let Some(process) = &self.process
            && process.is_running()
        {
            let _ = process.signal(Signal::QUIT);
            let pid = process.pid();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                #[allow(clippy::disallowed_methods, reason = "drop cannot await; a short wait for the server to go")]
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// The directory holding `initdb` and `postgres`: `$BERTH_E2E_PG_BIN`, or the
/// newest version under `/usr/lib/postgresql`.
fn pg_bin() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(PG_BIN_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(DEBIAN_PG_ROOT)
        .with_context(|| format!("no PostgreSQL under {DEBIAN_PG_ROOT}; install postgresql or set {PG_BIN_ENV}"))?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .with_context(|| format!("no PostgreSQL with initdb under {DEBIAN_PG_ROOT}; set {PG_BIN_ENV}"))
}

/// The uid and gid of the `postgres` user, from `/etc/passwd`.
fn postgres_user() -> anyhow::Result<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").context("cannot read /etc/passwd")?;
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&"postgres") && fields.len() > 3)
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
        .context("the test runs as root and there is no postgres user to run PostgreSQL as")
}
