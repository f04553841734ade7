//! `berth egress gateway|route apply|get|list|delete`, `berth egress dns
//! apply|get` and `berth egress plan`: each tenant's egress policy and DNS
//! config, spoken to the egress service.
//!
//! # Where egress is
//! `--egress-server` (or `BERTH_EGRESS_SERVER`); without it, where identity
//! says (`Mesh/GetEndpoints`).
//!
//! # What a spec file holds
//! JSON or YAML (read as [`spec_file`] says): a gateway `{project?, name?, listeners: [{name, protocol, port}]}`,
//! or a route `{project?, name?, parent_refs: [{gateway, listener?}],
//! hostnames: [...], ports?: [...], action?}`, with the field names of
//! `proto/berth/egress/v1/egress.proto` in snake_case or lowerCamel. A
//! protocol is `HTTP`, `HTTPS_CONNECT` or `TCP`; an action `ALLOW` (the
//! default) or `DENY` (the proto's full enum names are taken too). A DNS
//! config is `{project?, upstreams?: [...], search?: [...], ndots?}`. `--name`
//! and `--project` fill in what the file leaves out and must agree with what
//! it says. The file is converted field by field before anything is dialled:
//! an unknown field or a value of the wrong type is refused with its path,
//! e.g. `listeners[1].port`; the server checks the rest (names, ports, host
//! names) and names the field it refuses.

use berth_mtls::TlsCredentials;
use berth_proto::egress::v1 as egress;
use berth_proto::egress::v1::egress_client::EgressClient;
use berth_proto::types::v1::{Condition, ConditionStatus};
use berth_rpc::Channel;
use serde_json::Value;

use super::output::{self, Table};
use super::spec_fields::{Fields, Refusal};
use super::spec_file::{self, SpecError, SpecFileArgs};
use super::{CliError, ClientArgs, Connection, OutputFormat, parse_server};

/// The largest answer read from egress (`GetPlan` of a large tenant).
const MAX_PLAN_BYTES: usize = 64 * 1024 * 1024;

/// Flags of `berth egress`.
#[derive(Debug, clap::Args)]
pub(crate) struct EgressArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// The egress service to talk to [default: where identity says it is].
    #[arg(long = "egress-server", env = "BERTH_EGRESS_SERVER", value_name = "HOST:PORT",
          value_parser = parse_server, global = true)]
    egress_server: Option<String>,
    #[command(subcommand)]
    command: EgressCommand,
}

#[derive(Debug, clap::Subcommand)]
enum EgressCommand {
    /// Gateways: the listeners of a tenant's egress proxy.
    Gateway {
        #[command(subcommand)]
        command: ObjectCommand,
    },
    /// Routes: which destinations may (or may not) leave through which listeners.
    Route {
        #[command(subcommand)]
        command: ObjectCommand,
    },
    /// A project's DNS config: where its workloads' names outside berth are
    /// resolved, search domains and ndots.
    Dns {
        #[command(subcommand)]
        command: DnsCommand,
    },
    /// Show a project's compiled plan: what each service may reach, its DNS
    /// config, and which nodes applied it.
    Plan {
        /// The project [default: default].
        #[arg(value_name = "PROJECT")]
        project: Option<String>,
    },
}

#[derive(Debug, clap::Subcommand)]
enum ObjectCommand {
    /// Create or replace one from a JSON spec (`-f FILE`, or `-f -` for stdin).
    Apply(ApplyArgs),
    /// Show one with its status.
    Get(ObjectName),
    /// List a project's, by name.
    List {
        /// The project [default: default].
        #[arg(long, value_name = "PROJECT")]
        project: Option<String>,
    },
    /// Delete one.
    Delete(ObjectName),
}

