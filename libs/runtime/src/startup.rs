//! The common `main` of every berth binary.

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;

use std::time::Duration;

use berth_bus::Bus;
use berth_store::{Migration, Store, StoreError};
use tokio_util::sync::CancellationToken;

use crate::TelemetryArgs;

/// Why a process could not start, or stopped with an error. Printed as one
/// line naming the problem.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Certificates or keys could not be loaded.
    #[error("tls: {0}")]
    Tls(#[source] berth_mtls::MtlsError),
    /// The database could not be opened or migrated.
    #[error("database: {0}")]
    Store(#[source] berth_store::StoreError),
    /// The bus could not be reached.
    #[error("bus: {0}")]
    Bus(#[source] berth_bus::BusError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("{0}")]
    Serve(#[from] berth_rpc::RpcError),
    /// Telemetry could not be set up.
    #[error("telemetry: {0}")]
    Telemetry(#[source] berth_telemetry::TelemetryError),
    /// A file or directory of the process's own could not be used.
    #[error("{what} {path}: {source}")]
    Io {
        /// What the path is for.
        what: &'static str,
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Something else the process needs is wrong; the message says what.
    #[error("{0}")]
    Invalid(String),
}

/// Opens the service's store (its own schema) and applies its migrations.
pub async fn open_store(url: &str, schema: &str, migrations: &[Migration]) -> Result<Store, StartError> {
    let store = Store::connect(url, schema).await.map_err(StartError::Store)?;
    store.migrate(migrations).await.map_err(StartError::Store)?;
    Ok(store)
}

/// Connects the service's bus under its own key prefix.
pub async fn open_bus(url: &str, prefix: &str) -> Result<Bus, StartError> {
    Bus::connect(url, prefix).await.map_err(StartError::Bus)
}

/// The first wait between attempts to reach a dependency at start-up.
const FIRST_START_RETRY: Duration = Duration::from_millis(250);

/// The longest wait between attempts to reach a dependency at start-up.
const MAX_START_RETRY: Duration = Duration::from_secs(10);

/// [`open_store`] for a long-running service: while the database cannot be
/// reached (refused, timed out), it waits and tries again, saying so each
/// time, instead of exiting: a service started during a database failover,
/// or before its database in a deploy, comes up once the database does
/// (Kubernetes' start-up probe bounds the wait). Any other failure (a bad
/// URL, a refused login, a failed migration) ends the start at once, and so
/// does `stop`.
pub async fn wait_for_store(
    url: &str,
    schema: &str,
    migrations: &[Migration],
    stop: &CancellationToken,
) -> Result<Store, StartError> {
    wait_for(
        "database",
        stop,
        || open_store(url, schema, migrations),
        |error| matches!(error, StartError::Store(StoreError::Unavailable { .. })),
    )
    .await
}

/// [`open_bus`] that waits for Redis as [`wait_for_store`] waits for the database.
pub async fn wait_for_bus(url: &str, prefix: &str, stop: &CancellationToken) -> Result<Bus, StartError> {
    wait_for(
        "bus",
        stop,
        || open_bus(url, prefix),
        |error| matches!(error, StartError::Bus(bus) if bus.is_unavailable()),
    )
    .await
}

async fn wait_for<T, F, Fut>(
    what: &'static str,
    stop: &CancellationToken,
    mut attempt: F,
    is_unavailable: fn(&StartError) -> bool,
) -> Result<T, StartError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StartError>>,
{
    let mut delay = FIRST_START_RETRY;
    loop {
        let error = match attempt().await {
            Err(error) if is_unavailable(&error) => error,
            done => return done,
        };
        tracing::warn!(%error, retry_in = ?delay, "waiting for the {what} before serving");
        tokio::select! {
            () = stop.cancelled() => {
                return Err(StartError::Invalid(format!("stopped while waiting for the {what}: {error}")));
            }
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(MAX_START_RETRY);
    }
}

/// Runs a binary: installs the ring crypto provider, starts the runtime and
/// telemetry, runs `body`, and turns an error into `<binary>: error: ...`
/// on stderr and exit code 1.
pub fn run_main<F, Fut>(binary: &'static str, telemetry: &TelemetryArgs, body: F) -> ExitCode
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), StartError>>,
{
    // A second install only fails when one is already there, which is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(error) => {
            eprintln!("{binary}: error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let mut config = berth_telemetry::TelemetryConfig::from_env(binary).map_err(StartError::Telemetry)?;
        config.log_format = telemetry.log_format.parse().map_err(StartError::Telemetry)?;
        config.otlp_endpoint = telemetry.otlp_endpoint.clone().filter(|e| !e.is_empty());
        if let Some(host) = host_name() {
            config.resource.push(("host.name".to_owned(), host));
        }
        config.resource.extend(telemetry.resource.iter().cloned());
        if let Some(filter) = telemetry.default_log_filter
            && std::env::var_os("RUST_LOG").is_none_or(|v| v.is_empty())
        {
            config.log_filter = filter.to_string();
        }
        let guard = berth_telemetry::init(&config).map_err(StartError::Telemetry)?;
        let result = body().await;
        // A leading loop resigns as it ends: the next replica takes over at
        // once instead of a leader TTL later. Only a body that ended well
        // stopped its loops; one that failed exits without waiting for them.
        if result.is_ok() && !crate::loops::wait_for_loops(crate::LOOPS_GRACE).await {
            tracing::warn!(grace = ?crate::LOOPS_GRACE, "exiting before every loop ended; a lead it held lapses after its ttl");
        }
        if let Err(error) = guard.shutdown_async().await {
            tracing::warn!(%error, "flushing traces at exit failed");
        }
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{binary}: error: {}", chain(&error));
            ExitCode::FAILURE
        }
    }
}

/// This host's name, for the `host.name` resource attribute: which machine
/// a span came from, as operators name it.
fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok().or_else(|| std::env::var("HOSTNAME").ok())?;
    Some(name.trim().to_owned()).filter(|name| !name.is_empty())
}

/// The error and its sources on one line, skipping sources whose text the
/// outer message already includes.
pub fn chain(error: &dyn std::error::Error) -> String {
    with_causes(error.to_string(), error.source())
}

/// `line`, then `source` and each of its sources after it, each once: a
/// cause whose text the line already includes is not repeated.
pub fn with_causes(mut line: String, mut source: Option<&(dyn std::error::Error + 'static)>) -> String {
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line
}
