//! Workload certificates as a node gets them, on both backends, with a real
//! leases service judging every lease: the first against a launch
//! registration spent once, renewals only while the lease is open on the
//! node at its epoch, every one an SVID under a root the mesh does not
//! trust, which rotates apart from the mesh's.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use berth_core::Identity;
use berth_identity::{GrpcLaunchLedger, WorkloadSettings};
use berth_mtls::{TlsCredentials, TlsMaterial, generate_csr, verify_chain};
use berth_proto::identity::v1;
use berth_proto::leases::v1 as leases;
use berth_proto::types::v1::Capacity;
use berth_rpc::Channel;
use berth_testkit::{InProcessLeases, await_nodes_up, fast_ledger, on_both_backends};
use support::{Backend, Cluster, TestNode, fast_timing};
use tokio_util::sync::CancellationToken;
use tonic::Code;

fn workloads(addr: &str, node: &TestNode) -> v1::workloads_client::WorkloadsClient<Channel> {
    v1::workloads_client::WorkloadsClient::new(node.channel(addr))
}

fn sign(node: &TestNode, registration: &str) -> (v1::SignWorkloadCertificateRequest, String) {
    let (csr_pem, key_pem) = generate_csr("anything the workload likes").unwrap();
    let request = v1::SignWorkloadCertificateRequest {
        node_id: node.node_id.clone(),
        registration: registration.to_owned(),
        csr_pem,
    };
    (request, key_pem)
}

fn renew(node_id: &str, lease: &leases::Lease, epoch: u64) -> v1::RenewWorkloadCertificateRequest {
    let (csr_pem, _key) = generate_csr("w").unwrap();
    v1::RenewWorkloadCertificateRequest {
        node_id: node_id.to_owned(),
        lease_id: lease.lease_id.clone(),
        epoch,
        csr_pem,
    }
}

async fn register(leases_addr: &str, node: &TestNode, lease: &leases::Lease) -> String {
    let mut client = leases::node_leases_client::NodeLeasesClient::new(node.channel(leases_addr));
    let request =
        leases::RegisterLaunchRequest { node_id: node.node_id.clone(), lease_id: lease.lease_id.clone(), epoch: 1 };
    client.register_launch(request).await.unwrap().into_inner().registration
}

