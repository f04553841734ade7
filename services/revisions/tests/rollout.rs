//! Rollout, rollback and pinning as a user sees them, with a real leases
//! service whose lease phases are driven by node agents through
//! `NodeLeases/ReportPhase` with their own certificates.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::{Lease, LeasePhase, ResizeState};
use berth_proto::revisions::v1;
use berth_proto::types::v1::{Capacity, ConditionStatus, EventKind};
use berth_revisions::{LeaseCallError, LeaseClient, LeaseEvents, READY, ROLLOUT_COMPLETE, RevisionsConfig};
use berth_testkit::{PATIENCE, eventually};
use support::{Backend, Plane, WrapLeases, apply_request, condition, fast_config, pinned_reference};
use tonic::Code;

fn ms(ts: Option<prost_types::Timestamp>) -> i64 {
    let ts = ts.unwrap();
    ts.seconds * 1000 + i64::from(ts.nanos) / 1_000_000
}

/// Reports `lease`'s workload as exited with an error, as its node would.
async fn crash(plane: &Plane, lease: &Lease) {
    let request = leases::ReportPhaseRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: lease.epoch,
        phase: LeasePhase::Failed as i32,
        reason: "Exited".into(),
        ..Default::default()
    };
    plane.node(&lease.node_id).report_phase(request).await.unwrap();
}

fn web(env: &str) -> v1::ApplyServiceRequest {
    apply_request("web", &pinned_reference(), 2, &[("VERSION", env)])
}

/// Every lease revisions asked for `revision`, final ones included.
async fn all_leases(plane: &Plane, revision: &str) -> Vec<Lease> {
    plane.leases().await.into_iter().filter(|l| l.workload.as_ref().is_some_and(|w| w.revision == revision)).collect()
}

async fn set_traffic(plane: &Plane, pinned: &str) -> v1::Service {
    let request = v1::SetTrafficRequest { name: "web".into(), pinned_revision: pinned.into(), ..Default::default() };
    plane.services().set_traffic(request).await.unwrap().into_inner().service.unwrap()
}

async fn a_new_revision_takes_over_only_once_all_its_replicas_run(backend: Backend) {
    let plane = Plane::start(backend, fast_config(), &["n-1", "n-2", "n-3"]).await;
    plane.apply(web("1")).await;
    let first = plane.run("web-00001", 2).await;
    assert_ne!(first[0].node_id, first[1].node_id, "replicas of one service spread apart");
    plane.await_live("web", "web-00001").await;

    assert!(plane.apply(web("2")).await.revision_created);
    plane.await_open_leases("web-00002", 2).await;
    let service = plane
        .await_service("web", "rolling out", |s| {
            condition(s, ROLLOUT_COMPLETE).is_some_and(|c| c.reason == "RollingOut")
        })
        .await;
    assert_eq!(service.status.unwrap().live_revision, "web-00001");

    // One new replica runs: the old ones all stay.
    let pending = plane.open_leases("web-00002").await;
    let one = &pending[0];
    let request = berth_proto::leases::v1::ReportPhaseRequest {
        node_id: one.node_id.clone(),
        lease_id: one.lease_id.clone(),
        epoch: one.epoch,
        phase: LeasePhase::Running as i32,
        ..Default::default()
    };
    plane.node(&one.node_id).report_phase(request).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let old = plane.open_leases("web-00001").await;
    assert_eq!(old.iter().filter(|l| l.phase() == LeasePhase::Running).count(), 2, "{old:#?}");
    assert_eq!(plane.get("web").await.status.unwrap().live_revision, "web-00001");

    // Both run: the new revision is live, then the old leases are released.
    plane.report_all("web-00002", LeasePhase::Running).await;
    let service = plane.await_live("web", "web-00002").await;
    let status = service.status.clone().unwrap();
    assert_eq!((status.replicas_running, status.replicas_desired), (2, 2));
    assert_eq!(status.latest_ready_revision, "web-00002");
    assert_eq!(condition(&service, ROLLOUT_COMPLETE).unwrap().status(), ConditionStatus::True);
    plane.await_open_leases("web-00001", 0).await;

    // No moment with fewer than two replicas running: every old lease was
    // released after the last new one reported RUNNING.
    let new_running_at = all_leases(&plane, "web-00002").await.iter().map(|l| ms(l.phase_changed_at)).max().unwrap();
    for old in all_leases(&plane, "web-00001").await {
        assert_eq!(old.phase(), LeasePhase::Released);
        assert_eq!(old.reason, "Superseded");
        assert!(ms(old.phase_changed_at) >= new_running_at, "{old:#?} released before the new replicas ran");
    }

    // Pin the old revision: it is rolled out again and becomes live.
    let pinned = set_traffic(&plane, "web-00001").await;
    assert_eq!(pinned.pinned_revision, "web-00001");
    plane.run("web-00001", 2).await;
    let service = plane.await_live("web", "web-00001").await;
    assert_eq!(service.pinned_revision, "web-00001");
    assert_eq!(service.status.unwrap().latest_created_revision, "web-00002");
    plane.await_open_leases("web-00002", 0).await;

    // Unpinned, traffic follows the newest revision again.
    set_traffic(&plane, "").await;
    plane.run("web-00002", 2).await;
    plane.await_live("web", "web-00002").await;
    plane.await_open_leases("web-00001", 0).await;
    plane.cleanup().await;
}