#[derive(Debug, clap::Subcommand)]
enum DnsCommand {
    /// Set it from a JSON or YAML spec (`-f FILE`, or `-f -` for stdin);
    /// pushed to the project's nodes with its plan, no workload restarts.
    Apply {
        /// The spec: a JSON or YAML file (`.json`, `.yaml`, `.yml`), or `-`
        /// for stdin.
        #[arg(short = 'f', long = "filename", value_name = "FILE")]
        file: String,
        /// The project, when the file does not name one [default: default].
        #[arg(long, value_name = "PROJECT")]
        project: Option<String>,
    },
    /// Show it as applied.
    Get {
        /// The project [default: default].
        #[arg(value_name = "PROJECT")]
        project: Option<String>,
    },
}

#[derive(Debug, clap::Args)]
struct ObjectName {
    /// Its name.
    #[arg(value_name = "NAME")]
    name: String,
    /// Its project [default: default].
    #[arg(long, value_name = "PROJECT")]
    project: Option<String>,
}

type ApplyArgs = SpecFileArgs;

/// The egress client and the connection under it.
#[derive(Debug)]
struct Egress {
    client: EgressClient<Channel>,
    connection: Connection,
}

impl Egress {
    fn status(&self, status: tonic::Status) -> CliError {
        self.connection.status_error(status)
    }
}

impl EgressArgs {
    async fn connect(&self, credentials: TlsCredentials) -> Result<Egress, CliError> {
        let address =
            self.client.endpoint("egress", self.egress_server.as_ref(), "--egress-server", &credentials).await?;
        let connection = Connection::open("egress", &address, credentials)?;
        // A whole tenant's plan outgrows gRPC's 4 MiB default long before
        // anything else the CLI reads.
        let client = EgressClient::new(connection.channel.clone()).max_decoding_message_size(MAX_PLAN_BYTES);
        Ok(Egress { client, connection })
    }

    pub(crate) async fn run(self) -> Result<(), CliError> {
        let format = self.client.output;
        // A bad spec is refused before any credential is read or server dialled.
        let spec = match &self.command {
            EgressCommand::Gateway { command: ObjectCommand::Apply(args) } => {
                Some(Spec::Gateway(gateway_request(&spec_file::read(&args.file)?, args)?))
            }
            EgressCommand::Route { command: ObjectCommand::Apply(args) } => {
                Some(Spec::Route(route_request(&spec_file::read(&args.file)?, args)?))
            }
            EgressCommand::Dns { command: DnsCommand::Apply { file, project } } => {
                Some(Spec::Dns(dns_request(&spec_file::read(file)?, project.as_ref())?))
            }
            _ => None,
        };
        let mut egress = self.connect(self.client.credentials()?).await?;
        match (self.command, spec) {
            (EgressCommand::Gateway { .. }, Some(Spec::Gateway(apply))) => {
                let apply = egress.connection.request(apply);
                let response = egress.client.apply_gateway(apply).await.map_err(|s| egress.status(s))?;
                let response = response.into_inner();
                let gateway = response.gateway.as_ref().ok_or(CliError::IncompleteResponse("the gateway"))?;
                output::print_answer(format, &response, || {
                    format!(
                        "gateway {} applied (generation {}); its status follows the next egress pass\n",
                        gateway.name, gateway.generation
                    )
                })
            }
            (EgressCommand::Route { .. }, Some(Spec::Route(apply))) => {
                let apply = egress.connection.request(apply);
                let response = egress.client.apply_route(apply).await.map_err(|s| egress.status(s))?;
                let response = response.into_inner();
                let route = response.route.as_ref().ok_or(CliError::IncompleteResponse("the route"))?;
                output::print_answer(format, &response, || {
                    format!(
                        "route {} applied (generation {}); its status follows the next egress pass\n",
                        route.name, route.generation
                    )
                })
            }
            (EgressCommand::Dns { .. }, Some(Spec::Dns(apply))) => {
                let apply = egress.connection.request(apply);
                let response = egress.client.apply_dns_config(apply).await.map_err(|s| egress.status(s))?;
                let response = response.into_inner();
                let dns = response.dns_config.as_ref().ok_or(CliError::IncompleteResponse("the DNS config"))?;
                output::print_answer(format, &response, || {
                    format!(
                        "DNS config of {} applied (generation {}); it reaches the project's nodes with its plan\n",
                        output::project_name(&dns.project),
                        dns.generation
                    )
                })
            }
            (EgressCommand::Dns { command: DnsCommand::Get { project } }, _) => {
                let message = egress::GetDnsConfigRequest { project: project.unwrap_or_default() };
                let response = egress
                    .client
                    .get_dns_config(egress.connection.request(message))
                    .await
                    .map_err(|s| egress.status(s))?;
                let response = response.into_inner();
                let dns = response.dns_config.as_ref().ok_or(CliError::IncompleteResponse("the DNS config"))?;
                output::print_answer(format, &response, || dns_details(dns))
            }
            (EgressCommand::Dns { .. }, _) => Ok(()),
            (EgressCommand::Gateway { command }, _) => gateway_command(&mut egress, command, format).await,
            (EgressCommand::Route { command }, _) => route_command(&mut egress, command, format).await,
            (EgressCommand::Plan { project }, _) => {
                let message = egress::GetPlanRequest { project: project.unwrap_or_default() };
                let response =
                    egress.client.get_plan(egress.connection.request(message)).await.map_err(|s| egress.status(s))?;
                let response = response.into_inner();
                let plan = response.plan.as_ref().ok_or(CliError::IncompleteResponse("the plan"))?;
                output::print_answer(format, &response, || plan_details(plan, &response.passes.unwrap_or_default()))
            }
        }
    }
}

