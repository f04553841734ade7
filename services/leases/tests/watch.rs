//! `WatchLeases` as a requester (revisions, an operator with grpcurl) sees
//! it, on both backends: the open set and `SYNCED`, then each change as it
//! happens wherever it was made (placed, running, released, expired), only
//! for the scope asked for; and a broken stream resumed from its cursor
//! hears only what changed while it was away.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::Duration;

use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::types::v1::EventKind;
use berth_testkit::PATIENCE;
use support::{Backend, GIB, Ledger, MIB, ask, expiring_config, fast_config, forgetting_config, node};
use tonic::{Code, Streaming};

/// The next event, failing the test if none comes in time.
async fn next(stream: &mut Streaming<v1::LeaseEvent>) -> v1::LeaseEvent {
    tokio::time::timeout(PATIENCE, stream.message()).await.expect("no event in time").unwrap().expect("stream ended")
}

/// Asserts `event` is `kind` about `lease_id` and returns its lease.
fn about(event: &v1::LeaseEvent, kind: EventKind, lease_id: &str) -> v1::Lease {
    assert_eq!(event.kind(), kind, "{event:?}");
    let lease = event.lease.clone().unwrap();
    assert_eq!(lease.lease_id, lease_id, "{event:?}");
    lease
}

async fn watch(ledger: &Ledger, replica: usize, request: v1::WatchLeasesRequest) -> Streaming<v1::LeaseEvent> {
    ledger.leases(replica).watch_leases(request).await.unwrap().into_inner()
}

fn owned_by(key: &str, owner: &str) -> v1::RequestLeaseRequest {
    v1::RequestLeaseRequest { owner: owner.to_owned(), ..ask(key, 100, MIB) }
}

async fn the_open_set_then_synced_then_every_change_wherever_it_was_made(backend: Backend) {
    let mut ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let a = ledger.place("a", 100, MIB).await;
    let ended = ledger.place("ended", 100, MIB).await;
    ledger.report(&ended, 1, LeasePhase::Failed).await.unwrap();

    let other = ledger.add_replica().await;
    let mut stream = watch(&ledger, other, v1::WatchLeasesRequest::default()).await;
    assert_eq!(about(&next(&mut stream).await, EventKind::Upsert, &a.lease_id).phase(), LeasePhase::Bound);
    let synced = next(&mut stream).await;
    assert_eq!((synced.kind(), synced.lease.is_none()), (EventKind::Synced, true), "only the open lease came first");

    // Every change below is made through replica 0 and reaches the stream on the other one.
    let b = ledger.place("b", 100, MIB).await;
    assert_eq!(about(&next(&mut stream).await, EventKind::Upsert, &b.lease_id).phase(), LeasePhase::Bound);
    ledger.report(&a, 1, LeasePhase::Running).await.unwrap();
    assert_eq!(about(&next(&mut stream).await, EventKind::Upsert, &a.lease_id).phase(), LeasePhase::Running);
    let request = v1::ReleaseLeaseRequest { lease_id: a.lease_id.clone(), reason: "Superseded".into() };
    ledger.leases(0).release_lease(request).await.unwrap();
    let removed = about(&next(&mut stream).await, EventKind::Removed, &a.lease_id);
    assert_eq!((removed.phase(), removed.reason.as_str()), (LeasePhase::Released, "Superseded"));
    ledger.report(&b, 1, LeasePhase::Failed).await.unwrap();
    assert_eq!(about(&next(&mut stream).await, EventKind::Removed, &b.lease_id).phase(), LeasePhase::Failed);
    ledger.cleanup().await;
}

