//! The leases replica under test: the real `berth-leases` binary, run as a
//! process of its own with certificate files, a store and a bus made for
//! the run, so its throughput and memory are its own.
//!
//! # What is stored
//! - A temporary directory (removed at the end): the replica's certificate
//!   files, its log, and its SQLite file when no PostgreSQL server is given.
//! - With a PostgreSQL server: a scratch database `berth_bench_<pid>_<random>`
//!   created there and dropped at the end (FORCE), so the replica's `leases`
//!   schema and any baseline table are the run's alone.
//! - With a Redis: the replica's keys under its usual `leases:` prefix, which
//!   must be empty when the run starts and is cleared at the end.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use berth_bus::{Bus, Continuity};
use berth_mtls::{TlsCredentials, TlsMaterial};
use sqlx::{AnyConnection, Connection as _, Executor as _};
use tokio::sync::{oneshot, watch};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::identity_process::with_database;
use super::procfs::{self, Memory};

/// How long the replica may take from spawn to answering its health check.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How often readiness is probed.
const READY_POLL: Duration = Duration::from_millis(100);

/// How long the replica may take to drain and exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Lines of a log quoted when a process fails.
const LOG_TAIL_LINES: usize = 15;

/// Why a bench process or its state could not be made, watched or removed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServiceProcessError {
    /// The binary is not beside `berth`.
    #[error("{path} not found: build it with cargo build --release --bins (it must sit next to berth)")]
    MissingBinary {
        /// Where it was looked for.
        path: String,
    },
    /// The running executable's path is unknown.
    #[error("cannot find the running berth executable: {0}")]
    CurrentExe(#[source] std::io::Error),
    /// `--database-url` is not a PostgreSQL server.
    #[error("--database-url must be a postgres:// URL")]
    DatabaseUrl,
    /// The scratch database could not be created, used or dropped.
    #[error("{what} scratch database {name}: {source}")]
    ScratchDatabase {
        /// What failed.
        what: &'static str,
        /// The database.
        name: String,
        /// What PostgreSQL said.
        #[source]
        source: sqlx::Error,
    },
    /// The bus URL was refused or Redis is unreachable.
    #[error("redis: {0}")]
    Bus(#[source] berth_bus::BusError),
    /// The service's prefix already holds keys on that Redis.
    #[error(
        "{url} already holds {prefix} keys (prefix '{prefix}:'); the bench clears them when it ends, so point \
         --redis-url at a logical database of its own, e.g. redis://127.0.0.1:6379/15"
    )]
    BusInUse {
        /// The Redis given.
        url: String,
        /// The prefix in use.
        prefix: &'static str,
    },
    /// A file, directory or port could not be made.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The binary could not be run.
    #[error("cannot run {path}: {source}")]
    Spawn {
        /// The binary.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The process exited on its own.
    #[error("{binary} exited ({status}); the end of its log:\n{log_tail}")]
    Exited {
        /// Which binary.
        binary: &'static str,
        /// How it exited.
        status: String,
        /// The last lines it wrote.
        log_tail: String,
    },
    /// The process did not answer its health check in time.
    #[error("{binary} did not report SERVING within {}s; the end of its log:\n{log_tail}", READY_TIMEOUT.as_secs())]
    NotReady {
        /// Which binary.
        binary: &'static str,
        /// The last lines it wrote.
        log_tail: String,
    },
}

/// The binary `name` beside the running `berth`.
pub(super) fn sibling_binary(name: &str) -> Result<PathBuf, ServiceProcessError> {
    let me = std::env::current_exe().map_err(ServiceProcessError::CurrentExe)?;
    let path = me.with_file_name(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if path.is_file() { Ok(path) } else { Err(ServiceProcessError::MissingBinary { path: path.display().to_string() }) }
}

/// A loopback port nothing listens on right now.
pub(super) fn free_loopback_port() -> Result<SocketAddr, ServiceProcessError> {
    let probe = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|source| ServiceProcessError::Io { what: "cannot find a free loopback port", source })?;
    probe.local_addr().map_err(|source| ServiceProcessError::Io { what: "cannot find a free loopback port", source })
}

/// Where and how the leases replica runs.
#[derive(Debug)]
pub(super) struct LeasesLaunch<'a> {
    /// Its own certificate, key and CA bundle (a `leases` service identity).
    pub(super) material: TlsMaterial,
    /// Credentials the bench probes its health with.
    pub(super) probe: &'a TlsCredentials,
    /// Its store: `postgres://` (a scratch database) or `sqlite://` under the run's directory.
    pub(super) database_url: String,
    /// Its bus: `redis://` or `memory://`.
    pub(super) redis_url: String,
    /// Where it follows the node registry.
    pub(super) identity_addr: SocketAddr,
    /// Its lease TTL in seconds.
    pub(super) lease_ttl_seconds: u64,
}

