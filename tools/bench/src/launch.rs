//! `berth-bench launch`: from `RequestLease` to the workload's process
//! RUNNING on a real agent, with the agent's and the ledger's memory.
//!
//! # Expected flow
//! 1. `berth-identity`, `berth-leases` and two `berth-agent`s start as
//!    processes of their own on state made for the run; leases follows
//!    identity (which checks workloads' leases with it), each agent joins
//!    with a one-use token into a tier of its own and takes its assignments
//!    from leases: one mints every workload's credential before starting
//!    it, the other gives none. The first agent's idle memory is read once
//!    leases lists both nodes UP.
//! 2. `--leases` leases of `/bin/sleep` on each agent, one at a time and
//!    alternating between them: each counts from the request to the first
//!    answer of `GetLease` saying RUNNING (polled every [`POLL_EVERY`]); they
//!    are left running, and the first agent's memory is read with all of
//!    its leases up. What a credential adds to a launch is the difference
//!    of the two agents' figures, measured side by side.
//! 3. A simulated node joins in a tier of its own and `--records` leases are
//!    placed on it (never launched): leases' memory with that many on record.
//! 4. The running leases are released, so the agent stops its processes
//!    before every service is stopped and the state removed.
//! 5. What the runtime itself adds, at the provider, beside a raw
//!    `fork+exec` and the runtime's own bare `run` in the same run (see
//!    [`crate::runtime_launch`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use berth_mtls::{TlsMaterial, generate_csr};
use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1;
use berth_proto::types::v1::Capacity;
use berth_rpc::Channel;
use serde::Serialize;
use tokio::task::JoinSet;

use crate::identity_process::{IdentityProcess, ProcessError, StateOptions};
use crate::leases::{LeasesBenchError, latency, wait_for_nodes};
use crate::leases_process::{LeasesLaunch, LeasesProcess};
use crate::load::{ErrorCount, ErrorTally, Figures, Samples, status_message};
use crate::nodes::{self, NODE_CAPACITY};
use crate::output::{OutputFormat, RunError, print_report, progress};
use crate::process::{ChildProcess, ServiceProcessError, free_loopback_port, sibling_binary};
use crate::procfs::read_memory;
use crate::report::{Machine, Target};
use crate::runtime_launch::{BenchRuntime, RuntimeLaunch, RuntimeLaunchError};
use berth_agent::OciRuntime;

/// Request → RUNNING p99 must stay under this.
const TARGET_P99_MS: f64 = 100.0;

/// The contained process runtime's launch p50 may exceed a raw spawn's by this.
const TARGET_PROCESS_OVER_SPAWN_MS: f64 = 15.0;

/// runc's launch p50 through the provider may exceed a bare `runc run` by this.
const TARGET_RUNC_OVER_BARE_MS: f64 = 20.0;

/// runsc's launch p99 must stay under this.
const TARGET_RUNSC_P99_MS: f64 = 1000.0;

/// The agent's resident memory before any lease must stay under this.
const TARGET_AGENT_IDLE_MIB: f64 = 20.0;

/// The agent's resident memory with every launched lease running must stay under this.
const TARGET_AGENT_LOADED_MIB: f64 = 50.0;

/// How often a launched lease's phase is read.
const POLL_EVERY: Duration = Duration::from_millis(2);

/// How long one lease may take to run before it counts as failed.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the agent may take to join and be seen UP by leases.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the agent may take to stop released workloads.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a process settles before its memory is read.
const SETTLE: Duration = Duration::from_secs(1);

/// How long each workload sleeps: longer than any run, short enough that
/// nothing outlives a run that was killed by much.
const SLEEP_SECONDS: &str = "600";

/// The tier the node holding the records joins, so no launched lease lands there.
const RECORDS_TIER: &str = "bench-records";

/// How long a record may be refused for want of an UP node in its tier
/// once the node is listed UP, before the refusal counts as an error.
const RECORDS_PLACEABLE_WITHIN: Duration = Duration::from_secs(5);

/// The tiers of the agent that mints workload credentials and of the one
/// that does not.
const IDENTIFIED_TIER: &str = "bench-identified";
const PLAIN_TIER: &str = "bench-plain";

/// What minting a workload's credential may add to a launch's p99.
const TARGET_IDENTITY_P99_MS: f64 = 20.0;

