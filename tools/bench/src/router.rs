//! `berth-bench router`: what the data plane adds to a request, on a real
//! `berth dev` and a `berth-router` process of its own.
//!
//! # Expected flow
//! 1. `berth dev` starts (see [`crate::dev`]); a router identity is issued
//!    with `berth cert issue --kind router`, and `berth-router` starts from
//!    the binary beside this one, following the dev mesh.
//! 2. A bundle holding this executable, run as its `echo-server` (an HTTP
//!    server answering `GET /` with its revision, HTTP/1.1 and HTTP/2 with
//!    prior knowledge), is applied as two one-replica services: `echo`,
//!    whose port is named `http` (the router speaks HTTP/1.1 to it), and
//!    `echo-h2`, whose port is named `h2c` (HTTP/2).
//! 3. Load over `--connections` connections with one request in flight on
//!    each, measured for `--duration` in `--rounds` turns (each after
//!    `--warmup`), the three ways taking turns: straight to the
//!    replica (connected inside its network namespace, as its agent does),
//!    then through the router by host name, in HTTP/1.1 (`echo`) and in
//!    HTTP/2 (`echo-h2`), then through two bare byte relays, each a process
//!    of this executable (`berth-bench relay`) that copies each connection's
//!    bytes to the next hop and parses nothing: the floor of any design that
//!    puts two processes between a client and a replica, as the router and
//!    the agent are; and then through two such relays whose hop between
//!    them is mutual TLS with the mesh's own configuration (the second
//!    serving a service certificate, the first dialling as a router), the
//!    floor of any design whose two processes speak mTLS to each other, as
//!    the issue asks of the router and the agent. Taking turns, the four
//!    share a machine whose speed drifts alike. Over each measured window
//!    the CPU time of the router and of `berth dev` (whose node agent the
//!    routed requests cross), and of the two relays, is read from `/proc`,
//!    and divided by the requests that went through them: what each hop
//!    costs a request.
//! 4. Route changes: `echo` gets a second revision, then `--changes`
//!    `SetTraffic` calls swap its two revisions between 100% and 0%; each
//!    is timed until `GetService` (polled every [`POLL_EVERY`]) shows every
//!    router serving the new route generation (which a router acknowledges
//!    only once it routes by it).
//! 5. The router's resident memory with the two services, then after
//!    `--services` more (no replicas) are applied and it has followed them.
//! 6. The router stops, then `berth dev`, once every replica is gone.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use berth_mtls::{TlsCredentials, TlsMaterial};
use berth_proto::agent::v1 as agent;
use berth_proto::revisions::v1;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};

use crate::dev::{Dev, DevBenchError, Port, Series, rpc, setup};
use crate::egress::ms;
use crate::heartbeats::{parse_duration, parse_positive_duration};
use crate::leases::latency;
use crate::load::{Figures, Samples, Window};
use crate::output::{OutputFormat, print_report, progress};
use crate::process::{ChildProcess, free_loopback_port, sibling_binary};
use crate::procfs::read_cpu_time;

/// How often `GetService` is read while a route change is waited for.
const POLL_EVERY: Duration = Duration::from_millis(2);

/// How long one route change may take before it counts as missed.
const CHANGE_DEADLINE: Duration = Duration::from_secs(10);

/// The domain the router names services under.
const DOMAIN: &str = "berth.localhost";

/// Targets: what the router may add at p50 and p99, the share of the
/// direct rate it must keep, a route change in force on every router at
/// p99, and its memory with 1,000 services.
const TARGET_ADDED_P50_MS: f64 = 1.0;
const TARGET_ADDED_P99_MS: f64 = 3.0;
const TARGET_RATE_SHARE: f64 = 0.5;
const TARGET_CHANGE_P99_MS: f64 = 500.0;
const TARGET_RSS_MIB: f64 = 40.0;

/// Flags of `berth-bench router`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RouterArgs {
    /// Client connections of each load, one request in flight on each.
    #[arg(long, default_value_t = 16, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    connections: u32,
    /// How long each load is measured, over all its rounds.
    #[arg(long, default_value = "6s", value_name = "DURATION", value_parser = parse_positive_duration)]
    duration: Duration,
    /// Turns each load is measured in, direct, routed and the two relayed
    /// ways taking turns.
    #[arg(long, default_value_t = 3, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// How long each turn of a load runs before it is measured.
    #[arg(long, default_value = "1s", value_name = "DURATION", value_parser = parse_duration)]
    warmup: Duration,
    /// Route changes timed, one after the other.
    #[arg(long, default_value_t = 50, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    changes: u32,
    /// Services (without replicas) applied before the router's memory is
    /// read a second time.
    #[arg(long, default_value_t = 1000, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=10_000))]
    services: u32,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

