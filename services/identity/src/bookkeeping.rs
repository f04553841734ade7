//! Heartbeat bookkeeping written in batches, off the heartbeat's path: a
//! steady node's last heartbeat time and usage reach its row every
//! `persist_every`, many nodes to one transaction, while the heartbeat that
//! carried them has long been answered.
//!
//! # Expected flow
//! 1. A heartbeat of a live node that changes nothing but its bookkeeping, and
//!    whose bookkeeping is due, moves its bus deadline, hands a [`Beat`] to the
//!    [`Bookkeeper`] and answers.
//! 2. The writer task takes beats as they come; once [`FLUSH_EVERY`] has passed
//!    since the first of a batch, or [`MAX_BATCH`] are waiting, it writes them in
//!    one transaction and takes the written rows into the index.
//! 3. On shutdown it writes what is waiting, then stops.
//!
//! # Invariants
//! - A bookkeeping write changes only `last_heartbeat_at_ms`, the usage and the
//!   revision, and only of a row still live at the incarnation the heartbeat
//!   was checked against: a node reaped, drained, revoked or rejoined since
//!   keeps its row as it is.
//! - `last_heartbeat_at_ms` never goes back: a beat older than the stored one
//!   writes nothing.
//! - A batch that fails is not retried here: its nodes are marked unwritten,
//!   so their next heartbeat queues them again. Liveness never waits on this
//!   (it is the bus deadline), and the monitor's rebuild after a bus loss
//!   grants a grace on top of a row that may be `persist_every` old anyway.
//! - When the writer is not running or its queue is full, the heartbeat writes
//!   its bookkeeping itself, as one transaction of its own.
//!
//! The write itself is the registry's, which owns the rows and the index it
//! keeps of them; this module holds the queue and the writer task the
//! registry hands that write to, and imports nothing of the registry.

use std::time::Duration;

use berth_proto::types::v1::Capacity;
use berth_store::StoreError;
use tokio_util::sync::CancellationToken;

use crate::batches;

/// How long the first beat of a batch may wait for others to join it.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// The most beats written in one transaction.
pub(crate) const MAX_BATCH: usize = 256;

/// Beats that may wait for the writer before heartbeats write their own.
const QUEUE_CAPACITY: usize = 16 * 1024;

/// One node's bookkeeping, as its heartbeat reported it.
#[derive(Debug, Clone)]
pub(crate) struct Beat {
    /// The node.
    pub(crate) node_id: String,
    /// The incarnation the heartbeat was checked against.
    pub(crate) incarnation: i64,
    /// The usage it reported; `None` keeps the stored usage.
    pub(crate) usage: Option<Capacity>,
    /// When it arrived, on the database clock (epoch milliseconds).
    pub(crate) at_ms: i64,
}

/// Why a batch could not be written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BookkeepingError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(BookkeepingError);

/// The queue of beats waiting to be written, and its writer.
#[derive(Debug)]
pub(crate) struct Bookkeeper {
    queue: batches::Queue<Beat>,
}

impl Default for Bookkeeper {
    fn default() -> Self {
        Self { queue: batches::Queue::new(QUEUE_CAPACITY) }
    }
}

impl Bookkeeper {
    /// Queues `beat`; `false` when no writer runs or the queue is full, and the
    /// caller must write it itself.
    pub(crate) fn offer(&self, beat: Beat) -> bool {
        self.queue.offer(beat).is_ok()
    }

    /// Starts the writer until `shutdown`, handing each batch to `write`
    /// (the registry's: one transaction, then its cache); a second call
    /// does nothing.
    pub(crate) fn spawn<F, Fut>(&self, write: F, shutdown: &CancellationToken)
    where
        F: Fn(Vec<Beat>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if let Some(receiver) = self.queue.start() {
            tokio::spawn(batches::write_all(receiver, shutdown.clone(), FLUSH_EVERY, MAX_BATCH, write));
        }
    }
}