/// An apply read from a spec file.
#[derive(Debug)]
enum Spec {
    Gateway(egress::ApplyGatewayRequest),
    Route(egress::ApplyRouteRequest),
    Dns(egress::ApplyDnsConfigRequest),
}

async fn gateway_command(egress: &mut Egress, command: ObjectCommand, format: OutputFormat) -> Result<(), CliError> {
    match command {
        ObjectCommand::Apply(_) => Ok(()),
        ObjectCommand::Get(target) => {
            let message = egress::GetGatewayRequest { project: target.project.unwrap_or_default(), name: target.name };
            let response =
                egress.client.get_gateway(egress.connection.request(message)).await.map_err(|s| egress.status(s))?;
            let response = response.into_inner();
            let gateway = response.gateway.as_ref().ok_or(CliError::IncompleteResponse("the gateway"))?;
            output::print_answer(format, &response, || gateway_details(gateway))
        }
        ObjectCommand::List { project } => {
            let message = egress::ListGatewaysRequest { project: project.unwrap_or_default() };
            let response =
                egress.client.list_gateways(egress.connection.request(message)).await.map_err(|s| egress.status(s))?;
            let listed = response.into_inner();
            // ATTACHMENTS: route attachments summed over the listeners.
            let headers = vec!["NAME", "LISTENERS", "READY", "ATTACHMENTS", "AGE"];
            output::print_listed(&listed, &listed.gateways, "gateways", format, headers, |gateway| {
                let status = gateway.status.clone().unwrap_or_default();
                let routes: u32 = status.listeners.iter().map(|l| l.attached_routes).sum();
                vec![
                    gateway.name.clone(),
                    gateway.listeners.iter().map(listener_text).collect::<Vec<_>>().join(","),
                    output::condition_of(&status.conditions, "Ready"),
                    routes.to_string(),
                    output::age(gateway.created_at.as_ref()),
                ]
            })
        }
        ObjectCommand::Delete(target) => {
            let name = target.name.clone();
            let message =
                egress::DeleteGatewayRequest { project: target.project.unwrap_or_default(), name: target.name };
            let response =
                egress.client.delete_gateway(egress.connection.request(message)).await.map_err(|s| egress.status(s))?;
            output::print_answer(format, response.get_ref(), || {
                format!("gateway {name} deleted: services that select it send nothing out until it is back\n")
            })
        }
    }
}

