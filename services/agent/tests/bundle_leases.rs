//! Bundle leases end to end: `examples/hello` pushed to a real registry
//! (Debian's `docker-registry` on loopback) or to an OCI layout directory, a
//! lease of it asked for through the real leases service, and the agent
//! pulling it by digest, running it on a port of its own and showing that
//! port in ListInstances, where an HTTP client reaches it.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_bundle::testing::TestRegistry;
use berth_bundle::{BundleClient, BundleReference, Digest, PackedBundle, RegistryConfig, RegistryCredentials};
use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::types::v1 as types;
use berth_testkit::eventually;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use common::*;

fn hello_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/hello")
}

/// Packs `examples/hello` and pushes it to `reference`; its digest.
async fn push_hello(reference: &str) -> Digest {
    let packed = PackedBundle::from_dir(&hello_dir()).unwrap();
    let client = BundleClient::new(RegistryConfig::default()).unwrap();
    let reference = BundleReference::parse(reference).unwrap();
    client.push(&packed, &reference, &RegistryCredentials::Anonymous).await.unwrap()
}

/// Pushes `examples/hello` into the OCI layout `layout`; its digest, and
/// the repository (`oci:DIR`) that holds it.
async fn push_hello_to_layout(layout: &Path) -> (Digest, String) {
    let digest = push_hello(&format!("oci:{}:hello", layout.display())).await;
    (digest, format!("oci:{}", layout.display()))
}

/// A replica of revision `revision` of the hello service, running the
/// bundle `digest` of `repository` (`host:port/repo` or `oci:DIR`).
fn hello(repository: &str, digest: &Digest, revision: &str) -> leases::Workload {
    leases::Workload {
        bundle: Some(types::BundleRef { reference: format!("{repository}@{digest}"), ..Default::default() }),
        digest: digest.to_string(),
        service: "hello".into(),
        revision: revision.into(),
        ports: vec![types::Port { name: "http".into(), port: 8080 }],
        ..Default::default()
    }
}

/// `GET path` from 127.0.0.1:`port`: the status code and the body.
async fn get(port: u32, path: &str) -> std::io::Result<(u16, String)> {
    let port = u16::try_from(port).map_err(std::io::Error::other)?;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    tokio::time::timeout(SLOW, stream.read_to_end(&mut response)).await??;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response.split_once("\r\n\r\n").ok_or_else(|| std::io::Error::other("no HTTP response"))?;
    let status = head.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

/// What `GET path` answers once the workload listens.
async fn answer(port: u32, path: &str) -> (u16, String) {
    eventually(&format!("something to answer on port {port}"), SLOW, || get(port, path)).await
}

/// The processes working in `dir` (every workload of an agent on that data
/// directory works in a directory under it).
fn processes_in(dir: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let cwd = std::fs::read_link(entry.path().join("cwd")).ok()?;
            cwd.starts_with(dir).then_some(pid)
        })
        .filter(|pid| start_ticks(*pid).is_some())
        .collect()
}

/// The environment process `pid` started with.
fn environment(pid: u32) -> Vec<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    environ.split(|b| *b == 0).filter(|v| !v.is_empty()).map(|v| String::from_utf8_lossy(v).into_owned()).collect()
}

