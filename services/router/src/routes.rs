//! The route table: which replicas answer for which host name. A pure
//! function of what the router follows (services, their replicas' leases,
//! the nodes), rebuilt whole on every change, so a request always reads
//! one consistent table.
//!
//! # Host names
//! `<service>.<project>.<domain>` reaches a service's traffic split (its
//! status's `traffic`: every share names a revision; without one, the live
//! revision takes all), each request going to a share with the odds its
//! percent gives among the shares that have a replica.
//! `<tag>--<service>.<project>.<domain>` reaches the share tagged so,
//! whatever its percent. Names are matched without case and without the
//! port. The same names under `berth.internal` ([`SERVICE_ZONE`]) reach the
//! same services: what a workload's tenant resolver answers them with leads
//! here, whatever public domain the router serves.
//!
//! # Session affinity
//! A service whose status names an affinity (a header, or a cookie) keeps
//! each client's requests on one share and one replica by the value the
//! client sends: the value's hash is the roll that picks the share, and
//! the replica is the one whose lease id hashes highest with it
//! (rendezvous hashing), so a replica's coming or going moves only the
//! clients it had. The hash is fixed, so every router replica agrees.
//!
//! # Protocols
//! A replica is spoken to in HTTP/1.1 unless its first port is named `h2c`
//! or `grpc` (as Knative reads port names): then HTTP/2 with prior
//! knowledge, whatever the client spoke.
//!
//! # Replicas resized in place
//! A revision whose only change is its resources takes the running
//! replicas over instead of starting new ones; their leases keep naming
//! the revision they started as, and the service's status
//! (`adopted_replicas`) names the one each serves as now. That status and
//! the new live revision come in one write, so the traffic and the
//! replicas that serve it move together, with no moment of neither.
//!
//! # Invariants
//! - An endpoint is a RUNNING lease of a revision the split names, on a
//!   node that is up or draining, whose agent's address is known; nothing
//!   else is routed to.
//! - An unknown host resolves to [`Resolution::Unknown`], a known service
//!   with no such endpoint to [`Resolution::NoReplica`]: never a wait.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use berth_core::SERVICE_ZONE;
use berth_proto::identity::v1::{Node, NodeState};
use berth_proto::leases::v1::{Lease, LeasePhase};
use berth_proto::revisions::v1::{Service, TrafficTarget};

/// The names of a first port that speaks HTTP/2 with prior knowledge.
pub const H2C_PORT_NAMES: [&str; 2] = ["h2c", "grpc"];

/// The project a service with an empty project is in.
const DEFAULT_PROJECT: &str = "default";

/// A service, by (project, name).
pub type ServiceKey = (String, String);

/// A revision of a service, by (project, service, revision).
type RevisionKey = (String, String, String);

/// One replica a request may be sent to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The service it serves, by (project, name).
    pub service: ServiceKey,
    /// The node it runs on.
    pub node_id: String,
    /// Where that node's agent serves the data plane.
    pub agent_addr: String,
    /// The lease it runs for.
    pub lease_id: String,
    /// The revision it runs.
    pub revision: String,
    /// Whether it speaks HTTP/2 with prior knowledge (its first port is
    /// named `h2c` or `grpc`); else HTTP/1.1.
    pub h2c: bool,
}

/// What a host name resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution<'a> {
    /// The name is not one this table serves.
    Unknown {
        /// What the name was read as: `service S in project P`, or why it
        /// could not be read.
        looked_for: String,
    },
    /// The service exists and has no replica to send to now.
    NoReplica {
        /// `S` in project `P`.
        service: String,
    },
    /// The replicas to choose from; never empty.
    Endpoints(&'a [Arc<Endpoint>]),
}

/// How a service keeps a client's requests on one replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Affinity {
    /// By the value of this request header (lowercase).
    Header(String),
    /// By the value of this cookie; a client without it is given one.
    Cookie(String),
}

