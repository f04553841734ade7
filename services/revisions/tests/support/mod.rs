//! A running control plane for tests: a revisions replica and a real leases
//! replica, each on its own store and bus prefix, serving mTLS gRPC on
//! loopback ports, a scripted node registry, and clients: an admin, a
//! service, and node agents that report lease phases through the real
//! `NodeLeases` API with node certificates.
//!
//! # The node registry
//! Leases learns nodes only from identity's `Nodes/WatchNodes`; the tests
//! serve that one RPC themselves from a list they set, over mTLS like
//! identity, so the ledger runs its production path.
//!
//! `RUST_LOG=berth_revisions=debug` shows the replicas' logs.

#![allow(dead_code, reason = "each test binary uses a different part of the harness")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use berth_bundle::testing::TestRegistry;
use berth_bundle::{BundleClient, BundleReference, Digest, PackedBundle, RegistryConfig, RegistryCredentials};
use berth_bus::Bus;
use berth_core::Identity;
use berth_mtls::TlsCredentials;
use berth_proto::identity::v1 as identity;
use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::revisions::v1;
use berth_proto::types::v1::{BundleRef, Capacity, ConditionStatus};
use berth_revisions::{
    Dependencies, GrpcLeases, LeaseClient, RegistryPolicy, RegistrySecrets, RevisionsConfig, RevisionsService,
    TagResolver,
};
use berth_rpc::Channel;
use berth_runtime::ServiceContext;
use berth_store::ElectionTiming;
use berth_store::testing::TestDb;
pub(crate) use berth_testkit::Backend;
use berth_testkit::{LeasesMesh, PATIENCE, cleanup_bus, eventually, fast_ledger, replica_bus, test_bus, test_db};

/// A gibibyte.
pub(crate) const GIB: u64 = 1 << 30;

/// A digest no registry holds, for references pinned without a registry.
pub(crate) const PINNED: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// Loops in milliseconds.
pub(crate) fn fast_config() -> RevisionsConfig {
    RevisionsConfig {
        progress_deadline: Duration::from_secs(10),
        rollout_poll: Duration::from_millis(50),
        steady_resync: Duration::from_millis(300),
        full_resync: Duration::from_secs(1),
        resolve_backoff_min: Duration::from_millis(100),
        resolve_backoff_max: Duration::from_millis(400),
        resolve_timeout: Duration::from_secs(3),
        reconcile_timeout: Duration::from_secs(5),
        gc_keep: 5,
        gc_min_age: Duration::ZERO,
        workers: 4,
        watch_resync: Duration::from_secs(1),
        election: ElectionTiming::from_ttl(Duration::from_millis(900)),
        pull_credentials_ttl: Duration::from_secs(60),
        drain: Duration::from_millis(200),
    }
}

/// An UP node with room for many small replicas.
pub(crate) fn node(node_id: &str) -> identity::Node {
    identity::Node {
        node_id: node_id.to_owned(),
        state: NodeState::Up as i32,
        capacity: Some(Capacity { cpu_millis: 16_000, memory_bytes: 32 * GIB }),
        ..Default::default()
    }
}

/// One revisions replica serving on a loopback port.
pub(crate) type Replica = berth_testkit::Replica<RevisionsService>;

/// A control plane: revisions, leases, a scripted node registry, and clients.
pub(crate) struct Plane {
    pub(crate) backend: Backend,
    revisions_db: Option<TestDb>,
    /// The CA, the scripted node registry and leases.
    mesh: Option<LeasesMesh>,
    revisions_bus: Bus,
    pub(crate) replicas: Vec<Replica>,
    config: RevisionsConfig,
    resolver: Option<Arc<dyn TagResolver>>,
    secrets: RegistrySecrets,
    /// What each replica's leases client is wrapped in (a fault between
    /// revisions and leases).
    wrap_leases: Option<WrapLeases>,
}

/// Wraps a replica's client of the leases service.
pub(crate) type WrapLeases = Arc<dyn Fn(Arc<dyn LeaseClient>) -> Arc<dyn LeaseClient> + Send + Sync>;

impl Plane {
    /// Leases knowing `nodes`, and one revisions replica with `config`.
    pub(crate) async fn start(backend: Backend, config: RevisionsConfig, nodes: &[&str]) -> Self {
        Self::start_with(backend, config, nodes, None).await
    }

    /// Like [`Plane::start`], resolving tags with `resolver` instead of the registry client.
    pub(crate) async fn start_with(
        backend: Backend,
        config: RevisionsConfig,
        nodes: &[&str],
        resolver: Option<Arc<dyn TagResolver>>,
    ) -> Self {
        Self::start_full(backend, config, nodes, resolver, RegistrySecrets::none(), None).await
    }

