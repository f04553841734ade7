//! Fleet upgrades of the node agent: `Nodes/UpgradeNodes` records a rollout,
//! and one controller, elected among identity's replicas, walks it over the
//! nodes.
//!
//! # Expected flow
//! 1. `UpgradeNodes` resolves the reference to a manifest digest once, here
//!    (so every node installs the same bytes whatever the tag does later),
//!    picks the nodes (by id, tier or all, never a revoked one) and stores
//!    the rollout with each node `pending`, in the order they go. A rollout
//!    still running is superseded: nodes it had not started are left alone.
//! 2. The controller ([`UPGRADES_LOOP`]) starts nodes: the first `canary`
//!    alone, then the rest, never more than `max_unavailable` at once. To
//!    start a node it writes the node's upgrade mark (`started`, the pinned
//!    artifact); the node's heartbeat answer carries the mark to the agent
//!    for as long as it stays `started`.
//! 3. The agent pulls the artifact and hands the binary to its detached
//!    updater; its heartbeats report what came of it (`upgrading`, then
//!    `succeeded` with the new version, or `failed` with the reason), which
//!    the heartbeat handler writes onto the mark.
//! 4. The controller copies each node's outcome into the rollout; a node
//!    that went `DOWN`, was revoked, or reported nothing for
//!    [`NODE_UPGRADE_TIMEOUT`] failed. Past `max_failures` failures the
//!    rollout pauses itself; once every node finished it is done.
//!
//! # Invariants
//! - A rollout is written only by the controller holding its term (checked
//!   in the write's transaction), except its creation and supersession.
//! - A node is started at most once per rollout, and never while a mark of
//!   another rollout is still in flight on it.
//! - The artifact a node is given is pinned to a digest; the agent verifies
//!   what it pulls against it, and the updater the binary's hash.

use std::sync::Arc;
use std::time::Duration;

use berth_bundle::{BundleClient, BundleReference, RegistryCredentials};
use berth_proto::identity::v1;
use berth_runtime::{Action, ControllerConfig, Election, Leader, Reconciler, Trigger, Triggers};
use berth_store::{Fence, Store, StoreError, Term};
use sqlx::{AnyConnection, Row as _};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::IdentityService;
use crate::nodes_error::NodesApiError;
use crate::registry::{self, NodeRecord, NodeRegistry, NodeState, NodeUpgradeState, timestamp};

/// The name the upgrade controller's leadership is held under.
pub const UPGRADES_LOOP: &str = "identity.upgrades";

/// The bus topic a replica announces a new rollout on, so the leader
/// starts it at once.
const UPGRADES_TOPIC: &str = "upgrades";

/// How long a started node may go without an outcome before it failed.
pub(crate) const NODE_UPGRADE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// How often a running rollout is looked at even without a trigger: node
/// outcomes arrive on heartbeats, at any replica.
const RUNNING_REQUEUE: Duration = Duration::from_secs(1);

/// How long resolving the reference may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest reason kept from a node.
pub(crate) const MAX_UPGRADE_REASON: usize = 2048;

/// Where a rollout is, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UpgradeState {
    Running,
    Paused,
    Done,
    Superseded,
}

impl UpgradeState {
    fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Done => "done",
            Self::Superseded => "superseded",
        }
    }

    fn parse(stored: &str) -> Result<Self, StoreError> {
        Ok(match stored {
            "running" => Self::Running,
            "paused" => Self::Paused,
            "done" => Self::Done,
            "superseded" => Self::Superseded,
            other => return Err(StoreError::internal(format!("an upgrade holds unknown state {other:?}"))),
        })
    }

    fn to_proto(self) -> v1::UpgradeState {
        match self {
            Self::Running => v1::UpgradeState::Running,
            Self::Paused => v1::UpgradeState::Paused,
            Self::Done => v1::UpgradeState::Done,
            Self::Superseded => v1::UpgradeState::Superseded,
        }
    }
}

/// One `upgrades` row.
#[derive(Debug, Clone)]
struct Rollout {
    upgrade_id: String,
    reference: String,
    artifact: String,
    state: UpgradeState,
    reason: String,
    max_unavailable: i64,
    canary: i64,
    max_failures: i64,
    created_by: String,
    created_at_ms: i64,
}

