//! `berth-bench egress`: the egress control plane's compile, and the node
//! proxy's overhead on an allowed request against a direct one, in one run.
//!
//! # What it measures
//! 1. **compile**: [`berth_egress::compile`], the pure function the full pass
//!    runs per tenant, over one tenant of `--services` services, `--gateways`
//!    gateways and `--routes` routes, made up with a fixed seed, then over half
//!    and twice as many of each, so the growth rate shows whether it stays
//!    near-linear. Each size is compiled `--repeat` times after one warm-up
//!    run; the median and the fastest are reported. The time target is
//!    judged on the median; the growth rate on the fastest runs, the figure
//!    least disturbed by other work sharing the CPUs (the load average before
//!    the run is printed beside it). Inputs are shuffled before each run so
//!    no run is handed sorted input; the same compile is then timed with the
//!    inputs in name order, as the pass reads them from the database, and
//!    reported beside it (targets are judged on the shuffled runs). No I/O
//!    happens while the clock runs: this is the compile alone, not the
//!    pass's reads and writes.
//! 2. **proxy overhead**: the agent's egress proxy
//!    ([`berth_agent::EgressProxies`], the code a node runs) started in this
//!    process with isolation off (advisory, so it runs unprivileged on any
//!    host; the warning it logs saying so is expected) in a temporary data
//!    directory, one replica attached, and a node egress state applied whose
//!    plan allows a loopback HTTP origin (a small server in this process
//!    answering every request with the same short body and closing) through
//!    the service's HTTP and HTTPS_CONNECT listeners. Then `--proxy-requests`
//!    GETs of the origin are timed on each of three paths, after
//!    `--proxy-warmup` untimed ones: **direct** to the origin;
//!    **proxy (HTTP)**, the absolute-form request a client configured with
//!    `HTTP_PROXY` sends; and **proxy (CONNECT)**, a tunnel to the origin
//!    opened through the proxy and the GET sent inside it. Every request is
//!    on a fresh TCP connection on every path (the proxy closes each
//!    connection after one request, so the direct one does too, to compare
//!    like with like), one at a time, the three paths interleaved round by
//!    round so that other work on the machine weighs on each alike. A
//!    request counts only when it is answered 200 with the origin's body;
//!    anything else is an error, counted and kept out of the latencies. The
//!    clock runs from the connect to the end of the answer. Reported per
//!    path: p50, p99, mean and requests per second (one at a time); and what
//!    the proxy adds: p50 and p99 minus the direct ones, and its throughput
//!    over the direct one. `--proxy-requests 0` leaves it out, and
//!    [`Report::proxy`] is `null`.
//!
//! # The made-up tenant
//! Gateway `default` and `g1`..: three listeners each (HTTP, HTTPS CONNECT,
//! TCP). Routes spread round-robin over the gateways: most on every listener
//! of their gateway, some on one listener, a tenth on the TCP listener with
//! one host and one port (only the first of those per gateway is accepted,
//! as the compile's rules say); host names exact or `*.suffix`, a tenth of
//! the routes deny. Services spread over the gateways, some on the default,
//! some naming a gateway that does not exist, some disabled.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use berth_agent::{EgressIsolation, EgressProxies, EgressSettings};
use berth_egress::{
    CompiledPlan, GatewaySpec, HostPattern, ListenerSpec, ParentSpec, PlanInputs, Protocol, RouteAction, RouteSpec,
    Selection, ServiceInput, compile,
};
use berth_proto::egress::v1 as egress_proto;
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use serde::Serialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::output::{OutputFormat, print_report};

/// The full set must compile in under this, in milliseconds (median).
const TARGET_FULL_MS: f64 = 100.0;

/// Doubling every input may cost at most this factor in compile time to count
/// as near-linear (sorting alone adds a little over 2).
const TARGET_GROWTH: f64 = 2.5;

/// The seed the made-up tenant is drawn with, so every run compiles the same.
const SEED: u64 = 0x0e9_7e55;

/// The sizes compiled, as fractions of the flags' sizes.
const SCALES: [(&str, f64); 3] = [("half", 0.5), ("full", 1.0), ("double", 2.0)];

/// What the loopback origin answers every request with.
const ORIGIN_BODY: &str = "berth-bench egress: hello from the origin\n";

/// The tenant, service and lease the proxy is measured for.
const PROXY_PROJECT: &str = "bench";
const PROXY_SERVICE: &str = "web";
const PROXY_LEASE: &str = "bench-egress-lease";

/// Longest one proxied or direct request may take before it counts as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest request or answer head read before giving up on it.
const MAX_HEAD: usize = 16 * 1024;

/// Flags of `berth-bench egress`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct EgressArgs {
    /// Services in the tenant compiled (the full size; half and twice as many
    /// are compiled too).
    #[arg(long, default_value_t = 10_000, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    services: u32,
    /// Gateways in the tenant.
    #[arg(long, default_value_t = 1_000, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    gateways: u32,
    /// Routes in the tenant.
    #[arg(long, default_value_t = 10_000, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    routes: u32,
    /// Timed compiles per size, after one warm-up.
    #[arg(long, default_value_t = 11, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: u32,
    /// Timed GETs of the loopback origin per path (direct, through the
    /// proxy, through a CONNECT tunnel), each on a fresh connection; 0 skips
    /// the proxy measurement.
    #[arg(long, default_value_t = 2_000, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    proxy_requests: u32,
    /// Untimed GETs per path before the timed ones.
    #[arg(long, default_value_t = 200, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    proxy_warmup: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

