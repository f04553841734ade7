//! The full pass: the one loop, elected among the replicas, that compiles
//! each tenant's plan, writes the statuses and the plan, and decides what
//! every node is sent.
//!
//! # Expected flow
//! Every replica campaigns for [`EGRESS_LOOP`]. While one leads at term `t`:
//! 1. It follows revisions and leases into a fresh [`World`] and waits (at
//!    most `sync_timeout`) until both described it once.
//! 2. It marks every tenant it knows of (declared objects, plans, services,
//!    workloads) and node placement, then takes what falls due from the
//!    [`PassQueue`], one tenant at a time.
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

use std::sync::Arc;

use berth_bus::BusMessage;
use berth_runtime::{Election, Leader};
use berth_store::Term;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::catalog::{CatalogError, Fence};
use crate::compile::{PlanInputs, compile};
use crate::render::render;
use crate::shared::{CHANGES_TOPIC, Core};
use crate::world::{self, World};

/// The name the full pass's leadership is held under.
pub const EGRESS_LOOP: &str = "egress.full-pass";

/// Campaigns for [`EGRESS_LOOP`] and runs passes while leading, until `core.closing`.
pub(crate) fn spawn(core: Arc<Core>) {
    let election = Election::new(core.catalog.store().clone(), EGRESS_LOOP, &core.replica_id, core.config.election);
    let closing = core.closing.clone();
    berth_runtime::spawn_elected(election, closing, FullPass { core });
}

/// The full pass of one replica.
struct FullPass {
    core: Arc<Core>,
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
        lead(core, &fence, &world).await;
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

/// Why a term ended early.
struct Deposed;

/// Runs passes until deposed.
async fn lead(core: &Arc<Core>, fence: &Fence, world: &Arc<World>) {
    let config = &core.config;
    if tokio::time::timeout(config.sync_timeout, world.synced()).await.is_err() {
        tracing::warn!(timeout = ?config.sync_timeout,
            "revisions or leases did not describe the world in time; passing with what is known");
    }
    let mut subscription = match core.bus.subscribe(CHANGES_TOPIC).await {
        Ok(subscription) => Some(subscription),
        Err(error) => {
            tracing::warn!(%error, "cannot follow egress changes on the bus; acting on local changes and resyncs");
            None
        }
    };
    let mut resync = tokio::time::interval(config.full_resync);
    loop {
        let wake_at = core.queue.next_due();
        tokio::select! {
            _ = resync.tick() => mark_everything(core, world).await,
            () = core.queue.notified() => {}
            () = sleep_until(wake_at) => {}
            message = next_message(&mut subscription) => match message {
                Some(BusMessage::Payload(payload)) => {
                    let text = String::from_utf8_lossy(&payload);
                    if let Some((origin, project)) = text.split_once('\n')
                        && origin != core.replica_id
                    {
                        core.queue.mark(project);
                    }
                }
                Some(BusMessage::Gap) => resync.reset_immediately(),
                None => subscription = None,
            },
        }
        let due = core.queue.take_due(Instant::now());
        for project in &due.tenants {
            if pass(core, fence, world, project).await.is_err() {
                return;
            }
        }
        if due.placement && place(core, fence, world).await.is_err() {
            return;
        }
    }
}

/// Marks every tenant known anywhere, and placement.
async fn mark_everything(core: &Core, world: &World) {
    let mut projects = world.projects();
    match core.catalog.projects().await {
        Ok(stored) => projects.extend(stored),
        Err(error) => tracing::warn!(%error, "listing projects for a full resync failed"),
    }
    for project in &projects {
        core.queue.mark(project);
    }
    core.queue.mark_placement();
}

/// One tenant's pass; `Err` when deposed.
async fn pass(core: &Core, fence: &Fence, world: &World, project: &str) -> Result<(), Deposed> {
    let started = std::time::Instant::now();
    let services = world.services_of(project);
    let written = core
        .catalog
        .write_pass(fence, project, |gateways, routes, previous, now| {
            let inputs = PlanInputs {
                services: services.clone(),
                gateways: gateways.iter().map(|g| g.to_spec()).collect(),
                routes: routes.iter().map(|r| r.to_spec()).collect(),
            };
            let compiled = compile(&inputs);
            render(project, &compiled, gateways, routes, previous.map(|p| &p.content), now)
        })
        .await;
    match written {
        Ok(written) => {
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
        Err(CatalogError::Deposed) => Err(Deposed),
        Err(error) => {
            tracing::warn!(%project, %error, "egress pass failed; trying again");
            core.queue.mark(project);
            Ok(())
        }
    }
}

/// The placement pass; `Err` when deposed.
async fn place(core: &Core, fence: &Fence, world: &World) -> Result<(), Deposed> {
    match core.catalog.place(fence, &world.hosting()).await {
        Ok(changed) => {
            if !changed.is_empty() {
                tracing::info!(nodes = changed.len(), "egress placement changed");
            }
            core.nodes.announce(&core.bus, &changed).await;
            Ok(())
        }
        Err(CatalogError::Deposed) => Err(Deposed),
        Err(error) => {
            tracing::warn!(%error, "egress placement pass failed; trying again");
            core.queue.mark_placement();
            Ok(())
        }
    }
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
