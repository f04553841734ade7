//! The deploy reconciler's decisions, as pure functions of what one pass
//! observed: which revision traffic should go to, what each revision's
//! slots need (leases to ask for, to give back), where a rollout stands and
//! what it does next, what is released, what GC may delete, and the
//! status the service reports.
//!
//! The reconciler ([`crate::reconciler`]) observes (the catalog's snapshot
//! and the service's leases), asks these functions what to do, and acts;
//! nothing here reads or writes anything, so every decision is tested here
//! by table, without a store or a leases service.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use berth_proto::leases::v1::{self as leases, LeasePhase};
use berth_proto::types::v1::ConditionStatus;

use crate::catalog::StatusReport;
use crate::config::millis;
use crate::model::{Observed, READY, ROLLOUT_COMPLETE, SlotKey, differs_only_in_resources, replicas, resources};
use crate::records::{RevisionRow, RevisionState, ServiceRow};
use crate::route_acks::{RouterAck, all_serve};

/// Whether the lease holds capacity.
pub(crate) fn is_open(lease: &leases::Lease) -> bool {
    lease.phase().is_open()
}

/// Whether the lease is open on a draining node, to be replaced elsewhere
/// before it is given back.
pub(crate) fn is_draining(lease: &leases::Lease) -> bool {
    is_open(lease) && lease.reason == berth_core::NODE_DRAINING
}

/// A revision's leases by slot, each slot's attempts highest first.
#[derive(Debug, Default, Clone)]
pub(crate) struct Slots {
    pub(crate) by_slot: BTreeMap<u32, Vec<(u32, leases::Lease)>>,
    /// By slot, the highest attempt any lease keyed with this revision's
    /// name carries, including those a later revision took over: a key
    /// once used answers with its lease, so a new one starts above it.
    pub(crate) spent: BTreeMap<u32, u32>,
}

impl Slots {
    pub(crate) fn add(&mut self, key: SlotKey, lease: leases::Lease) {
        let attempts = self.by_slot.entry(key.slot).or_default();
        attempts.push((key.attempt, lease));
        attempts.sort_by_key(|(attempt, _)| std::cmp::Reverse(*attempt));
    }

    fn spend(&mut self, key: &SlotKey) {
        let spent = self.spent.entry(key.slot).or_default();
        *spent = (*spent).max(key.attempt);
    }

    /// The attempt a new lease of `slot` is asked for under: above its
    /// current one (`after`) and above every key of this revision spent.
    pub(crate) fn next_attempt(&self, slot: u32, after: Option<u32>) -> u32 {
        let spent = self.spent.get(&slot).map(|spent| spent.saturating_add(1));
        after.map(|attempt| attempt.saturating_add(1)).max(spent).unwrap_or(0)
    }

    /// Whether it holds no lease at all, open or ended.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
    }

    /// The slot's current lease and its attempt.
    pub(crate) fn current(&self, slot: u32) -> Option<&(u32, leases::Lease)> {
        self.by_slot.get(&slot).and_then(|attempts| attempts.first())
    }

    /// Slots below `desired` whose current lease runs, or whose current
    /// lease is on its way to replace one that still runs (a replica moving
    /// off a draining node serves until its replacement does).
    pub(crate) fn running(&self, desired: u32) -> u32 {
        let runs = |lease: &leases::Lease| lease.phase() == LeasePhase::Running;
        let running = (0..desired).filter(|slot| {
            self.by_slot.get(slot).is_some_and(|attempts| match attempts.split_first() {
                Some(((_, current), _)) if runs(current) => true,
                Some(((_, current), older)) => is_open(current) && older.iter().any(|(_, lease)| runs(lease)),
                None => false,
            })
        });
        u32::try_from(running.count()).unwrap_or(u32::MAX)
    }

    pub(crate) fn open(&self) -> impl Iterator<Item = &leases::Lease> {
        self.by_slot.values().flatten().map(|(_, lease)| lease).filter(|lease| is_open(lease))
    }

    pub(crate) fn has_open(&self) -> bool {
        self.open().next().is_some()
    }
}

/// Leases grouped by the revision they serve as: the one `adopted` names
/// for a replica a later revision took over in place (by lease id), else
/// the one their key names.
pub(crate) fn group(
    leases: Vec<leases::Lease>,
    uid: &str,
    adopted: &HashMap<String, String>,
) -> BTreeMap<String, Slots> {
    let mut grouped: BTreeMap<String, Slots> = BTreeMap::new();
    for lease in leases {
        match SlotKey::decode(&lease.idempotency_key) {
            Some(key) if key.uid == uid => {
                grouped.entry(key.revision.clone()).or_default().spend(&key);
                let serves_as = adopted.get(&lease.lease_id).unwrap_or(&key.revision);
                grouped.entry(serves_as.clone()).or_default().add(key, lease);
            }
            _ => tracing::debug!(lease_id = %lease.lease_id, key = %lease.idempotency_key,
                "a lease of this owner with a key not minted here; left alone"),
        }
    }
    grouped
}

