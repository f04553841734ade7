//! `berth lease request|list|get|resize|release` and `berth capacity`: the
//! capacity ledger as an operator reads it and asks it for compute.
//!
//! # Where leases is
//! `--leases-server` (or `BERTH_LEASES_SERVER`); without it, where identity
//! says (`Mesh/GetEndpoints`). Credentials are the same admin files every command uses.
//!
//! # Invariants
//! - A request always carries an idempotency key (random unless
//!   `--idempotency-key` is given), so asking again with the same key never
//!   makes a second lease.
//! - Quantities are checked here, before anything is dialled: a bad `--cpu`
//!   or `--memory` is a usage error naming the flag.

use std::collections::HashMap;
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_proto::leases::v1;
use berth_proto::leases::v1::capacity_client::CapacityClient;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_proto::types::v1::Capacity;
use berth_rpc::Channel;

use super::output::{self, Table};
use super::{CliError, ClientArgs, Connection, OutputFormat, ProjectScopeArgs, parse_label, parse_server};

/// How often `request --wait` asks how the lease is doing.
const WAIT_POLL: Duration = Duration::from_millis(250);

/// Where the leases service is, for every command that talks to it.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Global options")]
pub(super) struct LeasesServerArgs {
    /// The leases service to talk to [default: where identity says it is].
    #[arg(id = "leases_server", long = "leases-server", env = "BERTH_LEASES_SERVER", value_name = "HOST:PORT",
          value_parser = parse_server, global = true)]
    address: Option<String>,
}

impl LeasesServerArgs {
    /// A channel to leases with `credentials`, at `--leases-server` or where
    /// identity says; nothing is dialled until the first call.
    pub(super) async fn connect(
        &self,
        client: &ClientArgs,
        credentials: TlsCredentials,
    ) -> Result<Connection, CliError> {
        let address = client.endpoint("leases", self.address.as_ref(), "--leases-server", &credentials).await?;
        Connection::open("leases", &address, credentials)
    }
}

/// Flags of `berth lease`.
#[derive(Debug, clap::Args)]
pub(crate) struct LeaseArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    leases: LeasesServerArgs,
    #[command(subcommand)]
    command: LeaseCommand,
}

#[derive(Debug, clap::Subcommand)]
enum LeaseCommand {
    /// Ask for compute on some node to run a command, e.g.
    /// `berth lease request --owner alice -- sleep 60`.
    Request(RequestArgs),
    /// List leases, oldest first.
    List(ListArgs),
    /// Show one lease in full.
    Get {
        /// The lease's id.
        #[arg(value_name = "LEASE_ID")]
        lease_id: String,
    },
    /// Change what a lease reserves without restarting its workload, e.g.
    /// `berth lease resize l-1234 --memory 2Gi --wait`. Growing needs the room
    /// on the lease's node at once; its node then applies the new limits live
    /// (a memory decrease waits for the workload to use less, else is
    /// deferred and the old size kept).
    Resize(ResizeArgs),
    /// Give a lease back: its node stops the workload and the compute is
    /// freed. A lease that already ended is left as it is.
    Release {
        /// The lease's id.
        #[arg(value_name = "LEASE_ID")]
        lease_id: String,
        /// Why, one CamelCase word recorded as the lease's reason
        /// [default: Released].
        #[arg(long, value_name = "WORD")]
        reason: Option<String>,
    },
}

