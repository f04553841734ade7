//! `berth-bench deploy`: from `ApplyService` to every replica of the new
//! revision RUNNING, with the bundle already on the node (warm) and pulled
//! from a registry (cold), and how fast applies mint (or do not mint)
//! revisions.
//!
//! # Expected flow
//! 1. `berth-identity` and `berth-leases` start as processes of their own on
//!    PostgreSQL and Redis (identity in a scratch database of its own; leases
//!    and revisions share a second one, each in its schema, and each claims
//!    its Redis prefix). Revisions runs in this process on the real
//!    `RevisionsService`, and so does the node: a real agent that joins
//!    identity with a one-use token, takes its assignments from leases and
//!    runs each replica as a process.
//! 2. A `docker-registry` on loopback holds `--cold + 1` bundles of
//!    `--bundle-mib` MiB of random bytes each (so every one is a new digest
//!    the node has never pulled), whose program sleeps.
//! 3. The service `bench` is applied once and waited for (warm-up; the node
//!    pulls the first bundle). Then `--warm` applies, each changing only an
//!    environment variable: a new revision of a digest the node holds. Then
//!    `--cold` applies, each naming the tag of a bundle not pulled yet. Each
//!    counts from the apply to the first `ListLeases` (polled every
//!    [`POLL_EVERY`]) that shows every replica of the new revision RUNNING;
//!    the next one starts once the revision is live and the old replicas
//!    are released.
//! 4. Baselines in the same run: `RequestLease` → RUNNING straight to
//!    leases for the cached bundle (what a deploy adds to a lease), and
//!    `grpc.health.v1.Health/Check` on revisions (an empty mTLS RPC).
//! 5. The mint rate: `--mints` applies of one unchanged declaration, then
//!    `--mints` applies each changing the environment (each resolves the
//!    tag and mints), back to back on one connection, of a service with no
//!    replicas so nothing launches.
//! 6. Both services are deleted and the baseline leases released, so the
//!    node stops every replica before anything is stopped; the databases
//!    are dropped and the Redis prefixes cleared whatever happened.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_bundle::testing::{TestRegistry, TestRegistryError};
use berth_bundle::{BundleClient, BundleReference, PackedBundle, RegistryConfig, RegistryCredentials};
use berth_mtls::{TlsCredentials, TlsMaterial, generate_csr};
use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1::{self as leases, LeasePhase};
use berth_proto::revisions::v1;
use berth_proto::types::v1::{BundleRef, Capacity};
use berth_revisions::{Dependencies, GrpcLeases, RegistryPolicy, RevisionsConfig, RevisionsService};
use berth_rpc::Channel;
use berth_runtime::{ServiceContext, ServiceReplica as _, StartError};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::identity_process::{IdentityProcess, ProcessError, StateOptions};
use crate::leases::{LeasesBenchError, latency, wait_for_nodes};
use crate::leases_process::{LeasesLaunch, LeasesProcess};
use crate::load::{ErrorCount, ErrorTally, Figures, Samples, status_message};
use crate::output::{RunError, print_report, progress};
use crate::process::{ScratchDatabase, ServiceProcessError, SharedStateArgs, claim_bus, free_loopback_port};
use crate::report::{Machine, Target};

/// Apply → RUNNING p50 with the bundle on the node must stay under this.
const TARGET_WARM_P50_MS: f64 = 150.0;

/// Apply → RUNNING p99 pulling a new bundle must stay under this.
const TARGET_COLD_P99_MS: f64 = 1000.0;

/// How often a new revision's leases are listed.
const POLL_EVERY: Duration = Duration::from_millis(2);

/// How long one apply may take to run before it counts as failed.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the node may take to join and be seen UP by leases.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the node may take to stop every replica at the end.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How many times an apply is sent when the catalog aborts it on a
/// collision with the controller's own writes (`ABORTED`, "retry it").
const APPLY_ATTEMPTS: u32 = 5;

/// How often revisions looks at a rollout: how soon a revision whose
/// replicas run goes live and the old replicas are released. It decides
/// when the next sample starts, not what a sample measures.
const ROLLOUT_POLL: Duration = Duration::from_millis(20);

/// Leases live this long between the node's renewals.
const LEASE_TTL_SECONDS: u64 = 30;

/// Empty RPCs in the baseline.
const EMPTY_RPCS: u32 = 200;

/// What each replica reserves.
const REPLICA_ASK: Capacity = Capacity { cpu_millis: 10, memory_bytes: 16 << 20 };

/// What the node offers: room for every replica many times over.
const NODE_CAPACITY: berth_agent::Capacity = berth_agent::Capacity { cpu_millis: 64_000, memory_bytes: 64 << 30 };

