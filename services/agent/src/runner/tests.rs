//! The runner's state machine against a fake leases service (the seam the
//! runner talks through) and the real process provider: what it reports,
//! when it starts, renews, adopts, holds in custody and destroys.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use berth_proto::leases::v1::{
    AssumeCustodyRequest, ReconcileNodeRequest, ReconcileNodeResponse, RenewLeasesRequest, RenewLeasesResponse,
    ReportResizeRequest, Workload,
};
use berth_testkit::{PATIENCE, eventually};
use tokio::sync::Semaphore;

use super::*;
use crate::leases_client::AssignmentStream;
use crate::process::ProcessProvider;
use crate::procfs;
use crate::provider::{ProcessTiming, ProviderError};
use crate::testdir::TestDir;

const NODE: &str = "n-1";
/// The TTL the fake ledger gives; the keep-alive renews every third of it.
const TTL: Duration = Duration::from_millis(600);

// ---------------------------------------------------------------------------
// A fake leases service: a small ledger that keeps the rules the proto states
// ---------------------------------------------------------------------------

type EventSender = mpsc::UnboundedSender<Result<AssignmentEvent, tonic::Status>>;

#[derive(Debug, Default)]
struct Ledger {
    leases: BTreeMap<String, Lease>,
    reports: Vec<ReportPhaseRequest>,
    renewals: Vec<RenewLeasesRequest>,
    reconciles: Vec<ReconcileNodeRequest>,
    custody: Vec<AssumeCustodyRequest>,
    resizes: Vec<ReportResizeRequest>,
    streams_opened: usize,
    stream: Option<EventSender>,
    cursor: u64,
    /// Every call fails UNAVAILABLE.
    down: bool,
    /// AssumeCustody takes EXPIRED leases back (the custody window).
    custody_of_expired: bool,
    /// RenewLeases renews whatever it is given, as a ledger that has not
    /// caught up would.
    renew_blindly: bool,
    /// Renewals are never answered, as on a connection whose peer vanished.
    hang_renewals: bool,
}

#[derive(Debug, Default)]
struct FakeLeases {
    ledger: Mutex<Ledger>,
    /// When set, a LAUNCHING report waits for a permit before it is taken.
    launch_gate: Mutex<Option<Arc<Semaphore>>>,
    /// When set, ReconcileNode waits for a permit before it answers.
    reconcile_gate: Mutex<Option<Arc<Semaphore>>>,
    /// How many ReconcileNode calls have arrived, answered or not.
    reconciles_arrived: std::sync::atomic::AtomicUsize,
}

impl Ledger {
    fn push(&mut self, kind: EventKind, lease: Option<Lease>) {
        self.cursor += 1;
        let event = AssignmentEvent {
            kind: kind as i32,
            lease,
            cursor: self.cursor,
            resumed: false,
            ttl_ms: TTL.as_millis() as u32,
        };
        if let Some(stream) = &self.stream {
            let _ = stream.send(Ok(event));
        }
    }

    fn check(&self) -> Result<(), tonic::Status> {
        if self.down { Err(tonic::Status::unavailable("leases is down")) } else { Ok(()) }
    }
}

impl FakeLeases {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap()
    }

    /// Places a lease running `script` on the node, BOUND at epoch 1.
    fn place(&self, lease_id: &str, script: &str) -> Lease {
        let workload = Workload {
            command: "sh".into(),
            args: vec!["-c".into(), script.into()],
            service: "web".into(),
            ..Default::default()
        };
        self.place_workload(lease_id, workload)
    }

    /// Places a lease running `workload` on the node, BOUND at epoch 1.
    fn place_workload(&self, lease_id: &str, workload: Workload) -> Lease {
        let lease = Lease {
            lease_id: lease_id.into(),
            epoch: 1,
            project: "tenant".into(),
            node_id: NODE.into(),
            phase: LeasePhase::Bound as i32,
            workload: Some(workload),
            ..Default::default()
        };
        let mut ledger = self.ledger();
        ledger.leases.insert(lease_id.into(), lease.clone());
        ledger.push(EventKind::Upsert, Some(lease.clone()));
        lease
    }

    /// Changes a lease behind the node's back; `event` says whether the
    /// assignment stream hears of it.
    fn change(&self, lease_id: &str, event: Option<EventKind>, f: impl FnOnce(&mut Lease)) {
        let mut ledger = self.ledger();
        let lease = ledger.leases.get_mut(lease_id).unwrap();
        f(lease);
        let lease = lease.clone();
        if let Some(kind) = event {
            ledger.push(kind, Some(lease));
        }
    }

    fn lease(&self, lease_id: &str) -> Lease {
        self.ledger().leases[lease_id].clone()
    }

    fn set_down(&self, down: bool) {
        self.ledger().down = down;
    }

    async fn phase_until(&self, lease_id: &str, phase: LeasePhase) -> Lease {
        eventually(&format!("lease {lease_id} to be {phase:?}"), PATIENCE, || async {
            let lease = self.lease(lease_id);
            if lease.phase() == phase { Ok(lease) } else { Err(lease) }
        })
        .await
    }

    fn reported(&self, lease_id: &str) -> Vec<LeasePhase> {
        self.ledger().reports.iter().filter(|r| r.lease_id == lease_id).map(|r| r.phase()).collect()
    }

    fn renewals(&self) -> usize {
        self.ledger().renewals.len()
    }
}