    /// Like [`Plane::start`], each replica reaching leases through `wrap`.
    pub(crate) async fn start_wrapping_leases(
        backend: Backend,
        config: RevisionsConfig,
        nodes: &[&str],
        wrap: WrapLeases,
    ) -> Self {
        Self::start_full(backend, config, nodes, None, RegistrySecrets::none(), Some(wrap)).await
    }

    /// Like [`Plane::start`], with revisions holding the registry credentials `secrets`.
    pub(crate) async fn start_with_secrets(
        backend: Backend,
        config: RevisionsConfig,
        nodes: &[&str],
        secrets: RegistrySecrets,
    ) -> Self {
        Self::start_full(backend, config, nodes, None, secrets, None).await
    }

    async fn start_full(
        backend: Backend,
        config: RevisionsConfig,
        nodes: &[&str],
        resolver: Option<Arc<dyn TagResolver>>,
        secrets: RegistrySecrets,
        wrap_leases: Option<WrapLeases>,
    ) -> Self {
        let mesh = LeasesMesh::start(backend, "revisions test CA", nodes.iter().map(|n| node(n)), fast_ledger()).await;
        let revisions_db = test_db(backend).await;
        revisions_db.store().migrate(berth_revisions::MIGRATIONS).await.unwrap();
        let revisions_bus = test_bus(backend).await;
        let mut plane = Self {
            backend,
            revisions_db: Some(revisions_db),
            mesh: Some(mesh),
            revisions_bus,
            replicas: Vec::new(),
            config,
            resolver,
            secrets,
            wrap_leases,
        };
        plane.add_replica().await;
        plane
    }

    /// Starts another revisions replica on the same store and bus prefix.
    pub(crate) async fn add_replica(&mut self) -> usize {
        let db = self.revisions_db.as_ref().unwrap();
        let store = if self.replicas.is_empty() { db.store().clone() } else { db.connect().await.unwrap() };
        let bus = replica_bus(self.backend, &self.revisions_bus).await;
        let me = self.mesh().credentials(&Identity::service("revisions").unwrap());
        let ctx = ServiceContext::new(store, bus, me.clone());
        let mut leases: Arc<dyn LeaseClient> =
            Arc::new(GrpcLeases::connect(&self.leases_addr().to_string(), me.clone()).unwrap());
        if let Some(wrap) = &self.wrap_leases {
            leases = wrap(leases);
        }
        let mut dependencies =
            Dependencies::with_secrets(leases, RegistryPolicy::default(), self.secrets.clone(), &self.config).unwrap();
        if let Some(resolver) = &self.resolver {
            dependencies.resolver = resolver.clone();
        }
        let service = RevisionsService::new(&ctx, self.config.clone(), dependencies);
        let shutdown = self.mesh().stop.child_token();
        self.replicas.push(Replica::start(service, me, shutdown).await);
        self.replicas.len() - 1
    }

    /// The revisions store, for tests that look behind the API.
    pub(crate) fn store(&self) -> &berth_store::Store {
        self.revisions_db.as_ref().unwrap().store()
    }

    /// Stops replica `n`'s server and controller, as a crashed process would.
    pub(crate) fn stop_replica(&self, n: usize) {
        self.replicas[n].kill();
    }

    /// The CA, the node registry and leases.
    fn mesh(&self) -> &LeasesMesh {
        self.mesh.as_ref().unwrap()
    }

    /// Where leases serves.
    pub(crate) fn leases_addr(&self) -> SocketAddr {
        self.mesh().leases_addr()
    }

    fn leases_channel(&self, credentials: TlsCredentials) -> Channel {
        berth_rpc::connect(&self.leases_addr().to_string(), credentials).unwrap()
    }

    fn channel(&self, replica: usize, credentials: TlsCredentials) -> Channel {
        self.replicas[replica].channel(credentials)
    }

    /// `Services` as an admin, through replica 0.
    pub(crate) fn services(&self) -> v1::services_client::ServicesClient<Channel> {
        self.services_on(0)
    }

    /// `Services` as an admin, through `replica`.
    pub(crate) fn services_on(&self, replica: usize) -> v1::services_client::ServicesClient<Channel> {
        v1::services_client::ServicesClient::new(self.channel(replica, self.mesh().admin.clone()))
    }

    /// `Revisions` as an admin.
    pub(crate) fn revisions(&self) -> v1::revisions_client::RevisionsClient<Channel> {
        v1::revisions_client::RevisionsClient::new(self.channel(0, self.mesh().admin.clone()))
    }

