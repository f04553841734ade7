//! Starting an agent and holding on to it: join or resume, bind the agent
//! API, spawn the heartbeater, and hand back an [`AgentHandle`].
//!
//! # Expected flow
//! 1. The data directory is locked for this agent.
//! 2. An identity kept there whose certificate is still valid is resumed: no
//!    token needed, same node id, same incarnation. With none (or an expired
//!    one) the host joins with the join token; unreachable identity is
//!    retried with backoff until shutdown.
//! 3. The agent API is bound on the node certificate, and the heartbeater
//!    takes over the session.
//! 4. With a leases service configured, the bundle cache opens in
//!    `DATA_DIR/bundles` (clearing what a crash left half-done) and the lease
//!    runner starts: it recovers what the node ran before, then runs what is
//!    assigned to it (see [`crate::runner`] and [`crate::bundles`]).
//! 5. With an egress service configured, the egress proxies start, every
//!    replica is launched behind its tenant's proxy (and in its namespace,
//!    where the host allows it), and the node follows its egress state (see
//!    [`crate::egress`]).
//!
//! # Compute outlives the agent
//! Stopping the agent (SIGTERM, or a crash) leaves every workload running; a
//! restarted agent adopts what its leases still cover. When the session ends
//! for good (the heartbeater fails), [`AgentHandle::wait`] does not return
//! while the runner still holds compute in custody: it waits until that
//! compute is gone (the max-custody bound, or a revocation, destroys it) or
//! the agent is shut down.
//!
//! # Revocation
//! A revoked node stops heartbeating and [`AgentHandle::wait`] returns
//! [`AgentError::Revoked`], so `berth-agent` exits non-zero: the host's
//! supervisor shows the node as failed, which is what an operator who revoked
//! it expects to see. The revocation is recorded in the data directory, so a
//! restart fails at once with the same message instead of heartbeating with a
//! refused identity, and no join token brings the node back on its own: the
//! operator clears the data directory to join the host anew.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use berth_bundle::{BundleCache, BundleClient, CacheOptions, RegistryConfig};
use berth_mtls::TlsCredentials;
use berth_rpc::Listener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::AgentApi;
use crate::board::InstanceBoard;
use crate::bundles::{BundleStore, GrpcPullCredentials, PullCredentials};
use crate::config::AgentConfig;
use crate::config::{Containment, WorkloadRuntime};
use crate::container::{ContainerProvider, ContainerSettings, OciRuntime};
use crate::data_plane::DataPlane;
use crate::dial::Dialer;
use crate::egress::{EgressFollower, EgressProvider, EgressProxies, EgressSettings, EgressStatus, GrpcNodeEgress};
use crate::error::AgentError;
use crate::heartbeat::{Heartbeater, Watches, trust_union};
use crate::identity_dir::{IdentityDir, NodeIdentity};
use crate::interruption::InterruptionWatch;
use crate::join::{self, JoinError};
use crate::leases_client::{GrpcNodeLeases, NodeLeasesApi};
use crate::node_channel::NodeChannel;
use crate::process::ProcessProvider;
use crate::provider::{ProcessTiming, Provider};
use crate::runner::{RunnerHandle, RunnerParts, RunnerSettings};
use crate::status::{AgentStatus, Fence, NodeSession};
use crate::svids::{GrpcWorkloads, Svids};
use berth_core::backoff::Backoff;

/// Where the bundle cache lives in the data directory.
const BUNDLE_CACHE_DIR: &str = "bundles";

/// The node label naming what runs its workloads: `process`, `runc`,
/// `crun` or `runsc`.
pub const RUNTIME_LABEL: &str = "berth.runtime";

/// The node label saying whether its workloads are contained.
pub const CONTAINED_LABEL: &str = "berth.contained";

/// Whether this process sees a cgroup filesystem to limit workloads with:
/// v2's root, or v1's memory hierarchy (hybrid hosts too).
fn cgroups_visible() -> bool {
    let root = std::path::Path::new("/sys/fs/cgroup");
    root.join("cgroup.controllers").exists() || root.join("memory/memory.limit_in_bytes").exists()
}