/// Why the benchmark could not run to the end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EgressBenchError {
    /// The report could not be written.
    #[error("cannot write the report: {0}")]
    Output(String),
    /// A compile of shuffled inputs differed from the first: a bench of a
    /// wrong compile measures nothing.
    #[error("compiling the {0} tenant again from shuffled inputs gave a different plan")]
    NotDeterministic(&'static str),
    /// The origin or the egress proxy could not be set up.
    #[error("cannot set up the proxy measurement: {0}")]
    ProxySetup(String),
}

/// One size compiled.
#[derive(Debug, Clone, Serialize)]
struct SizeFigures {
    /// "half", "full" or "double".
    scale: &'static str,
    services: usize,
    gateways: usize,
    routes: usize,
    /// Destinations computed, once per gateway.
    destinations: usize,
    /// Destinations the per-service plan lists once expanded (what a plan
    /// message carries): each service lists its gateway's.
    service_destinations: usize,
    /// Services whose `EgressReady` holds.
    services_ready: usize,
    /// Every timed compile of shuffled inputs, milliseconds, fastest first.
    runs_ms: Vec<f64>,
    median_ms: f64,
    fastest_ms: f64,
    /// Median nanoseconds per input object (services + gateways + routes), shuffled.
    ns_per_object: f64,
    /// The same compile with the inputs in name order, as the pass reads them.
    by_name_median_ms: f64,
    by_name_fastest_ms: f64,
}

/// The proxy's overhead: the same GET of the loopback origin on three paths.
#[derive(Debug, Clone, Serialize)]
struct ProxyFigures {
    /// Timed requests per path.
    requests: u32,
    /// Untimed requests per path before them.
    warmup: u32,
    /// Bytes of the origin's answer body.
    body_bytes: usize,
    /// How the proxies said they enforce egress (advisory: isolation is off).
    enforcement: String,
    /// Requests the origin answered, warm-ups included: what reached it,
    /// directly or through the proxy.
    origin_answered: u64,
    /// Straight to the origin.
    direct: PathFigures,
    /// Through the proxy as an absolute-form HTTP request.
    http: PathFigures,
    /// Through a CONNECT tunnel opened by the proxy.
    connect: PathFigures,
    /// What the proxy adds to an HTTP request.
    http_overhead: Overhead,
    /// What the proxy adds to a request sent inside a CONNECT tunnel
    /// (opening the tunnel included).
    connect_overhead: Overhead,
}

/// One path's timed requests.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PathFigures {
    /// "direct", "proxy (HTTP)" or "proxy (CONNECT)".
    pub(crate) path: &'static str,
    /// Requests timed.
    pub(crate) requests: u32,
    /// Answered 200 with the origin's body.
    pub(crate) ok: u32,
    /// Anything else (refused, failed, timed out, another body).
    pub(crate) errors: u32,
    /// The first error, as a sample of what went wrong.
    pub(crate) first_error: Option<String>,
    /// Latencies of the successful requests, microseconds.
    pub(crate) p50_us: Option<f64>,
    pub(crate) p99_us: Option<f64>,
    pub(crate) mean_us: Option<f64>,
    pub(crate) max_us: Option<f64>,
    /// Successful requests per second, one at a time: `ok` over the time
    /// they took.
    pub(crate) per_s: f64,
}

/// What a path adds over the direct one.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Overhead {
    /// The path's p50 minus the direct p50, microseconds.
    pub(crate) added_p50_us: Option<f64>,
    /// The path's p99 minus the direct p99, microseconds.
    pub(crate) added_p99_us: Option<f64>,
    /// The path's mean minus the direct mean, microseconds.
    pub(crate) added_mean_us: Option<f64>,
    /// The path's requests per second over the direct path's.
    pub(crate) throughput_ratio: Option<f64>,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
