//! The deploy reconciler: for one service, reads the declaration, its
//! revisions and its leases, and moves them one step toward what was asked:
//! the newest revision resolved, `replicas` leases for the live revision,
//! the next revision rolled out beside it, then made live, and the rest
//! given back.
//!
//! # Expected flow
//! `reconcile(key, ctx)` is level-triggered: it decides from what it reads,
//! never from the event that woke it, so a missed wake-up is healed by the
//! next pass, and it returns when to look again ([`Action`]). Each step
//! observes (the catalog's snapshot, the service's leases), asks
//! [`crate::plan`]'s pure functions what to do, and acts; a step whose act
//! changes what the next one decides from (a revision resolved, made live
//! or failed) is followed by observing again. The controller
//! never runs two reconciles of one service at once. Every write it makes to
//! the catalog is fenced on the leadership term it runs under.
//!
//! # Rollout
//! The *target* is the pinned revision when traffic is pinned, else the
//! newest revision unless it failed, else the newest ready one. While the
//! target is not the live revision, its replicas are asked for beside the
//! live ones (surge), so the service never has fewer replicas running than
//! it had. When all of them run, the target becomes live and only then are
//! the previous live revision's leases released. A target whose lease
//! FAILED, or whose replicas did not all run within the progress deadline,
//! is marked failed and its leases released; the live revision keeps
//! serving (automatic rollback).
//!
//! # A change of resources alone
//! A target newer than the live revision that differs from it only in its
//! resources (same digest, same source, same template otherwise) rolls out
//! in place when every live replica runs ([`crate::plan::plan_in_place`]):
//! each live lease is asked to resize (`ResizeLease`, fenced by its epoch),
//! and once every node applied it the target goes live on those leases, in
//! one write with the service status's `adopted_replicas`, which names the
//! revision each serves as from then on (their keys and workload labels,
//! which leases never rewrites, keep the revision they were asked for). A
//! node that defers the resize, or has no room to grow it, sends the rollout
//! back to replacement; once the target holds a lease of its own, the
//! replacement goes on. Attempts for a slot are numbered above every key
//! its revision ever used, so a revision whose replicas another took over
//! never asks for one of those leases again.
//!
//! # Traffic splits and drain
//! Every revision a traffic split names keeps its replicas as the live one
//! does (see [`crate::traffic`]). A revision that stops taking traffic (the
//! rollout moved past it, a split dropped it) is recorded with the route
//! generation that left it out, and keeps its replicas until every live
//! router acknowledged that generation or a later one (see
//! [`crate::route_acks`]: a router acknowledges only once nothing it sent
//! there is still answering), or for `RevisionsConfig::drain` after that
//! moment, whichever comes first; then they are released, and stop with
//! their grace. An acknowledgement that moves a service on wakes its pass.
//!
//! # Leases
//! Replica `slot` of a revision is asked for with idempotency key
//! `<revision>/<uid>/<slot>/<attempt>`; the slot's current lease is its
//! highest attempt. A current lease that ended (expired, released, done, or
//! failed on the live revision) is replaced by asking for attempt + 1, so
//! asking again after a crash returns the same lease, never a second one.
//! A deposed leader's late requests are therefore harmless, and its writes
//! to the catalog are refused.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use berth_proto::artifact::ArtifactKind;
use berth_proto::leases::v1 as leases;
use berth_proto::types::v1::{BundleRef, ConditionStatus, Readiness};
use berth_runtime::Action;
use berth_store::Fence;

use crate::catalog::{Catalog, CatalogError, RolloutChange, StatusReport};
use crate::config::{RevisionsConfig, millis};
use crate::lease_view::LeaseView;
use crate::leases::{LeaseCallError, LeaseClient};
use crate::model::{Observed, READY, ServiceKey, SlotKey, lease_owner};
use crate::plan::{
    Drain, InPlace, Pass, Rollout, RolloutStep, Slots, Upkeep, adopted_after, collectable, decide_in_place,
    decide_rollout, group, is_draining, is_open, kept, open_ids, plan_in_place, plan_release, plan_upkeep,
    rollout_blocked, served_by_open, split_revisions, status_report, target,
};
use crate::records::{RevisionRow, RevisionState, ServiceRow};
use crate::resolver::{RegistryPolicy, TagResolver, resolve_template};
use crate::signals::Signals;

/// Why a reconcile stopped before it finished; it runs again later.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReconcileError {
    /// The catalog failed, or this replica was deposed.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The leases service could not be asked.
    #[error(transparent)]
    Leases(#[from] LeaseCallError),
    /// The reconcile took longer than it may, and was stopped.
    #[error("the reconcile took longer than {0:?} and was stopped")]
    TimedOut(Duration),
}

impl ReconcileError {
    /// Whether the leadership this reconcile ran under is gone.
    pub(crate) fn is_deposed(&self) -> bool {
        matches!(self, Self::Catalog(CatalogError::Deposed))
    }
}

/// What a reconcile works with.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    pub(crate) catalog: Catalog,
    pub(crate) leases: Arc<dyn LeaseClient>,
    pub(crate) lease_view: Arc<LeaseView>,
    pub(crate) resolver: Arc<dyn TagResolver>,
    pub(crate) policy: RegistryPolicy,
    pub(crate) config: RevisionsConfig,
    pub(crate) fence: Fence,
    pub(crate) signals: Signals,
    /// Replicas replaced off a draining node, waiting for the routers: by
    /// lease id, the route generation that left them out and when.
    pub(crate) retiring: Arc<std::sync::Mutex<HashMap<String, Retiring>>>,
}

