//! The deploy reconciler: for one service, reads the declaration, its
//! revisions and its leases, and moves them one step toward what was asked:
//! the newest revision resolved, `replicas` leases for the live revision,
//! the next revision rolled out beside it, then made live, and the rest
//! given back.
//!
//! # Expected flow
//! `reconcile(key, ctx)` is level-triggered: it decides from what it reads,
//! never from the event that woke it, so a missed wake-up is healed by the
//! next pass, and it returns when to look again ([`Action`]). The controller
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
//! # Leases
//! Replica `slot` of a revision is asked for with idempotency key
//! `<revision>/<uid>/<slot>/<attempt>`; the slot's current lease is its
//! highest attempt. A current lease that ended (expired, released, done, or
//! failed on the live revision) is replaced by asking for attempt + 1, so
//! asking again after a crash returns the same lease, never a second one.
//! A deposed leader's late requests are therefore harmless, and its writes
//! to the catalog are refused.

use berth_runtime::Action;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use berth_proto::artifact::ArtifactKind;
use berth_proto::leases::v1::{self as leases, LeasePhase};
use berth_proto::types::v1::{BundleRef, Capacity, ConditionStatus};
use tokio::time::timeout;

use crate::catalog::{Catalog, CatalogError, Fence, RolloutChange, StatusReport};
use crate::config::{DEFAULT_CPU_MILLIS, DEFAULT_MEMORY_BYTES, RevisionsConfig, millis};
use crate::leases::{LeaseCallError, LeaseClient};
use crate::model::{Observed, READY, ROLLOUT_COMPLETE, ServiceKey, SlotKey, lease_owner, replicas};
use crate::records::{RevisionRow, RevisionState, ServiceRow};
use crate::resolver::{RegistryPolicy, ResolveError, TagResolver};
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
    pub(crate) resolver: Arc<dyn TagResolver>,
    pub(crate) policy: RegistryPolicy,
    pub(crate) config: RevisionsConfig,
    pub(crate) fence: Fence,
    pub(crate) signals: Signals,
}

/// Whether the lease holds capacity.
fn is_open(lease: &leases::Lease) -> bool {
    lease.phase().is_open()
}

/// A revision's leases by slot, each slot's attempts highest first.
#[derive(Debug, Default, Clone)]
struct Slots {
    by_slot: BTreeMap<u32, Vec<(u32, leases::Lease)>>,
}

impl Slots {
    fn add(&mut self, key: SlotKey, lease: leases::Lease) {
        let attempts = self.by_slot.entry(key.slot).or_default();
        attempts.push((key.attempt, lease));
        attempts.sort_by_key(|(attempt, _)| std::cmp::Reverse(*attempt));
    }

    /// The slot's current lease and its attempt.
    fn current(&self, slot: u32) -> Option<&(u32, leases::Lease)> {
        self.by_slot.get(&slot).and_then(|attempts| attempts.first())
    }

    /// Current leases of slots below `desired` that run.
    fn running(&self, desired: u32) -> u32 {
        let running = (0..desired)
            .filter(|slot| self.current(*slot).is_some_and(|(_, lease)| lease.phase() == LeasePhase::Running));
        u32::try_from(running.count()).unwrap_or(u32::MAX)
    }

    fn open(&self) -> impl Iterator<Item = &leases::Lease> {
        self.by_slot.values().flatten().map(|(_, lease)| lease).filter(|lease| is_open(lease))
    }

    fn has_open(&self) -> bool {
        self.open().next().is_some()
    }
}

/// Leases grouped by the revision their key names.
fn group(leases: Vec<leases::Lease>, uid: &str) -> BTreeMap<String, Slots> {
    let mut grouped: BTreeMap<String, Slots> = BTreeMap::new();
    for lease in leases {
        match SlotKey::decode(&lease.idempotency_key) {
            Some(key) if key.uid == uid => grouped.entry(key.revision.clone()).or_default().add(key, lease),
            _ => tracing::debug!(lease_id = %lease.lease_id, key = %lease.idempotency_key,
                "a lease of this owner with a key not minted here; left alone"),
        }
    }
    grouped
}

