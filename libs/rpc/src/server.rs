//! The server bootstrap every berth service uses: its tonic services behind
//! the access layer, plus `grpc.health.v1` and reflection (v1 and v1alpha),
//! on an mTLS [`Listener`], until shutdown.
//!
//! # Connections
//! Each connection is served by hyper's HTTP/2 server directly rather than
//! through tonic's `Server`, whose builder does not reach two settings that
//! matter when one identity replica holds a connection per node for the
//! node's whole life: no `date` header (gRPC does not use it, and a value
//! that changes every second churned each connection's HPACK table, about
//! 6 KiB per connection) and the size of the header table a caller may fill.
//! What tonic's loop did besides is kept: the caller's [`PeerInfo`](crate::PeerInfo) in every
//! request's extensions, HTTP/2 keepalive pings, caller deadlines
//! (`grpc-timeout`, see [`crate::deadline`]), and a graceful drain. Added:
//! a connection whose peer's certificate expired is told (GOAWAY) to start
//! no new call and closed [`EXPIRED_GRACE`](crate::EXPIRED_GRACE) later, so
//! an identity lasts as long as its certificate, not its connection (a
//! client that renewed dials again with its new one).
//!
//! # Shutdown
//! When the token is cancelled the health service turns `NOT_SERVING`, the
//! listener stops accepting, and in-flight calls get [`DRAIN_TIMEOUT`] to
//! finish; long-lived streams should watch the same token and end.
//!
//! # Readiness
//! A server may carry a readiness probe (a service's round trip to its
//! database): it runs every [`READINESS_INTERVAL`] with a
//! [`READINESS_TIMEOUT`], and health follows it, `NOT_SERVING` while it
//! fails and `SERVING` again once it passes, without a restart, so a load
//! balancer or kubelet steers calls away from a replica whose truth is out
//! of reach. A server without a probe is serving for its whole life.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tower::ServiceExt as _;

use crate::access::{AccessLayer, AccessPolicy};
use crate::deadline::DeadlineLayer;
use crate::listener::Listener;
use crate::revocations::Revocations;
use crate::threads::ServingThreads;

/// The largest request message a berth server decodes; services pass it to
/// each generated server's `max_decoding_message_size`.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// How long in-flight calls may run on after shutdown begins.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How often an idle HTTP/2 connection is pinged, so dead peers are noticed.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);

/// The most a caller may store in a connection's HPACK decoder table. A
/// berth client's stable headers (path, authority, content type, user
/// agent) take about 300 bytes of it; per-call values are sent unindexed
/// (see `client.rs`), so a smaller table than HTTP/2's 4 KiB default costs
/// no re-sent bytes and bounds what each connection keeps.
const HEADER_TABLE_BYTES: u32 = 1024;

/// How often a server's readiness probe runs.
pub const READINESS_INTERVAL: Duration = Duration::from_secs(1);

/// How long one readiness probe may take before it counts as failed.
pub const READINESS_TIMEOUT: Duration = Duration::from_secs(1);

/// A readiness check: `Err` names what is unreachable.
pub type ReadinessProbe =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync + 'static>;

/// Why a server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The reflection service could not read the descriptor sets.
    #[error("reflection setup failed: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// Its serving threads could not be started.
    #[error("cannot start serving threads: {0}")]
    Threads(#[from] std::io::Error),
}

/// The health of every service one server serves, flipped together.
#[derive(Clone)]
pub struct ServingHealth {
    reporter: HealthReporter,
    services: Vec<&'static str>,
}

impl std::fmt::Debug for ServingHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingHealth").field("services", &self.services).finish()
    }
}

impl ServingHealth {
    /// Reports every service, and the server as a whole (`""`), as serving or not.
    pub async fn set(&self, serving: bool) {
        let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
        self.reporter.set_service_status("", status).await;
        for name in &self.services {
            self.reporter.set_service_status(*name, status).await;
        }
    }
}

/// Collects a process's gRPC services, then serves them.
pub struct ServerBuilder {
    routes: RoutesBuilder,
    services: Vec<&'static str>,
    policy: AccessPolicy,
    revocations: Revocations,
    reporter: HealthReporter,
    health_service: tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>,
    readiness: Option<ReadinessProbe>,
    threads: Option<Arc<ServingThreads>>,
    max_streams: Option<u32>,
}

