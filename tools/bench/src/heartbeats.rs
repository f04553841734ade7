//! `berth-bench heartbeats`: simulated nodes heartbeating identity over
//! real mTLS, beside an empty RPC on the same stack.
//!
//! # Expected flow
//! 1. Identity starts as a process of its own on fresh state (with
//!    `--replicas N`, N processes on one PostgreSQL database and Redis); its
//!    idle memory is read once it serves.
//! 2. Baseline: `--nodes` mTLS connections (the bench's admin certificate)
//!    call `grpc.health.v1.Health/Check` back to back, one call in flight on
//!    each: the most this stack serves of an RPC that does nothing.
//! 3. The nodes join, a bounded number at a time. Each sends its first
//!    heartbeat right away on its own mTLS connection with its own
//!    certificate (which brings it `UP`), then one every `--interval`, its
//!    phase spread evenly over one interval, as an agent does.
//! 4. Once every node is up: a warm-up, then the measured window of paced
//!    heartbeats.
//! 5. Then each node heartbeats back to back, one in flight, like the
//!    baseline: a warm-up and a measured window. This is the figure the
//!    baseline is compared with.
//!
//! Identity's memory is sampled throughout; its kernel-kept peak (`VmHWM`)
//! is the figure "at load".
//!
//! # Several replicas
//! Each node joins through replica `index % N` and heartbeats to the replica
//! an agent given all N addresses would prefer (`berth_agent::preferred_index`
//! of its node id), so the spread is the one a real fleet gets. The baseline's
//! connections go round the replicas. Memory and CPU figures are the sum over
//! the replicas; the report also gives each replica's nodes and memory, and
//! the memory target holds each replica, not their sum.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use berth_proto::identity::v1;
use berth_proto::identity::v1::node_session_client::NodeSessionClient;
use berth_rpc::Channel;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::identity_process::{IdentityProcess, ProcessError, StateOptions};
use crate::load::{CpuFigures, CpuUse, ErrorTally, Figures, Samples, Window, is_transient, status_message};
use crate::nodes::{self, JoinedNode, MAX_NODES, NODE_CAPACITY};
use crate::output::{OutputFormat, RunError, print_report, progress};
use crate::procfs::{MachineCpu, Memory, read_cpu_time, read_machine_cpu, read_memory};
use crate::report::{JoinFigures, Machine, MemoryFigures, PhasePeaks, ReplicaFigures, Report, human};

/// How long one call may take before it counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections dialled at once before the baseline starts.
const DIAL_CONCURRENCY: usize = 64;

/// How long identity idles after it serves before its idle memory is read.
const IDLE_SETTLE: Duration = Duration::from_secs(1);

/// How often identity's resident memory is sampled.
const MEMORY_SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Joins allowed per token; nodes take tokens in turn, so concurrent joins
/// rarely update one token's row at once.
const NODES_PER_TOKEN: u32 = 100;

/// How many times a node tries its join, and then its first heartbeat.
const SETUP_ATTEMPTS: u32 = 6;

/// The longest first wait before a node tries its join or first heartbeat again.
const SETUP_BACKOFF: Duration = Duration::from_millis(200);

/// Open files the bench needs beyond one per connection.
const SPARE_FILES: u64 = 256;

/// Flags of `berth-bench heartbeats`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct HeartbeatArgs {
    /// How many simulated nodes join and heartbeat, each on its own
    /// connection (and as many connections for the baseline).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_NODES)))]
    nodes: u32,
    /// How often each node heartbeats, e.g. 1s or 500ms.
    #[arg(long, default_value = "1s", value_name = "DURATION", value_parser = parse_positive_duration)]
    interval: Duration,
    /// How long each measured window lasts.
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = parse_positive_duration)]
    duration: Duration,
    /// How long the load runs before each measured window.
    #[arg(long, default_value = "5s", value_name = "DURATION", value_parser = parse_duration)]
    warmup: Duration,
    /// A PostgreSQL server to run identity on, the production shape. The bench
    /// creates a scratch database there and drops it at the end. Unset:
    /// identity runs on a temporary SQLite file.
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
    /// A Redis for identity's bus, e.g. redis://127.0.0.1:6379/15. Its
    /// 'identity:' prefix must be empty there; it is cleared at the end.
    /// Unset: identity's in-process bus.
    #[arg(long, value_name = "URL")]
    redis_url: Option<String>,
    /// How many identity replicas serve the nodes, on one PostgreSQL
    /// database and Redis (above 1, --database-url and --redis-url are
    /// needed).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=16))]
    replicas: u32,
    /// How many nodes join at once.
    #[arg(long, default_value_t = 32, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    join_concurrency: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

