//! The reaper: the one loop, elected among the ledger's replicas, that
//! expires leases their nodes stopped renewing (returning their capacity),
//! keeps the bus's deadline index in step with the database, and forgets
//! final leases past their retention.
//!
//! # Expected flow
//! Every replica campaigns for [`REAPER_LOOP`](crate::REAPER_LOOP). A replica
//! that wins a term rebuilds the deadline index from the database (the
//! database is the truth: every renewal writes `expires_at_ms` there first);
//! if the bus says it lost its state (or looks fresh), every open lease gets
//! `reset_grace` from now. Then, every `reap_every`, it lists due leases from
//! the index and expires those the database agrees are due, rescheduling the
//! ones renewed since. Every `index_resync` it rebuilds the index again
//! (restoring deadlines a failed bus write missed) and forgets old leases.
//!
//! # Invariants
//! - Expiry is fenced twice in SQL: on the lease's epoch, phase and deadline
//!   as read, and on this replica still holding its term in
//!   `_berth_leaders`, so a deposed reaper's late write changes nothing.
//! - After a bus loss no lease expires before the grace has passed: its node
//!   may not have received it while the bus could not fan changes out.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use berth_bus::{Bus, BusError};
use berth_runtime::{DeadlineKeeper, Election};
use berth_store::{StoreError, Term};

use berth_proto::identity::v1::NodeState;

use crate::config::millis;
use crate::ledger::{Expiry, LeaseError, REAPER_LOOP};
use crate::shared::{Core, EXPIRY_INDEX};

/// Due leases taken from the index at a time.
const DUE_BATCH: usize = 500;

/// Deadlines written to the bus per round trip when rebuilding.
const REBUILD_BATCH: usize = 1000;

/// Final leases forgotten per transaction.
const FORGET_BATCH: usize = 1000;