fn sized(memory_mib: u64) -> v1::ApplyServiceRequest {
    let mut request = web("1");
    request.template.as_mut().unwrap().resources = Some(mib(memory_mib));
    request
}

fn mib(memory_mib: u64) -> Capacity {
    Capacity { cpu_millis: 100, memory_bytes: memory_mib << 20 }
}

/// Waits until every open lease of `revision` has a resize to `memory_mib` pending.
async fn await_resizes(plane: &Plane, revision: &str, memory_mib: u64) -> Vec<Lease> {
    eventually(&format!("{revision}'s replicas to be asked to take {memory_mib} MiB"), PATIENCE, || async {
        let open = plane.open_leases(revision).await;
        let asked = |l: &Lease| {
            l.resize.as_ref().is_some_and(|r| r.state() == ResizeState::Pending && r.resources == Some(mib(memory_mib)))
        };
        if open.len() == 2 && open.iter().all(asked) { Ok(open) } else { Err(open) }
    })
    .await
}

/// Reports each lease's pending resize as its node would: applied, or
/// deferred with `reason`.
async fn report_resizes(plane: &Plane, leases: &[Lease], state: ResizeState, reason: &str) {
    for lease in leases {
        let request = leases::ReportResizeRequest {
            node_id: lease.node_id.clone(),
            lease_id: lease.lease_id.clone(),
            epoch: lease.epoch,
            resources: lease.resize.as_ref().unwrap().resources,
            state: state as i32,
            reason: reason.into(),
            message: String::new(),
        };
        plane.node(&lease.node_id).report_resize(request).await.unwrap();
    }
}

fn ids(leases: &[Lease]) -> Vec<String> {
    let mut ids: Vec<String> = leases.iter().map(|l| l.lease_id.clone()).collect();
    ids.sort();
    ids
}

