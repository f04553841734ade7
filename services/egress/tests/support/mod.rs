//! A running mesh for egress tests: a real leases replica and a real
//! revisions replica (each on its own store and bus prefix), one or more
//! egress replicas following them, all serving mTLS gRPC on loopback ports,
//! a scripted node registry, and clients: an admin, and nodes with their own
//! certificates.
//!
//! # Placement
//! Each node is alone in its tier (`t-<node>`), so a test puts a tenant's
//! workload on a node by asking leases, as an admin, for a lease in that
//! tier. Services are applied through revisions with zero replicas, so
//! revisions asks for no lease of its own and placement is the test's alone.
//!
//! `RUST_LOG=berth_egress=debug` shows the replicas' logs.

#![allow(dead_code, reason = "each test binary uses a different part of the harness")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use berth_bus::Bus;
use berth_core::Identity;
use berth_egress::{EgressConfig, EgressService, Sources};
use berth_leases::LeasesConfig;
use berth_mtls::TlsCredentials;
use berth_proto::egress::v1 as egress;
use berth_proto::identity::v1 as identity;
use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1 as leases;
use berth_proto::revisions::v1 as revisions;
use berth_proto::types::v1::{BundleRef, Capacity};
use berth_revisions::{Dependencies, GrpcLeases, RegistryPolicy, RevisionsConfig, RevisionsService};
use berth_rpc::Channel;
use berth_runtime::{ServiceContext, ServiceReplica as _};
use berth_store::ElectionTiming;
use berth_store::testing::TestDb;
pub(crate) use berth_testkit::Backend;
use berth_testkit::{
    LeasesMesh, PATIENCE, cleanup_bus, eventually, fast_ledger, replica_bus, serve, test_bus, test_db,
};

/// A digest no registry holds: references pinned to it resolve without a registry.
const PINNED: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// Egress timings in milliseconds, with no periodic resync to blur what a test counts.
pub(crate) fn fast_config() -> EgressConfig {
    EgressConfig {
        debounce: Duration::from_millis(50),
        max_delay: Duration::from_millis(500),
        full_resync: Duration::from_secs(3600),
        placement_poll: Duration::from_millis(100),
        watch_resync: Duration::from_millis(500),
        source_backoff_min: Duration::from_millis(50),
        source_backoff_max: Duration::from_millis(500),
        sync_timeout: Duration::from_secs(10),
        election: ElectionTiming::from_ttl(Duration::from_millis(900)),
    }
}

/// An UP node alone in its tier, with room for many small leases.
fn node(node_id: &str) -> identity::Node {
    identity::Node {
        node_id: node_id.to_owned(),
        tier: tier(node_id),
        state: NodeState::Up as i32,
        capacity: Some(Capacity { cpu_millis: 64_000, memory_bytes: 64 << 30 }),
        ..Default::default()
    }
}

fn tier(node_id: &str) -> String {
    format!("t-{node_id}")
}

/// One egress replica serving on a loopback port.
pub(crate) type Replica = berth_testkit::Replica<EgressService>;

/// The mesh: leases, revisions, egress, a scripted node registry, clients.
pub(crate) struct Mesh {
    pub(crate) backend: Backend,
    dbs: Vec<TestDb>,
    buses: Vec<Bus>,
    /// The CA, the scripted node registry and leases.
    base: Option<LeasesMesh>,
    egress_db: usize,
    egress_bus: Bus,
    revisions_addr: SocketAddr,
    pub(crate) replicas: Vec<Replica>,
    config: EgressConfig,
}

