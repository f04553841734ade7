//! The CA custodian against both store backends: custody across restarts,
//! one CA from racing replicas, SPIRE-style rotation, and issuance over the
//! real mTLS API.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::time::Duration;

use berth_core::Identity;
use berth_identity::{Authority, AuthorityTiming, IdentityConfig, IdentityService, KeptIdentity};
use berth_mtls::{TlsCredentials, TlsMaterial, certs_from_pem, generate_csr, verify_chain};
use berth_proto::identity::v1::{self, authority_client::AuthorityClient};
use berth_store::Store;
use berth_store::testing::TestDb;
use tokio_util::sync::CancellationToken;
use tonic::Code;

const SECRET: &str = "0123456789abcdef0123456789abcdef-test";

fn timing(min_prepared: Duration) -> AuthorityTiming {
    AuthorityTiming { min_prepared, ..AuthorityTiming::default() }
}

async fn migrated(db: &TestDb) -> Store {
    let store = db.store().clone();
    store.migrate(berth_identity::MIGRATIONS).await.unwrap();
    store
}

async fn active_rows(store: &Store) -> i64 {
    use sqlx::Row;
    sqlx::query("SELECT COUNT(*) AS n FROM authorities WHERE state = 'active'")
        .fetch_one(store.pool())
        .await
        .unwrap()
        .try_get("n")
        .unwrap()
}

macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(#[tokio::test] async fn $name() { super::$name(super::TestDb::postgres().await.unwrap()).await })*
        }
        mod sqlite {
            $(#[tokio::test] async fn $name() { super::$name(super::TestDb::sqlite().await.unwrap()).await })*
        }
    };
}

both_backends!(
    ca_survives_reopen_and_a_wrong_secret_is_refused,
    racing_first_starts_end_with_one_ca,
    rotation_prepares_then_activates_and_keeps_the_retired_ca_while_needed,
    issue_certificate_over_mtls_admits_admins_only,
);

async fn ca_survives_reopen_and_a_wrong_secret_is_refused(db: TestDb) {
    let store = migrated(&db).await;
    let first = Authority::open(store.clone(), SECRET, AuthorityTiming::default()).await.unwrap();
    let fingerprint = first.active_fingerprint().await.unwrap();
    let bundle = first.bundle_pem().await.unwrap();

    let again = Authority::open(db.connect().await.unwrap(), SECRET, AuthorityTiming::default()).await.unwrap();
    assert_eq!(again.active_fingerprint().await.unwrap(), fingerprint);
    assert_eq!(again.bundle_pem().await.unwrap(), bundle);

    let wrong = Authority::open(db.connect().await.unwrap(), &format!("{SECRET}-x"), AuthorityTiming::default()).await;
    let err = wrong.unwrap_err().to_string();
    assert!(err.contains("cannot unseal the CA key"), "{err}");

    // The key is stored sealed: the PEM never appears in the row.
    use sqlx::Row;
    let sealed: Vec<u8> =
        sqlx::query("SELECT sealed_key FROM authorities").fetch_one(store.pool()).await.unwrap().try_get(0).unwrap();
    assert!(!String::from_utf8_lossy(&sealed).contains("PRIVATE KEY"));
    db.cleanup().await.unwrap();
}

async fn racing_first_starts_end_with_one_ca(db: TestDb) {
    let store = migrated(&db).await;
    let mut opens = Vec::new();
    for _ in 0..4 {
        let s = db.connect().await.unwrap();
        opens.push(tokio::spawn(async move { Authority::open(s, SECRET, AuthorityTiming::default()).await }));
    }
    let mut fingerprints = Vec::new();
    for open in opens {
        fingerprints.push(open.await.unwrap().unwrap().active_fingerprint().await.unwrap());
    }
    fingerprints.dedup();
    assert_eq!(fingerprints.len(), 1, "every replica uses the one CA");
    assert_eq!(active_rows(&store).await, 1);
    db.cleanup().await.unwrap();
}

async fn rotation_prepares_then_activates_and_keeps_the_retired_ca_while_needed(db: TestDb) {
    let store = migrated(&db).await;
    let patient = Authority::open(store.clone(), SECRET, timing(Duration::from_secs(3600))).await.unwrap();
    let old = patient.active_fingerprint().await.unwrap();
    let node = Identity::node("n-1").unwrap();
    let (csr, _) = generate_csr("n-1").unwrap();
    let before = patient.sign(&csr, &node, &[], Duration::from_secs(600)).await.unwrap();

    patient.prepare().await.unwrap();
    let bundle = patient.bundle_pem().await.unwrap();
    assert_eq!(certs_from_pem("bundle", &bundle).unwrap().len(), 2, "the prepared CA is distributed");
    // Prepared: it signs nothing yet.
    let during = patient.sign(&csr, &node, &[], Duration::from_secs(600)).await.unwrap();
    assert!(verify_chain(&during.cert_pem, &certs_pem_of(&bundle, 0)).is_ok(), "still signed by the active CA");

    let refused = patient.activate(false).await.unwrap_err().to_string();
    assert!(refused.contains("wait"), "{refused}");

    let eager = Authority::open(db.connect().await.unwrap(), SECRET, timing(Duration::ZERO)).await.unwrap();
    eager.activate(false).await.unwrap();
    let new = eager.active_fingerprint().await.unwrap();
    assert_ne!(new, old);
    assert_eq!(eager.state_of(&old).await.unwrap(), Some("retired"));

    let after = eager.sign(&csr, &node, &[], Duration::from_secs(600)).await.unwrap();
    let bundle = eager.bundle_pem().await.unwrap();
    assert!(verify_chain(&after.cert_pem, &certs_pem_of(&bundle, 0)).is_ok(), "new certs chain to the new CA");
    assert!(verify_chain(&before.cert_pem, &bundle).is_ok(), "the retired CA stays while its certs live");
    assert_eq!(active_rows(&store).await, 1);

    // Activating twice with nothing prepared is refused with a reason.
    let again = eager.activate(false).await.unwrap_err().to_string();
    assert!(again.contains("no prepared CA"), "{again}");
    db.cleanup().await.unwrap();
}

