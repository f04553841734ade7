//! What marks a pass, and what the passes counted: every egress-relevant
//! event for a tenant is a trigger for the full pass's controller
//! ([`berth_runtime::run_controller`]), which coalesces them.
//!
//! # When a marked pass runs
//! At the earlier of `debounce` after the tenant's last event and
//! `max_delay` after its first ([`EgressConfig`](crate::EgressConfig)): a
//! quiet tenant is compiled soon after its last edit, and a tenant edited
//! without pause is still compiled every `max_delay`. Node placement (which
//! tenants each node hosts) is one more key, coalesced the same way.
//!
//! # Counters
//! Per tenant, while this replica leads: events marked, passes run, passes
//! that changed the plan. A replica that does not lead records nothing and
//! sends no trigger: it runs no pass.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use berth_runtime::Trigger;
use tokio::sync::mpsc;

/// How many marks may wait for the pass before more are dropped (every
/// `full_resync` passes every tenant all the same).
const MARKS_WAITING: usize = 4096;

/// What a pass is run for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum PassKey {
    /// One tenant's plan and statuses.
    Tenant(String),
    /// Which tenants each node hosts.
    Placement,
}

impl fmt::Display for PassKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tenant(project) => write!(f, "tenant {project}"),
            Self::Placement => f.write_str("placement"),
        }
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
    counters: HashMap<String, PassCounters>,
}

/// The marks and counters of one replica; shared by its handlers, its
/// followers and its pass.
#[derive(Debug)]
pub(crate) struct PassQueue {
    state: Mutex<State>,
    marks: mpsc::Sender<Trigger<PassKey>>,
    /// The receiving end, until the pass takes it.
    receiver: Mutex<Option<mpsc::Receiver<Trigger<PassKey>>>>,
}

impl PassQueue {
    pub(crate) fn new() -> Self {
        let (marks, receiver) = mpsc::channel(MARKS_WAITING);
        Self { state: Mutex::default(), marks, receiver: Mutex::new(Some(receiver)) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The marks, for the pass; `None` once taken.
    pub(crate) fn take_marks(&self) -> Option<mpsc::Receiver<Trigger<PassKey>>> {
        self.receiver.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Starts or stops taking marks.
    pub(crate) fn set_leading(&self, leading: bool) {
        self.lock().leading = leading;
    }

    /// Counts an event of `project` while leading; whether it leads.
    pub(crate) fn count_event(&self, project: &str) -> bool {
        let mut state = self.lock();
        if state.leading {
            state.counters.entry(project.to_owned()).or_default().events += 1;
        }
        state.leading
    }

    /// Marks a pass of `project`, counting the event.
    pub(crate) fn mark(&self, project: &str) {
        if self.count_event(project) {
            self.send(PassKey::Tenant(project.to_owned()));
        }
    }

    /// Marks node placement.
    pub(crate) fn mark_placement(&self) {
        if self.lock().leading {
            self.send(PassKey::Placement);
        }
    }

    fn send(&self, key: PassKey) {
        if let Err(error) = self.marks.try_send(Trigger { key, traceparent: String::new() }) {
            tracing::debug!(%error, "too many egress marks waiting; the next full resync passes every tenant");
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_counts_and_sends_each_mark_and_a_follower_neither() {
        let queue = PassQueue::new();
        let mut marks = queue.take_marks().unwrap();
        queue.mark("team");
        queue.mark_placement();
        assert!(marks.try_recv().is_err(), "a follower sends nothing");
        assert_eq!(queue.counters("team"), (false, PassCounters::default()));

        queue.set_leading(true);
        queue.mark("team");
        queue.mark("team");
        queue.mark_placement();
        let keys: Vec<PassKey> = std::iter::from_fn(|| marks.try_recv().ok()).map(|t| t.key).collect();
        let team = PassKey::Tenant("team".into());
        assert_eq!(keys, [team.clone(), team, PassKey::Placement]);
        assert_eq!(queue.counters("team").1.events, 2);
        assert!(queue.take_marks().is_none(), "one pass takes the marks");
    }
}