/// What each launched lease asks for: a quarter core, since a container
/// runtime's own start-up runs inside the lease's CPU quota (and gVisor's
/// whole kernel does).
const LAUNCH_ASK: Capacity = Capacity { cpu_millis: 250, memory_bytes: 64 << 20 };

/// What each lease on record asks for: the simulated node holds them all.
const RECORD_ASK: Capacity = Capacity { cpu_millis: 1, memory_bytes: 1 << 20 };

/// How often the records node heartbeats while its records are placed.
const RECORDS_HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// Placements in flight while the records are made.
const RECORD_CONCURRENCY: u32 = 32;

/// Flags of `berth-bench launch`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LaunchArgs {
    /// How many leases are launched, one after another, and left running.
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    leases: u32,
    /// How many leases are then put on record (on a simulated node) before
    /// leases' memory is read.
    #[arg(long, default_value_t = 10_000, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    records: u32,
    /// What the agent runs workloads through: the process runtime (the
    /// agent's own containment), a container through runc, runsc or crun
    /// (each needs root), or uncontained host processes.
    #[arg(long, value_enum, default_value_t = BenchRuntime::Process, value_name = "RUNTIME")]
    runtime: BenchRuntime,
    /// How many launches the provider-level comparison takes of each kind.
    #[arg(long, default_value_t = 50, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    compare: u32,
    /// Turn on the host's cgroup2 `favordynmods` first (as the agent's flag
    /// of that name does), so launches do not wait on cgroup migrations; it
    /// stays on until reboot.
    #[arg(long)]
    cgroup_favordynmods: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

