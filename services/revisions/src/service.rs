//! The service's life: a replica built over its shared state
//! ([`crate::shared`]), how its controller starts, and how it stops.
//!
//! # Expected flow
//! [`RevisionsService::new`] builds a replica over a
//! [`ServiceContext`](berth_runtime::ServiceContext) (store already migrated)
//! and its [`Dependencies`]: the leases client, the tag resolver, the
//! registry policy and the registry credentials. [`RevisionsService::spawn_loops`] starts the campaign
//! for the deploy reconciler, which runs on whichever replica leads; it
//! stops when the token passed is cancelled. Every replica serves RPCs.

use std::sync::{Arc, Mutex, PoisonError};

use berth_proto::revisions::v1;
use berth_rpc::{MAX_REQUEST_BYTES, Revocations, ServerBuilder};
use berth_runtime::{HeldLoops, ServiceContext, ServiceReplica};
use tokio_util::sync::CancellationToken;

use crate::catalog::Catalog;
use crate::config::RevisionsConfig;
use crate::leases::{LeaseClient, NoLeases};
use crate::resolver::{RegistryPolicy, RegistryResolver, TagResolver};
use crate::secrets::RegistrySecrets;
use crate::shared::Core;
use crate::signals::Signals;

/// What the revisions service talks to beyond its own state.
#[derive(Debug, Clone)]
pub struct Dependencies {
    /// The leases service, which the reconciler asks for replicas.
    pub leases: Arc<dyn LeaseClient>,
    /// Turns bundle tags into digests when revisions are minted.
    pub resolver: Arc<dyn TagResolver>,
    /// Which registries may be spoken to over plain HTTP.
    pub policy: RegistryPolicy,
    /// The registry credentials templates name, handed to nodes for their
    /// leases' pulls.
    pub secrets: RegistrySecrets,
}

impl Dependencies {
    /// `leases` with the default resolver (straight to the registry) under
    /// `policy`, holding no registry credentials.
    pub fn with_registry(
        leases: Arc<dyn LeaseClient>,
        policy: RegistryPolicy,
        config: &RevisionsConfig,
    ) -> Result<Self, berth_bundle::RegistryError> {
        Self::with_secrets(leases, policy, RegistrySecrets::none(), config)
    }

    /// `leases` with the default resolver under `policy`, which resolves
    /// with `secrets` as nodes pull with them.
    pub fn with_secrets(
        leases: Arc<dyn LeaseClient>,
        policy: RegistryPolicy,
        secrets: RegistrySecrets,
        config: &RevisionsConfig,
    ) -> Result<Self, berth_bundle::RegistryError> {
        let resolver = RegistryResolver::new(&policy, config.resolve_timeout)?.with_secrets(secrets.clone());
        Ok(Self { leases, resolver: Arc::new(resolver), policy, secrets })
    }

    /// No leases service and the default resolver: services are accepted
    /// and revisions minted, and every status says no leases address is set.
    pub fn without_leases(config: &RevisionsConfig) -> Result<Self, berth_bundle::RegistryError> {
        Self::with_registry(Arc::new(NoLeases), RegistryPolicy::default(), config)
    }
}

/// One replica of the revisions service: its gRPC handlers and its controller.
#[derive(Debug, Clone)]
pub struct RevisionsService {
    pub(crate) core: Arc<Core>,
    revocations: Revocations,
    /// Set when the controller lives exactly as long as the handlers (see [`crate::server`]).
    lifetime: HeldLoops,
}

impl RevisionsService {
    /// A replica over `ctx`'s store (already migrated) and bus.
    pub fn new(ctx: &ServiceContext, config: RevisionsConfig, dependencies: Dependencies) -> Self {
        let (signals, wakes) = Signals::new(ctx.bus.clone());
        let core = Core {
            catalog: Catalog::new(ctx.store.clone()),
            signals,
            leases: dependencies.leases,
            lease_view: Arc::default(),
            resolver: dependencies.resolver,
            policy: dependencies.policy,
            secrets: dependencies.secrets,
            config,
            replica_id: berth_runtime::replica_id("revisions"),
            closing: CancellationToken::new(),
            wakes: Mutex::new(Some(wakes)),
        };
        Self { core: Arc::new(core), revocations: ctx.revocations.clone(), lifetime: HeldLoops::default() }
    }

    /// The timings it runs with.
    pub fn config(&self) -> &RevisionsConfig {
        &self.core.config
    }
}

impl ServiceReplica for RevisionsService {
    /// This replica's name among the service's replicas, as it campaigns for
    /// the deploy reconciler ([`DEPLOY_LOOP`](crate::DEPLOY_LOOP)).
    fn replica_id(&self) -> &str {
        &self.core.replica_id
    }

    /// Every gRPC service of revisions, ready to serve, refusing revoked nodes.
    fn server(&self) -> ServerBuilder {
        berth_runtime::replica_server!(self, self.revocations, MAX_REQUEST_BYTES, [
            v1::services_server::ServicesServer<Self>,
            v1::revisions_server::RevisionsServer<Self>,
        ])
    }

    fn held_loops(&mut self) -> &mut HeldLoops {
        &mut self.lifetime
    }

    /// Starts the campaign for the deploy reconciler until `shutdown` (which
    /// also ends open watch streams). Only the first call starts anything.
    fn spawn_loops(&self, shutdown: &CancellationToken) {
        let wakes = self.core.wakes.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(wakes) = wakes else {
            tracing::warn!("the revisions controller is already running");
            return;
        };
        berth_runtime::close_with(shutdown, &self.core.closing);
        crate::controller::spawn(Arc::clone(&self.core), wakes);
        crate::lease_watch::spawn(Arc::clone(&self.core));
    }
}