/// Why the benchmark could not run to the end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    /// Identity could not be started, died, or its state not removed.
    #[error(transparent)]
    Identity(#[from] ProcessError),
    /// Replicas were asked for without the state they share.
    #[error("--replicas {0} needs --database-url and --redis-url: replicas share one PostgreSQL database and Redis")]
    ReplicasNeedSharedState(u32),
    /// The process may not open enough files for the connections.
    #[error(
        "{nodes} nodes need about {needed} open files, but the limit is {limit} (hard limit {hard}); \
         raise it, e.g. `ulimit -n {needed}`, or run fewer nodes"
    )]
    OpenFiles {
        /// Nodes asked for.
        nodes: u32,
        /// Files needed.
        needed: u64,
        /// The soft limit in force.
        limit: u64,
        /// The hard limit.
        hard: String,
    },
    /// A connection could not be made before the load started.
    #[error("cannot connect client {index} to identity: {message}")]
    Connect {
        /// Which connection.
        index: u32,
        /// What the client saw.
        message: String,
    },
    /// Identity refused a join token to the bench's admin.
    #[error("cannot create a join token: {0}")]
    Token(String),
    /// A node could not join.
    #[error("node {index} could not join: {source}")]
    Join {
        /// Which node.
        index: u32,
        /// Why.
        #[source]
        source: nodes::JoinError,
    },
    /// Identity refused a node's first heartbeat for good.
    #[error("node {index} ({node_id}) joined but its first heartbeat was refused: {message}")]
    FirstHeartbeat {
        /// Which node.
        index: u32,
        /// Its id.
        node_id: String,
        /// What the client saw.
        message: String,
    },
    /// Identity's memory could not be read from `/proc`.
    #[error("cannot read the memory of berth-identity (pid {pid}) from /proc/{pid}/status")]
    Memory {
        /// Identity's process id.
        pid: u32,
    },
    /// A client task failed, Ctrl-C arrived, or the report could not be written.
    #[error(transparent)]
    Run(#[from] RunError),
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: HeartbeatArgs) -> Result<(), BenchError> {
    if args.replicas > 1 && (args.database_url.is_none() || args.redis_url.is_none()) {
        return Err(BenchError::ReplicasNeedSharedState(args.replicas));
    }
    raise_open_files_limit(args.nodes, args.join_concurrency)?;
    let machine = Machine::before_run();
    let state =
        StateOptions { database_url: args.database_url.clone(), redis_url: args.redis_url.clone(), leases_addr: None };
    let shutdown = berth_rpc::shutdown_signal();
    let (store, bus) = state.describe();
    progress(&format!("starting {} berth-identity replica(s) on {store} with a {bus} bus", args.replicas));
    let mut report = IdentityProcess::around(
        &state,
        args.replicas as usize,
        &shutdown,
        || RunError::Interrupted.into(),
        async |identity| scenario(&args, identity, store, bus).await,
    )
    .await?;
    report.machine = machine;
    report.judge();
    print_report(args.output, &report, Report::table).map_err(RunError::Output)?;
    Ok(())
}

