//! `WatchLeases` as a requester (revisions, an operator with grpcurl) sees
//! it, on both backends: the open set and `SYNCED`, then each change as it
//! happens wherever it was made (placed, running, released, expired), only
//! for the scope asked for.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::Duration;

use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::types::v1::EventKind;
use berth_testkit::PATIENCE;
use support::{Backend, GIB, Ledger, MIB, ask, expiring_config, fast_config, node};
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

on_both_backends!(
    the_open_set_then_synced_then_every_change_wherever_it_was_made,
    a_watch_follows_only_its_scope,
    an_expired_lease_is_removed_from_the_watch,
    bad_scopes_and_nodes_are_refused,
);