/// One protocol's loads, direct, routed and through the bare relays.
#[derive(Debug, Serialize)]
struct Protocol {
    direct: Figures,
    routed: Figures,
    relayed: Figures,
    /// Through the two relays with mutual TLS between them.
    mtls_relayed: Figures,
    /// Routed p50 less direct p50.
    added_p50_ms: Option<f64>,
    /// Routed p99 less direct p99.
    added_p99_ms: Option<f64>,
    /// Routed rate over direct rate.
    rate_share: Option<f64>,
    /// Relayed rate over direct rate: what two processes between client
    /// and replica leave at the least work each can do.
    relay_share: Option<f64>,
    /// The same through the two relays with mutual TLS between them: what
    /// two processes that speak mTLS to each other leave, at the least.
    mtls_relay_share: Option<f64>,
    /// CPU time per routed request, microseconds: the router's, then the
    /// node agent's (`berth dev`'s, which holds it); `None` where `/proc`
    /// could not be read.
    routed_us_per_request: Option<[f64; 2]>,
    /// CPU time per relayed request of each of the two relays.
    relayed_us_per_request: Option<[f64; 2]>,
    /// CPU time per request of each of the two mTLS relays.
    mtls_relayed_us_per_request: Option<[f64; 2]>,
}

impl Protocol {
    fn of([direct, routed, relayed, mtls_relayed]: [Figures; 4], cpu: [Option<[Duration; 2]>; 3]) -> Self {
        let less = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a - b);
        let share = |of: &Figures| (direct.rate_per_s > 0.0).then(|| of.rate_per_s / direct.rate_per_s);
        let per_request = |used: Option<[Duration; 2]>, of: &Figures| {
            let requests = of.calls + of.errors;
            used.filter(|_| requests > 0).map(|used| used.map(|time| time.as_secs_f64() * 1e6 / requests as f64))
        };
        let [routed_cpu, relayed_cpu, mtls_relayed_cpu] = cpu;
        Protocol {
            added_p50_ms: less(routed.p50_ms, direct.p50_ms),
            added_p99_ms: less(routed.p99_ms, direct.p99_ms),
            rate_share: share(&routed),
            relay_share: share(&relayed),
            mtls_relay_share: share(&mtls_relayed),
            routed_us_per_request: per_request(routed_cpu, &routed),
            relayed_us_per_request: per_request(relayed_cpu, &relayed),
            mtls_relayed_us_per_request: per_request(mtls_relayed_cpu, &mtls_relayed),
            direct,
            routed,
            relayed,
            mtls_relayed,
        }
    }

    fn met(&self) -> bool {
        self.added_p50_ms.is_some_and(|ms| ms <= TARGET_ADDED_P50_MS)
            && self.added_p99_ms.is_some_and(|ms| ms <= TARGET_ADDED_P99_MS)
            && self.rate_share.is_some_and(|share| share >= TARGET_RATE_SHARE)
            && self.routed.errors == 0
    }
}

#[derive(Debug, Serialize)]
struct Report {
    http1: Protocol,
    http2: Protocol,
    /// `SetTraffic` to every router serving the new generation.
    route_change: Series,
    /// Changes not served by every router within [`CHANGE_DEADLINE`].
    missed_changes: u32,
    /// How many routers acknowledged (the bench's and `berth dev`'s own).
    routers: usize,
    /// The router's resident memory with the two measured services.
    rss_mib: Option<f64>,
    /// Services applied before the second reading.
    services: u32,
    /// Its resident memory then.
    rss_many_mib: Option<f64>,
    met: bool,
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: RouterArgs) -> Result<(), DevBenchError> {
    let dir = tempfile::tempdir().map_err(|e| setup("a scratch directory")(e.to_string()))?;
    progress("starting berth dev");
    let mut dev = Dev::start(dir.path(), &[]).await?;
    let outcome = async {
        let router = Router::start(&dev, dir.path()).await?;
        let measured = measure(&mut dev, &router, &args, dir.path()).await;
        router.process.stop().await;
        measured
    }
    .await;
    dev.stop().await;
    let report = outcome?;
    print_report(args.output, &report, table).map_err(DevBenchError::Output)?;
    Ok(())
}

/// The `berth-router` process under test.
struct Router {
    process: ChildProcess,
    http: SocketAddr,
}

