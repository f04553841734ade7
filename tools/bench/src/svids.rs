//! `berth-bench svids`: how fast identity signs workload certificates on a
//! real `berth dev`, each one the way a node gets a launch's first: a
//! launch registration from leases, then the signing, which has leases
//! spend it.
//!
//! # Expected flow
//! 1. `berth dev` starts as a process of its own on a scratch data
//!    directory; one bare lease is asked for, so its node holds one open
//!    lease to register launches of (a registration is good for one signing,
//!    and a lease may have many).
//! 2. Baseline in the same run: `grpc.health.v1.Health/Check` on identity
//!    (an empty mTLS RPC), `--baseline` times, one at a time.
//! 3. `--signings` signings by `--concurrency` workers presenting the dev
//!    node's own certificate: `NodeLeases/RegisterLaunch` then
//!    `Workloads/SignWorkloadCertificate` with a fresh P-256 CSR. The rate is
//!    signings over the wall time of the whole phase.
//! 4. The lease is released and `berth dev` stops; the data directory goes.
//!
//! Both stores are `berth dev`'s embedded SQLite; every registration and
//! every spend is a serializable write in leases' store.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1 as leases;
use berth_proto::types::v1::Capacity;
use berth_rpc::Channel;
use serde::Serialize;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::dev::{Dev, DevBenchError, Port, Series, rpc, setup};
use crate::egress::ms;
use crate::output::{OutputFormat, print_report};

/// The target: identity signs at least this many workload certificates a second.
const TARGET_PER_S: f64 = 1000.0;

/// Flags of `berth-bench svids`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SvidArgs {
    /// Workload certificates signed, each against a fresh registration.
    #[arg(long, default_value_t = 2000, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    signings: u32,
    /// Signings under way at once.
    #[arg(long, default_value_t = 16, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    concurrency: u32,
    /// Empty RPCs to identity timed as the baseline.
    #[arg(long, default_value_t = 200, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    baseline: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

#[derive(Debug, Serialize)]
struct Report {
    signings: u32,
    concurrency: u32,
    /// Signings a second over the whole phase.
    rate_per_s: f64,
    /// RegisterLaunch and the signing, as a node sees a launch's credential.
    register_and_sign: Series,
    /// The signing alone (leases spends the registration inside it).
    sign: Series,
    /// The empty mTLS RPC to identity.
    baseline: Series,
    target_per_s: f64,
    met: bool,
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: SvidArgs) -> Result<(), DevBenchError> {
    let dir = tempfile::tempdir().map_err(|e| setup("a scratch directory")(e.to_string()))?;
    let mut dev = Dev::start(dir.path(), &[]).await?;
    dev.ran_workloads();
    let outcome = measure(&dev, &args).await;
    dev.stop().await;
    let report = outcome?;
    print_report(args.output, &report, table).map_err(DevBenchError::Output)?;
    Ok(())
}

/// The dev node's own identity, as its agent keeps it.
fn node_credentials(data: &Path) -> Result<TlsCredentials, DevBenchError> {
    let dir = data.join("agent").join("identity");
    let material = TlsMaterial::from_files(dir.join("node.pem"), dir.join("node.key"), data.join("ca.pem"))
        .map_err(|e| setup("the dev node's identity")(e.to_string()))?;
    TlsCredentials::new(material).map_err(|e| setup("the dev node's identity")(e.to_string()).into())
}

/// One signing as a node does it; its latency in all and of the signing alone.
async fn sign_one(
    leases: &mut leases::node_leases_client::NodeLeasesClient<Channel>,
    workloads: &mut identity::workloads_client::WorkloadsClient<Channel>,
    lease: &leases::Lease,
) -> Result<(f64, f64), DevBenchError> {
    let (csr_pem, _key) = berth_mtls::generate_csr("bench").map_err(|e| setup("a CSR")(e.to_string()))?;
    let started = Instant::now();
    let register = leases::RegisterLaunchRequest {
        node_id: lease.node_id.clone(),
        lease_id: lease.lease_id.clone(),
        epoch: lease.epoch,
    };
    let registration = leases.register_launch(register).await.map_err(rpc("RegisterLaunch"))?.into_inner().registration;
    let signing = Instant::now();
    let request = identity::SignWorkloadCertificateRequest { node_id: lease.node_id.clone(), registration, csr_pem };
    workloads.sign_workload_certificate(request).await.map_err(rpc("SignWorkloadCertificate"))?;
    Ok((ms(started.elapsed()), ms(signing.elapsed())))
}

