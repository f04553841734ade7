//! A running identity deployment for tests: one or more replicas on one
//! store and one bus, each serving real mTLS gRPC on a loopback port, with an
//! admin client and joined test nodes driven the way an agent drives them.

#![allow(dead_code, reason = "each test binary uses a different part of the harness")]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use berth_bus::Bus;
use berth_core::Identity;
use berth_identity::{AuthorityTiming, IdentityConfig, IdentityService, MIGRATIONS, NodeTiming, WorkloadSettings};
use berth_mtls::{TlsCredentials, TlsMaterial, generate_csr};
use berth_proto::identity::v1;
use berth_proto::identity::v1::NodeState;
use berth_proto::types::v1::Capacity;
use berth_rpc::{Channel, Listener};
use berth_store::testing::TestDb;
use berth_store::{ElectionTiming, Store};
pub(crate) use berth_testkit::Backend;
use berth_testkit::{cleanup_bus, replica_bus, test_bus, test_db};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The secret every test CA key is sealed under.
const AUTH_SECRET: &str = "test-auth-secret-of-at-least-32-characters";

/// How long node certificates issued in tests live.
pub(crate) const NODE_CERT_TTL: Duration = Duration::from_secs(600);

/// Timings in milliseconds: beats every 100 ms, down after 500 ms of silence.
pub(crate) fn fast_timing() -> NodeTiming {
    NodeTiming {
        heartbeat_interval: Duration::from_millis(100),
        down_after: Duration::from_millis(500),
        reap_after: Duration::from_secs(3600),
        forget_after: Duration::from_secs(7200),
        reset_grace: Duration::from_millis(800),
        persist_every: Duration::from_millis(300),
        monitor_every: Duration::from_millis(50),
        resync_every: Duration::from_millis(500),
        election: ElectionTiming::from_ttl(Duration::from_millis(900)),
        join_attempts: 1000,
        join_window: Duration::from_secs(10),
        token_retention: Duration::from_secs(3600),
        certificate_overlap: Duration::from_secs(60),
        upgrade_grace: Duration::from_secs(2),
    }
}

/// [`fast_timing`], with a node taken for Down only after 2 s of silence:
/// for tests that keep a node Up (see [`TestNode::beating`]) while other
/// calls run, so that a loaded machine's slow beat is not a node gone.
pub(crate) fn patient_timing() -> NodeTiming {
    NodeTiming { down_after: Duration::from_secs(2), ..fast_timing() }
}

/// One identity replica serving on a loopback port.
pub(crate) struct Replica {
    pub(crate) service: IdentityService,
    pub(crate) addr: SocketAddr,
    shutdown: CancellationToken,
    server: JoinHandle<()>,
}

impl Replica {
    /// Stops serving and campaigning, resigning the monitor if it leads.
    pub(crate) async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), self.server).await;
    }
}

/// A deployment: a store, a bus, replicas, and an admin identity.
pub(crate) struct Cluster {
    pub(crate) backend: Backend,
    db: Option<TestDb>,
    bus: Bus,
    pub(crate) replicas: Vec<Replica>,
    pub(crate) admin: TlsCredentials,
    pub(crate) bundle: String,
    timing: NodeTiming,
}

