//! `WatchEgress` and `AckEgress` as node agents see them, with node
//! certificates over real mTLS: each node gets the whole plan of exactly the
//! tenants it hosts, with a generation that only grows; a reconnecting node
//! gets the current state first; acks show in the plan's `node_acks`; and a
//! node acts only on its own id.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::{Duration, Instant};

use berth_proto::egress::v1 as egress;
use berth_testkit::PATIENCE;
use support::{Backend, Mesh, fast_config, gateway, route};
use tonic::Code;

/// One node's open `WatchEgress` stream and everything it received.
struct Watch {
    node_id: String,
    stream: tonic::Streaming<egress::NodeEgressState>,
    received: Vec<egress::NodeEgressState>,
}

impl Watch {
    async fn open(mesh: &Mesh, node_id: &str) -> Self {
        let request = egress::WatchEgressRequest { node_id: node_id.to_owned() };
        let stream = mesh.node(node_id).watch_egress(request).await.unwrap().into_inner();
        Self { node_id: node_id.to_owned(), stream, received: Vec::new() }
    }

    /// The next state, within `wait`.
    async fn next(&mut self, wait: Duration) -> Option<egress::NodeEgressState> {
        let state = tokio::time::timeout(wait, self.stream.message()).await.ok()?.unwrap()?;
        self.received.push(state.clone());
        Some(state)
    }

    /// Reads states until one satisfies `check`.
    async fn until(&mut self, what: &str, check: impl Fn(&egress::NodeEgressState) -> bool) -> egress::NodeEgressState {
        let started = Instant::now();
        if let Some(last) = self.received.last()
            && check(last)
        {
            return last.clone();
        }
        loop {
            let left = PATIENCE.saturating_sub(started.elapsed());
            match self.next(left).await {
                Some(state) if check(&state) => return state,
                Some(_) => {}
                None => panic!("node {} never received a state that {what}: {:#?}", self.node_id, self.received),
            }
        }
    }

    /// Every project any received state named.
    fn projects_ever_sent(&self) -> Vec<String> {
        let mut projects: Vec<String> =
            self.received.iter().flat_map(|s| s.plans.iter().map(|p| p.project.clone())).collect();
        projects.sort();
        projects.dedup();
        projects
    }

    fn generations(&self) -> Vec<u64> {
        self.received.iter().map(|s| s.generation).collect()
    }
}

fn projects(state: &egress::NodeEgressState) -> Vec<&str> {
    state.plans.iter().map(|p| p.project.as_str()).collect()
}

fn plan_generation_of(state: &egress::NodeEgressState, project: &str) -> Option<u64> {
    state.plans.iter().find(|p| p.project == project).map(|p| p.generation)
}

fn strictly_growing(generations: &[u64]) -> bool {
    generations.windows(2).all(|w| w[0] < w[1])
}