/// One `upgrade_nodes` row.
#[derive(Debug, Clone)]
struct Target {
    node_id: String,
    ordinal: i64,
    state: NodeUpgradeState,
    reason: String,
    version: String,
    started_at_ms: Option<i64>,
    finished_at_ms: Option<i64>,
}

/// A rollout with its nodes in order.
#[derive(Debug, Clone)]
struct Upgrade {
    rollout: Rollout,
    targets: Vec<Target>,
}

impl Upgrade {
    fn to_proto(&self) -> v1::Upgrade {
        let r = &self.rollout;
        v1::Upgrade {
            upgrade_id: r.upgrade_id.clone(),
            reference: r.reference.clone(),
            artifact: r.artifact.clone(),
            state: r.state.to_proto() as i32,
            reason: r.reason.clone(),
            max_unavailable: u32::try_from(r.max_unavailable).unwrap_or(u32::MAX),
            canary: u32::try_from(r.canary).unwrap_or(u32::MAX),
            max_failures: u32::try_from(r.max_failures).unwrap_or(u32::MAX),
            nodes: self
                .targets
                .iter()
                .map(|t| v1::NodeUpgrade {
                    node_id: t.node_id.clone(),
                    state: t.state.to_proto() as i32,
                    reason: t.reason.clone(),
                    canary: t.ordinal < r.canary,
                    version: t.version.clone(),
                    started_at: t.started_at_ms.map(timestamp),
                    finished_at: t.finished_at_ms.map(timestamp),
                })
                .collect(),
            created_by: r.created_by.clone(),
            created_at: Some(timestamp(r.created_at_ms)),
        }
    }
}

