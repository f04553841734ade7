//! KeepAlive: renews every lease the node holds in one `RenewLeases` batch,
//! every third of the leases service's TTL, on a task of its own.
//!
//! # Invariants
//! - Nothing here waits on a workload or the provider: the set to renew is
//!   read from a watch the runner publishes, and leases reported lost are
//!   handed back over a channel that never blocks. A slow destroy cannot
//!   make the node miss a renewal.
//! - While the runner publishes no set (the session ended, or the node has
//!   not reconciled yet) nothing is renewed: a lease renewed at a stale
//!   epoch would be reported lost.
//! - A failed batch is retried with backoff, but never later than the next
//!   regular renewal would have gone out.
//! - The stop-after-disconnect clock belongs to one stint of holding
//!   leases: a session's, from its first lease until it holds none. A stint
//!   starts with a renewal at once (leases just reconciled after a restart
//!   or a rejoin, or the first placed after none), and the first TTL the
//!   service says shortens the interval guessed until then at once: the
//!   clock always runs from a renewal the service has seen in that stint,
//!   never from one an interval late or an earlier stint's.
//! - A renewal unanswered past the next regular one, or past the
//!   stop-after-disconnect bound, counts as failed: a cut link hangs a call
//!   on an open connection until TCP gives up, far past the bound.
//! - With a stop-after-disconnect bound, leases whose renewals have failed
//!   for that long are handed back as lost (`ControlPlaneLost`), so the node
//!   stops running what the leases service has, by then, most likely given
//!   to another node. Without one, a node that cannot reach the service
//!   keeps running its work until it can.

use std::time::Duration;

use berth_proto::leases::v1::{LeaseRef, RenewLeasesRequest};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::leases_client::NodeLeasesApi;
use berth_core::backoff::Backoff;

/// The shortest renewal interval, whatever the TTL, so a tiny TTL never
/// makes the node spin.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(20);

/// The least time one renewal is given to be answered, even right at the
/// stop-after-disconnect bound: a reachable service answers within it.
const MIN_ANSWER_WITHIN: Duration = Duration::from_millis(500);

/// Leases to take off the node, and why (the removal reason the runner
/// records: one CamelCase word).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lost {
    pub(crate) leases: Vec<LeaseRef>,
    pub(crate) reason: &'static str,
}

/// The leases service said these leases are no longer the node's.
pub(crate) const LEASE_LOST: &str = "LeaseLost";

/// Renewals failed for longer than the stop-after-disconnect bound.
pub(crate) const CONTROL_PLANE_LOST: &str = "ControlPlaneLost";

/// What to renew, as the runner publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RenewSet {
    /// The node, as its current session names it.
    pub(crate) node_id: String,
    /// The session's incarnation: a new one starts the renewal clock afresh.
    pub(crate) incarnation: u64,
    /// Every lease the node holds, at the epoch it holds it.
    pub(crate) leases: Vec<LeaseRef>,
}

/// The renewal task's state; [`KeepAlive::run`] owns it until shutdown.
pub(crate) struct KeepAlive {
    pub(crate) leases: std::sync::Arc<dyn NodeLeasesApi>,
    /// What to renew; `None` while nothing may be.
    pub(crate) renewals: watch::Receiver<Option<RenewSet>>,
    /// The leases service's TTL, once it said (on the assignment stream).
    pub(crate) ttl: watch::Receiver<Option<Duration>>,
    /// Where leases reported lost go.
    pub(crate) lost: mpsc::UnboundedSender<Lost>,
    /// How long renewals may fail before the node stops what it runs;
    /// `None` never stops it.
    pub(crate) stop_after_disconnect: Option<Duration>,
    /// The interval until the TTL is known.
    pub(crate) default_interval: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) shutdown: CancellationToken,
}

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeepAlive").field("default_interval", &self.default_interval).finish_non_exhaustive()
    }
}

impl KeepAlive {
    /// The regular interval: a third of the TTL once known.
    fn interval(&self, answered_ttl: Option<Duration>) -> Duration {
        match answered_ttl.or(*self.ttl.borrow()) {
            Some(ttl) => (ttl / 3).max(MIN_RENEW_INTERVAL),
            None => self.default_interval.max(MIN_RENEW_INTERVAL),
        }
    }

    /// How long one renewal may go unanswered before it counts as failed:
    /// never past the next regular renewal, and never past the
    /// stop-after-disconnect bound counted from `since` (the last renewal
    /// that went through). A connection whose peer vanished (a cut link)
    /// fails no call until TCP gives up, long after the RPC timeout; without
    /// this the node would notice the bound only when that call ended.
    fn answer_within(&self, interval: Duration, since: Option<Instant>) -> Duration {
        let to_bound = self
            .stop_after_disconnect
            .zip(since)
            .map(|(bound, since)| (since + bound).saturating_duration_since(Instant::now()));
        to_bound.map_or(interval, |left| left.clamp(MIN_ANSWER_WITHIN, interval.max(MIN_ANSWER_WITHIN)))
    }

