//! The open leases of every service, as the lease watch
//! ([`crate::lease_watch`]) last described them, so a reconcile of a steady
//! service reads its leases here instead of asking the leases service.
//!
//! # Invariants
//! - The view answers only while its stream is synced: from the stream's
//!   `SYNCED` until it breaks. A broken or fresh stream empties it, and every
//!   reconcile lists from the leases service meanwhile.
//! - It holds only open leases: a `REMOVED` event takes a lease out. A final
//!   lease (its attempt number, its reason) is never read from here, so a
//!   reconcile that has a slot to fill lists from the leases service, the
//!   truth (see [`crate::plan::served_by_open`]).
//! - A lease the view still shows open may have ended a moment ago; its
//!   `REMOVED` event wakes the service, and that reconcile sees it gone.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use berth_proto::leases::v1::{Lease, LeaseEvent};
use berth_proto::types::v1::EventKind;

/// The open leases by project and owner, and whether the stream is synced.
#[derive(Debug, Default)]
pub(crate) struct LeaseView {
    state: Mutex<ViewState>,
}

#[derive(Debug, Default)]
struct ViewState {
    synced: bool,
    /// `(project, owner)` → lease id → lease.
    open: HashMap<(String, String), HashMap<String, Lease>>,
}

impl LeaseView {
    fn lock(&self) -> std::sync::MutexGuard<'_, ViewState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets everything: a stream opened afresh, or broke.
    pub(crate) fn reset(&self) {
        let mut state = self.lock();
        state.synced = false;
        state.open.clear();
    }

    /// Takes one event of the stream in.
    pub(crate) fn apply(&self, event: &LeaseEvent) {
        let mut state = self.lock();
        match (event.kind(), &event.lease) {
            (EventKind::Synced, _) => state.synced = true,
            (EventKind::Upsert, Some(lease)) if lease.phase().is_open() => {
                let owner = (lease.project.clone(), lease.owner.clone());
                state.open.entry(owner).or_default().insert(lease.lease_id.clone(), lease.clone());
            }
            (EventKind::Upsert | EventKind::Removed, Some(lease)) => {
                let owner = (lease.project.clone(), lease.owner.clone());
                if let Some(leases) = state.open.get_mut(&owner) {
                    leases.remove(&lease.lease_id);
                    if leases.is_empty() {
                        state.open.remove(&owner);
                    }
                }
            }
            _ => {}
        }
    }

    /// The open leases of `owner` in `project`; `None` while the stream is
    /// not synced.
    pub(crate) fn open(&self, project: &str, owner: &str) -> Option<Vec<Lease>> {
        let state = self.lock();
        if !state.synced {
            return None;
        }
        let leases = state.open.get(&(project.to_owned(), owner.to_owned()));
        Some(leases.map(|leases| leases.values().cloned().collect()).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use berth_proto::leases::v1::LeasePhase;

    use super::*;

    fn event(kind: EventKind, id: &str, phase: LeasePhase) -> LeaseEvent {
        let mut lease = Lease {
            lease_id: id.into(),
            project: "default".into(),
            owner: "revisions/web/u".into(),
            ..Default::default()
        };
        lease.set_phase(phase);
        LeaseEvent { kind: kind as i32, lease: Some(lease) }
    }

    fn ids(view: &LeaseView) -> Option<Vec<String>> {
        view.open("default", "revisions/web/u").map(|leases| {
            let mut ids: Vec<String> = leases.into_iter().map(|l| l.lease_id).collect();
            ids.sort();
            ids
        })
    }

    #[test]
    fn the_view_answers_from_synced_until_the_stream_breaks_and_holds_only_open_leases() {
        let view = LeaseView::default();
        view.apply(&event(EventKind::Upsert, "l1", LeasePhase::Running));
        view.apply(&event(EventKind::Upsert, "l2", LeasePhase::Bound));
        assert_eq!(ids(&view), None, "not synced yet");
        view.apply(&LeaseEvent { kind: EventKind::Synced as i32, lease: None });
        assert_eq!(ids(&view), Some(vec!["l1".into(), "l2".into()]));

        view.apply(&event(EventKind::Removed, "l1", LeasePhase::Expired));
        view.apply(&event(EventKind::Upsert, "l2", LeasePhase::Running));
        view.apply(&event(EventKind::Upsert, "l3", LeasePhase::Done));
        assert_eq!(ids(&view), Some(vec!["l2".into()]), "removed and final leases are not open");
        assert_eq!(view.open("default", "revisions/other/u"), Some(Vec::new()), "an owner with none has none");

        view.reset();
        assert_eq!(ids(&view), None, "a broken stream answers nothing");
    }
}
