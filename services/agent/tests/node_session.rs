//! The agent against the real identity service, in process: join, resume,
//! renewal, fencing, outages and revocation, as an operator would see them
//! through the Nodes API and the agent's own status.
//!
//! Identity runs on a SQLite file and an in-process bus, and the agent
//! reaches it through a TCP relay that a test can take down, the way a
//! network partition or an identity restart would.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::cell::RefCell;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use berth_agent::{AgentConfig, AgentError, AgentHandle, AgentStatus, AgentTiming, Capacity, FenceReason};
use berth_core::Identity;
use berth_identity::{AuthorityTiming, IdentityConfig, IdentityService, KeptIdentity, NodeTiming};
use berth_mtls::TlsCredentials;
use berth_proto::identity::v1;
use berth_proto::identity::v1::authority_client::AuthorityClient;
use berth_proto::identity::v1::join_tokens_client::JoinTokensClient;
use berth_proto::identity::v1::nodes_client::NodesClient;
use berth_store::ElectionTiming;
use berth_store::testing::TestDb;
use berth_testkit::{PATIENCE, eventually};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const SECRET: &str = "0123456789abcdef0123456789abcdef-agent-test";

/// What the agent advertises; its host is written into the node certificate,
/// which is how a client dialling 127.0.0.1 verifies the agent API.
const ADVERTISE: &str = "127.0.0.1:7447";

// ---------------------------------------------------------------------------
// A relay in front of identity that can go down
// ---------------------------------------------------------------------------

/// Relays TCP to identity. While down it closes every live connection and
/// every new one at once, like a partition, and counts the connections it
/// turned away: each is one attempt by the agent.
struct Relay {
    addr: SocketAddr,
    /// Where it relays to.
    target: SocketAddr,
    down: Arc<AtomicBool>,
    turned_away: Arc<AtomicU64>,
    relayed: Arc<AtomicU64>,
    open: Arc<AtomicU64>,
    cuts: watch::Sender<u64>,
    accepting: JoinHandle<()>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let down = Arc::new(AtomicBool::new(false));
        let turned_away = Arc::new(AtomicU64::new(0));
        let (relayed, open) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let cuts = watch::channel(0u64).0;
        let (d, t, r, o, c) = (down.clone(), turned_away.clone(), relayed.clone(), open.clone(), cuts.clone());
        let accepting = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else { continue };
                if d.load(Ordering::SeqCst) {
                    t.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                }
                r.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let mut cut = c.subscribe();
                let o = o.clone();
                tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                            _ = cut.changed() => {}
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Relay { addr, target, down, turned_away, relayed, open, cuts, accepting }
    }

    fn go_down(&self) {
        self.down.store(true, Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }

    fn come_back(&self) {
        self.down.store(false, Ordering::SeqCst);
    }

    fn turned_away(&self) -> u64 {
        self.turned_away.load(Ordering::SeqCst)
    }

    /// Connections it let through to identity.
    fn relayed(&self) -> u64 {
        self.relayed.load(Ordering::SeqCst)
    }

    /// Connections it relays now.
    fn open(&self) -> u64 {
        self.open.load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cuts.send_modify(|n| *n += 1);
    }
}

// ---------------------------------------------------------------------------
// Identity, in process
// ---------------------------------------------------------------------------

struct IdentityUnderTest {
    db: Option<TestDb>,
    relay: Relay,
    bundle: String,
    authority: berth_identity::Authority,
    /// The certificate identity serves with; reloading it swaps what the
    /// next handshake presents.
    serving: TlsCredentials,
    admin: TlsCredentials,
    admin_channel: berth_rpc::Channel,
    stop: CancellationToken,
}

/// Node timings in milliseconds: beats every 100 ms, down after 600 ms of
/// silence, and nobody reaped or forgotten unless a test says so.
fn node_timing() -> NodeTiming {
    NodeTiming {
        heartbeat_interval: Duration::from_millis(100),
        down_after: Duration::from_millis(600),
        reap_after: Duration::from_secs(3600),
        forget_after: Duration::from_secs(7200),
        reset_grace: Duration::from_millis(600),
        persist_every: Duration::from_millis(200),
        monitor_every: Duration::from_millis(50),
        resync_every: Duration::from_secs(1),
        election: ElectionTiming::from_ttl(Duration::from_millis(900)),
        ..NodeTiming::default()
    }
}

/// Node timing under which a node that stops heartbeating is reaped and
/// then forgotten within a second.
fn forgetting_timing() -> NodeTiming {
    NodeTiming { reap_after: Duration::from_millis(300), forget_after: Duration::from_millis(300), ..node_timing() }
}

impl IdentityUnderTest {
    async fn start(node_cert_ttl: Duration, nodes: NodeTiming) -> IdentityUnderTest {
        Self::start_with(node_cert_ttl, nodes, AuthorityTiming::default()).await
    }