struct Report {
    seed: u64,
    repeat: u32,
    /// The one-minute load average before the run.
    load_average_before: Option<f64>,
    sizes: Vec<SizeFigures>,
    /// Fastest time at full size over fastest at half size.
    growth_half_to_full: f64,
    /// Fastest time at double size over fastest at full size.
    growth_full_to_double: f64,
    /// The same two ratios with the inputs in name order.
    by_name_growth: (f64, f64),
    /// The node proxy's overhead; `None` with `--proxy-requests 0`.
    proxy: Option<ProxyFigures>,
    targets: Vec<crate::report::Target>,
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: EgressArgs) -> Result<(), EgressBenchError> {
    let load_average_before = crate::procfs::load_average();
    let mut sizes = Vec::new();
    for (scale, factor) in SCALES {
        let n = |count: u32| ((f64::from(count) * factor).round() as usize).max(1);
        let inputs = tenant(n(args.services), n(args.gateways), n(args.routes));
        // Each size on a blocking thread: the compile is CPU alone.
        let repeat = args.repeat;
        let figures = tokio::task::spawn_blocking(move || measure(scale, inputs, repeat))
            .await
            .map_err(|e| EgressBenchError::Output(format!("the compile thread failed: {e}")))??;
        sizes.push(figures);
    }
    let proxy =
        if args.proxy_requests > 0 { Some(measure_proxy(args.proxy_requests, args.proxy_warmup).await?) } else { None };
    let median = |scale: &str| sizes.iter().find(|s| s.scale == scale).map_or(0.0, |s| s.median_ms);
    let fastest = |scale: &str| sizes.iter().find(|s| s.scale == scale).map_or(0.0, |s| s.fastest_ms);
    let growth = |from: &str, to: &str| if fastest(from) > 0.0 { fastest(to) / fastest(from) } else { 0.0 };
    let (half_to_full, full_to_double) = (growth("half", "full"), growth("full", "double"));
    let by_name = |scale: &str| sizes.iter().find(|s| s.scale == scale).map_or(0.0, |s| s.by_name_fastest_ms);
    let by_name_growth = |from: &str, to: &str| if by_name(from) > 0.0 { by_name(to) / by_name(from) } else { 0.0 };
    let by_name_growth = (by_name_growth("half", "full"), by_name_growth("full", "double"));
    let mut targets = vec![
        crate::report::Target {
            name: format!("full set < {TARGET_FULL_MS:.0}ms (median)"),
            value: Some(median("full")),
            met: median("full") < TARGET_FULL_MS,
        },
        crate::report::Target {
            name: format!("near-linear: x2 inputs <= x{TARGET_GROWTH} time (fastest runs)"),
            value: Some(half_to_full.max(full_to_double)),
            met: half_to_full <= TARGET_GROWTH && full_to_double <= TARGET_GROWTH,
        },
    ];
    if let Some(proxy) = &proxy {
        let failed = proxy.direct.errors + proxy.http.errors + proxy.connect.errors;
        targets.push(crate::report::Target {
            name: "every proxy-overhead request answered 200 (errors)".to_string(),
            value: Some(f64::from(failed)),
            met: failed == 0,
        });
    }
    let report = Report {
        seed: SEED,
        repeat: args.repeat,
        load_average_before,
        sizes,
        growth_half_to_full: half_to_full,
        growth_full_to_double: full_to_double,
        by_name_growth,
        proxy,
        targets,
    };
    print_report(args.output, &report, table).map_err(EgressBenchError::Output)?;
    Ok(())
}

/// Compiles `inputs` once to warm up, then `repeat` times on the clock.
fn measure(scale: &'static str, mut inputs: PlanInputs, repeat: u32) -> Result<SizeFigures, EgressBenchError> {
    let mut rng = StdRng::seed_from_u64(SEED ^ 0x5eed);
    let warm: CompiledPlan = compile(&inputs);
    let mut runs = Vec::with_capacity(repeat as usize);
    for _ in 0..repeat {
        inputs.services.shuffle(&mut rng);
        inputs.gateways.shuffle(&mut rng);
        inputs.routes.shuffle(&mut rng);
        runs.push(time_compile(scale, &inputs, &warm)?);
    }
    // The order the pass hands them over in: read by name from the database
    // (and, for services, from a map kept by name), so laid out in memory in
    // the order the compile sorts them to.
    let mut by_name = inputs.clone();
    by_name.services.sort();
    by_name.gateways.sort();
    by_name.routes.sort();
    let mut by_name_runs = Vec::with_capacity(repeat as usize);
    for _ in 0..repeat {
        by_name_runs.push(time_compile(scale, &by_name, &warm)?);
    }
    by_name_runs.sort_by(f64::total_cmp);
    runs.sort_by(f64::total_cmp);
    let median_ms = runs[runs.len() / 2];
    let objects = inputs.services.len() + inputs.gateways.len() + inputs.routes.len();
    let destinations = {
        let mut seen = std::collections::HashSet::new();
        warm.services
            .iter()
            .filter(|s| seen.insert(std::sync::Arc::as_ptr(&s.destinations)))
            .map(|s| s.destinations.allowed.len() + s.destinations.denied.len())
            .sum::<usize>()
    };
    Ok(SizeFigures {
        scale,
        services: inputs.services.len(),
        gateways: inputs.gateways.len(),
        routes: inputs.routes.len(),
        destinations,
        service_destinations: warm
            .services
            .iter()
            .map(|s| s.destinations.allowed.len() + s.destinations.denied.len())
            .sum(),
        services_ready: warm.services.iter().filter(|s| s.readiness.holds()).count(),
        fastest_ms: runs[0],
        median_ms,
        ns_per_object: median_ms * 1e6 / objects as f64,
        runs_ms: runs,
        by_name_median_ms: by_name_runs[by_name_runs.len() / 2],
        by_name_fastest_ms: by_name_runs[0],
    })
}

/// One timed compile of `inputs`, checked against `expected`.
fn time_compile(scale: &'static str, inputs: &PlanInputs, expected: &CompiledPlan) -> Result<f64, EgressBenchError> {
    let started = Instant::now();
    let compiled = compile(inputs);
    let elapsed = started.elapsed();
    if compiled != *expected {
        return Err(EgressBenchError::NotDeterministic(scale));
    }
    Ok(ms(elapsed))
}

