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

use crate::backoff::Backoff;
use crate::leases_client::NodeLeasesApi;

/// The shortest renewal interval, whatever the TTL, so a tiny TTL never
/// makes the node spin.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(20);

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

    /// Renews until shutdown.
    pub(crate) async fn run(mut self) {
        let mut answered_ttl = None;
        let mut last_renewed: Option<Instant> = None;
        // While renewals fail: since when the node has held its leases
        // unrenewed, for the stop-after-disconnect bound. That is the last
        // renewal that went through (the leases service counts its TTL from
        // there), else the first failure.
        let mut unrenewed_since: Option<Instant> = None;
        loop {
            let interval = self.interval(answered_ttl);
            let wait = if unrenewed_since.is_some() { self.backoff.next_delay().min(interval) } else { interval };
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            let Some(set) = self.renewals.borrow().clone().filter(|set| !set.leases.is_empty()) else {
                unrenewed_since = None;
                continue;
            };
            let held = set.leases.len();
            let request = RenewLeasesRequest { node_id: set.node_id, leases: set.leases };
            let renewed = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                renewed = self.leases.renew_leases(request) => renewed,
            };
            match renewed {
                Ok(response) => {
                    if unrenewed_since.take().is_some() {
                        tracing::info!("lease renewals go through again");
                    }
                    last_renewed = Some(Instant::now());
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
                    let since = *unrenewed_since.get_or_insert_with(|| last_renewed.unwrap_or_else(Instant::now));
                    tracing::warn!(held, error = %crate::join::status_text(&status), "cannot renew leases; retrying");
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
        }
    }
}
