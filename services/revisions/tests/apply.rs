//! `ApplyService` as a user sees it, against a real registry and a real
//! leases service: a tag resolved once to the registry's digest, minting
//! only on change, resolution failures as conditions that heal by
//! themselves, and refusals that name the field.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use berth_bundle::testing::TestRegistry;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::revisions::v1;
use berth_proto::types::v1::ConditionStatus;
use berth_revisions::{BUNDLE_RESOLVED, READY};
use support::{Backend, Plane, apply_request, condition, fast_config, pinned_reference, push_bundle};
use tonic::Code;

async fn a_tag_is_resolved_once_to_the_registrys_digest_and_only_a_change_mints(backend: Backend) {
    let registry = TestRegistry::start().await.unwrap();
    let first = push_bundle(&registry, "team/app:v1", "one").await;
    let plane = Plane::start(backend, fast_config(), &["n-1"]).await;
    let reference = registry.reference("team/app:v1");

    let applied = plane.apply(apply_request("web", &reference, 1, &[("MODE", "a")])).await;
    assert!(applied.revision_created);
    assert_eq!(applied.revision, "web-00001");
    let revision = plane.revision("web-00001").await;
    let registry_says = registry.manifest_digest("team/app", "v1").await.unwrap().unwrap();
    assert_eq!(revision.digest, registry_says);
    assert_eq!(revision.digest, first.to_string());
    let service = applied.service.unwrap();
    assert_eq!(condition(&service, BUNDLE_RESOLVED).unwrap().status(), ConditionStatus::True);
    assert_eq!(service.status.unwrap().latest_created_revision, "web-00001");

    // The replica's lease carries the digest and the revision's template, pinned.
    let lease = plane.await_open_leases("web-00001", 1).await.remove(0);
    let workload = lease.workload.unwrap();
    assert_eq!(workload.digest, first.to_string());
    assert_eq!(workload.bundle.unwrap().reference, format!("{}/team/app@{first}", registry.host()));
    assert_eq!((workload.service.as_str(), workload.revision.as_str()), ("web", "web-00001"));
    assert_eq!(workload.env["MODE"], "a");
    assert_eq!(workload.ports[0].port, 8080);
    assert_eq!(lease.spread_group, "web");

    // The tag moves; the same declaration again mints nothing and keeps the old digest.
    let second = push_bundle(&registry, "team/app:v1", "two").await;
    assert_ne!(first, second);
    let again = plane.apply(apply_request("web", &reference, 1, &[("MODE", "a")])).await;
    assert!(!again.revision_created);
    assert_eq!(again.revision, "web-00001");
    assert_eq!(again.service.unwrap().generation, 1);
    assert_eq!(plane.revision("web-00001").await.digest, first.to_string());
    assert_eq!(plane.revision_names("web").await, ["web-00001"]);

    // A changed environment mints, resolving the tag where it points now.
    let changed = plane.apply(apply_request("web", &reference, 1, &[("MODE", "b")])).await;
    assert!(changed.revision_created);
    assert_eq!(changed.revision, "web-00002");
    assert_eq!(changed.service.unwrap().generation, 2);
    assert_eq!(plane.revision("web-00002").await.digest, second.to_string());
    assert_eq!(plane.revision_names("web").await, ["web-00002", "web-00001"]);
    plane.cleanup().await;
}