impl std::fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerBuilder").field("services", &self.services).finish()
    }
}

impl Default for ServerBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerBuilder {
    /// An empty server enforcing the berth access policy.
    pub fn new() -> Self {
        let reporter = HealthReporter::new();
        let health_service = tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(reporter.clone()),
        );
        Self {
            routes: RoutesBuilder::default(),
            services: Vec::new(),
            policy: AccessPolicy::berth(),
            revocations: Revocations::new(),
            reporter,
            health_service,
            readiness: None,
            threads: None,
            max_streams: None,
        }
    }

    /// Replaces the access policy (for servers outside the berth API).
    pub fn with_policy(mut self, policy: AccessPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Refuses the nodes in `revocations` on every RPC.
    pub fn with_revocations(mut self, revocations: Revocations) -> Self {
        self.revocations = revocations;
        self
    }

    /// Reports `NOT_SERVING` while `probe` fails (see the module docs).
    pub fn with_readiness(mut self, probe: ReadinessProbe) -> Self {
        self.readiness = Some(probe);
        self
    }

    /// Serves each connection on one of `threads` (dealt in turn) rather
    /// than on the calling runtime: for a server whose calls are a
    /// host's traffic (see [`crate::threads`]). Its handlers then run on
    /// single-threaded runtimes, so none may block.
    pub fn with_serving_threads(mut self, threads: Arc<ServingThreads>) -> Self {
        self.threads = Some(threads);
        self
    }

    /// Lets each connection hold at most `streams` calls open at once (no
    /// limit by default, as tonic's server): for a server whose callers hold
    /// a stream per unit of their traffic, so that one caller cannot hold
    /// open without bound what each stream costs the server. A caller past
    /// the limit waits for one of its calls to end (its HTTP/2 client holds
    /// the new one back).
    pub fn with_max_streams(mut self, streams: u32) -> Self {
        self.max_streams = Some(streams);
        self
    }

    /// Adds a tonic service; it is listed by reflection and reported by health.
    pub fn add_service<S>(mut self, svc: S) -> Self
    where
        S: tower_service::Service<
                http::Request<tonic::body::Body>,
                Response = http::Response<tonic::body::Body>,
                Error = Infallible,
            > + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.services.push(S::NAME);
        self.routes.add_service(svc);
        self
    }

    /// The health handle, to report `NOT_SERVING` while a dependency is down.
    pub fn health(&self) -> ServingHealth {
        ServingHealth { reporter: self.reporter.clone(), services: self.services.clone() }
    }

    /// Reflection listing exactly the services this server serves.
    fn reflection(&self) -> tonic_reflection::server::Builder<'static> {
        let mut reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(berth_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("grpc.health.v1.Health")
            .with_service_name("grpc.reflection.v1.ServerReflection")
            .with_service_name("grpc.reflection.v1alpha.ServerReflection");
        for name in &self.services {
            reflection = reflection.with_service_name(*name);
        }
        reflection
    }

    /// Serves on `listener` until `shutdown` is cancelled, then drains.
    pub async fn serve(mut self, listener: Listener, shutdown: CancellationToken) -> Result<(), RpcError> {
        let health = self.health();
        health.set(true).await;
        if let Some(probe) = self.readiness.take() {
            tokio::spawn(follow_readiness(probe, health.clone(), shutdown.clone()));
        }

        // grpcurl 1.8 speaks only v1alpha; newer clients prefer v1.
        let v1 = self.reflection().build_v1()?;
        let v1alpha = self.reflection().build_v1alpha()?;

        let mut routes = self.routes;
        routes.add_service(self.health_service).add_service(v1).add_service(v1alpha);

        let service = tower::ServiceBuilder::new()
            .layer(berth_telemetry::ServerTraceLayer::default())
            .layer(AccessLayer::new(self.policy, self.revocations.clone()))
            .layer(DeadlineLayer)
            .service(routes.routes());

        let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEPALIVE_INTERVAL)
            .header_table_size(HEADER_TABLE_BYTES)
            .auto_date_header(false)
            // Unless the server sets one, no cap: as tonic's server, not
            // hyper's own (200), which would queue a busy control-plane
            // client's calls on its connection.
            .max_concurrent_streams(self.max_streams);

        let connections = TaskTracker::new();
        let threads = self.threads.take();
        let mut incoming = listener.incoming(shutdown.child_token(), threads.clone());
        loop {
            let stream = tokio::select! {
                () = shutdown.cancelled() => break,
                next = incoming.next() => match next {
                    Some(stream) => stream,
                    None => break,
                },
            };
            let info = stream.info().clone();
            let thread = stream.thread();
            let (expires_at, peer, remote_addr) = (info.expires_at, info.identity.clone(), info.remote_addr);
            let service = service.clone();
            let calls = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let mut req = req.map(tonic::body::Body::new);
                req.extensions_mut().insert(info.clone());
                service.clone().oneshot(req)
            });
            // Boxed before it moves into the task: a value captured by an
            // async block and then pinned inside it takes room twice in the
            // task (once as the capture, once as the pinned local), and this
            // one is the connection's whole TLS and HTTP/2 state, held for
            // as long as the peer stays connected.
            let mut connection = Box::pin(http2.serve_connection(TokioIo::new(stream), calls));
            let shutdown = shutdown.clone();
            let serving = connections.track_future(async move {
                let expired = crate::listener::certificate_expired(expires_at);
                tokio::pin!(expired);
                let served = tokio::select! {
                    served = &mut connection => served,
                    () = shutdown.cancelled() => {
                        // GOAWAY: calls in flight finish, no new ones start.
                        connection.as_mut().graceful_shutdown();
                        connection.await
                    }
                    () = &mut expired => {
                        let peer = peer.as_ref().map_or_else(|| "a peer".to_string(), ToString::to_string);
                        tracing::info!(%peer, %remote_addr, "its certificate expired; closing its connection");
                        connection.as_mut().graceful_shutdown();
                        match tokio::time::timeout(crate::listener::EXPIRED_GRACE, &mut connection).await {
                            Ok(served) => served,
                            Err(_) => Ok(()),
                        }
                    }
                };
                if let Err(error) = served {
                    tracing::debug!(%error, "connection ended with an error");
                }
            });
            match (&threads, thread) {
                (Some(threads), Some(thread)) => drop(threads.spawn(thread, serving)),
                _ => drop(tokio::spawn(serving)),
            }
        }
        drop(incoming);
        health.set(false).await;
        connections.close();
        if tokio::time::timeout(DRAIN_TIMEOUT, connections.wait()).await.is_err() {
            tracing::warn!(timeout = ?DRAIN_TIMEOUT, "calls still in flight after the drain timeout; closing");
        }
        Ok(())
    }
}

