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
//! node ids on the bus topic [`NODES_TOPIC`](crate::shared::NODES_TOPIC); every replica follows the
//! topic and wakes its streams for the nodes named. A signal carries no data.
//! Level-triggered: a lost signal delays a push until the stream's next
//! `watch_resync` re-read, and a bus gap wakes every stream.

use std::sync::Arc;

use berth_proto::egress::v1 as proto;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::catalog::CatalogError;
use crate::shared::Core;

/// States a slow node may have waiting before the stream waits for it.
const WATCH_BUFFER: usize = 4;

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