/// The measured service and the one the mint rate is taken on.
const SERVICE: &str = "bench";
const MINT_SERVICE: &str = "bench-mint";

/// The repository the bundles are pushed to.
const REPOSITORY: &str = "bench/app";

/// Flags of `berth-bench deploy`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DeployArgs {
    /// Applies measured with the bundle already on the node.
    #[arg(long, default_value_t = 30, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    warm: u32,
    /// Applies measured pulling a bundle the node has never seen.
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    cold: u32,
    /// The size of each bundle's payload, random so it does not compress.
    #[arg(long, default_value_t = 10, value_name = "MIB", value_parser = clap::value_parser!(u32).range(0..=1024))]
    bundle_mib: u32,
    /// Replicas of each revision.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    replicas: u32,
    /// Applies in each mint-rate run (unchanged, then changed).
    #[arg(long, default_value_t = 200, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    mints: u32,
    #[command(flatten)]
    state: SharedStateArgs,
}

/// Why the deploy benchmark could not run to the end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DeployBenchError {
    /// Identity could not be started, died, or its state not removed.
    #[error(transparent)]
    Identity(Box<ProcessError>),
    /// Leases could not be started or died, or the scratch state not made.
    #[error(transparent)]
    Process(Box<ServiceProcessError>),
    /// Waiting for leases' view of the node failed.
    #[error(transparent)]
    Leases(Box<LeasesBenchError>),
    /// Revisions' store, bus or listener could not be opened.
    #[error("revisions: {0}")]
    Revisions(Box<StartError>),
    /// A service refused the bench something it asked.
    #[error("{what} was refused: {message}")]
    Refused {
        /// What was asked.
        what: &'static str,
        /// What the client saw.
        message: String,
    },
    /// A key, CSR or certificate could not be made.
    #[error("{0}")]
    Tls(#[source] berth_mtls::MtlsError),
    /// The registry could not be started.
    #[error(transparent)]
    Registry(#[from] TestRegistryError),
    /// A bundle could not be made or pushed.
    #[error("bundle: {0}")]
    Bundle(String),
    /// The node could not start.
    #[error("the node's agent: {0}")]
    Agent(String),
    /// The node was not UP in leases in time.
    #[error("the node was not UP in berth-leases within {}s", JOIN_TIMEOUT.as_secs())]
    NodeNotUp,
    /// A file or directory could not be made.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A revision never ran; the run cannot go on.
    #[error("revision {revision} did not run: {why}")]
    NeverRan {
        /// The revision.
        revision: String,
        /// What was seen last.
        why: String,
    },
    /// A client task failed, Ctrl-C arrived, or the report could not be written.
    #[error(transparent)]
    Run(#[from] RunError),
}

impl From<ProcessError> for DeployBenchError {
    fn from(error: ProcessError) -> Self {
        Self::Identity(Box::new(error))
    }
}

impl From<ServiceProcessError> for DeployBenchError {
    fn from(error: ServiceProcessError) -> Self {
        Self::Process(Box::new(error))
    }
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
struct DeployReport {
    /// Always "deploy".
    scenario: &'static str,
    /// Replicas of each revision.
    replicas: u32,
    /// Each bundle's compressed size as pushed, bytes.
    bundle_bytes: u64,
    /// Revisions' and leases' store: always "postgres".
    store: &'static str,
    /// Their bus: always "redis".
    bus: &'static str,
    /// Apply → every replica RUNNING, the bundle on the node.
    warm: Figures,
    /// Apply → every replica RUNNING, the bundle pulled from the registry.
    cold: Figures,
    /// Baseline: `RequestLease` → RUNNING straight to leases, bundle on the node.
    lease_request: Figures,
    /// Baseline: `grpc.health.v1.Health/Check` on revisions.
    empty_rpc: Figures,
    /// Applies of an unchanged declaration: nothing minted.
    mint_unchanged: Figures,
    /// Applies each changing the environment: one revision minted each.
    mint_changed: Figures,
    /// Every distinct failure, commonest first.
    errors: Vec<ErrorCount>,
    /// The targets, judged.
    targets: Vec<Target>,
    /// The machine it ran on.
    #[serde(flatten)]
    machine: Machine,
}

impl DeployReport {
    fn judge(&mut self) {
        self.targets = vec![
            Target {
                name: format!("warm apply -> RUNNING p50 < {TARGET_WARM_P50_MS:.0}ms"),
                value: self.warm.p50_ms,
                met: self.warm.errors == 0 && self.warm.p50_ms.is_some_and(|p50| p50 < TARGET_WARM_P50_MS),
            },
            Target {
                name: format!(
                    "cold apply -> RUNNING p99 < {TARGET_COLD_P99_MS:.0}ms ({:.1} MiB bundle)",
                    self.bundle_bytes as f64 / f64::from(1 << 20)
                ),
                value: self.cold.p99_ms,
                met: self.cold.errors == 0 && self.cold.p99_ms.is_some_and(|p99| p99 < TARGET_COLD_P99_MS),
            },
        ];
    }

    fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "berth-bench deploy: {} replica(s) per revision, {:.1} MiB bundles, revisions and leases on {} + {}",
            self.replicas,
            self.bundle_bytes as f64 / f64::from(1 << 20),
            self.store,
            self.bus
        );
        let _ = writeln!(out, "{:<44}{:>8}{:>10}{:>10}{:>10}{:>8}", "", "calls", "p50", "p99", "max", "errors");
        for (name, figures) in [
            ("apply -> RUNNING, bundle on the node (warm)", &self.warm),
            ("apply -> RUNNING, pulled (cold)", &self.cold),
            ("RequestLease -> RUNNING, bundle on the node", &self.lease_request),
            ("empty mTLS RPC (revisions health)", &self.empty_rpc),
        ] {
            let _ = writeln!(
                out,
                "{name:<44}{:>8}{:>10}{:>10}{:>10}{:>8}",
                figures.calls,
                latency(figures.p50_ms),
                latency(figures.p99_ms),
                latency(figures.max_ms),
                figures.errors
            );
        }
        let _ = writeln!(out, "{:<44}{:>8}{:>10}{:>10}{:>10}{:>8}", "", "applies", "per s", "p50", "p99", "errors");
        for (name, figures) in [
            ("apply, unchanged (no revision minted)", &self.mint_unchanged),
            ("apply, changed (one revision minted)", &self.mint_changed),
        ] {
            let _ = writeln!(
                out,
                "{name:<44}{:>8}{:>10.1}{:>10}{:>10}{:>8}",
                figures.calls,
                figures.rate_per_s,
                latency(figures.p50_ms),
                latency(figures.p99_ms),
                figures.errors
            );
        }
        self.machine.write_footer(
            &mut out,
            "shared by identity, leases, revisions, the node, the registry, PostgreSQL, Redis and the bench",
            &self.targets,
            &self.errors,
        );
        out
    }
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: DeployArgs) -> Result<(), DeployBenchError> {
    let machine = Machine::before_run();
    let shutdown = berth_rpc::shutdown_signal();
    progress("starting berth-identity on postgres with a redis bus");
    let state = StateOptions {
        database_url: Some(args.state.database_url.clone()),
        redis_url: Some(args.state.redis_url.clone()),
        leases_addr: None,
    };
    let mut report = IdentityProcess::around(
        &state,
        1,
        &shutdown,
        || RunError::Interrupted.into(),
        async |identity| with_identity(&args, identity, &shutdown).await,
    )
    .await?;
    report.machine = machine;
    report.judge();
    print_report(args.state.output, &report, |r| r.table()).map_err(RunError::Output)?;
    Ok(())
}

/// Everything inside the scratch database leases and revisions share.
async fn with_identity(
    args: &DeployArgs,
    identity: &IdentityProcess,
    shutdown: &CancellationToken,
) -> Result<DeployReport, DeployBenchError> {
    progress("creating a scratch database for leases and revisions");
    let database = ScratchDatabase::create(&args.state.database_url).await?;
    let buses = (
        claim_bus(&args.state.redis_url, berth_leases::NAME).await,
        claim_bus(&args.state.redis_url, berth_revisions::NAME).await,
    );
    let outcome = match buses {
        (Ok(leases_bus), Ok(revisions_bus)) => {
            let outcome = with_database(args, identity, &database, revisions_bus.clone(), shutdown).await;
            for (prefix, bus) in [("leases", leases_bus), ("revisions", revisions_bus)] {
                if let Err(error) = bus.clear().await {
                    progress(&format!(
                        "warning: cannot clear the {prefix}: prefix on {}: {error}",
                        args.state.redis_url
                    ));
                }
            }
            outcome
        }
        (Err(error), _) | (_, Err(error)) => Err(error.into()),
    };
    progress("dropping the scratch database");
    let dropped = database.drop_database().await;
    let report = outcome?;
    dropped?;
    Ok(report)
}

/// A certificate of service `name` from identity's CA.
async fn service_material(admin: &Channel, name: &str) -> Result<TlsMaterial, DeployBenchError> {
    let (csr_pem, key_pem) = generate_csr(name).map_err(DeployBenchError::Tls)?;
    let mut authority = identity::authority_client::AuthorityClient::new(admin.clone());
    let issued = authority
        .issue_certificate(identity::IssueCertificateRequest {
            kind: identity::CertificateKind::Service as i32,
            name: name.to_string(),
            csr_pem,
            ttl_seconds: 0,
            dns_names: vec!["127.0.0.1".to_string(), "localhost".to_string()],
        })
        .await
        .map_err(|s| DeployBenchError::Refused { what: "a service certificate", message: status_message(&s) })?
        .into_inner();
    Ok(TlsMaterial { cert_chain_pem: issued.certificate_pem, key_pem, ca_bundle_pem: issued.ca_bundle_pem })
}

fn connect(addr: SocketAddr, credentials: &TlsCredentials) -> Result<Channel, DeployBenchError> {
    berth_rpc::connect(&addr.to_string(), credentials.clone())
        .map_err(|e| DeployBenchError::Refused { what: "a connection", message: e.to_string() })
}

async fn with_database(
    args: &DeployArgs,
    identity: &IdentityProcess,
    database: &ScratchDatabase,
    revisions_bus: berth_bus::Bus,
    shutdown: &CancellationToken,
) -> Result<DeployReport, DeployBenchError> {
    let admin = identity.admin().clone();
    let admin_channel = connect(identity.addr(), &admin)?;
    progress("starting berth-leases on postgres with a redis bus");
    let leases = LeasesProcess::start(LeasesLaunch {
        material: service_material(&admin_channel, berth_leases::NAME).await?,
        probe: &admin,
        database_url: database.url().to_string(),
        redis_url: args.state.redis_url.clone(),
        identity_addr: identity.addr(),
        lease_ttl_seconds: LEASE_TTL_SECONDS,
        listen: None,
    })
    .await?;

    progress("starting revisions in this process");
    let stop = shutdown.child_token();
    let revisions = start_revisions(&admin_channel, database, revisions_bus, leases.addr(), &stop).await;
    let outcome = match revisions {
        Ok(revisions_addr) => {
            tokio::select! {
                outcome = with_revisions(args, identity, &admin_channel, &leases, revisions_addr, &stop) => outcome,
                died = leases.exited() => Err(died.into()),
            }
        }
        Err(error) => Err(error),
    };
    stop.cancel();
    progress("stopping berth-leases");
    leases.stop().await;
    outcome
}

/// Serves a revisions replica on a loopback port until `stop`; its address.
async fn start_revisions(
    admin: &Channel,
    database: &ScratchDatabase,
    bus: berth_bus::Bus,
    leases_addr: SocketAddr,
    stop: &CancellationToken,
) -> Result<SocketAddr, DeployBenchError> {
    let revisions_error = |e: StartError| DeployBenchError::Revisions(Box::new(e));
    let material = service_material(admin, berth_revisions::NAME).await?;
    let credentials = TlsCredentials::new(material).map_err(DeployBenchError::Tls)?;
    let store = berth_runtime::open_store(database.url(), berth_revisions::NAME, berth_revisions::MIGRATIONS)
        .await
        .map_err(revisions_error)?;
    let ctx = ServiceContext::new(store, bus, credentials.clone());
    let config = RevisionsConfig { rollout_poll: ROLLOUT_POLL, ..RevisionsConfig::default() };
    let leases = GrpcLeases::connect(&leases_addr.to_string(), credentials.clone())
        .map_err(|e| DeployBenchError::Refused { what: "a connection to leases", message: e.to_string() })?;
    let dependencies = Dependencies::with_registry(Arc::new(leases), RegistryPolicy::default(), &config)
        .map_err(|e| DeployBenchError::Bundle(e.to_string()))?;
    let service = RevisionsService::new(&ctx, config, dependencies);
    service.spawn_loops(stop);
    let listener =
        berth_runtime::bind(SocketAddr::from(([127, 0, 0, 1], 0)), credentials).await.map_err(revisions_error)?;
    let addr = listener.local_addr().map_err(|source| DeployBenchError::Io { what: "revisions' address", source })?;
    let server = service.server();
    let stop = stop.clone();
    tokio::spawn(async move {
        if let Err(error) = server.serve(listener, stop).await {
            progress(&format!("warning: revisions stopped serving: {error}"));
        }
    });
    Ok(addr)
}

/// Joins the node, measures, and leaves no replica running.
async fn with_revisions(
    args: &DeployArgs,
    identity: &IdentityProcess,
    admin_channel: &Channel,
    leases: &LeasesProcess,
    revisions_addr: SocketAddr,
    stop: &CancellationToken,
) -> Result<DeployReport, DeployBenchError> {
    let dir = tempfile::Builder::new()
        .prefix("berth-bench-deploy-")
        .tempdir()
        .map_err(|source| DeployBenchError::Io { what: "cannot create a temporary directory", source })?;
    progress("starting the node's agent in this process");
    let token = join_token(admin_channel).await?;
    let listen = free_loopback_port()?;
    let agent_dir = dir.path().join("agent");
    let mut config = berth_agent::AgentConfig::new(
        identity.addr().to_string(),
        &agent_dir,
        listen.to_string(),
        listen,
        NODE_CAPACITY,
    );
    config.ca_bundle_pem = identity.ca_bundle_pem();
    config.join_token = Some(token);
    config.name = "bench-deploy".to_string();
    config.leases = Some(leases.addr().to_string());
    config.revisions = Some(revisions_addr.to_string());
    // Identity here is not wired to leases, so it signs no workload
    // certificate: the deploy is measured without one.
    config.workload_identity = false;
    config.lease_timing.stop_grace = Duration::from_secs(1);
    let agent_stop = stop.child_token();
    let agent =
        berth_agent::start(config, agent_stop.clone()).await.map_err(|e| DeployBenchError::Agent(e.to_string()))?;

    let admin = identity.admin().clone();
    let leases_channel = connect(leases.addr(), &admin)?;
    let clients = Clients {
        services: v1::services_client::ServicesClient::new(connect(revisions_addr, &admin)?),
        leases: leases::leases_client::LeasesClient::new(leases_channel.clone()),
        leases_channel,
        health: HealthClient::new(connect(revisions_addr, &admin)?),
    };
    let outcome = async {
        match tokio::time::timeout(JOIN_TIMEOUT, wait_for_nodes(&clients.leases_channel, 1)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(DeployBenchError::Leases(Box::new(error))),
            Err(_) => return Err(DeployBenchError::NodeNotUp),
        }
        measure(args, &clients, dir.path()).await
    }
    .await;
    progress("deleting the services and waiting for the node to stop their replicas");
    let drained = drain(&clients, &agent_dir).await;
    agent_stop.cancel();
    if let Err(error) = agent.wait().await {
        progress(&format!("warning: the node's agent stopped with: {error}"));
    }
    let report = outcome?;
    drained?;
    Ok(report)
}

async fn join_token(admin: &Channel) -> Result<String, DeployBenchError> {
    let mut tokens = identity::join_tokens_client::JoinTokensClient::new(admin.clone());
    let created = tokens
        .create_join_token(identity::CreateJoinTokenRequest {
            max_uses: 1,
            description: "berth-bench deploy".to_string(),
            ..Default::default()
        })
        .await
        .map_err(|s| DeployBenchError::Refused { what: "a join token", message: status_message(&s) })?;
    Ok(created.into_inner().token)
}

/// The bench's clients, all as the run's admin.
#[derive(Debug, Clone)]
struct Clients {
    services: v1::services_client::ServicesClient<Channel>,
    leases_channel: Channel,
    leases: leases::leases_client::LeasesClient<Channel>,
    health: HealthClient<Channel>,
}

impl Clients {
    /// Applies `request`, sending it again (an apply is idempotent) when
    /// the catalog aborted it on a collision, as its status asks; the
    /// latency a caller measures includes those attempts.
    async fn apply(&self, request: v1::ApplyServiceRequest) -> Result<v1::ApplyServiceResponse, String> {
        let mut attempt = 1;
        loop {
            let mut client = self.services.clone();
            let call = client.apply_service(request.clone());
            match tokio::time::timeout(CALL_TIMEOUT, call).await {
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) if status.code() == tonic::Code::Aborted && attempt < APPLY_ATTEMPTS => {
                    let cap = Duration::from_millis(20).saturating_mul(1 << attempt);
                    tokio::time::sleep(cap.mul_f64(rand::random::<f64>())).await;
                    attempt += 1;
                }
                Ok(Err(status)) => return Err(format!("apply: {}", status_message(&status))),
                Err(_) => return Err(format!("apply: no answer within {CALL_TIMEOUT:?}")),
            }
        }
    }

    /// Waits until every one of `replicas` leases of `revision` is RUNNING;
    /// a replica that failed ends the wait with its reason.
    async fn await_running(&self, revision: &str, replicas: u32) -> Result<(), String> {
        let deadline = Instant::now() + RUN_TIMEOUT;
        let mut client = self.leases.clone();
        loop {
            let listed = client
                .list_leases(leases::ListLeasesRequest::default())
                .await
                .map_err(|s| format!("list leases: {}", status_message(&s)))?
                .into_inner()
                .leases;
            let mine = listed.iter().filter(|l| l.workload.as_ref().is_some_and(|w| w.revision == revision));
            let mut running = 0;
            for lease in mine {
                match lease.phase() {
                    LeasePhase::Running => running += 1,
                    LeasePhase::Failed => return Err(format!("a replica failed: {} {}", lease.reason, lease.message)),
                    _ => {}
                }
            }
            if running >= replicas {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("{running} of {replicas} replicas RUNNING after {RUN_TIMEOUT:?}"));
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// Waits until `revision` is the service's live revision with every
    /// replica running, so the old replicas are on their way out.
    async fn await_live(&self, service: &str, revision: &str) -> Result<(), String> {
        let deadline = Instant::now() + RUN_TIMEOUT;
        let mut client = self.services.clone();
        loop {
            let request = v1::GetServiceRequest { project: String::new(), name: service.to_string() };
            let status = client
                .get_service(request)
                .await
                .map_err(|s| format!("get service: {}", status_message(&s)))?
                .into_inner()
                .service
                .and_then(|s| s.status)
                .unwrap_or_default();
            if status.live_revision == revision && status.replicas_running == status.replicas_desired {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("{revision} not live after {RUN_TIMEOUT:?}: live is {:?}", status.live_revision));
            }
            tokio::time::sleep(ROLLOUT_POLL).await;
        }
    }
}

/// The bundles of the run in the registry, by tag.
#[derive(Debug)]
pub(crate) struct Bundles {
    pub(crate) registry: TestRegistry,
    /// The compressed size of one bundle.
    pub(crate) bytes: u64,
}

impl Bundles {
    /// `registry/bench/app:tag`.
    pub(crate) fn reference(&self, tag: &str) -> String {
        self.registry.reference(&format!("{REPOSITORY}:{tag}"))
    }
}

/// Starts the registry and pushes `count` bundles of `mib` random MiB each,
/// tagged `b0`, `b1`, ….
pub(crate) async fn push_bundles(dir: &Path, count: u32, mib: u32) -> Result<Bundles, DeployBenchError> {
    let registry = TestRegistry::start().await?;
    let client = BundleClient::new(RegistryConfig::default()).map_err(|e| DeployBenchError::Bundle(e.to_string()))?;
    let mut bytes = 0;
    for index in 0..count {
        let source = dir.join(format!("bundle-{index}"));
        write_bundle(&source, mib).map_err(|source| DeployBenchError::Io { what: "cannot write a bundle", source })?;
        let packed = PackedBundle::from_dir(&source).map_err(|e| DeployBenchError::Bundle(e.to_string()))?;
        bytes = packed.manifest().layers.iter().map(|l| l.size).sum::<u64>();
        let reference = BundleReference::parse(&registry.reference(&format!("{REPOSITORY}:b{index}")))
            .map_err(|e| DeployBenchError::Bundle(e.to_string()))?;
        client
            .push(&packed, &reference, &RegistryCredentials::Anonymous)
            .await
            .map_err(|e| DeployBenchError::Bundle(e.to_string()))?;
        std::fs::remove_dir_all(&source)
            .map_err(|source| DeployBenchError::Io { what: "cannot remove a bundle", source })?;
    }
    Ok(Bundles { registry, bytes })
}

/// A bundle whose program sleeps, with `mib` MiB of random bytes beside it.
fn write_bundle(dir: &Path, mib: u32) -> std::io::Result<()> {
    use rand::RngCore as _;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir.join("bin"))?;
    std::fs::write(dir.join(berth_bundle::SPEC_FILE), "entrypoint = \"bin/run\"\n")?;
    let program = dir.join("bin/run");
    std::fs::write(&program, "#!/bin/sh\nexec sleep 600\n")?;
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))?;
    let mut payload = vec![0u8; (mib as usize) << 20];
    rand::rng().fill_bytes(&mut payload);
    std::fs::write(dir.join("payload.bin"), payload)
}