async fn each_node_gets_only_the_plans_of_the_tenants_it_hosts(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1", "n-2", "n-3"]).await;
    for project in ["alpha", "beta"] {
        mesh.apply_gateway(gateway(project, "default")).await;
        mesh.apply_route(route(project, "api", "default", &[&format!("api.{project}.example")], &[443])).await;
    }
    mesh.apply_service("alpha", "web", None).await;
    mesh.apply_service("beta", "api", None).await;
    mesh.await_plan("alpha", "listed web", |p| p.services.len() == 1).await;
    mesh.await_plan("beta", "listed api", |p| p.services.len() == 1).await;

    let mut one = Watch::open(&mesh, "n-1").await;
    let mut two = Watch::open(&mesh, "n-2").await;
    let mut three = Watch::open(&mesh, "n-3").await;
    let first = three.next(PATIENCE).await.unwrap();
    assert_eq!((first.generation, first.plans.len()), (0, 0), "a node sent nothing yet gets generation 0, empty");

    mesh.place("alpha", "web", "n-1").await;
    let beta_lease = mesh.place("beta", "api", "n-2").await;
    let state = one.until("holds alpha's plan", |s| projects(s) == ["alpha"]).await;
    let plan = &state.plans[0];
    assert!(plan.generation >= 1 && plan.node_acks.is_empty());
    assert_eq!(plan.services.iter().map(|s| s.service.as_str()).collect::<Vec<_>>(), ["web"]);
    assert_eq!(plan.services[0].allowed[0].hostname, "api.alpha.example");
    two.until("holds beta's plan", |s| projects(s) == ["beta"]).await;

    // A tenant's plan changes: only the nodes hosting it hear of it.
    let before = plan_generation_of(&state, "alpha").unwrap();
    mesh.apply_route(route("alpha", "api", "default", &["api.alpha.example"], &[8443])).await;
    let changed = one.until("carries alpha's new plan", |s| plan_generation_of(s, "alpha") > Some(before)).await;
    assert!(changed.generation > state.generation);
    assert_eq!(changed.plans[0].services[0].allowed[0].ports, [8443]);

    // A second tenant lands on n-2, then leaves it again.
    let alpha_on_two = mesh.place("alpha", "web", "n-2").await;
    two.until("holds both plans", |s| projects(s) == ["alpha", "beta"]).await;
    mesh.release(&alpha_on_two.lease_id).await;
    two.until("holds beta's alone again", |s| projects(s) == ["beta"]).await;
    mesh.release(&beta_lease.lease_id).await;
    two.until("holds nothing", |s| s.plans.is_empty()).await;

    // n-3 hosts nothing: whatever it was sent, no tenant's plan was in it.
    while three.next(Duration::from_millis(300)).await.is_some() {}
    assert!(three.projects_ever_sent().is_empty(), "n-3 was sent {:?}", three.projects_ever_sent());
    assert!(!one.projects_ever_sent().contains(&"beta".to_owned()), "n-1 never hosted beta");
    for watch in [&one, &two, &three] {
        assert!(strictly_growing(&watch.generations()), "{}: {:?}", watch.node_id, watch.generations());
    }
    mesh.cleanup().await;
}