/// Runs `probe` until `shutdown`, flipping `health` on each change and
/// logging it once per change rather than once per probe.
async fn follow_readiness(probe: ReadinessProbe, health: ServingHealth, shutdown: CancellationToken) {
    let mut serving = true;
    let mut ticks = tokio::time::interval(READINESS_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let outcome = match tokio::time::timeout(READINESS_TIMEOUT, probe()).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("no answer within {READINESS_TIMEOUT:?}")),
        };
        if shutdown.is_cancelled() {
            return;
        }
        match outcome {
            Ok(()) if !serving => {
                tracing::info!("readiness restored; serving");
                serving = true;
                health.set(true).await;
            }
            Err(error) if serving => {
                tracing::warn!(%error, "not ready; health reports NOT_SERVING until it recovers");
                serving = false;
                health.set(false).await;
            }
            _ => {}
        }
    }
}

/// A token cancelled on SIGTERM or Ctrl-C.
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(error) => {
                    tracing::warn!(%error, "cannot listen for SIGTERM; only Ctrl-C stops this process");
                    let _ = ctrl_c.await;
                    fire.cancel();
                    return;
                }
            };
            tokio::select! {
                _ = ctrl_c => tracing::info!("interrupted; shutting down"),
                _ = term.recv() => tracing::info!("terminated; shutting down"),
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
        fire.cancel();
    });
    token
}