/// What maintaining one revision's leases ran into.
#[derive(Debug, Default)]
pub(crate) struct Upkeep {
    /// A request was refused for want of room; the message says what was short.
    pub(crate) no_room: Option<String>,
    /// A current lease of the revision failed, with its reason and message.
    pub(crate) failed: Option<(String, String)>,
    /// Something is still on its way (a lease asked for, placed but not running).
    pub(crate) settling: bool,
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
///
/// While a rollout toward `target` is in flight, every revision newer than
/// the live one is kept as well: which of them ends live is not settled, and
/// counting from a live revision about to be replaced would collect one the
/// settled service keeps. So what survives a burst of applies is the same
/// whatever moment each pass happened to see.
pub(crate) fn collectable(
    revisions: &[RevisionRow],
    live: &str,
    target: Option<&str>,
    protected: &HashSet<&str>,
    keep: usize,
    min_age_ms: i64,
    now_ms: i64,
) -> Vec<String> {
    let newest = revisions.first().map(|r| r.name.as_str());
    let rolling_out = target.is_some_and(|target| target != live);
    let unsettled = if rolling_out { revisions.iter().take_while(|r| r.name != live).count() } else { 0 };
    revisions
        .iter()
        .skip(unsettled)
        .filter(|r| r.name != live)
        .skip(keep.saturating_sub(unsettled))
        .filter(|r| Some(r.name.as_str()) != newest && !protected.contains(r.name.as_str()))
        .filter(|r| now_ms.saturating_sub(r.created_at_ms) >= min_age_ms)
        .map(|r| r.name.clone())
        .collect()
}

/// Where the rollout of the target stands after this pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Rollout {
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

/// Whether every slot of each of `needed` has an open lease in
/// `by_revision`: then nothing is to be asked for, and a view of the open
/// leases alone is enough to reconcile on.
pub(crate) fn served_by_open(by_revision: &BTreeMap<String, Slots>, needed: &[&RevisionRow]) -> bool {
    !needed.is_empty()
        && needed.iter().all(|revision| {
            let slots = by_revision.get(&revision.name);
            (0..replicas(&revision.template)).all(|slot| {
                slots.and_then(|s| s.current(slot)).is_some_and(|(_, lease)| is_open(lease) && !is_draining(lease))
            })
        })
}

/// What keeping one revision's slots filled asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct UpkeepPlan {
    /// Slots to ask a lease for, each under the key of its next attempt.
    pub(crate) requests: Vec<SlotKey>,
    /// Open leases to give back (by id): slots past the count, and older
    /// attempts of a slot whose current lease runs.
    pub(crate) releases: Vec<String>,
    /// A current lease failed and is not to be replaced: its reason and message.
    pub(crate) failed: Option<(String, String)>,
    /// Something is on its way (a lease to ask for, or placed but not running).
    pub(crate) settling: bool,
}

/// Keeps one lease per slot of `revision`: asks for missing ones and
/// replaces ended ones. A failed lease of a revision not yet live is not
/// replaced but reported, unless `replace_failed`. A lease on a draining
/// node is replaced before it goes (make before break): its slot's next
/// attempt is asked for (placement avoids draining nodes), and the old one
/// is given back once that one runs, as any older attempt is.
pub(crate) fn plan_upkeep(uid: &str, revision: &RevisionRow, slots: &Slots, replace_failed: bool) -> UpkeepPlan {
    let mut plan = UpkeepPlan::default();
    let desired = replicas(&revision.template);
    for slot in 0..desired {
        let attempt = match slots.current(slot) {
            None => slots.next_attempt(slot, None),
            Some((attempt, lease)) if is_draining(lease) => slots.next_attempt(slot, Some(*attempt)),
            Some((_, lease)) if is_open(lease) => {
                if lease.phase() != LeasePhase::Running {
                    plan.settling = true;
                }
                continue;
            }
            Some((_, lease)) if lease.phase() == LeasePhase::Failed && !replace_failed => {
                plan.failed = Some((lease.reason.clone(), lease.message.clone()));
                continue;
            }
            Some((attempt, _)) => slots.next_attempt(slot, Some(*attempt)),
        };
        plan.settling = true;
        plan.requests.push(SlotKey { revision: revision.name.clone(), uid: uid.to_owned(), slot, attempt });
    }
    // Slots past the count (never minted here, as a revision's count never changes) and
    // older attempts that came back to life are given back once their slot runs.
    for (slot, attempts) in &slots.by_slot {
        let slot_runs = attempts.first().is_some_and(|(_, lease)| lease.phase() == LeasePhase::Running);
        let stale = attempts
            .iter()
            .enumerate()
            .filter(|(n, (_, lease))| is_open(lease) && (*slot >= desired || (*n > 0 && slot_runs)));
        plan.releases.extend(stale.map(|(_, (_, lease))| lease.lease_id.clone()));
    }
    plan
}

/// Why a rollout cannot start: the revision failed before, or its bundle
/// has not resolved.
pub(crate) fn rollout_blocked(next: &RevisionRow) -> Option<Rollout> {
    if next.state == RevisionState::Failed {
        Some(Rollout::Failed)
    } else if !next.resolved() {
        Some(Rollout::Unresolved)
    } else {
        None
    }
}

/// What a rollout does next, after this pass's upkeep of its slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RolloutStep {
    /// Its replicas are on their way; nothing to write.
    Continue { no_room: Option<String> },
    /// Every replica runs: it becomes live with this many.
    GoLive { replicas: u32 },
    /// It failed; the live revision keeps serving.
    Fail { reason: &'static str, message: String },
}

/// Where the rollout of `next` (begun at `started_ms`) goes, given its slots
/// and what their upkeep ran into, at `now_ms`.
pub(crate) fn decide_rollout(
    next: &RevisionRow,
    slots: &Slots,
    upkeep: &Upkeep,
    started_ms: i64,
    now_ms: i64,
    progress_deadline: Duration,
) -> RolloutStep {
    if let Some((reason, message)) = &upkeep.failed {
        let message = format!("a replica failed to start ({reason}): {message}");
        return RolloutStep::Fail { reason: "ReplicaFailed", message };
    }
    let desired = replicas(&next.template);
    let running = slots.running(desired);
    if running == desired {
        return RolloutStep::GoLive { replicas: desired };
    }
    if now_ms.saturating_sub(started_ms) > millis(progress_deadline) {
        let mut message =
            format!("{running} of {desired} replicas ran within the progress deadline of {progress_deadline:?}");
        if let Some(short) = &upkeep.no_room {
            message.push_str(&format!("; {short}"));
        }
        return RolloutStep::Fail { reason: "ProgressDeadlineExceeded", message };
    }
    RolloutStep::Continue { no_room: upkeep.no_room.clone() }
}

