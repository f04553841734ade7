//! The ledger as requesters and nodes see it, over mTLS gRPC, on both
//! backends: placement and its refusals, idempotency, the lifecycle fenced by
//! epochs, renewal, expiry, reconcile and custody, and who may call what.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::types::v1::{BundleRef, RuntimeClass};
use berth_testkit::{PATIENCE, eventually};
use support::{Backend, GIB, Ledger, MIB, ask, expiring_config, fast_config, node};
use tonic::Code;

fn three_nodes() -> Vec<berth_proto::identity::v1::Node> {
    vec![
        node("n-1", "", NodeState::Up, 4000, 8 * GIB),
        node("n-2", "", NodeState::Up, 4000, 8 * GIB),
        node("n-3", "", NodeState::Up, 4000, 8 * GIB),
    ]
}

fn lease_ref(lease: &v1::Lease, epoch: u64) -> v1::LeaseRef {
    v1::LeaseRef { lease_id: lease.lease_id.clone(), epoch }
}

async fn a_spread_group_lands_on_different_nodes_and_what_does_not_fit_is_refused(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), three_nodes()).await;
    let mut nodes = Vec::new();
    for replica in 0..3 {
        let request =
            v1::RequestLeaseRequest { spread_group: "web".into(), ..ask(&format!("web-{replica}"), 500, 512 * MIB) };
        let response = ledger.leases(0).request_lease(request).await.unwrap().into_inner();
        assert!(response.created);
        let lease = response.lease.unwrap();
        assert_eq!((lease.phase(), lease.epoch, lease.project.as_str()), (LeasePhase::Bound, 1, "default"));
        assert!(lease.expires_at.is_some());
        nodes.push(lease.node_id);
    }
    assert_eq!(nodes, ["n-1", "n-2", "n-3"], "one replica per node, ties to the lowest id");

    let too_big = ledger.leases(0).request_lease(ask("huge", 5000, GIB)).await.unwrap_err();
    assert_eq!(too_big.code(), Code::ResourceExhausted);
    assert_eq!(
        too_big.message(),
        "no UP node in any tier has 5000m cpu free; most free: n-1 with 3500m cpu and 7.5GiB memory free"
    );
    let gpu = v1::RequestLeaseRequest { tier: "gpu".into(), ..ask("gpu", 100, MIB) };
    let none = ledger.leases(0).request_lease(gpu).await.unwrap_err();
    assert_eq!((none.code(), none.message()), (Code::ResourceExhausted, "no UP node in tier 'gpu'"));
    let refused = v1::ListLeasesRequest { all_projects: true, ..Default::default() };
    assert_eq!(
        ledger.leases(0).list_leases(refused).await.unwrap().into_inner().leases.len(),
        3,
        "refusals record nothing"
    );

    let n1 = ledger.node_capacity("n-1").await;
    assert_eq!(n1.allocated.unwrap().cpu_millis, 500);
    assert_eq!(n1.free.unwrap().cpu_millis, 3500);
    assert_eq!((n1.leases, n1.state), (1, NodeState::Up as i32));
    ledger.cleanup().await;
}

async fn draining_and_down_nodes_get_nothing_new(backend: Backend) {
    let nodes = vec![node("n-1", "", NodeState::Up, 1000, GIB), node("n-2", "", NodeState::Up, 8000, 16 * GIB)];
    let ledger = Ledger::start(backend, fast_config(), nodes).await;
    assert_eq!(ledger.place("first", 100, MIB).await.node_id, "n-1", "both empty: the lowest id");
    ledger.set_state("n-1", NodeState::Draining).await;
    assert_eq!(ledger.place("second", 100, MIB).await.node_id, "n-2");
    assert_eq!(ledger.place("third", 100, MIB).await.node_id, "n-2", "n-1 is emptier but draining");
    ledger.set_state("n-2", NodeState::Down).await;
    let refused = ledger.leases(0).request_lease(ask("fourth", 100, MIB)).await.unwrap_err();
    assert_eq!((refused.code(), refused.message()), (Code::ResourceExhausted, "no UP node in any tier"));
    // What a draining node holds stays its own.
    assert_eq!(ledger.node_capacity("n-1").await.leases, 1);
    ledger.cleanup().await;
}

async fn bad_requests_name_the_field(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), three_nodes()).await;
    let cases = [
        ("owner", v1::RequestLeaseRequest { owner: String::new(), ..ask("k", 100, MIB) }),
        ("idempotency_key", ask("", 100, MIB)),
        ("resources", ask("k", 0, MIB)),
        ("project", v1::RequestLeaseRequest { project: "Not A Project".into(), ..ask("k", 100, MIB) }),
        ("workload", v1::RequestLeaseRequest { workload: None, ..ask("k", 100, MIB) }),
    ];
    for (field, request) in cases {
        let status = ledger.leases(0).request_lease(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(status.message().starts_with(&format!("invalid {field}:")), "{field}: {}", status.message());
    }
    let missing = ledger.leases(0).get_lease(v1::GetLeaseRequest { lease_id: "l-nope".into() }).await.unwrap_err();
    assert_eq!((missing.code(), missing.message()), (Code::NotFound, "lease l-nope not found"));
    ledger.cleanup().await;
}