#[derive(Debug, clap::Args)]
struct RequestArgs {
    /// Who asks, recorded on the lease, e.g. `alice` or `batch/nightly`.
    #[arg(long, value_name = "OWNER")]
    owner: String,
    /// The tenant [default: default].
    #[arg(long, value_name = "PROJECT")]
    project: Option<String>,
    /// Asking again with the same key in the same project returns the lease
    /// already made instead of a new one [default: a random key].
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// CPU to reserve: `500m`, `0.5` or `2` cores.
    #[arg(long, value_name = "QUANTITY", default_value = "100m", value_parser = parse_cpu)]
    cpu: u64,
    /// Memory to reserve: `64Mi`, `1Gi`, `512M` or bytes.
    #[arg(long, value_name = "QUANTITY", default_value = "64Mi", value_parser = parse_memory)]
    memory: u64,
    /// Only nodes of this tier [default: any tier].
    #[arg(long, value_name = "TIER")]
    tier: Option<String>,
    /// Leases sharing a spread group are placed on different nodes when
    /// possible.
    #[arg(long, value_name = "GROUP")]
    spread_group: Option<String>,
    /// An environment variable for the command; repeatable.
    #[arg(long = "env", value_name = "KEY=VALUE", value_parser = parse_label)]
    env: Vec<(String, String)>,
    /// A cache volume to mount: `KEY:PATH`, optionally `:always` or `:never`
    /// to publish its view also when the command fails, or never
    /// [default: when it succeeds]; repeatable.
    #[arg(long = "cache", value_name = "KEY:PATH[:COMMIT]", value_parser = parse_cache_mount)]
    cache: Vec<berth_proto::types::v1::CacheMount>,
    /// Wait until the lease runs or ends, and print it then.
    #[arg(long)]
    wait: bool,
    /// The program to run and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("size").required(true).multiple(true).args(["cpu", "memory"])))]
struct ResizeArgs {
    /// The lease's id.
    #[arg(value_name = "LEASE_ID")]
    lease_id: String,
    /// The new CPU: `500m`, `0.5` or `2` cores [default: unchanged].
    #[arg(long, value_name = "QUANTITY", value_parser = parse_cpu)]
    cpu: Option<u64>,
    /// The new memory: `64Mi`, `1Gi`, `512M` or bytes [default: unchanged].
    #[arg(long, value_name = "QUANTITY", value_parser = parse_memory)]
    memory: Option<u64>,
    /// Resize only if the lease is still at this epoch [default: the epoch
    /// it is at when read].
    #[arg(long, value_name = "EPOCH")]
    epoch: Option<u64>,
    /// Wait until its node applied or deferred the resize, and fail if it
    /// was deferred.
    #[arg(long)]
    wait: bool,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    #[command(flatten)]
    scope: ProjectScopeArgs,
    /// Only leases placed on this node.
    #[arg(long, value_name = "NODE_ID")]
    node: Option<String>,
    /// Only leases in this phase: pending, bound, launching, running, done,
    /// failed, released or expired.
    #[arg(long, value_name = "PHASE", value_parser = parse_phase)]
    phase: Option<v1::LeasePhase>,
    /// Only leases with this owner.
    #[arg(long, value_name = "OWNER")]
    owner: Option<String>,
    /// Keep going: the open leases, then each change as it happens (a lease
    /// placed, running, ended), one line each (one JSON object each with
    /// `-o json`), until interrupted.
    #[arg(long, short = 'w', conflicts_with_all = ["node", "phase"])]
    watch: bool,
}

/// A lease phase by the name the proto gives it after `LEASE_PHASE_`, in
/// any case (`running`).
fn parse_phase(text: &str) -> Result<v1::LeasePhase, String> {
    v1::LeasePhase::from_str_name(&format!("LEASE_PHASE_{}", text.to_ascii_uppercase()))
        .filter(|phase| *phase != v1::LeasePhase::Unspecified)
        .ok_or_else(|| {
            "not a lease phase: pending, bound, launching, running, done, failed, released or expired".to_string()
        })
}

/// Flags of `berth capacity`.
#[derive(Debug, clap::Args)]
pub(crate) struct CapacityArgs {
    // Before the flattened connection flags, whose help heading would
    // otherwise carry over to it.
    /// Only nodes of this tier.
    #[arg(long, value_name = "TIER")]
    tier: Option<String>,
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    leases: LeasesServerArgs,
}

impl LeaseArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let connection = self.leases.connect(&self.client, self.client.credentials()?).await?;
        let mut client = LeasesClient::new(connection.channel.clone());
        let format = self.client.output;
        match self.command {
            LeaseCommand::Request(args) => request(&mut client, &connection, args, format).await,
            LeaseCommand::List(args) if args.watch => watch(&mut client, &connection, args, format).await,
            LeaseCommand::List(args) => {
                let request = v1::ListLeasesRequest {
                    project: args.scope.project.unwrap_or_default(),
                    node_id: args.node.unwrap_or_default(),
                    phase: args.phase.unwrap_or(v1::LeasePhase::Unspecified) as i32,
                    owner: args.owner.unwrap_or_default(),
                    all_projects: args.scope.all_projects,
                };
                let listed = connection.answer(client.list_leases(connection.request(request))).await?;
                print_list(&listed, format)
            }
            LeaseCommand::Get { lease_id } => {
                let lease = get_lease(&mut client, &connection, &lease_id).await?;
                let text = details(&lease);
                output::print_answer(format, &v1::GetLeaseResponse { lease: Some(lease) }, || text)
            }
            LeaseCommand::Resize(args) => resize(&mut client, &connection, args, format).await,
            LeaseCommand::Release { lease_id, reason } => {
                let request = v1::ReleaseLeaseRequest { lease_id, reason: reason.unwrap_or_default() };
                let released = connection.answer(client.release_lease(connection.request(request))).await?;
                let lease = released.lease.as_ref().ok_or(CliError::IncompleteResponse("the lease"))?;
                output::print_answer(format, &released, || released_line(lease))
            }
        }
    }
}