/// What will run the node's workloads: the configured runtime where this
/// host can run it; else, when allowed, plain processes; else an error
/// that says what is missing.
fn choose_runtime(
    containment: &Containment,
    microvm: &crate::microvm::MicroVmConfig,
) -> Result<WorkloadRuntime, AgentError> {
    let euid = rustix::process::geteuid();
    let uids_usable =
        || containment.uids.check(euid.as_raw()).map_err(|e| AgentError::Config(format!("workload uids: {e}")));
    let why = match containment.runtime {
        WorkloadRuntime::MicroVm => match crate::microvm::missing(microvm) {
            None => {
                // A VM's QEMU and its own shared directories are given to users of the range.
                uids_usable()?;
                return Ok(WorkloadRuntime::MicroVm);
            }
            Some(why) => why,
        },
        runtime => match runtime.container_runtime() {
            None => "plain host processes contain nothing".to_string(),
            Some(oci) => {
                if !euid.is_root() {
                    let by = if oci == OciRuntime::Own { "the process runtime".to_string() } else { oci.to_string() };
                    format!("containing workloads with {by} needs root, and the agent runs as uid {}", euid.as_raw())
                } else if oci.binary().is_none() {
                    format!("{oci} is not installed (looked in /usr/local/sbin, /usr/local/bin, /usr/sbin, /usr/bin)")
                } else if !cgroups_visible() {
                    "no cgroup filesystem at /sys/fs/cgroup to hold workloads to their leases (an agent started \
                     by `ip netns exec` has a /sys of its own: use `nsenter --net=` instead)"
                        .to_string()
                } else {
                    uids_usable()?;
                    return Ok(containment.runtime);
                }
            }
        },
    };
    if containment.allow_uncontained {
        tracing::warn!(reason = %why, "running workloads uncontained, as allowed");
        Ok(WorkloadRuntime::Uncontained)
    } else {
        Err(AgentError::Uncontained(why))
    }
}

/// A running agent.
///
/// Dropping the handle leaves the agent running until the shutdown token
/// given to [`start`] is cancelled; [`wait`](Self::wait) waits for that.
#[derive(Debug)]
pub struct AgentHandle {
    credentials: TlsCredentials,
    local_addr: SocketAddr,
    status: watch::Receiver<AgentStatus>,
    session: watch::Receiver<NodeSession>,
    fences: watch::Receiver<Option<Fence>>,
    stop: CancellationToken,
    server: JoinHandle<Result<(), berth_rpc::RpcError>>,
    heartbeater: JoinHandle<Result<(), AgentError>>,
    runner: Option<RunnerHandle>,
    egress: Option<EgressProxies>,
    follower: Option<JoinHandle<()>>,
    provider: Option<Arc<dyn Provider>>,
}

impl AgentHandle {
    /// The node id the agent runs as now; it changes only when a rejoin
    /// hands out a new one.
    pub fn node_id(&self) -> String {
        self.session.borrow().node_id.clone()
    }

    /// The session the agent holds now, and every change to it.
    pub fn session(&self) -> watch::Receiver<NodeSession> {
        self.session.clone()
    }

    /// The node credentials: the agent reloads them on renewal, rejoin and
    /// CA rotation; clients built on them follow.
    pub fn credentials(&self) -> TlsCredentials {
        self.credentials.clone()
    }

    /// Where the agent API listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where the agent stands with the control plane.
    pub fn status(&self) -> watch::Receiver<AgentStatus> {
        self.status.clone()
    }

    /// The last session that ended, `None` until one does. Whatever runs on
    /// the node stops on every change: a watcher that awaits `changed()`
    /// never misses that a fence happened, though two quick fences may reach
    /// it as one.
    pub fn fences(&self) -> watch::Receiver<Option<Fence>> {
        self.fences.clone()
    }

    /// How many leases' compute the node holds now (running, starting, or
    /// being destroyed), and every change; always 0 without a leases service.
    pub fn holding(&self) -> watch::Receiver<usize> {
        match &self.runner {
            Some(runner) => runner.holding.clone(),
            None => watch::channel(0).1,
        }
    }

