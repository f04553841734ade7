//! Runs the deploy reconciler on the one replica that leads
//! [`DEPLOY_LOOP`]: a queue of service keys, woken by applies (locally and
//! through the bus), by each reconcile's own requeue, and by a periodic full
//! pass; up to `workers` services at once, never one service twice.
//!
//! # Expected flow
//! Every replica campaigns. While one leads at term `t`, its controller runs
//! with a [`Fence`] at `t`, so each catalog write it makes is refused once a
//! newer term exists; on losing the lead it stops every reconcile in flight
//! and waits to lead again. The first pass of a term queues every service,
//! so whatever happened while no one led is acted on.
//!
//! # Invariants
//! - A reconcile runs at most `reconcile_timeout`; past it, it is stopped
//!   and counted as failed, so one call that never returns cannot hold a
//!   service still (its key stays "running" until the reconcile ends).
//! - A failed reconcile is retried after a wait that doubles from
//!   `rollout_poll` and never exceeds `steady_resync`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use berth_bus::BusMessage;
use berth_store::{LeaderElector, Term};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::catalog::Fence;
use crate::model::ServiceKey;
use crate::reconciler::{Action, Context, ReconcileError, reconcile};
use crate::shared::Core;
use crate::signals::{WAKE_TOPIC, Wake};

/// The name the deploy reconciler's (and revision GC's) leadership is held under.
pub const DEPLOY_LOOP: &str = "revisions.deployer";

/// Campaigns for [`DEPLOY_LOOP`] and runs the controller while leading, until `core.closing`.
pub(crate) fn spawn(core: Arc<Core>, mut wakes: mpsc::Receiver<Wake>) {
    berth_runtime::spawn_loop(async move {
        let elector = LeaderElector::new(core.catalog.store().clone(), DEPLOY_LOOP, core.replica_id.clone())
            .with_timing(core.config.election)
            .spawn(&core.closing);
        let mut leadership = elector.subscribe();
        loop {
            let term = *leadership.borrow_and_update();
            match term {
                Some(term) => {
                    tracing::info!(term = %term, "leading the deploy reconciler");
                    run_term(&core, term, &mut leadership, &mut wakes).await;
                    tracing::info!(term = %term, "no longer leading the deploy reconciler");
                }
                None => {
                    tokio::select! {
                        () = core.closing.cancelled() => break,
                        changed = leadership.changed() => if changed.is_err() { break },
                        // Wake-ups are for the leader: while following, drop them.
                        _ = wakes.recv() => {}
                    }
                }
            }
            if core.closing.is_cancelled() {
                break;
            }
        }
        elector.shutdown().await;
    });
}

/// The queue of one term: when each key is due, which are running, how
/// many times in a row each failed, and the trace each was last woken in.
#[derive(Debug, Default)]
struct Queue {
    due: HashMap<ServiceKey, Instant>,
    running: HashSet<ServiceKey>,
    failures: HashMap<ServiceKey, u32>,
    traces: HashMap<ServiceKey, String>,
}

impl Queue {
    /// Makes the woken key due now; its reconciles join the waking call's
    /// trace until the service settles (or a later call's trace replaces it).
    fn wake(&mut self, wake: Wake) {
        if !wake.traceparent.is_empty() {
            self.traces.insert(wake.key.clone(), wake.traceparent);
        }
        self.schedule(wake.key, Instant::now());
    }

    /// Makes `key` due at `at`, or sooner if it already was.
    fn schedule(&mut self, key: ServiceKey, at: Instant) {
        let due = self.due.entry(key).or_insert(at);
        if at < *due {
            *due = at;
        }
    }

    fn next_due(&self) -> Option<Instant> {
        self.due.iter().filter(|(key, _)| !self.running.contains(*key)).map(|(_, at)| *at).min()
    }

    /// Keys due now and not running, soonest first, at most `room`.
    fn take_ready(&mut self, room: usize) -> Vec<ServiceKey> {
        let now = Instant::now();
        let mut ready: Vec<(Instant, ServiceKey)> = self
            .due
            .iter()
            .filter(|(key, at)| **at <= now && !self.running.contains(*key))
            .map(|(key, at)| (*at, key.clone()))
            .collect();
        ready.sort();
        ready.truncate(room);
        for (_, key) in &ready {
            self.due.remove(key);
            self.running.insert(key.clone());
        }
        ready.into_iter().map(|(_, key)| key).collect()
    }
}