async fn a_watch_follows_only_its_scope(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let by_prefix = v1::WatchLeasesRequest {
        all_projects: true,
        owner_prefix: "revisions/".into(),
        ..v1::WatchLeasesRequest::default()
    };
    let mut prefixed = watch(&ledger, 0, by_prefix).await;
    let by_owner = v1::WatchLeasesRequest { owner: "revisions/api@u-2".into(), ..v1::WatchLeasesRequest::default() };
    let mut exact = watch(&ledger, 0, by_owner).await;
    assert_eq!(next(&mut prefixed).await.kind(), EventKind::Synced);
    assert_eq!(next(&mut exact).await.kind(), EventKind::Synced);

    let mut leases = ledger.leases(0);
    let load = leases.request_lease(owned_by("load", "load")).await.unwrap().into_inner().lease.unwrap();
    let web = leases.request_lease(owned_by("web", "revisions/web@u-1")).await.unwrap().into_inner().lease.unwrap();
    let elsewhere = v1::RequestLeaseRequest { project: "acme".into(), ..owned_by("api", "revisions/api@u-2") };
    let acme = leases.request_lease(elsewhere).await.unwrap().into_inner().lease.unwrap();
    let api = leases.request_lease(owned_by("api", "revisions/api@u-2")).await.unwrap().into_inner().lease.unwrap();

    // The prefix across projects hears web's, acme's and api's, never load's.
    let mut heard = std::collections::BTreeSet::new();
    for _ in 0..3 {
        let event = next(&mut prefixed).await;
        assert_eq!(event.kind(), EventKind::Upsert, "{event:?}");
        heard.insert(event.lease.unwrap().lease_id);
    }
    let expected = [web.lease_id.clone(), acme.lease_id.clone(), api.lease_id.clone()].into_iter().collect();
    assert_eq!(heard, expected);
    assert!(!heard.contains(&load.lease_id));
    // The exact owner in the default project hears api's alone, not acme's namesake.
    about(&next(&mut exact).await, EventKind::Upsert, &api.lease_id);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), exact.message()).await.is_err(),
        "nothing else is in the exact scope"
    );
    ledger.cleanup().await;
}

async fn a_change_no_signal_told_of_is_read_by_the_resync_however_busy_other_owners_are(backend: Backend) {
    let config = fast_config();
    let resync = config.assignment_resync;
    let ledger = Ledger::start(backend, config, vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let owner = "revisions/quiet@u-1";
    let quiet = ledger.leases(0).request_lease(owned_by("quiet", owner)).await.unwrap().into_inner().lease.unwrap();
    let mut stream =
        watch(&ledger, 0, v1::WatchLeasesRequest { owner: owner.into(), ..v1::WatchLeasesRequest::default() }).await;
    about(&next(&mut stream).await, EventKind::Upsert, &quiet.lease_id);
    assert_eq!(next(&mut stream).await.kind(), EventKind::Synced);

    // Another owner's leases come and go many times a resync: signals the
    // stream wakes for and finds out of its scope.
    let mut busy_leases = ledger.leases(0);
    let busy = tokio::spawn(async move {
        for round in 0.. {
            let placed = busy_leases.request_lease(owned_by(&format!("busy-{round}"), "load")).await.unwrap();
            let lease_id = placed.into_inner().lease.unwrap().lease_id;
            let release = v1::ReleaseLeaseRequest { lease_id, reason: "Done".into() };
            busy_leases.release_lease(release).await.unwrap();
            tokio::time::sleep(resync / 10).await;
        }
    });
    // A change of the watched lease that no signal announces (as when one
    // is lost on the bus): only the periodic read can find it.
    tokio::time::sleep(resync / 2).await;
    let quiet_id = &quiet.lease_id;
    sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE leases SET reason = 'Quiet' WHERE lease_id = '{quiet_id}'")))
        .execute(ledger.store().pool())
        .await
        .unwrap();
    let heard = tokio::time::timeout(resync * 4, stream.message()).await;
    busy.abort();
    let event = heard.expect("the change was never read while other owners' signals kept coming").unwrap().unwrap();
    assert_eq!(about(&event, EventKind::Upsert, quiet_id).reason, "Quiet");
    ledger.cleanup().await;
}

async fn an_expired_lease_is_removed_from_the_watch(backend: Backend) {
    let ttl = Duration::from_millis(600);
    let ledger =
        Ledger::start(backend, expiring_config(ttl), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let mut stream = watch(&ledger, 0, v1::WatchLeasesRequest::default()).await;
    assert_eq!(next(&mut stream).await.kind(), EventKind::Synced);
    let lease = ledger.place("short", 100, MIB).await;
    about(&next(&mut stream).await, EventKind::Upsert, &lease.lease_id);
    let removed = about(&next(&mut stream).await, EventKind::Removed, &lease.lease_id);
    assert_eq!(removed.phase(), LeasePhase::Expired);
    ledger.cleanup().await;
}

async fn bad_scopes_and_nodes_are_refused(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let bad_project = v1::WatchLeasesRequest { project: "Not A Project".into(), ..v1::WatchLeasesRequest::default() };
    let status = ledger.leases(0).watch_leases(bad_project).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("project"), "{status:?}");
    let bad_owner = v1::WatchLeasesRequest { owner_prefix: "a\nb".into(), ..v1::WatchLeasesRequest::default() };
    let status = ledger.leases(0).watch_leases(bad_owner).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("owner_prefix"), "{status:?}");
    let status = ledger.leases_as_node("n-1").watch_leases(v1::WatchLeasesRequest::default()).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    ledger.cleanup().await;
}

