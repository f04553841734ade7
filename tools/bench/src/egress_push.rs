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

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_proto::agent::v1 as agent;
use berth_proto::egress::v1 as egress;
use berth_rpc::Channel;
use serde::Serialize;
use tokio::io::AsyncBufReadExt as _;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::egress::{ms, percentile};
use crate::output::{OutputFormat, print_report};

/// How often the plan is read while an edit is waited for.
const POLL_EVERY: Duration = Duration::from_millis(2);

/// How long one edit may take before it counts as not acknowledged.
const EDIT_DEADLINE: Duration = Duration::from_secs(10);

/// How long `berth dev` may take to print its banner, and its node to be UP.
const START_DEADLINE: Duration = Duration::from_secs(90);

/// How long `berth dev` may take to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

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

/// Why the benchmark could not run to the end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PushBenchError {
    /// A step of the set-up failed.
    #[error("{what}: {detail}")]
    Setup {
        /// The step.
        what: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// A call to egress failed.
    #[error("{what}: {status}")]
    Rpc {
        /// The call.
        what: &'static str,
        /// What egress answered.
        status: String,
    },
    /// The report could not be written.
    #[error("cannot write the report: {0}")]
    Output(String),
}

fn setup(what: &'static str) -> impl Fn(String) -> PushBenchError {
    move |detail| PushBenchError::Setup { what, detail }
}

/// Latency figures of one series, in milliseconds.
#[derive(Debug, Clone, Serialize)]
struct Series {
    count: usize,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    max_ms: Option<f64>,
}

impl Series {
    fn of(mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        Self {
            count: samples.len(),
            p50_ms: percentile(&samples, 0.50),
            p99_ms: percentile(&samples, 0.99),
            max_ms: samples.last().copied(),
        }
    }
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
pub(crate) async fn run(args: EgressPushArgs) -> Result<(), PushBenchError> {
    let dir = tempfile::tempdir().map_err(|e| setup("a scratch directory")(e.to_string()))?;
    let exe = crate::process::sibling_binary("berth").map_err(|e| setup("the berth executable")(e.to_string()))?;
    let data = dir.path().join("data");
    let base = free_port_base().ok_or_else(|| setup("ports")("no five consecutive free ports".into()))?;
    let mut dev = Dev::start(&exe, &data, base).await?;
    let outcome = dev.measure(&args, dir.path()).await;
    dev.stop().await;
    let report = outcome?;
    print_report(args.output, &report, table).map_err(PushBenchError::Output)?;
    Ok(())
}

/// A `berth dev` process and how to reach it.
struct Dev {
    exe: PathBuf,
    data: PathBuf,
    base: u16,
    child: tokio::process::Child,
    deployed: bool,
}

impl Dev {
    async fn start(exe: &Path, data: &Path, base: u16) -> Result<Self, PushBenchError> {
        let mut child = tokio::process::Command::new(exe)
            .args(["dev", "--data-dir"])
            .arg(data)
            .args(["--port-base", &base.to_string()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| setup("starting berth dev")(e.to_string()))?;
        let stdout = child.stdout.take().ok_or_else(|| setup("berth dev")("no stdout".into()))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let banner = tokio::time::timeout(START_DEADLINE, async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("berth dev is running") {
                    return true;
                }
            }
            false
        })
        .await;
        if banner != Ok(true) {
            return Err(setup("berth dev")(format!("no banner within {START_DEADLINE:?}")));
        }
        // Keep reading so the process never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { exe: exe.to_path_buf(), data: data.to_path_buf(), base, child, deployed: false })
    }

