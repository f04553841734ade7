//! Revision GC as a user sees it: under a burst of concurrent applies it
//! keeps the live revision, the pinned one and the newest N others, and
//! nothing else.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::Duration;

use berth_proto::revisions::v1;
use berth_testkit::{PATIENCE, eventually};
use support::{Backend, Plane, apply_request, fast_config, pinned_reference};
use tonic::Code;

/// Applies until the answer is final: a client retries what the server calls transient.
async fn apply(mut client: v1::services_client::ServicesClient<berth_rpc::Channel>, version: String) -> String {
    for attempt in 1..=10 {
        let request = apply_request("web", &pinned_reference(), 0, &[("VERSION", &version)]);
        match client.apply_service(request).await {
            Ok(response) => return response.into_inner().revision,
            Err(status) if matches!(status.code(), Code::Aborted | Code::Unavailable) => {
                tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
            }
            Err(status) => panic!("apply {version}: {status:?}"),
        }
    }
    panic!("apply {version} kept colliding");
}

/// Waits until the service's revisions are exactly `expected`, newest first.
async fn await_revisions(plane: &Plane, expected: &[&str]) {
    eventually(&format!("web's revisions to be {expected:?}"), PATIENCE, || async {
        let names = plane.revision_names("web").await;
        if names == expected { Ok(()) } else { Err(names) }
    })
    .await;
}

async fn gc_keeps_exactly_the_live_the_pinned_and_the_newest_n(backend: Backend) {
    let config = berth_revisions::RevisionsConfig { gc_keep: 3, ..fast_config() };
    let mut plane = Plane::start(backend, config, &["n-1"]).await;
    plane.add_replica().await;

    // Ten applies at once through two replicas, while the reconciler rolls
    // each newest revision out and collects behind it.
    let applies: Vec<_> = (0..10).map(|n| tokio::spawn(apply(plane.services_on(n % 2), format!("v{n}")))).collect();
    let mut minted = Vec::new();
    for applied in applies {
        minted.push(applied.await.unwrap());
    }
    minted.sort();
    let expected: Vec<String> = (1..=10).map(|g| format!("web-{g:05}")).collect();
    assert_eq!(minted, expected, "every apply minted its own generation");

    plane.await_live("web", "web-00010").await;
    await_revisions(&plane, &["web-00010", "web-00009", "web-00008", "web-00007"]).await;

    // Pin an old one: it is live, and kept while three newer ones are minted.
    let pin = v1::SetTrafficRequest { name: "web".into(), pinned_revision: "web-00007".into(), ..Default::default() };
    plane.services().set_traffic(pin).await.unwrap();
    plane.await_live("web", "web-00007").await;
    let applies: Vec<_> = (10..13).map(|n| tokio::spawn(apply(plane.services_on(n % 2), format!("v{n}")))).collect();
    for applied in applies {
        applied.await.unwrap();
    }
    await_revisions(&plane, &["web-00013", "web-00012", "web-00011", "web-00007"]).await;
    // Settled: another full pass collects nothing more.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(plane.revision_names("web").await, ["web-00013", "web-00012", "web-00011", "web-00007"]);
    let service = plane.get("web").await;
    assert_eq!(service.status.unwrap().live_revision, "web-00007");
    plane.cleanup().await;
}

on_both_backends!(gc_keeps_exactly_the_live_the_pinned_and_the_newest_n);