/// Reads up to and including the next `SYNCED`, returning the events before it and it.
async fn until_synced(stream: &mut Streaming<v1::LeaseEvent>) -> (Vec<v1::LeaseEvent>, v1::LeaseEvent) {
    let mut before = Vec::new();
    loop {
        let event = next(stream).await;
        if event.kind() == EventKind::Synced {
            return (before, event);
        }
        before.push(event);
    }
}

fn resume_from(cursor: u64) -> v1::WatchLeasesRequest {
    v1::WatchLeasesRequest { resume_cursor: cursor, ..v1::WatchLeasesRequest::default() }
}

async fn a_stream_resumed_from_its_cursor_hears_only_what_changed_while_it_was_away(backend: Backend) {
    let mut ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let steady = ledger.place("steady", 100, MIB).await;
    let moving = ledger.place("moving", 100, MIB).await;
    let ending = ledger.place("ending", 100, MIB).await;
    let mut stream = watch(&ledger, 0, v1::WatchLeasesRequest::default()).await;
    let (open, synced) = until_synced(&mut stream).await;
    assert_eq!(open.len(), 3, "{open:?}");
    assert!(open.iter().all(|event| event.cursor == 0), "the open set cannot be resumed from: {open:?}");
    assert!(!synced.resumed && synced.cursor > 0, "{synced:?}");
    let mut applied = synced.cursor;
    let born = ledger.place("born", 100, MIB).await;
    let event = next(&mut stream).await;
    about(&event, EventKind::Upsert, &born.lease_id);
    assert!(event.cursor >= applied, "{event:?} after {applied}");
    applied = event.cursor;
    drop(stream);

    // While the watcher is away: one moves, one ends, one is born and dies,
    // one is born and stays; `steady` and `born` do not change.
    ledger.report(&moving, 1, LeasePhase::Running).await.unwrap();
    ledger.report(&ending, 1, LeasePhase::Failed).await.unwrap();
    let brief = ledger.place("brief", 100, MIB).await;
    ledger.report(&brief, 1, LeasePhase::Failed).await.unwrap();
    let late = ledger.place("late", 100, MIB).await;

    let mut stream = watch(&ledger, 0, resume_from(applied)).await;
    let (changes, synced) = until_synced(&mut stream).await;
    assert!(synced.resumed, "{synced:?}");
    let heard: std::collections::BTreeMap<String, (EventKind, LeasePhase)> = changes
        .iter()
        .map(|event| {
            let lease = event.lease.clone().unwrap();
            (lease.lease_id.clone(), (event.kind(), lease.phase()))
        })
        .collect();
    assert_eq!(heard.get(&moving.lease_id), Some(&(EventKind::Upsert, LeasePhase::Running)), "{changes:?}");
    assert_eq!(heard.get(&ending.lease_id), Some(&(EventKind::Removed, LeasePhase::Failed)), "{changes:?}");
    assert_eq!(heard.get(&late.lease_id), Some(&(EventKind::Upsert, LeasePhase::Bound)), "{changes:?}");
    assert_eq!(heard.get(&brief.lease_id), Some(&(EventKind::Removed, LeasePhase::Failed)), "{changes:?}");
    // The cursor of `born`'s event resumes at that change, so it may come
    // again; `steady` may too on PostgreSQL, whose cursor is the oldest
    // transaction running anywhere in the cluster when the stream read (a
    // change is sent again rather than ever missed). Either comes unchanged.
    for (lease, phase) in [(&born, LeasePhase::Bound), (&steady, LeasePhase::Bound)] {
        if let Some(again) = heard.get(&lease.lease_id) {
            assert_eq!(again, &(EventKind::Upsert, phase), "{changes:?}");
        }
    }
    if backend == Backend::Sqlite {
        assert!(!heard.contains_key(&steady.lease_id), "an unchanged lease is not sent again: {changes:?}");
    }
    assert_eq!(changes.len(), heard.len(), "one event a lease: {changes:?}");

    // Live again, from a change made on another replica.
    let other = ledger.add_replica().await;
    let request = v1::ReleaseLeaseRequest { lease_id: steady.lease_id.clone(), reason: "Done".into() };
    ledger.leases(other).release_lease(request).await.unwrap();
    let removed = next(&mut stream).await;
    about(&removed, EventKind::Removed, &steady.lease_id);
    assert!(removed.cursor >= synced.cursor, "{removed:?} after {synced:?}");
    ledger.cleanup().await;
}

