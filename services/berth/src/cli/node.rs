//! `berth node list|get|drain|revoke|upgrade|upgrade-status`: the node
//! registry as an operator sees and steers it.

use berth_proto::identity::v1;
use berth_proto::identity::v1::nodes_client::NodesClient;
use berth_proto::leases::v1::ListLeasesRequest as LeasesRequest;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_rpc::Channel;
use tonic::{Code, Status};

use super::output::{self, Table};
use super::{CliError, ClientArgs, IdentityConnection, OutputFormat};

/// Flags of `berth node`.
#[derive(Debug, clap::Args)]
pub(crate) struct NodeArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    leases: super::lease::LeasesServerArgs,
    #[command(subcommand)]
    command: NodeCommand,
}

#[derive(Debug, clap::Subcommand)]
enum NodeCommand {
    /// List nodes, ordered by id.
    List {
        /// Only nodes in this tier.
        #[arg(long, value_name = "TIER")]
        tier: Option<String>,
        /// Only nodes in this state.
        #[arg(long, value_enum, value_name = "STATE")]
        state: Option<StateFilter>,
    },
    /// Show one node in full.
    Get {
        /// The node's id.
        #[arg(value_name = "NODE_ID")]
        node_id: String,
    },
    /// Drain a node: no new leases are placed on it, services' replicas
    /// there are replaced elsewhere before they stop, and every open lease
    /// is told (reason NodeDraining); e.g. `berth node drain n-1 --deadline 10m`.
    Drain {
        /// The node's id.
        #[arg(value_name = "NODE_ID")]
        node_id: String,
        /// Release whatever is still open on the node this long from now
        /// (`30m`, `1h`; a bare number is seconds) [default: no deadline].
        #[arg(long, value_name = "DURATION", value_parser = super::parse_ttl, conflicts_with = "undo")]
        deadline: Option<u32>,
        /// Wait until no open lease is left on the node, saying how many are
        /// left as that changes.
        #[arg(long, conflicts_with = "undo")]
        wait: bool,
        /// Lift the drain instead, so leases may be placed on the node again.
        #[arg(long)]
        undo: bool,
    },
    /// Roll a new agent out over nodes, e.g. `berth node upgrade --all --to
    /// registry.example.com/berth/agent:1.4.0 --max-unavailable 2 --canary 1`.
    /// The artifact is a berth bundle with `berth-agent` at its root
    /// (`berth bundle push DIR REF`); its tag is resolved once, and
    /// each node's updater installs it beside the old agent, putting the old
    /// one back if the new one does not report in. Workloads keep running.
    Upgrade {
        /// The nodes, by id.
        #[arg(value_name = "NODE_ID", required_unless_present_any = ["tier", "all"])]
        node_ids: Vec<String>,
        /// Every node of this tier.
        #[arg(long, value_name = "TIER", conflicts_with_all = ["node_ids", "all"])]
        tier: Option<String>,
        /// Every node.
        #[arg(long, conflicts_with = "node_ids")]
        all: bool,
        /// The agent artifact, by tag or digest.
        #[arg(long, value_name = "REF")]
        to: String,
        /// Nodes upgrading at once.
        #[arg(long, value_name = "N", default_value_t = 1)]
        max_unavailable: u32,
        /// Nodes upgraded first, alone, before any other.
        #[arg(long, value_name = "N", default_value_t = 0)]
        canary: u32,
        /// Failed nodes tolerated before the rollout pauses itself.
        #[arg(long, value_name = "N", default_value_t = 0)]
        max_failures: u32,
        /// Wait until the rollout is done or paused, saying each node's
        /// outcome as it comes; exits non-zero if it paused.
        #[arg(long)]
        wait: bool,
    },
    /// Show a fleet upgrade: each node's state, and why one failed.
    UpgradeStatus {
        /// The upgrade's id [default: the latest].
        #[arg(value_name = "UPGRADE_ID")]
        upgrade_id: Option<String>,
    },
    /// Revoke a node for good: its certificate is refused everywhere within
    /// seconds and it cannot rejoin without a new token.
    Revoke {
        /// The node's id.
        #[arg(value_name = "NODE_ID")]
        node_id: String,
        /// Why, for the audit log.
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
    },
}

