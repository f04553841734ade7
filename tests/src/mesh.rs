//! The mesh as production runs it, on one machine: every control-plane
//! service as separate processes (several replicas each, the real
//! binaries), a private PostgreSQL and Redis, node agents, and a [`Front`]
//! per service that clients, agents and the services themselves dial.
//!
//! # Expected flow
//! [`Mesh::start`] starts PostgreSQL and Redis, issues the admin and
//! service certificates straight from identity's state
//! ([`berth_identity::issue_from_state`], which creates the CA), starts
//! identity's replicas, then leases, revisions and egress, creates a join
//! token and starts the agents, and returns once every replica serves and
//! every agent's node is UP in identity and known to leases. From then on
//! any replica can be killed and started again ([`Mesh::kill_replica`],
//! [`Mesh::start_replica`]), PostgreSQL and Redis restarted, and agents
//! killed, restarted or cut off.
//!
//! # What is stored
//! One temporary directory, which every process of the mesh works in:
//! certificates (`certs/`), every process's log (`logs/<name>.log`,
//! appended across restarts), the agents' data directories (`agents/<i>/`),
//! the OCI layout bundles are pushed to (`oci/`), PostgreSQL's and Redis's
//! directories, and the run's owner file ([`crate::stale`]). It is removed
//! when the mesh is dropped, unless `BERTH_E2E_KEEP=1`, which keeps it (and
//! prints where) for a post-mortem.
//!
//! # Replica names
//! Replica `i` of a service runs with `HOSTNAME=<service>-<i>`, so the
//! holder names it campaigns under for its elected loops start with that
//! ([`Mesh::replica_of_holder`]).
//!
//! # Cleaning up
//! [`Mesh::shutdown`] stops the agents, kills every workload of the run
//! (they outlive their agents by design) and removes the network
//! namespaces agents made for them, then stops the services, Redis and
//! PostgreSQL. Dropping the mesh does the same without waiting: a failed
//! test leaves nothing running.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use berth_core::Identity;
use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_proto::identity::v1 as identity_v1;
use berth_proto::leases::v1 as leases_v1;
use berth_rpc::Channel;
use berth_store::ElectionTiming;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::agent::AgentProcess;
use crate::binaries::binary;
use crate::front::Front;
use crate::netns::NodeNetwork;
use crate::ports::free_loopback_addr;
use crate::postgres::PrivatePostgres;
use crate::process::{ManagedProcess, ProcessSpec};
use crate::redis::PrivateRedis;
use crate::workloads;

/// Keeps the mesh's directory after the mesh is dropped, for a post-mortem.
pub const KEEP_ENV: &str = "BERTH_E2E_KEEP";

/// Chooses how agents are isolated: `netns` or `loopback`.
pub const ISOLATION_ENV: &str = "BERTH_E2E_ISOLATION";

/// How long a replica may take from spawn to serving.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long agents may take to join and be known to leases.
const AGENTS_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one health check or lookup may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long processes get to stop after SIGTERM at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The lifetime of every certificate the mesh issues: longer than any run.
const CERT_TTL: Duration = Duration::from_secs(24 * 3600);

/// The admin identity tests call the mesh as: `e2e.admin.berth.internal`.
const ADMIN_NAME: &str = "e2e";

/// The port agents serve their API on inside their own namespace.
const NAMESPACED_AGENT_PORT: u16 = 7447;

/// The database every service keeps its schema in.
const DATABASE: &str = "berth";

/// A control-plane service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServiceKind {
    /// `berth-identity`.
    Identity,
    /// `berth-leases`.
    Leases,
    /// `berth-revisions`.
    Revisions,
    /// `berth-egress`.
    Egress,
}

impl ServiceKind {
    /// Every service, in the order they start.
    pub const ALL: [ServiceKind; 4] =
        [ServiceKind::Identity, ServiceKind::Leases, ServiceKind::Revisions, ServiceKind::Egress];

