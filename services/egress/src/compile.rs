//! The compile of one tenant's egress policy: its services' selections, its
//! gateways and its routes in; what each service may reach, and the status of
//! every gateway, listener and route, out.
//!
//! # Invariants
//! - Pure: no I/O, no clock, no randomness. The same inputs in any order give
//!   an equal [`CompiledPlan`], and every list in it is sorted (services,
//!   gateways and routes by name; destinations by listener, host name, route;
//!   a route's parents stay in the order the route declares them).
//! - Names are keys: when inputs repeat a name, the entry that sorts first
//!   (by its whole content) is the one compiled, so even that is independent
//!   of input order. The API never stores two objects under one name.
//! - A gateway's destinations are computed once and shared by every service
//!   that selects it ([`Arc`]), so a compile costs O(routes + services) plus
//!   the sorts, not services x routes.
//!
//! # Attaching a route to a listener
//! A parent reference names a gateway and, optionally, one of its listeners;
//! without a listener it names every listener of the gateway. A route
//! attaches to each named listener that can carry it:
//! - HTTP and HTTPS_CONNECT listeners carry any route: the destination is
//!   the request's Host or the CONNECT authority, matched against the route's
//!   exact names and `*.suffix` wildcards, and its ports (none: any port).
//! - A TCP listener sees no host name in the stream, so each connection goes
//!   to the one destination its route names: a route on it must name exactly
//!   one exact host name (no wildcard) and exactly one port, and only one
//!   ALLOW route may attach to it; among several, the first by name does and
//!   the others are refused (and the listener reports `Conflicted`).
//!
//! A parent's status is `Accepted` when the route attached to at least one of
//! its listeners, `NoMatchingParent` when its gateway or listener does not
//! exist, and `NotAllowedByListeners` when none of its listeners can carry
//! the route (the message says why).
//!
//! # A service's egress
//! A service takes the gateway its selection names, `default` when it names
//! none. Its allowed and denied destinations are those of every route
//! attached to that gateway's listeners, by action. Its `EgressReady`
//! condition: `Accepted` (true) with at least one allowed destination;
//! `Disabled` (true: the selection is honoured, nothing leaves); `NoRoutes`
//! (false: the gateway exists, nothing is allowed through it);
//! `GatewayNotFound` (false: nothing leaves until it exists). A denial
//! applies on the listener it is attached to and wins over any allowance
//! there that it overlaps ([`ServicePlan::admits`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::model::{HostPattern, Protocol, RouteAction, Selection};

/// One service of the tenant and where its traffic goes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceInput {
    /// The service's name.
    pub service: String,
    /// Its selection: from the live revision's template when one serves, else
    /// the service's template.
    pub selection: Selection,
}

/// One listener of a gateway.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ListenerSpec {
    /// Its name, unique within the gateway.
    pub name: String,
    /// What it speaks.
    pub protocol: Protocol,
    /// The port the tenant's proxy listens on for it.
    pub port: u16,
}

/// A gateway as declared.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct GatewaySpec {
    /// Its name, unique within the project.
    pub name: String,
    /// Its generation, reported as the conditions' observed generation.
    pub generation: u64,
    /// Its listeners, in the order declared.
    pub listeners: Vec<ListenerSpec>,
}

/// Which listener (or every listener) of which gateway a route attaches to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParentSpec {
    /// The gateway's name.
    pub gateway: String,
    /// The listener's name; `None` names every listener of the gateway.
    pub listener: Option<String>,
}

impl ParentSpec {
    /// The parent a route's declared reference names (an empty listener
    /// names every listener).
    pub fn from_proto(parent: &berth_proto::egress::v1::ParentRef) -> Self {
        ParentSpec {
            gateway: parent.gateway.clone(),
            listener: (!parent.listener.is_empty()).then(|| parent.listener.clone()),
        }
    }
}

