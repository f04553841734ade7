//! Heartbeat bookkeeping: a steady node's usage and last heartbeat reach its
//! row through the batch writer, and this replica's view follows the row.

#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

mod support;

use berth_testkit::on_both_backends;

use std::time::{Duration, Instant};

use berth_proto::types::v1::Capacity;
use support::{Backend, Cluster, fast_timing};

/// The stored last heartbeat and reported CPU usage of `node_id`.
async fn stored_bookkeeping(cluster: &Cluster, node_id: &str) -> (Option<i64>, i64) {
    sqlx::query_as("SELECT last_heartbeat_at_ms, usage_cpu_millis FROM nodes WHERE node_id = $1")
        .bind(node_id)
        .fetch_one(cluster.store().pool())
        .await
        .unwrap()
}

async fn a_steady_nodes_usage_and_last_heartbeat_reach_its_row(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(1).await;
    let node = cluster.join(0, &token, "10.0.5.1:7450").await.unwrap();
    let addr = cluster.addr(0);
    node.heartbeat(&addr).await.unwrap();
    let (first_beat_at, first_usage) = stored_bookkeeping(&cluster, &node.node_id).await;
    assert_eq!(first_usage, 100, "the first heartbeat writes its row at once");
    let first_beat_at = first_beat_at.unwrap();

    // Steady beats (same capacity and version) that report new usage: only
    // bookkeeping, written every `persist_every` (300 ms) in batches.
    let busy = Capacity { cpu_millis: 700, memory_bytes: 2 << 20 };
    let deadline = Instant::now() + Duration::from_secs(5);
    let stored = loop {
        let mut beat = node.beat();
        beat.usage = Some(busy);
        assert!(!node.send(&addr, beat).await.unwrap().fenced);
        let stored = stored_bookkeeping(&cluster, &node.node_id).await;
        if stored.1 == 700 || Instant::now() > deadline {
            break stored;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(stored.1, 700, "the reported usage never reached the row");
    assert!(stored.0.unwrap() > first_beat_at, "the last heartbeat did not move forward");

    let seen = cluster.get(&node.node_id).await;
    assert_eq!(seen.usage.unwrap(), busy, "the replica's view follows the written row");
    cluster.cleanup().await;
}

on_both_backends!(a_steady_nodes_usage_and_last_heartbeat_reach_its_row);
