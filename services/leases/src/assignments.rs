//! `WatchAssignments`: one task per stream that tells a node which leases it
//! holds, reading its node's changes from the database whenever they may
//! have moved.
//!
//! # Expected flow
//! The stream starts afresh (every open lease as `UPSERT`, then `SYNCED` with
//! `resumed = false`) or, when the node passes a cursor the ledger still
//! covers, resumed (every lease changed after it, open ones as `UPSERT` and
//! final ones as `REMOVED`, then `SYNCED` with `resumed = true`). From then
//! on, each wake by a [`NodeSignals`](crate::signals::NodeSignals) signal,
//! and each `assignment_resync` without one, reads the changes after the
//! last cursor sent and sends them the same way.
//!
//! # Invariants
//! - Every event carries the cursor of the change it reports (`SYNCED`, the
//!   node's cursor as read), so a node that applied an event can resume
//!   after it and miss nothing.
//! - The waker is taken before the first read, so no change lands between
//!   the read and the wait unseen.

use std::sync::Arc;

use berth_proto::leases::v1;
use berth_proto::types::v1::EventKind;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::ledger::Assignments;
use crate::records::LeaseRecord;
use crate::shared::Core;

/// Events a stream buffers for a slow node before its task waits.
const STREAM_BUFFER: usize = 256;

type Events = mpsc::Sender<Result<v1::AssignmentEvent, tonic::Status>>;

/// The node went away; the stream's task ends.
struct Gone;

/// Opens `node_id`'s stream, resuming after `resume` when it is `Some`.
pub(crate) fn open(
    core: Arc<Core>,
    node_id: String,
    resume: Option<i64>,
) -> tonic::codegen::BoxStream<v1::AssignmentEvent> {
    let (events, stream) = mpsc::channel(STREAM_BUFFER);
    tokio::spawn(async move {
        if feed(&core, &node_id, resume, &events).await.is_err() {
            tracing::debug!(%node_id, "assignment stream closed by the node");
        }
    });
    Box::pin(ReceiverStream::new(stream))
}

async fn feed(core: &Core, node_id: &str, resume: Option<i64>, events: &Events) -> Result<(), Gone> {
    let mut wake = core.signals.watch(node_id);
    wake.borrow_and_update();
    let ttl_ms = core.config.ttl_ms();
    let mut cursor = match core.ledger.assignments(node_id, resume).await {
        Ok(first) => send(events, &first, ttl_ms, true).await?,
        Err(error) => return fail(events, error.into()).await,
    };
    loop {
        tokio::select! {
            () = events.closed() => return Err(Gone),
            () = core.closing.cancelled() => {
                return fail(events, tonic::Status::unavailable("leases is shutting down; watch again")).await;
            }
            changed = wake.changed() => {
                if changed.is_err() {
                    return fail(events, tonic::Status::unavailable("leases lost track of this stream; watch again")).await;
                }
            }
            () = tokio::time::sleep(core.config.assignment_resync) => {}
        }
        wake.borrow_and_update();
        match core.ledger.assignments(node_id, Some(cursor)).await {
            // Resumed: only what changed, and no new SYNCED. Afresh means the
            // ledger forgot changes this stream had not sent; start over.
            Ok(next) => cursor = send(events, &next, ttl_ms, !next.resumed).await?,
            Err(error) => return fail(events, error.into()).await,
        }
    }
}

/// Sends the leases of `assignments` (and a `SYNCED` when `synced`); the
/// cursor to read after next.
async fn send(events: &Events, assignments: &Assignments, ttl_ms: u32, synced: bool) -> Result<i64, Gone> {
    for lease in &assignments.leases {
        events.send(Ok(event(lease, ttl_ms))).await.map_err(|_| Gone)?;
    }
    if synced {
        let marker = v1::AssignmentEvent {
            kind: EventKind::Synced as i32,
            lease: None,
            cursor: u64::try_from(assignments.cursor).unwrap_or_default(),
            resumed: assignments.resumed,
            ttl_ms,
        };
        events.send(Ok(marker)).await.map_err(|_| Gone)?;
    }
    Ok(assignments.cursor)
}

fn event(lease: &LeaseRecord, ttl_ms: u32) -> v1::AssignmentEvent {
    let kind = if lease.phase.is_open() { EventKind::Upsert } else { EventKind::Removed };
    v1::AssignmentEvent {
        kind: kind as i32,
        lease: Some(lease.to_proto()),
        cursor: u64::try_from(lease.seq).unwrap_or_default(),
        resumed: false,
        ttl_ms,
    }
}

async fn fail(events: &Events, status: tonic::Status) -> Result<(), Gone> {
    tracing::debug!(code = ?status.code(), message = status.message(), "ending an assignment stream");
    events.send(Err(status)).await.map_err(|_| Gone)
}
