//! What the tests of several service crates need alike, written once:
//! which backend a test runs on and its store and bus, certificates from a
//! test CA, a server on a loopback port, the node registry identity would
//! serve (scripted by the test), an in-process leases service following it
//! (alone, or as the base of a suite's control plane: [`LeasesMesh`]), the
//! workspace's binaries beside the one under test, and a host's join from
//! an address of its own ([`from_address`]), a project's upstream DNS
//! resolver ([`Resolver`]), and what a workload's cgroup holds
//! ([`cgroups`]).
//!
//! # Where it sits
//! A dev-dependency, and a dependency of `berth-bench`, which no image
//! ships. It sits above the services it starts (it links `berth-leases`),
//! which no library may; that is why nothing shipped depends on it, and why
//! no service crate's own code may.
//!
//! # Invariants
//! - Every store and bus is the test's own (a fresh database or SQLite
//!   file, a unique key prefix), removed when it is dropped.
//! - The scripted registry speaks identity's `Nodes/WatchNodes` over mTLS
//!   exactly: the whole list, `SYNCED`, then each change as `UPSERT` or
//!   `REMOVED`, so a service follows it on its production path.

#![allow(clippy::unwrap_used, reason = "a fixture that cannot be set up is a failed test, with its line")]

pub mod cgroups;
mod dial;
mod ports;
mod resolver;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_bus::{Bus, MemoryBus};
use berth_core::Identity;
use berth_leases::{LeasesConfig, LeasesService};
use berth_mtls::{CertificateAuthority, TlsCredentials, TlsMaterial};
use berth_proto::identity::v1 as identity;
use berth_proto::types::v1::EventKind;
use berth_rpc::{Listener, ServerBuilder};
use berth_runtime::{ServiceContext, ServiceReplica, follow_nodes};
use berth_store::testing::TestDb;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

pub use crate::dial::from_address;
pub use crate::ports::free_ports;
pub use crate::resolver::{RESOLVER_ANSWER, Resolver};

/// How long test certificates live.
pub const CERT_TTL: Duration = Duration::from_secs(3600);

/// How long a test waits for something that should happen within a second
/// or two: long enough for anything on a loaded two-core machine, and a
/// test that passes finishes far sooner.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// How often [`eventually`] looks again.
const POLL: Duration = Duration::from_millis(20);

/// Polls `check` until it answers `Ok`, and returns that. After `timeout`
/// the test fails, saying it was waiting for `what` and what `check` saw
/// last (its `Err`).
pub async fn eventually<T, Seen, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    Seen: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Seen>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match check().await {
            Ok(found) => return found,
            Err(seen) => {
                assert!(tokio::time::Instant::now() < deadline, "waited {timeout:?} for {what}; last saw {seen:#?}");
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Which store and bus a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// PostgreSQL and Redis: production.
    Postgres,
    /// SQLite and the in-process bus: `berth dev`.
    Sqlite,
}

/// Whether a test can run, `present` saying whether what it needs
/// (`what`: a tool, a module, root) is here: true when it is; false, after
/// saying the test skipped and checked nothing, when it is not; and a
/// failure under `CI=true`, where `make test` provides all of it and every
/// test must run.
pub fn needs(present: bool, what: &str) -> bool {
    if present {
        return true;
    }
    assert!(std::env::var("CI").as_deref() != Ok("true"), "this test needs {what}, and CI=true: make test provides it");
    eprintln!("SKIPPED: this test needs {what}; it checked nothing");
    false
}

/// Whether a test that needs root (`what` it needs it for) can run, as
/// [`needs`] says.
pub fn runs_as_root(what: &str) -> bool {
    needs(rustix::process::geteuid().is_root(), &format!("root for {what}"))
}

/// Installs the TLS crypto provider and, once per process, logs that
/// follow `RUST_LOG` into the test's output.
pub fn install_crypto_and_logs() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A database of the test's own on `backend`.
pub async fn test_db(backend: Backend) -> TestDb {
    match backend {
        Backend::Postgres => TestDb::postgres().await.unwrap(),
        Backend::Sqlite => TestDb::sqlite().await.unwrap(),
    }
}

/// A bus of the test's own on `backend` (a unique key prefix).
pub async fn test_bus(backend: Backend) -> Bus {
    match backend {
        Backend::Postgres => berth_bus::testing::redis_bus().await.unwrap(),
        Backend::Sqlite => Bus::new(MemoryBus::new(), &berth_bus::testing::unique_prefix()).unwrap(),
    }
}

/// Another connection to `bus`, with its prefix, as another replica's process has.
pub async fn replica_bus(backend: Backend, bus: &Bus) -> Bus {
    match backend {
        Backend::Postgres => Bus::connect(&berth_bus::testing::redis_url(), bus.prefix()).await.unwrap(),
        Backend::Sqlite => bus.with_prefix(bus.prefix()).unwrap(),
    }
}

/// Removes a bus's keys from Redis (the in-process bus goes with its process).
pub async fn cleanup_bus(backend: Backend, bus: &Bus) {
    if backend == Backend::Postgres {
        berth_bus::testing::cleanup(bus).await.unwrap();
    }
}

/// A certificate authority for one test.
pub fn test_ca(name: &str) -> CertificateAuthority {
    CertificateAuthority::generate(name, CERT_TTL).unwrap()
}

/// Credentials `ca` issues to `identity`, valid for loopback.
pub fn credentials(ca: &CertificateAuthority, identity: &Identity) -> TlsCredentials {
    let (cert, key_pem) = ca.issue(identity, &["localhost".to_owned(), "127.0.0.1".to_owned()], CERT_TTL).unwrap();
    TlsCredentials::new(TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem, ca_bundle_pem: ca.cert_pem().to_owned() })
        .unwrap()
}