    /// Its name: schema, bus prefix and `svc` SAN.
    pub fn name(self) -> &'static str {
        match self {
            ServiceKind::Identity => berth_identity::NAME,
            ServiceKind::Leases => berth_leases::NAME,
            ServiceKind::Revisions => berth_revisions::NAME,
            ServiceKind::Egress => "egress",
        }
    }

    /// Its binary.
    pub fn binary(self) -> &'static str {
        match self {
            ServiceKind::Identity => "berth-identity",
            ServiceKind::Leases => "berth-leases",
            ServiceKind::Revisions => "berth-revisions",
            ServiceKind::Egress => "berth-egress",
        }
    }

    /// The loops it elects a leader for.
    pub fn loops(self) -> &'static [&'static str] {
        match self {
            ServiceKind::Identity => &[berth_identity::MONITOR_LOOP],
            ServiceKind::Leases => &[berth_leases::REAPER_LOOP],
            ServiceKind::Revisions => &[berth_revisions::DEPLOY_LOOP],
            ServiceKind::Egress => &[berth_egress::EGRESS_LOOP],
        }
    }
}

impl fmt::Display for ServiceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How agents are kept apart from the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// Each agent in a network namespace of its own (root only): a
    /// partition drops its packets.
    Namespaces,
    /// Every agent on loopback: a partition freezes the agent (SIGSTOP).
    Loopback,
}

impl Isolation {
    /// `$BERTH_E2E_ISOLATION` if set (`netns` or `loopback`), else
    /// namespaces where they work.
    pub fn detect() -> Self {
        match std::env::var(ISOLATION_ENV).as_deref() {
            Ok("loopback") => Isolation::Loopback,
            Ok("netns") => Isolation::Namespaces,
            _ if NodeNetwork::available() => Isolation::Namespaces,
            _ => Isolation::Loopback,
        }
    }
}

/// The timings the binaries are started with, short so faults play out in
/// seconds. Each is the flag of the same name.
#[derive(Debug, Clone)]
pub struct MeshTimings {
    /// identity `--heartbeat-interval`.
    pub heartbeat_interval: Duration,
    /// identity `--down-after`.
    pub down_after: Duration,
    /// identity `--reap-after` (time in DOWN before the node is reaped).
    pub reap_after: Duration,
    /// leases `--lease-ttl`, whole seconds (at least 3).
    pub lease_ttl_secs: u64,
    /// agent `--stop-grace`.
    pub stop_grace: Duration,
    /// agent `--sweep-interval`.
    pub sweep_interval: Duration,
    /// revisions `--progress-deadline`.
    pub progress_deadline: Duration,
    /// Every service's `--leader-ttl`.
    pub leader_ttl: Duration,
}

impl MeshTimings {
    /// Seconds instead of minutes, with room for a busy two-core machine.
    pub fn fast() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(1),
            down_after: Duration::from_secs(5),
            reap_after: Duration::from_secs(8),
            lease_ttl_secs: 8,
            stop_grace: Duration::from_secs(1),
            sweep_interval: Duration::from_secs(5),
            progress_deadline: Duration::from_secs(120),
            leader_ttl: Duration::from_secs(6),
        }
    }

    /// The lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    /// The leadership lease of every elected loop, as `--leader-ttl` sets it.
    pub fn leader(&self) -> ElectionTiming {
        ElectionTiming::from_ttl(self.leader_ttl)
    }
}

/// How big a mesh to run.
#[derive(Debug, Clone)]
pub struct MeshOptions {
    /// Replicas of each service.
    pub replicas: usize,
    /// Node agents.
    pub agents: usize,
    /// CPU each agent offers, in thousandths of a core.
    pub agent_cpu_millis: u64,
    /// Memory each agent offers.
    pub agent_memory_bytes: u64,
    /// The tier the agents join (their token's).
    pub tier: String,
    /// How agents are isolated.
    pub isolation: Isolation,
    /// The binaries' timings.
    pub timings: MeshTimings,
    /// Variables given to every service and agent process on top of the
    /// test's environment, e.g. `OTEL_EXPORTER_OTLP_ENDPOINT` to collect
    /// their traces, or `BERTH_LOG_FORMAT=json`.
    pub env: Vec<(String, String)>,
    /// Whether agents follow egress for their nodes' egress plans
    /// (`--egress-addr`), holding every replica to its tenant's proxy.
    pub agent_egress: bool,
}