#[async_trait::async_trait]
impl NodeLeasesApi for FakeLeases {
    async fn watch_assignments(&self, node_id: &str, _resume_cursor: u64) -> Result<AssignmentStream, tonic::Status> {
        let mut ledger = self.ledger();
        ledger.check()?;
        assert_eq!(node_id, NODE);
        let (tx, rx) = mpsc::unbounded_channel();
        let open_set: Vec<Lease> = ledger.leases.values().filter(|l| l.phase().is_open()).cloned().collect();
        ledger.stream = Some(tx);
        ledger.streams_opened += 1;
        for lease in open_set {
            ledger.push(EventKind::Upsert, Some(lease));
        }
        ledger.push(EventKind::Synced, None);
        Ok(Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)))
    }

    async fn report_phase(&self, request: ReportPhaseRequest) -> Result<Lease, tonic::Status> {
        let gate = self.launch_gate.lock().unwrap().clone();
        if let Some(gate) = gate
            && request.phase() == LeasePhase::Launching
        {
            gate.acquire().await.unwrap().forget();
        }
        let mut ledger = self.ledger();
        ledger.check()?;
        ledger.reports.push(request.clone());
        let lease = ledger.leases.get_mut(&request.lease_id).ok_or_else(|| tonic::Status::not_found("no lease"))?;
        if lease.epoch != request.epoch {
            return Err(tonic::Status::failed_precondition("stale epoch"));
        }
        if !lease.phase().is_open() {
            return Err(tonic::Status::failed_precondition("lease is final"));
        }
        lease.phase = request.phase;
        lease.reason = request.reason.clone();
        lease.message = request.message.clone();
        lease.exit_code = request.exit_code;
        let lease = lease.clone();
        if !lease.phase().is_open() {
            ledger.push(EventKind::Removed, Some(lease.clone()));
        }
        Ok(lease)
    }

    async fn renew_leases(&self, request: RenewLeasesRequest) -> Result<RenewLeasesResponse, tonic::Status> {
        let hang = self.ledger().hang_renewals;
        if hang {
            std::future::pending::<()>().await;
        }
        let mut ledger = self.ledger();
        ledger.check()?;
        ledger.renewals.push(request.clone());
        let (mut renewed, mut lost) = (Vec::new(), Vec::new());
        for held in request.leases {
            let ok = ledger.renew_blindly
                || ledger.leases.get(&held.lease_id).is_some_and(|l| l.phase().is_open() && l.epoch == held.epoch);
            if ok { renewed.push(held) } else { lost.push(held) }
        }
        Ok(RenewLeasesResponse { renewed, lost, ttl_ms: TTL.as_millis() as u32 })
    }

    async fn reconcile_node(&self, request: ReconcileNodeRequest) -> Result<ReconcileNodeResponse, tonic::Status> {
        self.reconciles_arrived.fetch_add(1, Ordering::SeqCst);
        let gate = self.reconcile_gate.lock().unwrap().clone();
        if let Some(gate) = gate {
            gate.acquire().await.unwrap().forget();
        }
        let mut ledger = self.ledger();
        ledger.check()?;
        ledger.reconciles.push(request.clone());
        let destroy = request
            .running
            .iter()
            .filter(|r| !ledger.leases.get(&r.lease_id).is_some_and(|l| l.phase().is_open() && l.epoch == r.epoch))
            .cloned()
            .collect();
        let mut failed = Vec::new();
        for lease in ledger.leases.values_mut() {
            let listed = request.running.iter().any(|r| r.lease_id == lease.lease_id && r.epoch == lease.epoch);
            if lease.phase() == LeasePhase::Running && !listed {
                lease.phase = LeasePhase::Failed as i32;
                lease.reason = "NodeLost".into();
                failed.push(LeaseRef { lease_id: lease.lease_id.clone(), epoch: lease.epoch });
            }
        }
        Ok(ReconcileNodeResponse { destroy, failed })
    }

    async fn report_resize(&self, request: ReportResizeRequest) -> Result<Lease, tonic::Status> {
        let mut ledger = self.ledger();
        ledger.check()?;
        ledger.resizes.push(request.clone());
        let lease = ledger.leases.get_mut(&request.lease_id).ok_or_else(|| tonic::Status::not_found("no lease"))?;
        let resize = lease.resize.as_mut().filter(|r| r.resources == request.resources && lease.epoch == request.epoch);
        let resize = resize.ok_or_else(|| tonic::Status::failed_precondition("not the pending resize"))?;
        resize.state = request.state;
        resize.reason = request.reason.clone();
        if request.state() == ResizeState::Applied {
            lease.resources = request.resources;
        }
        Ok(lease.clone())
    }

    async fn open_cache(
        &self,
        _request: berth_proto::leases::v1::OpenCacheRequest,
    ) -> Result<berth_proto::leases::v1::OpenCacheResponse, tonic::Status> {
        Err(tonic::Status::unimplemented("this fake ledger keeps no cache volumes"))
    }

    async fn follow_caches(
        &self,
        _request: berth_proto::leases::v1::FollowCachesRequest,
    ) -> Result<berth_proto::leases::v1::FollowCachesResponse, tonic::Status> {
        Ok(berth_proto::leases::v1::FollowCachesResponse::default())
    }

    async fn commit_cache(
        &self,
        _request: berth_proto::leases::v1::CommitCacheRequest,
    ) -> Result<berth_proto::leases::v1::CommitCacheResponse, tonic::Status> {
        Err(tonic::Status::unimplemented("this fake ledger keeps no cache volumes"))
    }

    async fn assume_custody(&self, request: AssumeCustodyRequest) -> Result<Lease, tonic::Status> {
        let mut ledger = self.ledger();
        ledger.check()?;
        ledger.custody.push(request.clone());
        let custody_of_expired = ledger.custody_of_expired;
        let lease = ledger.leases.get_mut(&request.lease_id).ok_or_else(|| tonic::Status::not_found("no lease"))?;
        if lease.epoch != request.epoch {
            return Err(tonic::Status::failed_precondition("stale epoch"));
        }
        let takeable = lease.phase().is_open() || (lease.phase() == LeasePhase::Expired && custody_of_expired);
        if !takeable {
            return Err(tonic::Status::failed_precondition(format!("it is {:?}; destroy its workload", lease.phase())));
        }
        lease.epoch += 1;
        lease.phase = LeasePhase::Running as i32;
        lease.reason = "CustodyAssumed".into();
        let lease = lease.clone();
        ledger.push(EventKind::Upsert, Some(lease.clone()));
        Ok(lease)
    }

    fn reconnect(&self) {}
}

// ---------------------------------------------------------------------------
// A runner under test
// ---------------------------------------------------------------------------

fn settings() -> RunnerSettings {
    RunnerSettings {
        timing: LeaseTiming {
            renew_interval: Duration::from_millis(50),
            sweep_interval: Duration::from_secs(3600),
            stop_grace: Duration::from_secs(2),
            exit_poll: Duration::from_millis(20),
            log_poll: Duration::from_millis(20),
            retain_finished: Duration::from_secs(3600),
            resize_settle: Duration::from_secs(1),
        },
        retry_initial: Duration::from_millis(10),
        retry_max: Duration::from_millis(100),
        max_custody: None,
        custody_warning: Duration::from_secs(3600),
        stop_after_disconnect: None,
    }
}

/// [`settings`] with a sweep every `interval`.
fn with_sweep_interval(interval: Duration) -> RunnerSettings {
    let mut settings = settings();
    settings.timing.sweep_interval = interval;
    settings
}

/// [`settings`] with a stop grace of `grace`.
fn with_stop_grace(grace: Duration) -> RunnerSettings {
    let mut settings = settings();
    settings.timing.stop_grace = grace;
    settings
}

fn session(incarnation: u64) -> NodeSession {
    NodeSession { node_id: NODE.into(), incarnation }
}

struct Harness {
    board: InstanceBoard,
    session: watch::Sender<NodeSession>,
    fences: watch::Sender<Option<Fence>>,
    handle: RunnerHandle,
    stop: CancellationToken,
}

