//! The node registry: the `nodes` rows, this replica's in-memory index of
//! them (the heartbeat's hot path and the source of `WatchNodes`), and the
//! events and resyncs that keep every replica's index level with the database.
//!
//! # What is stored
//! - `nodes` (PostgreSQL/SQLite, the truth): one row per joined host. Every
//!   write bumps `revision`, so an index applies a row only when it is newer
//!   than the one it holds, whatever order reads complete in.
//! - Bus deadline index [`NODE_DEADLINES`]: per node, when the monitor must
//!   next look at it (database clock, milliseconds). A heartbeat pushes it
//!   `down_after` ahead; the monitor sets it to the reap or forget time.
//! - Bus topic [`NODES_TOPIC`]: the id of every node whose row changed.
//!
//! # Who writes this
//! `join` inserts and rejoins rows, `session` brings them up and persists
//! heartbeat bookkeeping, `monitor` marks them down, reaps and forgets them,
//! `nodes_api` revokes and drains. Each fences its `UPDATE` on the state and
//! incarnation it read, then hands the committed row to
//! [`NodeRegistry::committed`], which applies it here and publishes its id.
//!
//! # Expected flow
//! Every replica runs one follower: it subscribes to [`NODES_TOPIC`], then
//! reads the whole table; each event re-reads one row, a `Gap` or every
//! `resync_every` re-reads them all. The index is level-triggered: a missed
//! event is healed by the next resync, never acted on from the payload.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use berth_bus::{Bus, BusMessage};
use berth_proto::identity::v1;
use berth_proto::types::v1::Capacity;
use berth_rpc::{CertificateFloor, Revocations};
use berth_store::{Store, StoreError};
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row as _};
use tokio::sync::broadcast;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::bookkeeping::{Beat, Bookkeeper, BookkeepingError};
use crate::config::NodeTiming;
use crate::deadlines::{DeadlineWriter, Due};

/// The bus deadline index of every node the monitor watches.
pub(crate) const NODE_DEADLINES: &str = "node-deadlines";

/// The bus topic carrying the ids of changed nodes.
pub(crate) const NODES_TOPIC: &str = "nodes";

/// How many index changes a `WatchNodes` stream may fall behind before it is
/// brought level again from a snapshot.
const CHANGE_BUFFER: usize = 1024;

/// How long the follower waits before subscribing again after the bus refused.
const RESUBSCRIBE_BACKOFF: Duration = Duration::from_secs(1);

/// Every column of `nodes`, in [`NodeRecord::from_row`] order.
macro_rules! node_columns {
    () => {
        "node_id, name, tier, advertise_addr, state, incarnation, revision, labels_json, version, \
         capacity_cpu_millis, capacity_memory_bytes, usage_cpu_millis, usage_memory_bytes, join_token_id, \
         joined_at_ms, state_changed_at_ms, last_heartbeat_at_ms, certificate_expires_at_ms, drained_at_ms, \
         reaped_at_ms, revoked_at_ms, revoked_reason, certificate_floor_s, certificate_next_floor_s, \
         certificate_floor_moves_at_ms, drain_deadline_ms, upgrade_id, upgrade_artifact, upgrade_state, \
         upgrade_reason, upgrade_version"
    };
}

/// Every column of `nodes`, for statements built at run time.
pub(crate) const NODE_COLUMNS: &str = node_columns!();

/// Where a node is in its life, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum NodeState {
    /// Joined (or rejoined); its first heartbeat has not arrived.
    Joining,
    /// Heartbeating; leases may be placed on it.
    Up,
    /// Silent past the grace.
    Down,
    /// Heartbeating under an operator's drain.
    Draining,
    /// Revoked by an operator. Final.
    Revoked,
}

