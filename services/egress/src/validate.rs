//! Checks on what callers send, before anything is read or written. An apply
//! is checked whole: every bad field is named in one `INVALID_ARGUMENT`, with
//! what it must be instead.
//!
//! # What a valid object is
//! - Project: empty (the default project) or a DNS label. Name: a DNS label.
//! - A gateway has 1 to [`MAX_LISTENERS`] listeners, each with a DNS-label
//!   name and a port in 1..=65535, both unique within the gateway, and a
//!   protocol (HTTP, HTTPS_CONNECT or TCP).
//! - A route has 1 to [`MAX_PARENT_REFS`] distinct parents (a gateway name and
//!   optionally a listener name, DNS labels), 1 to [`MAX_HOSTNAMES`] distinct
//!   host names (exact or `*.suffix`, lowercase), up to [`MAX_PORTS`] distinct
//!   ports in 1..=65535, and an action (unset means ALLOW).
//!
//! - A DNS config has up to [`MAX_UPSTREAMS`] distinct upstreams (an IP
//!   address, or `IP:port` with a port in 1..=65535; port 53 when none),
//!   up to [`MAX_SEARCH`] distinct search domains (lowercase DNS names of
//!   DNS labels, at most 253 bytes) and `ndots` up to [`MAX_NDOTS`]. It is
//!   stored canonical: upstreams as `IP:port`.
//!
//! Whether a route fits the listeners it names (a TCP listener and a
//! wildcard, say) is not refused here: it is the compile's to report in the
//! route's status, because the listener may change after the route is applied.

use std::collections::HashSet;

use berth_proto::egress::v1 as proto;
use berth_rpc::invalid::{Checker, Invalid, shown};

use crate::compile::{ListenerSpec, ParentSpec};
use crate::model::{DEFAULT_PROJECT, HostPattern, Protocol, RouteAction};

/// Most listeners one gateway may have.
pub const MAX_LISTENERS: usize = 64;
/// Most parent references one route may have.
pub const MAX_PARENT_REFS: usize = 16;
/// Most host names one route may match.
pub const MAX_HOSTNAMES: usize = 128;
/// Most ports one route may match.
pub const MAX_PORTS: usize = 64;
/// Most upstream resolvers a DNS config may name (resolv.conf's limit).
pub const MAX_UPSTREAMS: usize = 3;
/// Most search domains a DNS config may name.
pub const MAX_SEARCH: usize = 6;
/// The largest `ndots` resolvers honour.
pub const MAX_NDOTS: u32 = 15;

/// An object's project and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ObjectKey {
    pub(crate) project: String,
    pub(crate) name: String,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.project, self.name)
    }
}

fn check_project(check: &mut Checker, project: &str) -> String {
    if project.is_empty() {
        return DEFAULT_PROJECT.to_owned();
    }
    check.dns_label("project", project, "a project name");
    project.to_owned()
}

/// `project`, or the default project when empty.
pub(crate) fn project(project: &str) -> Result<String, Invalid> {
    let mut check = Checker::default();
    let project = check_project(&mut check, project);
    check.finish().map(|()| project)
}

/// An object key from a request's project and name fields.
pub(crate) fn key(project: &str, name: &str, what: &str) -> Result<ObjectKey, Invalid> {
    let mut check = Checker::default();
    let project = check_project(&mut check, project);
    check.dns_label("name", name, what);
    check.finish().map(|()| ObjectKey { project, name: name.to_owned() })
}

