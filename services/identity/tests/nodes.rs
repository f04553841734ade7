//! The node side of identity as agents and operators meet it, over mTLS
//! gRPC against one replica, on PostgreSQL with Redis and on SQLite with the
//! in-process bus: join tokens, Join, Heartbeat (liveness, renewal,
//! fencing), the monitor's grace, and the Nodes API.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::Duration;

use berth_core::Identity;
use berth_mtls::{CertificateAuthority, TlsCredentials, TlsMaterial, generate_csr, verify_chain};
use berth_proto::identity::v1;
use berth_proto::identity::v1::NodeState;
use berth_proto::types::v1::EventKind;
use support::{Backend, Cluster, fast_timing, join_over, patient_timing};
use tonic::Code;

on_both_backends!(
    join_heartbeat_up_then_down_after_the_grace_then_up_again,
    a_single_use_token_joins_once,
    expired_and_revoked_tokens_are_refused,
    unknown_token_and_wrong_secret_read_the_same,
    brute_force_from_one_address_hits_the_rate_limit,
    join_tokens_are_listed_without_secrets_and_revocation_keeps_the_row,
    a_node_certificate_is_confined_to_its_own_node,
    renewal_returns_a_certificate_that_chains_to_the_bundle,
    a_superseded_certificate_is_refused_by_identity_and_every_follower,
    bad_and_weak_csrs_are_refused_naming_the_field,
    a_node_reaped_while_partitioned_is_fenced_and_rejoins,
    a_second_live_node_on_the_same_address_is_refused,
    a_revoked_node_is_refused_and_watchers_see_it,
    a_drained_node_shows_draining_until_undrained,
    a_long_dead_node_is_forgotten_but_a_revoked_one_is_kept,
    a_new_ca_is_activated_only_once_every_up_node_has_acknowledged_it,
);