impl Mesh {
    /// Leases knowing `nodes`, revisions, and one egress replica with `config`.
    pub(crate) async fn start(backend: Backend, config: EgressConfig, nodes: &[&str]) -> Self {
        let (mut dbs, mut buses) = (Vec::new(), Vec::new());
        // Leases live long: a test's own leases are never renewed.
        let ledger = LeasesConfig { lease_ttl: Duration::from_secs(600), ..fast_ledger() };
        let base = LeasesMesh::start(backend, "egress test CA", nodes.iter().map(|n| node(n)), ledger).await;
        let (leases_addr, stop) = (base.leases_addr(), base.stop.clone());

        let revisions_db = test_db(backend).await;
        revisions_db.store().migrate(berth_revisions::MIGRATIONS).await.unwrap();
        let revisions_bus = test_bus(backend).await;
        let revisions_credentials = base.credentials(&Identity::service("revisions").unwrap());
        let ctx =
            ServiceContext::new(revisions_db.store().clone(), revisions_bus.clone(), revisions_credentials.clone());
        let revisions_config = RevisionsConfig {
            rollout_poll: Duration::from_millis(50),
            steady_resync: Duration::from_millis(300),
            full_resync: Duration::from_secs(1),
            watch_resync: Duration::from_secs(1),
            election: ElectionTiming::from_ttl(Duration::from_millis(900)),
            ..RevisionsConfig::default()
        };
        let grpc_leases = GrpcLeases::connect(&leases_addr.to_string(), revisions_credentials.clone()).unwrap();
        let dependencies =
            Dependencies::with_registry(Arc::new(grpc_leases), RegistryPolicy::default(), &revisions_config).unwrap();
        let catalog = RevisionsService::new(&ctx, revisions_config, dependencies);
        catalog.spawn_loops(&stop);
        let revisions_addr = serve(catalog.server(), revisions_credentials, stop.clone()).await;
        dbs.push(revisions_db);
        buses.push(revisions_bus);

        let egress_db = test_db(backend).await;
        egress_db.store().migrate(berth_egress::MIGRATIONS).await.unwrap();
        let egress_bus = test_bus(backend).await;
        dbs.push(egress_db);

        let mut mesh = Self {
            backend,
            dbs,
            buses,
            base: Some(base),
            egress_db: 1,
            egress_bus,
            revisions_addr,
            replicas: Vec::new(),
            config,
        };
        mesh.add_replica().await;
        mesh
    }

    /// Starts another egress replica on the same store and bus prefix.
    pub(crate) async fn add_replica(&mut self) -> usize {
        let db = &self.dbs[self.egress_db];
        let store = if self.replicas.is_empty() { db.store().clone() } else { db.connect().await.unwrap() };
        let bus = replica_bus(self.backend, &self.egress_bus).await;
        let me = self.base().credentials(&Identity::service("egress").unwrap());
        let ctx = ServiceContext::new(store, bus, me.clone());
        let sources =
            Sources::connect(&me, Some(&self.revisions_addr.to_string()), Some(&self.base().leases_addr().to_string()))
                .unwrap();
        let service = EgressService::new(&ctx, self.config.clone(), sources);
        let shutdown = self.base().stop.child_token();
        self.replicas.push(Replica::start(service, me, shutdown).await);
        self.replicas.len() - 1
    }

    /// Stops replica `n`'s server and loops, as a crashed process would.
    pub(crate) fn stop_replica(&self, n: usize) {
        self.replicas[n].kill();
    }

    /// The egress store, for tests that look behind the API.
    pub(crate) fn store(&self) -> &berth_store::Store {
        self.dbs[self.egress_db].store()
    }

    /// The CA, the node registry and leases.
    fn base(&self) -> &LeasesMesh {
        self.base.as_ref().unwrap()
    }

    fn channel(&self, replica: usize, credentials: TlsCredentials) -> Channel {
        self.replicas[replica].channel(credentials)
    }

    /// `Egress` as an admin, through replica 0.
    pub(crate) fn egress(&self) -> egress::egress_client::EgressClient<Channel> {
        self.egress_on(0)
    }

    /// `Egress` as an admin, through `replica`.
    pub(crate) fn egress_on(&self, replica: usize) -> egress::egress_client::EgressClient<Channel> {
        egress::egress_client::EgressClient::new(self.channel(replica, self.base().admin.clone()))
    }

