//! The full pass: the one loop, elected among the replicas, that compiles
//! each tenant's plan, writes the statuses and the plan, and decides what
//! every node is sent.
//!
//! # Expected flow
//! Every replica campaigns for [`EGRESS_LOOP`]. While one leads at term `t`:
//! 1. It follows revisions and leases into a fresh [`World`] and waits (at
//!    most `sync_timeout`) until both described it once.
//! 2. It runs the pass's controller ([`berth_runtime::run_controller`],
//!    one key at a time): every tenant it knows of (declared objects, plans,
//!    services, workloads) and node placement at once and every
//!    `full_resync`, and each key marked ([`PassQueue`]) when its coalesced
//!    marks fall due.
//! 3. A tenant's pass reads its gateways, routes and plan, compiles
//!    ([`compile`]) against its services' selections, renders, and writes
//!    what changed in one transaction fenced on `t`
//!    ([`Catalog::write_pass`]); a changed plan moves every node hosting the
//!    tenant to its next generation in the same transaction.
//! 4. A placement pass makes each node's hosted tenants what leases says
//!    ([`Catalog::place`]). Nodes whose state changed are announced to every
//!    replica's `WatchEgress` streams.
//!
//! # What marks a tenant
//! A gateway or route applied or deleted on any replica (bus topic
//! [`CHANGES_TOPIC`], and directly on the replica that served it), a
//! service's selection changing (including its live revision changing), a
//! tenant first seen on a node, and every `full_resync`.
//!
//! # Invariants
//! - One writer: every write is fenced on the term, so a deposed leader's
//!   late pass changes nothing.
//! - A pass that compiles what is already written writes nothing.
//! - A pass that failed (not deposed) is tried again after a wait doubling
//!   from `debounce` up to `max_delay`.
//!
//! [`PassQueue`]: crate::queue::PassQueue

use std::sync::Arc;

use std::time::Duration;

use berth_runtime::{
    Action, Coalesce, ControllerConfig, DecodeTrigger, Election, Leader, Reconciler, Trigger, Triggers,
};
use berth_store::{Fence, Term};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::catalog::CatalogError;
use crate::compile::{PlanInputs, compile};
use crate::queue::PassKey;
use crate::render::render;
use crate::shared::{CHANGES_TOPIC, Core};
use crate::world::{self, World};

/// The name the full pass's leadership is held under.
pub const EGRESS_LOOP: &str = "egress.full-pass";

/// Campaigns for [`EGRESS_LOOP`] and runs passes while leading, until `core.closing`.
pub(crate) fn spawn(core: Arc<Core>) {
    let election = Election::new(core.catalog.store().clone(), EGRESS_LOOP, &core.replica_id, core.config.election);
    let closing = core.closing.clone();
    let Some(marks) = core.queue.take_marks() else {
        tracing::error!("the egress full pass was started twice; this one does not run");
        return;
    };
    berth_runtime::spawn_elected(election, closing, FullPass { core, marks });
}

/// The full pass of one replica, with the marks its replica sends it.
struct FullPass {
    core: Arc<Core>,
    marks: mpsc::Receiver<Trigger<PassKey>>,
}

impl Leader for FullPass {
    /// Follows the world and runs passes while `term` is held; returns when
    /// a newer term fenced a write off.
    async fn lead(&mut self, term: Term) {
        let core = &self.core;
        let fence = Fence { loop_name: EGRESS_LOOP, holder: core.replica_id.clone(), term };
        let world = World::new();
        let leading = Leading::start(core);
        world::spawn(Arc::clone(core), Arc::clone(&world), leading.stop.clone());
        lead(core, fence, world, &mut self.marks).await;
    }

    /// Marks are for the leader: while following, drop them.
    async fn follow(&mut self) {
        if self.marks.recv().await.is_none() {
            std::future::pending::<()>().await;
        }
    }
}

/// What leading sets up and must undo however the term ends: marks taken,
/// the world followed.
struct Leading<'a> {
    core: &'a Core,
    stop: CancellationToken,
}

impl<'a> Leading<'a> {
    fn start(core: &'a Core) -> Self {
        core.queue.set_leading(true);
        Self { core, stop: core.closing.child_token() }
    }
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        self.core.queue.set_leading(false);
        self.stop.cancel();
    }
}

/// Why a pass did not run to its end.
#[derive(Debug, thiserror::Error)]
enum PassError {
    /// A newer term exists: this replica no longer leads.
    #[error("deposed")]
    Deposed,
    /// The catalog failed; the pass is tried again.
    #[error(transparent)]
    Catalog(CatalogError),
    /// The pass took longer than it may.
    #[error("the pass took longer than {0:?} and was stopped")]
    TimedOut(Duration),
}

impl From<CatalogError> for PassError {
    fn from(error: CatalogError) -> Self {
        match error {
            CatalogError::Deposed => Self::Deposed,
            other => Self::Catalog(other),
        }
    }
}

/// What one term's passes work with.
struct PassTerm {
    core: Arc<Core>,
    fence: Fence,
    world: Arc<World>,
}