/// Checks a whole `ApplyDnsConfig`: the project, and the config in its
/// canonical form.
pub(crate) fn dns(request: proto::ApplyDnsConfigRequest) -> Result<(String, proto::DnsConfig), Invalid> {
    let mut check = Checker::default();
    let project = check_project(&mut check, &request.project);
    let spec = request.spec.unwrap_or_default();
    if spec.upstreams.len() > MAX_UPSTREAMS {
        check.bad("spec.upstreams", format!("at most {MAX_UPSTREAMS} upstreams, as resolv.conf allows"));
    }
    let mut upstreams = Vec::with_capacity(spec.upstreams.len());
    for (n, upstream) in spec.upstreams.iter().enumerate() {
        let field = format!("spec.upstreams[{n}]");
        let parsed = upstream
            .parse::<std::net::SocketAddr>()
            .ok()
            .or_else(|| upstream.parse::<std::net::IpAddr>().ok().map(|ip| std::net::SocketAddr::new(ip, 53)));
        match parsed {
            Some(addr) if addr.port() == 0 => check.bad(field, "the port must be 1..=65535"),
            Some(addr) if upstreams.contains(&addr.to_string()) => {
                check.bad(field, format!("{addr} is named twice"));
            }
            Some(addr) => upstreams.push(addr.to_string()),
            None => check.bad(field, format!("{} is not an IP address or IP:port", shown(upstream))),
        }
    }
    if spec.search.len() > MAX_SEARCH {
        check.bad("spec.search", format!("at most {MAX_SEARCH} search domains"));
    }
    for (n, domain) in spec.search.iter().enumerate() {
        let field = format!("spec.search[{n}]");
        let name = domain.strip_suffix('.').unwrap_or(domain);
        if name.is_empty() || name.len() > 253 || !name.split('.').all(berth_core::is_dns_label) {
            check.bad(field, format!("{} is not a lowercase DNS name", shown(domain)));
        } else if spec.search[..n].iter().any(|d| d.strip_suffix('.').unwrap_or(d) == name) {
            check.bad(field, format!("'{name}' is named twice"));
        }
    }
    if let Some(ndots) = spec.ndots
        && ndots > MAX_NDOTS
    {
        check.bad("spec.ndots", format!("{ndots} is more than {MAX_NDOTS}"));
    }
    check.finish()?;
    let search = spec.search.iter().map(|d| d.strip_suffix('.').unwrap_or(d).to_owned()).collect();
    Ok((project, proto::DnsConfig { upstreams, search, ndots: spec.ndots }))
}

/// A checked `ApplyGateway`: its key, its listeners, and the canonical
/// encoding of its declaration (which decides whether an apply changed it).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ValidGateway {
    pub(crate) key: ObjectKey,
    pub(crate) listeners: Vec<ListenerSpec>,
    pub(crate) spec: proto::ApplyGatewayRequest,
}

/// Checks a whole `ApplyGateway`.
pub(crate) fn gateway(request: proto::ApplyGatewayRequest) -> Result<ValidGateway, Invalid> {
    let mut check = Checker::default();
    let project = check_project(&mut check, &request.project);
    check.dns_label("name", &request.name, "a gateway name");
    if request.listeners.is_empty() {
        check.bad("listeners", "at least one listener is needed");
    } else if request.listeners.len() > MAX_LISTENERS {
        check.bad("listeners", format!("at most {MAX_LISTENERS} listeners"));
    }
    let (mut names, mut ports) = (HashSet::new(), HashSet::new());
    let mut listeners = Vec::with_capacity(request.listeners.len());
    for (n, listener) in request.listeners.iter().enumerate() {
        let field = |part: &str| format!("listeners[{n}].{part}");
        if check.dns_label(&field("name"), &listener.name, "a listener name") && !names.insert(listener.name.as_str()) {
            check.bad(field("name"), format!("'{}' is named twice", listener.name));
        }
        let protocol = Protocol::from_proto(listener.protocol);
        if protocol.is_none() {
            check.bad(
                field("protocol"),
                "must be LISTENER_PROTOCOL_HTTP, LISTENER_PROTOCOL_HTTPS_CONNECT or LISTENER_PROTOCOL_TCP",
            );
        }
        let port = check.port(&field("port"), listener.port);
        if let Some(port) = port
            && !ports.insert(port)
        {
            check.bad(field("port"), format!("{port} is used by another listener"));
        }
        if let (Some(protocol), Some(port)) = (protocol, port) {
            listeners.push(ListenerSpec { name: listener.name.clone(), protocol, port });
        }
    }
    check.finish()?;
    let spec = proto::ApplyGatewayRequest {
        project: String::new(),
        name: String::new(),
        listeners: listeners
            .iter()
            .map(|l| proto::Listener {
                name: l.name.clone(),
                protocol: l.protocol.to_proto() as i32,
                port: l.port.into(),
            })
            .collect(),
    };
    Ok(ValidGateway { key: ObjectKey { project, name: request.name }, listeners, spec })
}

