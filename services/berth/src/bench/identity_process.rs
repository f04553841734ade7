//! The identity replica under test: the real `berth-identity` binary, run
//! as a process of its own on state made for the run alone, so the memory
//! read from `/proc` is identity's and nothing else's.
//!
//! # What is stored
//! - A temporary directory (removed at the end): identity's log, and its
//!   SQLite file unless `--database-url` is given.
//! - With `--database-url`: a scratch database `berth_bench_<pid>_<random>`
//!   created on that PostgreSQL server and dropped at the end; identity keeps
//!   its usual `identity` schema in it.
//! - With `--redis-url`: identity's keys under its usual `identity:` prefix.
//!   That prefix must be empty there when the run starts (a logical database
//!   of its own), because it is cleared at the end.
//!
//! # Expected flow
//! [`IdentityProcess::start`] creates the state, opens the CA in-process the
//! way identity will (same database, same sealing secret) to issue the
//! bench's admin certificate, starts the binary on a free loopback port and
//! waits for its health check. [`IdentityProcess::stop`] sends SIGTERM, waits,
//! and removes the state whatever happened before.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use berth_bus::{Bus, Continuity};
use berth_core::Identity;
use berth_mtls::TlsCredentials;
use sqlx::{AnyConnection, Connection as _, Executor as _};
use tokio::sync::{oneshot, watch};

use super::procfs::{self, Memory};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// How long the bench's admin certificate lives: longer than any run.
const ADMIN_CERT_TTL: Duration = Duration::from_secs(24 * 3600);

/// The name in the bench's admin certificate: `bench.admin.berth.internal`.
const ADMIN_NAME: &str = "bench";

/// How long identity may take from spawn to answering its health check.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How often readiness is probed.
const READY_POLL: Duration = Duration::from_millis(100);

/// How long identity may take to drain and exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Random bytes in the sealing secret, hex encoded (64 characters).
const SECRET_BYTES: usize = 32;

/// Lines of identity's log quoted when it fails.
const LOG_TAIL_LINES: usize = 15;

