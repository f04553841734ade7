//! The node's egress proxies: for every tenant with replicas (or a plan) on
//! the node, its rules, its network namespace when the node isolates
//! replicas, and one proxy listener per service (see [`super::proxy`] for
//! why per service).
//!
//! # Expected flow
//! - [`EgressProxies::start`] decides how egress is enforced (see
//!   [`Enforcement`]), removes namespaces a previous run left unused, and
//!   reads the recorded listener ports.
//! - Before a replica starts, [`EgressProxies::attach`] makes sure its
//!   tenant has rules (refusing everything until a plan arrives), its
//!   namespace, and its service's listener, and says what the replica is
//!   given: the proxy variables and, when isolated, how to run it inside the
//!   namespace. Once it runs, [`EgressProxies::expose`] forwards its ports
//!   from the host into the namespace.
//! - [`EgressProxies::apply`] takes a whole [`NodeEgressState`]: every plan
//!   is compiled first, and only when all compile are the rules swapped, each
//!   tenant's at once. A tenant the state leaves out gets rules that refuse
//!   everything, and is stopped once no replica of it is left.
//! - [`EgressProxies::detach`] when a replica's lease ends; the tenant's
//!   listeners and namespace go when it has neither replicas nor a plan.
//! - [`EgressProxies::close`] at shutdown stops the listeners and removes the
//!   namespaces no process is in; replicas keep running.
//!
//! # What is stored
//! `DATA_DIR/egress/proxies.json`: the port of each service's listener, per
//! tenant, so that a restarted agent opens them again where the replicas it
//! adopts were told they are. Written whole (temporary file, rename).
//!
//! # Invariants
//! - A tenant's listeners read only that tenant's rules and, when isolated,
//!   exist only inside that tenant's namespace: one tenant's proxy never
//!   serves another tenant's replicas. When advisory, they listen on the
//!   host's loopback, each replica is given only its own tenant's, and
//!   nothing holds back a program that ignores it (which is what advisory
//!   means, and what the node reports).
//! - A state is applied whole or not at all.
//! - Every change goes through one lock: an apply, an attach and a detach
//!   never interleave.
//! - Nothing is stopped for a tenant before the replicas found at start have
//!   been attached again (see [`EgressProxies::recovered`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use berth_proto::egress::v1::{EgressEnforcement, NodeEgressState};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::dns;
use super::netns::{NamespaceError, Namespaces};
use super::proxy::{ProxyTiming, ServiceProxy};
use super::rules::{RulesError, TenantRules, tenant_name};
use crate::files::FileError;
use crate::provider::NetworkAttachment;

/// Where the proxies keep their record, in the data directory.
const EGRESS_DIR: &str = "egress";
const RECORD_FILE: &str = "proxies.json";
/// Where each tenant's `resolv.conf` is kept, under [`EGRESS_DIR`].
const RESOLV_DIR: &str = "resolv";

/// The addresses a replica reaches directly, never through the proxy.
const NO_PROXY: &str = "localhost,127.0.0.1,::1,.berth.internal";

/// Whether the agent runs replicas in network namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EgressIsolation {
    /// Isolate where the host allows it (root on Linux with `ip`), else
    /// enforce by advice only.
    #[default]
    Auto,
    /// Isolate, or refuse to start.
    Required,
    /// Never isolate: replicas are only given the proxy.
    Off,
}

impl std::str::FromStr for EgressIsolation {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(EgressIsolation::Auto),
            "required" | "namespace" | "netns" => Ok(EgressIsolation::Required),
            "off" | "none" => Ok(EgressIsolation::Off),
            other => Err(format!("'{other}' is not one of auto, required, off")),
        }
    }
}

impl std::fmt::Display for EgressIsolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EgressIsolation::Auto => "auto",
            EgressIsolation::Required => "required",
            EgressIsolation::Off => "off",
        })
    }
}

/// How the node holds replicas to their tenant's egress rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enforcement {
    /// Each tenant's replicas run in a network namespace whose only way out
    /// is the tenant's proxy.
    Isolated,
    /// Replicas are given the proxy in their environment, and a program
    /// that ignores it reaches the network directly.
    Advisory {
        /// Why the node does not isolate.
        reason: String,
    },
}