/// An apply of `name` running the bundle `reference` with `env`.
fn apply_request(name: &str, reference: &str, replicas: u32, env: &[(&str, String)]) -> v1::ApplyServiceRequest {
    v1::ApplyServiceRequest {
        project: String::new(),
        name: name.to_string(),
        template: Some(v1::ServiceTemplate {
            bundle: Some(BundleRef { reference: reference.to_string(), ..Default::default() }),
            env: env.iter().map(|(k, v)| ((*k).to_string(), v.clone())).collect(),
            replicas: Some(replicas),
            resources: Some(REPLICA_ASK),
            ..Default::default()
        }),
        source: None,
    }
}

async fn measure(args: &DeployArgs, clients: &Clients, dir: &Path) -> Result<DeployReport, DeployBenchError> {
    progress(&format!("pushing {} bundles of {} MiB to a registry on loopback", args.cold + 1, args.bundle_mib));
    let bundles = push_bundles(dir, args.cold + 1, args.bundle_mib).await?;
    let errors = ErrorTally::default();

    progress("warming up: the first revision, pulled");
    let first = apply_request(SERVICE, &bundles.reference("b0"), args.replicas, &[("BENCH_SAMPLE", "0".into())]);
    let applied =
        clients.apply(first).await.map_err(|why| DeployBenchError::NeverRan { revision: SERVICE.into(), why })?;
    let never_ran = |why: String| DeployBenchError::NeverRan { revision: applied.revision.clone(), why };
    clients.await_running(&applied.revision, args.replicas).await.map_err(never_ran)?;
    clients.await_live(SERVICE, &applied.revision).await.map_err(never_ran)?;

    progress(&format!("{} applies with the bundle on the node", args.warm));
    let mut warm = Samples::default();
    for sample in 1..=args.warm {
        let request =
            apply_request(SERVICE, &bundles.reference("b0"), args.replicas, &[("BENCH_SAMPLE", sample.to_string())]);
        deploy_one(clients, request, args.replicas, &mut warm, &errors).await;
    }
    let warm = warm.figures(Duration::ZERO, 1);

    progress(&format!("{} applies each pulling a new bundle", args.cold));
    let mut cold = Samples::default();
    for index in 1..=args.cold {
        let request = apply_request(
            SERVICE,
            &bundles.reference(&format!("b{index}")),
            args.replicas,
            &[("BENCH_SAMPLE", format!("cold-{index}"))],
        );
        deploy_one(clients, request, args.replicas, &mut cold, &errors).await;
    }
    let cold = cold.figures(Duration::ZERO, 1);

    progress(&format!("baseline: {} leases asked of leases straight, bundle on the node", args.warm));
    let lease_request = lease_baseline(clients, &bundles, args.warm, &errors).await?;
    progress(&format!("baseline: {EMPTY_RPCS} empty RPCs to revisions"));
    let empty_rpc = empty_rpcs(clients, &errors).await;

    progress(&format!("{} unchanged applies, then {} changed ones", args.mints, args.mints));
    let (mint_unchanged, mint_changed) = mint_rates(clients, &bundles, args.mints, &errors).await;

    Ok(DeployReport {
        scenario: "deploy",
        replicas: args.replicas,
        bundle_bytes: bundles.bytes,
        store: "postgres",
        bus: "redis",
        warm,
        cold,
        lease_request,
        empty_rpc,
        mint_unchanged,
        mint_changed,
        errors: errors.summary(),
        targets: Vec::new(),
        machine: Machine::default(),
    })
}

