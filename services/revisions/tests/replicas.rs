//! Revisions as production runs it: two replicas on one PostgreSQL schema
//! and one Redis prefix, both serving, one reconciling; when the leader
//! stops, the other takes over under a newer term and finishes the work.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_revisions::DEPLOY_LOOP;
use berth_runtime::ServiceReplica as _;
use berth_store::Term;
use berth_testkit::{PATIENCE, eventually};
use support::{Backend, Plane, apply_request, fast_config, pinned_reference};

async fn leader(plane: &Plane) -> (String, Term) {
    eventually("a replica to lead the deploy reconciler", PATIENCE, || async {
        plane.store().leader(DEPLOY_LOOP).await.unwrap().ok_or("no leader")
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_started_under_one_leader_is_finished_by_the_next() {
    let mut plane = Plane::start(Backend::Postgres, fast_config(), &["n-1", "n-2"]).await;
    plane.add_replica().await;
    let web = |version: &str| apply_request("web", &pinned_reference(), 2, &[("VERSION", version)]);

    plane.apply(web("1")).await;
    plane.run("web-00001", 2).await;
    plane.await_live("web", "web-00001").await;

    let (holder, term) = leader(&plane).await;
    let leading = plane.replicas.iter().position(|r| r.service.replica_id() == holder).unwrap();
    let other = 1 - leading;
    plane.services_on(other).apply_service(web("2")).await.unwrap();
    plane.await_open_leases("web-00002", 2).await;

    // The leader stops mid-rollout; the other replica takes over and finishes it.
    plane.stop_replica(leading);
    let (next, next_term) = eventually(&format!("another replica than {holder} to lead"), PATIENCE, || async {
        let (next, next_term) = leader(&plane).await;
        if next == holder { Err(next) } else { Ok((next, next_term)) }
    })
    .await;
    assert_eq!(next, plane.replicas[other].service.replica_id());
    assert!(next_term > term, "a new leader fences the old one with a newer term");

    plane.report_all("web-00002", berth_proto::leases::v1::LeasePhase::Running).await;
    eventually("web-00002 to go live with 2 replicas running", PATIENCE, || async {
        let request = berth_proto::revisions::v1::GetServiceRequest { project: String::new(), name: "web".into() };
        let service = plane.services_on(other).get_service(request).await.unwrap().into_inner().service.unwrap();
        let status = service.status.unwrap();
        if status.live_revision == "web-00002" && status.replicas_running == 2 { Ok(()) } else { Err(status) }
    })
    .await;
    plane.await_open_leases("web-00001", 0).await;
    assert_eq!(plane.open_leases("web-00002").await.len(), 2, "the same leases, not a second set");
    plane.cleanup().await;
}
