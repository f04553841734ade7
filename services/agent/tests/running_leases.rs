//! The agent running leases for the real identity and leases services, in
//! process: a lease asked for through the Leases API runs on the node, its
//! phases and exit status reach the ledger, a restarted agent adopts what
//! still runs and destroys what no lease covers, and the agent API shows
//! the instance, its logs, and signals it.
//!
//! Identity and leases each run on their own SQLite file and in-process bus,
//! on loopback mTLS ports, the way `berth dev` runs them.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use berth_agent::{AgentConfig, AgentHandle, AgentStatus, AgentTiming, Capacity, FenceReason, LeaseTiming};
use berth_core::Identity;
use berth_identity::{IdentityConfig, IdentityService, KeptIdentity, NodeTiming};
use berth_leases::{LeasesConfig, LeasesService};
use berth_mtls::TlsCredentials;
use berth_proto::agent::v1 as agent;
use berth_proto::agent::v1::agent_client::AgentClient;
use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::leases::v1::capacity_client::CapacityClient;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_proto::types::v1 as types;
use berth_rpc::{Channel, Revocations};
use berth_runtime::{NodeDirectory, ServiceContext, follow_nodes};
use berth_store::ElectionTiming;
use berth_store::testing::TestDb;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;

const SECRET: &str = "0123456789abcdef0123456789abcdef-lease-test";

/// What the agent advertises; its host is in the node certificate, so the
/// agent API verifies when dialled at 127.0.0.1.
const ADVERTISE: &str = "127.0.0.1:7447";

/// Long enough for anything on a loaded two-core machine; tests that pass
/// finish far sooner.
const PATIENCE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Identity and leases, in process
// ---------------------------------------------------------------------------

/// Node timings in milliseconds: beats every 100 ms, and nobody down,
/// reaped or forgotten unless a test says so.
fn node_timing() -> NodeTiming {
    NodeTiming {
        heartbeat_interval: Duration::from_millis(100),
        down_after: Duration::from_secs(5),
        reap_after: Duration::from_secs(3600),
        forget_after: Duration::from_secs(7200),
        reset_grace: Duration::from_secs(5),
        persist_every: Duration::from_millis(200),
        monitor_every: Duration::from_millis(50),
        resync_every: Duration::from_secs(1),
        election: ElectionTiming::from_ttl(Duration::from_millis(900)),
        ..NodeTiming::default()
    }
}

struct ControlPlane {
    dbs: Vec<TestDb>,
    identity_addr: String,
    leases_addr: String,
    bundle: String,
    admin: TlsCredentials,
    token: String,
    stop: CancellationToken,
}

impl ControlPlane {
    /// Identity with fast node timings and leases whose leases live `ttl`
    /// (and may be taken back into custody for as long after expiring).
    async fn start(ttl: Duration) -> ControlPlane {
        Self::start_with(ttl, node_timing()).await
    }