/// A checked `ApplyRoute`: its key, what the compile reads of it, and the
/// canonical encoding of its declaration.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ValidRoute {
    pub(crate) key: ObjectKey,
    pub(crate) parents: Vec<ParentSpec>,
    pub(crate) hostnames: Vec<HostPattern>,
    pub(crate) ports: Vec<u16>,
    pub(crate) action: RouteAction,
    pub(crate) spec: proto::ApplyRouteRequest,
}

/// Checks a whole `ApplyRoute`.
pub(crate) fn route(request: proto::ApplyRouteRequest) -> Result<ValidRoute, Invalid> {
    let mut check = Checker::default();
    let project = check_project(&mut check, &request.project);
    check.dns_label("name", &request.name, "a route name");

    if request.parent_refs.is_empty() {
        check.bad("parent_refs", "at least one parent (a gateway, and optionally its listener) is needed");
    } else if request.parent_refs.len() > MAX_PARENT_REFS {
        check.bad("parent_refs", format!("at most {MAX_PARENT_REFS} parents"));
    }
    let mut parents = Vec::with_capacity(request.parent_refs.len());
    let mut seen_parents = HashSet::new();
    for (n, parent) in request.parent_refs.iter().enumerate() {
        let gateway_ok = check.dns_label(&format!("parent_refs[{n}].gateway"), &parent.gateway, "a gateway name");
        let listener_ok = parent.listener.is_empty()
            || check.dns_label(&format!("parent_refs[{n}].listener"), &parent.listener, "a listener name");
        if gateway_ok && listener_ok {
            let spec = ParentSpec::from_proto(parent);
            if seen_parents.insert(spec.clone()) {
                parents.push(spec);
            } else {
                check.bad(format!("parent_refs[{n}]"), "names the same gateway and listener as an earlier parent");
            }
        }
    }

    if request.hostnames.is_empty() {
        check.bad("hostnames", "at least one host name (e.g. api.example.com or *.example.com) is needed");
    } else if request.hostnames.len() > MAX_HOSTNAMES {
        check.bad("hostnames", format!("at most {MAX_HOSTNAMES} host names"));
    }
    let mut hostnames = Vec::with_capacity(request.hostnames.len());
    let mut seen_hosts = HashSet::new();
    for (n, hostname) in request.hostnames.iter().enumerate() {
        match HostPattern::parse(hostname) {
            Ok(pattern) if seen_hosts.insert(pattern.clone()) => hostnames.push(pattern),
            Ok(_) => check.bad(format!("hostnames[{n}]"), format!("'{}' is listed twice", shown(hostname))),
            Err(error) => check.bad(format!("hostnames[{n}]"), error.to_string()),
        }
    }

    if request.ports.len() > MAX_PORTS {
        check.bad("ports", format!("at most {MAX_PORTS} ports"));
    }
    let mut ports = Vec::with_capacity(request.ports.len());
    for (n, port) in request.ports.iter().enumerate() {
        if let Some(port) = check.port(&format!("ports[{n}]"), *port) {
            if ports.contains(&port) {
                check.bad(format!("ports[{n}]"), format!("{port} is listed twice"));
            } else {
                ports.push(port);
            }
        }
    }

    let action = RouteAction::from_proto(request.action);
    if action.is_none() {
        check.bad("action", "must be ROUTE_ACTION_ALLOW or ROUTE_ACTION_DENY (unset means ALLOW)");
    }
    check.finish()?;
    let action = action.unwrap_or(RouteAction::Allow);
    let spec = proto::ApplyRouteRequest {
        project: String::new(),
        name: String::new(),
        parent_refs: request.parent_refs,
        hostnames: request.hostnames,
        ports: request.ports,
        action: action.to_proto() as i32,
    };
    Ok(ValidRoute { key: ObjectKey { project, name: request.name }, parents, hostnames, ports, action, spec })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good_gateway() -> proto::ApplyGatewayRequest {
        proto::ApplyGatewayRequest {
            project: String::new(),
            name: "default".into(),
            listeners: vec![
                proto::Listener { name: "http".into(), protocol: proto::ListenerProtocol::Http as i32, port: 3128 },
                proto::Listener {
                    name: "tls".into(),
                    protocol: proto::ListenerProtocol::HttpsConnect as i32,
                    port: 3129,
                },
            ],
        }
    }

    fn good_route() -> proto::ApplyRouteRequest {
        proto::ApplyRouteRequest {
            project: "team".into(),
            name: "github".into(),
            parent_refs: vec![proto::ParentRef { gateway: "default".into(), listener: String::new() }],
            hostnames: vec!["github.com".into(), "*.github.com".into()],
            ports: vec![443],
            action: 0,
        }
    }

    #[test]
    fn good_objects_pass_in_the_default_project_and_unset_action_allows() {
        let gateway = gateway(good_gateway()).unwrap();
        assert_eq!(gateway.key.project, "default");
        assert_eq!(gateway.listeners.len(), 2);
        let route = route(good_route()).unwrap();
        assert_eq!(route.key, ObjectKey { project: "team".into(), name: "github".into() });
        assert_eq!(route.action, RouteAction::Allow);
        assert_eq!(route.spec.action, proto::RouteAction::Allow as i32);
        assert!(route.hostnames[1].is_wildcard());
    }

    #[test]
    fn each_bad_gateway_field_is_named() {
        type Spoil = Box<dyn Fn(&mut proto::ApplyGatewayRequest)>;
        let cases: Vec<(&str, Spoil)> = vec![
            ("project", Box::new(|r| r.project = "Team".into())),
            ("name", Box::new(|r| r.name = "a_b".into())),
            ("listeners", Box::new(|r| r.listeners.clear())),
            ("listeners[1].name", Box::new(|r| r.listeners[1].name = "http".into())),
            ("listeners[0].name", Box::new(|r| r.listeners[0].name = String::new())),
            ("listeners[1].port", Box::new(|r| r.listeners[1].port = 3128)),
            ("listeners[0].port", Box::new(|r| r.listeners[0].port = 0)),
            ("listeners[0].port", Box::new(|r| r.listeners[0].port = 70_000)),
            ("listeners[0].protocol", Box::new(|r| r.listeners[0].protocol = 0)),
            ("listeners[0].protocol", Box::new(|r| r.listeners[0].protocol = 42)),
        ];
        for (field, spoil) in cases {
            let mut bad = good_gateway();
            spoil(&mut bad);
            assert_eq!(gateway(bad).unwrap_err().fields(), [field], "{field}");
        }
    }

    #[test]
    fn each_bad_route_field_is_named() {
        type Spoil = Box<dyn Fn(&mut proto::ApplyRouteRequest)>;
        let cases: Vec<(&str, Spoil)> = vec![
            ("name", Box::new(|r| r.name = String::new())),
            ("parent_refs", Box::new(|r| r.parent_refs.clear())),
            ("parent_refs[0].gateway", Box::new(|r| r.parent_refs[0].gateway = "Default".into())),
            ("parent_refs[0].listener", Box::new(|r| r.parent_refs[0].listener = "h_t".into())),
            ("parent_refs[1]", Box::new(|r| r.parent_refs.push(r.parent_refs[0].clone()))),
            ("hostnames", Box::new(|r| r.hostnames.clear())),
            ("hostnames[0]", Box::new(|r| r.hostnames[0] = "GitHub.com".into())),
            ("hostnames[0]", Box::new(|r| r.hostnames[0] = "git*.com".into())),
            ("hostnames[1]", Box::new(|r| r.hostnames[1] = "github.com".into())),
            ("ports[0]", Box::new(|r| r.ports[0] = 0)),
            ("ports[1]", Box::new(|r| r.ports.push(443))),
            ("action", Box::new(|r| r.action = 9)),
        ];
        for (field, spoil) in cases {
            let mut bad = good_route();
            spoil(&mut bad);
            assert_eq!(route(bad).unwrap_err().fields(), [field], "{field}");
        }
    }

    #[test]
    fn every_bad_field_is_named_at_once_as_invalid_argument() {
        let mut bad = good_route();
        bad.name = "Bad".into();
        bad.ports = vec![0];
        let error = route(bad).unwrap_err();
        assert_eq!(error.fields(), ["name", "ports[0]"]);
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("name: 'Bad' is not a route name"), "{}", status.message());
    }
}