impl Router {
    async fn start(dev: &Dev, scratch: &Path) -> Result<Self, DevBenchError> {
        let pki = scratch.join("router-pki");
        std::fs::create_dir_all(&pki).map_err(|e| setup("the router's identity")(e.to_string()))?;
        let file = |name: &str| pki.join(name).display().to_string();
        let (cert, key, ca) = (file("router.pem"), file("router-key.pem"), file("ca.pem"));
        let issue = ["cert", "issue", "--kind", "router", "--name", "bench"];
        dev.cli(&[&issue[..], &["--cert-out", &cert, "--key-out", &key, "--ca-out", &ca]].concat())
            .await
            .map_err(setup("issuing the router's identity"))?;
        let binary = sibling_binary("berth-router").map_err(|e| setup("the berth-router executable")(e.to_string()))?;
        let port = |what: &'static str| free_loopback_port().map_err(|e| setup(what)(e.to_string()));
        let (grpc, http) = (port("a port for the router")?, port("a port for the router")?);
        let dial = |offset: u16| SocketAddr::from((Ipv4Addr::LOCALHOST, dev.base() + offset)).to_string();
        let mut command = tokio::process::Command::new(&binary);
        command
            .args(["--listen", &grpc.to_string(), "--http-listen", &http.to_string(), "--domain", DOMAIN])
            .args(["--identity-addr", &dial(0), "--revisions-addr", &dial(1), "--leases-addr", &dial(2)])
            .args(["--instance", "bench", "--tls-cert", &cert, "--tls-key", &key, "--ca-file", &ca])
            .env("RUST_LOG", "warn");
        let process = ChildProcess::spawn("berth-router", &binary, command, scratch.join("router.log"))
            .map_err(|e| setup("starting berth-router")(e.to_string()))?;
        process.wait_until_serving(grpc, &dev.admin()?).await.map_err(|e| setup("berth-router")(e.to_string()))?;
        Ok(Router { process, http })
    }
}

/// The echo services, the loads, the route changes and the memory.
async fn measure(dev: &mut Dev, router: &Router, args: &RouterArgs, scratch: &Path) -> Result<Report, DevBenchError> {
    progress("deploying the echo services");
    let reference = push_echo(dev, scratch).await?;
    for (name, port_name) in [("echo", "http"), ("echo-h2", "h2c")] {
        dev.apply(scratch, name, &echo_spec(&reference, port_name, "1")).await?;
    }
    let http1_direct = replica_target(dev, "echo").await?;
    let http2_direct = replica_target(dev, "echo-h2").await?;
    let routed = |service: &str| Target::Routed { addr: router.http, host: format!("{service}.default.{DOMAIN}") };
    for target in [routed("echo"), routed("echo-h2")] {
        await_routed(&target).await?;
    }

    let routed_by = [router.process.pid(), dev.pid().unwrap_or_default()];
    let tls = RelayTls::issue(dev, scratch).await?;
    let http1 = loads(args, "HTTP/1.1", &http1_direct, (routed("echo"), routed_by), false, &tls, scratch).await?;
    let http2 = loads(args, "HTTP/2", &http2_direct, (routed("echo-h2"), routed_by), true, &tls, scratch).await?;

    progress("route changes");
    dev.apply(scratch, "echo", &echo_spec(&reference, "http", "2")).await?;
    let mut services = v1::services_client::ServicesClient::new(dev.channel(Port::Revisions)?);
    let (mut changes, mut missed, mut routers) = (Vec::new(), 0, 0);
    for change in 0..args.changes {
        let (first, second) = if change % 2 == 0 { (0, 100) } else { (100, 0) };
        let targets = vec![share("echo-00001", first), share("echo-00002", second)];
        let started = Instant::now();
        let request = v1::SetTrafficRequest { name: "echo".into(), targets, ..Default::default() };
        let set = services.set_traffic(request).await.map_err(rpc("SetTraffic"))?.into_inner();
        let generation = set.service.and_then(|s| s.status).map_or(0, |s| s.route_generation);
        let served = loop {
            let request = v1::GetServiceRequest { name: "echo".into(), ..Default::default() };
            let got = services.get_service(request).await.map_err(rpc("GetService"))?.into_inner();
            let acks = got.service.and_then(|s| s.status).map(|s| s.routers).unwrap_or_default();
            if !acks.is_empty() && acks.iter().all(|ack| ack.generation >= generation) {
                routers = acks.len();
                break true;
            }
            if started.elapsed() > CHANGE_DEADLINE {
                break false;
            }
            tokio::time::sleep(POLL_EVERY).await;
        };
        if served {
            changes.push(ms(started.elapsed()));
        } else {
            missed += 1;
        }
    }

    let rss_mib = router.process.memory().map(|m| m.rss_kib as f64 / 1024.0);
    progress(&format!("applying {} services", args.services));
    apply_many(&mut services, &reference, args.services).await?;
    // The router follows them by watch; give it a moment to hold them all.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_many_mib = router.process.memory().map(|m| m.rss_kib as f64 / 1024.0);

    let route_change = Series::of(changes);
    let met = http1.met()
        && http2.met()
        && missed == 0
        && route_change.p99_ms.is_some_and(|p99| p99 <= TARGET_CHANGE_P99_MS)
        && rss_many_mib.is_some_and(|mib| mib <= TARGET_RSS_MIB);
    Ok(Report {
        http1,
        http2,
        route_change,
        missed_changes: missed,
        routers,
        rss_mib,
        services: args.services,
        rss_many_mib,
        met,
    })
}

