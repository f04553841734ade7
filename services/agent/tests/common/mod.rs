//! The harness the agent's lease tests share: identity and leases in
//! process, each on its own SQLite file and in-process bus, on loopback
//! mTLS ports the way `berth dev` runs them, and an agent joined to them.

#![allow(dead_code, reason = "each test binary uses a part of the harness")]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use berth_agent::{AgentConfig, AgentHandle, AgentStatus, AgentTiming, Capacity, LeaseTiming};
use berth_core::Identity;
use berth_identity::{
    GrpcLaunchLedger, IdentityConfig, IdentityService, KeptIdentity, LaunchLedger, NodeTiming, WorkloadSettings,
};
use berth_leases::LeasesConfig;
use berth_mtls::TlsCredentials;
use berth_proto::agent::v1 as agent;
use berth_proto::agent::v1::agent_client::AgentClient;
use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::leases::v1::capacity_client::CapacityClient;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_proto::types::v1 as types;
use berth_rpc::Channel;
use berth_store::ElectionTiming;
use berth_store::testing::TestDb;
use berth_testkit::{Backend, InProcessLeases, eventually};
use tokio_util::sync::CancellationToken;

pub(crate) const SECRET: &str = "0123456789abcdef0123456789abcdef-lease-test";

/// What the agent advertises; its host is in the node certificate, so the
/// agent API verifies when dialled at 127.0.0.1.
pub(crate) const ADVERTISE: &str = "127.0.0.1:7447";

/// How long these tests wait for the agent: longer than the kit's
/// `PATIENCE`, since a step may take pulling a bundle and starting a
/// container (gVisor above all) on a loaded machine.
pub(crate) const SLOW: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Identity and leases, in process
// ---------------------------------------------------------------------------

