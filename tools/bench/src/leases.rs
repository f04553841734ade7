//! `berth-bench leases`: placements against one leases replica on
//! PostgreSQL and Redis, beside pgbench claiming rows with `FOR UPDATE SKIP
//! LOCKED` in the same database in the same run.
//!
//! # Expected flow
//! 1. A CA made for the run signs the replica's, the bench's and the
//!    scripted registry's certificates. The registry serves `Nodes/WatchNodes` over
//!    mTLS from a fixed list of `--nodes` UP nodes, each with room for every
//!    lease, so the ledger follows nodes exactly as it follows identity.
//! 2. `berth-leases` starts as a process of its own in a scratch database,
//!    with its `leases:` prefix on Redis claimed for the run; the bench waits
//!    until it lists every node UP.
//! 3. `--concurrency` clients, one connection each, ask for `--leases` leases
//!    back to back; a placement counts when `RequestLease` answers a new
//!    lease BOUND to a node. The rate is placements over the wall time of
//!    the whole batch.
//! 4. Baseline: a table of `--leases` rows in the same scratch database,
//!    claimed one row per transaction by `pgbench` with as many clients for
//!    `--duration`.
//!
//! The scratch database and the Redis prefix are removed whatever happened.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use berth_core::Identity;
use berth_mtls::{CertificateAuthority, TlsCredentials, TlsMaterial};
use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1;
use berth_proto::types::v1::Capacity;
use berth_rpc::Channel;
use berth_testkit::ScriptedRegistry;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::leases_process::{LeasesLaunch, LeasesProcess};
use crate::load::{ErrorCount, ErrorTally, Figures, Samples, is_transient, status_message};
use crate::output::{RunError, print_report, progress};
use crate::process::{ScratchDatabase, ServiceProcessError, SharedStateArgs, claim_bus};
use crate::report::{Machine, Target, human};

/// Placements per second the replica must reach.
const TARGET_PLACEMENTS_PER_S: f64 = 1500.0;

/// How long one call may take before it counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the certificates made for the run live: longer than any run.
const CERT_TTL: Duration = Duration::from_secs(24 * 3600);

/// What each lease asks for; every node offers this times `--leases`.
const LEASE_ASK: Capacity = Capacity { cpu_millis: 10, memory_bytes: 16 << 20 };

/// How many times one placement is asked for when the answer says to retry.
const PLACE_ATTEMPTS: u32 = 5;

/// How long the replica may take to learn every node from the registry.
const NODES_TIMEOUT: Duration = Duration::from_secs(30);

/// Leases live this long; nothing renews them, so it outlasts any run.
const LEASE_TTL_SECONDS: u64 = 3600;

/// Flags of `berth-bench leases`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LeasesArgs {
    /// How many simulated UP nodes the ledger places on.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    nodes: u32,
    /// How many leases are placed, and how many rows the pgbench table has.
    #[arg(long, value_name = "M", value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    leases: u32,
    /// Placements in flight at once, each client on its own connection; also
    /// pgbench's client count.
    #[arg(long, default_value_t = 32, value_name = "C", value_parser = clap::value_parser!(u32).range(1..=1024))]
    concurrency: u32,
    /// How long pgbench claims rows.
    #[arg(long, default_value = "10s", value_name = "DURATION", value_parser = berth_runtime::parse_duration)]
    duration: Duration,
    #[command(flatten)]
    state: SharedStateArgs,
}

