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
        Ok(ServiceContext { store, bus, credentials, revocations: Revocations::new(), nodes: NodeDirectory::new() })
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

/// Everything a service binary does before it serves: loads the certificate
/// files (and watches them for changes), opens the state, follows identity's
/// node registry and renews its own certificate through identity when
/// `--identity-addr` is given, and binds `listen`.
pub async fn start_service(
    spec: ServiceSpec,
    listen: SocketAddr,
    tls: &TlsArgs,
    state: &StateArgs,
    mesh: &MeshArgs,
    shutdown: &CancellationToken,
) -> Result<Started, StartError> {
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

/// Runs a service binary whose spec builds its whole server: [`start_service`],
/// then serves until `shutdown`.
pub async fn run_service(
    spec: ServiceSpec,
    listen: SocketAddr,
    tls: &TlsArgs,
    state: &StateArgs,
    mesh: &MeshArgs,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    let started = start_service(spec, listen, tls, state, mesh, &shutdown).await?;
    spec.serve(&started.ctx, started.listener, shutdown).await
}

impl std::fmt::Display for ServiceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// The flags of a control-plane service binary.
#[derive(Debug, clap::Parser)]
struct ServiceArgs {
    /// Address to serve mTLS gRPC on.
    #[arg(long, env = "BERTH_LISTEN", value_name = "ADDR")]
    listen: SocketAddr,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    mesh: MeshArgs,
    #[command(flatten)]
    telemetry: crate::TelemetryArgs,
}

/// The whole `main` of a control-plane service binary: its flags (with
/// `default_listen` as `--listen`'s default), then [`run_service`] until
/// SIGTERM or Ctrl-C.
pub fn service_main(
    binary: &'static str,
    about: &'static str,
    default_listen: &'static str,
    spec: ServiceSpec,
) -> std::process::ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let command = ServiceArgs::command()
        .name(binary)
        .bin_name(binary)
        .about(about)
        .version(env!("CARGO_PKG_VERSION"))
        .mut_arg("listen", |arg| arg.default_value(default_listen).required(false));
    let args = match ServiceArgs::from_arg_matches(&command.get_matches()) {
        Ok(args) => args,
        Err(error) => error.exit(),
    };
    crate::run_main(binary, &args.telemetry, || async {
        let shutdown = berth_rpc::shutdown_signal();
        run_service(spec, args.listen, &args.tls, &args.state, &args.mesh, shutdown).await
    })
}