    /// `berth ARGS` as the dev admin; its stdout, or why it failed.
    async fn cli(&self, args: &[&str]) -> Result<String, String> {
        let out = tokio::process::Command::new(&self.exe)
            .args(args)
            .env("BERTH_SERVER", format!("127.0.0.1:{}", self.base))
            .env("BERTH_DATA_DIR", &self.data)
            .env("RUST_LOG", "warn")
            .output()
            .await
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!("berth {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    fn channel(&self, offset: u16) -> Result<Channel, PushBenchError> {
        let material = TlsMaterial::from_files(
            self.data.join("admin.pem"),
            self.data.join("admin-key.pem"),
            self.data.join("ca.pem"),
        )
        .map_err(|e| setup("the dev admin identity")(e.to_string()))?;
        let credentials = TlsCredentials::new(material).map_err(|e| setup("the dev admin identity")(e.to_string()))?;
        berth_rpc::connect(&format!("127.0.0.1:{}", self.base + offset), credentials)
            .map_err(|e| setup("a channel to berth dev")(e.to_string()))
    }

    async fn measure(&mut self, args: &EgressPushArgs, scratch: &Path) -> Result<Report, PushBenchError> {
        self.deploy(scratch).await?;
        let channel = self.channel(3)?;
        let mut client = egress::egress_client::EgressClient::new(channel.clone());

        let mut health = HealthClient::new(channel);
        let mut baseline = Vec::new();
        for _ in 0..args.baseline {
            let started = Instant::now();
            health
                .check(HealthCheckRequest { service: String::new() })
                .await
                .map_err(|s| PushBenchError::Rpc { what: "Health/Check", status: s.to_string() })?;
            baseline.push(ms(started.elapsed()));
        }

        let (mut acked, mut enforcement) = node_ack(&mut client).await?;
        let (mut in_force, mut applies, mut missed) = (Vec::new(), Vec::new(), 0);
        for edit in 0..args.edits {
            let port = 20_000 + edit % 10_000;
            let started = Instant::now();
            client
                .apply_route(route(port))
                .await
                .map_err(|s| PushBenchError::Rpc { what: "ApplyRoute", status: s.to_string() })?;
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
    async fn deploy(&mut self, scratch: &Path) -> Result<(), PushBenchError> {
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            let listed = self.cli(&["capacity", "-o", "json"]).await.unwrap_or_default();
            let up = serde_json::from_str::<serde_json::Value>(&listed).ok().is_some_and(|parsed| {
                parsed["nodes"].as_array().into_iter().flatten().any(|n| n["state"] == "NODE_STATE_UP")
            });
            if up {
                break;
            }
            if Instant::now() > deadline {
                return Err(setup("the dev node")(format!("not UP within {START_DEADLINE:?}")));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let bundle = scratch.join("sleeper");
        std::fs::create_dir_all(&bundle).map_err(|e| setup("the bundle")(e.to_string()))?;
        std::fs::write(bundle.join(berth_bundle::SPEC_FILE), "entrypoint = \"/bin/sleep\"\nargs = [\"86400\"]\n")
            .map_err(|e| setup("the bundle")(e.to_string()))?;
        let reference = format!("oci:{}:sleeper", scratch.join("oci").display());
        let bundle_dir = bundle.display().to_string();
        self.cli(&["bundle", "push", &bundle_dir, &reference]).await.map_err(setup("pushing the bundle"))?;

        let write = |name: &str, value: serde_json::Value| -> Result<String, PushBenchError> {
            let path = scratch.join(name);
            std::fs::write(&path, value.to_string()).map_err(|e| setup("a spec file")(e.to_string()))?;
            Ok(path.display().to_string())
        };
        let gateway = write(
            "gateway.json",
            serde_json::json!({"name": "default", "listeners": [{"name": "http", "protocol": "HTTP", "port": 3128}]}),
        )?;
        self.cli(&["egress", "gateway", "apply", "-f", &gateway]).await.map_err(setup("the gateway"))?;
        let spec = write(
            "service.json",
            serde_json::json!({
                "bundle": {"reference": reference},
                "replicas": 1,
                "resources": {"cpu_millis": 10, "memory_bytes": 16_777_216},
            }),
        )?;
        self.deployed = true;
        self.cli(&["service", "apply", "-f", &spec, "--name", SERVICE, "--wait"])
            .await
            .map_err(setup("the service"))?;

        // The first plan reaches the node once it hosts the tenant.
        let mut client = egress::egress_client::EgressClient::new(self.channel(3)?);
        client
            .apply_route(route(19_999))
            .await
            .map_err(|s| PushBenchError::Rpc { what: "ApplyRoute", status: s.to_string() })?;
        let deadline = Instant::now() + START_DEADLINE;
        while node_ack(&mut client).await?.0 == 0 {
            if Instant::now() > deadline {
                return Err(setup("the dev node's first plan")(format!("no ack within {START_DEADLINE:?}")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Deletes the service and waits for the node to have stopped its
    /// replica, so none outlives the run, then stops `berth dev`.
    async fn stop(&mut self) {
        if self.deployed {
            if let Err(error) = self.cli(&["service", "delete", SERVICE]).await {
                eprintln!("bench: cannot delete the service: {error}");
            }
            // The lease ends at once; the node then stops the replica.
            if let Ok(channel) = self.channel(4) {
                let mut agent = agent::agent_client::AgentClient::new(channel);
                let deadline = Instant::now() + Duration::from_secs(60);
                while Instant::now() < deadline {
                    let listed = agent.list_instances(agent::ListInstancesRequest::default()).await;
                    if listed.is_ok_and(|r| r.into_inner().instances.is_empty()) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        // SIGTERM first: the node closes its proxies and removes the
        // tenant's network namespace on the way out.
        if let Some(pid) =
            self.child.id().and_then(|id| i32::try_from(id).ok()).and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        if tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await.is_err() {
            eprintln!("bench: berth dev did not exit {STOP_TIMEOUT:?} after SIGTERM; killing it");
            let _ = self.child.kill().await;
        }
    }
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
async fn node_ack(client: &mut egress::egress_client::EgressClient<Channel>) -> Result<(u64, String), PushBenchError> {
    let plan = client
        .get_plan(egress::GetPlanRequest { project: PROJECT.into() })
        .await
        .map_err(|s| PushBenchError::Rpc { what: "GetPlan", status: s.to_string() })?
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

/// Five consecutive free loopback ports (the first of them).
fn free_port_base() -> Option<u16> {
    for _ in 0..50 {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
        let base = probe.local_addr().ok()?.port();
        drop(probe);
        if base > 65_000 {
            continue;
        }
        if (0..5).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok()) {
            return Some(base);
        }
    }
    None
}

fn table(report: &Report) -> String {
    let latency = crate::leases::latency;
    let row = |name: &str, series: &Series| {
        format!(
            "{name:<28}{:>8}{:>12}{:>12}{:>12}\n",
            series.count,
            latency(series.p50_ms),
            latency(series.p99_ms),
            latency(series.max_ms)
        )
    };
    let mut out = format!(
        "berth-bench egress-push: {} route edits, one at a time, on berth dev's node ({})\n",
        report.edits, report.enforcement
    );
    out.push_str(&format!("{:<28}{:>8}{:>12}{:>12}{:>12}\n", "", "count", "p50", "p99", "max"));
    out.push_str(&row("edit in force on the node", &report.in_force));
    out.push_str(&row("ApplyRoute answered", &report.apply));
    out.push_str(&row("empty mTLS RPC (baseline)", &report.baseline));
    out.push_str(&format!(
        "target: every edit acknowledged by the node, p99 < {:.0}ms {} ({} missed, p99 {})",
        report.target_p99_ms,
        if report.met { "OK" } else { "MISSED" },
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