/// Why the leases benchmark could not run to the end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LeasesBenchError {
    /// The replica or its state could not be made, died, or not be removed.
    #[error(transparent)]
    Process(#[from] ServiceProcessError),
    /// The run's certificates could not be made.
    #[error("cannot make the run's certificates: {0}")]
    Certificates(#[source] berth_mtls::MtlsError),
    /// A name the run's certificates carry is not a valid identity.
    #[error("identity name: {0}")]
    Name(#[source] berth_core::IdentityError),
    /// The replica did not list every node UP in time.
    #[error("berth-leases saw {seen} of {nodes} nodes UP after {}s", NODES_TIMEOUT.as_secs())]
    NodesNotSeen {
        /// Nodes UP as the replica lists them.
        seen: usize,
        /// Nodes the registry serves.
        nodes: u32,
    },
    /// A client could not be made.
    #[error("cannot connect to berth-leases: {0}")]
    Connect(String),
    /// A client task failed, Ctrl-C arrived, or the report could not be written.
    #[error(transparent)]
    Run(#[from] RunError),
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LeasesReport {
    /// Always "leases".
    scenario: &'static str,
    /// Simulated UP nodes.
    nodes: u32,
    /// Leases asked for.
    leases: u32,
    /// Placements in flight at once.
    concurrency: u32,
    /// The replica's store: always "postgres".
    store: &'static str,
    /// The replica's bus: "redis" or "memory".
    bus: &'static str,
    /// The replica's process id.
    leases_pid: u32,
    /// RequestLease → BOUND, one call in flight per connection.
    placement: Figures,
    /// Wall time of the whole batch.
    placement_seconds: f64,
    /// The pgbench claim baseline.
    pgbench: Baseline,
    /// The replica's resident memory, MiB.
    leases_memory: LeasesMemory,
    /// Every distinct failure, commonest first.
    errors: Vec<ErrorCount>,
    /// The targets, judged.
    targets: Vec<Target>,
    /// The machine it ran on.
    #[serde(flatten)]
    machine: Machine,
}

/// The replica's resident memory, MiB.
#[derive(Debug, Clone, Serialize)]
struct LeasesMemory {
    /// Once it listed every node, before any lease.
    idle_mib: f64,
    /// With every lease on record.
    with_leases_mib: f64,
    /// The most it was ever resident (`VmHWM`).
    peak_mib: f64,
}

/// pgbench's claim rate, or why there is none.
#[derive(Debug, Clone, Serialize)]
struct Baseline {
    /// Whether pgbench ran.
    available: bool,
    /// Why not, when it did not.
    unavailable_reason: Option<String>,
    /// Transactions per second as pgbench reports them (without connection time).
    tps: Option<f64>,
    /// pgbench clients.
    clients: u32,
    /// How long it ran.
    seconds: f64,
    /// Rows in the table.
    rows: u32,
    /// Rows claimed by the end.
    rows_claimed: u64,
    /// Every row was claimed before the end, so later transactions found
    /// nothing to claim and `tps` overstates the claim rate.
    exhausted: bool,
    /// Rows claimed per second from the first claim to the last, read from
    /// the rows' own timestamps: the claim rate whether or not the table ran out.
    claims_per_s: Option<f64>,
    /// The exact command, for repeating it by hand.
    command: String,
}

/// The run's certificates, all signed by one CA made for it.
#[derive(Debug)]
pub(crate) struct RunCertificates {
    ca: CertificateAuthority,
}

impl RunCertificates {
    pub(crate) fn new() -> Result<Self, LeasesBenchError> {
        let ca = CertificateAuthority::generate("berth-bench CA", CERT_TTL).map_err(LeasesBenchError::Certificates)?;
        Ok(Self { ca })
    }

    /// Material for `identity`, valid as a server on loopback.
    pub(crate) fn material(&self, identity: &Identity) -> Result<TlsMaterial, LeasesBenchError> {
        let sans = ["localhost".to_string(), "127.0.0.1".to_string()];
        let (cert, key_pem) = self.ca.issue(identity, &sans, CERT_TTL).map_err(LeasesBenchError::Certificates)?;
        Ok(TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem, ca_bundle_pem: self.ca.cert_pem().to_string() })
    }

    pub(crate) fn credentials(&self, identity: &Identity) -> Result<TlsCredentials, LeasesBenchError> {
        TlsCredentials::new(self.material(identity)?).map_err(LeasesBenchError::Certificates)
    }
}

fn identity_of(result: Result<Identity, berth_core::IdentityError>) -> Result<Identity, LeasesBenchError> {
    result.map_err(LeasesBenchError::Name)
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: LeasesArgs) -> Result<(), LeasesBenchError> {
    let machine = Machine::before_run();
    let shutdown = berth_rpc::shutdown_signal();
    let certificates = RunCertificates::new()?;
    let admin = certificates.credentials(&identity_of(Identity::admin("bench"))?)?;

    let registry_stop = CancellationToken::new();
    let registry_addr = serve_registry(&certificates, args.nodes, args.leases, &registry_stop).await;

    progress("creating a scratch database");
    let database = ScratchDatabase::create(&args.state.database_url).await?;
    let outcome = tokio::select! {
        outcome = with_database(&args, &certificates, &admin, registry_addr, &database) => outcome,
        () = shutdown.cancelled() => Err(RunError::Interrupted.into()),
    };
    registry_stop.cancel();
    progress("dropping the scratch database");
    let dropped = database.drop_database().await;
    let mut report = outcome?;
    dropped?;
    report.machine = machine;
    report.judge();
    print_report(args.state.output, &report, |r| r.table()).map_err(RunError::Output)?;
    Ok(())
}

/// Serves a registry of `nodes` UP nodes, each with room for `leases`
/// leases, and no change after them.
async fn serve_registry(
    certificates: &RunCertificates,
    nodes: u32,
    leases: u32,
    stop: &CancellationToken,
) -> SocketAddr {
    let room = Capacity {
        cpu_millis: LEASE_ASK.cpu_millis * u64::from(leases),
        memory_bytes: LEASE_ASK.memory_bytes * u64::from(leases),
    };
    let registry = ScriptedRegistry::new((0..nodes).map(|index| identity::Node {
        node_id: format!("bench-node-{index:06}"),
        state: identity::NodeState::Up as i32,
        capacity: Some(room),
        ..Default::default()
    }));
    registry.serve(&certificates.ca, stop.clone()).await
}

/// Everything that runs inside the scratch database: the bus claim, the
/// replica, the placements and pgbench.
async fn with_database(
    args: &LeasesArgs,
    certificates: &RunCertificates,
    admin: &TlsCredentials,
    registry_addr: SocketAddr,
    database: &ScratchDatabase,
) -> Result<LeasesReport, LeasesBenchError> {
    let launch = LeasesLaunch {
        material: certificates.material(&identity_of(Identity::service(berth_leases::NAME))?)?,
        probe: admin,
        database_url: database.url().to_string(),
        redis_url: args.state.redis_url.clone(),
        identity_addr: registry_addr,
        lease_ttl_seconds: LEASE_TTL_SECONDS,
        listen: None,
    };
    let bus = if args.state.redis_url.starts_with("memory:") {
        None
    } else {
        Some(claim_bus(&args.state.redis_url, berth_leases::NAME).await?)
    };
    let outcome = with_leases(args, launch, database).await;
    if let Some(bus) = bus
        && let Err(error) = bus.clear().await
    {
        progress(&format!("warning: cannot clear the leases: prefix on {}: {error}", args.state.redis_url));
    }
    outcome
}

/// Runs `berth-leases` as `launch` says while the placements and pgbench
/// measure it.
async fn with_leases(
    args: &LeasesArgs,
    launch: LeasesLaunch<'_>,
    database: &ScratchDatabase,
) -> Result<LeasesReport, LeasesBenchError> {
    let bus = if args.state.redis_url.starts_with("memory:") { "memory" } else { "redis" };
    progress(&format!("starting berth-leases on postgres with a {bus} bus, following {} nodes", args.nodes));
    let admin = launch.probe;
    let leases = LeasesProcess::start(launch).await?;
    let outcome = tokio::select! {
        outcome = measure(args, admin, &leases, database, bus) => outcome,
        died = leases.exited() => Err(LeasesBenchError::Process(died)),
    };
    progress("stopping berth-leases");
    leases.stop().await;
    outcome
}

async fn measure(
    args: &LeasesArgs,
    admin: &TlsCredentials,
    leases: &LeasesProcess,
    database: &ScratchDatabase,
    bus: &'static str,
) -> Result<LeasesReport, LeasesBenchError> {
    let channel = connect(leases.addr(), admin)?;
    wait_for_nodes(&channel, args.nodes).await?;
    let idle_kib = leases.memory().map_or(0, |m| m.rss_kib);

    progress(&format!("placing {} leases, {} at a time", args.leases, args.concurrency));
    let errors = ErrorTally::default();
    let (samples, elapsed) = place_all(leases.addr(), admin, args, &errors).await?;
    let memory = leases.memory();

    progress(&format!(
        "pgbench: claiming {} rows with {} clients for {}",
        args.leases,
        args.concurrency,
        human(args.duration)
    ));
    let pgbench = pgbench(database, args.leases, args.concurrency, args.duration).await?;

    let mib = |kib: u64| kib as f64 / 1024.0;
    Ok(LeasesReport {
        scenario: "leases",
        nodes: args.nodes,
        leases: args.leases,
        concurrency: args.concurrency,
        store: "postgres",
        bus,
        leases_pid: leases.pid(),
        placement: samples.figures(elapsed, args.concurrency),
        placement_seconds: elapsed.as_secs_f64(),
        pgbench,
        leases_memory: LeasesMemory {
            idle_mib: mib(idle_kib),
            with_leases_mib: mib(memory.map_or(0, |m| m.rss_kib)),
            peak_mib: mib(memory.map_or(0, |m| m.peak_kib)),
        },
        errors: errors.summary(),
        targets: Vec::new(),
        machine: Machine::default(),
    })
}

fn connect(addr: SocketAddr, credentials: &TlsCredentials) -> Result<Channel, LeasesBenchError> {
    berth_rpc::connect(&addr.to_string(), credentials.clone()).map_err(|e| LeasesBenchError::Connect(e.to_string()))
}

/// Waits until the replica lists `nodes` nodes UP.
pub(crate) async fn wait_for_nodes(channel: &Channel, nodes: u32) -> Result<(), LeasesBenchError> {
    let mut capacity = v1::capacity_client::CapacityClient::new(channel.clone());
    let deadline = Instant::now() + NODES_TIMEOUT;
    loop {
        let seen = match capacity.list_node_capacity(v1::ListNodeCapacityRequest::default()).await {
            Ok(answer) => {
                answer.into_inner().nodes.iter().filter(|n| n.state == identity::NodeState::Up as i32).count()
            }
            Err(_) => 0,
        };
        if seen >= nodes as usize {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(LeasesBenchError::NodesNotSeen { seen, nodes });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Places every lease with `--concurrency` clients; the samples and the
/// wall time from the first request to the last answer.
async fn place_all(
    addr: SocketAddr,
    admin: &TlsCredentials,
    args: &LeasesArgs,
    errors: &ErrorTally,
) -> Result<(Samples, Duration), LeasesBenchError> {
    let mut clients = Vec::with_capacity(args.concurrency as usize);
    for _ in 0..args.concurrency {
        let channel = connect(addr, admin)?;
        // Dialled before the clock starts, so the rate is placements alone.
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        health
            .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
            .await
            .map_err(|s| LeasesBenchError::Connect(status_message(&s)))?;
        clients.push(v1::leases_client::LeasesClient::new(channel));
    }
    let next = Arc::new(AtomicU32::new(0));
    let started = Instant::now();
    let mut running = JoinSet::new();
    for mut client in clients {
        let (next, errors, total) = (next.clone(), errors.clone(), args.leases);
        running.spawn(async move {
            let mut samples = Samples::default();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= total {
                    return samples;
                }
                for attempt in 1..=PLACE_ATTEMPTS {
                    let sent = Instant::now();
                    match place(&mut client, index).await {
                        Ok(()) => {
                            samples.ok(sent.elapsed());
                            break;
                        }
                        Err((message, transient)) => {
                            samples.error();
                            errors.add(&message);
                            if !transient || attempt == PLACE_ATTEMPTS {
                                break;
                            }
                        }
                    }
                }
            }
        });
    }
    let mut all = Samples::default();
    while let Some(joined) = running.join_next().await {
        all.merge(joined.map_err(RunError::Task)?);
    }
    Ok((all, started.elapsed()))
}

/// Asks for lease `index`; Ok when it was created BOUND to a node.
async fn place(client: &mut v1::leases_client::LeasesClient<Channel>, index: u32) -> Result<(), (String, bool)> {
    let mut request = tonic::Request::new(v1::RequestLeaseRequest {
        project: String::new(),
        owner: "bench/leases".to_string(),
        idempotency_key: format!("bench-{index}"),
        resources: Some(LEASE_ASK),
        tier: String::new(),
        spread_group: String::new(),
        workload: Some(v1::Workload { command: "/bin/true".to_string(), ..Default::default() }),
    });
    request.set_timeout(CALL_TIMEOUT);
    match tokio::time::timeout(CALL_TIMEOUT, client.request_lease(request)).await {
        Ok(Ok(answer)) => {
            let answer = answer.into_inner();
            let phase = answer.lease.as_ref().map_or(0, |l| l.phase);
            let placed = answer.lease.as_ref().is_some_and(|l| !l.node_id.is_empty());
            if phase == v1::LeasePhase::Bound as i32 && placed {
                Ok(())
            } else {
                Err((format!("lease answered in phase {phase} (created: {})", answer.created), false))
            }
        }
        Ok(Err(status)) => Err((status_message(&status), is_transient(status.code()))),
        Err(_) => Err((format!("no answer within {}s", CALL_TIMEOUT.as_secs()), true)),
    }
}

/// The claim every pgbench transaction makes: the lowest unclaimed row,
/// skipping rows other clients hold, marked as this client's.
const CLAIM_SCRIPT: &str = "WITH next AS (SELECT id FROM bench_claims WHERE claimed_at IS NULL ORDER BY id LIMIT 1 \
     FOR UPDATE SKIP LOCKED) UPDATE bench_claims SET claimed_at = clock_timestamp(), claimed_by = :client_id \
     FROM next WHERE bench_claims.id = next.id;\n";

/// Runs the claim baseline in the scratch database; a missing pgbench or
/// a failed run is reported as unavailable, not as a failed bench.
async fn pgbench(
    database: &ScratchDatabase,
    rows: u32,
    clients: u32,
    duration: Duration,
) -> Result<Baseline, LeasesBenchError> {
    let seconds = duration.as_secs().max(1);
    let threads = clients.min(2);
    let command_line = format!("pgbench -n -f claim.sql -c {clients} -j {threads} -T {seconds} <scratch database>");
    let unavailable = |reason: String| Baseline {
        available: false,
        unavailable_reason: Some(reason),
        tps: None,
        clients,
        seconds: seconds as f64,
        rows,
        rows_claimed: 0,
        exhausted: false,
        claims_per_s: None,
        command: command_line.clone(),
    };
    let Some(pgbench) = find_in_path("pgbench") else {
        progress("pgbench not found (Debian: apt-get install postgresql-client); the baseline is unavailable");
        return Ok(unavailable("pgbench not found in PATH".to_string()));
    };
    database
        .execute(&format!(
            "CREATE TABLE bench_claims (id integer PRIMARY KEY, claimed_at timestamptz, claimed_by integer); \
             INSERT INTO bench_claims (id) SELECT generate_series(1, {rows}); \
             CREATE INDEX bench_claims_unclaimed ON bench_claims (id) WHERE claimed_at IS NULL; \
             ANALYZE bench_claims"
        ))
        .await?;
    let dir = tempfile::tempdir()
        .map_err(|source| ServiceProcessError::Io { what: "cannot create a temporary directory", source })?;
    let script = dir.path().join("claim.sql");
    std::fs::write(&script, CLAIM_SCRIPT)
        .map_err(|source| ServiceProcessError::Io { what: "cannot write the pgbench script", source })?;
    let output = tokio::process::Command::new(&pgbench)
        .arg("-n")
        .arg("-f")
        .arg(&script)
        .args(["-c", &clients.to_string(), "-j", &threads.to_string(), "-T", &seconds.to_string()])
        .arg(database.url())
        .output()
        .await;
    let output = match output {
        Ok(output) => output,
        Err(error) => return Ok(unavailable(format!("cannot run {}: {error}", pgbench.display()))),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let Some(tps) = output.status.success().then(|| parse_tps(&stdout)).flatten() else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output").to_string();
        return Ok(unavailable(format!("pgbench failed ({}): {last}", output.status)));
    };
    let claimed = database.count("SELECT count(*) FROM bench_claims WHERE claimed_at IS NOT NULL").await?;
    let rows_claimed = u64::try_from(claimed).unwrap_or(0);
    let span_us = database
        .count(
            "SELECT coalesce((extract(epoch FROM max(claimed_at) - min(claimed_at)) * 1000000)::bigint, 0) \
             FROM bench_claims WHERE claimed_at IS NOT NULL",
        )
        .await?;
    let claims_per_s = (span_us > 0).then(|| rows_claimed.saturating_sub(1) as f64 * 1e6 / span_us as f64);
    Ok(Baseline {
        available: true,
        unavailable_reason: None,
        tps: Some(tps),
        clients,
        seconds: seconds as f64,
        rows,
        rows_claimed,
        exhausted: rows_claimed >= u64::from(rows),
        claims_per_s,
        command: command_line,
    })
}

fn find_in_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(name)).find(|path| path.is_file())
}

/// pgbench's `tps = N (without initial connection time)`; older versions
/// print the figure "excluding connections establishing".
fn parse_tps(output: &str) -> Option<f64> {
    let figures: BTreeMap<bool, f64> = output
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("tps = ")?;
            let value = rest.split_whitespace().next()?.parse().ok()?;
            Some((rest.contains("without") || rest.contains("excluding"), value))
        })
        .collect();
    figures.get(&true).or_else(|| figures.get(&false)).copied()
}

impl LeasesReport {
    fn judge(&mut self) {
        let rate = self.placement.rate_per_s;
        self.targets = vec![
            Target {
                name: format!("placements >= {TARGET_PLACEMENTS_PER_S:.0}/s"),
                value: Some(rate),
                met: rate >= TARGET_PLACEMENTS_PER_S,
            },
            Target {
                name: "every lease placed, no errors".to_string(),
                value: Some(self.placement.errors as f64),
                met: self.placement.errors == 0 && self.placement.calls == u64::from(self.leases),
            },
        ];
    }

    fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "berth-bench leases: {} nodes, {} leases, {} at a time, leases on {} + {} (pid {})",
            self.nodes, self.leases, self.concurrency, self.store, self.bus, self.leases_pid
        );
        let _ = writeln!(out, "{:<34}{:>10}{:>10}{:>10}{:>10}{:>8}", "", "rate/s", "p50", "p99", "max", "errors");
        let p = &self.placement;
        let _ = writeln!(
            out,
            "{:<34}{:>10.1}{:>10}{:>10}{:>10}{:>8}",
            "RequestLease -> BOUND",
            p.rate_per_s,
            latency(p.p50_ms),
            latency(p.p99_ms),
            latency(p.max_ms),
            p.errors
        );
        let b = &self.pgbench;
        match b.tps {
            Some(tps) => {
                let claims = b.claims_per_s.map_or_else(|| "-".to_string(), |r| format!("{r:.1}"));
                let _ = writeln!(
                    out,
                    "{:<34}{claims:>10}{:>10}{:>10}{:>10}{:>8}",
                    "pgbench SKIP LOCKED claim", "-", "-", "-", 0
                );
                let _ = writeln!(
                    out,
                    "(pgbench: {} clients for {:.0}s on {} rows, {} claimed, first to last claim; pgbench's own tps {tps:.1}{})",
                    b.clients,
                    b.seconds,
                    b.rows,
                    b.rows_claimed,
                    if b.exhausted { ", which counts the empty claims after the table ran out" } else { "" }
                );
            }
            None => {
                let reason = b.unavailable_reason.as_deref().unwrap_or("unknown");
                let _ = writeln!(out, "pgbench baseline unavailable: {reason}");
            }
        }
        let _ = writeln!(
            out,
            "placed {} leases in {:.2}s; leases RSS: idle {:.1} MiB, with {} leases {:.1} MiB (peak {:.1} MiB)",
            p.calls,
            self.placement_seconds,
            self.leases_memory.idle_mib,
            self.leases,
            self.leases_memory.with_leases_mib,
            self.leases_memory.peak_mib
        );
        self.machine.write_footer(
            &mut out,
            "shared by leases, PostgreSQL, Redis and the bench",
            &self.targets,
            &self.errors,
        );
        out
    }
}

/// A latency for the table: two decimals under a millisecond, one above.
pub(crate) fn latency(ms: Option<f64>) -> String {
    match ms {
        None => "-".to_string(),
        Some(ms) if ms < 1.0 => format!("{ms:.2}ms"),
        Some(ms) => format!("{ms:.1}ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tps_is_read_without_connection_time() {
        let new = "number of transactions actually processed: 100\nlatency average = 1.2 ms\n\
                   initial connection time = 5.1 ms\ntps = 1834.123456 (without initial connection time)\n";
        assert_eq!(parse_tps(new), Some(1834.123456));
        let old =
            "tps = 900.5 (including connections establishing)\ntps = 950.25 (excluding connections establishing)\n";
        assert_eq!(parse_tps(old), Some(950.25));
        assert_eq!(parse_tps("pgbench: error: connection refused\n"), None);
    }
}