/// One protocol's loads: straight to the replica, through the router (the
/// target, and the router's and the agent's process ids), through two byte
/// relays and through two relays with mutual TLS between them, each
/// measured in `--rounds` turns, the four taking turns so that a machine
/// whose speed drifts shares the drift alike.
async fn loads(
    args: &RouterArgs,
    protocol: &str,
    direct: &Target,
    (routed, routed_by): (Target, [u32; 2]),
    http2: bool,
    tls: &RelayTls,
    scratch: &Path,
) -> Result<Protocol, DevBenchError> {
    let relays = Relays::start(direct, None, scratch).await?;
    let mtls_relays = match Relays::start(direct, Some(tls), scratch).await {
        Ok(started) => started,
        Err(error) => {
            relays.stop().await;
            return Err(error);
        }
    };
    let ways = [
        (direct.clone(), None),
        (routed, Some(routed_by)),
        (relays.target.clone(), Some(relays.pids())),
        (mtls_relays.target.clone(), Some(mtls_relays.pids())),
    ];
    let slice = args.duration / args.rounds;
    let mut samples: [Samples; 4] = Default::default();
    let mut cpu: [Option<[Duration; 2]>; 4] =
        [None, Some([Duration::ZERO; 2]), Some([Duration::ZERO; 2]), Some([Duration::ZERO; 2])];
    for round in 1..=args.rounds {
        progress(&format!(
            "load: {protocol}, round {round} of {}: direct, routed, relayed, relayed over mTLS",
            args.rounds
        ));
        for ((target, pids), (samples, cpu)) in ways.iter().zip(samples.iter_mut().zip(cpu.iter_mut())) {
            let window = Window::after(Instant::now(), args.warmup, slice);
            let measuring = pids.map(|pids| cpu_over(pids, window));
            samples.merge(load(target, http2, args.connections, window).await);
            let used = match measuring {
                Some(measuring) => measuring.await.ok().flatten(),
                None => None,
            };
            *cpu = cpu.zip(used).map(|(sum, used)| [sum[0] + used[0], sum[1] + used[1]]);
        }
    }
    relays.stop().await;
    mtls_relays.stop().await;
    let figures = samples.map(|samples| samples.figures(slice * args.rounds, args.connections));
    Ok(Protocol::of(figures, [cpu[1], cpu[2], cpu[3]]))
}

/// The CPU time processes `pids` use over `window`, read at its edges.
fn cpu_over(pids: [u32; 2], window: Window) -> tokio::task::JoinHandle<Option<[Duration; 2]>> {
    tokio::spawn(async move {
        let read = || -> Option<[Duration; 2]> { Some([read_cpu_time(pids[0])?, read_cpu_time(pids[1])?]) };
        tokio::time::sleep_until(window.start.into()).await;
        let before = read()?;
        tokio::time::sleep_until(window.end.into()).await;
        let after = read()?;
        Some([after[0].saturating_sub(before[0]), after[1].saturating_sub(before[1])])
    })
}

fn share(revision: &str, percent: u32) -> v1::TrafficTarget {
    v1::TrafficTarget { revision: revision.into(), percent, ..Default::default() }
}

/// Pushes a bundle holding this executable, run as its `echo-server`.
async fn push_echo(dev: &Dev, scratch: &Path) -> Result<String, DevBenchError> {
    let bundle = scratch.join("echo");
    std::fs::create_dir_all(&bundle).map_err(|e| setup("the bundle")(e.to_string()))?;
    let me = std::env::current_exe().map_err(|e| setup("this executable")(e.to_string()))?;
    std::fs::copy(&me, bundle.join("berth-bench")).map_err(|e| setup("the bundle")(e.to_string()))?;
    Ok(dev.push_bundle(scratch, "echo", "entrypoint = \"berth-bench\"\nargs = [\"echo-server\"]\n").await?)
}