impl NodeState {
    /// The stored spelling.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Joining => "joining",
            Self::Up => "up",
            Self::Down => "down",
            Self::Draining => "draining",
            Self::Revoked => "revoked",
        }
    }

    fn parse(stored: &str) -> Result<Self, StoreError> {
        Ok(match stored {
            "joining" => Self::Joining,
            "up" => Self::Up,
            "down" => Self::Down,
            "draining" => Self::Draining,
            "revoked" => Self::Revoked,
            other => return Err(StoreError::internal(format!("node row holds unknown state {other:?}"))),
        })
    }

    /// The state on the wire.
    pub(crate) fn to_proto(self) -> v1::NodeState {
        match self {
            Self::Joining => v1::NodeState::Joining,
            Self::Up => v1::NodeState::Up,
            Self::Down => v1::NodeState::Down,
            Self::Draining => v1::NodeState::Draining,
            Self::Revoked => v1::NodeState::Revoked,
        }
    }

    /// A state filter from the wire: `Ok(None)` for unspecified, `Err` for a
    /// number the API does not define.
    pub(crate) fn from_proto(value: i32) -> Result<Option<Self>, i32> {
        match v1::NodeState::try_from(value) {
            Ok(v1::NodeState::Unspecified) => Ok(None),
            Ok(v1::NodeState::Joining) => Ok(Some(Self::Joining)),
            Ok(v1::NodeState::Up) => Ok(Some(Self::Up)),
            Ok(v1::NodeState::Down) => Ok(Some(Self::Down)),
            Ok(v1::NodeState::Draining) => Ok(Some(Self::Draining)),
            Ok(v1::NodeState::Revoked) => Ok(Some(Self::Revoked)),
            Err(_) => Err(value),
        }
    }

    /// Whether the node is heard from and counted as present (`UP` or `DRAINING`).
    pub(crate) fn is_live(self) -> bool {
        matches!(self, Self::Up | Self::Draining)
    }

    /// Whether the monitor expects heartbeats from the node.
    pub(crate) fn is_watched(self) -> bool {
        matches!(self, Self::Joining | Self::Up | Self::Draining)
    }
}

/// One `nodes` row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NodeRecord {
    pub(crate) node_id: String,
    pub(crate) name: String,
    pub(crate) tier: String,
    pub(crate) advertise_addr: String,
    pub(crate) state: NodeState,
    pub(crate) incarnation: i64,
    pub(crate) revision: i64,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) version: String,
    pub(crate) capacity: Capacity,
    pub(crate) usage: Capacity,
    pub(crate) join_token_id: String,
    pub(crate) joined_at_ms: i64,
    pub(crate) state_changed_at_ms: i64,
    pub(crate) last_heartbeat_at_ms: Option<i64>,
    pub(crate) certificate_expires_at_ms: i64,
    /// Which of its certificates are still the node's (see [`CertificateFloor`]).
    pub(crate) certificate_floor: CertificateFloor,
    pub(crate) drained: bool,
    /// While drained with a deadline: when what is left on it is released.
    pub(crate) drain_deadline_ms: Option<i64>,
    pub(crate) reaped_at_ms: Option<i64>,
    pub(crate) revoked_at_ms: Option<i64>,
    pub(crate) revoked_reason: String,
    /// The node's latest fleet upgrade; `None` when it was never asked to upgrade.
    pub(crate) upgrade: Option<Box<NodeUpgradeMark>>,
}

/// A node's latest fleet upgrade: what it was asked for, and what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeUpgradeMark {
    pub(crate) upgrade_id: String,
    /// The artifact, pinned to its digest.
    pub(crate) artifact: String,
    pub(crate) state: NodeUpgradeState,
    pub(crate) reason: String,
    pub(crate) version: String,
}