    /// Renews until shutdown.
    pub(crate) async fn run(mut self) {
        let mut answered_ttl = None;
        let mut clock = Clock::default();
        let mut attempted_at = Instant::now();
        let mut next_at = attempted_at + self.interval(answered_ttl);
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                () = tokio::time::sleep_until(next_at) => {}
                changed = self.renewals.changed() => {
                    // The runner gone means shutdown.
                    if changed.is_err() {
                        return;
                    }
                    if clock.observe(self.renewals.borrow_and_update().as_ref()) {
                        next_at = Instant::now();
                    }
                    continue;
                }
                changed = self.ttl.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // The first TTL the service said shortens the interval
                    // guessed until then; the renewal due is not put off.
                    next_at = next_at.min(attempted_at + self.interval(answered_ttl));
                    continue;
                }
            }
            attempted_at = Instant::now();
            let interval = self.interval(answered_ttl);
            let set = self.renewals.borrow_and_update().clone();
            // A session that changed while a renewal was on its way (its
            // `None` never seen) starts its clock here.
            clock.observe(set.as_ref());
            let Some(set) = set.filter(|set| !set.leases.is_empty()) else {
                next_at = attempted_at + interval;
                continue;
            };
            let held = set.leases.len();
            let request = RenewLeasesRequest { node_id: set.node_id, leases: set.leases };
            let answer_within = self.answer_within(interval, clock.since());
            let renewed = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                renewed = tokio::time::timeout(answer_within, self.leases.renew_leases(request)) => {
                    renewed.unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded(format!(
                        "the leases service did not answer a renewal within {answer_within:?}"
                    ))))
                }
            };
            match renewed {
                Ok(response) => {
                    if clock.unrenewed_since.take().is_some() {
                        tracing::info!("lease renewals go through again");
                    }
                    clock.last_renewed = Some(Instant::now());
                    self.backoff.reset();
                    if response.ttl_ms > 0 {
                        answered_ttl = Some(Duration::from_millis(u64::from(response.ttl_ms)));
                    }
                    tracing::debug!(
                        held,
                        renewed = response.renewed.len(),
                        lost = response.lost.len(),
                        "renewed leases"
                    );
                    if !response.lost.is_empty() {
                        let lost: Vec<String> = response.lost.iter().map(|l| l.lease_id.clone()).collect();
                        tracing::warn!(?lost, "the leases service says these leases are no longer this node's");
                        // The runner gone means shutdown: nothing left to tell.
                        let _ = self.lost.send(Lost { leases: response.lost, reason: LEASE_LOST });
                    }
                }
                Err(status) => {
                    // With no renewal through in this session, the clock
                    // starts when the first failed one went out.
                    let since = *clock.unrenewed_since.get_or_insert(clock.last_renewed.unwrap_or(attempted_at));
                    tracing::warn!(held, error = %crate::rpc_status::status_text(&status), "cannot renew leases; retrying");
                    if let Some(bound) = self.stop_after_disconnect
                        && since.elapsed() >= bound
                    {
                        tracing::warn!(held, bound = ?bound,
                            "lease renewals have failed for longer than the stop-after-disconnect bound; \
                             stopping what the node runs");
                        // What the node holds now, as the runner publishes it.
                        let leases = self.renewals.borrow().as_ref().map(|set| set.leases.clone()).unwrap_or_default();
                        let _ = self.lost.send(Lost { leases, reason: CONTROL_PLANE_LOST });
                    }
                }
            }
            let interval = self.interval(answered_ttl);
            let wait = if clock.unrenewed_since.is_some() { self.backoff.next_delay().min(interval) } else { interval };
            next_at = Instant::now() + wait;
        }
    }
}

/// The clock of one stint of holding leases: a session's, from its first
/// lease until it holds none. The stop-after-disconnect bound counts from
/// the last renewal that went through in the stint, else its first failure.
#[derive(Debug, Default)]
struct Clock {
    /// The session (node id, incarnation) the stint belongs to; `None`
    /// while the node holds nothing.
    stint: Option<(String, u64)>,
    /// The last renewal that went through: the leases service counts its
    /// TTL from there.
    last_renewed: Option<Instant>,
    /// While renewals fail: since when the node has held its leases
    /// unrenewed.
    unrenewed_since: Option<Instant>,
}

impl Clock {
    /// Takes in what the runner publishes; whether a stint starts, so its
    /// leases are renewed at once (the clock then runs from a renewal the
    /// service has seen, not one an interval later).
    fn observe(&mut self, set: Option<&RenewSet>) -> bool {
        let Some(set) = set.filter(|set| !set.leases.is_empty()) else {
            *self = Self::default();
            return false;
        };
        if self
            .stint
            .as_ref()
            .is_some_and(|(node, incarnation)| *node == set.node_id && *incarnation == set.incarnation)
        {
            return false;
        }
        *self = Self { stint: Some((set.node_id.clone(), set.incarnation)), ..Self::default() };
        true
    }

    /// What the bound counts from now, if anything.
    fn since(&self) -> Option<Instant> {
        self.last_renewed.or(self.unrenewed_since)
    }
}
