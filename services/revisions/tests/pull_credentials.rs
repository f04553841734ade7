//! `GetPullCredentials` as nodes see it, against a real registry behind
//! htpasswd and a real leases service: the node a replica's lease is placed
//! on gets the credentials its revision names, for that registry, while the
//! lease is open; every other caller is refused, and the lease itself
//! carries only the credentials' name.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::SystemTime;

use berth_bundle::RegistryCredentials;
use berth_bundle::testing::TestRegistry;
use berth_proto::leases::v1 as leases;
use berth_proto::revisions::v1;
use berth_proto::types::v1::BundleRef;
use berth_revisions::RegistrySecrets;
use support::{Backend, Plane, apply_request, fast_config, pinned_reference, push_bundle_as};
use tonic::Code;

const USER: &str = "ci";
const PASSWORD: &str = "s3cret-pull";

fn basic() -> RegistryCredentials {
    RegistryCredentials::Basic { username: USER.into(), password: PASSWORD.into() }
}

/// An apply of `name` running `reference` with the credentials `secret`.
fn private(name: &str, reference: &str, secret: &str) -> v1::ApplyServiceRequest {
    let mut request = apply_request(name, reference, 1, &[]);
    let template = request.template.as_mut().unwrap();
    template.bundle = Some(BundleRef { reference: reference.to_owned(), secret: secret.to_owned(), insecure: false });
    request
}

async fn ask(plane: &Plane, node: &str, lease_id: &str) -> Result<v1::GetPullCredentialsResponse, tonic::Status> {
    let request = v1::GetPullCredentialsRequest { lease_id: lease_id.to_owned() };
    plane.revisions_as_node(node).get_pull_credentials(request).await.map(tonic::Response::into_inner)
}

async fn only_the_node_holding_an_open_lease_gets_its_revisions_credentials(backend: Backend) {
    let registry = TestRegistry::start_with_htpasswd(USER, PASSWORD).await.unwrap();
    let digest = push_bundle_as(&registry, "team/private:v1", "private", &basic()).await;
    let secrets = RegistrySecrets::none().with("team", Some(&registry.host()), basic()).with(
        "elsewhere",
        Some("registry.example.com"),
        basic(),
    );
    let plane = Plane::start_with_secrets(backend, fast_config(), &["n-1"], secrets).await;

    // The tag resolves with the credentials, so the revision pins the private digest.
    let applied = plane.apply(private("web", &registry.reference("team/private:v1"), "team")).await;
    assert_eq!(plane.revision(&applied.revision).await.digest, digest.to_string());
    let lease = plane.await_open_leases("web-00001", 1).await.remove(0);
    assert_eq!(lease.node_id, "n-1");
    // The lease names the credentials and holds nothing of them.
    let bundle = lease.workload.as_ref().unwrap().bundle.clone().unwrap();
    assert_eq!(bundle.secret, "team");
    assert!(!format!("{lease:?}").contains(PASSWORD), "{lease:?}");

    let before = SystemTime::now();
    let granted = ask(&plane, "n-1", &lease.lease_id).await.unwrap();
    assert_eq!(granted.registry, registry.host());
    assert_eq!((granted.username.as_str(), granted.password.as_str()), (USER, PASSWORD));
    assert_eq!(granted.bearer_token, "");
    assert_eq!(granted.secret, "team");
    let expires = SystemTime::try_from(granted.expires_at.unwrap()).unwrap();
    assert!(expires > before && expires <= SystemTime::now() + fast_config().pull_credentials_ttl, "{expires:?}");

    // Another node, an admin, and no lease at all are refused.
    let other = ask(&plane, "n-2", &lease.lease_id).await.unwrap_err();
    assert_eq!(other.code(), Code::PermissionDenied, "{other:?}");
    assert_eq!(other.message(), format!("lease {} is not open on node n-2", lease.lease_id));
    let request = v1::GetPullCredentialsRequest { lease_id: lease.lease_id.clone() };
    let admin = plane.revisions().get_pull_credentials(request).await.unwrap_err();
    assert_eq!(admin.code(), Code::PermissionDenied, "{admin:?}");
    let unknown = ask(&plane, "n-1", "l-nope").await.unwrap_err();
    assert_eq!(unknown.code(), Code::PermissionDenied, "{unknown:?}");
    let empty = ask(&plane, "n-1", "").await.unwrap_err();
    assert_eq!((empty.code(), empty.message()), (Code::InvalidArgument, "lease_id: must not be empty"));

    // A lease of the same workload that revisions did not ask for gets nothing.
    let copy = leases::RequestLeaseRequest {
        owner: "someone/else".into(),
        idempotency_key: "copy".into(),
        resources: lease.resources,
        workload: lease.workload.clone(),
        ..Default::default()
    };
    let copy = plane.ledger().request_lease(copy).await.unwrap().into_inner().lease.unwrap();
    assert_eq!(copy.node_id, "n-1");
    let refused = ask(&plane, "n-1", &copy.lease_id).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("revisions did not ask for it"), "{refused:?}");
    plane
        .ledger()
        .release_lease(leases::ReleaseLeaseRequest { lease_id: copy.lease_id, reason: String::new() })
        .await
        .unwrap();

    // Credentials bound to another registry are not handed out for this one.
    plane.apply(private("web", &registry.reference("team/private:v1"), "elsewhere")).await;
    let resolved = plane.revision("web-00002").await;
    assert_eq!(resolved.digest, "", "the resolver did not send them either");

    // Once released, the lease no longer opens the registry.
    plane
        .ledger()
        .release_lease(leases::ReleaseLeaseRequest { lease_id: lease.lease_id.clone(), reason: String::new() })
        .await
        .unwrap();
    let released = ask(&plane, "n-1", &lease.lease_id).await.unwrap_err();
    assert_eq!(released.code(), Code::PermissionDenied, "{released:?}");

    // A revision naming no credentials has none to give.
    plane.apply(apply_request("open", &pinned_reference(), 1, &[])).await;
    let open = plane.await_open_leases("open-00001", 1).await.remove(0);
    let none = ask(&plane, "n-1", &open.lease_id).await.unwrap_err();
    assert_eq!(none.code(), Code::FailedPrecondition, "{none:?}");
    assert!(none.message().contains("names no registry credentials"), "{none:?}");
    plane.cleanup().await;
}

on_both_backends!(only_the_node_holding_an_open_lease_gets_its_revisions_credentials);
