//! The placer: one task per replica that takes queued lease requests in
//! batches and places each batch in one transaction, answering every caller
//! through its own oneshot.
//!
//! # Expected flow
//! `RequestLease` validates, queues a [`LeaseAsk`] and awaits the reply. The
//! task takes whatever is queued (up to `max_batch`) as soon as the previous
//! batch committed, so an idle replica places a lone request at once and a
//! busy one places many per commit. After the commit it wakes the nodes'
//! streams, announces the change to the other replicas and indexes the new
//! leases' deadlines for the reaper.
//!
//! # Invariants
//! - The node list a batch is placed against is identity's registry as this
//!   replica last saw it; the allocation check inside the transaction keeps
//!   two replicas with slightly different views from over-committing a node.
//! - A batch that collides with another replica's is placed again whole, with
//!   jittered backoff; its callers see an error only once the attempts run out.

use std::sync::Arc;
use std::time::Duration;

use berth_proto::identity::v1::{Node, NodeState};
use tokio::sync::mpsc;

use crate::ledger::{LeaseAsk, LeaseError};
use crate::model::Resources;
use crate::placement::{NodeRuntime, PlacementNode};
use crate::shared::{Core, EXPIRY_INDEX, Queued, drain_batches};

/// How many times a batch is placed before its callers are told it collided.
const PLACE_ATTEMPTS: u32 = 8;

/// The first retry of a collided batch waits up to this long; each later one up to twice as long.
const RETRY_BACKOFF: Duration = Duration::from_millis(5);

/// No retry waits longer than this.
const MAX_RETRY_BACKOFF: Duration = Duration::from_millis(200);

/// Drains `queue` until the service closes.
pub(crate) fn spawn(core: Arc<Core>, queue: mpsc::Receiver<Queued>) {
    let (closing, max_batch) = (core.closing.clone(), core.config.max_batch);
    drain_batches(closing, queue, max_batch, move |batch| {
        let core = Arc::clone(&core);
        async move { place(&core, batch).await }
    });
}

/// A node of identity's registry as placement sees it, before the ledger's allocations are added.
pub(crate) fn placement_node(node: &Node) -> PlacementNode {
    PlacementNode::new(
        node.node_id.clone(),
        node.tier.clone(),
        NodeState::try_from(node.state).unwrap_or(NodeState::Unspecified),
        node.capacity.map(Resources::from).unwrap_or_default(),
    )
    .with_runtime(NodeRuntime::of_labels(&node.labels))
}

async fn place(core: &Arc<Core>, batch: Vec<Queued>) {
    // A caller that gave up is not placed for: retrying with its key finds nothing half-done.
    let batch: Vec<Queued> = batch.into_iter().filter(|queued| !queued.reply.is_closed()).collect();
    if batch.is_empty() {
        return;
    }
    let snapshot = core.nodes.snapshot();
    if !snapshot.synced {
        for queued in batch {
            let _ = queued.reply.send(Err(LeaseError::Unavailable(
                "the ledger has not learned the nodes from identity yet; retry shortly".to_owned(),
            )));
        }
        return;
    }
    let nodes: Vec<PlacementNode> = snapshot.nodes.values().map(placement_node).collect();
    let (asks, replies): (Vec<LeaseAsk>, Vec<_>) = batch.into_iter().map(|queued| (queued.ask, queued.reply)).unzip();

    let mut attempt = 1;
    let outcome = loop {
        match core.ledger.place_batch(&asks, &nodes).await {
            Err(error) if error.is_collision() && attempt < PLACE_ATTEMPTS => {
                tracing::debug!(attempt, %error, "placement batch collided; placing it again");
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            other => break other,
        }
    };
    let outcomes = match outcome {
        Ok(outcomes) => outcomes,
        Err(error) => {
            tracing::warn!(%error, requests = asks.len(), attempts = attempt, "placing a batch failed");
            for reply in replies {
                let _ = reply.send(Err(error.for_each_caller()));
            }
            return;
        }
    };

    let mut touched: Vec<String> = Vec::new();
    let mut deadlines: Vec<(String, i64)> = Vec::new();
    let mut placed_leases = Vec::new();
    for placed in outcomes.iter().flatten().filter(|placed| placed.created) {
        touched.push(placed.lease.node_id.clone());
        placed_leases.push(placed.lease.clone());
        if let Some(at) = placed.lease.expires_at_ms {
            deadlines.push((placed.lease.lease_id.clone(), at));
        }
    }
    touched.sort();
    touched.dedup();
    core.signals.wake(touched.iter().map(String::as_str));
    tracing::debug!(requests = asks.len(), placed = deadlines.len(), attempts = attempt, "placed a batch");
    for (reply, outcome) in replies.into_iter().zip(outcomes) {
        let _ = reply.send(outcome);
    }
    if touched.is_empty() {
        return;
    }
    // The bus is an accelerator: its round trips must not hold up the next batch.
    let core = Arc::clone(core);
    tokio::spawn(async move {
        core.signals.announce(&core.bus, &touched).await;
        core.announce_owners(&placed_leases).await;
        if let Err(error) = core.bus.deadline_set_many(EXPIRY_INDEX, &deadlines).await {
            tracing::warn!(%error, leases = deadlines.len(), "could not index new lease deadlines; the reaper restores them");
        }
    });
}

/// A random wait in `[0, min(MAX_RETRY_BACKOFF, RETRY_BACKOFF * 2^(attempt-1))]`.
fn backoff(attempt: u32) -> Duration {
    berth_core::backoff::full_jitter(RETRY_BACKOFF, MAX_RETRY_BACKOFF, attempt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_proto::types::v1::Capacity;

    #[test]
    fn retries_back_off_within_their_cap() {
        for attempt in 1..40 {
            assert!(backoff(attempt) <= MAX_RETRY_BACKOFF);
        }
    }

    #[test]
    fn an_unknown_state_or_missing_capacity_takes_nothing() {
        let node = Node { node_id: "n-1".into(), state: 99, capacity: None, ..Default::default() };
        let seen = placement_node(&node);
        assert_eq!(seen.state, NodeState::Unspecified);
        assert_eq!(seen.total, Resources::default());
        let up = Node {
            node_id: "n-2".into(),
            state: NodeState::Up as i32,
            capacity: Some(Capacity { cpu_millis: 4000, memory_bytes: 1 << 33 }),
            ..Default::default()
        };
        assert_eq!(placement_node(&up).total, Resources::new(4000, 1 << 33));
    }
}
