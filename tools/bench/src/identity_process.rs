//! Identity under test: the real `berth-identity` binary, run as a process
//! of its own (or several, as replicas) on state made for the run alone, so the memory
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
//! [`IdentityProcess::start_replicas`] creates the state, opens the CA
//! in-process the way identity will (same database, same sealing secret) to
//! issue the bench's admin certificate, starts the binary on free loopback
//! ports and waits for each replica's health check. [`IdentityProcess::stop`]
//! sends SIGTERM, waits, and removes the state whatever happened before;
//! [`IdentityProcess::around`] runs a scenario between the two.

use std::net::SocketAddr;

use berth_bus::Bus;
use berth_core::Identity;
use berth_mtls::TlsCredentials;

use crate::process::{
    ChildProcess, ScratchDatabase, ServiceProcessError, claim_bus, free_loopback_port, is_postgres, sibling_binary,
};

/// How long the bench's admin certificate lives: longer than any run.
const ADMIN_CERT_TTL: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// The name in the bench's admin certificate: `bench.admin.berth.internal`.
const ADMIN_NAME: &str = "bench";

/// Random bytes in the sealing secret, hex encoded (64 characters).
const SECRET_BYTES: usize = 32;

/// Why identity could not be started, watched or cleaned up after.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProcessError {
    /// The process, its files or its store and bus.
    #[error(transparent)]
    Process(#[from] ServiceProcessError),
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
}

/// Which state identity runs on.
#[derive(Debug, Clone, Default)]
pub(crate) struct StateOptions {
    /// A PostgreSQL server to make the scratch database on; `None` for SQLite.
    pub(crate) database_url: Option<String>,
    /// A Redis for identity's bus; `None` for the in-process one.
    pub(crate) redis_url: Option<String>,
    /// Where leases will serve, so identity signs workload certificates
    /// (checking their leases there); `None` signs none.
    pub(crate) leases_addr: Option<SocketAddr>,
}

impl StateOptions {
    /// The store and bus in words, for the report.
    pub(crate) fn describe(&self) -> (&'static str, &'static str) {
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
            Some(bus) => bus.clear().await.map(drop).map_err(ServiceProcessError::Bus),
            None => Ok(()),
        };
        let dropped = match self.database.take() {
            Some(database) => database.drop_database().await,
            None => Ok(()),
        };
        Ok(cleared.and(dropped)?)
    }
}

/// Identity under test: one replica or several on the same state.
#[derive(Debug)]
pub(crate) struct IdentityProcess {
    /// Each replica and where it serves; never empty.
    replicas: Vec<(ChildProcess, SocketAddr)>,
    admin: TlsCredentials,
    scratch: Scratch,
}

impl IdentityProcess {
    /// Starts `replicas` replicas on fresh state (see [`Self::start_replicas`]),
    /// runs `scenario` beside them until it ends, a replica dies or
    /// `shutdown` fires, then stops them and removes their state whatever
    /// happened. The scenario's failure is told before a failed clean-up.
    pub(crate) async fn around<T, E: From<ProcessError>>(
        options: &StateOptions,
        replicas: usize,
        shutdown: &tokio_util::sync::CancellationToken,
        interrupted: impl Fn() -> E,
        scenario: impl AsyncFnOnce(&IdentityProcess) -> Result<T, E>,
    ) -> Result<T, E> {
        let identity = tokio::select! {
            started = Self::start_replicas(options, replicas) => started?,
            () = shutdown.cancelled() => return Err(interrupted()),
        };
        let outcome = tokio::select! {
            outcome = scenario(&identity) => outcome,
            died = identity.exited() => Err(died.into()),
            () = shutdown.cancelled() => Err(interrupted()),
        };
        crate::output::progress("stopping berth-identity and removing its state");
        let stopped = identity.stop().await;
        let outcome = outcome?;
        stopped?;
        Ok(outcome)
    }