/// Why identity could not be started, watched or cleaned up after.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProcessError {
    /// The binary is not beside `berth`.
    #[error("{path} not found: build it with cargo build --release --bins (it must sit next to berth)")]
    MissingBinary {
        /// Where it was looked for.
        path: String,
    },
    /// The running executable's path is unknown.
    #[error("cannot find the running berth executable: {0}")]
    CurrentExe(#[source] std::io::Error),
    /// The temporary directory could not be made.
    #[error("cannot create a temporary directory: {0}")]
    TempDir(#[source] std::io::Error),
    /// `--database-url` is not a PostgreSQL server.
    #[error("--database-url must be a postgres:// URL (without it the bench uses a temporary SQLite file)")]
    DatabaseUrl,
    /// The scratch database could not be created or dropped.
    #[error("{what} scratch database {name}: {source}")]
    ScratchDatabase {
        /// "cannot create" or "cannot drop".
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
    /// Identity's prefix already holds keys on that Redis.
    #[error(
        "{url} already holds identity keys (prefix 'identity:'); the bench clears them when it ends, so point \
         --redis-url at a logical database of its own, e.g. redis://127.0.0.1:6379/15"
    )]
    BusInUse {
        /// The Redis given.
        url: String,
    },
    /// Identity's state could not be opened, or its CA refused to issue the
    /// admin certificate.
    #[error("cannot issue the bench's admin certificate: {0}")]
    Issue(#[source] Box<berth_identity::OfflineIssueError>),
    /// The admin name is not a valid identity.
    #[error("admin name: {0}")]
    AdminName(#[source] berth_core::IdentityError),
    /// The admin certificate made no usable credentials.
    #[error("admin credentials: {0}")]
    Tls(#[source] berth_mtls::MtlsError),
    /// No loopback port could be found, or the log file made.
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
    /// Identity exited on its own.
    #[error("berth-identity exited ({status}); the end of its log:\n{log_tail}")]
    Exited {
        /// How it exited.
        status: String,
        /// The last lines it wrote.
        log_tail: String,
    },
    /// Identity did not answer its health check in time.
    #[error("berth-identity did not report SERVING within {}s; the end of its log:\n{log_tail}", READY_TIMEOUT.as_secs())]
    NotReady {
        /// The last lines it wrote.
        log_tail: String,
    },
}

/// Which state identity runs on.
#[derive(Debug, Clone, Default)]
pub(super) struct StateOptions {
    /// A PostgreSQL server to make the scratch database on; `None` for SQLite.
    pub(super) database_url: Option<String>,
    /// A Redis for identity's bus; `None` for the in-process one.
    pub(super) redis_url: Option<String>,
}

impl StateOptions {
    /// The store and bus in words, for the report.
    pub(super) fn describe(&self) -> (&'static str, &'static str) {
        let store = if self.database_url.is_some() { "postgres" } else { "sqlite" };
        let bus = if self.redis_url.is_some() { "redis" } else { "memory" };
        (store, bus)
    }
}

/// What the run made and must remove.
#[derive(Debug)]
struct Scratch {
    dir: tempfile::TempDir,
    database: Option<ScratchDatabase>,
    bus: Option<Bus>,
}

impl Scratch {
    /// Removes the database and the bus keys; the directory goes on drop.
    async fn remove(&mut self) -> Result<(), ProcessError> {
        let cleared = match self.bus.take() {
            Some(bus) => bus.clear().await.map(drop).map_err(ProcessError::Bus),
            None => Ok(()),
        };
        let dropped = match self.database.take() {
            Some(database) => database.drop_database().await,
            None => Ok(()),
        };
        cleared.and(dropped)
    }
}

/// A running identity replica.
#[derive(Debug)]
pub(super) struct IdentityProcess {
    pid: u32,
    addr: SocketAddr,
    admin: TlsCredentials,
    log: PathBuf,
    scratch: Scratch,
    exited: watch::Receiver<Option<ExitStatus>>,
    kill: Option<oneshot::Sender<()>>,
}

impl IdentityProcess {
    /// Makes fresh state, starts `berth-identity` on it and waits until it
    /// serves. On failure whatever was made is removed again.
    pub(super) async fn start(options: &StateOptions) -> Result<Self, ProcessError> {
        if let Some(url) = &options.database_url
            && !is_postgres(url)
        {
            return Err(ProcessError::DatabaseUrl);
        }
        let binary = identity_binary()?;
        let dir = tempfile::Builder::new().prefix("berth-bench-").tempdir().map_err(ProcessError::TempDir)?;
        let mut scratch = Scratch { dir, database: None, bus: None };
        match launch(&binary, options, &mut scratch).await {
            Ok(launched) => Ok(Self {
                pid: launched.pid,
                addr: launched.addr,
                admin: launched.admin,
                log: launched.log,
                scratch,
                exited: launched.exited,
                kill: Some(launched.kill),
            }),
            Err(error) => {
                if let Err(cleanup) = scratch.remove().await {
                    eprintln!("bench: warning: {cleanup}");
                }
                Err(error)
            }
        }
    }

    /// Identity's process id.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Where identity serves (loopback).
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bench's admin identity, signed by identity's CA.
    pub(super) fn admin(&self) -> &TlsCredentials {
        &self.admin
    }

    /// The CA bundle identity's certificates chain to.
    pub(super) fn ca_bundle_pem(&self) -> String {
        self.admin.material().ca_bundle_pem
    }

    /// Identity's resident memory now and its peak so far.
    pub(super) fn memory(&self) -> Option<Memory> {
        procfs::read_memory(self.pid)
    }

    /// Resolves once identity has exited, with the reason as an error.
    pub(super) async fn exited(&self) -> ProcessError {
        let mut exited = self.exited.clone();
        let status = match exited.wait_for(Option::is_some).await {
            Ok(status) => status.map_or_else(|| "unknown status".to_string(), |s| s.to_string()),
            Err(_) => "its watcher stopped".to_string(),
        };
        ProcessError::Exited { status, log_tail: log_tail(&self.log) }
    }

    /// Stops identity (SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]) and
    /// removes the run's state.
    pub(super) async fn stop(mut self) -> Result<(), ProcessError> {
        if self.exited.borrow().is_none() {
            if let Some(pid) = i32::try_from(self.pid).ok().and_then(rustix::process::Pid::from_raw) {
                // Already gone is fine: the watcher reports it.
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let mut exited = self.exited.clone();
            let in_time = tokio::time::timeout(STOP_TIMEOUT, exited.wait_for(Option::is_some)).await.is_ok();
            if !in_time {
                eprintln!(
                    "bench: warning: berth-identity did not exit {}s after SIGTERM; killing it",
                    STOP_TIMEOUT.as_secs()
                );
                if let Some(kill) = self.kill.take() {
                    let _ = kill.send(());
                }
                let _ = exited.wait_for(Option::is_some).await;
            }
        }
        self.scratch.remove().await
    }
}

/// What [`launch`] started.
struct Launched {
    pid: u32,
    addr: SocketAddr,
    admin: TlsCredentials,
    log: PathBuf,
    exited: watch::Receiver<Option<ExitStatus>>,
    kill: oneshot::Sender<()>,
}

async fn launch(binary: &Path, options: &StateOptions, scratch: &mut Scratch) -> Result<Launched, ProcessError> {
    let redis_url = match &options.redis_url {
        Some(url) => {
            let bus = Bus::connect(url, berth_identity::NAME).await.map_err(ProcessError::Bus)?;
            // Claims the prefix: an empty one gets our marker and reads Fresh.
            if bus.continuity().await.map_err(ProcessError::Bus)? != Continuity::Fresh {
                return Err(ProcessError::BusInUse { url: url.clone() });
            }
            scratch.bus = Some(bus);
            url.clone()
        }
        None => "memory://".to_string(),
    };
    let database_url = match &options.database_url {
        Some(server) => {
            let database = ScratchDatabase::create(server).await?;
            let url = database.url.clone();
            scratch.database = Some(database);
            url
        }
        None => format!("sqlite://{}", scratch.dir.path().join("identity.db").display()),
    };
    let secret = random_secret();
    let admin = issue_admin(&database_url, &secret).await?;

    let addr = free_loopback_port()?;
    let log = scratch.dir.path().join("identity.log");
    let log_file = std::fs::File::create(&log)
        .map_err(|source| ProcessError::Io { what: "cannot create identity's log", source })?;
    let log_copy =
        log_file.try_clone().map_err(|source| ProcessError::Io { what: "cannot create identity's log", source })?;
    let mut child = tokio::process::Command::new(binary)
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--database-url")
        .arg(&database_url)
        .arg("--redis-url")
        .arg(&redis_url)
        // Through the environment, so the secret never shows in `ps`.
        .env("BERTH_AUTH_SECRET", &secret)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log_copy))
        .stderr(Stdio::from(log_file))
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ProcessError::Spawn { path: binary.display().to_string(), source })?;
    let pid = child.id().unwrap_or_default();
    let (exited_tx, exited) = watch::channel(None);
    let (kill, killed) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let status = tokio::select! {
            status = child.wait() => status,
            // Sent, or its sender dropped with a start that failed: either
            // way nobody will stop identity gracefully any more.
            _ = killed => {
                let _ = child.start_kill();
                child.wait().await
            }
        };
        let _ = exited_tx.send(status.ok());
    });

    let launched = Launched { pid, addr, admin, log, exited, kill };
    wait_until_serving(&launched).await?;
    Ok(launched)
}