/// A session key's hash, the same in every router of one build.
fn session_hash(key: &str, salt: &str) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    // SipHash with fixed keys: the same everywhere, and a client cannot
    // aim its key at one replica without trying keys.
    let mut hasher = std::hash::DefaultHasher::new();
    key.hash(&mut hasher);
    salt.hash(&mut hasher);
    hasher.finish()
}

/// The roll, in `[0, 1)`, that session `key` picks a share with.
pub fn session_roll(key: &str) -> f64 {
    // The top 53 bits: exactly representable.
    (session_hash(key, "") >> 11) as f64 / (1u64 << 53) as f64
}

/// Which of `endpoints` session `key` keeps to: the one whose lease hashes
/// highest with it.
pub fn session_replica(endpoints: &[Arc<Endpoint>], key: &str) -> usize {
    let mut best = (0, 0);
    for (i, endpoint) in endpoints.iter().enumerate() {
        let score = session_hash(key, &endpoint.lease_id);
        if i == 0 || score > best.1 {
            best = (i, score);
        }
    }
    best.0
}

/// One share of a service's traffic, with the replicas that serve it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Share {
    revision: String,
    percent: u32,
    tag: String,
    /// Shared with the requests sent to them: picking one copies no name.
    endpoints: Vec<Arc<Endpoint>>,
}

/// Every service's shares, by (project, service).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteTable {
    domain: String,
    services: HashMap<ServiceKey, Vec<Share>>,
    /// The route generation of each service the shares were built from.
    generations: HashMap<ServiceKey, u64>,
    /// The session affinity of each service that has one.
    affinities: HashMap<ServiceKey, Affinity>,
}

/// What the route table is built from: the current state of each followed
/// kind, by key.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// Services by `project/name`.
    pub services: BTreeMap<String, Service>,
    /// Open leases by id.
    pub leases: BTreeMap<String, Lease>,
    /// Nodes by id.
    pub nodes: BTreeMap<String, Node>,
}

fn project_of(project: &str) -> &str {
    if project.is_empty() { DEFAULT_PROJECT } else { project }
}

impl RouteTable {
    /// The table `sources` describe, serving names under `domain`.
    pub fn build(domain: &str, sources: &Sources) -> RouteTable {
        // Every replica that may take traffic, by (project, service, revision),
        // each with whether it is leaving (its node drains).
        let mut ready: HashMap<RevisionKey, Vec<(bool, Arc<Endpoint>)>> = HashMap::new();
        // Replicas a later revision took over by resizing them in place serve as it.
        let adopted: HashMap<&str, &str> = sources
            .services
            .values()
            .filter_map(|service| service.status.as_ref())
            .flat_map(|status| {
                status.adopted_replicas.iter().map(|(lease, revision)| (lease.as_str(), revision.as_str()))
            })
            .collect();
        for lease in sources.leases.values() {
            let Some(workload) = &lease.workload else { continue };
            if lease.phase() != LeasePhase::Running || workload.service.is_empty() {
                continue;
            }
            let Some(node) = sources.nodes.get(&lease.node_id) else { continue };
            let serving = matches!(node.state(), NodeState::Up | NodeState::Draining);
            if !serving || node.advertise_addr.is_empty() {
                continue;
            }
            let revision = adopted.get(lease.lease_id.as_str()).copied().unwrap_or(&workload.revision);
            let key = (project_of(&lease.project).to_string(), workload.service.clone(), revision.to_owned());
            let leaving = node.state() == NodeState::Draining || lease.reason == berth_core::NODE_DRAINING;
            ready.entry(key).or_default().push((
                leaving,
                Arc::new(Endpoint {
                    service: (project_of(&lease.project).to_string(), workload.service.clone()),
                    node_id: node.node_id.clone(),
                    agent_addr: node.advertise_addr.clone(),
                    lease_id: lease.lease_id.clone(),
                    revision: revision.to_owned(),
                    h2c: workload.ports.first().is_some_and(|port| H2C_PORT_NAMES.contains(&port.name.as_str())),
                }),
            ));
        }
        // A replica on a draining node is about to be replaced and given
        // back: while any other replica of its revision serves, it is sent
        // nothing new, so it has no request in flight when it stops.
        let ready: HashMap<RevisionKey, Vec<Arc<Endpoint>>> = ready
            .into_iter()
            .map(|(key, endpoints)| {
                let staying = endpoints.iter().any(|(leaving, _)| !leaving);
                let mut kept: Vec<Arc<Endpoint>> = endpoints
                    .into_iter()
                    .filter(|(leaving, _)| !(staying && *leaving))
                    .map(|(_, endpoint)| endpoint)
                    .collect();
                kept.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
                (key, kept)
            })
            .collect();
        let services = sources
            .services
            .values()
            .map(|service| {
                let project = project_of(&service.project).to_string();
                let shares = routed(service)
                    .into_iter()
                    .map(|target| Share {
                        percent: target.percent,
                        endpoints: ready
                            .get(&(project.clone(), service.name.clone(), target.revision.clone()))
                            .cloned()
                            .unwrap_or_default(),
                        revision: target.revision,
                        tag: target.tag,
                    })
                    .collect();
                ((project, service.name.clone()), shares)
            })
            .collect();
        let generations = sources
            .services
            .values()
            .map(|service| {
                let generation = service.status.as_ref().map_or(0, |status| status.route_generation);
                ((project_of(&service.project).to_string(), service.name.clone()), generation)
            })
            .collect();
        let affinities = sources
            .services
            .values()
            .filter_map(|service| {
                let affinity = service.status.as_ref()?.affinity.as_ref()?;
                let affinity = match (affinity.header.is_empty(), affinity.cookie.is_empty()) {
                    (false, _) => Affinity::Header(affinity.header.to_ascii_lowercase()),
                    (true, false) => Affinity::Cookie(affinity.cookie.clone()),
                    (true, true) => return None,
                };
                Some(((project_of(&service.project).to_string(), service.name.clone()), affinity))
            })
            .collect();
        RouteTable { domain: domain.trim_matches('.').to_ascii_lowercase(), services, generations, affinities }
    }

