//! Gateways and routes over real mTLS gRPC as an admin sees them: applied,
//! refused with the field named, listed and shown with the status the full
//! pass wrote, deleted; and each project's plan, compiled from the services
//! revisions holds.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use berth_core::Identity;
use berth_proto::egress::v1 as egress;
use berth_proto::revisions::v1 as revisions;
use berth_proto::types::v1::ConditionStatus;
use berth_testkit::{PATIENCE, eventually};
use support::{Backend, Mesh, egress_reason, fast_config, gateway, listener, route, service};
use tonic::Code;

fn condition<'a>(
    conditions: &'a [berth_proto::types::v1::Condition],
    kind: &str,
) -> &'a berth_proto::types::v1::Condition {
    conditions.iter().find(|c| c.r#type == kind).unwrap_or_else(|| panic!("no {kind} condition in {conditions:?}"))
}

async fn await_route(
    mesh: &Mesh,
    project: &str,
    name: &str,
    check: impl Fn(&egress::EgressRoute) -> bool,
) -> egress::EgressRoute {
    eventually(&format!("route {name} to get the status expected"), PATIENCE, || async {
        let request = egress::GetRouteRequest { project: project.into(), name: name.into() };
        let route = mesh.egress().get_route(request).await.unwrap().into_inner().route.unwrap();
        if check(&route) { Ok(route) } else { Err(route) }
    })
    .await
}

