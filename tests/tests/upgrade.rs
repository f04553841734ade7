//! A fleet upgrade of real agents, run as processes against the real
//! control plane, with the agent artifacts in a real registry
//! (`docker-registry`): `UpgradeNodes` rolls a new build out over two
//! nodes running a service's three replicas (canary first), the replicas
//! keep their processes, and every node reports the new build; an artifact
//! whose agent exits at once is rolled back within the deadline, the node
//! back on the build it ran, and the rollout paused naming why; an
//! artifact with no agent in it fails on the node, saying so.
//!
//! The "new build" is the agent binary with bytes appended, which runs the
//! same and has another SHA-256, so another build version
//! (`<crate version>+<12 hex digits of the binary's SHA-256>`).

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use berth_bundle::testing::TestRegistry;
use berth_bundle::{BundleClient, BundleReference, PackedBundle, RegistryConfig, RegistryCredentials};
use berth_e2e::invariants::{self, ResidentService};
use berth_e2e::{Isolation, Mesh, MeshOptions, MeshTimings, ServiceKind, workloads};
use berth_proto::identity::v1 as identity_v1;

const WEB: &str = "web";
const REPLICAS: u32 = 3;

/// How long the new agent has to report in before it is rolled back.
const UPGRADE_DEADLINE: &str = "15s";

/// How long a rollout may take here.
const ROLLOUT_PATIENCE: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs the machine to itself and the binaries built: make test-faults"]
async fn a_fleet_upgrade_keeps_every_workload_and_a_broken_agent_is_rolled_back() {
    let registry = TestRegistry::start().await.unwrap();
    let options = MeshOptions {
        replicas: 1,
        agents: 2,
        isolation: Isolation::Loopback,
        agent_egress: false,
        // Room for two agent restarts inside a lease's life.
        timings: MeshTimings { lease_ttl_secs: 20, ..MeshTimings::fast() },
        env: vec![("BERTH_UPGRADE_DEADLINE".into(), UPGRADE_DEADLINE.into())],
        ..MeshOptions::default()
    };
    let mut mesh = Mesh::start(options).await.unwrap();
    let result = upgrade_the_fleet(&mesh, &registry).await;
    for pid in upgraded_agents(&mesh) {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap(),
            rustix::process::Signal::TERM,
        );
    }
    let shutdown = mesh.shutdown().await;
    result.unwrap();
    shutdown.unwrap();
}

