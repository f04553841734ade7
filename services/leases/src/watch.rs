//! `WatchLeases`: one task per stream that follows the leases in a scope (a
//! project or all of them, an owner or an owner prefix), sending what
//! changed as it changes.
//!
//! # Expected flow
//! The task starts observing owner change signals, then reads every open
//! lease in scope and sends each as `UPSERT`, then `SYNCED`. From then on a
//! signal names the owners whose leases changed (on any replica); the task
//! re-reads those owners' open leases (and, one by one, each it sent as
//! open that no longer is) and sends the difference from what it sent: an
//! open lease that is new or moved (phase, epoch, node, reason) as
//! `UPSERT`, one that left the open phases as `REMOVED` with its final
//! state. Every `assignment_resync`, or when signals were lost (a bus gap, a
//! stream that fell behind), it re-reads the whole scope the same way.
//!
//! # Invariants
//! - The observer is taken before the first read, so no change lands
//!   between the read and the wait unheard.
//! - Level-triggered: a lost signal delays a change until the next re-read,
//!   never loses it; a change sent twice is the same state twice.
//! - A lease sent as open is followed until `REMOVED` is sent for it, even
//!   once forgotten after its retention (then with the last state sent).
//! - A renewal alone (a later `expires_at`) is not a change worth a send.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use berth_bus::Signal;
use berth_proto::leases::v1;
use berth_proto::types::v1::EventKind;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use crate::ledger::{LeaseError, LeaseFilter};
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

    /// The open leases in scope.
    fn open(&self) -> LeaseFilter {
        LeaseFilter {
            project: self.project.clone(),
            owner: self.owner.clone(),
            owner_prefix: self.owner_prefix.clone(),
            open_only: true,
            ..LeaseFilter::default()
        }
    }
}

/// What about a lease a watcher acts on; a renewal moves none of it.
fn shown(lease: &LeaseRecord) -> (Phase, i64, &str, &str) {
    (lease.phase, lease.epoch, lease.node_id.as_str(), lease.reason.as_str())
}

/// Opens a stream of the leases in `scope`.
pub(crate) fn open(core: Arc<Core>, scope: Scope) -> tonic::codegen::BoxStream<v1::LeaseEvent> {
    let (events, stream) = mpsc::channel(STREAM_BUFFER);
    tokio::spawn(async move {
        if feed(&core, &scope, &events).await.is_err() {
            tracing::debug!(?scope, "lease watch closed by the watcher");
        }
    });
    Box::pin(ReceiverStream::new(stream))
}

async fn feed(core: &Core, scope: &Scope, events: &Events) -> Result<(), Gone> {
    let mut signals = core.owners.observe();
    let mut sent: HashMap<String, LeaseRecord> = HashMap::new();
    match core.ledger.list(&scope.open()).await {
        Ok(open) => {
            for lease in open {
                send(events, EventKind::Upsert, &lease).await?;
                sent.insert(lease.lease_id.clone(), lease);
            }
        }
        Err(error) => return fail(events, error).await,
    }
    let synced = v1::LeaseEvent { kind: EventKind::Synced as i32, lease: None };
    events.send(Ok(synced)).await.map_err(|_| Gone)?;
    loop {
        let owners = tokio::select! {
            () = events.closed() => return Err(Gone),
            () = core.closing.cancelled() => {
                let status = tonic::Status::unavailable("leases is shutting down; watch again");
                return events.send(Err(status)).await.map_err(|_| Gone);
            }
            signal = signals.recv() => match signal {
                Ok(Signal::Keys(keys)) => {
                    let owners: BTreeSet<(String, String)> = keys
                        .iter()
                        .filter_map(|key| split_owner_key(key))
                        .filter(|(project, owner)| scope.covers(project, owner))
                        .map(|(project, owner)| (project.to_owned(), owner.to_owned()))
                        .collect();
                    if owners.is_empty() {
                        continue;
                    }
                    Some(owners)
                }
                Ok(Signal::All) | Err(broadcast::error::RecvError::Lagged(_)) => None,
                Err(broadcast::error::RecvError::Closed) => {
                    let status = tonic::Status::unavailable("leases lost track of this stream; watch again");
                    return events.send(Err(status)).await.map_err(|_| Gone);
                }
            },
            () = tokio::time::sleep(core.config.assignment_resync) => None,
        };
        let caught_up = match owners {
            Some(owners) => catch_up_owners(core, &owners, &mut sent, events).await?,
            None => catch_up(core, &scope.open(), |_| true, &mut sent, events).await?,
        };
        if let Err(error) = caught_up {
            return fail(events, error).await;
        }
    }
}