impl CapacityArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let connection = self.leases.connect(&self.client, self.client.credentials()?).await?;
        let request = v1::ListNodeCapacityRequest { tier: self.tier.unwrap_or_default() };
        let listed = connection
            .answer(CapacityClient::new(connection.channel.clone()).list_node_capacity(connection.request(request)))
            .await?;
        let headers = vec![
            "NODE",
            "TIER",
            "STATE",
            "RUNTIME",
            "CPU-TOTAL",
            "CPU-ALLOCATED",
            "CPU-FREE",
            "MEMORY-TOTAL",
            "MEMORY-ALLOCATED",
            "MEMORY-FREE",
            "LEASES",
        ];
        let cpu = |c: Option<&Capacity>| output::cpu(c.map_or(0, |c| c.cpu_millis));
        let memory = |c: Option<&Capacity>| output::memory(c.map_or(0, |c| c.memory_bytes));
        output::print_listed(&listed, &listed.nodes, "nodes", self.client.output, headers, |node| {
            let (total, allocated, free) = (node.total.as_ref(), node.allocated.as_ref(), node.free.as_ref());
            vec![
                node.node_id.clone(),
                output::or_none(&node.tier),
                output::node_state(node.state),
                match (node.runtime.as_str(), node.contained) {
                    ("", _) => output::NONE.to_string(),
                    (name, true) => name.to_string(),
                    (name, false) => format!("{name}/uncontained"),
                },
                cpu(total),
                cpu(allocated),
                cpu(free),
                memory(total),
                memory(allocated),
                memory(free),
                node.leases.to_string(),
            ]
        })
    }
}

/// Asks for the lease, waits for it when told to, and prints it.
async fn request(
    client: &mut LeasesClient<Channel>,
    connection: &Connection,
    args: RequestArgs,
    format: OutputFormat,
) -> Result<(), CliError> {
    let mut words = args.command.into_iter();
    let command = words.next().unwrap_or_default();
    let key = args.idempotency_key.unwrap_or_else(random_key);
    let request = v1::RequestLeaseRequest {
        project: args.project.unwrap_or_default(),
        owner: args.owner,
        idempotency_key: key.clone(),
        resources: Some(Capacity { cpu_millis: args.cpu, memory_bytes: args.memory }),
        tier: args.tier.unwrap_or_default(),
        spread_group: args.spread_group.unwrap_or_default(),
        workload: Some(v1::Workload {
            command,
            args: words.collect(),
            env: args.env.into_iter().collect::<HashMap<_, _>>(),
            cache: args.cache,
            ..Default::default()
        }),
    };
    let response = connection.answer(client.request_lease(connection.request(request))).await?;
    let mut lease = response.lease.ok_or(CliError::IncompleteResponse("the lease"))?;
    if !response.created {
        output::note(&format!("key {key} already made lease {}; this is that lease, not a new one", lease.lease_id));
    }
    if args.wait {
        while is_starting(lease.phase) {
            tokio::time::sleep(WAIT_POLL).await;
            lease = get_lease(client, connection, &lease.lease_id).await?;
        }
    }
    match format {
        OutputFormat::Json => {
            output::print_message(&v1::RequestLeaseResponse { lease: Some(lease), created: response.created })
        }
        OutputFormat::Table => {
            let mut table = Table::new(vec!["LEASE", "NODE", "PHASE", "EPOCH", "REASON"]);
            table.row(vec![
                lease.lease_id.clone(),
                output::or_none(&lease.node_id),
                output::lease_phase(lease.phase),
                lease.epoch.to_string(),
                output::lease_reason(&lease),
            ]);
            output::print(&table.render())
        }
    }
}