async fn a_reconnecting_node_gets_the_current_state_first_and_acks_show_in_the_plan(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1", "n-2"]).await;
    mesh.apply_gateway(gateway("alpha", "default")).await;
    mesh.apply_route(route("alpha", "api", "default", &["api.example.com"], &[443])).await;
    mesh.apply_service("alpha", "web", None).await;
    mesh.place("alpha", "web", "n-1").await;
    mesh.place("alpha", "web", "n-2").await;

    // Before any ack, both hosting nodes lag.
    let (plan, _) = mesh
        .await_plan("alpha", "listed web and both nodes", |p| p.services.len() == 1 && p.node_acks.len() == 2)
        .await;
    let plan_generation = plan.generation;
    let mut one = Watch::open(&mesh, "n-1").await;
    let state = one.until("holds alpha's plan", |s| plan_generation_of(s, "alpha") == Some(plan_generation)).await;
    let acks: Vec<(&str, u64)> = plan.node_acks.iter().map(|a| (a.node_id.as_str(), a.generation)).collect();
    assert_eq!(acks, [("n-1", 0), ("n-2", 0)]);

    let ack = egress::AckEgressRequest {
        node_id: "n-1".into(),
        generation: state.generation,
        error: String::new(),
        enforcement: egress::EgressEnforcement::Isolated as i32,
    };
    mesh.node("n-1").ack_egress(ack).await.unwrap();
    let (plan, _) =
        mesh.await_plan("alpha", "showed n-1's ack", |p| p.node_acks[0].generation == plan_generation).await;
    let n1 = &plan.node_acks[0];
    assert!(n1.acked_at.is_some() && n1.error.is_empty());
    assert_eq!(n1.enforcement, egress::EgressEnforcement::Isolated as i32);
    assert_eq!((plan.node_acks[1].node_id.as_str(), plan.node_acks[1].generation), ("n-2", 0), "n-2 still lags");

    // Reconnecting (as after an agent restart) yields the current state at once, unchanged.
    drop(one);
    let mut again = Watch::open(&mesh, "n-1").await;
    let first = again.next(PATIENCE).await.unwrap();
    assert_eq!(first.generation, state.generation);
    assert_eq!(first.plans, state.plans);

    // An ack reporting failure is shown; the applied generation stays.
    let failed = egress::AckEgressRequest {
        node_id: "n-1".into(),
        generation: state.generation,
        error: "port 3128 is in use".into(),
        ..Default::default()
    };
    mesh.node("n-1").ack_egress(failed).await.unwrap();
    let (plan, _) = mesh.await_plan("alpha", "showed n-1's error", |p| !p.node_acks[0].error.is_empty()).await;
    assert_eq!(plan.node_acks[0].error, "port 3128 is in use");
    assert_eq!(plan.node_acks[0].generation, plan_generation);

    // A generation never sent is refused; an old one changes nothing.
    let ahead = egress::AckEgressRequest {
        node_id: "n-1".into(),
        generation: state.generation + 10,
        error: String::new(),
        ..Default::default()
    };
    let status = mesh.node("n-1").ack_egress(ahead).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("generation"), "{}", status.message());
    let stale =
        egress::AckEgressRequest { node_id: "n-1".into(), generation: 0, error: String::new(), ..Default::default() };
    mesh.node("n-1").ack_egress(stale).await.unwrap();
    let (plan, _) = mesh.plan("alpha").await.unwrap();
    assert_eq!(plan.node_acks[0].error, "port 3128 is in use", "an older ack does not overwrite a newer one");
    mesh.cleanup().await;
}

async fn a_node_acts_only_on_its_own_id(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1", "n-2"]).await;
    let request = egress::WatchEgressRequest { node_id: "n-2".into() };
    let status = mesh.node("n-1").watch_egress(request).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("n-1") && status.message().contains("n-2"), "{}", status.message());
    let ack =
        egress::AckEgressRequest { node_id: "n-2".into(), generation: 0, error: String::new(), ..Default::default() };
    assert_eq!(mesh.node("n-1").ack_egress(ack).await.unwrap_err().code(), Code::PermissionDenied);

    let as_admin = mesh.egress().get_plan(egress::GetPlanRequest { project: "alpha".into() }).await;
    assert_eq!(as_admin.unwrap_err().code(), Code::NotFound, "admins read plans");
    let mut admin_node = egress::node_egress_client::NodeEgressClient::new(
        berth_rpc::connect(&mesh.replicas[0].addr.to_string(), admin_credentials(&mesh)).unwrap(),
    );
    let refused = admin_node.watch_egress(egress::WatchEgressRequest { node_id: "n-1".into() }).await;
    assert_eq!(refused.unwrap_err().code(), Code::PermissionDenied, "only nodes watch");
    mesh.cleanup().await;
}

fn admin_credentials(mesh: &Mesh) -> berth_mtls::TlsCredentials {
    mesh.credentials_for(&berth_core::Identity::admin("alice").unwrap())
}

fn dns_of<'a>(state: &'a egress::NodeEgressState, project: &str) -> Option<&'a egress::DnsConfig> {
    state.plans.iter().find(|p| p.project == project)?.dns.as_ref()
}