async fn scenario(
    args: &HeartbeatArgs,
    identity: &IdentityProcess,
    store: &'static str,
    bus: &'static str,
) -> Result<Report, BenchError> {
    let pids = identity.pids();
    let memory = MemorySampler::spawn(&pids);
    tokio::time::sleep(IDLE_SETTLE).await;
    let idle = replica_memory(&pids)?;
    let idle_kib: u64 = idle.iter().map(|m| m.rss_kib).sum();
    memory.take_peaks();
    let errors = ErrorTally::default();

    progress(&format!(
        "empty RPC baseline: {} connections, {} warm-up, {} measured",
        args.nodes,
        human(args.warmup),
        human(args.duration)
    ));
    let empty = baseline(identity, args, &errors).await?;
    let empty_peak: u64 = memory.take_peaks().iter().sum();

    progress(&format!("joining {} nodes, {} at a time", args.nodes, args.join_concurrency));
    let join_started = CpuMark::now(&pids);
    let fleet = Fleet::join(identity, args, &errors).await?;
    let join_cpu = join_started.zip(CpuMark::now(&pids)).map(|(before, after)| before.until(after));
    let join_peak: u64 = memory.take_peaks().iter().sum();
    let join = JoinFigures {
        nodes: args.nodes,
        first_heartbeat_failed: fleet.not_up,
        cpu: join_cpu.and_then(|used| CpuFigures::over(used, fleet.joined_in, u64::from(args.nodes))),
        concurrency: args.join_concurrency,
        seconds: fleet.joined_in.as_secs_f64(),
        rate_per_s: f64::from(args.nodes) / fleet.joined_in.as_secs_f64().max(f64::EPSILON),
    };
    progress(&format!(
        "joined in {:.1}s; heartbeats every {}: {} warm-up, {} measured, then saturated: {} warm-up, {} measured",
        join.seconds,
        human(args.interval),
        human(args.warmup),
        human(args.duration),
        human(args.warmup),
        human(args.duration)
    ));
    let plan = fleet.start_plan(args.warmup, args.duration);
    let paced_cpu = measure_cpu(&pids, plan.paced);
    let saturated_cpu = measure_cpu(&pids, plan.saturated);
    tokio::time::sleep_until(plan.saturate_at.into()).await;
    let paced_peaks = memory.take_peaks();
    let paced_peak: u64 = paced_peaks.iter().sum();
    let nodes_per_replica = fleet.per_replica.clone();
    let (paced, saturated) = fleet.finish().await?;
    let saturated_peak: u64 = memory.take_peaks().iter().sum();
    let at_load = replica_memory(&pids)?;
    let at_load_kib: u64 = at_load.iter().map(|m| m.peak_kib).sum();
    let replicas = (0..pids.len())
        .map(|i| ReplicaFigures {
            pid: pids[i],
            nodes: nodes_per_replica[i],
            idle_mib: mib(idle[i].rss_kib),
            at_load_mib: mib(at_load[i].peak_kib),
            heartbeat_mib: mib(paced_peaks[i]),
            per_node_kib: (nodes_per_replica[i] > 0)
                .then(|| paced_peaks[i].saturating_sub(idle[i].rss_kib) as f64 / f64::from(nodes_per_replica[i])),
        })
        .collect();

    Ok(Report {
        scenario: "heartbeats",
        nodes: args.nodes,
        interval_ms: millis(args.interval),
        warmup_ms: millis(args.warmup),
        duration_ms: millis(args.duration),
        store,
        bus,
        identity_pid: identity.pid(),
        heartbeat: paced
            .figures(plan.paced.length(), args.nodes)
            .with_cpu(cpu_of(paced_cpu).await, plan.paced.length()),
        heartbeat_offered_per_s: f64::from(args.nodes) / args.interval.as_secs_f64(),
        heartbeat_saturated: saturated
            .figures(plan.saturated.length(), args.nodes)
            .with_cpu(cpu_of(saturated_cpu).await, plan.saturated.length()),
        empty_rpc: empty,
        join,
        identity_memory: MemoryFigures {
            idle_mib: mib(idle_kib),
            at_load_mib: mib(at_load_kib),
            phase_peaks_mib: PhasePeaks {
                empty_rpc: mib(empty_peak),
                join: mib(join_peak),
                heartbeat: mib(paced_peak),
                heartbeat_saturated: mib(saturated_peak),
            },
            per_connection_kib: empty_peak.saturating_sub(idle_kib) as f64 / f64::from(args.nodes),
        },
        replicas,
        errors: errors.summary(),
        targets: Vec::new(),
        machine: Machine::default(),
    })
}

