//! A steady load on the mesh, the way its users and hosts make it:
//! synthetic nodes heartbeating, services applied, leases requested and
//! released, all through the services' fronts with the real gRPC clients.
//! It counts what succeeded and failed, and remembers everything a client
//! was told had succeeded, so a test can check the database still holds it.
//!
//! # Acknowledged means retried until answered
//! A write whose answer was lost (the replica died, the database went away)
//! may or may not have happened. Each write is therefore retried, unchanged,
//! until the mesh answers it: an apply of the same declaration mints
//! nothing new, a lease request with the same idempotency key returns the
//! lease already made, a release of a released lease returns it. So every
//! write ends acknowledged exactly once, and what was acknowledged can be
//! compared one for one with what is stored. A write still unanswered after
//! [`LoadOptions::ack_deadline`] is recorded as never acknowledged.
//!
//! # Pausing
//! [`Load::pause`] lets the writes in flight finish and starts no new one
//! (heartbeats go on, since a node that stops beating is marked down), so
//! acknowledged and stored can be compared at one instant.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use berth_proto::leases::v1 as leases_v1;
use berth_proto::revisions::v1 as revisions_v1;
use berth_proto::types::v1::{BundleRef, Capacity};
use berth_rpc::Channel;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::mesh::{Mesh, ServiceKind};
use crate::synthetic::SyntheticNode;
use crate::workloads::RUN_MARKER_ENV;

/// The owner recorded on every lease the load requests.
pub const LOAD_OWNER: &str = "e2e-load";

/// The prefix of the services the load applies (`load-0`, `load-1`, ...).
pub const LOAD_SERVICE_PREFIX: &str = "load-";

/// Wait between retries of one write.
const RETRY_EVERY: Duration = Duration::from_millis(250);

/// How often a paused worker looks whether it may go on.
const PAUSE_POLL: Duration = Duration::from_millis(20);

/// What the load is made of.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Synthetic nodes heartbeating at the interval identity gives.
    pub synthetic_nodes: u32,
    /// The tier their token joins them to.
    pub synthetic_tier: String,
    /// One `ApplyService` of a new declaration every this often.
    pub apply_every: Duration,
    /// How many services the applies cycle through; each has no replicas,
    /// so applies mint revisions without starting processes.
    pub load_services: usize,
    /// One `RequestLease` every this often.
    pub lease_every: Duration,
    /// Leases kept open by each lease writer: past this, its oldest is
    /// released.
    pub open_leases: usize,
    /// How many apply writers and how many lease writers run at once, each
    /// at the pace above.
    pub writers: usize,
    /// CPU each lease reserves, in thousandths of a core.
    pub lease_cpu_millis: u64,
    /// Memory each lease reserves.
    pub lease_memory_bytes: u64,
    /// The tier leases and services are placed in.
    pub tier: String,
    /// The deadline of one call.
    pub request_timeout: Duration,
    /// How long a write is retried before it counts as never acknowledged.
    pub ack_deadline: Duration,
    /// The bundle the load services name (`oci:DIR:TAG`).
    pub bundle_reference: String,
}

/// A kind of request the load makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    /// `NodeSession/Heartbeat` from a synthetic node.
    Heartbeat,
    /// `Services/ApplyService`.
    Apply,
    /// `Leases/RequestLease`.
    RequestLease,
    /// `Leases/ReleaseLease`.
    ReleaseLease,
}

impl Op {
    /// Every kind.
    pub const ALL: [Op; 4] = [Op::Heartbeat, Op::Apply, Op::RequestLease, Op::ReleaseLease];

    fn index(self) -> usize {
        self as usize
    }

    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::Heartbeat => "heartbeat",
            Op::Apply => "apply",
            Op::RequestLease => "request lease",
            Op::ReleaseLease => "release lease",
        }
    }
}

/// What the clients were told had succeeded.
#[derive(Debug, Clone, Default)]
pub struct Acks {
    /// Declaration number → (service, revision the apply led to).
    pub revisions: BTreeMap<u64, (String, String)>,
    /// Idempotency key → lease id, for every lease request answered with a lease.
    pub leases: BTreeMap<String, String>,
    /// Leases whose release was answered.
    pub released: BTreeSet<String>,
    /// Lease requests refused for want of room (nothing recorded, by contract).
    pub refused: u64,
    /// Writes never answered within the deadline, described.
    pub never_acknowledged: Vec<String>,
    /// Applies answered with an error and tried again: each may have been
    /// committed before its answer was lost, and so may have minted a
    /// revision no answer names (when another declaration of the same
    /// service came between it and its retry).
    pub apply_attempts_failed: u64,
    /// Synthetic nodes a heartbeat told they were fenced (reaped while beating).
    pub fenced: BTreeSet<String>,
}