async fn resize(
    client: &mut LeasesClient<Channel>,
    connection: &Connection,
    args: ResizeArgs,
    format: OutputFormat,
) -> Result<(), CliError> {
    let current = get_lease(client, connection, &args.lease_id).await?;
    let size = current.resize.as_ref().filter(|r| r.state() == v1::ResizeState::Pending).and_then(|r| r.resources);
    let size = size.or(current.resources).unwrap_or_default();
    let request = v1::ResizeLeaseRequest {
        lease_id: args.lease_id.clone(),
        epoch: args.epoch.unwrap_or(current.epoch),
        resources: Some(Capacity {
            cpu_millis: args.cpu.unwrap_or(size.cpu_millis),
            memory_bytes: args.memory.unwrap_or(size.memory_bytes),
        }),
    };
    let response = connection.answer(client.resize_lease(connection.request(request))).await?;
    let mut lease = response.lease.ok_or(CliError::IncompleteResponse("the lease"))?;
    if args.wait {
        while lease.resize.as_ref().is_some_and(|r| r.state() == v1::ResizeState::Pending) && is_open(lease.phase) {
            tokio::time::sleep(WAIT_POLL).await;
            lease = get_lease(client, connection, &lease.lease_id).await?;
        }
    }
    match format {
        OutputFormat::Json => output::print_message(&v1::ResizeLeaseResponse { lease: Some(lease.clone()) })?,
        OutputFormat::Table => output::print(&format!("lease {}: {}\n", lease.lease_id, resize_line(&lease)))?,
    }
    match lease.resize.as_ref() {
        Some(resize) if args.wait && resize.state() == v1::ResizeState::Deferred => {
            Err(CliError::Refused(format!("node {} deferred the resize: {}", lease.node_id, resize_reason(resize))))
        }
        _ if args.wait && !is_open(lease.phase) => {
            Err(CliError::Refused(format!("lease {} ended before its node applied the resize", lease.lease_id)))
        }
        _ => Ok(()),
    }
}

/// Where a lease's last resize stands, as a person reads it.
fn resize_line(lease: &v1::Lease) -> String {
    let Some(resize) = lease.resize.as_ref() else { return output::NONE.to_string() };
    let asked = output::capacity(resize.resources.as_ref());
    match resize.state() {
        v1::ResizeState::Pending => format!("to {asked}, pending on node {}", lease.node_id),
        v1::ResizeState::Applied => format!("to {asked}, applied"),
        v1::ResizeState::Deferred => format!("to {asked}, deferred: {}", resize_reason(resize)),
        v1::ResizeState::Unspecified => output::NONE.to_string(),
    }
}

fn resize_reason(resize: &v1::LeaseResize) -> String {
    if resize.message.is_empty() { resize.reason.clone() } else { format!("{} ({})", resize.reason, resize.message) }
}

/// Whether the lease still reserves compute.
fn is_open(phase: i32) -> bool {
    is_starting(phase) || phase == v1::LeasePhase::Running as i32
}

/// Whether the lease is open but its workload has not started running yet.
pub(super) fn is_starting(phase: i32) -> bool {
    matches!(
        v1::LeasePhase::try_from(phase),
        Ok(v1::LeasePhase::Pending | v1::LeasePhase::Bound | v1::LeasePhase::Launching)
    )
}