    /// The session affinity of the service `host` names (by its own name or
    /// a tag's), if it has one.
    pub fn affinity(&self, host: &str) -> Option<&Affinity> {
        let (label, project) = self.read_host(host).ok()?;
        self.affinity_of(&label, &project)
    }

    /// The session affinity of the service `label` (a name, or
    /// `<tag>--<name>`) names in `project`.
    fn affinity_of(&self, label: &str, project: &str) -> Option<&Affinity> {
        let service = label.split_once("--").map_or(label, |(_, service)| service);
        self.affinities.get(&(project.to_string(), service.to_string()))
    }

    /// `host` read as `(label, project)` under the domain, or what it was
    /// looked for as.
    fn read_host(&self, host: &str) -> Result<(String, String), String> {
        let name = strip_port(host).trim_end_matches('.').to_ascii_lowercase();
        let under = |domain: &str| name.strip_suffix(domain).and_then(|rest| rest.strip_suffix('.'));
        let Some(rest) = under(self.domain.as_str()).or_else(|| under(SERVICE_ZONE)) else {
            return Err(format!("a name under {} or {SERVICE_ZONE}", self.domain));
        };
        match rest.split_once('.').filter(|(s, p)| !s.is_empty() && !p.contains('.')) {
            Some((label, project)) => Ok((label.to_string(), project.to_string())),
            None => Err(format!("<service>.<project>.{}, and '{rest}' is not <service>.<project>", self.domain)),
        }
    }

    /// Each service's route generation, as the table serves it.
    pub fn generations(&self) -> impl Iterator<Item = (&ServiceKey, u64)> {
        self.generations.iter().map(|(key, generation)| (key, *generation))
    }

    /// The route generation of `service` the table serves, if it names it.
    pub fn generation(&self, service: &ServiceKey) -> Option<u64> {
        self.generations.get(service).copied()
    }

    /// Whether new requests to `service` may be sent to the replica of
    /// `revision` that runs for `lease_id`: no longer once its revision takes
    /// no traffic, its lease ended, or its node drains while another serves.
    pub fn sends_to(&self, service: &ServiceKey, revision: &str, lease_id: &str) -> bool {
        self.services.get(service).is_some_and(|shares| {
            shares.iter().any(|share| {
                share.revision == revision && share.endpoints.iter().any(|endpoint| endpoint.lease_id == lease_id)
            })
        })
    }