/// Counters at one instant.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    /// When.
    pub at: Instant,
    /// Successful requests per [`Op`].
    pub ok: [u64; 4],
    /// Failed attempts per [`Op`].
    pub errors: [u64; 4],
}

impl Snapshot {
    /// Successful requests per second between `earlier` and this.
    pub fn rate_since(&self, earlier: &Snapshot) -> f64 {
        let ok: u64 = self.ok.iter().zip(earlier.ok).map(|(now, then)| now - then).sum();
        let seconds = self.at.duration_since(earlier.at).as_secs_f64();
        if seconds > 0.0 { ok as f64 / seconds } else { 0.0 }
    }

    /// Failed attempts between `earlier` and this.
    pub fn errors_since(&self, earlier: &Snapshot) -> u64 {
        self.errors.iter().zip(earlier.errors).map(|(now, then)| now - then).sum()
    }

    /// Successful requests per second of each kind between `earlier` and
    /// this, e.g. `heartbeat 16.0, apply 1.9, ...`.
    pub fn breakdown_since(&self, earlier: &Snapshot) -> String {
        let seconds = self.at.duration_since(earlier.at).as_secs_f64().max(f64::EPSILON);
        Op::ALL
            .iter()
            .map(|op| {
                let ok = self.ok[op.index()] - earlier.ok[op.index()];
                let errors = self.errors[op.index()] - earlier.errors[op.index()];
                format!("{} {:.1}/s ({errors} errors)", op.name(), ok as f64 / seconds)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[derive(Debug, Default)]
struct Stats {
    ok: [AtomicU64; 4],
    errors: [AtomicU64; 4],
    last_ok: Mutex<[Option<Instant>; 4]>,
    last_error: Mutex<Option<String>>,
}

impl Stats {
    fn succeeded(&self, op: Op) {
        self.ok[op.index()].fetch_add(1, Ordering::Relaxed);
        self.last_ok.lock().unwrap_or_else(PoisonError::into_inner)[op.index()] = Some(Instant::now());
    }

    fn failed(&self, op: Op, status: &tonic::Status) {
        self.errors[op.index()].fetch_add(1, Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(format!("{op:?}: {:?}: {}", status.code(), status.message()));
    }
}

#[derive(Debug)]
struct Shared {
    options: LoadOptions,
    run_id: String,
    stats: Stats,
    acks: Mutex<Acks>,
    paused: AtomicBool,
    busy: AtomicUsize,
    stop: CancellationToken,
    /// The last declaration number and lease request number handed out.
    declarations: AtomicU64,
    lease_requests: AtomicU64,
}

impl Shared {
    fn acks(&self) -> std::sync::MutexGuard<'_, Acks> {
        self.acks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims a turn to write: `None` once stopping. Waits while paused.
    async fn turn(self: &Arc<Self>) -> Option<Turn> {
        loop {
            if self.stop.is_cancelled() {
                return None;
            }
            self.busy.fetch_add(1, Ordering::SeqCst);
            if !self.paused.load(Ordering::SeqCst) {
                return Some(Turn(self.clone()));
            }
            self.busy.fetch_sub(1, Ordering::SeqCst);
            tokio::time::sleep(PAUSE_POLL).await;
        }
    }

    /// Sleeps `duration` unless stopping; false once stopping.
    async fn rest(&self, duration: Duration) -> bool {
        tokio::select! {
            () = self.stop.cancelled() => false,
            () = tokio::time::sleep(duration) => true,
        }
    }
}

/// A write in progress; pausing waits for it to be dropped.
struct Turn(Arc<Shared>);

impl Drop for Turn {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The running load.
#[derive(Debug)]
pub struct Load {
    shared: Arc<Shared>,
    nodes: Vec<SyntheticNode>,
    tasks: Vec<JoinHandle<()>>,
}

impl Load {
    /// Joins the synthetic nodes and starts every worker.
    pub async fn start(mesh: &Mesh, options: LoadOptions) -> anyhow::Result<Self> {
        let token = mesh.create_join_token(&options.synthetic_tier).await?;
        let identity = mesh.front_addr(ServiceKind::Identity);
        let mut nodes = Vec::new();
        for index in 0..options.synthetic_nodes {
            nodes.push(SyntheticNode::join(index, identity, &token, mesh.ca_bundle_pem()).await?);
        }
        let shared = Arc::new(Shared {
            options,
            run_id: mesh.run_id().to_string(),
            stats: Stats::default(),
            acks: Mutex::new(Acks::default()),
            paused: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            stop: CancellationToken::new(),
            declarations: AtomicU64::new(0),
            lease_requests: AtomicU64::new(0),
        });
        let mut tasks = Vec::new();
        // Spread over one heartbeat interval, so the full rate is reached
        // within a second of the start.
        let count = nodes.len().max(1) as u64;
        for (index, node) in nodes.iter().enumerate() {
            let spread = Duration::from_millis(1000 * index as u64 / count);
            tasks.push(tokio::spawn(heartbeat_worker(shared.clone(), node.clone(), spread)));
        }
        for _ in 0..shared.options.writers.max(1) {
            tasks.push(tokio::spawn(apply_worker(shared.clone(), mesh.channel(ServiceKind::Revisions)?)));
            tasks.push(tokio::spawn(lease_worker(shared.clone(), mesh.channel(ServiceKind::Leases)?)));
        }
        Ok(Self { shared, nodes, tasks })
    }

    /// The synthetic nodes.
    pub fn nodes(&self) -> &[SyntheticNode] {
        &self.nodes
    }

    /// The counters now.
    pub fn snapshot(&self) -> Snapshot {
        let stats = &self.shared.stats;
        Snapshot {
            at: Instant::now(),
            ok: std::array::from_fn(|i| stats.ok[i].load(Ordering::Relaxed)),
            errors: std::array::from_fn(|i| stats.errors[i].load(Ordering::Relaxed)),
        }
    }

    /// When `op` last succeeded.
    pub fn last_ok(&self, op: Op) -> Option<Instant> {
        self.shared.stats.last_ok.lock().unwrap_or_else(PoisonError::into_inner)[op.index()]
    }

    /// Whether every kind of request has succeeded since `since`.
    pub fn all_succeeded_since(&self, since: Instant) -> bool {
        Op::ALL.iter().all(|op| self.last_ok(*op).is_some_and(|at| at >= since))
    }

    /// The last error a client saw, described.
    pub fn last_error(&self) -> Option<String> {
        self.shared.stats.last_error.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// What the clients were told had succeeded, so far.
    pub fn acks(&self) -> Acks {
        self.shared.acks().clone()
    }

    /// Lets the writes in flight finish and starts no new one until
    /// [`resume`](Self::resume); heartbeats go on.
    pub async fn pause(&self) {
        self.shared.paused.store(true, Ordering::SeqCst);
        while self.shared.busy.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(PAUSE_POLL).await;
        }
    }

    /// Starts writing again.
    pub fn resume(&self) {
        self.shared.paused.store(false, Ordering::SeqCst);
    }

    /// Stops every worker, letting the writes in flight finish.
    pub async fn stop(self) {
        self.shared.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

async fn heartbeat_worker(shared: Arc<Shared>, node: SyntheticNode, spread: Duration) {
    if !shared.rest(spread).await {
        return;
    }
    let timeout = shared.options.request_timeout;
    let mut interval = Duration::from_secs(1);
    loop {
        let started = Instant::now();
        match node.heartbeat(timeout).await {
            Ok(answer) => {
                shared.stats.succeeded(Op::Heartbeat);
                if answer.fenced {
                    shared.acks().fenced.insert(node.node_id.clone());
                }
                interval = Duration::from_millis(u64::from(answer.heartbeat_interval_ms.max(100)));
                // On the interval's cadence, as an agent beats: a slow answer
                // does not make the next beat later.
                if !shared.rest(interval.saturating_sub(started.elapsed())).await {
                    return;
                }
            }
            Err(status) => {
                shared.stats.failed(Op::Heartbeat, &status);
                if !shared.rest(interval.min(RETRY_EVERY * 2)).await {
                    return;
                }
            }
        }
    }
}

async fn apply_worker(shared: Arc<Shared>, channel: Channel) {
    let mut services = revisions_v1::services_client::ServicesClient::new(channel);
    let options = shared.options.clone();
    while let Some(turn) = shared.turn().await {
        let declaration = shared.declarations.fetch_add(1, Ordering::SeqCst) + 1;
        let service = format!("{LOAD_SERVICE_PREFIX}{}", declaration % options.load_services.max(1) as u64);
        let request = revisions_v1::ApplyServiceRequest {
            project: String::new(),
            name: service.clone(),
            template: Some(revisions_v1::ServiceTemplate {
                bundle: Some(BundleRef { reference: options.bundle_reference.clone(), ..Default::default() }),
                env: [
                    (RUN_MARKER_ENV.to_string(), shared.run_id.clone()),
                    ("DECLARATION".to_string(), declaration.to_string()),
                ]
                .into(),
                resources: Some(Capacity { cpu_millis: 50, memory_bytes: 16 << 20 }),
                replicas: Some(0),
                tier: options.tier.clone(),
                ..Default::default()
            }),
            source: None,
        };
        let started = Instant::now();
        loop {
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(options.request_timeout);
            match services.apply_service(call).await {
                Ok(answer) => {
                    shared.stats.succeeded(Op::Apply);
                    let revision = answer.into_inner().revision;
                    shared.acks().revisions.insert(declaration, (service.clone(), revision));
                    break;
                }
                Err(status) => {
                    shared.stats.failed(Op::Apply, &status);
                    shared.acks().apply_attempts_failed += 1;
                    if started.elapsed() > options.ack_deadline {
                        shared.acks().never_acknowledged.push(format!(
                            "apply of declaration {declaration} to {service}: {:?} {}",
                            status.code(),
                            status.message()
                        ));
                        break;
                    }
                    tokio::time::sleep(RETRY_EVERY).await;
                }
            }
        }
        drop(turn);
        if !shared.rest(options.apply_every).await {
            return;
        }
    }
}

async fn lease_worker(shared: Arc<Shared>, channel: Channel) {
    let mut leases = leases_v1::leases_client::LeasesClient::new(channel);
    let options = shared.options.clone();
    let mut open: VecDeque<String> = VecDeque::new();
    while let Some(turn) = shared.turn().await {
        let number = shared.lease_requests.fetch_add(1, Ordering::SeqCst) + 1;
        let key = format!("{}-{number}", shared.run_id);
        let request = leases_v1::RequestLeaseRequest {
            project: String::new(),
            owner: LOAD_OWNER.to_string(),
            idempotency_key: key.clone(),
            resources: Some(Capacity {
                cpu_millis: options.lease_cpu_millis,
                memory_bytes: options.lease_memory_bytes,
            }),
            tier: options.tier.clone(),
            spread_group: String::new(),
            workload: Some(leases_v1::Workload {
                command: "/bin/sleep".into(),
                args: vec!["100000".into()],
                env: [(RUN_MARKER_ENV.to_string(), shared.run_id.clone())].into(),
                ..Default::default()
            }),
        };
        let started = Instant::now();
        loop {
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(options.request_timeout);
            match leases.request_lease(call).await {
                Ok(answer) => {
                    shared.stats.succeeded(Op::RequestLease);
                    if let Some(lease) = answer.into_inner().lease {
                        shared.acks().leases.insert(key.clone(), lease.lease_id.clone());
                        open.push_back(lease.lease_id);
                    }
                    break;
                }
                Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                    // Answered: no room, nothing recorded.
                    shared.stats.succeeded(Op::RequestLease);
                    shared.acks().refused += 1;
                    break;
                }
                Err(status) => {
                    shared.stats.failed(Op::RequestLease, &status);
                    if started.elapsed() > options.ack_deadline {
                        shared.acks().never_acknowledged.push(format!(
                            "lease request {key}: {:?} {}",
                            status.code(),
                            status.message()
                        ));
                        break;
                    }
                    tokio::time::sleep(RETRY_EVERY).await;
                }
            }
        }
        while open.len() > options.open_leases {
            let Some(lease_id) = open.pop_front() else { break };
            release(&shared, &mut leases, &lease_id).await;
        }
        drop(turn);
        if !shared.rest(options.lease_every).await {
            return;
        }
    }
}

async fn release(shared: &Shared, leases: &mut leases_v1::leases_client::LeasesClient<Channel>, lease_id: &str) {
    let options = &shared.options;
    let started = Instant::now();
    loop {
        let mut call = tonic::Request::new(leases_v1::ReleaseLeaseRequest {
            lease_id: lease_id.to_string(),
            reason: String::new(),
        });
        call.set_timeout(options.request_timeout);
        match leases.release_lease(call).await {
            Ok(_) => {
                shared.stats.succeeded(Op::ReleaseLease);
                shared.acks().released.insert(lease_id.to_string());
                return;
            }
            Err(status) => {
                shared.stats.failed(Op::ReleaseLease, &status);
                if started.elapsed() > options.ack_deadline {
                    shared.acks().never_acknowledged.push(format!(
                        "release of {lease_id}: {:?} {}",
                        status.code(),
                        status.message()
                    ));
                    return;
                }
                tokio::time::sleep(RETRY_EVERY).await;
            }
        }
    }
}