/// How a rollout goes whose target differs from the live revision only in
/// its resources: the live replicas are resized in place and taken over,
/// so none restarts (see [`plan_in_place`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum InPlace {
    /// Ask these leases (id, epoch) to be resized to the target's size; the
    /// rest already are, or their nodes are applying it.
    Resize(Vec<(String, u64)>),
    /// Every replica has the target's size: the target takes these leases
    /// over and goes live.
    TakeOver(Vec<String>),
}

/// Whether `next` rolls out by resizing `live`'s replicas in place, and
/// what that needs now; `None` when it rolls out by replacement.
///
/// It does when `next` is newer than `live`, runs the same code the same
/// way (same digest, same template and source but for resources), has no
/// lease of its own (a replacement, once begun, goes on), and every slot
/// of `live` has exactly one open lease, running and not on a draining
/// node. A node that deferred the resize to `next`'s size (its runtime
/// cannot, or the memory is in use) sends the rollout back to replacement.
pub(crate) fn plan_in_place(
    live: &RevisionRow,
    next: &RevisionRow,
    live_slots: &Slots,
    next_slots: &Slots,
) -> Option<InPlace> {
    let same_work = next.generation > live.generation
        && next.digest == live.digest
        && next.source == live.source
        && differs_only_in_resources(&live.template, &next.template);
    if !same_work || !next_slots.is_empty() {
        return None;
    }
    let wanted = resources(&next.template);
    let desired = replicas(&live.template);
    let mut asks = Vec::new();
    let mut replicas = Vec::new();
    for slot in 0..desired {
        let attempts = live_slots.by_slot.get(&slot)?;
        let mut open = attempts.iter().filter(|(_, lease)| is_open(lease));
        let (Some((_, lease)), None) = (open.next(), open.next()) else { return None };
        if lease.phase() != LeasePhase::Running || is_draining(lease) {
            return None;
        }
        let asked = lease.resize.as_ref().filter(|resize| resize.resources == Some(wanted));
        if asked.is_some_and(|resize| resize.state() == leases::ResizeState::Deferred) {
            return None;
        }
        let pending = asked.is_some_and(|resize| resize.state() == leases::ResizeState::Pending);
        if lease.resources != Some(wanted) && !pending {
            asks.push((lease.lease_id.clone(), lease.epoch));
        }
        replicas.push(lease);
    }
    let sized = replicas.iter().all(|lease| lease.resources == Some(wanted));
    Some(if sized {
        InPlace::TakeOver(replicas.iter().map(|lease| lease.lease_id.clone()).collect())
    } else {
        InPlace::Resize(asks)
    })
}

/// Where a rollout by resizing in place goes while its nodes apply it:
/// on, until the progress deadline passes.
pub(crate) fn decide_in_place(
    next: &RevisionRow,
    started_ms: i64,
    now_ms: i64,
    progress_deadline: Duration,
) -> RolloutStep {
    if now_ms.saturating_sub(started_ms) > millis(progress_deadline) {
        let message = format!(
            "the replicas of {} were not all resized in place within the progress deadline of {progress_deadline:?}",
            next.name
        );
        return RolloutStep::Fail { reason: "ProgressDeadlineExceeded", message };
    }
    RolloutStep::Continue { no_room: None }
}

/// The ids of every open lease in `by_revision`.
pub(crate) fn open_ids(by_revision: &BTreeMap<String, Slots>) -> HashSet<&str> {
    by_revision.values().flat_map(Slots::open).map(|lease| lease.lease_id.as_str()).collect()
}

/// The replicas serving as another revision than their lease names once
/// `revision` took over `taken`: those recorded before whose leases are
/// still open, and the new ones.
pub(crate) fn adopted_after(
    before: &HashMap<String, String>,
    open: &HashSet<&str>,
    revision: &str,
    taken: &[String],
) -> HashMap<String, String> {
    let mut after: HashMap<String, String> = before
        .iter()
        .filter(|(lease_id, _)| open.contains(lease_id.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    after.extend(taken.iter().map(|lease_id| (lease_id.clone(), revision.to_owned())));
    after
}

/// What giving back the revisions no longer needed means.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ReleasePlan {
    /// Open leases to release: revision, lease id, and the reason recorded.
    pub(crate) releases: Vec<(String, String, &'static str)>,
    /// Revisions whose rollout was under way and stops.
    pub(crate) stop_rollouts: Vec<String>,
}

/// The revisions the traffic split names beside the live one and the
/// rollout's target, that can run (resolved, not failed).
pub(crate) fn split_revisions<'a>(
    service: &ServiceRow,
    revisions: &'a [RevisionRow],
    live: Option<&RevisionRow>,
    target: Option<&RevisionRow>,
) -> Vec<&'a RevisionRow> {
    let others = [live, target].map(|r| r.map(|r| r.name.as_str()));
    crate::traffic::named(&service.traffic)
        .into_iter()
        .filter(|name| !others.contains(&Some(*name)))
        .filter_map(|name| revisions.iter().find(|r| r.name == name))
        .filter(|r| r.resolved() && r.state != RevisionState::Failed)
        .collect()
}

/// How long a revision traffic left keeps its replicas: until every live
/// router serves a route generation without it, for at most `drain_ms`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Drain<'a> {
    pub(crate) now_ms: i64,
    pub(crate) drain_ms: i64,
    /// The live routers' acknowledgements of this service's routes.
    pub(crate) routers: &'a [RouterAck],
}

/// How soon a pass waiting on routers' acknowledgements looks again when
/// none wakes it: what notices a router that died holding a drain.
pub(crate) const ACK_RECHECK_MS: i64 = 1_000;