impl Enforcement {
    /// As the control plane is told it.
    pub fn to_proto(&self) -> EgressEnforcement {
        match self {
            Enforcement::Isolated => EgressEnforcement::Isolated,
            Enforcement::Advisory { .. } => EgressEnforcement::Advisory,
        }
    }
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Enforcement::Isolated => f.write_str("isolated"),
            Enforcement::Advisory { reason } => write!(f, "advisory ({reason})"),
        }
    }
}

/// Where the node stands with egress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressStatus {
    /// How egress is enforced.
    pub enforcement: Enforcement,
    /// The generation of the last node egress state applied; `None` before one was.
    pub applied: Option<u64>,
    /// Why the newest state could not be applied; `None` when it was.
    pub error: Option<String>,
}

/// What the proxies are built from.
#[derive(Debug, Clone)]
pub struct EgressSettings {
    /// The agent's data directory: it keeps the record, and names the
    /// agent's namespaces.
    pub data_dir: PathBuf,
    /// Whether to isolate replicas.
    pub isolation: EgressIsolation,
    /// The proxy's timings.
    pub timing: ProxyTiming,
    /// The router's cleartext listener, `host:port`: with it an isolated
    /// tenant's resolver answers `<service>.<project>.berth.internal` and
    /// its replicas reach those services through the router.
    pub router: Option<String>,
}

impl EgressSettings {
    /// Settings with the default isolation and timings, and no router.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            isolation: EgressIsolation::default(),
            timing: ProxyTiming::default(),
            router: None,
        }
    }
}