async fn one_key_makes_one_lease_even_asked_fifty_times_at_once(backend: Backend) {
    let ledger = Arc::new(Ledger::start(backend, fast_config(), three_nodes()).await);
    let asks: Vec<_> = (0..50)
        .map(|_| {
            let ledger = Arc::clone(&ledger);
            tokio::spawn(async move { ledger.leases(0).request_lease(ask("same-key", 250, 64 * MIB)).await })
        })
        .collect();
    let mut created = 0;
    let mut ids = std::collections::BTreeSet::new();
    for answer in asks {
        let response = answer.await.unwrap().unwrap().into_inner();
        created += usize::from(response.created);
        ids.insert(response.lease.unwrap().lease_id);
    }
    assert_eq!((created, ids.len()), (1, 1), "one lease, created once");
    let again = ledger.leases(0).request_lease(ask("same-key", 250, 64 * MIB)).await.unwrap().into_inner();
    assert!(!again.created);
    assert_eq!(Some(&again.lease.unwrap().lease_id), ids.first());
    let all = ledger.leases(0).list_leases(v1::ListLeasesRequest::default()).await.unwrap().into_inner().leases;
    assert_eq!(all.len(), 1);
    let mut allocated = 0;
    for node_id in ["n-1", "n-2", "n-3"] {
        allocated += ledger.node_capacity(node_id).await.allocated.unwrap().cpu_millis;
    }
    assert_eq!(allocated, 250, "the lease is reserved once");
    Arc::into_inner(ledger).unwrap().cleanup().await;
}

async fn phase_reports_move_forward_and_stale_epochs_change_nothing(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), three_nodes()).await;
    let lease = ledger.place("job", 1000, GIB).await;
    assert_eq!(ledger.report(&lease, 1, LeasePhase::Launching).await.unwrap().phase(), LeasePhase::Launching);
    // RUNNING records where the replica listens on its node; bad ports are
    // named and change nothing.
    let port = |name: &str, port: u32| berth_proto::types::v1::Port { name: name.into(), port };
    let report = |ports: Vec<berth_proto::types::v1::Port>| v1::ReportPhaseRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: 1,
        phase: LeasePhase::Running as i32,
        ports,
        ..Default::default()
    };
    let bad = ledger.node(&lease.node_id).report_phase(report(vec![port("http", 0)])).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("ports[0].port: 0 is not a port from 1 to 65535"), "{bad:?}");
    let twice = report(vec![port("http", 30001), port("http", 30002)]);
    let bad = ledger.node(&lease.node_id).report_phase(twice).await.unwrap_err();
    assert!(bad.message().contains("ports[1].name: 'http' is not a port name used once"), "{bad:?}");
    assert_eq!(ledger.get(&lease.lease_id).await.phase(), LeasePhase::Launching);
    let ports = vec![port("http", 30001), port("admin", 30002)];
    let running = ledger.node(&lease.node_id).report_phase(report(ports.clone())).await.unwrap().into_inner();
    let running = running.lease.unwrap();
    assert_eq!(running.phase(), LeasePhase::Running);
    assert_eq!(running.ports, ports, "the ports as reported, the first first");
    assert_eq!(ledger.get(&lease.lease_id).await.ports, ports, "and as stored");
    // A retried report of the same phase is harmless.
    assert_eq!(ledger.report(&lease, 1, LeasePhase::Running).await.unwrap(), running);

    let stale = ledger.report(&lease, 7, LeasePhase::Failed).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition);
    assert_eq!(
        stale.message(),
        format!("lease {} is at epoch 1; epoch 7 is stale, so nothing was changed", lease.lease_id)
    );
    assert_eq!(ledger.get(&lease.lease_id).await, running, "a stale report changes nothing");

    let done = v1::ReportPhaseRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: 1,
        phase: LeasePhase::Done as i32,
        reason: "Exited".into(),
        exit_code: Some(0),
        message: "exited on its own".into(),
        ports: Vec::new(),
    };
    let done = ledger.node(&lease.node_id).report_phase(done).await.unwrap().into_inner().lease.unwrap();
    assert_eq!((done.phase(), done.reason.as_str(), done.exit_code), (LeasePhase::Done, "Exited", Some(0)));
    assert!(done.ports.is_empty(), "where a replica listened holds only while it runs");
    assert!(ledger.get(&lease.lease_id).await.ports.is_empty());
    assert!(done.expires_at.is_none());
    let capacity = ledger.node_capacity(&lease.node_id).await;
    assert_eq!((capacity.leases, capacity.allocated.unwrap().cpu_millis), (0, 0), "a done lease returns its capacity");

    let back = ledger.report(&lease, 1, LeasePhase::Running).await.unwrap_err();
    assert_eq!(back.code(), Code::FailedPrecondition);
    assert_eq!(back.message(), format!("lease {} cannot move from DONE to RUNNING", lease.lease_id));
    assert_eq!(ledger.get(&lease.lease_id).await.phase(), LeasePhase::Done);

    let other = ledger.place("other", 100, MIB).await;
    let mut stranger = ledger.node("n-3");
    let theft = v1::ReportPhaseRequest {
        node_id: "n-3".into(),
        lease_id: other.lease_id.clone(),
        epoch: 1,
        phase: LeasePhase::Failed as i32,
        ..Default::default()
    };
    if other.node_id != "n-3" {
        let refused = stranger.report_phase(theft).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        assert_eq!(ledger.get(&other.lease_id).await.phase(), LeasePhase::Bound);
    }
    let not_a_phase = ledger.report(&other, 1, LeasePhase::Released).await.unwrap_err();
    assert_eq!(not_a_phase.code(), Code::InvalidArgument);
    ledger.cleanup().await;
}