/// The states `node list --state` filters on.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum StateFilter {
    /// Joined, no heartbeat yet.
    Joining,
    /// Heartbeating; leases may be placed on it.
    Up,
    /// Missed its heartbeats.
    Down,
    /// Heartbeating, but no new leases are placed on it.
    Draining,
    /// Revoked by an operator.
    Revoked,
}

impl From<StateFilter> for v1::NodeState {
    fn from(filter: StateFilter) -> Self {
        match filter {
            StateFilter::Joining => v1::NodeState::Joining,
            StateFilter::Up => v1::NodeState::Up,
            StateFilter::Down => v1::NodeState::Down,
            StateFilter::Draining => v1::NodeState::Draining,
            StateFilter::Revoked => v1::NodeState::Revoked,
        }
    }
}

impl NodeArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let connection = self.client.connect()?;
        let mut client = NodesClient::new(connection.channel.clone());
        let format = self.client.output;
        match self.command {
            NodeCommand::List { tier, state } => {
                let request = v1::ListNodesRequest {
                    tier: tier.unwrap_or_default(),
                    state: state.map_or(v1::NodeState::Unspecified, v1::NodeState::from) as i32,
                };
                let listed = connection.answer(client.list_nodes(connection.request(request))).await?;
                print_list(&listed, format)
            }
            NodeCommand::Get { node_id } => {
                let got =
                    match client.get_node(connection.request(v1::GetNodeRequest { node_id: node_id.clone() })).await {
                        Ok(got) => got.into_inner(),
                        Err(status) => return Err(node_error(&mut client, &connection, status, &node_id).await),
                    };
                let node = got.node.as_ref().ok_or(CliError::IncompleteResponse("the node"))?;
                match format {
                    OutputFormat::Json => output::print_message(&got),
                    OutputFormat::Table => {
                        let progress = match node.state() {
                            v1::NodeState::Draining => {
                                Some(drain_progress(&self.leases, &self.client, &node.node_id).await)
                            }
                            _ => None,
                        };
                        output::print(&details(node, progress))
                    }
                }
            }
            NodeCommand::Drain { node_id, deadline, wait, undo } => {
                let deadline = deadline.map(|seconds| prost_types::Duration { seconds: i64::from(seconds), nanos: 0 });
                let request = v1::DrainNodeRequest { node_id: node_id.clone(), undrain: undo, deadline };
                let drained = match client.drain_node(connection.request(request)).await {
                    Ok(drained) => drained.into_inner(),
                    Err(status) => return Err(node_error(&mut client, &connection, status, &node_id).await),
                };
                let node = drained.node.as_ref().ok_or(CliError::IncompleteResponse("the node"))?;
                let what = match (undo, node.drain_deadline.as_ref()) {
                    (true, _) => "leases may be placed on it again".to_string(),
                    (false, None) => "no new leases are placed on it and its work moves off".to_string(),
                    (false, Some(at)) => format!(
                        "no new leases are placed on it, its work moves off, and what is left is released {}",
                        output::until(Some(at))
                    ),
                };
                let what = what.as_str();
                print_changed(node, what, format)?;
                if wait {
                    wait_until_empty(&self.leases, &self.client, &node.node_id).await?;
                }
                Ok(())
            }
            NodeCommand::Upgrade { node_ids, tier, all, to, max_unavailable, canary, max_failures, wait } => {
                let request = v1::UpgradeNodesRequest {
                    node_ids,
                    tier: tier.unwrap_or_default(),
                    all,
                    to,
                    max_unavailable,
                    canary,
                    max_failures,
                };
                let started = connection.answer(client.upgrade_nodes(connection.request(request))).await?;
                let upgrade = started.upgrade.as_ref().ok_or(CliError::IncompleteResponse("the upgrade"))?;
                match format {
                    OutputFormat::Json if !wait => output::print_message(&started)?,
                    OutputFormat::Json => {}
                    OutputFormat::Table => output::print(&format!(
                        "upgrade {} started: {} node(s) to {}\n",
                        upgrade.upgrade_id,
                        upgrade.nodes.len(),
                        upgrade.artifact
                    ))?,
                }
                if wait {
                    let done = wait_for_upgrade(&mut client, &connection, &upgrade.upgrade_id, format).await?;
                    if done.state() == v1::UpgradeState::Paused {
                        return Err(CliError::Refused(format!("upgrade {} paused: {}", done.upgrade_id, done.reason)));
                    }
                }
                Ok(())
            }
            NodeCommand::UpgradeStatus { upgrade_id } => {
                let got = get_upgrade(&mut client, &connection, &upgrade_id.unwrap_or_default()).await?;
                let upgrade = got.upgrade.as_ref().ok_or(CliError::IncompleteResponse("the upgrade"))?;
                output::print_answer(format, &got, || upgrade_details(upgrade))
            }
            NodeCommand::Revoke { node_id, reason } => {
                let request = v1::RevokeNodeRequest { node_id: node_id.clone(), reason: reason.unwrap_or_default() };
                let revoked = match client.revoke_node(connection.request(request)).await {
                    Ok(revoked) => revoked.into_inner(),
                    Err(status) => return Err(node_error(&mut client, &connection, status, &node_id).await),
                };
                let node = revoked.node.as_ref().ok_or(CliError::IncompleteResponse("the node"))?;
                print_changed(node, "its certificate is refused everywhere", format)
            }
        }
    }
}