    /// Where the node stands with egress (how it enforces it, the last state
    /// applied); `None` without an egress service.
    pub fn egress(&self) -> Option<watch::Receiver<EgressStatus>> {
        self.egress.as_ref().map(EgressProxies::status)
    }

    /// Whether the node's workloads are contained.
    pub fn contained(&self) -> bool {
        self.provider.as_ref().is_some_and(|provider| provider.runtime().contained)
    }

    /// [`wait`](Self::wait), then destroys every workload the node still
    /// runs: for an agent no other will take over from (`berth dev`), whose
    /// workloads would otherwise run on, orphaned, after it stopped.
    pub async fn wait_then_stop_workloads(mut self) -> Result<(), AgentError> {
        let provider = self.provider.take();
        let result = self.wait().await;
        if let Some(provider) = provider {
            let held = provider.recover().await.unwrap_or_default();
            for launched in held.iter().filter(|l| l.exit.borrow().is_none()) {
                let lease_id = &launched.record.lease_id;
                tracing::info!(%lease_id, "stopping the workload with the agent");
                if let Err(error) = provider.destroy(lease_id).await {
                    tracing::warn!(%lease_id, %error, "cannot stop the workload");
                }
            }
        }
        result
    }

    /// Waits until the agent stops: `Ok` after shutdown, or the error that
    /// stopped it (a revocation, a refused rejoin, a failed listener). When
    /// one part fails the other is stopped too; when the session fails for
    /// good while the node holds compute, this waits for that compute to be
    /// gone (or for shutdown) first.
    pub async fn wait(self) -> Result<(), AgentError> {
        let AgentHandle { stop, mut server, mut heartbeater, runner, egress, follower, .. } = self;
        let server_result = |joined: Result<Result<(), berth_rpc::RpcError>, tokio::task::JoinError>| {
            joined.map_err(|e| AgentError::Task(e.to_string())).and_then(|r| r.map_err(AgentError::Serve))
        };
        let heartbeat_result = |joined: Result<Result<(), AgentError>, tokio::task::JoinError>| {
            joined.map_err(|e| AgentError::Task(e.to_string())).and_then(|r| r)
        };
        let (first, second) = tokio::select! {
            joined = &mut heartbeater => {
                let first = heartbeat_result(joined);
                if let (Err(error), Some(runner)) = (&first, &runner) {
                    hold_compute(error, runner.holding.clone(), &stop).await;
                }
                stop.cancel();
                (first, server_result(server.await))
            }
            joined = &mut server => {
                let first = server_result(joined);
                stop.cancel();
                (first, heartbeat_result(heartbeater.await))
            }
        };
        if let Some(runner) = runner
            && let Err(error) = runner.task.await
        {
            tracing::error!(%error, "the lease runner failed");
        }
        if let Some(follower) = follower
            && let Err(error) = follower.await
        {
            tracing::error!(%error, "the egress follower failed");
        }
        if let Some(egress) = egress {
            egress.close().await;
        }
        first.and(second)
    }
}

/// Waits, after the session failed for good, until the node holds no
/// compute or the agent is shut down.
async fn hold_compute(error: &AgentError, mut holding: watch::Receiver<usize>, stop: &CancellationToken) {
    let held = *holding.borrow();
    if held == 0 {
        return;
    }
    tracing::error!(%error, held,
        "the node's session is over, and the agent keeps running while it holds compute; \
         it exits once that compute is gone or on shutdown");
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = holding.wait_for(|held| *held == 0) => {}
    }
}

