//! `berth service apply|get|list|delete|pin|unpin|redeploy` and `berth
//! revision list|get`: services as the user declares them and the revisions
//! minted from them, spoken to revisions.
//!
//! # Where revisions is
//! `--revisions-server` (or `BERTH_REVISIONS_SERVER`); without it, where
//! identity says (`Mesh/GetEndpoints`). `service get` also lists the
//! service's replicas from leases (found the same way): each open lease, its node
//! (named by identity), and the node port its first port was given, as the
//! node reported it running. No agent is dialled, so an operator who
//! reaches only the control plane (from outside a compose network, say)
//! sees them all.
//!
//! # What a spec file holds
//! JSON or YAML, read as [`spec_file`] says, one schema: either a whole
//! declaration, `{project?, name, template, source?}`, or just the template
//! (the fields of `ServiceTemplate`) with `--name` on the command line.
//! Field names are the proto's, in snake_case or lowerCamel. It is converted
//! field by field before anything is dialled: an unknown field or a value of
//! the wrong type is named by its path, e.g. `template.replicas`, and
//! `env: {PORT: 8080}` is refused like its JSON twin, since environment
//! values are strings.
//!
//! # How redeploy mints a revision
//! Applying an unchanged declaration mints nothing. `redeploy` applies the
//! current template again with `source.labels["berth.redeploy"]` set to the
//! time now; a source change mints a revision, so the replicas are replaced
//! while what runs stays the same.

use std::time::{Duration, Instant, SystemTime};

use berth_mtls::TlsCredentials;
use berth_proto::identity::v1::ListNodesRequest;
use berth_proto::identity::v1::nodes_client::NodesClient;
use berth_proto::leases::v1::leases_client::LeasesClient;
use berth_proto::leases::v1::{Lease, LeasePhase, ListLeasesRequest};
use berth_proto::revisions::v1;
use berth_proto::revisions::v1::revisions_client::RevisionsClient;
use berth_proto::revisions::v1::services_client::ServicesClient;
use berth_proto::types::v1::{BundleRef, Capacity, Condition, ConditionStatus, Port};
use berth_rpc::Channel;
use serde_json::{Value, json};

use super::lease::LeasesServerArgs;
use super::output::{self, Table};
use super::spec_fields::{Fields, Refusal};
use super::spec_file::{self, SpecError, SpecFileArgs};
use super::{CliError, ClientArgs, Connection, OutputFormat, ProjectScopeArgs, parse_server};

/// How often `--wait` asks how the rollout is doing.
const WAIT_POLL: Duration = Duration::from_millis(500);

/// The source label `redeploy` sets to mint a revision of an unchanged
/// template.
const REDEPLOY_LABEL: &str = "berth.redeploy";

/// A bundle resolution that failed for this reason is tried again by
/// revisions, so `--wait` keeps waiting through it.
const TRANSIENT_RESOLVE_REASON: &str = "RegistryUnavailable";

/// Where the revisions service is, for every command that talks to it.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Global options")]
struct RevisionsServerArgs {
    /// The revisions service to talk to [default: where identity says it is].
    #[arg(long = "revisions-server", env = "BERTH_REVISIONS_SERVER", value_name = "HOST:PORT",
          value_parser = parse_server, global = true)]
    address: Option<String>,
}

impl RevisionsServerArgs {
    /// A channel to revisions with `credentials`; nothing is dialled until
    /// the first call.
    async fn connect(&self, client: &ClientArgs, credentials: TlsCredentials) -> Result<Revisions, CliError> {
        let address = client.endpoint("revisions", self.address.as_ref(), "--revisions-server", &credentials).await?;
        let connection = Connection::open("revisions", &address, credentials)?;
        Ok(Revisions {
            services: ServicesClient::new(connection.channel.clone()),
            revisions: RevisionsClient::new(connection.channel.clone()),
            connection,
        })
    }
}

/// Flags of `berth service`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServiceArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    revisions: RevisionsServerArgs,
    #[command(flatten)]
    leases: LeasesServerArgs,
    #[command(subcommand)]
    command: ServiceCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ServiceCommand {
    /// Create or update a service from a JSON or YAML spec, e.g. `berth
    /// service apply -f examples/hello/service.yaml --name hello --wait`. A
    /// new revision is minted only when the template or source changed.
    Apply(ApplyArgs),
    /// Show one service: its revisions, conditions and replicas.
    Get(ServiceName),
    /// List services, by name.
    List(ListArgs),
    /// Delete a service and its revisions; its replicas are stopped.
    Delete(ServiceName),
    /// Send the service's traffic to one of its revisions, whatever is
    /// applied later, until `unpin`.
    Pin {
        #[command(flatten)]
        service: ServiceName,
        /// The revision, e.g. `hello-00001`.
        #[arg(value_name = "REVISION")]
        revision: String,
    },
    /// Return the service's traffic to its latest ready revision.
    Unpin(ServiceName),
    /// Split the service's traffic among its revisions, e.g. `berth service
    /// traffic hello --to hello-00003=90,hello-00004=10 --tag
    /// canary=hello-00004`. Every revision named keeps its replicas running.
    Traffic(TrafficArgs),
    /// Mint a new revision of the current template, replacing every replica,
    /// by setting the source label `berth.redeploy` to the time now.
    Redeploy {
        #[command(flatten)]
        service: ServiceName,
        #[command(flatten)]
        wait: WaitArgs,
    },
}

/// One service, by name.
#[derive(Debug, clap::Args)]
struct ServiceName {
    /// The service's name.
    #[arg(value_name = "NAME")]
    name: String,
    /// The service's project [default: default].
    #[arg(long, value_name = "PROJECT")]
    project: Option<String>,
}