impl NodeRecord {
    /// Decodes a row selected with [`node_columns!`].
    pub(crate) fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let labels_json: String = row.try_get("labels_json")?;
        let labels = serde_json::from_str(&labels_json)
            .map_err(|e| StoreError::Internal { context: "decoding node labels".into(), source: Some(Box::new(e)) })?;
        let drained_at_ms: Option<i64> = row.try_get("drained_at_ms")?;
        Ok(Self {
            node_id: row.try_get("node_id")?,
            name: row.try_get("name")?,
            tier: row.try_get("tier")?,
            advertise_addr: row.try_get("advertise_addr")?,
            state: NodeState::parse(&row.try_get::<String, _>("state")?)?,
            incarnation: row.try_get("incarnation")?,
            revision: row.try_get("revision")?,
            labels,
            version: row.try_get("version")?,
            capacity: Capacity {
                cpu_millis: from_column(row.try_get("capacity_cpu_millis")?),
                memory_bytes: from_column(row.try_get("capacity_memory_bytes")?),
            },
            usage: Capacity {
                cpu_millis: from_column(row.try_get("usage_cpu_millis")?),
                memory_bytes: from_column(row.try_get("usage_memory_bytes")?),
            },
            join_token_id: row.try_get("join_token_id")?,
            joined_at_ms: row.try_get("joined_at_ms")?,
            state_changed_at_ms: row.try_get("state_changed_at_ms")?,
            last_heartbeat_at_ms: row.try_get("last_heartbeat_at_ms")?,
            certificate_expires_at_ms: row.try_get("certificate_expires_at_ms")?,
            certificate_floor: CertificateFloor {
                floor_s: row.try_get("certificate_floor_s")?,
                next_s: row.try_get("certificate_next_floor_s")?,
                moves_at_ms: row.try_get("certificate_floor_moves_at_ms")?,
            },
            drained: drained_at_ms.is_some(),
            drain_deadline_ms: row.try_get("drain_deadline_ms")?,
            reaped_at_ms: row.try_get("reaped_at_ms")?,
            revoked_at_ms: row.try_get("revoked_at_ms")?,
            revoked_reason: row.try_get("revoked_reason")?,
            upgrade: {
                let upgrade_id: String = row.try_get("upgrade_id")?;
                if upgrade_id.is_empty() {
                    None
                } else {
                    Some(Box::new(NodeUpgradeMark {
                        upgrade_id,
                        artifact: row.try_get("upgrade_artifact")?,
                        state: NodeUpgradeState::parse(&row.try_get::<String, _>("upgrade_state")?)?,
                        reason: row.try_get("upgrade_reason")?,
                        version: row.try_get("upgrade_version")?,
                    }))
                }
            },
        })
    }

    /// The node as the API shows it.
    pub(crate) fn to_proto(&self) -> v1::Node {
        v1::Node {
            node_id: self.node_id.clone(),
            name: self.name.clone(),
            tier: self.tier.clone(),
            advertise_addr: self.advertise_addr.clone(),
            state: self.state.to_proto() as i32,
            incarnation: u64::try_from(self.incarnation).unwrap_or_default(),
            last_heartbeat_at: self.last_heartbeat_at_ms.map(timestamp),
            capacity: Some(self.capacity),
            version: self.version.clone(),
            labels: self.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            joined_at: Some(timestamp(self.joined_at_ms)),
            usage: Some(self.usage),
            state_changed_at: Some(timestamp(self.state_changed_at_ms)),
            certificate_expires_at: Some(timestamp(self.certificate_expires_at_ms)),
            join_token_id: self.join_token_id.clone(),
            certificate_floor: (self.certificate_floor.floor_s > 0)
                .then(|| timestamp(self.certificate_floor.floor_s.saturating_mul(1000))),
            certificate_next_floor: (self.certificate_floor.next_s > 0)
                .then(|| timestamp(self.certificate_floor.next_s.saturating_mul(1000))),
            certificate_floor_moves_at: (self.certificate_floor.next_s > 0)
                .then(|| timestamp(self.certificate_floor.moves_at_ms)),
            drain_deadline: self.drain_deadline_ms.filter(|_| self.drained).map(timestamp),
            upgrade: self.upgrade.as_deref().map(|mark| v1::NodeUpgradeStatus {
                upgrade_id: mark.upgrade_id.clone(),
                artifact: mark.artifact.clone(),
                state: mark.state.to_proto() as i32,
                reason: mark.reason.clone(),
            }),
        }
    }

    /// The host part of the advertise address: the extra name the node's
    /// certificate carries so the control plane can verify its agent API.
    pub(crate) fn advertise_host(&self) -> String {
        advertise_host(&self.advertise_addr)
    }
}

/// The host part of `host:port` (IPv6 without its brackets).
pub(crate) fn advertise_host(addr: &str) -> String {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']').to_owned()
}

