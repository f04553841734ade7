//! Running one control-plane service: everything between parsed flags and
//! a serving mTLS listener. `berth dev` uses the same steps with its own
//! credentials and embedded state.

use std::net::SocketAddr;
use std::sync::Arc;

use berth_bus::Bus;
use berth_mtls::TlsCredentials;
use berth_rpc::{Listener, ReadinessProbe, Revocations, ServerBuilder};
use berth_store::{Migration, Store};
use tokio_util::sync::CancellationToken;

use crate::reload::{CERT_POLL_INTERVAL, watch_cert_files};
use crate::{MeshArgs, NodeDirectory, StartError, StateArgs, TlsArgs, follow_nodes, wait_for_bus, wait_for_store};

/// What a control-plane service declares about itself.
#[derive(Debug, Clone, Copy)]
pub struct ServiceSpec {
    /// Its name: the Postgres schema, the bus key prefix and the `svc` SAN.
    pub name: &'static str,
    /// Its schema migrations, oldest first.
    pub migrations: &'static [Migration],
    /// Builds its gRPC services over its state.
    pub build: fn(&ServiceContext) -> ServerBuilder,
}

/// The state a service's handlers share.
#[derive(Debug, Clone)]
pub struct ServiceContext {
    /// Its own schema.
    pub store: Store,
    /// Its own key prefix on the bus.
    pub bus: Bus,
    /// The credentials it serves and dials with.
    pub credentials: TlsCredentials,
    /// The nodes it refuses.
    pub revocations: Revocations,
    /// Identity's node registry, as followed (empty when no identity is configured).
    pub nodes: NodeDirectory,
}

impl ServiceContext {
    /// A context over `store` and `bus` that dials with `credentials`, refusing
    /// no node yet and knowing none of identity's (a service that follows
    /// identity fills both in as it learns them).
    pub fn new(store: Store, bus: Bus, credentials: TlsCredentials) -> Self {
        Self { store, bus, credentials, revocations: Revocations::new(), nodes: NodeDirectory::new() }
    }

    /// Readiness for the service's server (see [`store_readiness`]).
    pub fn readiness(&self) -> ReadinessProbe {
        store_readiness(&self.store)
    }
}

/// Readiness for a service's server: a round trip to its store, the truth
/// it cannot answer without. The bus is left out on purpose: losing Redis
/// slows a service down but loses nothing, so it stays serving.
pub fn store_readiness(store: &Store) -> ReadinessProbe {
    let store = store.clone();
    Arc::new(move || {
        let store = store.clone();
        Box::pin(async move { store.ping().await.map_err(|e| format!("database {}: {e}", store.target())) })
    })
}

impl ServiceSpec {
    /// Opens the service's store (migrated) and bus, waiting for either
    /// while it cannot be reached, until `stop`.
    pub async fn open(
        &self,
        state: &StateArgs,
        credentials: TlsCredentials,
        stop: &CancellationToken,
    ) -> Result<ServiceContext, StartError> {
        let store = wait_for_store(&state.database_url, self.name, self.migrations, stop).await?;
        let bus = wait_for_bus(&state.redis_url, self.name, stop).await?;
        Ok(ServiceContext::new(store, bus, credentials))
    }

    /// Serves the service on `listener` until `shutdown`.
    pub async fn serve(
        &self,
        ctx: &ServiceContext,
        listener: Listener,
        shutdown: CancellationToken,
    ) -> Result<(), StartError> {
        let addr = listener.local_addr().ok();
        let server = (self.build)(ctx).with_revocations(ctx.revocations.clone()).with_readiness(ctx.readiness());
        tracing::info!(service = self.name, addr = ?addr, "serving");
        server.serve(listener, shutdown).await?;
        tracing::info!(service = self.name, "stopped");
        Ok(())
    }
}

/// Binds `addr` with `credentials`, naming the address on failure.
pub async fn bind(addr: SocketAddr, credentials: TlsCredentials) -> Result<Listener, StartError> {
    Listener::bind(addr, credentials).await.map_err(|source| StartError::Bind { addr, source })
}

/// A service binary ready to serve: its state, its bound listener, and the
/// credentials it dials the rest of the mesh with.
#[derive(Debug)]
pub struct Started {
    /// Its store, bus, credentials and the node registry it follows.
    pub ctx: ServiceContext,
    /// The mTLS listener on `--listen`.
    pub listener: Listener,
    /// Its certificate, renewed from the files as they change.
    pub credentials: TlsCredentials,
}