/// What maintaining one revision's leases ran into.
#[derive(Debug, Default)]
struct Upkeep {
    /// A request was refused for want of room; the message says what was short.
    no_room: Option<String>,
    /// A current lease of the revision failed, with its reason and message.
    failed: Option<(String, String)>,
    /// Something is still on its way (a lease asked for, placed but not running).
    settling: bool,
}

/// The revision traffic should go to: the pin, else the newest unless it
/// failed, else the newest ready one.
pub(crate) fn target<'a>(service: &ServiceRow, revisions: &'a [RevisionRow]) -> Option<&'a RevisionRow> {
    if !service.pinned_revision.is_empty() {
        return revisions.iter().find(|r| r.name == service.pinned_revision);
    }
    match revisions.first() {
        Some(newest) if newest.state != RevisionState::Failed => Some(newest),
        _ => revisions.iter().find(|r| r.state == RevisionState::Ready),
    }
}

/// Revisions GC may delete: the non-live revisions beyond the newest `keep`
/// of them that are older than `min_age_ms`, except the newest revision and
/// any in `protected` (pinned, target, holding open leases).
pub(crate) fn collectable(
    revisions: &[RevisionRow],
    live: &str,
    protected: &HashSet<&str>,
    keep: usize,
    min_age_ms: i64,
    now_ms: i64,
) -> Vec<String> {
    let newest = revisions.first().map(|r| r.name.as_str());
    revisions
        .iter()
        .filter(|r| r.name != live)
        .skip(keep)
        .filter(|r| Some(r.name.as_str()) != newest && !protected.contains(r.name.as_str()))
        .filter(|r| now_ms.saturating_sub(r.created_at_ms) >= min_age_ms)
        .map(|r| r.name.clone())
        .collect()
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
            let outcome = resolve(ctx, newest).await;
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
    let listed = match ctx.leases.list(&key.project, &owner).await {
        Ok(listed) => listed,
        Err(error) => {
            unreachable_leases(ctx, &service, &revisions, &error).await?;
            return Err(error.into());
        }
    };
    let mut by_revision = group(listed, &service.uid);
    let live = revisions.iter().find(|r| r.name == service.live_revision && r.resolved());
    let target = target(&service, &revisions);

    // The live revision keeps its replicas, whatever else happens.
    let mut live_upkeep = Upkeep::default();
    if let Some(live) = live {
        let slots = by_revision.get(&live.name).cloned().unwrap_or_default();
        live_upkeep = upkeep(ctx, &service, live, &slots, true).await?;
    }

    let mut rollout = Rollout::Settled;
    if let Some(next) = target.filter(|t| Some(t.name.as_str()) != live.map(|l| l.name.as_str())) {
        rollout = roll_out(ctx, &service, next, by_revision.get(&next.name).cloned().unwrap_or_default(), now).await?;
        if matches!(rollout, Rollout::WentLive | Rollout::Failed) {
            by_revision = group(ctx.leases.list(&key.project, &owner).await?, &service.uid);
        }
    }
    // Read again as one snapshot: a delete or a new incarnation since is the next pass's.
    let (service, revisions) = match ctx.catalog.snapshot(key).await? {
        Some((fresh, revisions)) if fresh.uid == service.uid => (fresh, revisions),
        _ => return Ok(Action::Requeue(ctx.config.rollout_poll)),
    };
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

    // Give back what neither the live revision nor the one rolling out needs.
    let mut keep: HashSet<&str> = HashSet::new();
    keep.extend(live.map(|r| r.name.as_str()));
    if matches!(rollout, Rollout::InProgress { .. }) {
        keep.extend(target.map(|r| r.name.as_str()));
    }
    for (revision, slots) in &by_revision {
        if keep.contains(revision.as_str()) {
            continue;
        }
        let reason = if failed.is_some_and(|f| f.name == *revision) { "RolloutFailed" } else { "Superseded" };
        for lease in slots.open() {
            tracing::info!(service = %key, %revision, lease_id = %lease.lease_id, reason, "releasing lease");
            ctx.leases.release(&lease.lease_id, reason).await?;
        }
        if let Some(row) = revisions.iter().find(|r| r.name == *revision)
            && row.rollout_started_at_ms.is_some()
            && row.state == RevisionState::Pending
        {
            ctx.catalog.change_rollout(&ctx.fence, &key.project, revision, &RolloutChange::Stop).await?;
        }
    }

    // Revision GC.
    let mut protected: HashSet<&str> = keep.clone();
    protected.insert(service.pinned_revision.as_str());
    protected.extend(target.map(|r| r.name.as_str()));
    protected.extend(by_revision.iter().filter(|(_, slots)| slots.has_open()).map(|(name, _)| name.as_str()));
    let doomed = collectable(
        &revisions,
        &service.live_revision,
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
    let desired = live.or(target).map_or(0, |r| replicas(&r.template));
    let running = live.map_or(0, |l| by_revision.get(&l.name).map_or(0, |s| s.running(replicas(&l.template))));
    let report = StatusReport {
        uid: service.uid.clone(),
        latest_created: revisions.first().map(|r| r.name.clone()).unwrap_or_default(),
        observed_generation: service.generation,
        replicas_running: running,
        replicas_desired: desired,
        conditions: Pass { revisions: &revisions, live, target, failed, rollout: &rollout, live_upkeep: &live_upkeep }
            .conditions(running, desired),
        revision_running: revisions
            .iter()
            .map(|r| {
                let count = by_revision.get(&r.name).map_or(0, |s| s.running(replicas(&r.template)));
                (r.name.clone(), i64::from(count))
            })
            .collect(),
    };
    if ctx.catalog.report(&ctx.fence, key, &report).await? {
        ctx.signals.changed(key).await;
    }

    let settled = matches!(rollout, Rollout::Settled | Rollout::Failed)
        && running == desired
        && !live_upkeep.settling
        && live_upkeep.no_room.is_none();
    if !settled {
        soonest(ctx.config.rollout_poll);
    }
    Ok(Action::Requeue(wake_in.unwrap_or(ctx.config.steady_resync)))
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

async fn resolve(ctx: &Context, revision: &RevisionRow) -> Result<String, ResolveError> {
    let Some(artifact) = revision.template.artifact() else {
        return Err(ResolveError::InvalidReference("the template names no bundle nor image".to_owned()));
    };
    match timeout(ctx.config.resolve_timeout, ctx.resolver.resolve(artifact.reference)).await {
        Ok(result) => result.map(|digest| digest.to_string()),
        Err(_) => Err(ResolveError::RegistryUnavailable(format!(
            "the registry did not answer within {:?}",
            ctx.config.resolve_timeout
        ))),
    }
}

/// Where the rollout of the target stands after this pass.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rollout {
    /// The target is live (or there is none).
    Settled,
    /// The target's replicas are on their way.
    InProgress { no_room: Option<String> },
    /// The target's bundle has not resolved yet.
    Unresolved,
    /// The target failed (now or before); the live revision keeps serving.
    Failed,
    /// The target became live in this pass.
    WentLive,
}

async fn roll_out(
    ctx: &Context,
    service: &ServiceRow,
    next: &RevisionRow,
    slots: Slots,
    now: i64,
) -> Result<Rollout, ReconcileError> {
    let key = &service.key;
    if next.state == RevisionState::Failed {
        return Ok(Rollout::Failed);
    }
    if !next.resolved() {
        return Ok(Rollout::Unresolved);
    }
    let started = match next.rollout_started_at_ms {
        Some(started) => started,
        None => {
            tracing::info!(service = %key, revision = %next.name, "rolling out");
            ctx.catalog.change_rollout(&ctx.fence, &key.project, &next.name, &RolloutChange::Start).await?;
            now
        }
    };
    let upkeep = upkeep(ctx, service, next, &slots, false).await?;
    if let Some((reason, message)) = upkeep.failed {
        let message = format!("a replica failed to start ({reason}): {message}");
        return fail(ctx, service, next, "ReplicaFailed", message).await;
    }
    let desired = replicas(&next.template);
    if slots.running(desired) == desired {
        tracing::info!(service = %key, revision = %next.name, previous = %service.live_revision, "revision is live");
        if ctx.catalog.go_live(&ctx.fence, key, &next.name, desired).await? {
            ctx.signals.changed(key).await;
        }
        return Ok(Rollout::WentLive);
    }
    if now.saturating_sub(started) > millis(ctx.config.progress_deadline) {
        let running = slots.running(desired);
        let mut message = format!(
            "{running} of {desired} replicas ran within the progress deadline of {:?}",
            ctx.config.progress_deadline
        );
        if let Some(short) = &upkeep.no_room {
            message.push_str(&format!("; {short}"));
        }
        return fail(ctx, service, next, "ProgressDeadlineExceeded", message).await;
    }
    Ok(Rollout::InProgress { no_room: upkeep.no_room })
}

async fn fail(
    ctx: &Context,
    service: &ServiceRow,
    next: &RevisionRow,
    reason: &str,
    message: String,
) -> Result<Rollout, ReconcileError> {
    tracing::warn!(service = %service.key, revision = %next.name, reason, %message,
        live = %service.live_revision, "rollout failed; the live revision keeps serving");
    let change = RolloutChange::Fail { reason: reason.to_owned(), message };
    ctx.catalog.change_rollout(&ctx.fence, &service.key.project, &next.name, &change).await?;
    Ok(Rollout::Failed)
}

/// Keeps one lease per slot of `revision`: asks for missing ones and
/// replaces ended ones. A failed lease of a revision not yet live is not
/// replaced but reported, unless `replace_failed`.
async fn upkeep(
    ctx: &Context,
    service: &ServiceRow,
    revision: &RevisionRow,
    slots: &Slots,
    replace_failed: bool,
) -> Result<Upkeep, ReconcileError> {
    let mut upkeep = Upkeep::default();
    let desired = replicas(&revision.template);
    for slot in 0..desired {
        let attempt = match slots.current(slot) {
            None => 0,
            Some((_, lease)) if is_open(lease) => {
                if lease.phase() != LeasePhase::Running {
                    upkeep.settling = true;
                }
                continue;
            }
            Some((_, lease)) if lease.phase() == LeasePhase::Failed && !replace_failed => {
                upkeep.failed = Some((lease.reason.clone(), lease.message.clone()));
                continue;
            }
            Some((attempt, lease)) => {
                tracing::info!(service = %service.key, revision = %revision.name, slot, lease_id = %lease.lease_id,
                    phase = ?lease.phase(), reason = %lease.reason, "replacing a replica whose lease ended");
                attempt.saturating_add(1)
            }
        };
        upkeep.settling = true;
        let key = SlotKey { revision: revision.name.clone(), uid: service.uid.clone(), slot, attempt };
        match ctx.leases.request(lease_request(service, revision, &key, &ctx.policy)).await {
            Ok(lease) => tracing::debug!(lease_id = %lease.lease_id, node_id = %lease.node_id, key = %key.encode(),
                "replica lease placed"),
            Err(LeaseCallError::NoRoom(short)) => upkeep.no_room = Some(short),
            Err(error) => return Err(error.into()),
        }
    }
    // Slots past the count (never minted here, as a revision's count never changes) and
    // older attempts that came back to life are given back once their slot runs.
    for (slot, attempts) in &slots.by_slot {
        let slot_runs = attempts.first().is_some_and(|(_, lease)| lease.phase() == LeasePhase::Running);
        let stale = attempts
            .iter()
            .enumerate()
            .filter(|(n, (_, lease))| is_open(lease) && (*slot >= desired || (*n > 0 && slot_runs)));
        for (_, (_, lease)) in stale {
            ctx.leases.release(&lease.lease_id, "Superseded").await?;
        }
    }
    Ok(upkeep)
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
    let resources = template
        .resources
        .filter(|r| r.cpu_millis > 0 && r.memory_bytes > 0)
        .unwrap_or(Capacity { cpu_millis: DEFAULT_CPU_MILLIS, memory_bytes: DEFAULT_MEMORY_BYTES });
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
        }),
    }
}