    async fn start_with(ttl: Duration, nodes: NodeTiming) -> ControlPlane {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let stop = CancellationToken::new();

        let identity_db = TestDb::sqlite().await.unwrap();
        identity_db.store().migrate(berth_identity::MIGRATIONS).await.unwrap();
        let config = IdentityConfig {
            auth_secret: SECRET.into(),
            authority: Default::default(),
            node_cert_ttl: Duration::from_secs(600),
        };
        let service =
            IdentityService::open(identity_db.store().clone(), berth_bus::testing::memory_bus().unwrap(), config)
                .await
                .unwrap()
                .with_node_timing(nodes);
        let authority = service.authority().clone();
        let issue = |identity: Identity| {
            let authority = authority.clone();
            async move {
                KeptIdentity::issue(&authority, identity, vec!["127.0.0.1".into()], Duration::from_secs(3600))
                    .await
                    .unwrap()
                    .credentials
            }
        };
        let identity_creds = issue(Identity::service("identity").unwrap()).await;
        let listener = berth_rpc::Listener::bind("127.0.0.1:0".parse().unwrap(), identity_creds).await.unwrap();
        let identity_addr = listener.local_addr().unwrap().to_string();
        service.spawn_loops(&stop);
        tokio::spawn(service.server().serve(listener, stop.clone()));
        let admin = issue(Identity::admin("ops").unwrap()).await;

        let leases_db = TestDb::sqlite().await.unwrap();
        leases_db.store().migrate(berth_leases::MIGRATIONS).await.unwrap();
        let leases_creds = issue(Identity::service("leases").unwrap()).await;
        let ctx = ServiceContext {
            store: leases_db.store().clone(),
            bus: berth_bus::testing::memory_bus().unwrap(),
            credentials: leases_creds.clone(),
            revocations: Revocations::new(),
            nodes: NodeDirectory::new(),
        };
        follow_nodes(
            identity_addr.clone(),
            leases_creds.clone(),
            ctx.nodes.clone(),
            ctx.revocations.clone(),
            stop.clone(),
        );
        let config = LeasesConfig {
            reap_every: Duration::from_millis(50),
            assignment_resync: Duration::from_millis(500),
            index_resync: Duration::from_millis(500),
            election: ElectionTiming::from_ttl(Duration::from_millis(900)),
            ..LeasesConfig::with_lease_ttl(ttl)
        };
        let leases = LeasesService::new(&ctx, config);
        leases.spawn_loops(&stop);
        let listener = berth_rpc::Listener::bind("127.0.0.1:0".parse().unwrap(), leases_creds).await.unwrap();
        let leases_addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(leases.server().serve(listener, stop.clone()));

        let bundle = authority.bundle_pem().await.unwrap();
        let mut plane = ControlPlane {
            dbs: vec![identity_db, leases_db],
            identity_addr,
            leases_addr,
            bundle,
            admin,
            token: String::new(),
            stop,
        };
        let request = identity::CreateJoinTokenRequest { max_uses: 1, ttl_seconds: 600, ..Default::default() };
        plane.token = identity::join_tokens_client::JoinTokensClient::new(plane.channel(&plane.identity_addr))
            .create_join_token(request)
            .await
            .unwrap()
            .into_inner()
            .token;
        plane
    }

    fn channel(&self, addr: &str) -> Channel {
        berth_rpc::connect(addr, self.admin.clone()).unwrap()
    }

    fn leases(&self) -> LeasesClient<Channel> {
        LeasesClient::new(self.channel(&self.leases_addr))
    }