/// Why egress could not be set up or a plan applied.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// A plan cannot be turned into rules; nothing of the state was applied.
    #[error("invalid egress plan: {0}")]
    Plan(#[from] RulesError),
    /// The state carries two plans for one tenant; nothing of it was applied.
    #[error("the node egress state carries two plans for project {0}")]
    DuplicateTenant(String),
    /// Isolation was required and the host cannot do it.
    #[error("egress isolation is required and this host cannot isolate replicas: {0}")]
    IsolationUnavailable(#[source] NamespaceError),
    /// A tenant's namespace could not be made.
    #[error("cannot prepare the network namespace of project {project}: {source}")]
    Namespace {
        /// The tenant.
        project: String,
        /// Why.
        #[source]
        source: NamespaceError,
    },
    /// A service's listener could not be opened.
    #[error("cannot open the egress proxy of service '{service}' in project {project}: {source}")]
    Listen {
        /// The tenant.
        project: String,
        /// The service.
        service: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A replica's port could not be forwarded into its namespace.
    #[error("cannot forward port {port} of lease {lease_id} into its network namespace: {source}")]
    Forward {
        /// The lease.
        lease_id: String,
        /// The host port.
        port: u16,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The record of the listener ports could not be written or read.
    #[error(transparent)]
    Record(#[from] crate::files::FileError),
    /// The proxies were closed.
    #[error("the egress proxies are shut down")]
    Closed,
}

/// What a replica is given to reach the network through its tenant's proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    tenant: String,
    service: String,
    proxy: SocketAddr,
    namespace: Option<String>,
    network: Option<NetworkAttachment>,
}

impl Attachment {
    /// The tenant.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The service whose rules the replica's proxy holds it to.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The proxy's address as the replica reaches it (inside its
    /// namespace, when isolated).
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy
    }

    /// `http://127.0.0.1:<port>`.
    pub fn proxy_url(&self) -> String {
        format!("http://{}", self.proxy)
    }

    /// The namespace the replica runs in; `None` when the node does not isolate.
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    /// The variables every replica gets: `HTTP_PROXY`, `HTTPS_PROXY` and
    /// `ALL_PROXY` (and lower-case), `NO_PROXY` for loopback and services'
    /// internal names (reached directly, see [`dns`]), and
    /// `BERTH_EGRESS_PROXY`.
    pub fn env(&self) -> BTreeMap<String, String> {
        let url = self.proxy_url();
        let mut env = BTreeMap::new();
        for name in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"] {
            env.insert(name.to_string(), url.clone());
            env.insert(name.to_ascii_lowercase(), url.clone());
        }
        env.insert("NO_PROXY".into(), NO_PROXY.into());
        env.insert("no_proxy".into(), NO_PROXY.into());
        env.insert("BERTH_EGRESS_PROXY".into(), url);
        env
    }

    /// The command line that runs the host program `program` with `args`
    /// where the replica belongs: inside the namespace when isolated, as
    /// given otherwise.
    pub fn command(&self, program: &str, args: &[String]) -> (String, Vec<String>) {
        let mut line = self.network.as_ref().map(|network| network.enter.clone()).unwrap_or_default();
        line.push(program.to_string());
        line.extend(args.iter().cloned());
        let program = line.remove(0);
        (program, line)
    }

    /// The tenant's network namespace for the replica to join; `None`
    /// when the node does not isolate.
    pub(crate) fn network(&self) -> Option<&NetworkAttachment> {
        self.network.as_ref()
    }
}

/// How long a departed tenant's namespace is waited on to empty.
const NAMESPACE_LINGER: std::time::Duration = std::time::Duration::from_secs(60);

/// The node's egress proxies; cheap to clone.
#[derive(Debug, Clone)]
pub struct EgressProxies {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    timing: ProxyTiming,
    router: Option<Arc<str>>,
    namespaces: Option<Namespaces>,
    record_path: PathBuf,
    /// Each tenant's `resolv.conf`, as `<tenant>.conf`.
    resolv_dir: PathBuf,
    state: Mutex<State>,
    status: watch::Sender<EgressStatus>,
    stop: CancellationToken,
    /// The tasks serving proxy listeners: [`EgressProxies::close`] waits
    /// for them, so their ports are free again once it returns (a restart
    /// reopens each on the port its replicas were told).
    listeners: TaskTracker,
}

#[derive(Debug, Default)]
struct State {
    tenants: BTreeMap<String, Tenant>,
    /// Listener ports per tenant and service, as recorded.
    recorded: BTreeMap<String, BTreeMap<String, u16>>,
    /// Whether the replicas found at start have been attached again.
    recovered: bool,
    closed: bool,
}

#[derive(Debug)]
struct Tenant {
    rules: watch::Sender<Arc<TenantRules>>,
    /// The upstream resolvers of its DNS config, as its plan names them.
    upstreams: watch::Sender<Arc<Vec<SocketAddr>>>,
    /// Its `resolv.conf` as last written (or to be written with its namespace).
    resolv_conf: String,
    /// Whether the last applied state lists the tenant.
    planned: bool,
    namespace: Option<String>,
    /// The port of each service's listener.
    services: BTreeMap<String, u16>,
    /// The replicas attached, by lease, each with what stops its forwarding.
    leases: BTreeMap<String, CancellationToken>,
    /// Stops every listener and forwarding of the tenant.
    stop: CancellationToken,
}

impl Tenant {
    fn new(rules: TenantRules, parent: &CancellationToken) -> Self {
        Self {
            rules: watch::channel(Arc::new(rules)).0,
            upstreams: watch::channel(Arc::new(Vec::new())).0,
            resolv_conf: dns::resolv_conf(None),
            planned: false,
            namespace: None,
            services: BTreeMap::new(),
            leases: BTreeMap::new(),
            stop: parent.child_token(),
        }
    }
}

impl EgressProxies {
    /// Decides how egress is enforced, removes what an earlier run left
    /// unused, and reads the record; everything stops on `shutdown`.
    pub async fn start(settings: EgressSettings, shutdown: CancellationToken) -> Result<Self, EgressError> {
        let dir = settings.data_dir.join(EGRESS_DIR);
        let record = |action, source| EgressError::Record(FileError::new(action, &dir, source));
        tokio::fs::create_dir_all(&dir).await.map_err(|e| record("create", e))?;
        let (namespaces, enforcement) = match settings.isolation {
            EgressIsolation::Off => {
                (None, Enforcement::Advisory { reason: "isolation is turned off (--egress-isolation off)".into() })
            }
            EgressIsolation::Auto | EgressIsolation::Required => match Namespaces::probe(&settings.data_dir).await {
                Ok(namespaces) => (Some(namespaces), Enforcement::Isolated),
                Err(error) if settings.isolation == EgressIsolation::Required => {
                    return Err(EgressError::IsolationUnavailable(error));
                }
                Err(error) => (None, Enforcement::Advisory { reason: error.to_string() }),
            },
        };
        if let Some(namespaces) = &namespaces {
            let removed = namespaces.sweep().await;
            if !removed.is_empty() {
                tracing::info!(?removed, "removed network namespaces no process uses");
            }
        }
        let record_path = dir.join(RECORD_FILE);
        let recorded = read_record(&record_path).await;
        match &enforcement {
            Enforcement::Isolated => {
                tracing::info!("egress enforced: each tenant's replicas run in its own network namespace")
            }
            Enforcement::Advisory { reason } => tracing::warn!(%reason,
                "egress is advisory: replicas are given their proxy, and a program that ignores it is not held back"),
        }
        let status = EgressStatus { enforcement, applied: None, error: None };
        Ok(Self {
            inner: Arc::new(Inner {
                timing: settings.timing,
                router: settings.router.map(Into::into),
                namespaces,
                record_path,
                resolv_dir: dir.join(RESOLV_DIR),
                state: Mutex::new(State { recorded, ..State::default() }),
                status: watch::channel(status).0,
                stop: shutdown.child_token(),
                listeners: TaskTracker::new(),
            }),
        })
    }

    /// How egress is enforced on this node.
    pub fn enforcement(&self) -> Enforcement {
        self.inner.status.borrow().enforcement.clone()
    }

    /// Where the node stands with egress, and every change.
    pub fn status(&self) -> watch::Receiver<EgressStatus> {
        self.inner.status.subscribe()
    }

    /// Applies a whole node egress state: every plan, or none of them.
    pub async fn apply(&self, node_state: &NodeEgressState) -> Result<(), EgressError> {
        let applied = self.apply_whole(node_state).await;
        self.inner.status.send_modify(|status| match &applied {
            Ok(()) => {
                status.applied = Some(node_state.generation);
                status.error = None;
            }
            Err(error) => status.error = Some(error.to_string()),
        });
        applied
    }

    async fn apply_whole(&self, node_state: &NodeEgressState) -> Result<(), EgressError> {
        let mut compiled = BTreeMap::new();
        for plan in &node_state.plans {
            let rules = TenantRules::compile(plan)?;
            let tenant = rules.tenant().to_string();
            let dns = (dns::upstreams(plan.dns.as_ref()), dns::resolv_conf(plan.dns.as_ref()));
            if compiled.insert(tenant.clone(), (rules, dns)).is_some() {
                return Err(EgressError::DuplicateTenant(tenant));
            }
        }
        let mut state = self.inner.state.lock().await;
        if state.closed {
            return Err(EgressError::Closed);
        }
        let mut leaving = Vec::new();
        for (name, tenant) in &mut state.tenants {
            if !compiled.contains_key(name) {
                tenant.planned = false;
                tenant.rules.send_replace(Arc::new(TenantRules::withdrawn(name)));
                tenant.upstreams.send_replace(Arc::default());
                if tenant.leases.is_empty() {
                    leaving.push(name.clone());
                }
            }
        }
        for (name, (rules, (upstreams, resolv_conf))) in compiled {
            let stop = &self.inner.stop;
            let path = self.resolv_path(&name);
            let tenant =
                state.tenants.entry(name).or_insert_with_key(|name| Tenant::new(TenantRules::no_plan_yet(name), stop));
            if tenant.resolv_conf != resolv_conf {
                if tenant.namespace.is_some() {
                    dns::write_in_place(&path, &resolv_conf)
                        .await
                        .map_err(|source| EgressError::Record(FileError::new("write", &path, source)))?;
                }
                tenant.resolv_conf = resolv_conf;
            }
            tenant.planned = true;
            tenant.rules.send_replace(Arc::new(rules));
            tenant.upstreams.send_if_modified(|current| {
                let changed = **current != upstreams;
                if changed {
                    *current = Arc::new(upstreams);
                }
                changed
            });
        }
        if state.recovered {
            for name in leaving {
                self.remove_tenant(&mut state, &name).await;
            }
        }
        Ok(())
    }

    /// Prepares what a replica of `service` in `project` needs before it
    /// starts, and holds it for `lease_id` until [`detach`](Self::detach).
    pub async fn attach(&self, lease_id: &str, project: &str, service: &str) -> Result<Attachment, EgressError> {
        let name = tenant_name(project);
        let mut state = self.inner.state.lock().await;
        if state.closed {
            return Err(EgressError::Closed);
        }
        let State { tenants, recorded, .. } = &mut *state;
        let stop = &self.inner.stop;
        let tenant = tenants.entry(name.clone()).or_insert_with(|| Tenant::new(TenantRules::no_plan_yet(&name), stop));
        if let Some(namespaces) = &self.inner.namespaces
            && tenant.namespace.is_none()
        {
            let namespace = namespaces.name(&name);
            namespaces
                .ensure(&namespace)
                .await
                .map_err(|source| EgressError::Namespace { project: name.clone(), source })?;
            // The tenant's resolver, at the address its replicas' resolv.conf names.
            let path = self.resolv_path(&name);
            dns::write_in_place(&path, &tenant.resolv_conf)
                .await
                .map_err(|source| EgressError::Record(FileError::new("write", &path, source)))?;
            // Where services' internal names lead: the router, by way of the agent.
            let services = match &self.inner.router {
                Some(router) => {
                    let addr = SocketAddr::from((dns::SERVICES_ADDR, dns::SERVICES_PORT));
                    match namespaces.listen_at(&namespace, addr).await {
                        Ok(listener) => {
                            let to = ForwardTo::Router(router.clone());
                            self.inner.listeners.spawn(Forward { to }.serve(listener, tenant.stop.child_token()));
                            true
                        }
                        Err(error) => {
                            tracing::warn!(project = %name, %namespace, %error,
                                "cannot open the way to the router; its replicas reach no service by name");
                            false
                        }
                    }
                }
                None => false,
            };
            let guest_services: std::net::Ipv4Addr =
                berth_microvm::vmm::GUEST_SERVICES_ADDRESS.parse().unwrap_or(dns::SERVICES_ADDR);
            for (addr, answer) in [(dns::RESOLVER_ADDR, dns::SERVICES_ADDR), (dns::GUEST_RESOLVER_ADDR, guest_services)]
            {
                match namespaces.resolver_sockets(&namespace, addr).await {
                    Ok((udp, tcp)) => {
                        let tenant_dns = dns::TenantDns {
                            rules: tenant.rules.subscribe(),
                            upstreams: tenant.upstreams.subscribe(),
                            services: services.then_some(answer),
                        };
                        dns::serve(
                            name.clone(),
                            tenant_dns,
                            udp,
                            tcp,
                            &self.inner.listeners,
                            tenant.stop.child_token(),
                        );
                        tracing::info!(project = %name, %addr, %namespace, "tenant resolver listening");
                    }
                    Err(error) => tracing::warn!(project = %name, %addr, %namespace, %error,
                        "cannot open the tenant's resolver; its replicas resolve no name there"),
                }
            }
            tenant.namespace = Some(namespace);
        }
        let port = match tenant.services.get(service) {
            Some(port) => *port,
            None => {
                let kept = recorded.get(&name).cloned().unwrap_or_default();
                let port = self.open_listener(&name, tenant, service, &kept).await?;
                tenant.services.insert(service.to_string(), port);
                if recorded.entry(name.clone()).or_default().insert(service.to_string(), port) != Some(port) {
                    write_record(&self.inner.record_path, recorded).await?;
                }
                port
            }
        };
        tenant.leases.entry(lease_id.to_string()).or_insert_with(|| tenant.stop.child_token());
        let namespace = tenant.namespace.clone();
        let network = match (&self.inner.namespaces, &namespace) {
            (Some(namespaces), Some(namespace)) => Some(NetworkAttachment {
                namespace: namespaces.path(namespace),
                enter: namespaces.exec_prefix(namespace),
                resolv_conf: Some(self.resolv_path(&name)),
            }),
            _ => None,
        };
        Ok(Attachment {
            tenant: name,
            service: service.to_string(),
            proxy: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            namespace,
            network,
        })
    }

    /// Where `tenant`'s `resolv.conf` is kept.
    fn resolv_path(&self, tenant: &str) -> PathBuf {
        self.inner.resolv_dir.join(format!("{tenant}.conf"))
    }

    /// Opens the listener of `service` (on its recorded port when it has
    /// one) and starts serving it with the tenant's rules.
    async fn open_listener(
        &self,
        project: &str,
        tenant: &Tenant,
        service: &str,
        kept: &BTreeMap<String, u16>,
    ) -> Result<u16, EgressError> {
        let wanted = kept.get(service).copied();
        // Ports the tenant's other services hold, or were told they hold.
        let avoid: BTreeSet<u16> = tenant.services.values().chain(kept.values()).copied().collect();
        let open = |port: Option<u16>| {
            let avoid = avoid.clone();
            async move {
                match (&self.inner.namespaces, &tenant.namespace) {
                    (Some(namespaces), Some(namespace)) => namespaces.listen(namespace, port, &avoid).await,
                    _ => TcpListener::bind((Ipv4Addr::LOCALHOST, port.unwrap_or(0))).await,
                }
            }
        };
        let listener = match open(wanted).await {
            Ok(listener) => Ok(listener),
            Err(error) if wanted.is_some() => {
                tracing::warn!(%project, %service, port = ?wanted, %error,
                    "the recorded proxy port is taken; replicas started before the restart lose their proxy");
                open(None).await
            }
            Err(error) => Err(error),
        }
        .map_err(|source| EgressError::Listen {
            project: project.to_string(),
            service: service.to_string(),
            source,
        })?;
        let port = listener
            .local_addr()
            .map_err(|source| EgressError::Listen {
                project: project.to_string(),
                service: service.to_string(),
                source,
            })?
            .port();
        let proxy =
            ServiceProxy { service: service.to_string(), rules: tenant.rules.subscribe(), timing: self.inner.timing };
        self.inner.listeners.spawn(proxy.serve(listener, tenant.stop.child_token()));
        tracing::info!(%project, %service, port, namespace = ?tenant.namespace, "egress proxy listening");
        Ok(port)
    }

    /// Forwards the host `ports` of the replica of `lease_id` into its
    /// namespace, until it is detached; nothing to do when not isolated.
    pub async fn expose(&self, lease_id: &str, ports: &[u16]) -> Result<(), EgressError> {
        let Some(namespaces) = &self.inner.namespaces else { return Ok(()) };
        let state = self.inner.state.lock().await;
        let Some((namespace, stop)) = state.tenants.values().find_map(|tenant| {
            let stop = tenant.leases.get(lease_id)?;
            Some((tenant.namespace.clone()?, stop.clone()))
        }) else {
            return Ok(());
        };
        let ports: BTreeSet<u16> = ports.iter().copied().filter(|port| *port != 0).collect();
        for port in ports {
            let forward = |source| EgressError::Forward { lease_id: lease_id.to_string(), port, source };
            let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).await.map_err(forward)?;
            let to = ForwardTo::Replica { namespaces: namespaces.clone(), namespace: namespace.clone(), port };
            tokio::spawn(Forward { to }.serve(listener, stop.clone()));
        }
        Ok(())
    }

    /// Connects to `port` of the replica of `lease_id` where it listens:
    /// `127.0.0.1` inside its tenant's namespace when the node isolates
    /// egress, else `None` (the host's loopback is the caller's to dial).
    pub async fn connect_inside(&self, lease_id: &str, port: u16) -> Option<std::io::Result<tokio::net::TcpStream>> {
        let namespaces = self.inner.namespaces.as_ref()?;
        let namespace = {
            let state = self.inner.state.lock().await;
            state.tenants.values().find(|tenant| tenant.leases.contains_key(lease_id))?.namespace.clone()?
        };
        Some(namespaces.connect(&namespace, port).await)
    }

    /// Lets go of what `lease_id` held; its tenant is stopped once it has
    /// neither replicas nor a plan on the node.
    pub async fn detach(&self, lease_id: &str) {
        let mut state = self.inner.state.lock().await;
        let Some(name) = state.tenants.iter().find(|(_, t)| t.leases.contains_key(lease_id)).map(|(n, _)| n.clone())
        else {
            return;
        };
        let Some(tenant) = state.tenants.get_mut(&name) else { return };
        if let Some(forwarding) = tenant.leases.remove(lease_id) {
            forwarding.cancel();
        }
        if tenant.leases.is_empty() && !tenant.planned && state.recovered {
            self.remove_tenant(&mut state, &name).await;
        }
    }

    /// Says that the replicas found at start are attached again: from now
    /// on a tenant with neither replicas nor a plan is stopped, and the
    /// record forgets tenants no replica came back for.
    pub async fn recovered(&self) {
        let mut state = self.inner.state.lock().await;
        state.recovered = true;
        let idle: Vec<String> =
            state.tenants.iter().filter(|(_, t)| t.leases.is_empty() && !t.planned).map(|(n, _)| n.clone()).collect();
        for name in idle {
            self.remove_tenant(&mut state, &name).await;
        }
        let State { tenants, recorded, .. } = &mut *state;
        let before = recorded.len();
        recorded.retain(|name, _| tenants.contains_key(name));
        if recorded.len() != before
            && let Err(error) = write_record(&self.inner.record_path, recorded).await
        {
            tracing::warn!(%error, "cannot update the egress record");
        }
    }

    async fn remove_tenant(&self, state: &mut State, name: &str) {
        let Some(tenant) = state.tenants.remove(name) else { return };
        tenant.stop.cancel();
        if state.recorded.remove(name).is_some()
            && let Err(error) = write_record(&self.inner.record_path, &state.recorded).await
        {
            tracing::warn!(%error, "cannot update the egress record");
        }
        if let (Some(namespaces), Some(namespace)) = (&self.inner.namespaces, &tenant.namespace) {
            match namespaces.remove_if_unused(namespace).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!(project = %name, %namespace,
                        "the tenant left the node while a process is still in its network namespace; removing it once that is gone");
                    self.remove_when_unused(name.to_string(), namespace.clone());
                }
                Err(error) => tracing::warn!(project = %name, %namespace, %error, "cannot remove a network namespace"),
            }
        }
        tracing::info!(project = %name, "stopped the tenant's egress proxy");
    }

    /// Removes a departed tenant's namespace once the last process in it
    /// (a sandbox still tearing down, say) is gone, for up to
    /// [`NAMESPACE_LINGER`]. Each try holds the state lock and gives up if
    /// the tenant came back, so a namespace a new lease is about to use is
    /// never removed.
    fn remove_when_unused(&self, tenant: String, namespace: String) {
        let proxies = self.clone();
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + NAMESPACE_LINGER;
            while tokio::time::Instant::now() < deadline {
                tokio::select! {
                    _ = proxies.inner.stop.cancelled() => return,
                    _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                }
                let state = proxies.inner.state.lock().await;
                if state.closed || state.tenants.contains_key(&tenant) {
                    return;
                }
                let Some(namespaces) = &proxies.inner.namespaces else { return };
                match namespaces.remove_if_unused(&namespace).await {
                    Ok(true) => {
                        tracing::info!(project = %tenant, %namespace, "removed the departed tenant's network namespace");
                        return;
                    }
                    Ok(false) => {}
                    Err(error) => {
                        tracing::warn!(project = %tenant, %namespace, %error, "cannot remove a network namespace");
                        return;
                    }
                }
            }
            tracing::warn!(project = %tenant, %namespace,
                "a process is still in the departed tenant's network namespace; keeping it until the next start");
        });
    }

    /// Stops every listener and forwarding, and removes every namespace no
    /// process is in; replicas keep running, and a restarted agent opens
    /// their proxies again. Returns once every proxy port is closed.
    pub async fn close(&self) {
        let mut state = self.inner.state.lock().await;
        if state.closed {
            return;
        }
        state.closed = true;
        self.inner.stop.cancel();
        let tenants = std::mem::take(&mut state.tenants);
        if let Some(namespaces) = &self.inner.namespaces {
            for namespace in tenants.values().filter_map(|tenant| tenant.namespace.as_deref()) {
                if let Err(error) = namespaces.remove_if_unused(namespace).await {
                    tracing::warn!(%namespace, %error, "cannot remove a network namespace");
                }
            }
            namespaces.release_owner();
        }
        drop(state);
        self.inner.listeners.close();
        self.inner.listeners.wait().await;
    }
}