/// Polls ten beats' worth of time and checks the node never left `UP`.
async fn stays_up(cluster: &Cluster, node: &support::TestNode, beats: u32) {
    for _ in 0..beats {
        let answer = node.heartbeat(&cluster.addr(0)).await.unwrap();
        assert_eq!(answer.state(), NodeState::Up);
        assert!(!answer.fenced);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn join_heartbeat_up_then_down_after_the_grace_then_up_again(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(1).await;
    let node = cluster.join(0, &token, "10.0.0.7:7450").await.unwrap();
    assert!(node.node_id.starts_with("n-"), "{}", node.node_id);
    assert_eq!(node.incarnation, 1);
    assert_eq!(cluster.get(&node.node_id).await.state(), NodeState::Joining);

    let first = node.heartbeat(&cluster.addr(0)).await.unwrap();
    assert_eq!(first.state(), NodeState::Up);
    assert_eq!(first.heartbeat_interval_ms, 100);
    assert!(!first.ca_bundle_pem.is_empty());
    assert!(first.certificate_pem.is_empty(), "no renewal was asked for");
    // Beats keep it up for well past the grace.
    stays_up(&cluster, &node, 12).await;
    let seen = cluster.get(&node.node_id).await;
    assert_eq!(seen.state(), NodeState::Up);
    assert!(seen.last_heartbeat_at.is_some());
    assert_eq!(seen.capacity.unwrap().cpu_millis, 4000);

    // Silence: down after the 500 ms grace, not before it. The last beat was
    // about 100 ms before this point; the bound leaves room for the estimate
    // of the database clock, which a loaded machine skews by some tens of ms.
    let silent_since = std::time::Instant::now();
    let down = cluster.wait_for_state(&node.node_id, NodeState::Down, Duration::from_secs(5)).await;
    assert!(silent_since.elapsed() >= Duration::from_millis(300), "down after {:?}", silent_since.elapsed());
    assert_eq!(down.incarnation, 1, "down is not reaped");

    let back = node.heartbeat(&cluster.addr(0)).await.unwrap();
    assert_eq!(back.state(), NodeState::Up);
    assert!(!back.fenced);
    let node_now = cluster.get(&node.node_id).await;
    assert_eq!((node_now.state(), node_now.incarnation), (NodeState::Up, 1));
    cluster.cleanup().await;
}

async fn a_single_use_token_joins_once(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(0).await;
    cluster.join(0, &token, "10.0.0.1:7450").await.unwrap();
    let refused = cluster.join(0, &token, "10.0.0.2:7450").await.err().unwrap();
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert_eq!(refused.message(), "join token used up");
    let listed = cluster.nodes(0).list_nodes(v1::ListNodesRequest::default()).await.unwrap().into_inner();
    assert_eq!(listed.nodes.len(), 1);
    cluster.cleanup().await;
}

async fn expired_and_revoked_tokens_are_refused(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let short = cluster.token_with(v1::CreateJoinTokenRequest { ttl_seconds: 1, ..Default::default() }).await;
    let revoked = cluster.token_with(v1::CreateJoinTokenRequest::default()).await;
    cluster
        .tokens(0)
        .revoke_join_token(v1::RevokeJoinTokenRequest { token_id: revoked.token_id.clone() })
        .await
        .unwrap();
    let error = cluster.join(0, &revoked.token, "10.0.0.1:7450").await.err().unwrap();
    assert_eq!((error.code(), error.message()), (Code::Unauthenticated, "join token revoked"));

    tokio::time::sleep(Duration::from_millis(1100)).await;
    let error = cluster.join(0, &short.token, "10.0.0.1:7450").await.err().unwrap();
    assert_eq!((error.code(), error.message()), (Code::Unauthenticated, "join token expired"));
    cluster.cleanup().await;
}

async fn unknown_token_and_wrong_secret_read_the_same(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let real = cluster.token_with(v1::CreateJoinTokenRequest::default()).await;
    let wrong_secret = format!("berth-join.{}.{}", real.token_id, "0".repeat(64));
    let unknown_id = real.token.replacen(&real.token_id, "jt-000000000000", 1);
    let mut answers = Vec::new();
    for token in [wrong_secret.as_str(), unknown_id.as_str(), "not-a-token", ""] {
        let error = cluster.join(0, token, "10.0.0.1:7450").await.err().unwrap();
        answers.push((error.code(), error.message().to_owned()));
    }
    for answer in &answers {
        assert_eq!(answer, &(Code::Unauthenticated, "invalid join token".to_owned()));
    }
    // The real token still works: failed guesses take nothing from it.
    cluster.join(0, &real.token, "10.0.0.1:7450").await.unwrap();
    cluster.cleanup().await;
}

async fn brute_force_from_one_address_hits_the_rate_limit(backend: Backend) {
    let timing = v1_timing_with_join_limit(5);
    let cluster = Cluster::start(backend, timing).await;
    let real = cluster.token_with(v1::CreateJoinTokenRequest::default()).await;
    for guess in 0..5 {
        let token = format!("berth-join.{}.{guess:064}", real.token_id);
        let error = cluster.join(0, &token, "10.0.0.1:7450").await.err().unwrap();
        assert_eq!(error.code(), Code::Unauthenticated, "guess {guess}: {error:?}");
    }
    let limited = cluster.join(0, &real.token, "10.0.0.1:7450").await.err().unwrap();
    assert_eq!(limited.code(), Code::ResourceExhausted, "{limited:?}");
    assert!(limited.message().contains("127.0.0.1"), "{}", limited.message());
    let retry_after: u64 =
        limited.metadata().get(berth_identity::RETRY_AFTER_MS_HEADER).unwrap().to_str().unwrap().parse().unwrap();
    assert!(retry_after > 0 && retry_after <= 10_000, "{retry_after}");
    cluster.cleanup().await;
}

fn v1_timing_with_join_limit(attempts: u32) -> berth_identity::NodeTiming {
    berth_identity::NodeTiming { join_attempts: attempts, ..fast_timing() }
}

async fn join_tokens_are_listed_without_secrets_and_revocation_keeps_the_row(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let request = v1::CreateJoinTokenRequest {
        tier: "gpu".into(),
        labels: [("rack".to_owned(), "4".to_owned())].into(),
        ttl_seconds: 600,
        max_uses: 3,
        description: "rack 4 reinstall".into(),
    };
    let created = cluster.token_with(request).await;
    assert!(created.token.starts_with(&format!("berth-join.{}.", created.token_id)));
    let secret = created.token.rsplit('.').next().unwrap().to_owned();
    assert!(secret.len() >= 64, "32 random bytes, hex");

    let mut tokens = cluster.tokens(0);
    let listed = tokens.list_join_tokens(v1::ListJoinTokensRequest::default()).await.unwrap().into_inner();
    assert_eq!(listed.join_tokens.len(), 1);
    let token = &listed.join_tokens[0];
    assert_eq!((token.tier.as_str(), token.max_uses, token.uses, token.revoked), ("gpu", 3, 0, false));
    assert_eq!(token.created_by, "alice");
    assert_eq!(token.description, "rack 4 reinstall");
    assert!(!format!("{listed:?}").contains(&secret), "the secret is never listed");

    // A node joining with it lands in the token's tier with its labels.
    let node = cluster.join(0, &created.token, "10.0.0.1:7450").await.unwrap();
    let seen = cluster.get(&node.node_id).await;
    assert_eq!(seen.tier, "gpu");
    assert_eq!(seen.labels.get("rack").map(String::as_str), Some("4"));
    assert_eq!(seen.join_token_id, created.token_id);

    let revoked = tokens
        .revoke_join_token(v1::RevokeJoinTokenRequest { token_id: created.token_id.clone() })
        .await
        .unwrap()
        .into_inner()
        .join_token
        .unwrap();
    assert!(revoked.revoked);
    assert_eq!(revoked.uses, 1);
    let all = tokens.list_join_tokens(v1::ListJoinTokensRequest { usable_only: false }).await.unwrap().into_inner();
    assert_eq!(all.join_tokens.len(), 1, "revocation keeps the row");
    let usable = tokens.list_join_tokens(v1::ListJoinTokensRequest { usable_only: true }).await.unwrap().into_inner();
    assert!(usable.join_tokens.is_empty());

    let missing =
        tokens.revoke_join_token(v1::RevokeJoinTokenRequest { token_id: "jt-000000000000".into() }).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let bad = cluster
        .tokens(0)
        .create_join_token(v1::CreateJoinTokenRequest { ttl_seconds: 365 * 24 * 3600, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("ttl_seconds"), "{}", bad.message());
    cluster.cleanup().await;
}

async fn a_node_certificate_is_confined_to_its_own_node(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(2).await;
    let a = cluster.join(0, &token, "10.0.0.1:7450").await.unwrap();
    let b = cluster.join(0, &token, "10.0.0.2:7450").await.unwrap();

    let mut as_b = a.beat();
    as_b.node_id = b.node_id.clone();
    let error = a.send(&cluster.addr(0), as_b).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    assert!(error.message().contains(&b.node_id), "{}", error.message());

    let channel = a.channel(&cluster.addr(0));
    let error = v1::join_tokens_client::JoinTokensClient::new(channel.clone())
        .create_join_token(v1::CreateJoinTokenRequest::default())
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    let error = v1::nodes_client::NodesClient::new(channel.clone())
        .list_nodes(v1::ListNodesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    let error = v1::nodes_client::NodesClient::new(channel)
        .revoke_node(v1::RevokeNodeRequest { node_id: b.node_id.clone(), reason: String::new() })
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    assert_eq!(cluster.get(&b.node_id).await.state(), NodeState::Joining, "b untouched");

    // Without a certificate the heartbeat is not even reached.
    let anonymous = berth_rpc::connect_anonymous(&cluster.addr(0), &cluster.bundle).unwrap();
    let error = v1::node_session_client::NodeSessionClient::new(anonymous).heartbeat(a.beat()).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);

    // A certificate from another CA naming the same node fails the handshake.
    let other_ca = CertificateAuthority::generate("another CA", Duration::from_secs(3600)).unwrap();
    let (forged, key_pem) =
        other_ca.issue(&Identity::node(a.node_id.clone()).unwrap(), &[], Duration::from_secs(600)).unwrap();
    let forged = TlsCredentials::new(TlsMaterial {
        cert_chain_pem: forged.cert_pem,
        key_pem,
        ca_bundle_pem: cluster.bundle.clone(),
    })
    .unwrap();
    let channel = berth_rpc::connect(&cluster.addr(0), forged).unwrap();
    let error = v1::node_session_client::NodeSessionClient::new(channel).heartbeat(a.beat()).await.unwrap_err();
    // Under TLS 1.3 the client hears either the server's UnknownCA alert or
    // just the closed connection; either way no call reached a handler.
    let transport_failure = std::error::Error::source(&error)
        .is_some_and(|source| source.downcast_ref::<tonic::transport::Error>().is_some());
    assert!(transport_failure, "refused at the handshake, before any handler: {error:?}");
    assert_eq!(cluster.get(&a.node_id).await.state(), NodeState::Joining, "the forged beat changed nothing");
    cluster.cleanup().await;
}

/// When a certificate PEM was issued (its notBefore), seconds.
fn issued_at(pem: &str) -> i64 {
    let certs = berth_mtls::certs_from_pem("certificate", pem).unwrap();
    berth_mtls::cert_validity(&certs[0]).unwrap().0
}

/// A node's certificates are ordered by issue: once the node presents a
/// renewal, the one it replaced is refused after the overlap, and once it
/// rejoins, every certificate of its earlier incarnation is refused at
/// once, by identity and by every service following `WatchNodes`. A renewal
/// the node never presents (its reply lost) moves nothing.
async fn a_superseded_certificate_is_refused_by_identity_and_every_follower(backend: Backend) {
    let overlap = Duration::from_millis(700);
    let timing = berth_identity::NodeTiming { certificate_overlap: overlap, ..fast_timing() };
    let mut cluster = Cluster::start(backend, timing).await;
    cluster.add_replica().await;
    let token = cluster.token(1).await;
    let first = cluster.join(0, &token, "10.0.0.1:7450").await.unwrap();
    first.heartbeat(&cluster.addr(0)).await.unwrap();
    let first_pem = first.credentials.material().cert_chain_pem;
    let floor = cluster.get(&first.node_id).await.certificate_floor.unwrap();
    assert_eq!(floor.seconds, issued_at(&first_pem), "the floor is the joined certificate's issue time");

    // A service following identity, as leases and revisions do.
    let (directory, revocations) = (berth_runtime::NodeDirectory::new(), berth_rpc::Revocations::new());
    let stop = tokio_util::sync::CancellationToken::new();
    berth_runtime::follow_nodes(cluster.addr(1), cluster.admin.clone(), directory, revocations.clone(), stop.clone());

    // Certificates issued in the same second share their issue time.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let renew = |node: &support::TestNode| {
        let (csr, key_pem) = generate_csr("renewal").unwrap();
        let mut beat = node.beat();
        beat.renewal_csr_pem = csr;
        (beat, key_pem)
    };
    let (beat, _lost_key) = renew(&first);
    let lost = first.send(&cluster.addr(0), beat).await.unwrap();
    assert!(!lost.certificate_pem.is_empty());
    // Its reply lost: the node carries on with its certificate, accepted.
    first.heartbeat(&cluster.addr(0)).await.unwrap();
    first.heartbeat(&cluster.addr(1)).await.unwrap();

    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (beat, key_pem) = renew(&first);
    let answer = first.send(&cluster.addr(0), beat).await.unwrap();
    let renewed = support::TestNode {
        node_id: first.node_id.clone(),
        incarnation: first.incarnation,
        credentials: TlsCredentials::new(TlsMaterial {
            cert_chain_pem: answer.certificate_pem.clone(),
            key_pem,
            ca_bundle_pem: answer.ca_bundle_pem,
        })
        .unwrap(),
    };
    // Presented: the old one keeps working through the overlap...
    renewed.heartbeat(&cluster.addr(0)).await.unwrap();
    first.heartbeat(&cluster.addr(1)).await.unwrap();
    let node = cluster.get(&first.node_id).await;
    assert_eq!(node.certificate_floor.unwrap().seconds, issued_at(&first_pem));
    assert_eq!(node.certificate_next_floor.unwrap().seconds, issued_at(&answer.certificate_pem));
    // ...and is refused by every replica after it.
    tokio::time::sleep(overlap + Duration::from_millis(100)).await;
    for replica in 0..2 {
        let refused = first.heartbeat(&cluster.addr(replica)).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "replica {replica}: {refused:?}");
        assert!(refused.message().contains("superseded"), "{}", refused.message());
        renewed.heartbeat(&cluster.addr(replica)).await.unwrap();
    }
    // Neither the replaced nor the lost renewal is the node's for a follower.
    let old_issue = issued_at(&first_pem);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while revocations.superseded(&first.node_id, old_issue).is_none() {
        assert!(tokio::time::Instant::now() < deadline, "the follower never took the floor in");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(revocations.superseded(&first.node_id, issued_at(&lost.certificate_pem)).is_some());
    assert_eq!(revocations.superseded(&first.node_id, issued_at(&answer.certificate_pem)), None);

    // A rejoin (with the current certificate) supersedes every certificate of
    // the earlier incarnation at once: no overlap.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let rejoined = join_over(renewed.channel(&cluster.addr(0)), "", "10.0.0.1:7450", &cluster.bundle).await.unwrap();
    assert_eq!(rejoined.node_id, first.node_id);
    assert!(rejoined.incarnation > renewed.incarnation);
    let refused = renewed.heartbeat(&cluster.addr(0)).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("superseded"), "{}", refused.message());
    rejoined.heartbeat(&cluster.addr(0)).await.unwrap();
    let rejoined_issue = issued_at(&rejoined.credentials.material().cert_chain_pem);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while revocations.superseded(&first.node_id, issued_at(&answer.certificate_pem)).is_none() {
        assert!(tokio::time::Instant::now() < deadline, "the follower never took the rejoin's floor in");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(revocations.superseded(&first.node_id, rejoined_issue), None);
    stop.cancel();
    cluster.cleanup().await;
}

async fn renewal_returns_a_certificate_that_chains_to_the_bundle(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(1).await;
    let node = cluster.join(0, &token, "10.0.0.1:7450").await.unwrap();
    let before = cluster.get(&node.node_id).await.certificate_expires_at.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let (csr, key_pem) = generate_csr("renewal").unwrap();
    let mut beat = node.beat();
    beat.renewal_csr_pem = csr;
    let answer = node.send(&cluster.addr(0), beat).await.unwrap();
    assert!(!answer.certificate_pem.is_empty());
    verify_chain(&answer.certificate_pem, &answer.ca_bundle_pem).unwrap();
    let expires = answer.certificate_expires_at.unwrap();
    assert!(expires.seconds > before.seconds, "{expires:?} vs {before:?}");
    assert_eq!(cluster.get(&node.node_id).await.certificate_expires_at.unwrap(), expires);

    // The renewed certificate is the node's identity from now on.
    let renewed = TlsCredentials::new(TlsMaterial {
        cert_chain_pem: answer.certificate_pem,
        key_pem,
        ca_bundle_pem: answer.ca_bundle_pem,
    })
    .unwrap();
    assert_eq!(renewed.identity(), Some(Identity::node(node.node_id.clone()).unwrap()));
    let channel = berth_rpc::connect(&cluster.addr(0), renewed).unwrap();
    let answer = v1::node_session_client::NodeSessionClient::new(channel).heartbeat(node.beat()).await.unwrap();
    assert_eq!(answer.into_inner().state(), NodeState::Up);

    let mut weak = node.beat();
    weak.renewal_csr_pem = include_str!("../../../libs/mtls/testdata/rsa1024.csr").to_owned();
    let error = node.send(&cluster.addr(0), weak).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("weak"), "{}", error.message());
    cluster.cleanup().await;
}

async fn bad_and_weak_csrs_are_refused_naming_the_field(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(1).await;
    let mut client =
        v1::join_client::JoinClient::new(berth_rpc::connect_anonymous(&cluster.addr(0), &cluster.bundle).unwrap());
    let request = |csr_pem: &str| v1::JoinRequest {
        token: token.clone(),
        csr_pem: csr_pem.to_owned(),
        advertise_addr: "10.0.0.1:7450".into(),
        ..Default::default()
    };
    let garbage = "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n";
    let error = client.join(request(garbage)).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("csr_pem"), "{}", error.message());
    let error = client.join(request("")).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("csr_pem"), "{}", error.message());
    let weak = include_str!("../../../libs/mtls/testdata/rsa1024.csr");
    let error = client.join(request(weak)).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("weak"), "{}", error.message());
    let (csr, _) = generate_csr("x").unwrap();
    let mut bad_addr = request(&csr);
    bad_addr.advertise_addr = "10.0.0.1".into();
    let error = client.join(bad_addr).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("advertise_addr"), "{}", error.message());

    // None of the refusals used the single-use token.
    cluster.join(0, &token, "10.0.0.1:7450").await.unwrap();
    cluster.cleanup().await;
}