pub(crate) fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// The made-up tenant; see the module docs.
fn tenant(services: usize, gateways: usize, routes: usize) -> PlanInputs {
    let mut rng = StdRng::seed_from_u64(SEED);
    let gateway_name = |g: usize| if g == 0 { "default".to_string() } else { format!("g{g}") };
    let gateway_specs = (0..gateways)
        .map(|g| GatewaySpec {
            name: gateway_name(g),
            generation: 1,
            listeners: vec![
                ListenerSpec { name: "http".into(), protocol: Protocol::Http, port: 3128 },
                ListenerSpec { name: "https".into(), protocol: Protocol::HttpsConnect, port: 3129 },
                ListenerSpec { name: "tcp".into(), protocol: Protocol::Tcp, port: 5432 },
            ],
        })
        .collect();
    let route_specs = (0..routes)
        .map(|r| {
            let gateway = gateway_name(r % gateways);
            let tcp = rng.random_bool(0.1);
            let (listener, hostnames, ports) = if tcp {
                (Some("tcp".to_string()), vec![HostPattern::Exact(format!("db{r}.internal"))], vec![5432])
            } else {
                let listener = if rng.random_bool(0.2) { Some("http".to_string()) } else { None };
                let mut hostnames = vec![HostPattern::Exact(format!("api{r}.example.com"))];
                if rng.random_bool(0.5) {
                    hostnames.push(HostPattern::Suffix(format!("svc{r}.example.net")));
                }
                let ports = match rng.random_range(0..3) {
                    0 => vec![],
                    1 => vec![443],
                    _ => vec![80, 443],
                };
                (listener, hostnames, ports)
            };
            RouteSpec {
                name: format!("r{r}"),
                generation: 1,
                parents: vec![ParentSpec { gateway, listener }],
                hostnames,
                ports,
                action: if rng.random_bool(0.1) { RouteAction::Deny } else { RouteAction::Allow },
            }
        })
        .collect();
    let service_specs = (0..services)
        .map(|s| {
            let selection = match rng.random_range(0..20) {
                0 => Selection::Disabled,
                1 => Selection::Gateway("missing".into()),
                2 | 3 => Selection::Gateway("default".into()),
                _ => Selection::Gateway(gateway_name(rng.random_range(0..gateways))),
            };
            ServiceInput { service: format!("svc-{s}"), selection }
        })
        .collect();
    PlanInputs { services: service_specs, gateways: gateway_specs, routes: route_specs }
}

fn table(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "berth-bench egress: the pure compile of one tenant, {} timed runs per size after a warm-up (seed {:#x})",
        report.repeat, report.seed
    );
    let _ = writeln!(
        out,
        "{:<8}{:>10}{:>10}{:>10}{:>14}{:>13}{:>8}{:>10}{:>10}{:>11}{:>16}",
        "size",
        "services",
        "gateways",
        "routes",
        "destinations",
        "per-service",
        "ready",
        "median",
        "fastest",
        "ns/object",
        "by name: median"
    );
    for size in &report.sizes {
        let _ = writeln!(
            out,
            "{:<8}{:>10}{:>10}{:>10}{:>14}{:>13}{:>8}{:>8.1}ms{:>8.1}ms{:>11.0}{:>14.1}ms",
            size.scale,
            size.services,
            size.gateways,
            size.routes,
            size.destinations,
            size.service_destinations,
            size.services_ready,
            size.median_ms,
            size.fastest_ms,
            size.ns_per_object,
            size.by_name_median_ms,
        );
    }
    let _ = writeln!(
        out,
        "growth of the fastest runs: half -> full x{:.2}, full -> double x{:.2} (inputs x2 each step); \
         by name: x{:.2}, x{:.2}",
        report.growth_half_to_full, report.growth_full_to_double, report.by_name_growth.0, report.by_name_growth.1
    );
    let _ = writeln!(
        out,
        "(median, fastest, ns/object: inputs shuffled before every run, the worst case; by name: in the order \
         the pass reads them)"
    );
    let _ = writeln!(
        out,
        "machine: {} CPUs shared with all else; load average {} over the minute before the run",
        std::thread::available_parallelism().map_or(0, usize::from),
        report.load_average_before.map_or_else(|| "unknown".to_string(), |l| format!("{l:.2}")),
    );
    let _ = writeln!(
        out,
        "(destinations: computed once per gateway and shared; per-service: what the plan lists once each service \
         carries its gateway's)"
    );
    match &report.proxy {
        Some(proxy) => proxy_table(&mut out, proxy),
        None => {
            let _ = writeln!(out, "proxy overhead: not measured (--proxy-requests 0)");
        }
    }
    let _ = writeln!(out, "{}", crate::report::verdicts_line(&report.targets, 2));
    out
}

/// The proxy measurement's lines of the table.
fn proxy_table(out: &mut String, proxy: &ProxyFigures) {
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "proxy overhead: {} GETs per path after {} untimed, one at a time, each on a fresh connection, the paths \
         interleaved; a {}-byte answer from a loopback origin",
        proxy.requests, proxy.warmup, proxy.body_bytes
    );
    let _ = writeln!(out, "the agent's egress proxy in this process, enforcement: {}", proxy.enforcement);
    paths_table(
        out,
        &[&proxy.direct, &proxy.http, &proxy.connect],
        &[("the proxy, HTTP", &proxy.http_overhead), ("the proxy, CONNECT", &proxy.connect_overhead)],
    );
}

