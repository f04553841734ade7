//! `berth-bench mirror`: what a registry mirror that fails costs a pull,
//! beside the same pull with no mirror, in one run.
//!
//! # What it measures
//! A real registry (`docker-registry`, [`TestRegistry`]) on a loopback port
//! holds one bundle of `--bundle-mib` random MiB. Each timed pull is what a
//! node and the control plane do for a deploy: resolve the tag, then pull
//! the bundle by digest into a fresh cache (manifest, config, layer, all
//! verified, unpacked). It is timed on three paths, the paths interleaved
//! round by round so that other work on the machine weighs on each alike:
//! - **direct**: no mirror configured, the baseline;
//! - **refusing**: a mirror configured where nothing listens (connections
//!   refused at once);
//! - **silent**: a mirror that accepts connections and never answers, so
//!   a request to it waits out the mirror read timeout
//!   ([`berth_bundle::MIRROR_READ_TIMEOUT`]); `--silent-pulls` of them, as
//!   each costs seconds.
//!
//! Each path has a client of its own, made anew for every pull: a client
//! leaves a mirror that failed out of its next operations for a while
//! ([`berth_bundle::MIRROR_RETRY_AFTER`]), and what is measured here is
//! what a mirror's failure costs when it is first met.
//!
//! The target is judged on the refusing path: a mirror that refuses
//! connections adds at most 2 s to a pull (p99 over direct).

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::{Duration, Instant};

use berth_bundle::{
    BundleCache, BundleClient, BundleReference, CacheOptions, RegistryConfig, RegistryCredentials, RegistryMirror,
};
use serde::Serialize;

use crate::deploy::{DeployBenchError, push_bundles};
use crate::dev::Series;
use crate::egress::ms;
use crate::output::{OutputFormat, print_report, progress};

/// A mirror that refuses connections may add at most this to a pull, p99, ms.
const TARGET_REFUSING_ADDED_MS: f64 = 2000.0;

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct MirrorArgs {
    /// Pulls timed on the direct and the refusing paths.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pulls: u32,
    /// Pulls timed through a mirror that never answers (each waits out its timeouts).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=100))]
    silent_pulls: u32,
    /// The bundle's random payload, MiB.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=1024))]
    bundle_mib: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

/// Why the scenario could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MirrorBenchError {
    #[error(transparent)]
    Setup(#[from] DeployBenchError),
    #[error("a pull on the {path} path failed: {detail}")]
    Pull { path: &'static str, detail: String },
    #[error("{0}")]
    Other(String),
}

#[derive(Debug, Serialize)]
struct Report {
    scenario: &'static str,
    bundle_bytes: u64,
    direct: Series,
    refusing: Series,
    silent: Series,
    refusing_added_p99_ms: Option<f64>,
    silent_added_p50_ms: Option<f64>,
    target_refusing_added_ms: f64,
    met: bool,
}

pub(crate) async fn run(args: MirrorArgs) -> Result<(), MirrorBenchError> {
    let work = tempfile::Builder::new().prefix("berth-bench-mirror-").tempdir().map_err(other)?;
    let bundles = push_bundles(work.path(), 1, args.bundle_mib).await?;
    let reference = BundleReference::parse(&bundles.reference("b0")).map_err(other)?;
    let origin = bundles.registry.host();

    // Nothing listens where the refusing mirror is.
    let refusing = TcpListener::bind("127.0.0.1:0").map_err(other)?.local_addr().map_err(other)?;
    let silent = silent_listener().map_err(other)?;
    let through = |mirror: Option<SocketAddr>| {
        let mirrors =
            mirror.map(|m| RegistryMirror { origin: origin.clone(), mirror: m.to_string(), send_credentials: false });
        BundleClient::new(RegistryConfig { mirrors: mirrors.into_iter().collect(), ..RegistryConfig::default() })
            .map_err(other)
    };
    let paths = [("direct", None), ("refusing", Some(refusing)), ("silent", Some(silent))];

    progress(&format!(
        "{} pulls per path ({} through the silent mirror), one at a time",
        args.pulls, args.silent_pulls
    ));
    let mut samples: [Vec<f64>; 3] = Default::default();
    // One untimed pull per path first.
    for round in 0..=args.pulls {
        for (index, (name, mirror)) in paths.iter().enumerate() {
            if *name == "silent" && round > args.silent_pulls {
                continue;
            }
            let took = pull(&through(*mirror)?, &reference, work.path())
                .await
                .map_err(|detail| MirrorBenchError::Pull { path: name, detail })?;
            if round > 0 {
                samples[index].push(ms(took));
            }
        }
    }
    let [direct, refusing, silent] = samples.map(Series::of);
    let minus = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
    let refusing_added_p99_ms = minus(refusing.p99_ms, direct.p99_ms);
    let report = Report {
        scenario: "mirror",
        bundle_bytes: bundles.bytes,
        silent_added_p50_ms: minus(silent.p50_ms, direct.p50_ms),
        refusing_added_p99_ms,
        met: refusing_added_p99_ms.is_some_and(|added| added <= TARGET_REFUSING_ADDED_MS),
        target_refusing_added_ms: TARGET_REFUSING_ADDED_MS,
        direct,
        refusing,
        silent,
    };
    print_report(args.output, &report, table).map_err(MirrorBenchError::Other)
}

fn other(error: impl std::fmt::Display) -> MirrorBenchError {
    MirrorBenchError::Other(error.to_string())
}

/// Resolves `reference`'s tag and pulls it by digest into a fresh cache
/// under `dir`: how long both took.
async fn pull(client: &BundleClient, reference: &BundleReference, dir: &Path) -> Result<Duration, String> {
    let cache_dir = tempfile::tempdir_in(dir).map_err(|e| e.to_string())?;
    let cache = BundleCache::open(cache_dir.path(), CacheOptions::default()).await.map_err(|e| e.to_string())?;
    let started = Instant::now();
    let digest = client.resolve(reference, &RegistryCredentials::Anonymous).await.map_err(|e| e.to_string())?;
    let ready = cache.pull(client, &reference.pinned(&digest), &RegistryCredentials::Anonymous).await;
    let took = started.elapsed();
    ready.map_err(|e| e.to_string())?;
    Ok(took)
}

/// A listener that accepts every connection and never answers, holding
/// each until the process ends.
fn silent_listener() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::Builder::new().name("bench-silent-mirror".into()).spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    })?;
    Ok(addr)
}

fn table(report: &Report) -> String {
    let mut out = Series::table(
        &format!(
            "mirror: resolve + pull of one {}-byte bundle from a loopback registry, one at a time, the paths interleaved",
            report.bundle_bytes
        ),
        &[
            ("direct (no mirror)", &report.direct),
            ("refusing mirror", &report.refusing),
            ("silent mirror", &report.silent),
        ],
    );
    let shown = |value: Option<f64>| value.map_or_else(|| "unknown".to_string(), |ms| format!("{ms:+.1}ms"));
    out.push_str(&format!(
        "added by a refusing mirror: p99 {}; by a silent one: p50 {}\n",
        shown(report.refusing_added_p99_ms),
        shown(report.silent_added_p50_ms)
    ));
    out.push_str(&format!(
        "targets: a refusing mirror adds <= {:.0}ms p99 {}\n",
        report.target_refusing_added_ms,
        crate::report::verdict(report.met)
    ));
    out
}