/// The `i`th certificate of a bundle, PEM.
fn certs_pem_of(bundle: &str, i: usize) -> String {
    let blocks: Vec<&str> = bundle.split_inclusive("-----END CERTIFICATE-----").collect();
    blocks[i].trim().to_string() + "\n"
}

async fn issue_certificate_over_mtls_admits_admins_only(db: TestDb) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let store = migrated(&db).await;
    let config = IdentityConfig {
        auth_secret: SECRET.into(),
        authority: AuthorityTiming::default(),
        node_cert_ttl: Duration::from_secs(600),
    };
    let service = IdentityService::open(store, berth_bus::testing::memory_bus().unwrap(), config).await.unwrap();
    let authority = service.authority().clone();
    let me = KeptIdentity::issue(
        &authority,
        Identity::service("identity").unwrap(),
        vec!["127.0.0.1".into()],
        Duration::from_secs(600),
    )
    .await
    .unwrap();
    let listener = berth_rpc::Listener::bind("127.0.0.1:0".parse().unwrap(), me.credentials.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    tokio::spawn(service.server().serve(listener, stop.clone()));

    let admin = credentials(&authority, Identity::admin("ops").unwrap()).await;
    let node = credentials(&authority, Identity::node("n-9").unwrap()).await;

    let (csr, key) = generate_csr("leases").unwrap();
    let request = v1::IssueCertificateRequest {
        kind: v1::CertificateKind::Service as i32,
        name: "leases".into(),
        csr_pem: csr.clone(),
        ttl_seconds: 120,
        dns_names: vec!["leases".into(), "10.1.2.3".into()],
    };
    let mut as_admin = AuthorityClient::new(berth_rpc::connect(&addr, admin).unwrap());
    let issued = as_admin.issue_certificate(request.clone()).await.unwrap().into_inner();
    let material = TlsMaterial {
        cert_chain_pem: issued.certificate_pem.clone(),
        key_pem: key,
        ca_bundle_pem: issued.ca_bundle_pem,
    };
    let leases = TlsCredentials::new(material).unwrap();
    assert_eq!(leases.identity(), Some(Identity::service("leases").unwrap()));
    let bundle = as_admin.get_ca_bundle(v1::GetCaBundleRequest::default()).await.unwrap().into_inner();
    assert_eq!(bundle.authorities.len(), 1);
    assert_eq!(bundle.authorities[0].state, v1::AuthorityState::Active as i32);
    assert!(verify_chain(&issued.certificate_pem, &bundle.ca_bundle_pem).is_ok());

    let mut bad = request.clone();
    bad.kind = v1::CertificateKind::Unspecified as i32;
    assert_eq!(as_admin.issue_certificate(bad).await.unwrap_err().code(), Code::InvalidArgument);
    let mut bad = request.clone();
    bad.name = "Not_A_Label".into();
    let status = as_admin.issue_certificate(bad).await.unwrap_err();
    assert!(status.code() == Code::InvalidArgument && status.message().contains("name"), "{status:?}");
    let mut bad = request.clone();
    bad.csr_pem = "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n".into();
    let status = as_admin.issue_certificate(bad).await.unwrap_err();
    assert!(status.code() == Code::InvalidArgument && status.message().contains("csr_pem"), "{status:?}");

    // A router certificate, which its holder may renew and nothing more.
    let (router_csr, router_key) = generate_csr("edge").unwrap();
    let router_request = v1::IssueCertificateRequest {
        kind: v1::CertificateKind::Router as i32,
        name: "edge".into(),
        csr_pem: router_csr,
        ttl_seconds: 120,
        dns_names: vec!["router".into()],
    };
    let issued = as_admin.issue_certificate(router_request.clone()).await.unwrap().into_inner();
    let material = TlsMaterial {
        cert_chain_pem: issued.certificate_pem,
        key_pem: router_key,
        ca_bundle_pem: issued.ca_bundle_pem,
    };
    let router = TlsCredentials::new(material).unwrap();
    assert_eq!(router.identity(), Some(Identity::router("edge").unwrap()));
    let mut as_router = AuthorityClient::new(berth_rpc::connect(&addr, router).unwrap());
    assert!(as_router.issue_certificate(router_request.clone()).await.is_ok(), "a router renews itself");
    let status = as_router.issue_certificate(request.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "a router mints nothing else: {status:?}");
    let other = v1::IssueCertificateRequest { name: "other-edge".into(), ..router_request };
    assert_eq!(as_router.issue_certificate(other).await.unwrap_err().code(), Code::PermissionDenied);

    let mut as_node = AuthorityClient::new(berth_rpc::connect(&addr, node).unwrap());
    assert_eq!(as_node.issue_certificate(request).await.unwrap_err().code(), Code::PermissionDenied);
    assert!(as_node.get_ca_bundle(v1::GetCaBundleRequest::default()).await.is_ok(), "nodes may read the bundle");
    let rotate = as_node.rotate_ca(v1::RotateCaRequest::default()).await.unwrap_err();
    assert_eq!(rotate.code(), Code::PermissionDenied);

    stop.cancel();
    db.cleanup().await.unwrap();
}

async fn credentials(authority: &Authority, id: Identity) -> TlsCredentials {
    TlsCredentials::new(authority.issue_material(&id, &[], Duration::from_secs(600)).await.unwrap()).unwrap()
}