/// One lease, by id.
pub(super) async fn get_lease(
    client: &mut LeasesClient<Channel>,
    connection: &Connection,
    lease_id: &str,
) -> Result<v1::Lease, CliError> {
    connection
        .answer(client.get_lease(connection.request(v1::GetLeaseRequest { lease_id: lease_id.to_string() })))
        .await?
        .lease
        .ok_or(CliError::IncompleteResponse("the lease"))
}

/// A key no earlier request has used.
fn random_key() -> String {
    let bytes: [u8; 12] = rand::random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("cli-{hex}")
}

fn print_list(listed: &v1::ListLeasesResponse, format: OutputFormat) -> Result<(), CliError> {
    let headers = vec!["LEASE", "PROJECT", "OWNER", "NODE", "PHASE", "EPOCH", "CPU", "MEMORY", "AGE", "REASON"];
    output::print_listed(listed, &listed.leases, "leases", format, headers, |lease| {
        let resources = lease.resources.as_ref();
        vec![
            lease.lease_id.clone(),
            output::or_none(&lease.project),
            output::or_none(&lease.owner),
            output::or_none(&lease.node_id),
            output::lease_phase(lease.phase),
            lease.epoch.to_string(),
            resources.map_or_else(|| output::NONE.to_string(), |r| output::cpu(r.cpu_millis)),
            resources.map_or_else(|| output::NONE.to_string(), |r| output::memory(r.memory_bytes)),
            output::age(lease.created_at.as_ref()),
            output::lease_reason(lease),
        ]
    })
}

/// `lease list --watch`: follows `WatchLeases` and prints each event as it
/// comes, until the stream fails (an error) or the process is stopped.
async fn watch(
    client: &mut LeasesClient<Channel>,
    connection: &Connection,
    args: ListArgs,
    format: OutputFormat,
) -> Result<(), CliError> {
    let request = v1::WatchLeasesRequest {
        project: args.scope.project.unwrap_or_default(),
        all_projects: args.scope.all_projects,
        owner: args.owner.unwrap_or_default(),
        owner_prefix: String::new(),
        resume_cursor: 0,
    };
    let mut events = connection.answer(client.watch_leases(connection.request(request))).await?;
    if format == OutputFormat::Table {
        output::print(&watch_line(["EVENT", "LEASE", "PROJECT", "OWNER", "NODE", "PHASE", "EPOCH", "REASON"]))?;
    }
    loop {
        let Some(event) = events.message().await.map_err(|s| connection.status_error(s))? else {
            return Ok(());
        };
        let kind = event.kind();
        match (format, &event.lease) {
            (OutputFormat::Json, _) => {
                let event = output::message_json(&event)?;
                let mut line = serde_json::to_string(&event).map_err(|e| CliError::Output(e.into()))?;
                line.push('\n');
                output::print(&line)?;
            }
            (OutputFormat::Table, Some(lease)) => {
                let kind = kind.as_str_name().trim_start_matches("EVENT_KIND_");
                output::print(&watch_line([
                    kind,
                    &lease.lease_id,
                    &output::or_none(&lease.project),
                    &output::or_none(&lease.owner),
                    &output::or_none(&lease.node_id),
                    &output::lease_phase(lease.phase),
                    &lease.epoch.to_string(),
                    &output::lease_reason(lease),
                ]))?;
            }
            (OutputFormat::Table, None) => output::note("(every open lease shown; following changes)"),
        }
    }
}

/// One line of `lease list --watch`: event, lease, project, owner, node,
/// phase, epoch and reason, in columns wide enough for what they hold.
fn watch_line([kind, lease, project, owner, node, phase, epoch, reason]: [&str; 8]) -> String {
    format!("{kind:<8} {lease:<22} {project:<12} {owner:<24} {node:<16} {phase:<10} {epoch:>5}  {reason}\n")
}

/// What `release` did, in one line.
fn released_line(lease: &v1::Lease) -> String {
    let phase = output::lease_phase(lease.phase);
    if lease.phase == v1::LeasePhase::Released as i32 {
        format!("lease {} is {phase}: its node stops the workload and its compute is free\n", lease.lease_id)
    } else {
        format!(
            "lease {} had already ended {phase}: {}; nothing changed\n",
            lease.lease_id,
            output::lease_reason(lease)
        )
    }
}