async fn upgrade_the_fleet(mesh: &Mesh, registry: &TestRegistry) -> anyhow::Result<()> {
    let bundle = berth_e2e::bundles::push_sleeper(&mesh.dir().join("oci"), "sleeper").await?;
    berth_e2e::bundles::deploy(mesh, WEB, &bundle, REPLICAS).await?;
    let services = vec![ResidentService { name: WEB.into(), replicas: REPLICAS }];
    let (_, unsettled) = invariants::wait_settled(mesh, &services, Duration::from_secs(120)).await?;
    anyhow::ensure!(unsettled.is_empty(), "{WEB} never ran its replicas: {unsettled:?}");
    let before = running(mesh);
    anyhow::ensure!(before.len() == REPLICAS as usize, "{before:?}");
    let old_version = versions(mesh).await?;

    // A new build: every node is upgraded, canary first, and no workload
    // so much as restarts.
    let artifacts = tempfile::Builder::new().prefix("berth-e2e-agent-").tempdir()?;
    let current = berth_e2e::binaries::binary("berth-agent")?;
    let new_build = artifacts.path().join("new");
    std::fs::create_dir_all(&new_build)?;
    let mut bytes = std::fs::read(&current)?;
    bytes.extend_from_slice(b"\nberth e2e: another build of the same agent\n");
    write_executable(&new_build.join("berth-agent"), &bytes)?;
    let new_version = said_version(&new_build.join("berth-agent"))?;
    anyhow::ensure!(old_version.values().all(|v| *v != new_version), "{old_version:?} vs {new_version}");
    let next = push_agent(registry, &new_build, "berth/agent:next").await?;
    let upgrade = start_upgrade(
        mesh,
        identity_v1::UpgradeNodesRequest { all: true, to: next, max_unavailable: 1, canary: 1, ..Default::default() },
    )
    .await?;
    let done = wait_until_settled(mesh, &upgrade).await?;
    eprintln!(
        "upgrade: {} {:?}, nodes {:?}",
        done.upgrade_id,
        done.state(),
        done.nodes.iter().map(|n| (&n.node_id, n.state(), &n.version)).collect::<Vec<_>>()
    );
    anyhow::ensure!(done.state() == identity_v1::UpgradeState::Done, "{done:#?}");
    for node in &done.nodes {
        anyhow::ensure!(node.state() == identity_v1::NodeUpgradeState::Succeeded, "{done:#?}");
        anyhow::ensure!(node.version == new_version, "{done:#?}");
    }
    let now = versions(mesh).await?;
    anyhow::ensure!(now.values().all(|v| *v == new_version), "nodes report {now:?}, not {new_version}");
    anyhow::ensure!(running(mesh) == before, "workloads changed: {before:?} became {:?}", running(mesh));

    // A build that exits at once: rolled back, the node on the new build
    // again, the rollout paused saying why.
    let broken = artifacts.path().join("broken");
    std::fs::create_dir_all(&broken)?;
    let script = "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'berth-agent 9.9.9+broken'; exit 0; fi\nexit 3\n";
    write_executable(&broken.join("berth-agent"), script.as_bytes())?;
    let broken_ref = push_agent(registry, &broken, "berth/agent:broken").await?;
    let node_id = done.nodes[0].node_id.clone();
    let upgrade = start_upgrade(
        mesh,
        identity_v1::UpgradeNodesRequest { node_ids: vec![node_id.clone()], to: broken_ref, ..Default::default() },
    )
    .await?;
    let paused = wait_until_settled(mesh, &upgrade).await?;
    eprintln!("upgrade: {} {:?}: {}", paused.upgrade_id, paused.state(), paused.reason);
    anyhow::ensure!(paused.state() == identity_v1::UpgradeState::Paused, "{paused:#?}");
    let failed = &paused.nodes[0];
    anyhow::ensure!(failed.state() == identity_v1::NodeUpgradeState::Failed, "{paused:#?}");
    anyhow::ensure!(failed.reason.contains("rolled back"), "{paused:#?}");
    anyhow::ensure!(paused.reason.contains(&node_id), "{paused:#?}");
    let node = get_node(mesh, &node_id).await?;
    anyhow::ensure!(node.version == new_version, "after the rollback: {node:#?}");
    anyhow::ensure!(node.state() == identity_v1::NodeState::Up, "after the rollback: {node:#?}");
    anyhow::ensure!(running(mesh) == before, "workloads changed through the rollback");

    // An artifact with no agent in it fails on the node, which says why.
    let empty = artifacts.path().join("empty");
    std::fs::create_dir_all(&empty)?;
    write_executable(&empty.join("not-an-agent"), b"#!/bin/sh\nexit 0\n")?;
    std::fs::write(empty.join(berth_bundle::SPEC_FILE), "entrypoint = \"not-an-agent\"\n")?;
    let empty_ref = push_dir(registry, &empty, "berth/agent:empty").await?;
    let upgrade = start_upgrade(
        mesh,
        identity_v1::UpgradeNodesRequest { node_ids: vec![node_id.clone()], to: empty_ref, ..Default::default() },
    )
    .await?;
    let refused = wait_until_settled(mesh, &upgrade).await?;
    eprintln!("upgrade: {} {:?}: {}", refused.upgrade_id, refused.state(), refused.reason);
    anyhow::ensure!(refused.nodes[0].reason.contains("holds no berth-agent"), "{refused:#?}");
    anyhow::ensure!(running(mesh) == before, "workloads changed through a failed upgrade");
    Ok(())
}

/// The workloads of the run, with their start times: the same set means
/// no workload was restarted or replaced.
fn running(mesh: &Mesh) -> Vec<(u32, u64, String)> {
    let mut found: Vec<_> =
        workloads::scan(mesh.run_id()).into_iter().map(|w| (w.pid, w.start_time, w.lease_id)).collect();
    found.sort();
    found
}

