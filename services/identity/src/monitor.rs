//! The node monitor: the one loop, elected among identity's replicas, that
//! acts on node deadlines (marking silent nodes `DOWN`, reaping them,
//! forgetting them) and rebuilds the deadline index whenever the bus may
//! have lost it.
//!
//! # Expected flow
//! Every replica campaigns for [`MONITOR_LOOP`]. A replica that wins a term
//! first looks at the bus's continuity: after a loss (or on a fresh bus) it
//! gives every watched node `reset_grace` from now; otherwise it only adds
//! the deadlines that are missing. Then, every `monitor_every`, it checks
//! continuity again and acts on each due node, re-reading the row:
//! - `JOINING`/`UP`/`DRAINING` → `DOWN`, next look after `reap_after`;
//! - `DOWN` for `reap_after` → reaped (incarnation + 1, so its agent is
//!   fenced), next look after `forget_after`;
//! - reaped for `forget_after` → the row is deleted;
//! - revoked or gone → its deadline is dropped.
//!
//! Every `resync_every` it restores deadlines that went missing (a join while
//! the bus was away) and deletes join tokens long expired.
//!
//! # Invariants
//! - Every write is fenced twice in SQL: on the node's incarnation and state
//!   as read, and on this replica still holding its term in `_berth_leaders`,
//!   so a deposed monitor's late write changes nothing.
//! - A due deadline is re-read before acting: a heartbeat on another replica
//!   may have moved it since it was listed.
//! - After a bus loss no node is marked down before `reset_grace` has passed:
//!   the database's last heartbeat can be a `persist_every` old, so it is not
//!   trusted to say when a node was last heard.

use std::time::Duration;

use berth_bus::{Bus, BusError};
use berth_runtime::{DeadlineKeeper, Election};
use berth_store::{StoreError, Term, expect_one};
use tokio_util::sync::CancellationToken;

use crate::config::millis;
use crate::registry::{self, NODE_DEADLINES, NodeRecord, NodeRegistry, NodeState};

/// The name the monitor's leadership is held under.
pub const MONITOR_LOOP: &str = "identity.monitor";

/// Due deadlines taken from the bus at a time.
const DUE_BATCH: usize = 100;

/// Why one step of the monitor failed; logged, and the step is tried again
/// on the next tick.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MonitorError {
    /// The store failed, or a fenced write found the row or the term changed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The bus failed.
    #[error(transparent)]
    Bus(#[from] BusError),
}

berth_store::store_errors!(MonitorError);

/// When the monitor next needs to look at a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// At this instant, database clock milliseconds.
    At(i64),
    /// Never: it is revoked or gone.
    Never,
}

/// What one look at a due node did.
#[derive(Debug)]
enum Acted {
    /// Nothing changed.
    Nothing(Next),
    /// The row was written.
    Changed(Box<NodeRecord>, Next),
    /// The row was deleted.
    Forgotten,
}

/// The monitor of one replica: campaigns, and while it leads, acts.
#[derive(Debug)]
pub(crate) struct NodeMonitor {
    registry: NodeRegistry,
    holder: String,
}

impl NodeMonitor {
    /// A monitor campaigning under the replica's id.
    pub(crate) fn new(registry: NodeRegistry) -> Self {
        let holder = registry.replica_id().to_owned();
        Self { registry, holder }
    }

    /// Campaigns and runs until `shutdown`, then resigns.
    pub(crate) fn spawn(self, shutdown: &CancellationToken) {
        let election =
            Election::new(self.registry.store().clone(), MONITOR_LOOP, &self.holder, self.registry.timing().election);
        berth_runtime::spawn_elected(election, shutdown.clone(), self);
    }
}

impl DeadlineKeeper for NodeMonitor {
    const OF: &'static str = "node";
    type Error = MonitorError;

    fn bus(&self) -> &Bus {
        self.registry.bus()
    }

    fn cadence(&self) -> (Duration, Duration) {
        let timing = self.registry.timing();
        (timing.monitor_every, timing.resync_every)
    }

    async fn rebuild(&mut self, reset: bool) -> Result<(), MonitorError> {
        NodeMonitor::rebuild(self, reset).await
    }

