//! What every handler and loop of one replica shares: the [`Core`], the ways
//! into the queues whose tasks commit many callers' writes at once (the
//! placer's, the launch redeemer's), and the name of the deadline index.
//!
//! A leaf of the crate's modules: the handlers, the placer, the reaper and
//! the service that starts them all import it, and it imports none of them,
//! so no two modules import each other.

use std::sync::Mutex;

use berth_bus::Bus;
use berth_runtime::NodeDirectory;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::config::LeasesConfig;
use crate::ledger::{LeaseAsk, LeaseError, Ledger, Placed, Redeem};
use crate::records::LeaseRecord;
use crate::signals::NodeSignals;

/// The bus deadline index of open leases: member lease id, score `expires_at_ms`.
pub(crate) const EXPIRY_INDEX: &str = "lease-expiry";

/// What every handler and loop of one replica shares.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) ledger: Ledger,
    pub(crate) bus: Bus,
    /// Identity's node registry, as this replica follows it.
    pub(crate) nodes: NodeDirectory,
    /// What it dials agents with (`GetLeaseLogs`).
    pub(crate) credentials: berth_mtls::TlsCredentials,
    pub(crate) signals: NodeSignals,
    /// Which owners' leases changed, for `WatchLeases` streams.
    pub(crate) owners: berth_bus::KeySignals,
    pub(crate) config: LeasesConfig,
    /// This replica's name as it campaigns for the reaper.
    pub(crate) replica_id: String,
    /// Cancelled when the replica stops: loops and streams end.
    pub(crate) closing: CancellationToken,
    pub(crate) placer: PlacerHandle,
    /// The placer's queue until its task takes it.
    pub(crate) queue: Mutex<Option<mpsc::Receiver<Queued>>>,
    /// Launch registrations to spend, many per commit.
    pub(crate) redeemer: BatchHandle<Redeem, LeaseRecord>,
    /// The redeemer's queue until its task takes it.
    pub(crate) redeems: Mutex<Option<mpsc::Receiver<Asked<Redeem, LeaseRecord>>>>,
}

impl Core {
    /// Tells `WatchLeases` streams on every replica that these leases changed.
    pub(crate) async fn announce_owners<'a>(&self, leases: impl IntoIterator<Item = &'a crate::records::LeaseRecord>) {
        let mut keys: Vec<String> =
            leases.into_iter().map(|lease| crate::signals::owner_key(&lease.project, &lease.owner)).collect();
        keys.sort();
        keys.dedup();
        self.owners.announce(&self.bus, &keys).await;
    }
}

/// One queued ask and where its answer goes.
#[derive(Debug)]
pub(crate) struct Asked<A, R> {
    pub(crate) ask: A,
    pub(crate) reply: oneshot::Sender<Result<R, LeaseError>>,
}

/// One queued lease request.
pub(crate) type Queued = Asked<LeaseAsk, Placed>;

/// The way into the placer's queue.
pub(crate) type PlacerHandle = BatchHandle<LeaseAsk, Placed>;

/// The way into a queue whose task answers many asks per commit; cheap to
/// clone.
#[derive(Debug)]
pub(crate) struct BatchHandle<A, R> {
    queue: mpsc::Sender<Asked<A, R>>,
    /// What the task does, for the errors callers see ("placing the lease").
    doing: &'static str,
}

impl<A, R> Clone for BatchHandle<A, R> {
    fn clone(&self) -> Self {
        Self { queue: self.queue.clone(), doing: self.doing }
    }
}

impl<A, R> BatchHandle<A, R> {
    /// A handle and the queue its task will drain.
    pub(crate) fn new(capacity: usize, doing: &'static str) -> (Self, mpsc::Receiver<Asked<A, R>>) {
        let (queue, receiver) = mpsc::channel(capacity.max(1));
        (Self { queue, doing }, receiver)
    }

    /// Queues `ask` and waits for its answer.
    pub(crate) async fn request(&self, ask: A) -> Result<R, LeaseError> {
        let (reply, answer) = oneshot::channel();
        self.queue.try_send(Asked { ask, reply }).map_err(|error| match error {
            mpsc::error::TrySendError::Full(_) => {
                LeaseError::Unavailable("the ledger has too many requests queued; retry shortly".to_owned())
            }
            mpsc::error::TrySendError::Closed(_) => {
                LeaseError::Unavailable("the ledger is shutting down; retry on another replica".to_owned())
            }
        })?;
        answer.await.map_err(|_| LeaseError::Unavailable(format!("the ledger stopped before {}", self.doing)))?
    }
}

/// Drains `queue` until `closing`, handing `run` whatever is queued (up to
/// `max_batch`) as soon as the previous batch is done: an idle replica
/// answers a lone ask at once, a busy one many per commit. Asks left when
/// it closes are answered UNAVAILABLE.
pub(crate) fn drain_batches<A, R, F, Fut>(
    closing: CancellationToken,
    mut queue: mpsc::Receiver<Asked<A, R>>,
    max_batch: usize,
    mut run: F,
) where
    A: Send + 'static,
    R: Send + 'static,
    F: FnMut(Vec<Asked<A, R>>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        loop {
            let first = tokio::select! {
                () = closing.cancelled() => break,
                next = queue.recv() => match next {
                    Some(asked) => asked,
                    None => break,
                },
            };
            let mut batch = vec![first];
            while batch.len() < max_batch.max(1) {
                match queue.try_recv() {
                    Ok(asked) => batch.push(asked),
                    Err(_) => break,
                }
            }
            run(batch).await;
        }
        queue.close();
        while let Ok(asked) = queue.try_recv() {
            let _ = asked.reply.send(Err(LeaseError::Unavailable("the ledger is shutting down".to_owned())));
        }
    });
}