/// A replaced replica on its way out (see [`Context::retiring`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Retiring {
    /// The service's route generation issued once its replacement ran.
    pub(crate) generation: i64,
    /// When that was, database clock milliseconds.
    pub(crate) since_ms: i64,
}

/// One pass over the service `key`.
pub(crate) async fn reconcile(key: &ServiceKey, ctx: &Context) -> Result<Action, ReconcileError> {
    let now = ctx.catalog.store().now_ms().await.map_err(CatalogError::from)?;
    let tombstones_settled = release_tombstones(key, ctx).await?;
    let Some((service, mut revisions)) = ctx.catalog.snapshot(key).await? else {
        return Ok(if tombstones_settled { Action::AwaitChange } else { Action::Requeue(ctx.config.rollout_poll) });
    };
    let mut wake_in: Option<Duration> = (!tombstones_settled).then_some(ctx.config.rollout_poll);
    let mut soonest = |after: Duration| {
        wake_in = Some(wake_in.map_or(after, |current| current.min(after)));
    };

    if let Some(newest) = revisions.first()
        && !newest.resolved()
        && newest.state != RevisionState::Failed
    {
        if now >= newest.next_resolve_at_ms {
            let outcome = resolve_template(ctx.resolver.as_ref(), &newest.template, ctx.config.resolve_timeout).await;
            let attempts = u32::try_from(newest.resolve_attempts).unwrap_or(u32::MAX).saturating_add(1);
            let backoff = ctx.config.resolve_backoff(attempts);
            match &outcome {
                Ok(digest) => tracing::info!(service = %key, revision = %newest.name, %digest, "bundle resolved"),
                Err(error) => tracing::info!(service = %key, revision = %newest.name, reason = error.reason(),
                    %error, retry_in = ?backoff, "bundle did not resolve"),
            }
            let next_at = now.saturating_add(millis(backoff));
            if ctx.catalog.record_resolution(&ctx.fence, key, &newest.name, &outcome, next_at).await? {
                ctx.signals.changed(key).await;
            }
            if outcome.is_err() {
                soonest(backoff);
            }
            match ctx.catalog.snapshot(key).await? {
                Some((_, fresh)) => revisions = fresh,
                None => return Ok(Action::Requeue(ctx.config.rollout_poll)),
            }
        } else {
            let wait = u64::try_from(newest.next_resolve_at_ms.saturating_sub(now)).unwrap_or_default();
            soonest(Duration::from_millis(wait));
        }
    }

    let owner = lease_owner(&key.name, &service.uid);
    let mut by_revision = match leases_of(ctx, &service, &revisions).await {
        Ok(by_revision) => by_revision,
        Err(error) => {
            unreachable_leases(ctx, &service, &revisions, &error).await?;
            return Err(error.into());
        }
    };
    let live = revisions.iter().find(|r| r.name == service.live_revision && r.resolved());
    let target = target(&service, &revisions);

    // The live revision keeps its replicas, whatever else happens.
    let mut live_upkeep = Upkeep::default();
    if let Some(live) = live {
        let slots = by_revision.get(&live.name).cloned().unwrap_or_default();
        live_upkeep = upkeep(ctx, &service, live, &slots, true).await?;
    }
    // So does every other revision the traffic split names.
    for split in split_revisions(&service, &revisions, live, target) {
        let slots = by_revision.get(&split.name).cloned().unwrap_or_default();
        upkeep(ctx, &service, split, &slots, true).await?;
    }

    let mut rollout = Rollout::Settled;
    if let Some(next) = target.filter(|t| Some(t.name.as_str()) != live.map(|l| l.name.as_str())) {
        rollout = roll_out(ctx, &service, next, live, &by_revision, now).await?;
    }
    // Read again as one snapshot: a delete or a new incarnation since is the next pass's.
    let (service, revisions) = match ctx.catalog.snapshot(key).await? {
        Some((fresh, revisions)) if fresh.uid == service.uid => (fresh, revisions),
        _ => return Ok(Action::Requeue(ctx.config.rollout_poll)),
    };
    if matches!(rollout, Rollout::WentLive | Rollout::Failed) {
        by_revision =
            group(ctx.leases.list(&key.project, &owner).await?, &service.uid, &service.status.adopted_replicas);
    }
    let live = revisions.iter().find(|r| r.name == service.live_revision && r.resolved());
    let target = self::target(&service, &revisions);
    // Traffic fell back from a newest revision that failed: its rollout is not complete.
    let failed = match target {
        Some(t) if t.state == RevisionState::Failed => Some(t),
        _ if service.pinned_revision.is_empty() => revisions.first().filter(|r| r.state == RevisionState::Failed),
        _ => None,
    };
    if rollout == Rollout::Settled && failed.is_some() {
        rollout = Rollout::Failed;
    }

    // Give back what neither the live revision, the one rolling out, the
    // traffic split nor a drain needs.
    let drain_ms = millis(ctx.config.drain);
    let routers = if revisions.iter().any(|r| r.draining(now, drain_ms)) {
        ctx.catalog.route_acks(key).await?
    } else {
        Vec::new()
    };
    let drain = Drain { now_ms: now, drain_ms, routers: &routers };
    let (keep, drained_in) = kept(&service, &revisions, live, target, &rollout, &by_revision, drain);
    if let Some(left) = drained_in {
        soonest(Duration::from_millis(u64::try_from(left).unwrap_or_default()));
    }
    let release = plan_release(&by_revision, &revisions, &keep, failed);
    for (revision, lease_id, reason) in &release.releases {
        tracing::info!(service = %key, %revision, %lease_id, reason, "releasing lease");
        ctx.leases.release(lease_id, reason).await?;
    }
    for revision in &release.stop_rollouts {
        ctx.catalog.change_rollout(&ctx.fence, &key.project, revision, &RolloutChange::Stop).await?;
    }

    // Revision GC.
    let mut protected: HashSet<&str> = keep.clone();
    protected.insert(service.pinned_revision.as_str());
    protected.extend(target.map(|r| r.name.as_str()));
    protected.extend(by_revision.iter().filter(|(_, slots)| slots.has_open()).map(|(name, _)| name.as_str()));
    let doomed = collectable(
        &revisions,
        &service.live_revision,
        target.map(|r| r.name.as_str()),
        &protected,
        ctx.config.gc_keep,
        millis(ctx.config.gc_min_age),
        now,
    );
    if !doomed.is_empty() {
        let deleted = ctx.catalog.collect(&ctx.fence, key, &doomed).await?;
        tracing::info!(service = %key, deleted, revisions = ?doomed, "collected old revisions");
    }

    // Status.
    let pass = Pass { revisions: &revisions, live, target, failed, rollout: &rollout, live_upkeep: &live_upkeep };
    let report = status_report(&service, &by_revision, &pass);
    if ctx.catalog.report(&ctx.fence, key, &report).await? {
        ctx.signals.changed(key).await;
    }

    let settled = matches!(rollout, Rollout::Settled | Rollout::Failed)
        && report.replicas_running == report.replicas_desired
        && !live_upkeep.settling
        && live_upkeep.no_room.is_none();
    if !settled {
        soonest(ctx.config.rollout_poll);
    }
    Ok(Action::Requeue(wake_in.unwrap_or(ctx.config.steady_resync)))
}