/// The process provider, whose listing fails its first `failures` times
/// and whose destroy its first `destroy_failures` times.
#[derive(Debug, Default)]
struct FlakyInventory {
    inner: Option<Arc<dyn Provider>>,
    failures: std::sync::atomic::AtomicUsize,
    listings: std::sync::atomic::AtomicUsize,
    destroy_failures: std::sync::atomic::AtomicUsize,
    destroys: std::sync::atomic::AtomicUsize,
}

impl FlakyInventory {
    fn inner(&self) -> &Arc<dyn Provider> {
        self.inner.as_ref().unwrap()
    }

    /// `wrap` for [`Harness::start_with`], leaving the wrapper in `slot`.
    fn wrapping(
        failures: usize,
        destroy_failures: usize,
        slot: Arc<Mutex<Option<Arc<FlakyInventory>>>>,
    ) -> impl FnOnce(Arc<dyn Provider>) -> Arc<dyn Provider> {
        move |inner| {
            let wrapped = Arc::new(FlakyInventory {
                inner: Some(inner),
                failures: failures.into(),
                destroy_failures: destroy_failures.into(),
                ..FlakyInventory::default()
            });
            *slot.lock().unwrap() = Some(wrapped.clone());
            wrapped
        }
    }
}

crate::provider::wrapping_provider!(FlakyInventory, |this| this.inner(), {
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, ProviderError> {
        self.inner().launch(spec).await
    }
    async fn recover(&self) -> Result<Vec<Launched>, ProviderError> {
        self.listings.fetch_add(1, Ordering::SeqCst);
        let left = self.failures.load(Ordering::SeqCst);
        if left > 0 {
            self.failures.store(left - 1, Ordering::SeqCst);
            return Err(ProviderError::Unsupported("the instance directory cannot be read".into()));
        }
        self.inner().recover().await
    }
    async fn set_epoch(&self, lease_id: &str, epoch: u64) -> Result<(), ProviderError> {
        self.inner().set_epoch(lease_id, epoch).await
    }
    async fn settle(&self, lease_id: &str, settlement: Settlement) -> Result<(), ProviderError> {
        self.inner().settle(lease_id, settlement).await
    }
    async fn destroy(&self, lease_id: &str) -> Result<(), ProviderError> {
        self.destroys.fetch_add(1, Ordering::SeqCst);
        let left = self.destroy_failures.load(Ordering::SeqCst);
        if left > 0 {
            self.destroy_failures.store(left - 1, Ordering::SeqCst);
            return Err(ProviderError::Stuck { lease_id: lease_id.into(), detail: "it survived SIGKILL".into() });
        }
        self.inner().destroy(lease_id).await
    }
    async fn remove(&self, lease_id: &str) -> Result<(), ProviderError> {
        self.inner().remove(lease_id).await
    }
});

impl Harness {
    async fn start(fake: &Arc<FakeLeases>, dir: &Path, settings: RunnerSettings) -> Harness {
        Harness::start_with(fake, dir, settings, |provider| provider).await
    }

    /// [`Harness::start`] with the provider as `wrap` makes it.
    async fn start_with(
        fake: &Arc<FakeLeases>,
        dir: &Path,
        settings: RunnerSettings,
        wrap: impl FnOnce(Arc<dyn Provider>) -> Arc<dyn Provider>,
    ) -> Harness {
        let stop = CancellationToken::new();
        let timing = ProcessTiming { stop_grace: settings.timing.stop_grace, exit_poll: settings.timing.exit_poll };
        let provider: Arc<dyn Provider> = wrap(Arc::new(ProcessProvider::new(dir, timing, stop.clone())));
        let cache = berth_bundle::BundleCache::open(dir.join("bundles"), Default::default()).await.unwrap();
        let client = berth_bundle::BundleClient::new(Default::default()).unwrap();
        let bundles = BundleStore::new(cache, client);
        let (session, session_rx) = watch::channel(session(1));
        let (fences, fences_rx) = watch::channel(None);
        let board = InstanceBoard::default();
        let handle = spawn(RunnerParts {
            leases: fake.clone(),
            provider,
            bundles,
            board: board.clone(),
            dialer: crate::dial::Dialer::default(),
            svids: None,
            caches: None,
            session: session_rx,
            fences: fences_rx,
            settings,
            shutdown: stop.clone(),
        });
        Harness { board, session, fences, handle, stop }
    }

    /// Starts a runner and waits until it serves.
    async fn serving(fake: &Arc<FakeLeases>, dir: &Path, settings: RunnerSettings) -> Harness {
        let runner = Harness::start(fake, dir, settings).await;
        runner.standing_until(Standing::Serving).await;
        runner
    }

    async fn standing_until(&self, standing: Standing) {
        let mut rx = self.handle.standing.clone();
        let reached = tokio::time::timeout(PATIENCE, rx.wait_for(|s| *s == standing)).await.map(|r| r.is_ok());
        assert_eq!(reached, Ok(true), "never {standing:?}, still {:?}", *rx.borrow());
    }

    async fn holding_until(&self, count: usize) {
        let mut rx = self.handle.holding.clone();
        let reached = tokio::time::timeout(PATIENCE, rx.wait_for(|n| *n == count)).await.map(|r| r.is_ok());
        assert_eq!(reached, Ok(true), "never holding {count}, holding {}", *rx.borrow());
    }

    async fn view_until(&self, lease_id: &str, what: &str, pred: impl Fn(&InstanceView) -> bool) -> InstanceView {
        eventually(&format!("the board to show instance {lease_id} {what}"), PATIENCE, || async {
            match self.board.get(lease_id) {
                Some(view) if pred(&view) => Ok(view),
                seen => Err(seen),
            }
        })
        .await
    }

    async fn pid_of(&self, lease_id: &str) -> u32 {
        self.view_until(lease_id, "started", |v| v.pid.is_some()).await.pid.unwrap()
    }

    /// Stops the runner the way a killed agent stops: nothing is cleaned up.
    async fn kill(self) {
        self.stop.cancel();
        let _ = self.handle.task.await;
    }

    fn fence(&self, reason: FenceReason) {
        let fence = Fence { session: self.session.borrow().clone(), reason, at: SystemTime::now() };
        self.fences.send_replace(Some(fence));
    }
}

/// A fresh directory and an empty fake ledger.
fn fresh() -> (TestDir, Arc<FakeLeases>) {
    (TestDir::new(), Arc::new(FakeLeases::default()))
}

/// A fresh directory and fake ledger, and a runner serving over them.
async fn serving_runner(settings: RunnerSettings) -> (TestDir, Arc<FakeLeases>, Harness) {
    let (dir, fake) = fresh();
    let runner = Harness::serving(&fake, dir.path(), settings).await;
    (dir, fake, runner)
}

/// Places `lease_id` on the fake ledger running `command`; its pid once it
/// runs.
async fn run_lease(fake: &FakeLeases, runner: &Harness, lease_id: &str, command: &str) -> u32 {
    fake.place(lease_id, command);
    fake.phase_until(lease_id, LeasePhase::Running).await;
    runner.pid_of(lease_id).await
}