/// A stored amount: counters are `u64` on the wire and `BIGINT` in the database.
pub(crate) fn to_column(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn from_column(value: i64) -> u64 {
    u64::try_from(value).unwrap_or_default()
}

pub(crate) use berth_proto::timestamp_from_ms as timestamp;

/// Labels as stored.
pub(crate) fn labels_json(labels: &BTreeMap<String, String>) -> Result<String, StoreError> {
    serde_json::to_string(labels)
        .map_err(|e| StoreError::Internal { context: "encoding labels".into(), source: Some(Box::new(e)) })
}

/// The row of `node_id`, read inside the caller's transaction.
pub(crate) async fn fetch(conn: &mut AnyConnection, node_id: &str) -> Result<Option<NodeRecord>, StoreError> {
    let row = sqlx::query(concat!("SELECT ", node_columns!(), " FROM nodes WHERE node_id = $1"))
        .bind(node_id)
        .fetch_optional(&mut *conn)
        .await?;
    row.as_ref().map(NodeRecord::from_row).transpose()
}

/// The nodes matching the filters, ordered by node id.
pub(crate) async fn list(
    store: &Store,
    tier: Option<&str>,
    state: Option<NodeState>,
) -> Result<Vec<NodeRecord>, StoreError> {
    let mut nodes = Vec::new();
    for_each(store, tier, state, |node| nodes.push(node)).await?;
    Ok(nodes)
}

/// Hands each node matching the filters to `each`, in node-id order, as its
/// row arrives. A whole fleet is never held as rows: each row is decoded and
/// dropped before the next is read (at 10,000 nodes, the rows of a full read
/// held at once took about 20 MB beside the records).
pub(crate) async fn for_each(
    store: &Store,
    tier: Option<&str>,
    state: Option<NodeState>,
    mut each: impl FnMut(NodeRecord),
) -> Result<(), StoreError> {
    // An empty string means "no filter" so one statement serves every combination.
    let mut rows = sqlx::query(concat!(
        "SELECT ",
        node_columns!(),
        " FROM nodes WHERE ($1 = '' OR tier = $1) AND ($2 = '' OR state = $2) ORDER BY node_id"
    ))
    .bind(tier.unwrap_or(""))
    .bind(state.map_or("", NodeState::as_str))
    .fetch(store.pool());
    while let Some(row) = rows.next().await {
        each(NodeRecord::from_row(&row.map_err(StoreError::from)?)?);
    }
    Ok(())
}

/// A change to this replica's index, as `WatchNodes` streams it.
#[derive(Debug, Clone)]
pub(crate) enum NodeChange {
    /// The node is new or changed; its whole row.
    Upsert(Arc<NodeRecord>),
    /// The node was forgotten; its last known row.
    Removed(Arc<NodeRecord>),
}

impl NodeChange {
    /// The node the change is about.
    pub(crate) fn record(&self) -> &NodeRecord {
        match self {
            Self::Upsert(record) | Self::Removed(record) => record,
        }
    }
}

/// The registry of one replica: its store, bus, timing and index. Cheap to
/// clone; clones share everything.
#[derive(Debug, Clone)]
pub(crate) struct NodeRegistry {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// This replica's name, unique among identity's replicas.
    replica_id: String,
    store: Store,
    bus: Bus,
    timing: NodeTiming,
    index: RwLock<Index>,
    changes: broadcast::Sender<NodeChange>,
    /// Serializes full reloads so two never interleave their removals.
    resyncing: tokio::sync::Mutex<()>,
    /// When this replica last wrote (or queued) each node's heartbeat bookkeeping.
    persisted: Mutex<HashMap<String, Instant>>,
    /// Writes steady nodes' bookkeeping in batches.
    bookkeeper: Bookkeeper,
    /// Moves steady nodes' deadlines in batches.
    deadlines: DeadlineWriter,
    /// The database clock minus this host's, as last measured.
    clock_offset_ms: AtomicI64,
    /// Cancelled when the replica shuts down; ends `WatchNodes` streams.
    closing: CancellationToken,
    /// The revoked nodes identity's own server refuses on every RPC.
    revocations: Revocations,
}

#[derive(Debug, Default)]
struct Index {
    nodes: HashMap<String, Indexed>,
    /// Counts applications, so a resync removes only what it read after.
    applied: u64,
    loaded: bool,
}

#[derive(Debug)]
struct Indexed {
    record: Arc<NodeRecord>,
    /// The value of [`Index::applied`] when this row was taken in.
    applied: u64,
}

impl NodeRegistry {
    /// A registry over `store` and `bus` with an empty index; it loads on
    /// first need or when the follower starts.
    pub(crate) fn new(store: Store, bus: Bus, timing: NodeTiming) -> Self {
        Self {
            inner: Arc::new(Inner {
                replica_id: berth_runtime::replica_id("identity"),
                store,
                bus,
                timing,
                index: RwLock::default(),
                changes: broadcast::channel(CHANGE_BUFFER).0,
                resyncing: tokio::sync::Mutex::new(()),
                persisted: Mutex::default(),
                bookkeeper: Bookkeeper::default(),
                deadlines: DeadlineWriter::default(),
                clock_offset_ms: AtomicI64::new(0),
                closing: CancellationToken::new(),
                revocations: Revocations::new(),
            }),
        }
    }

    /// This replica's name, unique among identity's replicas.
    pub(crate) fn replica_id(&self) -> &str {
        &self.inner.replica_id
    }

    pub(crate) fn store(&self) -> &Store {
        &self.inner.store
    }

    pub(crate) fn bus(&self) -> &Bus {
        &self.inner.bus
    }

    pub(crate) fn timing(&self) -> &NodeTiming {
        &self.inner.timing
    }

    /// The revoked nodes, kept level with the index, for the access layer.
    pub(crate) fn revocations(&self) -> &Revocations {
        &self.inner.revocations
    }

    /// Cancelled when the replica shuts down.
    pub(crate) fn closing(&self) -> &CancellationToken {
        &self.inner.closing
    }

    /// The database clock as this host estimates it, in epoch milliseconds:
    /// bus deadlines are compared on it, so replicas on skewed hosts agree.
    pub(crate) fn now_ms(&self) -> i64 {
        berth_runtime::wall_clock_ms().saturating_add(self.inner.clock_offset_ms.load(Ordering::Relaxed))
    }

    /// Measures the database clock against this host's.
    async fn measure_clock(&self) -> Result<(), StoreError> {
        let before = berth_runtime::wall_clock_ms();
        let database = self.inner.store.now_ms().await?;
        let after = berth_runtime::wall_clock_ms();
        let offset = database - (before + (after - before) / 2);
        self.inner.clock_offset_ms.store(offset, Ordering::Relaxed);
        Ok(())
    }

    /// The indexed row of `node_id`, falling back to the database for a node
    /// this replica has not heard of yet.
    pub(crate) async fn lookup(&self, node_id: &str) -> Result<Option<Arc<NodeRecord>>, StoreError> {
        if let Some(entry) = self.read_index().nodes.get(node_id) {
            return Ok(Some(Arc::clone(&entry.record)));
        }
        // Boxed: a miss reads the database, and the future of every
        // heartbeat in flight would otherwise carry room for that read.
        Box::pin(self.refresh(node_id)).await
    }

    /// Re-reads one row and applies what it finds; the row as indexed now.
    pub(crate) async fn refresh(&self, node_id: &str) -> Result<Option<Arc<NodeRecord>>, StoreError> {
        let row = sqlx::query(concat!("SELECT ", node_columns!(), " FROM nodes WHERE node_id = $1"))
            .bind(node_id)
            .fetch_optional(self.inner.store.pool())
            .await
            .map_err(StoreError::from)?;
        match row.as_ref().map(NodeRecord::from_row).transpose()? {
            Some(record) => Ok(Some(self.apply(record))),
            None => {
                self.apply_removed(node_id);
                Ok(None)
            }
        }
    }

    /// Applies a row this replica has just committed and tells the other replicas.
    pub(crate) async fn committed(&self, record: NodeRecord) -> Arc<NodeRecord> {
        let node_id = record.node_id.clone();
        let applied = self.apply(record);
        self.publish(&node_id).await;
        applied
    }

    /// Drops a row this replica has just deleted and tells the other replicas.
    pub(crate) async fn deleted(&self, node_id: &str) {
        self.apply_removed(node_id);
        self.inner.persisted.lock().unwrap_or_else(PoisonError::into_inner).remove(node_id);
        self.publish(node_id).await;
    }

    /// Applies a row read or written here without telling the other replicas:
    /// nothing they act on changed, and their resync picks it up.
    pub(crate) fn remember(&self, record: NodeRecord) -> Arc<NodeRecord> {
        self.apply(record)
    }

    async fn publish(&self, node_id: &str) {
        if let Err(error) = self.inner.bus.publish(NODES_TOPIC, node_id.as_bytes().to_vec()).await {
            // The other replicas' resync picks the change up instead.
            tracing::warn!(%node_id, %error, "publishing a node change failed");
        }
    }

    /// Takes `record` into the index unless the index holds the same or a newer revision.
    fn apply(&self, record: NodeRecord) -> Arc<NodeRecord> {
        let mut index = self.write_index();
        if let Some(current) = index.nodes.get(&record.node_id)
            && current.record.revision >= record.revision
        {
            return Arc::clone(&current.record);
        }
        if record.state == NodeState::Revoked {
            self.inner.revocations.revoke(&record.node_id);
        }
        self.inner.revocations.set_floor(&record.node_id, record.certificate_floor);
        let record = Arc::new(record);
        index.applied += 1;
        let applied = index.applied;
        index.nodes.insert(record.node_id.clone(), Indexed { record: Arc::clone(&record), applied });
        // No receivers is fine: nobody is watching.
        let _ = self.inner.changes.send(NodeChange::Upsert(Arc::clone(&record)));
        record
    }

    fn apply_removed(&self, node_id: &str) {
        let mut index = self.write_index();
        if let Some(last) = index.nodes.remove(node_id) {
            self.inner.revocations.set_floor(node_id, CertificateFloor::default());
            let _ = self.inner.changes.send(NodeChange::Removed(last.record));
        }
    }

    /// Re-reads every row, applies what changed and drops what is gone.
    pub(crate) async fn resync(&self) -> Result<(), StoreError> {
        let _one_at_a_time = self.inner.resyncing.lock().await;
        if let Err(error) = self.measure_clock().await {
            tracing::debug!(%error, "measuring the database clock failed; keeping the last offset");
        }
        let read_after = self.read_index().applied;
        let mut present: HashSet<String> = HashSet::new();
        for_each(&self.inner.store, None, None, |record| {
            present.insert(record.node_id.clone());
            self.apply(record);
        })
        .await?;
        let mut index = self.write_index();
        // A row taken in while the table was being read may be newer than the read.
        let gone: Vec<String> = index
            .nodes
            .iter()
            .filter(|(id, entry)| entry.applied <= read_after && !present.contains(*id))
            .map(|(id, _)| id.clone())
            .collect();
        for node_id in gone {
            if let Some(last) = index.nodes.remove(&node_id) {
                let _ = self.inner.changes.send(NodeChange::Removed(last.record));
            }
        }
        let revoked = index.nodes.values().filter(|e| e.record.state == NodeState::Revoked);
        self.inner.revocations.replace(revoked.map(|e| e.record.node_id.clone()).collect());
        let floors = index.nodes.values().map(|e| (e.record.node_id.clone(), e.record.certificate_floor));
        self.inner
            .revocations
            .replace_floors(floors.filter(|(_, floor)| *floor != CertificateFloor::default()).collect());
        index.loaded = true;
        Ok(())
    }

    /// Loads the index if nothing has yet.
    async fn ensure_loaded(&self) -> Result<(), StoreError> {
        if self.read_index().loaded {
            return Ok(());
        }
        self.resync().await
    }

    /// Every indexed node, and the changes after that snapshot: nothing is
    /// missed or repeated between the two.
    pub(crate) async fn watch(&self) -> Result<(Vec<Arc<NodeRecord>>, broadcast::Receiver<NodeChange>), StoreError> {
        self.ensure_loaded().await?;
        Ok(self.snapshot())
    }

    /// The index now and a receiver of every change after it.
    pub(crate) fn snapshot(&self) -> (Vec<Arc<NodeRecord>>, broadcast::Receiver<NodeChange>) {
        let index = self.read_index();
        let receiver = self.inner.changes.subscribe();
        let mut nodes: Vec<_> = index.nodes.values().map(|e| Arc::clone(&e.record)).collect();
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        (nodes, receiver)
    }

    /// Whether this replica should write `node_id`'s heartbeat bookkeeping now.
    pub(crate) fn persist_due(&self, node_id: &str) -> bool {
        let persisted = self.inner.persisted.lock().unwrap_or_else(PoisonError::into_inner);
        persisted.get(node_id).is_none_or(|at| at.elapsed() >= self.inner.timing.persist_every)
    }

    /// Notes that `node_id`'s bookkeeping was just written.
    pub(crate) fn mark_persisted(&self, node_id: &str) {
        self.inner.persisted.lock().unwrap_or_else(PoisonError::into_inner).insert(node_id.to_owned(), Instant::now());
    }

    /// Marks `node_id`'s bookkeeping as not written, so its next heartbeat writes it.
    pub(crate) fn forget_persisted(&self, node_id: &str) {
        self.inner.persisted.lock().unwrap_or_else(PoisonError::into_inner).remove(node_id);
    }

    /// Hands a steady node's bookkeeping to the batch writer and marks it
    /// written; `false` when the writer cannot take it and the caller must
    /// write it itself.
    pub(crate) fn queue_bookkeeping(&self, beat: Beat) -> bool {
        let node_id = beat.node_id.clone();
        if !self.inner.bookkeeper.offer(beat) {
            return false;
        }
        self.mark_persisted(&node_id);
        true
    }

    /// Starts the bookkeeping and deadline writers until `shutdown` (once per registry).
    pub(crate) fn spawn_writers(&self, shutdown: &CancellationToken) {
        let registry = self.clone();
        self.inner.bookkeeper.spawn(
            move |batch| {
                let registry = registry.clone();
                async move { registry.write_bookkeeping(&batch).await }
            },
            shutdown,
        );
        let registry = self.clone();
        self.inner.deadlines.spawn(
            move |batch| {
                let registry = registry.clone();
                async move { registry.set_deadlines(&batch).await }
            },
            shutdown,
        );
    }

    /// Writes a batch of beats in one transaction and keeps what it wrote;
    /// on failure its nodes are due again (the next heartbeats retry).
    async fn write_bookkeeping(&self, batch: &[Beat]) {
        match write_beats(self.store(), batch).await {
            Ok(written) => {
                for record in written {
                    self.remember(record);
                }
            }
            Err(error) => {
                tracing::warn!(nodes = batch.len(), %error, "writing heartbeat bookkeeping failed; the next heartbeats retry");
                for beat in batch {
                    self.forget_persisted(&beat.node_id);
                }
            }
        }
    }

    /// Moves a steady node's deadline through the batch writer, or at once
    /// when the writer cannot take it.
    pub(crate) async fn queue_deadline(&self, node_id: &str, at_ms: i64) {
        if let Err((node_id, at_ms)) = self.inner.deadlines.offer((node_id.to_owned(), at_ms)) {
            // Boxed, as the rare path: a steady heartbeat's future stays small.
            Box::pin(self.set_deadline(&node_id, at_ms)).await;
        }
    }

    /// Moves a batch of deadlines in one round trip. Best effort, like
    /// [`Self::set_deadline`].
    pub(crate) async fn set_deadlines(&self, batch: &[Due]) {
        if let Err(error) = self.inner.bus.deadline_set_many(NODE_DEADLINES, batch).await {
            tracing::warn!(nodes = batch.len(), %error, "setting node deadlines failed; the monitor restores them");
        }
    }

    /// Sets when the monitor next looks at `node_id`. Best effort: a lost
    /// deadline is restored by the monitor's rebuild.
    pub(crate) async fn set_deadline(&self, node_id: &str, at_ms: i64) {
        if let Err(error) = self.inner.bus.deadline_set(NODE_DEADLINES, node_id, at_ms).await {
            tracing::warn!(%node_id, %error, "setting a node deadline failed; the monitor restores it");
        }
    }

    /// Stops the monitor looking at `node_id`. Best effort: the monitor drops
    /// deadlines of nodes that need none when they come due.
    pub(crate) async fn clear_deadline(&self, node_id: &str) {
        if let Err(error) = self.inner.bus.deadline_remove(NODE_DEADLINES, node_id).await {
            tracing::warn!(%node_id, %error, "removing a node deadline failed; the monitor drops it when due");
        }
    }

    /// Starts the follower that keeps the index level with the database
    /// until `shutdown`, and ends every watch stream then.
    pub(crate) fn spawn_follower(&self, shutdown: &CancellationToken) {
        let registry = self.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            registry.follow(&shutdown).await;
            registry.inner.closing.cancel();
        });
    }

    async fn follow(&self, shutdown: &CancellationToken) {
        let every = self.inner.timing.resync_every;
        let mut last_resync: Option<tokio::time::Instant> = None;
        loop {
            let subscribed = tokio::select! {
                () = shutdown.cancelled() => return,
                subscribed = self.inner.bus.subscribe(NODES_TOPIC) => subscribed,
            };
            let mut subscription = match subscribed {
                Ok(subscription) => subscription,
                Err(error) => {
                    tracing::warn!(%error, "subscribing to node changes failed; retrying, and resyncing on a timer meanwhile");
                    if last_resync.is_none_or(|at| at.elapsed() >= every) {
                        self.resync_logged().await;
                        last_resync = Some(tokio::time::Instant::now());
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(RESUBSCRIBE_BACKOFF.min(every)) => continue,
                    }
                }
            };
            // Read everything only once subscribed, so no change falls between the two.
            self.resync_logged().await;
            let mut next_resync = tokio::time::Instant::now() + every;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep_until(next_resync) => {
                        self.resync_logged().await;
                        next_resync = tokio::time::Instant::now() + every;
                    }
                    message = subscription.recv() => match message {
                        Some(BusMessage::Payload(payload)) => self.refresh_from_event(&payload).await,
                        Some(BusMessage::Gap) => {
                            self.resync_logged().await;
                            next_resync = tokio::time::Instant::now() + every;
                        }
                        None => break,
                    },
                }
            }
            last_resync = Some(tokio::time::Instant::now());
        }
    }

    async fn refresh_from_event(&self, payload: &[u8]) {
        let Ok(node_id) = std::str::from_utf8(payload) else {
            tracing::warn!("ignoring a node change event that is not a node id");
            return;
        };
        if let Err(error) = self.refresh(node_id).await {
            tracing::warn!(%node_id, %error, "re-reading a changed node failed; the next resync retries");
        }
    }

    async fn resync_logged(&self) {
        if let Err(error) = self.resync().await {
            tracing::warn!(%error, "re-reading the node registry failed; retrying at the next resync");
        }
    }

    fn read_index(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.inner.index.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_index(&self) -> std::sync::RwLockWriteGuard<'_, Index> {
        self.inner.index.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Writes every beat of `batch` in one transaction; the rows it changed.
async fn write_beats(store: &Store, batch: &[Beat]) -> Result<Vec<NodeRecord>, BookkeepingError> {
    let update = format!(
        "UPDATE nodes SET last_heartbeat_at_ms = $3, revision = revision + 1, \
         usage_cpu_millis = COALESCE($4, usage_cpu_millis), usage_memory_bytes = COALESCE($5, usage_memory_bytes) \
         WHERE node_id = $1 AND incarnation = $2 AND state IN ('up', 'draining') \
         AND (last_heartbeat_at_ms IS NULL OR last_heartbeat_at_ms < $3) \
         RETURNING {NODE_COLUMNS}"
    );
    let update = update.as_str();
    store
        .tx("nodes.heartbeat_bookkeeping", |conn| {
            Box::pin(async move {
                let mut written = Vec::with_capacity(batch.len());
                for beat in batch {
                    let row = sqlx::query(sqlx::AssertSqlSafe(update))
                        .bind(&beat.node_id)
                        .bind(beat.incarnation)
                        .bind(beat.at_ms)
                        .bind(beat.usage.map(|u| to_column(u.cpu_millis)))
                        .bind(beat.usage.map(|u| to_column(u.memory_bytes)))
                        .fetch_optional(&mut *conn)
                        .await?;
                    if let Some(row) = row {
                        written.push(NodeRecord::from_row(&row)?);
                    }
                }
                Ok(written)
            })
        })
        .await
}

/// Where one node is in an upgrade, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeUpgradeState {
    Pending,
    Started,
    Upgrading,
    Succeeded,
    Failed,
}

