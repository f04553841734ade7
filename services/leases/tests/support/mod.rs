//! A running ledger for tests: one or more leases replicas on one store and
//! one bus, each serving real mTLS gRPC on a loopback port, following a node
//! registry the test scripts, with admin and node clients.
//!
//! # The node registry
//! Leases learns node capacity and state only from identity's
//! `Nodes/WatchNodes` stream, followed by the runtime's `follow_nodes` into
//! the replica's `NodeDirectory`. The tests serve that one RPC themselves,
//! over mTLS like identity, from a list they edit (a node `UP`, then
//! `DRAINING`, then gone), so the ledger runs exactly its production path
//! while each test says what identity knows.
//!
//! `RUST_LOG=berth_leases=debug` shows the replicas' logs.

#![allow(dead_code, reason = "each test binary uses a different part of the harness")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_bus::Bus;
use berth_core::Identity;
use berth_leases::{LeasesConfig, LeasesService, MIGRATIONS};
use berth_mtls::{CertificateAuthority, TlsCredentials};
use berth_proto::identity::v1 as identity;
use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::types::v1::Capacity;
use berth_rpc::Channel;
use berth_runtime::{ServiceContext, follow_nodes};
use berth_store::testing::TestDb;
use berth_store::{ElectionTiming, Store};
pub(crate) use berth_testkit::Backend;
use berth_testkit::{
    PATIENCE, ScriptedRegistry, cleanup_bus, credentials, eventually, install_crypto_and_logs, replica_bus, test_bus,
    test_ca, test_db,
};
use tokio_util::sync::CancellationToken;

/// A gibibyte.
pub(crate) const GIB: u64 = 1 << 30;

/// A mebibyte.
pub(crate) const MIB: u64 = 1 << 20;

/// Loops in milliseconds; leases live 30 s, so only a test about expiry sees one expire.
pub(crate) fn fast_config() -> LeasesConfig {
    LeasesConfig {
        reap_every: Duration::from_millis(50),
        assignment_resync: Duration::from_millis(500),
        index_resync: Duration::from_millis(500),
        election: ElectionTiming::from_ttl(Duration::from_millis(900)),
        ..LeasesConfig::default()
    }
}

/// Like [`fast_config`], forgetting final leases 300 ms after they end.
pub(crate) fn forgetting_config() -> LeasesConfig {
    LeasesConfig { retention: Duration::from_millis(300), index_resync: Duration::from_millis(100), ..fast_config() }
}

/// Like [`fast_config`] with leases that live `ttl`.
pub(crate) fn expiring_config(ttl: Duration) -> LeasesConfig {
    LeasesConfig { lease_ttl: ttl, reset_grace: ttl, custody_window: Duration::from_secs(30), ..fast_config() }
}

/// A node as the scripted registry describes it.
pub(crate) fn node(node_id: &str, tier: &str, state: NodeState, cpu_millis: u64, memory_bytes: u64) -> identity::Node {
    identity::Node {
        node_id: node_id.to_owned(),
        tier: tier.to_owned(),
        state: state as i32,
        capacity: Some(Capacity { cpu_millis, memory_bytes }),
        ..Default::default()
    }
}

/// One leases replica serving on a loopback port.
pub(crate) type Replica = berth_testkit::Replica<LeasesService>;

/// A deployment: a store, a bus, a scripted registry, replicas, and clients.
pub(crate) struct Ledger {
    pub(crate) backend: Backend,
    db: Option<TestDb>,
    bus: Bus,
    ca: CertificateAuthority,
    registry: ScriptedRegistry,
    registry_addr: SocketAddr,
    registry_stop: CancellationToken,
    pub(crate) replicas: Vec<Replica>,
    admin: TlsCredentials,
    node_credentials: Mutex<HashMap<String, TlsCredentials>>,
    config: LeasesConfig,
}

impl Ledger {
    /// One replica with `config`, knowing the nodes in `nodes`.
    pub(crate) async fn start(backend: Backend, config: LeasesConfig, nodes: Vec<identity::Node>) -> Self {
        install_crypto_and_logs();
        let db = test_db(backend).await;
        db.store().migrate(MIGRATIONS).await.unwrap();
        let bus = test_bus(backend).await;
        let ca = test_ca("leases test CA");
        let registry = ScriptedRegistry::new(nodes);
        let registry_stop = CancellationToken::new();
        let registry_addr = registry.serve(&ca, registry_stop.clone()).await;
        let admin = credentials(&ca, &Identity::admin("alice").unwrap());
        let mut ledger = Self {
            backend,
            db: Some(db),
            bus,
            ca,
            registry,
            registry_addr,
            registry_stop,
            replicas: Vec::new(),
            admin,
            node_credentials: Mutex::new(HashMap::new()),
            config,
        };
        ledger.add_replica().await;
        ledger
    }