/// Each replica's memory now, in order.
fn replica_memory(pids: &[u32]) -> Result<Vec<Memory>, BenchError> {
    pids.iter().map(|&pid| read_memory(pid).ok_or(BenchError::Memory { pid })).collect()
}

/// The empty-RPC baseline: every connection dialled first, then health
/// checks back to back on each.
async fn baseline(
    identity: &IdentityProcess,
    args: &HeartbeatArgs,
    errors: &ErrorTally,
) -> Result<Figures, BenchError> {
    let addrs = identity.addrs();
    let mut clients = Vec::with_capacity(args.nodes as usize);
    for index in 0..args.nodes {
        let addr = addrs[index as usize % addrs.len()].to_string();
        let channel = berth_rpc::connect(&addr, identity.admin().clone())
            .map_err(|e| BenchError::Connect { index, message: e.to_string() })?;
        clients.push(HealthClient::new(channel));
    }
    let dial = Arc::new(Semaphore::new(DIAL_CONCURRENCY));
    let mut dialled = JoinSet::new();
    for (index, client) in (0u32..).zip(clients) {
        let dial = dial.clone();
        dialled.spawn(async move {
            let _permit = dial.acquire_owned().await;
            let mut client = client;
            match health_check(&mut client).await {
                Ok(()) => Ok(client),
                Err(message) => Err(BenchError::Connect { index, message }),
            }
        });
    }
    let mut ready = Vec::with_capacity(args.nodes as usize);
    while let Some(joined) = dialled.join_next().await {
        ready.push(joined.map_err(RunError::Task)??);
    }

    let window = Window::after(Instant::now(), args.warmup, args.duration);
    let cpu = measure_cpu(&identity.pids(), window);
    let mut running = JoinSet::new();
    for mut client in ready {
        let errors = errors.clone();
        running.spawn(async move {
            let mut samples = Samples::default();
            loop {
                let sent = Instant::now();
                if sent >= window.end {
                    return samples;
                }
                let outcome = health_check(&mut client).await;
                let done = Instant::now();
                if let Err(message) = &outcome {
                    errors.add(message);
                }
                if window.contains(done) {
                    match outcome {
                        Ok(()) => samples.ok(done - sent),
                        Err(_) => samples.error(),
                    }
                }
            }
        });
    }
    let mut all = Samples::default();
    while let Some(joined) = running.join_next().await {
        all.merge(joined.map_err(RunError::Task)?);
    }
    Ok(all.figures(window.length(), args.nodes).with_cpu(cpu_of(cpu).await, window.length()))
}

async fn health_check(client: &mut HealthClient<Channel>) -> Result<(), String> {
    let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
    request.set_timeout(CALL_TIMEOUT);
    match tokio::time::timeout(CALL_TIMEOUT, client.check(request)).await {
        Ok(Ok(answer)) if answer.get_ref().status == ServingStatus::Serving as i32 => Ok(()),
        Ok(Ok(answer)) => Err(format!("health check answered status {}", answer.get_ref().status)),
        Ok(Err(status)) => Err(status_message(&status)),
        Err(_) => Err(format!("no answer within {}s", CALL_TIMEOUT.as_secs())),
    }
}

/// When the heartbeat windows are, once every node is up.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Paced heartbeats counted here.
    paced: Window,
    /// From here on each node heartbeats back to back.
    saturate_at: Instant,
    /// Back-to-back heartbeats counted here; nodes stop at its end.
    saturated: Window,
}

/// What one node's loop saw.
#[derive(Debug, Default)]
struct NodeSamples {
    paced: Samples,
    saturated: Samples,
}

/// The joined nodes, heartbeating.
#[derive(Debug)]
struct Fleet {
    loops: JoinSet<NodeSamples>,
    plan: watch::Sender<Option<Plan>>,
    joined_in: Duration,
    /// Nodes whose first heartbeat failed every attempt; their loops go on trying.
    not_up: u32,
    /// Nodes heartbeating to each replica, in order.
    per_replica: Vec<u32>,
}

