//! The coalescing queue in front of the full pass: every egress-relevant event
//! for a tenant marks one pending pass; events arriving while it is pending
//! join it.
//!
//! # When a pending pass runs
//! At the earlier of `debounce` after the tenant's last event and
//! `max_delay` after its first ([`EgressConfig`](crate::EgressConfig)): a
//! quiet tenant is compiled soon after its last edit, and a tenant edited
//! without pause is still compiled every `max_delay`. Taking a pass clears
//! the mark, so events during the pass mark the next one. Node placement
//! (which tenants each node hosts) is one more pending item, coalesced the
//! same way.
//!
//! # Counters
//! Per tenant, while this replica leads: events marked, passes run, passes
//! that changed the plan. A replica that does not lead records nothing:
//! its marks would never be taken.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// A pending pass: when its first and last events arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    first: Instant,
    last: Instant,
}

impl Pending {
    fn new(now: Instant) -> Self {
        Self { first: now, last: now }
    }

    fn due(&self, debounce: Duration, max_delay: Duration) -> Instant {
        (self.last + debounce).min(self.first + max_delay)
    }
}

/// One tenant's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PassCounters {
    pub(crate) events: u64,
    pub(crate) passes: u64,
    pub(crate) changes: u64,
    /// Epoch milliseconds of the last pass, by the local clock.
    pub(crate) last_pass_ms: Option<i64>,
}

#[derive(Debug, Default)]
struct State {
    leading: bool,
    tenants: HashMap<String, Pending>,
    placement: Option<Pending>,
    counters: HashMap<String, PassCounters>,
}

/// What is due now.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Due {
    /// Tenants whose pass is due, by name.
    pub(crate) tenants: Vec<String>,
    /// Whether node placement is due.
    pub(crate) placement: bool,
}

/// The pending passes of one replica; shared by its handlers and its loop.
#[derive(Debug)]
pub(crate) struct PassQueue {
    state: Mutex<State>,
    notify: Notify,
    debounce: Duration,
    max_delay: Duration,
}

impl PassQueue {
    pub(crate) fn new(debounce: Duration, max_delay: Duration) -> Self {
        Self { state: Mutex::default(), notify: Notify::new(), debounce, max_delay: max_delay.max(debounce) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts or stops taking marks; stopping drops what is pending.
    pub(crate) fn set_leading(&self, leading: bool) {
        let mut state = self.lock();
        state.leading = leading;
        if !leading {
            state.tenants.clear();
            state.placement = None;
        }
    }

    /// Marks a pass of `project` pending, counting the event.
    pub(crate) fn mark(&self, project: &str) {
        let now = Instant::now();
        {
            let mut state = self.lock();
            if !state.leading {
                return;
            }
            state.counters.entry(project.to_owned()).or_default().events += 1;
            match state.tenants.get_mut(project) {
                Some(pending) => pending.last = now,
                None => {
                    state.tenants.insert(project.to_owned(), Pending::new(now));
                }
            }
        }
        self.notify.notify_one();
    }

    /// Marks node placement pending.
    pub(crate) fn mark_placement(&self) {
        let now = Instant::now();
        {
            let mut state = self.lock();
            if !state.leading {
                return;
            }
            match &mut state.placement {
                Some(pending) => pending.last = now,
                None => state.placement = Some(Pending::new(now)),
            }
        }
        self.notify.notify_one();
    }

    /// When the next pending item falls due; `None` when nothing is pending.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        let state = self.lock();
        let (debounce, max_delay) = (self.debounce, self.max_delay);
        state.tenants.values().chain(state.placement.iter()).map(|p| p.due(debounce, max_delay)).min()
    }

    /// Takes everything due at `now`, clearing its marks.
    pub(crate) fn take_due(&self, now: Instant) -> Due {
        let mut state = self.lock();
        let (debounce, max_delay) = (self.debounce, self.max_delay);
        let mut tenants: Vec<String> =
            state.tenants.iter().filter(|(_, p)| p.due(debounce, max_delay) <= now).map(|(t, _)| t.clone()).collect();
        tenants.sort();
        for tenant in &tenants {
            state.tenants.remove(tenant);
        }
        let placement = state.placement.is_some_and(|p| p.due(debounce, max_delay) <= now);
        if placement {
            state.placement = None;
        }
        Due { tenants, placement }
    }

    /// Counts a pass of `project` that ran at `now_ms`.
    pub(crate) fn record_pass(&self, project: &str, changed: bool, now_ms: i64) {
        let mut state = self.lock();
        let counters = state.counters.entry(project.to_owned()).or_default();
        counters.passes += 1;
        counters.changes += u64::from(changed);
        counters.last_pass_ms = Some(now_ms);
    }

    /// `project`'s counters and whether this replica leads.
    pub(crate) fn counters(&self, project: &str) -> (bool, PassCounters) {
        let state = self.lock();
        (state.leading, state.counters.get(project).copied().unwrap_or_default())
    }

    /// Resolves when something was marked since the last call.
    pub(crate) async fn notified(&self) {
        self.notify.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEBOUNCE: Duration = Duration::from_millis(100);
    const MAX_DELAY: Duration = Duration::from_millis(1000);

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_one_pass_after_it_goes_quiet() {
        let queue = PassQueue::new(DEBOUNCE, MAX_DELAY);
        queue.set_leading(true);
        for _ in 0..1000 {
            queue.mark("team");
        }
        assert_eq!(queue.take_due(Instant::now()), Due::default(), "nothing before the debounce");
        tokio::time::advance(DEBOUNCE).await;
        assert_eq!(queue.take_due(Instant::now()).tenants, ["team"]);
        assert!(queue.next_due().is_none(), "taking it cleared the mark");
        assert_eq!(queue.counters("team").1.events, 1000);
    }

    #[tokio::test(start_paused = true)]
    async fn events_that_never_stop_still_pass_every_max_delay() {
        let queue = PassQueue::new(DEBOUNCE, MAX_DELAY);
        queue.set_leading(true);
        let started = Instant::now();
        let mut passes = 0;
        while started.elapsed() < Duration::from_secs(5) {
            queue.mark("busy");
            tokio::time::advance(Duration::from_millis(10)).await;
            passes += queue.take_due(Instant::now()).tenants.len();
        }
        assert!((4..=6).contains(&passes), "{passes} passes in 5s of constant edits");
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_records_nothing() {
        let queue = PassQueue::new(DEBOUNCE, MAX_DELAY);
        queue.mark("team");
        queue.mark_placement();
        assert!(queue.next_due().is_none());
        assert_eq!(queue.counters("team"), (false, PassCounters::default()));
    }
}