impl Default for MeshOptions {
    fn default() -> Self {
        Self {
            replicas: 2,
            agents: 3,
            agent_cpu_millis: 2000,
            agent_memory_bytes: 2 << 30,
            tier: "compute".into(),
            isolation: Isolation::detect(),
            timings: MeshTimings::fast(),
            env: Vec::new(),
            agent_egress: true,
        }
    }
}

/// One replica of a service.
#[derive(Debug)]
pub struct Replica {
    addr: SocketAddr,
    spec: ProcessSpec,
    process: Option<ManagedProcess>,
}

impl Replica {
    /// Where it serves.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().filter(|p| p.is_running()).map(ManagedProcess::pid)
    }

    /// Its log, every life of it appended.
    pub fn log_path(&self) -> &Path {
        self.spec.log()
    }

    /// The last lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        crate::process::log_tail(self.spec.log(), lines)
    }
}

#[derive(Debug)]
struct ServiceGroup {
    front: Front,
    replicas: Vec<Replica>,
}

/// A running mesh; see the module docs.
#[derive(Debug)]
pub struct Mesh {
    options: MeshOptions,
    run_id: String,
    agents: Vec<AgentProcess>,
    groups: BTreeMap<ServiceKind, ServiceGroup>,
    network: Option<NodeNetwork>,
    admin: TlsCredentials,
    ca_bundle_pem: String,
    database_url: String,
    pool: PgPool,
    join_token: String,
    redis: PrivateRedis,
    postgres: PrivatePostgres,
    dir: Option<tempfile::TempDir>,
}

impl Mesh {
    /// Starts everything; see the module docs.
    pub async fn start(options: MeshOptions) -> anyhow::Result<Self> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        for removed in crate::stale::sweep().await {
            eprintln!("mesh: removed the leftovers of a run that did not clean up: {removed}");
        }
        let run_id = format!("{:08x}", rand::random::<u32>());
        let dir = tempfile::Builder::new().prefix("berth-e2e-").tempdir().context("cannot make a temp dir")?;
        // Traversable, so PostgreSQL (run as its own user) can reach its directory in it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711))?;
        for sub in ["certs", "logs", "agents", "oci"] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        let network = match options.isolation {
            Isolation::Namespaces => Some(NodeNetwork::create()?),
            Isolation::Loopback => None,
        };
        crate::stale::write_owner(dir.path(), &run_id, network.as_ref().map(NodeNetwork::tag))?;
        let bridge_ip = network.as_ref().map(NodeNetwork::host_ip);

        let (postgres, redis) =
            tokio::try_join!(PrivatePostgres::start_in(dir.path()), PrivateRedis::start_in(dir.path()))?;
        let database_url = postgres.create_database(DATABASE).await?;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(PROBE_TIMEOUT)
            .connect(&database_url)
            .await
            .context("cannot connect to the mesh's database")?;