    async fn start_with(node_cert_ttl: Duration, nodes: NodeTiming, authority: AuthorityTiming) -> IdentityUnderTest {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let db = TestDb::sqlite().await.unwrap();
        let store = db.store().clone();
        store.migrate(berth_identity::MIGRATIONS).await.unwrap();
        let config = IdentityConfig { auth_secret: SECRET.into(), authority, node_cert_ttl };
        let service = IdentityService::open(store, berth_bus::testing::memory_bus().unwrap(), config)
            .await
            .unwrap()
            .with_node_timing(nodes);
        let authority = service.authority().clone();
        let me = KeptIdentity::issue(
            &authority,
            Identity::service("identity").unwrap(),
            vec!["127.0.0.1".into()],
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
        let listener = berth_rpc::Listener::bind("127.0.0.1:0".parse().unwrap(), me.credentials.clone()).await.unwrap();
        let direct = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        service.spawn_loops(&stop);
        tokio::spawn(service.server().serve(listener, stop.clone()));
        let admin = TlsCredentials::new(
            authority.issue_material(&Identity::admin("ops").unwrap(), &[], Duration::from_secs(3600)).await.unwrap(),
        )
        .unwrap();
        let admin_channel = berth_rpc::connect(&direct.to_string(), admin.clone()).unwrap();
        IdentityUnderTest {
            db: Some(db),
            relay: Relay::start(direct).await,
            bundle: authority.bundle_pem().await.unwrap(),
            serving: me.credentials.clone(),
            authority,
            admin,
            admin_channel,
            stop,
        }
    }

    /// An agent on `dir` joining with a token good for one use.
    async fn join_agent(&self, dir: &Path) -> RunningAgent {
        RunningAgent::start(agent_config(self, dir, Some(self.token(1).await))).await
    }

    /// A join token created the way an operator does, through JoinTokens.
    async fn token(&self, max_uses: u32) -> String {
        let request = v1::CreateJoinTokenRequest { max_uses, ttl_seconds: 600, ..Default::default() };
        JoinTokensClient::new(self.admin_channel.clone()).create_join_token(request).await.unwrap().into_inner().token
    }

    async fn token_uses(&self) -> Vec<u32> {
        let listed = JoinTokensClient::new(self.admin_channel.clone())
            .list_join_tokens(v1::ListJoinTokensRequest { usable_only: false })
            .await
            .unwrap()
            .into_inner();
        listed.join_tokens.iter().map(|t| t.uses).collect()
    }

    async fn node(&self, node_id: &str) -> v1::Node {
        let request = v1::GetNodeRequest { node_id: node_id.into() };
        NodesClient::new(self.admin_channel.clone()).get_node(request).await.unwrap().into_inner().node.unwrap()
    }

    async fn nodes(&self) -> Vec<v1::Node> {
        let request = v1::ListNodesRequest::default();
        NodesClient::new(self.admin_channel.clone()).list_nodes(request).await.unwrap().into_inner().nodes
    }

    async fn revoke(&self, node_id: &str) {
        let request = v1::RevokeNodeRequest { node_id: node_id.into(), reason: "decommissioned".into() };
        NodesClient::new(self.admin_channel.clone()).revoke_node(request).await.unwrap();
    }

    /// One step of a CA rotation, as an operator takes it; returns the bundle.
    async fn rotate_ca(&self, activate: bool) -> String {
        self.try_rotate_ca(activate).await.unwrap()
    }

    /// [`Self::rotate_ca`], refusals included.
    async fn try_rotate_ca(&self, activate: bool) -> Result<String, tonic::Status> {
        let request = v1::RotateCaRequest { activate, ..Default::default() };
        Ok(AuthorityClient::new(self.admin_channel.clone()).rotate_ca(request).await?.into_inner().ca_bundle_pem)
    }

    /// Activates the prepared CA whatever the nodes acknowledged
    /// (`RotateCA {activate: true, force: true}`), has identity serve a
    /// certificate of the new CA as its keeper does, and has the operator's
    /// client trust the new bundle; returns it.
    async fn force_activate(&self) -> String {
        let request = v1::RotateCaRequest { activate: true, force: true, ..Default::default() };
        let bundle = AuthorityClient::new(self.admin_channel.clone())
            .rotate_ca(request)
            .await
            .unwrap()
            .into_inner()
            .ca_bundle_pem;
        let mut admin = self.admin.material();
        admin.ca_bundle_pem = bundle.clone();
        self.admin.reload(admin).unwrap();
        let me = Identity::service("identity").unwrap();
        let serving =
            self.authority.issue_material(&me, &["127.0.0.1".into()], Duration::from_secs(3600)).await.unwrap();
        self.serving.reload(serving).unwrap();
        bundle
    }

    /// Cuts the node off from identity until identity no longer knows it
    /// (polling GetNode), then lets it through again.
    async fn forget_while_cut_off(&self, node_id: &str) {
        self.relay.go_down();
        eventually(&format!("node {node_id} to be forgotten"), PATIENCE, || async {
            let request = v1::GetNodeRequest { node_id: node_id.into() };
            match NodesClient::new(self.admin_channel.clone()).get_node(request).await {
                Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
                other => Err(other.map(tonic::Response::into_inner)),
            }
        })
        .await;
        self.relay.come_back();
    }

    /// Polls GetNode until `pred` holds.
    async fn node_until(&self, node_id: &str, what: &str, pred: impl Fn(&v1::Node) -> bool) -> v1::Node {
        eventually(&format!("node {node_id} to be {what}"), PATIENCE, || async {
            let node = self.node(node_id).await;
            if pred(&node) { Ok(node) } else { Err(node) }
        })
        .await
    }

    async fn cleanup(mut self) {
        self.stop.cancel();
        if let Some(db) = self.db.take() {
            db.cleanup().await.unwrap();
        }
    }
}

fn up() -> i32 {
    v1::NodeState::Up as i32
}

// ---------------------------------------------------------------------------
// The agent
// ---------------------------------------------------------------------------

fn agent_timing() -> AgentTiming {
    AgentTiming {
        retry_initial: Duration::from_millis(50),
        retry_max: Duration::from_millis(400),
        rpc_timeout: Duration::from_secs(3),
        min_heartbeat_interval: Duration::from_millis(10),
        max_heartbeat_interval: Duration::from_secs(5),
    }
}

fn agent_config(identity: &IdentityUnderTest, dir: &Path, token: Option<String>) -> AgentConfig {
    let capacity = Capacity { cpu_millis: 2000, memory_bytes: 4 << 30 };
    let mut config =
        AgentConfig::new(identity.relay.addr.to_string(), dir, ADVERTISE, "127.0.0.1:0".parse().unwrap(), capacity);
    config.ca_bundle_pem = identity.bundle.clone();
    config.join_token = token;
    config.name = "test-host".into();
    config.timing = agent_timing();
    config
}

struct RunningAgent {
    handle: AgentHandle,
    stop: CancellationToken,
}

impl RunningAgent {
    async fn start(config: AgentConfig) -> RunningAgent {
        let stop = CancellationToken::new();
        let handle = berth_agent::start(config, stop.clone()).await.unwrap();
        RunningAgent { handle, stop }
    }