/// A route as declared.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RouteSpec {
    /// Its name, unique within the project.
    pub name: String,
    /// Its generation, reported as the conditions' observed generation.
    pub generation: u64,
    /// The listeners it attaches to, in the order declared.
    pub parents: Vec<ParentSpec>,
    /// The destinations it matches.
    pub hostnames: Vec<HostPattern>,
    /// The destination ports it matches; empty means any port.
    pub ports: Vec<u16>,
    /// What it does with matching traffic.
    pub action: RouteAction,
}

/// Everything one tenant's compile reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanInputs {
    /// Its services, in any order.
    pub services: Vec<ServiceInput>,
    /// Its gateways, in any order.
    pub gateways: Vec<GatewaySpec>,
    /// Its routes, in any order.
    pub routes: Vec<RouteSpec>,
}

/// One destination reachable (or refused) through one listener.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Destination {
    /// The listener the traffic goes through.
    pub listener: Arc<str>,
    /// What the listener speaks.
    pub protocol: Protocol,
    /// The port the listener is on.
    pub listener_port: u16,
    /// The host name matched.
    pub hostname: HostPattern,
    /// The destination ports matched, sorted; empty means any port.
    pub ports: Arc<[u16]>,
    /// The route it comes from.
    pub route: Arc<str>,
}

impl Destination {
    fn covers(&self, listener: &str, host: &str, port: u16) -> bool {
        *self.listener == *listener
            && self.hostname.matches(host)
            && (self.ports.is_empty() || self.ports.contains(&port))
    }
}

/// What a gateway lets through, shared by every service that selects it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Destinations {
    /// Allowed, sorted by listener, host name, route.
    pub allowed: Vec<Destination>,
    /// Denied, sorted likewise.
    pub denied: Vec<Destination>,
}

/// Why a service's egress reads as it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressReadiness {
    /// Its gateway exists and allows at least one destination.
    Accepted,
    /// Its template disables egress.
    Disabled,
    /// Its gateway exists but allows nothing.
    NoRoutes,
    /// Its gateway (named here) does not exist.
    GatewayNotFound(String),
}

impl EgressReadiness {
    /// Whether the condition holds: the selection is in force as declared.
    pub fn holds(&self) -> bool {
        matches!(self, Self::Accepted | Self::Disabled)
    }

    /// The condition's reason.
    pub fn reason(&self) -> &'static str {
        use crate::model::reason;
        match self {
            Self::Accepted => reason::ACCEPTED,
            Self::Disabled => reason::DISABLED,
            Self::NoRoutes => reason::NO_ROUTES,
            Self::GatewayNotFound(_) => reason::GATEWAY_NOT_FOUND,
        }
    }

    /// The condition's message, for people.
    pub fn message(&self, gateway: Option<&str>) -> String {
        match (self, gateway) {
            (Self::Accepted, Some(gateway)) => format!("egress goes through gateway {gateway}"),
            (Self::Accepted, None) => String::new(),
            (Self::Disabled, _) => "egress is disabled: nothing leaves the service".to_owned(),
            (Self::NoRoutes, gateway) => format!(
                "gateway {} exists but no accepted route allows anything through it",
                gateway.unwrap_or_default()
            ),
            (Self::GatewayNotFound(name), _) => {
                format!("gateway {name} does not exist in the project; nothing leaves until it does")
            }
        }
    }
}

/// What one service may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePlan {
    /// The service's name.
    pub service: String,
    /// The gateway its traffic goes through; `None` when disabled or missing.
    pub gateway: Option<String>,
    /// The gateway's destinations (empty without a gateway).
    pub destinations: Arc<Destinations>,
    /// Its `EgressReady` condition.
    pub readiness: EgressReadiness,
}

impl ServicePlan {
    /// Whether traffic to `host:port` through `listener` leaves: a denial
    /// attached to the listener that covers it refuses it, else an allowance
    /// there that covers it lets it through, else it is refused.
    pub fn admits(&self, listener: &str, host: &str, port: u16) -> bool {
        let destinations = &self.destinations;
        !destinations.denied.iter().any(|d| d.covers(listener, host, port))
            && destinations.allowed.iter().any(|d| d.covers(listener, host, port))
    }
}