fn parent_reason(route: &egress::EgressRoute) -> Option<(i32, String)> {
    let parent = route.status.as_ref()?.parents.first()?;
    let accepted = parent.conditions.iter().find(|c| c.r#type == "Accepted")?;
    Some((accepted.status, accepted.reason.clone()))
}

async fn gateways_and_routes_round_trip_with_their_status(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1"]).await;
    let mut api = mesh.egress();

    let applied = mesh.apply_gateway(gateway("team", "default")).await;
    assert_eq!((applied.project.as_str(), applied.name.as_str(), applied.generation), ("team", "default", 1));
    let mut db = gateway("team", "db");
    db.listeners = vec![listener("pg", egress::ListenerProtocol::Tcp, 5432)];
    mesh.apply_gateway(db).await;

    mesh.apply_route(route("team", "github", "default", &["github.com", "*.github.com"], &[443])).await;
    mesh.apply_route(route("team", "ghost", "nowhere", &["x.example.com"], &[])).await;
    mesh.apply_route(route("team", "wild-db", "db", &["*.internal"], &[5432])).await;
    mesh.apply_route(route("team", "pg", "db", &["pg.internal"], &[5432])).await;

    let accepted = (ConditionStatus::True as i32, "Accepted".to_owned());
    let github = await_route(&mesh, "team", "github", |r| parent_reason(r) == Some(accepted.clone())).await;
    let conditions = &github.status.unwrap().parents[0].conditions;
    assert!(condition(conditions, "Accepted").message.contains("http, https"), "{conditions:?}");
    let refused = |reason: &str| Some((ConditionStatus::False as i32, reason.to_owned()));
    await_route(&mesh, "team", "ghost", |r| parent_reason(r) == refused("NoMatchingParent")).await;
    let wild = await_route(&mesh, "team", "wild-db", |r| parent_reason(r) == refused("NotAllowedByListeners")).await;
    let message = &wild.status.unwrap().parents[0].conditions[0].message;
    assert!(message.contains("TCP") && message.contains("wildcard"), "{message}");
    await_route(&mesh, "team", "pg", |r| parent_reason(r) == Some(accepted.clone())).await;

    let request = egress::GetGatewayRequest { project: "team".into(), name: "default".into() };
    let shown = api.get_gateway(request).await.unwrap().into_inner().gateway.unwrap();
    let status = shown.status.unwrap();
    let ready = condition(&status.conditions, "Ready");
    assert_eq!((ready.status, ready.observed_generation), (ConditionStatus::True as i32, 1));
    assert!(ready.last_transition_time.is_some());
    let attached: Vec<(String, u32)> = status.listeners.iter().map(|l| (l.name.clone(), l.attached_routes)).collect();
    assert_eq!(attached, [("http".to_owned(), 1), ("https".to_owned(), 1)]);

    let listed = api.list_gateways(egress::ListGatewaysRequest { project: "team".into() }).await.unwrap().into_inner();
    let names: Vec<&str> = listed.gateways.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["db", "default"]);
    assert!(listed.gateways.iter().all(|g| g.status.as_ref().is_some_and(|s| !s.conditions.is_empty())));
    let listed = api.list_routes(egress::ListRoutesRequest { project: "team".into() }).await.unwrap().into_inner();
    let names: Vec<&str> = listed.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["ghost", "github", "pg", "wild-db"]);
    let other = api.list_routes(egress::ListRoutesRequest { project: "other".into() }).await.unwrap().into_inner();
    assert!(other.routes.is_empty(), "projects do not see each other's routes");

    // The same declaration changes nothing; a changed one is a new generation.
    assert_eq!(mesh.apply_gateway(gateway("team", "default")).await.generation, 1);
    let mut moved = gateway("team", "default");
    moved.listeners[0].port = 8080;
    assert_eq!(mesh.apply_gateway(moved).await.generation, 2);
    eventually("the gateway's status to observe generation 2", PATIENCE, || {
        let mut api = api.clone();
        async move {
            let request = egress::GetGatewayRequest { project: "team".into(), name: "default".into() };
            let shown = api.get_gateway(request).await.unwrap().into_inner().gateway.unwrap();
            let observed = condition(&shown.status.unwrap().conditions, "Ready").observed_generation;
            if observed == 2 { Ok(()) } else { Err(observed) }
        }
    })
    .await;

    // Deleting a route takes it out of the plan.
    mesh.await_plan("team", "listed ghost", |p| p.routes.iter().any(|r| r.name == "ghost")).await;
    api.delete_route(egress::DeleteRouteRequest { project: "team".into(), name: "ghost".into() }).await.unwrap();
    mesh.await_plan("team", "dropped ghost", |p| !p.routes.iter().any(|r| r.name == "ghost")).await;
    let gone = api.get_route(egress::GetRouteRequest { project: "team".into(), name: "ghost".into() }).await;
    assert_eq!(gone.unwrap_err().code(), Code::NotFound);
    let again = api.delete_route(egress::DeleteRouteRequest { project: "team".into(), name: "ghost".into() }).await;
    assert_eq!(again.unwrap_err().code(), Code::NotFound);
    let missing = api.get_gateway(egress::GetGatewayRequest { project: "team".into(), name: "nope".into() }).await;
    assert_eq!(missing.unwrap_err().code(), Code::NotFound);
    let delete = api.delete_gateway(egress::DeleteGatewayRequest { project: "team".into(), name: "nope".into() }).await;
    assert_eq!(delete.unwrap_err().code(), Code::NotFound);
    mesh.cleanup().await;
}