/// A running `berth-leases`.
#[derive(Debug)]
pub(super) struct LeasesProcess {
    child: ChildProcess,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl LeasesProcess {
    /// Writes the certificate files, starts the replica on a free loopback
    /// port and waits until it serves.
    pub(super) async fn start(launch: LeasesLaunch<'_>) -> Result<Self, ServiceProcessError> {
        let binary = sibling_binary("berth-leases")?;
        let dir = tempfile::Builder::new()
            .prefix("berth-bench-leases-")
            .tempdir()
            .map_err(|source| ServiceProcessError::Io { what: "cannot create a temporary directory", source })?;
        let write = |name: &str, text: &str| -> Result<PathBuf, ServiceProcessError> {
            let path = dir.path().join(name);
            std::fs::write(&path, text)
                .map_err(|source| ServiceProcessError::Io { what: "cannot write a certificate file", source })?;
            Ok(path)
        };
        let cert = write("leases.crt", &launch.material.cert_chain_pem)?;
        let key = write("leases.key", &launch.material.key_pem)?;
        let ca = write("ca.crt", &launch.material.ca_bundle_pem)?;
        let addr = free_loopback_port()?;
        let mut command = tokio::process::Command::new(&binary);
        command
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .arg("--ca-file")
            .arg(ca)
            .arg("--database-url")
            .arg(&launch.database_url)
            .arg("--redis-url")
            .arg(&launch.redis_url)
            .arg("--identity-addr")
            .arg(launch.identity_addr.to_string())
            .arg("--lease-ttl")
            .arg(launch.lease_ttl_seconds.to_string());
        let child = ChildProcess::spawn("berth-leases", &binary, command, dir.path().join("leases.log"))?;
        child.wait_until_serving(addr, launch.probe).await?;
        Ok(Self { child, addr, _dir: dir })
    }

    /// The replica's process id.
    pub(super) fn pid(&self) -> u32 {
        self.child.pid
    }

    /// Where it serves.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its resident memory now and its peak so far.
    pub(super) fn memory(&self) -> Option<Memory> {
        procfs::read_memory(self.child.pid)
    }

    /// Resolves once it has exited, with the reason as an error.
    pub(super) async fn exited(&self) -> ServiceProcessError {
        self.child.exited().await
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    pub(super) async fn stop(self) {
        self.child.stop().await;
    }
}

/// A child process the bench started, watched until it exits.
#[derive(Debug)]
pub(super) struct ChildProcess {
    binary: &'static str,
    pid: u32,
    log: PathBuf,
    exited: watch::Receiver<Option<ExitStatus>>,
    kill: Option<oneshot::Sender<()>>,
}

impl ChildProcess {
    /// Spawns `command` with its output in `log`; it is killed if the bench drops it.
    pub(super) fn spawn(
        binary: &'static str,
        path: &Path,
        mut command: tokio::process::Command,
        log: PathBuf,
    ) -> Result<Self, ServiceProcessError> {
        let log_file = std::fs::File::create(&log)
            .map_err(|source| ServiceProcessError::Io { what: "cannot create a log file", source })?;
        let log_copy = log_file
            .try_clone()
            .map_err(|source| ServiceProcessError::Io { what: "cannot create a log file", source })?;
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_copy))
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| ServiceProcessError::Spawn { path: path.display().to_string(), source })?;
        let pid = child.id().unwrap_or_default();
        let (exited_tx, exited) = watch::channel(None);
        let (kill, killed) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let status = tokio::select! {
                status = child.wait() => status,
                Ok(()) = killed => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            let _ = exited_tx.send(status.ok());
        });
        Ok(Self { binary, pid, log, exited, kill: Some(kill) })
    }

    /// The process id.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Polls `grpc.health.v1` at `addr` until it says SERVING.
    pub(super) async fn wait_until_serving(
        &self,
        addr: SocketAddr,
        credentials: &TlsCredentials,
    ) -> Result<(), ServiceProcessError> {
        let channel = berth_rpc::connect(&addr.to_string(), credentials.clone()).map_err(|e| {
            ServiceProcessError::Io { what: "cannot dial the process", source: std::io::Error::other(e.to_string()) }
        })?;
        let mut health = HealthClient::new(channel);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = *self.exited.borrow() {
                return Err(ServiceProcessError::Exited {
                    binary: self.binary,
                    status: status.to_string(),
                    log_tail: log_tail(&self.log),
                });
            }
            let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
            request.set_timeout(Duration::from_secs(1));
            if let Ok(Ok(answer)) = tokio::time::timeout(Duration::from_secs(2), health.check(request)).await
                && answer.get_ref().status == ServingStatus::Serving as i32
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ServiceProcessError::NotReady { binary: self.binary, log_tail: log_tail(&self.log) });
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// Resolves once the process has exited, with the reason as an error.
    pub(super) async fn exited(&self) -> ServiceProcessError {
        let mut exited = self.exited.clone();
        let status = match exited.wait_for(Option::is_some).await {
            Ok(status) => status.map_or_else(|| "unknown status".to_string(), |s| s.to_string()),
            Err(_) => "its watcher stopped".to_string(),
        };
        ServiceProcessError::Exited { binary: self.binary, status, log_tail: log_tail(&self.log) }
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    pub(super) async fn stop(mut self) {
        if self.exited.borrow().is_some() {
            return;
        }
        if let Some(pid) = i32::try_from(self.pid).ok().and_then(rustix::process::Pid::from_raw) {
            // Already gone is fine: the watcher reports it.
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let mut exited = self.exited.clone();
        if tokio::time::timeout(STOP_TIMEOUT, exited.wait_for(Option::is_some)).await.is_err() {
            eprintln!(
                "bench: warning: {} did not exit {}s after SIGTERM; killing it",
                self.binary,
                STOP_TIMEOUT.as_secs()
            );
            if let Some(kill) = self.kill.take() {
                let _ = kill.send(());
            }
            let _ = exited.wait_for(Option::is_some).await;
        }
    }
}

/// The last lines of a log, indented.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    if tail.is_empty() {
        "  (nothing)".to_string()
    } else {
        tail.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
    }
}