impl Fleet {
    /// Creates the join tokens, joins every node (each then heartbeating on
    /// its own), and returns once all are up.
    async fn join(identity: &IdentityProcess, args: &HeartbeatArgs, errors: &ErrorTally) -> Result<Self, BenchError> {
        let started = Instant::now();
        let tokens: Arc<Vec<String>> = Arc::new(create_tokens(identity, args.nodes).await?);
        let ca_bundle_pem: Arc<str> = identity.ca_bundle_pem().into();
        let (plan, plan_rx) = watch::channel(None);
        // Node i beats at epoch + i/n of an interval, + k intervals.
        let epoch = Instant::now();
        let mut loops = JoinSet::new();
        let mut joins = JoinSet::new();
        let slots = Arc::new(Semaphore::new(args.join_concurrency as usize));
        let addrs: Arc<Vec<std::net::SocketAddr>> = Arc::new(identity.addrs());
        let mut per_replica = vec![0; addrs.len()];
        let mut not_up = 0;
        let mut launch = |joined: Result<JoinedClient, BenchError>| {
            let JoinedClient { index, node, client, up, replica } = joined?;
            not_up += u32::from(!up);
            per_replica[replica] += 1;
            let phase = args.interval.mul_f64(f64::from(index) / f64::from(args.nodes));
            let beat = Beat { node_id: node.node_id, incarnation: node.incarnation };
            loops.spawn(heartbeat_loop(client, beat, epoch + phase, args.interval, plan_rx.clone(), errors.clone()));
            Ok::<(), BenchError>(())
        };
        for index in 0..args.nodes {
            let slot = slots.clone().acquire_owned().await.map_err(|_| RunError::Interrupted)?;
            let (tokens, ca_bundle_pem, errors, addrs) =
                (tokens.clone(), ca_bundle_pem.clone(), errors.clone(), addrs.clone());
            joins.spawn(async move {
                let _slot = slot;
                let token = &tokens[index as usize % tokens.len()];
                join_and_beat(index, &addrs, token, &ca_bundle_pem, &errors).await
            });
            while let Some(joined) = joins.try_join_next() {
                launch(joined.map_err(RunError::Task)?)?;
            }
        }
        while let Some(joined) = joins.join_next().await {
            launch(joined.map_err(RunError::Task)?)?;
        }
        Ok(Fleet { loops, plan, joined_in: started.elapsed(), not_up, per_replica })
    }

    /// Sets the windows from now and tells every node.
    fn start_plan(&self, warmup: Duration, duration: Duration) -> Plan {
        let paced = Window::after(Instant::now(), warmup, duration);
        let saturate_at = paced.end;
        let plan = Plan { paced, saturate_at, saturated: Window::after(saturate_at, warmup, duration) };
        self.plan.send_replace(Some(plan));
        plan
    }

    /// Waits for every node to finish the saturated window; the paced and
    /// saturated samples of all of them.
    async fn finish(mut self) -> Result<(Samples, Samples), BenchError> {
        let (mut paced, mut saturated) = (Samples::default(), Samples::default());
        while let Some(node) = self.loops.join_next().await {
            let node = node.map_err(RunError::Task)?;
            paced.merge(node.paced);
            saturated.merge(node.saturated);
        }
        Ok((paced, saturated))
    }
}

/// One join token per [`NODES_PER_TOKEN`] nodes, each allowing its share.
async fn create_tokens(identity: &IdentityProcess, nodes: u32) -> Result<Vec<String>, BenchError> {
    let channel = berth_rpc::connect(&identity.addr().to_string(), identity.admin().clone())
        .map_err(|e| BenchError::Token(e.to_string()))?;
    let mut client = v1::join_tokens_client::JoinTokensClient::new(channel);
    let count = nodes.div_ceil(NODES_PER_TOKEN);
    let uses = nodes.div_ceil(count);
    let mut tokens = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let mut request = tonic::Request::new(v1::CreateJoinTokenRequest {
            tier: String::new(),
            labels: Default::default(),
            ttl_seconds: 0,
            max_uses: uses,
            description: "berth-bench heartbeats".to_string(),
        });
        request.set_timeout(CALL_TIMEOUT);
        let created = client.create_join_token(request).await.map_err(|s| BenchError::Token(status_message(&s)))?;
        tokens.push(created.into_inner().token);
    }
    Ok(tokens)
}