/// How often `upgrade --wait` looks at the rollout.
const UPGRADE_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// Waits until the rollout is no longer running, saying each node's
/// outcome once; returns the rollout as it ended.
async fn wait_for_upgrade(
    client: &mut NodesClient<Channel>,
    connection: &IdentityConnection,
    upgrade_id: &str,
    format: OutputFormat,
) -> Result<v1::Upgrade, CliError> {
    let mut said = std::collections::HashMap::new();
    loop {
        let got = get_upgrade(client, connection, upgrade_id).await?;
        let upgrade = got.upgrade.clone().ok_or(CliError::IncompleteResponse("the upgrade"))?;
        if format == OutputFormat::Table {
            for node in &upgrade.nodes {
                if said.get(&node.node_id) != Some(&node.state) && node.state() != v1::NodeUpgradeState::Pending {
                    said.insert(node.node_id.clone(), node.state);
                    output::print(&format!("{}: {}\n", node.node_id, node_upgrade_line(node)))?;
                }
            }
        }
        if upgrade.state() != v1::UpgradeState::Running {
            match format {
                OutputFormat::Json => output::print_message(&got)?,
                OutputFormat::Table => output::print(&format!(
                    "upgrade {} is {}{}\n",
                    upgrade.upgrade_id,
                    upgrade_state(upgrade.state),
                    if upgrade.reason.is_empty() { String::new() } else { format!(": {}", upgrade.reason) }
                ))?,
            }
            return Ok(upgrade);
        }
        tokio::time::sleep(UPGRADE_POLL).await;
    }
}

/// `GetUpgrade` of `upgrade_id` (empty: the latest).
async fn get_upgrade(
    client: &mut NodesClient<Channel>,
    connection: &IdentityConnection,
    upgrade_id: &str,
) -> Result<v1::GetUpgradeResponse, CliError> {
    let request = v1::GetUpgradeRequest { upgrade_id: upgrade_id.to_owned() };
    connection.answer(client.get_upgrade(connection.request(request))).await
}

fn upgrade_state(state: i32) -> String {
    v1::UpgradeState::try_from(state)
        .map_or_else(|_| format!("UNKNOWN({state})"), |s| s.as_str_name().trim_start_matches("UPGRADE_STATE_").into())
}

fn node_upgrade_state(state: i32) -> String {
    v1::NodeUpgradeState::try_from(state).map_or_else(
        |_| format!("UNKNOWN({state})"),
        |s| s.as_str_name().trim_start_matches("NODE_UPGRADE_STATE_").into(),
    )
}

/// A node's part in an upgrade as one line: its state, and the version
/// it reached or why it failed.
fn node_upgrade_line(node: &v1::NodeUpgrade) -> String {
    match node.state() {
        v1::NodeUpgradeState::Succeeded => format!("SUCCEEDED, now at {}", output::or_none(&node.version)),
        v1::NodeUpgradeState::Failed => format!("FAILED: {}", node.reason),
        _ => node_upgrade_state(node.state),
    }
}

