//! Fleet upgrades as an operator and the nodes' agents meet them, over mTLS
//! gRPC against one replica, on PostgreSQL with Redis and on SQLite with the
//! in-process bus: `UpgradeNodes` picks the nodes, the controller starts the
//! canary alone and then at most `max_unavailable` at once, each node's
//! heartbeat answer names the artifact while it is due, its reports move
//! it along, and a failure past the tolerated count pauses the rollout.
//! The nodes here are test clients speaking the heartbeat protocol; the
//! agent's side is tested with the agent.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use std::time::Duration;

use berth_proto::identity::v1;
use berth_proto::identity::v1::{NodeState, NodeUpgradeState, UpgradeState};
use berth_testkit::{eventually, on_both_backends};
use support::{Backend, Cluster, TestNode, fast_timing};
use tonic::Code;

on_both_backends!(a_rollout_goes_canary_first_and_pauses_past_its_failures, upgrade_requests_are_checked);

/// An artifact pinned to a digest: resolving it needs no registry.
const ARTIFACT: &str =
    "127.0.0.1:5999/berth/agent@sha256:1111111111111111111111111111111111111111111111111111111111111111";

const PATIENCE: Duration = Duration::from_secs(10);

async fn get(cluster: &Cluster, upgrade_id: &str) -> v1::Upgrade {
    let request = v1::GetUpgradeRequest { upgrade_id: upgrade_id.to_owned() };
    cluster.nodes(0).get_upgrade(request).await.unwrap().into_inner().upgrade.unwrap()
}

fn node_state(upgrade: &v1::Upgrade, node_id: &str) -> NodeUpgradeState {
    upgrade.nodes.iter().find(|n| n.node_id == node_id).unwrap().state()
}

/// A beat carrying `report` of `upgrade_id`.
fn reporting(node: &TestNode, upgrade_id: &str, state: NodeUpgradeState, reason: &str) -> v1::HeartbeatRequest {
    v1::HeartbeatRequest {
        upgrading: state == NodeUpgradeState::Upgrading,
        upgrade: Some(v1::NodeUpgradeReport {
            upgrade_id: upgrade_id.to_owned(),
            state: state as i32,
            reason: reason.to_owned(),
            version: if state == NodeUpgradeState::Succeeded { "0.2.0".into() } else { String::new() },
        }),
        version: if state == NodeUpgradeState::Succeeded { "0.2.0".into() } else { "0.1.0".into() },
        ..node.beat()
    }
}