/// What the compile observed about one listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerOutcome {
    /// The listener's name.
    pub name: String,
    /// How many routes attach to it.
    pub attached_routes: u32,
    /// Routes refused because the (TCP) listener already carries another; sorted.
    pub conflicts: Vec<String>,
}

/// What the compile observed about one gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayOutcome {
    /// The gateway's name.
    pub name: String,
    /// The generation compiled.
    pub generation: u64,
    /// One entry per listener, in the order declared.
    pub listeners: Vec<ListenerOutcome>,
    /// How many distinct routes attach to any of its listeners.
    pub attached_routes: u32,
    /// How many services select it.
    pub services: u32,
}

/// How one parent reference of a route fared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParentVerdict {
    /// The route attached to these listeners of the parent (at least one).
    Accepted {
        /// The listeners, in the gateway's order.
        listeners: Vec<String>,
    },
    /// The parent's gateway or listener does not exist.
    NoMatchingParent {
        /// What is missing, for people.
        message: String,
    },
    /// None of the parent's listeners can carry the route.
    NotAllowedByListeners {
        /// Why, for people.
        message: String,
    },
}

impl ParentVerdict {
    /// Whether the route attached through this parent.
    pub fn accepted(&self) -> bool {
        matches!(self, Self::Accepted { .. })
    }

    /// The `Accepted` condition's reason.
    pub fn reason(&self) -> &'static str {
        use crate::model::reason;
        match self {
            Self::Accepted { .. } => reason::ACCEPTED,
            Self::NoMatchingParent { .. } => reason::NO_MATCHING_PARENT,
            Self::NotAllowedByListeners { .. } => reason::NOT_ALLOWED_BY_LISTENERS,
        }
    }

    /// The `Accepted` condition's message.
    pub fn message(&self) -> String {
        match self {
            Self::Accepted { listeners } => format!("attached to listener {}", listeners.join(", ")),
            Self::NoMatchingParent { message } | Self::NotAllowedByListeners { message } => message.clone(),
        }
    }
}

/// One parent reference of a route and how it fared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentOutcome {
    /// The parent as the route declares it.
    pub parent: ParentSpec,
    /// How it fared.
    pub verdict: ParentVerdict,
}

/// What the compile observed about one route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteOutcome {
    /// The route's name.
    pub name: String,
    /// The generation compiled.
    pub generation: u64,
    /// One entry per parent reference, in the order declared.
    pub parents: Vec<ParentOutcome>,
}

/// A tenant's egress policy, compiled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompiledPlan {
    /// One entry per service, by name.
    pub services: Vec<ServicePlan>,
    /// One entry per gateway, by name.
    pub gateways: Vec<GatewayOutcome>,
    /// One entry per route, by name.
    pub routes: Vec<RouteOutcome>,
}

impl CompiledPlan {
    /// Compiles `inputs`; see the module docs for the rules.
    pub fn compile(inputs: &PlanInputs) -> CompiledPlan {
        compile(inputs)
    }
}

/// Sorts by whole content and keeps the first entry of each name.
fn by_name<T: Ord + Clone>(items: &[T], name: impl Fn(&T) -> &str) -> Vec<&T> {
    let mut sorted: Vec<&T> = items.iter().collect();
    // Unstable is enough: entries equal under `Ord` are equal in every field.
    sorted.sort_unstable();
    sorted.dedup_by(|later, first| name(later) == name(first));
    sorted
}

/// Why a route cannot attach to a listener.
enum Refusal {
    /// The route's shape does not fit the listener's protocol.
    Shape(String),
    /// The (TCP) listener already carries another allow route.
    Taken(String),
}

/// Why `route` cannot attach to `listener`, if it cannot.
fn refusal(route: &RouteSpec, gateway: &str, listener: &ListenerSpec, tcp_owner: Option<&str>) -> Option<Refusal> {
    if listener.protocol != Protocol::Tcp {
        return None;
    }
    let shape = route.hostnames.len() == 1 && !route.hostnames[0].is_wildcard() && route.ports.len() == 1;
    if !shape {
        return Some(Refusal::Shape(format!(
            "listener {} of gateway {gateway} is TCP: a route on it must name exactly one exact host name \
             (no wildcard) and exactly one port",
            listener.name
        )));
    }
    match tcp_owner {
        Some(owner) if route.action == RouteAction::Allow && owner != route.name => Some(Refusal::Taken(format!(
            "listener {} of gateway {gateway} is TCP and already carries route {owner}",
            listener.name
        ))),
        _ => None,
    }
}

