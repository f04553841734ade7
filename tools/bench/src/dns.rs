//! `berth-bench dns`: how long a workload waits for a name from its
//! tenant's resolver, beside the same query sent straight to an upstream,
//! in one run.
//!
//! # What it measures
//! The agent's egress proxies ([`berth_agent::EgressProxies`], the code a
//! node runs) start in this process isolating replicas (so it needs root
//! on Linux, as a node does), in a temporary data directory, told of a
//! router; one replica of project `bench` is attached, which makes the
//! tenant's namespace and starts its resolver there, and a plan is applied
//! that lets the service reach `*.example.com` and names a loopback
//! upstream ([`berth_testkit::Resolver`] in this process, answering every
//! `A` query with one address).
//!
//! A client thread then opens one UDP socket on the host and, after
//! entering the tenant's namespace, one inside it: the socket a workload
//! would use. It sends `--queries` `A` queries on each of three paths,
//! after `--warmup` untimed ones, one at a time, the paths interleaved
//! round by round so that other work on the machine weighs on each alike:
//! - **direct**: `api.example.com` from the host straight to the upstream,
//!   the baseline;
//! - **internal**: `bench.bench.berth.internal` from inside the namespace
//!   to the tenant's resolver, answered on the node;
//! - **forwarded**: `api.example.com` from inside the namespace to the
//!   tenant's resolver, which checks it against the routes and relays the
//!   upstream's answer.
//!
//! A query counts only when its answer carries the query's id, `NOERROR`
//! and the expected address; anything else (a timeout after
//! [`QUERY_TIMEOUT`] included) is an error, counted and kept out of the
//! latencies. The clock runs from the send to the answer's arrival.
//! Reported per path: p50, p99, mean and queries per second (one at a
//! time), and what each resolver path adds over the direct one. The
//! target is judged on the internal path's p99.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use berth_agent::{EgressIsolation, EgressProxies, EgressSettings};
use berth_proto::egress::v1 as egress_proto;
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, RecordType};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::egress::{Overhead, PathFigures, overhead, path_figures, paths_table};
use crate::output::{OutputFormat, print_report, progress};
use crate::report::{Machine, Target, verdicts_line};

/// An internal name must resolve within this, p99, in milliseconds.
const TARGET_INTERNAL_P99_MS: f64 = 1.0;

/// What the upstream answers every `A` query with.
const UPSTREAM_ANSWER: Ipv4Addr = berth_testkit::RESOLVER_ANSWER;

/// Where the tenant's resolver listens inside its namespace.
const RESOLVER: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)), 53);

/// What a service's internal name resolves to.
const SERVICES_ADDR: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 54);

/// How long one query may wait for its answer.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

const PROJECT: &str = "bench";
const SERVICE: &str = "bench";
const LEASE: &str = "bench-dns-lease";
const INTERNAL_NAME: &str = "bench.bench.berth.internal.";
const EXTERNAL_NAME: &str = "api.example.com.";

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DnsArgs {
    /// Queries timed per path.
    #[arg(long, default_value_t = 20_000)]
    queries: u32,
    /// Untimed queries per path first.
    #[arg(long, default_value_t = 1_000)]
    warmup: u32,
    /// How the report is printed.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: OutputFormat,
}

/// Why the scenario could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DnsBenchError {
    #[error("the resolver runs inside a tenant's network namespace, which needs root on Linux")]
    NotRoot,
    #[error("setting up: {0}")]
    Setup(String),
    #[error("printing the report: {0}")]
    Print(String),
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
struct Report {
    scenario: &'static str,
    queries: u32,
    warmup: u32,
    /// How the proxies said they enforce egress (isolated, for this to mean anything).
    enforcement: String,
    /// Queries the upstream answered, warm-ups included.
    upstream_answered: u64,
    direct: PathFigures,
    internal: PathFigures,
    forwarded: PathFigures,
    internal_overhead: Overhead,
    forwarded_overhead: Overhead,
    targets: Vec<Target>,
    #[serde(flatten)]
    machine: Machine,
}