async fn a_node_reaped_while_partitioned_is_fenced_and_rejoins(backend: Backend) {
    let timing = berth_identity::NodeTiming { reap_after: Duration::from_millis(300), ..fast_timing() };
    let cluster = Cluster::start(backend, timing).await;
    let token = cluster.token(1).await;
    let node = cluster.join(0, &token, "10.0.0.7:7450").await.unwrap();
    assert_eq!(node.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Up);

    // Partitioned: silent past the grace and then past the reap.
    cluster.wait_for_state(&node.node_id, NodeState::Down, Duration::from_secs(5)).await;
    let started = std::time::Instant::now();
    loop {
        let seen = cluster.get(&node.node_id).await;
        if seen.incarnation > node.incarnation {
            assert_eq!(seen.state(), NodeState::Down);
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "not reaped: {seen:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // Back from the partition with its old incarnation: fenced, and stays down.
    let answer = node.heartbeat(&cluster.addr(0)).await.unwrap();
    assert!(answer.fenced);
    assert_eq!(answer.state(), NodeState::Down);
    assert!(!answer.ca_bundle_pem.is_empty());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(cluster.get(&node.node_id).await.state(), NodeState::Down);

    // It rejoins with its own certificate, no token: same id, newer incarnation.
    let rejoined = join_over(node.channel(&cluster.addr(0)), "", "10.0.0.7:7450", &cluster.bundle).await.unwrap();
    assert_eq!(rejoined.node_id, node.node_id);
    assert_eq!(rejoined.incarnation, node.incarnation + 2, "joined 1, reaped 2, rejoined 3");
    assert_eq!(rejoined.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Up);
    // The old agent, should it still run, stays fenced: refused outright as
    // superseded when its certificate predates the rejoin's by a second or
    // more (certificate times are in seconds), else told it is fenced.
    match node.heartbeat(&cluster.addr(0)).await {
        Ok(answer) => assert!(answer.fenced),
        Err(refused) => {
            assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
            assert!(refused.message().contains("superseded"), "{}", refused.message());
        }
    }
    assert_eq!(cluster.get(&node.node_id).await.state(), NodeState::Up);
    cluster.cleanup().await;
}

async fn a_second_live_node_on_the_same_address_is_refused(backend: Backend) {
    let cluster = Cluster::start(backend, patient_timing()).await;
    let token = cluster.token(2).await;
    let first = cluster.join(0, &token, "10.0.0.9:7450").await.unwrap();
    assert_eq!(first.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Up);
    // While the first beats, the second is refused the address.
    let second = first
        .beating(&cluster.addr(0), async {
            let second = cluster.join(0, &token, "10.0.0.9:7450").await.unwrap();
            let error = second.heartbeat(&cluster.addr(0)).await.unwrap_err();
            assert_eq!(error.code(), Code::FailedPrecondition);
            assert!(error.message().contains(&first.node_id), "{}", error.message());
            // Joining, or Down once it missed its beats on a slow machine: never Up.
            assert_ne!(cluster.get(&second.node_id).await.state(), NodeState::Up);
            second
        })
        .await;

    // Once the first is gone, the address is free, and the first is refused it.
    cluster.wait_for_state(&first.node_id, NodeState::Down, Duration::from_secs(5)).await;
    assert_eq!(second.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Up);
    second
        .beating(&cluster.addr(0), async {
            let error = first.heartbeat(&cluster.addr(0)).await.unwrap_err();
            assert_eq!(error.code(), Code::FailedPrecondition);
            assert!(error.message().contains(&second.node_id), "{}", error.message());
        })
        .await;
    cluster.cleanup().await;
}

async fn a_revoked_node_is_refused_and_watchers_see_it(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let token = cluster.token(1).await;
    let node = cluster.join(0, &token, "10.0.0.3:7450").await.unwrap();
    node.heartbeat(&cluster.addr(0)).await.unwrap();

    let mut watch = cluster.nodes(0).watch_nodes(v1::WatchNodesRequest::default()).await.unwrap().into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.kind(), EventKind::Upsert);
    assert_eq!(first.node.as_ref().unwrap().node_id, node.node_id);
    assert_eq!(watch.message().await.unwrap().unwrap().kind(), EventKind::Synced);

    let revoked = cluster
        .nodes(0)
        .revoke_node(v1::RevokeNodeRequest { node_id: node.node_id.clone(), reason: "disk stolen".into() })
        .await
        .unwrap()
        .into_inner()
        .node
        .unwrap();
    assert_eq!(revoked.state(), NodeState::Revoked);
    let event = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let event = watch.message().await.unwrap().unwrap();
            if event.node.as_ref().is_some_and(|n| n.state() == NodeState::Revoked) {
                return event;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(event.kind(), EventKind::Upsert);
    assert_eq!(event.node.unwrap().node_id, node.node_id);

    let error = node.heartbeat(&cluster.addr(0)).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    assert!(error.message().contains("revoked"), "{}", error.message());
    let error = join_over(node.channel(&cluster.addr(0)), "", "10.0.0.3:7450", &cluster.bundle).await.err().unwrap();
    assert_eq!(error.code(), Code::PermissionDenied, "a revoked node cannot rejoin as itself");
    // Revocation is final, and the row stays.
    let error = cluster
        .nodes(0)
        .drain_node(v1::DrainNodeRequest { node_id: node.node_id.clone(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::FailedPrecondition);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(cluster.get(&node.node_id).await.state(), NodeState::Revoked, "the monitor leaves it alone");
    let missing = cluster.nodes(0).get_node(v1::GetNodeRequest { node_id: "n-000000000000".into() }).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    cluster.cleanup().await;
}

async fn a_drained_node_shows_draining_until_undrained(backend: Backend) {
    let cluster = Cluster::start(backend, patient_timing()).await;
    let token = cluster.token(2).await;
    let node = cluster.join(0, &token, "10.0.0.4:7450").await.unwrap();
    node.heartbeat(&cluster.addr(0)).await.unwrap();

    // An admin's drain or undrain, and the node as it then stands.
    let drain = |request| async { cluster.nodes(0).drain_node(request).await.unwrap().into_inner().node.unwrap() };
    let drained = drain(v1::DrainNodeRequest { node_id: node.node_id.clone(), ..Default::default() }).await;
    assert_eq!(drained.state(), NodeState::Draining);
    assert_eq!(drained.drain_deadline, None, "a drain without a deadline releases nothing");
    // Draining again with a deadline sets it; a bad one is refused.
    let deadline = |seconds| Some(prost_types::Duration { seconds, nanos: 0 });
    let again = v1::DrainNodeRequest { node_id: node.node_id.clone(), undrain: false, deadline: deadline(600) };
    let again = drain(again).await;
    let at = again.drain_deadline.unwrap();
    let from_now =
        at.seconds - std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert!((590..=610).contains(&from_now), "{at:?} is {from_now}s from now");
    assert_eq!(cluster.get(&node.node_id).await.drain_deadline, Some(at), "as stored");
    let bad = v1::DrainNodeRequest { node_id: node.node_id.clone(), undrain: false, deadline: deadline(-5) };
    let bad = cluster.nodes(0).drain_node(bad).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("deadline"), "{bad:?}");
    assert_eq!(cluster.get(&node.node_id).await.state(), NodeState::Draining);
    let listed = cluster
        .nodes(0)
        .list_nodes(v1::ListNodesRequest { tier: String::new(), state: NodeState::Draining as i32 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.nodes.iter().map(|n| n.node_id.as_str()).collect::<Vec<_>>(), [node.node_id.as_str()]);
    let up = cluster
        .nodes(0)
        .list_nodes(v1::ListNodesRequest { tier: String::new(), state: NodeState::Up as i32 })
        .await
        .unwrap()
        .into_inner();
    assert!(up.nodes.is_empty());

    // Heartbeats keep it draining; the drain survives a trip through DOWN.
    assert_eq!(node.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Draining);
    cluster.wait_for_state(&node.node_id, NodeState::Down, Duration::from_secs(5)).await;
    assert_eq!(node.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Draining);

    // From here the node beats on, as its agent would (and the neighbour
    // once it joined): however slow the machine, neither is taken for gone
    // while the drains are asked for.
    node.beating(&cluster.addr(0), async {
        let undrained =
            drain(v1::DrainNodeRequest { node_id: node.node_id.clone(), undrain: true, deadline: None }).await;
        assert_eq!(undrained.state(), NodeState::Up);
        assert_eq!(undrained.drain_deadline, None, "lifting a drain lifts its deadline");
        assert_eq!(node.heartbeat(&cluster.addr(0)).await.unwrap().state(), NodeState::Up);
        let error =
            cluster.nodes(0).list_nodes(v1::ListNodesRequest { tier: String::new(), state: 42 }).await.unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument);

        let neighbour = cluster.join(0, &token, "10.0.0.5:7450").await.unwrap();
        neighbour.heartbeat(&cluster.addr(0)).await.unwrap();
        neighbour
            .beating(&cluster.addr(0), async {
                // A node may drain itself (an interruption notice), not another, and never lift a drain.
                let as_node = |who: &_| v1::nodes_client::NodesClient::new(cluster_channel(&cluster, who));
                let other = v1::DrainNodeRequest { node_id: node.node_id.clone(), ..Default::default() };
                let refused = as_node(&neighbour).drain_node(other).await.unwrap_err();
                assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
                let itself = v1::DrainNodeRequest { node_id: neighbour.node_id.clone(), ..Default::default() };
                let drained = as_node(&neighbour).drain_node(itself).await.unwrap().into_inner().node.unwrap();
                assert_eq!(drained.state(), NodeState::Draining);
                let lift = v1::DrainNodeRequest { node_id: neighbour.node_id.clone(), undrain: true, deadline: None };
                let refused = as_node(&neighbour).drain_node(lift).await.unwrap_err();
                assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
                assert_eq!(cluster.get(&node.node_id).await.state(), NodeState::Up, "the other node is untouched");
            })
            .await;
    })
    .await;
    cluster.cleanup().await;
}

fn cluster_channel(cluster: &Cluster, node: &support::TestNode) -> berth_rpc::Channel {
    node.channel(&cluster.addr(0))
}

async fn a_long_dead_node_is_forgotten_but_a_revoked_one_is_kept(backend: Backend) {
    let timing = berth_identity::NodeTiming {
        reap_after: Duration::from_millis(300),
        forget_after: Duration::from_millis(300),
        ..fast_timing()
    };
    let cluster = Cluster::start(backend, timing).await;
    let token = cluster.token(3).await;
    let dead = cluster.join(0, &token, "10.0.0.5:7450").await.unwrap();
    let revoked = cluster.join(0, &token, "10.0.0.6:7450").await.unwrap();
    dead.heartbeat(&cluster.addr(0)).await.unwrap();
    revoked.heartbeat(&cluster.addr(0)).await.unwrap();
    cluster
        .nodes(0)
        .revoke_node(v1::RevokeNodeRequest { node_id: revoked.node_id.clone(), reason: "retired".into() })
        .await
        .unwrap();
    let mut watch = cluster.nodes(0).watch_nodes(v1::WatchNodesRequest::default()).await.unwrap().into_inner();

    // Down, reaped, then forgotten: the watcher is told it is gone.
    let removed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let event = watch.message().await.unwrap().unwrap();
            if event.kind() == EventKind::Removed {
                return event.node.unwrap();
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(removed.node_id, dead.node_id);
    let error = cluster.nodes(0).get_node(v1::GetNodeRequest { node_id: dead.node_id.clone() }).await.unwrap_err();
    assert_eq!(error.code(), Code::NotFound);
    let error = dead.heartbeat(&cluster.addr(0)).await.unwrap_err();
    assert_eq!(error.code(), Code::NotFound);
    assert!(error.message().contains("join again"), "{}", error.message());

    // Its agent cannot rejoin as itself, but joins afresh with a token.
    let error = join_over(dead.channel(&cluster.addr(0)), "", "10.0.0.5:7450", &cluster.bundle).await.err().unwrap();
    assert_eq!(error.code(), Code::NotFound);
    let fresh = join_over(dead.channel(&cluster.addr(0)), &token, "10.0.0.5:7450", &cluster.bundle).await.unwrap();
    assert_ne!(fresh.node_id, dead.node_id);
    assert_eq!(fresh.incarnation, 1);

    // The revoked row outlives every retention, for audit.
    assert_eq!(cluster.get(&revoked.node_id).await.state(), NodeState::Revoked);
    cluster.cleanup().await;
}

async fn a_new_ca_is_activated_only_once_every_up_node_has_acknowledged_it(backend: Backend) {
    let cluster = Cluster::start(backend, patient_timing()).await;
    let token = cluster.token(1).await;
    let node = cluster.join(0, &token, "10.0.0.9:7450").await.unwrap();
    let first = node.heartbeat(&cluster.addr(0)).await.unwrap();
    assert_eq!(first.state(), NodeState::Up);
    // The node beats on throughout, as its agent would (a beat that names
    // no bundle leaves its acknowledgement as it was): however slow the
    // machine, it stays an Up node whose word activation waits for.
    node.beating(&cluster.addr(0), async {
        let mut authority = v1::authority_client::AuthorityClient::new(cluster.admin_channel(0));
        let step = |activate, force| v1::RotateCaRequest { activate, force, ..Default::default() };
        let prepared = authority.rotate_ca(step(false, false)).await.unwrap().into_inner().ca_bundle_pem;

        // The node has not said it trusts the bundle holding the new CA.
        let refused = authority.rotate_ca(step(true, false)).await.unwrap_err();
        assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
        assert!(refused.message().contains(&node.node_id), "{}", refused.message());

        // It reports the old bundle: still refused. A digest that is not one is refused by name.
        let mut beat = node.beat();
        beat.ca_bundle_sha256 = berth_identity::bundle_digest(&first.ca_bundle_pem);
        let answer = node.send(&cluster.addr(0), beat.clone()).await.unwrap();
        assert_eq!(answer.ca_bundle_pem, prepared, "the heartbeat hands out the bundle holding the new CA");
        assert_eq!(authority.rotate_ca(step(true, false)).await.unwrap_err().code(), Code::FailedPrecondition);
        let bad_beat = v1::HeartbeatRequest { ca_bundle_sha256: "XYZ".into(), ..beat.clone() };
        let bad = node.send(&cluster.addr(0), bad_beat).await.unwrap_err();
        assert_eq!(bad.code(), Code::InvalidArgument);
        assert!(bad.message().contains("ca_bundle_sha256"), "{}", bad.message());

        // It reports the new one: activation goes through.
        beat.ca_bundle_sha256 = berth_identity::bundle_digest(&prepared);
        node.send(&cluster.addr(0), beat).await.unwrap();
        let activated = authority.rotate_ca(step(true, false)).await.unwrap().into_inner();
        assert_eq!(activated.authorities[0].state(), v1::AuthorityState::Active);

        // Forced, a lagging node does not hold activation back.
        authority.rotate_ca(step(false, false)).await.unwrap();
        assert_eq!(authority.rotate_ca(step(true, false)).await.unwrap_err().code(), Code::FailedPrecondition);
        authority.rotate_ca(step(true, true)).await.unwrap();
    })
    .await;
    cluster.cleanup().await;
}