/// The per-listener state of one gateway while routes attach.
#[derive(Debug, Default, Clone)]
struct ListenerSlot {
    /// Indexes into the sorted routes, in route order, no repeats.
    routes: Vec<usize>,
    /// The ALLOW route a TCP listener carries.
    tcp_owner: Option<usize>,
    conflicts: Vec<String>,
}

/// Compiles `inputs`; see the module docs for the rules.
pub fn compile(inputs: &PlanInputs) -> CompiledPlan {
    let gateways = by_name(&inputs.gateways, |g| &g.name);
    let routes = by_name(&inputs.routes, |r| &r.name);
    let services = by_name(&inputs.services, |s| &s.service);
    let gateway_index: HashMap<&str, usize> = gateways.iter().enumerate().map(|(i, g)| (g.name.as_str(), i)).collect();
    let mut slots: Vec<Vec<ListenerSlot>> =
        gateways.iter().map(|g| vec![ListenerSlot::default(); g.listeners.len()]).collect();

    let mut route_outcomes = Vec::with_capacity(routes.len());
    for (route_index, route) in routes.iter().enumerate() {
        let mut parents = Vec::with_capacity(route.parents.len());
        for parent in &route.parents {
            let verdict = match gateway_index.get(parent.gateway.as_str()) {
                None => ParentVerdict::NoMatchingParent { message: format!("gateway {} not found", parent.gateway) },
                Some(&g) => attach(route, route_index, &routes, gateways[g], &mut slots[g], parent),
            };
            parents.push(ParentOutcome { parent: parent.clone(), verdict });
        }
        route_outcomes.push(RouteOutcome { name: route.name.clone(), generation: route.generation, parents });
    }

    // Names and ports every destination of a route or listener shares.
    let shared: Vec<SharedRoute> = routes.iter().map(|r| SharedRoute::of(r)).collect();
    let destinations: Vec<Arc<Destinations>> = gateways
        .iter()
        .zip(&slots)
        .map(|(gateway, slots)| Arc::new(gateway_destinations(gateway, slots, &routes, &shared)))
        .collect();

    let none = Arc::new(Destinations::default());
    let mut selected = vec![0u32; gateways.len()];
    let service_plans = services
        .iter()
        .map(|input| {
            let (gateway, destinations, readiness) = match &input.selection {
                Selection::Disabled => (None, Arc::clone(&none), EgressReadiness::Disabled),
                Selection::Gateway(name) => match gateway_index.get(name.as_str()) {
                    None => (None, Arc::clone(&none), EgressReadiness::GatewayNotFound(name.clone())),
                    Some(&g) => {
                        selected[g] += 1;
                        let readiness = if destinations[g].allowed.is_empty() {
                            EgressReadiness::NoRoutes
                        } else {
                            EgressReadiness::Accepted
                        };
                        (Some(name.clone()), Arc::clone(&destinations[g]), readiness)
                    }
                },
            };
            ServicePlan { service: input.service.clone(), gateway, destinations, readiness }
        })
        .collect();

    let gateway_outcomes = gateways
        .iter()
        .zip(slots)
        .zip(selected)
        .map(|((gateway, slots), services)| {
            let attached: BTreeSet<usize> = slots.iter().flat_map(|s| s.routes.iter().copied()).collect();
            GatewayOutcome {
                name: gateway.name.clone(),
                generation: gateway.generation,
                listeners: gateway
                    .listeners
                    .iter()
                    .zip(slots)
                    .map(|(listener, mut slot)| {
                        slot.conflicts.sort();
                        slot.conflicts.dedup();
                        ListenerOutcome {
                            name: listener.name.clone(),
                            attached_routes: count(slot.routes.len()),
                            conflicts: slot.conflicts,
                        }
                    })
                    .collect(),
                attached_routes: count(attached.len()),
                services,
            }
        })
        .collect();

    CompiledPlan { services: service_plans, gateways: gateway_outcomes, routes: route_outcomes }
}

