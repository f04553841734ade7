//! The lease runner: runs the leases the control plane assigns to this node
//! through a [`Provider`], reports their phases, and keeps what the node runs
//! in line with the open leases placed on it.
//!
//! # Expected flow
//! - **Recover**: at start the provider lists what it recorded. Workloads
//!   still running are held *in custody* until the leases service confirms
//!   them: each is taken into custody (`AssumeCustody`), then everything is
//!   compared with the node's open leases (`ReconcileNode`, see
//!   [`crate::recovery`]). What no open lease covers is destroyed.
//! - **Serve**: the assignment stream delivers leases. A BOUND lease gets a
//!   worker that starts pulling its bundle (see [`crate::bundles`]), reports
//!   LAUNCHING *before* starting the workload, waits for the bundle (a pull
//!   that fails fails the lease, with the reason), starts it, reports
//!   RUNNING, waits for it to end and reports DONE or FAILED with its exit
//!   status. A lease that leaves the node (released, expired, moved) is
//!   destroyed. [`KeepAlive`] renews every held lease, on its own task.
//! - **Sweep**: every sweep interval the same comparison runs again, and
//!   finished instances past their retention are cleaned up, and bundles no
//!   lease holds evicted past the cache's budget.
//! - **Custody**: when the node's session ends (a fence), everything it runs
//!   is kept running but held in custody: no reports, no renewals, no
//!   assignments. Once the agent has rejoined, the runner recovers under the
//!   new session as at start. A revoked node destroys everything instead,
//!   since no session will come back for it. With a max-custody bound,
//!   compute held in custody longer than that is destroyed.
//!
//! # Invariants
//! - One worker per lease, so a lease's reports go out in order, and never
//!   two reconcile passes at once. Assignments that arrive during a pass
//!   start only after it, so a pass never misses a workload being started.
//! - Stopping the agent stops the runner, its workers and its tasks, and
//!   never a workload: a restarted agent adopts what still runs.
//! - Every report and renewal carries the epoch the node holds the lease at
//!   now; custody moves it, and the worker picks the new one up.
//! - A worker holds its lease's bundle (pinned in the cache) until it is done
//!   with the lease; a workload adopted after a restart is pinned again
//!   before anything can be pulled.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use berth_bundle::ReadyBundle;
use berth_proto::leases::v1::{
    AssignmentEvent, CommitCacheRequest, Lease, LeasePhase, LeaseRef, OpenCacheRequest, ReportPhaseRequest,
    ReportResizeRequest, ResizeState,
};
use berth_proto::types::v1::{CacheCommit, CacheMount, EventKind, Readiness, RuntimeClass};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::board::{Custody, InstanceBoard, InstanceView};
use crate::bundles::{BundleAsk, BundleError, BundleStore, bundle_spec};
use crate::caches::CacheVolumes;
use crate::caches::registry::Transfer;
use crate::config::LeaseTiming;
use crate::dial::Dialer;
use crate::keepalive::{KeepAlive, Lost, RenewSet};
use crate::leases_client::{NodeLeasesApi, is_transient};
use crate::provider::{
    CacheBind, Exit, ExitStatus, ExitWatch, ImageOverrides, InstanceMeta, LaunchSpec, Launched, Program, Provider,
    ResizeAsk, Resized, Resources, Runtime, Settlement, WorkloadRoot,
};
use crate::recovery::{PassPlan, PassReport, run_pass};
use crate::status::{Fence, FenceReason, NodeSession};
use crate::svids::{IDENTITY_UNAVAILABLE, LeaseWatch, SvidError, Svids};
use berth_core::backoff::Backoff;

/// The runner's settings: its timings, the agent's retry bounds, and the
/// max-custody bound.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunnerSettings {
    pub(crate) timing: LeaseTiming,
    pub(crate) retry_initial: Duration,
    pub(crate) retry_max: Duration,
    pub(crate) max_custody: Option<Duration>,
    pub(crate) custody_warning: Duration,
    pub(crate) stop_after_disconnect: Option<Duration>,
}

impl RunnerSettings {
    fn backoff(&self) -> Backoff {
        Backoff::new(self.retry_initial, self.retry_max)
    }
}

/// Where the runner stands with the leases service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Reconciling under the current session: nothing is reported, renewed
    /// or started until it is done.
    Recovering,
    /// Reconciled: serving assignments, reporting and renewing.
    Serving,
    /// The session ended: compute is held, untouched, until a new session
    /// reconciles it (or the max-custody bound ends it).
    Custody,
}

/// Why a held lease's workload is being destroyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Removal {
    /// The lease's phase, when the leases service said it.
    pub(crate) phase: Option<LeasePhase>,
    /// One CamelCase word.
    pub(crate) reason: String,
}

impl Removal {
    fn new(phase: Option<LeasePhase>, reason: &str) -> Self {
        Self { phase, reason: reason.to_string() }
    }
}

/// What the runner's helpers tell it.
#[derive(Debug)]
enum Inbox {
    /// The assignment stream (of the given generation) was (re)opened.
    StreamOpened { stream: u64 },
    /// An assignment event, from the stream of the given generation.
    Assignment { stream: u64, event: Box<AssignmentEvent> },
    /// A reconcile pass ended.
    PassDone(PassReport),
}

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WorkerEnd {
    /// The agent has nothing more to do for the lease: its end was reported
    /// (or could not be), or its workload was destroyed.
    Settled,
    /// The agent is stopping; the workload was left as it was.
    Stopped,
}

/// What the runner and its workers share.
#[derive(Debug)]
struct Shared {
    leases: Arc<dyn NodeLeasesApi>,
    provider: Arc<dyn Provider>,
    bundles: BundleStore,
    board: InstanceBoard,
    /// Reaches replicas' ports, for readiness checks.
    dialer: Dialer,
    /// Mints, renews and hands out each workload's credential; `None` on a
    /// node that gives its workloads none.
    svids: Option<Svids>,
    /// The node's cache volumes; `None` on a node that keeps none.
    caches: Option<CacheVolumes>,
    settings: RunnerSettings,
    shutdown: CancellationToken,
}

/// Why a lease failed when one of its cache volumes could not be opened.
const CACHE_UNAVAILABLE: &str = "CacheUnavailable";

/// How many times a cache view's outcome is offered to a ledger that
/// cannot take it now before it is left unrecorded.
const CACHE_COMMIT_ATTEMPTS: u32 = 5;

/// A lease the node holds, and the worker that runs it.
#[derive(Debug)]
struct Held {
    /// The epoch the node holds it at; the worker reads it for every report.
    epoch: watch::Sender<u64>,
    /// Set to have the worker destroy the workload.
    removal: watch::Sender<Option<Removal>>,
    /// Whether the workload has been started (the worker sets it).
    started: Arc<AtomicBool>,
    /// Whether it must be taken into custody before it is served again.
    needs_custody: bool,
    /// Which worker runs it, so a late end of an earlier one is told apart.
    generation: u64,
    /// The resize the leases service asks of its running workload; the
    /// worker clears it once it reported on it, so the same size asked for
    /// again (after a deferral) is applied again.
    resize: Arc<watch::Sender<Option<ResizeWanted>>>,
}

/// A resize the leases service asks for: the lease's size now and the size asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ResizeWanted {
    from: Resources,
    to: Resources,
}

impl ResizeWanted {
    /// The pending resize of `lease`, if it has one.
    fn of(lease: &Lease) -> Option<Self> {
        let resize = lease.resize.as_ref().filter(|r| r.state() == ResizeState::Pending)?;
        Some(Self { from: resources_of(lease.resources), to: resources_of(resize.resources) })
    }
}

fn resources_of(capacity: Option<berth_proto::types::v1::Capacity>) -> Resources {
    capacity.map(|r| Resources { cpu_millis: r.cpu_millis, memory_bytes: r.memory_bytes }).unwrap_or_default()
}

impl Held {
    fn epoch(&self) -> u64 {
        *self.epoch.borrow()
    }

    fn destroying(&self) -> bool {
        self.removal.borrow().is_some()
    }

    fn lease_ref(&self, lease_id: &str) -> LeaseRef {
        LeaseRef { lease_id: lease_id.to_string(), epoch: self.epoch() }
    }
}

/// What the rest of the agent sees of a running runner.
#[derive(Debug)]
pub(crate) struct RunnerHandle {
    /// How many leases' compute the node holds (running, or being started
    /// or destroyed).
    pub(crate) holding: watch::Receiver<usize>,
    /// Where the runner stands.
    #[cfg_attr(not(test), allow(dead_code, reason = "watched by the runner's tests"))]
    pub(crate) standing: watch::Receiver<Standing>,
    /// The runner task.
    pub(crate) task: JoinHandle<()>,
}

/// Everything a runner is built from.
#[derive(Debug)]
pub(crate) struct RunnerParts {
    pub(crate) leases: Arc<dyn NodeLeasesApi>,
    pub(crate) provider: Arc<dyn Provider>,
    pub(crate) bundles: BundleStore,
    pub(crate) board: InstanceBoard,
    pub(crate) dialer: Dialer,
    pub(crate) svids: Option<Svids>,
    pub(crate) caches: Option<CacheVolumes>,
    pub(crate) session: watch::Receiver<NodeSession>,
    pub(crate) fences: watch::Receiver<Option<Fence>>,
    pub(crate) settings: RunnerSettings,
    pub(crate) shutdown: CancellationToken,
}