    /// What `host` (a `Host` header or URI authority) resolves to; `roll`,
    /// uniform in `[0, 1)`, picks the share of a split.
    pub fn resolve(&self, host: &str, roll: f64) -> Resolution<'_> {
        self.resolve_by(host, |_| roll)
    }

    /// [`RouteTable::resolve`], with the roll asked of `roll` given the
    /// service's session affinity (once the host names a known domain), so
    /// a request's host is read once.
    pub fn resolve_by(&self, host: &str, roll: impl FnOnce(Option<&Affinity>) -> f64) -> Resolution<'_> {
        let (label, project) = match self.read_host(host) {
            Ok(read) => read,
            Err(looked_for) => return Resolution::Unknown { looked_for },
        };
        // `<tag>--<service>` names one tagged share, when the service has
        // that tag; an empty tag names none (untagged shares are reached
        // only by the split).
        let tagged = label
            .split_once("--")
            .filter(|(tag, _)| !tag.is_empty())
            .map(|(tag, service)| (tag.to_string(), (project.clone(), service.to_string())));
        let key: ServiceKey = (project, label);
        let roll = roll(self.affinities.get(tagged.as_ref().map_or(&key, |(_, service)| service)));
        if let Some((tag, service)) = &tagged
            && let Some(share) = self.services.get(service).and_then(|shares| shares.iter().find(|s| &s.tag == tag))
        {
            if share.endpoints.is_empty() {
                let (project, service) = service;
                return Resolution::NoReplica {
                    service: format!("tag {tag} of service {service} in project {project}"),
                };
            }
            return Resolution::Endpoints(&share.endpoints);
        }
        let described = || format!("service {} in project {}", key.1, key.0);
        let Some(shares) = self.services.get(&key) else {
            return Resolution::Unknown { looked_for: described() };
        };
        // The split among the shares that have replicas, as their percents say.
        let live = || shares.iter().filter(|s| s.percent > 0 && !s.endpoints.is_empty());
        let total: u32 = live().map(|s| s.percent).sum();
        let mut point = roll.clamp(0.0, 1.0) * f64::from(total);
        let mut last = None;
        for share in live() {
            point -= f64::from(share.percent);
            if point < 0.0 {
                return Resolution::Endpoints(&share.endpoints);
            }
            last = Some(share);
        }
        last.map_or_else(
            || Resolution::NoReplica { service: described() },
            |share| Resolution::Endpoints(&share.endpoints),
        )
    }

    /// Every endpoint of every service.
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.services.values().flatten().flat_map(|share| share.endpoints.iter().map(|endpoint| &**endpoint))
    }
}

/// The shares a service's traffic goes to: its status's split, or all to
/// its live revision (a revisions that reports no split), or none.
fn routed(service: &Service) -> Vec<TrafficTarget> {
    let Some(status) = &service.status else { return Vec::new() };
    if !status.traffic.is_empty() {
        return status.traffic.iter().filter(|t| !t.revision.is_empty()).cloned().collect();
    }
    if status.live_revision.is_empty() {
        return Vec::new();
    }
    vec![TrafficTarget { revision: status.live_revision.clone(), latest: true, percent: 100, tag: String::new() }]
}