async fn renewals_keep_held_leases_and_name_the_lost_ones(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 4000, 8 * GIB)]).await;
    let kept = ledger.place("kept", 100, MIB).await;
    let released = ledger.place("released", 100, MIB).await;
    let request = v1::ReleaseLeaseRequest { lease_id: released.lease_id.clone(), reason: "ScaledDown".into() };
    let after = ledger.leases(0).release_lease(request).await.unwrap().into_inner().lease.unwrap();
    assert_eq!((after.phase(), after.reason.as_str()), (LeasePhase::Released, "ScaledDown"));

    tokio::time::sleep(Duration::from_millis(20)).await;
    let renewal = v1::RenewLeasesRequest {
        node_id: "n-1".into(),
        leases: vec![
            lease_ref(&kept, 1),
            lease_ref(&released, 1),
            lease_ref(&kept, 2),
            v1::LeaseRef { lease_id: "l-unknown".into(), epoch: 1 },
        ],
    };
    let renewed = ledger.node("n-1").renew_leases(renewal).await.unwrap().into_inner();
    assert_eq!(renewed.renewed, vec![lease_ref(&kept, 1)]);
    assert_eq!(
        renewed.lost,
        vec![lease_ref(&released, 1), lease_ref(&kept, 2), v1::LeaseRef { lease_id: "l-unknown".into(), epoch: 1 }]
    );
    assert_eq!(renewed.ttl_ms, 30_000);
    let now = ledger.get(&kept.lease_id).await;
    assert!(
        now.expires_at.unwrap().seconds * 1000 + i64::from(now.expires_at.unwrap().nanos / 1_000_000)
            > kept.expires_at.unwrap().seconds * 1000 + i64::from(kept.expires_at.unwrap().nanos / 1_000_000)
    );
    assert_eq!(ledger.get(&released.lease_id).await, after, "renewing a final lease changes nothing");

    // Releasing again is a no-op that reports the final state.
    let again = v1::ReleaseLeaseRequest { lease_id: released.lease_id.clone(), reason: String::new() };
    assert_eq!(ledger.leases(0).release_lease(again).await.unwrap().into_inner().lease.unwrap(), after);
    let capacity = ledger.node_capacity("n-1").await;
    assert_eq!((capacity.leases, capacity.allocated.unwrap().cpu_millis), (1, 100));
    ledger.cleanup().await;
}

async fn leases_list_by_project_node_phase_and_owner(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), three_nodes()).await;
    let a = ledger.place("a", 100, MIB).await;
    let b = ledger.place("b", 100, MIB).await;
    let other =
        v1::RequestLeaseRequest { project: "team-x".into(), owner: "revisions/x-1".into(), ..ask("a", 100, MIB) };
    let x = ledger.leases(0).request_lease(other).await.unwrap().into_inner();
    assert!(x.created, "keys are per project");
    ledger.report(&b, 1, LeasePhase::Running).await.unwrap();
    let list = |request: v1::ListLeasesRequest| {
        let mut client = ledger.leases(0);
        async move {
            let leases = client.list_leases(request).await.unwrap().into_inner().leases;
            leases.into_iter().map(|l| l.lease_id).collect::<Vec<_>>()
        }
    };
    assert_eq!(list(v1::ListLeasesRequest::default()).await, [a.lease_id.clone(), b.lease_id.clone()]);
    assert_eq!(
        list(v1::ListLeasesRequest { project: "team-x".into(), ..Default::default() }).await,
        [x.lease.as_ref().unwrap().lease_id.clone()]
    );
    assert_eq!(list(v1::ListLeasesRequest { all_projects: true, ..Default::default() }).await.len(), 3);
    assert_eq!(
        list(v1::ListLeasesRequest { phase: LeasePhase::Running as i32, ..Default::default() }).await,
        [b.lease_id.as_str()]
    );
    assert_eq!(
        list(v1::ListLeasesRequest { node_id: a.node_id.clone(), ..Default::default() }).await,
        [a.lease_id.as_str()]
    );
    assert_eq!(
        list(v1::ListLeasesRequest { owner: "revisions/x-1".into(), all_projects: true, ..Default::default() }).await,
        [x.lease.unwrap().lease_id]
    );
    ledger.cleanup().await;
}