    async fn act(&mut self, term: Term) {
        if let Err(error) = self.act_on_due(term).await {
            tracing::warn!(%error, "acting on due nodes failed; retrying next tick");
        }
    }

    async fn tidy(&mut self) {
        let retention = self.registry.timing().token_retention;
        match crate::tokens::forget_expired(self.registry.store(), retention).await {
            Ok(0) => {}
            Ok(forgotten) => tracing::info!(forgotten, "forgot long-expired join tokens"),
            Err(error) => tracing::warn!(%error, "forgetting expired join tokens failed"),
        }
    }
}

impl NodeMonitor {
    /// Gives every node the deadline the database implies. Watched nodes get
    /// `reset_grace` from now: all of them when `reset`, else only those
    /// without a deadline.
    async fn rebuild(&self, reset: bool) -> Result<(), MonitorError> {
        let bus = self.registry.bus();
        let nodes = registry::list(self.registry.store(), None, None).await?;
        let monitored = nodes.iter().filter(|n| n.state != NodeState::Revoked).count();
        if !reset && bus.deadline_len(NODE_DEADLINES).await? >= u64::try_from(monitored).unwrap_or(u64::MAX) {
            return Ok(());
        }
        let timing = self.registry.timing();
        let grace_until = self.registry.now_ms() + millis(timing.effective_reset_grace());
        let mut deadlines = Vec::new();
        for node in &nodes {
            match self.next_look(node) {
                Next::Never => {
                    bus.deadline_remove(NODE_DEADLINES, &node.node_id).await?;
                }
                Next::At(_) if node.state.is_watched() => {
                    if reset || bus.deadline_get(NODE_DEADLINES, &node.node_id).await?.is_none() {
                        deadlines.push((node.node_id.clone(), grace_until));
                    }
                }
                Next::At(at) => deadlines.push((node.node_id.clone(), at)),
            }
        }
        bus.deadline_set_many(NODE_DEADLINES, &deadlines).await?;
        if !deadlines.is_empty() {
            tracing::info!(restored = deadlines.len(), reset, "node deadlines rebuilt from the database");
        }
        Ok(())
    }

    /// When the monitor must look at `node` next, from its row alone.
    fn next_look(&self, node: &NodeRecord) -> Next {
        let timing = self.registry.timing();
        match (node.state, node.reaped_at_ms) {
            (NodeState::Revoked, _) => Next::Never,
            (NodeState::Down, Some(reaped_at)) => Next::At(reaped_at.saturating_add(millis(timing.forget_after))),
            (NodeState::Down, None) => Next::At(node.state_changed_at_ms.saturating_add(millis(timing.reap_after))),
            (_, _) => Next::At(
                node.last_heartbeat_at_ms.unwrap_or(node.state_changed_at_ms).saturating_add(millis(timing.down_after)),
            ),
        }
    }

    async fn act_on_due(&self, term: Term) -> Result<(), MonitorError> {
        let bus = self.registry.bus();
        loop {
            let now = self.registry.now_ms();
            let due = bus.deadline_due(NODE_DEADLINES, now, DUE_BATCH).await?;
            for (node_id, _) in &due {
                // A heartbeat elsewhere may have moved it since the listing.
                match bus.deadline_get(NODE_DEADLINES, node_id).await? {
                    Some(at) if at <= now => {}
                    _ => continue,
                }
                match self.act(node_id, term).await {
                    Ok(Acted::Nothing(next)) => self.schedule(node_id, next).await?,
                    Ok(Acted::Changed(record, next)) => {
                        tracing::info!(
                            node_id = %record.node_id,
                            state = record.state.as_str(),
                            incarnation = record.incarnation,
                            reaped = record.reaped_at_ms.is_some(),
                            "node monitor acted"
                        );
                        self.schedule(node_id, next).await?;
                        self.registry.committed(*record).await;
                    }
                    Ok(Acted::Forgotten) => {
                        tracing::info!(%node_id, "node forgotten after its retention");
                        bus.deadline_remove(NODE_DEADLINES, node_id).await?;
                        self.registry.deleted(node_id).await;
                    }
                    Err(MonitorError::Store(StoreError::Conflict { what })) => {
                        // The row or the term moved under us: the next look re-reads it.
                        tracing::info!(%what, "node monitor write fenced off");
                    }
                    Err(error) => return Err(error),
                }
            }
            if due.len() < DUE_BATCH {
                return Ok(());
            }
        }
    }