async fn load(conn: &mut AnyConnection, upgrade_id: &str) -> Result<Option<Upgrade>, StoreError> {
    let row = sqlx::query(
        "SELECT upgrade_id, reference, artifact, state, reason, max_unavailable, canary, max_failures, created_by, \
         created_at_ms FROM upgrades WHERE upgrade_id = $1",
    )
    .bind(upgrade_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let rollout = Rollout {
        upgrade_id: row.try_get("upgrade_id")?,
        reference: row.try_get("reference")?,
        artifact: row.try_get("artifact")?,
        state: UpgradeState::parse(&row.try_get::<String, _>("state")?)?,
        reason: row.try_get("reason")?,
        max_unavailable: row.try_get("max_unavailable")?,
        canary: row.try_get("canary")?,
        max_failures: row.try_get("max_failures")?,
        created_by: row.try_get("created_by")?,
        created_at_ms: row.try_get("created_at_ms")?,
    };
    let rows = sqlx::query(
        "SELECT node_id, ordinal, state, reason, version, started_at_ms, finished_at_ms FROM upgrade_nodes \
         WHERE upgrade_id = $1 ORDER BY ordinal",
    )
    .bind(upgrade_id)
    .fetch_all(&mut *conn)
    .await?;
    let mut targets = Vec::with_capacity(rows.len());
    for row in rows {
        targets.push(Target {
            node_id: row.try_get("node_id")?,
            ordinal: row.try_get("ordinal")?,
            state: NodeUpgradeState::parse(&row.try_get::<String, _>("state")?)?,
            reason: row.try_get("reason")?,
            version: row.try_get("version")?,
            started_at_ms: row.try_get("started_at_ms")?,
            finished_at_ms: row.try_get("finished_at_ms")?,
        });
    }
    Ok(Some(Upgrade { rollout, targets }))
}

/// The latest rollout's id, if any.
async fn latest_id(conn: &mut AnyConnection) -> Result<Option<String>, StoreError> {
    Ok(sqlx::query_scalar("SELECT upgrade_id FROM upgrades ORDER BY created_at_ms DESC, upgrade_id DESC LIMIT 1")
        .fetch_optional(&mut *conn)
        .await?)
}

/// What `UpgradeNodes` asks for, checked.
#[derive(Debug, Clone)]
pub(crate) struct UpgradeAsk {
    selector: Selector,
    reference: BundleReference,
    max_unavailable: i64,
    canary: i64,
    max_failures: i64,
}

#[derive(Debug, Clone)]
enum Selector {
    Nodes(Vec<String>),
    Tier(String),
    All,
}

impl UpgradeAsk {
    /// Checks a request, naming the first field that is wrong.
    pub(crate) fn parse(request: v1::UpgradeNodesRequest) -> Result<Self, NodesApiError> {
        let invalid =
            |field: &'static str, reason: &str| NodesApiError::InvalidArgument { field, reason: reason.into() };
        let chosen = usize::from(!request.node_ids.is_empty())
            + usize::from(!request.tier.is_empty())
            + usize::from(request.all);
        if chosen != 1 {
            return Err(invalid("node_ids", "name the nodes by exactly one of node_ids, tier and all"));
        }
        let selector = if request.all {
            Selector::All
        } else if !request.tier.is_empty() {
            Selector::Tier(request.tier)
        } else {
            let mut ids = Vec::with_capacity(request.node_ids.len());
            for id in request.node_ids {
                if !berth_core::is_dns_label(&id) {
                    return Err(NodesApiError::InvalidArgument {
                        field: "node_ids",
                        reason: format!("'{id}' is not a node id"),
                    });
                }
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            Selector::Nodes(ids)
        };
        if request.to.trim().is_empty() {
            return Err(invalid("to", "name the agent artifact, e.g. registry.example.com/berth/agent:1.4.0"));
        }
        let reference = BundleReference::parse(request.to.trim()).map_err(|e| NodesApiError::InvalidArgument {
            field: "to",
            reason: format!("'{}' is not a reference: {e}", request.to),
        })?;
        if !reference.is_registry() {
            return Err(invalid("to", "must name a registry: every node pulls the agent from there"));
        }
        Ok(Self {
            selector,
            reference,
            max_unavailable: i64::from(request.max_unavailable.max(1)),
            canary: i64::from(request.canary),
            max_failures: i64::from(request.max_failures),
        })
    }
}

/// How identity resolves agent artifacts, and tells its controller of new
/// rollouts.
#[derive(Debug, Clone)]
pub(crate) struct Upgrades {
    client: BundleClient,
    wake: mpsc::Sender<Trigger<String>>,
    /// The controller's end of `wake`, taken once when the loops start.
    woken: Arc<std::sync::Mutex<Option<mpsc::Receiver<Trigger<String>>>>>,
}

impl Upgrades {
    pub(crate) fn new(client: BundleClient) -> Self {
        let (wake, woken) = mpsc::channel(64);
        Self { client, wake, woken: Arc::new(std::sync::Mutex::new(Some(woken))) }
    }
}

fn new_upgrade_id() -> String {
    format!("up-{}", hex::encode(rand::random::<[u8; 6]>()))
}

impl IdentityService {
    /// `UpgradeNodes`: resolves, picks the nodes, stores the rollout.
    pub(crate) async fn upgrade_nodes(&self, admin: &str, ask: UpgradeAsk) -> Result<v1::Upgrade, NodesApiError> {
        let shown = ask.reference.to_string();
        let resolved = tokio::time::timeout(
            RESOLVE_TIMEOUT,
            self.upgrades.client.resolve(&ask.reference, &RegistryCredentials::Anonymous),
        )
        .await;
        let digest = match resolved {
            Ok(Ok(digest)) => digest,
            Ok(Err(error)) => return Err(NodesApiError::Unresolvable { reference: shown, reason: error.to_string() }),
            Err(_) => {
                return Err(NodesApiError::Unresolvable {
                    reference: shown,
                    reason: format!("the registry did not answer within {RESOLVE_TIMEOUT:?}"),
                });
            }
        };
        let artifact = ask.reference.pinned(&digest).to_string();
        let upgrade_id = new_upgrade_id();
        let now_sql = self.store.now_ms_sql();
        let (id, admin_name) = (upgrade_id.clone(), admin.to_owned());
        let upgrade = self
            .store
            .tx("upgrades.create", move |conn| {
                let (ask, id, artifact, shown, admin) =
                    (ask.clone(), id.clone(), artifact.clone(), shown.clone(), admin_name.clone());
                Box::pin(async move {
                    let nodes = chosen_nodes(conn, &ask.selector).await?;
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    sqlx::query(
                        "UPDATE upgrades SET state = 'superseded', reason = $1 WHERE state IN ('running', 'paused')",
                    )
                    .bind(format!("superseded by {id}"))
                    .execute(&mut *conn)
                    .await?;
                    sqlx::query(
                        "INSERT INTO upgrades (upgrade_id, reference, artifact, state, reason, max_unavailable, canary, \
                         max_failures, created_by, created_at_ms) VALUES ($1, $2, $3, 'running', '', $4, $5, $6, $7, $8)",
                    )
                    .bind(&id)
                    .bind(&shown)
                    .bind(&artifact)
                    .bind(ask.max_unavailable)
                    .bind(ask.canary)
                    .bind(ask.max_failures)
                    .bind(&admin)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                    for (ordinal, node_id) in nodes.iter().enumerate() {
                        sqlx::query(
                            "INSERT INTO upgrade_nodes (upgrade_id, node_id, ordinal, state) VALUES ($1, $2, $3, 'pending')",
                        )
                        .bind(&id)
                        .bind(node_id)
                        .bind(i64::try_from(ordinal).unwrap_or(i64::MAX))
                        .execute(&mut *conn)
                        .await?;
                    }
                    load(conn, &id)
                        .await?
                        .ok_or_else(|| NodesApiError::from(StoreError::internal("a new upgrade vanished")))
                })
            })
            .await?;
        tracing::info!(%upgrade_id, %admin, artifact = %upgrade.rollout.artifact, nodes = upgrade.targets.len(),
            "fleet upgrade started");
        let trigger = Trigger { key: upgrade_id.clone(), traceparent: String::new() };
        let _ = self.upgrades.wake.try_send(trigger);
        if let Err(error) = self.bus.publish(UPGRADES_TOPIC, upgrade_id.clone().into_bytes()).await {
            tracing::info!(%error, "cannot announce the upgrade on the bus; the controller finds it on its next pass");
        }
        Ok(upgrade.to_proto())
    }

    /// `GetUpgrade`: one rollout, or the latest.
    pub(crate) async fn get_upgrade(&self, upgrade_id: &str) -> Result<v1::Upgrade, NodesApiError> {
        let id = upgrade_id.to_owned();
        let upgrade = self
            .store
            .read("upgrades.get", move |conn| {
                let id = id.clone();
                Box::pin(async move {
                    let id = match id.as_str() {
                        "" => latest_id(conn)
                            .await?
                            .ok_or_else(|| NodesApiError::NoUpgrade("no upgrade was ever started".into()))?,
                        _ => id,
                    };
                    load(conn, &id).await?.ok_or_else(|| NodesApiError::NoUpgrade(format!("upgrade {id} not found")))
                })
            })
            .await?;
        Ok(upgrade.to_proto())
    }
}

/// The nodes a selector names, in the order they go: as listed, else by id.
async fn chosen_nodes(conn: &mut AnyConnection, selector: &Selector) -> Result<Vec<String>, NodesApiError> {
    let nodes = match selector {
        Selector::Nodes(ids) => {
            for id in ids {
                let node = registry::fetch(conn, id).await?.ok_or_else(|| NodesApiError::NotFound(id.clone()))?;
                if node.state == NodeState::Revoked {
                    return Err(NodesApiError::RevokedNotUpgraded(id.clone()));
                }
            }
            ids.clone()
        }
        Selector::Tier(tier) => {
            sqlx::query_scalar("SELECT node_id FROM nodes WHERE tier = $1 AND state <> 'revoked' ORDER BY node_id")
                .bind(tier)
                .fetch_all(&mut *conn)
                .await
                .map_err(StoreError::from)?
        }
        Selector::All => sqlx::query_scalar("SELECT node_id FROM nodes WHERE state <> 'revoked' ORDER BY node_id")
            .fetch_all(&mut *conn)
            .await
            .map_err(StoreError::from)?,
    };
    if nodes.is_empty() {
        return Err(NodesApiError::InvalidArgument {
            field: "tier",
            reason: "no node that is not revoked matches".into(),
        });
    }
    Ok(nodes)
}

/// The controller of one replica: campaigns, and while it leads, walks the
/// running rollouts.
pub(crate) struct UpgradeController {
    registry: NodeRegistry,
    woken: mpsc::Receiver<Trigger<String>>,
}

impl std::fmt::Debug for UpgradeController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpgradeController").finish_non_exhaustive()
    }
}