/// What a node puts in every heartbeat.
#[derive(Debug, Clone)]
struct Beat {
    node_id: String,
    incarnation: u64,
}

impl Beat {
    /// Same capacity and version every time, as a steady agent reports.
    fn request(&self) -> tonic::Request<v1::HeartbeatRequest> {
        let mut request = tonic::Request::new(v1::HeartbeatRequest {
            node_id: self.node_id.clone(),
            incarnation: self.incarnation,
            usage: Some(berth_proto::types::v1::Capacity { cpu_millis: 0, memory_bytes: 0 }),
            capacity: Some(NODE_CAPACITY),
            version: env!("CARGO_PKG_VERSION").to_string(),
            renewal_csr_pem: String::new(),
            ca_bundle_sha256: String::new(),
            ..Default::default()
        });
        request.set_timeout(CALL_TIMEOUT);
        request
    }

    async fn send(&self, client: &mut NodeSessionClient<Channel>) -> Result<(), CallFailure> {
        match tokio::time::timeout(CALL_TIMEOUT, client.heartbeat(self.request())).await {
            Ok(Ok(answer)) if answer.get_ref().fenced => {
                Err(CallFailure { message: "fenced: identity says the incarnation is stale".into(), transient: false })
            }
            Ok(Ok(_)) => Ok(()),
            Ok(Err(status)) => {
                Err(CallFailure { message: status_message(&status), transient: is_transient(status.code()) })
            }
            Err(_) => {
                Err(CallFailure { message: format!("no answer within {}s", CALL_TIMEOUT.as_secs()), transient: true })
            }
        }
    }
}

/// A failed call as the client saw it.
#[derive(Debug)]
struct CallFailure {
    /// In the tally's words.
    message: String,
    /// Whether an agent would simply try again.
    transient: bool,
}

/// A joined node with the client its heartbeats go through.
#[derive(Debug)]
struct JoinedClient {
    index: u32,
    node: JoinedNode,
    client: NodeSessionClient<Channel>,
    /// Whether its first heartbeat succeeded.
    up: bool,
    /// Which replica it heartbeats to.
    replica: usize,
}

/// Joins node `index` (through replica `index % N` of `replicas`) and sends
/// its first heartbeat over its own mTLS connection, which that heartbeat
/// dials, to the replica an agent with the same list would prefer. Like an agent, it tries a
/// transient failure again after a jittered backoff, and when its first
/// heartbeat keeps failing so it goes on heartbeating in its loop; every
/// failure is counted in `errors`. A refusal no retry can cure ends the run.
async fn join_and_beat(
    index: u32,
    replicas: &[std::net::SocketAddr],
    token: &str,
    ca_bundle_pem: &str,
    errors: &ErrorTally,
) -> Result<JoinedClient, BenchError> {
    let mut attempt = 1;
    let node = loop {
        match nodes::join(index, replicas[index as usize % replicas.len()], token, ca_bundle_pem).await {
            Ok(node) => break node,
            Err(source) => {
                errors.add(&format!("join: {source}"));
                if !source.is_transient() || attempt == SETUP_ATTEMPTS {
                    return Err(BenchError::Join { index, source });
                }
            }
        }
        tokio::time::sleep(setup_backoff(attempt)).await;
        attempt += 1;
    };
    let replica = berth_agent::preferred_index(&node.node_id, replicas.len());
    let channel = berth_rpc::connect(&replicas[replica].to_string(), node.credentials.clone())
        .map_err(|e| BenchError::Connect { index, message: e.to_string() })?;
    let mut client = NodeSessionClient::new(channel);
    let beat = Beat { node_id: node.node_id.clone(), incarnation: node.incarnation };
    let mut attempt = 1;
    loop {
        match beat.send(&mut client).await {
            Ok(()) => return Ok(JoinedClient { index, node, client, up: true, replica }),
            Err(failure) => {
                errors.add(&format!("first heartbeat: {}", failure.message));
                if !failure.transient {
                    return Err(BenchError::FirstHeartbeat { index, node_id: node.node_id, message: failure.message });
                }
                if attempt == SETUP_ATTEMPTS {
                    return Ok(JoinedClient { index, node, client, up: false, replica });
                }
            }
        }
        tokio::time::sleep(setup_backoff(attempt)).await;
        attempt += 1;
    }
}

