//! The identity service: the mesh's root of trust and its register of
//! hosts. It holds the CA, issues join tokens, joins nodes, takes their
//! heartbeats (renewing certificates and fencing stale incarnations), keeps
//! the node registry, and revokes.
//!
//! # Who writes what
//! - `authorities`: only [`Authority`] (creation, rotation, issuance marks).
//! - Everything node- and token-shaped: the node modules, through
//!   [`IdentityService`].

mod authority;
mod batches;
mod bookkeeping;
pub mod cli;
mod config;
mod deadlines;
mod join;
mod keeper;
mod mesh;
mod monitor;
mod nodes_api;
mod nodes_error;
mod offline;
mod registry;
mod session;
mod tokens;
mod upgrades;
mod workloads;

use std::sync::Arc;
use std::time::Duration;

use berth_bundle::{BundleClient, RegistryConfig};
use berth_bus::Bus;
use berth_proto::identity::v1;
use berth_rpc::{MAX_REQUEST_BYTES, ServerBuilder};
use berth_store::{Migration, Store};
use tokio_util::sync::CancellationToken;

pub use authority::{
    AUTH_SECRET_MIN_LEN, Authority, AuthorityApi, AuthorityError, AuthorityTiming, Purpose, Resealed, bundle_digest,
};
pub use config::{DEFAULT_TOKEN_TTL, MAX_TOKEN_TTL, MAX_TOKEN_USES, NodeTiming};
pub use join::RETRY_AFTER_MS_HEADER;
pub use keeper::{KEEPER_POLL, KeptIdentity, spawn_keeper, write_bundle};
pub use mesh::Endpoints;
pub use monitor::MONITOR_LOOP;
pub use offline::{OfflineIssueError, issue_from_state};
pub use upgrades::UPGRADES_LOOP;
pub use workloads::{
    DEFAULT_WORKLOAD_CERT_TTL, GrpcLaunchLedger, LaunchLedger, WORKLOAD_CERT_TTL_RANGE, WorkloadSettings,
    parse_trust_domain, spiffe_id,
};

/// The service's name: its Postgres schema, bus prefix and `svc` SAN.
pub const NAME: &str = "identity";

/// The port it listens on by default.
pub const DEFAULT_PORT: u16 = 7443;

/// Its schema, oldest migration first.
pub static MIGRATIONS: &[Migration] = berth_store::migrations![
    "0001_authority",
    "0002_nodes",
    "0003_ca_acks",
    "0004_certificate_floor",
    "0005_workload_authority",
    "0006_drain_deadline",
    "0007_upgrades",
];

/// How identity is configured beyond its state.
#[derive(Clone)]
pub struct IdentityConfig {
    /// The secret the CA key is sealed under.
    pub auth_secret: String,
    /// CA lifetimes and rotation timing.
    pub authority: AuthorityTiming,
    /// How long node certificates are valid.
    pub node_cert_ttl: Duration,
}

impl std::fmt::Debug for IdentityConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdentityConfig")
            .field("authority", &self.authority)
            .field("node_cert_ttl", &self.node_cert_ttl)
            .finish_non_exhaustive()
    }
}

/// The handlers' shared state.
#[derive(Debug, Clone)]
pub struct IdentityService {
    store: Store,
    bus: Bus,
    authority: Authority,
    /// The workloads' authority: SVIDs, under a root of its own.
    workload_authority: Authority,
    /// How workload certificates are signed, and the leases they are checked with.
    workloads: Arc<WorkloadSettings>,
    config: Arc<IdentityConfig>,
    /// The node registry with its index, timing and replica id.
    nodes: registry::NodeRegistry,
    /// Where the rest of the mesh is (`Mesh/GetEndpoints`).
    endpoints: Arc<Endpoints>,
    /// Fleet upgrades: the registry client agent artifacts are resolved with.
    upgrades: upgrades::Upgrades,
}

impl IdentityService {
    /// Opens identity over its (migrated) store and bus: loads the CA, or
    /// creates it on first start.
    pub async fn open(store: Store, bus: Bus, config: IdentityConfig) -> Result<Self, AuthorityError> {
        let authority = Authority::open(store.clone(), &config.auth_secret, config.authority.clone()).await?;
        Self::with_authority(store, bus, config, authority).await
    }

