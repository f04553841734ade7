//! `WatchLeases`: one task per stream that follows the leases in a scope (a
//! project or all of them, an owner or an owner prefix), sending what
//! changed as it changes, and resuming a broken stream from its cursor.
//!
//! # Expected flow
//! The task starts observing owner change signals, then reads from the
//! ledger's change log ([`Ledger::changes`](crate::ledger::Ledger::changes)):
//! afresh, every open lease in scope, each sent as `UPSERT`; resumed, every
//! lease in scope changed since the client's cursor, open as `UPSERT`, final
//! as `REMOVED`. Then `SYNCED` with the read's cursor. From then on a signal
//! naming an owner in scope (from any replica), a lost signal, or every
//! `assignment_resync` makes it read the changes since its cursor and send
//! the difference from what it sent: an open lease new or moved (phase,
//! epoch, node, reason) as `UPSERT`, one that left the open phases as
//! `REMOVED` with its final state.
//!
//! Signals only wake the task: what it sends comes from the change log, so
//! every event's cursor is exact. Each event carries the cursor its read
//! started from, so a client resuming from the last event it applied gets
//! that event's change again at most, never loses one.
//!
//! # Invariants
//! - The observer is taken before the first read, so no change lands
//!   between the read and the wait unheard.
//! - Level-triggered: a lost signal delays a change until the next read,
//!   never loses it; a change sent twice is the same state twice. The next
//!   read is at most `assignment_resync` after the last one, however many
//!   signals for other scopes wake the task meanwhile.
//! - A lease sent as open is followed until `REMOVED` is sent for it. If
//!   the log was forgotten under a stream that fell that far behind, the
//!   stream reads the open set again and sends each lease it sent as open
//!   that is no longer in it as `REMOVED` (its final state, or the last one
//!   sent once forgotten past its retention). Final leases are never read
//!   in bulk, however many an owner has had: only those changed since.
//! - A renewal alone (a later `expires_at`) is not a change worth a send,
//!   and does not stamp the change log.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use berth_bus::Signal;
use berth_proto::leases::v1;
use berth_proto::types::v1::EventKind;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::ledger::{Changes, LeaseError, LeaseFilter};
use crate::model::Phase;
use crate::records::LeaseRecord;
use crate::shared::Core;
use crate::signals::split_owner_key;

/// Events a stream buffers for a slow watcher before its task waits.
const STREAM_BUFFER: usize = 256;

type Events = mpsc::Sender<Result<v1::LeaseEvent, tonic::Status>>;

/// The watcher went away; the stream's task ends.
struct Gone;

/// Which leases a stream follows; every set field must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Scope {
    /// `None` follows every project.
    pub(crate) project: Option<String>,
    pub(crate) owner: Option<String>,
    pub(crate) owner_prefix: Option<String>,
}

impl Scope {
    /// Whether leases of `owner` in `project` are in scope.
    fn covers(&self, project: &str, owner: &str) -> bool {
        self.project.as_deref().is_none_or(|p| p == project)
            && self.owner.as_deref().is_none_or(|o| o == owner)
            && self.owner_prefix.as_deref().is_none_or(|prefix| owner.starts_with(prefix))
    }

    /// The leases in scope, open or final.
    fn filter(&self) -> LeaseFilter {
        LeaseFilter {
            project: self.project.clone(),
            owner: self.owner.clone(),
            owner_prefix: self.owner_prefix.clone(),
            ..LeaseFilter::default()
        }
    }
}

/// What about a lease a watcher acts on; a renewal moves none of it.
fn shown(lease: &LeaseRecord) -> (Phase, i64, &str, &str) {
    (lease.phase, lease.epoch, lease.node_id.as_str(), lease.reason.as_str())
}

/// Opens a stream of the leases in `scope`, resumed from `resume` when the
/// ledger still can.
pub(crate) fn open(core: Arc<Core>, scope: Scope, resume: Option<i64>) -> tonic::codegen::BoxStream<v1::LeaseEvent> {
    let (events, stream) = mpsc::channel(STREAM_BUFFER);
    tokio::spawn(async move {
        if feed(&core, &scope, resume, &events).await.is_err() {
            tracing::debug!(?scope, "lease watch closed by the watcher");
        }
    });
    Box::pin(ReceiverStream::new(stream))
}

/// What one stream has told its watcher.
struct Told<'a> {
    events: &'a Events,
    /// Each lease sent as open, as last sent.
    open: HashMap<String, LeaseRecord>,
    /// Final leases sent as `REMOVED` that the last read still returned, so
    /// the next read that returns them again sends nothing.
    removed: HashSet<String>,
    /// Whether the watcher may hold leases this stream never sent (it
    /// resumed): then every final lease read is sent as `REMOVED` once.
    resumed: bool,
}