async fn an_unrenewed_lease_expires_and_returns_its_capacity_while_a_renewed_one_stays(backend: Backend) {
    // Long enough that a loaded machine never lets a renewal every ttl/8 slip past it.
    let ttl = Duration::from_secs(2);
    let ledger =
        Ledger::start(backend, expiring_config(ttl), vec![node("n-1", "", NodeState::Up, 4000, 8 * GIB)]).await;
    let placed = Instant::now();
    let forgotten = ledger.place("forgotten", 1000, GIB).await;
    let renewed = ledger.place("renewed", 1000, GIB).await;
    let mut node = ledger.node("n-1");
    loop {
        let renewal = v1::RenewLeasesRequest { node_id: "n-1".into(), leases: vec![lease_ref(&renewed, 1)] };
        let answer = node.renew_leases(renewal).await.unwrap().into_inner();
        assert_eq!(answer.renewed.len(), 1, "the renewed lease was lost: {answer:?}");
        if ledger.get(&forgotten.lease_id).await.phase() == LeasePhase::Expired {
            assert!(placed.elapsed() >= ttl, "the unrenewed lease expired before its ttl");
            break;
        }
        assert!(placed.elapsed() < ttl * 10, "the unrenewed lease never expired");
        tokio::time::sleep(ttl / 8).await;
    }
    let expired = ledger.get(&forgotten.lease_id).await;
    assert_eq!((expired.phase(), expired.reason.as_str()), (LeasePhase::Expired, "NotRenewed"));
    assert_eq!(ledger.get(&renewed.lease_id).await.phase(), LeasePhase::Bound);
    let capacity = ledger.node_capacity("n-1").await;
    assert_eq!((capacity.leases, capacity.allocated.unwrap().cpu_millis), (1, 1000));

    // A late renewal of the expired lease is refused: the node must stop it.
    let late = v1::RenewLeasesRequest { node_id: "n-1".into(), leases: vec![lease_ref(&forgotten, 1)] };
    assert_eq!(node.renew_leases(late).await.unwrap().into_inner().lost, vec![lease_ref(&forgotten, 1)]);
    ledger.cleanup().await;
}

async fn reconcile_destroys_what_no_open_lease_covers_and_fails_what_the_node_lost(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let running = ledger.place("running", 100, MIB).await;
    let lost = ledger.place("lost", 100, MIB).await;
    let bound = ledger.place("bound", 100, MIB).await;
    let launching = ledger.place("launching", 100, MIB).await;
    let released = ledger.place("released", 100, MIB).await;
    for lease in [&running, &lost] {
        ledger.report(lease, 1, LeasePhase::Running).await.unwrap();
    }
    ledger.report(&launching, 1, LeasePhase::Launching).await.unwrap();
    let release = v1::ReleaseLeaseRequest { lease_id: released.lease_id.clone(), reason: String::new() };
    ledger.leases(0).release_lease(release).await.unwrap();

    let stranger = v1::LeaseRef { lease_id: "l-stranger".into(), epoch: 1 };
    let request = v1::ReconcileNodeRequest {
        node_id: "n-1".into(),
        running: vec![lease_ref(&running, 1), lease_ref(&released, 1), stranger.clone(), lease_ref(&lost, 9)],
    };
    let answer = ledger.node("n-1").reconcile_node(request).await.unwrap().into_inner();
    assert_eq!(answer.destroy, vec![lease_ref(&released, 1), stranger, lease_ref(&lost, 9)]);
    assert_eq!(answer.failed, vec![lease_ref(&lost, 1)]);
    let failed = ledger.get(&lost.lease_id).await;
    assert_eq!((failed.phase(), failed.reason.as_str()), (LeasePhase::Failed, "NodeLost"));
    for (lease, phase) in
        [(&running, LeasePhase::Running), (&bound, LeasePhase::Bound), (&launching, LeasePhase::Launching)]
    {
        assert_eq!(ledger.get(&lease.lease_id).await.phase(), phase, "{}", lease.idempotency_key);
    }
    assert_eq!(ledger.node_capacity("n-1").await.leases, 3);
    ledger.cleanup().await;
}