/// `host` without a `:port` (and without the brackets of an IPv6 literal).
fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(ip, _)| ip);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use berth_proto::leases::v1::Workload;
    use berth_proto::revisions::v1::ServiceStatus;

    use super::*;

    pub(crate) fn service(project: &str, name: &str, live: &str) -> Service {
        Service {
            project: project.into(),
            name: name.into(),
            status: Some(ServiceStatus { live_revision: live.into(), ..Default::default() }),
            ..Default::default()
        }
    }

    pub(crate) fn lease(
        id: &str,
        project: &str,
        service: &str,
        revision: &str,
        node: &str,
        phase: LeasePhase,
    ) -> Lease {
        Lease {
            lease_id: id.into(),
            project: project.into(),
            node_id: node.into(),
            phase: phase as i32,
            workload: Some(Workload { service: service.into(), revision: revision.into(), ..Default::default() }),
            ..Default::default()
        }
    }

    pub(crate) fn node(id: &str, state: NodeState) -> Node {
        Node { node_id: id.into(), advertise_addr: format!("{id}:7447"), state: state as i32, ..Default::default() }
    }

    fn sources() -> Sources {
        let mut sources = Sources::default();
        for s in [service("", "hello", "hello-00002"), service("team", "api", "api-00001"), service("", "idle", "")] {
            sources.services.insert(format!("{}/{}", s.project, s.name), s);
        }
        for l in [
            lease("l-1", "", "hello", "hello-00002", "n-1", LeasePhase::Running),
            lease("l-2", "default", "hello", "hello-00002", "n-2", LeasePhase::Running),
            // The old revision, a replica still launching, one on a node that is down.
            lease("l-3", "", "hello", "hello-00001", "n-1", LeasePhase::Running),
            lease("l-4", "", "hello", "hello-00002", "n-1", LeasePhase::Launching),
            lease("l-5", "", "hello", "hello-00002", "n-3", LeasePhase::Running),
            // Another project's service of the same name is not hello.default's.
            lease("l-6", "team", "hello", "hello-00002", "n-1", LeasePhase::Running),
            lease("l-7", "team", "api", "api-00001", "n-2", LeasePhase::Running),
        ] {
            sources.leases.insert(l.lease_id.clone(), l);
        }
        for n in [node("n-1", NodeState::Up), node("n-2", NodeState::Up), node("n-3", NodeState::Down)] {
            sources.nodes.insert(n.node_id.clone(), n);
        }
        sources
    }

    fn leases(resolution: Resolution<'_>) -> Vec<&str> {
        match resolution {
            Resolution::Endpoints(endpoints) => endpoints.iter().map(|e| e.lease_id.as_str()).collect(),
            other => panic!("no endpoints: {other:?}"),
        }
    }

    #[test]
    fn a_session_keeps_to_one_share_and_one_replica_and_moves_only_with_its_replica() {
        let mut sources = sources();
        let hello = sources.services.get_mut("/hello").unwrap();
        let status = hello.status.as_mut().unwrap();
        status.affinity =
            Some(berth_proto::revisions::v1::SessionAffinity { header: "X-User".into(), cookie: "".into() });
        let table = RouteTable::build("berth.localhost", &sources);
        let header = Some(&Affinity::Header("x-user".into()));
        assert_eq!(table.affinity("hello.default.berth.localhost:8080"), header);
        assert_eq!(table.affinity("canary--hello.default.berth.localhost"), header, "a tag's host keeps the service's");
        assert_eq!(table.affinity("api.team.berth.localhost"), None);
        assert_eq!(table.affinity("nothing.example"), None);

        // Each key always lands on the same replica; keys spread over both.
        let Resolution::Endpoints(endpoints) = table.resolve("hello.default.berth.localhost", 0.0) else {
            unreachable!()
        };
        let keys: Vec<String> = (0..1000).map(|i| format!("user-{i}")).collect();
        let chosen: Vec<usize> = keys.iter().map(|key| session_replica(endpoints, key)).collect();
        assert_eq!(chosen, keys.iter().map(|key| session_replica(endpoints, key)).collect::<Vec<_>>());
        let on_first = chosen.iter().filter(|&&i| i == 0).count();
        assert!((400..=600).contains(&on_first), "{on_first} of 1000 keys on the first of two replicas");

        // A third replica takes only keys from the two: none moves between them.
        let mut three = endpoints.to_vec();
        three.push(Arc::new(Endpoint { lease_id: "l-9".into(), ..(*endpoints[0]).clone() }));
        for (key, before) in keys.iter().zip(&chosen) {
            let now = session_replica(&three, key);
            assert!(now == *before || now == 2, "{key} moved from {before} to {now}");
        }

        // The roll picks the share: a 90/10 split holds across keys.
        let rolls = keys.iter().filter(|key| session_roll(key) < 0.1).count();
        assert!((70..=130).contains(&rolls), "{rolls} of 1000 keys under 0.1");
        assert!(keys.iter().all(|key| (0.0..1.0).contains(&session_roll(key))));
    }

    #[test]
    fn a_service_name_reaches_the_running_replicas_of_its_live_revision_on_serving_nodes() {
        let table = RouteTable::build("berth.localhost", &sources());
        assert_eq!(leases(table.resolve("hello.default.berth.localhost", 0.0)), ["l-1", "l-2"]);
        assert_eq!(leases(table.resolve("HELLO.Default.berth.localhost:8080", 0.0)), ["l-1", "l-2"]);
        assert_eq!(leases(table.resolve("hello.default.berth.localhost.", 0.0)), ["l-1", "l-2"]);
        assert_eq!(leases(table.resolve("api.team.berth.localhost", 0.0)), ["l-7"]);
        assert_eq!(leases(table.resolve("api.team.berth.internal:80", 0.0)), ["l-7"]);
        let Resolution::Endpoints(endpoints) = table.resolve("api.team.berth.localhost", 0.0) else { unreachable!() };
        assert_eq!(endpoints[0].agent_addr, "n-2:7447");
        assert_eq!(endpoints[0].revision, "api-00001");
    }

    #[test]
    fn a_replica_resized_in_place_serves_as_the_revision_that_took_it_over() {
        // hello-00003 took l-3 (started as hello-00001) over in place and is live.
        let mut sources = sources();
        let hello = sources.services.get_mut("/hello").unwrap();
        let status = hello.status.as_mut().unwrap();
        status.live_revision = "hello-00003".into();
        status.adopted_replicas = [("l-3".to_owned(), "hello-00003".to_owned())].into();
        let table = RouteTable::build("berth.localhost", &sources);
        assert_eq!(leases(table.resolve("hello.default.berth.localhost", 0.0)), ["l-3"]);
        let Resolution::Endpoints(endpoints) = table.resolve("hello.default.berth.localhost", 0.0) else {
            unreachable!()
        };
        assert_eq!(endpoints[0].revision, "hello-00003");
        // Without the record, the lease's own revision is not live: nothing serves.
        let mut unrecorded = sources.clone();
        unrecorded.services.get_mut("/hello").unwrap().status.as_mut().unwrap().adopted_replicas.clear();
        let table = RouteTable::build("berth.localhost", &unrecorded);
        assert!(matches!(table.resolve("hello.default.berth.localhost", 0.0), Resolution::NoReplica { .. }));
    }

    #[test]
    fn a_replica_on_a_draining_node_is_sent_nothing_while_another_serves() {
        // n-2 drains: hello's replica there is left out while l-1 serves;
        // api's only replica is there, and serves on until it is replaced.
        let mut draining = sources();
        draining.nodes.insert("n-2".into(), node("n-2", NodeState::Draining));
        let table = RouteTable::build("berth.localhost", &draining);
        assert_eq!(leases(table.resolve("hello.default.berth.localhost", 0.0)), ["l-1"]);
        assert_eq!(leases(table.resolve("api.team.berth.localhost", 0.0)), ["l-7"]);
        // A lease told its node drains leaves before the node shows DRAINING.
        let mut sources = sources();
        sources.leases.get_mut("l-1").unwrap().reason = berth_core::NODE_DRAINING.into();
        let table = RouteTable::build("berth.localhost", &sources);
        assert_eq!(leases(table.resolve("hello.default.berth.localhost", 0.0)), ["l-2"]);
    }

    #[test]
    fn unknown_names_say_what_was_looked_for_and_a_service_without_replicas_is_no_replica() {
        let table = RouteTable::build("berth.localhost", &sources());
        let unknown = |host: &str| match table.resolve(host, 0.0) {
            Resolution::Unknown { looked_for } => looked_for,
            other => panic!("{host}: {other:?}"),
        };
        assert_eq!(unknown("nope.default.berth.localhost"), "service nope in project default");
        assert_eq!(unknown("hello.default.example.com"), "a name under berth.localhost or berth.internal");
        assert!(unknown("a.b.c.berth.localhost").contains("'a.b.c' is not <service>.<project>"));
        assert!(unknown("berth.localhost").contains("a name under"));
        assert_eq!(
            table.resolve("idle.default.berth.localhost", 0.0),
            Resolution::NoReplica { service: "service idle in project default".into() }
        );
        assert_eq!(
            table.resolve("[::1]:80", 0.0),
            Resolution::Unknown { looked_for: "a name under berth.localhost or berth.internal".into() }
        );
    }

    #[test]
    fn a_replica_whose_first_port_is_h2c_or_grpc_is_spoken_to_in_http2() {
        let mut sources = sources();
        let port = |name: &str| berth_proto::types::v1::Port { name: name.into(), port: 8080 };
        for (id, ports) in [("l-1", vec![port("http")]), ("l-7", vec![port("grpc"), port("http")])] {
            sources.leases.get_mut(id).unwrap().workload.as_mut().unwrap().ports = ports;
        }
        let table = RouteTable::build("berth.localhost", &sources);
        let h2c = |host: &str| match table.resolve(host, 0.0) {
            Resolution::Endpoints(endpoints) => endpoints.iter().map(|e| e.h2c).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(h2c("hello.default.berth.localhost"), [false, false], "http, and no port at all");
        assert_eq!(h2c("api.team.berth.localhost"), [true]);
    }

    #[test]
    fn a_split_sends_each_share_its_percent_of_the_rolls_and_a_tag_reaches_its_share_alone() {
        let mut sources = sources();
        let mut hello = service("", "hello", "hello-00002");
        let share = |revision: &str, percent: u32, tag: &str| TrafficTarget {
            revision: revision.into(),
            latest: false,
            percent,
            tag: tag.into(),
        };
        hello.status.as_mut().unwrap().traffic = vec![share("hello-00001", 90, "old"), share("hello-00002", 10, "")];
        sources.services.insert("/hello".into(), hello.clone());
        let table = RouteTable::build("berth.localhost", &sources);
        let host = "hello.default.berth.localhost";
        assert_eq!(leases(table.resolve(host, 0.0)), ["l-3"]);
        assert_eq!(leases(table.resolve(host, 0.899)), ["l-3"]);
        assert_eq!(leases(table.resolve(host, 0.9)), ["l-1", "l-2"]);
        assert_eq!(leases(table.resolve(host, 0.999)), ["l-1", "l-2"]);
        assert_eq!(leases(table.resolve("old--hello.default.berth.localhost", 0.999)), ["l-3"]);
        assert_eq!(
            table.resolve("nope--hello.default.berth.localhost", 0.0),
            Resolution::Unknown { looked_for: "service nope--hello in project default".into() }
        );
        assert_eq!(
            table.resolve("--hello.default.berth.localhost", 0.999),
            Resolution::Unknown { looked_for: "service --hello in project default".into() },
            "an empty tag names no share, not the first untagged one"
        );

        // A share with no replica takes none of the traffic: the rest is
        // split among the shares that have them.
        hello.status.as_mut().unwrap().traffic = vec![share("hello-00009", 90, "gone"), share("hello-00002", 10, "")];
        sources.services.insert("/hello".into(), hello);
        let table = RouteTable::build("berth.localhost", &sources);
        assert_eq!(leases(table.resolve(host, 0.0)), ["l-1", "l-2"]);
        assert_eq!(
            table.resolve("gone--hello.default.berth.localhost", 0.0),
            Resolution::NoReplica { service: "tag gone of service hello in project default".into() }
        );
    }

    #[test]
    fn a_service_with_no_live_revision_or_no_known_node_has_no_replica() {
        let mut sources = sources();
        sources.nodes.clear();
        let table = RouteTable::build("berth.localhost", &sources);
        assert!(matches!(table.resolve("hello.default.berth.localhost", 0.0), Resolution::NoReplica { .. }));
        assert_eq!(table.endpoints().count(), 0);
    }
}