/// A random wait up to [`SETUP_BACKOFF`] doubled per attempt, so retries
/// spread out instead of colliding again.
fn setup_backoff(attempt: u32) -> Duration {
    let cap = SETUP_BACKOFF.saturating_mul(1 << attempt.saturating_sub(1).min(8));
    cap.mul_f64(rand::random::<f64>())
}

/// One node's heartbeats: at its phase every interval until the plan says
/// to saturate, then back to back until the saturated window ends. A beat
/// that overruns its interval is followed by the next at once, as an agent's
/// ticker does.
async fn heartbeat_loop(
    mut client: NodeSessionClient<Channel>,
    beat: Beat,
    phase: Instant,
    interval: Duration,
    mut plan: watch::Receiver<Option<Plan>>,
    errors: ErrorTally,
) -> NodeSamples {
    let mut samples = NodeSamples::default();
    let mut next = next_tick(phase, interval, Instant::now());
    loop {
        let current = *plan.borrow_and_update();
        let now = Instant::now();
        if current.is_some_and(|p| now >= p.saturated.end) {
            return samples;
        }
        let saturated = current.is_some_and(|p| now >= p.saturate_at);
        if !saturated {
            let wake = current.map_or(next, |p| next.min(p.saturate_at));
            tokio::select! {
                () = tokio::time::sleep_until(wake.into()) => {}
                changed = plan.changed(), if current.is_none() => {
                    if changed.is_err() {
                        return samples;
                    }
                    continue;
                }
            }
            if wake < next {
                continue;
            }
        }
        let sent = Instant::now();
        let outcome = beat.send(&mut client).await;
        let done = Instant::now();
        next = (next + interval).max(done);
        if let Err(failure) = &outcome {
            errors.add(&failure.message);
        }
        let Some(p) = current else { continue };
        let window = if p.paced.contains(done) {
            &mut samples.paced
        } else if p.saturated.contains(done) {
            &mut samples.saturated
        } else {
            continue;
        };
        match outcome {
            Ok(()) => window.ok(done - sent),
            Err(_) => window.error(),
        }
    }
}

/// The first beat time of the series `phase + k * interval` after `now`.
fn next_tick(phase: Instant, interval: Duration, now: Instant) -> Instant {
    if now < phase {
        return phase;
    }
    let elapsed = (now - phase).as_nanos();
    let step = interval.as_nanos().max(1);
    let ticks = u32::try_from(elapsed / step + 1).unwrap_or(u32::MAX);
    phase + interval.saturating_mul(ticks)
}

/// Samples each replica's resident memory in the background, keeping the
/// highest reading of each since it was last asked.
#[derive(Debug)]
struct MemorySampler {
    peaks_kib: Arc<Vec<AtomicU64>>,
    task: tokio::task::JoinHandle<()>,
}

impl MemorySampler {
    fn spawn(pids: &[u32]) -> Self {
        let peaks_kib: Arc<Vec<AtomicU64>> = Arc::new(pids.iter().map(|_| AtomicU64::new(0)).collect());
        let (pids, peaks) = (pids.to_vec(), peaks_kib.clone());
        let task = tokio::spawn(async move {
            let mut every = tokio::time::interval(MEMORY_SAMPLE_EVERY);
            loop {
                every.tick().await;
                for (pid, peak) in pids.iter().zip(peaks.iter()) {
                    if let Some(memory) = read_memory(*pid) {
                        peak.fetch_max(memory.rss_kib, Ordering::Relaxed);
                    }
                }
            }
        });
        MemorySampler { peaks_kib, task }
    }

    /// Each replica's highest reading since the last call, KiB.
    fn take_peaks(&self) -> Vec<u64> {
        self.peaks_kib.iter().map(|peak| peak.swap(0, Ordering::Relaxed)).collect()
    }
}

