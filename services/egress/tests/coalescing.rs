//! A burst of edits costs a handful of full passes, not one each: the pass
//! counters `GetPlan` shows say how many ran, and the plan still ends at the
//! last edit.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::{Duration, Instant};

use berth_egress::EgressConfig;
use support::{Backend, Mesh, fast_config, gateway, route};

/// Edits in the burst.
const EDITS: u32 = 1000;

/// Clients sending them at once.
const CLIENTS: u32 = 8;

fn burst_config() -> EgressConfig {
    EgressConfig {
        debounce: berth_egress::DEFAULT_DEBOUNCE,
        max_delay: berth_egress::DEFAULT_MAX_DELAY,
        ..fast_config()
    }
}

fn ports_of(plan: &berth_proto::egress::v1::EgressPlan, name: &str) -> Option<Vec<u32>> {
    plan.routes.iter().find(|r| r.name == name).map(|r| r.ports.clone())
}

async fn a_thousand_route_edits_cost_a_handful_of_passes(backend: Backend) {
    let config = burst_config();
    let mesh = Mesh::start(backend, config.clone(), &["n-1"]).await;
    mesh.apply_service("burst", "web", None).await;
    mesh.apply_gateway(gateway("burst", "default")).await;
    mesh.apply_route(route("burst", "api", "default", &["api.example.com"], &[1])).await;
    let (before, counted) =
        mesh.await_plan("burst", "compiled the first edit", |p| ports_of(p, "api") == Some(vec![1])).await;
    // Let the first edits' passes finish before counting.
    tokio::time::sleep(config.max_delay).await;
    let counted = mesh.plan("burst").await.map_or(counted, |(_, passes)| passes);

    // The burst: every edit but the last from CLIENTS clients at once, then the last one.
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..CLIENTS {
        let mut api = mesh.egress();
        clients.spawn(async move {
            for n in (client..EDITS - 1).step_by(CLIENTS as usize) {
                let edit = route("burst", "api", "default", &["api.example.com"], &[1000 + n]);
                api.apply_route(edit).await.unwrap();
            }
        });
    }
    while let Some(done) = clients.join_next().await {
        done.unwrap();
    }
    let last_edit = route("burst", "api", "default", &["api.example.com"], &[1000 + EDITS - 1]);
    mesh.egress().apply_route(last_edit).await.unwrap();
    let burst = started.elapsed();
    let last = vec![1000 + EDITS - 1];
    let (after, _) =
        mesh.await_plan("burst", "reached the last edit", |p| ports_of(p, "api") == Some(last.clone())).await;
    tokio::time::sleep(config.max_delay).await;
    let (settled, passes) = mesh.plan("burst").await.unwrap();
    assert_eq!(ports_of(&settled, "api"), Some(last), "the plan ends at the last edit");
    let web = settled.services.iter().find(|s| s.service == "web").unwrap();
    assert!(web.allowed.iter().all(|d| d.ports == [1000 + EDITS - 1]), "and so does what the service may reach");

    let ran = passes.passes - counted.passes;
    let seen = passes.events - counted.events;
    // Without a pause, a pass runs at most every max_delay, plus one at the start and one after the end.
    let bound = burst.as_millis() / config.max_delay.as_millis() + 2;
    eprintln!(
        "{EDITS} edits in {burst:?}: {seen} events, {ran} passes (bound {bound}), generation {} -> {}",
        before.generation, after.generation
    );
    assert!(seen >= u64::from(EDITS), "every edit was an event: {seen}");
    assert!(u128::from(ran) <= bound, "{ran} passes for {EDITS} edits in {burst:?}; at most {bound} expected");
    assert!(ran <= u64::from(EDITS / 50), "a handful of passes, not {ran}");
    assert!(after.generation - before.generation <= ran, "the generation grows only with passes that changed the plan");
    assert!(settled.generation == after.generation, "no pass after the last edit changed anything");
    mesh.cleanup().await;
}

async fn a_resync_that_compiles_nothing_new_writes_nothing(backend: Backend) {
    let config = EgressConfig { full_resync: Duration::from_millis(200), ..fast_config() };
    let mesh = Mesh::start(backend, config, &["n-1"]).await;
    mesh.apply_service("quiet", "web", None).await;
    mesh.apply_gateway(gateway("quiet", "default")).await;
    mesh.apply_route(route("quiet", "api", "default", &["api.example.com"], &[443])).await;
    mesh.await_plan("quiet", "listed web", |p| p.services.len() == 1 && p.routes.len() == 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (before, counted) = mesh.plan("quiet").await.unwrap();

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (after, passes) = mesh.plan("quiet").await.unwrap();
    assert!(passes.passes >= counted.passes + 3, "resyncs ran: {counted:?} -> {passes:?}");
    assert_eq!(passes.changes, counted.changes, "none of them changed the plan");
    assert_eq!(after.generation, before.generation, "so its generation stayed");
    assert_eq!(after.compiled_at, before.compiled_at, "and it was not written again");
    assert_eq!(after.gateways, before.gateways, "nor were the statuses, transition times included");
    assert_eq!(after.routes, before.routes);
    mesh.cleanup().await;
}

on_both_backends!(a_thousand_route_edits_cost_a_handful_of_passes, a_resync_that_compiles_nothing_new_writes_nothing);
