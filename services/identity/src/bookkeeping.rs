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

use std::time::Duration;

use berth_proto::types::v1::Capacity;
use berth_store::{StoreError, TxError};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::batches;
use crate::registry::{NODE_COLUMNS, NodeRecord, NodeRegistry, to_column};

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
enum BookkeepingError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl TxError for BookkeepingError {
    fn store_error(&self) -> Option<&StoreError> {
        match self {
            Self::Store(error) => Some(error),
        }
    }
}

impl From<sqlx::Error> for BookkeepingError {
    fn from(error: sqlx::Error) -> Self {
        Self::Store(error.into())
    }
}

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

    /// Starts the writer over `registry` until `shutdown`; a second call does nothing.
    pub(crate) fn spawn(&self, registry: NodeRegistry, shutdown: &CancellationToken) {
        if let Some(receiver) = self.queue.start() {
            tokio::spawn(write_batches(registry, receiver, shutdown.clone()));
        }
    }
}

/// The writer: batches beats and writes each batch in one transaction.
async fn write_batches(registry: NodeRegistry, mut receiver: mpsc::Receiver<Beat>, shutdown: CancellationToken) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while batches::gather(&mut receiver, &shutdown, FLUSH_EVERY, MAX_BATCH, &mut batch).await {
        write_logged(&registry, &mut batch).await;
    }
    write_logged(&registry, &mut batch).await;
    for mut rest in batches::drain(&mut receiver, MAX_BATCH) {
        write_logged(&registry, &mut rest).await;
    }
}

/// Writes and empties `batch`; on failure its nodes are due again.
async fn write_logged(registry: &NodeRegistry, batch: &mut Vec<Beat>) {
    if batch.is_empty() {
        return;
    }
    match write(registry, batch).await {
        Ok(written) => {
            for record in written {
                registry.remember(record);
            }
        }
        Err(error) => {
            tracing::warn!(nodes = batch.len(), %error, "writing heartbeat bookkeeping failed; the next heartbeats retry");
            for beat in batch.iter() {
                registry.forget_persisted(&beat.node_id);
            }
        }
    }
    batch.clear();
}

/// Writes every beat of `batch` in one transaction; the rows it changed.
async fn write(registry: &NodeRegistry, batch: &[Beat]) -> Result<Vec<NodeRecord>, BookkeepingError> {
    let update = format!(
        "UPDATE nodes SET last_heartbeat_at_ms = $3, revision = revision + 1, \
         usage_cpu_millis = COALESCE($4, usage_cpu_millis), usage_memory_bytes = COALESCE($5, usage_memory_bytes) \
         WHERE node_id = $1 AND incarnation = $2 AND state IN ('up', 'draining') \
         AND (last_heartbeat_at_ms IS NULL OR last_heartbeat_at_ms < $3) \
         RETURNING {NODE_COLUMNS}"
    );
    let update = update.as_str();
    registry
        .store()
        .tx("nodes.heartbeat_bookkeeping", |conn| {
            Box::pin(async move {
                let mut written = Vec::with_capacity(batch.len());
                for beat in batch {
                    let row = sqlx::query(sqlx::AssertSqlSafe(update))
                        .bind(&beat.node_id)
                        .bind(beat.incarnation)
                        .bind(beat.at_ms)
                        .bind(beat.usage.map(|u| to_column(u.cpu_millis)))
                        .bind(beat.usage.map(|u| to_column(u.memory_bytes)))
                        .fetch_optional(&mut *conn)
                        .await?;
                    if let Some(row) = row {
                        written.push(NodeRecord::from_row(&row)?);
                    }
                }
                Ok(written)
            })
        })
        .await
}