async fn a_change_of_resources_alone_resizes_the_replicas_in_place_instead_of_replacing_them(backend: Backend) {
    let plane = Plane::start(backend, fast_config(), &["n-1", "n-2", "n-3"]).await;
    plane.apply(sized(64)).await;
    let first = ids(&plane.run("web-00001", 2).await);
    plane.await_live("web", "web-00001").await;

    // More memory: both replicas are asked to grow, and no new one is asked for.
    assert!(plane.apply(sized(96)).await.revision_created);
    let growing = await_resizes(&plane, "web-00001", 96).await;
    assert!(all_leases(&plane, "web-00002").await.is_empty());
    assert_eq!(plane.get("web").await.status.unwrap().live_revision, "web-00001");

    // Their nodes apply it: web-00002 is live on the same two leases.
    report_resizes(&plane, &growing, ResizeState::Applied, "").await;
    let service = plane.await_live("web", "web-00002").await;
    let status = service.status.unwrap();
    assert_eq!((status.replicas_running, status.replicas_desired), (2, 2));
    let mut adopted: Vec<(String, String)> = status.adopted_replicas.into_iter().collect();
    adopted.sort();
    assert_eq!(adopted, first.iter().map(|id| (id.clone(), "web-00002".to_owned())).collect::<Vec<_>>());
    eventually("web-00002 to count the two replicas it took over", PATIENCE, || async {
        let revision = plane.revision("web-00002").await;
        if revision.replicas_running == 2 { Ok(()) } else { Err(revision) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let open = plane.open_leases("web-00001").await;
    assert_eq!(ids(&open), first, "the same replicas serve, none given back");
    assert!(open.iter().all(|l| l.phase() == LeasePhase::Running && l.resources == Some(mib(96))), "{open:#?}");
    assert!(all_leases(&plane, "web-00002").await.is_empty(), "no replica was started for web-00002");

    // A shrink the nodes cannot make now: web-00003 rolls out new replicas
    // instead, and the ones taken over are given back once those run.
    assert!(plane.apply(sized(32)).await.revision_created);
    let shrinking = await_resizes(&plane, "web-00001", 32).await;
    report_resizes(&plane, &shrinking, ResizeState::Deferred, "MemoryInUse").await;
    plane.run("web-00003", 2).await;
    plane.await_live("web", "web-00003").await;
    plane.await_open_leases("web-00001", 0).await;
    for lease in all_leases(&plane, "web-00001").await {
        assert_eq!((lease.phase(), lease.reason.as_str()), (LeasePhase::Released, "Superseded"), "{lease:#?}");
    }
    let settled = plane
        .await_service("web", "the record of the replicas taken over to go with them", |s| {
            s.status.as_ref().is_some_and(|status| status.adopted_replicas.is_empty())
        })
        .await;
    assert_eq!(settled.status.unwrap().replicas_running, 2);
    plane.cleanup().await;
}

async fn a_revision_whose_replicas_fail_is_rolled_back(backend: Backend) {
    let config = berth_revisions::RevisionsConfig { progress_deadline: Duration::from_secs(2), ..fast_config() };
    let plane = Plane::start(backend, config, &["n-1", "n-2"]).await;
    plane.apply(web("1")).await;
    plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;

    // The new revision's replicas fail to start.
    plane.apply(web("2")).await;
    plane.await_open_leases("web-00002", 2).await;
    plane.report_all("web-00002", LeasePhase::Failed).await;
    let service = plane
        .await_service("web", "rolled back", |s| {
            condition(s, ROLLOUT_COMPLETE).is_some_and(|c| c.reason == "RevisionFailed")
        })
        .await;
    let status = service.status.clone().unwrap();
    assert_eq!(status.live_revision, "web-00001");
    assert_eq!(status.latest_created_revision, "web-00002");
    assert_eq!(status.latest_ready_revision, "web-00001");
    assert_eq!(condition(&service, READY).unwrap().status(), ConditionStatus::True);
    let failed = plane.revision("web-00002").await;
    let ready = failed.conditions.iter().find(|c| c.r#type == READY).unwrap();
    assert_eq!((ready.status(), ready.reason.as_str()), (ConditionStatus::False, "ReplicaFailed"));
    assert!(ready.message.contains("exited with status 3"), "{}", ready.message);
    plane.await_open_leases("web-00002", 0).await;
    for lease in all_leases(&plane, "web-00002").await {
        assert_eq!(lease.phase(), LeasePhase::Failed, "{lease:#?}");
    }
    // Later passes keep saying so while the newest revision is the failed one.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let service = plane.get("web").await;
    assert_eq!(condition(&service, ROLLOUT_COMPLETE).unwrap().reason, "RevisionFailed");
    assert_eq!(condition(&service, READY).unwrap().status(), ConditionStatus::True);
    let old = plane.open_leases("web-00001").await;
    assert_eq!(old.iter().filter(|l| l.phase() == LeasePhase::Running).count(), 2);

    // A revision whose replicas never run is failed at the progress deadline.
    plane.apply(web("3")).await;
    plane.await_open_leases("web-00003", 2).await;
    let ready = eventually("web-00003 to pass its progress deadline", PATIENCE, || async {
        let late = plane.revision("web-00003").await;
        let ready = late.conditions.iter().find(|c| c.r#type == READY).unwrap().clone();
        if ready.reason == "ProgressDeadlineExceeded" { Ok(ready) } else { Err(ready) }
    })
    .await;
    assert_eq!(ready.status(), ConditionStatus::False);
    let service = plane
        .await_service("web", "rolled back again", |s| {
            condition(s, ROLLOUT_COMPLETE)
                .is_some_and(|c| c.reason == "RevisionFailed" && c.message.contains("revision web-00003 failed"))
        })
        .await;
    assert_eq!(service.status.unwrap().live_revision, "web-00001");
    plane.await_open_leases("web-00003", 0).await;
    assert_eq!(plane.open_leases("web-00001").await.len(), 2);

    // Pinning the failed revision tries it again.
    set_traffic(&plane, "web-00003").await;
    plane.run("web-00003", 2).await;
    plane.await_live("web", "web-00003").await;
    plane.cleanup().await;
}

async fn a_replica_whose_lease_ends_is_replaced(backend: Backend) {
    let plane = Plane::start(backend, fast_config(), &["n-1", "n-2"]).await;
    plane.apply(web("1")).await;
    let leases = plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;

    // A running replica crashes: its slot gets a new lease, on a new key.
    let crashed = &leases[0];
    crash(&plane, crashed).await;
    plane
        .await_service("web", "short a replica", |s| {
            condition(s, READY).is_some_and(|c| c.status() == ConditionStatus::False)
        })
        .await;
    let open = plane.await_open_leases("web-00001", 2).await;
    let replacement = open.iter().find(|l| l.lease_id != leases[1].lease_id).unwrap();
    assert_ne!(replacement.lease_id, crashed.lease_id);
    assert_ne!(replacement.idempotency_key, crashed.idempotency_key);
    plane.report_all("web-00001", LeasePhase::Running).await;
    plane.await_live("web", "web-00001").await;
    assert_eq!(plane.revision_names("web").await, ["web-00001"], "a replacement mints nothing");
    plane.cleanup().await;
}

async fn a_replica_on_a_draining_node_is_replaced_elsewhere_before_it_is_given_back(backend: Backend) {
    let plane = Plane::start(backend, fast_config(), &["n-1", "n-2", "n-3"]).await;
    plane.apply(web("1")).await;
    let leases = plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;
    let (moving, staying) = (&leases[0], &leases[1]);

    plane.set_node_state(&moving.node_id, berth_proto::identity::v1::NodeState::Draining);
    // Its replacement is placed on another node while it still runs.
    let open = plane.await_open_leases("web-00001", 3).await;
    let replacement = open.iter().find(|l| l.lease_id != moving.lease_id && l.lease_id != staying.lease_id).unwrap();
    assert_ne!(replacement.node_id, moving.node_id, "placement avoids the draining node");
    let old = open.iter().find(|l| l.lease_id == moving.lease_id).unwrap();
    assert_eq!((old.phase(), old.reason.as_str()), (LeasePhase::Running, "NodeDraining"), "make before break");
    let service = plane.get("web").await;
    assert_eq!(condition(&service, READY).unwrap().status(), ConditionStatus::True, "it serves throughout");

    // Once the replacement runs, the old replica is given back.
    plane.report_all("web-00001", LeasePhase::Running).await;
    let released = eventually("the drained replica to be given back", PATIENCE, || async {
        let all = all_leases(&plane, "web-00001").await;
        let old = all.into_iter().find(|l| l.lease_id == moving.lease_id).unwrap();
        if old.phase() == LeasePhase::Released { Ok(old) } else { Err(old) }
    })
    .await;
    assert_eq!(released.reason, "Superseded");
    let open = plane.await_open_leases("web-00001", 2).await;
    assert!(open.iter().all(|l| l.node_id != moving.node_id), "the draining node is empty: {open:?}");
    plane.await_live("web", "web-00001").await;
    assert_eq!(plane.revision_names("web").await, ["web-00001"], "moving a replica mints nothing");
    plane.cleanup().await;
}

/// The faults a test arms in the leases its revisions replicas reach, and
/// what the watches through them did.
#[derive(Debug, Default)]
struct Faults {
    /// The next listing of `web`'s leases never answers: a call on a
    /// connection cut without a reset.
    hang_web_list: AtomicBool,
    /// The watch stream ends at its next event, dropping that event.
    cut_watch: AtomicBool,
    /// The cursor each watch resumed from, in order.
    resumed_from: std::sync::Mutex<Vec<u64>>,
    /// Every `SYNCED` a watch passed on.
    synced: std::sync::Mutex<Vec<leases::LeaseEvent>>,
}

impl Faults {
    /// Each replica's leases through these faults.
    fn wrapping(self: &Arc<Self>) -> WrapLeases {
        let faults = self.clone();
        Arc::new(move |inner| Arc::new(Faulty { inner, faults: faults.clone() }))
    }
}

/// Leases with [`Faults`] in the way.
#[derive(Debug)]
struct Faulty {
    inner: Arc<dyn LeaseClient>,
    faults: Arc<Faults>,
}

#[tonic::async_trait]
impl LeaseClient for Faulty {
    async fn request(&self, request: leases::RequestLeaseRequest) -> Result<Lease, LeaseCallError> {
        self.inner.request(request).await
    }

    async fn list(&self, project: &str, owner: &str) -> Result<Vec<Lease>, LeaseCallError> {
        if owner.starts_with("revisions/web@") && self.faults.hang_web_list.swap(false, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.list(project, owner).await
    }

    async fn get(&self, lease_id: &str) -> Result<Option<Lease>, LeaseCallError> {
        self.inner.get(lease_id).await
    }

    async fn release(&self, lease_id: &str, reason: &str) -> Result<(), LeaseCallError> {
        self.inner.release(lease_id, reason).await
    }

    async fn resize(
        &self,
        lease_id: &str,
        epoch: u64,
        resources: berth_proto::types::v1::Capacity,
    ) -> Result<Lease, LeaseCallError> {
        self.inner.resize(lease_id, epoch, resources).await
    }

    async fn watch(&self, owner_prefix: &str, resume_cursor: u64) -> Result<LeaseEvents, LeaseCallError> {
        use tokio_stream::StreamExt as _;
        self.faults.resumed_from.lock().unwrap().push(resume_cursor);
        let (cut, seen) = (self.faults.clone(), self.faults.clone());
        let events = self.inner.watch(owner_prefix, resume_cursor).await?;
        Ok(Box::pin(events.take_while(move |_| !cut.cut_watch.swap(false, Ordering::SeqCst)).map(move |event| {
            if let Ok(event) = &event
                && event.kind() == EventKind::Synced
            {
                seen.synced.lock().unwrap().push(event.clone());
            }
            event
        })))
    }
}

/// Polls far slower than any wait below: what the controller sees in time,
/// it saw through `WatchLeases`.
fn polls_hourly() -> RevisionsConfig {
    let hour = Duration::from_secs(3600);
    RevisionsConfig {
        rollout_poll: hour,
        steady_resync: hour,
        full_resync: hour,
        progress_deadline: hour * 24,
        reconcile_timeout: hour,
        ..fast_config()
    }
}

async fn a_replica_that_runs_or_ends_moves_the_status_at_once_not_at_the_next_poll(backend: Backend) {
    let plane = Plane::start(backend, polls_hourly(), &["n-1", "n-2"]).await;
    plane.apply(web("1")).await;
    let leases = plane.run("web-00001", 2).await;
    let service = plane.await_live("web", "web-00001").await;
    assert_eq!(service.status.unwrap().replicas_running, 2);

    // A replica crashes: the service says so, and its slot is asked for again.
    let crashed = &leases[0];
    crash(&plane, crashed).await;
    plane
        .await_service("web", "short a replica", |s| {
            s.status.as_ref().is_some_and(|status| status.replicas_running == 1)
        })
        .await;
    let open = plane.await_open_leases("web-00001", 2).await;
    assert!(open.iter().all(|l| l.lease_id != crashed.lease_id));
    plane.report_all("web-00001", LeasePhase::Running).await;
    plane
        .await_service("web", "whole again", |s| s.status.as_ref().is_some_and(|status| status.replicas_running == 2))
        .await;
    plane.cleanup().await;
}

async fn a_reconcile_whose_call_to_leases_hangs_is_stopped_and_tried_again(backend: Backend) {
    let faults = Arc::new(Faults::default());
    let config = RevisionsConfig { reconcile_timeout: Duration::from_millis(500), ..fast_config() };
    let plane = Plane::start_wrapping_leases(backend, config, &["n-1", "n-2"], faults.wrapping()).await;
    plane.apply(web("1")).await;
    let leases = plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;

    // A replica crashes, and the reconcile that lists web's leases to fill
    // its slot hangs on that call. (A steady service is reconciled from the
    // lease view and asks leases nothing.) The slot is still replaced and
    // the status follows, once the hung reconcile is stopped.
    faults.hang_web_list.store(true, Ordering::SeqCst);
    let crashed = &leases[0];
    crash(&plane, crashed).await;
    eventually("web's leases to be listed, and that call to hang", PATIENCE, || async {
        if faults.hang_web_list.load(Ordering::SeqCst) { Err("not yet") } else { Ok(()) }
    })
    .await;
    let open = plane.await_open_leases("web-00001", 2).await;
    assert!(open.iter().all(|l| l.lease_id != crashed.lease_id));
    plane.report_all("web-00001", LeasePhase::Running).await;
    let service = plane
        .await_service("web", "both replicas running again", |s| {
            s.status.as_ref().is_some_and(|status| status.replicas_running == 2)
                && condition(s, READY).is_some_and(|c| c.status() == ConditionStatus::True)
        })
        .await;
    assert_eq!(service.status.unwrap().replicas_desired, 2);
    plane.cleanup().await;
}

async fn a_broken_lease_watch_resumes_from_its_cursor_and_loses_no_change(backend: Backend) {
    let faults = Arc::new(Faults::default());
    let plane = Plane::start_wrapping_leases(backend, polls_hourly(), &["n-1", "n-2"], faults.wrapping()).await;
    plane.apply(web("1")).await;
    let leases = plane.run("web-00001", 2).await;
    plane
        .await_service("web", "both running", |s| s.status.as_ref().is_some_and(|status| status.replicas_running == 2))
        .await;

    // The stream breaks taking the crash's event with it; the follower
    // resumes from its cursor, and the crash still reaches the status long
    // before any poll would.
    faults.cut_watch.store(true, Ordering::SeqCst);
    crash(&plane, &leases[0]).await;
    plane
        .await_service("web", "short a replica", |s| {
            s.status.as_ref().is_some_and(|status| status.replicas_running == 1)
        })
        .await;
    assert!(!faults.cut_watch.load(Ordering::SeqCst), "the stream was cut");
    // The status may move first (a pass may list the leases itself); the
    // follower's new stream comes after its backoff.
    let cursors = eventually("the follower opens a new stream", PATIENCE, || async {
        let cursors = faults.resumed_from.lock().unwrap().clone();
        let synced = faults.synced.lock().unwrap().len();
        if cursors.len() >= 2 && synced >= 2 { Ok(cursors) } else { Err((cursors, synced)) }
    })
    .await;
    assert_eq!(cursors.first(), Some(&0), "the first stream starts afresh: {cursors:?}");
    assert!(cursors.iter().skip(1).any(|&cursor| cursor > 0), "a later one resumes: {cursors:?}");
    let synced = faults.synced.lock().unwrap().clone();
    assert!(synced.iter().any(|event| event.resumed), "leases resumed it: {synced:?}");
    plane.cleanup().await;
}

async fn deleting_a_service_releases_its_leases_and_watchers_see_it(backend: Backend) {
    let plane = Plane::start(backend, fast_config(), &["n-1", "n-2"]).await;
    let mut watch = plane
        .services()
        .watch_services(v1::WatchServicesRequest { project: String::new(), all_projects: false })
        .await
        .unwrap()
        .into_inner();
    let synced = tokio::time::timeout(PATIENCE, watch.message()).await.unwrap().unwrap().unwrap();
    assert_eq!(synced.kind(), EventKind::Synced);

    plane.apply(web("1")).await;
    plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;
    // The watcher saw the service appear and go live.
    loop {
        let event = tokio::time::timeout(PATIENCE, watch.message()).await.unwrap().unwrap().unwrap();
        assert_eq!(event.kind(), EventKind::Upsert);
        if event.service.unwrap().status.unwrap().live_revision == "web-00001" {
            break;
        }
    }

    let delete = v1::DeleteServiceRequest { project: String::new(), name: "web".into() };
    plane.services().delete_service(delete.clone()).await.unwrap();
    plane.await_open_leases("web-00001", 0).await;
    for lease in all_leases(&plane, "web-00001").await {
        assert_eq!((lease.phase(), lease.reason.as_str()), (LeasePhase::Released, "ServiceDeleted"));
    }
    let gone = plane.services().get_service(v1::GetServiceRequest { name: "web".into(), ..Default::default() }).await;
    assert_eq!(gone.unwrap_err().code(), Code::NotFound);
    assert_eq!(plane.services().delete_service(delete).await.unwrap_err().code(), Code::NotFound);
    loop {
        let event = tokio::time::timeout(PATIENCE, watch.message()).await.unwrap().unwrap().unwrap();
        if event.kind() == EventKind::Removed {
            assert_eq!(event.service.unwrap().name, "web");
            break;
        }
    }

    // The name is free again; the new incarnation's leases are its own.
    let again = plane.apply(web("1")).await;
    assert_eq!(again.revision, "web-00001");
    plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;
    assert_eq!(plane.open_leases("web-00001").await.len(), 2);
    plane.cleanup().await;
}

/// Makes web-00001 live with its two replicas running, then rolls out web-00002 the same way.
async fn roll_to_second(plane: &Plane) {
    for (edition, revision) in [("1", "web-00001"), ("2", "web-00002")] {
        plane.apply(web(edition)).await;
        plane.run(revision, 2).await;
        plane.await_live("web", revision).await;
    }
}

fn share(revision: &str, percent: u32, tag: &str) -> v1::TrafficTarget {
    v1::TrafficTarget { revision: revision.into(), latest: false, percent, tag: tag.into() }
}

async fn split(plane: &Plane, targets: Vec<v1::TrafficTarget>) -> Result<v1::Service, tonic::Status> {
    let request = v1::SetTrafficRequest { name: "web".into(), targets, ..Default::default() };
    plane.services().set_traffic(request).await.map(|response| response.into_inner().service.unwrap())
}

async fn a_traffic_split_keeps_every_revision_it_names_running_and_gives_them_back_when_unnamed(backend: Backend) {
    let plane = Plane::start(backend, fast_config(), &["n-1", "n-2", "n-3"]).await;
    roll_to_second(&plane).await;
    plane.await_open_leases("web-00001", 0).await;

    // 90/10 between the old and the new, the new one also tagged: the old
    // revision's replicas come back, and the new one stays live.
    let targets = vec![share("web-00001", 90, ""), share("web-00002", 10, "canary")];
    let service = split(&plane, targets.clone()).await.unwrap();
    assert_eq!(service.traffic, targets);
    assert_eq!(service.pinned_revision, "web-00001", "no latest target: pinned to the largest share");
    plane.run("web-00001", 2).await;
    let service = plane.await_live("web", "web-00001").await;
    assert_eq!(service.status.as_ref().unwrap().traffic, targets, "the split as routed names both revisions");
    assert_eq!(plane.open_leases("web-00002").await.len(), 2, "the tagged 10% keeps its replicas");

    // A latest target follows the rollout; every lease of a revision no
    // target names any more is given back.
    let latest = v1::TrafficTarget { latest: true, percent: 100, ..Default::default() };
    let service = split(&plane, vec![latest.clone()]).await.unwrap();
    assert_eq!(service.pinned_revision, "");
    let service = plane.await_live("web", "web-00002").await;
    assert_eq!(service.status.unwrap().traffic, [v1::TrafficTarget { revision: "web-00002".into(), ..latest }]);
    plane.await_open_leases("web-00001", 0).await;

    // What a caller gets wrong is named, and nothing changes.
    let status = split(&plane, vec![share("web-00001", 90, "")]).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("targets: the percents sum to 90, not 100"), "{status:?}");
    let status = split(&plane, vec![share("web-00009", 100, "")]).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    let both = v1::SetTrafficRequest {
        name: "web".into(),
        pinned_revision: "web-00001".into(),
        targets: vec![share("web-00001", 100, "")],
        ..Default::default()
    };
    let status = plane.services().set_traffic(both).await.unwrap_err();
    assert!(status.message().contains("either pinned_revision or targets"), "{status:?}");
    assert_eq!(plane.get("web").await.pinned_revision, "");

    // A session affinity is part of the routes: routers are told (a new
    // generation), the header name as routers match it, until a call
    // without one clears it.
    let before = route_generation(&plane.get("web").await);
    let latest = v1::TrafficTarget { latest: true, percent: 100, ..Default::default() };
    let sticky = |header: &str, cookie: &str| v1::SetTrafficRequest {
        name: "web".into(),
        targets: vec![latest.clone()],
        affinity: Some(v1::SessionAffinity { header: header.into(), cookie: cookie.into() }),
        ..Default::default()
    };
    let service = plane.services().set_traffic(sticky("X-User", "")).await.unwrap().into_inner().service.unwrap();
    let status = service.status.unwrap();
    assert_eq!(status.affinity, Some(v1::SessionAffinity { header: "x-user".into(), cookie: String::new() }));
    assert!(status.route_generation > before, "{} then {}", before, status.route_generation);
    let service = plane.services().set_traffic(sticky("x-user", "")).await.unwrap().into_inner().service.unwrap();
    assert_eq!(route_generation(&service), status.route_generation, "the same routes again change nothing");
    let status = plane.services().set_traffic(sticky("x-user", "session")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("affinity: give either a header or a cookie"), "{status:?}");
    assert!(plane.get("web").await.status.unwrap().affinity.is_some(), "a refused call changes nothing");
    let service = split(&plane, vec![latest]).await.unwrap();
    assert_eq!(service.status.unwrap().affinity, None, "a split without an affinity clears it");
    plane.cleanup().await;
}

/// Acknowledges generation `generation` of web's routes as router `name`
/// (generation 0: only says it is alive).
async fn ack(plane: &Plane, name: &str, generation: u64) {
    let acks = if generation == 0 {
        Vec::new()
    } else {
        vec![v1::RouteAck { project: String::new(), service: "web".into(), generation }]
    };
    let request = v1::AckRoutesRequest { acks, instance: "router-0".into() };
    plane.services_as_router(name).ack_routes(request).await.unwrap();
}

fn route_generation(service: &v1::Service) -> u64 {
    service.status.as_ref().unwrap().route_generation
}

async fn a_revision_traffic_left_keeps_its_replicas_until_every_router_moved_off_it(backend: Backend) {
    // A drain far longer than the test's patience: only the routers end it.
    let config = RevisionsConfig { drain: Duration::from_secs(600), ..fast_config() };
    let plane = Plane::start(backend, config, &["n-1", "n-2", "n-3"]).await;

    // No router alive: nothing routes to the old revision, it is given back.
    roll_to_second(&plane).await;
    plane.await_open_leases("web-00001", 0).await;

    // A router alive: dropped from a split, the revision keeps its replicas
    // until the router acknowledged the generation that dropped it.
    let both = || vec![share("web-00001", 60, ""), share("web-00002", 40, "")];
    split(&plane, both()).await.unwrap();
    plane.run("web-00001", 2).await;
    let before = route_generation(&plane.await_live("web", "web-00001").await);
    ack(&plane, "edge", before).await;
    let latest = v1::TrafficTarget { latest: true, percent: 100, ..Default::default() };
    split(&plane, vec![latest.clone()]).await.unwrap();
    let dropped = route_generation(&plane.await_live("web", "web-00002").await);
    assert!(dropped > before, "dropping a revision is a new route generation: {before} then {dropped}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ack(&plane, "edge", 0).await;
    assert_eq!(plane.open_leases("web-00001").await.len(), 2, "the router still sends to it");
    let routers = plane.get("web").await.status.unwrap().routers;
    assert_eq!(routers.len(), 1, "{routers:?}");
    assert_eq!((routers[0].router.as_str(), routers[0].instance.as_str()), ("edge", "router-0"));
    assert_eq!(routers[0].generation, before, "GetService shows what the router serves");
    ack(&plane, "edge", dropped).await;
    plane.await_open_leases("web-00001", 0).await;
    let routers = plane.get("web").await.status.unwrap().routers;
    assert_eq!(routers[0].generation, dropped);
    assert!(routers[0].acked_at.is_some());

    // A late acknowledgement of an older generation takes nothing back,
    // and what a router gets wrong is named.
    ack(&plane, "edge", before).await;
    let silent = std::time::Instant::now();
    assert_eq!(plane.get("web").await.status.unwrap().routers[0].generation, dropped);
    let bad = v1::AckRoutesRequest {
        acks: vec![v1::RouteAck { project: "Not A Project".into(), service: String::new(), generation: 1 }],
        instance: "router 0".into(),
    };
    let status = plane.services_as_router("edge").ack_routes(bad).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    for field in ["instance", "acks[0].project", "acks[0].service"] {
        assert!(status.message().contains(field), "{field} is named: {status:?}");
    }
    let status = plane.services().ack_routes(v1::AckRoutesRequest::default()).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "only routers acknowledge routes: {status:?}");

    // A router that stops calling stops holding a drain once it counts as
    // gone, 15s after its last call.
    split(&plane, both()).await.unwrap();
    plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;
    split(&plane, vec![latest]).await.unwrap();
    eventually("web-00001's replicas given back once the router is gone", Duration::from_secs(40), || async {
        let open = plane.open_leases("web-00001").await;
        if open.is_empty() { Ok(()) } else { Err(open.len()) }
    })
    .await;
    assert!(silent.elapsed() >= Duration::from_secs(14), "the router counted as alive until then");
    assert!(plane.get("web").await.status.unwrap().routers.is_empty(), "a gone router is not shown");
    plane.cleanup().await;
}

on_both_backends!(
    a_revision_traffic_left_keeps_its_replicas_until_every_router_moved_off_it,
    a_traffic_split_keeps_every_revision_it_names_running_and_gives_them_back_when_unnamed,
    a_new_revision_takes_over_only_once_all_its_replicas_run,
    a_change_of_resources_alone_resizes_the_replicas_in_place_instead_of_replacing_them,
    a_revision_whose_replicas_fail_is_rolled_back,
    a_replica_whose_lease_ends_is_replaced,
    a_replica_on_a_draining_node_is_replaced_elsewhere_before_it_is_given_back,
    a_reconcile_whose_call_to_leases_hangs_is_stopped_and_tried_again,
    a_replica_that_runs_or_ends_moves_the_status_at_once_not_at_the_next_poll,
    deleting_a_service_releases_its_leases_and_watchers_see_it,
    a_broken_lease_watch_resumes_from_its_cursor_and_loses_no_change,
);