async fn bad_declarations_are_refused_naming_the_field(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1"]).await;
    let mut api = mesh.egress();
    let refused = |status: tonic::Status, field: &str| {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(&format!("{field}:")), "{field} not named in {:?}", status.message());
    };

    let mut bad = gateway("team", "Default");
    refused(api.apply_gateway(bad.clone()).await.unwrap_err(), "name");
    bad = gateway("team", "default");
    bad.listeners[1].port = 3128;
    refused(api.apply_gateway(bad.clone()).await.unwrap_err(), "listeners[1].port");
    bad = gateway("team", "default");
    bad.listeners[1].name = "http".into();
    refused(api.apply_gateway(bad.clone()).await.unwrap_err(), "listeners[1].name");
    bad = gateway("team", "default");
    bad.listeners[0].protocol = 0;
    refused(api.apply_gateway(bad.clone()).await.unwrap_err(), "listeners[0].protocol");
    bad = gateway("team", "default");
    bad.listeners.clear();
    refused(api.apply_gateway(bad).await.unwrap_err(), "listeners");
    refused(api.apply_gateway(gateway("Team", "default")).await.unwrap_err(), "project");

    let mut bad = route("team", "r", "default", &["API.example.com"], &[]);
    refused(api.apply_route(bad.clone()).await.unwrap_err(), "hostnames[0]");
    bad = route("team", "r", "default", &["api.*.com"], &[]);
    refused(api.apply_route(bad.clone()).await.unwrap_err(), "hostnames[0]");
    bad = route("team", "r", "default", &["api.example.com"], &[0]);
    refused(api.apply_route(bad.clone()).await.unwrap_err(), "ports[0]");
    bad = route("team", "r", "default", &["api.example.com"], &[443, 443]);
    refused(api.apply_route(bad.clone()).await.unwrap_err(), "ports[1]");
    bad = route("team", "r", "default", &[], &[]);
    refused(api.apply_route(bad.clone()).await.unwrap_err(), "hostnames");
    bad = route("team", "r", "default", &["api.example.com"], &[]);
    bad.parent_refs.clear();
    refused(api.apply_route(bad.clone()).await.unwrap_err(), "parent_refs");
    bad = route("team", "r", "Default", &["api.example.com"], &[]);
    refused(api.apply_route(bad).await.unwrap_err(), "parent_refs[0].gateway");
    let get = api.get_route(egress::GetRouteRequest { project: "team".into(), name: "R".into() }).await;
    refused(get.unwrap_err(), "name");

    // Nothing refused was stored.
    let listed = api.list_gateways(egress::ListGatewaysRequest { project: "team".into() }).await.unwrap().into_inner();
    assert!(listed.gateways.is_empty());
    let plan = api.get_plan(egress::GetPlanRequest { project: "team".into() }).await;
    assert_eq!(plan.unwrap_err().code(), Code::NotFound, "no plan for a project with nothing in it");

    // Only admins declare; a service may read; a node may do neither.
    let as_node = mesh.egress_as(&Identity::node("n-1").unwrap()).apply_gateway(gateway("team", "default")).await;
    assert_eq!(as_node.unwrap_err().code(), Code::PermissionDenied);
    let mut as_service = mesh.egress_as(&Identity::service("revisions").unwrap());
    let write = as_service.apply_route(route("team", "r", "default", &["a.example.com"], &[])).await;
    assert_eq!(write.unwrap_err().code(), Code::PermissionDenied);
    let read = as_service.list_routes(egress::ListRoutesRequest { project: "team".into() }).await;
    assert!(read.is_ok(), "{read:?}");
    mesh.cleanup().await;
}