#[derive(Debug, clap::Args)]
struct TrafficArgs {
    #[command(flatten)]
    service: ServiceName,
    /// Shares of the traffic, `REVISION=PERCENT` (or `latest=PERCENT` for the
    /// latest ready revision), summing to 100.
    #[arg(long = "to", value_name = "REVISION=PERCENT", value_delimiter = ',', required = true,
          value_parser = parse_share)]
    to: Vec<(String, u32)>,
    /// Names a share: `TAG=REVISION` reaches REVISION at
    /// `TAG--<service>.<project>.<domain>` (a revision no `--to` names is
    /// added at 0 percent).
    #[arg(long = "tag", value_name = "TAG=REVISION", value_delimiter = ',', value_parser = parse_tag)]
    tags: Vec<(String, String)>,
    /// Keep each client on one revision and replica by the value of this
    /// request header (e.g. x-user-id).
    #[arg(long = "sticky-header", value_name = "HEADER", conflicts_with = "sticky_cookie")]
    sticky_header: Option<String>,
    /// Keep each client on one revision and replica by this cookie, which
    /// the router gives a client that comes without it.
    #[arg(long = "sticky-cookie", value_name = "NAME")]
    sticky_cookie: Option<String>,
}

impl TrafficArgs {
    /// The session affinity the flags ask for, if any.
    fn affinity(&self) -> Option<v1::SessionAffinity> {
        match (&self.sticky_header, &self.sticky_cookie) {
            (None, None) => None,
            (header, cookie) => Some(v1::SessionAffinity {
                header: header.clone().unwrap_or_default(),
                cookie: cookie.clone().unwrap_or_default(),
            }),
        }
    }
}

/// `REVISION=PERCENT`.
fn parse_share(text: &str) -> Result<(String, u32), String> {
    let bad = || format!("'{text}' is not REVISION=PERCENT, e.g. hello-00003=90 or latest=10");
    let (revision, percent) = text.split_once('=').ok_or_else(bad)?;
    let percent = percent.trim().parse::<u32>().map_err(|_| bad())?;
    if revision.trim().is_empty() {
        return Err(bad());
    }
    Ok((revision.trim().to_string(), percent))
}

/// `TAG=REVISION`.
fn parse_tag(text: &str) -> Result<(String, String), String> {
    let bad = || format!("'{text}' is not TAG=REVISION, e.g. canary=hello-00004");
    let (tag, revision) = text.split_once('=').ok_or_else(bad)?;
    if tag.trim().is_empty() || revision.trim().is_empty() {
        return Err(bad());
    }
    Ok((tag.trim().to_string(), revision.trim().to_string()))
}

/// The targets `--to` and `--tag` make: one per share, tagged where a tag
/// names its revision, then one at 0 percent per tag of a revision no share names.
fn traffic_targets(args: &TrafficArgs) -> Vec<v1::TrafficTarget> {
    let target = |revision: &str, percent: u32, tag: &str| {
        let latest = revision == "latest";
        v1::TrafficTarget {
            revision: if latest { String::new() } else { revision.to_string() },
            latest,
            percent,
            tag: tag.to_string(),
        }
    };
    let mut tags: Vec<&(String, String)> = args.tags.iter().collect();
    let mut targets = Vec::new();
    for (revision, percent) in &args.to {
        let tag = tags.iter().position(|(_, r)| r == revision).map(|i| tags.remove(i).0.clone()).unwrap_or_default();
        targets.push(target(revision, *percent, &tag));
    }
    targets.extend(tags.into_iter().map(|(tag, revision)| target(revision, 0, tag)));
    targets
}

#[derive(Debug, clap::Args)]
struct ApplyArgs {
    #[command(flatten)]
    spec: SpecFileArgs,
    #[command(flatten)]
    wait: WaitArgs,
}

#[derive(Debug, Clone, clap::Args)]
struct WaitArgs {
    /// Wait until the revision takes the traffic with all its replicas
    /// running, or fails.
    #[arg(long)]
    wait: bool,
    /// How long `--wait` waits before giving up.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = berth_runtime::parse_duration,
          requires = "wait")]
    timeout: Duration,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    #[command(flatten)]
    scope: ProjectScopeArgs,
}

/// Flags of `berth revision`.
#[derive(Debug, clap::Args)]
pub(crate) struct RevisionArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    revisions: RevisionsServerArgs,
    #[command(subcommand)]
    command: RevisionCommand,
}

#[derive(Debug, clap::Subcommand)]
enum RevisionCommand {
    /// List a service's revisions, newest first.
    List {
        /// The service's name.
        #[arg(value_name = "SERVICE")]
        service: String,
        /// The service's project [default: default].
        #[arg(long, value_name = "PROJECT")]
        project: Option<String>,
    },
    /// Show one revision in full.
    Get {
        /// The revision's name, e.g. `hello-00002`.
        #[arg(value_name = "NAME")]
        name: String,
        /// The revision's project [default: default].
        #[arg(long, value_name = "PROJECT")]
        project: Option<String>,
    },
}

/// The two clients of the revisions service and the connection under them.
#[derive(Debug)]
struct Revisions {
    services: ServicesClient<Channel>,
    revisions: RevisionsClient<Channel>,
    connection: Connection,
}

impl Revisions {
    async fn get_service(&mut self, project: &str, name: &str) -> Result<v1::Service, CliError> {
        let request = v1::GetServiceRequest { project: project.to_string(), name: name.to_string() };
        self.connection
            .answer(self.services.get_service(self.connection.request(request)))
            .await?
            .service
            .ok_or(CliError::IncompleteResponse("the service"))
    }