    async fn schedule(&self, node_id: &str, next: Next) -> Result<(), MonitorError> {
        let bus = self.registry.bus();
        match next {
            Next::At(at) => bus.deadline_set(NODE_DEADLINES, node_id, at).await?,
            Next::Never => {
                bus.deadline_remove(NODE_DEADLINES, node_id).await?;
            }
        }
        Ok(())
    }

    /// One look at a due node, in one transaction fenced by the row and the term.
    async fn act(&self, node_id: &str, term: Term) -> Result<Acted, MonitorError> {
        let store = self.registry.store();
        let now_sql = store.now_ms_sql();
        let fence = format!(
            "EXISTS (SELECT 1 FROM _berth_leaders WHERE loop_name = '{MONITOR_LOOP}' AND holder = $4 \
             AND term = $5 AND expires_at_ms > {now_sql})"
        );
        let mark_down = format!(
            "UPDATE nodes SET state = 'down', state_changed_at_ms = {now_sql}, revision = revision + 1 \
             WHERE node_id = $1 AND incarnation = $2 AND state = $3 AND {fence}"
        );
        let reap = format!(
            "UPDATE nodes SET incarnation = incarnation + 1, reaped_at_ms = {now_sql}, revision = revision + 1 \
             WHERE node_id = $1 AND incarnation = $2 AND state = $3 AND reaped_at_ms IS NULL AND {fence}"
        );
        let forget = format!(
            "DELETE FROM nodes WHERE node_id = $1 AND incarnation = $2 AND state = $3 \
             AND reaped_at_ms IS NOT NULL AND {fence}"
        );
        let timing = self.registry.timing().clone();
        let (node_id, holder) = (node_id.to_owned(), self.holder.clone());
        store
            .tx("nodes.monitor", move |conn| {
                let (mark_down, reap, forget) = (mark_down.clone(), reap.clone(), forget.clone());
                let (node_id, holder, timing) = (node_id.clone(), holder.clone(), timing.clone());
                Box::pin(async move {
                    let Some(node) = registry::fetch(conn, &node_id).await? else {
                        return Ok(Acted::Nothing(Next::Never));
                    };
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let fenced_on = format!("node {node_id} at incarnation {} under term {term}", node.incarnation);
                    let (statement, next) = match (node.state, node.reaped_at_ms) {
                        (NodeState::Revoked, _) => return Ok(Acted::Nothing(Next::Never)),
                        (state, _) if state.is_watched() => (mark_down, Next::At(now + millis(timing.reap_after))),
                        (_, None) => {
                            let reap_at = node.state_changed_at_ms.saturating_add(millis(timing.reap_after));
                            if reap_at > now {
                                return Ok(Acted::Nothing(Next::At(reap_at)));
                            }
                            (reap, Next::At(now + millis(timing.forget_after)))
                        }
                        (_, Some(reaped_at)) => {
                            let forget_at = reaped_at.saturating_add(millis(timing.forget_after));
                            if forget_at > now {
                                return Ok(Acted::Nothing(Next::At(forget_at)));
                            }
                            (forget, Next::Never)
                        }
                    };
                    let done = sqlx::query(sqlx::AssertSqlSafe(statement))
                        .bind(&node_id)
                        .bind(node.incarnation)
                        .bind(node.state.as_str())
                        .bind(&holder)
                        .bind(term.0)
                        .execute(&mut *conn)
                        .await?;
                    expect_one(done.rows_affected(), &fenced_on)?;
                    match registry::fetch(conn, &node_id).await? {
                        Some(written) => Ok(Acted::Changed(Box::new(written), next)),
                        None => Ok(Acted::Forgotten),
                    }
                })
            })
            .await
    }
}
