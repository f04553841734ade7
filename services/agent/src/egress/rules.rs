//! One tenant's egress rules, compiled from its [`EgressPlan`]: for each
//! service, which destinations its replicas may reach through the tenant's
//! proxy, and the verdict on one request. Pure: no I/O.
//!
//! # Matching
//! - A host pattern is an exact name (`api.example.com`), or `*.suffix`, which
//!   matches names *under* the suffix (`a.example.com`, `a.b.example.com`)
//!   and never the suffix itself. Names compare case-insensitively and
//!   without a trailing dot; an IP address matches only a pattern that names
//!   that address (IPv6 with or without brackets).
//! - An empty port list matches any port.
//! - A denial wins: a request that a denied destination of the service
//!   matches is refused, whichever listener the denial came through and even
//!   when a route allows it. Denials are held wider than their listener on
//!   purpose: a destination a tenant denied is never reachable from the
//!   service, whichever way the replica asks.
//! - An allowance holds for the traffic of its listener's protocol: an HTTP
//!   listener's destinations allow plain HTTP requests, an HTTPS_CONNECT
//!   listener's destinations allow CONNECT tunnels. Destinations of TCP
//!   listeners allow neither (the node's proxy does not serve TCP listeners).
//! - Egress disabled (a service the plan lists without a gateway), a service
//!   the plan does not list, and every service of a tenant whose plan has not
//!   reached the node (or was withdrawn) are refused everything.
//!
//! Every refusal carries a sentence naming why: the route that denied it,
//! or that no route allows the destination for the service.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr};

use berth_proto::egress::v1::{Destination, EgressPlan, ListenerProtocol, ServiceEgress};

/// The project name the control plane uses for an empty one.
pub(crate) const DEFAULT_PROJECT: &str = "default";

/// The tenant a project names: empty means [`DEFAULT_PROJECT`].
pub(crate) fn tenant_name(project: &str) -> String {
    let project = project.trim();
    if project.is_empty() { DEFAULT_PROJECT.to_string() } else { project.to_string() }
}

/// Why a plan cannot be turned into rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RulesError {
    /// A destination names a host that is neither a host name, an IP
    /// address, nor `*.suffix`.
    #[error(
        "project {project}: service {service}: route {route}: hostname '{hostname}' is not a host name, an IP address or *.suffix"
    )]
    Hostname {
        /// The tenant.
        project: String,
        /// The service the destination belongs to.
        service: String,
        /// The route it comes from.
        route: String,
        /// The hostname as sent.
        hostname: String,
    },
    /// A destination names a port outside 1..=65535.
    #[error("project {project}: service {service}: route {route}: port {port} is not between 1 and 65535")]
    Port {
        /// The tenant.
        project: String,
        /// The service the destination belongs to.
        service: String,
        /// The route it comes from.
        route: String,
        /// The port as sent.
        port: u32,
    },
    /// The plan lists a service twice.
    #[error("project {project}: service {service} is listed twice")]
    DuplicateService {
        /// The tenant.
        project: String,
        /// The service.
        service: String,
    },
}

/// What a replica asks the proxy for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TrafficKind {
    /// A plain HTTP request in absolute form.
    Http,
    /// A CONNECT tunnel.
    Connect,
}

impl TrafficKind {
    fn protocol(self) -> ListenerProtocol {
        match self {
            TrafficKind::Http => ListenerProtocol::Http,
            TrafficKind::Connect => ListenerProtocol::HttpsConnect,
        }
    }
}

impl std::fmt::Display for TrafficKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TrafficKind::Http => "HTTP",
            TrafficKind::Connect => "CONNECT",
        })
    }
}

/// The proxy's decision on one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A route allows it.
    Allowed {
        /// The route that allows it.
        route: String,
    },
    /// It is refused, and why, in a sentence naming the rule.
    Refused {
        /// Why.
        reason: String,
    },
}

/// A host pattern, normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPattern {
    /// This host and no other.
    Exact(String),
    /// Names under this suffix (held without the leading `*.`).
    Under(String),
}

impl HostPattern {
    fn parse(pattern: &str) -> Option<Self> {
        let pattern = pattern.trim();
        match pattern.strip_prefix("*.") {
            Some(suffix) => normalize_host(suffix).filter(|s| is_host_name(s)).map(HostPattern::Under),
            None => normalize_host(pattern)
                .filter(|host| is_host_name(host) || host.parse::<IpAddr>().is_ok())
                .map(HostPattern::Exact),
        }
    }

    fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(exact) => exact == host,
            HostPattern::Under(suffix) => {
                host.len() > suffix.len() + 1
                    && host.ends_with(suffix.as_str())
                    && host.as_bytes()[host.len() - suffix.len() - 1] == b'.'
            }
        }
    }
}

/// A destination of a service, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    host: HostPattern,
    /// Empty matches any port.
    ports: Vec<u16>,
    protocol: ListenerProtocol,
    route: String,
}

impl Rule {
    fn matches(&self, host: &str, port: u16) -> bool {
        self.host.matches(host) && (self.ports.is_empty() || self.ports.contains(&port))
    }
}

/// What one service may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ServiceRules {
    /// The service has no gateway: nothing is allowed.
    Disabled {
        /// Why, as the plan says it.
        why: String,
    },
    /// Its destinations.
    Routed { allowed: Vec<Rule>, denied: Vec<Rule> },
}

/// Where a tenant's rules come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RulesSource {
    /// No plan for the tenant has reached the node yet.
    NoPlanYet,
    /// The last whole state the node applied did not list the tenant.
    Withdrawn,
    /// The plan of this generation.
    Plan {
        /// The plan's generation.
        generation: u64,
    },
}

/// One tenant's rules: what its proxy allows, per service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TenantRules {
    tenant: String,
    source: RulesSource,
    services: BTreeMap<String, ServiceRules>,
}

impl TenantRules {
    /// Rules that refuse everything until a plan arrives.
    pub(crate) fn no_plan_yet(project: &str) -> Self {
        Self { tenant: tenant_name(project), source: RulesSource::NoPlanYet, services: BTreeMap::new() }
    }

    /// Rules that refuse everything: the tenant's plan was withdrawn.
    pub(crate) fn withdrawn(project: &str) -> Self {
        Self { tenant: tenant_name(project), source: RulesSource::Withdrawn, services: BTreeMap::new() }
    }

    /// Compiles a plan; a destination that cannot be matched refuses the
    /// whole plan, so a node never runs half of one.
    pub(crate) fn compile(plan: &EgressPlan) -> Result<Self, RulesError> {
        let tenant = tenant_name(&plan.project);
        let mut services = BTreeMap::new();
        for service in &plan.services {
            let rules = compile_service(&tenant, service)?;
            if services.insert(service.service.clone(), rules).is_some() {
                return Err(RulesError::DuplicateService { project: tenant, service: service.service.clone() });
            }
        }
        Ok(Self { tenant, source: RulesSource::Plan { generation: plan.generation }, services })
    }

    /// The tenant's name.
    pub(crate) fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The verdict on `service` asking for `host:port` as `kind` traffic.
    /// `host` is as the replica sent it; it is normalised here.
    pub(crate) fn decide(&self, service: &str, kind: TrafficKind, host: &str, port: u16) -> Verdict {
        let Some(host) = normalize_host(host) else {
            return refused(format!("'{host}' is not a host name or an IP address"));
        };
        let destination = display_destination(&host, port);
        let service_name = display_service(service);
        let rules = match self.source {
            RulesSource::NoPlanYet => {
                return refused(format!(
                    "no egress plan of project {} has reached this node yet, so {service_name} may not reach {destination}",
                    self.tenant
                ));
            }
            RulesSource::Withdrawn => {
                return refused(format!(
                    "project {} has no egress plan on this node, so {service_name} may not reach {destination}",
                    self.tenant
                ));
            }
            RulesSource::Plan { .. } => match self.services.get(service) {
                Some(rules) => rules,
                None => {
                    return refused(format!(
                        "the egress plan of project {} does not list {service_name}, so it may not reach {destination}",
                        self.tenant
                    ));
                }
            },
        };
        match rules {
            ServiceRules::Disabled { why } => {
                refused(format!("egress is disabled for {service_name} ({why}), so it may not reach {destination}"))
            }
            ServiceRules::Routed { allowed, denied } => {
                if let Some(rule) = denied.iter().find(|rule| rule.matches(&host, port)) {
                    return refused(format!("route {} denies {destination} for {service_name}", rule.route));
                }
                let protocol = kind.protocol();
                match allowed.iter().find(|rule| rule.protocol == protocol && rule.matches(&host, port)) {
                    Some(rule) => Verdict::Allowed { route: rule.route.clone() },
                    None => refused(format!("no route allows {destination} for {service_name} ({kind})")),
                }
            }
        }
    }
}