/// Applies `request`, counts until its revision runs, then waits (unmeasured)
/// until it is live and the previous one is released.
async fn deploy_one(
    clients: &Clients,
    request: v1::ApplyServiceRequest,
    replicas: u32,
    samples: &mut Samples,
    errors: &ErrorTally,
) {
    let sent = Instant::now();
    let outcome = async {
        let applied = clients.apply(request).await?;
        if !applied.revision_created {
            return Err("the apply minted no revision".to_string());
        }
        clients.await_running(&applied.revision, replicas).await?;
        Ok(applied.revision)
    }
    .await;
    match outcome {
        Ok(revision) => {
            samples.ok(sent.elapsed());
            if let Err(why) = clients.await_live(SERVICE, &revision).await {
                errors.add(&why);
            }
        }
        Err(why) => {
            samples.error();
            errors.add(&why);
        }
    }
}

/// `count` leases of the first bundle asked of leases one at a time, each
/// counted from `RequestLease` to RUNNING and released after.
async fn lease_baseline(
    clients: &Clients,
    bundles: &Bundles,
    count: u32,
    errors: &ErrorTally,
) -> Result<Figures, DeployBenchError> {
    let digest = bundles
        .registry
        .manifest_digest(REPOSITORY, "b0")
        .await?
        .ok_or_else(|| DeployBenchError::Bundle("the registry gave no digest for b0".into()))?;
    let mut client = clients.leases.clone();
    let mut samples = Samples::default();
    for index in 0..count {
        let request = leases::RequestLeaseRequest {
            project: String::new(),
            owner: "bench/baseline".to_string(),
            idempotency_key: format!("baseline-{index}"),
            resources: Some(REPLICA_ASK),
            workload: Some(leases::Workload {
                bundle: Some(BundleRef {
                    reference: bundles.registry.reference(&format!("{REPOSITORY}@{digest}")),
                    insecure: true,
                    ..Default::default()
                }),
                digest: digest.clone(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let sent = Instant::now();
        let lease = match client.request_lease(request).await {
            Ok(response) => response.into_inner().lease.unwrap_or_default(),
            Err(status) => {
                samples.error();
                errors.add(&format!("request lease: {}", status_message(&status)));
                continue;
            }
        };
        match await_lease_running(&mut client, &lease.lease_id).await {
            Ok(()) => samples.ok(sent.elapsed()),
            Err(why) => {
                samples.error();
                errors.add(&why);
            }
        }
        let release = leases::ReleaseLeaseRequest { lease_id: lease.lease_id, reason: String::new() };
        if let Err(status) = client.release_lease(release).await {
            errors.add(&format!("release lease: {}", status_message(&status)));
        }
    }
    Ok(samples.figures(Duration::ZERO, 1))
}

async fn await_lease_running(
    client: &mut leases::leases_client::LeasesClient<Channel>,
    lease_id: &str,
) -> Result<(), String> {
    let deadline = Instant::now() + RUN_TIMEOUT;
    loop {
        let lease = client
            .get_lease(leases::GetLeaseRequest { lease_id: lease_id.to_string() })
            .await
            .map_err(|s| format!("get lease: {}", status_message(&s)))?
            .into_inner()
            .lease
            .unwrap_or_default();
        match lease.phase() {
            LeasePhase::Running => return Ok(()),
            LeasePhase::Failed => return Err(format!("a lease failed: {} {}", lease.reason, lease.message)),
            _ if Instant::now() >= deadline => return Err(format!("a lease not RUNNING after {RUN_TIMEOUT:?}")),
            _ => tokio::time::sleep(POLL_EVERY).await,
        }
    }
}

async fn empty_rpcs(clients: &Clients, errors: &ErrorTally) -> Figures {
    let mut health = clients.health.clone();
    let mut samples = Samples::default();
    let started = Instant::now();
    for _ in 0..EMPTY_RPCS {
        let sent = Instant::now();
        match health.check(HealthCheckRequest { service: String::new() }).await {
            Ok(_) => samples.ok(sent.elapsed()),
            Err(status) => {
                samples.error();
                errors.add(&format!("health check: {}", status_message(&status)));
            }
        }
    }
    samples.figures(started.elapsed(), 1)
}

/// `count` unchanged applies, then `count` changed ones, of a service with
/// no replicas.
async fn mint_rates(clients: &Clients, bundles: &Bundles, count: u32, errors: &ErrorTally) -> (Figures, Figures) {
    let reference = bundles.reference("b0");
    let declaration = |value: String| apply_request(MINT_SERVICE, &reference, 0, &[("BENCH_MINT", value)]);
    if let Err(why) = clients.apply(declaration("first".into())).await {
        errors.add(&why);
    }
    let mut rates = Vec::with_capacity(2);
    for changed in [false, true] {
        let mut samples = Samples::default();
        let started = Instant::now();
        for index in 0..count {
            let value = if changed { index.to_string() } else { "first".to_string() };
            let sent = Instant::now();
            match clients.apply(declaration(value)).await {
                Ok(applied) if applied.revision_created == changed => samples.ok(sent.elapsed()),
                Ok(applied) => {
                    samples.error();
                    errors.add(&format!(
                        "an apply minted {:?} when it should {}",
                        applied.revision,
                        if changed { "have" } else { "not have" }
                    ));
                }
                Err(why) => {
                    samples.error();
                    errors.add(&why);
                }
            }
        }
        rates.push(samples.figures(started.elapsed(), 1));
    }
    let changed = rates.pop().unwrap_or_else(|| Samples::default().figures(Duration::ZERO, 1));
    let unchanged = rates.pop().unwrap_or_else(|| Samples::default().figures(Duration::ZERO, 1));
    (unchanged, changed)
}

/// Deletes both services, releases every lease left, and waits until no
/// process works under the node's data directory.
async fn drain(clients: &Clients, agent_dir: &Path) -> Result<(), DeployBenchError> {
    for name in [SERVICE, MINT_SERVICE] {
        let request = v1::DeleteServiceRequest { project: String::new(), name: name.to_string() };
        if let Err(status) = clients.services.clone().delete_service(request).await
            && status.code() != tonic::Code::NotFound
        {
            progress(&format!("warning: cannot delete service {name}: {}", status_message(&status)));
        }
    }
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    let mut client = clients.leases.clone();
    loop {
        // Revisions releases its services' leases; the baseline's are released here.
        if let Ok(listed) = client.list_leases(leases::ListLeasesRequest::default()).await {
            for lease in listed.into_inner().leases {
                if lease.owner.starts_with("bench/")
                    && matches!(lease.phase(), LeasePhase::Bound | LeasePhase::Launching | LeasePhase::Running)
                {
                    let _ = client
                        .release_lease(leases::ReleaseLeaseRequest { lease_id: lease.lease_id, reason: String::new() })
                        .await;
                }
            }
        }
        let left = processes_under(agent_dir);
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(DeployBenchError::Agent(format!(
                "replicas still running under {} after {DRAIN_TIMEOUT:?}: pids {left:?}",
                agent_dir.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The processes whose working directory is under `dir`: the node runs
/// every replica in a directory of its own there.
fn processes_under(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let cwd: PathBuf = std::fs::read_link(entry.path().join("cwd")).ok()?;
            cwd.starts_with(dir).then_some(pid)
        })
        .collect()
}
