//! `berth bench egress`: the egress control plane's compile, and (later) the
//! node proxy's overhead.
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
//! 2. **proxy overhead**: not measured here yet. The agent's egress proxy
//!    (`services/agent/src/egress/`) is measured by its own scenario, which
//!    will report under [`Report::proxy`]; until then that field is `null` and
//!    the table says so.
//!
//! # The made-up tenant
//! Gateway `default` and `g1`..: three listeners each (HTTP, HTTPS CONNECT,
//! TCP). Routes spread round-robin over the gateways: most on every listener
//! of their gateway, some on one listener, a tenth on the TCP listener with
//! one host and one port (only the first of those per gateway is accepted,
//! as the compile's rules say); host names exact or `*.suffix`, a tenth of
//! the routes deny. Services spread over the gateways, some on the default,
//! some naming a gateway that does not exist, some disabled.

use std::time::{Duration, Instant};

use berth_egress::{
    CompiledPlan, GatewaySpec, HostPattern, ListenerSpec, ParentSpec, PlanInputs, Protocol, RouteAction, RouteSpec,
    Selection, ServiceInput, compile,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use serde::Serialize;

use super::heartbeats::OutputFormat;

/// The full set must compile in under this, in milliseconds (median).
const TARGET_FULL_MS: f64 = 100.0;

/// Doubling every input may cost at most this factor in compile time to count
/// as near-linear (sorting alone adds a little over 2).
const TARGET_GROWTH: f64 = 2.5;

/// The seed the made-up tenant is drawn with, so every run compiles the same.
const SEED: u64 = 0x0e9_7e55;

/// The sizes compiled, as fractions of the flags' sizes.
const SCALES: [(&str, f64); 3] = [("half", 0.5), ("full", 1.0), ("double", 2.0)];

/// Flags of `berth bench egress`.
#[derive(Debug, Clone, clap::Args)]
pub(super) struct EgressArgs {
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

/// Where the proxy's figures will go once that scenario exists.
#[derive(Debug, Clone, Serialize)]
struct ProxyFigures {}

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
    /// The node proxy's overhead; not measured by this scenario yet.
    proxy: Option<ProxyFigures>,
    targets: Vec<super::report::Target>,
}

/// Runs the scenario and prints its report.
pub(super) async fn run(args: EgressArgs) -> Result<(), EgressBenchError> {
    let load_average_before = super::procfs::load_average();
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
    let median = |scale: &str| sizes.iter().find(|s| s.scale == scale).map_or(0.0, |s| s.median_ms);
    let fastest = |scale: &str| sizes.iter().find(|s| s.scale == scale).map_or(0.0, |s| s.fastest_ms);
    let growth = |from: &str, to: &str| if fastest(from) > 0.0 { fastest(to) / fastest(from) } else { 0.0 };
    let (half_to_full, full_to_double) = (growth("half", "full"), growth("full", "double"));
    let by_name = |scale: &str| sizes.iter().find(|s| s.scale == scale).map_or(0.0, |s| s.by_name_fastest_ms);
    let by_name_growth = |from: &str, to: &str| if by_name(from) > 0.0 { by_name(to) / by_name(from) } else { 0.0 };
    let by_name_growth = (by_name_growth("half", "full"), by_name_growth("full", "double"));
    let targets = vec![
        super::report::Target {
            name: format!("full set < {TARGET_FULL_MS:.0}ms (median)"),
            value: Some(median("full")),
            met: median("full") < TARGET_FULL_MS,
        },
        super::report::Target {
            name: format!("near-linear: x2 inputs <= x{TARGET_GROWTH} time (fastest runs)"),
            value: Some(half_to_full.max(full_to_double)),
            met: half_to_full <= TARGET_GROWTH && full_to_double <= TARGET_GROWTH,
        },
    ];
    let report = Report {
        seed: SEED,
        repeat: args.repeat,
        load_average_before,
        sizes,
        growth_half_to_full: half_to_full,
        growth_full_to_double: full_to_double,
        by_name_growth,
        proxy: None,
        targets,
    };
    let text = match args.output {
        OutputFormat::Table => table(&report),
        OutputFormat::Json => {
            serde_json::to_string_pretty(&report).map_err(|e| EgressBenchError::Output(e.to_string()))? + "\n"
        }
    };
    print!("{text}");
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

fn ms(duration: Duration) -> f64 {
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
        "berth bench egress: the pure compile of one tenant, {} timed runs per size after a warm-up (seed {:#x})",
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
    let _ = writeln!(out, "proxy overhead: not measured by this scenario yet");
    let verdicts: Vec<String> = report
        .targets
        .iter()
        .map(|t| {
            let value = t.value.map_or_else(|| "no figure".to_string(), |v| format!("{v:.2}"));
            format!("{} {} ({value})", t.name, if t.met { "OK" } else { "MISSED" })
        })
        .collect();
    let _ = writeln!(out, "targets: {}", verdicts.join("; "));
    out
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

    #[test]
    fn a_small_run_reports_every_size() {
        let figures = measure("full", tenant(100, 10, 100), 3).unwrap();
        assert_eq!((figures.services, figures.gateways, figures.routes), (100, 10, 100));
        assert_eq!(figures.runs_ms.len(), 3);
        assert!(figures.fastest_ms <= figures.median_ms);
    }
}