impl UpgradeController {
    /// Campaigns and runs until `shutdown`; `None` when the loop was started already.
    pub(crate) fn spawn(registry: NodeRegistry, upgrades: &Upgrades, shutdown: &CancellationToken) {
        let woken = upgrades.woken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let Some(woken) = woken else { return };
        let holder = registry.replica_id().to_owned();
        let election = Election::new(registry.store().clone(), UPGRADES_LOOP, &holder, registry.timing().election);
        berth_runtime::spawn_elected(election, shutdown.clone(), Self { registry, woken });
    }
}

impl Leader for UpgradeController {
    async fn lead(&mut self, term: Term) {
        let fence = Fence { loop_name: UPGRADES_LOOP, holder: self.registry.replica_id().to_owned(), term };
        let bus = match self.registry.bus().subscribe(UPGRADES_TOPIC).await {
            Ok(subscription) => {
                let decode: berth_runtime::DecodeTrigger<String> = Box::new(|payload| {
                    let id = std::str::from_utf8(payload).ok()?;
                    Some(Trigger { key: id.to_owned(), traceparent: String::new() })
                });
                Some((subscription, decode))
            }
            Err(error) => {
                tracing::info!(%error, "cannot follow new upgrades on the bus; full passes find them");
                None
            }
        };
        let config = ControllerConfig {
            workers: 1,
            reconcile_timeout: Duration::from_secs(30),
            full_resync: Duration::from_secs(5),
            retry_base: Duration::from_millis(500),
            retry_max: Duration::from_secs(10),
            coalesce: None,
        };
        let walker = Arc::new(Walker { registry: self.registry.clone(), fence });
        berth_runtime::run_controller(walker, config, Triggers { local: &mut self.woken, bus }).await;
    }
}