async fn custody_takes_a_lost_launch_to_running_at_the_next_epoch(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 8000, 8 * GIB)]).await;
    let lease = ledger.place("lost-report", 500, MIB).await;
    ledger.report(&lease, 1, LeasePhase::Launching).await.unwrap();
    let mut node = ledger.node("n-1");
    let custody =
        |lease_id: &str, epoch| v1::AssumeCustodyRequest { node_id: "n-1".into(), lease_id: lease_id.into(), epoch };

    let held = node.assume_custody(custody(&lease.lease_id, 1)).await.unwrap().into_inner().lease.unwrap();
    assert_eq!((held.phase(), held.epoch, held.reason.as_str()), (LeasePhase::Running, 2, "CustodyAssumed"));
    let stale = ledger.report(&lease, 1, LeasePhase::Failed).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "the old epoch is fenced off");
    // The reply was lost and the node asks again with the epoch it had: the
    // custody it already holds is the answer, not a refusal.
    let again = node.assume_custody(custody(&lease.lease_id, 1)).await.unwrap().into_inner().lease.unwrap();
    assert_eq!((again.phase(), again.epoch), (LeasePhase::Running, 2), "the same custody, no further epoch");
    let mut n2 = ledger.node("n-2");
    let other = n2.assume_custody(v1::AssumeCustodyRequest { node_id: "n-2".into(), ..custody(&lease.lease_id, 1) });
    assert_eq!(other.await.unwrap_err().code(), Code::PermissionDenied, "another node never takes it");
    assert_eq!(ledger.report(&lease, 2, LeasePhase::Done).await.unwrap().phase(), LeasePhase::Done);
    let after_end = node.assume_custody(custody(&lease.lease_id, 1)).await.unwrap_err();
    assert_eq!(after_end.code(), Code::FailedPrecondition, "once it ended, an old epoch is refused again");

    let refused = node.assume_custody(custody(&lease.lease_id, 2)).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(
        refused.message(),
        format!("lease {} cannot be taken into custody: it is DONE; destroy its workload", lease.lease_id)
    );
    let missing = node.assume_custody(custody("l-nope", 1)).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    ledger.cleanup().await;
}

/// Waits until `lease_id` has expired.
async fn expired(ledger: &Ledger, lease_id: &str) {
    eventually(&format!("{lease_id} to expire"), PATIENCE, || async {
        let phase = ledger.get(lease_id).await.phase();
        if phase == LeasePhase::Expired { Ok(()) } else { Err(phase) }
    })
    .await;
}

async fn custody_saves_a_recently_expired_lease_while_its_room_is_free(backend: Backend) {
    // Long enough that the re-held lease does not expire again before its room is read.
    let ttl = Duration::from_secs(1);
    let ledger = Ledger::start(backend, expiring_config(ttl), vec![node("n-1", "", NodeState::Up, 1000, GIB)]).await;
    let lease = ledger.place("slow-agent", 600, MIB).await;
    expired(&ledger, &lease.lease_id).await;
    assert_eq!(ledger.node_capacity("n-1").await.allocated.unwrap().cpu_millis, 0);
    let request = v1::AssumeCustodyRequest { node_id: "n-1".into(), lease_id: lease.lease_id.clone(), epoch: 1 };
    let held = ledger.node("n-1").assume_custody(request).await.unwrap().into_inner().lease.unwrap();
    assert_eq!((held.phase(), held.epoch), (LeasePhase::Running, 2));
    assert_eq!(ledger.node_capacity("n-1").await.allocated.unwrap().cpu_millis, 600, "its room is taken again");

    // Expired again, and this time another lease took the room first.
    expired(&ledger, &lease.lease_id).await;
    ledger.place("newcomer", 600, MIB).await;
    let request = v1::AssumeCustodyRequest { node_id: "n-1".into(), lease_id: lease.lease_id.clone(), epoch: 2 };
    let refused = ledger.node("n-1").assume_custody(request).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains("node n-1 no longer has room for it"), "{}", refused.message());
    ledger.cleanup().await;
}

async fn nodes_may_not_request_leases_nor_act_for_other_nodes(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), three_nodes()).await;
    let denied = ledger.leases_as_node("n-1").request_lease(ask("k", 100, MIB)).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(denied.message().contains("node 'n-1' may not call"), "{}", denied.message());

    let mut n1 = ledger.node("n-1");
    let watch = v1::WatchAssignmentsRequest { node_id: "n-2".into(), resume_cursor: 0 };
    let denied = n1.watch_assignments(watch).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert_eq!(denied.message(), "node 'n-1' may act only on its own node id, not 'n-2'");
    let renew = v1::RenewLeasesRequest { node_id: "n-2".into(), leases: Vec::new() };
    assert_eq!(n1.renew_leases(renew).await.unwrap_err().code(), Code::PermissionDenied);
    let reconcile = v1::ReconcileNodeRequest { node_id: "n-2".into(), running: Vec::new() };
    assert_eq!(n1.reconcile_node(reconcile).await.unwrap_err().code(), Code::PermissionDenied);
    ledger.cleanup().await;
}