/// Destroys a workload a killed runner left running, as a restarted agent's
/// provider would find it.
async fn destroy_left_behind(dir: &Path, lease_id: &str) {
    let provider = ProcessProvider::new(dir, ProcessTiming::default(), CancellationToken::new());
    provider.recover().await.unwrap();
    provider.destroy(lease_id).await.unwrap();
}

fn group_gone(pid: u32) -> bool {
    procfs::group_members(Path::new(procfs::PROC_ROOT), i32::try_from(pid).unwrap()).is_empty()
}

async fn gone_until(pid: u32) {
    eventually(&format!("process group {pid} to be gone"), PATIENCE, || async {
        if group_gone(pid) { Ok(()) } else { Err(format!("process group {pid} still runs")) }
    })
    .await;
}

fn alive(pid: u32) -> bool {
    !group_gone(pid)
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[tokio::test]
async fn launching_is_reported_before_the_workload_starts_then_running_then_done() {
    let (dir, fake) = fresh();
    let gate = Arc::new(Semaphore::new(0));
    *fake.launch_gate.lock().unwrap() = Some(gate.clone());
    let runner = Harness::serving(&fake, dir.path(), settings()).await;
    fake.place("l-1", "echo ran > ran; exit 0");

    // The LAUNCHING report is held at the service: nothing may start yet.
    runner.view_until("l-1", "taken on", |_| true).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!dir.path().join("leases/l-1/ran").exists(), "the workload started before LAUNCHING was taken");
    assert_eq!(runner.board.get("l-1").unwrap().pid, None);
    gate.add_permits(1);

    let done = fake.phase_until("l-1", LeasePhase::Done).await;
    assert_eq!(done.exit_code, Some(0));
    assert_eq!(done.reason, "Exited");
    assert_eq!(fake.reported("l-1"), vec![LeasePhase::Launching, LeasePhase::Running, LeasePhase::Done]);
    assert!(dir.path().join("leases/l-1/ran").exists());
    let view = runner.view_until("l-1", "settled", |v| v.ended_at.is_some()).await;
    assert_eq!((view.phase, view.exit), (LeasePhase::Done, Some(ExitStatus::Code(0))));
    assert_eq!(view.meta.project, "tenant");
    runner.holding_until(0).await;
    runner.kill().await;
}