/// Why the launch benchmark could not run to the end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LaunchBenchError {
    /// Identity could not be started, died, or its state not removed.
    #[error(transparent)]
    Identity(#[from] ProcessError),
    /// Leases or the agent could not be started or died.
    #[error(transparent)]
    Process(#[from] ServiceProcessError),
    /// Waiting for leases' view of the nodes failed.
    #[error(transparent)]
    Leases(#[from] LeasesBenchError),
    /// Identity refused the bench something it asked as an admin.
    #[error("identity refused {what}: {message}")]
    Refused {
        /// What was asked.
        what: &'static str,
        /// What the client saw.
        message: String,
    },
    /// A key, CSR or certificate could not be made.
    #[error("{0}")]
    Tls(#[source] berth_mtls::MtlsError),
    /// The simulated records node could not join.
    #[error("the records node could not join: {0}")]
    Join(#[source] nodes::JoinError),
    /// A file or directory could not be made.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The agent's node was not UP in leases in time.
    #[error("the agent's node was not UP in berth-leases within {}s; the agent's log:\n{log_tail}", JOIN_TIMEOUT.as_secs())]
    AgentNotUp {
        /// The end of the agent's log.
        log_tail: String,
    },
    /// A client task failed, Ctrl-C arrived, or the report could not be written.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The provider-level comparison could not run.
    #[error(transparent)]
    Runtime(#[from] RuntimeLaunchError),
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
struct LaunchReport {
    /// Always "launch".
    scenario: &'static str,
    /// Leases launched.
    leases: u32,
    /// Leases put on record for the ledger's memory.
    records: u32,
    /// What the agent ran workloads through.
    provider: &'static str,
    /// RequestLease → RUNNING, one lease at a time, each workload given its
    /// credential before it starts.
    launch: Figures,
    /// The same, on an agent that gives workloads no credential.
    launch_without_identity: Figures,
    /// The runtime at the provider, beside its baselines.
    runtime: Option<RuntimeLaunch>,
    /// The agent's resident memory, MiB.
    agent_memory: AgentMemory,
    /// The ledger's resident memory, MiB.
    leases_memory: RecordsMemory,
    /// Every distinct failure, commonest first.
    errors: Vec<ErrorCount>,
    /// The targets, judged.
    targets: Vec<Target>,
    /// The machine it ran on.
    #[serde(flatten)]
    machine: Machine,
}

/// The agent's resident memory, MiB.
#[derive(Debug, Clone, Serialize)]
struct AgentMemory {
    /// Joined and idle, before any lease.
    idle_mib: f64,
    /// With every launched lease running.
    with_leases_mib: f64,
}

/// The ledger's resident memory, MiB.
#[derive(Debug, Clone, Serialize)]
struct RecordsMemory {
    /// Once it saw the agent's node, before any lease.
    idle_mib: f64,
    /// With the launched leases and the records on record.
    with_records_mib: f64,
    /// Records that were placed.
    records_placed: u64,
}

/// Runs the scenario and prints its report.
pub(crate) async fn run(args: LaunchArgs) -> Result<(), LaunchBenchError> {
    if args.runtime == BenchRuntime::Uncontained && rustix::process::geteuid().is_root() {
        return Err(LaunchBenchError::Refused {
            what: "--runtime uncontained",
            message: "as root the agent contains every workload; run it as another user".into(),
        });
    }
    if args.cgroup_favordynmods {
        let mount = berth_agent::favor_cgroup_migrations()
            .map_err(|message| LaunchBenchError::Refused { what: "--cgroup-favordynmods", message })?;
        progress(&format!("favordynmods is on at {}", mount.display()));
    }
    let machine = Machine::before_run();
    let shutdown = berth_rpc::shutdown_signal();
    progress("starting berth-identity on sqlite with a memory bus");
    let leases_addr = free_loopback_port()?;
    let state = StateOptions { leases_addr: Some(leases_addr), ..StateOptions::default() };
    let mut report = IdentityProcess::around(
        &state,
        1,
        &shutdown,
        || RunError::Interrupted.into(),
        async |identity| with_identity(&args, identity, leases_addr).await,
    )
    .await?;
    progress(&format!(
        "launching {} workloads through the {} provider beside its baselines",
        args.compare,
        args.runtime.name()
    ));
    report.runtime = Some(crate::runtime_launch::measure(args.runtime, args.compare).await?);
    report.machine = machine;
    report.judge();
    print_report(args.output, &report, |r| r.table()).map_err(RunError::Output)?;
    Ok(())
}

async fn with_identity(
    args: &LaunchArgs,
    identity: &IdentityProcess,
    leases_addr: SocketAddr,
) -> Result<LaunchReport, LaunchBenchError> {
    let dir = tempfile::Builder::new()
        .prefix("berth-bench-launch-")
        .tempdir()
        .map_err(|source| LaunchBenchError::Io { what: "cannot create a temporary directory", source })?;
    let admin_channel = berth_rpc::connect(&identity.addr().to_string(), identity.admin().clone())
        .map_err(|e| LaunchBenchError::Refused { what: "a connection", message: e.to_string() })?;
    let material = leases_material(&admin_channel).await?;
    progress("starting berth-leases on sqlite with a memory bus");
    let leases = LeasesProcess::start(LeasesLaunch {
        material,
        probe: identity.admin(),
        database_url: format!("sqlite://{}", dir.path().join("leases.db").display()),
        redis_url: "memory://".to_string(),
        identity_addr: identity.addr(),
        lease_ttl_seconds: 3600,
        listen: Some(leases_addr),
    })
    .await?;
    let outcome = tokio::select! {
        outcome = with_leases(args, identity, &admin_channel, &leases, dir.path()) => outcome,
        died = leases.exited() => Err(LaunchBenchError::Process(died)),
    };
    progress("stopping berth-leases");
    leases.stop().await;
    outcome
}

/// A `leases` service certificate from identity's CA, for the leases replica.
async fn leases_material(admin: &Channel) -> Result<TlsMaterial, LaunchBenchError> {
    let (csr_pem, key_pem) = generate_csr("leases").map_err(LaunchBenchError::Tls)?;
    let mut authority = identity::authority_client::AuthorityClient::new(admin.clone());
    let issued = authority
        .issue_certificate(identity::IssueCertificateRequest {
            kind: identity::CertificateKind::Service as i32,
            name: berth_leases::NAME.to_string(),
            csr_pem,
            ttl_seconds: 0,
            dns_names: vec!["127.0.0.1".to_string(), "localhost".to_string()],
        })
        .await
        .map_err(|s| LaunchBenchError::Refused { what: "a leases certificate", message: status_message(&s) })?
        .into_inner();
    Ok(TlsMaterial { cert_chain_pem: issued.certificate_pem, key_pem, ca_bundle_pem: issued.ca_bundle_pem })
}

async fn join_token(admin: &Channel, tier: &str, uses: u32) -> Result<String, LaunchBenchError> {
    let mut tokens = identity::join_tokens_client::JoinTokensClient::new(admin.clone());
    let created = tokens
        .create_join_token(identity::CreateJoinTokenRequest {
            tier: tier.to_string(),
            labels: Default::default(),
            ttl_seconds: 0,
            max_uses: uses,
            description: "berth-bench launch".to_string(),
        })
        .await
        .map_err(|s| LaunchBenchError::Refused { what: "a join token", message: status_message(&s) })?;
    Ok(created.into_inner().token)
}

async fn with_leases(
    args: &LaunchArgs,
    identity: &IdentityProcess,
    admin_channel: &Channel,
    leases: &LeasesProcess,
    dir: &std::path::Path,
) -> Result<LaunchReport, LaunchBenchError> {
    let leases_channel = berth_rpc::connect(&leases.addr().to_string(), identity.admin().clone())
        .map_err(|e| LaunchBenchError::Refused { what: "a connection", message: e.to_string() })?;
    tokio::time::sleep(SETTLE).await;
    let leases_idle_kib = leases.memory().map_or(0, |m| m.rss_kib);

    progress(&format!(
        "starting two berth-agents with the {} runtime, with and without workload identity",
        args.runtime.name()
    ));
    let agents = Agents { identified: dir.join("identified"), plain: dir.join("plain") };
    for dir in [&agents.identified, &agents.plain] {
        std::fs::create_dir_all(dir)
            .map_err(|source| LaunchBenchError::Io { what: "cannot create an agent's directory", source })?;
    }
    let token = join_token(admin_channel, IDENTIFIED_TIER, 1).await?;
    let agent = start_agent(args.runtime, identity, leases.addr(), &token, &agents.identified, true)?;
    let token = join_token(admin_channel, PLAIN_TIER, 1).await?;
    let plain = match start_agent(args.runtime, identity, leases.addr(), &token, &agents.plain, false) {
        Ok(plain) => plain,
        Err(error) => {
            agent.stop().await;
            return Err(error);
        }
    };
    let outcome = tokio::select! {
        outcome = with_agent(args, identity, admin_channel, leases, &leases_channel, [&agent, &plain], &agents, leases_idle_kib) => outcome,
        died = agent.exited() => Err(LaunchBenchError::Process(died)),
        died = plain.exited() => Err(LaunchBenchError::Process(died)),
    };
    progress("stopping the berth-agents");
    agent.stop().await;
    plain.stop().await;
    outcome
}

/// The two agents' directories: the one that mints workload credentials,
/// and the one that does not.
struct Agents {
    identified: std::path::PathBuf,
    plain: std::path::PathBuf,
}

fn start_agent(
    runtime: BenchRuntime,
    identity: &IdentityProcess,
    leases_addr: SocketAddr,
    token: &str,
    dir: &std::path::Path,
    workload_identity: bool,
) -> Result<ChildProcess, LaunchBenchError> {
    let binary = sibling_binary("berth-agent")?;
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, identity.ca_bundle_pem())
        .map_err(|source| LaunchBenchError::Io { what: "cannot write the CA file", source })?;
    let listen = free_loopback_port()?;
    let mut command = tokio::process::Command::new(&binary);
    command
        .arg("--server")
        .arg(identity.addr().to_string())
        .arg("--ca-file")
        .arg(&ca_file)
        .arg("--data-dir")
        .arg(dir.join("agent"))
        .arg("--advertise-addr")
        .arg(listen.to_string())
        .arg("--listen")
        .arg(listen.to_string())
        .arg("--leases-addr")
        .arg(leases_addr.to_string())
        .args(["--cpu-millis", "64000", "--memory-bytes", &(64u64 << 30).to_string(), "--name", "bench-agent"])
        .args(["--stop-grace", "2s"])
        .args(["--workload-identity", if workload_identity { "true" } else { "false" }])
        .args(match runtime.oci() {
            Some(OciRuntime::Own) => vec!["--runtime".to_string(), "process".into()],
            Some(oci) => vec!["--runtime".to_string(), "oci".into(), "--oci-runtime".into(), oci.name().into()],
            // Uncontained only where the agent cannot contain (not root).
            None => vec!["--runtime".into(), "process".into(), "--allow-uncontained".into()],
        })
        // Through the environment, so the token never shows in `ps`.
        .env("BERTH_JOIN_TOKEN", token)
        .env("RUST_LOG", "warn");
    Ok(ChildProcess::spawn("berth-agent", &binary, command, dir.join("agent.log"))?)
}

#[allow(clippy::too_many_arguments, reason = "every process of the run, passed down once")]
async fn with_agent(
    args: &LaunchArgs,
    identity: &IdentityProcess,
    admin_channel: &Channel,
    leases: &LeasesProcess,
    leases_channel: &Channel,
    [agent, plain]: [&ChildProcess; 2],
    agents: &Agents,
    leases_idle_kib: u64,
) -> Result<LaunchReport, LaunchBenchError> {
    match tokio::time::timeout(JOIN_TIMEOUT, wait_for_nodes(leases_channel, 2)).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) | Err(_) => {
            let log_tail = std::fs::read_to_string(agents.identified.join("agent.log")).unwrap_or_default();
            let tail: Vec<&str> = log_tail.lines().rev().take(15).collect();
            return Err(LaunchBenchError::AgentNotUp {
                log_tail: tail.into_iter().rev().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n"),
            });
        }
    }
    tokio::time::sleep(SETTLE).await;
    let agent_idle_kib = read_memory(agent.pid()).map_or(0, |m| m.rss_kib);

    progress(&format!("launching {} leases on each agent, one at a time, alternating", args.leases));
    let errors = ErrorTally::default();
    let mut client = v1::leases_client::LeasesClient::new(leases_channel.clone());
    let (mut with_identity, mut without_identity) = (Samples::default(), Samples::default());
    let mut launched = Vec::with_capacity(2 * args.leases as usize);
    let started = Instant::now();
    for index in 0..2 * args.leases {
        let (tier, samples) =
            if index % 2 == 0 { (IDENTIFIED_TIER, &mut with_identity) } else { (PLAIN_TIER, &mut without_identity) };
        let sent = Instant::now();
        match launch_one(&mut client, index, tier).await {
            Ok(lease_id) => {
                samples.ok(sent.elapsed());
                launched.push(lease_id);
            }
            Err((message, lease_id)) => {
                samples.error();
                errors.add(&message);
                launched.extend(lease_id);
            }
        }
    }
    let launch = with_identity.figures(started.elapsed(), 1);
    let launch_without_identity = without_identity.figures(started.elapsed(), 1);
    tokio::time::sleep(SETTLE).await;
    let agent_loaded_kib = read_memory(agent.pid()).map_or(0, |m| m.rss_kib);

    let mut records_placed = 0;
    if args.records > 0 {
        progress(&format!("putting {} leases on record on a simulated node", args.records));
        records_placed = put_records(identity, admin_channel, leases_channel, args.records, &errors).await?;
        tokio::time::sleep(SETTLE).await;
    }
    let leases_records_kib = leases.memory().map_or(0, |m| m.rss_kib);

    progress(&format!("releasing the {} launched leases", launched.len()));
    let workloads: Vec<u32> = child_pids(agent.pid()).into_iter().chain(child_pids(plain.pid())).collect();
    for lease_id in launched {
        let request = v1::ReleaseLeaseRequest { lease_id, reason: String::new() };
        if let Err(status) = client.release_lease(request).await {
            errors.add(&format!("release: {}", status_message(&status)));
        }
    }
    stop_workloads(&workloads, &errors).await;
    // The agent deletes a container's state just after its process is
    // gone: give it the same time to finish.
    let deadline = Instant::now() + RELEASE_TIMEOUT;
    let data_dirs = [agents.identified.join("agent"), agents.plain.join("agent")];
    while data_dirs.iter().map(|dir| berth_agent::containers_left(dir)).sum::<usize>() > 0 && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A container an agent still had (its monitor killed above) is
    // destroyed through its runtime, so no run leaves one behind.
    let left: usize = data_dirs.iter().map(|dir| berth_agent::destroy_containers(dir)).sum();
    if left > 0 {
        errors.add(&format!("{left} containers were still there after the release; destroyed"));
    }
    let mib = |kib: u64| kib as f64 / 1024.0;
    Ok(LaunchReport {
        scenario: "launch",
        leases: args.leases,
        records: args.records,
        provider: args.runtime.name(),
        launch,
        launch_without_identity,
        runtime: None,
        agent_memory: AgentMemory { idle_mib: mib(agent_idle_kib), with_leases_mib: mib(agent_loaded_kib) },
        leases_memory: RecordsMemory {
            idle_mib: mib(leases_idle_kib),
            with_records_mib: mib(leases_records_kib),
            records_placed,
        },
        errors: errors.summary(),
        targets: Vec::new(),
        machine: Machine::default(),
    })
}

/// The processes `pid` started that still run: the agent's workloads.
fn child_pids(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|children| children.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// Waits for the agent to stop the released workloads; any still running
/// after [`RELEASE_TIMEOUT`] is killed, so no run leaves a process behind
/// (an agent stopped with workloads running keeps them for its next start).
async fn stop_workloads(pids: &[u32], errors: &ErrorTally) {
    let alive = |pid: &&u32| std::path::Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(**pid);
    let deadline = Instant::now() + RELEASE_TIMEOUT;
    while pids.iter().any(|pid| alive(&pid)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for pid in pids.iter().filter(alive) {
        errors.add(&format!("a released workload still ran after {}s; killed", RELEASE_TIMEOUT.as_secs()));
        if let Some(pid) = i32::try_from(*pid).ok().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rfind(')').map(|end| stat[end + 1..].trim_start().starts_with('Z')))
        .unwrap_or(true)
}

/// Asks for lease `index` and polls it until RUNNING; its id either way
/// when it was created, so it can be released.
async fn launch_one(
    client: &mut v1::leases_client::LeasesClient<Channel>,
    index: u32,
    tier: &str,
) -> Result<String, (String, Option<String>)> {
    let mut request = tonic::Request::new(v1::RequestLeaseRequest {
        project: String::new(),
        owner: "bench/launch".to_string(),
        idempotency_key: format!("launch-{index}"),
        resources: Some(LAUNCH_ASK),
        tier: tier.to_string(),
        spread_group: String::new(),
        workload: Some(v1::Workload {
            command: "/bin/sleep".to_string(),
            args: vec![SLEEP_SECONDS.to_string()],
            ..Default::default()
        }),
    });
    request.set_timeout(CALL_TIMEOUT);
    let lease = client
        .request_lease(request)
        .await
        .map_err(|s| (format!("request: {}", status_message(&s)), None))?
        .into_inner()
        .lease
        .ok_or_else(|| ("request: answered without a lease".to_string(), None))?;
    let deadline = Instant::now() + LAUNCH_TIMEOUT;
    loop {
        let answer = client.get_lease(v1::GetLeaseRequest { lease_id: lease.lease_id.clone() }).await;
        let phase = match answer {
            Ok(answer) => answer.into_inner().lease.map_or(0, |l| l.phase),
            Err(status) => return Err((format!("get: {}", status_message(&status)), Some(lease.lease_id))),
        };
        if phase == v1::LeasePhase::Running as i32 {
            return Ok(lease.lease_id);
        }
        let open = [v1::LeasePhase::Bound, v1::LeasePhase::Launching, v1::LeasePhase::Pending];
        if !open.iter().any(|p| *p as i32 == phase) {
            let name =
                v1::LeasePhase::try_from(phase).map_or_else(|_| phase.to_string(), |p| p.as_str_name().to_string());
            return Err((format!("lease reached {name} instead of RUNNING"), Some(lease.lease_id)));
        }
        if Instant::now() >= deadline {
            return Err((format!("not RUNNING within {}s", LAUNCH_TIMEOUT.as_secs()), Some(lease.lease_id)));
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// Joins a simulated node in [`RECORDS_TIER`], brings it UP with one
/// heartbeat offering room for every record, and places `records` leases
/// on it; how many were placed.
async fn put_records(
    identity: &IdentityProcess,
    admin_channel: &Channel,
    leases_channel: &Channel,
    records: u32,
    errors: &ErrorTally,
) -> Result<u64, LaunchBenchError> {
    let token = join_token(admin_channel, RECORDS_TIER, 1).await?;
    let node =
        nodes::join(0, identity.addr(), &token, &identity.ca_bundle_pem()).await.map_err(LaunchBenchError::Join)?;
    let session = berth_rpc::connect(&identity.addr().to_string(), node.credentials.clone())
        .map_err(|e| LaunchBenchError::Refused { what: "a node connection", message: e.to_string() })?;
    let mut session = identity::node_session_client::NodeSessionClient::new(session);
    let beat = identity::HeartbeatRequest {
        node_id: node.node_id.clone(),
        incarnation: node.incarnation,
        usage: Some(Capacity { cpu_millis: 0, memory_bytes: 0 }),
        capacity: Some(Capacity {
            cpu_millis: NODE_CAPACITY.cpu_millis + RECORD_ASK.cpu_millis * u64::from(records),
            memory_bytes: NODE_CAPACITY.memory_bytes + RECORD_ASK.memory_bytes * u64::from(records),
        }),
        version: env!("CARGO_PKG_VERSION").to_string(),
        renewal_csr_pem: String::new(),
        ca_bundle_sha256: String::new(),
        ..Default::default()
    };
    session
        .heartbeat(beat.clone())
        .await
        .map_err(|s| LaunchBenchError::Refused { what: "the records node's heartbeat", message: status_message(&s) })?;
    // The node stays UP while its records are placed, as a live agent's would.
    let heartbeats = tokio::spawn({
        let errors = errors.clone();
        async move {
            loop {
                tokio::time::sleep(RECORDS_HEARTBEAT_EVERY).await;
                if let Err(status) = session.heartbeat(beat.clone()).await {
                    errors.add(&format!("records node heartbeat: {}", status_message(&status)));
                }
            }
        }
    });
    let placed = place_records(leases_channel, records, errors).await;
    heartbeats.abort();
    placed
}

/// Places `records` leases in [`RECORDS_TIER`]; how many were placed.
async fn place_records(leases_channel: &Channel, records: u32, errors: &ErrorTally) -> Result<u64, LaunchBenchError> {
    wait_for_nodes(leases_channel, 2).await?;

    let next = Arc::new(AtomicU32::new(0));
    let mut running = JoinSet::new();
    for _ in 0..RECORD_CONCURRENCY {
        let mut client = v1::leases_client::LeasesClient::new(leases_channel.clone());
        let (next, errors) = (next.clone(), errors.clone());
        running.spawn(async move {
            let mut placed = 0u64;
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= records {
                    return placed;
                }
                let request = v1::RequestLeaseRequest {
                    project: String::new(),
                    owner: "bench/records".to_string(),
                    idempotency_key: format!("record-{index}"),
                    resources: Some(RECORD_ASK),
                    tier: RECORDS_TIER.to_string(),
                    spread_group: String::new(),
                    workload: Some(v1::Workload { command: "/bin/true".to_string(), ..Default::default() }),
                };
                // The node is UP in the capacity listing; the placer's own
                // view of the tier may follow a moment later.
                let deadline = Instant::now() + RECORDS_PLACEABLE_WITHIN;
                loop {
                    match client.request_lease(request.clone()).await {
                        Ok(_) => placed += 1,
                        Err(status) if status.code() == tonic::Code::ResourceExhausted && Instant::now() < deadline => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                        Err(status) => errors.add(&format!("record: {}", status_message(&status))),
                    }
                    break;
                }
            }
        });
    }
    let mut placed = 0;
    while let Some(joined) = running.join_next().await {
        placed += joined.map_err(RunError::Task)?;
    }
    Ok(placed)
}

impl LaunchReport {
    fn judge(&mut self) {
        let (agent, launch) = (&self.agent_memory, &self.launch);
        self.targets = vec![
            Target {
                name: format!("p99 < {TARGET_P99_MS:.0}ms, every lease RUNNING"),
                value: launch.p99_ms,
                met: launch.p99_ms.is_some_and(|p| p < TARGET_P99_MS)
                    && launch.errors == 0
                    && launch.calls == u64::from(self.leases),
            },
            Target {
                name: format!("agent idle < {TARGET_AGENT_IDLE_MIB:.0} MiB"),
                value: Some(agent.idle_mib),
                met: agent.idle_mib > 0.0 && agent.idle_mib < TARGET_AGENT_IDLE_MIB,
            },
            Target {
                name: format!("agent with {} leases < {TARGET_AGENT_LOADED_MIB:.0} MiB", self.leases),
                value: Some(agent.with_leases_mib),
                met: agent.with_leases_mib > 0.0 && agent.with_leases_mib < TARGET_AGENT_LOADED_MIB,
            },
            Target {
                name: format!("workload identity adds <= {TARGET_IDENTITY_P99_MS:.0}ms to launch p99"),
                value: launch.p99_ms.zip(self.launch_without_identity.p99_ms).map(|(with, without)| with - without),
                met: launch
                    .p99_ms
                    .zip(self.launch_without_identity.p99_ms)
                    .is_some_and(|(with, without)| with - without <= TARGET_IDENTITY_P99_MS)
                    && self.launch_without_identity.errors == 0,
            },
        ];
        let Some(runtime) = &self.runtime else { return };
        let over = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a - b);
        let clean = runtime.provider.errors == 0;
        self.targets.push(match self.provider {
            // Nothing is promised of what contains nothing.
            "uncontained" => return,
            "process" => {
                let value = over(runtime.provider.p50_ms, runtime.raw_spawn.p50_ms);
                Target {
                    name: format!("process launch p50 <= raw fork+exec + {TARGET_PROCESS_OVER_SPAWN_MS:.0}ms"),
                    value,
                    met: clean && value.is_some_and(|v| v <= TARGET_PROCESS_OVER_SPAWN_MS),
                }
            }
            "runsc" => Target {
                name: format!("runsc launch p99 < {TARGET_RUNSC_P99_MS:.0}ms"),
                value: runtime.provider.p99_ms,
                met: clean && runtime.provider.p99_ms.is_some_and(|v| v < TARGET_RUNSC_P99_MS),
            },
            name => {
                let value = over(runtime.provider.p50_ms, runtime.same_bundle.as_ref().and_then(|f| f.p50_ms));
                Target {
                    name: format!(
                        "{name} launch p50 <= bare {name} run of the same bundle + {TARGET_RUNC_OVER_BARE_MS:.0}ms"
                    ),
                    value,
                    met: clean && value.is_some_and(|v| v <= TARGET_RUNC_OVER_BARE_MS),
                }
            }
        });
    }

    fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let l = &self.launch;
        let _ = writeln!(out, "berth-bench launch: {} leases one at a time, {} provider", self.leases, self.provider);
        let _ = writeln!(out, "{:<30}{:>10}{:>10}{:>10}{:>8}", "", "p50", "p99", "max", "errors");
        for (name, l) in
            [("RequestLease -> RUNNING", l), ("  without workload identity", &self.launch_without_identity)]
        {
            let _ = writeln!(
                out,
                "{:<30}{:>10}{:>10}{:>10}{:>8}",
                name,
                latency(l.p50_ms),
                latency(l.p99_ms),
                latency(l.max_ms),
                l.errors
            );
        }
        if let Some(runtime) = &self.runtime {
            let mut row = |name: &str, f: &Figures| {
                let _ = writeln!(
                    out,
                    "{:<30}{:>10}{:>10}{:>10}{:>8}",
                    name,
                    latency(f.p50_ms),
                    latency(f.p99_ms),
                    latency(f.max_ms),
                    f.errors
                );
            };
            row(&format!("{} provider launch", self.provider), &runtime.provider);
            row("raw fork+exec (baseline)", &runtime.raw_spawn);
            if let Some(bare) = &runtime.bare_runtime {
                row(&format!("bare {} run -d, minimal", self.provider), bare);
            }
            if let Some(same) = &runtime.same_bundle {
                row(&format!("bare {} run -d, same bundle", self.provider), same);
            }
        }
        let _ = writeln!(
            out,
            "agent RSS: idle {:.1} MiB, with {} leases running {:.1} MiB",
            self.agent_memory.idle_mib, self.leases, self.agent_memory.with_leases_mib
        );
        let _ = writeln!(
            out,
            "leases RSS: idle {:.1} MiB, with {} leases on record {:.1} MiB",
            self.leases_memory.idle_mib,
            self.leases_memory.records_placed + l.calls,
            self.leases_memory.with_records_mib
        );
        self.machine.write_footer(
            &mut out,
            "shared by identity, leases, the node and the bench",
            &self.targets,
            &self.errors,
        );
        out
    }
}
