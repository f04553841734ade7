//! Launch registrations as nodes and identity use them, on both backends:
//! a node takes one for a lease it holds open, identity (and no other
//! caller) spends it once, a forged one is refused, and an ended launch's
//! registration is worthless.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_core::Identity;
use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1;
use berth_proto::leases::v1::LeasePhase;
use berth_testkit::on_both_backends;
use support::{Backend, GIB, Ledger, fast_config, node};
use tonic::Code;

fn two_nodes() -> Vec<berth_proto::identity::v1::Node> {
    vec![node("n-1", "", NodeState::Up, 4000, 8 * GIB), node("n-2", "", NodeState::Up, 4000, 8 * GIB)]
}

fn register(lease: &v1::Lease, node_id: &str, epoch: u64) -> v1::RegisterLaunchRequest {
    v1::RegisterLaunchRequest { node_id: node_id.into(), lease_id: lease.lease_id.clone(), epoch }
}

fn redeem(registration: &str, node_id: &str) -> v1::RedeemLaunchRegistrationRequest {
    v1::RedeemLaunchRegistrationRequest { registration: registration.into(), node_id: node_id.into() }
}

fn identity() -> Identity {
    Identity::service("identity").unwrap()
}

async fn a_registration_is_spent_once_by_identity_for_the_node_holding_the_lease(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), two_nodes()).await;
    let lease = ledger.place("job", 1000, GIB).await;
    assert_eq!(lease.node_id, "n-1");

    // Only the node holding the lease, at its epoch, gets a registration.
    let elsewhere = ledger.node("n-2").register_launch(register(&lease, "n-2", 1)).await.unwrap_err();
    assert_eq!(elsewhere.code(), Code::PermissionDenied, "{elsewhere:?}");
    let stale = ledger.node("n-1").register_launch(register(&lease, "n-1", 2)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    let impostor = ledger.node("n-2").register_launch(register(&lease, "n-1", 1)).await.unwrap_err();
    assert_eq!(impostor.code(), Code::PermissionDenied, "a node acts only for itself: {impostor:?}");
    let taken = ledger.node("n-1").register_launch(register(&lease, "n-1", 1)).await.unwrap().into_inner();
    assert!(taken.registration.starts_with(&format!("{}/1/n-1/", lease.lease_id)), "{taken:?}");
    let expires = taken.expires_at.unwrap().seconds;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let now = i64::try_from(now).unwrap();
    assert!((now + 60..=now + 180).contains(&expires), "good for a couple of minutes: {expires} at {now}");
    let again = ledger.node("n-1").register_launch(register(&lease, "n-1", 1)).await.unwrap().into_inner();
    assert_ne!(again.registration, taken.registration, "every registration is a fresh secret");

    // Only identity spends one: another service is refused by the handler,
    // a node by the access layer.
    let revisions = Identity::service("revisions").unwrap();
    let refused = ledger.leases_as(&revisions).redeem_launch_registration(redeem(&taken.registration, "n-1")).await;
    let refused = refused.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("only identity"), "{refused:?}");
    let node = ledger.leases_as_node("n-1").redeem_launch_registration(redeem(&taken.registration, "n-1")).await;
    assert_eq!(node.unwrap_err().code(), Code::PermissionDenied);

    // Presented for the wrong node: refused, and still good for the right one.
    let mut identity = ledger.leases_as(&identity());
    let wrong = identity.redeem_launch_registration(redeem(&taken.registration, "n-2")).await.unwrap_err();
    assert_eq!(wrong.code(), Code::FailedPrecondition, "{wrong:?}");
    assert!(wrong.message().contains("issued to another node than n-2"), "{wrong:?}");
    let spent = identity.redeem_launch_registration(redeem(&taken.registration, "n-1")).await.unwrap();
    let spent = spent.into_inner().lease.unwrap();
    assert_eq!((spent.lease_id.as_str(), spent.epoch, spent.node_id.as_str()), (lease.lease_id.as_str(), 1, "n-1"));

    // A replay is refused, naming the lease and who spent it.
    let replay = identity.redeem_launch_registration(redeem(&taken.registration, "n-1")).await.unwrap_err();
    assert_eq!(replay.code(), Code::FailedPrecondition, "{replay:?}");
    let said = replay.message();
    assert!(said.contains(&lease.lease_id) && said.contains("already spent"), "{said}");
    assert!(said.contains("redeemed by service 'identity'"), "{said}");

    // A forged one (its epoch changed, or its signature) was never issued.
    let forged = again.registration.replacen("/1/n-1/", "/2/n-1/", 1);
    let forged = identity.redeem_launch_registration(redeem(&forged, "n-1")).await.unwrap_err();
    assert_eq!((forged.code(), forged.message()), (Code::FailedPrecondition, "no such launch registration"));
    let mut tampered = again.registration.clone();
    let last = if tampered.ends_with('0') { "1" } else { "0" };
    tampered.replace_range(tampered.len() - 1.., last);
    let tampered = identity.redeem_launch_registration(redeem(&tampered, "n-1")).await.unwrap_err();
    assert_eq!(tampered.message(), "no such launch registration");
    let malformed = identity.redeem_launch_registration(redeem("abc", "n-1")).await.unwrap_err();
    assert_eq!(malformed.code(), Code::InvalidArgument);
    assert!(malformed.message().starts_with("invalid registration"), "{malformed:?}");
    ledger.cleanup().await;
}