impl Drop for MemorySampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Identity's, this process's and the machine's CPU time at one instant.
#[derive(Debug, Clone, Copy)]
struct CpuMark {
    identity: Duration,
    bench: Duration,
    machine: MachineCpu,
}

impl CpuMark {
    /// Identity's time is the sum over its replicas.
    fn now(identity_pids: &[u32]) -> Option<Self> {
        let identity = identity_pids.iter().map(|&pid| read_cpu_time(pid)).sum::<Option<Duration>>()?;
        Some(CpuMark { identity, bench: read_cpu_time(std::process::id())?, machine: read_machine_cpu()? })
    }

    /// What was used from `self` until `later`.
    fn until(self, later: CpuMark) -> CpuUse {
        CpuUse {
            identity: later.identity.saturating_sub(self.identity),
            bench: later.bench.saturating_sub(self.bench),
            machine_busy: later.machine.busy.saturating_sub(self.machine.busy),
        }
    }
}

/// Reads the CPU marks at the edges of `window`.
fn measure_cpu(identity_pids: &[u32], window: Window) -> tokio::task::JoinHandle<Option<CpuUse>> {
    let pids = identity_pids.to_vec();
    tokio::spawn(async move {
        tokio::time::sleep_until(window.start.into()).await;
        let before = CpuMark::now(&pids)?;
        tokio::time::sleep_until(window.end.into()).await;
        Some(before.until(CpuMark::now(&pids)?))
    })
}

async fn cpu_of(measuring: tokio::task::JoinHandle<Option<CpuUse>>) -> Option<CpuUse> {
    measuring.await.ok().flatten()
}

/// Raises the soft open-files limit to the hard one when the connections
/// need it; identity, started after, inherits it.
fn raise_open_files_limit(nodes: u32, join_concurrency: u32) -> Result<(), BenchError> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let needed = u64::from(nodes) + u64::from(join_concurrency) + SPARE_FILES;
    let limit = getrlimit(Resource::Nofile);
    let Some(soft) = limit.current else { return Ok(()) };
    if soft >= needed {
        return Ok(());
    }
    if limit.maximum.is_none_or(|hard| hard > soft) {
        let raised = Rlimit { current: limit.maximum, maximum: limit.maximum };
        if let Err(error) = setrlimit(Resource::Nofile, raised) {
            eprintln!("bench: warning: cannot raise the open-files limit: {error}");
        }
    }
    let now = getrlimit(Resource::Nofile);
    match now.current {
        Some(soft) if soft < needed => Err(BenchError::OpenFiles {
            nodes,
            needed,
            limit: soft,
            hard: now.maximum.map_or_else(|| "unlimited".to_string(), |h| h.to_string()),
        }),
        _ => Ok(()),
    }
}

/// Accepts `500ms`, `1s`, `1.5s`, `2m`, and `0s`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        return Err(format!("'{text}' needs a unit: ms, s or m (e.g. 500ms, 1s, 2m)"));
    };
    let value: f64 = number.trim().parse().map_err(|_| format!("'{text}' is not a duration like 500ms, 1s or 2m"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("'{text}' must be zero or more"));
    }
    Duration::try_from_secs_f64(value * unit).map_err(|_| format!("'{text}' is too long"))
}

/// Like [`parse_duration`], but zero is refused.
pub(crate) fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let duration = parse_duration(text)?;
    if duration < Duration::from_millis(1) {
        return Err(format!("'{text}' must be at least 1ms"));
    }
    Ok(duration)
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_the_units_the_help_names() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("30").unwrap_err().contains("needs a unit"));
        assert!(parse_duration("-1s").unwrap_err().contains("zero or more"));
        assert!(parse_duration("fast").is_err());
        assert!(parse_positive_duration("0s").unwrap_err().contains("at least 1ms"));
    }

    #[test]
    fn the_next_tick_keeps_the_nodes_phase() {
        let phase = Instant::now();
        let second = Duration::from_secs(1);
        assert_eq!(next_tick(phase + second, second, phase), phase + second);
        assert_eq!(next_tick(phase, second, phase), phase + second);
        assert_eq!(next_tick(phase, second, phase + Duration::from_millis(2500)), phase + 3 * second);
    }
}