/// A node as it joins saying what runs its workloads.
fn run_by(node: berth_proto::identity::v1::Node, runtime: &str, contained: bool) -> berth_proto::identity::v1::Node {
    let mut node = node;
    node.labels.insert("berth.runtime".into(), runtime.into());
    node.labels.insert("berth.contained".into(), contained.to_string());
    node
}

async fn a_lease_goes_only_where_the_runtime_it_needs_runs(backend: Backend) {
    // The emptiest node runs plain processes: only leases that need nothing go there.
    let nodes = vec![
        run_by(node("n-1", "", NodeState::Up, 64000, 64 * GIB), "process", false),
        run_by(node("n-2", "", NodeState::Up, 4000, 8 * GIB), "runc", true),
        run_by(node("n-3", "", NodeState::Up, 4000, 8 * GIB), "runsc", true),
    ];
    let ledger = Ledger::start(backend, fast_config(), nodes).await;
    let with = |key: &str, runtime: RuntimeClass, image: bool| {
        let mut request = ask(key, 100, MIB);
        let workload = request.workload.as_mut().unwrap();
        workload.runtime = runtime as i32;
        if image {
            workload.command.clear();
            workload.digest = format!("sha256:{}", "a".repeat(64));
            workload.image =
                Some(BundleRef { reference: format!("registry.test/web@{}", workload.digest), ..Default::default() });
        }
        request
    };
    let placed = |request| async { ledger.leases(0).request_lease(request).await.unwrap().into_inner().lease.unwrap() };
    let sandboxed = placed(with("sandboxed", RuntimeClass::Sandboxed, false)).await;
    assert_eq!(sandboxed.node_id, "n-3");
    assert_eq!(sandboxed.workload.unwrap().runtime(), RuntimeClass::Sandboxed, "the lease keeps what it needs");
    assert_eq!(placed(with("contained", RuntimeClass::Contained, false)).await.node_id, "n-2");
    assert_eq!(placed(with("image", RuntimeClass::Unspecified, true)).await.node_id, "n-2");
    assert_eq!(placed(with("anything", RuntimeClass::Unspecified, false)).await.node_id, "n-1");

    let capacity = ledger.node_capacity("n-3").await;
    assert_eq!((capacity.runtime.as_str(), capacity.contained), ("runsc", true), "ListNodeCapacity says what runs");

    ledger.set_state("n-3", NodeState::Draining).await;
    let refused = ledger.leases(0).request_lease(with("nowhere", RuntimeClass::Sandboxed, false)).await.unwrap_err();
    assert_eq!(
        (refused.code(), refused.message()),
        (Code::ResourceExhausted, "no UP node in any tier that runs gVisor (runsc)")
    );
    let mut unknown = ask("unknown", 100, MIB);
    unknown.workload.as_mut().unwrap().runtime = 7;
    let refused = ledger.leases(0).request_lease(unknown).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("workload.runtime"), "{}", refused.message());
    ledger.cleanup().await;
}

fn size(cpu_millis: u64, memory_bytes: u64) -> Option<berth_proto::types::v1::Capacity> {
    Some(berth_proto::types::v1::Capacity { cpu_millis, memory_bytes })
}

fn resize(lease: &v1::Lease, epoch: u64, cpu_millis: u64, memory_bytes: u64) -> v1::ResizeLeaseRequest {
    v1::ResizeLeaseRequest { lease_id: lease.lease_id.clone(), epoch, resources: size(cpu_millis, memory_bytes) }
}

fn resized(lease: &v1::Lease, state: v1::ResizeState, cpu_millis: u64, memory_bytes: u64) -> v1::ReportResizeRequest {
    v1::ReportResizeRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: lease.epoch,
        resources: size(cpu_millis, memory_bytes),
        state: state as i32,
        reason: if state == v1::ResizeState::Deferred { "MemoryInUse".into() } else { String::new() },
        message: String::new(),
    }
}