    /// `Egress` with `identity`'s certificate.
    pub(crate) fn egress_as(&self, identity: &Identity) -> egress::egress_client::EgressClient<Channel> {
        egress::egress_client::EgressClient::new(self.channel(0, self.base().credentials(identity)))
    }

    /// Certificates for `identity`, signed by the mesh's CA.
    pub(crate) fn credentials_for(&self, identity: &Identity) -> TlsCredentials {
        self.base().credentials(identity)
    }

    /// `NodeEgress` as node `node_id`, with its own certificate, through `replica`.
    pub(crate) fn node_on(
        &self,
        replica: usize,
        node_id: &str,
    ) -> egress::node_egress_client::NodeEgressClient<Channel> {
        let node = self.base().credentials(&Identity::node(node_id).unwrap());
        egress::node_egress_client::NodeEgressClient::new(self.channel(replica, node))
    }

    /// `NodeEgress` as node `node_id`, through replica 0.
    pub(crate) fn node(&self, node_id: &str) -> egress::node_egress_client::NodeEgressClient<Channel> {
        self.node_on(0, node_id)
    }

    /// `Services` on revisions, as an admin.
    pub(crate) fn services(&self) -> revisions::services_client::ServicesClient<Channel> {
        let channel = berth_rpc::connect(&self.revisions_addr.to_string(), self.base().admin.clone()).unwrap();
        revisions::services_client::ServicesClient::new(channel)
    }

    /// `Leases` on leases, as an admin.
    pub(crate) fn leases(&self) -> leases::leases_client::LeasesClient<Channel> {
        let channel = berth_rpc::connect(&self.base().leases_addr().to_string(), self.base().admin.clone()).unwrap();
        leases::leases_client::LeasesClient::new(channel)
    }

    /// Applies a gateway as an admin.
    pub(crate) async fn apply_gateway(&self, request: egress::ApplyGatewayRequest) -> egress::EgressGateway {
        self.egress().apply_gateway(request).await.unwrap().into_inner().gateway.unwrap()
    }

    /// Applies a route as an admin.
    pub(crate) async fn apply_route(&self, request: egress::ApplyRouteRequest) -> egress::EgressRoute {
        self.egress().apply_route(request).await.unwrap().into_inner().route.unwrap()
    }

    /// Declares service `name` in `project` with zero replicas and `egress` as its selection.
    pub(crate) async fn apply_service(
        &self,
        project: &str,
        name: &str,
        egress: Option<revisions::EgressSelection>,
    ) -> revisions::ApplyServiceResponse {
        let request = revisions::ApplyServiceRequest {
            project: project.to_owned(),
            name: name.to_owned(),
            template: Some(revisions::ServiceTemplate {
                bundle: Some(BundleRef { reference: format!("127.0.0.1:1/team/app@{PINNED}"), ..Default::default() }),
                replicas: Some(0),
                egress,
                ..Default::default()
            }),
            source: None,
        };
        self.services().apply_service(request).await.unwrap().into_inner()
    }

    /// Puts a workload of `project`'s `service` on `node_id`; the lease.
    pub(crate) async fn place(&self, project: &str, service: &str, node_id: &str) -> leases::Lease {
        let request = leases::RequestLeaseRequest {
            project: project.to_owned(),
            owner: "egress-test".into(),
            idempotency_key: format!("{project}/{service}/{node_id}/{}", rand::random::<u32>()),
            resources: Some(Capacity { cpu_millis: 10, memory_bytes: 1 << 20 }),
            tier: tier(node_id),
            spread_group: String::new(),
            workload: Some(leases::Workload {
                command: "/bin/true".into(),
                service: service.to_owned(),
                ..Default::default()
            }),
        };
        let lease = self.leases().request_lease(request).await.unwrap().into_inner().lease.unwrap();
        assert_eq!(lease.node_id, node_id, "the tier pins the node");
        lease
    }

    /// Gives a lease back.
    pub(crate) async fn release(&self, lease_id: &str) {
        let request = leases::ReleaseLeaseRequest { lease_id: lease_id.to_owned(), reason: String::new() };
        self.leases().release_lease(request).await.unwrap();
    }