/// One term's work: reconciling rollouts.
struct Walker {
    registry: NodeRegistry,
    fence: Fence,
}

/// Why a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WalkError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the controller's term is over")]
    Deposed,
    #[error("a reconcile took longer than {0:?}")]
    TimedOut(Duration),
}

berth_store::store_errors!(WalkError);

impl Reconciler for Walker {
    type Key = String;
    type Error = WalkError;

    async fn reconcile(self: Arc<Self>, key: String) -> Result<Action, WalkError> {
        let (running, started) = step(self.registry.store(), &self.fence, &key).await?;
        for record in started {
            self.registry.committed(record).await;
        }
        Ok(if running { Action::Requeue(RUNNING_REQUEUE) } else { Action::AwaitChange })
    }

    async fn keys(&self) -> Result<Vec<String>, WalkError> {
        Ok(sqlx::query_scalar("SELECT upgrade_id FROM upgrades WHERE state = 'running' ORDER BY created_at_ms")
            .fetch_all(self.registry.store().pool())
            .await
            .map_err(StoreError::from)?)
    }

    fn is_deposed(error: &WalkError) -> bool {
        matches!(error, WalkError::Deposed)
    }

    fn timed_out(limit: Duration) -> WalkError {
        WalkError::TimedOut(limit)
    }
}

/// What became of one in-flight node, from its row.
fn outcome(
    target: &Target,
    node: Option<&NodeRecord>,
    upgrade_id: &str,
    now: i64,
) -> Option<(NodeUpgradeState, String, String)> {
    let Some(node) = node else {
        return Some((NodeUpgradeState::Failed, "the node was forgotten".into(), String::new()));
    };
    if node.state == NodeState::Revoked {
        return Some((NodeUpgradeState::Failed, "the node was revoked".into(), String::new()));
    }
    match node.upgrade.as_deref() {
        Some(mark) if mark.upgrade_id == upgrade_id => match mark.state {
            NodeUpgradeState::Succeeded => {
                return Some((NodeUpgradeState::Succeeded, String::new(), mark.version.clone()));
            }
            NodeUpgradeState::Failed => return Some((NodeUpgradeState::Failed, mark.reason.clone(), String::new())),
            NodeUpgradeState::Upgrading if target.state == NodeUpgradeState::Started => {
                return Some((NodeUpgradeState::Upgrading, String::new(), String::new()));
            }
            _ => {}
        },
        _ => return Some((NodeUpgradeState::Failed, "the node was asked for another upgrade".into(), String::new())),
    }
    if node.state == NodeState::Down {
        return Some((NodeUpgradeState::Failed, "the node went DOWN during its upgrade".into(), String::new()));
    }
    let timeout = i64::try_from(NODE_UPGRADE_TIMEOUT.as_millis()).unwrap_or(i64::MAX);
    if target.started_at_ms.is_some_and(|at| now - at > timeout) {
        return Some((
            NodeUpgradeState::Failed,
            format!("no outcome reported within {}s", NODE_UPGRADE_TIMEOUT.as_secs()),
            String::new(),
        ));
    }
    None
}