/// Measures on a started `berth dev`.
async fn measure(dev: &Dev, args: &SvidArgs) -> Result<Report, DevBenchError> {
    let mut requester = leases::leases_client::LeasesClient::new(dev.channel(Port::Leases)?);
    let ask = leases::RequestLeaseRequest {
        project: "default".into(),
        owner: "bench/svids".into(),
        idempotency_key: "svids".into(),
        resources: Some(Capacity { cpu_millis: 10, memory_bytes: 16 << 20 }),
        workload: Some(leases::Workload {
            command: "/bin/sleep".into(),
            args: vec!["3600".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    let lease = requester.request_lease(ask).await.map_err(rpc("RequestLease"))?.into_inner().lease;
    let lease = Arc::new(lease.ok_or_else(|| setup("the lease")("leases answered without it".into()))?);
    let outcome = signings(dev, args, &lease).await;
    let release = leases::ReleaseLeaseRequest { lease_id: lease.lease_id.clone(), ..Default::default() };
    if let Err(status) = requester.release_lease(release).await {
        eprintln!("bench: cannot release lease {}: {}", lease.lease_id, status.message());
    }
    outcome
}

async fn signings(dev: &Dev, args: &SvidArgs, lease: &Arc<leases::Lease>) -> Result<Report, DevBenchError> {
    let mut health = HealthClient::new(dev.channel(Port::Identity)?);
    let mut baseline = Vec::new();
    for _ in 0..args.baseline {
        let started = Instant::now();
        health.check(HealthCheckRequest { service: String::new() }).await.map_err(rpc("Health/Check"))?;
        baseline.push(ms(started.elapsed()));
    }

    let node = node_credentials(dev.data())?;
    let dial = |port: Port| {
        berth_rpc::connect(&format!("127.0.0.1:{}", dev.base() + port as u16), node.clone())
            .map_err(|e| DevBenchError::from(setup("a channel as the dev node")(e.to_string())))
    };
    let leases_channel = dial(Port::Leases)?;
    let identity_channel = dial(Port::Identity)?;
    // One warm-up signing: the channels connect and identity's leases client dials.
    let mut warm_leases = leases::node_leases_client::NodeLeasesClient::new(leases_channel.clone());
    let mut warm_workloads = identity::workloads_client::WorkloadsClient::new(identity_channel.clone());
    sign_one(&mut warm_leases, &mut warm_workloads, lease).await?;

    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..args.concurrency {
        let share = args.signings / args.concurrency + u32::from(worker < args.signings % args.concurrency);
        let mut leases = leases::node_leases_client::NodeLeasesClient::new(leases_channel.clone());
        let mut workloads = identity::workloads_client::WorkloadsClient::new(identity_channel.clone());
        let lease = Arc::clone(lease);
        workers.spawn(async move {
            let mut samples = Vec::with_capacity(share as usize);
            for _ in 0..share {
                samples.push(sign_one(&mut leases, &mut workloads, &lease).await?);
            }
            Ok::<_, DevBenchError>(samples)
        });
    }
    let (mut both, mut sign) = (Vec::new(), Vec::new());
    while let Some(done) = workers.join_next().await {
        let samples = done.map_err(|e| setup("a signing worker")(e.to_string()))??;
        for (all, alone) in samples {
            both.push(all);
            sign.push(alone);
        }
    }
    let elapsed = started.elapsed().max(Duration::from_micros(1));
    let rate_per_s = both.len() as f64 / elapsed.as_secs_f64();
    Ok(Report {
        signings: args.signings,
        concurrency: args.concurrency,
        rate_per_s,
        register_and_sign: Series::of(both),
        sign: Series::of(sign),
        baseline: Series::of(baseline),
        target_per_s: TARGET_PER_S,
        met: rate_per_s >= TARGET_PER_S,
    })
}

fn table(report: &Report) -> String {
    let mut out = Series::table(
        &format!(
            "berth-bench svids: {} workload certificates, {} at once, on berth dev (embedded store)",
            report.signings, report.concurrency
        ),
        &[
            ("register + sign (a launch's first)", &report.register_and_sign),
            ("sign (spends the registration)", &report.sign),
            ("empty mTLS RPC (baseline)", &report.baseline),
        ],
    );
    out.push_str(&format!(
        "target: ≥ {:.0} signed/s {} ({:.0}/s)",
        report.target_per_s,
        crate::report::verdict(report.met),
        report.rate_per_s
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_each_series_the_rate_and_the_verdict() {
        let report = Report {
            signings: 3,
            concurrency: 2,
            rate_per_s: 812.4,
            register_and_sign: Series::of(vec![2.0, 3.0, 4.0]),
            sign: Series::of(vec![1.0, 2.0, 3.0]),
            baseline: Series::of(vec![0.2, 0.3]),
            target_per_s: TARGET_PER_S,
            met: false,
        };
        let text = table(&report);
        assert!(text.lines().any(|l| l.starts_with("register + sign") && l.contains('3')), "{text}");
        assert!(text.lines().any(|l| l.starts_with("empty mTLS RPC (baseline)")), "{text}");
        assert!(text.ends_with("target: ≥ 1000 signed/s MISSED (812/s)"), "{text}");
    }
}