/// Spawns the runner and its keep-alive task.
pub(crate) fn spawn(parts: RunnerParts) -> RunnerHandle {
    let RunnerParts {
        leases,
        provider,
        bundles,
        board,
        dialer,
        svids,
        caches,
        mut session,
        mut fences,
        settings,
        shutdown,
    } = parts;
    let current = session.borrow_and_update().clone();
    fences.borrow_and_update();
    let (inbox_tx, inbox) = mpsc::unbounded_channel();
    let (lost_tx, lost) = mpsc::unbounded_channel();
    let (renewals, renewals_rx) = watch::channel(None);
    let (ttl, ttl_rx) = watch::channel(None);
    let (holding, holding_rx) = watch::channel(0);
    let (standing, standing_rx) = watch::channel(Standing::Recovering);
    let keepalive = KeepAlive {
        leases: leases.clone(),
        renewals: renewals_rx,
        ttl: ttl_rx,
        lost: lost_tx,
        stop_after_disconnect: settings.stop_after_disconnect,
        default_interval: settings.timing.renew_interval,
        backoff: settings.backoff(),
        shutdown: shutdown.clone(),
    };
    let (reporting, reporting_rx) = watch::channel(None);
    let follower = caches.clone().map(|volumes| crate::caches::follow::HeadFollower {
        leases: leases.clone(),
        volumes,
        client: bundles.client().clone(),
        reporting: reporting_rx,
        period: crate::caches::follow::FOLLOW_PERIOD,
        shutdown: shutdown.clone(),
    });
    let shared = Arc::new(Shared { leases, provider, bundles, board, dialer, svids, caches, settings, shutdown });
    let runner = Runner {
        shared,
        session_rx: session,
        fences,
        session: current,
        standing: Standing::Recovering,
        custody_since: None,
        held: BTreeMap::new(),
        workers: JoinSet::new(),
        worker_leases: HashMap::new(),
        next_generation: 0,
        inbox,
        inbox_tx,
        lost,
        reporting,
        renewals,
        ttl,
        holding,
        standing_tx: standing,
        watcher: None,
        stream_generation: 0,
        stream_seen: BTreeSet::new(),
        pass_running: false,
        custody_generation: 0,
        pass_generation: 0,
        pass_due: Some(Instant::now()),
        pass_backoff: settings.backoff(),
        deferred: Vec::new(),
        inventoried: false,
        inventory_due: None,
        stop_by: None,
        custody_warned_at: None,
        inventory_backoff: settings.backoff(),
    };
    let task = tokio::spawn(async move {
        let keepalive = tokio::spawn(keepalive.run());
        let follower = follower.map(|follower| tokio::spawn(follower.run()));
        runner.run().await;
        keepalive.abort();
        if let Some(follower) = follower {
            follower.abort();
        }
    });
    RunnerHandle { holding: holding_rx, standing: standing_rx, task }
}