/// Attaches `route` to the listeners `parent` names on `gateway`.
fn attach(
    route: &RouteSpec,
    route_index: usize,
    routes: &[&RouteSpec],
    gateway: &GatewaySpec,
    slots: &mut [ListenerSlot],
    parent: &ParentSpec,
) -> ParentVerdict {
    let candidates: Vec<usize> = match &parent.listener {
        Some(name) => match gateway.listeners.iter().position(|l| &l.name == name) {
            Some(i) => vec![i],
            None => {
                return ParentVerdict::NoMatchingParent {
                    message: format!("gateway {} has no listener {name}", gateway.name),
                };
            }
        },
        None => (0..gateway.listeners.len()).collect(),
    };
    let mut attached = Vec::new();
    let mut refusals = Vec::new();
    for i in candidates {
        let listener = &gateway.listeners[i];
        let slot = &mut slots[i];
        let owner = slot.tcp_owner.map(|r| routes[r].name.as_str());
        match refusal(route, &gateway.name, listener, owner) {
            Some(Refusal::Shape(why)) => refusals.push(why),
            Some(Refusal::Taken(why)) => {
                slot.conflicts.push(route.name.clone());
                refusals.push(why);
            }
            None => {
                if listener.protocol == Protocol::Tcp && route.action == RouteAction::Allow {
                    slot.tcp_owner = Some(route_index);
                }
                if slot.routes.last() != Some(&route_index) {
                    slot.routes.push(route_index);
                }
                attached.push(listener.name.clone());
            }
        }
    }
    if !attached.is_empty() {
        ParentVerdict::Accepted { listeners: attached }
    } else if refusals.is_empty() {
        ParentVerdict::NotAllowedByListeners { message: format!("gateway {} has no listeners", gateway.name) }
    } else {
        ParentVerdict::NotAllowedByListeners { message: refusals.join("; ") }
    }
}

/// What every destination of one route shares: its name and its ports,
/// sorted and without repeats.
struct SharedRoute {
    name: Arc<str>,
    ports: Arc<[u16]>,
}

impl SharedRoute {
    fn of(route: &RouteSpec) -> Self {
        let mut ports = route.ports.clone();
        ports.sort_unstable();
        ports.dedup();
        Self { name: Arc::from(route.name.as_str()), ports: Arc::from(ports) }
    }
}

/// Every destination of the routes attached to `gateway`'s listeners, sorted.
fn gateway_destinations(
    gateway: &GatewaySpec,
    slots: &[ListenerSlot],
    routes: &[&RouteSpec],
    shared: &[SharedRoute],
) -> Destinations {
    let mut destinations = Destinations::default();
    for (listener, slot) in gateway.listeners.iter().zip(slots) {
        if slot.routes.is_empty() {
            continue;
        }
        let listener_name: Arc<str> = Arc::from(listener.name.as_str());
        for &r in &slot.routes {
            let route = routes[r];
            let bucket = match route.action {
                RouteAction::Allow => &mut destinations.allowed,
                RouteAction::Deny => &mut destinations.denied,
            };
            for hostname in &route.hostnames {
                bucket.push(Destination {
                    listener: Arc::clone(&listener_name),
                    protocol: listener.protocol,
                    listener_port: listener.port,
                    hostname: hostname.clone(),
                    ports: Arc::clone(&shared[r].ports),
                    route: Arc::clone(&shared[r].name),
                });
            }
        }
    }
    let order = |a: &Destination, b: &Destination| {
        (&a.listener, &a.hostname, &a.route, &a.ports).cmp(&(&b.listener, &b.hostname, &b.route, &b.ports))
    };
    destinations.allowed.sort_unstable_by(order);
    destinations.allowed.dedup();
    destinations.denied.sort_unstable_by(order);
    destinations.denied.dedup();
    destinations
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}