/// One look at a rollout, in one transaction fenced on the term: records
/// what its in-flight nodes came to, pauses or finishes it, starts what
/// may start. Returns whether it still runs, and the node rows it wrote.
async fn step(store: &Store, fence: &Fence, upgrade_id: &str) -> Result<(bool, Vec<NodeRecord>), WalkError> {
    let now_sql = store.now_ms_sql();
    let (fence, id) = (fence.clone(), upgrade_id.to_owned());
    store
        .tx("upgrades.step", move |conn| {
            let (fence, id) = (fence.clone(), id.clone());
            Box::pin(async move {
                if !fence.holds(conn, now_sql).await.map_err(StoreError::from)? {
                    return Err(WalkError::Deposed);
                }
                let Some(mut upgrade) = load(conn, &id).await? else { return Ok((false, Vec::new())) };
                if upgrade.rollout.state != UpgradeState::Running {
                    return Ok((false, Vec::new()));
                }
                let now = berth_store::now_ms_in(conn, now_sql).await.map_err(StoreError::from)?;
                for target in &mut upgrade.targets {
                    if !target.state.in_flight() {
                        continue;
                    }
                    let node = registry::fetch(conn, &target.node_id).await?;
                    if let Some((state, reason, version)) = outcome(target, node.as_ref(), &id, now) {
                        set_target(conn, &id, target, state, &reason, &version, now).await?;
                    }
                }
                let rollout = &upgrade.rollout;
                let failed: Vec<&Target> =
                    upgrade.targets.iter().filter(|t| t.state == NodeUpgradeState::Failed).collect();
                if i64::try_from(failed.len()).unwrap_or(i64::MAX) > rollout.max_failures {
                    let last = failed.iter().max_by_key(|t| t.finished_at_ms).copied();
                    let reason = format!(
                        "{} node(s) failed, more than the {} tolerated; {}",
                        failed.len(),
                        rollout.max_failures,
                        last.map(|t| format!("node {}: {}", t.node_id, t.reason)).unwrap_or_default()
                    );
                    set_rollout(conn, &id, UpgradeState::Paused, &reason).await?;
                    tracing::warn!(upgrade_id = %id, %reason, "fleet upgrade paused");
                    return Ok((false, Vec::new()));
                }
                if upgrade.targets.iter().all(|t| t.state.is_final()) {
                    let reason = match failed.len() {
                        0 => String::new(),
                        n => format!("{n} node(s) failed, within the {} tolerated", rollout.max_failures),
                    };
                    set_rollout(conn, &id, UpgradeState::Done, &reason).await?;
                    tracing::info!(upgrade_id = %id, failed = failed.len(), "fleet upgrade done");
                    return Ok((false, Vec::new()));
                }
                let in_flight = upgrade.targets.iter().filter(|t| t.state.in_flight()).count();
                let mut slots = usize::try_from(rollout.max_unavailable).unwrap_or(1).saturating_sub(in_flight);
                let canaries_done =
                    upgrade.targets.iter().filter(|t| t.ordinal < rollout.canary).all(|t| t.state.is_final());
                let (artifact, canary) = (rollout.artifact.clone(), rollout.canary);
                let mut started = Vec::new();
                for target in &mut upgrade.targets {
                    if slots == 0 {
                        break;
                    }
                    if target.state != NodeUpgradeState::Pending || (!canaries_done && target.ordinal >= canary) {
                        continue;
                    }
                    let node = registry::fetch(conn, &target.node_id).await?;
                    let node = match node {
                        None => {
                            set_target(conn, &id, target, NodeUpgradeState::Failed, "the node was forgotten", "", now)
                                .await?;
                            continue;
                        }
                        Some(node) if node.state == NodeState::Revoked => {
                            set_target(conn, &id, target, NodeUpgradeState::Failed, "the node was revoked", "", now)
                                .await?;
                            continue;
                        }
                        Some(node) => node,
                    };
                    // A node that is not heard from waits for its return; one
                    // still at another rollout's upgrade waits for its end.
                    let busy = node.upgrade.as_deref().is_some_and(|m| m.upgrade_id != id && m.state.in_flight());
                    if !node.state.is_live() || busy {
                        continue;
                    }
                    let done = sqlx::query(
                        "UPDATE nodes SET upgrade_id = $2, upgrade_artifact = $3, upgrade_state = 'started', \
                         upgrade_reason = '', upgrade_version = '', revision = revision + 1 \
                         WHERE node_id = $1 AND incarnation = $4",
                    )
                    .bind(&node.node_id)
                    .bind(&id)
                    .bind(&artifact)
                    .bind(node.incarnation)
                    .execute(&mut *conn)
                    .await
                    .map_err(StoreError::from)?;
                    berth_store::expect_one(done.rows_affected(), &format!("node {}", node.node_id))?;
                    set_target(conn, &id, target, NodeUpgradeState::Started, "", "", now).await?;
                    if let Some(written) = registry::fetch(conn, &node.node_id).await? {
                        started.push(written);
                    }
                    tracing::info!(upgrade_id = %id, node_id = %node.node_id, "node upgrade started");
                    slots -= 1;
                }
                Ok((true, started))
            })
        })
        .await
}