/// Serves `server` with `credentials` on a free loopback port until `stop`.
pub async fn serve(server: ServerBuilder, credentials: TlsCredentials, stop: CancellationToken) -> SocketAddr {
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), credentials).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve(listener, stop).await.unwrap() });
    addr
}

/// One replica of a service under test: its loops, and its handlers served
/// on a free loopback port, until it is stopped.
#[derive(Debug)]
pub struct Replica<S> {
    /// The service, for tests that look behind the API.
    pub service: S,
    /// Where it serves.
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

impl<S: ServiceReplica> Replica<S> {
    /// Starts `service`'s loops and serves its handlers with `credentials`,
    /// both until `shutdown` (or [`Replica::kill`]).
    pub async fn start(service: S, credentials: TlsCredentials, shutdown: CancellationToken) -> Self {
        service.spawn_loops(&shutdown);
        let listener = Listener::bind("127.0.0.1:0".parse().unwrap(), credentials).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = service.server();
        let stop = shutdown.clone();
        let server = tokio::spawn(async move { server.serve(listener, stop).await.unwrap() });
        Self { service, addr, shutdown, server }
    }

    /// Stops its server and loops at once, as a crashed process would.
    pub fn kill(&self) {
        self.shutdown.cancel();
    }

    /// Stops it and waits (up to 15 s) for its server to end.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), self.server).await;
    }

    /// A channel to it, presenting `credentials`.
    pub fn channel(&self, credentials: TlsCredentials) -> berth_rpc::Channel {
        berth_rpc::connect(&self.addr.to_string(), credentials).unwrap()
    }
}

/// The node registry identity serves, as the test scripts it.
#[derive(Debug, Clone)]
pub struct ScriptedRegistry {
    nodes: watch::Sender<BTreeMap<String, identity::Node>>,
}

impl ScriptedRegistry {
    /// A registry listing `nodes`.
    pub fn new(nodes: impl IntoIterator<Item = identity::Node>) -> Self {
        let nodes = nodes.into_iter().map(|node| (node.node_id.clone(), node)).collect();
        Self { nodes: watch::channel(nodes).0 }
    }

    /// Serves `Nodes/WatchNodes` as identity, with certificates from `ca`, until `stop`.
    pub async fn serve(&self, ca: &CertificateAuthority, stop: CancellationToken) -> SocketAddr {
        let server = ServerBuilder::new().add_service(identity::nodes_server::NodesServer::new(self.clone()));
        serve(server, credentials(ca, &Identity::service("identity").unwrap()), stop).await
    }

    /// Adds `node`, or changes it.
    pub fn put(&self, node: identity::Node) {
        self.nodes.send_modify(|nodes| {
            nodes.insert(node.node_id.clone(), node);
        });
    }

    /// Takes `node_id` off the list.
    pub fn remove(&self, node_id: &str) {
        self.nodes.send_modify(|nodes| {
            nodes.remove(node_id);
        });
    }