async fn run_term(
    core: &Arc<Core>,
    term: Term,
    leadership: &mut watch::Receiver<Option<Term>>,
    wakes: &mut mpsc::Receiver<Wake>,
) {
    let fence = Fence { loop_name: DEPLOY_LOOP, holder: core.replica_id.clone(), term };
    let ctx = Arc::new(Context {
        catalog: core.catalog.clone(),
        leases: core.leases.clone(),
        resolver: core.resolver.clone(),
        policy: core.policy.clone(),
        config: core.config.clone(),
        fence,
        signals: core.signals.clone(),
    });
    let mut subscription = match core.signals.bus().subscribe(WAKE_TOPIC).await {
        Ok(subscription) => Some(subscription),
        Err(error) => {
            tracing::warn!(%error, "cannot follow wake-ups on the bus; acting on local applies and full passes");
            None
        }
    };
    let mut queue = Queue::default();
    let mut reconciles: JoinSet<(ServiceKey, Result<Action, ReconcileError>)> = JoinSet::new();
    let mut full_pass = tokio::time::interval(core.config.full_resync);
    let workers = core.config.workers.max(1);
    loop {
        for key in queue.take_ready(workers.saturating_sub(queue.running.len())) {
            let ctx = Arc::clone(&ctx);
            let span = tracing::info_span!("reconcile", service = %key);
            if let Some(traceparent) = queue.traces.get(&key) {
                berth_telemetry::adopt_traceparent(&span, traceparent);
            }
            reconciles.spawn(async move {
                let limit = ctx.config.reconcile_timeout;
                let reconciled = tracing::Instrument::instrument(reconcile(&key, &ctx), span);
                let result =
                    tokio::time::timeout(limit, reconciled).await.unwrap_or(Err(ReconcileError::TimedOut(limit)));
                (key, result)
            });
        }
        let next_due = queue.next_due();
        tokio::select! {
            () = core.closing.cancelled() => break,
            changed = leadership.changed() => {
                if changed.is_err() || *leadership.borrow() != Some(term) {
                    break;
                }
            }
            _ = full_pass.tick() => match core.catalog.keys().await {
                Ok(keys) => {
                    let now = Instant::now();
                    for key in keys {
                        queue.schedule(key, now);
                    }
                }
                Err(error) => tracing::warn!(%error, "listing services for a full pass failed"),
            },
            Some(wake) = wakes.recv() => queue.wake(wake),
            message = next_message(&mut subscription) => match message {
                Some(BusMessage::Payload(payload)) => {
                    if let Some(wake) = Wake::decode(&payload) {
                        queue.wake(wake);
                    }
                }
                Some(BusMessage::Gap) => full_pass.reset_immediately(),
                None => subscription = None,
            },
            () = sleep_until(next_due) => {}
            Some(joined) = reconciles.join_next() => {
                let Ok((key, result)) = joined else { continue };
                queue.running.remove(&key);
                match result {
                    Ok(action) => {
                        queue.failures.remove(&key);
                        match action {
                            Action::Requeue(after) => queue.schedule(key, Instant::now() + after),
                            Action::AwaitChange => {
                                queue.traces.remove(&key);
                            }
                        }
                    }
                    Err(error) if error.is_deposed() => {
                        tracing::info!(service = %key, "deposed while reconciling");
                        break;
                    }
                    Err(error) => {
                        let failures = queue.failures.entry(key.clone()).or_default();
                        *failures = failures.saturating_add(1);
                        let backoff = error_backoff(&core.config, *failures);
                        tracing::warn!(service = %key, %error, retry_in = ?backoff, "reconcile failed");
                        queue.schedule(key, Instant::now() + backoff);
                    }
                }
            }
        }
    }
    reconciles.abort_all();
    while reconciles.join_next().await.is_some() {}
}

/// The wait before trying a service again after `failures` failed
/// reconciles in a row: doubling from `rollout_poll`, never longer than
/// `steady_resync`.
fn error_backoff(config: &crate::config::RevisionsConfig, failures: u32) -> Duration {
    config.rollout_poll.saturating_mul(1 << failures.min(16)).min(config.steady_resync)
}

async fn next_message(subscription: &mut Option<berth_bus::Subscription>) -> Option<BusMessage> {
    match subscription {
        Some(subscription) => subscription.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RevisionsConfig;

    #[test]
    fn a_failing_service_is_tried_again_at_least_as_often_as_a_settled_one() {
        let config = RevisionsConfig::default();
        assert_eq!(error_backoff(&config, 1), config.rollout_poll * 2);
        assert_eq!(error_backoff(&config, 2), config.rollout_poll * 4);
        for failures in [5, 8, 40, u32::MAX] {
            assert_eq!(error_backoff(&config, failures), config.steady_resync, "after {failures} failures");
        }
    }
}