/// An upgrade as `upgrade-status` shows it: the rollout, then its nodes.
fn upgrade_details(upgrade: &v1::Upgrade) -> String {
    let count = |state: v1::NodeUpgradeState| upgrade.nodes.iter().filter(|n| n.state() == state).count();
    let rows: Vec<(&str, String)> = vec![
        ("Upgrade", upgrade.upgrade_id.clone()),
        ("State", upgrade_state(upgrade.state)),
        ("Reason", output::or_none(&upgrade.reason)),
        ("Reference", upgrade.reference.clone()),
        ("Artifact", upgrade.artifact.clone()),
        (
            "Progress",
            format!(
                "{} of {} succeeded, {} failed",
                count(v1::NodeUpgradeState::Succeeded),
                upgrade.nodes.len(),
                count(v1::NodeUpgradeState::Failed)
            ),
        ),
        (
            "Pace",
            format!(
                "{} at once, {} canary, {} failure(s) tolerated",
                upgrade.max_unavailable, upgrade.canary, upgrade.max_failures
            ),
        ),
        ("Started by", output::or_none(&upgrade.created_by)),
        (
            "Started",
            output::when(upgrade.created_at.as_ref(), &format!("{} ago", output::age(upgrade.created_at.as_ref()))),
        ),
    ];
    let mut table = Table::new(vec!["NODE", "STATE", "CANARY", "VERSION", "REASON"]);
    for node in &upgrade.nodes {
        table.row(vec![
            node.node_id.clone(),
            node_upgrade_state(node.state),
            if node.canary { "yes".into() } else { "no".into() },
            output::or_none(&node.version),
            output::or_none(&node.reason),
        ]);
    }
    format!("{}\n{}", output::fields(&rows), table.render())
}