    /// Asks for a lease running `sh -c script`, retrying while leases has not
    /// yet learned of the node.
    async fn request(&self, key: &str, script: &str) -> leases::Lease {
        let request = leases::RequestLeaseRequest {
            owner: "tests/running-leases".into(),
            idempotency_key: key.into(),
            resources: Some(types::Capacity { cpu_millis: 250, memory_bytes: 64 << 20 }),
            workload: Some(leases::Workload {
                command: "sh".into(),
                args: vec!["-c".into(), script.into()],
                env: [("GREETING".to_string(), "hello".to_string())].into(),
                service: "web".into(),
                ports: vec![types::Port { name: "http".into(), port: 8080 }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            match self.leases().request_lease(request.clone()).await {
                Ok(response) => return response.into_inner().lease.unwrap(),
                Err(status) => {
                    assert!(tokio::time::Instant::now() < deadline, "the lease was never placed: {status:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn lease(&self, lease_id: &str) -> leases::Lease {
        let request = leases::GetLeaseRequest { lease_id: lease_id.into() };
        self.leases().get_lease(request).await.unwrap().into_inner().lease.unwrap()
    }

    async fn phase_until(&self, lease_id: &str, phase: LeasePhase) -> leases::Lease {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let lease = self.lease(lease_id).await;
            if lease.phase() == phase {
                return lease;
            }
            assert!(tokio::time::Instant::now() < deadline, "lease {lease_id} never {phase:?}: {lease:?}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn release(&self, lease_id: &str) {
        let request = leases::ReleaseLeaseRequest { lease_id: lease_id.into(), reason: String::new() };
        self.leases().release_lease(request).await.unwrap();
    }

    async fn node(&self, node_id: &str) -> identity::Node {
        let request = identity::GetNodeRequest { node_id: node_id.into() };
        identity::nodes_client::NodesClient::new(self.channel(&self.identity_addr))
            .get_node(request)
            .await
            .unwrap()
            .into_inner()
            .node
            .unwrap()
    }

    async fn node_capacity(&self, node_id: &str) -> leases::NodeCapacity {
        let listed = CapacityClient::new(self.channel(&self.leases_addr))
            .list_node_capacity(leases::ListNodeCapacityRequest::default())
            .await
            .unwrap()
            .into_inner();
        listed.nodes.into_iter().find(|n| n.node_id == node_id).unwrap()
    }

    async fn cleanup(self) {
        self.stop.cancel();
        for db in self.dbs {
            db.cleanup().await.unwrap();
        }
    }
}

/// Relays TCP to identity; while down it cuts every connection, like a
/// partition between the node and identity alone.
struct Relay {
    addr: String,
    down: Arc<AtomicBool>,
    cuts: watch::Sender<u64>,
    accepting: JoinHandle<()>,
}

impl Relay {
    async fn start(target: &str) -> Relay {
        let target = target.to_string();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let down = Arc::new(AtomicBool::new(false));
        let cuts = watch::channel(0u64).0;
        let (d, c) = (down.clone(), cuts.clone());
        let accepting = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else { continue };
                if d.load(Ordering::SeqCst) {
                    continue;
                }
                let mut cut = c.subscribe();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(target).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Relay { addr, down, cuts, accepting }
    }

    fn go_down(&self) {
        self.down.store(true, Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }

    fn come_back(&self) {
        self.down.store(false, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cuts.send_modify(|n| *n += 1);
    }
}

// ---------------------------------------------------------------------------
// The agent
// ---------------------------------------------------------------------------

fn agent_config(plane: &ControlPlane, dir: &Path) -> AgentConfig {
    let capacity = Capacity { cpu_millis: 2000, memory_bytes: 4 << 30 };
    let mut config =
        AgentConfig::new(plane.identity_addr.clone(), dir, ADVERTISE, "127.0.0.1:0".parse().unwrap(), capacity);
    config.ca_bundle_pem = plane.bundle.clone();
    config.join_token = Some(plane.token.clone());
    config.name = "lease-host".into();
    config.timing = AgentTiming {
        retry_initial: Duration::from_millis(50),
        retry_max: Duration::from_millis(400),
        rpc_timeout: Duration::from_secs(5),
        min_heartbeat_interval: Duration::from_millis(10),
        max_heartbeat_interval: Duration::from_secs(5),
    };
    config.leases = Some(plane.leases_addr.clone());
    config.lease_timing = LeaseTiming {
        renew_interval: Duration::from_millis(200),
        sweep_interval: Duration::from_secs(1),
        stop_grace: Duration::from_secs(3),
        exit_poll: Duration::from_millis(50),
        log_poll: Duration::from_millis(50),
        retain_finished: Duration::from_secs(3600),
    };
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
        let mut status = handle.status();
        tokio::time::timeout(PATIENCE, status.wait_for(AgentStatus::is_up)).await.unwrap().unwrap();
        RunningAgent { handle, stop }
    }

    /// Stops the agent the way `kill -9` would as far as its workloads go:
    /// its tasks end and nothing of theirs is stopped.
    async fn kill(self) {
        self.stop.cancel();
        self.handle.wait().await.unwrap();
    }

    fn api(&self, plane: &ControlPlane) -> AgentClient<Channel> {
        AgentClient::new(plane.channel(&self.handle.local_addr().to_string()))
    }

    async fn instance_until(
        &self,
        plane: &ControlPlane,
        lease_id: &str,
        what: &str,
        pred: impl Fn(&agent::Instance) -> bool,
    ) -> agent::Instance {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let listed = self.api(plane).list_instances(agent::ListInstancesRequest::default()).await.unwrap();
            let found = listed.into_inner().instances.into_iter().find(|i| i.lease_id == lease_id);
            if let Some(instance) = found.as_ref().filter(|i| pred(i)) {
                return instance.clone();
            }
            assert!(tokio::time::Instant::now() < deadline, "instance of {lease_id} never {what}: {found:?}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

/// The agent's data directory: dropping it kills every process still
/// working in it first, so a failed test leaves no workload running behind.
struct TestDir(tempfile::TempDir);

impl TestDir {
    fn new() -> Self {
        Self(tempfile::tempdir().unwrap())
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        for entry in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            let cwd = std::fs::read_link(entry.path().join("cwd"));
            if cwd.is_ok_and(|cwd| cwd.starts_with(self.0.path()))
                && let Some(pid) = rustix::process::Pid::from_raw(pid)
            {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`), or
/// `None` when it no longer runs.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

async fn gone_until(pid: u32) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while start_ticks(pid).is_some() {
        assert!(tokio::time::Instant::now() < deadline, "process {pid} still runs");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_lease_runs_to_done_and_a_failing_one_is_failed_with_its_exit_code() {
    let plane = ControlPlane::start(Duration::from_secs(5)).await;
    let dir = TestDir::new();
    let agent = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let node_id = agent.handle.node_id();

    let lease = plane.request("ok", "sleep 1; exit 0").await;
    assert_eq!(lease.node_id, node_id);
    let running = plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    assert_eq!(plane.node_capacity(&node_id).await.leases, 1);
    let instance = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await;
    assert_eq!((instance.service.as_str(), instance.port, instance.epoch), ("web", 8080, running.epoch));
    let done = plane.phase_until(&lease.lease_id, LeasePhase::Done).await;
    assert_eq!(done.exit_code, Some(0));
    assert_eq!(done.reason, "Exited");
    let capacity = plane.node_capacity(&node_id).await;
    assert_eq!(capacity.leases, 0, "the capacity is returned: {capacity:?}");
    assert_eq!(capacity.allocated.unwrap().cpu_millis, 0);

    let lease = plane.request("three", "exit 3").await;
    let failed = plane.phase_until(&lease.lease_id, LeasePhase::Failed).await;
    assert_eq!(failed.exit_code, Some(3));
    assert_eq!(failed.reason, "Exited");
    assert!(failed.message.contains("exited with code 3"), "{failed:?}");
    let instance = agent.instance_until(&plane, &lease.lease_id, "failed", |i| i.exit_code.is_some()).await;
    assert_eq!((instance.exit_code, instance.pid), (Some(3), 0));
    assert_eq!(plane.node_capacity(&node_id).await.leases, 0);

    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_killed_agent_leaves_its_workload_running_and_the_next_one_adopts_it() {
    let plane = ControlPlane::start(Duration::from_secs(3)).await;
    let dir = TestDir::new();
    let first = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let lease = plane.request("adopt", "exec sleep 1000").await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = first.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;
    let started = start_ticks(pid).unwrap();
    first.kill().await;
    assert_eq!(start_ticks(pid), Some(started), "killing the agent left the workload alone");

    let second = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let adopted = second.instance_until(&plane, &lease.lease_id, "adopted", |i| i.epoch > lease.epoch).await;
    assert_eq!(adopted.pid, pid, "the same process, not a new one");
    assert_eq!(start_ticks(pid), Some(started));
    assert_eq!(adopted.phase(), LeasePhase::Running);
    // Two TTLs later the lease is still RUNNING: the new agent renews it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let lease_now = plane.lease(&lease.lease_id).await;
    assert_eq!(lease_now.phase(), LeasePhase::Running, "{lease_now:?}");
    assert_eq!(lease_now.epoch, adopted.epoch);
    assert_eq!(start_ticks(pid), Some(started));

    plane.release(&lease.lease_id).await;
    gone_until(pid).await;
    second.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_workload_whose_lease_expired_while_the_agent_was_away_is_destroyed() {
    let ttl = Duration::from_secs(1);
    let plane = ControlPlane::start(ttl).await;
    let dir = TestDir::new();
    let first = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let lease = plane.request("orphan", "sleep 1000 & exec sleep 1000").await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = first.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;
    first.kill().await;

    plane.phase_until(&lease.lease_id, LeasePhase::Expired).await;
    // Past the custody window too: the lease cannot be taken back.
    tokio::time::sleep(ttl * 2).await;
    assert!(start_ticks(pid).is_some(), "the orphan ran on while no agent watched");

    let second = RunningAgent::start(agent_config(&plane, dir.path())).await;
    gone_until(pid).await;
    let instance = second.instance_until(&plane, &lease.lease_id, "settled", |i| i.pid == 0).await;
    assert!(!instance.reason.is_empty(), "{instance:?}");
    assert_eq!(plane.lease(&lease.lease_id).await.phase(), LeasePhase::Expired);
    second.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn the_agent_api_shows_the_logs_and_a_term_signal_ends_the_workload() {
    let plane = ControlPlane::start(Duration::from_secs(5)).await;
    let dir = TestDir::new();
    let agent = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let script = "echo $GREETING from $BERTH_LEASE_ID; echo oops >&2; \
                  trap 'echo bye; exit 0' TERM; while true; do sleep 0.05; done";
    let lease = plane.request("logs", script).await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await;

    let logs = |follow| agent::GetLogsRequest { lease_id: lease.lease_id.clone(), follow, tail_lines: 0 };
    let expected = format!("hello from {}\n", lease.lease_id);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let (stdout, stderr) = loop {
        let mut stream = agent.api(&plane).get_logs(logs(false)).await.unwrap().into_inner();
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            match chunk.stream() {
                agent::LogStream::Stdout => stdout.extend(chunk.data),
                agent::LogStream::Stderr => stderr.extend(chunk.data),
                agent::LogStream::Unspecified => panic!("a chunk from no stream"),
            }
        }
        if stdout == expected.as_bytes() && stderr == b"oops\n" {
            break (stdout, stderr);
        }
        assert!(tokio::time::Instant::now() < deadline, "logs were {stdout:?} / {stderr:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((stdout.len(), stderr.len()), (expected.len(), 5));

    let stats = agent
        .api(&plane)
        .get_stats(agent::GetStatsRequest { lease_id: lease.lease_id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert!(stats.memory_bytes > 0, "{stats:?}");

    // Follow, then ask the workload to stop: its goodbye arrives and the
    // stream ends with the lease.
    let mut followed = agent.api(&plane).get_logs(logs(true)).await.unwrap().into_inner();
    let signal = agent::SignalInstanceRequest { lease_id: lease.lease_id.clone(), signal: agent::Signal::Term as i32 };
    agent.api(&plane).signal_instance(signal).await.unwrap();
    let mut seen = Vec::new();
    let ended = tokio::time::timeout(PATIENCE, async {
        while let Some(chunk) = followed.next().await {
            let chunk = chunk.unwrap();
            if chunk.stream() == agent::LogStream::Stdout {
                seen.extend(chunk.data);
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the followed log never ended; saw {:?}", String::from_utf8_lossy(&seen));
    assert_eq!(String::from_utf8_lossy(&seen), format!("{expected}bye\n"));
    let done = plane.phase_until(&lease.lease_id, LeasePhase::Done).await;
    assert_eq!(done.exit_code, Some(0));

    // A workload that does not catch TERM is killed by it: FAILED.
    let lease = plane.request("killed", "exec sleep 1000").await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;
    let signal = agent::SignalInstanceRequest { lease_id: lease.lease_id.clone(), signal: agent::Signal::Term as i32 };
    agent.api(&plane).signal_instance(signal).await.unwrap();
    let failed = plane.phase_until(&lease.lease_id, LeasePhase::Failed).await;
    assert_eq!((failed.reason.as_str(), failed.exit_code), ("Killed", None));
    assert!(failed.message.contains("SIGTERM"), "{failed:?}");
    gone_until(pid).await;

    // What a caller gets wrong is named.
    let unknown = agent::SignalInstanceRequest { lease_id: "no-such-lease".into(), signal: agent::Signal::Term as i32 };
    let status = agent.api(&plane).signal_instance(unknown).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    let unset = agent::SignalInstanceRequest { lease_id: lease.lease_id.clone(), signal: 0 };
    let status = agent.api(&plane).signal_instance(unset).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("signal"), "{status:?}");
    let status =
        agent.api(&plane).get_stats(agent::GetStatsRequest { lease_id: lease.lease_id.clone() }).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "an ended instance has no stats: {status:?}");

    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_fenced_node_holds_its_workload_in_custody_and_takes_it_back_after_rejoining() {
    let nodes = NodeTiming {
        down_after: Duration::from_millis(600),
        reap_after: Duration::from_millis(500),
        reset_grace: Duration::from_millis(600),
        ..node_timing()
    };
    let plane = ControlPlane::start_with(Duration::from_secs(3), nodes).await;
    let relay = Relay::start(&plane.identity_addr).await;
    let dir = TestDir::new();
    let mut config = agent_config(&plane, dir.path());
    config.server = relay.addr.clone();
    let agent = RunningAgent::start(config).await;
    let node_id = agent.handle.node_id();
    let lease = plane.request("fenced", "exec sleep 1000").await;
    let running = plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;
    let started = start_ticks(pid).unwrap();
    let mut fences = agent.handle.fences();

    // Cut off from identity long enough to be reaped: the next heartbeat
    // that gets through is told the incarnation is fenced.
    relay.go_down();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while plane.node(&node_id).await.incarnation < 2 {
        assert!(tokio::time::Instant::now() < deadline, "the node was never reaped");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.come_back();
    tokio::time::timeout(PATIENCE, fences.changed()).await.expect("the agent never saw the fence").unwrap();
    assert_eq!(fences.borrow().as_ref().unwrap().reason, FenceReason::Fenced);

    // After the rejoin the workload is taken back, not restarted.
    let adopted = agent.instance_until(&plane, &lease.lease_id, "taken back", |i| i.epoch > running.epoch).await;
    assert_eq!(adopted.pid, pid);
    assert_eq!(start_ticks(pid), Some(started));
    let lease_now = plane.lease(&lease.lease_id).await;
    assert_eq!((lease_now.phase(), lease_now.epoch), (LeasePhase::Running, adopted.epoch));
    assert!(agent.handle.session().borrow().incarnation >= 2);

    plane.release(&lease.lease_id).await;
    gone_until(pid).await;
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_revoked_node_destroys_its_workloads_before_the_agent_exits() {
    let plane = ControlPlane::start(Duration::from_secs(5)).await;
    let dir = TestDir::new();
    let agent = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let lease = plane.request("revoked", "sleep 1000 & exec sleep 1000").await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;

    let request = identity::RevokeNodeRequest { node_id: agent.handle.node_id(), reason: "decommissioned".into() };
    identity::nodes_client::NodesClient::new(plane.channel(&plane.identity_addr)).revoke_node(request).await.unwrap();
    let stopped = tokio::time::timeout(PATIENCE, agent.handle.wait()).await.expect("the agent never stopped");
    assert!(matches!(stopped, Err(berth_agent::AgentError::Revoked { .. })), "{stopped:?}");
    assert_eq!(start_ticks(pid), None, "the agent exited while its workload still ran");
    plane.cleanup().await;
}

#[tokio::test]
async fn a_node_that_cannot_rejoin_holds_its_workload_until_the_custody_bound_and_only_then_exits() {
    let nodes = NodeTiming {
        down_after: Duration::from_millis(600),
        reap_after: Duration::from_millis(300),
        forget_after: Duration::from_millis(300),
        reset_grace: Duration::from_millis(600),
        ..node_timing()
    };
    let plane = ControlPlane::start_with(Duration::from_secs(30), nodes).await;
    let relay = Relay::start(&plane.identity_addr).await;
    let dir = TestDir::new();
    let mut config = agent_config(&plane, dir.path());
    config.server = relay.addr.clone();
    RunningAgent::start(config.clone()).await.kill().await;
    // Resumed without a token: once identity forgets the node, nothing can
    // bring it back.
    config.join_token = None;
    let bound = Duration::from_millis(1500);
    config.max_custody = Some(bound);
    let agent = RunningAgent::start(config).await;
    let node_id = agent.handle.node_id();
    let lease = plane.request("stranded", "exec sleep 1000").await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;
    let mut fences = agent.handle.fences();

    relay.go_down();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let request = identity::GetNodeRequest { node_id: node_id.clone() };
        let found =
            identity::nodes_client::NodesClient::new(plane.channel(&plane.identity_addr)).get_node(request).await;
        if found.is_err_and(|status| status.code() == tonic::Code::NotFound) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the node was never forgotten");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.come_back();
    tokio::time::timeout(PATIENCE, fences.changed()).await.expect("the agent never saw the fence").unwrap();
    let fenced_at = tokio::time::Instant::now();
    assert_eq!(fences.borrow().as_ref().unwrap().reason, FenceReason::Forgotten);

    let waiting = tokio::spawn(agent.handle.wait());
    tokio::time::sleep(bound / 2).await;
    assert!(!waiting.is_finished(), "the agent exited while it held a workload in custody");
    assert!(start_ticks(pid).is_some(), "custody keeps the workload running");
    let stopped = tokio::time::timeout(PATIENCE, waiting).await.expect("the agent never stopped").unwrap();
    assert!(fenced_at.elapsed() >= bound, "destroyed before the bound");
    assert!(matches!(stopped, Err(berth_agent::AgentError::RejoinNeedsToken { .. })), "{stopped:?}");
    assert_eq!(start_ticks(pid), None, "the agent exited while its workload still ran");
    drop(agent.stop);
    plane.cleanup().await;
}
