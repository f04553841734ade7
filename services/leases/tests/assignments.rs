//! `WatchAssignments` as a node agent sees it, on both backends: the open set
//! and `SYNCED`, then each change as it happens (wherever it was made), and
//! a reconnect that resumes after the last event applied.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::types::v1::EventKind;
use berth_testkit::PATIENCE;
use support::{Backend, GIB, Ledger, MIB, ask, fast_config, forgetting_config, node};
use tonic::Streaming;

/// The next event, failing the test if none comes in time.
async fn next(stream: &mut Streaming<v1::AssignmentEvent>) -> v1::AssignmentEvent {
    tokio::time::timeout(PATIENCE, stream.message()).await.expect("no event in time").unwrap().expect("stream ended")
}

/// Asserts `event` is `kind` about `lease_id` and returns its lease.
fn about(event: &v1::AssignmentEvent, kind: EventKind, lease_id: &str) -> v1::Lease {
    assert_eq!(event.kind(), kind, "{event:?}");
    let lease = event.lease.clone().unwrap();
    assert_eq!(lease.lease_id, lease_id, "{event:?}");
    assert_eq!(event.ttl_ms, 30_000);
    lease
}

async fn watch(ledger: &Ledger, resume_cursor: u64) -> Streaming<v1::AssignmentEvent> {
    let request = v1::WatchAssignmentsRequest { node_id: "n-1".into(), resume_cursor };
    ledger.node("n-1").watch_assignments(request).await.unwrap().into_inner()
}

async fn release(ledger: &Ledger, lease: &v1::Lease) {
    let request = v1::ReleaseLeaseRequest { lease_id: lease.lease_id.clone(), reason: String::new() };
    ledger.leases(0).release_lease(request).await.unwrap();
}

async fn the_open_set_then_synced_then_every_change_then_a_resumed_reconnect(backend: Backend) {
    let mut ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let a = ledger.place("a", 100, MIB).await;
    let done = ledger.place("failed", 100, MIB).await;
    ledger.report(&done, 1, LeasePhase::Failed).await.unwrap();

    let mut stream = watch(&ledger, 0).await;
    let first = next(&mut stream).await;
    assert_eq!(about(&first, EventKind::Upsert, &a.lease_id).phase(), LeasePhase::Bound);
    let synced = next(&mut stream).await;
    assert_eq!((synced.kind(), synced.resumed, synced.lease.is_none()), (EventKind::Synced, false, true));
    assert!(synced.cursor > first.cursor, "the finished lease moved the cursor past the open one");

    // A lease placed through another replica reaches this stream through the bus.
    let other = ledger.add_replica().await;
    let response = ledger.leases(other).request_lease(ask("b", 100, MIB)).await.unwrap().into_inner();
    let b = response.lease.unwrap();
    let placed = next(&mut stream).await;
    about(&placed, EventKind::Upsert, &b.lease_id);
    assert!(placed.cursor > synced.cursor);

    release(&ledger, &a).await;
    let removed = next(&mut stream).await;
    assert_eq!(about(&removed, EventKind::Removed, &a.lease_id).phase(), LeasePhase::Released);

    // Custody moves the epoch, which the node hears about too.
    ledger.report(&b, 1, LeasePhase::Launching).await.unwrap();
    let custody = v1::AssumeCustodyRequest { node_id: "n-1".into(), lease_id: b.lease_id.clone(), epoch: 1 };
    ledger.node("n-1").assume_custody(custody).await.unwrap();
    let moved = next(&mut stream).await;
    assert_eq!(about(&moved, EventKind::Upsert, &b.lease_id).epoch, 2);
    let applied = moved.cursor;
    drop(stream);

    // What happens while the node is away arrives on reconnect, in order.
    let c = ledger.place("c", 100, MIB).await;
    release(&ledger, &b).await;
    let mut resumed = watch(&ledger, applied).await;
    about(&next(&mut resumed).await, EventKind::Upsert, &c.lease_id);
    about(&next(&mut resumed).await, EventKind::Removed, &b.lease_id);
    let synced = next(&mut resumed).await;
    assert_eq!((synced.kind(), synced.resumed), (EventKind::Synced, true));
    let d = ledger.place("d", 100, MIB).await;
    about(&next(&mut resumed).await, EventKind::Upsert, &d.lease_id);

    // A cursor the ledger never issued starts afresh: the open set alone.
    let mut fresh = watch(&ledger, 1 << 40).await;
    about(&next(&mut fresh).await, EventKind::Upsert, &c.lease_id);
    about(&next(&mut fresh).await, EventKind::Upsert, &d.lease_id);
    let synced = next(&mut fresh).await;
    assert_eq!((synced.kind(), synced.resumed), (EventKind::Synced, false));
    ledger.cleanup().await;
}

async fn a_node_with_nothing_assigned_is_told_so_at_once(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let mut stream = watch(&ledger, 0).await;
    let synced = next(&mut stream).await;
    assert_eq!((synced.kind(), synced.cursor, synced.resumed), (EventKind::Synced, 0, false));
    let a = ledger.place("a", 100, MIB).await;
    let placed = next(&mut stream).await;
    about(&placed, EventKind::Upsert, &a.lease_id);
    assert_eq!(placed.cursor, 1);
    ledger.cleanup().await;
}

async fn a_reconnect_from_before_forgotten_changes_starts_afresh(backend: Backend) {
    let ledger = Ledger::start(backend, forgetting_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let a = ledger.place("a", 100, MIB).await;
    let b = ledger.place("b", 100, MIB).await;
    let mut stream = watch(&ledger, 0).await;
    let applied = next(&mut stream).await.cursor;
    drop(stream);
    release(&ledger, &a).await;

    ledger.await_forgotten(&a.lease_id).await;
    // The release of `a` is gone from the log, so the node must hear the whole open set instead.
    let mut stream = watch(&ledger, applied).await;
    about(&next(&mut stream).await, EventKind::Upsert, &b.lease_id);
    let synced = next(&mut stream).await;
    assert_eq!((synced.kind(), synced.resumed), (EventKind::Synced, false));
    // From the cursor it was just given, it resumes with nothing missed.
    let mut stream = watch(&ledger, synced.cursor).await;
    let synced = next(&mut stream).await;
    assert_eq!((synced.kind(), synced.resumed), (EventKind::Synced, true));
    ledger.cleanup().await;
}

on_both_backends!(
    a_reconnect_from_before_forgotten_changes_starts_afresh,
    the_open_set_then_synced_then_every_change_then_a_resumed_reconnect,
    a_node_with_nothing_assigned_is_told_so_at_once,
);