/// The service's leases by revision: from the lease view when it is synced and every
/// slot of the live revision and of the target holds an open lease there
/// (a steady service: nothing to ask for, so no final lease is needed),
/// else listed from the leases service, the truth.
async fn leases_of(
    ctx: &Context,
    service: &ServiceRow,
    revisions: &[RevisionRow],
) -> Result<BTreeMap<String, Slots>, LeaseCallError> {
    let owner = lease_owner(&service.key.name, &service.uid);
    if let Some(open) = ctx.lease_view.open(&service.key.project, &owner) {
        let live = revisions.iter().find(|r| r.name == service.live_revision && r.resolved());
        let mut needed: Vec<&RevisionRow> = live.into_iter().collect();
        let target = target(service, revisions);
        needed.extend(target.filter(|t| Some(t.name.as_str()) != live.map(|l| l.name.as_str())));
        needed.extend(split_revisions(service, revisions, live, target));
        let by_revision = group(open, &service.uid, &service.status.adopted_replicas);
        if served_by_open(&by_revision, &needed) {
            return Ok(by_revision);
        }
    }
    Ok(group(ctx.leases.list(&service.key.project, &owner).await?, &service.uid, &service.status.adopted_replicas))
}

/// Says in the service's status that leases could not be asked, keeping
/// the replica counts it last observed.
async fn unreachable_leases(
    ctx: &Context,
    service: &ServiceRow,
    revisions: &[RevisionRow],
    error: &LeaseCallError,
) -> Result<(), ReconcileError> {
    let mut conditions: Vec<Observed> = revisions.first().map(RevisionRow::resolution).into_iter().collect();
    conditions.push(Observed::new(READY, ConditionStatus::Unknown, "LeasesUnavailable", error.to_string()));
    let report = StatusReport {
        uid: service.uid.clone(),
        latest_created: revisions.first().map(|r| r.name.clone()).unwrap_or_default(),
        observed_generation: service.generation,
        replicas_running: service.status.replicas_running,
        replicas_desired: service.status.replicas_desired,
        conditions,
        revision_running: Vec::new(),
        adoptions_ended: Vec::new(),
    };
    if ctx.catalog.report(&ctx.fence, &service.key, &report).await? {
        ctx.signals.changed(&service.key).await;
    }
    Ok(())
}

/// Releases the leases of deleted incarnations of `key`; true once none is left.
async fn release_tombstones(key: &ServiceKey, ctx: &Context) -> Result<bool, ReconcileError> {
    let mut settled = true;
    for tombstone in ctx.catalog.tombstones(key).await? {
        let owner = lease_owner(&key.name, &tombstone.uid);
        let leases = ctx.leases.list(&key.project, &owner).await?;
        let open: Vec<_> = leases.iter().filter(|lease| is_open(lease)).collect();
        for lease in &open {
            tracing::info!(service = %key, lease_id = %lease.lease_id, "releasing a deleted service's lease");
            ctx.leases.release(&lease.lease_id, "ServiceDeleted").await?;
        }
        if open.is_empty() {
            ctx.catalog.forget(&ctx.fence, &tombstone).await?;
        } else {
            settled = false;
        }
    }
    Ok(settled)
}