    /// Every node listed now.
    pub fn nodes(&self) -> BTreeMap<String, identity::Node> {
        self.nodes.borrow().clone()
    }
}

#[tonic::async_trait]
impl identity::nodes_server::Nodes for ScriptedRegistry {
    async fn watch_nodes(
        &self,
        _request: tonic::Request<identity::WatchNodesRequest>,
    ) -> Result<tonic::Response<tonic::codegen::BoxStream<identity::NodeEvent>>, tonic::Status> {
        let mut nodes = self.nodes.subscribe();
        let (events, stream) = mpsc::channel(64);
        tokio::spawn(async move {
            let event =
                |kind: EventKind, node: Option<identity::Node>| Ok(identity::NodeEvent { kind: kind as i32, node });
            let mut sent = nodes.borrow_and_update().clone();
            for node in sent.values() {
                if events.send(event(EventKind::Upsert, Some(node.clone()))).await.is_err() {
                    return;
                }
            }
            if events.send(event(EventKind::Synced, None)).await.is_err() {
                return;
            }
            while nodes.changed().await.is_ok() {
                let now = nodes.borrow_and_update().clone();
                for (node_id, node) in &now {
                    if sent.get(node_id) != Some(node)
                        && events.send(event(EventKind::Upsert, Some(node.clone()))).await.is_err()
                    {
                        return;
                    }
                }
                for (node_id, node) in &sent {
                    if !now.contains_key(node_id)
                        && events.send(event(EventKind::Removed, Some(node.clone()))).await.is_err()
                    {
                        return;
                    }
                }
                sent = now;
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(stream))))
    }
}

/// One leases replica in this process, on a store and bus of its own,
/// following a node registry (scripted, or a real identity).
pub struct InProcessLeases {
    /// Where it serves.
    pub addr: SocketAddr,
    /// The service, for tests that look behind the API.
    pub service: LeasesService,
    db: TestDb,
    bus: Bus,
}

impl std::fmt::Debug for InProcessLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessLeases").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl InProcessLeases {
    /// Starts it with `config`, presenting `me` (a `leases` service
    /// certificate), following the registry at `registry` (`host:port`),
    /// until `stop`.
    pub async fn start(
        backend: Backend,
        me: TlsCredentials,
        registry: &str,
        config: LeasesConfig,
        stop: &CancellationToken,
    ) -> Self {
        let db = test_db(backend).await;
        db.store().migrate(berth_leases::MIGRATIONS).await.unwrap();
        let bus = test_bus(backend).await;
        let ctx = ServiceContext::new(db.store().clone(), bus.clone(), me.clone());
        follow_nodes(registry.to_owned(), me.clone(), ctx.nodes.clone(), ctx.revocations.clone(), stop.clone());
        let service = LeasesService::new(&ctx, config);
        service.spawn_loops(stop);
        let addr = serve(service.server(), me, stop.clone()).await;
        Self { addr, service, db, bus }
    }

    /// Its database, removed with it by [`InProcessLeases::cleanup`].
    pub fn db(&self) -> &TestDb {
        &self.db
    }

    /// Its bus.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Removes its database and, on Redis, its bus keys; stop it first.
    pub async fn cleanup(self, backend: Backend) {
        cleanup_bus(backend, &self.bus).await;
        self.db.cleanup().await.unwrap();
    }
}

/// Runs each named test body (an `async fn(Backend)`) on both backends,
/// each in its own test: `postgres::name` and `sqlite::name`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::Backend::Postgres).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::Backend::Sqlite).await;
                }
            )*
        }
    };
}

/// A ledger timed for tests: reaping, index and assignment resyncs in
/// fractions of a second, and a 900 ms lead.
pub fn fast_ledger() -> LeasesConfig {
    LeasesConfig {
        reap_every: Duration::from_millis(50),
        assignment_resync: Duration::from_millis(500),
        index_resync: Duration::from_millis(500),
        election: berth_store::ElectionTiming::from_ttl(Duration::from_millis(900)),
        ..LeasesConfig::default()
    }
}