/// Joins (or resumes), binds the agent API on `config.listen`, and spawns
/// the heartbeater; everything stops when `shutdown` is cancelled.
pub async fn start(mut config: AgentConfig, shutdown: CancellationToken) -> Result<AgentHandle, AgentError> {
    config.validate().map_err(AgentError::Config)?;
    // Workloads run in directories of their own, so every path the agent
    // hands them (a bundle's entrypoint, its root) must not depend on the
    // agent's working directory.
    if config.data_dir.is_relative()
        && let Ok(cwd) = std::env::current_dir()
    {
        config.data_dir = cwd.join(&config.data_dir);
    }
    let runtime = choose_runtime(&config.containment, &config.microvm)?;
    let contained = runtime.contained();
    let node_ports = config.containment.node_ports;
    if let Some(ephemeral) = node_ports.ephemeral_overlap() {
        tracing::warn!(
            %node_ports, %ephemeral,
            "the node's port range overlaps the host's ephemeral range: an outgoing connection may take a port \
             a workload was given before the workload binds it (--node-ports)"
        );
    }
    if contained && config.containment.favor_cgroup_migrations {
        match crate::container::favor_cgroup_migrations() {
            Ok(mount) => tracing::info!(mount = %mount.display(), "cgroup migrations favoured (favordynmods)"),
            Err(error) => tracing::warn!(%error, "launches will wait on cgroup migrations"),
        }
    }
    if !contained {
        tracing::warn!(
            "workloads on this node are NOT contained: they run as the agent's user, see its files, \
            and have no memory, CPU or process limit"
        );
    }
    // Set by the agent, whatever the operator's labels say.
    let runtime_name = runtime.label().to_string();
    if runtime == WorkloadRuntime::MicroVm
        && config.workload_identity
        && crate::microvm::share_daemon(&config.microvm).is_none()
    {
        // A guest gets its identity as files in a shared directory; a node
        // that shares none would refuse every launch with an identity.
        tracing::warn!(
            "microVMs on this node get no workload identity (no virtiofsd to share it with them): \
             leases on this node run without an SVID"
        );
        config.workload_identity = false;
    }
    config.labels.insert(RUNTIME_LABEL.into(), runtime_name);
    config.labels.insert(CONTAINED_LABEL.into(), contained.to_string());
    // What each workload holds beyond its lease, charged against the node by leases.
    let (overhead, floor) = runtime.memory_overhead();
    for (label, bytes) in [(berth_core::MEMORY_OVERHEAD_LABEL, overhead), (berth_core::MEMORY_FLOOR_LABEL, floor)] {
        if bytes > 0 {
            config.labels.insert(label.into(), bytes.to_string());
        } else {
            config.labels.remove(label);
        }
    }
    let config = Arc::new(config);
    let dir = IdentityDir::open(&config.data_dir)?;
    let data_dir = || dir.root().display().to_string();
    if let Some(revocation) = dir.revocation()? {
        return Err(AgentError::Revoked { node_id: revocation.node_id, data_dir: data_dir() });
    }

    let identity = match dir.load()? {
        Some(identity) if !identity.expired_at(SystemTime::now()) => {
            tracing::info!(node_id = %identity.node_id, incarnation = identity.incarnation,
                "resuming the node identity kept in the data directory");
            if names_advertise_host(&identity, &config.advertise_addr) {
                identity
            } else {
                // The host kept its data directory but not its address (a
                // replaced pod, a re-addressed host): the same node rejoins
                // with its certificate, so the control plane dials it where
                // it is now and its certificate names that address.
                let rejoined = rejoin_at_new_address(&config, &identity, &shutdown).await?;
                dir.save(&rejoined)?;
                rejoined
            }
        }
        kept => {
            let Some(token) = config.token() else {
                return Err(match kept {
                    Some(expired) => AgentError::CertificateExpired { node_id: expired.node_id, data_dir: data_dir() },
                    None => AgentError::NoIdentity { data_dir: data_dir() },
                });
            };
            let bundle = match &kept {
                Some(expired) => {
                    tracing::warn!(node_id = %expired.node_id, "the kept node certificate expired; joining again with the join token");
                    trust_union(&expired.ca_bundle_pem, &config.ca_bundle_pem)
                }
                None => config.ca_bundle_pem.clone(),
            };
            if bundle.trim().is_empty() {
                return Err(AgentError::Config(
                    "ca_bundle_pem: the CA bundle to verify identity with is needed to join (--ca-file)".into(),
                ));
            }
            let identity = join_first(&config, &token, &bundle, &shutdown).await?;
            dir.save(&identity)?;
            identity
        }
    };

    // The operator's --ca-file is trusted beside the kept bundle until the
    // first heartbeat brings identity's: a node that was away while a CA was
    // rotated and force-activated, whose kept bundle no longer verifies
    // identity, is brought back by restarting it with the current bundle.
    let mut material = identity.material();
    material.ca_bundle_pem = trust_union(&identity.ca_bundle_pem, &config.ca_bundle_pem);
    let credentials = TlsCredentials::new(material).map_err(AgentError::Tls)?;
    let listener = Listener::bind(config.listen, credentials.clone())
        .await
        .map_err(|source| AgentError::Bind { addr: config.listen, source })?;
    let local_addr = listener.local_addr().map_err(|source| AgentError::Bind { addr: config.listen, source })?;

    let session = NodeSession { node_id: identity.node_id.clone(), incarnation: identity.incarnation };
    let (status_tx, status) = watch::channel(AgentStatus::Joined { session: session.clone() });
    let (session_tx, session_rx) = watch::channel(session);
    let (fences_tx, fences) = watch::channel(None);
    let watches = Watches { status: status_tx, session: session_tx, fences: fences_tx };

    let stop = shutdown.child_token();
    let egress = match &config.egress {
        Some(addr) => {
            let settings = EgressSettings {
                data_dir: dir.root().to_path_buf(),
                isolation: config.egress_isolation,
                timing: config.proxy_timing,
                router: config.router.clone(),
            };
            let proxies = EgressProxies::start(settings, stop.clone()).await.map_err(AgentError::Egress)?;
            let api = GrpcNodeEgress::new(addr, credentials.clone(), config.timing.rpc_timeout)
                .map_err(AgentError::Client)?;
            Some((proxies, Arc::new(api)))
        }
        None => None,
    };
    let board = InstanceBoard::default();
    let runner = match &config.leases {
        Some(addr) => {
            let timing = &config.lease_timing;
            let process_timing = ProcessTiming { stop_grace: timing.stop_grace, exit_poll: timing.exit_poll };
            let mut provider: Arc<dyn Provider> = match runtime.container_runtime() {
                None if runtime == WorkloadRuntime::MicroVm => Arc::new(crate::microvm::MicroVmProvider::new(
                    dir.root(),
                    crate::microvm::MicroVmSettings {
                        pids_limit: config.containment.pids_limit,
                        uids: config.containment.uids,
                        node_ports,
                        ..crate::microvm::MicroVmSettings::from_config(&config.microvm, process_timing)
                            .map_err(AgentError::Uncontained)?
                    },
                    stop.clone(),
                )),
                None => Arc::new(ProcessProvider::with_ports(dir.root(), process_timing, node_ports, stop.clone())),
                Some(oci) => {
                    let settings = ContainerSettings {
                        runtime: oci,
                        binary: match (oci, &config.process_runtime_exe) {
                            (OciRuntime::Own, Some(exe)) => exe.clone(),
                            _ => oci
                                .binary()
                                .ok_or_else(|| AgentError::Uncontained(format!("{oci} is not installed")))?,
                        },
                        uids: config.containment.uids,
                        pids_limit: config.containment.pids_limit,
                        timing: process_timing,
                        node_ports,
                    };
                    Arc::new(ContainerProvider::new(dir.root(), settings, stop.clone()))
                }
            };
            tracing::info!(runtime = %runtime, contained, "workloads run through this runtime");
            if let Some((proxies, _)) = &egress {
                provider = Arc::new(EgressProvider::new(provider, proxies.clone()));
            }
            let leases = GrpcNodeLeases::new(addr, credentials.clone(), config.timing.rpc_timeout)
                .map_err(AgentError::Client)?;
            let settings = RunnerSettings {
                timing: *timing,
                retry_initial: config.timing.retry_initial,
                retry_max: config.timing.retry_max,
                max_custody: config.max_custody,
                custody_warning: config.custody_warning,
                stop_after_disconnect: config.stop_after_disconnect,
            };
            let bundles = open_bundles(&config, dir.root(), &credentials).await?;
            crate::log_rotation::spawn(dir.root(), config.log_max_bytes, stop.clone());
            let leases: Arc<dyn NodeLeasesApi> = Arc::new(leases);
            let svids = if config.workload_identity {
                let replicas = crate::identity_servers::parse(&config.server).map_err(AgentError::Config)?;
                let replica = &replicas[crate::identity_servers::preferred_index(&identity.node_id, replicas.len())];
                let api = GrpcWorkloads::new(addr, replica, credentials.clone(), config.timing.rpc_timeout)
                    .map_err(AgentError::Client)?;
                let retry = (config.timing.retry_initial, config.timing.retry_max);
                Some(Svids::new(dir.root(), Arc::new(api), retry, stop.clone()))
            } else {
                None
            };
            #[cfg(feature = "fault-injection")]
            let (leases, provider) =
                crate::faults::Faults::from_env().map_err(AgentError::Config)?.wrap(leases, provider);
            let caches = crate::caches::CacheVolumes::new(dir.root());
            Some((provider, leases, bundles, svids, settings, caches))
        }
        None => {
            if let Some((proxies, _)) = &egress {
                // No runner, so no replicas to find again.
                proxies.recovered().await;
            }
            None
        }
    };
    let workloads = runner.as_ref().map(|(provider, ..)| provider.clone());
    let dialer = Dialer { egress: egress.as_ref().map(|(proxies, _)| proxies.clone()) };
    let data_plane = DataPlane { board: board.clone(), dialer: dialer.clone(), shutdown: stop.clone() };
    let api = AgentApi {
        board: board.clone(),
        provider: workloads.clone(),
        log_poll: config.lease_timing.log_poll,
        shutdown: stop.clone(),
    };
    let runner = runner.map(|(provider, leases, bundles, svids, settings, caches)| {
        crate::runner::spawn(RunnerParts {
            leases,
            provider,
            bundles,
            board,
            dialer,
            svids,
            caches: Some(caches),
            session: session_rx.clone(),
            fences: fences.clone(),
            settings,
            shutdown: stop.clone(),
        })
    });
    let follower = egress.as_ref().map(|(proxies, api)| {
        let follower = EgressFollower {
            api: api.clone(),
            proxies: proxies.clone(),
            session: session_rx.clone(),
            backoff: Backoff::new(config.timing.retry_initial, config.timing.retry_max),
            shutdown: stop.clone(),
        };
        tokio::spawn(follower.run())
    });
    let egress = egress.map(|(proxies, _)| proxies);
    let replicas = crate::identity_servers::parse(&config.server).map_err(AgentError::Config)?;
    let replica = &replicas[crate::identity_servers::preferred_index(&identity.node_id, replicas.len())];
    let interruptions = InterruptionWatch {
        file: config.interruption_file.clone().unwrap_or_else(|| dir.root().join(crate::interruption::DEFAULT_FILE)),
        default_deadline: config.interruption_deadline,
        identity: NodeChannel::new("identity", replica, credentials.clone(), config.timing.rpc_timeout)
            .map_err(AgentError::Client)?,
        session: session_rx.clone(),
        backoff: Backoff::new(config.timing.retry_initial, config.timing.retry_max),
        shutdown: stop.clone(),
    };
    tokio::spawn(interruptions.run());
    let upgrades = crate::upgrades::Upgrades::new(dir.root(), registry_client(&config)?, config.upgrades.clone());
    let heartbeater = Heartbeater::new(config, dir, identity, credentials.clone(), watches, upgrades, stop.clone())?;
    let server = tokio::spawn(crate::api::serve(listener, credentials.clone(), api, data_plane, stop.clone()));
    let heartbeater = tokio::spawn(heartbeater.run());
    Ok(AgentHandle {
        credentials,
        local_addr,
        status,
        session: session_rx,
        fences,
        stop,
        server,
        heartbeater,
        provider: workloads,
        runner,
        egress,
        follower,
    })
}