/// Moves the rollout of `next` one step: starts it, resizes the live
/// replicas in place where [`plan_in_place`] says it can, else keeps its
/// own slots filled, and makes it live or failed as [`decide_rollout`] says.
async fn roll_out(
    ctx: &Context,
    service: &ServiceRow,
    next: &RevisionRow,
    live: Option<&RevisionRow>,
    by_revision: &BTreeMap<String, Slots>,
    now: i64,
) -> Result<Rollout, ReconcileError> {
    let key = &service.key;
    if let Some(blocked) = rollout_blocked(next) {
        return Ok(blocked);
    }
    let started = match next.rollout_started_at_ms {
        Some(started) => started,
        None => {
            tracing::info!(service = %key, revision = %next.name, "rolling out");
            ctx.catalog.change_rollout(&ctx.fence, &key.project, &next.name, &RolloutChange::Start).await?;
            now
        }
    };
    let slots = by_revision.get(&next.name).cloned().unwrap_or_default();
    let in_place = live.and_then(|live| {
        let live_slots = by_revision.get(&live.name).cloned().unwrap_or_default();
        plan_in_place(live, next, &live_slots, &slots).map(|plan| (live, plan))
    });
    let step = match in_place {
        Some((live, InPlace::TakeOver(taken))) => {
            tracing::info!(service = %key, revision = %next.name, previous = %live.name, replicas = taken.len(),
                "the live replicas were resized in place; they serve as the new revision");
            let replicas = u32::try_from(taken.len()).unwrap_or(u32::MAX);
            return go_live(ctx, service, next, by_revision, &taken, replicas).await;
        }
        Some((live, InPlace::Resize(asks))) => match resize_in_place(ctx, service, next, live, &asks).await? {
            Some(no_room) => {
                tracing::info!(service = %key, revision = %next.name, %no_room,
                    "a replica cannot grow on its node; rolling out new replicas instead");
                None
            }
            None => Some(decide_in_place(next, started, now, ctx.config.progress_deadline)),
        },
        None => None,
    };
    let step = match step {
        Some(step) => step,
        None => {
            let upkeep = upkeep(ctx, service, next, &slots, false).await?;
            decide_rollout(next, &slots, &upkeep, started, now, ctx.config.progress_deadline)
        }
    };
    match step {
        RolloutStep::Continue { no_room } => Ok(Rollout::InProgress { no_room }),
        RolloutStep::GoLive { replicas } => go_live(ctx, service, next, by_revision, &[], replicas).await,
        RolloutStep::Fail { reason, message } => {
            tracing::warn!(service = %key, revision = %next.name, reason, %message,
                live = %service.live_revision, "rollout failed; the live revision keeps serving");
            let change = RolloutChange::Fail { reason: reason.to_owned(), message };
            ctx.catalog.change_rollout(&ctx.fence, &key.project, &next.name, &change).await?;
            Ok(Rollout::Failed)
        }
    }
}

/// Makes `next` live with `replicas`, the replicas it `took` over in place
/// serving as it from now on.
async fn go_live(
    ctx: &Context,
    service: &ServiceRow,
    next: &RevisionRow,
    by_revision: &BTreeMap<String, Slots>,
    took: &[String],
    replicas: u32,
) -> Result<Rollout, ReconcileError> {
    let key = &service.key;
    tracing::info!(service = %key, revision = %next.name, previous = %service.live_revision, "revision is live");
    let adopted = adopted_after(&service.status.adopted_replicas, &open_ids(by_revision), &next.name, took);
    if ctx.catalog.go_live(&ctx.fence, key, &next.name, replicas, &adopted).await? {
        ctx.signals.changed(key).await;
    }
    Ok(Rollout::WentLive)
}

/// Asks for each of `asks` (lease id, epoch) of `live` to be resized to
/// `next`'s size. `Some(shortage)` when a node has no room for one: the
/// rollout then goes by replacement. A refusal (the lease changed hands or
/// ended since it was read) is left to the next pass, which reads again.
async fn resize_in_place(
    ctx: &Context,
    service: &ServiceRow,
    next: &RevisionRow,
    live: &RevisionRow,
    asks: &[(String, u64)],
) -> Result<Option<String>, ReconcileError> {
    let wanted = crate::model::resources(&next.template);
    for (lease_id, epoch) in asks {
        tracing::info!(service = %service.key, revision = %next.name, live = %live.name, %lease_id,
            cpu_millis = wanted.cpu_millis, memory_bytes = wanted.memory_bytes, "resizing a replica in place");
        match ctx.leases.resize(lease_id, *epoch, wanted).await {
            Ok(_) => {}
            Err(LeaseCallError::NoRoom(short)) => return Ok(Some(short)),
            Err(LeaseCallError::Refused { code, message }) => {
                tracing::info!(service = %service.key, %lease_id, ?code, %message, "the resize was refused; looking again");
            }
            Err(error) => return Err(error.into()),
        }
    }
    Ok(None)
}

