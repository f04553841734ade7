//! The open leases of every service, as the lease watch
//! ([`crate::lease_watch`]) last described them, so a reconcile of a steady
//! service reads its leases here instead of asking the leases service.
//!
//! # Invariants
//! - The view answers only while its stream is synced: from the stream's
//!   `SYNCED` until it breaks. A broken stream stops it answering, and every
//!   reconcile lists from the leases service meanwhile.
//! - It keeps what it held, and the cursor of the last event it applied,
//!   across a break: the next stream resumes from that cursor. A stream's
//!   events are staged until its `SYNCED`, which says whether they are what
//!   changed since the cursor (applied over what it held) or the whole open
//!   set (which replaces it); a stream that breaks before `SYNCED` leaves the
//!   view as it was.
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
    /// The current stream's events before its `SYNCED`.
    staged: Vec<LeaseEvent>,
    /// Where the next stream resumes: the cursor of the last event applied.
    cursor: u64,
    /// `(project, owner)` → lease id → lease.
    open: HashMap<(String, String), HashMap<String, Lease>>,
}

impl ViewState {
    fn take_in(&mut self, event: &LeaseEvent) {
        if event.cursor > 0 {
            self.cursor = event.cursor;
        }
        let Some(lease) = &event.lease else { return };
        let owner = (lease.project.clone(), lease.owner.clone());
        if event.kind() == EventKind::Upsert && lease.phase().is_open() {
            self.open.entry(owner).or_default().insert(lease.lease_id.clone(), lease.clone());
        } else if let Some(leases) = self.open.get_mut(&owner) {
            leases.remove(&lease.lease_id);
            if leases.is_empty() {
                self.open.remove(&owner);
            }
        }
    }
}

impl LeaseView {
    fn lock(&self) -> std::sync::MutexGuard<'_, ViewState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops answering: the stream broke, or a new one is opening. What the
    /// view holds stays, for a stream resumed from [`Self::cursor`].
    pub(crate) fn unsync(&self) {
        let mut state = self.lock();
        state.synced = false;
        state.staged.clear();
    }

    /// Where a new stream should resume from; 0 when it must start afresh.
    pub(crate) fn cursor(&self) -> u64 {
        self.lock().cursor
    }

    /// Takes one event of the stream in.
    pub(crate) fn apply(&self, event: &LeaseEvent) {
        let mut state = self.lock();
        match (state.synced, event.kind()) {
            (true, _) => state.take_in(event),
            (false, EventKind::Synced) => {
                if !event.resumed {
                    state.open.clear();
                }
                for staged in std::mem::take(&mut state.staged) {
                    state.take_in(&staged);
                }
                state.take_in(event);
                state.synced = true;
            }
            (false, _) => state.staged.push(event.clone()),
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
        LeaseEvent { kind: kind as i32, lease: Some(lease), ..Default::default() }
    }

    fn synced(cursor: u64, resumed: bool) -> LeaseEvent {
        LeaseEvent { kind: EventKind::Synced as i32, lease: None, cursor, resumed }
    }

    fn at(cursor: u64, event: LeaseEvent) -> LeaseEvent {
        LeaseEvent { cursor, ..event }
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
        view.apply(&synced(7, false));
        assert_eq!(ids(&view), Some(vec!["l1".into(), "l2".into()]));
        assert_eq!(view.cursor(), 7);

        view.apply(&event(EventKind::Removed, "l1", LeasePhase::Expired));
        view.apply(&event(EventKind::Upsert, "l2", LeasePhase::Running));
        view.apply(&event(EventKind::Upsert, "l3", LeasePhase::Done));
        assert_eq!(ids(&view), Some(vec!["l2".into()]), "removed and final leases are not open");
        assert_eq!(view.open("default", "revisions/other/u"), Some(Vec::new()), "an owner with none has none");

        view.unsync();
        assert_eq!(ids(&view), None, "a broken stream answers nothing");
    }

    #[test]
    fn a_resumed_stream_applies_its_changes_over_what_the_view_held_and_a_fresh_one_replaces_it() {
        let view = LeaseView::default();
        view.apply(&event(EventKind::Upsert, "l1", LeasePhase::Running));
        view.apply(&event(EventKind::Upsert, "l2", LeasePhase::Running));
        view.apply(&synced(10, false));
        view.apply(&at(10, event(EventKind::Upsert, "l3", LeasePhase::Bound)));
        assert_eq!(view.cursor(), 10);

        view.unsync();
        assert_eq!(ids(&view), None, "broken");
        view.apply(&at(12, event(EventKind::Removed, "l1", LeasePhase::Failed)));
        assert_eq!(ids(&view), None, "staged until SYNCED");
        view.apply(&synced(15, true));
        assert_eq!(ids(&view), Some(vec!["l2".into(), "l3".into()]), "resumed: the change applied over what was held");
        assert_eq!(view.cursor(), 15);

        view.unsync();
        view.apply(&event(EventKind::Upsert, "l9", LeasePhase::Running));
        view.unsync();
        assert_eq!(view.cursor(), 15, "a stream broken before SYNCED moves nothing");
        view.apply(&event(EventKind::Upsert, "l4", LeasePhase::Running));
        view.apply(&synced(20, false));
        assert_eq!(ids(&view), Some(vec!["l4".into()]), "afresh: the open set replaces what was held");
    }
}