/// `examples/hello`-like bundle whose program writes `ran` and sleeps,
/// pushed into a layout directory; the workload that runs it.
async fn sleeping_bundle(source: &Path, layout: &Path) -> Workload {
    std::fs::write(source.join("berth.toml"), "entrypoint = \"run.sh\"\nargs = [\"1000\"]\n").unwrap();
    std::fs::write(source.join("run.sh"), "#!/bin/sh\necho ran > ran\nexec sleep \"$1\"\n").unwrap();
    std::fs::set_permissions(source.join("run.sh"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let packed = berth_bundle::PackedBundle::from_dir(source).unwrap();
    let reference = berth_bundle::BundleReference::parse(&format!("oci:{}:v1", layout.display())).unwrap();
    let client = berth_bundle::BundleClient::new(Default::default()).unwrap();
    let digest = client.push(&packed, &reference, &Default::default()).await.unwrap();
    Workload {
        bundle: Some(berth_proto::types::v1::BundleRef {
            reference: format!("oci:{}@{digest}", layout.display()),
            ..Default::default()
        }),
        digest: digest.to_string(),
        service: "web".into(),
        revision: "web-00001".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_bundle_is_pulled_while_the_lease_is_bound_and_runs_once_launching_is_taken() {
    let (dir, source, layout) = (TestDir::new(), TestDir::new(), TestDir::new());
    let workload = sleeping_bundle(source.path(), layout.path()).await;
    let hex = workload.digest.trim_start_matches("sha256:").to_string();
    let fake = Arc::new(FakeLeases::default());
    let gate = Arc::new(Semaphore::new(0));
    *fake.launch_gate.lock().unwrap() = Some(gate.clone());
    let runner = Harness::serving(&fake, dir.path(), settings()).await;
    fake.place_workload("l-1", workload);

    // LAUNCHING is held at the service, and the bundle arrives all the same.
    let extracted = dir.path().join("bundles/bundles/sha256").join(&hex);
    eventually("the bundle to be pulled while the lease is BOUND", PATIENCE, || async {
        if extracted.is_dir() { Ok(()) } else { Err(format!("no {}", extracted.display())) }
    })
    .await;
    assert_eq!(fake.lease("l-1").phase(), LeasePhase::Bound);
    assert!(!dir.path().join("leases/l-1/ran").exists(), "the workload started before LAUNCHING was taken");
    gate.add_permits(1);

    fake.phase_until("l-1", LeasePhase::Running).await;
    let view = runner.view_until("l-1", "started", |v| v.pid.is_some()).await;
    assert_eq!(view.meta.digest, format!("sha256:{hex}"));
    assert_ne!(view.meta.port, 0);
    let ran = dir.path().join("leases/l-1/ran");
    eventually("the bundle's program to run in the lease's directory", PATIENCE, || async {
        if ran.exists() { Ok(()) } else { Err(format!("no {}", ran.display())) }
    })
    .await;
    fake.change("l-1", Some(EventKind::Removed), |lease| lease.phase = LeasePhase::Released as i32);
    runner.holding_until(0).await;
    runner.kill().await;
}

#[tokio::test]
async fn a_failing_workload_is_failed_with_its_exit_code() {
    let (_dir, fake, runner) = serving_runner(settings()).await;
    fake.place("l-1", "exit 3");
    let failed = fake.phase_until("l-1", LeasePhase::Failed).await;
    assert_eq!(failed.exit_code, Some(3));
    assert_eq!(failed.reason, "Exited");
    assert_eq!(failed.message, "exited with code 3");

    // A command that cannot start fails its lease without RUNNING.
    let lease = Lease {
        lease_id: "l-2".into(),
        epoch: 1,
        node_id: NODE.into(),
        phase: LeasePhase::Bound as i32,
        workload: Some(Workload { command: "/nonexistent/program".into(), ..Default::default() }),
        ..Default::default()
    };
    {
        let mut ledger = fake.ledger();
        ledger.leases.insert("l-2".into(), lease.clone());
        ledger.push(EventKind::Upsert, Some(lease));
    }
    let failed = fake.phase_until("l-2", LeasePhase::Failed).await;
    assert_eq!(failed.reason, "StartFailed");
    assert!(failed.message.contains("/nonexistent/program"), "{}", failed.message);
    assert_eq!(fake.reported("l-2"), vec![LeasePhase::Launching, LeasePhase::Failed]);
    runner.kill().await;
}

#[tokio::test]
async fn a_released_lease_is_destroyed_and_held_leases_are_renewed_in_one_batch() {
    let (dir, fake, runner) = serving_runner(settings()).await;
    fake.place("l-1", "sleep 1000 & sleep 1000");
    fake.place("l-2", "exec sleep 1000");
    fake.phase_until("l-1", LeasePhase::Running).await;
    fake.phase_until("l-2", LeasePhase::Running).await;
    let pid = runner.pid_of("l-1").await;

    let batch = eventually("both leases to be renewed in one batch", PATIENCE, || async {
        match fake.ledger().renewals.last().cloned() {
            Some(batch) if batch.leases.len() == 2 => Ok(batch),
            last => Err(last),
        }
    })
    .await;
    assert_eq!(batch.node_id, NODE);
    let epochs: Vec<(String, u64)> = batch.leases.iter().map(|l| (l.lease_id.clone(), l.epoch)).collect();
    assert_eq!(epochs, vec![("l-1".to_string(), 1), ("l-2".to_string(), 1)]);

    fake.change("l-1", Some(EventKind::Removed), |l| l.phase = LeasePhase::Released as i32);
    gone_until(pid).await;
    let view = runner.view_until("l-1", "settled", |v| v.ended_at.is_some()).await;
    assert_eq!((view.phase, view.reason.as_str()), (LeasePhase::Released, "Released"));
    assert_eq!(
        fake.reported("l-1"),
        vec![LeasePhase::Launching, LeasePhase::Running],
        "a removed lease is not reported"
    );
    assert!(alive(runner.pid_of("l-2").await), "the other lease runs on");
    runner.holding_until(1).await;
    let pid2 = runner.pid_of("l-2").await;
    runner.kill().await;
    assert!(alive(pid2), "stopping the runner leaves the workload running");
    destroy_left_behind(dir.path(), "l-2").await;
}

#[tokio::test]
async fn a_lease_reported_lost_is_destroyed_and_renewals_go_on_while_a_destroy_waits() {
    let (dir, fake, runner) = serving_runner(with_stop_grace(Duration::from_millis(1500))).await;
    // Ignores SIGTERM: destroying it takes the whole grace.
    fake.place("l-stubborn", "trap '' TERM; sleep 1000");
    fake.place("l-other", "exec sleep 1000");
    fake.phase_until("l-stubborn", LeasePhase::Running).await;
    fake.phase_until("l-other", LeasePhase::Running).await;
    let stubborn = runner.pid_of("l-stubborn").await;

    // The ledger moves on without telling the stream: only the renewal
    // can find out.
    fake.change("l-stubborn", None, |l| l.phase = LeasePhase::Expired as i32);
    runner.view_until("l-stubborn", "being destroyed", |v| v.reason == "LeaseLost").await;
    // Renewals go on while the destroy waits out the grace: three of them
    // come before the stubborn workload is gone.
    let before = fake.renewals();
    eventually("three renewals or the destroy to come", PATIENCE, || async {
        let renewed = fake.renewals() - before;
        if renewed >= 3 || !alive(stubborn) { Ok(()) } else { Err(format!("{renewed} renewals, the workload alive")) }
    })
    .await;
    assert!(
        alive(stubborn),
        "renewals stalled while a destroy waited: {} before the grace ran out",
        fake.renewals() - before
    );
    gone_until(stubborn).await;
    assert_eq!(fake.lease("l-other").phase(), LeasePhase::Running);
    runner.kill().await;
    destroy_left_behind(dir.path(), "l-other").await;
}

#[tokio::test]
async fn a_restarted_runner_adopts_what_its_leases_still_cover_and_destroys_the_rest() {
    let (dir, fake) = fresh();
    let first = Harness::serving(&fake, dir.path(), settings()).await;
    fake.place("l-kept", "exec sleep 1000");
    fake.place("l-gone", "exec sleep 1000");
    fake.phase_until("l-kept", LeasePhase::Running).await;
    fake.phase_until("l-gone", LeasePhase::Running).await;
    let kept = first.pid_of("l-kept").await;
    let gone = first.pid_of("l-gone").await;
    first.kill().await;

    // While no agent watched, one lease was released.
    fake.change("l-gone", None, |l| l.phase = LeasePhase::Released as i32);
    let earlier = fake.ledger().reconciles.len();
    let second = Harness::serving(&fake, dir.path(), settings()).await;
    gone_until(gone).await;
    assert!(alive(kept));
    let view = second.view_until("l-kept", "taken into custody", |v| v.epoch == 2).await;
    assert_eq!(view.pid, Some(kept), "adopted, not restarted");
    let lease = fake.lease("l-kept");
    assert_eq!((lease.phase(), lease.epoch), (LeasePhase::Running, 2));
    let ledger_custody: Vec<(String, u64)> =
        fake.ledger().custody.iter().map(|c| (c.lease_id.clone(), c.epoch)).collect();
    assert!(ledger_custody.contains(&("l-kept".to_string(), 1)), "{ledger_custody:?}");
    let reconciled = fake.ledger().reconciles[earlier].clone();
    assert!(
        reconciled.running.contains(&LeaseRef { lease_id: "l-kept".into(), epoch: 2 }),
        "reconciled at the epoch custody gave: {reconciled:?}"
    );
    let kept_record = std::fs::read_to_string(dir.path().join("instances/l-kept.json")).unwrap();
    assert!(kept_record.contains("\"epoch\": 2"), "{kept_record}");

    // Renewals carry the new epoch, and the lease's end is reported at it.
    eventually("l-kept to be renewed at epoch 2", PATIENCE, || async {
        let renewals = fake.ledger().renewals.clone();
        let at_2 = LeaseRef { lease_id: "l-kept".into(), epoch: 2 };
        if renewals.iter().any(|r| r.leases.contains(&at_2)) { Ok(()) } else { Err(renewals) }
    })
    .await;
    rustix::process::kill_process_group(
        rustix::process::Pid::from_raw(i32::try_from(kept).unwrap()).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let failed = fake.phase_until("l-kept", LeasePhase::Failed).await;
    assert_eq!(failed.reason, "ExitUnknown", "an adopted process's exit status cannot be known");
    assert_eq!(fake.ledger().reports.last().unwrap().epoch, 2);
    second.kill().await;
}

#[tokio::test]
async fn a_failed_listing_at_start_reconciles_nothing_until_a_listing_succeeds() {
    let (dir, fake) = fresh();
    let first = Harness::serving(&fake, dir.path(), settings()).await;
    let kept = run_lease(&fake, &first, "l-kept", "exec sleep 1000").await;
    first.kill().await;

    // The restarted agent cannot read what it runs, twice.
    let earlier = fake.ledger().reconciles.len();
    let flaky = Arc::new(Mutex::new(None));
    let second =
        Harness::start_with(&fake, dir.path(), settings(), FlakyInventory::wrapping(2, 0, flaky.clone())).await;
    let wrapped = flaky.lock().unwrap().clone().unwrap();
    eventually("the listing to be asked again", PATIENCE, || async {
        let listings = wrapped.listings.load(Ordering::SeqCst);
        if listings >= 2 {
            return Ok(());
        }
        assert_eq!(fake.ledger().reconciles.len(), earlier, "nothing is reconciled on a failed listing");
        assert_eq!(*second.handle.standing.borrow(), Standing::Recovering, "not serving meanwhile");
        Err(format!("{listings} listings"))
    })
    .await;
    assert!(alive(kept), "the workload it could not list is left alone");

    // Once a listing succeeds it is adopted, not replaced.
    second.standing_until(Standing::Serving).await;
    assert!(wrapped.listings.load(Ordering::SeqCst) >= 3);
    let view = second.view_until("l-kept", "taken into custody", |v| v.epoch == 2).await;
    assert_eq!(view.pid, Some(kept), "adopted, not restarted");
    assert_eq!(fake.lease("l-kept").phase(), LeasePhase::Running);
    let reconciled = fake.ledger().reconciles[earlier].clone();
    assert!(reconciled.running.iter().any(|l| l.lease_id == "l-kept"), "{reconciled:?}");
    fake.change("l-kept", Some(EventKind::Upsert), |l| l.phase = LeasePhase::Released as i32);
    gone_until(kept).await;
    second.kill().await;
}

#[tokio::test]
async fn a_destroy_that_fails_is_tried_again_visibly_until_the_workload_is_gone() {
    let (dir, fake) = fresh();
    let flaky = Arc::new(Mutex::new(None));
    let runner =
        Harness::start_with(&fake, dir.path(), settings(), FlakyInventory::wrapping(0, 2, flaky.clone())).await;
    runner.standing_until(Standing::Serving).await;
    let wrapped = flaky.lock().unwrap().clone().unwrap();
    let pid = run_lease(&fake, &runner, "l-stuck", "exec sleep 1000").await;

    fake.change("l-stuck", Some(EventKind::Upsert), |l| l.phase = LeasePhase::Released as i32);
    runner.view_until("l-stuck", "shown as failing to be destroyed", |v| v.reason == "DestroyFailing").await;
    assert!(alive(pid), "not yet destroyed");
    assert_eq!(*runner.handle.holding.borrow(), 1, "still held, not forgotten");
    gone_until(pid).await;
    runner.view_until("l-stuck", "settled once gone", |v| v.ended_at.is_some()).await;
    assert_eq!(wrapped.destroys.load(Ordering::SeqCst), 3, "two refusals, then the destroy that worked");
    runner.holding_until(0).await;
    runner.kill().await;
}

#[tokio::test]
async fn a_sweep_finds_and_destroys_a_workload_no_held_lease_covers() {
    let (dir, fake) = fresh();
    let flaky = Arc::new(Mutex::new(None));
    let quick = with_sweep_interval(Duration::from_millis(100));
    let runner = Harness::start_with(&fake, dir.path(), quick, FlakyInventory::wrapping(0, 0, flaky.clone())).await;
    runner.standing_until(Standing::Serving).await;
    let wrapped = flaky.lock().unwrap().clone().unwrap();
    // Something the provider runs that the runner holds no lease for.
    let stray = wrapped.launch(LaunchSpec::for_test("l-stray", "exec sleep 1000")).await.unwrap();
    let pid = stray.record.pid.unwrap();
    let view = runner.view_until("l-stray", "found by a sweep", |v| v.reason == "Stray").await;
    assert_eq!(view.phase, LeasePhase::Released);
    gone_until(pid).await;
    runner.view_until("l-stray", "settled", |v| v.ended_at.is_some()).await;
    assert!(!fake.ledger().reports.iter().any(|r| r.lease_id == "l-stray"), "no report for a lease it never held");
    runner.kill().await;
}

#[tokio::test]
async fn a_fenced_node_holds_its_compute_in_custody_and_reconciles_after_it_rejoins() {
    let (dir, fake, runner) = serving_runner(settings()).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;

    runner.fence(FenceReason::Fenced);
    runner.standing_until(Standing::Custody).await;
    let (renewals, reports) = (fake.renewals(), fake.ledger().reports.len());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(alive(pid), "custody keeps the workload running");
    assert_eq!(fake.renewals(), renewals, "no renewals without a session");
    assert_eq!(fake.ledger().reports.len(), reports);
    // Meanwhile the leases service let the lease expire.
    fake.change("l-1", None, |l| l.phase = LeasePhase::Expired as i32);
    fake.ledger().custody_of_expired = true;

    runner.session.send_replace(session(2));
    runner.standing_until(Standing::Serving).await;
    assert!(alive(pid));
    let lease = fake.lease("l-1");
    assert_eq!((lease.phase(), lease.epoch, lease.reason.as_str()), (LeasePhase::Running, 2, "CustodyAssumed"));
    assert_eq!(runner.board.get("l-1").unwrap().pid, Some(pid));
    runner.kill().await;
    destroy_left_behind(dir.path(), "l-1").await;
}

#[tokio::test]
async fn compute_held_in_custody_past_the_bound_is_destroyed() {
    let settings = RunnerSettings { max_custody: Some(Duration::from_millis(300)), ..settings() };
    let (_dir, fake, runner) = serving_runner(settings).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;

    let fenced_at = Instant::now();
    runner.fence(FenceReason::Fenced);
    gone_until(pid).await;
    assert!(fenced_at.elapsed() >= Duration::from_millis(300), "destroyed before the bound");
    let view = runner.view_until("l-1", "settled", |v| v.ended_at.is_some()).await;
    assert_eq!(view.reason, "CustodyExpired");
    runner.holding_until(0).await;
    runner.kill().await;
}

#[tokio::test]
async fn what_a_node_holds_in_custody_is_counted_with_its_age_until_confirmed() {
    let quick = RunnerSettings { custody_warning: Duration::from_millis(50), ..settings() };
    let (_dir, fake, runner) = serving_runner(quick).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;
    assert_eq!(runner.board.custody(), Custody::default(), "serving: nothing in custody");

    let fenced_at = SystemTime::now();
    runner.fence(FenceReason::Fenced);
    runner.standing_until(Standing::Custody).await;
    eventually("custody to be counted", PATIENCE, || async {
        let custody = runner.board.custody();
        if custody.held == 1 { Ok(()) } else { Err(custody) }
    })
    .await;
    let since = runner.board.custody().since.expect("since when");
    assert!(since <= SystemTime::now() && since + Duration::from_secs(1) >= fenced_at, "{since:?}");
    // Past the warning age the runner keeps running it (and warns each sweep).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(alive(pid));

    // Rejoined and confirmed: nothing in custody any more.
    runner.session.send_replace(session(2));
    runner.standing_until(Standing::Serving).await;
    eventually("custody to end", PATIENCE, || async {
        let custody = runner.board.custody();
        if custody == Custody::default() { Ok(()) } else { Err(custody) }
    })
    .await;
    runner.kill().await;
}

#[tokio::test]
async fn a_node_that_can_never_rejoin_destroys_its_custody_after_the_stop_grace() {
    let (_dir, fake, runner) = serving_runner(with_stop_grace(Duration::from_millis(300))).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;

    // Fenced, it may still rejoin: custody keeps the work, with no bound set.
    runner.fence(FenceReason::Forgotten);
    runner.standing_until(Standing::Custody).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(alive(pid), "a node that may rejoin keeps its custody");

    // Its rejoin refused, it never can: the custody goes after the grace.
    let refused_at = Instant::now();
    runner.fence(FenceReason::RejoinRefused);
    gone_until(pid).await;
    assert!(refused_at.elapsed() >= Duration::from_millis(300), "destroyed before the stop grace");
    runner.holding_until(0).await;
    let view = runner.view_until("l-1", "destroyed", |v| v.ended_at.is_some()).await;
    assert_eq!(view.reason, "RejoinRefused");
    runner.kill().await;
}

#[tokio::test]
async fn a_node_cut_off_from_leases_keeps_its_work_without_a_stop_bound() {
    let (dir, fake, runner) = serving_runner(settings()).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;

    fake.set_down(true);
    tokio::time::sleep(TTL * 2).await;
    assert!(alive(pid), "no bound: the work outlives an outage of two TTLs");
    fake.set_down(false);
    tokio::time::sleep(TTL).await;
    assert!(alive(pid));
    assert_eq!(runner.board.get("l-1").unwrap().pid, Some(pid));
    runner.kill().await;
    destroy_left_behind(dir.path(), "l-1").await;
}

/// A runner with `--stop-after-disconnect` `bound`, running one lease that
/// has been renewed at least once: the clock starts from a renewal.
async fn renewed_once_with_stop_bound(fake: &Arc<FakeLeases>, dir: &Path, bound: Duration) -> (Harness, u32, Duration) {
    let settings = RunnerSettings { stop_after_disconnect: Some(bound), ..settings() };
    let stop_grace = settings.timing.stop_grace;
    let runner = Harness::serving(fake, dir, settings).await;
    let pid = run_lease(fake, &runner, "l-1", "exec sleep 1000").await;
    let renewals = fake.renewals();
    eventually("the lease to be renewed", PATIENCE, || async {
        let now = fake.renewals();
        if now == renewals { Err(format!("still {now} renewals")) } else { Ok(()) }
    })
    .await;
    (runner, pid, stop_grace)
}

#[tokio::test]
async fn a_node_cut_off_from_leases_past_the_stop_bound_stops_its_work() {
    let (dir, fake) = fresh();
    let bound = Duration::from_millis(400);
    let (runner, pid, _) = renewed_once_with_stop_bound(&fake, dir.path(), bound).await;

    let down_at = Instant::now();
    fake.set_down(true);
    gone_until(pid).await;
    assert!(down_at.elapsed() >= bound - TTL / 3, "stopped before the bound: {:?}", down_at.elapsed());
    let view = runner.view_until("l-1", "settled", |v| v.ended_at.is_some()).await;
    assert_eq!(view.reason, "ControlPlaneLost");
    runner.holding_until(0).await;
    runner.kill().await;
}

#[tokio::test]
async fn a_node_whose_renewals_hang_stops_its_work_at_the_bound_not_when_tcp_gives_up() {
    let (dir, fake) = fresh();
    let bound = Duration::from_millis(400);
    let (runner, pid, stop_grace) = renewed_once_with_stop_bound(&fake, dir.path(), bound).await;

    cut_until_stopped(&fake, &runner, pid, bound, stop_grace).await;
    runner.kill().await;
}

/// Cuts the link (the open connection swallows every renewal unanswered)
/// and checks that the node stops `l-1` (`pid`) at the bound, not when TCP
/// gives up.
async fn cut_until_stopped(fake: &FakeLeases, runner: &Harness, pid: u32, bound: Duration, stop_grace: Duration) {
    let cut_at = Instant::now();
    fake.ledger().hang_renewals = true;
    gone_until(pid).await;
    // The bound, one renewal interval, the least answer time and the stop
    // grace, with room for a loaded machine; a hung call alone would never end.
    let within = bound + TTL / 3 + Duration::from_millis(500) + stop_grace + Duration::from_secs(2);
    assert!(cut_at.elapsed() < within, "stopped {:?} after the cut", cut_at.elapsed());
    let view = runner.view_until("l-1", "settled", |v| v.ended_at.is_some()).await;
    assert_eq!(view.reason, "ControlPlaneLost");
}

/// Cut off right after it started serving, before any regular renewal: the
/// clock runs from the renewal that went out as soon as it held a lease,
/// not from one a (long) guessed interval later.
#[tokio::test]
async fn a_node_cut_off_before_its_first_regular_renewal_stops_its_work_at_the_bound() {
    let (dir, fake) = fresh();
    let bound = Duration::from_millis(400);
    let mut settings = RunnerSettings { stop_after_disconnect: Some(bound), ..settings() };
    // The interval guessed until the service says its TTL: far past the bound.
    settings.timing.renew_interval = Duration::from_secs(60);
    let stop_grace = settings.timing.stop_grace;
    let runner = Harness::serving(&fake, dir.path(), settings).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;

    cut_until_stopped(&fake, &runner, pid, bound, stop_grace).await;
    assert!(fake.renewals() >= 1, "nothing was renewed before the cut");
    runner.kill().await;
}

/// A lease placed long after the node last held one starts a clock of its
/// own: a renewal that fails once does not stop it as though nothing had
/// been renewed since the last lease went.
#[tokio::test]
async fn a_lease_placed_after_an_idle_stretch_survives_one_failed_renewal() {
    let (dir, fake) = fresh();
    let bound = Duration::from_secs(1);
    let (runner, pid, _) = renewed_once_with_stop_bound(&fake, dir.path(), bound).await;
    fake.change("l-1", Some(EventKind::Removed), |l| l.phase = LeasePhase::Released as i32);
    gone_until(pid).await;
    runner.holding_until(0).await;
    // Holding nothing for longer than the bound.
    tokio::time::sleep(bound * 3 / 2).await;

    let pid = run_lease(&fake, &runner, "l-2", "exec sleep 1000").await;
    fake.set_down(true);
    tokio::time::sleep(Duration::from_millis(200)).await;
    fake.set_down(false);
    tokio::time::sleep(bound).await;
    assert!(alive(pid), "stopped for an outage of 200 ms: {:?}", runner.board.get("l-2"));
    assert_eq!(runner.board.get("l-2").unwrap().reason, "");
    runner.kill().await;
    destroy_left_behind(dir.path(), "l-2").await;
}

#[tokio::test]
async fn a_revoked_node_destroys_what_it_runs() {
    let (_dir, fake, runner) = serving_runner(settings()).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;
    runner.fence(FenceReason::Revoked);
    gone_until(pid).await;
    runner.holding_until(0).await;
    assert_eq!(runner.board.get("l-1").unwrap().reason, "NodeRevoked");
    runner.kill().await;
}

#[tokio::test]
async fn the_sweep_destroys_what_no_open_lease_covers() {
    let (_dir, fake, runner) = serving_runner(with_sweep_interval(Duration::from_millis(200))).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;
    // Neither the stream nor the renewals say: only the sweep can find out.
    fake.ledger().renew_blindly = true;
    fake.change("l-1", None, |l| l.epoch = 5);
    gone_until(pid).await;
    assert_eq!(runner.board.get("l-1").unwrap().reason, "NotCovered");
    runner.kill().await;
}

#[tokio::test]
async fn reports_wait_out_a_leases_outage() {
    let (_dir, fake, runner) = serving_runner(settings()).await;
    fake.place("l-1", "exec sleep 0.3");
    fake.phase_until("l-1", LeasePhase::Running).await;
    fake.set_down(true);
    runner.view_until("l-1", "exited", |v| v.exit.is_some()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(fake.lease("l-1").phase(), LeasePhase::Running);
    fake.set_down(false);
    let done = fake.phase_until("l-1", LeasePhase::Done).await;
    assert_eq!(done.exit_code, Some(0));
    runner.kill().await;
}

#[tokio::test]
async fn a_start_during_an_outage_recovers_once_leases_answers() {
    let (dir, fake) = fresh();
    fake.set_down(true);
    let runner = Harness::start(&fake, dir.path(), settings()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*runner.handle.standing.borrow(), Standing::Recovering);
    fake.set_down(false);
    runner.standing_until(Standing::Serving).await;
    assert_eq!(fake.ledger().streams_opened, 1);
    runner.kill().await;
}

#[tokio::test]
async fn a_sweep_that_was_under_way_when_the_session_ended_does_not_end_custody() {
    let (dir, fake, runner) = serving_runner(with_sweep_interval(Duration::from_millis(100))).await;
    let pid = run_lease(&fake, &runner, "l-1", "exec sleep 1000").await;

    // A sweep is held at the service while the session ends and a new one begins.
    let gate = Arc::new(Semaphore::new(0));
    *fake.reconcile_gate.lock().unwrap() = Some(gate.clone());
    let arrived = fake.reconciles_arrived.load(Ordering::SeqCst);
    eventually("a sweep to come", PATIENCE, || async {
        let now = fake.reconciles_arrived.load(Ordering::SeqCst);
        if now == arrived { Err(format!("still {now} reconciles arrived")) } else { Ok(()) }
    })
    .await;
    runner.fence(FenceReason::Fenced);
    runner.standing_until(Standing::Custody).await;
    runner.session.send_replace(session(2));
    runner.standing_until(Standing::Recovering).await;
    *fake.reconcile_gate.lock().unwrap() = None;
    gate.add_permits(100);

    runner.standing_until(Standing::Serving).await;
    let custody: Vec<String> = fake.ledger().custody.iter().map(|c| c.lease_id.clone()).collect();
    assert_eq!(custody, vec!["l-1".to_string()], "serving again before the workload was taken into custody");
    assert_eq!(runner.board.get("l-1").unwrap().epoch, 2);
    assert!(alive(pid));
    runner.kill().await;
    destroy_left_behind(dir.path(), "l-1").await;
}

#[test]
fn a_lease_needing_a_runtime_this_node_lacks_is_refused_naming_both() {
    let runc = Runtime { name: "runc".into(), contained: true };
    let runsc = Runtime { name: "runsc".into(), contained: true };
    let process = Runtime { name: "process".into(), contained: false };
    let sandboxed = RuntimeClass::Sandboxed as i32;
    let contained = RuntimeClass::Contained as i32;
    assert_eq!(runtime_refusal(sandboxed, &runsc), None);
    assert_eq!(runtime_refusal(contained, &runc), None);
    assert_eq!(runtime_refusal(RuntimeClass::Unspecified as i32, &process), None);
    let refused = runtime_refusal(sandboxed, &runc).unwrap();
    assert!(refused.contains("gVisor (runsc)") && refused.contains("with runc"), "{refused}");
    let refused = runtime_refusal(contained, &process).unwrap();
    assert!(refused.contains("process (uncontained)"), "{refused}");
    assert!(runtime_refusal(9, &runsc).unwrap().contains("runtime class 9"));
}

#[tokio::test]
async fn a_pending_resize_is_applied_to_the_running_workload_once_per_ask_without_a_restart() {
    let (_dir, fake, runner) = serving_runner(settings()).await;
    let capacity = |cpu_millis, memory_bytes| Some(berth_proto::types::v1::Capacity { cpu_millis, memory_bytes });
    let pid = run_lease(&fake, &runner, "l-1", "sleep 600").await;

    let resize = |lease: &mut Lease| {
        lease.resize = Some(berth_proto::leases::v1::LeaseResize {
            resources: capacity(2000, 1 << 30),
            state: ResizeState::Pending as i32,
            ..Default::default()
        });
    };
    fake.change("l-1", Some(EventKind::Upsert), resize);
    let reported = eventually("the resize to be reported", PATIENCE, || async {
        let resizes = fake.ledger().resizes.clone();
        if resizes.is_empty() { Err("no report yet") } else { Ok(resizes) }
    })
    .await;
    assert_eq!(reported[0].state(), ResizeState::Applied, "an uncontained workload has no limits to wait on");
    assert_eq!((reported[0].resources, reported[0].epoch), (capacity(2000, 1 << 30), 1));
    assert_eq!(fake.lease("l-1").resources, capacity(2000, 1 << 30));

    // The stream sending the lease again, its resize applied, asks for
    // nothing more; the workload never restarted.
    fake.change("l-1", Some(EventKind::Upsert), |_| {});
    tokio::time::sleep(Duration::from_millis(300)).await;
    let resizes = fake.ledger().resizes.clone();
    assert_eq!(resizes.len(), 1, "{resizes:?}");

    // The same size asked for again (as after a deferral) is applied again.
    fake.change("l-1", Some(EventKind::Upsert), |lease| {
        lease.resources = None;
        resize(lease);
    });
    eventually("the resize asked again to be reported", PATIENCE, || async {
        let count = fake.ledger().resizes.len();
        if count == 2 { Ok(()) } else { Err(count) }
    })
    .await;
    assert_eq!(runner.pid_of("l-1").await, pid);
    assert!(alive(pid));
    assert_eq!(fake.reported("l-1"), vec![LeasePhase::Launching, LeasePhase::Running]);
    runner.kill().await;
}