/// A one-replica service of the echo bundle whose port is named `port_name`.
fn echo_spec(reference: &str, port_name: &str, edition: &str) -> serde_json::Value {
    serde_json::json!({
        "bundle": {"reference": reference},
        "replicas": 1,
        "ports": [{"name": port_name, "port": 8080}],
        "env": {"EDITION": edition},
        "resources": {"cpu_millis": 500, "memory_bytes": 134_217_728},
    })
}

/// `count` services of the echo bundle without replicas, eight at a time.
async fn apply_many(
    services: &mut v1::services_client::ServicesClient<berth_rpc::Channel>,
    reference: &str,
    count: u32,
) -> Result<(), DevBenchError> {
    let mut pending: tokio::task::JoinSet<Result<(), tonic::Status>> = tokio::task::JoinSet::new();
    for n in 0..count {
        if pending.len() >= 8
            && let Some(done) = pending.join_next().await
        {
            done.map_err(|e| setup("applying services")(e.to_string()))?.map_err(rpc("ApplyService"))?;
        }
        let mut client = services.clone();
        let template = v1::ServiceTemplate {
            bundle: Some(berth_proto::types::v1::BundleRef { reference: reference.into(), ..Default::default() }),
            replicas: Some(0),
            ..Default::default()
        };
        let request =
            v1::ApplyServiceRequest { name: format!("idle-{n}"), template: Some(template), ..Default::default() };
        pending.spawn(async move { client.apply_service(request).await.map(drop) });
    }
    while let Some(done) = pending.join_next().await {
        done.map_err(|e| setup("applying services")(e.to_string()))?.map_err(rpc("ApplyService"))?;
    }
    Ok(())
}

/// Where a load sends its requests.
#[derive(Debug, Clone)]
enum Target {
    /// Straight to a replica's port, connected inside its network namespace.
    Direct { namespace: PathBuf, port: u16 },
    /// To the router, naming the service in the host.
    Routed { addr: SocketAddr, host: String },
    /// To the first of two byte relays in front of a replica's port.
    Relayed { addr: SocketAddr, port: u16 },
}

impl Target {
    async fn connect(&self) -> std::io::Result<TcpStream> {
        let stream = match self {
            Target::Direct { namespace, port } => {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, *port));
                berth_agent::connect_in_namespace(namespace.clone(), addr, Duration::from_secs(2)).await?
            }
            Target::Routed { addr, .. } | Target::Relayed { addr, .. } => TcpStream::connect(addr).await?,
        };
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    fn host(&self) -> String {
        match self {
            Target::Direct { port, .. } | Target::Relayed { port, .. } => format!("localhost:{port}"),
            Target::Routed { host, .. } => host.clone(),
        }
    }
}

/// The one replica of `service`: its port, and its network namespace.
async fn replica_target(dev: &Dev, service: &str) -> Result<Target, DevBenchError> {
    let mut agent = agent::agent_client::AgentClient::new(dev.channel(Port::Agent)?);
    let listed =
        agent.list_instances(agent::ListInstancesRequest::default()).await.map_err(rpc("ListInstances"))?.into_inner();
    let instance = listed
        .instances
        .into_iter()
        .find(|i| i.service == service && i.pid != 0 && i.port != 0)
        .ok_or_else(|| setup("the replica")(format!("no running replica of {service} on the node")))?;
    let port = u16::try_from(instance.port).map_err(|e| setup("the replica")(e.to_string()))?;
    Ok(Target::Direct { namespace: PathBuf::from(format!("/proc/{}/ns/net", instance.pid)), port })
}