/// The base of an in-process control plane: a test CA, a scripted node
/// registry knowing the suite's nodes, and a leases service following it,
/// which has seen every node UP. A suite starts the service it tests on top
/// (with [`LeasesMesh::credentials`]) and stops everything with
/// [`LeasesMesh::stop`].
#[derive(Debug)]
pub struct LeasesMesh {
    /// The CA every certificate here is signed by.
    pub ca: CertificateAuthority,
    /// Cancelled to stop every server and loop of the mesh.
    pub stop: CancellationToken,
    /// The node registry leases follows; changed by the test.
    pub registry: ScriptedRegistry,
    /// The leases service.
    pub leases: InProcessLeases,
    /// An admin's certificate (`alice`).
    pub admin: TlsCredentials,
}

impl LeasesMesh {
    /// Starts it on `backend` with `nodes` and the ledger `config`, naming
    /// its CA `ca_name`; returns once leases lists every node UP.
    pub async fn start(
        backend: Backend,
        ca_name: &str,
        nodes: impl IntoIterator<Item = identity::Node>,
        config: LeasesConfig,
    ) -> Self {
        install_crypto_and_logs();
        let ca = test_ca(ca_name);
        let stop = CancellationToken::new();
        let registry = ScriptedRegistry::new(nodes);
        let registry_addr = registry.serve(&ca, stop.clone()).await;
        let me = credentials(&ca, &Identity::service("leases").unwrap());
        let leases = InProcessLeases::start(backend, me, &registry_addr.to_string(), config, &stop).await;
        let admin = credentials(&ca, &Identity::admin("alice").unwrap());
        await_nodes_up(leases.addr, admin.clone(), registry.nodes().len()).await;
        Self { ca, stop, registry, leases, admin }
    }

    /// A certificate for `identity`, signed by the mesh's CA.
    pub fn credentials(&self, identity: &Identity) -> TlsCredentials {
        credentials(&self.ca, identity)
    }

    /// Where leases serves.
    pub fn leases_addr(&self) -> SocketAddr {
        self.leases.addr
    }

    /// Removes leases' database and bus keys; stop the mesh first.
    pub async fn cleanup(self, backend: Backend) {
        self.leases.cleanup(backend).await;
    }
}

/// Waits until the leases service at `leases` lists `expected` nodes UP,
/// asking as `admin`.
pub async fn await_nodes_up(leases: SocketAddr, admin: TlsCredentials, expected: usize) {
    use berth_proto::leases::v1 as api;
    let channel = berth_rpc::connect(&leases.to_string(), admin).unwrap();
    let capacity = api::capacity_client::CapacityClient::new(channel);
    eventually(&format!("leases to learn all {expected} nodes"), PATIENCE, || {
        let mut capacity = capacity.clone();
        async move {
            let known = capacity
                .list_node_capacity(api::ListNodeCapacityRequest::default())
                .await
                .map(|r| r.into_inner().nodes.iter().filter(|n| n.state == identity::NodeState::Up as i32).count())
                .unwrap_or_default();
            if known == expected { Ok(()) } else { Err(format!("{known} nodes UP")) }
        }
    })
    .await;
}

/// The binary `name`, of `package`, beside `beside` (a test's
/// `env!("CARGO_BIN_EXE_…")`).
///
/// A workspace test run (`make test`, `cargo nextest run --workspace`)
/// builds every package's binaries before any test starts, so they are
/// there; a test never runs cargo itself. Run alone (`cargo test -p …`), a
/// test fails naming what to build.
pub fn sibling(beside: &str, name: &str, package: &str) -> PathBuf {
    let beside = Path::new(beside);
    let binary = beside.with_file_name(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let release = beside.parent().and_then(Path::file_name).is_some_and(|profile| profile == "release");
    assert!(
        binary.is_file(),
        "{} is not built: a workspace test run builds it, or run `cargo build{} -p {package} --bin {name}` first",
        binary.display(),
        if release { " --release" } else { "" },
    );
    binary
}

/// Service binary `binary`'s flags `A`, checked for consistency, parsed
/// from the flags every such binary requires (its TLS material and a
/// database) followed by `flags`.
pub fn parse_service_flags<A: clap::Parser>(binary: &'static str, flags: &[&str]) -> Result<A, clap::Error> {
    A::command().debug_assert();
    let required = [binary, "--tls-cert", "c", "--tls-key", "k", "--ca-file", "a", "--database-url", "sqlite://x"];
    A::try_parse_from(required.into_iter().chain(flags.iter().copied()))
}
