//! Identity's write-behind queues: callers hand work to a [`Queue`] without
//! waiting, and its one writer task gathers it: wait for the first item, then
//! take more until a window has passed since it or a batch is full, so a
//! quiet queue costs nothing and a busy one writes in few trips.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A bounded queue with one writer, which may not have started yet.
#[derive(Debug)]
pub(crate) struct Queue<T> {
    sender: mpsc::Sender<T>,
    /// Taken by the writer when it starts.
    receiver: Mutex<Option<mpsc::Receiver<T>>>,
    running: AtomicBool,
}

impl<T> Queue<T> {
    /// A queue holding at most `capacity` items.
    pub(crate) fn new(capacity: usize) -> Self {
        let (sender, receiver) = mpsc::channel(capacity);
        Self { sender, receiver: Mutex::new(Some(receiver)), running: AtomicBool::new(false) }
    }

    /// Queues `item`; gives it back when no writer runs or the queue is
    /// full, and the caller must do the work itself.
    pub(crate) fn offer(&self, item: T) -> Result<(), T> {
        if !self.running.load(Ordering::Acquire) {
            return Err(item);
        }
        self.sender.try_send(item).map_err(|refused| match refused {
            mpsc::error::TrySendError::Full(item) | mpsc::error::TrySendError::Closed(item) => item,
        })
    }

    /// The receiving end, for the writer starting now; `None` once taken.
    pub(crate) fn start(&self) -> Option<mpsc::Receiver<T>> {
        let receiver = self.receiver.lock().unwrap_or_else(PoisonError::into_inner).take()?;
        self.running.store(true, Ordering::Release);
        Some(receiver)
    }
}

/// Fills `batch` (which the caller has emptied) from `receiver`: waits for a
/// first item, then takes more until `window` has passed since it arrived or
/// `max` are in the batch. `false` when there will be no more: `shutdown`
/// was cancelled or the queue closed; `batch` may still hold items to write.
pub(crate) async fn gather<T>(
    receiver: &mut mpsc::Receiver<T>,
    shutdown: &CancellationToken,
    window: Duration,
    max: usize,
    batch: &mut Vec<T>,
) -> bool {
    let first = tokio::select! {
        biased;
        () = shutdown.cancelled() => return false,
        item = receiver.recv() => item,
    };
    let Some(first) = first else { return false };
    batch.push(first);
    let flush_at = tokio::time::Instant::now() + window;
    while batch.len() < max {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep_until(flush_at) => break,
            item = receiver.recv() => match item {
                Some(item) => batch.push(item),
                None => return false,
            },
        }
    }
    true
}

/// What was queued before shutdown, in batches of at most `max`, so it is
/// still written within one pass.
pub(crate) fn drain<T>(receiver: &mut mpsc::Receiver<T>, max: usize) -> Vec<Vec<T>> {
    receiver.close();
    let mut batches = Vec::new();
    let mut batch = Vec::new();
    while let Ok(item) = receiver.try_recv() {
        batch.push(item);
        if batch.len() == max {
            batches.push(std::mem::take(&mut batch));
        }
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    batches
}

/// A queue's writer, until `shutdown`: gathers each batch (see [`gather`])
/// and hands it to `write`; once stopped, writes what is still queued. An
/// empty batch is never handed over.
pub(crate) async fn write_all<T, F, Fut>(
    mut receiver: mpsc::Receiver<T>,
    shutdown: CancellationToken,
    flush_every: Duration,
    max_batch: usize,
    write: F,
) where
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut batch = Vec::with_capacity(max_batch);
    while gather(&mut receiver, &shutdown, flush_every, max_batch, &mut batch).await {
        if !batch.is_empty() {
            write(std::mem::replace(&mut batch, Vec::with_capacity(max_batch))).await;
        }
    }
    if !batch.is_empty() {
        write(batch).await;
    }
    for rest in drain(&mut receiver, max_batch).into_iter().filter(|rest| !rest.is_empty()) {
        write(rest).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_batch_closes_when_full_or_when_its_window_has_passed() {
        let (tx, mut rx) = mpsc::channel(16);
        let shutdown = CancellationToken::new();
        for n in 0..5 {
            tx.send(n).await.unwrap();
        }
        let mut batch = Vec::new();
        assert!(gather(&mut rx, &shutdown, Duration::from_millis(20), 3, &mut batch).await);
        assert_eq!(batch, [0, 1, 2], "full at three");
        batch.clear();
        assert!(gather(&mut rx, &shutdown, Duration::from_millis(20), 3, &mut batch).await);
        assert_eq!(batch, [3, 4], "closed by the window with two");
    }

    #[test]
    fn a_queue_refuses_work_until_its_writer_starts_and_when_full() {
        let queue = Queue::new(1);
        assert_eq!(queue.offer(1), Err(1), "no writer yet");
        let mut receiver = queue.start().unwrap();
        assert!(queue.start().is_none(), "one writer");
        assert_eq!(queue.offer(2), Ok(()));
        assert_eq!(queue.offer(3), Err(3), "full");
        assert_eq!(receiver.try_recv().ok(), Some(2));
    }

    #[tokio::test]
    async fn shutdown_ends_gathering_and_drain_keeps_what_was_queued() {
        let (tx, mut rx) = mpsc::channel(16);
        let shutdown = CancellationToken::new();
        for n in 0..5 {
            tx.send(n).await.unwrap();
        }
        shutdown.cancel();
        let mut batch = Vec::new();
        assert!(!gather(&mut rx, &shutdown, Duration::from_secs(60), 3, &mut batch).await);
        assert_eq!(drain(&mut rx, 2), [vec![0, 1], vec![2, 3], vec![4]]);
        assert!(tx.try_send(9).is_err(), "closed after the drain");
    }
}