/// Where a [`Forward`] sends each connection it accepts.
enum ForwardTo {
    /// `127.0.0.1:port` inside a tenant's namespace: a replica's port.
    Replica { namespaces: Namespaces, namespace: String, port: u16 },
    /// The router's cleartext listener, `host:port` (looked up at each
    /// connection): services' internal names.
    Router(Arc<str>),
}

/// Forwards the connections a listener accepts, byte for byte: from a host
/// port into a tenant's namespace, or from [`dns::SERVICES_ADDR`] inside
/// one to the router.
struct Forward {
    to: ForwardTo,
}

impl Forward {
    async fn connect(&self) -> std::io::Result<tokio::net::TcpStream> {
        match &self.to {
            ForwardTo::Replica { namespaces, namespace, port } => namespaces.connect(namespace, *port).await,
            ForwardTo::Router(router) => tokio::net::TcpStream::connect(&**router).await,
        }
    }

    async fn serve(self, listener: TcpListener, stop: CancellationToken) {
        let inbound = Arc::new(self);
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let Ok((mut client, _)) = accepted else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let (inbound, stop) = (inbound.clone(), stop.clone());
            tokio::spawn(async move {
                let mut workload = match inbound.connect().await {
                    Ok(workload) => workload,
                    Err(error) => {
                        match &inbound.to {
                            ForwardTo::Replica { namespace, port, .. } => tracing::debug!(%namespace, port, %error,
                                "nothing answers on the replica's port inside its namespace"),
                            ForwardTo::Router(router) => tracing::warn!(%router, %error,
                                "cannot reach the router for a workload's connection to a service"),
                        }
                        return;
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::io::copy_bidirectional(&mut client, &mut workload) => {}
                }
            });
        }
    }
}