impl NodeUpgradeState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Started => "started",
            Self::Upgrading => "upgrading",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }

    pub(crate) fn parse(stored: &str) -> Result<Self, StoreError> {
        Ok(match stored {
            "pending" => Self::Pending,
            "started" => Self::Started,
            "upgrading" => Self::Upgrading,
            "succeeded" => Self::Succeeded,
            "failed" => Self::Failed,
            other => return Err(StoreError::internal(format!("an upgrade row holds unknown state {other:?}"))),
        })
    }

    pub(crate) fn to_proto(self) -> v1::NodeUpgradeState {
        match self {
            Self::Pending => v1::NodeUpgradeState::Pending,
            Self::Started => v1::NodeUpgradeState::Started,
            Self::Upgrading => v1::NodeUpgradeState::Upgrading,
            Self::Succeeded => v1::NodeUpgradeState::Succeeded,
            Self::Failed => v1::NodeUpgradeState::Failed,
        }
    }

    /// What a node may report: `UPGRADING`, `SUCCEEDED` or `FAILED`.
    pub(crate) fn reported(value: i32) -> Option<Self> {
        match v1::NodeUpgradeState::try_from(value).ok()? {
            v1::NodeUpgradeState::Upgrading => Some(Self::Upgrading),
            v1::NodeUpgradeState::Succeeded => Some(Self::Succeeded),
            v1::NodeUpgradeState::Failed => Some(Self::Failed),
            _ => None,
        }
    }

    /// Whether the node is done with it, one way or the other.
    pub(crate) fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }

    /// Whether the node is at it now.
    pub(crate) fn in_flight(self) -> bool {
        matches!(self, Self::Started | Self::Upgrading)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_round_trips_through_its_stored_spelling() {
        for state in [NodeState::Joining, NodeState::Up, NodeState::Down, NodeState::Draining, NodeState::Revoked] {
            assert_eq!(NodeState::parse(state.as_str()).unwrap(), state);
            assert_eq!(NodeState::from_proto(state.to_proto() as i32), Ok(Some(state)));
        }
        assert!(NodeState::parse("gone").is_err());
        assert_eq!(NodeState::from_proto(0), Ok(None));
        assert_eq!(NodeState::from_proto(42), Err(42));
    }

    #[test]
    fn advertise_host_drops_the_port_and_ipv6_brackets() {
        assert_eq!(advertise_host("10.0.0.7:7450"), "10.0.0.7");
        assert_eq!(advertise_host("host-a.example:7450"), "host-a.example");
        assert_eq!(advertise_host("[::1]:7450"), "::1");
    }
}