async fn set_target(
    conn: &mut AnyConnection,
    upgrade_id: &str,
    target: &mut Target,
    state: NodeUpgradeState,
    reason: &str,
    version: &str,
    now: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE upgrade_nodes SET state = $3, reason = $4, version = $5, \
         started_at_ms = CASE WHEN $3 = 'started' THEN $6 ELSE started_at_ms END, \
         finished_at_ms = CASE WHEN $3 IN ('succeeded', 'failed') THEN $6 ELSE finished_at_ms END \
         WHERE upgrade_id = $1 AND node_id = $2",
    )
    .bind(upgrade_id)
    .bind(&target.node_id)
    .bind(state.as_str())
    .bind(reason)
    .bind(version)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    if matches!(state, NodeUpgradeState::Succeeded | NodeUpgradeState::Failed) {
        tracing::info!(%upgrade_id, node_id = %target.node_id, state = state.as_str(), %reason, "node upgrade finished");
    }
    target.state = state;
    reason.clone_into(&mut target.reason);
    version.clone_into(&mut target.version);
    if state == NodeUpgradeState::Started {
        target.started_at_ms = Some(now);
    }
    if state.is_final() {
        target.finished_at_ms = Some(now);
    }
    Ok(())
}

async fn set_rollout(
    conn: &mut AnyConnection,
    upgrade_id: &str,
    state: UpgradeState,
    reason: &str,
) -> Result<(), StoreError> {
    sqlx::query("UPDATE upgrades SET state = $2, reason = $3 WHERE upgrade_id = $1")
        .bind(upgrade_id)
        .bind(state.as_str())
        .bind(reason)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(to: &str) -> v1::UpgradeNodesRequest {
        v1::UpgradeNodesRequest { all: true, to: to.into(), ..Default::default() }
    }

    #[test]
    fn a_request_names_its_nodes_one_way_and_a_registry_artifact() {
        let both = v1::UpgradeNodesRequest { tier: "a".into(), ..request("r.example/agent:1") };
        assert!(UpgradeAsk::parse(both).unwrap_err().to_string().contains("exactly one of"));
        let none = v1::UpgradeNodesRequest { all: false, ..request("r.example/agent:1") };
        assert!(UpgradeAsk::parse(none).unwrap_err().to_string().contains("exactly one of"));
        assert!(UpgradeAsk::parse(request("")).unwrap_err().to_string().contains("invalid to"));
        assert!(UpgradeAsk::parse(request("oci:/tmp/layout:1")).unwrap_err().to_string().contains("registry"));
        let bad_id =
            v1::UpgradeNodesRequest { all: false, node_ids: vec!["No Such".into()], ..request("r.example/a:1") };
        assert!(UpgradeAsk::parse(bad_id).unwrap_err().to_string().contains("'No Such' is not a node id"));
        let ask = UpgradeAsk::parse(request("r.example/agent:1")).unwrap();
        assert_eq!((ask.max_unavailable, ask.canary, ask.max_failures), (1, 0, 0));
    }
}