async fn route_command(egress: &mut Egress, command: ObjectCommand, format: OutputFormat) -> Result<(), CliError> {
    match command {
        ObjectCommand::Apply(_) => Ok(()),
        ObjectCommand::Get(target) => {
            let message = egress::GetRouteRequest { project: target.project.unwrap_or_default(), name: target.name };
            let response =
                egress.client.get_route(egress.connection.request(message)).await.map_err(|s| egress.status(s))?;
            let response = response.into_inner();
            let route = response.route.as_ref().ok_or(CliError::IncompleteResponse("the route"))?;
            output::print_answer(format, &response, || route_details(route))
        }
        ObjectCommand::List { project } => {
            let message = egress::ListRoutesRequest { project: project.unwrap_or_default() };
            let response =
                egress.client.list_routes(egress.connection.request(message)).await.map_err(|s| egress.status(s))?;
            let listed = response.into_inner();
            let headers = vec!["NAME", "ACTION", "HOSTNAMES", "PORTS", "PARENTS", "ACCEPTED", "AGE"];
            output::print_listed(&listed, &listed.routes, "routes", format, headers, |route| {
                let parents = route.status.as_ref().map_or(&[][..], |s| s.parents.as_slice());
                let accepted = parents.iter().filter(|p| holds(&p.conditions, "Accepted")).count();
                vec![
                    route.name.clone(),
                    action_text(route.action),
                    route.hostnames.join(","),
                    ports_text(&route.ports),
                    route.parent_refs.iter().map(parent_text).collect::<Vec<_>>().join(","),
                    format!("{accepted}/{}", route.parent_refs.len()),
                    output::age(route.created_at.as_ref()),
                ]
            })
        }
        ObjectCommand::Delete(target) => {
            let name = target.name.clone();
            let message = egress::DeleteRouteRequest { project: target.project.unwrap_or_default(), name: target.name };
            let response =
                egress.client.delete_route(egress.connection.request(message)).await.map_err(|s| egress.status(s))?;
            output::print_answer(format, response.get_ref(), || format!("route {name} deleted\n"))
        }
    }
}