async fn a_plan_shows_what_each_service_may_reach(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1"]).await;
    mesh.apply_gateway(gateway("team", "default")).await;
    mesh.apply_route(route("team", "github", "default", &["github.com"], &[443])).await;
    mesh.apply_service("team", "web", None).await;
    let corp = revisions::EgressSelection { gateway: "corp".into(), disabled: false };
    mesh.apply_service("team", "batch", Some(corp)).await;
    let sealed = revisions::EgressSelection { gateway: String::new(), disabled: true };
    mesh.apply_service("team", "sealed", Some(sealed)).await;

    let (plan, passes) = mesh.await_plan("team", "listed three services", |p| p.services.len() == 3).await;
    assert_eq!(plan.project, "team");
    assert!(plan.generation >= 1 && plan.compiled_at.is_some());
    let names: Vec<&str> = plan.services.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(names, ["batch", "sealed", "web"]);
    let web = service(&plan, "web").unwrap();
    assert_eq!(web.gateway, "default");
    let allowed: Vec<(&str, &str, &[u32])> =
        web.allowed.iter().map(|d| (d.listener.as_str(), d.hostname.as_str(), d.ports.as_slice())).collect();
    assert_eq!(allowed, [("http", "github.com", &[443][..]), ("https", "github.com", &[443][..])]);
    let ready = web.condition.clone().unwrap();
    assert_eq!((ready.r#type.as_str(), ready.status), ("EgressReady", ConditionStatus::True as i32));
    assert_eq!(egress_reason(&plan, "batch").as_deref(), Some("GatewayNotFound"));
    assert_eq!(service(&plan, "batch").unwrap().condition.clone().unwrap().status, ConditionStatus::False as i32);
    assert_eq!(egress_reason(&plan, "sealed").as_deref(), Some("Disabled"));
    assert!(service(&plan, "sealed").unwrap().allowed.is_empty());
    assert!(passes.leading && passes.passes >= 1 && passes.events >= passes.passes);

    // The missing gateway appears: the service's egress resolves without touching it.
    mesh.apply_gateway(gateway("team", "corp")).await;
    mesh.apply_route(route("team", "corp-api", "corp", &["*.corp.example"], &[])).await;
    let (plan, _) =
        mesh.await_plan("team", "resolved batch", |p| egress_reason(p, "batch").as_deref() == Some("Accepted")).await;
    let batch = service(&plan, "batch").unwrap();
    assert_eq!(batch.gateway, "corp");
    assert!(batch.allowed.iter().all(|d| d.hostname == "*.corp.example"));

    // A deleted service leaves the plan.
    let request = revisions::DeleteServiceRequest { project: "team".into(), name: "sealed".into() };
    mesh.services().delete_service(request).await.unwrap();
    mesh.await_plan("team", "dropped sealed", |p| service(p, "sealed").is_none()).await;
    mesh.cleanup().await;
}

async fn the_live_revisions_selection_wins_over_the_template(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1"]).await;
    mesh.apply_gateway(gateway("team", "default")).await;
    mesh.apply_gateway(gateway("team", "corp")).await;
    mesh.apply_route(route("team", "everywhere", "default", &["*.example.com"], &[])).await;
    mesh.apply_route(route("team", "corp-only", "corp", &["*.corp.example"], &[])).await;
    let corp = revisions::EgressSelection { gateway: "corp".into(), disabled: false };
    let first = mesh.apply_service("team", "web", Some(corp)).await;
    assert_eq!(first.revision, "web-00001");
    let gateway_of = |plan: &egress::EgressPlan| service(plan, "web").map(|s| s.gateway.clone());
    mesh.await_plan("team", "sent web through corp", |p| gateway_of(p).as_deref() == Some("corp")).await;
    await_live(&mesh, "web", "web-00001").await;

    // Traffic pinned to the first revision: a template naming another
    // gateway mints a revision that does not serve, so nothing moves.
    let pin = revisions::SetTrafficRequest {
        project: "team".into(),
        name: "web".into(),
        pinned_revision: "web-00001".into(),
        ..Default::default()
    };
    mesh.services().set_traffic(pin).await.unwrap();
    let second = mesh.apply_service("team", "web", Some(revisions::EgressSelection::default())).await;
    assert_eq!(second.revision, "web-00002");
    // A later service in the same stream proves egress has seen web's change.
    mesh.apply_service("team", "marker", None).await;
    let (plan, _) = mesh.await_plan("team", "listed marker", |p| service(p, "marker").is_some()).await;
    assert_eq!(gateway_of(&plan).as_deref(), Some("corp"), "the live revision's selection, not the template's");

    // Unpinned, the new revision serves and its selection takes over.
    let unpin = revisions::SetTrafficRequest { project: "team".into(), name: "web".into(), ..Default::default() };
    mesh.services().set_traffic(unpin).await.unwrap();
    await_live(&mesh, "web", "web-00002").await;
    mesh.await_plan("team", "sent web through default", |p| gateway_of(p).as_deref() == Some("default")).await;
    mesh.cleanup().await;
}

async fn await_live(mesh: &Mesh, name: &str, revision: &str) {
    eventually(&format!("{revision} to go live"), PATIENCE, || async {
        let request = revisions::GetServiceRequest { project: "team".into(), name: name.into() };
        let service = mesh.services().get_service(request).await.unwrap().into_inner().service.unwrap();
        if service.status.as_ref().is_some_and(|s| s.live_revision == revision) { Ok(()) } else { Err(service) }
    })
    .await;
}

on_both_backends!(
    gateways_and_routes_round_trip_with_their_status,
    bad_declarations_are_refused_naming_the_field,
    a_plan_shows_what_each_service_may_reach,
    the_live_revisions_selection_wins_over_the_template,
);
