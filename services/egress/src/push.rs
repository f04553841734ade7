//! `WatchEgress`: each node's whole egress state, streamed from any replica,
//! and the signals that tell a replica's streams their node changed.
//!
//! # Expected flow
//! A stream sends its node's state at once: the node's generation and every
//! plan of every tenant it hosts, read in one transaction (generation 0 and
//! no plans for a node never sent anything). It sends the whole state again
//! whenever the stored generation is newer than what it last sent, so a
//! reconnecting node gets the current state first and every state a node
//! receives has a larger generation than the one before. Plans in a push
//! carry no `node_acks`; `GetPlan` shows those.
//!
//! # Signals
//! The full pass, on whichever replica leads, announces the nodes whose
//! state it changed: it wakes its own streams for them and publishes the
//! node ids on the bus topic [`NODES_TOPIC`]; every replica follows the
//! topic and wakes its streams for the nodes named. A signal carries no data.
//! Level-triggered: a lost signal delays a push until the stream's next
//! `watch_resync` re-read, and a bus gap wakes every stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use berth_bus::{Bus, BusMessage};
use berth_proto::egress::v1 as proto;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::catalog::CatalogError;
use crate::service::Core;

/// The bus topic node change signals travel on; the payload is node ids, one per line.
pub(crate) const NODES_TOPIC: &str = "egress.nodes";

/// States a slow node may have waiting before the stream waits for it.
const WATCH_BUFFER: usize = 4;

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
    /// A receiver that changes whenever `node_id`'s state may have changed.
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
    pub(crate) async fn announce(&self, bus: &Bus, node_ids: &[String]) {
        if node_ids.is_empty() {
            return;
        }
        self.wake(node_ids.iter().map(String::as_str));
        if let Err(error) = bus.publish(NODES_TOPIC, node_ids.join("\n")).await {
            tracing::warn!(%error, nodes = node_ids.len(), "could not announce egress changes on the bus");
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
                    subscribed = bus.subscribe(NODES_TOPIC) => subscribed,
                };
                match subscribed {
                    Ok(mut subscription) => {
                        backoff = MIN_BACKOFF;
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
                        tracing::warn!("the bus subscription for egress changes ended; subscribing again");
                    }
                    Err(error) => tracing::warn!(%error, "cannot subscribe to egress changes on the bus; retrying"),
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

/// Opens `node_id`'s stream.
pub(crate) fn open(core: Arc<Core>, node_id: String) -> tonic::codegen::BoxStream<proto::NodeEgressState> {
    let (states, stream) = mpsc::channel(WATCH_BUFFER);
    let wake = core.nodes.watch(&node_id);
    tokio::spawn(async move {
        let feed = Feed { core, node_id, states, sent: None };
        feed.run(wake).await;
    });
    Box::pin(ReceiverStream::new(stream))
}

struct Feed {
    core: Arc<Core>,
    node_id: String,
    states: mpsc::Sender<Result<proto::NodeEgressState, tonic::Status>>,
    /// The generation last sent.
    sent: Option<u64>,
}

/// Why a feed stops.
enum Stop {
    /// The node went away.
    Gone,
    /// The catalog failed; the node is told to watch again.
    Failed(CatalogError),
}

impl Feed {
    async fn run(mut self, mut wake: watch::Receiver<u64>) {
        let mut resync = tokio::time::interval(self.core.config.watch_resync);
        resync.tick().await;
        let mut step = self.send_state().await;
        loop {
            if let Err(stop) = step {
                if let Stop::Failed(error) = stop {
                    tracing::warn!(node = %self.node_id, %error, "an egress watch failed");
                    let _ = self.states.send(Err(error.into())).await;
                }
                return;
            }
            step = tokio::select! {
                () = self.states.closed() => return,
                () = self.core.closing.cancelled() => {
                    let _ = self.states.send(Err(tonic::Status::unavailable("egress is shutting down; watch again"))).await;
                    return;
                }
                changed = wake.changed() => match changed {
                    Ok(()) => self.send_if_newer().await,
                    Err(_) => return,
                },
                _ = resync.tick() => self.send_if_newer().await,
            };
        }
    }

    async fn send_if_newer(&mut self) -> Result<(), Stop> {
        let generation = self.core.catalog.node_generation(&self.node_id).await.map_err(Stop::Failed)?;
        if self.sent.is_some_and(|sent| sent >= generation) {
            return Ok(());
        }
        self.send_state().await
    }

    async fn send_state(&mut self) -> Result<(), Stop> {
        let state = self.core.catalog.node_state(&self.node_id).await.map_err(Stop::Failed)?;
        if self.sent.is_some_and(|sent| sent >= state.generation) {
            return Ok(());
        }
        let plans = state.plans.iter().map(|plan| plan.to_proto(Vec::new())).collect();
        let message = proto::NodeEgressState { generation: state.generation, plans };
        self.states.send(Ok(message)).await.map_err(|_| Stop::Gone)?;
        tracing::debug!(node = %self.node_id, generation = state.generation, "egress state sent");
        self.sent = Some(state.generation);
        Ok(())
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
        signals.wake_all();
        assert!(one.has_changed().unwrap() && two.has_changed().unwrap());
    }
}