    /// `project`'s plan and pass counters as replica 0 answers, if compiled.
    pub(crate) async fn plan(&self, project: &str) -> Option<(egress::EgressPlan, egress::PassStats)> {
        self.plan_on(0, project).await
    }

    /// `project`'s plan and pass counters as `replica` answers, if compiled.
    pub(crate) async fn plan_on(
        &self,
        replica: usize,
        project: &str,
    ) -> Option<(egress::EgressPlan, egress::PassStats)> {
        let request = egress::GetPlanRequest { project: project.to_owned() };
        match self.egress_on(replica).get_plan(request).await {
            Ok(response) => {
                let response = response.into_inner();
                Some((response.plan.unwrap(), response.passes.unwrap()))
            }
            Err(status) if status.code() == tonic::Code::NotFound => None,
            Err(status) => panic!("GetPlan failed: {status:?}"),
        }
    }

    /// Waits until `project`'s plan satisfies `check`; returns it.
    pub(crate) async fn await_plan(
        &self,
        project: &str,
        what: &str,
        check: impl Fn(&egress::EgressPlan) -> bool,
    ) -> (egress::EgressPlan, egress::PassStats) {
        eventually(&format!("the plan of {project} to have {what}"), PATIENCE, || async {
            match self.plan(project).await {
                Some((plan, stats)) if check(&plan) => Ok((plan, stats)),
                other => Err(other),
            }
        })
        .await
    }

    /// Stops everything and drops the schemas or files and the bus keys.
    pub(crate) async fn cleanup(mut self) {
        self.base().stop.cancel();
        // Let the loops resign and the servers drain.
        tokio::time::sleep(Duration::from_millis(200)).await;
        for bus in self.buses.iter().chain(std::iter::once(&self.egress_bus)) {
            cleanup_bus(self.backend, bus).await;
        }
        for db in self.dbs.drain(..) {
            db.cleanup().await.unwrap();
        }
        if let Some(base) = self.base.take() {
            base.cleanup(self.backend).await;
        }
    }
}

/// A listener.
pub(crate) fn listener(name: &str, protocol: egress::ListenerProtocol, port: u32) -> egress::Listener {
    egress::Listener { name: name.to_owned(), protocol: protocol as i32, port }
}

/// A gateway `name` in `project` with an HTTP listener on 3128 and an HTTPS CONNECT one on 3129.
pub(crate) fn gateway(project: &str, name: &str) -> egress::ApplyGatewayRequest {
    egress::ApplyGatewayRequest {
        project: project.to_owned(),
        name: name.to_owned(),
        listeners: vec![
            listener("http", egress::ListenerProtocol::Http, 3128),
            listener("https", egress::ListenerProtocol::HttpsConnect, 3129),
        ],
    }
}

/// An allow route `name` in `project` on every listener of `gateway`.
pub(crate) fn route(
    project: &str,
    name: &str,
    gateway: &str,
    hosts: &[&str],
    ports: &[u32],
) -> egress::ApplyRouteRequest {
    egress::ApplyRouteRequest {
        project: project.to_owned(),
        name: name.to_owned(),
        parent_refs: vec![egress::ParentRef { gateway: gateway.to_owned(), listener: String::new() }],
        hostnames: hosts.iter().map(|h| h.to_string()).collect(),
        ports: ports.to_vec(),
        action: egress::RouteAction::Allow as i32,
    }
}

/// The service `name` of a plan.
pub(crate) fn service<'a>(plan: &'a egress::EgressPlan, name: &str) -> Option<&'a egress::ServiceEgress> {
    plan.services.iter().find(|s| s.service == name)
}

/// The reason of `name`'s `EgressReady` condition in a plan.
pub(crate) fn egress_reason(plan: &egress::EgressPlan, name: &str) -> Option<String> {
    service(plan, name).and_then(|s| s.condition.as_ref()).map(|c| c.reason.clone())
}
