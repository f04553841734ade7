//! Heartbeat deadlines moved in batches: a steady node's heartbeat hands its
//! next deadline to a writer that moves up to [`MAX_BATCH`] of them in one bus
//! round trip, at most [`FLUSH_EVERY`] after the first of them, instead of one
//! round trip per heartbeat. At 10,000 nodes a second that is about 50 round
//! trips a second instead of 10,000, for identity and for Redis.
//!
//! # Invariants
//! - A deadline reaches the bus at most [`FLUSH_EVERY`] plus one round trip
//!   after its heartbeat was answered. The deadline itself lies
//!   `--down-after` ahead of the heartbeat, and the monitor acts only once it
//!   has passed, so the delay would have to exceed `--down-after` (always
//!   longer than the heartbeat interval) to let a node look late.
//! - Batches are written one at a time in the order their beats arrived, and
//!   within a batch a later entry for a node overrides an earlier one, so a
//!   node's deadline never moves back.
//! - When the writer is not running or its queue is full, the heartbeat moves
//!   its deadline itself, as one round trip of its own.
//! - A batch that fails is logged, like a failed single move; the monitor's
//!   rebuild after a bus loss restores every deadline from the database.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::batches;

/// How long the first deadline of a batch may wait for others to join it.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// The most deadlines moved in one round trip.
pub(crate) const MAX_BATCH: usize = 1024;

/// Deadlines that may wait for the writer before heartbeats move their own.
const QUEUE_CAPACITY: usize = 16 * 1024;

/// A node and the moment its next heartbeat is due by, in epoch milliseconds.
pub(crate) type Due = (String, i64);

/// The queue of deadlines waiting to be moved, and its writer.
#[derive(Debug)]
pub(crate) struct DeadlineWriter {
    queue: batches::Queue<Due>,
}

impl Default for DeadlineWriter {
    fn default() -> Self {
        Self { queue: batches::Queue::new(QUEUE_CAPACITY) }
    }
}

impl DeadlineWriter {
    /// Queues `due`; gives it back when no writer runs or the queue is full,
    /// and the caller must move it itself.
    pub(crate) fn offer(&self, due: Due) -> Result<(), Due> {
        self.queue.offer(due)
    }

    /// Starts the writer until `shutdown`, handing each batch to `write`
    /// (the registry's: one round trip); a second call does nothing.
    pub(crate) fn spawn<F, Fut>(&self, write: F, shutdown: &CancellationToken)
    where
        F: Fn(Vec<Due>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if let Some(receiver) = self.queue.start() {
            tokio::spawn(batches::write_all(receiver, shutdown.clone(), FLUSH_EVERY, MAX_BATCH, write));
        }
    }
}