/// Waits for the world, then runs the controller until deposed.
async fn lead(core: &Arc<Core>, fence: Fence, world: Arc<World>, marks: &mut mpsc::Receiver<Trigger<PassKey>>) {
    let config = &core.config;
    if tokio::time::timeout(config.sync_timeout, world.synced()).await.is_err() {
        tracing::warn!(timeout = ?config.sync_timeout,
            "revisions or leases did not describe the world in time; passing with what is known");
    }
    let bus = match core.bus.subscribe(CHANGES_TOPIC).await {
        Ok(subscription) => Some((subscription, remote_marks(Arc::clone(core)))),
        Err(error) => {
            tracing::warn!(%error, "cannot follow egress changes on the bus; acting on local changes and resyncs");
            None
        }
    };
    let controller = ControllerConfig {
        workers: 1,
        reconcile_timeout: PASS_TIMEOUT,
        full_resync: config.full_resync,
        retry_base: config.debounce,
        retry_max: config.max_delay,
        coalesce: Some(Coalesce { debounce: config.debounce, max_delay: config.max_delay }),
    };
    let term = Arc::new(PassTerm { core: Arc::clone(core), fence, world });
    berth_runtime::run_controller(term, controller, Triggers { local: marks, bus }).await;
}

/// The longest one pass may take.
const PASS_TIMEOUT: Duration = Duration::from_secs(60);

/// Reads a change another replica announced (`<replica id>\n<project>`),
/// counting it; its own announcements were marked when made.
fn remote_marks(core: Arc<Core>) -> DecodeTrigger<PassKey> {
    Box::new(move |payload| {
        let text = std::str::from_utf8(payload).ok()?;
        let (origin, project) = text.split_once('\n')?;
        (origin != core.replica_id && core.queue.count_event(project))
            .then(|| Trigger { key: PassKey::Tenant(project.to_owned()), traceparent: String::new() })
    })
}

impl Reconciler for PassTerm {
    type Key = PassKey;
    type Error = PassError;

    async fn reconcile(self: Arc<Self>, key: PassKey) -> Result<Action, PassError> {
        match &key {
            PassKey::Tenant(project) => pass(&self.core, &self.fence, &self.world, project).await?,
            PassKey::Placement => place(&self.core, &self.fence, &self.world).await?,
        }
        Ok(Action::AwaitChange)
    }

    /// Every tenant known anywhere, and placement.
    async fn keys(&self) -> Result<Vec<PassKey>, PassError> {
        let mut projects = self.world.projects();
        match self.core.catalog.projects().await {
            Ok(stored) => projects.extend(stored),
            Err(error) => tracing::warn!(%error, "listing projects for a full resync failed"),
        }
        let mut keys: Vec<PassKey> = projects.into_iter().map(PassKey::Tenant).collect();
        keys.push(PassKey::Placement);
        Ok(keys)
    }

    fn is_deposed(error: &PassError) -> bool {
        matches!(error, PassError::Deposed)
    }

    fn timed_out(limit: Duration) -> PassError {
        PassError::TimedOut(limit)
    }
}

/// One tenant's pass.
async fn pass(core: &Core, fence: &Fence, world: &World, project: &str) -> Result<(), CatalogError> {
    let started = std::time::Instant::now();
    let services = world.services_of(project);
    let written = core
        .catalog
        .write_pass(fence, project, |declared, previous, now| {
            let inputs = PlanInputs {
                services: services.clone(),
                gateways: declared.gateways.iter().map(|g| g.to_spec()).collect(),
                routes: declared.routes.iter().map(|r| r.to_spec()).collect(),
            };
            let compiled = compile(&inputs);
            render(project, &compiled, declared, previous.map(|p| &p.content), now)
        })
        .await?;
    core.queue.record_pass(project, written.plan_changed, berth_runtime::wall_clock_ms());
    let (_, counters) = core.queue.counters(project);
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    if written.plan_changed || written.statuses_written > 0 {
        tracing::info!(%project, pass = counters.passes, events = counters.events,
            generation = written.generation, plan_changed = written.plan_changed,
            statuses = written.statuses_written, nodes = written.nodes.len(), elapsed_ms, "egress pass");
    } else {
        tracing::debug!(%project, pass = counters.passes, events = counters.events,
            generation = written.generation, elapsed_ms, "egress pass changed nothing");
    }
    if written.plan_changed && written.generation == 1 {
        // Nodes already hosting a tenant get its plan once it exists.
        core.queue.mark_placement();
    }
    core.nodes.announce(&core.bus, &written.nodes).await;
    Ok(())
}

/// The placement pass.
async fn place(core: &Core, fence: &Fence, world: &World) -> Result<(), CatalogError> {
    let changed = core.catalog.place(fence, &world.hosting()).await?;
    if !changed.is_empty() {
        tracing::info!(nodes = changed.len(), "egress placement changed");
    }
    core.nodes.announce(&core.bus, &changed).await;
    Ok(())
}