/// Acts on [`plan_upkeep`] for `revision`: asks for the leases it lists
/// (a refusal for want of room is noted, not an error) and gives back the
/// stale ones.
async fn upkeep(
    ctx: &Context,
    service: &ServiceRow,
    revision: &RevisionRow,
    slots: &Slots,
    replace_failed: bool,
) -> Result<Upkeep, ReconcileError> {
    let plan = plan_upkeep(&service.uid, revision, slots, replace_failed);
    let mut upkeep = Upkeep { no_room: None, failed: plan.failed, settling: plan.settling };
    for key in &plan.requests {
        if let Some((_, lease)) = slots.current(key.slot) {
            let why = if is_draining(lease) {
                "replacing a replica on a draining node before it is given back"
            } else {
                "replacing a replica whose lease ended"
            };
            tracing::info!(service = %service.key, revision = %revision.name, slot = key.slot,
                lease_id = %lease.lease_id, phase = ?lease.phase(), reason = %lease.reason, "{why}");
        }
        match ctx.leases.request(lease_request(service, revision, key, &ctx.policy)).await {
            Ok(lease) => tracing::debug!(lease_id = %lease.lease_id, node_id = %lease.node_id, key = %key.encode(),
                "replica lease placed"),
            Err(LeaseCallError::NoRoom(short)) => upkeep.no_room = Some(short),
            Err(error) => return Err(error.into()),
        }
    }
    let (retire, release): (Vec<&String>, Vec<&String>) = plan.releases.iter().partition(|lease_id| {
        slots.by_slot.values().flatten().any(|(_, lease)| &lease.lease_id == *lease_id && is_draining(lease))
    });
    for lease_id in release {
        ctx.leases.release(lease_id, "Superseded").await?;
    }
    if !retire.is_empty() && retire_after_routers(ctx, service, &retire).await? {
        upkeep.settling = true;
    }
    Ok(upkeep)
}

/// Gives back replicas replaced off a draining node once every live router
/// serves a route generation issued after their replacements ran (the
/// routers send a draining node's replica nothing while another serves), or
/// once the drain timeout passed: so no request is in flight to one when it
/// stops. The first look at one issues that generation. Whether any is still
/// waiting.
async fn retire_after_routers(ctx: &Context, service: &ServiceRow, leases: &[&String]) -> Result<bool, ReconcileError> {
    let key = &service.key;
    let now = ctx.catalog.store().now_ms().await.map_err(CatalogError::from)?;
    let known = |lease_id: &str| ctx.retiring.lock().unwrap_or_else(PoisonError::into_inner).get(lease_id).copied();
    if leases.iter().any(|lease_id| known(lease_id).is_none()) {
        let generation = ctx.catalog.bump_route_generation(&ctx.fence, key).await?;
        ctx.signals.changed(key).await;
        let mut retiring = ctx.retiring.lock().unwrap_or_else(PoisonError::into_inner);
        for lease_id in leases {
            retiring.entry((*lease_id).clone()).or_insert(Retiring { generation, since_ms: now });
        }
    }
    let routers = ctx.catalog.route_acks(key).await?;
    let drain_ms = millis(ctx.config.drain);
    let mut waiting = false;
    for lease_id in leases {
        let Some(retiring) = known(lease_id) else { continue };
        let routed_out = crate::route_acks::all_serve(&routers, retiring.generation);
        if routed_out || now.saturating_sub(retiring.since_ms) >= drain_ms {
            tracing::info!(service = %key, %lease_id, routed_out, generation = retiring.generation,
                "giving back a replica replaced off a draining node");
            ctx.leases.release(lease_id, "Superseded").await?;
            ctx.retiring.lock().unwrap_or_else(PoisonError::into_inner).remove(lease_id.as_str());
        } else {
            waiting = true;
        }
    }
    Ok(waiting)
}

