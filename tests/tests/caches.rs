//! A real agent, run as a process against the real control plane, killed
//! with SIGKILL while it seals a lease's cache view for publishing, then
//! started again: the volume's head is the old generation or the new one,
//! whole (its tree's digest is the one the ledger recorded), never part of
//! one; what the crash left half-written is swept, and the next lease
//! starts from the head and sees all of it.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use berth_e2e::{Isolation, Mesh, MeshOptions, MeshTimings, ServiceKind};
use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_proto::types::v1 as types;

/// Files of 4 MiB the second lease writes: enough that sealing them takes
/// long enough to be killed in the middle of.
const FILES: u32 = 192;

const PATIENCE: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs the machine to itself and the binaries built: make test-faults"]
async fn an_agent_killed_while_it_publishes_a_cache_view_leaves_the_head_whole() {
    if !berth_testkit::runs_as_root("a cache volume's contained runtime") {
        return;
    }
    let options = MeshOptions {
        replicas: 1,
        agents: 1,
        isolation: Isolation::Loopback,
        agent_egress: false,
        timings: MeshTimings { lease_ttl_secs: 20, ..MeshTimings::fast() },
        ..MeshOptions::default()
    };
    let mut mesh = Mesh::start(options).await.unwrap();
    let result = kill_mid_publish(&mut mesh).await;
    let shutdown = mesh.shutdown().await;
    result.unwrap();
    shutdown.unwrap();
}