/// A registry client as the agent's configuration says.
fn registry_client(config: &AgentConfig) -> Result<BundleClient, AgentError> {
    let registries = RegistryConfig {
        insecure_registries: config.insecure_registries.clone(),
        ca_pem: config.registry_ca_pem.clone(),
        mirrors: config.registry_mirrors.clone(),
        ..RegistryConfig::default()
    };
    BundleClient::new(registries).map_err(|e| AgentError::Config(format!("registry_ca_pem: {e}")))
}

/// The node's bundles: the cache in `DATA_DIR/bundles`, pulling through the
/// configured registries, with registry credentials from revisions when its
/// address is configured.
async fn open_bundles(
    config: &AgentConfig,
    data_dir: &std::path::Path,
    credentials: &TlsCredentials,
) -> Result<BundleStore, AgentError> {
    let client = registry_client(config)?;
    let options = CacheOptions { budget_bytes: config.bundle_cache_budget, ..CacheOptions::default() };
    let cache = BundleCache::open(data_dir.join(BUNDLE_CACHE_DIR), options).await.map_err(AgentError::BundleCache)?;
    let pull_credentials = match &config.revisions {
        Some(addr) => Some(Arc::new(
            GrpcPullCredentials::new(addr, credentials.clone(), config.timing.rpc_timeout)
                .map_err(AgentError::Client)?,
        ) as Arc<dyn PullCredentials>),
        None => None,
    };
    Ok(BundleStore::with_credentials(cache, client, pull_credentials))
}