/// `berth-identity` beside the running `berth`.
fn identity_binary() -> Result<PathBuf, ProcessError> {
    let me = std::env::current_exe().map_err(ProcessError::CurrentExe)?;
    let path = me.with_file_name(format!("berth-identity{}", std::env::consts::EXE_SUFFIX));
    if path.is_file() { Ok(path) } else { Err(ProcessError::MissingBinary { path: path.display().to_string() }) }
}

fn random_secret() -> String {
    let bytes: [u8; SECRET_BYTES] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Opens identity's CA in this process, as the binary will on the same
/// state and secret (creating it, since the state is fresh), and issues the
/// bench's admin certificate through it.
async fn issue_admin(database_url: &str, secret: &str) -> Result<TlsCredentials, ProcessError> {
    let admin = Identity::admin(ADMIN_NAME).map_err(ProcessError::AdminName)?;
    let material = berth_identity::issue_from_state(database_url, secret, &admin, &[], ADMIN_CERT_TTL)
        .await
        .map_err(|e| ProcessError::Issue(Box::new(e)))?;
    TlsCredentials::new(material).map_err(ProcessError::Tls)
}

/// A loopback port nothing listens on right now.
fn free_loopback_port() -> Result<SocketAddr, ProcessError> {
    let probe = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|source| ProcessError::Io { what: "cannot find a free loopback port", source })?;
    probe.local_addr().map_err(|source| ProcessError::Io { what: "cannot find a free loopback port", source })
}