/// Every field of a lease, one per line, like `kubectl describe`.
fn details(lease: &v1::Lease) -> String {
    let ago = |at: Option<&prost_types::Timestamp>| output::when(at, &format!("{} ago", output::age(at)));
    let expires = lease.expires_at.as_ref();
    let workload = lease.workload.clone().unwrap_or_default();
    let program = if workload.command.is_empty() {
        "<the bundle's entrypoint>".to_string()
    } else {
        std::iter::once(&workload.command).chain(&workload.args).map(|w| shell_word(w)).collect::<Vec<_>>().join(" ")
    };
    let rows: Vec<(&str, String)> = vec![
        ("ID", lease.lease_id.clone()),
        ("Project", output::or_none(&lease.project)),
        ("Owner", output::or_none(&lease.owner)),
        ("Phase", output::lease_phase(lease.phase)),
        ("Phase changed", ago(lease.phase_changed_at.as_ref())),
        ("Reason", output::or_none(&lease.reason)),
        ("Message", output::or_none(&lease.message)),
        ("Exit code", lease.exit_code.map_or_else(|| output::NONE.to_string(), |code| code.to_string())),
        ("Node", output::or_none(&lease.node_id)),
        ("Epoch", lease.epoch.to_string()),
        ("Resources", output::capacity(lease.resources.as_ref())),
        (
            "Node overhead",
            match lease.memory_overhead_bytes {
                0 => output::NONE.to_string(),
                bytes => format!("{} memory (held beside its resources, e.g. by its VMM)", output::memory(bytes)),
            },
        ),
        ("Resize", resize_line(lease)),
        ("Cache", cache_line(&workload, &lease.cache)),
        ("Tier", output::or_none(&lease.tier)),
        ("Spread group", output::or_none(&lease.spread_group)),
        ("Command", program),
        ("Environment", output::labels(&workload.env)),
        output::artifact_row(workload.artifact()),
        ("Service", output::or_none(&workload.service)),
        ("Revision", output::or_none(&workload.revision)),
        ("Created", ago(lease.created_at.as_ref())),
        ("Expires", output::when(expires, &output::until(expires))),
        ("Idempotency key", output::or_none(&lease.idempotency_key)),
    ];
    output::fields(&rows)
}

/// Each cache volume the workload mounts, where, and what it did:
/// `deps at /cache: hit from generation 3, published generation 4`.
fn cache_line(workload: &v1::Workload, observations: &[v1::CacheObservation]) -> String {
    if workload.cache.is_empty() {
        return output::NONE.to_string();
    }
    let volumes = workload.cache.iter().map(|mount| {
        let did = match observations.iter().find(|seen| seen.key == mount.key) {
            None => "not opened yet".to_string(),
            Some(seen) => {
                let outcome = if seen.outcome() == v1::CacheOutcome::Hit { "hit" } else { "miss" };
                let settled = if seen.committed_generation > 0 {
                    format!(", published generation {}", seen.committed_generation)
                } else if !seen.reason.is_empty() {
                    format!(", not published: {}", seen.reason)
                } else {
                    String::new()
                };
                format!("{outcome} from generation {}{settled}", seen.base_generation)
            }
        };
        format!("{} at {}: {did}", mount.key, mount.path)
    });
    volumes.collect::<Vec<_>>().join("; ")
}

/// `KEY:PATH[:COMMIT]` as a cache mount; the key and path are checked by
/// the ledger, the commit here.
fn parse_cache_mount(text: &str) -> Result<berth_proto::types::v1::CacheMount, String> {
    use berth_proto::types::v1::{CacheCommit, CacheMount};
    let mut parts = text.splitn(3, ':');
    let (Some(key), Some(path)) = (parts.next(), parts.next()) else {
        return Err(format!("'{text}' is not KEY:PATH[:COMMIT]"));
    };
    let commit = match parts.next() {
        None | Some("on_success" | "on-success") => CacheCommit::OnSuccess,
        Some("always") => CacheCommit::Always,
        Some("never") => CacheCommit::Never,
        Some(other) => return Err(format!("'{other}' is not a commit: on_success, always or never")),
    };
    Ok(CacheMount { key: key.to_string(), path: path.to_string(), commit: commit as i32 })
}