/// A row per path (latencies and rate), a line per overhead (what `by`
/// adds over the direct path), then each path's first error.
pub(crate) fn paths_table(out: &mut String, paths: &[&PathFigures], overheads: &[(&str, &Overhead)]) {
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "{:<18}{:>9}{:>9}{:>8}{:>12}{:>12}{:>12}{:>12}{:>10}",
        "path", "requests", "ok", "errors", "p50", "p99", "mean", "max", "req/s"
    );
    for path in paths {
        let _ = writeln!(
            out,
            "{:<18}{:>9}{:>9}{:>8}{:>12}{:>12}{:>12}{:>12}{:>10.0}",
            path.path,
            path.requests,
            path.ok,
            path.errors,
            micros(path.p50_us),
            micros(path.p99_us),
            micros(path.mean_us),
            micros(path.max_us),
            path.per_s,
        );
    }
    for (by, overhead) in overheads {
        let _ = writeln!(
            out,
            "added by {by}: p50 {}, p99 {}, mean {}; throughput {} of direct",
            signed_micros(overhead.added_p50_us),
            signed_micros(overhead.added_p99_us),
            signed_micros(overhead.added_mean_us),
            overhead.throughput_ratio.map_or_else(|| "unknown".to_string(), |r| format!("x{r:.2}")),
        );
    }
    for path in paths {
        if let Some(error) = &path.first_error {
            let _ = writeln!(out, "first error, {}: {error}", path.path);
        }
    }
}

fn micros(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |us| format!("{us:.1}us"))
}

fn signed_micros(value: Option<f64>) -> String {
    value.map_or_else(|| "unknown".to_string(), |us| format!("{us:+.1}us"))
}

/// The three ways the origin is fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FetchPath {
    /// Straight to the origin.
    Direct,
    /// `GET http://origin/` sent to the proxy.
    Http,
    /// `CONNECT origin` through the proxy, then `GET /` inside the tunnel.
    Connect,
}

impl FetchPath {
    const ALL: [FetchPath; 3] = [FetchPath::Direct, FetchPath::Http, FetchPath::Connect];

    fn label(self) -> &'static str {
        match self {
            FetchPath::Direct => "direct",
            FetchPath::Http => "proxy (HTTP)",
            FetchPath::Connect => "proxy (CONNECT)",
        }
    }
}

/// Runs the proxy measurement: origin and proxies up, the origin allowed,
/// `requests` timed GETs per path after `warmup` untimed ones, all down.
async fn measure_proxy(requests: u32, warmup: u32) -> Result<ProxyFigures, EgressBenchError> {
    let bench = ProxyBench::start().await?;
    let applied = bench.allow_origin().await;
    let figures = match applied {
        Ok(()) => Ok(bench.run(requests, warmup).await),
        Err(error) => Err(error),
    };
    bench.close().await;
    figures
}

/// A loopback HTTP origin answering every request [`ORIGIN_BODY`] and
/// closing, counting the requests it answered.
#[derive(Debug)]
struct Origin {
    addr: SocketAddr,
    answered: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl Origin {
    async fn start() -> std::io::Result<Origin> {
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let answered = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let (counted, stopped) = (answered.clone(), stop.clone());
        let answer: Arc<[u8]> = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{ORIGIN_BODY}",
            ORIGIN_BODY.len()
        )
        .into_bytes()
        .into();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stopped.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((mut stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let (counted, answer) = (counted.clone(), answer.clone());
                tokio::spawn(async move {
                    if !read_request_head(&mut stream).await {
                        return;
                    }
                    if stream.write_all(&answer).await.is_ok() {
                        counted.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = stream.shutdown().await;
                });
            }
        });
        Ok(Origin { addr, answered, stop })
    }

    /// Requests answered so far.
    fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Reads up to the end of a request head: `false` when the peer closed or
/// sent more than a head may be first.
async fn read_request_head(stream: &mut TcpStream) -> bool {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 2048];
    loop {
        let read = match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(read) => read,
        };
        let from = head.len().saturating_sub(3);
        head.extend_from_slice(&chunk[..read]);
        if head[from..].windows(4).any(|w| w == b"\r\n\r\n") {
            return true;
        }
        if head.len() > MAX_HEAD {
            return false;
        }
    }
}

/// The origin and the node's egress proxies with one replica attached.
#[derive(Debug)]
struct ProxyBench {
    origin: Origin,
    proxies: EgressProxies,
    /// The replica's proxy, as its `HTTP_PROXY` names it.
    proxy: SocketAddr,
    _dir: tempfile::TempDir,
}

impl ProxyBench {
    /// Starts the origin and the proxies (isolation off) in a temporary data
    /// directory, and attaches one replica; no plan is applied yet, so the
    /// proxy refuses everything until [`allow_origin`](Self::allow_origin).
    async fn start() -> Result<ProxyBench, EgressBenchError> {
        let setup =
            |what: &str, error: &dyn std::fmt::Display| EgressBenchError::ProxySetup(format!("{what}: {error}"));
        let origin = Origin::start().await.map_err(|e| setup("the loopback origin", &e))?;
        let dir = tempfile::Builder::new()
            .prefix("berth-bench-egress-")
            .tempdir()
            .map_err(|e| setup("a temporary data directory", &e))?;
        let settings = EgressSettings { isolation: EgressIsolation::Off, ..EgressSettings::new(dir.path()) };
        let proxies = EgressProxies::start(settings, CancellationToken::new())
            .await
            .map_err(|e| setup("the egress proxies", &e))?;
        proxies.recovered().await;
        let attachment = match proxies.attach(PROXY_LEASE, PROXY_PROJECT, PROXY_SERVICE).await {
            Ok(attachment) => attachment,
            Err(error) => {
                proxies.close().await;
                return Err(setup("attaching a replica", &error));
            }
        };
        Ok(ProxyBench { origin, proxies, proxy: attachment.proxy_addr(), _dir: dir })
    }