impl TenantRules {
    /// The verdict on resolving `host` for the tenant: a resolver serves
    /// the whole namespace and cannot tell which service asks, so a name
    /// resolves when some service of the tenant may reach it through its
    /// proxy (an HTTP or HTTPS_CONNECT allowance on some port, the name not
    /// denied to that service on every port). Nothing resolves before a plan.
    pub(crate) fn decide_name(&self, host: &str) -> Verdict {
        let Some(host) = normalize_host(host) else {
            return refused(format!("'{host}' is not a host name"));
        };
        if !matches!(self.source, RulesSource::Plan { .. }) {
            return refused(format!(
                "no egress plan of project {} is on this node, so {host} does not resolve",
                self.tenant
            ));
        }
        let proxied = [ListenerProtocol::Http, ListenerProtocol::HttpsConnect];
        for rules in self.services.values() {
            let ServiceRules::Routed { allowed, denied } = rules else { continue };
            if denied.iter().any(|rule| rule.ports.is_empty() && rule.host.matches(&host)) {
                continue;
            }
            if let Some(rule) = allowed.iter().find(|rule| proxied.contains(&rule.protocol) && rule.host.matches(&host))
            {
                return Verdict::Allowed { route: rule.route.clone() };
            }
        }
        refused(format!("no route of project {} lets any of its services reach {host}", self.tenant))
    }
}

fn refused(reason: String) -> Verdict {
    Verdict::Refused { reason }
}

fn display_service(service: &str) -> String {
    if service.is_empty() { "a workload with no service".to_string() } else { format!("service {service}") }
}