/// What one pass saw and did, from which the service's conditions are read.
#[derive(Debug)]
struct Pass<'a> {
    revisions: &'a [RevisionRow],
    live: Option<&'a RevisionRow>,
    target: Option<&'a RevisionRow>,
    /// The revision whose failure traffic fell back from, if any.
    failed: Option<&'a RevisionRow>,
    rollout: &'a Rollout,
    live_upkeep: &'a Upkeep,
}

impl Pass<'_> {
    /// The service's conditions as this pass observed them.
    fn conditions(&self, running: u32, desired: u32) -> Vec<Observed> {
        let Pass { revisions, live, target, failed, rollout, live_upkeep } = *self;
        use ConditionStatus::{False, Unknown};
        let mut observed = Vec::new();
        if let Some(newest) = revisions.first() {
            observed.push(newest.resolution());
        }
        let target_name = target.map_or("", |t| t.name.as_str());
        let live_name = live.map_or("", |l| l.name.as_str());
        let failure =
            failed.or(target).map(|t| format!("revision {} failed: {}", t.name, t.state_message)).unwrap_or_default();
        let unresolved = target.map(RevisionRow::resolution);
        let complete = match rollout {
            Rollout::Settled | Rollout::WentLive => Observed::holds(ROLLOUT_COMPLETE),
            Rollout::InProgress { no_room: Some(short) } => Observed::new(ROLLOUT_COMPLETE, False, "NoCapacity", short),
            Rollout::InProgress { no_room: None } => Observed::new(
                ROLLOUT_COMPLETE,
                False,
                "RollingOut",
                format!("revision {target_name} is starting its replicas beside {}", or_none(live_name)),
            ),
            Rollout::Unresolved => {
                let message = unresolved.as_ref().map(|u| u.message.clone()).unwrap_or_default();
                Observed::new(ROLLOUT_COMPLETE, False, "BundleUnresolved", message)
            }
            Rollout::Failed => Observed::new(
                ROLLOUT_COMPLETE,
                False,
                "RevisionFailed",
                format!("{failure}; {} keeps serving", or_none(live_name)),
            ),
        };
        let ready = if live.is_some() && running == desired {
            Observed::holds(READY)
        } else if let Some(short) = live.and(live_upkeep.no_room.as_ref()) {
            Observed::new(READY, False, "NoCapacity", short.clone())
        } else if live.is_some() {
            Observed::new(READY, False, "ReplicasNotRunning", format!("{running} of {desired} replicas are running"))
        } else {
            match rollout {
                Rollout::Unresolved => match unresolved {
                    Some(u) if u.status == False => Observed::new(READY, False, u.reason, u.message),
                    _ => Observed::new(READY, Unknown, "Resolving", "the bundle tag is being resolved"),
                },
                Rollout::Failed => Observed::new(READY, False, "RevisionFailed", failure),
                Rollout::InProgress { no_room: Some(short) } => {
                    Observed::new(READY, False, "NoCapacity", short.clone())
                }
                _ if target.is_none() => Observed::new(READY, False, "NoRevision", "no revision can serve"),
                _ => Observed::new(READY, Unknown, "Deploying", format!("revision {target_name} is starting")),
            }
        };
        observed.push(ready);
        observed.push(complete);
        observed
    }
}