    /// Applies a node state whose plan allows the service to reach the
    /// origin: plain HTTP through its HTTP listener, CONNECT through its
    /// HTTPS_CONNECT listener, the origin's port only.
    async fn allow_origin(&self) -> Result<(), EgressBenchError> {
        let destination = |listener: &str, protocol: egress_proto::ListenerProtocol, listener_port, route: &str| {
            egress_proto::Destination {
                listener: listener.into(),
                protocol: protocol as i32,
                listener_port,
                hostname: self.origin.addr.ip().to_string(),
                ports: vec![u32::from(self.origin.addr.port())],
                route: route.into(),
            }
        };
        let service = egress_proto::ServiceEgress {
            service: PROXY_SERVICE.into(),
            gateway: "default".into(),
            allowed: vec![
                destination("http", egress_proto::ListenerProtocol::Http, 3128, "bench-origin"),
                destination("https", egress_proto::ListenerProtocol::HttpsConnect, 3129, "bench-origin-tunnel"),
            ],
            denied: Vec::new(),
            condition: None,
        };
        let plan = egress_proto::EgressPlan {
            project: PROXY_PROJECT.into(),
            generation: 1,
            services: vec![service],
            ..Default::default()
        };
        let state = egress_proto::NodeEgressState { generation: 1, plans: vec![plan] };
        self.proxies
            .apply(&state)
            .await
            .map_err(|e| EgressBenchError::ProxySetup(format!("applying the plan that allows the origin: {e}")))
    }

    /// `warmup` untimed rounds, then `requests` timed ones; each round
    /// fetches the origin once on every path, in an order that rotates.
    async fn run(&self, requests: u32, warmup: u32) -> ProxyFigures {
        for round in 0..warmup {
            for path in rotation(round) {
                let _ = fetch(path, self.origin.addr, self.proxy).await;
            }
        }
        let mut samples: [Vec<f64>; 3] = Default::default();
        let mut errors = [0u32; 3];
        let mut first_errors: [Option<String>; 3] = Default::default();
        for round in 0..requests {
            for path in rotation(round) {
                let slot = path as usize;
                let started = Instant::now();
                let fetched = fetch(path, self.origin.addr, self.proxy).await;
                let elapsed = started.elapsed();
                match fetched {
                    Ok(()) => samples[slot].push(elapsed.as_secs_f64() * 1e6),
                    Err(error) => {
                        errors[slot] += 1;
                        first_errors[slot].get_or_insert(error);
                    }
                }
            }
        }
        let [direct, http, connect] = FetchPath::ALL.map(|path| {
            let slot = path as usize;
            path_figures(
                path.label(),
                requests,
                std::mem::take(&mut samples[slot]),
                errors[slot],
                first_errors[slot].take(),
            )
        });
        ProxyFigures {
            requests,
            warmup,
            body_bytes: ORIGIN_BODY.len(),
            enforcement: self.proxies.enforcement().to_string(),
            origin_answered: self.origin.answered(),
            http_overhead: overhead(&direct, &http),
            connect_overhead: overhead(&direct, &connect),
            direct,
            http,
            connect,
        }
    }

    /// Stops the proxies and the origin.
    async fn close(self) {
        self.proxies.detach(PROXY_LEASE).await;
        self.proxies.close().await;
    }
}

/// The order of the paths in round `round`: each path goes first, second and
/// third in turn.
fn rotation(round: u32) -> [FetchPath; 3] {
    let first = (round % 3) as usize;
    [0, 1, 2].map(|k| FetchPath::ALL[(first + k) % 3])
}