        let secret: String = (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
        let mut names = vec!["localhost".to_string(), Ipv4Addr::LOCALHOST.to_string()];
        names.extend(bridge_ip.map(|ip| ip.to_string()));
        let admin_identity = Identity::admin(ADMIN_NAME)?;
        let admin_material =
            berth_identity::issue_from_state(&database_url, &secret, &admin_identity, &[], CERT_TTL).await?;
        let ca_bundle_pem = admin_material.ca_bundle_pem.clone();
        let admin = TlsCredentials::new(admin_material)?;
        let ca_file = dir.path().join("certs/ca.pem");
        std::fs::write(&ca_file, &ca_bundle_pem)?;

        let mut groups = BTreeMap::new();
        let extra: Vec<Ipv4Addr> = bridge_ip.into_iter().collect();
        for kind in ServiceKind::ALL {
            groups.insert(kind, ServiceGroup { front: Front::bind(kind.name(), &extra).await?, replicas: Vec::new() });
        }
        let front_of = |kind: ServiceKind| groups[&kind].front.addr().to_string();
        let (identity_front, leases_front, revisions_front) =
            (front_of(ServiceKind::Identity), front_of(ServiceKind::Leases), front_of(ServiceKind::Revisions));
        let timings = &options.timings;
        let redis_url = redis.url();
        for kind in ServiceKind::ALL {
            let certs = match kind {
                ServiceKind::Identity => None,
                _ => {
                    let identity = Identity::service(kind.name())?;
                    let material =
                        berth_identity::issue_from_state(&database_url, &secret, &identity, &names, CERT_TTL).await?;
                    Some(write_material(&dir.path().join("certs"), kind.name(), &material)?)
                }
            };
            for index in 0..options.replicas {
                let addr = free_loopback_addr()?;
                let log = dir.path().join(format!("logs/{kind}-{index}.log"));
                let mut spec = ProcessSpec::new(format!("{kind}-{index}"), binary(kind.binary())?, log)
                    .current_dir(dir.path())
                    .env("HOSTNAME", format!("{kind}-{index}"))
                    .arg("--listen")
                    .arg(addr.to_string())
                    .arg("--database-url")
                    .arg(&database_url)
                    .arg("--redis-url")
                    .arg(&redis_url)
                    .arg("--leader-ttl")
                    .arg(duration_flag(timings.leader_ttl));
                if let Some((cert, key)) = &certs {
                    spec = spec
                        .arg("--tls-cert")
                        .arg(cert)
                        .arg("--tls-key")
                        .arg(key)
                        .arg("--ca-file")
                        .arg(&ca_file)
                        .arg("--identity-addr")
                        .arg(&identity_front);
                }
                spec = match kind {
                    ServiceKind::Identity => spec
                        .env("BERTH_AUTH_SECRET", &secret)
                        .arg("--advertise-names")
                        .arg(names.join(","))
                        .arg("--heartbeat-interval")
                        .arg(duration_flag(timings.heartbeat_interval))
                        .arg("--down-after")
                        .arg(duration_flag(timings.down_after))
                        .arg("--reap-after")
                        .arg(duration_flag(timings.reap_after))
                        // Workloads' credentials are signed against leases.
                        .arg("--leases-addr")
                        .arg(&leases_front),
                    ServiceKind::Leases => spec.arg("--lease-ttl").arg(timings.lease_ttl_secs.to_string()),
                    ServiceKind::Revisions => spec
                        .arg("--leases-addr")
                        .arg(&leases_front)
                        .arg("--allow-oci-layouts")
                        .arg("--progress-deadline")
                        .arg(duration_flag(timings.progress_deadline)),
                    // Through the environment: the flags of the same names.
                    ServiceKind::Egress => {
                        spec.env("BERTH_REVISIONS_ADDR", &revisions_front).env("BERTH_LEASES_ADDR", &leases_front)
                    }
                };
                for (key, value) in &options.env {
                    spec = spec.env(key, value);
                }
                groups.get_mut(&kind).context("every service has a group")?.replicas.push(Replica {
                    addr,
                    spec,
                    process: None,
                });
            }
        }

        let mut mesh = Self {
            options,
            run_id,
            agents: Vec::new(),
            groups,
            network,
            admin,
            ca_bundle_pem,
            database_url,
            pool,
            join_token: String::new(),
            redis,
            postgres,
            dir: Some(dir),
        };
        // Identity first: the others follow it for the node registry.
        for kind in ServiceKind::ALL {
            for index in 0..mesh.options.replicas {
                mesh.spawn_replica(kind, index)?;
            }
            if kind == ServiceKind::Identity {
                mesh.wait_group_serving(kind).await?;
            }
        }
        for kind in ServiceKind::ALL {
            mesh.wait_group_serving(kind).await?;
        }
        for group in mesh.groups.values() {
            group.front.set_backends(group.replicas.iter().map(Replica::addr).collect());
        }
        mesh.join_token = mesh.create_join_token(&mesh.options.tier.clone()).await?;
        mesh.start_agents(&ca_file)?;
        mesh.wait_agents_up().await?;
        Ok(mesh)
    }