pub(crate) async fn run(args: DnsArgs) -> Result<(), DnsBenchError> {
    if !rustix::process::geteuid().is_root() {
        return Err(DnsBenchError::NotRoot);
    }
    let machine = Machine::before_run();
    let setup = |what: &str, error: &dyn std::fmt::Display| DnsBenchError::Setup(format!("{what}: {error}"));
    let upstream = berth_testkit::Resolver::start();
    let dir =
        tempfile::Builder::new().prefix("berth-bench-dns-").tempdir().map_err(|e| setup("a data directory", &e))?;
    let settings = EgressSettings {
        isolation: EgressIsolation::Required,
        // Only resolved, never dialled: the router is not what is measured.
        router: Some("127.0.0.1:9".into()),
        ..EgressSettings::new(dir.path())
    };
    let proxies =
        EgressProxies::start(settings, CancellationToken::new()).await.map_err(|e| setup("the egress proxies", &e))?;
    proxies.recovered().await;
    let measured = measure(&proxies, upstream.addr, &args).await;
    proxies.detach(LEASE).await;
    proxies.close().await;
    let (direct, internal, forwarded) = measured?;

    let internal_p99_ms = internal.p99_us.map(|us| us / 1000.0);
    let mut report = Report {
        scenario: "dns",
        queries: args.queries,
        warmup: args.warmup,
        enforcement: proxies.enforcement().to_string(),
        upstream_answered: upstream.asked().len() as u64,
        internal_overhead: overhead(&direct, &internal),
        forwarded_overhead: overhead(&direct, &forwarded),
        direct,
        internal,
        forwarded,
        targets: Vec::new(),
        machine,
    };
    report.targets = vec![Target {
        name: format!("internal name p99 <= {TARGET_INTERNAL_P99_MS}ms from the workload's namespace, no errors"),
        value: internal_p99_ms,
        met: internal_p99_ms.is_some_and(|p99| p99 <= TARGET_INTERNAL_P99_MS) && report.internal.errors == 0,
    }];
    print_report(args.output, &report, table).map_err(DnsBenchError::Print)
}

/// Attaches the replica, applies the plan, and times the three paths.
async fn measure(
    proxies: &EgressProxies,
    upstream: SocketAddr,
    args: &DnsArgs,
) -> Result<(PathFigures, PathFigures, PathFigures), DnsBenchError> {
    let setup = |what: &str, error: &dyn std::fmt::Display| DnsBenchError::Setup(format!("{what}: {error}"));
    let attachment = proxies.attach(LEASE, PROJECT, SERVICE).await.map_err(|e| setup("attaching a replica", &e))?;
    let namespace = attachment
        .namespace()
        .map(|name| Path::new("/run/netns").join(name))
        .ok_or_else(|| DnsBenchError::Setup("the replica got no network namespace".into()))?;
    proxies.apply(&node_state(upstream)).await.map_err(|e| setup("applying the plan", &e))?;
    progress(&format!("{} queries per path after {} untimed, from {}", args.queries, args.warmup, namespace.display()));
    let (queries, warmup) = (args.queries, args.warmup);
    tokio::task::spawn_blocking(move || client(&namespace, upstream, queries, warmup))
        .await
        .map_err(|e| setup("the client thread", &e))?
        .map_err(|e| setup("the client's sockets", &e))
}

/// A plan letting the service reach `*.example.com`, resolving through `upstream`.
fn node_state(upstream: SocketAddr) -> egress_proto::NodeEgressState {
    let destination = egress_proto::Destination {
        listener: "tls".into(),
        protocol: egress_proto::ListenerProtocol::HttpsConnect as i32,
        listener_port: 3128,
        hostname: "*.example.com".into(),
        ports: vec![443],
        route: "api".into(),
    };
    let service = egress_proto::ServiceEgress {
        service: SERVICE.into(),
        gateway: "default".into(),
        allowed: vec![destination],
        ..Default::default()
    };
    let plan = egress_proto::EgressPlan {
        project: PROJECT.into(),
        generation: 1,
        services: vec![service],
        dns: Some(egress_proto::DnsConfig { upstreams: vec![upstream.to_string()], search: Vec::new(), ndots: None }),
        ..Default::default()
    };
    egress_proto::NodeEgressState { generation: 1, plans: vec![plan] }
}

/// One path's socket, where it sends, what it asks, and what it must get.
struct PathClient {
    name: &'static str,
    socket: UdpSocket,
    to: SocketAddr,
    question: &'static str,
    expect: Ipv4Addr,
    samples_us: Vec<f64>,
    errors: u32,
    first_error: Option<String>,
}

impl PathClient {
    fn new(name: &'static str, to: SocketAddr, question: &'static str, expect: Ipv4Addr) -> std::io::Result<Self> {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
        socket.set_read_timeout(Some(QUERY_TIMEOUT))?;
        socket.connect(to)?;
        Ok(Self { name, socket, to, question, expect, samples_us: Vec::new(), errors: 0, first_error: None })
    }

    /// Sends one query with `id`; its latency when timed and answered right.
    fn ask(&mut self, id: u16, timed: bool) {
        let started = Instant::now();
        match self.exchange(id) {
            Ok(()) if timed => self.samples_us.push(started.elapsed().as_secs_f64() * 1e6),
            Ok(()) => {}
            Err(error) => {
                self.errors += u32::from(timed);
                if self.first_error.is_none() {
                    self.first_error = Some(format!("{}: {error}", self.to));
                }
            }
        }
    }