/// The revisions whose leases this pass keeps: the live one, every one the
/// traffic split names, the target while it rolls out, and any that stopped
/// taking traffic, still holds open leases, and is not yet out of every
/// router's routes while its drain lasts; and, when one is draining, how
/// many milliseconds until this pass should look again.
pub(crate) fn kept<'a>(
    service: &'a ServiceRow,
    revisions: &'a [RevisionRow],
    live: Option<&'a RevisionRow>,
    target: Option<&'a RevisionRow>,
    rollout: &Rollout,
    by_revision: &BTreeMap<String, Slots>,
    drain: Drain<'_>,
) -> (HashSet<&'a str>, Option<i64>) {
    let mut keep: HashSet<&str> = HashSet::new();
    keep.extend(live.map(|r| r.name.as_str()));
    keep.extend(crate::traffic::named(&service.traffic));
    if matches!(rollout, Rollout::InProgress { .. }) {
        keep.extend(target.map(|r| r.name.as_str()));
    }
    let mut drained_in: Option<i64> = None;
    for draining in revisions {
        let holds = by_revision.get(&draining.name).is_some_and(Slots::has_open);
        let unrouted = draining.unrouted_generation.is_some_and(|g| all_serve(drain.routers, g));
        if holds && !unrouted && draining.draining(drain.now_ms, drain.drain_ms) && keep.insert(draining.name.as_str())
        {
            let left = draining
                .unrouted_at_ms
                .unwrap_or(drain.now_ms)
                .saturating_add(drain.drain_ms)
                .saturating_sub(drain.now_ms)
                .min(ACK_RECHECK_MS);
            drained_in = Some(drained_in.map_or(left, |d| d.min(left)));
        }
    }
    (keep, drained_in)
}

/// Gives back every revision but those in `keep`: its open leases
/// (`RolloutFailed` for the revision traffic fell back from, else
/// `Superseded`), and the rollout of one still pending.
pub(crate) fn plan_release(
    by_revision: &BTreeMap<String, Slots>,
    revisions: &[RevisionRow],
    keep: &HashSet<&str>,
    failed: Option<&RevisionRow>,
) -> ReleasePlan {
    let mut plan = ReleasePlan::default();
    for (revision, slots) in by_revision {
        if keep.contains(revision.as_str()) {
            continue;
        }
        let reason = if failed.is_some_and(|f| f.name == *revision) { "RolloutFailed" } else { "Superseded" };
        plan.releases.extend(slots.open().map(|lease| (revision.clone(), lease.lease_id.clone(), reason)));
        if let Some(row) = revisions.iter().find(|r| r.name == *revision)
            && row.rollout_started_at_ms.is_some()
            && row.state == RevisionState::Pending
        {
            plan.stop_rollouts.push(revision.clone());
        }
    }
    plan
}

/// The status a pass reports: replica counts of the live revision (or the
/// one on its way when none is live), each revision's running count, and
/// the conditions.
pub(crate) fn status_report(
    service: &ServiceRow,
    by_revision: &BTreeMap<String, Slots>,
    pass: &Pass<'_>,
) -> StatusReport {
    let revisions = pass.revisions;
    let desired = pass.live.or(pass.target).map_or(0, |r| replicas(&r.template));
    let running = pass.live.map_or(0, |l| by_revision.get(&l.name).map_or(0, |s| s.running(replicas(&l.template))));
    StatusReport {
        uid: service.uid.clone(),
        latest_created: revisions.first().map(|r| r.name.clone()).unwrap_or_default(),
        observed_generation: service.generation,
        replicas_running: running,
        replicas_desired: desired,
        conditions: pass.conditions(running, desired),
        revision_running: revisions
            .iter()
            .map(|r| {
                let count = by_revision.get(&r.name).map_or(0, |s| s.running(replicas(&r.template)));
                (r.name.clone(), i64::from(count))
            })
            .collect(),
        adoptions_ended: {
            let open = open_ids(by_revision);
            let mut ended: Vec<String> =
                service.status.adopted_replicas.keys().filter(|id| !open.contains(id.as_str())).cloned().collect();
            ended.sort();
            ended
        },
    }
}

/// What one pass saw and did, from which the service's conditions are read.
#[derive(Debug)]
pub(crate) struct Pass<'a> {
    pub(crate) revisions: &'a [RevisionRow],
    pub(crate) live: Option<&'a RevisionRow>,
    pub(crate) target: Option<&'a RevisionRow>,
    /// The revision whose failure traffic fell back from, if any.
    pub(crate) failed: Option<&'a RevisionRow>,
    pub(crate) rollout: &'a Rollout,
    pub(crate) live_upkeep: &'a Upkeep,
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
pub(crate) mod tests {
    use berth_proto::revisions::v1;

    use super::*;
    use crate::model::ServiceKey;

    pub(crate) const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn key() -> ServiceKey {
        ServiceKey::new("default", "web")
    }