fn holds(conditions: &[Condition], kind: &str) -> bool {
    conditions.iter().any(|c| c.r#type == kind && c.status == ConditionStatus::True as i32)
}

fn protocol_text(protocol: i32) -> String {
    match egress::ListenerProtocol::try_from(protocol) {
        Ok(egress::ListenerProtocol::Http) => "HTTP".to_string(),
        Ok(egress::ListenerProtocol::HttpsConnect) => "HTTPS_CONNECT".to_string(),
        Ok(egress::ListenerProtocol::Tcp) => "TCP".to_string(),
        _ => format!("UNKNOWN({protocol})"),
    }
}

fn action_text(action: i32) -> String {
    match egress::RouteAction::try_from(action) {
        Ok(egress::RouteAction::Deny) => "DENY".to_string(),
        Ok(egress::RouteAction::Allow | egress::RouteAction::Unspecified) => "ALLOW".to_string(),
        Err(_) => format!("UNKNOWN({action})"),
    }
}

fn listener_text(listener: &egress::Listener) -> String {
    format!("{}={}:{}", listener.name, protocol_text(listener.protocol), listener.port)
}

fn parent_text(parent: &egress::ParentRef) -> String {
    if parent.listener.is_empty() { parent.gateway.clone() } else { format!("{}/{}", parent.gateway, parent.listener) }
}

fn ports_text(ports: &[u32]) -> String {
    if ports.is_empty() { "any".to_string() } else { ports.iter().map(u32::to_string).collect::<Vec<_>>().join(",") }
}

fn gateway_details(gateway: &egress::EgressGateway) -> String {
    let status = gateway.status.clone().unwrap_or_default();
    let rows: Vec<(&str, String)> = vec![
        ("Name", gateway.name.clone()),
        ("Project", output::project_name(&gateway.project).to_string()),
        ("Generation", gateway.generation.to_string()),
        ("Created", output::age(gateway.created_at.as_ref())),
        ("Updated", output::age(gateway.updated_at.as_ref())),
    ];
    let mut text = output::fields(&rows);
    text.push_str("\nListeners:\n");
    let mut table = Table::new(vec!["NAME", "PROTOCOL", "PORT", "ROUTES", "ACCEPTED"]);
    for listener in &gateway.listeners {
        let observed = status.listeners.iter().find(|l| l.name == listener.name);
        table.row(vec![
            listener.name.clone(),
            protocol_text(listener.protocol),
            listener.port.to_string(),
            observed.map_or_else(|| output::NONE.to_string(), |l| l.attached_routes.to_string()),
            observed.map_or_else(|| "Unknown".to_string(), |l| output::condition_of(&l.conditions, "Accepted")),
        ]);
    }
    text.push_str(&output::indent(&table.render()));
    text.push_str("\nConditions:\n");
    let mut conditions = status.conditions.clone();
    for listener in &status.listeners {
        conditions.extend(
            listener
                .conditions
                .iter()
                .filter(|c| c.r#type != "Accepted")
                .map(|c| Condition { r#type: format!("{} ({})", c.r#type, listener.name), ..c.clone() }),
        );
    }
    text.push_str(&output::indent(&output::conditions_table(&conditions)));
    text
}

fn route_details(route: &egress::EgressRoute) -> String {
    let rows: Vec<(&str, String)> = vec![
        ("Name", route.name.clone()),
        ("Project", output::project_name(&route.project).to_string()),
        ("Action", action_text(route.action)),
        ("Hostnames", route.hostnames.join(", ")),
        ("Ports", ports_text(&route.ports)),
        ("Generation", route.generation.to_string()),
        ("Created", output::age(route.created_at.as_ref())),
        ("Updated", output::age(route.updated_at.as_ref())),
    ];
    let mut text = output::fields(&rows);
    text.push_str("\nParents:\n");
    let mut table = Table::new(vec!["GATEWAY", "LISTENER", "ACCEPTED", "REASON", "MESSAGE"]);
    let parents = route.status.as_ref().map_or(&[][..], |s| s.parents.as_slice());
    for parent in &route.parent_refs {
        let observed = parents.iter().find(|p| p.parent_ref.as_ref() == Some(parent));
        let accepted = observed.and_then(|p| p.conditions.iter().find(|c| c.r#type == "Accepted"));
        table.row(vec![
            parent.gateway.clone(),
            if parent.listener.is_empty() { "<every>".to_string() } else { parent.listener.clone() },
            accepted.map_or_else(|| "Unknown".to_string(), |c| output::condition_status(c.status)),
            accepted.map_or_else(|| output::NONE.to_string(), |c| output::or_none(&c.reason)),
            accepted.map_or_else(|| "not compiled yet".to_string(), |c| output::or_none(&c.message)),
        ]);
    }
    text.push_str(&output::indent(&table.render()));
    text
}

/// A DNS config on one line: `upstreams 10.0.0.53:53; search corp.example; ndots 1`.
fn dns_text(dns: &egress::DnsConfig) -> String {
    let (upstreams, search) = (listed(&dns.upstreams, ","), listed(&dns.search, ","));
    format!("upstreams {upstreams}; search {search}; ndots {}", dns.ndots.unwrap_or(berth_egress::DEFAULT_NDOTS))
}

/// `items` joined by `separator`, or `<none>`.
fn listed(items: &[String], separator: &str) -> String {
    if items.is_empty() { "<none>".to_string() } else { items.join(separator) }
}

fn dns_details(dns: &egress::EgressDnsConfig) -> String {
    let spec = dns.spec.clone().unwrap_or_default();
    let list = |items: &[String]| listed(items, ", ");
    output::fields(&[
        ("Project", output::project_name(&dns.project).to_string()),
        ("Generation", dns.generation.to_string()),
        ("Created", output::age(dns.created_at.as_ref())),
        ("Updated", output::age(dns.updated_at.as_ref())),
        ("Upstreams", list(&spec.upstreams)),
        ("Search", list(&spec.search)),
        ("Ndots", spec.ndots.unwrap_or(berth_egress::DEFAULT_NDOTS).to_string()),
    ])
}

fn plan_details(plan: &egress::EgressPlan, passes: &egress::PassStats) -> String {
    let rows: Vec<(&str, String)> = vec![
        ("Project", output::project_name(&plan.project).to_string()),
        ("Generation", plan.generation.to_string()),
        (
            "Compiled",
            output::when(plan.compiled_at.as_ref(), &format!("{} ago", output::age(plan.compiled_at.as_ref()))),
        ),
        ("Gateways", plan.gateways.len().to_string()),
        ("Routes", plan.routes.len().to_string()),
        ("DNS", plan.dns.as_ref().map_or_else(|| "<none>".to_string(), dns_text)),
        (
            "Passes",
            if passes.leading {
                format!("{} run, {} changed the plan, for {} events", passes.passes, passes.changes, passes.events)
            } else {
                "counted by the replica that runs the full pass; this one does not".to_string()
            },
        ),
    ];
    let mut text = output::fields(&rows);
    let mut services = Table::new(vec!["SERVICE", "GATEWAY", "READY", "REASON", "ALLOWED", "DENIED"]);
    for service in &plan.services {
        let condition = service.condition.clone().unwrap_or_default();
        services.row(vec![
            service.service.clone(),
            output::or_none(&service.gateway),
            output::condition_status(condition.status),
            output::or_none(&condition.reason),
            destinations_text(&service.allowed),
            destinations_text(&service.denied),
        ]);
    }
    text.push_str(&services.section("Services", "<none>"));
    let mut nodes = Table::new(vec!["NODE", "APPLIED", "STATUS", "ACKED", "ERROR"]);
    for ack in &plan.node_acks {
        let state = if ack.generation >= plan.generation { "current" } else { "lagging" };
        nodes.row(vec![
            ack.node_id.clone(),
            ack.generation.to_string(),
            state.to_string(),
            output::when(ack.acked_at.as_ref(), &format!("{} ago", output::age(ack.acked_at.as_ref()))),
            output::or_none(&ack.error),
        ]);
    }
    text.push_str(&nodes.section("Nodes", "<none: no node hosts the project>"));
    text
}

/// `listener/host:ports` of each destination, at most a few, then a count.
fn destinations_text(destinations: &[egress::Destination]) -> String {
    const SHOWN: usize = 3;
    if destinations.is_empty() {
        return output::NONE.to_string();
    }
    let mut parts: Vec<String> = destinations
        .iter()
        .take(SHOWN)
        .map(|d| {
            let ports = if d.ports.is_empty() { String::new() } else { format!(":{}", ports_text(&d.ports)) };
            format!("{}/{}{ports}", d.listener, d.hostname)
        })
        .collect();
    if destinations.len() > SHOWN {
        parts.push(format!("+{} more", destinations.len() - SHOWN));
    }
    parts.join(" ")
}

const GATEWAY_FIELDS: [&str; 3] = ["project", "name", "listeners"];
const LISTENER_FIELDS: [&str; 3] = ["name", "protocol", "port"];
const ROUTE_FIELDS: [&str; 6] = ["project", "name", "parent_refs", "hostnames", "ports", "action"];
const PARENT_FIELDS: [&str; 2] = ["gateway", "listener"];
const DNS_FIELDS: [&str; 4] = ["project", "upstreams", "search", "ndots"];

fn dns_request(spec: &(String, Value), project: Option<&String>) -> Result<egress::ApplyDnsConfigRequest, SpecError> {
    let (file, value) = spec;
    let refused = |(path, problem): Refusal| SpecError::Field { file: file.clone(), path, problem };
    let fields = Fields::of(value, "", &DNS_FIELDS).map_err(refused)?;
    let project = fields.string("project").and_then(|in_file| pick("project", in_file, project)).map_err(refused)?;
    let spec = egress::DnsConfig {
        upstreams: fields.strings("upstreams").map_err(refused)?,
        search: fields.strings("search").map_err(refused)?,
        ndots: fields.number("ndots").map_err(refused)?,
    };
    Ok(egress::ApplyDnsConfigRequest { project, spec: Some(spec) })
}

fn gateway_request(spec: &(String, Value), args: &ApplyArgs) -> Result<egress::ApplyGatewayRequest, SpecError> {
    let (file, value) = spec;
    let refused = |(path, problem): Refusal| SpecError::Field { file: file.clone(), path, problem };
    let fields = Fields::of(value, "", &GATEWAY_FIELDS).map_err(refused)?;
    let (project, name) = key(&fields, args).map_err(refused)?;
    let listeners = fields
        .objects("listeners", &LISTENER_FIELDS)
        .and_then(|listeners| {
            listeners
                .iter()
                .map(|l| {
                    Ok(egress::Listener {
                        name: l.string("name")?,
                        protocol: l.enumeration("protocol", "LISTENER_PROTOCOL_", |n| {
                            egress::ListenerProtocol::from_str_name(n).map(|p| p as i32)
                        })?,
                        port: l.number("port")?.unwrap_or_default(),
                    })
                })
                .collect::<Result<Vec<_>, Refusal>>()
        })
        .map_err(refused)?;
    Ok(egress::ApplyGatewayRequest { project, name, listeners })
}

fn route_request(spec: &(String, Value), args: &ApplyArgs) -> Result<egress::ApplyRouteRequest, SpecError> {
    let (file, value) = spec;
    let refused = |(path, problem): Refusal| SpecError::Field { file: file.clone(), path, problem };
    let fields = Fields::of(value, "", &ROUTE_FIELDS).map_err(refused)?;
    let (project, name) = key(&fields, args).map_err(refused)?;
    let parent_refs = fields
        .objects("parent_refs", &PARENT_FIELDS)
        .and_then(|parents| {
            parents
                .iter()
                .map(|p| Ok(egress::ParentRef { gateway: p.string("gateway")?, listener: p.string("listener")? }))
                .collect::<Result<Vec<_>, Refusal>>()
        })
        .map_err(refused)?;
    let action = if fields.has("action") {
        fields
            .enumeration("action", "ROUTE_ACTION_", |n| egress::RouteAction::from_str_name(n).map(|a| a as i32))
            .map_err(refused)?
    } else {
        egress::RouteAction::Allow as i32
    };
    Ok(egress::ApplyRouteRequest {
        project,
        name,
        parent_refs,
        hostnames: fields.strings("hostnames").map_err(refused)?,
        ports: fields.numbers("ports").map_err(refused)?,
        action,
    })
}

/// The object's project and name: from the file, else from the flags; both
/// given must agree.
fn key(fields: &Fields<'_>, args: &ApplyArgs) -> Result<(String, String), Refusal> {
    let project = pick("project", fields.string("project")?, args.project.as_ref())?;
    let name = pick("name", fields.string("name")?, args.name.as_ref())?;
    Ok((project, name))
}

/// `field` as the file gives it, or as its flag does when the file leaves it
/// out; both must agree when both give it. Only a name must be given.
fn pick(field: &str, file: String, flag: Option<&String>) -> Result<String, Refusal> {
    match (file.as_str(), flag) {
        ("", None) if field == "name" => {
            Err((field.to_string(), "missing; give `name` in the file or pass --name NAME".to_string()))
        }
        ("", flag) => Ok(flag.cloned().unwrap_or_default()),
        (file, Some(flag)) if file != flag => {
            Err((field.to_string(), format!("is {file:?} but --{field} says {flag:?}")))
        }
        (file, _) => Ok(file.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(name: Option<&str>, project: Option<&str>) -> ApplyArgs {
        ApplyArgs { file: "spec.json".into(), name: name.map(str::to_owned), project: project.map(str::to_owned) }
    }

    fn spec(value: Value) -> (String, Value) {
        ("spec.json".to_string(), value)
    }

    fn refusal(error: SpecError) -> (String, String) {
        match error {
            SpecError::Field { path, problem, .. } => (path, problem),
            other => panic!("not a field refusal: {other}"),
        }
    }

    #[test]
    fn a_gateway_reads_short_and_proto_enum_names_in_either_spelling() {
        let value = json!({
            "name": "default",
            "listeners": [
                {"name": "http", "protocol": "HTTP", "port": 3128},
                {"name": "tls", "protocol": "https_connect", "port": 3129},
                {"name": "db", "protocol": "LISTENER_PROTOCOL_TCP", "port": 5432},
            ],
        });
        let request = gateway_request(&spec(value), &args(None, Some("team"))).unwrap();
        assert_eq!((request.project.as_str(), request.name.as_str()), ("team", "default"));
        let protocols: Vec<i32> = request.listeners.iter().map(|l| l.protocol).collect();
        assert_eq!(
            protocols,
            [
                egress::ListenerProtocol::Http as i32,
                egress::ListenerProtocol::HttpsConnect as i32,
                egress::ListenerProtocol::Tcp as i32
            ]
        );
    }

    #[test]
    fn a_yaml_gateway_reads_as_its_json_twin() {
        let yaml = "name: default\nlisteners:\n  - {name: http, protocol: HTTP, port: 3128}\n";
        let value = spec_file::parse("gateway.yaml", yaml).unwrap();
        let from_yaml = gateway_request(&("gateway.yaml".into(), value), &args(None, None)).unwrap();
        let json = json!({"name": "default", "listeners": [{"name": "http", "protocol": "HTTP", "port": 3128}]});
        assert_eq!(from_yaml, gateway_request(&spec(json), &args(None, None)).unwrap());
        assert_eq!(from_yaml.listeners[0].port, 3128);
    }

    #[test]
    fn a_route_reads_in_lower_camel_and_allows_by_default() {
        let value = json!({
            "parentRefs": [{"gateway": "default"}, {"gateway": "default", "listener": "db"}],
            "hostnames": ["api.example.com", "*.example.com"],
            "ports": [443],
        });
        let request = route_request(&spec(value), &args(Some("api"), None)).unwrap();
        assert_eq!(request.name, "api");
        assert_eq!(request.parent_refs[1].listener, "db");
        assert_eq!(request.action, egress::RouteAction::Allow as i32);
        let deny = json!({"name": "no", "parent_refs": [{"gateway": "g"}], "hostnames": ["x.com"], "action": "deny"});
        assert_eq!(route_request(&spec(deny), &args(None, None)).unwrap().action, egress::RouteAction::Deny as i32);
    }

    #[test]
    fn each_refusal_names_the_field() {
        let gateway = |value| refusal(gateway_request(&spec(value), &args(Some("g"), None)).unwrap_err());
        let route = |value| refusal(route_request(&spec(value), &args(Some("r"), None)).unwrap_err());
        assert_eq!(gateway(json!({"listeners": [{"name": "a", "port": "80"}]})).0, "listeners[0].port");
        assert_eq!(gateway(json!({"listeners": [{"name": "a", "protocol": "UDP"}]})).0, "listeners[0].protocol");
        assert_eq!(gateway(json!({"listenerz": []})).0, "listenerz");
        assert_eq!(gateway(json!({"name": "other"})).0, "name");
        assert_eq!(route(json!({"hostnames": ["a.com", 7]})).0, "hostnames[1]");
        assert_eq!(route(json!({"ports": [-1]})).0, "ports[0]");
        assert_eq!(route(json!({"parent_refs": [{"gw": "x"}]})).0, "parent_refs[0].gw");
        assert_eq!(route(json!({"action": "MAYBE"})).0, "action");
        let missing = refusal(route_request(&spec(json!({})), &args(None, None)).unwrap_err());
        assert!(missing.0 == "name" && missing.1.contains("--name"), "{missing:?}");
    }
}