async fn a_rollout_goes_canary_first_and_pauses_past_its_failures(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(3).await;
    let mut nodes = Vec::new();
    for address in ["10.0.1.1:7450", "10.0.1.2:7450", "10.0.1.3:7450"] {
        let node = cluster.join(0, &token, address).await.unwrap();
        node.heartbeat(&cluster.addr(0)).await.unwrap();
        nodes.push(node);
    }
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    // All but the canary beat on their own; the canary's beats are the test's.
    let stop = tokio_util::sync::CancellationToken::new();
    let beating: Vec<_> = nodes[1..]
        .iter()
        .map(|node| node.keep_beating(vec![cluster.addr(0)], fast_timing().heartbeat_interval, stop.clone()))
        .collect();
    let request =
        v1::UpgradeNodesRequest { all: true, to: ARTIFACT.into(), max_unavailable: 2, canary: 1, ..Default::default() };
    let upgrade = cluster.nodes(0).upgrade_nodes(request).await.unwrap().into_inner().upgrade.unwrap();
    assert_eq!(upgrade.state(), UpgradeState::Running);
    assert_eq!(upgrade.artifact, ARTIFACT, "a pinned reference is its own artifact");
    assert_eq!(upgrade.created_by, "alice");
    let order: Vec<&str> = upgrade.nodes.iter().map(|n| n.node_id.as_str()).collect();
    let ids: Vec<&str> = nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(order, ids, "every node, by id");
    assert!(upgrade.nodes[0].canary && !upgrade.nodes[1].canary);
    let id = upgrade.upgrade_id.clone();

    // The canary is started alone; its beat answer names the artifact.
    let canary = &nodes[0];
    let answer = eventually("the canary is asked to upgrade", PATIENCE, || async {
        canary.heartbeat(&cluster.addr(0)).await.unwrap().upgrade.ok_or("no upgrade named")
    })
    .await;
    assert_eq!((answer.upgrade_id.as_str(), answer.artifact.as_str()), (id.as_str(), ARTIFACT));
    for other in &nodes[1..] {
        assert_eq!(other.heartbeat(&cluster.addr(0)).await.unwrap().upgrade, None, "not before the canary is done");
    }
    let shown = cluster.get(&canary.node_id).await.upgrade.unwrap();
    assert_eq!((shown.upgrade_id.as_str(), shown.state()), (id.as_str(), NodeUpgradeState::Started));

    // Upgrading: the answer stops naming it, and the node is given the
    // upgrade grace: silent past down_after, it is still not DOWN.
    let beat = reporting(canary, &id, NodeUpgradeState::Upgrading, "");
    canary.send(&cluster.addr(0), beat).await.unwrap();
    let beat = reporting(canary, &id, NodeUpgradeState::Upgrading, "");
    assert_eq!(canary.send(&cluster.addr(0), beat).await.unwrap().upgrade, None);
    eventually("the canary shows upgrading", PATIENCE, || async {
        (node_state(&get(&cluster, &id).await, &canary.node_id) == NodeUpgradeState::Upgrading)
            .then_some(())
            .ok_or("not yet")
    })
    .await;
    tokio::time::sleep(fast_timing().down_after * 2).await;
    assert_eq!(cluster.get(&canary.node_id).await.state(), NodeState::Up, "within the upgrade grace");

    // It succeeds: the two others start at once (max_unavailable 2).
    let beat = reporting(canary, &id, NodeUpgradeState::Succeeded, "");
    canary.send(&cluster.addr(0), beat).await.unwrap();
    let after = eventually("the canary succeeded", PATIENCE, || async {
        let upgrade = get(&cluster, "").await;
        (node_state(&upgrade, &canary.node_id) == NodeUpgradeState::Succeeded).then_some(upgrade).ok_or("not yet")
    })
    .await;
    let finished = after.nodes.iter().find(|n| n.node_id == canary.node_id).unwrap();
    assert_eq!(finished.version, "0.2.0");
    assert!(finished.started_at.is_some() && finished.finished_at.is_some());
    assert_eq!(cluster.get(&canary.node_id).await.version, "0.2.0");
    for other in &nodes[1..] {
        let asked = eventually("the rest are asked", PATIENCE, || async {
            let answer = other.heartbeat(&cluster.addr(0)).await.unwrap().upgrade;
            answer.ok_or(get(&cluster, &id).await)
        })
        .await;
        assert_eq!(asked.upgrade_id, id);
    }

    // One is refused by its updater: past zero tolerated failures, the
    // rollout pauses, naming the node and its reason.
    let refused = &nodes[1];
    let beat = reporting(refused, &id, NodeUpgradeState::Failed, "refused: no agent runs as pid 7");
    refused.send(&cluster.addr(0), beat).await.unwrap();
    let paused = eventually("the rollout pauses", PATIENCE, || async {
        let upgrade = get(&cluster, &id).await;
        (upgrade.state() == UpgradeState::Paused).then_some(upgrade).ok_or("not yet")
    })
    .await;
    assert!(paused.reason.contains(&refused.node_id) && paused.reason.contains("no agent runs as pid 7"), "{paused:?}");
    let failed = paused.nodes.iter().find(|n| n.node_id == refused.node_id).unwrap();
    assert_eq!((failed.state(), failed.reason.as_str()), (NodeUpgradeState::Failed, "refused: no agent runs as pid 7"));

    // A new rollout supersedes the paused one.
    let again =
        v1::UpgradeNodesRequest { node_ids: vec![refused.node_id.clone()], to: ARTIFACT.into(), ..Default::default() };
    let next = cluster.nodes(0).upgrade_nodes(again).await.unwrap().into_inner().upgrade.unwrap();
    let old = get(&cluster, &id).await;
    assert_eq!(old.state(), UpgradeState::Superseded);
    assert!(old.reason.contains(&next.upgrade_id), "{old:?}");
    assert_eq!(get(&cluster, "").await.upgrade_id, next.upgrade_id, "the latest");
    stop.cancel();
    for task in beating {
        task.await.unwrap();
    }
    cluster.cleanup().await;
}

async fn upgrade_requests_are_checked(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(1).await;
    let node = cluster.join(0, &token, "10.0.2.1:7450").await.unwrap();
    node.heartbeat(&cluster.addr(0)).await.unwrap();
    let ask = |request: v1::UpgradeNodesRequest| {
        let mut nodes = cluster.nodes(0);
        async move { nodes.upgrade_nodes(request).await.unwrap_err() }
    };
    let none = ask(v1::UpgradeNodesRequest { to: ARTIFACT.into(), ..Default::default() }).await;
    assert_eq!(none.code(), Code::InvalidArgument, "{none:?}");
    assert!(none.message().contains("exactly one of"), "{none:?}");
    let unknown =
        ask(v1::UpgradeNodesRequest { node_ids: vec!["n-nope".into()], to: ARTIFACT.into(), ..Default::default() })
            .await;
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    let empty_tier =
        ask(v1::UpgradeNodesRequest { tier: "gpu".into(), to: ARTIFACT.into(), ..Default::default() }).await;
    assert_eq!(empty_tier.code(), Code::InvalidArgument, "{empty_tier:?}");
    // Nothing answers at this registry: the tag cannot be resolved.
    let unresolvable =
        ask(v1::UpgradeNodesRequest { all: true, to: "127.0.0.1:9/berth/agent:1.0".into(), ..Default::default() })
            .await;
    assert_eq!(unresolvable.code(), Code::FailedPrecondition, "{unresolvable:?}");
    assert!(unresolvable.message().contains("127.0.0.1:9/berth/agent:1.0"), "{unresolvable:?}");
    let missing = cluster.nodes(0).get_upgrade(v1::GetUpgradeRequest::default()).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "no upgrade yet: {missing:?}");

    // A malformed report is refused, naming the field; nothing is written.
    let bad = v1::HeartbeatRequest {
        upgrade: Some(v1::NodeUpgradeReport { upgrade_id: "up-1".into(), state: 1, ..Default::default() }),
        ..node.beat()
    };
    let refused = node.send(&cluster.addr(0), bad).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("upgrade"), "{refused:?}");
    // A report of an upgrade the node was never asked for changes nothing.
    let stray = reporting(&node, "up-000000000000", NodeUpgradeState::Failed, "what upgrade?");
    node.send(&cluster.addr(0), stray).await.unwrap();
    assert_eq!(cluster.get(&node.node_id).await.upgrade, None);
    cluster.cleanup().await;
}