/// The runner task's state; [`Runner::run`] owns it until shutdown.
struct Runner {
    shared: Arc<Shared>,
    session_rx: watch::Receiver<NodeSession>,
    fences: watch::Receiver<Option<Fence>>,
    /// The session the runner works under.
    session: NodeSession,
    standing: Standing,
    /// Since when compute has been held without the leases service's word.
    custody_since: Option<Instant>,
    held: BTreeMap<String, Held>,
    workers: JoinSet<(String, u64, WorkerEnd)>,
    worker_leases: HashMap<tokio::task::Id, (String, u64)>,
    next_generation: u64,
    inbox: mpsc::UnboundedReceiver<Inbox>,
    inbox_tx: mpsc::UnboundedSender<Inbox>,
    lost: mpsc::UnboundedReceiver<Lost>,
    /// The node id workers report as; `None` while they must not report.
    reporting: watch::Sender<Option<String>>,
    renewals: watch::Sender<Option<RenewSet>>,
    ttl: watch::Sender<Option<Duration>>,
    holding: watch::Sender<usize>,
    standing_tx: watch::Sender<Standing>,
    watcher: Option<JoinHandle<()>>,
    /// Tells events of the current assignment stream from a stopped one's.
    stream_generation: u64,
    /// Leases the current stream has upserted since it (re)opened.
    stream_seen: BTreeSet<String>,
    pass_running: bool,
    /// Counts the sessions that ended or changed; a pass that started under
    /// an earlier count cannot confirm what the node holds now.
    custody_generation: u64,
    /// The count the running (or last) pass started under.
    pass_generation: u64,
    pass_due: Option<Instant>,
    pass_backoff: Backoff,
    /// BOUND leases that arrived during a pass, to start after it.
    deferred: Vec<Lease>,
    /// Whether the provider has listed what the node runs since the start.
    /// Until it has, nothing is reconciled: an empty set the node failed to
    /// read is not evidence that nothing runs.
    inventoried: bool,
    /// When to ask the provider for its listing again.
    inventory_due: Option<Instant>,
    inventory_backoff: Backoff,
    /// When what the node holds in custody goes because it can never rejoin.
    stop_by: Option<Instant>,
    /// When the runner last warned of the custody it holds.
    custody_warned_at: Option<Instant>,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("session", &self.session)
            .field("standing", &self.standing)
            .field("held", &self.held.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Runner {
    async fn run(mut self) {
        self.take_inventory().await;
        let (mut fences_open, mut session_open) = (true, true);
        loop {
            self.publish();
            let pass_at = self.pass_due.filter(|_| !self.pass_running && self.inventoried);
            let inventory_at = self.inventory_due;
            let custody_deadline = self.custody_deadline();
            let warn_at = self.custody_warning_due();
            tokio::select! {
                biased;
                _ = self.shared.shutdown.cancelled() => break,
                changed = self.fences.changed(), if fences_open => match changed {
                    Ok(()) => self.on_fence(),
                    Err(_) => fences_open = false,
                },
                changed = self.session_rx.changed(), if session_open => match changed {
                    Ok(()) => self.on_session(),
                    Err(_) => session_open = false,
                },
                Some(message) = self.inbox.recv() => self.on_inbox(message),
                Some(lost) = self.lost.recv() => self.on_lost(lost),
                Some(joined) = self.workers.join_next_with_id(), if !self.workers.is_empty() => {
                    self.on_worker_end(joined);
                }
                _ = sleep_until(pass_at), if pass_at.is_some() => self.start_pass(),
                _ = sleep_until(inventory_at), if inventory_at.is_some() => self.take_inventory().await,
                _ = sleep_until(warn_at), if warn_at.is_some() => self.warn_of_custody(),
                _ = sleep_until(custody_deadline), if custody_deadline.is_some() => self.custody_expired(),
            }
        }
        self.stop_watching();
        self.workers.abort_all();
    }

    /// Asks the provider what the node runs and adopts it; a listing that
    /// fails leaves everything as it is (nothing reconciled, nothing
    /// destroyed, no assignments served) and is asked again with backoff.
    async fn take_inventory(&mut self) {
        self.inventory_due = None;
        let recovered = tokio::select! {
            _ = self.shared.shutdown.cancelled() => return,
            recovered = self.shared.provider.recover() => recovered,
        };
        match recovered {
            Ok(recovered) => {
                let found: HashSet<String> =
                    recovered.iter().map(|launched| launched.record.lease_id.clone()).collect();
                if let Some(caches) = self.shared.caches.clone() {
                    // Views of leases whose workloads are gone, and seals a crash cut short.
                    let _ = tokio::task::spawn_blocking(move || caches.sweep(&found)).await;
                }
                for launched in recovered {
                    let bundle = self.adopted_bundle(&launched).await;
                    self.adopt(launched, bundle);
                }
                self.inventoried = true;
                self.inventory_backoff.reset();
                if !self.held.is_empty() {
                    self.custody_since.get_or_insert_with(Instant::now);
                    tracing::info!(held = self.held.len(), "recovering the workloads found on this node");
                }
            }
            Err(error) => {
                let retry = self.inventory_backoff.next_delay();
                tracing::error!(%error, retry_in = ?retry,
                    "cannot list the workloads on this node; reconciling nothing until a listing succeeds");
                self.inventory_due = Some(Instant::now() + retry);
            }
        }
    }

    /// Publishes what the keep-alive task, the workers and the agent read.
    fn publish(&mut self) {
        let serving = self.standing == Standing::Serving;
        let node = serving.then(|| self.session.node_id.clone());
        self.reporting.send_if_modified(|current| {
            let changed = *current != node;
            *current = node;
            changed
        });
        let set = serving.then(|| RenewSet {
            node_id: self.session.node_id.clone(),
            incarnation: self.session.incarnation,
            leases: self.held.iter().filter(|(_, h)| !h.destroying()).map(|(id, h)| h.lease_ref(id)).collect(),
        });
        self.renewals.send_if_modified(|current| {
            let changed = *current != set;
            *current = set;
            changed
        });
        let holding = self.held.len();
        self.holding.send_if_modified(|current| std::mem::replace(current, holding) != holding);
        let held = self.in_custody().len();
        if held == 0 {
            self.custody_warned_at = None;
        }
        let shown = self.shared.board.custody();
        if shown.held != held || shown.since.is_some() != (held > 0) {
            let since = self
                .custody_since
                .filter(|_| held > 0)
                .map(|since| SystemTime::now().checked_sub(since.elapsed()).unwrap_or(SystemTime::UNIX_EPOCH));
            self.shared.board.set_custody(Custody { held, since });
        }
        let standing = self.standing;
        self.standing_tx.send_if_modified(|current| std::mem::replace(current, standing) != standing);
    }

    /// The workloads held in custody now: running, not being destroyed, and
    /// not yet confirmed by the leases service.
    fn in_custody(&self) -> Vec<&String> {
        if self.standing == Standing::Serving || self.custody_since.is_none() {
            return Vec::new();
        }
        self.held.iter().filter(|(_, h)| !h.destroying()).map(|(id, _)| id).collect()
    }

    /// When to warn next of compute held in custody past the warning age:
    /// at that age, then every sweep.
    fn custody_warning_due(&self) -> Option<Instant> {
        if self.in_custody().is_empty() {
            return None;
        }
        let first = self.custody_since? + self.shared.settings.custody_warning;
        let sweep = self.shared.settings.timing.sweep_interval;
        Some(self.custody_warned_at.map_or(first, |at| (at + sweep).max(first)))
    }

    fn warn_of_custody(&mut self) {
        self.custody_warned_at = Some(Instant::now());
        let held = self.in_custody();
        let age = self.custody_since.map(|since| since.elapsed()).unwrap_or_default();
        tracing::warn!(?held, count = held.len(), ?age, standing = ?self.standing,
            "holding compute it cannot account for");
    }

    fn custody_deadline(&self) -> Option<Instant> {
        if self.standing == Standing::Serving || self.held.values().all(Held::destroying) {
            return None;
        }
        let bound = self.shared.settings.max_custody.zip(self.custody_since).map(|(bound, since)| since + bound);
        match (bound, self.stop_by) {
            (Some(bound), Some(stop_by)) => Some(bound.min(stop_by)),
            (bound, stop_by) => bound.or(stop_by),
        }
    }

    // -- taking leases on ---------------------------------------------------

    /// Pins the bundle a workload found running after a restart runs, so
    /// nothing evicts it from under the workload.
    async fn adopted_bundle(&self, launched: &Launched) -> Option<ReadyBundle> {
        let record = &launched.record;
        let running = !record.settled && launched.exit.borrow().is_none();
        if !running || record.meta.digest.is_empty() {
            return None;
        }
        let meta = &record.meta;
        let pinned = self.shared.bundles.adopt(&meta.project, &meta.service, &meta.revision, &meta.digest).await;
        if pinned.is_none() {
            tracing::warn!(lease_id = %record.lease_id, digest = %meta.digest,
                "the bundle of a workload found running is no longer in the cache");
        }
        pinned
    }

    /// Takes on a workload the provider recorded before a restart.
    fn adopt(&mut self, launched: Launched, bundle: Option<ReadyBundle>) {
        let Launched { record, exit } = launched;
        let ended = *exit.borrow();
        let mut view = InstanceView::new(&record.lease_id, record.epoch, record.meta.clone(), LeasePhase::Running);
        view.pid = record.pid;
        view.started_at = record.started_at;
        view.exit = ended.map(|e| e.status);
        if record.settled {
            // As it was left before the restart, not running.
            let (phase, reason) = settled_as(record.settlement.as_ref(), ended.map(|e| e.status));
            view.phase = phase;
            view.reason = reason;
            view.ended_at = Some(ended.map_or_else(SystemTime::now, |e| e.at));
            self.shared.board.put(view);
            return;
        }
        self.shared.board.put(view);
        let running = ended.is_none();
        let held = self.hold(&record.lease_id, record.epoch, running, running);
        tracing::info!(lease_id = %record.lease_id, epoch = record.epoch, pid = ?record.pid, running,
            "holding a workload recorded before the restart");
        self.spawn_worker(&record.lease_id, held, Start::Adopt { exit, bundle });
    }

    /// Starts a worker for a BOUND lease.
    fn launch(&mut self, lease: Lease) {
        let workload = lease.workload.clone().unwrap_or_default();
        let meta = meta_of(&lease);
        let spec = LaunchSpec {
            lease_id: lease.lease_id.clone(),
            epoch: lease.epoch,
            node_id: self.session.node_id.clone(),
            root: WorkloadRoot::Host,
            program: Program::of_lease(&workload.command),
            args: workload.args,
            env: workload.env.into_iter().collect(),
            ports: workload.ports.iter().map(|port| port.name.clone()).collect(),
            resources: resources_of(lease.resources),
            network: None,
            meta: meta.clone(),
            image: ImageOverrides { working_dir: workload.working_dir, user: workload.user },
            identity: None,
            caches: Vec::new(),
        };
        self.shared.board.put(InstanceView::new(&lease.lease_id, lease.epoch, meta, LeasePhase::Bound));
        let held = self.hold(&lease.lease_id, lease.epoch, false, false);
        self.want_resize(&lease);
        tracing::info!(lease_id = %lease.lease_id, epoch = lease.epoch, "taking on a lease");
        let bundle = BundleAsk::of(&lease);
        let traceparent = lease.traceparent.clone();
        let runtime = workload.runtime;
        let readiness = workload.readiness;
        let cache = workload.cache;
        self.spawn_worker(
            &lease.lease_id,
            held,
            Start::Launch(Box::new(Launch { spec, bundle, traceparent, runtime, readiness, cache })),
        );
    }

    fn hold(&mut self, lease_id: &str, epoch: u64, started: bool, needs_custody: bool) -> WorkerWiring {
        self.next_generation += 1;
        let (epoch_tx, epoch_rx) = watch::channel(epoch);
        let (removal_tx, removal_rx) = watch::channel(None);
        let (resize_tx, resize_rx) = watch::channel(None);
        let resize_tx = Arc::new(resize_tx);
        let started = Arc::new(AtomicBool::new(started));
        let generation = self.next_generation;
        self.held.insert(
            lease_id.to_string(),
            Held {
                epoch: epoch_tx,
                removal: removal_tx,
                started: started.clone(),
                needs_custody,
                generation,
                resize: resize_tx.clone(),
            },
        );
        WorkerWiring { epoch: epoch_rx, removal: removal_rx, resize: (resize_tx, resize_rx), started, generation }
    }

    /// Hands a held lease's pending resize to its worker, unless it is the
    /// one the worker already has.
    fn want_resize(&self, lease: &Lease) {
        let (Some(held), Some(wanted)) = (self.held.get(&lease.lease_id), ResizeWanted::of(lease)) else { return };
        held.resize.send_if_modified(|current| {
            let new = *current != Some(wanted);
            if new {
                *current = Some(wanted);
            }
            new
        });
    }

    fn spawn_worker(&mut self, lease_id: &str, wiring: WorkerWiring, start: Start) {
        let worker = Worker {
            lease_id: lease_id.to_string(),
            shared: self.shared.clone(),
            epoch: wiring.epoch,
            removal: wiring.removal,
            resize: wiring.resize.1,
            resize_done: wiring.resize.0,
            reporting: self.reporting.subscribe(),
            started: wiring.started,
        };
        let generation = wiring.generation;
        let id = lease_id.to_string();
        let handle = self.workers.spawn(async move { (id, generation, worker.run(start).await) });
        self.worker_leases.insert(handle.id(), (lease_id.to_string(), generation));
    }

    fn on_worker_end(&mut self, joined: Result<(tokio::task::Id, (String, u64, WorkerEnd)), tokio::task::JoinError>) {
        let (id, lease_id, generation) = match joined {
            Ok((id, (lease_id, generation, _end))) => (id, lease_id, generation),
            Err(error) => {
                let Some((lease_id, generation)) = self.worker_leases.get(&error.id()).cloned() else { return };
                tracing::error!(%lease_id, %error, "a lease worker failed");
                (error.id(), lease_id, generation)
            }
        };
        self.worker_leases.remove(&id);
        if self.held.get(&lease_id).is_some_and(|h| h.generation == generation) {
            self.held.remove(&lease_id);
        }
    }

    /// Has the worker of `lease_id` destroy its workload.
    fn destroy(&mut self, lease_id: &str, removal: Removal) {
        if let Some(held) = self.held.get_mut(lease_id)
            && !held.destroying()
        {
            tracing::info!(%lease_id, reason = %removal.reason, "destroying the workload");
            held.removal.send_replace(Some(removal));
        }
    }

    /// Destroys the workload of `lease` if the node still holds it at that epoch.
    fn destroy_at(&mut self, lease: &LeaseRef, removal: Removal) {
        if self.held.get(&lease.lease_id).is_some_and(|h| h.epoch() == lease.epoch) {
            self.destroy(&lease.lease_id, removal);
        }
    }

    fn destroy_all(&mut self, removal: &Removal) {
        let ids: Vec<String> = self.held.keys().cloned().collect();
        for lease_id in ids {
            self.destroy(&lease_id, removal.clone());
        }
    }

    // -- the session --------------------------------------------------------

    fn on_fence(&mut self) {
        let Some(fence) = self.fences.borrow_and_update().clone() else { return };
        if fence.session.node_id == self.session.node_id && fence.session.incarnation < self.session.incarnation {
            // A fence of a session the runner has already moved past.
            return;
        }
        if fence.reason == FenceReason::RejoinRefused {
            let grace = self.shared.settings.timing.stop_grace;
            tracing::warn!(node_id = %fence.session.node_id, held = self.held.len(), ?grace,
                "the node cannot rejoin: destroying what it holds after the stop grace");
            self.stop_by = Some(Instant::now() + grace);
        } else if fence.reason == FenceReason::Revoked {
            tracing::warn!(node_id = %fence.session.node_id, held = self.held.len(),
                "the node was revoked: destroying everything it runs");
            self.destroy_all(&Removal::new(None, "NodeRevoked"));
        } else {
            tracing::warn!(node_id = %fence.session.node_id, reason = %fence.reason, held = self.held.len(),
                "the node's session ended; holding its workloads in custody until it rejoins");
        }
        self.enter_custody();
        self.standing = Standing::Custody;
        self.pass_due = None;
    }

    fn on_session(&mut self) {
        let session = self.session_rx.borrow_and_update().clone();
        if session == self.session {
            return;
        }
        tracing::info!(node_id = %session.node_id, incarnation = session.incarnation,
            "new session; reconciling what the node runs under it");
        self.session = session;
        self.stop_by = None;
        self.shared.leases.reconnect();
        self.enter_custody();
        self.standing = Standing::Recovering;
        self.pass_backoff.reset();
        self.pass_due = Some(Instant::now());
    }

    /// Stops serving; whatever runs is held until a pass confirms it.
    fn enter_custody(&mut self) {
        self.custody_generation += 1;
        if self.standing == Standing::Serving || self.custody_since.is_none() {
            self.custody_since = Some(Instant::now());
        }
        self.stop_watching();
        self.deferred.clear();
        for held in self.held.values_mut() {
            held.needs_custody = held.started.load(Ordering::SeqCst) && !held.destroying();
        }
    }

    fn custody_expired(&mut self) {
        if self.stop_by.is_some_and(|at| at <= Instant::now()) {
            tracing::warn!(held = self.held.len(), "the node cannot rejoin; destroying what it held in custody");
            self.destroy_all(&Removal::new(None, "RejoinRefused"));
            return;
        }
        tracing::warn!(held = self.held.len(), bound = ?self.shared.settings.max_custody,
            "compute was held in custody longer than the max-custody bound; destroying it");
        self.destroy_all(&Removal::new(None, "CustodyExpired"));
    }

    // -- reconcile passes ---------------------------------------------------

    fn start_pass(&mut self) {
        self.pass_due = None;
        if self.standing == Standing::Custody {
            return;
        }
        if self.standing == Standing::Serving {
            self.clean_up_finished();
            self.list_strays();
        }
        let live = self.held.iter().filter(|(_, h)| !h.destroying());
        let plan = PassPlan {
            node_id: self.session.node_id.clone(),
            custody: live
                .clone()
                .filter(|(_, h)| h.needs_custody && h.started.load(Ordering::SeqCst))
                .map(|(id, h)| h.lease_ref(id))
                .collect(),
            listed: live.map(|(id, h)| h.lease_ref(id)).collect(),
        };
        self.pass_running = true;
        self.pass_generation = self.custody_generation;
        let (leases, provider, inbox) =
            (self.shared.leases.clone(), self.shared.provider.clone(), self.inbox_tx.clone());
        let shutdown = self.shared.shutdown.clone();
        tokio::spawn(async move {
            let report = tokio::select! {
                _ = shutdown.cancelled() => return,
                report = run_pass(leases.as_ref(), &provider, plan) => report,
            };
            let _ = inbox.send(Inbox::PassDone(report));
        });
    }

    fn on_pass_done(&mut self, report: PassReport) {
        self.pass_running = false;
        // What the leases service did and said holds whatever happened
        // since: custody moved those epochs, and a workload it does not
        // cover at the epoch held is no one's.
        for lease in &report.assumed {
            if let Some(held) = self.held.get_mut(&lease.lease_id)
                && lease.epoch > held.epoch()
            {
                held.epoch.send_replace(lease.epoch);
                held.needs_custody = false;
                self.shared.board.update(&lease.lease_id, |view| {
                    view.epoch = lease.epoch;
                    view.phase = lease.phase();
                    view.reason = lease.reason.clone();
                });
            }
        }
        for (lease, _) in &report.refused {
            self.destroy_at(lease, Removal::new(None, "CustodyRefused"));
        }
        for lease in &report.destroy {
            self.destroy_at(lease, Removal::new(None, "NotCovered"));
        }
        if !report.failed.is_empty() {
            let failed: Vec<&str> = report.failed.iter().map(|l| l.lease_id.as_str()).collect();
            tracing::warn!(?failed, "the leases service failed leases this node does not run");
        }
        if self.pass_generation != self.custody_generation {
            // The session ended or changed under the pass: it cannot confirm
            // what the node holds now. A recovering runner asks again.
            if self.standing == Standing::Recovering {
                self.pass_due = Some(Instant::now());
            }
            return;
        }
        if let Some(error) = report.error {
            let retry = if self.standing == Standing::Serving {
                self.shared.settings.timing.sweep_interval
            } else {
                self.pass_backoff.next_delay()
            };
            tracing::warn!(error = %crate::rpc_status::status_text(&error), retry_in = ?retry, "reconcile with leases failed");
            self.pass_due = Some(Instant::now() + retry);
            self.launch_deferred();
            return;
        }
        self.pass_backoff.reset();
        if self.standing == Standing::Recovering {
            tracing::info!(held = self.held.len(), "reconciled with leases; serving assignments");
            self.standing = Standing::Serving;
            self.custody_since = None;
            self.start_watching();
        }
        self.pass_due = Some(Instant::now() + self.shared.settings.timing.sweep_interval);
        self.launch_deferred();
    }

    /// Asks the provider what it actually runs, so a workload the runner
    /// holds no lease for (one whose destroy never finished before a
    /// restart, or whose lease the runner let go while it still ran) is
    /// found and destroyed. The provider's listing reads only what it
    /// tracks; it is not the start-up inventory, which adopts and fixes
    /// records and must not run beside launches.
    fn list_strays(&mut self) {
        let running = self.shared.provider.running();
        self.on_listed(running);
    }

    /// Destroys every listed workload no held lease covers, and shows it
    /// (reason `Stray`) until it is gone; a destroy that fails is tried
    /// again by its worker, and the next sweep lists it again meanwhile.
    fn on_listed(&mut self, running: Vec<String>) {
        let strays: Vec<String> = running.into_iter().filter(|id| !self.held.contains_key(id)).collect();
        for lease_id in strays {
            tracing::warn!(%lease_id, "a workload runs that no lease held by this node covers; destroying it");
            let epoch = self.shared.board.get(&lease_id).map_or(0, |view| view.epoch);
            let meta = self.shared.board.get(&lease_id).map(|view| view.meta).unwrap_or_default();
            let mut view = InstanceView::new(&lease_id, epoch, meta, LeasePhase::Released);
            view.reason = "Stray".into();
            self.shared.board.put(view);
            let held = self.hold(&lease_id, epoch, true, false);
            if let Some(entry) = self.held.get(&lease_id) {
                // Destroying from the start: never renewed nor reconciled.
                entry.removal.send_replace(Some(Removal::new(Some(LeasePhase::Released), "Stray")));
            }
            self.spawn_worker(&lease_id, held, Start::Stray);
        }
    }

    fn launch_deferred(&mut self) {
        for lease in std::mem::take(&mut self.deferred) {
            if !self.held.contains_key(&lease.lease_id) {
                self.launch(lease);
            }
        }
    }

    /// Forgets finished instances kept past their retention.
    fn clean_up_finished(&mut self) {
        let retain = self.shared.settings.timing.retain_finished;
        let now = SystemTime::now();
        for view in self.shared.board.list() {
            let expired = view.ended_at.is_some_and(|at| now.duration_since(at).unwrap_or_default() >= retain);
            if !expired || self.held.contains_key(&view.lease_id) {
                continue;
            }
            self.shared.board.remove(&view.lease_id);
            let provider = self.shared.provider.clone();
            tokio::spawn(async move {
                if let Err(error) = provider.remove(&view.lease_id).await {
                    tracing::warn!(lease_id = %view.lease_id, %error, "cannot clean up a finished instance");
                }
            });
        }
        let bundles = self.shared.bundles.clone();
        tokio::spawn(async move { bundles.evict().await });
        if let Some(svids) = self.shared.svids.clone() {
            let held: BTreeSet<String> = self.held.keys().cloned().collect();
            tokio::spawn(async move { svids.retain(&held).await });
        }
        // Cache views a settle could not remove, and seals a crash cut
        // short, go once no held lease has them.
        if let Some(caches) = self.shared.caches.clone() {
            let held: HashSet<String> = self.held.keys().cloned().collect();
            tokio::task::spawn_blocking(move || caches.sweep(&held));
        }
    }

    // -- assignments --------------------------------------------------------

    fn start_watching(&mut self) {
        self.stop_watching();
        self.stream_generation += 1;
        let watcher = AssignmentWatcher {
            leases: self.shared.leases.clone(),
            node_id: self.session.node_id.clone(),
            stream: self.stream_generation,
            inbox: self.inbox_tx.clone(),
            backoff: self.shared.settings.backoff(),
            shutdown: self.shared.shutdown.clone(),
        };
        self.watcher = Some(tokio::spawn(watcher.run()));
    }

    fn stop_watching(&mut self) {
        if let Some(watcher) = self.watcher.take() {
            watcher.abort();
        }
        self.stream_seen.clear();
    }

    fn on_inbox(&mut self, message: Inbox) {
        match message {
            Inbox::PassDone(report) => self.on_pass_done(report),
            Inbox::StreamOpened { stream } if stream == self.stream_generation => self.stream_seen.clear(),
            Inbox::Assignment { stream, event } if stream == self.stream_generation => self.on_assignment(*event),
            // From a stream stopped since.
            Inbox::StreamOpened { .. } | Inbox::Assignment { .. } => {}
        }
    }

    fn on_assignment(&mut self, event: AssignmentEvent) {
        if self.standing != Standing::Serving {
            return;
        }
        if event.ttl_ms > 0 {
            let ttl = Some(Duration::from_millis(u64::from(event.ttl_ms)));
            self.ttl.send_if_modified(|current| std::mem::replace(current, ttl) != ttl);
        }
        match (event.kind(), event.lease) {
            (EventKind::Upsert, Some(lease)) => self.on_upsert(lease),
            (EventKind::Removed, Some(lease)) => {
                self.stream_seen.remove(&lease.lease_id);
                let removal = Removal::new(Some(lease.phase()), &removed_reason(&lease));
                self.destroy(&lease.lease_id, removal);
            }
            (EventKind::Synced, _) if !event.resumed => {
                // The events before it were the whole open set.
                let gone: Vec<String> =
                    self.held.keys().filter(|id| !self.stream_seen.contains(*id)).cloned().collect();
                for lease_id in gone {
                    self.destroy(&lease_id, Removal::new(None, "NotAssigned"));
                }
            }
            _ => {}
        }
    }

    fn on_upsert(&mut self, lease: Lease) {
        self.stream_seen.insert(lease.lease_id.clone());
        if let Some(held) = self.held.get(&lease.lease_id) {
            if lease.epoch > held.epoch() && lease.phase().is_open() {
                tracing::info!(lease_id = %lease.lease_id, from = held.epoch(), to = lease.epoch, "the lease moved to a new epoch");
                held.epoch.send_replace(lease.epoch);
                self.shared.board.update(&lease.lease_id, |view| view.epoch = lease.epoch);
            }
            self.want_resize(&lease);
            return;
        }
        match lease.phase() {
            LeasePhase::Bound if self.pass_running => self.deferred.push(lease),
            LeasePhase::Bound => self.launch(lease),
            phase if phase.is_open() => {
                tracing::warn!(lease_id = %lease.lease_id, ?phase,
                    "the leases service has this node running a lease it does not run; the next sweep settles it");
            }
            _ => {}
        }
    }

    fn on_lost(&mut self, lost: Lost) {
        if self.standing != Standing::Serving {
            // A renewal sent before the session ended; the recovery pass
            // (custody may take an expired lease back) decides instead.
            return;
        }
        for lease in &lost.leases {
            self.destroy_at(lease, Removal::new(None, lost.reason));
        }
    }
}

/// The receiving ends a worker needs.
struct WorkerWiring {
    epoch: watch::Receiver<u64>,
    removal: watch::Receiver<Option<Removal>>,
    resize: (Arc<watch::Sender<Option<ResizeWanted>>>, watch::Receiver<Option<ResizeWanted>>),
    started: Arc<AtomicBool>,
    generation: u64,
}

fn meta_of(lease: &Lease) -> InstanceMeta {
    let workload = lease.workload.clone().unwrap_or_default();
    InstanceMeta {
        project: lease.project.clone(),
        service: workload.service,
        revision: workload.revision,
        digest: workload.digest,
        // The host ports are the provider's to give, at launch.
        port: 0,
        ports: BTreeMap::new(),
    }
}

fn removed_reason(lease: &Lease) -> String {
    if !lease.reason.is_empty() {
        return lease.reason.clone();
    }
    match lease.phase() {
        LeasePhase::Released => "Released",
        LeasePhase::Expired => "Expired",
        _ => "Removed",
    }
    .to_string()
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

// ---------------------------------------------------------------------------
// The assignment stream
// ---------------------------------------------------------------------------

/// Follows the node's assignment stream into the runner's inbox, resuming
/// from the last cursor after a break.
struct AssignmentWatcher {
    leases: Arc<dyn NodeLeasesApi>,
    node_id: String,
    stream: u64,
    inbox: mpsc::UnboundedSender<Inbox>,
    backoff: Backoff,
    shutdown: CancellationToken,
}

impl AssignmentWatcher {
    async fn run(mut self) {
        let mut cursor = 0;
        loop {
            let opened = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                opened = self.leases.watch_assignments(&self.node_id, cursor) => opened,
            };
            match opened {
                Err(status) => {
                    tracing::warn!(error = %crate::rpc_status::status_text(&status), "cannot open the assignment stream")
                }
                Ok(mut events) => {
                    if self.inbox.send(Inbox::StreamOpened { stream: self.stream }).is_err() {
                        return;
                    }
                    loop {
                        let next = tokio::select! {
                            _ = self.shutdown.cancelled() => return,
                            next = events.next() => next,
                        };
                        match next {
                            Some(Ok(event)) => {
                                self.backoff.reset();
                                cursor = cursor.max(event.cursor);
                                let event = Box::new(event);
                                if self.inbox.send(Inbox::Assignment { stream: self.stream, event }).is_err() {
                                    return;
                                }
                            }
                            Some(Err(status)) => {
                                tracing::warn!(error = %crate::rpc_status::status_text(&status), "the assignment stream broke");
                                break;
                            }
                            None => {
                                tracing::info!("the leases service ended the assignment stream");
                                break;
                            }
                        }
                    }
                }
            }
            let delay = self.backoff.next_delay();
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------

/// How a worker begins.
enum Start {
    /// Pull the bundle, report LAUNCHING, start the workload, report RUNNING.
    Launch(Box<Launch>),
    /// A workload no held lease covers: destroy it.
    Stray,
    /// The workload was started before a restart; only its end is awaited.
    Adopt {
        /// Fires when it ends.
        exit: ExitWatch,
        /// Its bundle, pinned, when it runs one the cache still has.
        bundle: Option<ReadyBundle>,
    },
}

/// How a readiness gate opened.
enum Gate {
    /// A check passed.
    Ready,
    /// The workload ended before one did.
    Ended,
}

/// What a BOUND lease asks the node to start.
struct Launch {
    /// What the lease says to run; for a bundle, its overrides.
    spec: LaunchSpec,
    /// Its bundle, when it runs one.
    bundle: Option<BundleAsk>,
    /// The trace of the request that created the lease; the launch joins it.
    traceparent: String,
    /// The [`RuntimeClass`] the lease needs.
    runtime: i32,
    /// When the workload is ready: it is RUNNING only then.
    readiness: Option<Readiness>,
    /// The cache volumes it mounts.
    cache: Vec<CacheMount>,
}

/// The phase and reason a settled instance shows after a restart: what it
/// was settled with, or, for a record from before settlements were kept,
/// what its exit says.
fn settled_as(settlement: Option<&Settlement>, exit: Option<ExitStatus>) -> (LeasePhase, String) {
    if let Some(settlement) = settlement
        && let Some(phase) = LeasePhase::from_str_name(&settlement.phase)
    {
        return (phase, settlement.reason.clone());
    }
    match exit {
        Some(status) => {
            let (phase, reason) = ended_as(status);
            (phase, reason.to_owned())
        }
        None => (LeasePhase::Released, String::new()),
    }
}

/// The phase and reason a workload that ended with `status` reports.
fn ended_as(status: ExitStatus) -> (LeasePhase, &'static str) {
    match status {
        ExitStatus::Code(0) => (LeasePhase::Done, "Exited"),
        ExitStatus::Code(_) => (LeasePhase::Failed, "Exited"),
        ExitStatus::Signal(_) => (LeasePhase::Failed, "Killed"),
        ExitStatus::OutOfMemory => (LeasePhase::Failed, "OOMKilled"),
        ExitStatus::Unknown => (LeasePhase::Failed, "ExitUnknown"),
    }
}

/// Why this node's runtime cannot run a lease needing `class`, if it cannot:
/// placement only sends a lease to a node whose labels satisfy it, so this
/// catches labels that changed under a placement.
fn runtime_refusal(class: i32, runtime: &Runtime) -> Option<String> {
    let shown = if runtime.contained { runtime.name.clone() } else { format!("{} (uncontained)", runtime.name) };
    match RuntimeClass::try_from(class) {
        Ok(RuntimeClass::Sandboxed) if runtime.name != "runsc" || !runtime.contained => {
            Some(format!("the lease needs a gVisor (runsc) node, and this node runs its workloads with {shown}"))
        }
        Ok(RuntimeClass::Microvm) if runtime.name != "microvm" => {
            Some(format!("the lease needs a microVM node, and this node runs its workloads with {shown}"))
        }
        Ok(RuntimeClass::Contained) if !runtime.contained => {
            Some(format!("the lease needs a node that contains its workloads, and this node runs them with {shown}"))
        }
        Ok(_) => None,
        Err(_) => Some(format!("the lease asks for runtime class {class}, which this node does not know")),
    }
}

/// Why a report did not go through.
enum Interrupt {
    /// The workload is to be destroyed.
    Removed(Removal),
    /// The leases service refused it: the lease is not the node's at this
    /// epoch any more.
    Refused(tonic::Status),
    /// The agent is stopping.
    Stopped,
}

/// The detail a phase report carries.
#[derive(Debug, Default, Clone)]
struct Detail {
    reason: String,
    message: String,
    exit_code: Option<i32>,
    /// With RUNNING: where the replica listens on the node, the port
    /// `PORT` names first.
    ports: Vec<berth_proto::types::v1::Port>,
}

impl Detail {
    /// A RUNNING report of the node ports `meta` says the replica has.
    fn running(meta: &InstanceMeta) -> Self {
        let named = |(name, port): (&String, &u32)| berth_proto::types::v1::Port { name: name.clone(), port: *port };
        let (first, rest): (Vec<_>, Vec<_>) = meta.ports.iter().partition(|(_, port)| **port == meta.port);
        Self { ports: first.into_iter().chain(rest).map(named).collect(), ..Self::default() }
    }

    /// A workload that could not be started, and why.
    fn failed(reason: &str, message: String) -> Self {
        Self { reason: reason.to_string(), message, ..Self::default() }
    }

    /// A bundle that could not be made ready to run.
    fn bundle(error: BundleError) -> Self {
        Self::failed(error.reason(), error.to_string())
    }
}

/// Runs one lease: start (or adopt), report, wait for the end or a removal.
struct Worker {
    lease_id: String,
    shared: Arc<Shared>,
    epoch: watch::Receiver<u64>,
    removal: watch::Receiver<Option<Removal>>,
    resize: watch::Receiver<Option<ResizeWanted>>,
    /// Clears `resize` once the resize it asks for was reported on.
    resize_done: Arc<watch::Sender<Option<ResizeWanted>>>,
    reporting: watch::Receiver<Option<String>>,
    started: Arc<AtomicBool>,
}

impl Worker {
    async fn run(mut self, start: Start) -> WorkerEnd {
        let end = self.run_to_end(start).await;
        if end == WorkerEnd::Settled
            && let Some(svids) = &self.shared.svids
        {
            svids.forget(&self.lease_id).await;
        }
        end
    }

    async fn run_to_end(&mut self, start: Start) -> WorkerEnd {
        // The bundle stays pinned until the worker is done with the lease.
        let (exit, _bundle) = match start {
            Start::Stray => {
                self.started.store(true, Ordering::SeqCst);
                return self.destroyed(Removal::new(Some(LeasePhase::Released), "Stray")).await;
            }
            Start::Adopt { exit, bundle } => {
                if let Some(svids) = &self.shared.svids {
                    svids.adopt(self.lease_watch()).await;
                }
                (exit, bundle)
            }
            Start::Launch(launch) => match self.traced_launch(*launch).await {
                Ok(started) => started,
                Err(end) => return end,
            },
        };
        self.supervise(exit).await
    }

    /// The lease as its credential follows it: its epoch and the node id
    /// it is reported under.
    fn lease_watch(&self) -> LeaseWatch {
        LeaseWatch { lease_id: self.lease_id.clone(), epoch: self.epoch.clone(), node: self.reporting.clone() }
    }

    /// Mints the workload's credential into `spec`; a credential that
    /// cannot be minted fails the lease, with the reason.
    async fn with_identity(&mut self, mut spec: LaunchSpec) -> Result<LaunchSpec, WorkerEnd> {
        let Some(svids) = self.shared.svids.clone() else { return Ok(spec) };
        let lease = self.lease_watch();
        let minted = tokio::select! {
            _ = self.shared.shutdown.cancelled() => return Err(WorkerEnd::Stopped),
            removal = removed(&mut self.removal) => return Err(self.destroyed(removal).await),
            minted = svids.mint(lease) => minted,
        };
        match minted {
            Ok(dir) => {
                spec.identity = Some(dir);
                Ok(spec)
            }
            Err(SvidError::Stopped) => Err(WorkerEnd::Stopped),
            Err(error) => {
                tracing::warn!(lease_id = %self.lease_id, %error, "cannot mint the workload's credential; failing the launch");
                Err(self.report_end(LeasePhase::Failed, Detail::failed(IDENTITY_UNAVAILABLE, error.to_string())).await)
            }
        }
    }

    /// Opens each cache volume the lease mounts (the ledger answers the
    /// head its view starts from) and mounts the lease's view of it into
    /// `spec`; a volume that cannot be opened fails the lease, with the reason.
    async fn with_caches(&mut self, mut spec: LaunchSpec, mounts: &[CacheMount]) -> Result<LaunchSpec, WorkerEnd> {
        if mounts.is_empty() {
            return Ok(spec);
        }
        let runtime = self.shared.provider.runtime();
        let caches = match self.shared.caches.clone() {
            Some(caches) if runtime.contained => caches,
            Some(_) => {
                let message = format!(
                    "this node runs workloads uncontained ({}), with no root of their own to mount a cache volume in",
                    runtime.name
                );
                return Err(self.report_end(LeasePhase::Failed, Detail::failed(CACHE_UNAVAILABLE, message)).await);
            }
            None => {
                let message = "this node keeps no cache volumes".to_owned();
                return Err(self.report_end(LeasePhase::Failed, Detail::failed(CACHE_UNAVAILABLE, message)).await);
            }
        };
        for mount in mounts {
            let held = caches.held(&spec.meta.project, &mount.key);
            let request = OpenCacheRequest {
                node_id: spec.node_id.clone(),
                lease_id: self.lease_id.clone(),
                epoch: spec.epoch,
                key: mount.key.clone(),
                held_generations: held.clone(),
            };
            let opened = tokio::select! {
                _ = self.shared.shutdown.cancelled() => return Err(WorkerEnd::Stopped),
                removal = removed(&mut self.removal) => return Err(self.destroyed(removal).await),
                opened = self.shared.leases.open_cache(request) => opened,
            };
            let (head, publish, registry, from) = match opened {
                // A volume the ledger settled at once (its project's caching is off) publishes nothing.
                Ok(opened) => (
                    opened.head.unwrap_or_default(),
                    opened.observation.is_none_or(|seen| seen.reason.is_empty()),
                    opened.registry,
                    opened.held,
                ),
                Err(status) => {
                    let message = format!("cannot open cache volume {}: {}", mount.key, status.message());
                    tracing::warn!(lease_id = %self.lease_id, %message, "failing the launch");
                    return Err(self.report_end(LeasePhase::Failed, Detail::failed(CACHE_UNAVAILABLE, message)).await);
                }
            };
            // A head this node does not hold is fetched from the registry, where it was pushed.
            if let Some(registry) = registry.filter(|_| {
                publish && head.generation > 0 && !head.artifact.is_empty() && !held.contains(&head.generation)
            }) {
                let transfer = Transfer {
                    volumes: &caches,
                    client: self.shared.bundles.client(),
                    registry: &registry,
                    lease_id: &self.lease_id,
                };
                let fetched = tokio::select! {
                    _ = self.shared.shutdown.cancelled() => return Err(WorkerEnd::Stopped),
                    fetched = transfer.fetch(&head, from.as_ref()) => fetched,
                };
                match fetched {
                    Ok(got) => tracing::info!(lease_id = %self.lease_id, key = %mount.key,
                        generation = head.generation, bytes = got.sealed.size_bytes, pulled_layers = got.pulled_layers,
                        layers = got.layers, "cache volume head fetched"),
                    Err(error) => tracing::warn!(lease_id = %self.lease_id, key = %mount.key, %error,
                        "cannot fetch the cache volume's head; the view starts empty"),
                }
            }
            let (volumes, lease_id, mount_owned) = (caches.clone(), self.lease_id.clone(), mount.clone());
            let view =
                tokio::task::spawn_blocking(move || volumes.open_view(&lease_id, &mount_owned, &head, publish)).await;
            match view {
                Ok(Ok(view)) => {
                    tracing::info!(lease_id = %self.lease_id, key = %view.key, generation = view.base_generation,
                        based = view.based, "cache volume view mounted");
                    spec.caches.push(CacheBind { host: view.merged, inside: view.inside });
                }
                Ok(Err(error)) => {
                    let message = error.to_string();
                    return Err(self.report_end(LeasePhase::Failed, Detail::failed(CACHE_UNAVAILABLE, message)).await);
                }
                Err(_) => return Err(WorkerEnd::Stopped),
            }
        }
        Ok(spec)
    }

    /// Settles each cache view of the lease now that its workload ended as
    /// `ended` (`None`: it was stopped): seals and publishes it where its
    /// `commit` allows, else records why not. Best effort: an outcome the
    /// ledger cannot be told now is left unrecorded, and nothing published.
    async fn publish_caches(&mut self, ended: Option<LeasePhase>) {
        let Some(caches) = self.shared.caches.clone() else { return };
        let views = caches.views(&self.lease_id);
        if views.is_empty() {
            return;
        }
        let project = self.shared.board.get(&self.lease_id).map(|view| view.meta.project).unwrap_or_default();
        let Some(node_id) = self.reporting.borrow().clone() else {
            // Not serving (custody): the ledger cannot be told now, so nothing is published.
            tracing::warn!(lease_id = %self.lease_id, "cannot settle the lease's cache views while the node is not serving");
            return;
        };
        for view in views {
            let skip = match (view.commit(), ended) {
                (CacheCommit::Never, _) => Some(("CommitNever", "the volume is mounted with commit NEVER".to_owned())),
                _ if !view.based => Some((
                    "HeadNotHeld",
                    format!("this node did not hold generation {}, so the view started empty", view.base_generation),
                )),
                (_, Some(LeasePhase::Done)) | (CacheCommit::Always, Some(LeasePhase::Failed)) => None,
                (_, Some(LeasePhase::Failed)) => Some(("WorkloadFailed", "the workload failed".to_owned())),
                _ => Some(("WorkloadStopped", "the workload was stopped before it ended".to_owned())),
            };
            let mut request = CommitCacheRequest {
                node_id: node_id.clone(),
                lease_id: self.lease_id.clone(),
                epoch: *self.epoch.borrow(),
                key: view.key.clone(),
                base_generation: view.base_generation,
                ..Default::default()
            };
            match skip {
                Some((reason, message)) => {
                    request.skip_reason = reason.to_owned();
                    request.message = message;
                }
                None => {
                    let (volumes, lease_id, owner, sealing) =
                        (caches.clone(), self.lease_id.clone(), project.clone(), view.clone());
                    match tokio::task::spawn_blocking(move || volumes.seal(&lease_id, &owner, &sealing)).await {
                        Ok(Ok(sealed)) => {
                            request.artifact = self.push_cache(&caches, &node_id, &project, &view, &sealed).await;
                            request.digest = sealed.digest;
                            request.size_bytes = sealed.size_bytes;
                        }
                        Ok(Err(error)) => {
                            tracing::warn!(lease_id = %self.lease_id, key = %view.key, %error, "cannot seal the cache view");
                            request.skip_reason = "SealFailed".to_owned();
                            request.message = error.to_string();
                        }
                        Err(_) => return,
                    }
                }
            }
            let digest = request.digest.clone();
            let mut backoff = self.shared.settings.backoff();
            let outcome = loop {
                let outcome = tokio::select! {
                    _ = self.shared.shutdown.cancelled() => return,
                    outcome = self.shared.leases.commit_cache(request.clone()) => outcome,
                };
                match outcome {
                    Err(status) if is_transient(&status) && backoff.failures() < CACHE_COMMIT_ATTEMPTS => {
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    outcome => break outcome,
                }
            };
            match outcome {
                Ok(response) if response.committed => {
                    let generation = response.observation.map_or(0, |seen| seen.committed_generation);
                    tracing::info!(lease_id = %self.lease_id, key = %view.key, generation, %digest, "cache view published");
                    let (volumes, project, key) = (caches.clone(), project.clone(), view.key.clone());
                    let recorded =
                        tokio::task::spawn_blocking(move || volumes.record(&project, &key, generation, &digest)).await;
                    if let Ok(Err(error)) = recorded {
                        tracing::warn!(lease_id = %self.lease_id, %error, "cannot record the published generation");
                    }
                }
                Ok(response) => {
                    let reason = response.observation.map(|seen| seen.reason).unwrap_or_default();
                    tracing::info!(lease_id = %self.lease_id, key = %view.key, %reason, "cache view not published");
                }
                Err(status) => {
                    tracing::warn!(lease_id = %self.lease_id, key = %view.key, error = %status.message(),
                        "cannot settle the cache view with the ledger");
                }
            }
        }
    }

    /// Pushes a sealed view to the cache registry, when the mesh keeps one:
    /// the artifact's digest, or empty when it was not pushed (the
    /// generation is then held by this node alone). Asks the ledger again
    /// for the volume (an open is answered as it was first) for the
    /// registry's credentials, which the node keeps in memory only.
    async fn push_cache(
        &self,
        caches: &CacheVolumes,
        node_id: &str,
        project: &str,
        view: &crate::caches::View,
        sealed: &crate::caches::Sealed,
    ) -> String {
        let request = OpenCacheRequest {
            node_id: node_id.to_owned(),
            lease_id: self.lease_id.clone(),
            epoch: *self.epoch.borrow(),
            key: view.key.clone(),
            held_generations: Vec::new(),
        };
        let opened = tokio::select! {
            _ = self.shared.shutdown.cancelled() => return String::new(),
            opened = self.shared.leases.open_cache(request) => opened,
        };
        let (base, registry) = match opened {
            Ok(opened) => match opened.registry {
                Some(registry) => (opened.head.unwrap_or_default(), registry),
                None => return String::new(),
            },
            Err(status) => {
                tracing::warn!(lease_id = %self.lease_id, key = %view.key, error = %status.message(),
                    "cannot ask for the cache registry; the generation stays on this node");
                return String::new();
            }
        };
        let transfer = Transfer {
            volumes: caches,
            client: self.shared.bundles.client(),
            registry: &registry,
            lease_id: &self.lease_id,
        };
        let pushed = tokio::select! {
            _ = self.shared.shutdown.cancelled() => return String::new(),
            pushed = transfer.push(project, view, &base, sealed) => pushed,
        };
        match pushed {
            Ok(artifact) => {
                tracing::info!(lease_id = %self.lease_id, key = %view.key, %artifact, "cache view pushed");
                artifact.to_string()
            }
            Err(error) => {
                tracing::warn!(lease_id = %self.lease_id, key = %view.key, %error,
                    "cannot push the cache view; the generation stays on this node");
                String::new()
            }
        }
    }

    /// [`Worker::launch`] in a span of its own, a child of the lease
    /// request's trace: pulling the bundle, reporting LAUNCHING and RUNNING
    /// and starting the workload show in the trace that asked for it.
    async fn traced_launch(&mut self, launch: Launch) -> Result<(ExitWatch, Option<ReadyBundle>), WorkerEnd> {
        let span = tracing::info_span!("launch", lease_id = %self.lease_id, epoch = launch.spec.epoch,
            project = %launch.spec.meta.project, service = %launch.spec.meta.service);
        berth_telemetry::adopt_traceparent(&span, &launch.traceparent);
        tracing::Instrument::instrument(self.launch(launch), span).await
    }

    async fn launch(&mut self, launch: Launch) -> Result<(ExitWatch, Option<ReadyBundle>), WorkerEnd> {
        let Launch { mut spec, bundle, runtime, readiness, cache, .. } = launch;
        let refusal = runtime_refusal(runtime, &self.shared.provider.runtime());
        // The pull starts while the lease is still BOUND and goes on while
        // LAUNCHING is reported; dropping the handle abandons it.
        let warming = bundle.filter(|_| refusal.is_none()).map(|ask| {
            let bundles = self.shared.bundles.clone();
            AbortOnDropHandle::new(tokio::spawn(async move { bundles.warm(&ask).await }))
        });
        match self.report(LeasePhase::Launching, Detail::default()).await {
            Ok(()) => {}
            Err(Interrupt::Stopped) => return Err(WorkerEnd::Stopped),
            Err(Interrupt::Removed(removal)) => return Err(self.destroyed(removal).await),
            Err(Interrupt::Refused(status)) => {
                tracing::warn!(lease_id = %self.lease_id, error = %status.message(), "LAUNCHING refused; not starting the workload");
                return Err(self.destroyed(Removal::new(None, "LaunchRefused")).await);
            }
        }
        if let Some(message) = refusal {
            tracing::warn!(lease_id = %self.lease_id, %message, "not starting a lease this node's runtime cannot run");
            return Err(self.report_end(LeasePhase::Failed, Detail::failed("RuntimeMismatch", message)).await);
        }
        let bundle = match warming {
            Some(warming) => {
                let (bundled, ready) = self.bundled(warming, spec).await?;
                spec = bundled;
                Some(ready)
            }
            None => None,
        };
        spec.epoch = *self.epoch.borrow();
        if let Some(node_id) = self.reporting.borrow().clone() {
            spec.node_id = node_id;
        }
        let spec = self.with_identity(spec).await?;
        let spec = self.with_caches(spec, &cache).await?;
        let launched = tokio::select! {
            _ = self.shared.shutdown.cancelled() => return Err(WorkerEnd::Stopped),
            launched = self.shared.provider.launch(spec) => launched,
        };
        let (mut exit, meta) = match launched {
            Ok(launched) => {
                self.started.store(true, Ordering::SeqCst);
                self.shared.board.update(&self.lease_id, |view| {
                    view.pid = launched.record.pid;
                    view.started_at = launched.record.started_at;
                    view.meta = launched.record.meta.clone();
                });
                (launched.exit, launched.record.meta)
            }
            Err(error) => {
                tracing::warn!(lease_id = %self.lease_id, %error, "cannot start the workload");
                let detail = Detail::failed(error.start_reason(), error.to_string());
                return Err(self.report_end(LeasePhase::Failed, detail).await);
            }
        };
        if let Some(readiness) = readiness {
            match self.until_ready(&readiness, &meta, &mut exit).await {
                Ok(Gate::Ready) => {}
                // The workload ended first: its end is what is reported.
                Ok(Gate::Ended) => return Ok((exit, bundle)),
                Err(end) => return Err(end),
            }
        }
        match self.report(LeasePhase::Running, Detail::running(&meta)).await {
            Ok(()) => Ok((exit, bundle)),
            Err(Interrupt::Stopped) => Err(WorkerEnd::Stopped),
            Err(Interrupt::Removed(removal)) => Err(self.destroyed(removal).await),
            Err(Interrupt::Refused(status)) => {
                tracing::warn!(lease_id = %self.lease_id, error = %status.message(), "RUNNING refused; destroying the workload");
                Err(self.destroyed(Removal::new(None, "RunningRefused")).await)
            }
        }
    }

    /// Checks the started workload against `readiness` until it passes, it
    /// ends, or the lease is taken away (what is then returned).
    async fn until_ready(
        &mut self,
        readiness: &Readiness,
        meta: &InstanceMeta,
        exit: &mut ExitWatch,
    ) -> Result<Gate, WorkerEnd> {
        let port =
            if readiness.port.is_empty() { meta.port } else { meta.ports.get(&readiness.port).copied().unwrap_or(0) };
        let Ok(port) = u16::try_from(port) else { return Ok(Gate::Ready) };
        if port == 0 {
            tracing::warn!(lease_id = %self.lease_id, port = %readiness.port, "no port to check readiness on; taking it as ready");
            return Ok(Gate::Ready);
        }
        let period = crate::dial::period(readiness);
        let mut last = String::new();
        loop {
            match self.shared.dialer.ready(self.shared.provider.as_ref(), &self.lease_id, port, readiness).await {
                Ok(()) => {
                    tracing::info!(lease_id = %self.lease_id, port, "the workload is ready");
                    return Ok(Gate::Ready);
                }
                Err(why) if why != last => {
                    tracing::debug!(lease_id = %self.lease_id, port, %why, "the workload is not ready yet");
                    last = why;
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = self.shared.shutdown.cancelled() => return Err(WorkerEnd::Stopped),
                removal = removed(&mut self.removal) => return Err(self.destroyed(removal).await),
                _ = async { exit.wait_for(Option::is_some).await.map(|_| ()) } => return Ok(Gate::Ended),
                () = tokio::time::sleep(period) => {}
            }
        }
    }

    /// Waits for the lease's bundle and makes `spec` run it; a bundle that
    /// cannot be run fails the lease, with the reason.
    async fn bundled(
        &mut self,
        warming: AbortOnDropHandle<Result<ReadyBundle, BundleError>>,
        spec: LaunchSpec,
    ) -> Result<(LaunchSpec, ReadyBundle), WorkerEnd> {
        let warmed = tokio::select! {
            _ = self.shared.shutdown.cancelled() => return Err(WorkerEnd::Stopped),
            removal = removed(&mut self.removal) => return Err(self.destroyed(removal).await),
            warmed = warming => warmed,
        };
        let prepared = match warmed {
            Ok(Ok(ready)) => {
                bundle_spec(ready.definition(), spec).map(|bundled| (bundled, ready)).map_err(Detail::bundle)
            }
            Ok(Err(error)) => Err(Detail::bundle(error)),
            Err(error) => Err(Detail::failed("NodeError", format!("the bundle pull failed: {error}"))),
        };
        match prepared {
            Ok(prepared) => Ok(prepared),
            Err(detail) => {
                tracing::warn!(lease_id = %self.lease_id, reason = %detail.reason, error = %detail.message,
                    "cannot run the bundle");
                Err(self.report_end(LeasePhase::Failed, detail).await)
            }
        }
    }

    /// Waits for the workload to end (and reports how) or to be removed,
    /// resizing it meanwhile as the leases service asks.
    async fn supervise(&mut self, mut exit: ExitWatch) -> WorkerEnd {
        let first = *self.resize.borrow_and_update();
        let mut resizing = first.map(|wanted| self.resizing(wanted));
        let ended: Exit = loop {
            tokio::select! {
                _ = self.shared.shutdown.cancelled() => return WorkerEnd::Stopped,
                removal = removed(&mut self.removal) => return self.destroyed(removal).await,
                ended = async { exit.wait_for(Option::is_some).await.ok().and_then(|e| *e) } => match ended {
                    Some(ended) => break ended,
                    // The provider stopped watching: the agent is stopping.
                    None => return WorkerEnd::Stopped,
                },
                Ok(()) = self.resize.changed() => {
                    // A newer size replaces one still being applied.
                    let wanted = *self.resize.borrow_and_update();
                    resizing = wanted.map(|wanted| self.resizing(wanted));
                }
                done = async { match resizing.as_mut() { Some(resize) => resize.await, None => std::future::pending().await } } => {
                    resizing = None;
                    // Unless a newer size came meanwhile.
                    self.resize_done.send_if_modified(|wanted| {
                        let finished = *wanted == Some(done);
                        if finished {
                            *wanted = None;
                        }
                        finished
                    });
                }
            }
        };
        self.shared.board.update(&self.lease_id, |view| view.exit = Some(ended.status));
        let (phase, reason) = ended_as(ended.status);
        let detail = Detail {
            reason: reason.to_string(),
            message: ended.status.to_string(),
            exit_code: ended.status.code(),
            ..Detail::default()
        };
        self.report_end(phase, detail).await
    }

    /// Applies `wanted` to the running workload and reports how it went,
    /// retrying the report while it may go through later.
    fn resizing(&self, wanted: ResizeWanted) -> std::pin::Pin<Box<dyn Future<Output = ResizeWanted> + Send>> {
        let (shared, lease_id) = (self.shared.clone(), self.lease_id.clone());
        let (epoch, mut reporting) = (self.epoch.clone(), self.reporting.clone());
        Box::pin(async move {
            let ask = ResizeAsk { from: wanted.from, to: wanted.to, settle: shared.settings.timing.resize_settle };
            let (state, reason, message) = match shared.provider.resize(&lease_id, ask).await {
                Ok(Resized::Applied) => (ResizeState::Applied, String::new(), String::new()),
                Ok(Resized::Deferred { reason, message }) => (ResizeState::Deferred, reason.to_string(), message),
                Err(error) => (ResizeState::Deferred, "ResizeFailed".to_string(), error.to_string()),
            };
            tracing::info!(%lease_id, from = ?wanted.from, to = ?wanted.to, ?state, %reason, %message, "resized");
            let mut backoff = shared.settings.backoff();
            loop {
                let Ok(node_id) =
                    reporting.wait_for(Option::is_some).await.map(|node| node.clone().unwrap_or_default())
                else {
                    return wanted;
                };
                let request = ReportResizeRequest {
                    node_id,
                    lease_id: lease_id.clone(),
                    epoch: *epoch.borrow(),
                    resources: Some(berth_proto::types::v1::Capacity {
                        cpu_millis: wanted.to.cpu_millis,
                        memory_bytes: wanted.to.memory_bytes,
                    }),
                    state: state as i32,
                    reason: reason.clone(),
                    message: message.clone(),
                };
                match shared.leases.report_resize(request).await {
                    Ok(_) => return wanted,
                    Err(status) if is_transient(&status) => tokio::time::sleep(backoff.next_delay()).await,
                    Err(status) => {
                        // A newer resize replaced it, or the lease moved on:
                        // the stream says what is wanted now.
                        tracing::info!(%lease_id, error = %status.message(), "the resize report was not taken");
                        return wanted;
                    }
                }
            }
        })
    }

    /// Reports the lease's final phase, then settles it.
    async fn report_end(&mut self, phase: LeasePhase, detail: Detail) -> WorkerEnd {
        self.shared.board.update(&self.lease_id, |view| {
            view.phase = phase;
            view.reason = detail.reason.clone();
        });
        match self.report(phase, detail).await {
            Ok(()) => {}
            Err(Interrupt::Stopped) => return WorkerEnd::Stopped,
            Err(Interrupt::Removed(removal)) => {
                tracing::info!(lease_id = %self.lease_id, reason = %removal.reason, "the lease ended before its end was reported");
            }
            Err(Interrupt::Refused(status)) => {
                tracing::warn!(lease_id = %self.lease_id, ?phase, error = %status.message(), "the end of the workload was not taken");
            }
        }
        self.publish_caches(Some(phase)).await;
        self.settle().await
    }

    /// Destroys the workload for `removal` and settles the lease.
    async fn destroyed(&mut self, removal: Removal) -> WorkerEnd {
        self.shared.board.update(&self.lease_id, |view| {
            // From now on no router's tunnel reaches it, however long its
            // stop grace (or a failing destroy) keeps it running.
            view.ending = true;
            if let Some(phase) = removal.phase {
                view.phase = phase;
            }
            view.reason = removal.reason.clone();
        });
        if self.started.load(Ordering::SeqCst) {
            // A workload is never forgotten while it may still run: a destroy
            // that fails is tried again, visibly, until it is gone.
            let mut backoff = self.shared.settings.backoff();
            loop {
                let destroyed = tokio::select! {
                    _ = self.shared.shutdown.cancelled() => return WorkerEnd::Stopped,
                    destroyed = self.shared.provider.destroy(&self.lease_id) => destroyed,
                };
                let Err(error) = destroyed else { break };
                let retry = backoff.next_delay();
                tracing::warn!(lease_id = %self.lease_id, %error, retry_in = ?retry,
                    "cannot destroy the workload; trying again");
                self.shared.board.update(&self.lease_id, |view| view.reason = "DestroyFailing".into());
                tokio::select! {
                    _ = self.shared.shutdown.cancelled() => return WorkerEnd::Stopped,
                    () = tokio::time::sleep(retry) => {}
                }
            }
            self.shared.board.update(&self.lease_id, |view| view.reason = removal.reason.clone());
        }
        self.publish_caches(None).await;
        self.settle().await
    }

    async fn settle(&mut self) -> WorkerEnd {
        let settlement = self
            .shared
            .board
            .get(&self.lease_id)
            .map(|view| Settlement { phase: view.phase.as_str_name().to_owned(), reason: view.reason })
            .unwrap_or_default();
        if let Err(error) = self.shared.provider.settle(&self.lease_id, settlement).await
            && self.started.load(Ordering::SeqCst)
        {
            tracing::warn!(lease_id = %self.lease_id, %error, "cannot record that the instance is settled");
        }
        // The workload is gone: its cache views go with it.
        if let Some(caches) = self.shared.caches.clone() {
            let lease_id = self.lease_id.clone();
            let closed = tokio::task::spawn_blocking(move || caches.close_views(&lease_id)).await;
            if let Ok(Err(error)) = closed {
                tracing::warn!(lease_id = %self.lease_id, %error, "cannot remove the lease's cache views; the sweep will");
            }
        }
        self.shared.board.update(&self.lease_id, |view| view.ended_at = Some(SystemTime::now()));
        WorkerEnd::Settled
    }

    /// Reports `phase` at the epoch held now, waiting while reports are held
    /// back and retrying what may go through later.
    async fn report(&mut self, phase: LeasePhase, detail: Detail) -> Result<(), Interrupt> {
        let mut backoff = self.shared.settings.backoff();
        loop {
            let node_id = tokio::select! {
                _ = self.shared.shutdown.cancelled() => return Err(Interrupt::Stopped),
                removal = removed(&mut self.removal) => return Err(Interrupt::Removed(removal)),
                node = self.reporting.wait_for(Option::is_some) => match node {
                    Ok(node) => node.clone().unwrap_or_default(),
                    Err(_) => return Err(Interrupt::Stopped),
                },
            };
            let epoch = *self.epoch.borrow();
            let request = ReportPhaseRequest {
                node_id,
                lease_id: self.lease_id.clone(),
                epoch,
                phase: phase as i32,
                reason: detail.reason.clone(),
                exit_code: detail.exit_code,
                message: detail.message.clone(),
                ports: detail.ports.clone(),
            };
            let outcome = tokio::select! {
                _ = self.shared.shutdown.cancelled() => return Err(Interrupt::Stopped),
                removal = removed(&mut self.removal) => return Err(Interrupt::Removed(removal)),
                outcome = self.shared.leases.report_phase(request) => outcome,
            };
            match outcome {
                Ok(_) => {
                    tracing::info!(lease_id = %self.lease_id, epoch, ?phase, reason = %detail.reason, "reported");
                    self.shared.board.update(&self.lease_id, |view| {
                        view.phase = phase;
                        view.epoch = epoch;
                        view.reason = detail.reason.clone();
                    });
                    return Ok(());
                }
                // Custody moved the lease while the report was on its way.
                Err(_) if *self.epoch.borrow() != epoch => continue,
                Err(status) if is_transient(&status) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(lease_id = %self.lease_id, ?phase, error = %crate::rpc_status::status_text(&status),
                        retry_in = ?delay, "cannot report; retrying");
                    tokio::select! {
                        _ = self.shared.shutdown.cancelled() => return Err(Interrupt::Stopped),
                        removal = removed(&mut self.removal) => return Err(Interrupt::Removed(removal)),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Err(status) => return Err(Interrupt::Refused(status)),
            }
        }
    }
}

/// Resolves once the runner asks for the workload to be destroyed.
async fn removed(removal: &mut watch::Receiver<Option<Removal>>) -> Removal {
    let found = removal.wait_for(Option::is_some).await.ok().map(|removal| removal.clone());
    match found {
        Some(removal) => removal.unwrap_or_else(|| Removal::new(None, "Removed")),
        // The runner is gone: the agent is stopping, and that is not a removal.
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
