//! The ledger as production runs it: two replicas on one PostgreSQL schema
//! and one Redis prefix, both placing at once, one reaping, and a Redis that
//! loses its contents without costing a lease its life.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use berth_leases::{LeasesConfig, REAPER_LOOP};
use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::leases::v1::LeasePhase;
use berth_rpc::Channel;
use berth_runtime::ServiceReplica as _;
use berth_testkit::{PATIENCE, eventually};
use support::{Backend, GIB, Ledger, MIB, ask, fast_config, node};
use tonic::Code;

/// Asks until the answer is final: a client retries what the server calls transient.
async fn request(
    mut client: v1::leases_client::LeasesClient<Channel>,
    key: String,
) -> Result<v1::RequestLeaseResponse, tonic::Status> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match client.request_lease(ask(&key, 100, 64 * MIB)).await {
            Err(status) if matches!(status.code(), Code::Aborted | Code::Unavailable) && attempt < 5 => {
                tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
            }
            other => return other.map(tonic::Response::into_inner),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_placing_at_once_never_overcommit_a_node() {
    let nodes: Vec<_> = (1..=5).map(|n| node(&format!("n-{n}"), "", NodeState::Up, 4000, 8 * GIB)).collect();
    let mut ledger = Ledger::start(Backend::Postgres, fast_config(), nodes).await;
    ledger.add_replica().await;
    let clients = [ledger.leases(0), ledger.leases(1)];

    // 250 keys, each asked once through each replica: 500 requests at once for
    // 25 cores when the nodes have 20.
    let started = Instant::now();
    let asks: Vec<_> = (0..500)
        .map(|n| {
            let client = clients[n % 2].clone();
            tokio::spawn(request(client, format!("key-{}", n / 2)))
        })
        .collect();
    let mut answers: BTreeMap<String, Vec<Result<v1::Lease, Code>>> = BTreeMap::new();
    for (n, answer) in asks.into_iter().enumerate() {
        let answer = answer.await.unwrap().map(|r| r.lease.unwrap()).map_err(|status| {
            assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
            status.code()
        });
        answers.entry(format!("key-{}", n / 2)).or_default().push(answer);
    }
    let elapsed = started.elapsed();

    let mut placed = BTreeSet::new();
    for (key, pair) in &answers {
        match (&pair[0], &pair[1]) {
            (Ok(one), Ok(other)) => {
                assert_eq!(one.lease_id, other.lease_id, "{key} yielded two leases");
                placed.insert(one.lease_id.clone());
            }
            (Err(_), Err(_)) => {}
            // Room only shrinks here, so a key refused for want of room was
            // refused after every placement, its own included had there been one.
            (one, other) => panic!("{key} was both placed and refused: {one:?}, {other:?}"),
        }
    }
    assert_eq!(placed.len(), 200, "twenty cores hold exactly two hundred 100m leases");
    eprintln!("500 requests on 2 replicas: {} placed in {elapsed:?}", placed.len());

    let store = ledger.store();
    let per_node: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT node_id, CAST(SUM(cpu_millis) AS BIGINT), CAST(SUM(memory_bytes) AS BIGINT), COUNT(*) FROM leases \
         WHERE phase IN ('bound', 'launching', 'running') GROUP BY node_id ORDER BY node_id",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(per_node.len(), 5, "{per_node:?}");
    for (node_id, cpu, memory, _) in &per_node {
        assert!(*cpu <= 4000 && *memory <= 8 * (GIB as i64), "{node_id} over capacity: {cpu}m, {memory} bytes");
    }
    let ledger_rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT node_id, cpu_allocated, memory_allocated, open_leases FROM node_ledger ORDER BY node_id",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(ledger_rows, per_node, "the node rows add up to their leases");
    let doubled: Vec<(String, i64)> = sqlx::query_as(
        "SELECT idempotency_key, COUNT(*) FROM leases GROUP BY project, idempotency_key HAVING COUNT(*) > 1",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert!(doubled.is_empty(), "{doubled:?}");

    let ids: Vec<String> = ledger.replicas.iter().map(|r| r.service.replica_id().to_owned()).collect();
    let (leader, _) = store.leader(REAPER_LOOP).await.unwrap().expect("one replica reaps");
    assert!(ids.contains(&leader), "{leader} is not one of {ids:?}");
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_bus_reaps_no_lease_before_the_grace_has_passed() {
    let ttl = Duration::from_millis(800);
    let grace = Duration::from_millis(2500);
    let config = LeasesConfig { lease_ttl: ttl, reset_grace: grace, ..fast_config() };
    let ledger = Ledger::start(Backend::Postgres, config, vec![node("n-1", "", NodeState::Up, 4000, 8 * GIB)]).await;
    // Let the reaper index the placement before the bus is wiped.
    let lease = ledger.place("orphan", 100, MIB).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let lost = Instant::now();
    assert!(ledger.bus().clear().await.unwrap() > 0, "the bus held the ledger's keys");

    tokio::time::sleep(ttl * 2).await;
    assert_eq!(ledger.get(&lease.lease_id).await.phase(), LeasePhase::Bound, "reaped within the grace");
    eventually("the lease to be reaped", grace + PATIENCE, || async {
        let phase = ledger.get(&lease.lease_id).await.phase();
        if phase == LeasePhase::Expired { Ok(()) } else { Err(phase) }
    })
    .await;
    assert!(lost.elapsed() >= grace, "reaped {:?} after the loss, before the {grace:?} grace", lost.elapsed());
    ledger.cleanup().await;
}
