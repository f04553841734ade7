//! Identity as a replicated service: two replicas on one PostgreSQL schema
//! and one Redis prefix, as production runs it. Both serve every RPC, one at
//! a time runs the node monitor, and losing Redis's contents (a simulated
//! FLUSHALL of identity's keys) marks no healthy node down.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_identity::{MONITOR_LOOP, NodeTiming};
use berth_proto::identity::v1;
use berth_proto::identity::v1::NodeState;
use berth_proto::types::v1::EventKind;
use support::{Backend, Cluster, fast_timing};
use tokio_util::sync::CancellationToken;
use tonic::Code;

/// Waits until `holder` leads the monitor; panics after `within`.
async fn wait_for_leader(cluster: &Cluster, holders: &[&str], within: Duration) -> String {
    let started = Instant::now();
    loop {
        if let Some((holder, _)) = cluster.store().leader(MONITOR_LOOP).await.unwrap()
            && holders.contains(&holder.as_str())
        {
            return holder;
        }
        assert!(started.elapsed() < within, "no monitor among {holders:?} after {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_joins_with_a_single_use_token_yield_one_node() {
    let mut cluster = Cluster::start(Backend::Postgres, fast_timing()).await;
    cluster.add_replica().await;
    let token = cluster.token(1).await;
    let cluster = Arc::new(cluster);
    let joins: Vec<_> = (0..8)
        .map(|n| {
            let (cluster, token) = (Arc::clone(&cluster), token.clone());
            tokio::spawn(async move { cluster.join(n % 2, &token, &format!("10.0.1.{n}:7450")).await })
        })
        .collect();
    let mut joined = Vec::new();
    let mut refused = Vec::new();
    for join in joins {
        match join.await.unwrap() {
            Ok(node) => joined.push(node.node_id),
            Err(status) => refused.push(status),
        }
    }
    assert_eq!(joined.len(), 1, "exactly one join succeeds; refused: {refused:?}");
    for status in refused {
        match status.code() {
            Code::Unauthenticated => assert_eq!(status.message(), "join token used up"),
            // A collision the store gave up on: the client retries, and learns the token is spent.
            Code::Aborted => {
                let again = cluster.join(0, &token, "10.0.1.99:7450").await.err().unwrap();
                assert_eq!((again.code(), again.message()), (Code::Unauthenticated, "join token used up"));
            }
            other => panic!("unexpected refusal {other:?}: {status:?}"),
        }
    }
    let nodes = cluster.nodes(1).list_nodes(v1::ListNodesRequest::default()).await.unwrap().into_inner().nodes;
    assert_eq!(nodes.iter().map(|n| n.node_id.clone()).collect::<Vec<_>>(), joined);
    let tokens = cluster.tokens(0).list_join_tokens(v1::ListJoinTokensRequest::default()).await.unwrap().into_inner();
    assert_eq!(tokens.join_tokens[0].uses, 1);
    Arc::into_inner(cluster).unwrap().cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_replicas_serve_and_the_monitor_moves_when_its_replica_stops() {
    let mut cluster = Cluster::start(Backend::Postgres, fast_timing()).await;
    cluster.add_replica().await;
    let ids: Vec<String> = cluster.replicas.iter().map(|r| r.service.replica_id().to_owned()).collect();
    assert_ne!(ids[0], ids[1]);
    let leader = wait_for_leader(&cluster, &[&ids[0], &ids[1]], Duration::from_secs(5)).await;

    // Joins and heartbeats through either replica.
    let token = cluster.token(3).await;
    let a = cluster.join(0, &token, "10.0.2.1:7450").await.unwrap();
    let b = cluster.join(1, &token, "10.0.2.2:7450").await.unwrap();
    assert_eq!(a.heartbeat(&cluster.addr(1)).await.unwrap().state(), NodeState::Up);
    assert_eq!(b.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Up);
    assert_eq!(cluster.get_via(1, &a.node_id).await.state(), NodeState::Up);

    // A revocation made on one replica reaches a watcher on the other.
    let c = cluster.join(1, &token, "10.0.2.3:7450").await.unwrap();
    let mut watch = cluster.nodes(1).watch_nodes(v1::WatchNodesRequest::default()).await.unwrap().into_inner();
    while watch.message().await.unwrap().unwrap().kind() != EventKind::Synced {}
    cluster
        .nodes(0)
        .revoke_node(v1::RevokeNodeRequest { node_id: c.node_id.clone(), reason: "test".into() })
        .await
        .unwrap();
    let revoked_seen = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            let event = watch.message().await.unwrap().unwrap();
            if event.node.as_ref().is_some_and(|n| n.node_id == c.node_id && n.state() == NodeState::Revoked) {
                return;
            }
        }
    })
    .await;
    assert!(revoked_seen.is_ok(), "the other replica's watcher never saw the revocation");
    let error = c.heartbeat(&cluster.addr(1)).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);

    // One monitor, and it stays put while its replica runs.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(cluster.store().leader(MONITOR_LOOP).await.unwrap().unwrap().0, leader);

    // Keep both nodes beating at the replica that will survive, then stop the leader's replica.
    let leading = ids.iter().position(|id| *id == leader).unwrap();
    let surviving = 1 - leading;
    let survivor_addr = cluster.addr(surviving);
    let stop_a = CancellationToken::new();
    let stop_b = CancellationToken::new();
    let beating_a = a.keep_beating(vec![survivor_addr.clone()], Duration::from_millis(100), stop_a.clone());
    let beating_b = b.keep_beating(vec![survivor_addr.clone()], Duration::from_millis(100), stop_b.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.replicas.remove(leading).stop().await;
    // The survivor takes the monitor over (by the resign, or the lapse of
    // the stopped leader's term), however long a loaded machine takes.
    let new_leader = wait_for_leader(&cluster, &[&ids[surviving]], Duration::from_secs(30)).await;
    assert_eq!(new_leader, ids[surviving]);

    // The new monitor does the work: a goes silent and down, b stays up.
    stop_a.cancel();
    beating_a.await.unwrap();
    cluster.wait_for_state(&a.node_id, NodeState::Down, Duration::from_secs(5)).await;
    assert_eq!(cluster.get(&b.node_id).await.state(), NodeState::Up);
    stop_b.cancel();
    beating_b.await.unwrap();
    cluster.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_bus_contents_marks_no_healthy_node_down() {
    // Heartbeat bookkeeping reaches the database only every 30 s: a rebuild
    // that trusted it would mark every healthy node down.
    let timing =
        NodeTiming { persist_every: Duration::from_secs(30), reset_grace: Duration::from_secs(1), ..fast_timing() };
    let mut cluster = Cluster::start(Backend::Postgres, timing).await;
    cluster.add_replica().await;
    let ids: Vec<String> = cluster.replicas.iter().map(|r| r.service.replica_id().to_owned()).collect();
    wait_for_leader(&cluster, &[&ids[0], &ids[1]], Duration::from_secs(5)).await;

    let token = cluster.token(3).await;
    let healthy = [
        cluster.join(0, &token, "10.0.3.1:7450").await.unwrap(),
        cluster.join(1, &token, "10.0.3.2:7450").await.unwrap(),
    ];
    let silent = cluster.join(0, &token, "10.0.3.3:7450").await.unwrap();
    let stop = CancellationToken::new();
    let addrs = vec![cluster.addr(0), cluster.addr(1)];
    let beating: Vec<_> =
        healthy.iter().map(|n| n.keep_beating(addrs.clone(), Duration::from_millis(100), stop.clone())).collect();
    for node in &healthy {
        cluster.wait_for_state(&node.node_id, NodeState::Up, Duration::from_secs(3)).await;
    }

    // Record every state any watcher sees from here on.
    let seen: Arc<Mutex<Vec<(String, NodeState)>>> = Arc::default();
    let mut watch = cluster.nodes(0).watch_nodes(v1::WatchNodesRequest::default()).await.unwrap().into_inner();
    let recorder = {
        let seen = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok(Some(event)) = watch.message().await {
                if let Some(node) = event.node {
                    seen.lock().unwrap().push((node.node_id.clone(), node.state()));
                }
            }
        })
    };

    // The silent node beats once, then the bus loses everything, twice.
    assert_eq!(silent.heartbeat(&cluster.addr(1)).await.unwrap().state(), NodeState::Up);
    let flushed_at_ms =
        i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()).unwrap();
    let deleted = cluster.bus().clear().await.unwrap();
    assert!(deleted > 0, "the deadline index and continuity marker were there to lose");
    tokio::time::sleep(Duration::from_millis(700)).await;
    cluster.bus().clear().await.unwrap();
    tokio::time::sleep(Duration::from_millis(2300)).await;

    // The silent node went down, but only once a full grace after the loss
    // had passed: the index was rebuilt from the database.
    let down = cluster.wait_for_state(&silent.node_id, NodeState::Down, Duration::from_secs(5)).await;
    assert_eq!(down.incarnation, 1);
    let changed = down.state_changed_at.unwrap();
    let down_at_ms = changed.seconds * 1000 + i64::from(changed.nanos / 1_000_000);
    assert!(down_at_ms >= flushed_at_ms + 950, "down {} ms after the loss", down_at_ms - flushed_at_ms);
    for node in &healthy {
        assert_eq!(cluster.get(&node.node_id).await.state(), NodeState::Up);
    }
    let healthy_ids: Vec<&str> = healthy.iter().map(|n| n.node_id.as_str()).collect();
    let flaps: Vec<_> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, state)| healthy_ids.contains(&id.as_str()) && *state != NodeState::Up)
        .cloned()
        .collect();
    assert!(flaps.is_empty(), "healthy nodes left UP: {flaps:?}");

    stop.cancel();
    for task in beating {
        task.await.unwrap();
    }
    recorder.abort();
    cluster.cleanup().await;
}