    async fn get_revision(&mut self, project: &str, name: &str) -> Result<v1::Revision, CliError> {
        let request = v1::GetRevisionRequest { project: project.to_string(), name: name.to_string() };
        self.connection
            .answer(self.revisions.get_revision(self.connection.request(request)))
            .await?
            .revision
            .ok_or(CliError::IncompleteResponse("the revision"))
    }

    async fn apply(&mut self, request: v1::ApplyServiceRequest) -> Result<v1::ApplyServiceResponse, CliError> {
        self.connection.answer(self.services.apply_service(self.connection.request(request))).await
    }

    /// The session affinity `target` has now.
    async fn affinity(&mut self, target: &ServiceName) -> Result<Option<v1::SessionAffinity>, CliError> {
        let project = target.project.clone().unwrap_or_default();
        let service = self.get_service(&project, &target.name).await?;
        Ok(service.status.and_then(|status| status.affinity))
    }

    async fn set_traffic(
        &mut self,
        target: &ServiceName,
        pinned: &str,
        targets: Vec<v1::TrafficTarget>,
        affinity: Option<v1::SessionAffinity>,
    ) -> Result<v1::Service, CliError> {
        let request = v1::SetTrafficRequest {
            project: target.project.clone().unwrap_or_default(),
            name: target.name.clone(),
            pinned_revision: pinned.to_string(),
            targets,
            affinity,
        };
        self.connection
            .answer(self.services.set_traffic(self.connection.request(request)))
            .await?
            .service
            .ok_or(CliError::IncompleteResponse("the service"))
    }

    /// Polls the service until `revision` (or the pinned revision, when
    /// traffic is pinned) is live with every replica running, or fails.
    async fn wait_live(
        &mut self,
        project: &str,
        name: &str,
        revision: &str,
        wait: &WaitArgs,
    ) -> Result<v1::Service, CliError> {
        let started = Instant::now();
        loop {
            let service = self.get_service(project, name).await?;
            let status = service.status.clone().unwrap_or_default();
            let target = if service.pinned_revision.is_empty() { revision } else { service.pinned_revision.as_str() };
            if status.live_revision == target && status.replicas_running == status.replicas_desired {
                return Ok(service);
            }
            let candidate = self.get_revision(project, target).await?;
            if let Some(failed) = failure(&candidate.conditions) {
                return Err(CliError::RolloutFailed {
                    revision: candidate.name,
                    condition: failed.r#type.clone(),
                    reason: failed.reason.clone(),
                    message: failed.message.clone(),
                });
            }
            if started.elapsed() >= wait.timeout {
                return Err(CliError::WaitTimedOut {
                    revision: target.to_string(),
                    waited: output::human_duration(wait.timeout.as_secs()),
                    progress: progress(&status),
                });
            }
            tokio::time::sleep(WAIT_POLL).await;
        }
    }
}