async fn an_ended_launch_leaves_no_registration_to_spend(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), two_nodes()).await;
    let mut identity = ledger.leases_as(&identity());

    // A launch that failed: its unspent registration is worth nothing.
    let failed = ledger.place("failed", 1000, GIB).await;
    let node_id = failed.node_id.clone();
    let taken = ledger.node(&node_id).register_launch(register(&failed, &node_id, 1)).await.unwrap().into_inner();
    ledger.report(&failed, 1, LeasePhase::Failed).await.unwrap();
    let revoked = identity.redeem_launch_registration(redeem(&taken.registration, &node_id)).await.unwrap_err();
    assert_eq!(revoked.code(), Code::FailedPrecondition, "{revoked:?}");
    assert!(revoked.message().contains("so its launch is over"), "{revoked:?}");
    let late = ledger.node(&node_id).register_launch(register(&failed, &node_id, 1)).await.unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition, "{late:?}");
    assert!(late.message().contains("has no launch to register"), "{late:?}");

    // A lease released after its registration was taken: nothing to sign.
    let released = ledger.place("released", 1000, GIB).await;
    let node_id = released.node_id.clone();
    let taken = ledger.node(&node_id).register_launch(register(&released, &node_id, 1)).await.unwrap().into_inner();
    let release = v1::ReleaseLeaseRequest { lease_id: released.lease_id.clone(), ..Default::default() };
    ledger.leases(0).release_lease(release).await.unwrap();
    let over = identity.redeem_launch_registration(redeem(&taken.registration, &node_id)).await.unwrap_err();
    assert_eq!(over.code(), Code::FailedPrecondition, "{over:?}");
    assert!(over.message().contains("so its launch is over"), "{over:?}");
    ledger.cleanup().await;
}

async fn registrations_spent_at_once_are_each_spent_exactly_once(backend: Backend) {
    let ledger = Ledger::start(backend, fast_config(), two_nodes()).await;
    let lease = ledger.place("burst", 1000, GIB).await;
    let node = lease.node_id.clone();
    let mut registrations = Vec::new();
    for _ in 0..8 {
        let taken = ledger.node(&node).register_launch(register(&lease, &node, 1)).await.unwrap().into_inner();
        registrations.push(taken.registration);
    }
    // Each registration presented three times, all at once: the redeemer
    // spends many per commit, and never one twice.
    let mut presented = tokio::task::JoinSet::new();
    for registration in registrations.iter().flat_map(|r| [r.clone(), r.clone(), r.clone()]) {
        let mut identity = ledger.leases_as(&identity());
        let node = node.clone();
        presented.spawn(async move {
            let answer = identity.redeem_launch_registration(redeem(&registration, &node)).await;
            (registration, answer.map(|_| ()).map_err(|status| (status.code(), status.message().to_owned())))
        });
    }
    let mut spent = std::collections::BTreeMap::<String, u32>::new();
    while let Some(joined) = presented.join_next().await {
        let (registration, answer) = joined.unwrap();
        match answer {
            Ok(()) => *spent.entry(registration).or_default() += 1,
            Err((code, message)) => {
                assert_eq!(code, Code::FailedPrecondition, "{message}");
                assert!(message.contains("already spent"), "{message}");
            }
        }
    }
    assert_eq!(spent.len(), registrations.len(), "every registration was spent: {spent:?}");
    assert!(spent.values().all(|n| *n == 1), "none twice: {spent:?}");
    ledger.cleanup().await;
}

on_both_backends!(
    a_registration_is_spent_once_by_identity_for_the_node_holding_the_lease,
    an_ended_launch_leaves_no_registration_to_spend,
    registrations_spent_at_once_are_each_spent_exactly_once,
);
