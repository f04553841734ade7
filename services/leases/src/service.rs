//! The service's life: a replica built over its shared state
//! ([`crate::shared`]), how its loops start, and how they stop.
//!
//! # Expected flow
//! [`LeasesService::new`] builds a replica over a [`ServiceContext`] (no I/O:
//! the store is already migrated). [`LeasesService::spawn_loops`] starts the
//! placer, the bus followers that wake assignment and lease watch streams, and the reaper's
//! campaign; they stop when the token passed is cancelled. Without the loops
//! nothing places requests, so every process that serves the ledger runs them.

use std::sync::{Arc, Mutex, PoisonError};

use berth_proto::leases::v1;
use berth_rpc::{MAX_REQUEST_BYTES, Revocations, ServerBuilder};
use berth_runtime::{HeldLoops, ServiceContext, ServiceReplica};
use tokio_util::sync::CancellationToken;

use crate::config::LeasesConfig;
use crate::ledger::Ledger;
use crate::shared::{BatchHandle, Core, PlacerHandle};
use crate::signals::{node_signals, owner_signals};

/// One replica of the ledger: its gRPC handlers and its loops.
#[derive(Debug, Clone)]
pub struct LeasesService {
    pub(crate) core: Arc<Core>,
    revocations: Revocations,
    /// Set when the loops live exactly as long as the handlers (see [`crate::server`]).
    lifetime: HeldLoops,
}

impl LeasesService {
    /// A replica over `ctx`'s store (already migrated), bus and view of
    /// identity's node registry.
    pub fn new(ctx: &ServiceContext, config: LeasesConfig) -> Self {
        let (placer, queue) = PlacerHandle::new(config.placer_queue, "placing the lease");
        let (redeemer, redeems) = BatchHandle::new(config.placer_queue, "spending the launch registration");
        let core = Core {
            ledger: Ledger::new(ctx.store.clone(), &config),
            bus: ctx.bus.clone(),
            nodes: ctx.nodes.clone(),
            credentials: ctx.credentials.clone(),
            signals: node_signals(),
            owners: owner_signals(),
            config,
            replica_id: berth_runtime::replica_id("leases"),
            closing: CancellationToken::new(),
            placer,
            queue: Mutex::new(Some(queue)),
            redeemer,
            redeems: Mutex::new(Some(redeems)),
        };
        Self { core: Arc::new(core), revocations: ctx.revocations.clone(), lifetime: HeldLoops::default() }
    }

    /// The timings it runs with.
    pub fn config(&self) -> &LeasesConfig {
        &self.core.config
    }
}

impl ServiceReplica for LeasesService {
    /// This replica's name among the ledger's replicas, as it campaigns for
    /// the reaper ([`REAPER_LOOP`](crate::REAPER_LOOP)).
    fn replica_id(&self) -> &str {
        &self.core.replica_id
    }

    /// Every gRPC service of leases, ready to serve, refusing revoked nodes.
    fn server(&self) -> ServerBuilder {
        berth_runtime::replica_server!(self, self.revocations, MAX_REQUEST_BYTES, [
            v1::leases_server::LeasesServer<Self>,
            v1::capacity_server::CapacityServer<Self>,
            v1::caches_server::CachesServer<Self>,
            v1::node_leases_server::NodeLeasesServer<Self>,
        ])
    }

    fn held_loops(&mut self) -> &mut HeldLoops {
        &mut self.lifetime
    }

    /// Starts the placer, the change follower and the reaper's campaign,
    /// until `shutdown` (which also ends open assignment streams). Only the
    /// first call starts anything.
    fn spawn_loops(&self, shutdown: &CancellationToken) {
        let queue = self.core.queue.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(queue) = queue else {
            tracing::warn!("the ledger's loops are already running");
            return;
        };
        berth_runtime::close_with(shutdown, &self.core.closing);
        crate::placer::spawn(Arc::clone(&self.core), queue);
        if let Some(redeems) = self.core.redeems.lock().unwrap_or_else(PoisonError::into_inner).take() {
            crate::redeemer::spawn(Arc::clone(&self.core), redeems);
        }
        self.core.signals.spawn_follower(self.core.bus.clone(), self.core.closing.clone());
        self.core.owners.spawn_follower(self.core.bus.clone(), self.core.closing.clone());
        crate::reaper::spawn(Arc::clone(&self.core));
    }
}