    /// A resolved revision row of `web`, for tests.
    pub(crate) fn row(name: &str, generation: i64, state: RevisionState, created_at_ms: i64) -> RevisionRow {
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
            unrouted_at_ms: None,
            unrouted_generation: None,
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
        let service = |pinned: &str| ServiceRow { pinned_revision: pinned.into(), ..service_row("web-00002") };
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
        let doomed = collectable(&revisions, "web-00005", Some("web-00005"), &none, 2, 0, 100_000);
        assert_eq!(doomed, ["web-00006", "web-00004", "web-00003", "web-00002", "web-00001"]);
        // Younger than the minimum age: kept.
        let doomed = collectable(&revisions, "web-00005", Some("web-00005"), &none, 2, 96_500, 100_000);
        assert_eq!(doomed, ["web-00003", "web-00002", "web-00001"]);
        // Pinned (or holding leases): kept.
        let protected: HashSet<&str> = ["web-00002"].into();
        let doomed = collectable(&revisions, "web-00005", Some("web-00005"), &protected, 2, 0, 100_000);
        assert!(!doomed.contains(&"web-00002".to_owned()));
        // Keeping none still keeps the newest.
        let doomed = collectable(&revisions, "web-00005", Some("web-00005"), &none, 0, 0, 100_000);
        assert!(!doomed.contains(&"web-00008".to_owned()));
        assert_eq!(doomed.len(), 6);
        // Rolling out from web-00005 to web-00008: nothing newer than live is
        // collected, and those newer ones count towards the newest two.
        let doomed = collectable(&revisions, "web-00005", Some("web-00008"), &none, 2, 0, 100_000);
        assert_eq!(doomed, ["web-00004", "web-00003", "web-00002", "web-00001"]);
        // Nothing live yet: every revision is still on its way.
        let doomed = collectable(&revisions, "", Some("web-00008"), &none, 2, 0, 100_000);
        assert!(doomed.is_empty(), "{doomed:?}");
    }

    #[test]
    fn a_pass_keeps_the_live_revision_the_split_the_rollout_and_what_drains_until_its_drain_ends() {
        let mut revisions = vec![
            row("web-00004", 4, RevisionState::Pending, 0),
            row("web-00003", 3, RevisionState::Ready, 0),
            row("web-00002", 2, RevisionState::Ready, 0),
            row("web-00001", 1, RevisionState::Ready, 0),
        ];
        // web-00002 stopped taking traffic at 1,000 and web-00001 at 500.
        revisions[2].unrouted_at_ms = Some(1_000);
        revisions[3].unrouted_at_ms = Some(500);
        let split = |names: &[&str]| ServiceRow {
            traffic: names
                .iter()
                .map(|n| v1::TrafficTarget { revision: (*n).into(), percent: 0, ..Default::default() })
                .collect(),
            ..service_row("web-00003")
        };
        let open = slots(&[(0, 0, Running)]);
        let every: BTreeMap<String, Slots> = revisions.iter().map(|r| (r.name.clone(), open.clone())).collect();
        let live = Some(&revisions[1]);
        let target = Some(&revisions[0]);
        let rolling = Rollout::InProgress { no_room: None };
        let sorted = |held: HashSet<&str>| {
            let mut held: Vec<String> = held.into_iter().map(str::to_owned).collect();
            held.sort_unstable();
            held
        };

        // (split, rollout, leases held, now) => (kept, next look in)
        let at = |now_ms: i64| Drain { now_ms, drain_ms: 1_000, routers: &[] };
        let service = split(&[]);
        let (held, drained_in) = kept(&service, &revisions, live, target, &rolling, &every, at(1_200));
        assert_eq!(sorted(held), ["web-00001", "web-00002", "web-00003", "web-00004"]);
        assert_eq!(drained_in, Some(300), "web-00001's drain ends first, at 1,500");
        let (held, drained_in) = kept(&service, &revisions, live, target, &Rollout::Settled, &every, at(1_600));
        assert_eq!(sorted(held), ["web-00002", "web-00003"], "drained and not rolling out: given back");
        assert_eq!(drained_in, Some(400));
        let (held, drained_in) = kept(&service, &revisions, live, target, &Rollout::Settled, &every, at(2_000));
        assert_eq!(sorted(held), ["web-00003"]);
        assert_eq!(drained_in, None);
        // A split keeps what it names, drained or not; a revision holding no
        // open lease has nothing to drain.
        let service = split(&["web-00001"]);
        let none: BTreeMap<String, Slots> = BTreeMap::new();
        let (held, drained_in) = kept(&service, &revisions, live, target, &Rollout::Settled, &none, at(1_200));
        assert_eq!(sorted(held), ["web-00001", "web-00003"]);
        assert_eq!(drained_in, None);
    }

    #[test]
    fn a_revision_traffic_left_drains_until_every_live_router_serves_routes_without_it() {
        let mut revisions =
            vec![row("web-00002", 2, RevisionState::Ready, 0), row("web-00001", 1, RevisionState::Ready, 0)];
        // web-00001 left the routes at generation 5, at 1,000 on a 30,000 drain.
        revisions[1].unrouted_at_ms = Some(1_000);
        revisions[1].unrouted_generation = Some(5);
        let service = ServiceRow { route_generation: 5, ..service_row("web-00002") };
        let open = slots(&[(0, 0, Running)]);
        let every: BTreeMap<String, Slots> = revisions.iter().map(|r| (r.name.clone(), open.clone())).collect();
        let router = |name: &str, generation: i64| RouterAck {
            router: name.into(),
            instance: String::new(),
            generation,
            acked_at_ms: 1_000,
        };
        let live = Some(&revisions[0]);
        let pass = |routers: &[RouterAck], now_ms: i64| {
            let drain = Drain { now_ms, drain_ms: 30_000, routers };
            let (held, next) = kept(&service, &revisions, live, live, &Rollout::Settled, &every, drain);
            (held.contains("web-00001"), next)
        };

        // (routers and what they serve, now) => (web-00001 kept, next look in)
        assert_eq!(
            pass(&[router("a", 5), router("b", 4)], 1_200),
            (true, Some(ACK_RECHECK_MS)),
            "b still routes to it"
        );
        assert_eq!(pass(&[router("a", 5), router("b", 0)], 1_200), (true, Some(ACK_RECHECK_MS)), "b acked nothing yet");
        assert_eq!(pass(&[router("a", 5), router("b", 6)], 1_200), (false, None), "every router moved past it");
        assert_eq!(pass(&[], 1_200), (false, None), "no router alive: nothing routes to it");
        assert_eq!(pass(&[router("b", 4)], 30_500), (true, Some(500)), "the drain bounds the wait");
        assert_eq!(pass(&[router("b", 4)], 31_000), (false, None), "and ends it");
    }