impl Cluster {
    /// A deployment of one replica.
    pub(crate) async fn start(backend: Backend, timing: NodeTiming) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let db = test_db(backend).await;
        let bus = test_bus(backend).await;
        db.store().migrate(MIGRATIONS).await.unwrap();
        let first = start_replica(db.store().clone(), bus.clone(), timing.clone(), WorkloadSettings::default()).await;
        let admin_material = first
            .service
            .authority()
            .issue_material(&Identity::admin("alice").unwrap(), &[], Duration::from_secs(3600))
            .await
            .unwrap();
        let bundle = admin_material.ca_bundle_pem.clone();
        let admin = TlsCredentials::new(admin_material).unwrap();
        Self { backend, db: Some(db), bus, replicas: vec![first], admin, bundle, timing }
    }

    /// Starts another replica on the same store and bus prefix, as another
    /// process would: its own database pool and, on Redis, its own connection.
    pub(crate) async fn add_replica(&mut self) -> usize {
        let db = self.db.as_ref().unwrap();
        let store = db.connect().await.unwrap();
        let bus = replica_bus(self.backend, &self.bus).await;
        self.replicas.push(start_replica(store, bus, self.timing.clone(), WorkloadSettings::default()).await);
        self.replicas.len() - 1
    }

    /// [`Cluster::add_replica`], signing workload certificates as `settings` say.
    pub(crate) async fn add_replica_with(&mut self, settings: WorkloadSettings) -> usize {
        let db = self.db.as_ref().unwrap();
        let store = db.connect().await.unwrap();
        let bus = replica_bus(self.backend, &self.bus).await;
        self.replicas.push(start_replica(store, bus, self.timing.clone(), settings).await);
        self.replicas.len() - 1
    }

    /// A bus handle on the deployment's prefix, for tests that fault it.
    pub(crate) fn bus(&self) -> &Bus {
        &self.bus
    }

    /// The store, for tests that look behind the API.
    pub(crate) fn store(&self) -> &Store {
        self.db.as_ref().unwrap().store()
    }

    pub(crate) fn addr(&self, replica: usize) -> String {
        self.replicas[replica].addr.to_string()
    }

    pub(crate) fn admin_channel(&self, replica: usize) -> Channel {
        berth_rpc::connect(&self.addr(replica), self.admin.clone()).unwrap()
    }

    pub(crate) fn nodes(&self, replica: usize) -> v1::nodes_client::NodesClient<Channel> {
        v1::nodes_client::NodesClient::new(self.admin_channel(replica))
    }

    pub(crate) fn tokens(&self, replica: usize) -> v1::join_tokens_client::JoinTokensClient<Channel> {
        v1::join_tokens_client::JoinTokensClient::new(self.admin_channel(replica))
    }

    /// A new join token of `max_uses` uses, no tier.
    pub(crate) async fn token(&self, max_uses: u32) -> String {
        self.token_with(v1::CreateJoinTokenRequest { max_uses, ..Default::default() }).await.token
    }

    pub(crate) async fn token_with(&self, request: v1::CreateJoinTokenRequest) -> v1::CreateJoinTokenResponse {
        self.tokens(0).create_join_token(request).await.unwrap().into_inner()
    }

    /// Joins a host at `advertise_addr` through `replica`, without a client certificate.
    pub(crate) async fn join(
        &self,
        replica: usize,
        token: &str,
        advertise_addr: &str,
    ) -> Result<TestNode, tonic::Status> {
        let channel = berth_rpc::connect_anonymous(&self.addr(replica), &self.bundle).unwrap();
        join_over(channel, token, advertise_addr, &self.bundle).await
    }

    pub(crate) async fn get(&self, node_id: &str) -> v1::Node {
        self.get_via(0, node_id).await
    }

    pub(crate) async fn get_via(&self, replica: usize, node_id: &str) -> v1::Node {
        let request = v1::GetNodeRequest { node_id: node_id.to_owned() };
        self.nodes(replica).get_node(request).await.unwrap().into_inner().node.unwrap()
    }

    /// Polls `GetNode` until the node is in `state`; panics after `within`.
    pub(crate) async fn wait_for_state(&self, node_id: &str, state: NodeState, within: Duration) -> v1::Node {
        let started = Instant::now();
        loop {
            let node = self.get_via(self.replicas.len() - 1, node_id).await;
            if node.state() == state {
                return node;
            }
            assert!(
                started.elapsed() < within,
                "node {node_id} still {:?} after {within:?}, expected {state:?}",
                node.state()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Stops every replica and drops the schema or file and the bus keys.
    pub(crate) async fn cleanup(mut self) {
        for replica in self.replicas.drain(..) {
            replica.stop().await;
        }
        cleanup_bus(self.backend, &self.bus).await;
        if let Some(db) = self.db.take() {
            db.cleanup().await.unwrap();
        }
    }
}

async fn start_replica(store: Store, bus: Bus, timing: NodeTiming, workloads: WorkloadSettings) -> Replica {
    let config = IdentityConfig {
        auth_secret: AUTH_SECRET.to_owned(),
        // No wait after preparing a CA: the tests drive rotations step by step.
        authority: AuthorityTiming { min_prepared: Duration::ZERO, ..AuthorityTiming::default() },
        node_cert_ttl: NODE_CERT_TTL,
    };
    let service = IdentityService::open(store, bus, config)
        .await
        .unwrap()
        .with_node_timing(timing)
        .with_workload_settings(workloads);
    let material = service
        .authority()
        .issue_material(
            &Identity::service("identity").unwrap(),
            &["localhost".to_owned(), "127.0.0.1".to_owned()],
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    let listener =
        Listener::bind("127.0.0.1:0".parse().unwrap(), TlsCredentials::new(material).unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    service.spawn_loops(&shutdown);
    let server = service.server();
    let stop = shutdown.clone();
    let server = tokio::spawn(async move {
        server.serve(listener, stop).await.unwrap();
    });
    Replica { service, addr, shutdown, server }
}

/// Sends a `JoinRequest` over `channel` and turns the answer into a node.
pub(crate) async fn join_over(
    channel: Channel,
    token: &str,
    advertise_addr: &str,
    bundle: &str,
) -> Result<TestNode, tonic::Status> {
    let (csr_pem, key_pem) = generate_csr("test host").unwrap();
    let request = v1::JoinRequest {
        token: token.to_owned(),
        csr_pem,
        name: "test-host".to_owned(),
        advertise_addr: advertise_addr.to_owned(),
        tier: String::new(),
        version: "0.1.0".to_owned(),
        capacity: Some(Capacity { cpu_millis: 4000, memory_bytes: 8 << 30 }),
        labels: Default::default(),
    };
    let joined = v1::join_client::JoinClient::new(channel).join(request).await?.into_inner();
    assert!(!bundle.is_empty());
    let material = TlsMaterial { cert_chain_pem: joined.certificate_pem, key_pem, ca_bundle_pem: joined.ca_bundle_pem };
    Ok(TestNode {
        node_id: joined.node_id,
        incarnation: joined.incarnation,
        credentials: TlsCredentials::new(material).unwrap(),
    })
}

/// A joined host, as its agent holds it.
pub(crate) struct TestNode {
    pub(crate) node_id: String,
    pub(crate) incarnation: u64,
    pub(crate) credentials: TlsCredentials,
}

impl TestNode {
    pub(crate) fn channel(&self, addr: &str) -> Channel {
        berth_rpc::connect(addr, self.credentials.clone()).unwrap()
    }

    /// A heartbeat for itself at its incarnation.
    pub(crate) fn beat(&self) -> v1::HeartbeatRequest {
        v1::HeartbeatRequest {
            node_id: self.node_id.clone(),
            incarnation: self.incarnation,
            usage: Some(Capacity { cpu_millis: 100, memory_bytes: 1 << 20 }),
            capacity: Some(Capacity { cpu_millis: 4000, memory_bytes: 8 << 30 }),
            version: "0.1.0".to_owned(),
            renewal_csr_pem: String::new(),
            ca_bundle_sha256: String::new(),
            upgrading: false,
            upgrade: None,
        }
    }

    pub(crate) async fn heartbeat(&self, addr: &str) -> Result<v1::HeartbeatResponse, tonic::Status> {
        self.send(addr, self.beat()).await
    }

    /// Runs `work` while the node heartbeats at `addr` every beat interval
    /// of [`fast_timing`] (see [`TestNode::keep_beating`]), as a live agent
    /// does: however slow the machine, the node is not taken for gone
    /// meanwhile. A beat refused fails the test.
    pub(crate) async fn beating<T>(&self, addr: &str, work: impl std::future::Future<Output = T>) -> T {
        let stop = CancellationToken::new();
        let beats = self.keep_beating(vec![addr.to_owned()], fast_timing().heartbeat_interval, stop.clone());
        let done = work.await;
        stop.cancel();
        beats.await.unwrap();
        done
    }

    pub(crate) async fn send(
        &self,
        addr: &str,
        beat: v1::HeartbeatRequest,
    ) -> Result<v1::HeartbeatResponse, tonic::Status> {
        let mut session = v1::node_session_client::NodeSessionClient::new(self.channel(addr));
        session.heartbeat(beat).await.map(tonic::Response::into_inner)
    }

    /// Heartbeats every `every` through `addrs` in turn until `stop`,
    /// panicking on any refusal.
    pub(crate) fn keep_beating(&self, addrs: Vec<String>, every: Duration, stop: CancellationToken) -> JoinHandle<()> {
        let node = TestNode {
            node_id: self.node_id.clone(),
            incarnation: self.incarnation,
            credentials: self.credentials.clone(),
        };
        tokio::spawn(async move {
            let mut turn = 0;
            while !stop.is_cancelled() {
                let addr = &addrs[turn % addrs.len()];
                let answer =
                    node.heartbeat(addr).await.unwrap_or_else(|s| panic!("{} beat refused: {s:?}", node.node_id));
                assert!(!answer.fenced, "{} fenced", node.node_id);
                turn += 1;
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(every) => {}
                }
            }
        })
    }
}