impl Told<'_> {
    /// Sends what changed in `read` (changes since `from`) from what was told.
    async fn changes(&mut self, read: &Changes, from: i64) -> Result<(), Gone> {
        let mut removed = HashSet::new();
        for lease in &read.leases {
            if lease.phase.is_open() {
                self.removed.remove(&lease.lease_id);
                if self.open.get(&lease.lease_id).is_none_or(|before| shown(before) != shown(lease)) {
                    self.send(EventKind::Upsert, lease, from).await?;
                    self.open.insert(lease.lease_id.clone(), lease.clone());
                }
            } else {
                let held = self.open.remove(&lease.lease_id).is_some();
                if held || (self.resumed && !self.removed.contains(&lease.lease_id)) {
                    self.send(EventKind::Removed, lease, from).await?;
                }
                if held || self.resumed {
                    removed.insert(lease.lease_id.clone());
                }
            }
        }
        self.removed = removed;
        Ok(())
    }

    /// Sends what changed given `open`, the whole open set: each lease that
    /// is new or moved as `UPSERT`, and each sent as open that is not in it
    /// as `REMOVED`, read alone for its final state (its last one sent when
    /// forgotten past its retention). Every event carries cursor 0: the
    /// stream's next read's events carry the set's cursor.
    async fn open_set(&mut self, core: &Core, open: &Changes) -> Result<Result<(), LeaseError>, Gone> {
        self.changes(open, 0).await?;
        let still_open: BTreeSet<&str> = open.leases.iter().map(|lease| lease.lease_id.as_str()).collect();
        let left: Vec<String> = self.open.keys().filter(|id| !still_open.contains(id.as_str())).cloned().collect();
        for lease_id in left {
            let lease = match core.ledger.get(&lease_id).await {
                Ok(lease) if !lease.phase.is_open() => lease,
                // Open again after the set was read: the next read sends it.
                Ok(_) => continue,
                Err(LeaseError::NotFound(_)) => match self.open.get(&lease_id) {
                    Some(last) => last.clone(),
                    None => continue,
                },
                Err(error) => return Ok(Err(error)),
            };
            self.open.remove(&lease_id);
            // Cursor 0, as the open set's events: a watcher cut off among
            // them cannot resume, since these changes predate any cursor.
            self.send(EventKind::Removed, &lease, 0).await?;
        }
        Ok(Ok(()))
    }

    async fn send(&self, kind: EventKind, lease: &LeaseRecord, cursor: i64) -> Result<(), Gone> {
        let event = v1::LeaseEvent {
            kind: kind as i32,
            lease: Some(lease.to_proto()),
            cursor: u64::try_from(cursor).unwrap_or_default(),
            resumed: false,
        };
        self.events.send(Ok(event)).await.map_err(|_| Gone)
    }
}

async fn feed(core: &Core, scope: &Scope, resume: Option<i64>, events: &Events) -> Result<(), Gone> {
    let mut signals = core.owners.observe();
    let filter = scope.filter();
    let first = match core.ledger.changes(&filter, resume).await {
        Ok(first) => first,
        Err(error) => return fail(events, error).await,
    };
    let mut told = Told { events, open: HashMap::new(), removed: HashSet::new(), resumed: first.resumed };
    let from = if first.resumed { resume.unwrap_or_default() } else { 0 };
    told.changes(&first, from).await?;
    let synced = v1::LeaseEvent {
        kind: EventKind::Synced as i32,
        lease: None,
        cursor: u64::try_from(first.cursor).unwrap_or_default(),
        resumed: first.resumed,
    };
    events.send(Ok(synced)).await.map_err(|_| Gone)?;
    let mut cursor = first.cursor;
    // A deadline, not a fresh sleep per wait: signals for owners out of
    // scope come many times a second under load, and must not put off the
    // read that heals a lost signal.
    let mut resync_at = Instant::now() + core.config.assignment_resync;
    loop {
        tokio::select! {
            () = events.closed() => return Err(Gone),
            () = core.closing.cancelled() => {
                let status = tonic::Status::unavailable("leases is shutting down; watch again");
                return events.send(Err(status)).await.map_err(|_| Gone);
            }
            signal = signals.recv() => match signal {
                Ok(Signal::Keys(keys)) => {
                    let in_scope = keys
                        .iter()
                        .filter_map(|key| split_owner_key(key))
                        .any(|(project, owner)| scope.covers(project, owner));
                    if !in_scope {
                        continue;
                    }
                }
                Ok(Signal::All) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => {
                    let status = tonic::Status::unavailable("leases lost track of this stream; watch again");
                    return events.send(Err(status)).await.map_err(|_| Gone);
                }
            },
            () = tokio::time::sleep_until(resync_at) => {}
        }
        resync_at = Instant::now() + core.config.assignment_resync;
        let read = match core.ledger.changes(&filter, Some(cursor)).await {
            Ok(read) => read,
            Err(error) => return fail(events, error).await,
        };
        if read.resumed {
            told.changes(&read, cursor).await?;
        } else if told.resumed {
            // The watcher may hold leases this stream never sent, which
            // ended in the forgotten stretch: only a fresh stream can say so.
            let status = tonic::Status::aborted("this lease watch fell behind what the ledger keeps; watch again");
            return events.send(Err(status)).await.map_err(|_| Gone);
        } else {
            tracing::info!(?scope, cursor, "a lease watch fell behind the change log; reading the open set again");
            if let Err(error) = told.open_set(core, &read).await? {
                return fail(events, error).await;
            }
        }
        cursor = read.cursor;
    }
}

async fn fail(events: &Events, error: LeaseError) -> Result<(), Gone> {
    let status: tonic::Status = error.into();
    tracing::debug!(code = ?status.code(), message = status.message(), "ending a lease watch");
    events.send(Err(status)).await.map_err(|_| Gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_covers_only_what_each_set_field_allows() {
        let everything = Scope { project: None, owner: None, owner_prefix: None };
        assert!(everything.covers("acme", "anyone"));
        let prefixed = Scope { project: None, owner: None, owner_prefix: Some("revisions/".into()) };
        assert!(prefixed.covers("acme", "revisions/web@u-1"));
        assert!(!prefixed.covers("acme", "load"));
        let one = Scope { project: Some("acme".into()), owner: Some("load".into()), owner_prefix: None };
        assert!(one.covers("acme", "load"));
        assert!(!one.covers("other", "load"));
        assert!(!one.covers("acme", "load-2"));
    }
}