async fn a_resize_grows_at_once_shrinks_once_applied_and_what_does_not_fit_changes_nothing(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 4000, 8 * GIB)]).await;
    let job = ledger.place("job", 1000, GIB).await;
    let other = ledger.place("other", 1000, GIB).await;
    let allocated = async |ledger: &Ledger| {
        let allocated = ledger.node_capacity("n-1").await.allocated.unwrap();
        (allocated.cpu_millis, allocated.memory_bytes)
    };

    // Growing reserves the new size at once; the lease's own size waits for its node.
    let asked = ledger.leases(0).resize_lease(resize(&job, 1, 2000, 2 * GIB)).await.unwrap().into_inner();
    let asked = asked.lease.unwrap();
    let pending = asked.resize.clone().unwrap();
    assert_eq!((pending.state(), pending.resources), (v1::ResizeState::Pending, size(2000, 2 * GIB)));
    assert_eq!(asked.resources, size(1000, GIB), "the size changes once its node applied it");
    assert_eq!(asked.phase(), LeasePhase::Bound, "a resize leaves the lease's phase alone");
    assert_eq!(allocated(&ledger).await, (3000, 3 * GIB));
    assert_eq!(ledger.get(&job.lease_id).await, asked, "as stored");
    let again = ledger.leases(0).resize_lease(resize(&job, 1, 2000, 2 * GIB)).await.unwrap().into_inner();
    assert_eq!(again.lease.unwrap(), asked, "asking again for the pending size changes nothing");

    // What does not fit is refused, naming the shortage, and changes nothing.
    let refused = ledger.leases(0).resize_lease(resize(&job, 1, 5000, 2 * GIB)).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(
        refused.message(),
        format!(
            "lease {} cannot grow to 5000m cpu and 2GiB memory on node n-1: it needs 3000m cpu and 0 bytes memory \
             more and the node has 1000m cpu and 5GiB memory free",
            job.lease_id
        )
    );
    assert_eq!(ledger.get(&job.lease_id).await, asked);
    assert_eq!(allocated(&ledger).await, (3000, 3 * GIB));
    let stale = ledger.leases(0).resize_lease(resize(&job, 2, 500, GIB)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    let bad = ledger.leases(0).resize_lease(resize(&job, 1, 0, GIB)).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("resources"), "{bad:?}");

    // The node reports on the size asked for, no other.
    let mut node = ledger.node("n-1");
    let wrong = node.report_resize(resized(&job, v1::ResizeState::Applied, 3000, 2 * GIB)).await.unwrap_err();
    assert_eq!(wrong.code(), Code::FailedPrecondition, "{wrong:?}");
    let applied = node.report_resize(resized(&job, v1::ResizeState::Applied, 2000, 2 * GIB)).await.unwrap();
    let applied = applied.into_inner().lease.unwrap();
    assert_eq!(
        (applied.resources, applied.resize.as_ref().unwrap().state()),
        (size(2000, 2 * GIB), v1::ResizeState::Applied)
    );
    assert_eq!(allocated(&ledger).await, (3000, 3 * GIB));
    let retried = node.report_resize(resized(&job, v1::ResizeState::Applied, 2000, 2 * GIB)).await.unwrap();
    assert_eq!(retried.into_inner().lease.unwrap(), applied, "a retried report is a no-op");

    // Shrinking frees nothing until the node applied it; a deferred shrink keeps the old size.
    ledger.leases(0).resize_lease(resize(&job, 1, 500, GIB / 2)).await.unwrap();
    assert_eq!(allocated(&ledger).await, (3000, 3 * GIB), "a pending shrink still reserves the old size");
    let deferred = node.report_resize(resized(&job, v1::ResizeState::Deferred, 500, GIB / 2)).await.unwrap();
    let deferred = deferred.into_inner().lease.unwrap();
    let resize_seen = deferred.resize.unwrap();
    assert_eq!((resize_seen.state(), resize_seen.reason.as_str()), (v1::ResizeState::Deferred, "MemoryInUse"));
    assert_eq!(deferred.resources, size(2000, 2 * GIB), "a deferred shrink keeps the old size");
    assert_eq!(allocated(&ledger).await, (3000, 3 * GIB));
    ledger.leases(0).resize_lease(resize(&job, 1, 500, GIB / 2)).await.unwrap();
    node.report_resize(resized(&job, v1::ResizeState::Applied, 500, GIB / 2)).await.unwrap();
    assert_eq!(allocated(&ledger).await, (1500, GIB + GIB / 2), "an applied shrink frees the difference");

    // A lease that ends with a resize pending returns all it reserved; a final one cannot be resized.
    ledger.leases(0).resize_lease(resize(&other, 1, 3000, GIB)).await.unwrap();
    assert_eq!(allocated(&ledger).await, (3500, GIB + GIB / 2));
    let release = v1::ReleaseLeaseRequest { lease_id: other.lease_id.clone(), reason: String::new() };
    ledger.leases(0).release_lease(release).await.unwrap();
    assert_eq!(allocated(&ledger).await, (500, GIB / 2));
    let ended = ledger.leases(0).resize_lease(resize(&other, 1, 500, GIB)).await.unwrap_err();
    assert_eq!(ended.code(), Code::FailedPrecondition, "{ended:?}");
    assert!(ended.message().contains("only an open lease can be resized"), "{ended:?}");
    ledger.cleanup().await;
}

