//! What every scenario needs to run a service under test as a process of
//! its own: the binary beside `berth-bench`, a child watched until it exits
//! and stopped gracefully, a scratch PostgreSQL database and a claimed Redis
//! prefix, each removed at the end.
//!
//! # What is stored
//! - A process's log, in a directory its caller makes and removes.
//! - A scratch database `berth_bench_<pid>_<random>` on the PostgreSQL
//!   server given, dropped (FORCE) by [`ScratchDatabase::drop_database`].
//! - On Redis, a service's usual prefix, which must be empty when claimed
//!   ([`claim_bus`]) because the run clears it when it ends.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use berth_bus::{Bus, Continuity};
use berth_mtls::TlsCredentials;
use sqlx::{AnyConnection, Connection as _, Executor as _};
use tokio::sync::{oneshot, watch};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::procfs::{self, Memory};

/// How long a process may take from spawn to answering its health check.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How often readiness is probed.
const READY_POLL: Duration = Duration::from_millis(100);

/// How long a process may take to drain and exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Lines of a log quoted when a process fails.
const LOG_TAIL_LINES: usize = 15;

/// Why a bench process or its state could not be made, watched or removed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServiceProcessError {
    /// The binary is not beside `berth-bench`.
    #[error("{path} not found: build it with cargo build --release --bins (it must sit next to berth-bench)")]
    MissingBinary {
        /// Where it was looked for.
        path: String,
    },
    /// The running executable's path is unknown.
    #[error("cannot find the running berth-bench executable: {0}")]
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

/// The binary `name` beside the running `berth-bench`.
pub(crate) fn sibling_binary(name: &str) -> Result<PathBuf, ServiceProcessError> {
    let me = std::env::current_exe().map_err(ServiceProcessError::CurrentExe)?;
    let path = me.with_file_name(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if path.is_file() { Ok(path) } else { Err(ServiceProcessError::MissingBinary { path: path.display().to_string() }) }
}

/// A loopback port nothing listens on right now.
pub(crate) fn free_loopback_port() -> Result<SocketAddr, ServiceProcessError> {
    let probe = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|source| ServiceProcessError::Io { what: "cannot find a free loopback port", source })?;
    probe.local_addr().map_err(|source| ServiceProcessError::Io { what: "cannot find a free loopback port", source })
}

/// A child process the bench started, watched until it exits.
#[derive(Debug)]
pub(crate) struct ChildProcess {
    binary: &'static str,
    pid: u32,
    log: PathBuf,
    exited: watch::Receiver<Option<ExitStatus>>,
    kill: Option<oneshot::Sender<()>>,
}

impl ChildProcess {
    /// Spawns `command` with its output in `log`; it is killed if the bench
    /// drops it without [`ChildProcess::stop`].
    pub(crate) fn spawn(
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
                // Sent, or its sender dropped with the process's owner (a
                // start that failed): either way nobody will stop it
                // gracefully any more.
                _ = killed => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            let _ = exited_tx.send(status.ok());
        });
        Ok(Self { binary, pid, log, exited, kill: Some(kill) })
    }

    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Its resident memory now and its peak so far.
    pub(crate) fn memory(&self) -> Option<Memory> {
        procfs::read_memory(self.pid)
    }

    /// Polls `grpc.health.v1` at `addr` until it says SERVING.
    pub(crate) async fn wait_until_serving(
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
    pub(crate) async fn exited(&self) -> ServiceProcessError {
        let mut exited = self.exited.clone();
        let status = match exited.wait_for(Option::is_some).await {
            Ok(status) => status.map_or_else(|| "unknown status".to_string(), |s| s.to_string()),
            Err(_) => "its watcher stopped".to_string(),
        };
        ServiceProcessError::Exited { binary: self.binary, status, log_tail: log_tail(&self.log) }
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    pub(crate) async fn stop(mut self) {
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
pub(crate) async fn claim_bus(url: &str, prefix: &'static str) -> Result<Bus, ServiceProcessError> {
    let bus = Bus::connect(url, prefix).await.map_err(ServiceProcessError::Bus)?;
    if bus.continuity().await.map_err(ServiceProcessError::Bus)? != Continuity::Fresh {
        return Err(ServiceProcessError::BusInUse { url: url.to_string(), prefix });
    }
    Ok(bus)
}

/// Where a bench that runs services on shared state keeps it, and how it
/// reports.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SharedStateArgs {
    /// The PostgreSQL server; the bench creates scratch databases there and
    /// drops them at the end.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres", value_name = "URL")]
    pub(crate) database_url: String,
    /// The Redis for the services' buses. The prefixes of the services the
    /// bench runs must be empty there; they are cleared at the end. The
    /// leases bench also takes `memory://`: an in-process bus.
    #[arg(long, default_value = "redis://127.0.0.1:6379/15", value_name = "URL")]
    pub(crate) redis_url: String,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = crate::output::OutputFormat::Table, value_name = "FORMAT")]
    pub(crate) output: crate::output::OutputFormat,
}

/// A database of the run's own on the PostgreSQL server it was given.
#[derive(Debug)]
pub(crate) struct ScratchDatabase {
    server_url: String,
    name: String,
    url: String,
}

impl ScratchDatabase {
    /// Creates `berth_bench_<pid>_<random>` on `server_url`.
    pub(crate) async fn create(server_url: &str) -> Result<Self, ServiceProcessError> {
        if !is_postgres(server_url) {
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
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Runs `sql` (one or more statements) in the scratch database.
    pub(crate) async fn execute(&self, sql: &str) -> Result<(), ServiceProcessError> {
        let failed =
            |source| ServiceProcessError::ScratchDatabase { what: "cannot use", name: self.name.clone(), source };
        let mut conn = AnyConnection::connect(&self.url).await.map_err(failed)?;
        conn.execute(sqlx::AssertSqlSafe(sql.to_string())).await.map_err(failed)?;
        let _ = conn.close().await;
        Ok(())
    }

    /// The first column of the one row `sql` returns, as a count.
    pub(crate) async fn count(&self, sql: &str) -> Result<i64, ServiceProcessError> {
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
    pub(crate) async fn drop_database(self) -> Result<(), ServiceProcessError> {
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

/// Whether `url` names a PostgreSQL server.
pub(crate) fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// `url` naming database `name` instead of its own, query kept.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let server = match base[authority_start..].find('/') {
        Some(slash) => &base[..authority_start + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{server}/{name}?{query}"),
        None => format!("{server}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scratch_database_replaces_only_the_database_name() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "b1"),
            "postgres://postgres@127.0.0.1:5432/b1"
        );
        assert_eq!(with_database("postgres://u:p@db:5432", "b1"), "postgres://u:p@db:5432/b1");
        assert_eq!(
            with_database("postgresql://u@db/test?sslmode=disable", "b1"),
            "postgresql://u@db/b1?sslmode=disable"
        );
        assert_eq!(
            with_database("postgresql://u@db/test?sslmode=disable&application_name=x", "b1"),
            "postgresql://u@db/b1?sslmode=disable&application_name=x"
        );
    }

    #[test]
    fn a_sqlite_url_is_refused_as_a_database_server() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let refused = runtime.block_on(ScratchDatabase::create("sqlite:///tmp/x.db"));
        assert!(matches!(refused, Err(ServiceProcessError::DatabaseUrl)));
    }
}
