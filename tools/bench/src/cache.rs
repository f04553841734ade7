//! `berth-bench cache`: what a cache volume adds to a launch and what
//! publishing a view costs, on the node's own code, beside baselines taken
//! in the same run; and how often placement puts a volume's next lease where
//! its head is, on simulated nodes.
//!
//! # What it measures
//! A volume of `--volume-mib` MiB (files of 4 MiB of random bytes) is sealed
//! and recorded as generation 1 in a data directory of the run's own.
//! - **launch**: `Provider::launch` of `sleep` under the chosen runtime,
//!   with no volume (the baseline), and with the volume's view mounted for
//!   it first (the overlay of the sealed generation and the bind into the
//!   workload's root): request → workload running, each destroyed (and its
//!   view closed) before the next, the two kinds interleaved.
//! - **publish**: a view of the volume, `--changed-mib` MiB of it rewritten,
//!   sealed as the next generation would be (what changed copied and
//!   digested, the rest linked); beside it, the same view sealed with
//!   nothing of it known, every byte copied and digested, which is what a
//!   seal without the previous tree's file digests costs.
//! - **push and fetch**: with a cache registry (`docker-registry` on
//!   loopback), the first generation pushed whole; each published view then
//!   pushed as the node does after its seal (one layer of what changed over
//!   the base's layers), so "publish" is seal + push; and the head fetched
//!   by a node that does not hold it (pull, unpack, digest check), beside
//!   the whole volume's first push.
//! - **placement**: `--nodes` simulated nodes under random load, and one
//!   key used every minute for `--minutes` minutes: each lease is placed by
//!   the ledger's placement with the nodes holding the head preferred, the
//!   node it lands on then seals the next head and the volume's follower
//!   (the node that held the head it grew from) fetches it; the hit rate is
//!   the share placed on a node holding the head.
//!
//! Targets: a warm volume adds at most 100 ms to a launch, p99; publishing
//! a view that changed 10 MiB of a 1 GiB volume takes at most 1 s; the hit
//! rate is at least 90%.

use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use berth_agent::{
    CacheBind, CacheVolumes, ContainerProvider, ContainerSettings, ProcessTiming, Provider, Transfer, UidRange, View,
};
use berth_bundle::testing::TestRegistry;
use berth_bundle::{BundleClient, RegistryConfig};
use berth_proto::identity::v1::NodeState;
use berth_proto::leases::v1::{CacheGeneration, CacheRegistry};
use berth_proto::types::v1::{CacheCommit, CacheMount};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::dev::Series;
use crate::output::{OutputFormat, print_report, progress};
use crate::runtime_launch::{BenchRuntime, sleep_spec};

/// A warm volume may add at most this to a launch, p99, ms.
const TARGET_MOUNT_ADDED_P99_MS: f64 = 100.0;
/// Publishing a view that changed 10 MiB of 1 GiB may take at most this, ms.
const TARGET_PUBLISH_MS: f64 = 1000.0;
/// Placement keeps at least this share of a key's leases where its head is.
const TARGET_HIT_RATE: f64 = 0.90;