async fn a_draining_nodes_leases_are_told_and_what_is_left_is_released_at_its_deadline(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), vec![node("n-1", "", NodeState::Up, 4000, 8 * GIB)]).await;
    let first = ledger.place("first", 1000, GIB).await;
    let second = ledger.place("second", 1000, GIB).await;
    ledger.report(&second, 1, LeasePhase::Running).await.unwrap();

    ledger.set_state("n-1", NodeState::Draining).await;
    for (lease, phase) in [(&first, LeasePhase::Bound), (&second, LeasePhase::Running)] {
        let told = eventually("the lease to be told its node drains", PATIENCE, || async {
            let now = ledger.get(&lease.lease_id).await;
            if now.reason == "NodeDraining" { Ok(now) } else { Err(now) }
        })
        .await;
        assert!(told.message.contains("n-1 is draining"), "{told:?}");
        assert_eq!((told.phase(), told.epoch), (phase, 1), "telling it changes nothing else");
    }
    assert_eq!(ledger.node_capacity("n-1").await.leases, 2, "a drain without a deadline releases nothing");

    // A drain lifted takes the mark off: nothing is to move any more.
    ledger.set_state("n-1", NodeState::Up).await;
    eventually("the drain's mark to be taken off", PATIENCE, || async {
        let now = ledger.get(&second.lease_id).await;
        if now.reason.is_empty() { Ok(()) } else { Err(now) }
    })
    .await;

    // The deadline passes: whatever is still open is released, its capacity returned.
    let mut drained = node("n-1", "", NodeState::Draining, 4000, 8 * GIB);
    let past = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64 - 1;
    drained.drain_deadline = Some(prost_types::Timestamp { seconds: past, nanos: 0 });
    ledger.put_node(drained).await;
    for lease in [&first, &second] {
        let released = eventually("the lease to be released at the deadline", PATIENCE, || async {
            let now = ledger.get(&lease.lease_id).await;
            if now.phase() == LeasePhase::Released { Ok(now) } else { Err(now) }
        })
        .await;
        assert_eq!(released.reason, "NodeDrained", "{released:?}");
    }
    let capacity = ledger.node_capacity("n-1").await;
    assert_eq!((capacity.leases, capacity.allocated.unwrap().cpu_millis), (0, 0));
    ledger.cleanup().await;
}

async fn a_nodes_declared_memory_overhead_is_held_with_each_lease_and_given_back_with_it(backend: Backend) {
    let mut vm_node = node("vm", "", NodeState::Up, 4000, GIB);
    vm_node.labels.insert("berth.runtime".into(), "microvm".into());
    vm_node.labels.insert("berth.contained".into(), "true".into());
    vm_node.labels.insert(berth_core::MEMORY_OVERHEAD_LABEL.into(), (256 * MIB).to_string());
    vm_node.labels.insert(berth_core::MEMORY_FLOOR_LABEL.into(), (128 * MIB).to_string());
    let ledger = Ledger::start(backend, fast_config(), vec![vm_node]).await;

    // 64 MiB asked: the guest is raised to 128 MiB and the VMM's 256 MiB is held beside it.
    let first = ledger.leases(0).request_lease(ask("first", 100, 64 * MIB)).await.unwrap().into_inner().lease.unwrap();
    assert_eq!((first.resources.unwrap().memory_bytes, first.memory_overhead_bytes), (64 * MIB, 320 * MIB));
    let second =
        ledger.leases(0).request_lease(ask("second", 100, 64 * MIB)).await.unwrap().into_inner().lease.unwrap();
    assert_eq!(ledger.node_capacity("vm").await.allocated.unwrap().memory_bytes, 768 * MIB);
    let refused = ledger.leases(0).request_lease(ask("third", 100, 64 * MIB)).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "1 GiB holds two VMs of 384 MiB, not three: {refused:?}");
    assert!(refused.message().contains("memory"), "{refused:?}");

    // Each lease gives back all it held.
    for lease in [first, second] {
        let release = v1::ReleaseLeaseRequest { lease_id: lease.lease_id.clone(), ..Default::default() };
        ledger.leases(0).release_lease(release).await.unwrap();
    }
    let capacity = ledger.node_capacity("vm").await;
    assert_eq!((capacity.leases, capacity.allocated.unwrap().memory_bytes), (0, 0));
    ledger.cleanup().await;
}

on_both_backends!(
    a_nodes_declared_memory_overhead_is_held_with_each_lease_and_given_back_with_it,
    a_draining_nodes_leases_are_told_and_what_is_left_is_released_at_its_deadline,
    a_resize_grows_at_once_shrinks_once_applied_and_what_does_not_fit_changes_nothing,
    a_lease_goes_only_where_the_runtime_it_needs_runs,
    a_spread_group_lands_on_different_nodes_and_what_does_not_fit_is_refused,
    draining_and_down_nodes_get_nothing_new,
    bad_requests_name_the_field,
    one_key_makes_one_lease_even_asked_fifty_times_at_once,
    phase_reports_move_forward_and_stale_epochs_change_nothing,
    renewals_keep_held_leases_and_name_the_lost_ones,
    leases_list_by_project_node_phase_and_owner,
    an_unrenewed_lease_expires_and_returns_its_capacity_while_a_renewed_one_stays,
    reconcile_destroys_what_no_open_lease_covers_and_fails_what_the_node_lost,
    custody_takes_a_lost_launch_to_running_at_the_next_epoch,
    custody_saves_a_recently_expired_lease_while_its_room_is_free,
    nodes_may_not_request_leases_nor_act_for_other_nodes,
);