    /// [`IdentityService::open`], with the auth secret read from `path`
    /// instead of `config.auth_secret`, and read again after a reseal.
    pub async fn open_with_secret_file(
        store: Store,
        bus: Bus,
        config: IdentityConfig,
        path: &std::path::Path,
    ) -> Result<Self, AuthorityError> {
        let authority = Authority::open_with_secret_file(store.clone(), path, config.authority.clone()).await?;
        Self::with_authority(store, bus, config, authority).await
    }

    async fn with_authority(
        store: Store,
        bus: Bus,
        config: IdentityConfig,
        authority: Authority,
    ) -> Result<Self, AuthorityError> {
        let workload_authority = authority.workloads().await?;
        let nodes = registry::NodeRegistry::new(store.clone(), bus.clone(), NodeTiming::default());
        Ok(Self {
            store,
            bus,
            authority,
            workload_authority,
            workloads: Arc::default(),
            config: Arc::new(config),
            nodes,
            endpoints: Arc::default(),
            upgrades: upgrades::Upgrades::new(
                BundleClient::new(RegistryConfig::default())
                    .map_err(|e| AuthorityError::InvalidArgument(format!("the registry client: {e}")))?,
            ),
        })
    }

    /// Signs workload certificates as `settings` say, checking leases with
    /// its ledger; call before serving.
    pub fn with_workload_settings(mut self, settings: WorkloadSettings) -> Self {
        self.workloads = Arc::new(settings);
        self
    }

    /// How workload certificates are signed.
    pub(crate) fn workload_settings(&self) -> &WorkloadSettings {
        &self.workloads
    }

    /// The workloads' authority.
    pub fn workload_authority(&self) -> &Authority {
        &self.workload_authority
    }

    /// Replaces the node timings (heartbeat, grace, reap, election, join
    /// rate limit); call before serving or spawning the loops.
    pub fn with_node_timing(mut self, timing: NodeTiming) -> Self {
        self.nodes = registry::NodeRegistry::new(self.store.clone(), self.bus.clone(), timing);
        self
    }

    /// Resolves agent artifacts for fleet upgrades with `client` (its
    /// insecure registries, CA and mirrors); call before serving.
    pub fn with_agent_registry(mut self, client: BundleClient) -> Self {
        self.upgrades = upgrades::Upgrades::new(client);
        self
    }

    /// Tells clients where the rest of the mesh is (`Mesh/GetEndpoints`).
    pub fn with_endpoints(mut self, endpoints: Endpoints) -> Self {
        self.endpoints = Arc::new(endpoints);
        self
    }

    /// Where the rest of the mesh is.
    pub(crate) fn endpoints(&self) -> &Endpoints {
        &self.endpoints
    }

    /// This replica's name among identity's replicas, as it campaigns for
    /// the node monitor ([`MONITOR_LOOP`]).
    pub fn replica_id(&self) -> &str {
        self.nodes.replica_id()
    }

    /// The CA custodian.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// Every gRPC service of identity, ready to serve.
    pub fn server(&self) -> ServerBuilder {
        berth_runtime::replica_server!(self, self.nodes.revocations(), MAX_REQUEST_BYTES, [
            v1::join_tokens_server::JoinTokensServer<Self>,
            v1::join_server::JoinServer<Self>,
            v1::node_session_server::NodeSessionServer<Self>,
            v1::nodes_server::NodesServer<Self>,
            v1::mesh_server::MeshServer<Self>,
            v1::workloads_server::WorkloadsServer<Self>,
        ])
        .add_service(
            v1::authority_server::AuthorityServer::new(AuthorityApi::new(
                self.authority.clone(),
                self.workload_authority.clone(),
                self.workloads.cert_ttl,
            ))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
        )
    }

    /// Starts the background loops (the registry follower, the heartbeat
    /// bookkeeping writer, the elected monitor) until `shutdown`.
    pub fn spawn_loops(&self, shutdown: &CancellationToken) {
        self.nodes.spawn_follower(shutdown);
        self.nodes.spawn_writers(shutdown);
        monitor::NodeMonitor::new(self.nodes.clone()).spawn(shutdown);
        upgrades::UpgradeController::spawn(self.nodes.clone(), &self.upgrades, shutdown);
    }
}