async fn a_missing_tag_is_a_condition_and_nothing_is_asked_of_leases(backend: Backend) {
    let registry = TestRegistry::start().await.unwrap();
    push_bundle(&registry, "team/app:v1", "one").await;
    let plane = Plane::start(backend, fast_config(), &["n-1"]).await;

    let applied = plane.apply(apply_request("web", &registry.reference("team/app:nope"), 1, &[])).await;
    assert!(applied.revision_created, "the declaration is accepted");
    let resolved = condition(&applied.service.unwrap(), BUNDLE_RESOLVED).unwrap();
    assert_eq!((resolved.status(), resolved.reason.as_str()), (ConditionStatus::False, "TagNotFound"));

    let service = plane
        .await_service("web", "reconciled", |s| s.status.as_ref().is_some_and(|st| st.observed_generation == 1))
        .await;
    let ready = condition(&service, READY).unwrap();
    assert_eq!((ready.status(), ready.reason.as_str()), (ConditionStatus::False, "TagNotFound"));
    assert!(ready.message.contains("nope"), "{}", ready.message);
    let revision = plane.revision("web-00001").await;
    assert!(revision.digest.is_empty());
    let resolved = revision.conditions.iter().find(|c| c.r#type == BUNDLE_RESOLVED).unwrap();
    assert_eq!(resolved.reason, "TagNotFound");
    assert!(plane.leases().await.is_empty(), "no digest, no lease");
    plane.cleanup().await;
}

async fn a_registry_outage_during_apply_heals_without_a_new_apply(backend: Backend) {
    let mut registry = TestRegistry::start().await.unwrap();
    let digest = push_bundle(&registry, "team/app:v1", "one").await;
    let plane = Plane::start(backend, fast_config(), &["n-1", "n-2"]).await;

    registry.stop();
    let applied = plane.apply(apply_request("web", &registry.reference("team/app:v1"), 2, &[])).await;
    assert!(applied.revision_created);
    let resolved = condition(&applied.service.unwrap(), BUNDLE_RESOLVED).unwrap();
    assert_eq!((resolved.status(), resolved.reason.as_str()), (ConditionStatus::False, "RegistryUnavailable"));
    // Still down after a few retries: still unavailable, nothing runs.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let service = plane.get("web").await;
    assert_eq!(condition(&service, BUNDLE_RESOLVED).unwrap().reason, "RegistryUnavailable");
    assert!(plane.leases().await.is_empty());

    registry.restart().await.unwrap();
    plane
        .await_service("web", "resolved", |s| {
            condition(s, BUNDLE_RESOLVED).is_some_and(|c| c.status() == ConditionStatus::True)
        })
        .await;
    assert_eq!(plane.revision("web-00001").await.digest, digest.to_string());
    plane.run("web-00001", 2).await;
    let service = plane.await_live("web", "web-00001").await;
    assert_eq!(service.generation, 1, "healed with no new apply");
    assert_eq!(plane.revision_names("web").await, ["web-00001"]);
    plane.cleanup().await;
}

on_both_backends!(
    a_tag_is_resolved_once_to_the_registrys_digest_and_only_a_change_mints,
    a_missing_tag_is_a_condition_and_nothing_is_asked_of_leases,
    a_registry_outage_during_apply_heals_without_a_new_apply,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_fields_are_named_and_nodes_may_not_apply() {
    let plane = Plane::start(Backend::Sqlite, fast_config(), &["n-1"]).await;
    let mut services = plane.services();

    let mut bad = apply_request("Web_1", &pinned_reference(), 1, &[]);
    bad.template.as_mut().unwrap().ports[0].port = 0;
    bad.template.as_mut().unwrap().env.insert("A=B".into(), "1".into());
    let status = services.apply_service(bad).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    for field in ["name:", "template.env:", "template.ports[0].port:"] {
        assert!(status.message().contains(field), "{field} not named in {}", status.message());
    }

    let mut no_template = apply_request("web", &pinned_reference(), 1, &[]);
    no_template.template = None;
    let status = services.apply_service(no_template).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("template: must be set"), "{}", status.message());

    let mut layout = apply_request("web", "oci:/tmp/layout:v1", 1, &[]);
    layout.project = "team-a".into();
    let status = services.apply_service(layout).await.unwrap_err();
    assert!(status.message().contains("template.bundle.reference"), "{}", status.message());

    let get = v1::GetServiceRequest { project: "Team A".into(), name: "web".into() };
    let status = services.get_service(get).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("project"), "{}", status.message());

    let pin = v1::SetTrafficRequest { name: "web".into(), pinned_revision: "web/1".into(), ..Default::default() };
    let status = services.set_traffic(pin).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("pinned_revision"), "{}", status.message());

    let status = plane.services_as_node("n-1").apply_service(apply_request("web", &pinned_reference(), 1, &[])).await;
    assert_eq!(status.unwrap_err().code(), Code::PermissionDenied);
    let status = plane.services_as_node("n-1").get_service(v1::GetServiceRequest::default()).await;
    assert_eq!(status.unwrap_err().code(), Code::PermissionDenied);

    // Nothing was recorded by any refused call.
    let listed = services.list_services(v1::ListServicesRequest { all_projects: true, ..Default::default() }).await;
    assert!(listed.unwrap().into_inner().services.is_empty());
    let missing = services.get_service(v1::GetServiceRequest { project: String::new(), name: "web".into() }).await;
    assert_eq!(missing.unwrap_err().code(), Code::NotFound);
    assert!(plane.leases().await.iter().all(|l| l.phase() != LeasePhase::Bound));
    plane.cleanup().await;
}