async fn kill_mid_publish(mesh: &mut Mesh) -> anyhow::Result<()> {
    mesh.wait_agents_up().await?;
    let volume = mesh.dir().join("agents/0/caches/volumes/default/deps");

    // Generation 1: one small file.
    let one = request(mesh, "one", "echo one > /cache/marker").await?;
    let seen = settled(mesh, &one.lease_id).await?;
    anyhow::ensure!(seen.committed_generation == 1, "the first lease published nothing: {seen:?}");

    // The second writes a large view and is killed while the node seals it.
    let script = format!(
        "echo two > /cache/marker && i=0 && while [ $i -lt {FILES} ]; do \
         head -c 4194304 /dev/zero > /cache/f$i || exit 1; i=$((i+1)); done"
    );
    let two = request(mesh, "two", &script).await?;
    let staging = volume.join("staging").join(&two.lease_id);
    let started = Instant::now();
    loop {
        let copied = std::fs::read_dir(&staging).map(Iterator::count).unwrap_or(0);
        if copied >= 8 {
            break;
        }
        anyhow::ensure!(started.elapsed() < PATIENCE, "the node never started sealing lease two's view");
        anyhow::ensure!(
            lease(mesh, &two.lease_id).await?.cache.first().is_none_or(|seen| seen.committed_generation == 0),
            "lease two was published before the agent could be killed mid-seal"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    mesh.agent_mut(0)?.kill().await?;
    let left = std::fs::read_dir(&staging).map(Iterator::count).unwrap_or(0);
    anyhow::ensure!(left < FILES as usize + 1, "the seal was already whole when the agent was killed");
    anyhow::ensure!(
        lease(mesh, &two.lease_id).await?.cache.first().is_none_or(|seen| seen.committed_generation == 0),
        "the kill came after the publish"
    );

    mesh.agent_mut(0)?.start()?;
    mesh.wait_agents_up().await?;

    // The head is generation 1 or 2, and whole; nothing half-sealed stays.
    let head = wait_for("the crash's leftovers to be swept", || async {
        let pending = std::fs::read_dir(volume.join("staging")).map(Iterator::count).unwrap_or(0);
        let head = cache_head(mesh).await?;
        Ok((pending == 0).then_some(head))
    })
    .await?;
    anyhow::ensure!(matches!(head.generation, 1 | 2), "the head is generation {}", head.generation);
    let tree = volume.join("sealed").join(head.digest.strip_prefix("sha256:").unwrap());
    let resealed = reseal(&tree)?;
    anyhow::ensure!(resealed == head.digest, "the head's tree digests to {resealed}, the ledger says {}", head.digest);
    for sealed in std::fs::read_dir(volume.join("sealed"))? {
        let path = sealed?.path();
        if path.is_dir() {
            let name = format!("sha256:{}", path.file_name().unwrap().to_string_lossy());
            anyhow::ensure!(reseal(&path)? == name, "sealed tree {} is not whole", path.display());
        }
    }

    // The next lease sees all of the head it starts from: the marker and
    // no large file, or the marker and every one. The recovered agent may
    // still publish lease two's view after the sweep, so which head that is
    // is read from the lease itself; the content it saw goes into the
    // generation it publishes, to be read back from the sealed tree.
    let check = format!(
        "n=0; for f in /cache/f*; do [ -f \"$f\" ] && [ $(wc -c < \"$f\") -eq 4194304 ] && n=$((n+1)); done; \
         seen=\"$(cat /cache/marker) $n\"; [ \"$seen\" = \"one 0\" ] || [ \"$seen\" = \"two {FILES}\" ] || exit 1; \
         echo \"$seen\" > /cache/seen"
    );
    let three = request(mesh, "three", &check).await?;
    let done = phase(mesh, &three.lease_id).await?;
    anyhow::ensure!(done.phase() == LeasePhase::Done, "the next lease saw a generation in part: {done:?}");
    let seen = settled(mesh, &three.lease_id).await?;
    let base = seen.base_generation;
    anyhow::ensure!(
        base >= head.generation && matches!(base, 1 | 2) && seen.committed_generation == base + 1,
        "the next lease started from {base} (the head was {} after the sweep) and published {}",
        head.generation,
        seen.committed_generation
    );
    let after = cache_head(mesh).await?;
    anyhow::ensure!(after.generation == base + 1, "the head is {} after the next lease", after.generation);
    let tree = volume.join("sealed").join(after.digest.strip_prefix("sha256:").unwrap());
    let saw = std::fs::read_to_string(tree.join("seen"))?;
    let expected = if base == 2 { format!("two {FILES}") } else { "one 0".to_owned() };
    anyhow::ensure!(saw.trim() == expected, "the next lease started from generation {base} and saw '{}'", saw.trim());
    eprintln!(
        "killed mid-seal: the head is generation {} after the restart, whole; the next lease started from {base}",
        head.generation
    );
    Ok(())
}

/// The digest a node's seal gives `tree`, sealed afresh elsewhere.
fn reseal(tree: &Path) -> anyhow::Result<String> {
    let scratch = tempfile::tempdir()?;
    let volumes = berth_agent::CacheVolumes::new(scratch.path());
    let view = berth_agent::View {
        key: "deps".into(),
        inside: PathBuf::from("/cache"),
        merged: tree.to_path_buf(),
        lower: PathBuf::new(),
        upper: PathBuf::new(),
        base_generation: 0,
        based: true,
        commit: 0,
    };
    Ok(volumes.seal("check", "default", &view)?.digest)
}

async fn request(mesh: &Mesh, key: &str, script: &str) -> anyhow::Result<leases::Lease> {
    let workload = leases::Workload {
        command: "sh".into(),
        args: vec!["-c".into(), script.into()],
        cache: vec![types::CacheMount { key: "deps".into(), path: "/cache".into(), commit: 0 }],
        ..Default::default()
    };
    let request = leases::RequestLeaseRequest {
        owner: "tests/caches".into(),
        idempotency_key: key.into(),
        resources: Some(types::Capacity { cpu_millis: 250, memory_bytes: 128 << 20 }),
        workload: Some(workload),
        ..Default::default()
    };
    let mut client = LeasesClient::new(mesh.channel(ServiceKind::Leases)?);
    Ok(client.request_lease(request).await?.into_inner().lease.unwrap())
}

async fn lease(mesh: &Mesh, lease_id: &str) -> anyhow::Result<leases::Lease> {
    let mut client = LeasesClient::new(mesh.channel(ServiceKind::Leases)?);
    let request = leases::GetLeaseRequest { lease_id: lease_id.into() };
    Ok(client.get_lease(request).await?.into_inner().lease.unwrap())
}

async fn phase(mesh: &Mesh, lease_id: &str) -> anyhow::Result<leases::Lease> {
    wait_for("the lease to end", || async {
        let lease = lease(mesh, lease_id).await?;
        Ok(matches!(lease.phase(), LeasePhase::Done | LeasePhase::Failed).then_some(lease))
    })
    .await
}

async fn settled(mesh: &Mesh, lease_id: &str) -> anyhow::Result<leases::CacheObservation> {
    wait_for("the lease's cache view to settle", || async {
        let lease = lease(mesh, lease_id).await?;
        Ok(lease.cache.first().filter(|seen| seen.committed_generation > 0 || !seen.reason.is_empty()).cloned())
    })
    .await
}

async fn cache_head(mesh: &Mesh) -> anyhow::Result<leases::CacheGeneration> {
    let mut client = leases::caches_client::CachesClient::new(mesh.channel(ServiceKind::Leases)?);
    let request = leases::GetCacheRequest { project: String::new(), key: "deps".into() };
    Ok(client.get_cache(request).await?.into_inner().volume.and_then(|volume| volume.head).unwrap_or_default())
}

async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let started = Instant::now();
    loop {
        let last = match check().await {
            Ok(Some(found)) => return Ok(found),
            Ok(None) => String::new(),
            Err(error) => error.to_string(),
        };
        anyhow::ensure!(started.elapsed() < PATIENCE, "waited {PATIENCE:?} for {what}; last error: {last}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
