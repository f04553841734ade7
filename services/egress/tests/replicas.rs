//! Egress as production runs it: two replicas on one PostgreSQL schema and
//! one Redis prefix, both serving, one running the full pass. Edits through
//! the follower are compiled by the leader; nodes watching the follower get
//! what the leader wrote; when the leader stops, the other takes over under a
//! newer term.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_egress::EGRESS_LOOP;
use berth_proto::egress::v1 as egress;
use berth_runtime::ServiceReplica as _;
use berth_store::Term;
use berth_testkit::{PATIENCE, eventually};
use support::{Backend, Mesh, fast_config, gateway, route};

async fn leader(mesh: &Mesh) -> (String, Term) {
    eventually("a replica to lead the egress full pass", PATIENCE, || async {
        mesh.store().leader(EGRESS_LOOP).await.unwrap().ok_or("no leader")
    })
    .await
}

async fn next_state(stream: &mut tonic::Streaming<egress::NodeEgressState>) -> egress::NodeEgressState {
    tokio::time::timeout(PATIENCE, stream.message()).await.expect("a state in time").unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follower_serves_what_the_leader_compiles_and_takes_over_when_it_stops() {
    let mut mesh = Mesh::start(Backend::Postgres, fast_config(), &["n-1"]).await;
    mesh.add_replica().await;
    let (holder, term) = leader(&mesh).await;
    let leading = mesh.replicas.iter().position(|r| r.service.replica_id() == holder).unwrap();
    let other = 1 - leading;

    // Declared through the follower, compiled by the leader.
    let mut follower = mesh.egress_on(other);
    follower.apply_gateway(gateway("alpha", "default")).await.unwrap();
    follower.apply_route(route("alpha", "api", "default", &["api.example.com"], &[443])).await.unwrap();
    mesh.apply_service("alpha", "web", None).await;
    let (plan, passes) = mesh.await_plan("alpha", "listed web", |p| p.services.len() == 1 && p.routes.len() == 1).await;
    let (_, on_follower) = mesh.plan_on(other, "alpha").await.unwrap();
    let (_, on_leader) = mesh.plan_on(leading, "alpha").await.unwrap();
    assert!(on_leader.leading && on_leader.passes >= 1, "{on_leader:?}");
    assert!(!on_follower.leading && on_follower.passes == 0, "{on_follower:?}");
    let _ = passes;

    // A node watching the follower gets the plan the leader placed.
    mesh.place("alpha", "web", "n-1").await;
    let request = egress::WatchEgressRequest { node_id: "n-1".into() };
    let mut stream = mesh.node_on(other, "n-1").watch_egress(request).await.unwrap().into_inner();
    let mut state = next_state(&mut stream).await;
    while state.plans.is_empty() {
        state = next_state(&mut stream).await;
    }
    assert_eq!(state.plans[0].generation, plan.generation);

    // The leader stops; the follower takes over with a newer term and compiles the next edit.
    mesh.stop_replica(leading);
    let (next, next_term) = eventually(&format!("another replica than {holder} to lead"), PATIENCE, || async {
        let (next, next_term) = leader(&mesh).await;
        if next == holder { Err(next) } else { Ok((next, next_term)) }
    })
    .await;
    assert_eq!(next, mesh.replicas[other].service.replica_id());
    assert!(next_term > term, "a new leader fences the old one with a newer term");
    follower.apply_route(route("alpha", "api", "default", &["api.example.com"], &[8443])).await.unwrap();
    let moved = loop {
        let next = next_state(&mut stream).await;
        if next.plans.first().is_some_and(|p| p.generation > plan.generation) {
            break next;
        }
    };
    assert!(moved.generation > state.generation);
    let destinations = &moved.plans[0].services[0].allowed;
    assert!(destinations.iter().all(|d| d.ports == [8443]), "{destinations:?}");
    mesh.cleanup().await;
}
