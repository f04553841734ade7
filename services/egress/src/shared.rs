//! What every handler and loop of one replica shares: the [`Core`], and the
//! bus topics replicas signal each other on.
//!
//! A leaf of the crate's modules: the handlers, the pass, the node streams,
//! the followers and the service that starts them all import it, and it
//! imports none of them, so no two modules import each other.

use std::sync::Mutex;

use berth_bus::Bus;
use tokio_util::sync::CancellationToken;

use crate::catalog::Catalog;
use crate::config::EgressConfig;
use crate::queue::PassQueue;
use crate::sources::Sources;

/// The bus topic gateway and route changes travel on; the payload is
/// `<replica id>\n<project>`, so the leader skips what it already marked.
pub(crate) const CHANGES_TOPIC: &str = "egress.changed";

/// The bus topic node change signals travel on; the payload is node ids, one per line.
pub(crate) const NODES_TOPIC: &str = "egress.nodes";

/// The replica's wakers for node streams, one per node with a live stream
/// (the fan-out leases uses for its assignment streams).
pub(crate) type NodeSignals = berth_bus::KeySignals;

/// Signals on [`NODES_TOPIC`].
pub(crate) fn node_signals() -> NodeSignals {
    NodeSignals::new(NODES_TOPIC)
}

/// What every handler and loop of one replica shares.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) catalog: Catalog,
    pub(crate) bus: Bus,
    pub(crate) config: EgressConfig,
    pub(crate) queue: PassQueue,
    pub(crate) nodes: NodeSignals,
    pub(crate) sources: Sources,
    /// This replica's name as it campaigns for the full pass.
    pub(crate) replica_id: String,
    /// Cancelled when the replica stops: loops and streams end.
    pub(crate) closing: CancellationToken,
    pub(crate) started: Mutex<bool>,
}

impl Core {
    /// Marks a pass of `project` here (when leading) and on whichever replica leads.
    pub(crate) async fn changed(&self, project: &str) {
        self.queue.mark(project);
        let payload = format!("{}\n{project}", self.replica_id);
        if let Err(error) = self.bus.publish(CHANGES_TOPIC, payload).await {
            tracing::debug!(%error, %project, "could not announce an egress change; the next full resync compiles it");
        }
    }
}