/// Node timings in milliseconds: beats every 100 ms, and nobody down,
/// reaped or forgotten unless a test says so.
pub(crate) fn node_timing() -> NodeTiming {
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

pub(crate) struct ControlPlane {
    identity_db: TestDb,
    leases: InProcessLeases,
    pub(crate) identity_addr: String,
    pub(crate) leases_addr: String,
    pub(crate) bundle: String,
    pub(crate) admin: TlsCredentials,
    /// A data-plane router's credentials.
    pub(crate) router: TlsCredentials,
    pub(crate) token: String,
    pub(crate) stop: CancellationToken,
    /// What identity checks workloads' leases with.
    pub(crate) workload_ledger: Arc<LateLedger>,
}

impl ControlPlane {
    /// Identity with fast node timings and leases whose leases live `ttl`
    /// (and may be taken back into custody for as long after expiring).
    pub(crate) async fn start(ttl: Duration) -> ControlPlane {
        Self::start_with(ttl, node_timing()).await
    }

    pub(crate) async fn start_with(ttl: Duration, nodes: NodeTiming) -> ControlPlane {
        Self::start_signing(ttl, nodes, berth_identity::DEFAULT_WORKLOAD_CERT_TTL).await
    }

    /// [`Self::start_with`], with workload certificates that live `cert_ttl`.
    pub(crate) async fn start_signing(ttl: Duration, nodes: NodeTiming, cert_ttl: Duration) -> ControlPlane {
        Self::start_configured(ttl, nodes, cert_ttl, |_| {}).await
    }

    /// [`Self::start`], with leases configured further by `configure`.
    pub(crate) async fn start_with_leases(ttl: Duration, configure: impl FnOnce(&mut LeasesConfig)) -> ControlPlane {
        Self::start_configured(ttl, node_timing(), berth_identity::DEFAULT_WORKLOAD_CERT_TTL, configure).await
    }

    async fn start_configured(
        ttl: Duration,
        nodes: NodeTiming,
        cert_ttl: Duration,
        configure: impl FnOnce(&mut LeasesConfig),
    ) -> ControlPlane {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let stop = CancellationToken::new();

        let identity_db = TestDb::sqlite().await.unwrap();
        identity_db.store().migrate(berth_identity::MIGRATIONS).await.unwrap();
        let config = IdentityConfig {
            auth_secret: SECRET.into(),
            authority: Default::default(),
            node_cert_ttl: Duration::from_secs(600),
        };
        // Identity checks workloads' leases with leases, which starts after
        // it (it follows identity's nodes): the ledger is connected then.
        let ledger = Arc::new(LateLedger::default());
        let service =
            IdentityService::open(identity_db.store().clone(), berth_bus::testing::memory_bus().unwrap(), config)
                .await
                .unwrap()
                .with_node_timing(nodes)
                .with_workload_settings(WorkloadSettings {
                    ledger: Some(ledger.clone() as Arc<dyn LaunchLedger>),
                    cert_ttl,
                    ..WorkloadSettings::default()
                });
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
        let router = issue(Identity::router("edge").unwrap()).await;

        let leases_creds = issue(Identity::service("leases").unwrap()).await;
        let mut config = LeasesConfig {
            reap_every: Duration::from_millis(50),
            assignment_resync: Duration::from_millis(500),
            index_resync: Duration::from_millis(500),
            election: ElectionTiming::from_ttl(Duration::from_millis(900)),
            ..LeasesConfig::with_lease_ttl(ttl)
        };
        configure(&mut config);
        let leases = InProcessLeases::start(Backend::Sqlite, leases_creds, &identity_addr, config, &stop).await;
        let leases_addr = leases.addr.to_string();
        let identity_me = issue(Identity::service("identity").unwrap()).await;
        ledger.ledger.set(GrpcLaunchLedger::connect(&leases_addr, identity_me).unwrap()).unwrap();

        let bundle = authority.bundle_pem().await.unwrap();
        let mut plane = ControlPlane {
            identity_db,
            leases,
            identity_addr,
            leases_addr,
            bundle,
            admin,
            router,
            token: String::new(),
            stop,
            workload_ledger: ledger,
        };
        plane.token = plane.join_token().await;
        plane
    }

    /// A new join token for one node.
    pub(crate) async fn join_token(&self) -> String {
        let request = identity::CreateJoinTokenRequest { max_uses: 1, ttl_seconds: 600, ..Default::default() };
        identity::join_tokens_client::JoinTokensClient::new(self.channel(&self.identity_addr))
            .create_join_token(request)
            .await
            .unwrap()
            .into_inner()
            .token
    }

    pub(crate) fn channel(&self, addr: &str) -> Channel {
        berth_rpc::connect(addr, self.admin.clone()).unwrap()
    }

    pub(crate) fn leases(&self) -> LeasesClient<Channel> {
        LeasesClient::new(self.channel(&self.leases_addr))
    }

    /// Asks for a lease running `sh -c script`, retrying while leases has not
    /// yet learned of the node.
    pub(crate) async fn request(&self, key: &str, script: &str) -> leases::Lease {
        let workload = leases::Workload {
            command: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: [("GREETING".to_string(), "hello".to_string())].into(),
            service: "web".into(),
            ports: vec![types::Port { name: "http".into(), port: 8080 }],
            ..Default::default()
        };
        self.request_workload(key, workload).await
    }

    /// Asks for a lease running `workload`, retrying while leases has not
    /// yet learned of the node.
    pub(crate) async fn request_workload(&self, key: &str, workload: leases::Workload) -> leases::Lease {
        let request = leases::RequestLeaseRequest {
            owner: "tests/running-leases".into(),
            idempotency_key: key.into(),
            resources: Some(types::Capacity { cpu_millis: 250, memory_bytes: 64 << 20 }),
            workload: Some(workload),
            ..Default::default()
        };
        eventually("the lease to be placed", SLOW, || async {
            self.leases().request_lease(request.clone()).await.map(|response| response.into_inner().lease.unwrap())
        })
        .await
    }

    pub(crate) async fn lease(&self, lease_id: &str) -> leases::Lease {
        let request = leases::GetLeaseRequest { lease_id: lease_id.into() };
        self.leases().get_lease(request).await.unwrap().into_inner().lease.unwrap()
    }

    pub(crate) async fn phase_until(&self, lease_id: &str, phase: LeasePhase) -> leases::Lease {
        eventually(&format!("lease {lease_id} to be {phase:?}"), SLOW, || async {
            let lease = self.lease(lease_id).await;
            if lease.phase() == phase { Ok(lease) } else { Err(lease) }
        })
        .await
    }

    pub(crate) async fn release(&self, lease_id: &str) {
        let request = leases::ReleaseLeaseRequest { lease_id: lease_id.into(), reason: String::new() };
        self.leases().release_lease(request).await.unwrap();
    }

    pub(crate) async fn node(&self, node_id: &str) -> identity::Node {
        let request = identity::GetNodeRequest { node_id: node_id.into() };
        identity::nodes_client::NodesClient::new(self.channel(&self.identity_addr))
            .get_node(request)
            .await
            .unwrap()
            .into_inner()
            .node
            .unwrap()
    }

    pub(crate) async fn node_capacity(&self, node_id: &str) -> leases::NodeCapacity {
        let listed = CapacityClient::new(self.channel(&self.leases_addr))
            .list_node_capacity(leases::ListNodeCapacityRequest::default())
            .await
            .unwrap()
            .into_inner();
        listed.nodes.into_iter().find(|n| n.node_id == node_id).unwrap()
    }

    pub(crate) async fn cleanup(self) {
        self.stop.cancel();
        self.identity_db.cleanup().await.unwrap();
        self.leases.cleanup(Backend::Sqlite).await;
    }
}

/// The leases ledger identity checks workloads with, connected once leases
/// serves; a test may have it refuse, as identity does when it was started
/// without leases' address.
#[derive(Debug, Default)]
pub(crate) struct LateLedger {
    ledger: OnceLock<GrpcLaunchLedger>,
    refusing: AtomicBool,
}

impl LateLedger {
    fn ledger(&self) -> Result<&GrpcLaunchLedger, tonic::Status> {
        if self.refusing.load(Ordering::SeqCst) {
            return Err(tonic::Status::failed_precondition(
                "identity cannot check a lease and signs no workload certificate",
            ));
        }
        self.ledger.get().ok_or_else(|| tonic::Status::unavailable("leases has not started yet"))
    }

    /// From now on, every workload certificate is refused.
    pub(crate) fn refuse(&self) {
        self.refusing.store(true, Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl LaunchLedger for LateLedger {
    async fn redeem(&self, registration: &str, node_id: &str) -> Result<leases::Lease, tonic::Status> {
        self.ledger()?.redeem(registration, node_id).await
    }

    async fn lease(&self, lease_id: &str) -> Result<leases::Lease, tonic::Status> {
        self.ledger()?.lease(lease_id).await
    }
}

// ---------------------------------------------------------------------------
// The agent
// ---------------------------------------------------------------------------

pub(crate) fn agent_config(plane: &ControlPlane, dir: &Path) -> AgentConfig {
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
        resize_settle: Duration::from_secs(2),
    };
    config
}

/// A control plane whose leases live `ttl`, and an agent on a fresh data
/// directory joined to it, once it is up.
pub(crate) async fn plane_with_agent(ttl: Duration) -> (ControlPlane, TestDir, RunningAgent) {
    let plane = ControlPlane::start(ttl).await;
    let dir = TestDir::new();
    let agent = RunningAgent::start(agent_config(&plane, dir.path())).await;
    (plane, dir, agent)
}

pub(crate) struct RunningAgent {
    pub(crate) handle: AgentHandle,
    pub(crate) stop: CancellationToken,
}

impl RunningAgent {
    pub(crate) async fn start(config: AgentConfig) -> RunningAgent {
        let stop = CancellationToken::new();
        let handle = berth_agent::start(config, stop.clone()).await.unwrap();
        let mut status = handle.status();
        tokio::time::timeout(SLOW, status.wait_for(AgentStatus::is_up)).await.unwrap().unwrap();
        RunningAgent { handle, stop }
    }

    /// Stops the agent the way `kill -9` would as far as its workloads go:
    /// its tasks end and nothing of theirs is stopped.
    pub(crate) async fn kill(self) {
        self.stop.cancel();
        self.handle.wait().await.unwrap();
    }

    pub(crate) fn api(&self, plane: &ControlPlane) -> AgentClient<Channel> {
        AgentClient::new(plane.channel(&self.handle.local_addr().to_string()))
    }

    /// Waits for lease `lease_id` to be RUNNING and for this agent to show
    /// its workload started; the instance then.
    pub(crate) async fn started(&self, plane: &ControlPlane, lease_id: &str) -> agent::Instance {
        plane.phase_until(lease_id, LeasePhase::Running).await;
        self.instance_until(plane, lease_id, "running", |i| i.pid != 0).await
    }

    pub(crate) async fn instance_until(
        &self,
        plane: &ControlPlane,
        lease_id: &str,
        what: &str,
        pred: impl Fn(&agent::Instance) -> bool,
    ) -> agent::Instance {
        eventually(&format!("the instance of {lease_id} to be {what}"), SLOW, || async {
            let listed = self.api(plane).list_instances(agent::ListInstancesRequest::default()).await.unwrap();
            match listed.into_inner().instances.into_iter().find(|i| i.lease_id == lease_id) {
                Some(instance) if pred(&instance) => Ok(instance),
                found => Err(found),
            }
        })
        .await
    }
}

/// The agent's data directory: dropping it kills every process still
/// working in it first, so a failed test leaves no workload running behind.
pub(crate) struct TestDir(tempfile::TempDir);

impl TestDir {
    pub(crate) fn new() -> Self {
        Self(tempfile::tempdir().unwrap())
    }

    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        berth_agent::destroy_containers(self.0.path());
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
pub(crate) fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

pub(crate) async fn gone_until(pid: u32) {
    eventually(&format!("process {pid} to end"), SLOW, || async {
        match start_ticks(pid) {
            None => Ok(()),
            Some(ticks) => Err(format!("process {pid} still runs, started at tick {ticks}")),
        }
    })
    .await;
}