async fn wait_until_serving(launched: &Launched) -> Result<(), ProcessError> {
    let channel = berth_rpc::connect(&launched.addr.to_string(), launched.admin.clone())
        .map_err(|e| ProcessError::Io { what: "cannot dial identity", source: std::io::Error::other(e.to_string()) })?;
    let mut health = HealthClient::new(channel);
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = *launched.exited.borrow() {
            return Err(ProcessError::Exited { status: status.to_string(), log_tail: log_tail(&launched.log) });
        }
        let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
        request.set_timeout(Duration::from_secs(1));
        if let Ok(Ok(answer)) = tokio::time::timeout(Duration::from_secs(2), health.check(request)).await
            && answer.get_ref().status == ServingStatus::Serving as i32
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(ProcessError::NotReady { log_tail: log_tail(&launched.log) });
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

/// The last lines of identity's log, indented.
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

/// A database of the run's own on the PostgreSQL server it was given.
#[derive(Debug)]
struct ScratchDatabase {
    /// The server as given, used to create and drop.
    server_url: String,
    name: String,
    /// The scratch database's own URL.
    url: String,
}

impl ScratchDatabase {
    async fn create(server_url: &str) -> Result<Self, ProcessError> {
        if !is_postgres(server_url) {
            return Err(ProcessError::DatabaseUrl);
        }
        let name = format!("berth_bench_{}_{:08x}", std::process::id(), rand::random::<u32>());
        let url = with_database(server_url, &name);
        let failed = |source| ProcessError::ScratchDatabase { what: "cannot create", name: name.clone(), source };
        sqlx::any::install_default_drivers();
        let mut conn = AnyConnection::connect(server_url).await.map_err(failed)?;
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\""))).await.map_err(failed)?;
        let _ = conn.close().await;
        Ok(Self { server_url: server_url.to_string(), name, url })
    }

    async fn drop_database(self) -> Result<(), ProcessError> {
        let failed = |source| ProcessError::ScratchDatabase { what: "cannot drop", name: self.name.clone(), source };
        let mut conn = AnyConnection::connect(&self.server_url).await.map_err(failed)?;
        // FORCE ends any session identity left behind, which DROP would wait on.
        conn.execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name)))
            .await
            .map_err(failed)?;
        let _ = conn.close().await;
        Ok(())
    }
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// `url` naming database `name` instead of its own, query kept.
pub(super) fn with_database(url: &str, name: &str) -> String {
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
        assert!(matches!(refused, Err(ProcessError::DatabaseUrl)));
    }
}