    /// Service `web` (uid `u`) with `live` live, and nothing else set.
    pub(crate) fn service_row(live: &str) -> ServiceRow {
        ServiceRow {
            key: key(),
            uid: "u".into(),
            generation: 1,
            template: v1::ServiceTemplate::default(),
            source: v1::Source::default(),
            pinned_revision: String::new(),
            traffic: Vec::new(),
            affinity: None,
            live_revision: live.into(),
            status: v1::ServiceStatus::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            version: 1,
            route_generation: 0,
        }
    }

    /// The slots of `web-00001` (uid `u`) holding leases given as
    /// `(slot, attempt, phase)`, each with id `l<slot>.<attempt>`.
    fn slots(leases: &[(u32, u32, LeasePhase)]) -> Slots {
        let leases = leases
            .iter()
            .map(|&(slot, attempt, phase)| {
                let key = SlotKey { revision: "web-00001".into(), uid: "u".into(), slot, attempt };
                let mut lease = leases::Lease {
                    lease_id: format!("l{slot}.{attempt}"),
                    idempotency_key: key.encode(),
                    reason: if phase == LeasePhase::Failed { "Exited".into() } else { String::new() },
                    ..Default::default()
                };
                lease.set_phase(phase);
                lease
            })
            .collect();
        group(leases, "u", &HashMap::new()).remove("web-00001").unwrap_or_default()
    }

    fn capacity(memory_mib: u64) -> berth_proto::types::v1::Capacity {
        berth_proto::types::v1::Capacity { cpu_millis: 100, memory_bytes: memory_mib << 20 }
    }

    /// `web-00001` live with two replicas of 128 MiB, and `web-00002` of
    /// `memory_mib`; each lease as `edit` leaves it.
    fn resized(memory_mib: u64, edit: impl Fn(u32, &mut leases::Lease)) -> (RevisionRow, RevisionRow, Slots) {
        let mut live = row("web-00001", 1, RevisionState::Ready, 0);
        live.template.replicas = Some(2);
        live.template.resources = Some(capacity(128));
        let mut next = row("web-00002", 2, RevisionState::Pending, 0);
        next.template = v1::ServiceTemplate { resources: Some(capacity(memory_mib)), ..live.template.clone() };
        let leases = (0..2)
            .map(|slot| {
                let key = SlotKey { revision: "web-00001".into(), uid: "u".into(), slot, attempt: 0 };
                let mut lease = leases::Lease {
                    lease_id: format!("l{slot}"),
                    epoch: 3,
                    idempotency_key: key.encode(),
                    resources: Some(capacity(128)),
                    ..Default::default()
                };
                lease.set_phase(LeasePhase::Running);
                edit(slot, &mut lease);
                lease
            })
            .collect();
        let slots = group(leases, "u", &HashMap::new()).remove("web-00001").unwrap_or_default();
        (live, next, slots)
    }

    fn resize(memory_mib: u64, state: leases::ResizeState) -> Option<leases::LeaseResize> {
        Some(leases::LeaseResize { resources: Some(capacity(memory_mib)), state: state as i32, ..Default::default() })
    }

    #[test]
    fn a_change_of_resources_alone_resizes_the_live_replicas_in_place_and_takes_them_over() {
        use leases::ResizeState::{Applied, Deferred, Pending};
        let none = Slots::default();
        let asks = |ids: &[&str]| InPlace::Resize(ids.iter().map(|id| ((*id).to_owned(), 3)).collect());

        // Nothing resized yet: both are asked for.
        let (live, next, slots) = resized(256, |_, _| {});
        assert_eq!(plan_in_place(&live, &next, &slots, &none), Some(asks(&["l0", "l1"])));
        // One on its way: only the other is asked for; then neither while both apply.
        let (live, next, slots) = resized(256, |slot, l| {
            if slot == 0 {
                l.resize = resize(256, Pending)
            }
        });
        assert_eq!(plan_in_place(&live, &next, &slots, &none), Some(asks(&["l1"])));
        let (live, next, slots) = resized(256, |_, l| l.resize = resize(256, Pending));
        assert_eq!(plan_in_place(&live, &next, &slots, &none), Some(asks(&[])));
        // A pending resize to another size (an earlier apply's) is asked again.
        let (live, next, slots) = resized(256, |_, l| l.resize = resize(512, Pending));
        assert_eq!(plan_in_place(&live, &next, &slots, &none), Some(asks(&["l0", "l1"])));
        // Both applied: the target takes them over.
        let (live, next, slots) = resized(256, |_, l| {
            l.resize = resize(256, Applied);
            l.resources = Some(capacity(256));
        });
        let took = InPlace::TakeOver(vec!["l0".into(), "l1".into()]);
        assert_eq!(plan_in_place(&live, &next, &slots, &none), Some(took));

        // A node deferred it: replacement instead.
        let (live, next, slots) = resized(64, |slot, l| {
            if slot == 1 {
                l.resize = resize(64, Deferred)
            }
        });
        assert_eq!(plan_in_place(&live, &next, &slots, &none), None);
        // A replica not running, or on a draining node, or a slot with two open leases: replacement.
        let (live, next, slots) = resized(256, |slot, l| {
            if slot == 1 {
                l.set_phase(LeasePhase::Launching)
            }
        });
        assert_eq!(plan_in_place(&live, &next, &slots, &none), None);
        let (live, next, slots) = resized(256, |slot, l| {
            if slot == 1 {
                l.reason = berth_core::NODE_DRAINING.into()
            }
        });
        assert_eq!(plan_in_place(&live, &next, &slots, &none), None);
        // Once the target has a lease of its own, its replacement goes on.
        let (live, next, slots) = resized(256, |_, _| {});
        let (_, _, own) = resized(256, |_, _| {});
        assert_eq!(plan_in_place(&live, &next, &slots, &own), None);

        // Anything else changed, or an older target: replacement.
        let (live, mut next, slots) = resized(256, |_, _| {});
        next.template.env.insert("VERSION".into(), "2".into());
        assert_eq!(plan_in_place(&live, &next, &slots, &none), None);
        let (live, mut next, slots) = resized(256, |_, _| {});
        next.template.replicas = Some(3);
        assert_eq!(plan_in_place(&live, &next, &slots, &none), None);
        let (live, mut next, slots) = resized(256, |_, _| {});
        next.digest = "sha256:other".into();
        assert_eq!(plan_in_place(&live, &next, &slots, &none), None, "the tag moved to other code");
        let (live, mut next, slots) = resized(256, |_, _| {});
        next.generation = 0;
        assert_eq!(plan_in_place(&live, &next, &slots, &none), None, "a rollback to an older revision");
    }