/// `word` as a POSIX shell would need it written to mean itself.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A CPU quantity as Kubernetes writes it (`500m`, `0.5`, `2`), in
/// thousandths of a core, above zero.
fn parse_cpu(value: &str) -> Result<u64, String> {
    let (number, unit) = match value.strip_suffix('m') {
        Some(number) => (number, 1),
        None => (value, 1000),
    };
    let (millis, exact) =
        scale(number, unit).ok_or_else(|| format!("'{value}' is not a cpu quantity (use 500m, 0.5 or 2)"))?;
    if !exact {
        return Err(format!("'{value}' is finer than 1m, a thousandth of a core"));
    }
    whole_amount(value, millis, "cpu")
}

/// The binary and decimal suffixes a memory quantity may carry, longest
/// first so `Mi` is not read as `M`.
const MEMORY_UNITS: [(&str, u64); 12] = [
    ("Ki", 1 << 10),
    ("Mi", 1 << 20),
    ("Gi", 1 << 30),
    ("Ti", 1 << 40),
    ("Pi", 1 << 50),
    ("Ei", 1 << 60),
    ("k", 1_000),
    ("M", 1_000_000),
    ("G", 1_000_000_000),
    ("T", 1_000_000_000_000),
    ("P", 1_000_000_000_000_000),
    ("E", 1_000_000_000_000_000_000),
];

/// A memory quantity as Kubernetes writes it (`64Mi`, `1.5Gi`, `512M`, or
/// bytes), in bytes rounded up, above zero.
fn parse_memory(value: &str) -> Result<u64, String> {
    let (number, unit) = MEMORY_UNITS
        .iter()
        .find_map(|(suffix, unit)| value.strip_suffix(suffix).map(|n| (n, *unit)))
        .unwrap_or((value, 1));
    let (bytes, _) =
        scale(number, unit).ok_or_else(|| format!("'{value}' is not a memory quantity (use 64Mi, 1Gi or 512M)"))?;
    whole_amount(value, bytes, "memory")
}

/// `amount` if it is above zero and fits the API.
fn whole_amount(value: &str, amount: u128, what: &str) -> Result<u64, String> {
    match u64::try_from(amount) {
        Ok(0) => Err(format!("'{value}' is zero; a lease needs some {what}")),
        Ok(amount) => Ok(amount),
        Err(_) => Err(format!("'{value}' is more {what} than any node has")),
    }
}

