//! What every handler and loop of one replica shares: the [`Core`], the way
//! into the placer's queue, and the name of the deadline index.
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
use crate::ledger::{LeaseAsk, LeaseError, Ledger, Placed};
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

/// One queued request and where its answer goes.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) ask: LeaseAsk,
    pub(crate) reply: oneshot::Sender<Result<Placed, LeaseError>>,
}

/// The way into the placer's queue; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct PlacerHandle {
    queue: mpsc::Sender<Queued>,
}

impl PlacerHandle {
    /// A handle and the queue the placer task will drain.
    pub(crate) fn new(capacity: usize) -> (Self, mpsc::Receiver<Queued>) {
        let (queue, receiver) = mpsc::channel(capacity.max(1));
        (Self { queue }, receiver)
    }

    /// Places `ask`, or finds the lease its key already names.
    pub(crate) async fn request(&self, ask: LeaseAsk) -> Result<Placed, LeaseError> {
        let (reply, answer) = oneshot::channel();
        self.queue.try_send(Queued { ask, reply }).map_err(|error| match error {
            mpsc::error::TrySendError::Full(_) => {
                LeaseError::Unavailable("the ledger has too many requests queued; retry shortly".to_owned())
            }
            mpsc::error::TrySendError::Closed(_) => {
                LeaseError::Unavailable("the ledger is shutting down; retry on another replica".to_owned())
            }
        })?;
        answer.await.map_err(|_| LeaseError::Unavailable("the ledger stopped before placing the lease".to_owned()))?
    }
}
