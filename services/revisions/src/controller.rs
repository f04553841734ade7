//! Runs the deploy reconciler on the one replica that leads
//! [`DEPLOY_LOOP`]: a queue of service keys, woken by applies (locally and
//! through the bus), by each reconcile's own requeue, and by a periodic full
//! pass; up to `workers` services at once, never one service twice.
//!
//! # Expected flow
//! Every replica campaigns ([`berth_runtime::spawn_elected`]). While one
//! leads at term `t`, its controller runs with a [`Fence`] at `t`, so each
//! catalog write it makes is refused once a newer term exists; on losing the
//! lead it stops every reconcile in flight and waits to lead again. The first pass of a term queues every service,
//! so whatever happened while no one led is acted on.
//!
//! # Invariants
//! - A reconcile runs at most `reconcile_timeout`; past it, it is stopped
//!   and counted as failed, so one call that never returns cannot hold a
//!   service still (its key stays "running" until the reconcile ends).
//! - A failed reconcile is retried after a wait that doubles from
//!   `rollout_poll` and never exceeds `steady_resync`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use berth_runtime::{Action, ControllerConfig, DecodeTrigger, Election, Leader, Reconciler, Triggers};
use berth_store::{Fence, Term};
use tokio::sync::mpsc;

use crate::config::RevisionsConfig;
use crate::model::ServiceKey;
use crate::reconciler::{Context, ReconcileError, reconcile};
use crate::shared::Core;
use crate::signals::{self, WAKE_TOPIC, Wake};

/// The name the deploy reconciler's (and revision GC's) leadership is held under.
pub const DEPLOY_LOOP: &str = "revisions.deployer";

/// Campaigns for [`DEPLOY_LOOP`] and runs the controller while leading, until `core.closing`.
pub(crate) fn spawn(core: Arc<Core>, wakes: mpsc::Receiver<Wake>) {
    let election = Election::new(core.catalog.store().clone(), DEPLOY_LOOP, &core.replica_id, core.config.election);
    let closing = core.closing.clone();
    berth_runtime::spawn_elected(election, closing, Deployer { core, wakes });
}

/// The deploy controller of one replica, with the wake-ups it is sent.
struct Deployer {
    core: Arc<Core>,
    wakes: mpsc::Receiver<Wake>,
}

impl Leader for Deployer {
    fn lead(&mut self, term: Term) -> impl Future<Output = ()> + Send + '_ {
        run_term(&self.core, term, &mut self.wakes)
    }

    /// Wake-ups are for the leader: while following, drop them.
    async fn follow(&mut self) {
        if self.wakes.recv().await.is_none() {
            std::future::pending::<()>().await;
        }
    }
}

/// Reconciles while `term` is held; returns when a write found a newer term.
async fn run_term(core: &Arc<Core>, term: Term, wakes: &mut mpsc::Receiver<Wake>) {
    let fence = Fence { loop_name: DEPLOY_LOOP, holder: core.replica_id.clone(), term };
    let ctx = Arc::new(Context {
        catalog: core.catalog.clone(),
        leases: core.leases.clone(),
        lease_view: Arc::clone(&core.lease_view),
        resolver: core.resolver.clone(),
        policy: core.policy.clone(),
        config: core.config.clone(),
        fence,
        signals: core.signals.clone(),
        retiring: Arc::default(),
    });
    let bus = match core.signals.bus().subscribe(WAKE_TOPIC).await {
        Ok(subscription) => Some((subscription, Box::new(signals::decode) as DecodeTrigger<ServiceKey>)),
        Err(error) => {
            tracing::warn!(%error, "cannot follow wake-ups on the bus; acting on local applies and full passes");
            None
        }
    };
    berth_runtime::run_controller(ctx, controller_config(&core.config), Triggers { local: wakes, bus }).await;
}

/// The pace of the deploy controller: a failed service is tried again after
/// a wait doubling from `rollout_poll`, never longer than `steady_resync`, so
/// a failing service is looked at at least as often as a settled one.
fn controller_config(config: &RevisionsConfig) -> ControllerConfig {
    ControllerConfig {
        workers: config.workers,
        reconcile_timeout: config.reconcile_timeout,
        full_resync: config.full_resync,
        retry_base: config.rollout_poll,
        retry_max: config.steady_resync,
        coalesce: None,
    }
}

impl Reconciler for Context {
    type Key = ServiceKey;
    type Error = ReconcileError;

    async fn reconcile(self: Arc<Self>, key: ServiceKey) -> Result<Action, ReconcileError> {
        reconcile(&key, &self).await
    }

    async fn keys(&self) -> Result<Vec<ServiceKey>, ReconcileError> {
        Ok(self.catalog.keys().await?)
    }

    fn is_deposed(error: &ReconcileError) -> bool {
        error.is_deposed()
    }

    fn timed_out(limit: Duration) -> ReconcileError {
        ReconcileError::TimedOut(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_service_is_tried_again_at_least_as_often_as_a_settled_one() {
        let config = RevisionsConfig::default();
        let controller = controller_config(&config);
        assert_eq!(controller.backoff(1), config.rollout_poll * 2);
        assert_eq!(controller.backoff(2), config.rollout_poll * 4);
        for failures in [5, 8, 40, u32::MAX] {
            assert_eq!(controller.backoff(failures), config.steady_resync, "after {failures} failures");
        }
    }
}