    /// Makes fresh state and starts `replicas` `berth-identity` replicas on
    /// it (sealed under the same secret), one after the other, each serving
    /// before the next starts. On failure whatever was made is removed again.
    pub(crate) async fn start_replicas(options: &StateOptions, replicas: usize) -> Result<Self, ProcessError> {
        if let Some(url) = &options.database_url
            && !is_postgres(url)
        {
            return Err(ServiceProcessError::DatabaseUrl.into());
        }
        let binary = sibling_binary("berth-identity")?;
        let dir = tempfile::Builder::new()
            .prefix("berth-bench-")
            .tempdir()
            .map_err(|source| ServiceProcessError::Io { what: "cannot create a temporary directory", source })?;
        let mut scratch = Scratch { dir, database: None, bus: None };
        match launch(&binary, options, replicas.max(1), &mut scratch).await {
            Ok((replicas, admin)) => Ok(Self { replicas, admin, scratch }),
            Err(error) => {
                if let Err(cleanup) = scratch.remove().await {
                    eprintln!("bench: warning: {cleanup}");
                }
                Err(error)
            }
        }
    }

    /// The first replica's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.replicas[0].0.pid()
    }

    /// Where the first replica serves (loopback).
    pub(crate) fn addr(&self) -> SocketAddr {
        self.replicas[0].1
    }

    /// Every replica's process id, in order.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.replicas.iter().map(|(child, _)| child.pid()).collect()
    }

    /// Where every replica serves, in order.
    pub(crate) fn addrs(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(|(_, addr)| *addr).collect()
    }

    /// The bench's admin identity, signed by identity's CA.
    pub(crate) fn admin(&self) -> &TlsCredentials {
        &self.admin
    }

    /// The CA bundle identity's certificates chain to.
    pub(crate) fn ca_bundle_pem(&self) -> String {
        self.admin.material().ca_bundle_pem
    }

    /// Resolves once any replica has exited, with the reason as an error.
    pub(crate) async fn exited(&self) -> ProcessError {
        let exits = self.replicas.iter().map(|(child, _)| Box::pin(child.exited()));
        futures::future::select_all(exits).await.0.into()
    }

    /// Stops every replica (SIGTERM, then SIGKILL when one lingers) and
    /// removes the run's state.
    pub(crate) async fn stop(mut self) -> Result<(), ProcessError> {
        futures::future::join_all(self.replicas.drain(..).map(|(child, _)| child.stop())).await;
        self.scratch.remove().await
    }
}

/// Makes the state, then starts `replicas` replicas on it, each serving
/// before the next starts.
async fn launch(
    binary: &std::path::Path,
    options: &StateOptions,
    replicas: usize,
    scratch: &mut Scratch,
) -> Result<(Vec<(ChildProcess, SocketAddr)>, TlsCredentials), ProcessError> {
    let redis_url = match &options.redis_url {
        Some(url) => {
            scratch.bus = Some(claim_bus(url, berth_identity::NAME).await?);
            url.clone()
        }
        None => "memory://".to_string(),
    };
    let database_url = match &options.database_url {
        Some(server) => {
            let database = ScratchDatabase::create(server).await?;
            let url = database.url().to_string();
            scratch.database = Some(database);
            url
        }
        None => format!("sqlite://{}", scratch.dir.path().join("identity.db").display()),
    };
    let secret = random_secret();
    let admin = issue_admin(&database_url, &secret).await?;

    let mut started = Vec::with_capacity(replicas);
    for replica in 0..replicas {
        let addr = free_loopback_port()?;
        let mut command = tokio::process::Command::new(binary);
        command
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--database-url")
            .arg(&database_url)
            .arg("--redis-url")
            .arg(&redis_url)
            // Through the environment, so the secret never shows in `ps`.
            .env("BERTH_AUTH_SECRET", &secret);
        if let Some(leases) = options.leases_addr {
            command.arg("--leases-addr").arg(leases.to_string());
        }
        let log = scratch.dir.path().join(format!("identity-{replica}.log"));
        let child = ChildProcess::spawn("berth-identity", binary, command, log)?;
        child.wait_until_serving(addr, &admin).await?;
        started.push((child, addr));
    }
    Ok((started, admin))
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