/// Why one step of the reaper failed; logged, and the step is tried again on
/// the next tick.
#[derive(Debug, thiserror::Error)]
enum ReaperError {
    /// The ledger failed, or found this replica no longer leads.
    #[error(transparent)]
    Ledger(#[from] LeaseError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The bus failed.
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// Campaigns until the service closes, and reaps while it leads.
pub(crate) fn spawn(core: Arc<Core>) {
    let election = Election::new(core.ledger.store().clone(), REAPER_LOOP, &core.replica_id, core.config.election);
    let closing = core.closing.clone();
    berth_runtime::spawn_elected(election, closing, Reaper { core, grace_until: 0, draining: BTreeSet::new() });
}

/// The reaper's state while it leads.
struct Reaper {
    core: Arc<Core>,
    /// No lease's deadline is indexed before this, database clock milliseconds.
    grace_until: i64,
    /// The nodes seen draining at the last tick, to notice a drain lifted.
    draining: BTreeSet<String>,
}

impl DeadlineKeeper for Reaper {
    const OF: &'static str = "lease";
    type Error = ReaperError;

    fn bus(&self) -> &Bus {
        &self.core.bus
    }

    fn cadence(&self) -> (Duration, Duration) {
        (self.core.config.reap_every, self.core.config.index_resync)
    }

    async fn rebuild(&mut self, reset: bool) -> Result<(), ReaperError> {
        Reaper::rebuild(self, reset).await
    }

    async fn act(&mut self, term: Term) {
        if let Err(error) = self.reap_due(term).await {
            tracing::warn!(%error, "reaping due leases failed; retrying next tick");
        }
        if let Err(error) = self.drain_nodes().await {
            tracing::warn!(%error, "moving draining nodes' leases along failed; retrying next tick");
        }
    }

    /// Marks a lifted drain left behind (whoever led when it was lifted),
    /// and forgets final leases past their retention.
    async fn tidy(&mut self) {
        if let Err(error) = self.clear_drain_marks().await {
            tracing::warn!(%error, "clearing lifted drains' marks failed; retrying at the next resync");
        }
        self.forget_logged().await;
    }
}

impl Reaper {
    /// Indexes every open lease's deadline from the database; after a reset,
    /// none earlier than a grace from now.
    async fn rebuild(&mut self, reset: bool) -> Result<(), ReaperError> {
        let open = self.core.ledger.open_deadlines().await?;
        if reset {
            let now = self.core.ledger.store().now_ms().await?;
            self.grace_until = now.saturating_add(millis(self.core.config.effective_reset_grace()));
        }
        let deadlines: Vec<(String, i64)> =
            open.into_iter().map(|(lease_id, at)| (lease_id, at.max(self.grace_until))).collect();
        for chunk in deadlines.chunks(REBUILD_BATCH) {
            self.core.bus.deadline_set_many(EXPIRY_INDEX, chunk).await?;
        }
        if reset {
            tracing::info!(leases = deadlines.len(), "lease deadlines rebuilt from the database with a grace");
        }
        Ok(())
    }

    async fn reap_due(&self, term: Term) -> Result<(), ReaperError> {
        let bus = &self.core.bus;
        loop {
            let now = self.core.ledger.store().now_ms().await?;
            if now < self.grace_until {
                // A deadline written by a placement or renewal racing the
                // rebuild may be due already; the grace holds for it too.
                return Ok(());
            }
            let due = bus.deadline_due(EXPIRY_INDEX, now, DUE_BATCH).await?;
            if due.is_empty() {
                return Ok(());
            }
            let lease_ids: Vec<String> = due.iter().map(|(lease_id, _)| lease_id.clone()).collect();
            let outcomes = match self.core.ledger.expire(&lease_ids, &self.core.replica_id, term).await {
                Err(LeaseError::Store(StoreError::Conflict { what })) => {
                    tracing::info!(%what, "reaper write fenced off; no longer leading");
                    return Ok(());
                }
                other => other?,
            };
            let mut touched = Vec::new();
            let mut expired = Vec::new();
            for (lease_id, outcome) in outcomes {
                match outcome {
                    Expiry::Expired(lease) => {
                        tracing::info!(lease_id = %lease.lease_id, node_id = %lease.node_id, epoch = lease.epoch,
                            "lease expired: not renewed in time");
                        touched.push(lease.node_id.clone());
                        bus.deadline_remove(EXPIRY_INDEX, &lease_id).await?;
                        expired.push(lease);
                    }
                    Expiry::NotYet(at) => bus.deadline_set(EXPIRY_INDEX, &lease_id, at.max(self.grace_until)).await?,
                    Expiry::Gone => {
                        bus.deadline_remove(EXPIRY_INDEX, &lease_id).await?;
                    }
                }
            }
            touched.sort();
            touched.dedup();
            self.core.signals.announce(bus, &touched).await;
            self.core.announce_owners(expired.iter().map(|lease| &**lease)).await;
            if due.len() < DUE_BATCH {
                return Ok(());
            }
        }
    }

    /// Tells the open leases of every draining node that it drains, and
    /// releases them once its drain's deadline (identity's) has passed; takes
    /// the mark off again where a drain was lifted since the last tick.
    async fn drain_nodes(&mut self) -> Result<(), ReaperError> {
        let snapshot = self.core.nodes.snapshot();
        let draining: Vec<&berth_proto::identity::v1::Node> =
            snapshot.nodes.values().filter(|node| node.state() == NodeState::Draining).collect();
        let now_draining: BTreeSet<String> = draining.iter().map(|node| node.node_id.clone()).collect();
        if self.draining.iter().any(|node_id| !now_draining.contains(node_id)) {
            self.draining.clone_from(&now_draining);
            self.clear_drain_marks().await?;
        }
        self.draining = now_draining;
        if draining.is_empty() {
            return Ok(());
        }
        let now = self.core.ledger.store().now_ms().await?;
        for node in draining {
            let deadline = node.drain_deadline.as_ref().map(berth_proto::timestamp_to_ms);
            let passed = deadline.is_some_and(|at| at <= now);
            let changed = self.core.ledger.drain(&node.node_id, passed).await?;
            if changed.is_empty() {
                continue;
            }
            if passed {
                tracing::info!(node_id = %node.node_id, released = changed.len(),
                    "the drain's deadline passed: released what was still open on the node");
                for lease in &changed {
                    self.core.bus.deadline_remove(EXPIRY_INDEX, &lease.lease_id).await?;
                }
                self.core.signals.announce(&self.core.bus, std::slice::from_ref(&node.node_id)).await;
            } else {
                tracing::info!(node_id = %node.node_id, told = changed.len(), "leases told their node drains");
            }
            self.core.announce_owners(changed.iter()).await;
        }
        Ok(())
    }

    /// Takes the `NodeDraining` mark off the leases of nodes no longer draining.
    async fn clear_drain_marks(&self) -> Result<(), ReaperError> {
        let cleared = self.core.ledger.clear_drain_marks(&self.draining).await?;
        if !cleared.is_empty() {
            tracing::info!(leases = cleared.len(), "a drain was lifted: its leases stay where they are");
            self.core.announce_owners(cleared.iter()).await;
        }
        Ok(())
    }

    async fn forget_logged(&self) {
        let retention = millis(self.core.config.retention);
        loop {
            match self.core.ledger.forget_final(retention, FORGET_BATCH).await {
                Ok(0) => return,
                Ok(forgotten) => {
                    tracing::info!(forgotten, "forgot final leases past their retention");
                    if forgotten < FORGET_BATCH {
                        return;
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "forgetting old leases failed; retrying at the next resync");
                    return;
                }
            }
        }
    }
}