/// Whether the kept certificate names the host of `advertise_addr`.
fn names_advertise_host(identity: &NodeIdentity, advertise_addr: &str) -> bool {
    let host = advertise_addr.rsplit_once(':').map_or(advertise_addr, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let Ok(certs) = berth_mtls::certs_from_pem("certificate", &identity.cert_pem) else { return false };
    certs
        .first()
        .and_then(|leaf| berth_mtls::cert_host_names(leaf).ok())
        .is_some_and(|names| names.iter().any(|name| name.eq_ignore_ascii_case(host)))
}

/// Rejoins as the kept node, with its certificate, from its new address.
async fn rejoin_at_new_address(
    config: &AgentConfig,
    identity: &NodeIdentity,
    shutdown: &CancellationToken,
) -> Result<NodeIdentity, AgentError> {
    tracing::info!(node_id = %identity.node_id, advertise_addr = %config.advertise_addr,
        "the kept certificate does not name this advertise address; rejoining as the same node");
    let credentials = TlsCredentials::new(identity.material()).map_err(AgentError::Tls)?;
    let rejoined = retried(config, "rejoin", shutdown, || join::rejoin_with_certificate(config, &credentials)).await?;
    tracing::info!(node_id = %rejoined.node_id, incarnation = rejoined.incarnation, "rejoined at the new address");
    Ok(rejoined)
}

/// `attempt` until it joins, fails for good or `shutdown` fires, backing
/// off as the agent's timing says between transient failures.
async fn retried<F, Fut>(
    config: &AgentConfig,
    what: &str,
    shutdown: &CancellationToken,
    attempt: F,
) -> Result<NodeIdentity, AgentError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<NodeIdentity, JoinError>>,
{
    let mut backoff = Backoff::new(config.timing.retry_initial, config.timing.retry_max);
    join::retrying(what, &mut backoff, shutdown, attempt).await.map_err(|error| match error {
        JoinError::Cancelled => AgentError::Cancelled,
        error => AgentError::Join(error),
    })
}

async fn join_first(
    config: &AgentConfig,
    token: &str,
    ca_bundle_pem: &str,
    shutdown: &CancellationToken,
) -> Result<NodeIdentity, AgentError> {
    let joined = retried(config, "join", shutdown, || join::join_with_token(config, token, ca_bundle_pem)).await?;
    tracing::info!(node_id = %joined.node_id, incarnation = joined.incarnation, "joined");
    Ok(joined)
}