async fn an_svid_is_signed_once_per_launch_and_renewed_only_while_its_lease_is_open(backend: Backend) {
    let mut cluster = Cluster::start(backend, fast_timing()).await;
    let stop = CancellationToken::new();
    let token = cluster.token(2).await;
    let one = cluster.join(0, &token, "10.0.0.1:7447").await.unwrap();
    let two = cluster.join(0, &token, "10.0.0.2:7447").await.unwrap();
    one.keep_beating(vec![cluster.addr(0)], Duration::from_millis(100), stop.clone());
    two.keep_beating(vec![cluster.addr(0)], Duration::from_millis(100), stop.clone());

    // Leases follows identity's registry; identity's second replica asks it
    // about launches, as --leases-addr makes it.
    let authority = cluster.replicas[0].service.authority().clone();
    let issue = |identity: Identity| {
        let authority = authority.clone();
        async move {
            let names = ["localhost".to_owned(), "127.0.0.1".to_owned()];
            TlsCredentials::new(authority.issue_material(&identity, &names, Duration::from_secs(3600)).await.unwrap())
                .unwrap()
        }
    };
    let leases_me = issue(Identity::service("leases").unwrap()).await;
    let ledger = InProcessLeases::start(backend, leases_me, &cluster.addr(0), fast_ledger(), &stop).await;
    await_nodes_up(ledger.addr, cluster.admin.clone(), 2).await;
    let identity_me = issue(Identity::service("identity").unwrap()).await;
    let launches = GrpcLaunchLedger::connect(&ledger.addr.to_string(), identity_me).unwrap();
    let signer = cluster
        .add_replica_with(WorkloadSettings {
            trust_domain: "prod.example.org".into(),
            cert_ttl: Duration::from_secs(300),
            ledger: Some(Arc::new(launches)),
        })
        .await;
    let (signer, leases_addr) = (cluster.addr(signer), ledger.addr.to_string());

    let admin = berth_rpc::connect(&leases_addr, cluster.admin.clone()).unwrap();
    let mut requester = leases::leases_client::LeasesClient::new(admin);
    let ask = leases::RequestLeaseRequest {
        project: "shop".into(),
        owner: "tests/workloads".into(),
        idempotency_key: "web-1".into(),
        resources: Some(Capacity { cpu_millis: 100, memory_bytes: 1 << 20 }),
        workload: Some(leases::Workload {
            command: "/bin/true".into(),
            service: "web".into(),
            revision: "web-00003".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let lease = requester.request_lease(ask).await.unwrap().into_inner().lease.unwrap();
    let (holder, other) = if lease.node_id == one.node_id { (&one, &two) } else { (&two, &one) };

    // The first certificate, against a fresh registration.
    let registration = register(&leases_addr, holder, &lease).await;
    let (request, key_pem) = sign(holder, &registration);
    let signed = workloads(&signer, holder).sign_workload_certificate(request).await.unwrap().into_inner();
    let spiffe_id = format!("spiffe://prod.example.org/ns/shop/svc/web/rev/web-00003/lease/{}", lease.lease_id);
    assert_eq!(
        (signed.spiffe_id.as_str(), signed.lease_id.as_str(), signed.epoch),
        (spiffe_id.as_str(), lease.lease_id.as_str(), 1)
    );
    let lifetime = signed.not_after.unwrap().seconds - signed.not_before.unwrap().seconds;
    assert!((300..=300 + 5 * 60).contains(&lifetime), "the configured 5 minutes, backdated for skew: {lifetime}");
    verify_chain(&signed.certificate_pem, &signed.bundle_pem).unwrap();

    // Under a root of its own: the mesh's bundle does not verify it, and a
    // mesh endpoint refuses it as a client.
    assert_ne!(signed.bundle_pem, cluster.bundle);
    assert!(verify_chain(&signed.certificate_pem, &cluster.bundle).is_err(), "the mesh does not trust an SVID");
    let svid =
        TlsMaterial { cert_chain_pem: signed.certificate_pem.clone(), key_pem, ca_bundle_pem: cluster.bundle.clone() };
    let as_workload = berth_rpc::connect(&signer, TlsCredentials::new(svid).unwrap()).unwrap();
    let refused = v1::authority_client::AuthorityClient::new(as_workload)
        .get_ca_bundle(v1::GetCaBundleRequest::default())
        .await
        .unwrap_err();
    // The server's TLS refuses it (the client sees the connection fail, how
    // depends on when the alert arrives) before admission or a handler
    // could answer with a status of their own.
    let transport = std::error::Error::source(&refused).is_some_and(|e| e.is::<tonic::transport::Error>());
    assert!(
        transport && matches!(refused.code(), Code::Unknown | Code::Cancelled | Code::Unavailable),
        "an SVID is no mesh credential: {refused:?}"
    );
    let bundle = workloads(&signer, other).get_workload_bundle(v1::GetWorkloadBundleRequest::default()).await;
    let bundle = bundle.unwrap().into_inner();
    assert_eq!(
        (bundle.bundle_pem.as_str(), bundle.trust_domain.as_str()),
        (signed.bundle_pem.as_str(), "prod.example.org")
    );

    // A replay, and a registration presented by a node it was not issued to.
    let (replay, _) = sign(holder, &registration);
    let replayed = workloads(&signer, holder).sign_workload_certificate(replay).await.unwrap_err();
    assert_eq!(replayed.code(), Code::FailedPrecondition, "{replayed:?}");
    assert!(replayed.message().contains("already spent"), "{replayed:?}");
    let fresh = register(&leases_addr, holder, &lease).await;
    let (stolen, _) = sign(other, &fresh);
    let stolen = workloads(&signer, other).sign_workload_certificate(stolen).await.unwrap_err();
    assert_eq!(stolen.code(), Code::FailedPrecondition, "{stolen:?}");
    let (mine_for_another, _) = sign(holder, &fresh);
    let impostor = v1::SignWorkloadCertificateRequest { node_id: other.node_id.clone(), ..mine_for_another };
    let impostor = workloads(&signer, holder).sign_workload_certificate(impostor).await.unwrap_err();
    assert_eq!(impostor.code(), Code::PermissionDenied, "a node asks only for itself: {impostor:?}");

    // Renewals: the holder at the lease's epoch, while it is open.
    let renewed = workloads(&signer, holder).renew_workload_certificate(renew(&holder.node_id, &lease, 1)).await;
    let renewed = renewed.unwrap().into_inner();
    assert_eq!(renewed.spiffe_id, spiffe_id);
    verify_chain(&renewed.certificate_pem, &renewed.bundle_pem).unwrap();
    let stale = workloads(&signer, holder).renew_workload_certificate(renew(&holder.node_id, &lease, 2)).await;
    assert_eq!(stale.unwrap_err().code(), Code::FailedPrecondition);
    let elsewhere = workloads(&signer, other).renew_workload_certificate(renew(&other.node_id, &lease, 1)).await;
    assert_eq!(elsewhere.unwrap_err().code(), Code::PermissionDenied);

    // JWT-SVIDs: for the holder at the lease's epoch, for an audience, and
    // verified by the JWK set the bundle publishes.
    let jwt = |node: &TestNode, epoch: u64, audience: &[&str]| v1::SignWorkloadJwtRequest {
        node_id: node.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch,
        audience: audience.iter().map(|a| a.to_string()).collect(),
    };
    let token = workloads(&signer, holder).sign_workload_jwt(jwt(holder, 1, &["db"])).await.unwrap().into_inner();
    assert_eq!(token.spiffe_id, spiffe_id);
    let bundle = workloads(&signer, holder).get_workload_bundle(v1::GetWorkloadBundleRequest {}).await.unwrap();
    assert_eq!(bundle.get_ref().jwks_json, token.jwks_json, "the bundle publishes the key that signed it");
    let claims = berth_mtls::verify_jwt_svid(&token.token, &bundle.get_ref().jwks_json, "db").unwrap();
    assert_eq!(claims.sub, spiffe_id);
    assert!(claims.exp - claims.iat <= 300, "a JWT-SVID lives at most 5 minutes: {claims:?}");
    assert!(berth_mtls::verify_jwt_svid(&token.token, &bundle.get_ref().jwks_json, "web").is_err());
    let no_audience = workloads(&signer, holder).sign_workload_jwt(jwt(holder, 1, &[])).await.unwrap_err();
    assert_eq!(no_audience.code(), Code::InvalidArgument, "{no_audience:?}");
    let stale = workloads(&signer, holder).sign_workload_jwt(jwt(holder, 2, &["db"])).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    let elsewhere = workloads(&signer, other).sign_workload_jwt(jwt(other, 1, &["db"])).await.unwrap_err();
    assert_eq!(elsewhere.code(), Code::PermissionDenied, "{elsewhere:?}");

    // The workloads' authority rotates apart from the mesh's: a prepared
    // root reaches workloads with their next renewal, and signs only once
    // every SVID alive has been renewed with it (a whole lifetime), or when
    // forced.
    let mut authority = v1::authority_client::AuthorityClient::new(cluster.admin_channel(0));
    let workload_step =
        |activate, force| v1::RotateCaRequest { activate, force, purpose: v1::CaPurpose::Workload as i32 };
    let prepared = authority.rotate_ca(workload_step(false, false)).await.unwrap().into_inner();
    let states: Vec<_> = prepared.authorities.iter().map(|a| a.state()).collect();
    assert_eq!(states, [v1::AuthorityState::Active, v1::AuthorityState::Prepared]);
    let old_root = signed.bundle_pem.clone();
    let mesh = authority.get_ca_bundle(v1::GetCaBundleRequest::default()).await.unwrap().into_inner();
    assert_eq!(mesh.ca_bundle_pem, cluster.bundle, "the mesh's authority is untouched");
    assert_eq!(mesh.authorities.len(), 1);
    let renewed = berth_testkit::eventually("renewals to carry the prepared root", berth_testkit::PATIENCE, || async {
        let renewed = workloads(&signer, holder).renew_workload_certificate(renew(&holder.node_id, &lease, 1)).await;
        let renewed = renewed.map_err(|e| format!("{e:?}"))?.into_inner();
        if renewed.bundle_pem == prepared.ca_bundle_pem { Ok(renewed) } else { Err(renewed.bundle_pem) }
    })
    .await;
    verify_chain(&renewed.certificate_pem, &old_root).expect("still signed by the active root");
    let early = authority.rotate_ca(workload_step(true, false)).await.unwrap_err();
    assert_eq!(early.code(), Code::FailedPrecondition, "{early:?}");
    assert!(early.message().contains("every workload has renewed with it"), "{early:?}");
    let activated = authority.rotate_ca(workload_step(true, true)).await.unwrap().into_inner();
    let new_root = activated.authorities[0].certificate_pem.clone();
    assert_eq!(activated.authorities[0].fingerprint, prepared.authorities[1].fingerprint, "the prepared root signs");
    let renewed = berth_testkit::eventually("renewals under the new root", berth_testkit::PATIENCE, || async {
        let renewed = workloads(&signer, holder).renew_workload_certificate(renew(&holder.node_id, &lease, 1)).await;
        let renewed = renewed.map_err(|e| format!("{e:?}"))?.into_inner();
        verify_chain(&renewed.certificate_pem, &new_root).map_err(|e| e.to_string())?;
        Ok::<_, String>(renewed)
    })
    .await;
    assert!(verify_chain(&renewed.certificate_pem, &old_root).is_err(), "no longer under the old root");
    verify_chain(&signed.certificate_pem, &renewed.bundle_pem).expect("the retired root stays in the bundle");
    let token = workloads(&signer, holder).sign_workload_jwt(jwt(holder, 1, &["db"])).await.unwrap().into_inner();
    berth_mtls::verify_jwt_svid(&token.token, &token.jwks_json, "db").expect("tokens follow the new key");
    let mesh_after = authority.get_ca_bundle(v1::GetCaBundleRequest::default()).await.unwrap().into_inner();
    assert_eq!(mesh_after.ca_bundle_pem, cluster.bundle, "still untouched");
    let bad = v1::RotateCaRequest { purpose: 9, ..Default::default() };
    let bad = authority.rotate_ca(bad).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("purpose"), "{bad:?}");

    let release = leases::ReleaseLeaseRequest { lease_id: lease.lease_id.clone(), ..Default::default() };
    requester.release_lease(release).await.unwrap();
    let over = workloads(&signer, holder).renew_workload_certificate(renew(&holder.node_id, &lease, 1)).await;
    let over = over.unwrap_err();
    assert_eq!(over.code(), Code::FailedPrecondition, "{over:?}");
    assert!(over.message().contains("is not renewed"), "{over:?}");
    let over = workloads(&signer, holder).sign_workload_jwt(jwt(holder, 1, &["db"])).await.unwrap_err();
    assert_eq!(over.code(), Code::FailedPrecondition, "a released lease's workload gets no token: {over:?}");

    // A replica not told where leases is signs nothing.
    let blind = workloads(&cluster.addr(0), holder).renew_workload_certificate(renew(&holder.node_id, &lease, 1)).await;
    let blind = blind.unwrap_err();
    assert_eq!(blind.code(), Code::FailedPrecondition);
    assert!(blind.message().contains("--leases-addr"), "{blind:?}");

    // A revoked node's workloads renew nothing, whatever their leases: it is
    // refused at the door.
    let revoke = v1::RevokeNodeRequest { node_id: holder.node_id.clone(), reason: "disk stolen".into() };
    cluster.nodes(0).revoke_node(revoke).await.unwrap();
    let revoked = berth_testkit::eventually("the revocation to reach the signer", berth_testkit::PATIENCE, || async {
        let renewed = workloads(&signer, holder).renew_workload_certificate(renew(&holder.node_id, &lease, 1)).await;
        match renewed {
            Err(status) if status.code() == Code::PermissionDenied => Ok(status),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(revoked.message().contains("revoked"), "{revoked:?}");

    stop.cancel();
    ledger.cleanup(backend).await;
    cluster.cleanup().await;
}

on_both_backends!(an_svid_is_signed_once_per_launch_and_renewed_only_while_its_lease_is_open);