/// Waits until the router answers 200 for `target`.
async fn await_routed(target: &Target) -> Result<(), DevBenchError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answered = async {
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(target.connect().await?))
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(connection);
            let response = sender.send_request(get(target)).await.map_err(std::io::Error::other)?;
            Ok::<StatusCode, std::io::Error>(response.status())
        }
        .await;
        if matches!(answered, Ok(StatusCode::OK)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(setup("the router")(format!("{} not served within 30s: {answered:?}", target.host())).into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn get(target: &Target) -> Request<Empty<Bytes>> {
    let host = target.host();
    Request::get(format!("http://{host}/")).header(hyper::header::HOST, host).body(Empty::new()).unwrap_or_default()
}

/// `connections` clients sending one request after another to `target`
/// until `window` ends; what answered inside it.
async fn load(target: &Target, http2: bool, connections: u32, window: Window) -> Samples {
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let target = target.clone();
        clients.spawn(async move {
            let mut samples = Samples::default();
            while Instant::now() < window.end {
                match connection_run(&target, http2, window, &mut samples).await {
                    Ok(()) => {}
                    Err(_) if Instant::now() >= window.end => {}
                    Err(_) => {
                        samples.error();
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            samples
        });
    }
    let mut all = Samples::default();
    while let Some(done) = clients.join_next().await {
        if let Ok(samples) = done {
            all.merge(samples);
        }
    }
    all
}

/// One connection's requests until `window` ends or one fails.
async fn connection_run(target: &Target, http2: bool, window: Window, samples: &mut Samples) -> Result<(), String> {
    let io = TokioIo::new(target.connect().await.map_err(|e| e.to_string())?);
    macro_rules! requests {
        ($sender:expr) => {
            while Instant::now() < window.end {
                let sent = Instant::now();
                let response = $sender.send_request(get(target)).await.map_err(|e| e.to_string())?;
                let ok = response.status() == StatusCode::OK;
                let body = response.into_body().collect().await.map_err(|e| e.to_string())?;
                let answered = Instant::now();
                if window.contains(answered) {
                    if ok && !body.to_bytes().is_empty() { samples.ok(answered - sent) } else { samples.error() }
                }
            }
        };
    }
    if http2 {
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        requests!(sender);
    } else {
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await.map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        requests!(sender);
    }
    Ok(())
}

/// The certificates of two relays that speak mutual TLS to each other, as
/// the mesh's: each a certificate, its key and the CA bundle (files).
struct RelayTls {
    /// The second relay's, which accepts: a service's, naming `127.0.0.1`.
    server: [String; 3],
    /// The first relay's, which dials: a router's.
    client: [String; 3],
}

impl RelayTls {
    /// Issues both from `berth dev`'s CA.
    async fn issue(dev: &Dev, scratch: &Path) -> Result<Self, DevBenchError> {
        let pki = scratch.join("relay-pki");
        std::fs::create_dir_all(&pki).map_err(|e| setup("the relays' certificates")(e.to_string()))?;
        let mut issued = Vec::new();
        for kind in ["service", "router"] {
            let file = |name: &str| pki.join(format!("{kind}-{name}")).display().to_string();
            let files = [file("cert.pem"), file("key.pem"), file("ca.pem")];
            let issue = ["cert", "issue", "--kind", kind, "--name", "relay"];
            let out = ["--cert-out", &files[0], "--key-out", &files[1], "--ca-out", &files[2]];
            dev.cli(&[&issue[..], &out[..]].concat()).await.map_err(setup("issuing a relay's certificate"))?;
            issued.push(files);
        }
        let client = issued.pop().ok_or_else(|| setup("the relays' certificates")("none issued".into()))?;
        let server = issued.pop().ok_or_else(|| setup("the relays' certificates")("none issued".into()))?;
        Ok(RelayTls { server, client })
    }
}

/// Two `berth-bench relay` processes in front of a replica: the first
/// relays to the second, the second into the replica's namespace.
struct Relays {
    first: ChildProcess,
    second: ChildProcess,
    target: Target,
}

impl Relays {
    /// Starts the two, with mutual TLS between them when `tls` is given.
    async fn start(direct: &Target, tls: Option<&RelayTls>, scratch: &Path) -> Result<Self, DevBenchError> {
        let Target::Direct { namespace, port } = direct else {
            return Err(setup("the relays")("they relay to a replica's port".to_string()).into());
        };
        let port_for = |what: &'static str| free_loopback_port().map_err(|e| setup(what)(e.to_string()));
        let (first_addr, second_addr) = (port_for("a port for a relay")?, port_for("a port for a relay")?);
        let me = std::env::current_exe().map_err(|e| setup("this executable")(e.to_string()))?;
        let spawn =
            |listen: SocketAddr, to: SocketAddr, namespace: Option<&Path>, tls: Option<(&str, &[String; 3])>| {
                let mut command = tokio::process::Command::new(&me);
                command.args(["relay", "--listen", &listen.to_string(), "--to", &to.to_string()]);
                if let Some(namespace) = namespace {
                    command.arg("--namespace").arg(namespace);
                }
                if let Some((flag, files)) = tls {
                    command.arg(flag).args(files);
                }
                let log = format!("relay-{}{}.log", listen.port(), if tls.is_some() { "-mtls" } else { "" });
                ChildProcess::spawn("berth-bench relay", &me, command, scratch.join(log))
                    .map_err(|e| setup("starting a relay")(e.to_string()))
            };
        let replica = SocketAddr::from((Ipv4Addr::LOCALHOST, *port));
        let second = spawn(second_addr, replica, Some(namespace.as_path()), tls.map(|t| ("--tls-accept", &t.server)))?;
        let first = spawn(first_addr, second_addr, None, tls.map(|t| ("--tls-connect", &t.client)))?;
        let relays = Relays { first, second, target: Target::Relayed { addr: first_addr, port: *port } };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(first_addr).await.is_err() || TcpStream::connect(second_addr).await.is_err() {
            if Instant::now() > deadline {
                relays.stop().await;
                return Err(setup("the relays")("not listening within 10s".to_string()).into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(relays)
    }

    /// The first relay's process id and the second's.
    fn pids(&self) -> [u32; 2] {
        [self.first.pid(), self.second.pid()]
    }

    async fn stop(self) {
        self.first.stop().await;
        self.second.stop().await;
    }
}

/// Flags of `berth-bench relay`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RelayArgs {
    /// The address to listen on.
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,
    /// Where each connection's bytes go.
    #[arg(long, value_name = "ADDR")]
    to: SocketAddr,
    /// The network namespace `--to` is reached in (`/proc/PID/ns/net`).
    #[arg(long, value_name = "PATH")]
    namespace: Option<PathBuf>,
    /// Accepts each connection in mutual TLS, serving this certificate and
    /// key and admitting clients the CA bundle signed, as a mesh service does.
    #[arg(long, num_args = 3, value_names = ["CERT", "KEY", "CA"])]
    tls_accept: Option<Vec<PathBuf>>,
    /// Dials `--to` in mutual TLS with this certificate and key, verifying
    /// the server by the CA bundle, as a mesh client does.
    #[arg(long, num_args = 3, value_names = ["CERT", "KEY", "CA"])]
    tls_connect: Option<Vec<PathBuf>>,
}

/// Any connection a relay copies between: TCP, or TLS over it.
trait Connection: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Connection for T {}

/// The credentials `files` (certificate, key, CA bundle) name.
fn relay_credentials(files: Option<&Vec<PathBuf>>) -> Result<Option<TlsCredentials>, String> {
    let Some([cert, key, ca]) = files.map(Vec::as_slice) else { return Ok(None) };
    let material = TlsMaterial::from_files(cert, key, ca).map_err(|e| format!("the relay's TLS files: {e}"))?;
    TlsCredentials::new(material).map(Some).map_err(|e| format!("the relay's TLS files: {e}"))
}

/// `berth-bench relay`: copies each connection's bytes to a connection of
/// its own to `--to` and back, parsing nothing, until killed. The router
/// scenario's floor: the least a process between client and replica costs.
pub(crate) async fn relay(args: RelayArgs) -> Result<(), String> {
    let acceptor = relay_credentials(args.tls_accept.as_ref())?
        .map(|credentials| tokio_rustls::TlsAcceptor::from(credentials.server_config()));
    let connector = relay_credentials(args.tls_connect.as_ref())?
        .map(|credentials| tokio_rustls::TlsConnector::from(credentials.client_config()));
    let listener =
        TcpListener::bind(args.listen).await.map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        let (args, acceptor, connector) = (args.clone(), acceptor.clone(), connector.clone());
        tokio::spawn(async move {
            let _ = client.set_nodelay(true);
            let mut client: Box<dyn Connection> = match acceptor {
                Some(acceptor) => match acceptor.accept(client).await {
                    Ok(tls) => Box::new(tls),
                    Err(_) => return,
                },
                None => Box::new(client),
            };
            let upstream = match args.namespace {
                Some(namespace) => berth_agent::connect_in_namespace(namespace, args.to, Duration::from_secs(2)).await,
                None => TcpStream::connect(args.to).await,
            };
            let Ok(upstream) = upstream else { return };
            let _ = upstream.set_nodelay(true);
            let mut upstream: Box<dyn Connection> = match connector {
                Some(connector) => {
                    let name = rustls_pki_types::ServerName::IpAddress(args.to.ip().into());
                    match connector.connect(name, upstream).await {
                        Ok(tls) => Box::new(tls),
                        Err(_) => return,
                    }
                }
                None => Box::new(upstream),
            };
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        });
    }
}

/// `berth-bench echo-server`: answers `GET` with the revision it runs
/// (`$BERTH_REVISION`) on `$PORT`, in HTTP/1.1 and HTTP/2 with prior
/// knowledge, until killed. What the router scenario deploys.
pub(crate) async fn echo_server() -> Result<(), String> {
    let port: u16 = std::env::var("PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(8080);
    let answer = Bytes::from(format!("{}\n", std::env::var("BERTH_REVISION").unwrap_or_else(|_| "echo".into())));
    let listener = TcpListener::bind(("0.0.0.0", port)).await.map_err(|e| format!("cannot listen on {port}: {e}"))?;
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        let answer = answer.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |_request: Request<hyper::body::Incoming>| {
                let answer = answer.clone();
                async move { Ok::<_, std::convert::Infallible>(Response::new(Full::new(answer))) }
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

fn table(report: &Report) -> String {
    let row = |name: &str, f: &Figures| {
        format!(
            "{name:<32}{:>10.0}{:>10}{:>10}{:>10}{:>8}\n",
            f.rate_per_s,
            latency(f.p50_ms),
            latency(f.p99_ms),
            latency(f.max_ms),
            f.errors
        )
    };
    let added = |p: &Protocol, name: &str| {
        let percent = |share: Option<f64>| share.map_or_else(|| "-".into(), |s| format!("{:.0}%", s * 100.0));
        format!(
            "{name}: router adds {} at p50 (target <= {TARGET_ADDED_P50_MS}ms), {} at p99 (<= {TARGET_ADDED_P99_MS}ms), keeps {} of the direct rate (>= {:.0}%; two byte relays keep {}, with mTLS between them {}): {}\n",
            latency(p.added_p50_ms),
            latency(p.added_p99_ms),
            percent(p.rate_share),
            TARGET_RATE_SHARE * 100.0,
            percent(p.relay_share),
            percent(p.mtls_relay_share),
            crate::report::verdict(p.met())
        )
    };
    let connections = report.http1.direct.connections;
    let mut out = format!(
        "berth-bench router: GET / over {connections} connections, one request in flight on each, on berth dev's node\n"
    );
    out.push_str(&format!("{:<32}{:>10}{:>10}{:>10}{:>10}{:>8}\n", "", "req/s", "p50", "p99", "max", "errors"));
    out.push_str(&row("HTTP/1.1 direct to the replica", &report.http1.direct));
    out.push_str(&row("HTTP/1.1 through the router", &report.http1.routed));
    out.push_str(&row("HTTP/1.1 through two byte relays", &report.http1.relayed));
    out.push_str(&row("HTTP/1.1 through two mTLS relays", &report.http1.mtls_relayed));
    out.push_str(&row("HTTP/2 direct to the replica", &report.http2.direct));
    out.push_str(&row("HTTP/2 through the router", &report.http2.routed));
    out.push_str(&row("HTTP/2 through two byte relays", &report.http2.relayed));
    out.push_str(&row("HTTP/2 through two mTLS relays", &report.http2.mtls_relayed));
    out.push_str(&added(&report.http1, "HTTP/1.1"));
    out.push_str(&added(&report.http2, "HTTP/2"));
    let cpu = |p: &Protocol, name: &str| {
        let us = |pair: Option<[f64; 2]>| {
            pair.map_or_else(|| "-".into(), |[a, b]| format!("{a:.0} µs + {b:.0} µs = {:.0} µs", a + b))
        };
        format!(
            "{name}: CPU per request: router + agent {}; two byte relays {}; two mTLS relays {}\n",
            us(p.routed_us_per_request),
            us(p.relayed_us_per_request),
            us(p.mtls_relayed_us_per_request)
        )
    };
    out.push_str(&cpu(&report.http1, "HTTP/1.1"));
    out.push_str(&cpu(&report.http2, "HTTP/2"));
    let change = &report.route_change;
    out.push_str(&format!(
        "route change in force on all {} routers: {} changes, p50 {}, p99 {} (target <= {TARGET_CHANGE_P99_MS:.0}ms), max {}, {} missed\n",
        report.routers,
        change.count,
        latency(change.p50_ms),
        latency(change.p99_ms),
        latency(change.max_ms),
        report.missed_changes
    ));
    let mib = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1} MiB"));
    out.push_str(&format!(
        "router resident memory: {} with 2 services, {} with {} more (target <= {TARGET_RSS_MIB:.0} MiB)\n",
        mib(report.rss_mib),
        mib(report.rss_many_mib),
        report.services
    ));
    out.push_str(&format!("targets: {}", if report.met { "all met" } else { "not all met" }));
    out
}