    /// Waits for the status to satisfy `pred`, and returns it.
    async fn status_until(&self, what: &str, pred: impl Fn(&AgentStatus) -> bool) -> AgentStatus {
        let mut status = self.handle.status();
        let found = tokio::time::timeout(PATIENCE, status.wait_for(|s| pred(s))).await.map(|r| r.map(|s| s.clone()));
        match found {
            Ok(Ok(found)) => found,
            Ok(Err(_)) => panic!("the agent stopped before it was {what}"),
            Err(_) => panic!("the agent was never {what}; last status {:?}", *status.borrow()),
        }
    }

    async fn up(&self) -> (String, u64) {
        let status = self.status_until("up", AgentStatus::is_up).await;
        let session = status.session().unwrap();
        (session.node_id.clone(), session.incarnation)
    }

    async fn stop(self) -> Result<(), AgentError> {
        self.stop.cancel();
        self.handle.wait().await
    }

    /// Collects every status until the agent stops that says its session
    /// was disturbed: retrying, or fenced.
    fn trouble_seen(&self) -> tokio::task::JoinHandle<Vec<AgentStatus>> {
        let mut status = self.handle.status();
        tokio::spawn(async move {
            let mut trouble = Vec::new();
            while status.changed().await.is_ok() {
                let now = status.borrow_and_update().clone();
                if matches!(now, AgentStatus::Retrying { .. } | AgentStatus::Fenced { .. }) {
                    trouble.push(now);
                }
            }
            trouble
        })
    }
}

/// The SHA-256 of the certificate the agent API serves right now.
async fn served_fingerprint(addr: SocketAddr, client: &TlsCredentials) -> String {
    use rustls_pki_types::ServerName;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap().to_owned();
    let tls = tokio_rustls::TlsConnector::from(client.client_config()).connect(name, tcp).await.unwrap();
    berth_mtls::fingerprint(&tls.get_ref().1.peer_certificates().unwrap()[0])
}

fn pem_fingerprint(pem: &str) -> String {
    berth_mtls::fingerprint(&berth_mtls::certs_from_pem("certificate", pem).unwrap()[0])
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_host_joins_heartbeats_and_is_up_with_its_key_kept_private() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = identity.join_agent(dir.path()).await;
    let (node_id, incarnation) = agent.up().await;
    assert_eq!(agent.handle.node_id(), node_id);
    assert_eq!(incarnation, 1);

    let node = identity.node_until(&node_id, "UP", |n| n.state == up()).await;
    assert_eq!(node.name, "test-host");
    assert_eq!(node.advertise_addr, ADVERTISE);
    assert_eq!(node.incarnation, 1);
    assert_eq!(node.capacity.unwrap().cpu_millis, 2000);
    assert_eq!(node.version, env!("CARGO_PKG_VERSION"));

    let kept = dir.path().join("identity");
    let key_mode = std::fs::metadata(kept.join("node.key")).unwrap().permissions().mode() & 0o777;
    assert_eq!(key_mode, 0o600, "the node key is readable by its owner only");
    let kept_cert = std::fs::read_to_string(kept.join("node.pem")).unwrap();
    assert_eq!(
        served_fingerprint(agent.handle.local_addr(), &identity.admin).await,
        pem_fingerprint(&kept_cert),
        "the agent API serves the node certificate it keeps"
    );
    assert_eq!(agent.handle.credentials().identity(), Some(Identity::node(node_id).unwrap()));

    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn a_restarted_agent_resumes_the_same_node_without_a_token() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let first = identity.join_agent(dir.path()).await;
    let (node_id, _) = first.up().await;
    first.stop().await.unwrap();
    let stopped_at = SystemTime::now();

    // No token and no CA file: everything needed is in the data directory.
    let mut config = agent_config(&identity, dir.path(), None);
    config.ca_bundle_pem = String::new();
    let second = RunningAgent::start(config).await;
    assert_eq!(second.handle.node_id(), node_id);
    let (again, incarnation) = second.up().await;
    assert_eq!((again.as_str(), incarnation), (node_id.as_str(), 1), "same node, same incarnation");

    let node = identity
        .node_until(&node_id, "heard from after the restart", |n| {
            n.state == up() && n.last_heartbeat_at.as_ref().is_some_and(|t| t.seconds as u64 >= secs(stopped_at))
        })
        .await;
    assert_eq!(node.incarnation, 1);
    assert_eq!(identity.nodes().await.len(), 1, "no second node");
    assert_eq!(identity.token_uses().await, vec![1], "no second join");
    second.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn a_restarted_agent_at_a_new_address_rejoins_as_the_same_node_named_there() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let first = identity.join_agent(dir.path()).await;
    let (node_id, _) = first.up().await;
    first.stop().await.unwrap();

    // The data directory survived; the address did not (a replaced pod).
    let mut config = agent_config(&identity, dir.path(), None);
    config.advertise_addr = "127.0.0.2:7447".into();
    let second = RunningAgent::start(config).await;
    let (again, incarnation) = second.up().await;
    assert_eq!((again.as_str(), incarnation), (node_id.as_str(), 2), "the same node, rejoined");
    let node = identity.node_until(&node_id, "at the new address", |n| n.advertise_addr == "127.0.0.2:7447").await;
    assert_eq!(node.state, up());
    assert_eq!(identity.nodes().await.len(), 1, "no second node");
    assert_eq!(identity.token_uses().await, vec![1], "rejoined with its certificate, not the token");
    let kept = std::fs::read_to_string(dir.path().join("identity/node.pem")).unwrap();
    let certs = berth_mtls::certs_from_pem("kept", &kept).unwrap();
    let names = berth_mtls::cert_host_names(&certs[0]).unwrap();
    assert!(names.contains(&"127.0.0.2".to_owned()), "the kept certificate names the new address: {names:?}");
    second.stop().await.unwrap();
    identity.cleanup().await;
}

fn secs(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs()
}

#[tokio::test]
async fn the_certificate_renews_again_and_again_and_the_api_serves_each_renewal() {
    let ttl = Duration::from_secs(3);
    let identity = IdentityUnderTest::start(ttl, node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = identity.join_agent(dir.path()).await;
    let (node_id, _) = agent.up().await;
    let first_expiry = agent.handle.credentials().not_after();

    // A renewal must never cost a failed beat.
    let watcher = agent.trouble_seen();

    let served = RefCell::new(vec![served_fingerprint(agent.handle.local_addr(), &identity.admin).await]);
    eventually("the agent API to serve four certificates in turn", PATIENCE, || async {
        // A TLS handshake each look: a few looks a second are enough.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = served_fingerprint(agent.handle.local_addr(), &identity.admin).await;
        let mut served = served.borrow_mut();
        if served.last() != Some(&now) {
            served.push(now);
        }
        if served.len() >= 4 { Ok(()) } else { Err(served.clone()) }
    })
    .await;
    // Three renewals of a 3 s certificate: the agent outlived its first one.
    assert!(agent.handle.credentials().not_after() > first_expiry);
    // What is served is what is kept, so a restart resumes the renewed
    // certificate (a renewal may land between the two reads: look again).
    let mut matched = false;
    for _ in 0..5 {
        let kept = std::fs::read_to_string(dir.path().join("identity/node.pem")).unwrap();
        if served_fingerprint(agent.handle.local_addr(), &identity.admin).await == pem_fingerprint(&kept) {
            matched = true;
            break;
        }
    }
    assert!(matched, "the served certificate is the one kept in the data directory");

    let node = identity.node(&node_id).await;
    assert_eq!(node.state, up());
    assert_eq!(node.incarnation, 1, "renewal is not a rejoin");
    agent.stop().await.unwrap();
    let trouble = watcher.await.unwrap();
    assert!(trouble.is_empty(), "renewals disturbed the session: {trouble:?}");
    identity.cleanup().await;
}

#[tokio::test]
async fn a_node_reaped_while_partitioned_is_fenced_and_rejoins_under_a_new_incarnation() {
    let timing = NodeTiming { reap_after: Duration::from_millis(500), ..node_timing() };
    let identity = IdentityUnderTest::start(Duration::from_secs(600), timing).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = identity.join_agent(dir.path()).await;
    let (node_id, incarnation) = agent.up().await;
    let mut fences = agent.handle.fences();
    assert!(fences.borrow_and_update().is_none());

    identity.relay.go_down();
    let reaped = identity.node_until(&node_id, "reaped", |n| n.incarnation > incarnation).await;
    assert_ne!(reaped.state, up());
    identity.relay.come_back();

    tokio::time::timeout(PATIENCE, fences.changed()).await.expect("the agent never saw the fence").unwrap();
    let fence = fences.borrow().clone().unwrap();
    assert_eq!(fence.reason, FenceReason::Fenced);
    assert_eq!((fence.session.node_id.as_str(), fence.session.incarnation), (node_id.as_str(), incarnation));

    let status = agent
        .status_until("up under a new incarnation", |s| s.is_up() && s.session().unwrap().incarnation > incarnation)
        .await;
    let session = status.session().unwrap().clone();
    assert_eq!(session.node_id, node_id, "a rejoin with a still-valid certificate keeps the node id");
    let node = identity.node_until(&node_id, "UP again", |n| n.state == up()).await;
    assert_eq!(node.incarnation, session.incarnation);
    let kept = std::fs::read_to_string(dir.path().join("identity/node.json")).unwrap();
    assert!(kept.contains(&format!("\"incarnation\": {}", session.incarnation)), "{kept}");
    assert_eq!(identity.token_uses().await, vec![1], "the rejoin spent no token use");
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn an_identity_outage_is_retried_with_backoff_and_the_node_recovers() {
    let timing =
        NodeTiming { down_after: Duration::from_secs(30), reset_grace: Duration::from_secs(30), ..node_timing() };
    let identity = IdentityUnderTest::start(Duration::from_secs(600), timing).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = identity.join_agent(dir.path()).await;
    let (node_id, incarnation) = agent.up().await;

    let outage = Duration::from_millis(2500);
    identity.relay.go_down();
    let retrying = agent.status_until("retrying", |s| matches!(s, AgentStatus::Retrying { .. })).await;
    tokio::time::sleep(outage).await;
    let attempts = identity.relay.turned_away();
    identity.relay.come_back();

    // Beats every 100 ms would be 25 attempts; backoff (50 ms doubling to
    // 400 ms) makes it about ten, and never a tight loop.
    assert!(attempts >= 3, "the agent kept trying: {attempts} attempts");
    assert!(attempts <= 16, "the agent backed off: {attempts} attempts in {outage:?}");
    let AgentStatus::Retrying { last_error, .. } = retrying else { unreachable!() };
    assert!(!last_error.is_empty());

    let (again, same_incarnation) = agent.up().await;
    assert_eq!((again.as_str(), same_incarnation), (node_id.as_str(), incarnation), "an outage is not a fence");
    assert!(agent.handle.fences().borrow().is_none());
    identity.node_until(&node_id, "UP", |n| n.state == up()).await;
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn a_node_given_two_identity_replicas_moves_to_the_other_when_its_own_goes_and_stays_up() {
    let timing = NodeTiming { down_after: Duration::from_secs(30), ..node_timing() };
    let identity = IdentityUnderTest::start(Duration::from_secs(600), timing).await;
    // A second way in to the same state: a replica of its own to the agent.
    let second = Relay::start(identity.relay.target).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = agent_config(&identity, dir.path(), Some(identity.token(1).await));
    config.server = format!("{},{}", identity.relay.addr, second.addr);
    let agent = RunningAgent::start(config).await;
    let (node_id, incarnation) = agent.up().await;

    // Whichever replica the node heartbeats to goes away for good. (The
    // join's own connection may have gone through either; it is closed.)
    eventually("the node to hold one connection to identity", PATIENCE, || async {
        let open = identity.relay.open() + second.open();
        if open == 1 { Ok(()) } else { Err(format!("{open} connections open")) }
    })
    .await;
    let (own, other) = if identity.relay.open() == 1 { (&identity.relay, &second) } else { (&second, &identity.relay) };
    let reached_other = other.relayed();
    let last_beat = |node: &v1::Node| node.last_heartbeat_at.as_ref().map(|at| (at.seconds, at.nanos));
    own.go_down();
    eventually("the node to connect through the other replica", PATIENCE, || async {
        let open = other.open();
        if open == 1 { Ok(()) } else { Err(format!("{open} connections open through it")) }
    })
    .await;
    let moved_at = last_beat(&identity.node(&node_id).await);

    // The node carries on through the other one: the same session, UP,
    // heartbeating while its own replica stays down.
    identity
        .node_until(&node_id, "heartbeating through the other replica", |n| n.state == up() && last_beat(n) > moved_at)
        .await;
    let (again, same_incarnation) = agent.up().await;
    assert_eq!((again.as_str(), same_incarnation), (node_id.as_str(), incarnation), "a replica's loss is not a fence");
    assert!(agent.handle.fences().borrow().is_none());
    assert!(other.relayed() > reached_other, "it connected through the other replica");
    assert!(own.turned_away() <= 2, "it moved on instead of retrying the lost one: {}", own.turned_away());
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn a_join_passes_over_an_identity_replica_that_is_down() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), node_timing()).await;
    let down = Relay::start(identity.relay.target).await;
    down.go_down();
    let dir = tempfile::tempdir().unwrap();
    let mut config = agent_config(&identity, dir.path(), Some(identity.token(1).await));
    config.server = format!("{},{}", down.addr, identity.relay.addr);
    let agent = RunningAgent::start(config).await;
    let (node_id, _) = agent.up().await;
    identity.node_until(&node_id, "UP", |n| n.state == up()).await;
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn an_identity_list_with_a_bad_entry_is_refused_naming_it() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = agent_config(&identity, dir.path(), Some(identity.token(1).await));
    config.server = format!("{},identity", identity.relay.addr);
    let error = berth_agent::start(config, CancellationToken::new()).await.unwrap_err();
    assert!(error.to_string().contains(r#""identity" is not host:port"#), "{error}");
    identity.cleanup().await;
}

#[tokio::test]
async fn a_revoked_node_stops_and_a_restart_refuses_to_run_it() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let token = identity.token(5).await;
    let agent = RunningAgent::start(agent_config(&identity, dir.path(), Some(token.clone()))).await;
    let (node_id, _) = agent.up().await;
    let fences = agent.handle.fences();

    identity.revoke(&node_id).await;
    agent.status_until("revoked", |s| matches!(s, AgentStatus::Revoked { .. })).await;
    assert_eq!(fences.borrow().as_ref().unwrap().reason, FenceReason::Revoked);
    let stopped = tokio::time::timeout(PATIENCE, agent.handle.wait()).await.expect("the agent stops");
    let err = stopped.unwrap_err();
    assert!(matches!(&err, AgentError::Revoked { node_id: n, .. } if *n == node_id), "{err}");

    // Even with a token that still has uses, the host does not come back on
    // its own: the operator decided.
    let err = berth_agent::start(agent_config(&identity, dir.path(), Some(token)), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("revoked") && err.to_string().contains("remove"), "{err}");
    assert_eq!(identity.nodes().await.len(), 1);
    identity.cleanup().await;
}

#[tokio::test]
async fn a_bad_token_fails_the_join_at_once_instead_of_retrying() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let real = identity.token(1).await;
    let (token_id, _secret) = real.rsplit_once('.').unwrap();
    let forged = format!("{token_id}.{}", "A".repeat(43));
    let started = tokio::time::Instant::now();
    let err = berth_agent::start(agent_config(&identity, dir.path(), Some(forged)), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "refused, not retried: {:?}", started.elapsed());
    match &err {
        AgentError::Join(berth_agent::JoinError::Refused { code, message }) => {
            assert_eq!(*code, tonic::Code::Unauthenticated, "{message}");
            assert!(message.contains("join token"), "{message}");
        }
        other => panic!("expected a refused join, got {other}"),
    }
    assert!(identity.nodes().await.is_empty());

    let err =
        berth_agent::start(agent_config(&identity, dir.path(), None), CancellationToken::new()).await.unwrap_err();
    assert!(matches!(err, AgentError::NoIdentity { .. }), "{err}");
    assert!(err.to_string().contains("--join-token"), "{err}");
    identity.cleanup().await;
}

#[tokio::test]
async fn an_identity_that_expired_while_stopped_needs_a_token_and_rejoins_with_it() {
    let ttl = Duration::from_secs(2);
    let identity = IdentityUnderTest::start(ttl, node_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let token = identity.token(2).await;
    let agent = RunningAgent::start(agent_config(&identity, dir.path(), Some(token.clone()))).await;
    let (first_node, _) = agent.up().await;
    let expires = agent.handle.credentials().not_after();
    agent.stop().await.unwrap();
    let wait = u64::try_from(expires).unwrap().saturating_sub(secs(SystemTime::now())) + 1;
    tokio::time::sleep(Duration::from_secs(wait)).await;

    let err =
        berth_agent::start(agent_config(&identity, dir.path(), None), CancellationToken::new()).await.unwrap_err();
    assert!(matches!(&err, AgentError::CertificateExpired { node_id, .. } if *node_id == first_node), "{err}");
    assert!(err.to_string().contains("--join-token"), "{err}");

    let agent = RunningAgent::start(agent_config(&identity, dir.path(), Some(token))).await;
    let (node_id, _) = agent.up().await;
    assert_ne!(node_id, first_node, "a token join is a new node");
    identity.node_until(&node_id, "UP", |n| n.state == up()).await;
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn an_agent_restored_from_a_backup_is_refused_its_superseded_certificate_and_rejoins_with_its_token() {
    let ttl = Duration::from_secs(10);
    let timing = NodeTiming { certificate_overlap: Duration::from_millis(200), ..node_timing() };
    let identity = IdentityUnderTest::start(ttl, timing).await;
    let dir = tempfile::tempdir().unwrap();
    let token = identity.token(2).await;
    let agent = RunningAgent::start(agent_config(&identity, dir.path(), Some(token.clone()))).await;
    let (old_node, _) = agent.up().await;
    // A backup of the data directory, taken before the node renews.
    let backup = tempfile::tempdir().unwrap();
    let copied =
        std::process::Command::new("cp").arg("-a").arg(dir.path().join(".")).arg(backup.path()).status().unwrap();
    assert!(copied.success());
    let joined_expiry = agent.handle.credentials().not_after();
    eventually("the node to renew", PATIENCE, || async {
        let expiry = agent.handle.credentials().not_after();
        if expiry == joined_expiry { Err(expiry) } else { Ok(()) }
    })
    .await;
    // Presented on a heartbeat, then past the overlap: the backup's
    // certificate, still unexpired, is no longer the node's.
    identity.node_until(&old_node, "marked with its renewal", |n| n.certificate_next_floor.is_some()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    agent.stop().await.unwrap();

    // The host restored from the backup.
    let agent = RunningAgent::start(agent_config(&identity, backup.path(), Some(token))).await;
    let fences = agent.handle.fences();
    let status =
        agent.status_until("up as a new node", |s| s.is_up() && s.session().unwrap().node_id != old_node).await;
    let fence = fences.borrow().clone().unwrap();
    assert_eq!(
        (fence.session.node_id.as_str(), fence.reason),
        (old_node.as_str(), FenceReason::CertificateSuperseded),
        "refused as superseded, not expired: the backup's certificate was still valid"
    );
    identity.node_until(&status.session().unwrap().node_id, "UP", |n| n.state == up()).await;
    assert_eq!(identity.token_uses().await, vec![2], "the token brought the host back");
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn a_token_rotated_in_its_file_is_the_one_a_forgotten_node_rejoins_with() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), forgetting_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let token_file = secrets.path().join("token");
    // A single-use token: spent by the first join.
    std::fs::write(&token_file, identity.token(1).await).unwrap();
    let mut config = agent_config(&identity, dir.path(), None);
    config.join_token_file = Some(token_file.clone());
    let agent = RunningAgent::start(config).await;
    let (old_node, _) = agent.up().await;

    // The operator rotates the token: the Secret's file is rewritten in place.
    std::fs::write(&token_file, identity.token(1).await).unwrap();
    identity.forget_while_cut_off(&old_node).await;

    let status =
        agent.status_until("up as a new node", |s| s.is_up() && s.session().unwrap().node_id != old_node).await;
    identity.node_until(&status.session().unwrap().node_id, "UP", |n| n.state == up()).await;
    let mut uses = identity.token_uses().await;
    uses.sort_unstable();
    assert_eq!(uses, vec![1, 1], "each token joined once: the rotated one brought the host back");
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn a_forgotten_node_discards_its_identity_and_rejoins_with_its_token() {
    let identity = IdentityUnderTest::start(Duration::from_secs(600), forgetting_timing()).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = RunningAgent::start(agent_config(&identity, dir.path(), Some(identity.token(2).await))).await;
    let (old_node, _) = agent.up().await;
    let fences = agent.handle.fences();

    identity.forget_while_cut_off(&old_node).await;

    let status =
        agent.status_until("up as a new node", |s| s.is_up() && s.session().unwrap().node_id != old_node).await;
    let new_node = status.session().unwrap().node_id.clone();
    let fence = fences.borrow().clone().unwrap();
    assert_eq!((fence.session.node_id.as_str(), fence.reason), (old_node.as_str(), FenceReason::Forgotten));
    assert_eq!(agent.handle.node_id(), new_node);
    identity.node_until(&new_node, "UP", |n| n.state == up()).await;
    let kept = std::fs::read_to_string(dir.path().join("identity/node.json")).unwrap();
    assert!(kept.contains(&new_node) && !kept.contains(&old_node), "the old identity is gone: {kept}");
    assert_eq!(identity.token_uses().await, vec![2], "the token brought the host back");
    agent.stop().await.unwrap();
    identity.cleanup().await;
}

#[tokio::test]
async fn a_rotated_ca_reaches_the_agent_before_it_signs_and_renewals_follow_it() {
    use berth_mtls::{certs_from_pem, verify_chain};
    let authority = AuthorityTiming { min_prepared: Duration::ZERO, ..AuthorityTiming::default() };
    // Short enough to see a renewal under the new CA, long enough that a
    // loaded machine answers the first heartbeat well before the first
    // certificate (whose notAfter is in whole seconds) runs out.
    let identity = IdentityUnderTest::start_with(Duration::from_secs(6), node_timing(), authority).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = identity.join_agent(dir.path()).await;
    agent.up().await;
    let watcher = agent.trouble_seen();

    let prepared = identity.rotate_ca(false).await;
    assert_eq!(certs_from_pem("bundle", &prepared).unwrap().len(), 2);
    // Until the node has acknowledged the bundle holding the new CA, it
    // cannot be activated: the refusal names the node.
    let early = identity.try_rotate_ca(true).await.unwrap_err();
    assert_eq!(early.code(), tonic::Code::FailedPrecondition, "{early:?}");
    assert!(early.message().contains(&agent.handle.node_id()), "{}", early.message());
    eventually("the prepared CA to reach the agent", PATIENCE, || async {
        let bundle = agent.handle.credentials().material().ca_bundle_pem;
        if bundle == prepared { Ok(()) } else { Err(bundle) }
    })
    .await;
    let kept = std::fs::read_to_string(dir.path().join("identity/ca.pem")).unwrap();
    assert_eq!(kept, prepared, "the new bundle is kept for the next start");
    // The operator's client learns the new bundle too.
    let mut admin = identity.admin.material();
    admin.ca_bundle_pem = prepared.clone();
    identity.admin.reload(admin).unwrap();

    // Once its next heartbeat says it has the bundle, activation goes through.
    eventually("activation to be allowed", PATIENCE, || identity.try_rotate_ca(true)).await;
    // The prepared CA is the second in the bundle; once active, renewals are
    // signed by it alone.
    let new_ca = prepared.split_inclusive("-----END CERTIFICATE-----").nth(1).unwrap().trim().to_string() + "\n";
    eventually("the node to renew under the new CA", PATIENCE, || async {
        verify_chain(&agent.handle.credentials().material().cert_chain_pem, &new_ca)
    })
    .await;
    let served = served_fingerprint(agent.handle.local_addr(), &identity.admin).await;
    assert_eq!(served, pem_fingerprint(&agent.handle.credentials().material().cert_chain_pem));
    agent.up().await;
    agent.stop().await.unwrap();
    let trouble = watcher.await.unwrap();
    assert!(trouble.is_empty(), "the rotation disturbed the session: {trouble:?}");
    identity.cleanup().await;
}

#[tokio::test]
async fn a_node_away_through_a_forced_ca_activation_is_told_how_to_recover_and_does() {
    let authority = AuthorityTiming { min_prepared: Duration::ZERO, ..AuthorityTiming::default() };
    let identity = IdentityUnderTest::start_with(Duration::from_secs(3600), node_timing(), authority).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = identity.join_agent(dir.path()).await;
    agent.up().await;
    agent.stop().await.unwrap();

    // While the node is away, a new CA is prepared and activated by force,
    // and identity serves a certificate it signed.
    identity.rotate_ca(false).await;
    let bundle = identity.force_activate().await;
    assert_ne!(bundle, identity.bundle);

    // Back with only the bundle it had, it cannot verify identity, and its
    // status says why and what to do.
    let stale = RunningAgent::start(agent_config(&identity, dir.path(), None)).await;
    let told = stale
        .status_until(
            "told how to recover",
            |s| matches!(s, AgentStatus::Retrying { last_error, .. } if last_error.contains("--ca-file")),
        )
        .await;
    let AgentStatus::Retrying { last_error, .. } = told else { unreachable!() };
    assert!(last_error.contains("a CA rotation was activated while this node was away"), "{last_error}");
    stale.stop().await.unwrap();

    // Restarted with the current bundle, as told, it is UP again and keeps
    // identity's bundle for its next start.
    let mut config = agent_config(&identity, dir.path(), None);
    config.ca_bundle_pem = bundle.clone();
    let back = RunningAgent::start(config).await;
    back.up().await;
    eventually("the current bundle to be kept", PATIENCE, || async {
        let kept = std::fs::read_to_string(dir.path().join("identity/ca.pem")).unwrap();
        if kept == bundle { Ok(()) } else { Err(kept) }
    })
    .await;
    back.stop().await.unwrap();
    identity.cleanup().await;
}