    #[test]
    fn replicas_taken_over_count_as_the_revision_they_serve_and_keys_once_spent_are_not_asked_again() {
        // web-00002 took l0 (keyed web-00001 slot 0 attempt 0) over.
        let key = SlotKey { revision: "web-00001".into(), uid: "u".into(), slot: 0, attempt: 0 };
        let mut lease = leases::Lease { lease_id: "l0".into(), idempotency_key: key.encode(), ..Default::default() };
        lease.set_phase(LeasePhase::Running);
        let adopted: HashMap<String, String> = [("l0".to_owned(), "web-00002".to_owned())].into();
        let grouped = group(vec![lease.clone()], "u", &adopted);
        assert_eq!(grouped["web-00002"].current(0).map(|(_, l)| l.lease_id.as_str()), Some("l0"));
        assert!(!grouped["web-00001"].has_open());
        // web-00001 rolled back to asks above the key its old replica holds.
        let mut old = row("web-00001", 1, RevisionState::Ready, 0);
        old.template.replicas = Some(1);
        let plan = plan_upkeep("u", &old, &grouped["web-00001"], true);
        assert_eq!(plan.requests.iter().map(SlotKey::encode).collect::<Vec<_>>(), ["web-00001/u/0/1"]);
        // The record of a replica whose lease ended is dropped at the next take-over.
        let open: HashSet<&str> = HashSet::new();
        let after = adopted_after(&adopted, &open, "web-00003", &["l7".to_owned()]);
        assert_eq!(after, [("l7".to_owned(), "web-00003".to_owned())].into());
    }

    fn revision(replicas: u32) -> RevisionRow {
        let mut revision = row("web-00001", 1, RevisionState::Pending, 0);
        revision.template.replicas = Some(replicas);
        revision
    }

    fn requested(plan: &UpkeepPlan) -> Vec<(u32, u32)> {
        plan.requests.iter().map(|key| (key.slot, key.attempt)).collect()
    }

    use LeasePhase::{Bound, Done, Expired, Failed, Running};