#[tokio::test]
async fn a_bundle_from_a_registry_answers_on_its_port_and_later_leases_of_it_run_from_the_cache() {
    let mut registry = TestRegistry::start().await.unwrap();
    let digest = push_hello(&registry.reference("hello:v1")).await;
    let repository = registry.reference("hello");
    let (plane, _dir, agent) = plane_with_agent(Duration::from_secs(5)).await;

    let lease = plane.request_workload("hello-1", hello(&repository, &digest, "hello-00001")).await;
    let instance = agent.started(&plane, &lease.lease_id).await;
    assert_eq!(instance.digest, digest.to_string());
    assert_eq!((instance.service.as_str(), instance.revision.as_str()), ("hello", "hello-00001"));
    assert_ne!(instance.port, 0, "{instance:?}");
    assert_eq!(answer(instance.port, "/").await, (200, "hello from hello-00001\n".to_string()));
    assert_eq!(answer(instance.port, "/healthz").await, (200, "ok\n".to_string()));

    plane.release(&lease.lease_id).await;
    gone_until(instance.pid).await;
    assert!(get(instance.port, "/").await.is_err(), "something still answers on the released port");

    // With the registry gone, two replicas of the same bundle still start:
    // the node has it, and this tenant fetched it before.
    registry.stop();
    let mut replicas = Vec::new();
    for key in ["hello-2a", "hello-2b"] {
        let lease = plane.request_workload(key, hello(&repository, &digest, "hello-00002")).await;
        replicas.push(lease.lease_id);
    }
    let mut ports = Vec::new();
    for lease_id in &replicas {
        let instance = agent.started(&plane, lease_id).await;
        assert_eq!(answer(instance.port, "/").await, (200, "hello from hello-00002\n".to_string()));
        ports.push((instance.port, instance.pid));
    }
    assert_ne!(ports[0].0, ports[1].0, "two replicas on one node share a port");

    for lease_id in &replicas {
        plane.release(lease_id).await;
    }
    for (_, pid) in ports {
        gone_until(pid).await;
    }
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_lease_of_a_digest_the_registry_does_not_have_fails_naming_it_and_runs_nothing() {
    let registry = TestRegistry::start().await.unwrap();
    push_hello(&registry.reference("hello:v1")).await;
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let node_id = agent.handle.node_id();

    let missing = Digest::of(b"a manifest no one pushed");
    let lease = plane.request_workload("missing", hello(&registry.reference("hello"), &missing, "hello-00001")).await;
    let failed = plane.phase_until(&lease.lease_id, LeasePhase::Failed).await;
    assert_eq!(failed.reason, "BundleNotFound", "{failed:?}");
    assert!(failed.message.contains(&missing.to_string()), "the message names the digest: {failed:?}");
    let instance = agent.instance_until(&plane, &lease.lease_id, "failed", |i| i.reason == "BundleNotFound").await;
    assert_eq!((instance.pid, instance.port), (0, 0), "{instance:?}");
    assert!(processes_in(dir.path()).is_empty(), "something runs for a lease that failed");
    assert_eq!(plane.node_capacity(&node_id).await.leases, 0, "the capacity is returned");

    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_bundle_from_an_oci_layout_runs_with_no_registry_in_its_own_directory() {
    let layout = TestDir::new();
    let (digest, repository) = push_hello_to_layout(layout.path()).await;
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;

    let lease = plane.request_workload("layout", hello(&repository, &digest, "hello-00007")).await;
    let instance = agent.started(&plane, &lease.lease_id).await;
    assert_eq!(answer(instance.port, "/").await, (200, "hello from hello-00007\n".to_string()));

    // The workload works in its lease's own directory, which is all it sees
    // of the agent's data directory (contained, at /berth/work), with the
    // bundle's settings, its bundle at /berth/bundle, and its port.
    let cwd = std::fs::read_link(format!("/proc/{}/cwd", instance.pid)).unwrap();
    assert_eq!(cwd, std::path::Path::new("/berth/work"), "works in {}", cwd.display());
    assert!(dir.path().join("leases").join(&lease.lease_id).is_dir());
    let env = environment(instance.pid);
    for expected in [
        "BERTH_BUNDLE_DIR=/berth/bundle".to_string(),
        format!("PORT={}", instance.port),
        format!("BERTH_PORT_HTTP={}", instance.port),
        format!("BERTH_BUNDLE_DIGEST={digest}"),
        "PYTHONUNBUFFERED=1".to_string(),
        "BERTH_REVISION=hello-00007".to_string(),
    ] {
        assert!(env.contains(&expected), "{expected} missing from {env:?}");
    }

    plane.release(&lease.lease_id).await;
    gone_until(instance.pid).await;
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn an_adopted_bundle_workload_keeps_its_port_across_an_agent_restart() {
    let layout = TestDir::new();
    let (digest, repository) = push_hello_to_layout(layout.path()).await;
    let (plane, dir, first) = plane_with_agent(Duration::from_secs(5)).await;

    let lease = plane.request_workload("kept", hello(&repository, &digest, "hello-00001")).await;
    let before = first.started(&plane, &lease.lease_id).await;
    assert_eq!(answer(before.port, "/").await.0, 200);
    first.kill().await;

    let second = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let adopted = second.instance_until(&plane, &lease.lease_id, "adopted", |i| i.epoch > before.epoch).await;
    assert_eq!((adopted.pid, adopted.port), (before.pid, before.port), "the same process on the same port");
    assert_eq!(adopted.digest, digest.to_string());
    assert_eq!(answer(adopted.port, "/").await, (200, "hello from hello-00001\n".to_string()));

    // A replica started after the restart gets a port of its own.
    let next = plane.request_workload("next", hello(&repository, &digest, "hello-00001")).await;
    let started = second.started(&plane, &next.lease_id).await;
    assert_ne!(started.port, adopted.port);
    assert_eq!(answer(started.port, "/").await.0, 200);

    for (lease_id, pid) in [(&lease.lease_id, adopted.pid), (&next.lease_id, started.pid)] {
        plane.release(lease_id).await;
        gone_until(pid).await;
    }
    second.kill().await;
    plane.cleanup().await;
}