async fn a_dns_config_is_stored_canonical_and_pushed_with_the_plan_of_its_project(backend: Backend) {
    let mesh = Mesh::start(backend, fast_config(), &["n-1"]).await;
    let mut api = mesh.egress();
    let missing = api.get_dns_config(egress::GetDnsConfigRequest { project: "team".into() }).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert!(missing.message().contains("no DNS config was applied to project team"), "{}", missing.message());

    mesh.apply_gateway(gateway("team", "default")).await;
    mesh.apply_service("team", "web", None).await;
    mesh.await_plan("team", "listed web", |p| p.services.len() == 1).await;
    let mut node = Watch::open(&mesh, "n-1").await;
    mesh.place("team", "web", "n-1").await;
    let state = node.until("holds team's plan", |s| projects(s) == ["team"]).await;
    let default = egress::DnsConfig { ndots: Some(1), ..Default::default() };
    assert_eq!(dns_of(&state, "team"), Some(&default), "the default until one is applied");

    let spec = egress::DnsConfig {
        upstreams: vec!["10.0.0.53".into(), "[fd00::53]:5353".into()],
        search: vec!["corp.example.".into(), "svc.corp.example".into()],
        ndots: Some(2),
    };
    let apply = || egress::ApplyDnsConfigRequest { project: "team".into(), spec: Some(spec.clone()) };
    let applied = api.apply_dns_config(apply()).await.unwrap().into_inner().dns_config.unwrap();
    let canonical = egress::DnsConfig {
        upstreams: vec!["10.0.0.53:53".into(), "[fd00::53]:5353".into()],
        search: vec!["corp.example".into(), "svc.corp.example".into()],
        ndots: Some(2),
    };
    assert_eq!((applied.project.as_str(), applied.generation), ("team", 1));
    assert_eq!(applied.spec.as_ref(), Some(&canonical));
    let again = api.apply_dns_config(apply()).await.unwrap().into_inner().dns_config.unwrap();
    assert_eq!(again.generation, 1, "the same config again changes nothing");
    let got = api.get_dns_config(egress::GetDnsConfigRequest { project: "team".into() }).await.unwrap();
    assert_eq!(got.into_inner().dns_config.unwrap(), applied);

    // Pushed whole with the project's plan, to the node hosting it.
    let before = plan_generation_of(&state, "team").unwrap();
    let pushed = node.until("carries team's DNS config", |s| dns_of(s, "team") == Some(&canonical)).await;
    assert!(plan_generation_of(&pushed, "team").unwrap() > before && pushed.generation > state.generation);
    let (plan, _) = mesh.await_plan("team", "the DNS config", |p| p.dns.as_ref() == Some(&canonical)).await;
    assert_eq!(plan.services.len(), 1, "the rest of the plan is as it was");

    // A bad config names every bad field and changes nothing stored.
    let bad = egress::DnsConfig {
        upstreams: vec!["resolver.example".into(), "10.0.0.1:0".into(), "1.1.1.1".into(), "1.1.1.1:53".into()],
        search: vec!["Corp_Example".into()],
        ndots: Some(16),
    };
    let request = egress::ApplyDnsConfigRequest { project: "team".into(), spec: Some(bad) };
    let refused = api.apply_dns_config(request).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    for field in [
        "spec.upstreams:",
        "spec.upstreams[0]:",
        "spec.upstreams[1]:",
        "spec.upstreams[3]:",
        "spec.search[0]:",
        "spec.ndots:",
    ] {
        assert!(refused.message().contains(field), "{field} not named in {}", refused.message());
    }
    let kept = api.get_dns_config(egress::GetDnsConfigRequest { project: "team".into() }).await.unwrap();
    assert_eq!(kept.into_inner().dns_config.unwrap(), applied);
    let as_node = mesh.egress_as(&berth_core::Identity::node("n-1").unwrap()).apply_dns_config(apply()).await;
    assert_eq!(as_node.unwrap_err().code(), Code::PermissionDenied);
    mesh.cleanup().await;
}

on_both_backends!(
    a_dns_config_is_stored_canonical_and_pushed_with_the_plan_of_its_project,
    each_node_gets_only_the_plans_of_the_tenants_it_hosts,
    a_reconnecting_node_gets_the_current_state_first_and_acks_show_in_the_plan,
    a_node_acts_only_on_its_own_id,
);