    /// The id that marks this run's workloads ([`workloads::RUN_MARKER_ENV`]).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// How the mesh was started.
    pub fn options(&self) -> &MeshOptions {
        &self.options
    }

    /// The mesh's directory (logs, certificates, agent data, bundles).
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().map_or(Path::new("/nonexistent"), |d| d.path())
    }

    /// The admin credentials every test client uses.
    pub fn admin(&self) -> TlsCredentials {
        self.admin.clone()
    }

    /// The CA bundle every certificate chains to.
    pub fn ca_bundle_pem(&self) -> &str {
        &self.ca_bundle_pem
    }

    /// The URL of the database every service keeps its schema in.
    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// A pool on that database, for reading the services' tables (qualify
    /// them: `leases.leases`, `identity.nodes`, ...).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The private PostgreSQL, to restart.
    pub fn postgres_mut(&mut self) -> &mut PrivatePostgres {
        &mut self.postgres
    }

    /// The private Redis, to restart or flush.
    pub fn redis_mut(&mut self) -> &mut PrivateRedis {
        &mut self.redis
    }

    /// The join token agents joined with (tier [`MeshOptions::tier`]).
    pub fn join_token(&self) -> &str {
        &self.join_token
    }

    /// The front of `kind`, as the host dials it.
    pub fn front_addr(&self, kind: ServiceKind) -> SocketAddr {
        self.groups[&kind].front.addr()
    }

    /// A channel to `kind` through its front, as the admin.
    pub fn channel(&self, kind: ServiceKind) -> anyhow::Result<Channel> {
        Ok(berth_rpc::connect(&self.front_addr(kind).to_string(), self.admin.clone())?)
    }

    /// A channel straight to one replica, as the admin.
    pub fn replica_channel(&self, kind: ServiceKind, index: usize) -> anyhow::Result<Channel> {
        Ok(berth_rpc::connect(&self.replica(kind, index)?.addr.to_string(), self.admin.clone())?)
    }

    /// Replica `index` of `kind`.
    pub fn replica(&self, kind: ServiceKind, index: usize) -> anyhow::Result<&Replica> {
        self.groups[&kind].replicas.get(index).with_context(|| format!("{kind} has no replica {index}"))
    }

    /// How many replicas each service has.
    pub fn replicas(&self) -> usize {
        self.options.replicas
    }

    /// `kill -9` replica `index` of `kind`, and waits until it is gone.
    pub async fn kill_replica(&mut self, kind: ServiceKind, index: usize) -> anyhow::Result<()> {
        let replica = self.replica_mut(kind, index)?;
        match replica.process.as_mut() {
            Some(process) => process.kill().await,
            None => bail!("{kind}-{index} is not running"),
        }
    }

    /// Stops replica `index` of `kind` as an orchestrator does (SIGTERM:
    /// it drains and exits; SIGKILL if it has not after a grace).
    pub async fn stop_replica(&mut self, kind: ServiceKind, index: usize) -> anyhow::Result<()> {
        if let Some(process) = self.replica_mut(kind, index)?.process.as_mut() {
            process.terminate(STOP_GRACE).await?;
        }
        Ok(())
    }

    /// Starts replica `index` of `kind` again and waits until it serves.
    pub async fn start_replica(&mut self, kind: ServiceKind, index: usize) -> anyhow::Result<()> {
        self.spawn_replica(kind, index)?;
        self.wait_serving(kind, index).await
    }

    /// Replica `index`'s health as it answers it now; `None` when it does
    /// not answer.
    pub async fn health(&self, kind: ServiceKind, index: usize) -> Option<ServingStatus> {
        let channel = self.replica_channel(kind, index).ok()?;
        let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
        request.set_timeout(PROBE_TIMEOUT);
        let answer = tokio::time::timeout(PROBE_TIMEOUT, HealthClient::new(channel).check(request)).await.ok()?.ok()?;
        ServingStatus::try_from(answer.get_ref().status).ok()
    }

    /// Who leads `loop_name` now (in `kind`'s schema): the holder and its
    /// term, or `None` while nobody holds a live lead.
    pub async fn leader(&self, kind: ServiceKind, loop_name: &str) -> anyhow::Result<Option<(String, i64)>> {
        let sql = format!(
            "SELECT holder, term FROM {}._berth_leaders WHERE loop_name = $1 AND holder <> '' \
             AND expires_at_ms > (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
            kind.name()
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(loop_name).fetch_optional(&self.pool).await?)
    }

    /// Which replica of `kind` a leader holder name belongs to.
    pub fn replica_of_holder(&self, kind: ServiceKind, holder: &str) -> Option<usize> {
        let rest = holder.strip_prefix(kind.name())?.strip_prefix('-')?;
        let (index, _) = rest.split_once('-')?;
        index.parse().ok().filter(|i| *i < self.options.replicas)
    }

    /// The agents.
    pub fn agents(&self) -> &[AgentProcess] {
        &self.agents
    }

    /// Agent `index`.
    pub fn agent_mut(&mut self, index: usize) -> anyhow::Result<&mut AgentProcess> {
        self.agents.get_mut(index).with_context(|| format!("no agent {index}"))
    }

    /// A channel to agent `index`'s API, as the admin.
    pub fn agent_channel(&self, index: usize) -> anyhow::Result<Channel> {
        let agent = self.agents.get(index).with_context(|| format!("no agent {index}"))?;
        Ok(berth_rpc::connect(&agent.api_addr().to_string(), self.admin.clone())?)
    }

    /// The identity row of the node named `name`, read from the database.
    pub async fn node(&self, name: &str) -> anyhow::Result<Option<NodeRow>> {
        Ok(sqlx::query_as::<_, (String, String, i64, Option<i64>)>(
            "SELECT node_id, state, incarnation, reaped_at_ms FROM identity.nodes WHERE name = $1 \
             ORDER BY joined_at_ms DESC LIMIT 1",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await?
        .map(|(node_id, state, incarnation, reaped_at_ms)| NodeRow {
            node_id,
            state,
            incarnation,
            reaped_at_ms,
        }))
    }

    /// The node id agent `index` runs as.
    pub async fn agent_node_id(&self, index: usize) -> anyhow::Result<String> {
        let agent = self.agents.get(index).with_context(|| format!("no agent {index}"))?;
        Ok(self.node(agent.name()).await?.with_context(|| format!("{} never joined", agent.name()))?.node_id)
    }

    /// The agent whose node is `node_id`.
    pub async fn agent_of_node(&self, node_id: &str) -> anyhow::Result<Option<usize>> {
        for index in 0..self.agents.len() {
            if self.agent_node_id(index).await? == node_id {
                return Ok(Some(index));
            }
        }
        Ok(None)
    }

    /// Creates a join token for `tier`, usable many times for an hour.
    pub async fn create_join_token(&self, tier: &str) -> anyhow::Result<String> {
        let mut tokens = identity_v1::join_tokens_client::JoinTokensClient::new(self.channel(ServiceKind::Identity)?);
        let created = tokens
            .create_join_token(identity_v1::CreateJoinTokenRequest {
                tier: tier.to_string(),
                ttl_seconds: 3600,
                max_uses: 1000,
                description: "e2e".into(),
                ..Default::default()
            })
            .await
            .context("CreateJoinToken")?;
        Ok(created.into_inner().token)
    }

    /// Waits until every agent's node is UP in identity and UP in leases'
    /// view of capacity.
    pub async fn wait_agents_up(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + AGENTS_TIMEOUT;
        let mut capacity = leases_v1::capacity_client::CapacityClient::new(self.channel(ServiceKind::Leases)?);
        loop {
            let mut missing = Vec::new();
            let listed = capacity.list_node_capacity(leases_v1::ListNodeCapacityRequest::default()).await;
            let up_in_leases: Vec<String> = listed
                .map(|r| {
                    r.into_inner()
                        .nodes
                        .into_iter()
                        .filter(|n| n.state == identity_v1::NodeState::Up as i32)
                        .map(|n| n.node_id)
                        .collect()
                })
                .unwrap_or_default();
            for agent in &self.agents {
                match self.node(agent.name()).await? {
                    Some(node) if node.state == "up" && up_in_leases.contains(&node.node_id) => {}
                    other => missing.push(format!("{}: {other:?}", agent.name())),
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let logs: Vec<String> =
                    self.agents.iter().map(|a| format!("{}:\n{}", a.name(), a.log_tail(15))).collect();
                bail!("agents not up after {AGENTS_TIMEOUT:?}: {missing:?}\n{}", logs.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops the agents, kills every workload of the run (and removes the
    /// namespaces agents made for them), then stops the services, Redis and
    /// PostgreSQL.
    pub async fn shutdown(&mut self) -> anyhow::Result<()> {
        for agent in &mut self.agents {
            let _ = agent.heal();
            agent.stop(STOP_GRACE).await?;
        }
        workloads::kill_all(&self.run_id);
        for index in 0..self.agents.len() {
            // Containers and their cgroups: runc's state outlives the kill.
            berth_agent::destroy_containers(&self.dir().join(format!("agents/{index}")));
        }
        crate::netns::remove_agent_namespaces(self.dir());
        for group in self.groups.values_mut() {
            for replica in &mut group.replicas {
                if let Some(process) = replica.process.as_mut() {
                    process.terminate(STOP_GRACE).await?;
                }
            }
        }
        self.pool.close().await;
        self.redis.stop().await?;
        self.postgres.stop().await?;
        Ok(())
    }

    fn replica_mut(&mut self, kind: ServiceKind, index: usize) -> anyhow::Result<&mut Replica> {
        self.groups
            .get_mut(&kind)
            .and_then(|g| g.replicas.get_mut(index))
            .with_context(|| format!("{kind} has no replica {index}"))
    }

    fn spawn_replica(&mut self, kind: ServiceKind, index: usize) -> anyhow::Result<()> {
        let replica = self.replica_mut(kind, index)?;
        if replica.process.as_ref().is_some_and(ManagedProcess::is_running) {
            bail!("{kind}-{index} is already running");
        }
        replica.process = Some(replica.spec.spawn()?);
        Ok(())
    }

    async fn wait_group_serving(&self, kind: ServiceKind) -> anyhow::Result<()> {
        for index in 0..self.options.replicas {
            self.wait_serving(kind, index).await?;
        }
        Ok(())
    }

    /// Waits until replica `index` of `kind` answers SERVING.
    pub async fn wait_serving(&self, kind: ServiceKind, index: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let replica = self.replica(kind, index)?;
            if let Some(status) = replica.process.as_ref().and_then(ManagedProcess::exit_status) {
                bail!("{kind}-{index} exited ({status}):\n{}", replica.log_tail(20));
            }
            if self.health(kind, index).await == Some(ServingStatus::Serving) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("{kind}-{index} did not serve within {READY_TIMEOUT:?}:\n{}", replica.log_tail(20));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn start_agents(&mut self, ca_file: &Path) -> anyhow::Result<()> {
        let agent_binary = binary("berth-agent")?;
        let dir = self.dir().to_path_buf();
        // Every node's namespace (and its port on the bridge) first, so no
        // port joins the bridge while an agent is already talking over it.
        let mut namespaces = Vec::new();
        if let Some(network) = &self.network {
            for index in 0..self.options.agents {
                namespaces.push(network.add_namespace(u8::try_from(index)?)?);
            }
        }
        let mut namespaces = namespaces.into_iter();
        for index in 0..self.options.agents {
            let name = format!("e2e-agent-{index}");
            let data_dir = dir.join(format!("agents/{index}"));
            let log = dir.join(format!("logs/agent-{index}.log"));
            let (namespace, listen, api_addr, server_ip) = match &self.network {
                Some(network) => {
                    let namespace = namespaces.next().context("a node namespace for every agent")?;
                    let api = SocketAddr::from((namespace.ip(), NAMESPACED_AGENT_PORT));
                    let listen = SocketAddr::from((Ipv4Addr::UNSPECIFIED, NAMESPACED_AGENT_PORT));
                    (Some(namespace), listen, api, network.host_ip())
                }
                None => {
                    let addr = free_loopback_addr()?;
                    (None, addr, addr, Ipv4Addr::LOCALHOST)
                }
            };
            let front = |kind: ServiceKind| SocketAddr::from((server_ip, self.groups[&kind].front.port())).to_string();
            let timings = &self.options.timings;
            let mut spec = ProcessSpec::new(name.clone(), &agent_binary, log)
                .current_dir(&dir)
                .arg("--server")
                .arg(front(ServiceKind::Identity))
                .arg("--leases-addr")
                .arg(front(ServiceKind::Leases))
                .arg("--ca-file")
                .arg(ca_file)
                .arg("--data-dir")
                .arg(&data_dir)
                .arg("--advertise-addr")
                .arg(api_addr.to_string())
                .arg("--listen")
                .arg(listen.to_string())
                .arg("--name")
                .arg(&name)
                .arg("--cpu-millis")
                .arg(self.options.agent_cpu_millis.to_string())
                .arg("--memory-bytes")
                .arg(self.options.agent_memory_bytes.to_string())
                .arg("--stop-grace")
                .arg(duration_flag(timings.stop_grace))
                .arg("--sweep-interval")
                .arg(duration_flag(timings.sweep_interval))
                // Through the environment, so the token never shows in `ps`.
                .env("BERTH_JOIN_TOKEN", &self.join_token)
                .env("BERTH_REVISIONS_ADDR", front(ServiceKind::Revisions));
            if self.options.agent_egress {
                spec = spec.env("BERTH_EGRESS_ADDR", front(ServiceKind::Egress));
            }
            for (key, value) in &self.options.env {
                spec = spec.env(key, value);
            }
            if let Some(namespace) = &namespace {
                spec = spec.in_netns(namespace.name());
            }
            let mut agent = AgentProcess::new(name, spec, api_addr, namespace);
            agent.start()?;
            self.agents.push(agent);
        }
        Ok(())
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        // Agents first, so none starts a workload after the sweep below.
        for agent in &mut self.agents {
            let _ = agent.heal();
        }
        self.agents.clear();
        workloads::kill_all(&self.run_id);
        for index in 0..self.agents.len() {
            // Containers and their cgroups: runc's state outlives the kill.
            berth_agent::destroy_containers(&self.dir().join(format!("agents/{index}")));
        }
        crate::netns::remove_agent_namespaces(self.dir());
        self.groups.clear();
        if std::env::var_os(KEEP_ENV).is_some_and(|v| v == "1")
            && let Some(dir) = self.dir.take()
        {
            crate::stale::disown(dir.path());
            eprintln!("mesh directory kept at {}", dir.keep().display());
        }
    }
}

/// A node as identity's table holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRow {
    /// The node id.
    pub node_id: String,
    /// `joining`, `up`, `down`, `draining` or `revoked`.
    pub state: String,
    /// Grows with every rejoin and reap.
    pub incarnation: i64,
    /// When the monitor reaped it, until it rejoins.
    pub reaped_at_ms: Option<i64>,
}

/// Writes `<name>.pem` and `<name>-key.pem` into `dir`.
fn write_material(dir: &Path, name: &str, material: &TlsMaterial) -> anyhow::Result<(PathBuf, PathBuf)> {
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}-key.pem"));
    std::fs::write(&cert, &material.cert_chain_pem)?;
    std::fs::write(&key, &material.key_pem)?;
    Ok((cert, key))
}

/// A duration as the binaries' flags read it.
fn duration_flag(duration: Duration) -> String {
    format!("{}ms", duration.as_millis())
}