    /// Starts another replica on the same store and bus prefix, as another
    /// process would: its own pool and, on Redis, its own connection. Waits
    /// until it has learned the registry.
    pub(crate) async fn add_replica(&mut self) -> usize {
        let db = self.db.as_ref().unwrap();
        let store = if self.replicas.is_empty() { db.store().clone() } else { db.connect().await.unwrap() };
        let bus = replica_bus(self.backend, &self.bus).await;
        let credentials = credentials(&self.ca, &Identity::service("leases").unwrap());
        let ctx = ServiceContext::new(store, bus, credentials.clone());
        let shutdown = CancellationToken::new();
        follow_nodes(
            self.registry_addr.to_string(),
            credentials.clone(),
            ctx.nodes.clone(),
            ctx.revocations.clone(),
            shutdown.clone(),
        );
        let service = LeasesService::new(&ctx, self.config.clone());
        self.replicas.push(Replica::start(service, credentials, shutdown).await);
        let replica = self.replicas.len() - 1;
        self.settle_replica(replica).await;
        replica
    }

    /// Tells the registry about `node` (new or changed) and waits until every replica knows.
    pub(crate) async fn put_node(&self, node: identity::Node) {
        self.registry.put(node);
        self.settle().await;
    }

    /// Moves `node_id` to `state` in the registry and waits until every replica knows.
    pub(crate) async fn set_state(&self, node_id: &str, state: NodeState) {
        let mut node = self.registry.nodes().remove(node_id).unwrap();
        node.state = state as i32;
        self.registry.put(node);
        self.settle().await;
    }

    /// Waits until every replica's view of the nodes is the registry's.
    pub(crate) async fn settle(&self) {
        for replica in 0..self.replicas.len() {
            self.settle_replica(replica).await;
        }
    }

    async fn settle_replica(&self, replica: usize) {
        let expected: Vec<(String, i32, Option<Capacity>)> =
            self.registry.nodes().values().map(|n| (n.node_id.clone(), n.state, n.capacity)).collect();
        let what = format!("replica {replica} to see the registry's {expected:?}");
        eventually(&what, PATIENCE, || async {
            let seen: Vec<(String, i32, Option<Capacity>)> = self
                .capacity(replica)
                .list_node_capacity(v1::ListNodeCapacityRequest::default())
                .await
                .unwrap()
                .into_inner()
                .nodes
                .into_iter()
                .filter(|n| n.total.is_some_and(|t| t.cpu_millis > 0) || n.state != NodeState::Unspecified as i32)
                .map(|n| (n.node_id, n.state, n.total))
                .collect();
            if seen == expected { Ok(()) } else { Err(seen) }
        })
        .await;
    }

    /// The store, for tests that look behind the API.
    pub(crate) fn store(&self) -> &Store {
        self.db.as_ref().unwrap().store()
    }

    /// A bus handle on the deployment's prefix, for tests that fault it.
    pub(crate) fn bus(&self) -> &Bus {
        &self.bus
    }

    pub(crate) fn admin_channel(&self, replica: usize) -> Channel {
        berth_rpc::connect(&self.replicas[replica].addr.to_string(), self.admin.clone()).unwrap()
    }

    /// `Leases` as an admin.
    pub(crate) fn leases(&self, replica: usize) -> v1::leases_client::LeasesClient<Channel> {
        v1::leases_client::LeasesClient::new(self.admin_channel(replica))
    }

    /// `Capacity` as an admin.
    pub(crate) fn capacity(&self, replica: usize) -> v1::capacity_client::CapacityClient<Channel> {
        v1::capacity_client::CapacityClient::new(self.admin_channel(replica))
    }

    /// The credentials of node `node_id`, as identity would have issued them.
    pub(crate) fn node_credentials(&self, node_id: &str) -> TlsCredentials {
        let mut issued = self.node_credentials.lock().unwrap();
        issued
            .entry(node_id.to_owned())
            .or_insert_with(|| credentials(&self.ca, &Identity::node(node_id).unwrap()))
            .clone()
    }