async fn a_cursor_the_ledger_cannot_resume_from_starts_afresh(backend: Backend) {
    let ledger = Ledger::start(backend, forgetting_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let kept = ledger.place("kept", 100, MIB).await;
    let gone = ledger.place("gone", 100, MIB).await;
    let mut stream = watch(&ledger, 0, v1::WatchLeasesRequest::default()).await;
    let (_, synced) = until_synced(&mut stream).await;
    drop(stream);

    // A cursor from the future was never given out.
    let mut stream = watch(&ledger, 0, resume_from(u64::MAX / 2)).await;
    let (open, fresh) = until_synced(&mut stream).await;
    assert!(!fresh.resumed, "{fresh:?}");
    assert_eq!(open.len(), 2, "{open:?}");
    drop(stream);

    // `gone` ends and is forgotten: its change left the log, so the old
    // cursor must hear the whole open set instead.
    ledger.report(&gone, 1, LeasePhase::Failed).await.unwrap();
    ledger.await_forgotten(&gone.lease_id).await;
    let mut stream = watch(&ledger, 0, resume_from(synced.cursor)).await;
    let (open, fresh) = until_synced(&mut stream).await;
    assert!(!fresh.resumed, "{fresh:?}");
    assert_eq!(open.len(), 1, "{open:?}");
    about(&open[0], EventKind::Upsert, &kept.lease_id);
    // Its new cursor resumes, with nothing missed.
    let mut stream = watch(&ledger, 0, resume_from(fresh.cursor)).await;
    let (changes, resumed) = until_synced(&mut stream).await;
    assert!(resumed.resumed, "{resumed:?}");
    // Nothing changed; PostgreSQL may send `kept` again, unchanged (see above).
    assert!(changes.iter().all(|event| about(event, EventKind::Upsert, &kept.lease_id).phase() == LeasePhase::Bound));
    if backend == Backend::Sqlite {
        assert!(changes.is_empty(), "nothing changed: {changes:?}");
    }
    ledger.cleanup().await;
}

on_both_backends!(
    a_stream_resumed_from_its_cursor_hears_only_what_changed_while_it_was_away,
    a_cursor_the_ledger_cannot_resume_from_starts_afresh,
    the_open_set_then_synced_then_every_change_wherever_it_was_made,
    a_watch_follows_only_its_scope,
    an_expired_lease_is_removed_from_the_watch,
    a_change_no_signal_told_of_is_read_by_the_resync_however_busy_other_owners_are,
    bad_scopes_and_nodes_are_refused,
);