    fn exchange(&self, id: u16) -> Result<(), String> {
        let mut query = Message::query();
        query.metadata.id = id;
        query.metadata.recursion_desired = true;
        let name = Name::from_ascii(self.question).map_err(|e| e.to_string())?;
        query.add_query(Query::query(name, RecordType::A));
        self.socket.send(&query.to_vec().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        let mut buffer = [0u8; 1500];
        loop {
            let len = self.socket.recv(&mut buffer).map_err(|e| format!("no answer: {e}"))?;
            let answer = Message::from_vec(&buffer[..len]).map_err(|e| e.to_string())?;
            if answer.metadata.id != id {
                continue; // a late answer to an earlier query
            }
            if answer.metadata.response_code != ResponseCode::NoError {
                return Err(format!("answered {}", answer.metadata.response_code));
            }
            let got: Vec<_> = answer
                .answers
                .iter()
                .filter_map(|r| if let RData::A(A(ip)) = &r.data { Some(*ip) } else { None })
                .collect();
            return if got == [self.expect] { Ok(()) } else { Err(format!("answered {got:?}")) };
        }
    }

    fn figures(self, queries: u32) -> PathFigures {
        path_figures(self.name, queries, self.samples_us, self.errors, self.first_error)
    }
}

/// The client thread: the direct socket on the host, the others opened
/// after entering `namespace`; then the interleaved rounds.
fn client(
    namespace: &Path,
    upstream: SocketAddr,
    queries: u32,
    warmup: u32,
) -> std::io::Result<(PathFigures, PathFigures, PathFigures)> {
    let mut direct = PathClient::new("direct", upstream, EXTERNAL_NAME, UPSTREAM_ANSWER)?;
    enter(namespace)?;
    let mut internal = PathClient::new("internal", RESOLVER, INTERNAL_NAME, SERVICES_ADDR)?;
    let mut forwarded = PathClient::new("forwarded", RESOLVER, EXTERNAL_NAME, UPSTREAM_ANSWER)?;
    for round in 0..warmup.saturating_add(queries) {
        let timed = round >= warmup;
        let id = u16::try_from(round % 65_536).unwrap_or(0);
        let mut paths = [&mut direct, &mut internal, &mut forwarded];
        paths.rotate_left(usize::try_from(round % 3).unwrap_or(0));
        for path in paths {
            path.ask(id, timed);
        }
    }
    Ok((direct.figures(queries), internal.figures(queries), forwarded.figures(queries)))
}

/// Moves this thread into the network namespace at `path`, for good: the
/// thread is the bench's own and ends with the run.
fn enter(path: &Path) -> std::io::Result<()> {
    use std::os::fd::AsFd as _;
    let namespace = std::fs::File::open(path)?;
    rustix::thread::move_into_link_name_space(namespace.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))
        .map_err(std::io::Error::from)
}

fn table(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "dns: {} A queries per path after {} untimed, one at a time over UDP, the paths interleaved; {} CPUs, load {}",
        report.queries,
        report.warmup,
        report.machine.cpus,
        report.machine.load_average_before.map_or_else(|| "unknown".to_string(), |l| format!("{l:.2}")),
    );
    let _ = writeln!(
        out,
        "the agent's tenant resolver in this process, enforcement: {}; the upstream answered {}",
        report.enforcement, report.upstream_answered
    );
    paths_table(
        &mut out,
        &[&report.direct, &report.internal, &report.forwarded],
        &[
            ("the resolver, internal name", &report.internal_overhead),
            ("the resolver, forwarded name", &report.forwarded_overhead),
        ],
    );
    let _ = writeln!(out, "{}", verdicts_line(&report.targets, 3));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_path_answers_what_it_must_from_inside_the_namespace() {
        if !berth_testkit::runs_as_root("the resolver's network namespace") {
            return;
        }
        let upstream = berth_testkit::Resolver::start();
        let dir = tempfile::tempdir().unwrap();
        let settings = EgressSettings {
            isolation: EgressIsolation::Required,
            router: Some("127.0.0.1:9".into()),
            ..EgressSettings::new(dir.path())
        };
        let proxies = EgressProxies::start(settings, CancellationToken::new()).await.unwrap();
        let args = DnsArgs { queries: 20, warmup: 2, output: OutputFormat::Json };
        let measured = measure(&proxies, upstream.addr, &args).await;
        proxies.detach(LEASE).await;
        proxies.close().await;
        let (direct, internal, forwarded) = measured.unwrap();
        for path in [&direct, &internal, &forwarded] {
            assert_eq!((path.ok, path.errors), (20, 0), "{path:?}");
            assert!(path.p99_us.is_some(), "{path:?}");
        }
        // The direct and the forwarded queries reached the upstream; the
        // internal ones never left the node.
        assert_eq!(upstream.asked().len(), 2 * 22);
    }
}