/// The condition of a revision that says it will not become live: `Ready`
/// false (its replicas failed), or its bundle failed to resolve for a reason
/// that trying again does not fix.
fn failure(conditions: &[Condition]) -> Option<&Condition> {
    conditions.iter().find(|c| {
        c.status == ConditionStatus::False as i32
            && (c.r#type == "Ready" || (c.r#type == "BundleResolved" && c.reason != TRANSIENT_RESOLVE_REASON))
    })
}

/// Where a rollout stands, in one phrase.
fn progress(status: &v1::ServiceStatus) -> String {
    let not_ready = status
        .conditions
        .iter()
        .filter(|c| c.status != ConditionStatus::True as i32)
        .map(|c| format!("{} {}", c.r#type, c.reason))
        .collect::<Vec<_>>();
    let mut line = format!(
        "live revision {}, {} of {} replicas running",
        output::or_none(&status.live_revision),
        status.replicas_running,
        status.replicas_desired
    );
    if !not_ready.is_empty() {
        line.push_str(&format!(" ({})", not_ready.join(", ")));
    }
    line
}

impl ServiceArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let format = self.client.output;
        // A bad spec is refused before any credential is read or server dialled.
        let spec = match &self.command {
            ServiceCommand::Apply(args) => Some(read_spec(args)?),
            _ => None,
        };
        let credentials = self.client.credentials()?;
        let mut revisions = self.revisions.connect(&self.client, credentials.clone()).await?;
        match self.command {
            ServiceCommand::Apply(args) => {
                let request = match spec {
                    Some(request) => request,
                    None => read_spec(&args)?,
                };
                apply(&mut revisions, request, &args.wait, format).await
            }
            ServiceCommand::Get(target) => {
                let project = target.project.unwrap_or_default();
                let service = revisions.get_service(&project, &target.name).await?;
                let replicas = replicas(&self.client, &self.leases, credentials, &service).await?;
                match format {
                    OutputFormat::Json => {
                        let replicas = replicas
                            .iter()
                            .map(|(node, lease)| {
                                let mut replica = output::message_json(lease)?;
                                replica["node"] = Value::String(node.clone());
                                replica["revision"] = Value::String(revision_of(&service, lease).to_string());
                                replica["port"] = Value::from(port_of(lease));
                                Ok(replica)
                            })
                            .collect::<Result<Vec<_>, CliError>>()?;
                        let service = output::message_json(&service)?;
                        output::print_json(&json!({ "service": service, "replicas": replicas }))
                    }
                    OutputFormat::Table => output::print(&service_details(&service, &replicas)),
                }
            }
            ServiceCommand::List(args) => {
                let request = v1::ListServicesRequest {
                    project: args.scope.project.unwrap_or_default(),
                    all_projects: args.scope.all_projects,
                };
                let listed = revisions
                    .connection
                    .answer(revisions.services.list_services(revisions.connection.request(request)))
                    .await?;
                print_services(&listed, args.scope.all_projects, format)
            }
            ServiceCommand::Delete(target) => {
                let request =
                    v1::DeleteServiceRequest { project: target.project.unwrap_or_default(), name: target.name.clone() };
                revisions
                    .services
                    .delete_service(revisions.connection.request(request))
                    .await
                    .map_err(|s| revisions.connection.status_error(s))?;
                output::print_answer(format, &v1::DeleteServiceResponse {}, || {
                    format!("service {} deleted: its revisions are gone and its replicas are stopped\n", target.name)
                })
            }
            // A pin moves the traffic and keeps the session affinity.
            ServiceCommand::Pin { service: target, revision } => {
                let affinity = revisions.affinity(&target).await?;
                let service = revisions.set_traffic(&target, &revision, Vec::new(), affinity).await?;
                print_traffic(&service, format)
            }
            ServiceCommand::Unpin(target) => {
                let affinity = revisions.affinity(&target).await?;
                let service = revisions.set_traffic(&target, "", Vec::new(), affinity).await?;
                print_traffic(&service, format)
            }
            ServiceCommand::Traffic(args) => {
                let targets = traffic_targets(&args);
                let service = revisions.set_traffic(&args.service, "", targets, args.affinity()).await?;
                print_traffic(&service, format)
            }
            ServiceCommand::Redeploy { service: target, wait } => {
                let project = target.project.unwrap_or_default();
                let current = revisions.get_service(&project, &target.name).await?;
                let mut source = current.source.unwrap_or_default();
                let now = prost_types::Timestamp::from(SystemTime::now());
                source.labels.insert(REDEPLOY_LABEL.to_string(), now.to_string());
                let request = v1::ApplyServiceRequest {
                    project,
                    name: target.name,
                    template: current.template,
                    source: Some(source),
                };
                apply(&mut revisions, request, &wait, format).await
            }
        }
    }
}

impl RevisionArgs {
    pub(crate) async fn run(self) -> Result<(), CliError> {
        let format = self.client.output;
        let mut revisions = self.revisions.connect(&self.client, self.client.credentials()?).await?;
        match self.command {
            RevisionCommand::List { service, project } => {
                let request = v1::ListRevisionsRequest { project: project.unwrap_or_default(), service };
                let listed = revisions
                    .connection
                    .answer(revisions.revisions.list_revisions(revisions.connection.request(request)))
                    .await?;
                print_revisions(&listed, format)
            }
            RevisionCommand::Get { name, project } => {
                let revision = revisions.get_revision(&project.unwrap_or_default(), &name).await?;
                let text = revision_details(&revision);
                output::print_answer(format, &v1::GetRevisionResponse { revision: Some(revision) }, || text)
            }
        }
    }
}

/// Applies `request`, says whether it minted a revision, and waits for that
/// revision when told to.
async fn apply(
    revisions: &mut Revisions,
    request: v1::ApplyServiceRequest,
    wait: &WaitArgs,
    format: OutputFormat,
) -> Result<(), CliError> {
    let (project, name) = (request.project.clone(), request.name.clone());
    let applied = revisions.apply(request).await?;
    let mut service = applied.service.ok_or(CliError::IncompleteResponse("the service"))?;
    let outcome = if applied.revision_created {
        format!("revision {} minted", applied.revision)
    } else {
        format!("unchanged (no new revision; latest is {})", output::or_none(&applied.revision))
    };
    if format == OutputFormat::Table {
        output::print(&format!("service {}: {outcome}\n", service.name))?;
    }
    if wait.wait {
        service = revisions.wait_live(&project, &name, &applied.revision, wait).await?;
        if format == OutputFormat::Table {
            let status = service.status.clone().unwrap_or_default();
            output::print(&format!(
                "service {}: {} is live, {} of {} replicas running\n",
                service.name, status.live_revision, status.replicas_running, status.replicas_desired
            ))?;
        }
    }
    match format {
        OutputFormat::Json => output::print_message(&v1::ApplyServiceResponse {
            service: Some(service),
            revision_created: applied.revision_created,
            revision: applied.revision,
        }),
        OutputFormat::Table => Ok(()),
    }
}

/// The open leases of `service` (its replicas, starting or running), each
/// with the name of its node. Read from leases and identity alone, so they
/// show wherever the control plane is reachable, agents or not.
async fn replicas(
    client: &ClientArgs,
    leases: &LeasesServerArgs,
    credentials: TlsCredentials,
    service: &v1::Service,
) -> Result<Vec<(String, Lease)>, CliError> {
    let identity = Connection::open("identity", &client.server, credentials.clone())?;
    let names: std::collections::HashMap<String, String> = identity
        .answer(NodesClient::new(identity.channel.clone()).list_nodes(identity.request(ListNodesRequest::default())))
        .await?
        .nodes
        .into_iter()
        .map(|node| {
            let label = if node.name.is_empty() { node.node_id.clone() } else { node.name };
            (node.node_id, label)
        })
        .collect();
    let connection = leases.connect(client, credentials).await?;
    let mut ledger = LeasesClient::new(connection.channel.clone());
    let mut found = Vec::new();
    for phase in [LeasePhase::Bound, LeasePhase::Launching, LeasePhase::Running] {
        let request = ListLeasesRequest { project: service.project.clone(), phase: phase as i32, ..Default::default() };
        let listed = connection.answer(ledger.list_leases(connection.request(request))).await?.leases;
        found.extend(
            listed
                .into_iter()
                .filter(|lease| lease.workload.as_ref().is_some_and(|w| w.service == service.name))
                .map(|lease| (names.get(&lease.node_id).cloned().unwrap_or_else(|| lease.node_id.clone()), lease)),
        );
    }
    found.sort_by(|a, b| (&a.0, &a.1.lease_id).cmp(&(&b.0, &b.1.lease_id)));
    Ok(found)
}

/// The revision a replica's lease runs.
/// The revision a replica serves as: the one that took it over in place,
/// else the one its lease was asked for.
fn revision_of<'a>(service: &'a v1::Service, lease: &'a Lease) -> &'a str {
    let adopted = service.status.as_ref().and_then(|status| status.adopted_replicas.get(&lease.lease_id));
    adopted.map_or_else(|| lease.workload.as_ref().map_or("", |w| w.revision.as_str()), String::as_str)
}

/// The node port a replica's first port was given; 0 when it has none yet.
fn port_of(lease: &Lease) -> u32 {
    lease.ports.first().map_or(0, |p| p.port)
}

/// The route generation and which routers serve it:
/// `generation 4; served by edge/router-0, edge/router-1 at 3`.
fn routes(status: &v1::ServiceStatus) -> String {
    let current = status.route_generation;
    let mut behind: Vec<String> = Vec::new();
    let mut serving = 0;
    for ack in &status.routers {
        let name =
            if ack.instance.is_empty() { ack.router.clone() } else { format!("{}/{}", ack.router, ack.instance) };
        if ack.generation >= current {
            serving += 1;
        } else {
            behind.push(format!("{name} at {}", ack.generation));
        }
    }
    let mut text = format!("generation {current}; {serving} of {} routers serve it", status.routers.len());
    if !behind.is_empty() {
        text.push_str(&format!(" ({} behind)", behind.join(", ")));
    }
    text
}

/// Every field of a service, its conditions and its replicas, like
/// `kubectl describe`.
fn service_details(service: &v1::Service, replicas: &[(String, Lease)]) -> String {
    let ago = |at: Option<&prost_types::Timestamp>| output::when(at, &format!("{} ago", output::age(at)));
    let status = service.status.clone().unwrap_or_default();
    let template = service.template.clone().unwrap_or_default();
    let rows: Vec<(&str, String)> = vec![
        ("Name", service.name.clone()),
        ("Project", output::project_name(&service.project).to_string()),
        ("Generation", service.generation.to_string()),
        output::artifact_row(template.artifact()),
        ("Runtime", output::runtime_class_text(template.runtime)),
        ("Live revision", output::or_none(&status.live_revision)),
        ("Latest created", output::or_none(&status.latest_created_revision)),
        ("Latest ready", output::or_none(&status.latest_ready_revision)),
        ("Pinned", output::or_none(&service.pinned_revision)),
        ("Traffic", if status.traffic.is_empty() { output::NONE.to_string() } else { shares(&status.traffic, "") }),
        ("Sticky", status.affinity.as_ref().map_or_else(|| output::NONE.to_string(), affinity_text)),
        ("Routes", routes(&status)),
        ("Replicas", format!("{} running, {} desired", status.replicas_running, status.replicas_desired)),
        ("Created", ago(service.created_at.as_ref())),
        ("Updated", ago(service.updated_at.as_ref())),
    ];
    let mut text = output::fields(&rows);
    text.push_str("\nConditions:\n");
    text.push_str(&output::indent(&output::conditions_table(&status.conditions)));
    let cached = replicas.iter().any(|(_, lease)| !lease.cache.is_empty());
    let mut columns = vec!["NODE", "LEASE", "REVISION", "PHASE", "PORT", "AGE"];
    if cached {
        columns.push("CACHE");
    }
    let mut table = Table::new(columns);
    for (node, lease) in replicas {
        let port = port_of(lease);
        let mut row = vec![
            node.clone(),
            lease.lease_id.clone(),
            output::or_none(revision_of(service, lease)),
            output::lease_phase(lease.phase),
            if port == 0 { output::NONE.to_string() } else { port.to_string() },
            output::age(lease.phase_changed_at.as_ref()),
        ];
        if cached {
            row.push(output::cache_outcomes(&lease.cache));
        }
        table.row(row);
    }
    text.push_str(&table.section("Replicas", "<none>"));
    text
}

/// Every field of a revision and its conditions.
fn revision_details(revision: &v1::Revision) -> String {
    let created = revision.created_at.as_ref();
    let template = revision.template.clone().unwrap_or_default();
    let source = revision.source.clone().unwrap_or_default();
    let program = if template.command.is_empty() && template.args.is_empty() {
        if template.image.is_some() { "<the image's entrypoint and cmd>" } else { "<the bundle's entrypoint>" }
            .to_string()
    } else {
        let command = if template.command.is_empty() { "<entrypoint>" } else { template.command.as_str() };
        std::iter::once(command).chain(template.args.iter().map(String::as_str)).collect::<Vec<_>>().join(" ")
    };
    let origin = [&source.repo, &source.r#ref, &source.commit]
        .into_iter()
        .filter(|part| !part.is_empty())
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(" ");
    let ports = template.ports.iter().map(|p| format!("{}={}", p.name, p.port)).collect::<Vec<_>>().join(",");
    let rows: Vec<(&str, String)> = vec![
        ("Name", revision.name.clone()),
        ("Service", revision.service.clone()),
        ("Project", output::project_name(&revision.project).to_string()),
        ("Generation", revision.generation.to_string()),
        ("Digest", output::or_none(&revision.digest)),
        output::artifact_row(template.artifact()),
        ("Runtime", output::runtime_class_text(template.runtime)),
        ("Command", program),
        ("Environment", output::labels(&template.env)),
        ("Replicas", format!("{} running, {} desired", revision.replicas_running, template.replicas.unwrap_or(1))),
        ("Resources", output::capacity(template.resources.as_ref())),
        ("Ports", output::or_none(&ports)),
        ("Tier", output::or_none(&template.tier)),
        ("Source", output::or_none(&origin)),
        ("Source labels", output::labels(&source.labels)),
        ("Created", output::when(created, &format!("{} ago", output::age(created)))),
    ];
    let mut text = output::fields(&rows);
    text.push_str("\nConditions:\n");
    text.push_str(&output::indent(&output::conditions_table(&revision.conditions)));
    text
}

fn print_services(listed: &v1::ListServicesResponse, all_projects: bool, format: OutputFormat) -> Result<(), CliError> {
    let mut headers = vec!["NAME", "LIVE", "LATEST", "READY", "REPLICAS", "AGE"];
    if all_projects {
        headers.insert(0, "PROJECT");
    }
    output::print_listed(listed, &listed.services, "services", format, headers, |service| {
        let status = service.status.clone().unwrap_or_default();
        let mut row = vec![
            service.name.clone(),
            output::or_none(&status.live_revision),
            output::or_none(&status.latest_created_revision),
            output::condition_of(&status.conditions, "Ready"),
            format!("{}/{}", status.replicas_running, status.replicas_desired),
            output::age(service.created_at.as_ref()),
        ];
        if all_projects {
            row.insert(0, output::project_name(&service.project).to_string());
        }
        row
    })
}

fn print_revisions(listed: &v1::ListRevisionsResponse, format: OutputFormat) -> Result<(), CliError> {
    let headers = vec!["NAME", "GENERATION", "DIGEST", "READY", "RUNNING", "AGE"];
    output::print_listed(listed, &listed.revisions, "revisions", format, headers, |revision| {
        vec![
            revision.name.clone(),
            revision.generation.to_string(),
            short_digest(&revision.digest),
            output::condition_of(&revision.conditions, "Ready"),
            revision.replicas_running.to_string(),
            output::age(revision.created_at.as_ref()),
        ]
    })
}

/// `sha256:` and the first 12 hex digits, enough to tell digests apart.
fn short_digest(digest: &str) -> String {
    match digest.split_once(':') {
        Some((algorithm, hex)) => format!("{algorithm}:{}", hex.get(..12).unwrap_or(hex)),
        None => output::or_none(digest),
    }
}

/// A split as one line: `hello-00001 90%, latest (hello-00002) 10% as canary`;
/// a latest target names `live` when it is given, else the revision it routes to.
fn shares(targets: &[v1::TrafficTarget], live: &str) -> String {
    let shares: Vec<String> = targets
        .iter()
        .map(|t| {
            let revision = match (t.latest, live.is_empty()) {
                (true, false) => format!("latest ({live})"),
                (true, true) => format!("latest ({})", output::or_none(&t.revision)),
                (false, _) => t.revision.clone(),
            };
            let tag = if t.tag.is_empty() { String::new() } else { format!(" as {}", t.tag) };
            format!("{revision} {}%{tag}", t.percent)
        })
        .collect();
    shares.join(", ")
}

fn print_traffic(service: &v1::Service, format: OutputFormat) -> Result<(), CliError> {
    if format == OutputFormat::Json {
        return output::print_message(&v1::SetTrafficResponse { service: Some(service.clone()) });
    }
    let live = service.status.as_ref().map_or("", |s| s.live_revision.as_str());
    let split = service.traffic.len() > 1 || service.traffic.iter().any(|t| !t.tag.is_empty() || t.latest);
    let line = if split {
        format!("service {}: traffic split {}\n", service.name, shares(&service.traffic, live))
    } else if service.pinned_revision.is_empty() {
        format!(
            "service {}: traffic follows the latest ready revision (live now: {})\n",
            service.name,
            output::or_none(live)
        )
    } else {
        format!(
            "service {}: traffic pinned to {} (live now: {}); it moves once the pinned revision's replicas run\n",
            service.name,
            service.pinned_revision,
            output::or_none(live)
        )
    };
    let sticky = service.status.as_ref().and_then(|s| s.affinity.as_ref()).map(affinity_text);
    match sticky {
        Some(sticky) => output::print(&format!("{}; each client keeps to one replica {sticky}\n", line.trim_end())),
        None => output::print(&line),
    }
}

/// How a session affinity reads: `by header x-user`, `by cookie session`.
fn affinity_text(affinity: &v1::SessionAffinity) -> String {
    if affinity.header.is_empty() {
        format!("by cookie {}", affinity.cookie)
    } else {
        format!("by header {}", affinity.header)
    }
}

/// The apply request the spec file and flags make.
fn read_spec(args: &ApplyArgs) -> Result<v1::ApplyServiceRequest, SpecError> {
    let (file, value) = spec_file::read(&args.spec.file)?;
    spec_request(&value, args.spec.name.as_deref(), args.spec.project.as_deref())
        .map_err(|(path, problem)| SpecError::Field { file, path, problem })
}

/// The fields of a declaration, in the proto's snake_case.
const SPEC_FIELDS: [&str; 4] = ["project", "name", "template", "source"];
const TEMPLATE_FIELDS: [&str; 15] = [
    "bundle",
    "image",
    "command",
    "args",
    "env",
    "resources",
    "replicas",
    "ports",
    "egress",
    "tier",
    "runtime",
    "readiness",
    "working_dir",
    "user",
    "cache",
];
const CACHE_FIELDS: [&str; 3] = ["key", "path", "commit"];
const BUNDLE_FIELDS: [&str; 3] = ["reference", "secret", "insecure"];
const CAPACITY_FIELDS: [&str; 2] = ["cpu_millis", "memory_bytes"];
const PORT_FIELDS: [&str; 2] = ["name", "port"];
const EGRESS_FIELDS: [&str; 2] = ["gateway", "disabled"];
const READINESS_FIELDS: [&str; 3] = ["http_path", "port", "period_millis"];
const SOURCE_FIELDS: [&str; 4] = ["repo", "commit", "ref", "labels"];

/// Converts a parsed spec into the apply request: a whole declaration when it
/// has a `template`, else a template with `name` from the flag.
fn spec_request(
    value: &Value,
    name_flag: Option<&str>,
    project_flag: Option<&str>,
) -> Result<v1::ApplyServiceRequest, Refusal> {
    let whole = matches!(value, Value::Object(map) if map.contains_key("template"));
    let (name, project, template, source) = if whole {
        let spec = Fields::of(value, "", &SPEC_FIELDS)?;
        let template = spec.object("template", &TEMPLATE_FIELDS)?.map(|t| template(&t)).transpose()?;
        let source = spec.object("source", &SOURCE_FIELDS)?.map(|s| source(&s)).transpose()?;
        (spec.string("name")?, spec.string("project")?, template, source)
    } else {
        let fields = Fields::of(value, "", &TEMPLATE_FIELDS).map_err(|(path, problem)| {
            (path, format!("{problem} (a file with no `template` field is read as the template alone)"))
        })?;
        (String::new(), String::new(), Some(template(&fields)?), None)
    };
    let name = match (name.as_str(), name_flag) {
        ("", None) => return Err(("name".to_string(), "missing; give `name` in the file or pass --name NAME".into())),
        ("", Some(flag)) => flag.to_string(),
        (file, Some(flag)) if file != flag => {
            return Err(("name".to_string(), format!("is {file:?} but --name says {flag:?}")));
        }
        (file, _) => file.to_string(),
    };
    let project = match (project.as_str(), project_flag) {
        ("", flag) => flag.unwrap_or_default().to_string(),
        (file, Some(flag)) if file != flag => {
            return Err(("project".to_string(), format!("is {file:?} but --project says {flag:?}")));
        }
        (file, _) => file.to_string(),
    };
    Ok(v1::ApplyServiceRequest { project, name, template, source })
}

fn template(fields: &Fields<'_>) -> Result<v1::ServiceTemplate, Refusal> {
    // A bundle or image is an object, or its reference alone as a string.
    let artifact = |name: &str| -> Result<Option<BundleRef>, Refusal> {
        if fields.is_string(name) {
            return Ok(Some(BundleRef { reference: fields.string(name)?, ..BundleRef::default() }));
        }
        fields
            .object(name, &BUNDLE_FIELDS)?
            .map(|b| -> Result<BundleRef, Refusal> {
                Ok(BundleRef {
                    reference: b.string("reference")?,
                    secret: b.string("secret")?,
                    insecure: b.flag("insecure")?,
                })
            })
            .transpose()
    };
    let bundle = artifact("bundle")?;
    let image = artifact("image")?;
    let resources = fields
        .object("resources", &CAPACITY_FIELDS)?
        .map(|c| -> Result<Capacity, Refusal> {
            Ok(Capacity {
                cpu_millis: c.number("cpu_millis")?.unwrap_or_default(),
                memory_bytes: c.number("memory_bytes")?.unwrap_or_default(),
            })
        })
        .transpose()?;
    let ports = fields
        .objects("ports", &PORT_FIELDS)?
        .iter()
        .map(|p| -> Result<Port, Refusal> {
            Ok(Port { name: p.string("name")?, port: p.number("port")?.unwrap_or_default() })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let egress = fields
        .object("egress", &EGRESS_FIELDS)?
        .map(|e| -> Result<v1::EgressSelection, Refusal> {
            Ok(v1::EgressSelection { gateway: e.string("gateway")?, disabled: e.flag("disabled")? })
        })
        .transpose()?;
    Ok(v1::ServiceTemplate {
        bundle,
        command: fields.string("command")?,
        args: fields.strings("args")?,
        env: fields.string_map("env")?,
        resources,
        replicas: fields.number("replicas")?,
        ports,
        egress,
        tier: fields.string("tier")?,
        image,
        runtime: fields.enumeration("runtime", "RUNTIME_CLASS_", |n| {
            berth_proto::types::v1::RuntimeClass::from_str_name(n).map(|c| c as i32)
        })?,
        readiness: fields
            .object("readiness", &READINESS_FIELDS)?
            .map(|r| -> Result<berth_proto::types::v1::Readiness, Refusal> {
                Ok(berth_proto::types::v1::Readiness {
                    http_path: r.string("http_path")?,
                    port: r.string("port")?,
                    period_millis: r.number("period_millis")?.unwrap_or_default(),
                })
            })
            .transpose()?,
        working_dir: fields.string("working_dir")?,
        user: fields.string("user")?,
        cache: fields
            .objects("cache", &CACHE_FIELDS)?
            .iter()
            .map(|c| -> Result<berth_proto::types::v1::CacheMount, Refusal> {
                Ok(berth_proto::types::v1::CacheMount {
                    key: c.string("key")?,
                    path: c.string("path")?,
                    commit: c.enumeration("commit", "CACHE_COMMIT_", |n| {
                        berth_proto::types::v1::CacheCommit::from_str_name(n).map(|c| c as i32)
                    })?,
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
    })
}

fn source(fields: &Fields<'_>) -> Result<v1::Source, Refusal> {
    Ok(v1::Source {
        repo: fields.string("repo")?,
        commit: fields.string("commit")?,
        r#ref: fields.string("ref")?,
        labels: fields.string_map("labels")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(spec: Value, name: Option<&str>) -> Refusal {
        spec_request(&spec, name, None).unwrap_err()
    }

    #[test]
    fn the_example_template_reads_with_a_name_from_the_flag() {
        let text = include_str!("../../../../examples/hello/service.json");
        let value: Value = serde_json::from_str(text).unwrap();
        let request = spec_request(&value, Some("hello"), None).unwrap();
        assert_eq!(request.name, "hello");
        assert_eq!(request.project, "");
        let template = request.template.unwrap();
        assert_eq!(template.bundle.unwrap().reference, "oci:.berth/oci:hello");
        assert_eq!(template.replicas, Some(2));
        assert_eq!(template.ports, vec![Port { name: "http".into(), port: 8080 }]);
        assert_eq!(template.resources, Some(Capacity { cpu_millis: 100, memory_bytes: 64 << 20 }));
        assert!(request.source.is_none());
    }

    #[test]
    fn the_yaml_example_reads_as_the_json_one() {
        let json: Value = serde_json::from_str(include_str!("../../../../examples/hello/service.json")).unwrap();
        let yaml = spec_file::parse("service.yaml", include_str!("../../../../examples/hello/service.yaml")).unwrap();
        assert_eq!(
            spec_request(&yaml, Some("hello"), None).unwrap(),
            spec_request(&json, Some("hello"), None).unwrap()
        );
    }

    #[test]
    fn a_yaml_field_of_the_wrong_type_is_named_like_a_json_one() {
        let value = spec_file::parse("s.yaml", "name: web\ntemplate:\n  env:\n    PORT: 8080\n").unwrap();
        assert_eq!(
            spec_request(&value, None, None).unwrap_err(),
            ("template.env.PORT".to_string(), "must be a string, not the number 8080".to_string())
        );
        let value = spec_file::parse("s.yml", "replicas: two\n").unwrap();
        assert_eq!(spec_request(&value, Some("x"), None).unwrap_err().0, "replicas");
    }

    #[test]
    fn a_whole_declaration_reads_in_lower_camel_too() {
        let spec = json!({
            "project": "team",
            "name": "web",
            "template": {"bundle": {"reference": "r:v1"}, "resources": {"cpuMillis": 250}, "env": {"A": "1"}},
            "source": {"repo": "https://git.example.com/web", "ref": "refs/heads/main", "labels": {"ci": "7"}},
        });
        let request = spec_request(&spec, None, None).unwrap();
        assert_eq!((request.project.as_str(), request.name.as_str()), ("team", "web"));
        let template = request.template.unwrap();
        assert_eq!(template.resources.unwrap().cpu_millis, 250);
        assert_eq!(template.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(template.replicas, None);
        let source = request.source.unwrap();
        assert_eq!(source.r#ref, "refs/heads/main");
        assert_eq!(source.labels.get("ci").map(String::as_str), Some("7"));
    }

    #[test]
    fn each_refusal_names_the_field() {
        let (path, problem) = refusal(json!({"replicas": "two"}), Some("x"));
        assert_eq!(path, "replicas");
        assert!(problem.contains("whole number") && problem.contains("\"two\""), "{problem}");

        let (path, problem) = refusal(json!({"name": "x", "template": {"replicaz": 2}}), None);
        assert_eq!(path, "template.replicaz");
        assert!(problem.contains("unknown field"), "{problem}");

        let (path, _) = refusal(json!({"name": "x", "template": {"ports": [{"name": "http", "port": -1}]}}), None);
        assert_eq!(path, "template.ports[0].port");

        let (path, _) = refusal(json!({"name": "x", "template": {"env": {"A": 1}}}), None);
        assert_eq!(path, "template.env.A");

        let (path, _) = refusal(json!({"name": "x", "template": {"args": ["a", 2]}}), None);
        assert_eq!(path, "template.args[1]");

        let (path, problem) = refusal(json!({"replicas": 1}), None);
        assert_eq!(path, "name");
        assert!(problem.contains("--name"), "{problem}");

        let (path, _) = refusal(json!({"name": "x", "template": {}}), Some("y"));
        assert_eq!(path, "name");

        let (path, _) = refusal(json!({"name": "x", "template": {"replicas": 5_000_000_000u64}}), None);
        assert_eq!(path, "template.replicas");

        let (path, _) = refusal(json!(["not", "an", "object"]), Some("x"));
        assert_eq!(path, "the file");
    }

    #[test]
    fn a_field_given_in_both_spellings_is_refused() {
        let (path, problem) = refusal(json!({"resources": {"cpu_millis": 1, "cpuMillis": 2}}), Some("x"));
        assert!(path.starts_with("resources."), "{path}");
        assert!(problem.contains("twice"), "{problem}");
    }

    #[test]
    fn a_failed_revision_stops_the_wait_and_a_flaky_registry_does_not() {
        let condition = |kind: &str, status: ConditionStatus, reason: &str| Condition {
            r#type: kind.into(),
            status: status as i32,
            reason: reason.into(),
            ..Default::default()
        };
        let deploying = [
            condition("BundleResolved", ConditionStatus::True, ""),
            condition("Ready", ConditionStatus::Unknown, "Deploying"),
        ];
        assert!(failure(&deploying).is_none());
        let flaky = [condition("BundleResolved", ConditionStatus::False, TRANSIENT_RESOLVE_REASON)];
        assert!(failure(&flaky).is_none());
        let missing = [condition("BundleResolved", ConditionStatus::False, "TagNotFound")];
        assert_eq!(failure(&missing).map(|c| c.reason.as_str()), Some("TagNotFound"));
        let failed = [condition("Ready", ConditionStatus::False, "ReplicaFailed")];
        assert_eq!(failure(&failed).map(|c| c.reason.as_str()), Some("ReplicaFailed"));
    }

    #[test]
    fn digests_are_shortened_to_twelve_hex_digits() {
        assert_eq!(short_digest("sha256:0123456789abcdef0123"), "sha256:0123456789ab");
        assert_eq!(short_digest(""), output::NONE);
    }
}
