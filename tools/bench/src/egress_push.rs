//! `berth-bench egress-push`: how long after a route edit the node that
//! hosts the tenant has the new policy in force, end to end through a real
//! `berth dev` (identity, revisions, leases, egress and an agent enforcing
//! egress, on its embedded store).
//!
//! # Expected flow
//! 1. `berth dev` starts as a process of its own, on a scratch data
//!    directory and five free loopback ports; a bundle whose program sleeps
//!    is pushed to an OCI layout, and the CLI applies a gateway, a route and
//!    a one-replica service of it, waiting for the replica to run, so the
//!    dev node hosts the tenant and receives its plans.
//! 2. Baseline in the same run: `grpc.health.v1.Health/Check` on egress
//!    (an empty mTLS RPC), `--baseline` times.
//! 3. `--edits` times, one after the other: the route's port list changes,
//!    and the clock runs from just before `ApplyRoute` until `GetPlan`
//!    (polled every [`POLL_EVERY`]) shows the node's acknowledged
//!    generation above the one before the edit. The node acknowledges a
//!    state only once it swapped it into its proxies, so this is the edit
//!    in force on the node, plus at most one poll.
//! 4. The service is deleted and the node's instances waited out, so the
//!    replica is stopped before `berth dev` is; the data directory goes.
//!
//! The figure includes egress's debounce (`--debounce`, 200 ms by default):
//! a single edit waits that long for company before the pass compiles.

use std::path::Path;
use std::time::{Duration, Instant};

use berth_proto::egress::v1 as egress;
use berth_rpc::Channel;
use serde::Serialize;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::dev::{Dev, DevBenchError, Port, START_DEADLINE, Series, rpc, setup};
use crate::egress::ms;
use crate::output::{OutputFormat, print_report};

/// How often the plan is read while an edit is waited for.
const POLL_EVERY: Duration = Duration::from_millis(2);

/// How long one edit may take before it counts as not acknowledged.
const EDIT_DEADLINE: Duration = Duration::from_secs(10);

/// The edit's target: in force on the node within a second (p99).
const TARGET_MS: f64 = 1000.0;

/// The project everything is made in.
const PROJECT: &str = "default";

/// The service, gateway and route names.
const SERVICE: &str = "pushed";
const ROUTE: &str = "bench";

/// Flags of `berth-bench egress-push`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct EgressPushArgs {
    /// Route edits timed, one after the other.
    #[arg(long, default_value_t = 50, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    edits: u32,
    /// Empty RPCs to egress timed as the baseline.
    #[arg(long, default_value_t = 200, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    baseline: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

#[derive(Debug, Serialize)]
struct Report {
    edits: u32,
    /// Edit to the node's acknowledgement.
    in_force: Series,
    /// Edits the node did not acknowledge within [`EDIT_DEADLINE`].
    missed: u32,
    /// `ApplyRoute` alone, as the caller saw it.
    apply: Series,
    /// The empty mTLS RPC to egress.
    baseline: Series,
    /// How the node enforces egress, as its ack says.
    enforcement: String,
    target_p99_ms: f64,
    met: bool,
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: EgressPushArgs) -> Result<(), DevBenchError> {
    let dir = tempfile::tempdir().map_err(|e| setup("a scratch directory")(e.to_string()))?;
    let mut dev = Dev::start(dir.path(), &[]).await?;
    let outcome = measure(&mut dev, &args, dir.path()).await;
    dev.stop().await;
    let report = outcome?;
    print_report(args.output, &report, table).map_err(DevBenchError::Output)?;
    Ok(())
}

/// Measures on a started `berth dev`.
async fn measure(dev: &mut Dev, args: &EgressPushArgs, scratch: &Path) -> Result<Report, DevBenchError> {
    deploy(dev, scratch).await?;
    let channel = dev.channel(Port::Egress)?;
    let mut client = egress::egress_client::EgressClient::new(channel.clone());

    let mut health = HealthClient::new(channel);
    let mut baseline = Vec::new();
    for _ in 0..args.baseline {
        let started = Instant::now();
        health.check(HealthCheckRequest { service: String::new() }).await.map_err(rpc("Health/Check"))?;
        baseline.push(ms(started.elapsed()));
    }

    let (mut acked, mut enforcement) = node_ack(&mut client).await?;
    let (mut in_force, mut applies, mut missed) = (Vec::new(), Vec::new(), 0);
    for edit in 0..args.edits {
        let port = 20_000 + edit % 10_000;
        let started = Instant::now();
        client.apply_route(route(port)).await.map_err(rpc("ApplyRoute"))?;
        applies.push(ms(started.elapsed()));
        let seen = loop {
            let (generation, how) = node_ack(&mut client).await?;
            if generation > acked {
                break Some((generation, how));
            }
            if started.elapsed() > EDIT_DEADLINE {
                break None;
            }
            tokio::time::sleep(POLL_EVERY).await;
        };
        match seen {
            Some((generation, how)) => {
                in_force.push(ms(started.elapsed()));
                (acked, enforcement) = (generation, how);
            }
            None => missed += 1,
        }
    }
    let in_force = Series::of(in_force);
    let met = missed == 0 && in_force.p99_ms.is_some_and(|p99| p99 < TARGET_MS);
    Ok(Report {
        edits: args.edits,
        in_force,
        missed,
        apply: Series::of(applies),
        baseline: Series::of(baseline),
        enforcement,
        target_p99_ms: TARGET_MS,
        met,
    })
}