/// `host:port`, with an IPv6 address in brackets.
pub(crate) fn display_destination(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

fn compile_service(tenant: &str, service: &ServiceEgress) -> Result<ServiceRules, RulesError> {
    if service.gateway.trim().is_empty() {
        let why = service
            .condition
            .as_ref()
            .map(|c| if c.message.is_empty() { c.reason.clone() } else { c.message.clone() })
            .filter(|why| !why.trim().is_empty())
            .unwrap_or_else(|| "it selects no gateway".to_string());
        return Ok(ServiceRules::Disabled { why });
    }
    let compile = |destinations: &[Destination]| -> Result<Vec<Rule>, RulesError> {
        destinations.iter().map(|d| compile_destination(tenant, &service.service, d)).collect()
    };
    Ok(ServiceRules::Routed { allowed: compile(&service.allowed)?, denied: compile(&service.denied)? })
}

fn compile_destination(tenant: &str, service: &str, destination: &Destination) -> Result<Rule, RulesError> {
    let host = HostPattern::parse(&destination.hostname).ok_or_else(|| RulesError::Hostname {
        project: tenant.to_string(),
        service: service.to_string(),
        route: destination.route.clone(),
        hostname: destination.hostname.clone(),
    })?;
    let ports = destination
        .ports
        .iter()
        .map(|&port| {
            u16::try_from(port).ok().filter(|p| *p != 0).ok_or_else(|| RulesError::Port {
                project: tenant.to_string(),
                service: service.to_string(),
                route: destination.route.clone(),
                port,
            })
        })
        .collect::<Result<Vec<u16>, RulesError>>()?;
    // An unknown protocol number matches no traffic kind: it allows
    // nothing, and as a denial it still refuses.
    let protocol = ListenerProtocol::try_from(destination.protocol).unwrap_or(ListenerProtocol::Unspecified);
    Ok(Rule { host, ports, protocol, route: destination.route.clone() })
}

/// A host as compared: lower case, no trailing dot, an IPv6 address without
/// brackets; `None` when it is empty or holds what no host does.
pub(crate) fn normalize_host(host: &str) -> Option<String> {
    let host = host.trim();
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if host.is_empty() {
        return None;
    }
    if host.contains(':') {
        return host.parse::<Ipv6Addr>().ok().map(|ip| ip.to_string());
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
    host.chars().all(allowed).then_some(host)
}

/// Dot-separated labels of letters, digits, `-` and `_`, none empty.
fn is_host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

#[cfg(test)]
mod tests {
    use berth_proto::types::v1::Condition;

    use super::*;

    fn destination(route: &str, protocol: ListenerProtocol, hostname: &str, ports: &[u32]) -> Destination {
        Destination {
            listener: "l".into(),
            protocol: protocol as i32,
            listener_port: 3128,
            hostname: hostname.into(),
            ports: ports.to_vec(),
            route: route.into(),
        }
    }

    fn plan(services: Vec<ServiceEgress>) -> EgressPlan {
        EgressPlan { project: "acme".into(), generation: 4, services, ..Default::default() }
    }

    fn routed(service: &str, allowed: Vec<Destination>, denied: Vec<Destination>) -> ServiceEgress {
        ServiceEgress { service: service.into(), gateway: "gw".into(), allowed, denied, condition: None }
    }

    fn reason(verdict: Verdict) -> String {
        match verdict {
            Verdict::Refused { reason } => reason,
            Verdict::Allowed { route } => panic!("allowed by {route}"),
        }
    }

    #[test]
    fn exact_hosts_match_themselves_and_wildcards_only_subdomains() {
        let rules = TenantRules::compile(&plan(vec![routed(
            "web",
            vec![
                destination("exact", ListenerProtocol::Http, "API.Example.com.", &[]),
                destination("sub", ListenerProtocol::Http, "*.cdn.example.com", &[80]),
            ],
            vec![],
        )]))
        .unwrap();
        let http = |host: &str, port| rules.decide("web", TrafficKind::Http, host, port);
        assert_eq!(http("api.example.com", 8080), Verdict::Allowed { route: "exact".into() });
        assert_eq!(http("api.example.com.", 1), Verdict::Allowed { route: "exact".into() }, "empty ports: any");
        assert_eq!(http("a.cdn.example.com", 80), Verdict::Allowed { route: "sub".into() });
        assert_eq!(http("a.b.cdn.example.com", 80), Verdict::Allowed { route: "sub".into() });
        assert!(reason(http("cdn.example.com", 80)).contains("no route allows cdn.example.com:80 for service web"));
        assert!(reason(http("xcdn.example.com", 80)).starts_with("no route allows"), "not a subdomain");
        assert!(reason(http("a.cdn.example.com", 443)).starts_with("no route allows"), "port not listed");
        assert!(reason(http("other.example.com", 80)).starts_with("no route allows"));
    }

    #[test]
    fn a_name_resolves_when_some_service_may_reach_it_through_the_proxy() {
        let rules = TenantRules::compile(&plan(vec![
            routed(
                "web",
                vec![
                    destination("api", ListenerProtocol::HttpsConnect, "*.example.com", &[443]),
                    destination("db", ListenerProtocol::Tcp, "db.internal", &[5432]),
                ],
                vec![
                    destination("no-admin", ListenerProtocol::Http, "admin.example.com", &[]),
                    destination("no-8443", ListenerProtocol::Http, "pay.example.com", &[8443]),
                ],
            ),
            routed("batch", vec![destination("mirror", ListenerProtocol::Http, "mirror.example.org", &[])], vec![]),
        ]))
        .unwrap();
        assert_eq!(rules.decide_name("API.example.com."), Verdict::Allowed { route: "api".into() });
        assert_eq!(rules.decide_name("mirror.example.org"), Verdict::Allowed { route: "mirror".into() });
        assert_eq!(
            rules.decide_name("pay.example.com"),
            Verdict::Allowed { route: "api".into() },
            "denied on one port only"
        );
        for refused in ["admin.example.com", "db.internal", "example.com", "evil.example.net"] {
            let why = reason(rules.decide_name(refused));
            assert_eq!(why, format!("no route of project acme lets any of its services reach {refused}"));
        }
        let why = reason(TenantRules::no_plan_yet("acme").decide_name("api.example.com"));
        assert!(why.contains("no egress plan of project acme"), "{why}");
    }

    #[test]
    fn a_denial_wins_over_an_allowance_and_is_named() {
        let rules = TenantRules::compile(&plan(vec![routed(
            "web",
            vec![destination("allow-all", ListenerProtocol::HttpsConnect, "*.example.com", &[])],
            vec![destination("no-admin", ListenerProtocol::Http, "admin.example.com", &[443])],
        )]))
        .unwrap();
        let connect = |host: &str, port| rules.decide("web", TrafficKind::Connect, host, port);
        assert_eq!(connect("api.example.com", 443), Verdict::Allowed { route: "allow-all".into() });
        assert_eq!(
            reason(connect("admin.example.com", 443)),
            "route no-admin denies admin.example.com:443 for service web"
        );
        assert_eq!(connect("admin.example.com", 8443), Verdict::Allowed { route: "allow-all".into() });
    }

    #[test]
    fn an_allowance_holds_for_its_listeners_protocol_only() {
        let rules = TenantRules::compile(&plan(vec![routed(
            "web",
            vec![
                destination("tls", ListenerProtocol::HttpsConnect, "secure.example.com", &[443]),
                destination("db", ListenerProtocol::Tcp, "db.example.com", &[5432]),
            ],
            vec![],
        )]))
        .unwrap();
        assert_eq!(
            rules.decide("web", TrafficKind::Connect, "secure.example.com", 443),
            Verdict::Allowed { route: "tls".into() }
        );
        assert!(reason(rules.decide("web", TrafficKind::Http, "secure.example.com", 443)).ends_with("(HTTP)"));
        assert!(reason(rules.decide("web", TrafficKind::Connect, "db.example.com", 5432)).starts_with("no route"));
    }

    #[test]
    fn disabled_unlisted_and_unplanned_services_are_refused_everything() {
        let disabled = ServiceEgress {
            service: "batch".into(),
            gateway: String::new(),
            condition: Some(Condition { reason: "GatewayNotFound".into(), ..Default::default() }),
            ..Default::default()
        };
        let rules = TenantRules::compile(&plan(vec![disabled])).unwrap();
        assert_eq!(
            reason(rules.decide("batch", TrafficKind::Http, "example.com", 80)),
            "egress is disabled for service batch (GatewayNotFound), so it may not reach example.com:80"
        );
        assert!(
            reason(rules.decide("web", TrafficKind::Http, "example.com", 80)).contains("does not list service web")
        );
        let none = TenantRules::no_plan_yet("");
        assert!(reason(none.decide("web", TrafficKind::Http, "example.com", 80)).contains("project default"));
        let gone = TenantRules::withdrawn("acme");
        assert!(reason(gone.decide("web", TrafficKind::Connect, "[::1]", 443)).contains("[::1]:443"));
    }

    #[test]
    fn a_plan_with_an_unmatchable_destination_is_refused_whole() {
        for bad in ["", "*", "*.", "a*.example.com", "exa mple.com", "http://x", "*.*.example.com"] {
            let error = TenantRules::compile(&plan(vec![routed(
                "web",
                vec![destination("ok", ListenerProtocol::Http, "fine.example.com", &[])],
                vec![destination("bad", ListenerProtocol::Http, bad, &[])],
            )]))
            .unwrap_err();
            assert!(matches!(error, RulesError::Hostname { .. }), "{bad}: {error}");
            assert!(error.to_string().contains("route bad"), "{error}");
        }
        let error = TenantRules::compile(&plan(vec![routed(
            "web",
            vec![destination("big", ListenerProtocol::Http, "x.example.com", &[70000])],
            vec![],
        )]))
        .unwrap_err();
        assert_eq!(error.to_string(), "project acme: service web: route big: port 70000 is not between 1 and 65535");
        let twice = TenantRules::compile(&plan(vec![routed("web", vec![], vec![]), routed("web", vec![], vec![])]));
        assert!(matches!(twice, Err(RulesError::DuplicateService { .. })));
    }

    #[test]
    fn ip_addresses_match_only_themselves() {
        let rules = TenantRules::compile(&plan(vec![routed(
            "web",
            vec![
                destination("v4", ListenerProtocol::Http, "127.0.0.1", &[]),
                destination("v6", ListenerProtocol::HttpsConnect, "[::1]", &[]),
            ],
            vec![],
        )]))
        .unwrap();
        assert_eq!(rules.decide("web", TrafficKind::Http, "127.0.0.1", 80), Verdict::Allowed { route: "v4".into() });
        assert_eq!(rules.decide("web", TrafficKind::Connect, "::1", 443), Verdict::Allowed { route: "v6".into() });
        assert!(matches!(rules.decide("web", TrafficKind::Http, "127.0.0.2", 80), Verdict::Refused { .. }));
    }
}