/// Sends what changed among the leases of `owners` (each `(project, owner)`).
async fn catch_up_owners(
    core: &Core,
    owners: &BTreeSet<(String, String)>,
    sent: &mut HashMap<String, LeaseRecord>,
    events: &Events,
) -> Result<Result<(), LeaseError>, Gone> {
    for (project, owner) in owners {
        let open = LeaseFilter {
            project: Some(project.clone()),
            owner: Some(owner.clone()),
            open_only: true,
            ..LeaseFilter::default()
        };
        let covers = |lease: &LeaseRecord| lease.project == *project && lease.owner == *owner;
        if let Err(error) = catch_up(core, &open, covers, sent, events).await? {
            return Ok(Err(error));
        }
    }
    Ok(Ok(()))
}

/// Sends what changed among the leases `open` selects (open ones only) and
/// those `covers` of what was sent: a lease sent as open and no longer in
/// the open set is read alone, to send its final state, or its last one
/// sent when it was forgotten past its retention. Final leases are never
/// read in bulk, however many an owner has had.
async fn catch_up(
    core: &Core,
    open: &LeaseFilter,
    covers: impl Fn(&LeaseRecord) -> bool,
    sent: &mut HashMap<String, LeaseRecord>,
    events: &Events,
) -> Result<Result<(), LeaseError>, Gone> {
    let open = match core.ledger.list(open).await {
        Ok(open) => open,
        Err(error) => return Ok(Err(error)),
    };
    let still_open: BTreeSet<&str> = open.iter().map(|lease| lease.lease_id.as_str()).collect();
    let left: Vec<String> = sent
        .values()
        .filter(|lease| covers(lease) && !still_open.contains(lease.lease_id.as_str()))
        .map(|lease| lease.lease_id.clone())
        .collect();
    for lease in &open {
        differ(lease, sent, events).await?;
    }
    for lease_id in left {
        match core.ledger.get(&lease_id).await {
            Ok(lease) => differ(&lease, sent, events).await?,
            Err(LeaseError::NotFound(_)) => {
                if let Some(last) = sent.remove(&lease_id) {
                    send(events, EventKind::Removed, &last).await?;
                }
            }
            Err(error) => return Ok(Err(error)),
        }
    }
    Ok(Ok(()))
}

/// Sends `lease` if it differs from what was sent of it: `UPSERT` while
/// open, `REMOVED` (once) when it is final.
async fn differ(lease: &LeaseRecord, sent: &mut HashMap<String, LeaseRecord>, events: &Events) -> Result<(), Gone> {
    let before = sent.get(&lease.lease_id);
    if lease.phase.is_open() {
        if before.is_none_or(|before| shown(before) != shown(lease)) {
            send(events, EventKind::Upsert, lease).await?;
            sent.insert(lease.lease_id.clone(), lease.clone());
        }
    } else if sent.remove(&lease.lease_id).is_some() {
        send(events, EventKind::Removed, lease).await?;
    }
    Ok(())
}

async fn send(events: &Events, kind: EventKind, lease: &LeaseRecord) -> Result<(), Gone> {
    let event = v1::LeaseEvent { kind: kind as i32, lease: Some(lease.to_proto()) };
    events.send(Ok(event)).await.map_err(|_| Gone)
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