/// A gateway, a route and a running replica of the tenant on the node.
async fn deploy(dev: &mut Dev, scratch: &Path) -> Result<(), DevBenchError> {
    let reference = dev.push_bundle(scratch, "sleeper", "entrypoint = \"/bin/sleep\"\nargs = [\"86400\"]\n").await?;
    let path = scratch.join("gateway.json");
    let gateway =
        serde_json::json!({"name": "default", "listeners": [{"name": "http", "protocol": "HTTP", "port": 3128}]});
    std::fs::write(&path, gateway.to_string()).map_err(|e| setup("a spec file")(e.to_string()))?;
    dev.cli(&["egress", "gateway", "apply", "-f", &path.display().to_string()]).await.map_err(setup("the gateway"))?;
    let spec = serde_json::json!({
        "bundle": {"reference": reference},
        "replicas": 1,
        "resources": {"cpu_millis": 10, "memory_bytes": 16_777_216},
    });
    dev.apply(scratch, SERVICE, &spec).await?;

    // The first plan reaches the node once it hosts the tenant.
    let mut client = egress::egress_client::EgressClient::new(dev.channel(Port::Egress)?);
    client.apply_route(route(19_999)).await.map_err(rpc("ApplyRoute"))?;
    let deadline = Instant::now() + START_DEADLINE;
    while node_ack(&mut client).await?.0 == 0 {
        if Instant::now() > deadline {
            return Err(setup("the dev node's first plan")(format!("no ack within {START_DEADLINE:?}")).into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The route of the run, matching the loopback address on `port`.
fn route(port: u32) -> egress::ApplyRouteRequest {
    egress::ApplyRouteRequest {
        project: PROJECT.into(),
        name: ROUTE.into(),
        parent_refs: vec![egress::ParentRef { gateway: "default".into(), listener: "http".into() }],
        hostnames: vec!["127.0.0.2".into()],
        ports: vec![port],
        action: egress::RouteAction::Allow as i32,
    }
}

/// The generation the one node acknowledged (0 before any) and how it
/// enforces.
async fn node_ack(client: &mut egress::egress_client::EgressClient<Channel>) -> Result<(u64, String), DevBenchError> {
    let plan = client
        .get_plan(egress::GetPlanRequest { project: PROJECT.into() })
        .await
        .map_err(rpc("GetPlan"))?
        .into_inner()
        .plan
        .unwrap_or_default();
    Ok(plan
        .node_acks
        .first()
        .map(|ack| {
            let how = egress::EgressEnforcement::try_from(ack.enforcement)
                .map_or_else(|_| ack.enforcement.to_string(), |e| e.as_str_name().to_string());
            (ack.generation, how)
        })
        .unwrap_or_default())
}

fn table(report: &Report) -> String {
    let latency = crate::leases::latency;
    let mut out = Series::table(
        &format!(
            "berth-bench egress-push: {} route edits, one at a time, on berth dev's node ({})",
            report.edits, report.enforcement
        ),
        &[
            ("edit in force on the node", &report.in_force),
            ("ApplyRoute answered", &report.apply),
            ("empty mTLS RPC (baseline)", &report.baseline),
        ],
    );
    out.push_str(&format!(
        "target: every edit acknowledged by the node, p99 < {:.0}ms {} ({} missed, p99 {})",
        report.target_p99_ms,
        crate::report::verdict(report.met),
        report.missed,
        latency(report.in_force.p99_ms)
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_each_series_and_the_verdict() {
        let report = Report {
            edits: 3,
            in_force: Series::of(vec![210.0, 230.0, 205.0]),
            missed: 0,
            apply: Series::of(vec![2.0, 3.0, 2.5]),
            baseline: Series::of(vec![0.4, 0.5]),
            enforcement: "EGRESS_ENFORCEMENT_ISOLATED".into(),
            target_p99_ms: TARGET_MS,
            met: true,
        };
        assert_eq!(report.in_force.p50_ms, Some(210.0));
        assert_eq!(report.in_force.max_ms, Some(230.0));
        let text = table(&report);
        let row = |label: &str| {
            text.lines().find(|l| l.starts_with(label)).map(|l| l[label.len()..].split_whitespace().collect::<Vec<_>>())
        };
        assert_eq!(row("edit in force on the node"), Some(vec!["3", "210.0ms", "230.0ms", "230.0ms"]));
        assert!(text.contains("p99 < 1000ms OK (0 missed"), "{text}");
        assert!(text.contains("EGRESS_ENFORCEMENT_ISOLATED"), "{text}");
    }
}