    /// `Services` as node `node_id`, which the access layer should refuse for writes.
    pub(crate) fn services_as_node(&self, node_id: &str) -> v1::services_client::ServicesClient<Channel> {
        let node = self.mesh().credentials(&Identity::node(node_id).unwrap());
        v1::services_client::ServicesClient::new(self.channel(0, node))
    }

    /// `Services` as router `name`, with its own certificate.
    pub(crate) fn services_as_router(&self, name: &str) -> v1::services_client::ServicesClient<Channel> {
        let router = self.mesh().credentials(&Identity::router(name).unwrap());
        v1::services_client::ServicesClient::new(self.channel(0, router))
    }

    /// `Revisions` as node `node_id`, with its own certificate.
    pub(crate) fn revisions_as_node(&self, node_id: &str) -> v1::revisions_client::RevisionsClient<Channel> {
        let node = self.mesh().credentials(&Identity::node(node_id).unwrap());
        v1::revisions_client::RevisionsClient::new(self.channel(0, node))
    }

    /// `Leases` as an admin, to look at what revisions asked for.
    pub(crate) fn ledger(&self) -> leases::leases_client::LeasesClient<Channel> {
        leases::leases_client::LeasesClient::new(self.leases_channel(self.mesh().admin.clone()))
    }

    /// `NodeLeases` as node `node_id`, with its own certificate.
    pub(crate) fn node(&self, node_id: &str) -> leases::node_leases_client::NodeLeasesClient<Channel> {
        let node = self.mesh().credentials(&Identity::node(node_id).unwrap());
        leases::node_leases_client::NodeLeasesClient::new(self.leases_channel(node))
    }

    /// Moves `node_id` to `state` in the node registry leases follows.
    pub(crate) fn set_node_state(&self, node_id: &str, state: NodeState) {
        let registry = &self.mesh.as_ref().expect("the plane runs").registry;
        let mut node = registry.nodes().remove(node_id).expect("a node the plane started with");
        node.state = state as i32;
        registry.put(node);
    }

    /// Every lease of the default project, oldest first.
    pub(crate) async fn leases(&self) -> Vec<leases::Lease> {
        let request = leases::ListLeasesRequest::default();
        self.ledger().list_leases(request).await.unwrap().into_inner().leases
    }

    /// Open leases of `revision`.
    pub(crate) async fn open_leases(&self, revision: &str) -> Vec<leases::Lease> {
        self.leases()
            .await
            .into_iter()
            .filter(|l| l.workload.as_ref().is_some_and(|w| w.revision == revision))
            .filter(|l| {
                matches!(
                    l.phase(),
                    LeasePhase::Bound | LeasePhase::Launching | LeasePhase::Running | LeasePhase::Pending
                )
            })
            .collect()
    }

    /// Waits until `revision` has `count` open leases.
    pub(crate) async fn await_open_leases(&self, revision: &str, count: usize) -> Vec<leases::Lease> {
        eventually(&format!("{revision} to have {count} open leases"), PATIENCE, || async {
            let open = self.open_leases(revision).await;
            if open.len() == count { Ok(open) } else { Err(open) }
        })
        .await
    }

    /// Reports `phase` for every open lease of `revision` not already in it,
    /// each as its own node; how many were moved.
    pub(crate) async fn report_all(&self, revision: &str, phase: LeasePhase) -> usize {
        let mut moved = 0;
        for lease in self.open_leases(revision).await {
            if lease.phase() == phase {
                continue;
            }
            let request = leases::ReportPhaseRequest {
                node_id: lease.node_id.clone(),
                lease_id: lease.lease_id.clone(),
                epoch: lease.epoch,
                phase: phase as i32,
                reason: if phase == LeasePhase::Failed { "Exited".into() } else { String::new() },
                exit_code: (phase == LeasePhase::Failed).then_some(3),
                message: if phase == LeasePhase::Failed { "exited with status 3".into() } else { String::new() },
                ports: Vec::new(),
            };
            self.node(&lease.node_id).report_phase(request).await.unwrap();
            moved += 1;
        }
        moved
    }

    /// Waits for `revision`'s `count` leases and reports them all RUNNING.
    pub(crate) async fn run(&self, revision: &str, count: usize) -> Vec<leases::Lease> {
        let leases = self.await_open_leases(revision, count).await;
        self.report_all(revision, LeasePhase::Running).await;
        leases
    }

    /// Applies `request` as an admin.
    pub(crate) async fn apply(&self, request: v1::ApplyServiceRequest) -> v1::ApplyServiceResponse {
        self.services().apply_service(request).await.unwrap().into_inner()
    }

    /// The service as it is now.
    pub(crate) async fn get(&self, name: &str) -> v1::Service {
        let request = v1::GetServiceRequest { project: String::new(), name: name.to_owned() };
        self.services().get_service(request).await.unwrap().into_inner().service.unwrap()
    }