async fn read_record(path: &std::path::Path) -> BTreeMap<String, BTreeMap<String, u16>> {
    match tokio::fs::read(path).await {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|error| {
            tracing::warn!(path = %path.display(), %error, "ignoring an unreadable egress record");
            BTreeMap::new()
        }),
        Err(_) => BTreeMap::new(),
    }
}

async fn write_record(
    path: &std::path::Path,
    recorded: &BTreeMap<String, BTreeMap<String, u16>>,
) -> Result<(), EgressError> {
    let failed = |action, source| EgressError::Record(FileError::new(action, path, source));
    let bytes = serde_json::to_vec_pretty(recorded).map_err(|e| failed("encode", std::io::Error::other(e)))?;
    let tmp = path.with_extension("json.tmp");
    tokio::fs::write(&tmp, bytes).await.map_err(|e| failed("write", e))?;
    tokio::fs::rename(&tmp, path).await.map_err(|e| failed("replace", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isolation_reads_the_way_the_flag_is_written() {
        assert_eq!("auto".parse::<EgressIsolation>(), Ok(EgressIsolation::Auto));
        assert_eq!("Required".parse::<EgressIsolation>(), Ok(EgressIsolation::Required));
        assert_eq!("off".parse::<EgressIsolation>(), Ok(EgressIsolation::Off));
        assert!("sometimes".parse::<EgressIsolation>().unwrap_err().contains("auto, required, off"));
        assert_eq!(EgressIsolation::Required.to_string().parse::<EgressIsolation>(), Ok(EgressIsolation::Required));
    }

    #[test]
    fn an_isolated_replica_gets_every_proxy_variable() {
        let attachment = Attachment {
            tenant: "acme".into(),
            service: "web".into(),
            proxy: "127.0.0.1:3128".parse().unwrap(),
            namespace: Some("berth-x-acme".into()),
            network: None,
        };
        let env = attachment.env();
        for name in ["HTTP_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "BERTH_EGRESS_PROXY"] {
            assert_eq!(env[name], "http://127.0.0.1:3128", "{name}");
        }
        assert_eq!(env["NO_PROXY"], NO_PROXY);
    }
}