/// How often `drain --wait` looks at what is left on the node.
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// Waits until no open lease is left on `node_id`, noting each change.
async fn wait_until_empty(
    leases: &super::lease::LeasesServerArgs,
    client: &ClientArgs,
    node_id: &str,
) -> Result<(), CliError> {
    let connection = leases.connect(client, client.credentials()?).await?;
    let mut last = String::new();
    loop {
        let request = LeasesRequest { node_id: node_id.to_string(), all_projects: true, ..Default::default() };
        let listed = connection
            .answer(LeasesClient::new(connection.channel.clone()).list_leases(connection.request(request)))
            .await?;
        let line = drain_line(&listed.leases);
        if line != last {
            output::note(&format!("node {node_id}: {line}"));
            last = line;
        }
        if open_of(&listed.leases).is_empty() {
            return Ok(());
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
}

/// The open leases among `leases`.
fn open_of(leases: &[berth_proto::leases::v1::Lease]) -> Vec<&berth_proto::leases::v1::Lease> {
    use berth_proto::leases::v1::LeasePhase;
    leases
        .iter()
        .filter(|l| {
            matches!(l.phase(), LeasePhase::Pending | LeasePhase::Bound | LeasePhase::Launching | LeasePhase::Running)
        })
        .collect()
}

/// What is still open on a draining node, as a line of `node get`.
async fn drain_progress(leases: &super::lease::LeasesServerArgs, client: &ClientArgs, node_id: &str) -> String {
    let listed = async {
        let connection = leases.connect(client, client.credentials()?).await?;
        let request = LeasesRequest { node_id: node_id.to_string(), all_projects: true, ..Default::default() };
        let listed = LeasesClient::new(connection.channel.clone())
            .list_leases(connection.request(request))
            .await
            .map_err(|s| connection.status_error(s))?;
        Ok::<_, CliError>(listed.into_inner().leases)
    };
    match listed.await {
        Ok(leases) => drain_line(&leases),
        Err(error) => format!("unknown ({error})"),
    }
}

/// How far a drain got, from the leases still on the node.
fn drain_line(leases: &[berth_proto::leases::v1::Lease]) -> String {
    let open = open_of(leases);
    if open.is_empty() {
        return "done: no open lease is left on the node".to_string();
    }
    let replicas = open.iter().filter(|l| l.workload.as_ref().is_some_and(|w| !w.service.is_empty())).count();
    format!(
        "{} open leases left: {replicas} service replicas being replaced elsewhere, {} other leases",
        open.len(),
        open.len() - replicas
    )
}

/// The status as an error. Operators know hosts by name, so an id that is
/// no node's but is some node's name gets the id it stands for.
async fn node_error(
    client: &mut NodesClient<Channel>,
    connection: &IdentityConnection,
    status: Status,
    node_id: &str,
) -> CliError {
    let not_found = status.code() == Code::NotFound;
    let error = connection.status_error(status);
    if !not_found {
        return error;
    }
    let Ok(listed) = client.list_nodes(connection.request(v1::ListNodesRequest::default())).await else {
        return error;
    };
    let ids: Vec<String> =
        listed.into_inner().nodes.into_iter().filter(|n| n.name == node_id).map(|n| n.node_id).collect();
    match ids.as_slice() {
        [] => error,
        [id] => CliError::Refused(format!("{error}; '{node_id}' is the name of node {id}: pass its id")),
        _ => CliError::Refused(format!("{error}; '{node_id}' names nodes {}: pass one id", ids.join(", "))),
    }
}

fn print_list(listed: &v1::ListNodesResponse, format: OutputFormat) -> Result<(), CliError> {
    let headers = vec!["ID", "NAME", "STATE", "TIER", "ADDRESS", "HEARTBEAT", "AGE", "VERSION"];
    output::print_listed(listed, &listed.nodes, "nodes", format, headers, |node| {
        vec![
            node.node_id.clone(),
            output::or_none(&node.name),
            output::node_state(node.state),
            output::or_none(&node.tier),
            output::or_none(&node.advertise_addr),
            output::age(node.last_heartbeat_at.as_ref()),
            output::age(node.joined_at.as_ref()),
            output::or_none(&node.version),
        ]
    })
}

/// A drain or revoke as one line: the node, its state now, and what that means.
fn print_changed(node: &v1::Node, what: &str, format: OutputFormat) -> Result<(), CliError> {
    match format {
        OutputFormat::Json => output::print_message(&v1::GetNodeResponse { node: Some(node.clone()) }),
        OutputFormat::Table => {
            output::print(&format!("node {} is {}: {what}\n", node.node_id, output::node_state(node.state)))
        }
    }
}

/// Every field of a node, one per line, like `kubectl describe`.
fn details(node: &v1::Node, drain_progress: Option<String>) -> String {
    let ago = |at: Option<&prost_types::Timestamp>| output::when(at, &format!("{} ago", output::age(at)));
    let expires = node.certificate_expires_at.as_ref();
    let mut rows: Vec<(&str, String)> = vec![
        ("ID", node.node_id.clone()),
        ("Name", output::or_none(&node.name)),
        ("State", output::node_state(node.state)),
        ("State changed", ago(node.state_changed_at.as_ref())),
        ("Drain deadline", output::when(node.drain_deadline.as_ref(), &output::until(node.drain_deadline.as_ref()))),
        ("Tier", output::or_none(&node.tier)),
        ("Labels", output::labels(&node.labels)),
        ("Address", output::or_none(&node.advertise_addr)),
        ("Incarnation", node.incarnation.to_string()),
        ("Version", output::or_none(&node.version)),
        ("Last heartbeat", ago(node.last_heartbeat_at.as_ref())),
        ("Joined", ago(node.joined_at.as_ref())),
        ("Join token", output::or_none(&node.join_token_id)),
        ("Capacity", output::capacity(node.capacity.as_ref())),
        ("Usage", output::capacity(node.usage.as_ref())),
        ("Certificate expires", output::when(expires, &output::until(expires))),
    ];
    if let Some(upgrade) = &node.upgrade {
        let state = match upgrade.state() {
            v1::NodeUpgradeState::Failed => format!("FAILED: {}", upgrade.reason),
            _ => node_upgrade_state(upgrade.state),
        };
        rows.push(("Upgrade", format!("{} {state} ({})", upgrade.upgrade_id, upgrade.artifact)));
    }
    rows.extend(drain_progress.map(|progress| ("Drain progress", progress)));
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    rows.iter().map(|(key, value)| format!("{:<width$}  {value}\n", format!("{key}:"))).collect()
}