    /// Waits until `check` holds for the service, returning it.
    pub(crate) async fn await_service(
        &self,
        name: &str,
        what: &str,
        check: impl Fn(&v1::Service) -> bool,
    ) -> v1::Service {
        eventually(&format!("{name} to become {what}"), PATIENCE, || async {
            let service = self.get(name).await;
            if check(&service) { Ok(service) } else { Err(service) }
        })
        .await
    }

    /// Waits until `name`'s live revision is `revision` and all its replicas run.
    pub(crate) async fn await_live(&self, name: &str, revision: &str) -> v1::Service {
        self.await_service(name, &format!("live at {revision}"), |s| {
            let status = s.status.clone().unwrap_or_default();
            status.live_revision == revision
                && status.replicas_running == status.replicas_desired
                && condition(s, berth_revisions::READY).is_some_and(|c| c.status() == ConditionStatus::True)
        })
        .await
    }

    /// The service's revisions, newest first.
    pub(crate) async fn revision_names(&self, name: &str) -> Vec<String> {
        let request = v1::ListRevisionsRequest { project: String::new(), service: name.to_owned() };
        let revisions = self.revisions().list_revisions(request).await.unwrap().into_inner().revisions;
        revisions.into_iter().map(|r| r.name).collect()
    }

    /// One revision.
    pub(crate) async fn revision(&self, name: &str) -> v1::Revision {
        let request = v1::GetRevisionRequest { project: String::new(), name: name.to_owned() };
        self.revisions().get_revision(request).await.unwrap().into_inner().revision.unwrap()
    }

    /// Stops everything and drops the schemas or files and the bus keys.
    pub(crate) async fn cleanup(mut self) {
        self.mesh().stop.cancel();
        // Let the controllers resign and the servers drain.
        tokio::time::sleep(Duration::from_millis(200)).await;
        cleanup_bus(self.backend, &self.revisions_bus).await;
        if let Some(db) = self.revisions_db.take() {
            db.cleanup().await.unwrap();
        }
        if let Some(mesh) = self.mesh.take() {
            mesh.cleanup(self.backend).await;
        }
    }
}

/// The condition `kind` of a service, if it has one.
pub(crate) fn condition(service: &v1::Service, kind: &str) -> Option<berth_proto::types::v1::Condition> {
    service.status.as_ref()?.conditions.iter().find(|c| c.r#type == kind).cloned()
}

/// An apply of `name` running `reference` with `replicas` replicas and `env`.
pub(crate) fn apply_request(
    name: &str,
    reference: &str,
    replicas: u32,
    env: &[(&str, &str)],
) -> v1::ApplyServiceRequest {
    v1::ApplyServiceRequest {
        project: String::new(),
        name: name.to_owned(),
        template: Some(v1::ServiceTemplate {
            bundle: Some(BundleRef { reference: reference.to_owned(), ..Default::default() }),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            replicas: Some(replicas),
            resources: Some(Capacity { cpu_millis: 100, memory_bytes: 64 << 20 }),
            ports: vec![berth_proto::types::v1::Port { name: "http".into(), port: 8080 }],
            ..Default::default()
        }),
        source: Some(v1::Source { repo: "https://git.example.com/team/app".into(), ..Default::default() }),
    }
}

/// A reference pinned to [`PINNED`], which resolves without a registry.
pub(crate) fn pinned_reference() -> String {
    format!("127.0.0.1:1/team/app@{PINNED}")
}

/// Packs a small bundle whose data file says `marker` and pushes it to
/// `reference` in `registry`; its digest.
pub(crate) async fn push_bundle(registry: &TestRegistry, repository_and_tag: &str, marker: &str) -> Digest {
    push_bundle_as(registry, repository_and_tag, marker, &RegistryCredentials::Anonymous).await
}

/// Like [`push_bundle`], pushing with `credentials`.
pub(crate) async fn push_bundle_as(
    registry: &TestRegistry,
    repository_and_tag: &str,
    marker: &str,
    credentials: &RegistryCredentials,
) -> Digest {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("berth.toml"),
        "entrypoint = \"bin/app\"\n\n[[ports]]\nname = \"http\"\nport = 8080\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.path().join("bin")).unwrap();
    std::fs::write(dir.path().join("bin/app"), format!("#!/bin/sh\necho {marker}\n")).unwrap();
    let bundle = PackedBundle::from_dir(dir.path()).unwrap();
    let client = BundleClient::new(RegistryConfig::default()).unwrap();
    let reference = BundleReference::parse(&registry.reference(repository_and_tag)).unwrap();
    client.push(&bundle, &reference, credentials).await.unwrap()
}