/// Claims `prefix` on the Redis at `url` for the run: an empty prefix gets
/// the bus's marker and reads fresh; anything else is someone's data.
pub(super) async fn claim_bus(url: &str, prefix: &'static str) -> Result<Bus, ServiceProcessError> {
    let bus = Bus::connect(url, prefix).await.map_err(ServiceProcessError::Bus)?;
    if bus.continuity().await.map_err(ServiceProcessError::Bus)? != Continuity::Fresh {
        return Err(ServiceProcessError::BusInUse { url: url.to_string(), prefix });
    }
    Ok(bus)
}

/// A database of the run's own on the PostgreSQL server it was given.
#[derive(Debug)]
pub(super) struct ScratchDatabase {
    server_url: String,
    name: String,
    url: String,
}

impl ScratchDatabase {
    /// Creates `berth_bench_<pid>_<random>` on `server_url`.
    pub(super) async fn create(server_url: &str) -> Result<Self, ServiceProcessError> {
        if !(server_url.starts_with("postgres://") || server_url.starts_with("postgresql://")) {
            return Err(ServiceProcessError::DatabaseUrl);
        }
        let name = format!("berth_bench_{}_{:08x}", std::process::id(), rand::random::<u32>());
        let url = with_database(server_url, &name);
        let failed =
            |source| ServiceProcessError::ScratchDatabase { what: "cannot create", name: name.clone(), source };
        sqlx::any::install_default_drivers();
        let mut conn = AnyConnection::connect(server_url).await.map_err(failed)?;
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\""))).await.map_err(failed)?;
        let _ = conn.close().await;
        Ok(Self { server_url: server_url.to_string(), name, url })
    }

    /// The scratch database's own URL.
    pub(super) fn url(&self) -> &str {
        &self.url
    }

    /// Runs `sql` (one or more statements) in the scratch database.
    pub(super) async fn execute(&self, sql: &str) -> Result<(), ServiceProcessError> {
        let failed =
            |source| ServiceProcessError::ScratchDatabase { what: "cannot use", name: self.name.clone(), source };
        let mut conn = AnyConnection::connect(&self.url).await.map_err(failed)?;
        conn.execute(sqlx::AssertSqlSafe(sql.to_string())).await.map_err(failed)?;
        let _ = conn.close().await;
        Ok(())
    }

    /// The first column of the one row `sql` returns, as a count.
    pub(super) async fn count(&self, sql: &str) -> Result<i64, ServiceProcessError> {
        use sqlx::Row as _;
        let failed =
            |source| ServiceProcessError::ScratchDatabase { what: "cannot use", name: self.name.clone(), source };
        let mut conn = AnyConnection::connect(&self.url).await.map_err(failed)?;
        let row = sqlx::query(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(&mut conn).await.map_err(failed)?;
        let count = row.try_get::<i64, _>(0).map_err(failed)?;
        let _ = conn.close().await;
        Ok(count)
    }

    /// Drops the database, ending any session left in it.
    pub(super) async fn drop_database(self) -> Result<(), ServiceProcessError> {
        let failed =
            |source| ServiceProcessError::ScratchDatabase { what: "cannot drop", name: self.name.clone(), source };
        let mut conn = AnyConnection::connect(&self.server_url).await.map_err(failed)?;
        conn.execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name)))
            .await
            .map_err(failed)?;
        let _ = conn.close().await;
        Ok(())
    }
}