/// The flags every control-plane service binary takes beside `--listen`
/// (whose default is the binary's own port): its certificate files, its
/// state, the mesh it follows and its telemetry. A binary flattens them into
/// its own flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceFlags {
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub state: StateArgs,
    #[command(flatten)]
    pub mesh: MeshArgs,
    #[command(flatten)]
    pub telemetry: crate::TelemetryArgs,
}

/// Everything a service binary does before it serves: loads the certificate
/// files (and watches them for changes), opens the state, follows identity's
/// node registry and workload bundle and renews its own certificate through identity when
/// `--identity-addr` is given, and binds `listen`.
pub async fn start_service(
    spec: ServiceSpec,
    listen: SocketAddr,
    flags: &ServiceFlags,
    shutdown: &CancellationToken,
) -> Result<Started, StartError> {
    let ServiceFlags { tls, state, mesh, .. } = flags;
    let credentials = tls.load()?;
    let ctx = spec.open(state, credentials.clone(), shutdown).await?;
    if let Some(identity) = &mesh.identity_addr {
        follow_nodes(
            identity.clone(),
            credentials.clone(),
            ctx.nodes.clone(),
            ctx.revocations.clone(),
            shutdown.clone(),
        );
        // Workloads holding their SVIDs are callers too (caller kind WORKLOAD).
        crate::follow_workload_bundle(identity.clone(), credentials.clone(), shutdown.clone());
    }
    let listener = bind(listen, credentials.clone()).await?;
    watch_cert_files(tls.clone(), credentials.clone(), CERT_POLL_INTERVAL, shutdown.clone());
    if let Some(identity) = &mesh.identity_addr {
        // Its certificate renews itself through identity past half its life.
        crate::renew_service_certificate(
            tls.clone(),
            credentials.clone(),
            identity.clone(),
            crate::RENEW_CHECK_INTERVAL,
            shutdown.clone(),
        );
    }
    Ok(Started { ctx, listener, credentials })
}

/// One replica of a control-plane service, as its binary runs it.
pub trait ServiceReplica {
    /// Its name among the service's replicas, as it campaigns for its loops.
    fn replica_id(&self) -> &str;
    /// Every gRPC service it serves, refusing revoked nodes.
    fn server(&self) -> ServerBuilder;
    /// Starts its loops until `shutdown`; only the first call starts anything.
    fn spawn_loops(&self, shutdown: &CancellationToken);
    /// Where it holds its loops when nothing else stops them: a field its
    /// clones share.
    fn held_loops(&mut self) -> &mut HeldLoops;

    /// Its server, with its loops running until every handle on the replica
    /// (the server's included) is dropped: for callers that only hand out a
    /// [`ServerBuilder`].
    fn server_holding_its_loops(mut self) -> ServerBuilder
    where
        Self: Sized,
    {
        let token = CancellationToken::new();
        self.spawn_loops(&token);
        *self.held_loops() = HeldLoops { _guard: Some(Arc::new(token.drop_guard())) };
        self.server()
    }
}

/// A replica's loops held for as long as any clone of the replica lives;
/// none by default (its binary stops them through its shutdown token).
#[derive(Debug, Clone, Default)]
pub struct HeldLoops {
    /// Dropped with the last clone, which stops the loops.
    _guard: Option<Arc<tokio_util::sync::DropGuard>>,
}

/// A replica's gRPC services over `$replica` (cloned into each), every
/// request bounded to `$limit` bytes, refusing the nodes in `$revocations`.
#[macro_export]
macro_rules! replica_server {
    ($replica:expr, $revocations:expr, $limit:expr, [$($server:ty),+ $(,)?]) => {
        $crate::ServerBuilder::new()
            .with_revocations($revocations.clone())
            $(.add_service(<$server>::new($replica.clone()).max_decoding_message_size($limit)))+
    };
}

/// The rest of a service binary once its replica is built: starts the
/// replica's loops and serves it on `started`'s listener, ready while its
/// store answers, until `shutdown`.
pub async fn serve_replica(
    spec: ServiceSpec,
    replica: &impl ServiceReplica,
    started: Started,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    replica.spawn_loops(&shutdown);
    let addr = started.listener.local_addr().ok();
    tracing::info!(service = spec.name, ?addr, replica = replica.replica_id(), "serving");
    replica.server().with_readiness(started.ctx.readiness()).serve(started.listener, shutdown).await?;
    Ok(())
}

impl std::fmt::Display for ServiceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}
