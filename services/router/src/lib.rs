//! berth-router: the data plane. It serves each service's live revision by
//! host name (`<service>.<project>.<domain>`), over HTTP/1.1 and HTTP/2, in
//! cleartext and over TLS (a certificate the operator gives it), and
//! reaches replicas only through the node agents' mTLS data-plane endpoint
//! (`berth.agent.v1.DataPlane`), as a router identity
//! (`<name>.router.berth.internal`).
//!
//! # Parts
//! - [`routes`]: the route table, a pure function of what is followed.
//! - `follow`: keeps it current by watch (services, leases, nodes).
//! - `proxy`: the public HTTP server and the tunnels through the agents.
//! - `acks`: tells revisions which route generation each service is served
//!   at, once no request is still answering from a revision it dropped.
//!
//! # Expected flow
//! [`start`] follows revisions, leases and identity, serves the public
//! listener, and serves gRPC health on its mTLS listener (so `berth health`
//! and probes work as for every service). A router holds no state of its
//! own: any number of replicas serve the same table, and a restarted one
//! rebuilds it from the watches.
//!
//! # Invariants
//! - No request waits for a route: until the sources have synced, every
//!   host is unknown (404) or has no replica (503, with `Retry-After`).
//! - Every byte to a replica passes through its agent over mTLS.
//! - A replica learns who called only from the router: a workload that
//!   presented its X.509-SVID over TLS (verified against the workload bundle
//!   the router follows from identity) is named to the callee in
//!   `X-Forwarded-Client-Cert` (`Hash=<sha-256 of its certificate>;URI=<its
//!   SPIFFE ID>`, as Envoy writes it); whatever a client sent in that header
//!   itself is dropped.

mod acks;
mod follow;
mod proxy;
pub mod routes;

pub use acks::host_instance;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_rpc::{Listener, Revocations, ServerBuilder};
use berth_runtime::{
    NodeDirectory, StartError, TelemetryArgs, TlsArgs, follow_nodes, follow_workload_bundle, renew_service_certificate,
};
use clap::Parser;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The name this service goes by in logs and traces.
pub const NAME: &str = "router";

/// The domain services are named under when none is given.
pub const DEFAULT_DOMAIN: &str = "berth.localhost";

/// The public HTTP port when none is given.
pub const DEFAULT_HTTP_PORT: u16 = 8080;

/// The mTLS gRPC port (health) when none is given.
pub const DEFAULT_PORT: u16 = 7449;

/// How long a replica may take to begin answering when no
/// `--response-timeout` is given: Knative's and Cloud Run's default.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(300);

/// Reads `--response-timeout` (`30s`, `5m`, …); for clap's `value_parser`.
/// Zero is refused: it would answer every request 504.
pub fn parse_response_timeout(text: &str) -> Result<Duration, String> {
    let timeout = berth_runtime::parse_duration(text)?;
    if timeout.is_zero() {
        return Err(format!("'{text}' would answer every request 504: give a duration above zero"));
    }
    Ok(timeout)
}

/// How often the router's certificate is checked for renewal.
const RENEW_EVERY: Duration = Duration::from_secs(60);

/// Where the router learns its routes, and what it serves them under.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Names are `<service>.<project>.<domain>`.
    pub domain: String,
    /// The identity service (`host:port`): the node registry.
    pub identity_addr: String,
    /// The revisions service: services and their live revisions.
    pub revisions_addr: String,
    /// The leases service: where each replica runs.
    pub leases_addr: String,
    /// The router's identity, which dials all three and every agent.
    pub credentials: TlsCredentials,
    /// Which replica of the router this is, among those sharing its
    /// identity (see [`host_instance`]).
    pub instance: String,
    /// How long a replica may take to begin its answer (status and
    /// headers) before the client is answered 504; a body streamed after
    /// that is not limited.
    pub response_timeout: Duration,
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// An address to dial is not usable.
    #[error("{what} address: {source}")]
    Address {
        /// Which flag.
        what: &'static str,
        /// Why.
        #[source]
        source: berth_rpc::ClientError,
    },
    /// Its serving threads could not be started.
    #[error("cannot start serving threads: {0}")]
    Threads(#[source] std::io::Error),
}

/// Where the router serves the public: cleartext, TLS, or both.
#[derive(Debug, Default)]
pub struct PublicListeners {
    /// HTTP/1.1 and HTTP/2 with prior knowledge.
    pub http: Option<TcpListener>,
    /// TLS, offering HTTP/2 and HTTP/1.1 by ALPN, with this configuration
    /// (see [`public_tls`]).
    pub https: Option<(TcpListener, PublicTls)>,
}