/// The lease request for one slot of `revision`.
fn lease_request(
    service: &ServiceRow,
    revision: &RevisionRow,
    key: &SlotKey,
    policy: &RegistryPolicy,
) -> leases::RequestLeaseRequest {
    let template = &revision.template;
    let (kind, bundle) = match template.artifact() {
        Some(artifact) => (artifact.kind, artifact.reference.clone()),
        None => (ArtifactKind::Bundle, BundleRef::default()),
    };
    let pinned = match berth_bundle::BundleReference::parse(&bundle.reference) {
        Ok(reference) => match revision.digest.parse::<berth_bundle::Digest>() {
            Ok(digest) => reference.pinned(&digest).to_string(),
            Err(_) => bundle.reference.clone(),
        },
        Err(_) => bundle.reference.clone(),
    };
    let insecure = bundle.insecure
        || match berth_bundle::BundleReference::parse(&bundle.reference) {
            Ok(berth_bundle::BundleReference::Registry(r)) => policy.plain_http(r.registry()),
            _ => false,
        };
    let resources = crate::model::resources(template);
    let pinned = Some(BundleRef { reference: pinned, secret: bundle.secret, insecure });
    let (bundle, image) = match kind {
        ArtifactKind::Bundle => (pinned, None),
        ArtifactKind::Image => (None, pinned),
    };
    leases::RequestLeaseRequest {
        project: service.key.project.clone(),
        owner: lease_owner(&service.key.name, &service.uid),
        idempotency_key: key.encode(),
        resources: Some(resources),
        tier: template.tier.clone(),
        spread_group: service.key.name.clone(),
        workload: Some(leases::Workload {
            bundle,
            image,
            runtime: template.runtime,
            digest: revision.digest.clone(),
            command: template.command.clone(),
            args: template.args.clone(),
            env: template.env.clone(),
            ports: template.ports.clone(),
            service: service.key.name.clone(),
            revision: revision.name.clone(),
            // A replica with ports takes traffic once its first port accepts, unless told otherwise.
            readiness: template.readiness.clone().or_else(|| (!template.ports.is_empty()).then(Readiness::default)),
            working_dir: template.working_dir.clone(),
            user: template.user.clone(),
            cache: template.cache.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use berth_proto::revisions::v1;
    use berth_store::testing::TestDb;
    use berth_store::{Store, Term};

    use super::*;
    use crate::DEPLOY_LOOP;
    use crate::catalog::Resolution;
    use crate::model::ROLLOUT_COMPLETE;
    use crate::model::fingerprint;
    use crate::plan::tests::row;
    use crate::resolver::ResolveError;
    use crate::validate::ValidApply;
    use berth_proto::leases::v1::LeasePhase;
    use berth_proto::types::v1::EventKind;

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// The leases service as the reconciler sees it, in memory: every
    /// request is placed BOUND unless `refuse` says there is no room.
    #[derive(Debug, Default)]
    struct FakeLeases {
        leases: Mutex<Vec<leases::Lease>>,
        refuse: Mutex<bool>,
        asked: Mutex<Vec<String>>,
        lists: Mutex<u32>,
    }

    impl FakeLeases {
        fn for_test() -> Arc<Self> {
            Arc::new(Self::default())
        }

        fn set_phase(&self, revision: &str, phase: LeasePhase) {
            for lease in self.leases.lock().unwrap().iter_mut() {
                if lease.workload.as_ref().is_some_and(|w| w.revision == revision) && is_open(lease) {
                    lease.set_phase(phase);
                }
            }
        }

        fn open(&self, revision: &str) -> usize {
            let leases = self.leases.lock().unwrap();
            leases.iter().filter(|l| l.workload.as_ref().is_some_and(|w| w.revision == revision) && is_open(l)).count()
        }
    }

    #[tonic::async_trait]
    impl LeaseClient for FakeLeases {
        async fn request(&self, request: leases::RequestLeaseRequest) -> Result<leases::Lease, LeaseCallError> {
            self.asked.lock().unwrap().push(request.idempotency_key.clone());
            let mut leases = self.leases.lock().unwrap();
            if let Some(existing) = leases.iter().find(|l| l.idempotency_key == request.idempotency_key) {
                return Ok(existing.clone());
            }
            if *self.refuse.lock().unwrap() {
                return Err(LeaseCallError::NoRoom("no node has 100m of CPU free".into()));
            }
            let lease = leases::Lease {
                lease_id: format!("l-{}", leases.len()),
                epoch: 1,
                project: request.project,
                owner: request.owner,
                node_id: "n-1".into(),
                phase: LeasePhase::Bound as i32,
                idempotency_key: request.idempotency_key,
                workload: request.workload,
                ..Default::default()
            };
            leases.push(lease.clone());
            Ok(lease)
        }

        async fn list(&self, project: &str, owner: &str) -> Result<Vec<leases::Lease>, LeaseCallError> {
            *self.lists.lock().unwrap() += 1;
            let leases = self.leases.lock().unwrap();
            Ok(leases.iter().filter(|l| l.project == project && l.owner == owner).cloned().collect())
        }

        async fn get(&self, lease_id: &str) -> Result<Option<leases::Lease>, LeaseCallError> {
            Ok(self.leases.lock().unwrap().iter().find(|l| l.lease_id == lease_id).cloned())
        }

        async fn release(&self, lease_id: &str, reason: &str) -> Result<(), LeaseCallError> {
            let mut leases = self.leases.lock().unwrap();
            if let Some(lease) = leases.iter_mut().find(|l| l.lease_id == lease_id && is_open(l)) {
                lease.set_phase(LeasePhase::Released);
                lease.reason = reason.to_owned();
            }
            Ok(())
        }

        async fn resize(
            &self,
            lease_id: &str,
            epoch: u64,
            resources: berth_proto::types::v1::Capacity,
        ) -> Result<leases::Lease, LeaseCallError> {
            let mut leases = self.leases.lock().unwrap();
            let lease = leases.iter_mut().find(|l| l.lease_id == lease_id && l.epoch == epoch).ok_or_else(|| {
                LeaseCallError::Refused { code: tonic::Code::FailedPrecondition, message: "stale epoch".into() }
            })?;
            let state = leases::ResizeState::Pending as i32;
            lease.resize = Some(leases::LeaseResize { resources: Some(resources), state, ..Default::default() });
            Ok(lease.clone())
        }
    }

    /// A resolver that is never asked: every revision here is minted resolved.
    #[derive(Debug)]
    struct Unreachable;

    #[tonic::async_trait]
    impl TagResolver for Unreachable {
        async fn resolve(&self, _bundle: &BundleRef) -> Result<berth_bundle::Digest, ResolveError> {
            Err(ResolveError::RegistryUnavailable("no registry in this test".into()))
        }
    }

    async fn context(store: &Store, leases: Arc<dyn LeaseClient>) -> Context {
        let term = store.try_acquire_leadership(DEPLOY_LOOP, "test", Duration::from_secs(60)).await.unwrap().unwrap();
        let (signals, _wakes) = Signals::new(berth_bus::testing::memory_bus().unwrap());
        Context {
            catalog: Catalog::new(store.clone()),
            leases,
            lease_view: Arc::default(),
            resolver: Arc::new(Unreachable),
            policy: RegistryPolicy::default(),
            config: RevisionsConfig { rollout_poll: Duration::from_millis(10), ..RevisionsConfig::default() },
            fence: Fence { loop_name: DEPLOY_LOOP, holder: "test".into(), term },
            signals,
            retiring: Arc::default(),
        }
    }

    async fn mint(ctx: &Context, version: &str) -> String {
        let template = v1::ServiceTemplate {
            bundle: Some(BundleRef { reference: "registry.test/team/web:v1".into(), ..Default::default() }),
            env: [("VERSION".to_owned(), version.to_owned())].into(),
            replicas: Some(2),
            ..Default::default()
        };
        let source = v1::Source::default();
        let valid = ValidApply {
            key: ServiceKey::new("default", "web"),
            fingerprint: fingerprint(&template, &source),
            template,
            source,
        };
        let applied = ctx.catalog.apply(&valid, &Resolution::Resolved(DIGEST.into()), 1000).await.unwrap();
        applied.revision
    }

    fn key() -> ServiceKey {
        ServiceKey::new("default", "web")
    }

    async fn status_of(ctx: &Context) -> v1::ServiceStatus {
        ctx.catalog.service(&key()).await.unwrap().unwrap().to_proto().status.unwrap()
    }

    fn reason(status: &v1::ServiceStatus, kind: &str) -> String {
        status.conditions.iter().find(|c| c.r#type == kind).map(|c| c.reason.clone()).unwrap_or_default()
    }

    #[tokio::test]
    async fn a_request_refused_for_room_is_a_condition_and_asked_again_under_the_same_key() {
        let db = TestDb::sqlite().await.unwrap();
        db.store().migrate(crate::MIGRATIONS).await.unwrap();
        let fake = FakeLeases::for_test();
        let ctx = context(db.store(), fake.clone()).await;
        mint(&ctx, "1").await;

        *fake.refuse.lock().unwrap() = true;
        let action = reconcile(&key(), &ctx).await.unwrap();
        assert_eq!(action, Action::Requeue(ctx.config.rollout_poll));
        let status = status_of(&ctx).await;
        assert_eq!(reason(&status, READY), "NoCapacity");
        assert_eq!(reason(&status, ROLLOUT_COMPLETE), "NoCapacity");
        reconcile(&key(), &ctx).await.unwrap();
        let asked = fake.asked.lock().unwrap().clone();
        assert_eq!(asked.len(), 4);
        assert_eq!(asked[0], asked[2], "a slot is asked for again under the same key");

        *fake.refuse.lock().unwrap() = false;
        reconcile(&key(), &ctx).await.unwrap();
        assert_eq!(fake.open("web-00001"), 2);
        fake.set_phase("web-00001", LeasePhase::Running);
        reconcile(&key(), &ctx).await.unwrap();
        let status = status_of(&ctx).await;
        assert_eq!(status.live_revision, "web-00001");
        assert_eq!((status.replicas_running, status.replicas_desired), (2, 2));
        assert_eq!(reconcile(&key(), &ctx).await.unwrap(), Action::Requeue(ctx.config.steady_resync));
        db.cleanup().await.unwrap();
    }

    #[tokio::test]
    async fn without_a_leases_address_the_status_says_so() {
        let db = TestDb::sqlite().await.unwrap();
        db.store().migrate(crate::MIGRATIONS).await.unwrap();
        let ctx = context(db.store(), Arc::new(crate::leases::NoLeases)).await;
        mint(&ctx, "1").await;
        let error = reconcile(&key(), &ctx).await.unwrap_err();
        assert!(matches!(error, ReconcileError::Leases(LeaseCallError::Unavailable(_))), "{error}");
        let status = status_of(&ctx).await;
        let ready = status.conditions.iter().find(|c| c.r#type == READY).unwrap();
        assert_eq!(ready.reason, "LeasesUnavailable");
        assert!(ready.message.contains("--leases-addr"), "{}", ready.message);
        db.cleanup().await.unwrap();
    }

    #[tokio::test]
    async fn a_deposed_reconciler_changes_nothing() {
        let db = TestDb::sqlite().await.unwrap();
        db.store().migrate(crate::MIGRATIONS).await.unwrap();
        let fake = FakeLeases::for_test();
        let mut ctx = context(db.store(), fake.clone()).await;
        mint(&ctx, "1").await;
        reconcile(&key(), &ctx).await.unwrap();
        fake.set_phase("web-00001", LeasePhase::Running);

        // Another replica took the lead at a newer term.
        ctx.fence.term = Term(ctx.fence.term.0 - 1);
        let error = reconcile(&key(), &ctx).await.unwrap_err();
        assert!(error.is_deposed(), "{error}");
        assert_eq!(status_of(&ctx).await.live_revision, "", "a stale term made nothing live");
        db.cleanup().await.unwrap();
    }

    #[tokio::test]
    async fn superseded_candidates_are_released_and_the_live_revision_kept() {
        let (db, fake, ctx) = live_web().await;

        // Two applies in a row: the first candidate never runs and is given back.
        mint(&ctx, "2").await;
        reconcile(&key(), &ctx).await.unwrap();
        assert_eq!(fake.open("web-00002"), 2);
        mint(&ctx, "3").await;
        reconcile(&key(), &ctx).await.unwrap();
        assert_eq!((fake.open("web-00001"), fake.open("web-00002"), fake.open("web-00003")), (2, 0, 2));
        let status = status_of(&ctx).await;
        assert_eq!(status.live_revision, "web-00001");
        assert_eq!(reason(&status, ROLLOUT_COMPLETE), "RollingOut");
        db.cleanup().await.unwrap();
    }

    /// A database, the fake leases and a context in which `web-00001` is
    /// live with both its replicas running.
    async fn live_web() -> (TestDb, Arc<FakeLeases>, Context) {
        let db = TestDb::sqlite().await.unwrap();
        db.store().migrate(crate::MIGRATIONS).await.unwrap();
        let fake = FakeLeases::for_test();
        let ctx = context(db.store(), fake.clone()).await;
        mint(&ctx, "1").await;
        reconcile(&key(), &ctx).await.unwrap();
        fake.set_phase("web-00001", LeasePhase::Running);
        reconcile(&key(), &ctx).await.unwrap();
        (db, fake, ctx)
    }

    /// Describes every lease `fake` holds to `view`, as a fresh watch stream would.
    fn sync_view(view: &LeaseView, fake: &FakeLeases) {
        view.unsync();
        for lease in fake.leases.lock().unwrap().iter() {
            let upsert =
                leases::LeaseEvent { kind: EventKind::Upsert as i32, lease: Some(lease.clone()), ..Default::default() };
            view.apply(&upsert);
        }
        view.apply(&leases::LeaseEvent { kind: EventKind::Synced as i32, ..Default::default() });
    }

    #[tokio::test]
    async fn a_steady_service_is_reconciled_from_the_lease_view_and_a_slot_to_fill_lists_the_truth() {
        let (db, fake, ctx) = live_web().await;
        assert_eq!(status_of(&ctx).await.live_revision, "web-00001");

        // Synced and every slot open: no call to the leases service.
        sync_view(&ctx.lease_view, &fake);
        let lists = *fake.lists.lock().unwrap();
        assert_eq!(reconcile(&key(), &ctx).await.unwrap(), Action::Requeue(ctx.config.steady_resync));
        assert_eq!(*fake.lists.lock().unwrap(), lists, "a steady service reads its leases from the view");
        assert_eq!(status_of(&ctx).await.replicas_running, 2);

        // A replica's lease ends: the view no longer covers the slot, so the
        // reconcile lists and asks for the slot's next attempt.
        let ended = {
            let mut leases = fake.leases.lock().unwrap();
            leases[0].set_phase(LeasePhase::Expired);
            leases[0].clone()
        };
        let removed =
            leases::LeaseEvent { kind: EventKind::Removed as i32, lease: Some(ended.clone()), ..Default::default() };
        ctx.lease_view.apply(&removed);
        reconcile(&key(), &ctx).await.unwrap();
        assert_eq!(*fake.lists.lock().unwrap(), lists + 1);
        let replacement = fake.asked.lock().unwrap().last().cloned().unwrap();
        let ended_key = SlotKey::decode(&ended.idempotency_key).unwrap();
        assert_eq!(replacement, SlotKey { attempt: ended_key.attempt + 1, ..ended_key }.encode());

        // A view not synced answers nothing: every reconcile lists.
        ctx.lease_view.unsync();
        reconcile(&key(), &ctx).await.unwrap();
        assert_eq!(*fake.lists.lock().unwrap(), lists + 2);
        db.cleanup().await.unwrap();
    }

    #[test]
    fn a_replicas_lease_runs_the_templates_image_pinned_and_needs_its_runtime() {
        let mut revision = row("web-00001", 1, RevisionState::Pending, 0);
        revision.template.image =
            Some(BundleRef { reference: "127.0.0.1:5000/team/web:v1".into(), ..Default::default() });
        revision.template.runtime = berth_proto::types::v1::RuntimeClass::Sandboxed as i32;
        let service = ServiceRow { template: revision.template.clone(), ..crate::plan::tests::service_row("") };
        let slot = SlotKey { revision: revision.name.clone(), uid: "u".into(), slot: 0, attempt: 0 };
        let request = lease_request(&service, &revision, &slot, &RegistryPolicy::default());
        let workload = request.workload.unwrap();
        assert!(workload.bundle.is_none(), "an image lease names no bundle");
        let image = workload.image.clone().unwrap();
        assert_eq!(image.reference, format!("127.0.0.1:5000/team/web@{DIGEST}"), "pinned to the revision's digest");
        assert!(image.insecure, "a loopback registry is spoken to over plain HTTP");
        assert_eq!(workload.digest, DIGEST);
        assert_eq!(workload.runtime(), berth_proto::types::v1::RuntimeClass::Sandboxed);
        assert_eq!(workload.readiness, None, "a template without ports is ready when it starts");

        // With ports, a replica is ready once its first port accepts, unless
        // the template says how else.
        revision.template.ports = vec![berth_proto::types::v1::Port { name: "http".into(), port: 8080 }];
        let request = lease_request(&service, &revision, &slot, &RegistryPolicy::default());
        assert_eq!(request.workload.unwrap().readiness, Some(Readiness::default()));
        let declared = Readiness { http_path: "/healthz".into(), port: "http".into(), period_millis: 500 };
        revision.template.readiness = Some(declared.clone());
        let request = lease_request(&service, &revision, &slot, &RegistryPolicy::default());
        assert_eq!(request.workload.unwrap().readiness, Some(declared));
    }
}