/// Each file of the volume.
const FILE_BYTES: usize = 4 << 20;

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct CacheArgs {
    /// Launches timed with the volume, and as many without.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    launches: u32,
    /// Views published.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    publishes: u32,
    /// The volume's size, MiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(4..=65_536))]
    volume_mib: u32,
    /// Fetches of the head by a node without it.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    fetches: u32,
    /// What each published view rewrote, MiB.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=65_536))]
    changed_mib: u32,
    /// The runtime launches go through.
    #[arg(long, value_enum, default_value_t = BenchRuntime::Runc)]
    runtime: BenchRuntime,
    /// Simulated nodes for the placement figure.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    nodes: u32,
    /// Minutes simulated, one lease of the key each.
    #[arg(long, default_value_t = 1440, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    minutes: u32,
    /// The most of a simulated node other leases take, percent; each
    /// node's share is drawn uniformly up to it every minute.
    #[arg(long, default_value_t = 95, value_parser = clap::value_parser!(u32).range(0..=100))]
    busy_max: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

#[derive(Debug, Serialize)]
struct Report {
    scenario: &'static str,
    runtime: &'static str,
    volume_bytes: u64,
    changed_bytes: u64,
    launch_without: Series,
    launch_with: Series,
    mount_added_p99_ms: Option<f64>,
    publish: Series,
    /// The same publishes, the push to the registry alone.
    publish_push: Series,
    publish_full_copy: Series,
    /// The volume's first generation pushed whole, ms.
    first_push_ms: f64,
    /// The head fetched by a node without it, each.
    fetch: Series,
    placement_nodes: u32,
    placement_leases: u32,
    placement_busy_max_percent: u32,
    placement_hit_rate: f64,
    /// The share of leases for which no node holding the head had room:
    /// the misses placement could not avoid.
    placement_head_full_rate: f64,
    target_mount_added_p99_ms: f64,
    target_publish_ms: f64,
    target_hit_rate: f64,
}

pub(crate) async fn run(args: CacheArgs) -> Result<(), String> {
    let oci = args.runtime.oci().ok_or("the cache scenario needs a runtime that contains (not uncontained)")?;
    if !rustix::process::geteuid().is_root() {
        return Err("mounting views and running containers needs root".into());
    }
    let binary = oci.binary().ok_or_else(|| format!("{} is not installed (make test installs it)", oci.name()))?;
    let dir = tempfile::tempdir().map_err(|e| format!("cannot make a directory: {e}"))?;
    let volumes = CacheVolumes::new(dir.path());
    progress(&format!("writing and sealing a {} MiB volume", args.volume_mib));
    let seed = dir.path().join("seed");
    let files = usize::try_from(args.volume_mib).unwrap_or(usize::MAX).div_ceil(4);
    write_files(&seed, files).map_err(|e| format!("cannot write the volume: {e}"))?;
    let sealed = volumes.seal("seed", "bench", &plain_view(&seed)).map_err(|e| e.to_string())?;
    volumes.record("bench", "deps", 1, &sealed.digest).map_err(|e| e.to_string())?;
    let head = CacheGeneration {
        project: "bench".into(),
        key: "deps".into(),
        generation: 1,
        digest: sealed.digest.clone(),
        ..Default::default()
    };
    let mount = CacheMount { key: "deps".into(), path: "/cache".into(), commit: CacheCommit::OnSuccess as i32 };

    progress(&format!("{} launches under {} with the volume and without, interleaved", args.launches, oci.name()));
    let stop = CancellationToken::new();
    let timing = ProcessTiming { stop_grace: Duration::from_secs(2), exit_poll: Duration::from_millis(50) };
    let settings = ContainerSettings::new(oci, binary, UidRange { first: 310_000, count: 1000 }, timing);
    let provider = ContainerProvider::new(dir.path(), settings, stop.clone());
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for index in 0..args.launches {
        for cached in [false, true] {
            let lease_id = format!("bench-{index}-{}", u8::from(cached));
            let sent = Instant::now();
            let mut spec = sleep_spec(&lease_id);
            if cached {
                let view = volumes.open_view(&lease_id, &mount, &head, true).map_err(|e| e.to_string())?;
                spec.caches.push(CacheBind { host: view.merged, inside: view.inside });
            }
            let launched = provider.launch(spec).await.map_err(|e| format!("launch {lease_id}: {e}"))?;
            let took = sent.elapsed().as_secs_f64() * 1000.0;
            if launched.record.pid.is_none() {
                return Err(format!("launch {lease_id} did not start"));
            }
            if cached {
                with.push(took)
            } else {
                without.push(took)
            }
            let _ = provider.destroy(&lease_id).await;
            let _ = provider.remove(&lease_id).await;
            volumes.close_views(&lease_id).map_err(|e| e.to_string())?;
        }
    }
    stop.cancel();

    progress("pushing the volume whole to a registry on loopback");
    let registry_process = TestRegistry::start().await.map_err(|e| format!("cannot start the registry: {e}"))?;
    let registry =
        CacheRegistry { repository: format!("{}/berth-caches/bench", registry_process.host()), ..Default::default() };
    let client = BundleClient::new(RegistryConfig::default()).map_err(|e| e.to_string())?;
    let seed_view = volumes
        .open_view("seed", &mount, &CacheGeneration { generation: 0, ..head.clone() }, true)
        .map_err(|e| e.to_string())?;
    let sent = Instant::now();
    let first = Transfer { volumes: &volumes, client: &client, registry: &registry, lease_id: "seed" }
        .push("bench", &seed_view, &CacheGeneration::default(), &sealed)
        .await
        .map_err(|e| e.to_string())?;
    let first_push_ms = sent.elapsed().as_secs_f64() * 1000.0;
    volumes.close_views("seed").map_err(|e| e.to_string())?;
    let head = CacheGeneration { artifact: first.to_string(), ..head };

    progress(&format!("{} views published, {} MiB changed in each", args.publishes, args.changed_mib));
    let changed_files = usize::try_from(args.changed_mib).unwrap_or(usize::MAX).div_ceil(4).min(files);
    let (mut publish, mut pushes, mut full) = (Vec::new(), Vec::new(), Vec::new());
    for index in 0..args.publishes {
        let lease_id = format!("publish-{index}");
        let view = volumes.open_view(&lease_id, &mount, &head, true).map_err(|e| e.to_string())?;
        rewrite(&view.merged, changed_files).map_err(|e| format!("cannot write into the view: {e}"))?;
        let sent = Instant::now();
        let sealed = volumes.seal(&lease_id, "bench", &view).map_err(|e| e.to_string())?;
        let pushing = Instant::now();
        Transfer { volumes: &volumes, client: &client, registry: &registry, lease_id: &lease_id }
            .push("bench", &view, &head, &sealed)
            .await
            .map_err(|e| e.to_string())?;
        pushes.push(pushing.elapsed().as_secs_f64() * 1000.0);
        publish.push(sent.elapsed().as_secs_f64() * 1000.0);
        // The same view, as if nothing of it were known: every byte read and written.
        let unknown = View { lower: Path::new("/nonexistent").to_path_buf(), ..view };
        let sent = Instant::now();
        volumes.seal(&format!("{lease_id}-full"), "bench-full", &unknown).map_err(|e| e.to_string())?;
        full.push(sent.elapsed().as_secs_f64() * 1000.0);
        volumes.close_views(&lease_id).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_dir_all(dir.path().join("caches/volumes/bench-full"));
    }

    progress(&format!("the head fetched {} times by a node without it", args.fetches));
    let mut fetches = Vec::new();
    for index in 0..args.fetches {
        let cold = tempfile::tempdir().map_err(|e| format!("cannot make a directory: {e}"))?;
        let elsewhere = CacheVolumes::new(cold.path());
        let lease_id = format!("fetch-{index}");
        let sent = Instant::now();
        Transfer { volumes: &elsewhere, client: &client, registry: &registry, lease_id: &lease_id }
            .fetch(&head, None)
            .await
            .map_err(|e| e.to_string())?;
        fetches.push(sent.elapsed().as_secs_f64() * 1000.0);
        if elsewhere.held("bench", "deps") != [1] {
            return Err("the fetched head is not held".into());
        }
    }
    drop(registry_process);

    progress(&format!("{} minutes of one key on {} simulated nodes", args.minutes, args.nodes));
    let (hit_rate, head_full_rate) = placement_hit_rate(args.nodes, args.minutes, args.busy_max);

    let (launch_without, launch_with) = (Series::of(without), Series::of(with));
    let report = Report {
        scenario: "cache",
        runtime: oci.name(),
        volume_bytes: sealed.size_bytes,
        changed_bytes: u64::try_from(changed_files * FILE_BYTES).unwrap_or(u64::MAX),
        mount_added_p99_ms: launch_with.p99_ms.zip(launch_without.p99_ms).map(|(with, without)| with - without),
        launch_without,
        launch_with,
        publish: Series::of(publish),
        publish_push: Series::of(pushes),
        publish_full_copy: Series::of(full),
        first_push_ms,
        fetch: Series::of(fetches),
        placement_nodes: args.nodes,
        placement_leases: args.minutes,
        placement_busy_max_percent: args.busy_max,
        placement_hit_rate: hit_rate,
        placement_head_full_rate: head_full_rate,
        target_mount_added_p99_ms: TARGET_MOUNT_ADDED_P99_MS,
        target_publish_ms: TARGET_PUBLISH_MS,
        target_hit_rate: TARGET_HIT_RATE,
    };
    print_report(args.output, &report, table)
}

fn table(report: &Report) -> String {
    let mut out = Series::table(
        &format!(
            "cache volumes: a {} MiB volume under {}, {} MiB changed per publish",
            report.volume_bytes >> 20,
            report.runtime,
            report.changed_bytes >> 20
        ),
        &[
            ("launch, no volume (baseline)", &report.launch_without),
            ("launch, warm volume mounted", &report.launch_with),
            ("publish (seal + push of the change)", &report.publish),
            ("  of which the push", &report.publish_push),
            ("seal of every byte (baseline)", &report.publish_full_copy),
            ("fetch of the head, node without it", &report.fetch),
        ],
    );
    let added = report.mount_added_p99_ms.map_or_else(|| "-".to_string(), |ms| format!("{ms:.1} ms"));
    out.push_str(&format!(
        "volume added to a launch, p99: {added} (target <= {} ms)\n",
        report.target_mount_added_p99_ms
    ));
    out.push_str(&format!("publish p99 target: <= {} ms\n", report.target_publish_ms));
    out.push_str(&format!("first push of the whole volume: {:.1} ms\n", report.first_push_ms));
    out.push_str(&format!(
        "placement beside the head: {:.1}% of {} leases on {} nodes each up to {}% busy (target >= {:.0}%); \
         no node holding the head had room for {:.1}%\n",
        report.placement_hit_rate * 100.0,
        report.placement_leases,
        report.placement_nodes,
        report.placement_busy_max_percent,
        report.target_hit_rate * 100.0,
        report.placement_head_full_rate * 100.0
    ));
    out
}

/// A directory sealed as it is, with nothing known of it.
fn plain_view(dir: &Path) -> View {
    View {
        key: "deps".into(),
        inside: "/cache".into(),
        merged: dir.to_path_buf(),
        lower: Path::new("/nonexistent").to_path_buf(),
        upper: Path::new("/nonexistent").to_path_buf(),
        base_generation: 0,
        based: true,
        commit: 0,
    }
}

/// `count` files of [`FILE_BYTES`] random bytes under `dir/data`.
fn write_files(dir: &Path, count: usize) -> std::io::Result<()> {
    std::fs::create_dir_all(dir.join("data"))?;
    rewrite(dir, count)
}

/// Writes the first `count` files of `dir/data` anew with random bytes
/// (incompressible, different every time).
fn rewrite(dir: &Path, count: usize) -> std::io::Result<()> {
    use rand::RngCore as _;
    let mut bytes = vec![0_u8; FILE_BYTES];
    for index in 0..count {
        rand::rng().fill_bytes(&mut bytes);
        std::fs::File::create(dir.join("data").join(format!("{index:05}.bin")))?.write_all(&bytes)?;
    }
    Ok(())
}

/// The share of `minutes` leases of one key placed on a node holding its
/// head, and the share for which no node holding it had room, on `nodes`
/// nodes of 4 cores and 8 GiB whose other leases take a uniformly drawn
/// 0 to `busy_max`% of each every minute (a fixed seed: the same run, the
/// same figure). A lease of 1 core and 2 GiB; the node it lands on seals
/// the next head, and the ledger's follower rule names the node holding
/// the head's base (when another) to fetch it, which it does within the
/// minute (`FollowCaches` every 10 s; a fetch of a whole 1 GiB volume
/// takes about 10 s here).
fn placement_hit_rate(nodes: u32, minutes: u32, busy_max: u32) -> (f64, f64) {
    use berth_leases::{PlacementNode, PlacementRequest, Resources as Capacity, place};
    let total = Capacity::new(4000, 8 << 30);
    let ask = Capacity::new(1000, 2 << 30);
    let mut state: u64 = 0x5EED;
    let mut roll = |below: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % below
    };
    let (mut sealer, mut follower): (Option<String>, Option<String>) = (None, None);
    let (mut hits, mut head_full) = (0_u32, 0_u32);
    for _ in 0..minutes {
        let fleet: Vec<PlacementNode> = (0..nodes)
            .map(|n| {
                let mut node = PlacementNode::new(format!("n-{n:03}"), "", NodeState::Up, total);
                let busy = roll(u64::from(busy_max) + 1);
                node.allocated = Capacity::new(total.cpu_millis * busy / 100, total.memory_bytes / 100 * busy);
                node
            })
            .collect();
        let holders: Vec<String> = sealer.iter().chain(follower.iter()).cloned().collect();
        let request = PlacementRequest {
            resources: ask,
            tier: String::new(),
            spread_group: String::new(),
            runtime: Default::default(),
            warm_nodes: holders.clone(),
        };
        let room = |id: &String| fleet.iter().any(|node| node.node_id == *id && node.free().holds(ask));
        if !holders.is_empty() && !holders.iter().any(room) {
            head_full += 1;
        }
        let plan = place(&fleet, &[request]);
        let Some(node) = plan.placements[0].node_id().map(str::to_owned) else { continue };
        if holders.contains(&node) {
            hits += 1;
        }
        // As the ledger names the follower when the lease publishes over the head.
        follower = match sealer.take() {
            Some(base_sealer) if base_sealer != node => Some(base_sealer),
            _ => follower.filter(|follower| *follower != node),
        };
        sealer = Some(node);
    }
    // The first lease has no head to land beside.
    let leases = f64::from(minutes.saturating_sub(1).max(1));
    (f64::from(hits) / leases, f64::from(head_full) / leases)
}