/// Every node's version, by node id.
async fn versions(mesh: &Mesh) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut nodes = identity_v1::nodes_client::NodesClient::new(mesh.channel(ServiceKind::Identity)?);
    let listed = nodes.list_nodes(identity_v1::ListNodesRequest::default()).await?.into_inner();
    Ok(listed.nodes.into_iter().map(|n| (n.node_id, n.version)).collect())
}

async fn get_node(mesh: &Mesh, node_id: &str) -> anyhow::Result<identity_v1::Node> {
    let mut nodes = identity_v1::nodes_client::NodesClient::new(mesh.channel(ServiceKind::Identity)?);
    let request = identity_v1::GetNodeRequest { node_id: node_id.to_owned() };
    nodes.get_node(request).await?.into_inner().node.context("GetNode answered no node")
}

async fn start_upgrade(mesh: &Mesh, request: identity_v1::UpgradeNodesRequest) -> anyhow::Result<identity_v1::Upgrade> {
    let mut nodes = identity_v1::nodes_client::NodesClient::new(mesh.channel(ServiceKind::Identity)?);
    nodes.upgrade_nodes(request).await?.into_inner().upgrade.context("UpgradeNodes answered no upgrade")
}

/// Polls the rollout until it is no longer running.
async fn wait_until_settled(mesh: &Mesh, upgrade: &identity_v1::Upgrade) -> anyhow::Result<identity_v1::Upgrade> {
    let mut nodes = identity_v1::nodes_client::NodesClient::new(mesh.channel(ServiceKind::Identity)?);
    let started = Instant::now();
    loop {
        let request = identity_v1::GetUpgradeRequest { upgrade_id: upgrade.upgrade_id.clone() };
        let now = nodes.get_upgrade(request).await?.into_inner().upgrade.context("no upgrade")?;
        if now.state() != identity_v1::UpgradeState::Running {
            return Ok(now);
        }
        if started.elapsed() > ROLLOUT_PATIENCE {
            let logs: Vec<String> = (0..mesh.agents().len())
                .map(|i| {
                    let dir = mesh.dir().join(format!("agents/{i}"));
                    let tail = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
                    format!("agent {i} updater.log:\n{}\nagent.log:\n{}", tail("updater.log"), tail("agent.log"))
                })
                .collect();
            anyhow::bail!("the rollout still runs after {ROLLOUT_PATIENCE:?}: {now:#?}\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The pids of the agents an updater started (each data directory's last report).
fn upgraded_agents(mesh: &Mesh) -> Vec<u32> {
    (0..mesh.agents().len())
        .filter_map(|i| {
            let said = std::fs::read_to_string(mesh.dir().join(format!("agents/{i}/reported-version"))).ok()?;
            said.split_whitespace().nth(1)?.parse().ok()
        })
        .filter(|pid| mesh.agents().iter().all(|agent| agent.pid() != Some(*pid)))
        .collect()
}

fn write_executable(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, bytes)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// What `binary --version` says, its last word.
fn said_version(binary: &Path) -> anyhow::Result<String> {
    let output = std::process::Command::new(binary).arg("--version").output()?;
    let said = String::from_utf8(output.stdout)?;
    said.split_whitespace().last().map(str::to_owned).context("--version said nothing")
}

/// Pushes `dir` (holding `berth-agent`) as an agent artifact; its reference.
async fn push_agent(registry: &TestRegistry, dir: &Path, name: &str) -> anyhow::Result<String> {
    std::fs::write(dir.join(berth_bundle::SPEC_FILE), "entrypoint = \"berth-agent\"\nargs = [\"--version\"]\n")?;
    push_dir(registry, dir, name).await
}

async fn push_dir(registry: &TestRegistry, dir: &Path, name: &str) -> anyhow::Result<String> {
    let owned: PathBuf = dir.to_path_buf();
    let bundle = tokio::task::spawn_blocking(move || PackedBundle::from_dir(&owned)).await??;
    let reference = registry.reference(name);
    let parsed = BundleReference::parse(&reference)?;
    BundleClient::new(RegistryConfig::default())?.push(&bundle, &parsed, &RegistryCredentials::default()).await?;
    Ok(reference)
}
