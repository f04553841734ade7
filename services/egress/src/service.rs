//! The service's life: a replica built over its shared state
//! ([`crate::shared`]), how its loops start, and how they stop.
//!
//! # Expected flow
//! [`EgressService::new`] builds a replica over a
//! [`ServiceContext`](berth_runtime::ServiceContext) (store already migrated
//! with [`MIGRATIONS`](crate::MIGRATIONS)) and its [`Sources`] (channels to
//! revisions and leases). [`EgressService::spawn_loops`]
//! starts the bus follower that wakes `WatchEgress` streams and the campaign
//! for the full pass, which runs on whichever replica leads; they stop when
//! the token passed is cancelled. Every replica serves every RPC.

use std::sync::{Arc, Mutex, PoisonError};

use berth_proto::egress::v1;
use berth_rpc::{MAX_REQUEST_BYTES, Revocations, ServerBuilder};
use berth_runtime::{HeldLoops, ServiceContext, ServiceReplica};
use tokio_util::sync::CancellationToken;

use crate::catalog::Catalog;
use crate::config::EgressConfig;
use crate::queue::PassQueue;
use crate::shared::{Core, node_signals};
use crate::sources::Sources;

/// One replica of the egress service: its gRPC handlers and its loops.
#[derive(Debug, Clone)]
pub struct EgressService {
    pub(crate) core: Arc<Core>,
    revocations: Revocations,
    /// Set when the loops live exactly as long as the handlers (see [`crate::server`]).
    lifetime: HeldLoops,
}

impl EgressService {
    /// A replica over `ctx`'s store (already migrated) and bus, learning
    /// services and placement from `sources`.
    pub fn new(ctx: &ServiceContext, config: EgressConfig, sources: Sources) -> Self {
        let core = Core {
            catalog: Catalog::new(ctx.store.clone()),
            bus: ctx.bus.clone(),
            queue: PassQueue::new(),
            config,
            nodes: node_signals(),
            sources,
            replica_id: berth_runtime::replica_id("egress"),
            closing: CancellationToken::new(),
            started: Mutex::new(false),
        };
        Self { core: Arc::new(core), revocations: ctx.revocations.clone(), lifetime: HeldLoops::default() }
    }

    /// The timings it runs with.
    pub fn config(&self) -> &EgressConfig {
        &self.core.config
    }
}

impl ServiceReplica for EgressService {
    /// This replica's name among the service's replicas, as it campaigns for
    /// the full pass ([`EGRESS_LOOP`](crate::EGRESS_LOOP)).
    fn replica_id(&self) -> &str {
        &self.core.replica_id
    }

    /// Every gRPC service of egress, ready to serve, refusing revoked nodes.
    fn server(&self) -> ServerBuilder {
        berth_runtime::replica_server!(self, self.revocations, MAX_REQUEST_BYTES, [
            v1::egress_server::EgressServer<Self>,
            v1::node_egress_server::NodeEgressServer<Self>,
        ])
    }

    fn held_loops(&mut self) -> &mut HeldLoops {
        &mut self.lifetime
    }

    /// Starts the stream waker and the campaign for the full pass until
    /// `shutdown` (which also ends open watch streams). Only the first call
    /// starts anything.
    fn spawn_loops(&self, shutdown: &CancellationToken) {
        {
            let mut started = self.core.started.lock().unwrap_or_else(PoisonError::into_inner);
            if *started {
                tracing::warn!("the egress loops are already running");
                return;
            }
            *started = true;
        }
        berth_runtime::close_with(shutdown, &self.core.closing);
        self.core.nodes.spawn_follower(self.core.bus.clone(), self.core.closing.clone());
        crate::pass::spawn(Arc::clone(&self.core));
    }
}
