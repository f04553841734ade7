//! Node change signals: how a replica's assignment streams learn that their
//! node's leases changed, whichever replica changed them.
//!
//! # Expected flow
//! A replica that commits a change to some nodes' leases wakes its own
//! streams for those nodes at once and publishes the node ids on the bus
//! topic [`ASSIGNMENTS_TOPIC`]. Every replica holds one subscription to the
//! topic and wakes its streams for the nodes named. A signal carries no
//! data: a woken stream re-reads its node's changes from the database.
//!
//! # Invariants
//! - Level-triggered: a lost signal delays a change until the stream's next
//!   periodic re-read, never loses it. A bus gap (or a broken subscription)
//!   wakes every stream.
//! - One waiter per stream, coalescing: however many signals arrive while a
//!   stream reads, it reads once more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use berth_bus::{Bus, BusMessage};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The bus topic node change signals travel on; the payload is node ids, one per line.
pub(crate) const ASSIGNMENTS_TOPIC: &str = "assignments";

/// First wait before subscribing again after the subscription broke; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);

/// Longest wait between subscription attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The replica's wakers, one per node with a live stream; cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeSignals {
    wakers: Arc<Mutex<HashMap<String, watch::Sender<u64>>>>,
}

impl NodeSignals {
    /// A receiver that changes whenever `node_id`'s leases may have changed.
    pub(crate) fn watch(&self, node_id: &str) -> watch::Receiver<u64> {
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.entry(node_id.to_owned()).or_insert_with(|| watch::channel(0).0).subscribe()
    }

    /// Wakes the streams of `node_ids` on this replica.
    pub(crate) fn wake<'a>(&self, node_ids: impl IntoIterator<Item = &'a str>) {
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        for node_id in node_ids {
            match wakers.get(node_id) {
                Some(waker) if waker.receiver_count() == 0 => {
                    wakers.remove(node_id);
                }
                Some(waker) => waker.send_modify(|n| *n = n.wrapping_add(1)),
                None => {}
            }
        }
    }

    /// Wakes every stream on this replica, after signals may have been lost.
    pub(crate) fn wake_all(&self) {
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.retain(|_, waker| waker.receiver_count() > 0);
        for waker in wakers.values() {
            waker.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Wakes `node_ids` here, then tells the other replicas through `bus`.
    /// A failed publish is logged: their streams catch up at their next re-read.
    pub(crate) async fn announce(&self, bus: &Bus, node_ids: &[String]) {
        if node_ids.is_empty() {
            return;
        }
        self.wake(node_ids.iter().map(String::as_str));
        if let Err(error) = bus.publish(ASSIGNMENTS_TOPIC, node_ids.join("\n")).await {
            tracing::warn!(%error, nodes = node_ids.len(), "could not announce lease changes on the bus");
        }
    }

    /// Follows the bus topic until `stop`, waking streams as signals arrive.
    pub(crate) fn spawn_follower(&self, bus: Bus, stop: CancellationToken) {
        let signals = self.clone();
        tokio::spawn(async move {
            let mut backoff = MIN_BACKOFF;
            loop {
                let subscribed = tokio::select! {
                    () = stop.cancelled() => return,
                    subscribed = bus.subscribe(ASSIGNMENTS_TOPIC) => subscribed,
                };
                match subscribed {
                    Ok(mut subscription) => {
                        backoff = MIN_BACKOFF;
                        // Whatever was published while unsubscribed is unknown.
                        signals.wake_all();
                        loop {
                            let message = tokio::select! {
                                () = stop.cancelled() => return,
                                message = subscription.recv() => message,
                            };
                            match message {
                                Some(BusMessage::Payload(payload)) => {
                                    let text = String::from_utf8_lossy(&payload);
                                    signals.wake(text.lines().filter(|line| !line.is_empty()));
                                }
                                Some(BusMessage::Gap) => signals.wake_all(),
                                None => break,
                            }
                        }
                        tracing::warn!("the bus subscription for lease changes ended; subscribing again");
                    }
                    Err(error) => tracing::warn!(%error, "cannot subscribe to lease changes on the bus; retrying"),
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_wakes_only_its_node_and_coalesces() {
        let signals = NodeSignals::default();
        let mut one = signals.watch("n-1");
        let two = signals.watch("n-2");
        signals.wake(["n-1", "n-1", "n-3"]);
        assert!(one.has_changed().unwrap());
        assert!(!two.has_changed().unwrap());
        one.borrow_and_update();
        assert!(!one.has_changed().unwrap());
        signals.wake_all();
        assert!(one.has_changed().unwrap() && two.has_changed().unwrap());
    }

    #[tokio::test]
    async fn wakers_of_closed_streams_are_dropped() {
        let signals = NodeSignals::default();
        drop(signals.watch("n-1"));
        signals.wake(["n-1"]);
        assert!(signals.wakers.lock().unwrap().is_empty());
    }
}