/// One GET of the origin on `path`, on a fresh connection: `Ok` when it was
/// answered 200 with the origin's body.
async fn fetch(path: FetchPath, origin: SocketAddr, proxy: SocketAddr) -> Result<(), String> {
    let attempt = async {
        let to = if path == FetchPath::Direct { origin } else { proxy };
        let mut stream = TcpStream::connect(to).await.map_err(|e| format!("cannot connect to {to}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let mut answer = Vec::with_capacity(256);
        match path {
            FetchPath::Direct => send_get(&mut stream, "/", origin).await?,
            FetchPath::Http => send_get(&mut stream, &format!("http://{origin}/"), origin).await?,
            FetchPath::Connect => {
                let open = format!("CONNECT {origin} HTTP/1.1\r\nHost: {origin}\r\n\r\n");
                stream.write_all(open.as_bytes()).await.map_err(|e| format!("cannot send CONNECT: {e}"))?;
                answer = read_answer_head(&mut stream).await?;
                let end = head_end(&answer).unwrap_or(answer.len());
                let status = status_line(&answer[..end]);
                if status.split(' ').nth(1) != Some("200") {
                    let _ = stream.read_to_end(&mut answer).await;
                    return Err(format!("the tunnel was refused: {}", excerpt(&answer)));
                }
                // Whatever came after the tunnel's answer is the origin's.
                answer.drain(..end);
                send_get(&mut stream, "/", origin).await?;
            }
        }
        stream.read_to_end(&mut answer).await.map_err(|e| format!("cannot read the answer: {e}"))?;
        check_answer(&answer)
    };
    tokio::time::timeout(REQUEST_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {REQUEST_TIMEOUT:?}")))
}

async fn send_get(stream: &mut TcpStream, target: &str, origin: SocketAddr) -> Result<(), String> {
    let request = format!("GET {target} HTTP/1.1\r\nHost: {origin}\r\nUser-Agent: berth-bench\r\nAccept: */*\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(|e| format!("cannot send the request: {e}"))
}

/// Reads until the end of an answer head (and maybe past it).
async fn read_answer_head(stream: &mut TcpStream) -> Result<Vec<u8>, String> {
    let mut head = Vec::with_capacity(256);
    let mut chunk = [0u8; 1024];
    while head_end(&head).is_none() {
        let read = stream.read(&mut chunk).await.map_err(|e| format!("cannot read the tunnel's answer: {e}"))?;
        if read == 0 {
            return Err(format!("the proxy closed without answering CONNECT: {}", excerpt(&head)));
        }
        head.extend_from_slice(&chunk[..read]);
        if head.len() > MAX_HEAD {
            return Err("the answer to CONNECT has no end of head".to_string());
        }
    }
    Ok(head)
}

/// Where the head of `bytes` ends (past its blank line), if it does.
fn head_end(bytes: &[u8]) -> Option<usize> {
    bytes.windows(4).position(|w| w == b"\r\n\r\n").map(|at| at + 4)
}

fn status_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.lines().next().unwrap_or_default().to_string()
}

/// `Ok` for a 200 carrying the origin's body.
fn check_answer(answer: &[u8]) -> Result<(), String> {
    let Some(end) = head_end(answer) else {
        return Err(format!("no complete answer: {}", excerpt(answer)));
    };
    let status = status_line(&answer[..end]);
    if status.split(' ').nth(1) != Some("200") {
        return Err(format!("answered {}", excerpt(answer)));
    }
    if &answer[end..] != ORIGIN_BODY.as_bytes() {
        return Err(format!("answered 200 with another body: {}", excerpt(&answer[end..])));
    }
    Ok(())
}

/// At most 200 characters of `bytes`, on one line.
fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    line.chars().take(200).collect()
}

/// One path's figures from the latencies of its successful requests.
pub(crate) fn path_figures(
    path: &'static str,
    requests: u32,
    mut samples_us: Vec<f64>,
    errors: u32,
    first_error: Option<String>,
) -> PathFigures {
    samples_us.sort_by(f64::total_cmp);
    let total_us: f64 = samples_us.iter().sum();
    let ok = u32::try_from(samples_us.len()).unwrap_or(u32::MAX);
    PathFigures {
        path,
        requests,
        ok,
        errors,
        first_error,
        p50_us: percentile(&samples_us, 0.50),
        p99_us: percentile(&samples_us, 0.99),
        mean_us: (!samples_us.is_empty()).then(|| total_us / samples_us.len() as f64),
        max_us: samples_us.last().copied(),
        per_s: if total_us > 0.0 { f64::from(ok) / (total_us / 1e6) } else { 0.0 },
    }
}

/// The nearest-rank percentile `q` of sorted samples.
pub(crate) fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// What `path` adds over `direct`.
pub(crate) fn overhead(direct: &PathFigures, path: &PathFigures) -> Overhead {
    let minus = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
    Overhead {
        added_p50_us: minus(path.p50_us, direct.p50_us),
        added_p99_us: minus(path.p99_us, direct.p99_us),
        added_mean_us: minus(path.mean_us, direct.mean_us),
        throughput_ratio: (direct.per_s > 0.0 && path.ok > 0).then(|| path.per_s / direct.per_s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_made_up_tenant_is_the_same_every_time_and_compiles_to_something() {
        let first = tenant(200, 20, 200);
        assert_eq!(first, tenant(200, 20, 200));
        let compiled = compile(&first);
        assert_eq!(compiled.services.len(), 200);
        assert!(compiled.services.iter().filter(|s| s.readiness.holds()).count() > 150);
        assert!(
            compiled.routes.iter().any(|r| r.parents.iter().any(|p| !p.verdict.accepted())),
            "some TCP routes lose"
        );
    }

    #[tokio::test]
    async fn a_small_proxy_run_times_every_path_and_what_the_proxy_adds() {
        let figures = measure_proxy(5, 1).await.unwrap();
        assert!(figures.enforcement.starts_with("advisory"), "{}", figures.enforcement);
        for path in [&figures.direct, &figures.http, &figures.connect] {
            assert_eq!((path.requests, path.ok, path.errors), (5, 5, 0), "{path:?}");
            assert_eq!(path.first_error, None);
            let (p50, p99, mean) = (path.p50_us.unwrap(), path.p99_us.unwrap(), path.mean_us.unwrap());
            assert!(p50 > 0.0 && p50 <= p99 && p99 <= path.max_us.unwrap() && mean > 0.0, "{path:?}");
            assert!(path.per_s > 0.0, "{path:?}");
        }
        assert_eq!(figures.origin_answered, 3 * (5 + 1), "every request, warm-ups included, reached the origin");
        for overhead in [&figures.http_overhead, &figures.connect_overhead] {
            assert!(overhead.added_p50_us.is_some() && overhead.added_p99_us.is_some(), "{overhead:?}");
            assert!(overhead.throughput_ratio.unwrap() > 0.0, "{overhead:?}");
        }
        let added = figures.http.p50_us.unwrap() - figures.direct.p50_us.unwrap();
        assert_eq!(figures.http_overhead.added_p50_us, Some(added));
    }

    #[tokio::test]
    async fn a_refused_request_counts_as_an_error_and_never_reaches_the_origin() {
        let bench = ProxyBench::start().await.unwrap();
        // No plan applied: the proxy refuses everything.
        let figures = bench.run(3, 0).await;
        assert_eq!((figures.direct.ok, figures.direct.errors), (3, 0));
        for path in [&figures.http, &figures.connect] {
            assert_eq!((path.ok, path.errors), (0, 3), "{path:?}");
            assert!(path.first_error.as_deref().unwrap().contains("403"), "{path:?}");
            assert_eq!((path.p50_us, path.per_s), (None, 0.0));
        }
        assert_eq!(figures.origin_answered, 3, "only the direct requests reached the origin");
        assert_eq!(figures.http_overhead.added_p50_us, None);
        assert_eq!(figures.connect_overhead.throughput_ratio, None);
        bench.close().await;
    }

    #[test]
    fn only_a_200_with_the_origins_body_counts() {
        let ok = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{ORIGIN_BODY}", ORIGIN_BODY.len());
        assert_eq!(check_answer(ok.as_bytes()), Ok(()));
        let refused = "HTTP/1.1 403 Forbidden\r\n\r\nberth egress: no route allows it\n";
        assert!(check_answer(refused.as_bytes()).unwrap_err().contains("403 Forbidden"));
        assert!(check_answer(b"HTTP/1.1 200 OK\r\n\r\nsomething else").unwrap_err().contains("another body"));
        assert!(check_answer(b"HTTP/1.1 200 OK\r\n").unwrap_err().contains("no complete answer"));
    }

    #[test]
    fn overhead_is_the_proxied_figure_minus_the_direct_one() {
        let direct = path_figures("direct", 4, vec![100.0, 200.0, 100.0, 400.0], 0, None);
        assert_eq!((direct.p50_us, direct.p99_us, direct.mean_us), (Some(100.0), Some(400.0), Some(200.0)));
        assert_eq!(direct.per_s, 5000.0);
        let proxied = path_figures("proxy (HTTP)", 4, vec![300.0, 500.0, 300.0], 1, Some("x".into()));
        let added = overhead(&direct, &proxied);
        assert_eq!((added.added_p50_us, added.added_p99_us), (Some(200.0), Some(100.0)));
        assert_eq!(added.throughput_ratio, Some(proxied.per_s / direct.per_s));
        assert!((added.throughput_ratio.unwrap() - 200.0 / (1100.0 / 3.0)).abs() < 1e-9);
    }

    #[test]
    fn the_table_shows_every_path_and_what_the_proxy_adds() {
        let direct = path_figures("direct", 2, vec![100.0, 120.0], 0, None);
        let http = path_figures("proxy (HTTP)", 2, vec![150.0, 190.0], 0, None);
        let connect = path_figures("proxy (CONNECT)", 2, vec![210.0], 1, Some("answered HTTP/1.1 403".into()));
        let proxy = ProxyFigures {
            requests: 2,
            warmup: 1,
            body_bytes: ORIGIN_BODY.len(),
            enforcement: "advisory (isolation is turned off)".into(),
            origin_answered: 8,
            http_overhead: overhead(&direct, &http),
            connect_overhead: overhead(&direct, &connect),
            direct,
            http,
            connect,
        };
        let report = Report {
            seed: SEED,
            repeat: 1,
            load_average_before: None,
            sizes: Vec::new(),
            growth_half_to_full: 0.0,
            growth_full_to_double: 0.0,
            by_name_growth: (0.0, 0.0),
            proxy: Some(proxy),
            targets: Vec::new(),
        };
        let text = table(&report);
        assert!(!text.contains('\\'), "{text}");
        assert!(text.contains("proxy overhead: 2 GETs per path after 1 untimed"), "{text}");
        assert!(text.contains("enforcement: advisory (isolation is turned off)"), "{text}");
        let row =
            |label: &str| text.lines().find(|l| l.starts_with(label)).unwrap().split_whitespace().collect::<Vec<_>>();
        assert_eq!(row("direct")[1..], ["2", "2", "0", "100.0us", "120.0us", "110.0us", "120.0us", "9091"]);
        assert_eq!(row("proxy (HTTP)")[2..], ["2", "2", "0", "150.0us", "190.0us", "170.0us", "190.0us", "5882"]);
        assert_eq!(row("proxy (CONNECT)")[2..5], ["2", "1", "1"]);
        assert!(
            text.contains(
                "added by the proxy, HTTP: p50 +50.0us, p99 +70.0us, mean +60.0us; throughput x0.65 of direct"
            ),
            "{text}"
        );
        assert!(text.contains("added by the proxy, CONNECT: p50 +110.0us, p99 +90.0us"), "{text}");
        assert!(text.contains("first error, proxy (CONNECT): answered HTTP/1.1 403"), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["proxy"]["http_overhead"]["added_p50_us"], 50.0);
        assert_eq!(json["proxy"]["direct"]["p99_us"], 120.0);
    }

    #[test]
    fn every_path_takes_each_place_in_the_rounds() {
        assert_eq!(rotation(0), [FetchPath::Direct, FetchPath::Http, FetchPath::Connect]);
        assert_eq!(rotation(1), [FetchPath::Http, FetchPath::Connect, FetchPath::Direct]);
        assert_eq!(rotation(5), [FetchPath::Connect, FetchPath::Direct, FetchPath::Http]);
    }

    #[test]
    fn a_small_run_reports_every_size() {
        let figures = measure("full", tenant(100, 10, 100), 3).unwrap();
        assert_eq!((figures.services, figures.gateways, figures.routes), (100, 10, 100));
        assert_eq!(figures.runs_ms.len(), 3);
        assert!(figures.fastest_ms <= figures.median_ms);
    }
}