fn or_none(name: &str) -> &str {
    if name.is_empty() { "no revision" } else { name }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use berth_proto::revisions::v1;
    use berth_store::testing::TestDb;
    use berth_store::{Store, Term};

    use super::*;
    use crate::catalog::Resolution;
    use crate::controller::DEPLOY_LOOP;
    use crate::model::fingerprint;
    use crate::validate::ValidApply;

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// The leases service as the reconciler sees it, in memory: every
    /// request is placed BOUND unless `refuse` says there is no room.
    #[derive(Debug, Default)]
    struct FakeLeases {
        leases: Mutex<Vec<leases::Lease>>,
        refuse: Mutex<bool>,
        asked: Mutex<Vec<String>>,
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
            resolver: Arc::new(Unreachable),
            policy: RegistryPolicy::default(),
            config: RevisionsConfig { rollout_poll: Duration::from_millis(10), ..RevisionsConfig::default() },
            fence: Fence { loop_name: DEPLOY_LOOP, holder: "test".into(), term },
            signals,
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
        let db = TestDb::sqlite().await.unwrap();
        db.store().migrate(crate::MIGRATIONS).await.unwrap();
        let fake = FakeLeases::for_test();
        let ctx = context(db.store(), fake.clone()).await;
        mint(&ctx, "1").await;
        reconcile(&key(), &ctx).await.unwrap();
        fake.set_phase("web-00001", LeasePhase::Running);
        reconcile(&key(), &ctx).await.unwrap();

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

    fn row(name: &str, generation: i64, state: RevisionState, created_at_ms: i64) -> RevisionRow {
        RevisionRow {
            project: "default".into(),
            name: name.into(),
            service: "web".into(),
            generation,
            template: v1::ServiceTemplate::default(),
            source: v1::Source::default(),
            fingerprint: String::new(),
            digest: DIGEST.into(),
            resolve_reason: String::new(),
            resolve_message: String::new(),
            resolve_attempts: 1,
            resolve_changed_at_ms: 0,
            next_resolve_at_ms: 0,
            state,
            state_reason: String::new(),
            state_message: String::new(),
            state_changed_at_ms: 0,
            rollout_started_at_ms: None,
            replicas_running: 0,
            created_at_ms,
        }
    }

    #[test]
    fn the_target_is_the_pin_else_the_newest_unless_failed_else_the_newest_ready() {
        let revisions = [
            row("web-00004", 4, RevisionState::Failed, 0),
            row("web-00003", 3, RevisionState::Pending, 0),
            row("web-00002", 2, RevisionState::Ready, 0),
            row("web-00001", 1, RevisionState::Ready, 0),
        ];
        let service = |pinned: &str| ServiceRow {
            key: key(),
            uid: "u".into(),
            generation: 4,
            template: v1::ServiceTemplate::default(),
            source: v1::Source::default(),
            pinned_revision: pinned.into(),
            live_revision: "web-00002".into(),
            status: v1::ServiceStatus::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            version: 1,
        };
        assert_eq!(target(&service(""), &revisions).unwrap().name, "web-00002", "not an older pending one");
        assert_eq!(target(&service("web-00001"), &revisions).unwrap().name, "web-00001");
        assert_eq!(target(&service(""), &revisions[1..]).unwrap().name, "web-00003");
    }

    #[test]
    fn gc_keeps_the_newest_n_non_live_and_the_young() {
        let revisions: Vec<RevisionRow> =
            (1..=8).rev().map(|g| row(&format!("web-{g:05}"), g, RevisionState::Ready, g * 1000)).collect();
        let none = HashSet::new();
        // Live is web-00005; the newest two others are 8 and 7.
        let doomed = collectable(&revisions, "web-00005", &none, 2, 0, 100_000);
        assert_eq!(doomed, ["web-00006", "web-00004", "web-00003", "web-00002", "web-00001"]);
        // Younger than the minimum age: kept.
        let doomed = collectable(&revisions, "web-00005", &none, 2, 96_500, 100_000);
        assert_eq!(doomed, ["web-00003", "web-00002", "web-00001"]);
        // Pinned (or holding leases): kept.
        let protected: HashSet<&str> = ["web-00002"].into();
        let doomed = collectable(&revisions, "web-00005", &protected, 2, 0, 100_000);
        assert!(!doomed.contains(&"web-00002".to_owned()));
        // Keeping none still keeps the newest.
        let doomed = collectable(&revisions, "web-00005", &none, 0, 0, 100_000);
        assert!(!doomed.contains(&"web-00008".to_owned()));
        assert_eq!(doomed.len(), 6);
    }

    #[test]
    fn a_replicas_lease_runs_the_templates_image_pinned_and_needs_its_runtime() {
        let mut revision = row("web-00001", 1, RevisionState::Pending, 0);
        revision.template.image =
            Some(BundleRef { reference: "127.0.0.1:5000/team/web:v1".into(), ..Default::default() });
        revision.template.runtime = berth_proto::types::v1::RuntimeClass::Sandboxed as i32;
        let service = ServiceRow {
            key: key(),
            uid: "u".into(),
            generation: 1,
            template: revision.template.clone(),
            source: v1::Source::default(),
            pinned_revision: String::new(),
            live_revision: String::new(),
            status: v1::ServiceStatus::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            version: 1,
        };
        let slot = SlotKey { revision: revision.name.clone(), uid: "u".into(), slot: 0, attempt: 0 };
        let request = lease_request(&service, &revision, &slot, &RegistryPolicy::default());
        let workload = request.workload.unwrap();
        assert!(workload.bundle.is_none(), "an image lease names no bundle");
        let image = workload.image.clone().unwrap();
        assert_eq!(image.reference, format!("127.0.0.1:5000/team/web@{DIGEST}"), "pinned to the revision's digest");
        assert!(image.insecure, "a loopback registry is spoken to over plain HTTP");
        assert_eq!(workload.digest, DIGEST);
        assert_eq!(workload.runtime(), berth_proto::types::v1::RuntimeClass::Sandboxed);
    }
}