/// The TLS configuration of a public listener presenting `cert_chain_pem`
/// with `key_pem`: HTTP/2 then HTTP/1.1 offered, and a client certificate
/// asked for (never required) once the router trusts a workload bundle.
pub fn public_tls(cert_chain_pem: &str, key_pem: &str) -> Result<PublicTls, berth_mtls::MtlsError> {
    PublicTls::new(cert_chain_pem, key_pem)
}

/// What the public TLS listener presents, and the configuration built for
/// the workload bundle last seen; rebuilt when the bundle changes.
#[derive(Clone)]
pub struct PublicTls {
    cert_chain_pem: Arc<str>,
    key_pem: Arc<str>,
    built: Arc<std::sync::Mutex<Built>>,
}

/// The workload bundle a configuration was built for, and the configuration.
type Built = (Option<Arc<str>>, Arc<rustls::ServerConfig>);

impl std::fmt::Debug for PublicTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublicTls").finish_non_exhaustive()
    }
}

/// What the public listener offers by ALPN, preferred first.
const PUBLIC_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

impl PublicTls {
    fn new(cert_chain_pem: &str, key_pem: &str) -> Result<Self, berth_mtls::MtlsError> {
        let config = berth_mtls::public_server_config(cert_chain_pem, key_pem, &PUBLIC_ALPN, None)?;
        Ok(Self {
            cert_chain_pem: cert_chain_pem.into(),
            key_pem: key_pem.into(),
            built: Arc::new(std::sync::Mutex::new((None, config))),
        })
    }

    /// The acceptor for the next handshake, admitting SVIDs of
    /// `workload_bundle`; a bundle that cannot be used keeps the last one.
    /// The bundle is shared with the credentials, so the check made at every
    /// handshake is a pointer comparison until it changes.
    pub(crate) fn acceptor(&self, workload_bundle: Option<Arc<str>>) -> tokio_rustls::TlsAcceptor {
        let mut built = self.built.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if built.0 != workload_bundle {
            match berth_mtls::public_server_config(
                &self.cert_chain_pem,
                &self.key_pem,
                &PUBLIC_ALPN,
                workload_bundle.as_deref(),
            ) {
                Ok(config) => *built = (workload_bundle, config),
                Err(error) => tracing::warn!(%error, "cannot admit workload certificates from the new bundle"),
            }
        }
        tokio_rustls::TlsAcceptor::from(built.1.clone())
    }
}

/// A started router: what to wait for once it is told to stop.
#[derive(Debug)]
pub struct RouterHandle {
    connections: TaskTracker,
    shutdown: CancellationToken,
}

impl RouterHandle {
    /// Waits until the router is told to stop and the requests under way
    /// have finished (each connection gives them a grace of its own).
    pub async fn stopped(self) {
        self.shutdown.cancelled().await;
        self.connections.close();
        self.connections.wait().await;
    }
}

/// Starts following, and serving `public`, until `shutdown`.
pub fn start(
    config: RouterConfig,
    public: PublicListeners,
    shutdown: &CancellationToken,
) -> Result<RouterHandle, RouterError> {
    let dial = |what, addr: &str| {
        berth_rpc::connect(addr, config.credentials.clone()).map_err(|source| RouterError::Address { what, source })
    };
    let revisions = dial("revisions", &config.revisions_addr)?;
    let leases = dial("leases", &config.leases_addr)?;
    let nodes = NodeDirectory::new();
    follow_nodes(
        config.identity_addr.clone(),
        config.credentials.clone(),
        nodes.clone(),
        Revocations::new(),
        shutdown.clone(),
    );
    // Workloads calling through the public TLS listener present SVIDs.
    follow_workload_bundle(config.identity_addr.clone(), config.credentials.clone(), shutdown.clone());
    let shared = follow::Shared::new(&config.domain);
    follow::spawn(&shared, revisions.clone(), leases, nodes, shutdown);
    let inflight = acks::InFlight::new(shared.table());
    tokio::spawn(acks::acknowledge(inflight.clone(), revisions, config.instance, shutdown.clone()));
    let threads = berth_rpc::threads::ServingThreads::per_cpu("router").map_err(RouterError::Threads)?;
    let proxy = proxy::Proxies::new(threads, &shared.table(), &inflight, &config.credentials, config.response_timeout);
    proxy.let_go_of_unused(shutdown);
    let connections = TaskTracker::new();
    if let Some(http) = public.http {
        tracing::info!(addr = ?http.local_addr().ok(), domain = %config.domain, "router serving HTTP");
        tokio::spawn(proxy.clone().serve(http, None, connections.clone(), shutdown.clone()));
    }
    if let Some((https, tls)) = public.https {
        tracing::info!(addr = ?https.local_addr().ok(), domain = %config.domain, "router serving HTTPS");
        tokio::spawn(proxy.serve(https, Some(tls), connections.clone(), shutdown.clone()));
    }
    Ok(RouterHandle { connections, shutdown: shutdown.clone() })
}

