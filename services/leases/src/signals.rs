//! Change signals: how a replica's assignment streams learn that their
//! node's leases changed, and its `WatchLeases` streams that an owner's
//! did, whichever replica changed them.
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

/// The bus topic owner change signals travel on; the payload is owner keys
/// (`project/owner`), one per line.
pub(crate) const OWNERS_TOPIC: &str = "lease-owners";

/// The replica's signals of which owners' leases changed, observed by `WatchLeases` streams.
pub(crate) fn owner_signals() -> berth_bus::KeySignals {
    berth_bus::KeySignals::new(OWNERS_TOPIC)
}

/// The signal key of `owner`'s leases in `project`. A project never holds a
/// `/`, so the first one splits the key.
pub(crate) fn owner_key(project: &str, owner: &str) -> String {
    format!("{project}/{owner}")
}

/// The project and owner a signal key names.
pub(crate) fn split_owner_key(key: &str) -> Option<(&str, &str)> {
    key.split_once('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_key_reads_back_whatever_the_owner_holds() {
        for owner in ["revisions/web@u-1", "load", "a/b/c"] {
            assert_eq!(split_owner_key(&owner_key("acme", owner)), Some(("acme", owner)));
        }
    }
}
