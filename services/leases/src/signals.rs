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
//! The fan-out itself is [`berth_bus::KeySignals`], which egress shares for
//! its own node streams: level-triggered, coalescing, a gap wakes all.

/// The bus topic node change signals travel on; the payload is node ids, one per line.
pub(crate) const ASSIGNMENTS_TOPIC: &str = "assignments";

/// The replica's wakers for assignment streams, one per node with a live stream.
pub(crate) type NodeSignals = berth_bus::KeySignals;

/// Signals on [`ASSIGNMENTS_TOPIC`].
pub(crate) fn node_signals() -> NodeSignals {
    NodeSignals::new(ASSIGNMENTS_TOPIC)
}