/// The berth data-plane router: serves each service by host name, through
/// the node agents.
#[derive(Debug, Parser)]
#[command(name = "berth-router", version)]
struct Args {
    /// Address to serve mTLS gRPC (health) on.
    #[arg(long, env = "BERTH_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)))]
    listen: SocketAddr,
    /// Address to serve HTTP/1.1 and HTTP/2 (cleartext) on, for everyone.
    #[arg(long, env = "BERTH_HTTP_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_HTTP_PORT)))]
    http_listen: SocketAddr,
    /// Address to serve HTTPS on (HTTP/2 and HTTP/1.1 by ALPN), with
    /// --https-cert and --https-key; unset, no HTTPS.
    #[arg(long, env = "BERTH_HTTPS_LISTEN", requires_all = ["https_cert", "https_key"])]
    https_listen: Option<SocketAddr>,
    /// PEM certificate chain the public HTTPS listener presents (leaf first),
    /// e.g. a wildcard for `*.<project>.<DOMAIN>`.
    #[arg(long, env = "BERTH_HTTPS_CERT", value_name = "FILE", requires = "https_listen")]
    https_cert: Option<std::path::PathBuf>,
    /// PEM private key of --https-cert.
    #[arg(long, env = "BERTH_HTTPS_KEY", value_name = "FILE", requires = "https_listen")]
    https_key: Option<std::path::PathBuf>,
    /// Services answer at `<service>.<project>.<DOMAIN>`.
    #[arg(long, env = "BERTH_DOMAIN", default_value = DEFAULT_DOMAIN, value_name = "DOMAIN")]
    domain: String,
    /// The identity service (`host:port`), followed for the nodes.
    #[arg(long, env = "BERTH_IDENTITY_ADDR", value_name = "HOST:PORT")]
    identity_addr: String,
    /// The revisions service (`host:port`), followed for the services.
    #[arg(long, env = "BERTH_REVISIONS_ADDR", value_name = "HOST:PORT")]
    revisions_addr: String,
    /// The leases service (`host:port`), followed for the replicas.
    #[arg(long, env = "BERTH_LEASES_ADDR", value_name = "HOST:PORT")]
    leases_addr: String,
    /// Which replica of this router it is, told apart from others sharing
    /// its certificate when they acknowledge routes; the host name if unset.
    #[arg(long, env = "BERTH_INSTANCE", value_name = "NAME")]
    instance: Option<String>,
    /// How long a replica may take to begin answering a request (its status
    /// and headers) before the router answers 504 Gateway Timeout; a body
    /// streamed after that is not limited.
    #[arg(long, env = "BERTH_RESPONSE_TIMEOUT", value_name = "DURATION", default_value = "5m",
          value_parser = parse_response_timeout)]
    response_timeout: Duration,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

/// Parses the flags and serves until SIGTERM or Ctrl-C.
pub fn binary_main() -> ExitCode {
    let args = Args::parse();
    let telemetry = args.telemetry.clone();
    berth_runtime::run_main("berth-router", &telemetry, || run(args))
}

async fn run(args: Args) -> Result<(), StartError> {
    let shutdown = berth_rpc::shutdown_signal();
    let credentials = args.tls.load()?;
    let domain = args.domain.trim().trim_matches('.').to_ascii_lowercase();
    if domain.is_empty() {
        return Err(StartError::Invalid("--domain: a domain to name services under is required".into()));
    }
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr).await.map_err(|source| StartError::Bind { addr, source })
    };
    let https = match (args.https_listen, &args.https_cert, &args.https_key) {
        (Some(addr), Some(cert), Some(key)) => {
            let read = |path: &std::path::Path| {
                std::fs::read_to_string(path).map_err(|source| StartError::Io {
                    what: "cannot read",
                    path: path.display().to_string(),
                    source,
                })
            };
            let tls = public_tls(&read(cert)?, &read(key)?).map_err(StartError::Tls)?;
            Some((bind(addr).await?, tls))
        }
        _ => None,
    };
    let public = PublicListeners { http: Some(bind(args.http_listen).await?), https };
    let config = RouterConfig {
        domain,
        identity_addr: args.identity_addr.clone(),
        revisions_addr: args.revisions_addr,
        leases_addr: args.leases_addr,
        credentials: credentials.clone(),
        instance: args.instance.unwrap_or_else(host_instance),
        response_timeout: args.response_timeout,
    };
    let router = start(config, public, &shutdown).map_err(|e| StartError::Invalid(e.to_string()))?;
    renew_service_certificate(args.tls, credentials.clone(), args.identity_addr, RENEW_EVERY, shutdown.clone());
    let listener = Listener::bind(args.listen, credentials)
        .await
        .map_err(|source| StartError::Bind { addr: args.listen, source })?;
    ServerBuilder::new().serve(listener, shutdown).await?;
    router.stopped().await;
    Ok(())
}