    /// `NodeLeases` as node `node_id`.
    pub(crate) fn node(&self, node_id: &str) -> v1::node_leases_client::NodeLeasesClient<Channel> {
        let channel = berth_rpc::connect(&self.replicas[0].addr.to_string(), self.node_credentials(node_id)).unwrap();
        v1::node_leases_client::NodeLeasesClient::new(channel)
    }

    /// `Leases` as `identity` (a service, say), through replica 0.
    pub(crate) fn leases_as(&self, identity: &Identity) -> v1::leases_client::LeasesClient<Channel> {
        let channel = berth_rpc::connect(&self.replicas[0].addr.to_string(), credentials(&self.ca, identity)).unwrap();
        v1::leases_client::LeasesClient::new(channel)
    }

    /// `Leases` as node `node_id`, which the access layer should refuse.
    pub(crate) fn leases_as_node(&self, node_id: &str) -> v1::leases_client::LeasesClient<Channel> {
        let channel = berth_rpc::connect(&self.replicas[0].addr.to_string(), self.node_credentials(node_id)).unwrap();
        v1::leases_client::LeasesClient::new(channel)
    }

    /// Places a lease asking `cpu_millis` and `memory_bytes`, keyed `key`, through replica 0.
    pub(crate) async fn place(&self, key: &str, cpu_millis: u64, memory_bytes: u64) -> v1::Lease {
        let response = self.leases(0).request_lease(ask(key, cpu_millis, memory_bytes)).await.unwrap().into_inner();
        assert!(response.created, "{key} already existed");
        response.lease.unwrap()
    }

    /// The lease as it is now.
    pub(crate) async fn get(&self, lease_id: &str) -> v1::Lease {
        let request = v1::GetLeaseRequest { lease_id: lease_id.to_owned() };
        self.leases(0).get_lease(request).await.unwrap().into_inner().lease.unwrap()
    }

    /// Waits until the ledger has forgotten `lease_id` (its retention passed).
    pub(crate) async fn await_forgotten(&self, lease_id: &str) {
        eventually("the ended lease to be forgotten", PATIENCE, || async {
            match self.leases(0).get_lease(v1::GetLeaseRequest { lease_id: lease_id.to_owned() }).await {
                Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
                other => Err(other),
            }
        })
        .await;
    }

    /// One node's capacity entry as replica 0 reports it.
    pub(crate) async fn node_capacity(&self, node_id: &str) -> v1::NodeCapacity {
        let nodes = self.capacity(0).list_node_capacity(v1::ListNodeCapacityRequest::default()).await.unwrap();
        nodes.into_inner().nodes.into_iter().find(|n| n.node_id == node_id).unwrap()
    }

    /// Reports `phase` for `lease` as its node, at `epoch`.
    pub(crate) async fn report(
        &self,
        lease: &v1::Lease,
        epoch: u64,
        phase: v1::LeasePhase,
    ) -> Result<v1::Lease, tonic::Status> {
        let request = v1::ReportPhaseRequest {
            node_id: lease.node_id.clone(),
            lease_id: lease.lease_id.clone(),
            epoch,
            phase: phase as i32,
            ..Default::default()
        };
        self.node(&lease.node_id).report_phase(request).await.map(|r| r.into_inner().lease.unwrap())
    }

    /// Stops every replica and drops the schema or file and the bus keys.
    pub(crate) async fn cleanup(mut self) {
        for replica in self.replicas.drain(..) {
            replica.stop().await;
        }
        self.registry_stop.cancel();
        cleanup_bus(self.backend, &self.bus).await;
        if let Some(db) = self.db.take() {
            db.cleanup().await.unwrap();
        }
    }
}

/// A request for a bare-command lease in the default project.
pub(crate) fn ask(key: &str, cpu_millis: u64, memory_bytes: u64) -> v1::RequestLeaseRequest {
    v1::RequestLeaseRequest {
        project: String::new(),
        owner: "tests/ledger".to_owned(),
        idempotency_key: key.to_owned(),
        resources: Some(Capacity { cpu_millis, memory_bytes }),
        tier: String::new(),
        spread_group: String::new(),
        workload: Some(v1::Workload { command: "/bin/true".to_owned(), ..Default::default() }),
    }
}

/// Shared across tasks that issue requests concurrently.
pub(crate) type SharedLedger = Arc<Ledger>;