/// A decimal `number` (`2`, `0.5`, `.25`) times `unit`, rounded up, and
/// whether it came out whole; `None` when it is not a plain decimal.
fn scale(number: &str, unit: u64) -> Option<(u128, bool)> {
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = format!("{whole}{fraction}");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || number.ends_with('.') {
        return None;
    }
    let denominator = 10u128.checked_pow(u32::try_from(fraction.len()).ok()?)?;
    let numerator = digits.parse::<u128>().ok()?.checked_mul(u128::from(unit))?;
    Some((numerator.div_ceil(denominator), numerator % denominator == 0))
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[derive(Debug, Parser)]
    struct Berth {
        #[command(subcommand)]
        command: Top,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Top {
        Lease(LeaseArgs),
        Capacity(CapacityArgs),
    }

    // Regression: a request flag named like a global one (`--key`) made clap
    // panic at parse time instead of reading either.
    #[test]
    fn request_flags_stand_apart_from_the_global_ones() {
        Berth::command().debug_assert();
        let parsed = Berth::try_parse_from([
            "berth",
            "lease",
            "request",
            "--owner",
            "o",
            "--idempotency-key",
            "k1",
            "--key",
            "admin-key.pem",
            "--leases-server",
            "leases:7445",
            "--cpu",
            "0.5",
            "--memory",
            "1Gi",
            "--env",
            "A=1",
            "--",
            "sh",
            "-c",
            "exit 3",
        ])
        .unwrap();
        let Top::Lease(LeaseArgs { client, leases, command: LeaseCommand::Request(request) }) = parsed.command else {
            panic!("parsed as another command");
        };
        assert_eq!(client.key.as_deref(), Some(std::path::Path::new("admin-key.pem")));
        assert_eq!(leases.address.as_deref(), Some("leases:7445"));
        assert_eq!(request.idempotency_key.as_deref(), Some("k1"));
        assert_eq!((request.cpu, request.memory), (500, 1 << 30));
        assert_eq!(request.command, ["sh", "-c", "exit 3"]);
    }

    #[test]
    fn a_resize_names_at_least_one_new_size() {
        let parsed = Berth::try_parse_from(["berth", "lease", "resize", "l-1", "--memory", "2Gi", "--wait"]).unwrap();
        let Top::Lease(LeaseArgs { command: LeaseCommand::Resize(resize), .. }) = parsed.command else {
            panic!("parsed as another command");
        };
        assert_eq!((resize.lease_id.as_str(), resize.cpu, resize.memory), ("l-1", None, Some(2 << 30)));
        assert!(resize.wait && resize.epoch.is_none());
        let neither = Berth::try_parse_from(["berth", "lease", "resize", "l-1"]).unwrap_err();
        assert!(neither.to_string().contains("--cpu"), "{neither}");
        let bad = Berth::try_parse_from(["berth", "lease", "resize", "l-1", "--cpu", "lots"]).unwrap_err();
        assert!(bad.to_string().contains("--cpu"), "{bad}");
    }

    #[test]
    fn cpu_reads_like_kubernetes() {
        assert_eq!(parse_cpu("100m"), Ok(100));
        assert_eq!(parse_cpu("0.5"), Ok(500));
        assert_eq!(parse_cpu(".25"), Ok(250));
        assert_eq!(parse_cpu("2"), Ok(2000));
        assert_eq!(parse_cpu("1.5"), Ok(1500));
    }

    #[test]
    fn cpu_refusals_say_what_is_wrong() {
        assert_eq!(parse_cpu("2x"), Err("'2x' is not a cpu quantity (use 500m, 0.5 or 2)".to_string()));
        for bad in ["", "m", "1.", "-1", "1e3", " 1", "1 ", "1..2"] {
            assert!(parse_cpu(bad).unwrap_err().contains("not a cpu quantity"), "{bad}");
        }
        assert!(parse_cpu("0.0005").unwrap_err().contains("finer than 1m"));
        assert!(parse_cpu("0.5m").unwrap_err().contains("finer than 1m"));
        assert!(parse_cpu("0").unwrap_err().contains("is zero"));
        assert!(parse_cpu("0m").unwrap_err().contains("is zero"));
        assert!(parse_cpu("99999999999999999999").unwrap_err().contains("more cpu"));
    }

    #[test]
    fn memory_reads_binary_and_decimal_units() {
        assert_eq!(parse_memory("64Mi"), Ok(64 << 20));
        assert_eq!(parse_memory("1Gi"), Ok(1 << 30));
        assert_eq!(parse_memory("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_memory("512M"), Ok(512_000_000));
        assert_eq!(parse_memory("2k"), Ok(2000));
        assert_eq!(parse_memory("4096"), Ok(4096));
        // A fraction of a byte is one more byte, as Kubernetes rounds.
        assert_eq!(parse_memory("0.1Ki"), Ok(103));
    }

    #[test]
    fn memory_refusals_say_what_is_wrong() {
        assert_eq!(parse_memory("64Mb"), Err("'64Mb' is not a memory quantity (use 64Mi, 1Gi or 512M)".to_string()));
        for bad in ["", "Mi", "1m", "1.Gi", "-1Gi", "1 Gi"] {
            assert!(parse_memory(bad).unwrap_err().contains("not a memory quantity"), "{bad}");
        }
        assert!(parse_memory("0Mi").unwrap_err().contains("is zero"));
        assert!(parse_memory("100Ei").unwrap_err().contains("more memory"));
    }

    #[test]
    fn commands_are_shown_as_a_shell_would_take_them() {
        assert_eq!(shell_word("sleep"), "sleep");
        assert_eq!(shell_word("echo hi; exit 3"), "'echo hi; exit 3'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