    #[test]
    fn upkeep_fills_each_slot_once_and_replaces_only_what_ended() {
        // (leases held, replace a failed one?) => (slots asked for with their attempt, released, failed?, settling)
        type Row =
            (&'static [(u32, u32, LeasePhase)], bool, &'static [(u32, u32)], &'static [&'static str], bool, bool);
        let table: &[Row] = &[
            // Nothing yet: every slot asked for at attempt 0.
            (&[], false, &[(0, 0), (1, 0), (2, 0)], &[], false, true),
            // Placed but not running: nothing asked, still settling.
            (&[(0, 0, Bound), (1, 0, Running), (2, 0, Running)], false, &[], &[], false, true),
            // All running: settled, nothing to do.
            (&[(0, 0, Running), (1, 0, Running), (2, 0, Running)], false, &[], &[], false, false),
            // Ended (expired, done): the next attempt of that slot only.
            (&[(0, 3, Expired), (1, 0, Done), (2, 0, Running)], false, &[(0, 4), (1, 1)], &[], false, true),
            // A failed lease of a revision not yet live is reported, not replaced.
            (&[(0, 0, Failed), (1, 0, Running), (2, 0, Running)], false, &[], &[], true, false),
            // ... and of the live revision, replaced.
            (&[(0, 0, Failed), (1, 0, Running), (2, 0, Running)], true, &[(0, 1)], &[], false, true),
            // An older attempt back to life is given back once the slot runs, not before.
            (
                &[(0, 0, Running), (0, 1, Running), (1, 0, Running), (2, 0, Running)],
                false,
                &[],
                &["l0.0"],
                false,
                false,
            ),
            (&[(0, 0, Running), (0, 1, Bound), (1, 0, Running), (2, 0, Running)], false, &[], &[], false, true),
            // A slot past the count is given back.
            (
                &[(0, 0, Running), (1, 0, Running), (2, 0, Running), (3, 0, Running)],
                false,
                &[],
                &["l3.0"],
                false,
                false,
            ),
        ];
        for (n, (held, replace_failed, asks, releases, failed, settling)) in table.iter().enumerate() {
            let plan = plan_upkeep("u", &revision(3), &slots(held), *replace_failed);
            assert_eq!(requested(&plan), *asks, "row {n}: asked");
            assert_eq!(plan.releases, *releases, "row {n}: released");
            assert_eq!(plan.failed.is_some(), *failed, "row {n}: failed");
            assert_eq!(plan.settling, *settling, "row {n}: settling");
            assert!(plan.requests.iter().all(|key| key.uid == "u" && key.revision == "web-00001"), "row {n}");
        }
    }

    #[test]
    fn a_replica_on_a_draining_node_is_replaced_before_it_is_given_back() {
        let drain = |slots: &mut Slots, slot: u32, attempt: usize| {
            slots.by_slot.get_mut(&slot).unwrap()[attempt].1.reason = berth_core::NODE_DRAINING.into();
        };
        // Told its node drains: the slot's next attempt is asked for; the old one stays.
        let mut held = slots(&[(0, 0, Running), (1, 0, Running)]);
        drain(&mut held, 1, 0);
        let plan = plan_upkeep("u", &revision(2), &held, true);
        assert_eq!((requested(&plan), plan.releases.clone(), plan.settling), (vec![(1, 1)], vec![], true));
        assert!(!served_by_open(&[("web-00001".to_string(), held.clone())].into(), &[&revision(2)]));
        assert_eq!(held.running(2), 2);
        // The replacement placed, not yet running: nothing more asked, nothing given back, both still count.
        let mut moving = slots(&[(0, 0, Running), (1, 0, Running), (1, 1, Bound)]);
        drain(&mut moving, 1, 1);
        let plan = plan_upkeep("u", &revision(2), &moving, true);
        assert_eq!((requested(&plan), plan.releases.clone(), plan.settling), (vec![], vec![], true));
        assert_eq!(moving.running(2), 2, "the old replica serves until its replacement does");
        // The replacement runs: the old one is given back.
        let mut moved = slots(&[(0, 0, Running), (1, 0, Running), (1, 1, Running)]);
        drain(&mut moved, 1, 1);
        let plan = plan_upkeep("u", &revision(2), &moved, true);
        assert_eq!((requested(&plan), plan.releases.clone(), plan.settling), (vec![], vec!["l1.0".to_string()], false));
    }

    #[test]
    fn a_rollout_goes_live_when_every_replica_runs_and_fails_on_a_failed_replica_or_the_deadline() {
        const DEADLINE: Duration = Duration::from_secs(60);
        let running = slots(&[(0, 0, Running), (1, 0, Running)]);
        let half = slots(&[(0, 0, Running), (1, 0, Bound)]);
        let short = Upkeep { no_room: Some("no node has 4 CPUs free".into()), ..Upkeep::default() };
        let failed = Upkeep { failed: Some(("Exited".into(), "exit code 1".into())), ..Upkeep::default() };
        let fine = Upkeep::default();
        let decide = |slots: &Slots, upkeep: &Upkeep, elapsed_ms: i64| {
            decide_rollout(&revision(2), slots, upkeep, 1_000, 1_000 + elapsed_ms, DEADLINE)
        };
        assert_eq!(decide(&running, &fine, 0), RolloutStep::GoLive { replicas: 2 });
        assert_eq!(decide(&half, &fine, 59_000), RolloutStep::Continue { no_room: None });
        assert_eq!(decide(&half, &short, 0), RolloutStep::Continue { no_room: short.no_room.clone() });
        match decide(&half, &short, 61_000) {
            RolloutStep::Fail { reason: "ProgressDeadlineExceeded", message } => {
                assert!(
                    message.starts_with("1 of 2 replicas ran within") && message.ends_with("4 CPUs free"),
                    "{message}"
                );
            }
            other => panic!("past the deadline: {other:?}"),
        }
        match decide(&running, &failed, 0) {
            RolloutStep::Fail { reason: "ReplicaFailed", message } => {
                assert_eq!(message, "a replica failed to start (Exited): exit code 1");
            }
            other => panic!("a failed replica fails the rollout, even with the rest running: {other:?}"),
        }
    }

    #[test]
    fn a_rollout_waits_for_its_bundle_and_never_restarts_a_failed_revision() {
        let mut unresolved = revision(1);
        unresolved.digest.clear();
        assert_eq!(rollout_blocked(&unresolved), Some(Rollout::Unresolved));
        let mut failed = revision(1);
        failed.state = RevisionState::Failed;
        assert_eq!(rollout_blocked(&failed), Some(Rollout::Failed));
        assert_eq!(rollout_blocked(&revision(1)), None);
    }

    #[test]
    fn every_revision_not_kept_gives_back_its_open_leases_and_stops_its_rollout() {
        let mut by_revision = BTreeMap::new();
        for (revision, phases) in
            [("web-00001", [Running, Running]), ("web-00002", [Running, Bound]), ("web-00003", [Bound, Done])]
        {
            let leases = phases
                .iter()
                .enumerate()
                .map(|(slot, &phase)| {
                    let slot = u32::try_from(slot).unwrap();
                    let key = SlotKey { revision: revision.into(), uid: "u".into(), slot, attempt: 0 };
                    let mut lease = leases::Lease {
                        lease_id: format!("{revision}.{slot}"),
                        idempotency_key: key.encode(),
                        ..Default::default()
                    };
                    lease.set_phase(phase);
                    lease
                })
                .collect();
            by_revision.extend(group(leases, "u", &HashMap::new()));
        }
        let mut rolling = row("web-00003", 3, RevisionState::Pending, 0);
        rolling.rollout_started_at_ms = Some(5);
        let mut failed = row("web-00002", 2, RevisionState::Failed, 0);
        failed.rollout_started_at_ms = Some(4);
        let revisions = [rolling, failed.clone(), row("web-00001", 1, RevisionState::Ready, 0)];
        let keep: HashSet<&str> = ["web-00001"].into();

        let plan = plan_release(&by_revision, &revisions, &keep, Some(&failed));
        let released: Vec<(&str, &str, &str)> =
            plan.releases.iter().map(|(r, l, why)| (r.as_str(), l.as_str(), *why)).collect();
        assert_eq!(
            released,
            [
                ("web-00002", "web-00002.0", "RolloutFailed"),
                ("web-00002", "web-00002.1", "RolloutFailed"),
                ("web-00003", "web-00003.0", "Superseded"),
            ],
            "the kept revision's leases stay; an ended lease is not released again"
        );
        assert_eq!(plan.stop_rollouts, ["web-00003"], "a failed revision's rollout is over already");
    }
}
