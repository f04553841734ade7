//! The ledger in the database: every read and write of leases and node rows,
//! each one transaction through [`Store::tx`], and the one error every lease
//! operation returns.
//!
//! # Who writes this
//! - The placer: inserts leases and adds them to their node rows, a batch per
//!   transaction.
//! - Nodes (`ReportPhase`, `RenewLeases`, `ReconcileNode`, `AssumeCustody`),
//!   on their own leases only.
//! - Requesters (`ReleaseLease`).
//! - The elected reaper: expiry, fenced on its term, and forgetting final
//!   leases past their retention.
//!
//! # Invariants
//! - A node row's allocation is the sum of the resources of the open leases
//!   placed on the node: every move between open and final goes through
//!   [`apply`], which adjusts the row in the same transaction.
//! - Placement adds to a node row only `WHERE cpu_allocated + $cpu <= $total
//!   AND memory_allocated + $memory <= $total`, so two replicas placing at once
//!   never over-commit a node: on PostgreSQL the `SERIALIZABLE` transaction that
//!   read a row another one changed is rolled back and placed again.
//! - Every write about a lease is fenced `WHERE lease_id = $1 AND epoch = $2
//!   AND phase = $3` on what the same transaction read; a node's write also
//!   checks the lease is its own.
//! - A change a node must act on (placement, a new epoch, leaving the open
//!   phases) moves the node's `assignment_cursor` in the same transaction and
//!   stamps the lease's `seq` with it, so streams read a node's changes in
//!   commit order.
//! - Every change a lease watcher sees (an insert; phase, epoch, node or
//!   reason moved) stamps the lease's `change_seq`, by a trigger in the
//!   schema so that no write path can forget it (see migration 3): a
//!   watch's cursor finds every change made since it read. No node row or
//!   other shared row is written for it, so writers to different nodes
//!   still never wait on each other.
//!
//! # Reconcile and custody
//! `ReconcileNode(running)`: a listed `(lease, epoch)` is to be destroyed
//! unless an open lease placed on the node has that id at that epoch; a
//! `RUNNING` lease on the node not listed at its current epoch becomes
//! `FAILED`, reason `NodeLost`. `BOUND` and `LAUNCHING` leases are never
//! failed here: the node may not have started them yet.
//!
//! `AssumeCustody(lease, epoch)`: the lease must be the caller's and at
//! `epoch`. An open lease becomes `RUNNING` at `epoch + 1`; an `EXPIRED` one
//! does too if it expired at most `custody_window` ago and its node still has
//! room (its capacity is reserved again, checked in SQL as at placement).
//! Either way the reason is `CustodyAssumed` and the lease lives a full TTL
//! from now. Anything else is refused and the workload is the node's to
//! destroy. Custody beats expiry because a launch whose report was lost is
//! still running work; the new epoch fences whatever the node's previous
//! incarnation still had in flight.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use berth_proto::leases::v1;
use berth_store::{Backend, Store, StoreError, Term, expect_one};
use prost::Message as _;
use ring::hmac;
use sqlx::AnyConnection;

use crate::config::{LeasesConfig, millis};
use crate::model::{OPEN_PHASES_SQL, Phase, Resize, ResizeState, Resources};
use crate::placement::{Placement, PlacementNode, PlacementRequest, RuntimeNeed, Shortage, place};
use crate::records::{LeaseRecord, NodeLedgerRow, format_ports, lease_columns, to_column};

/// The name the reaper's leadership is held under.
pub const REAPER_LOOP: &str = "leases.reaper";

use berth_core::NODE_DRAINING as DRAINING;

/// The reason a lease still open on a drained node is released with once the
/// drain's deadline passed.
const DRAINED: &str = "NodeDrained";

/// The final phases as an SQL list.
const FINAL_PHASES_SQL: &str = "('done', 'failed', 'released', 'expired')";

/// Rows one multi-row statement carries, well under both backends' parameter limits.
const ROWS_PER_STATEMENT: usize = 200;

/// How long a launch registration can be spent: a launch signs its first
/// workload certificate within seconds of registering.
pub(crate) const LAUNCH_REGISTRATION_TTL: std::time::Duration = std::time::Duration::from_secs(120);

/// Why a lease operation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LeaseError {
    /// A request field is missing or malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The request field.
        field: &'static str,
        /// What it must be instead.
        reason: String,
    },
    /// No lease has this id (never created, or forgotten after its retention).
    #[error("lease {0} not found")]
    NotFound(String),
    /// A node acted on a lease placed on another node.
    #[error("lease {lease_id} is not placed on node {caller}")]
    NotOnNode {
        /// The lease.
        lease_id: String,
        /// The calling node.
        caller: String,
    },
    /// The caller holds the lease at an epoch it is no longer at.
    #[error("lease {lease_id} is at epoch {current}; epoch {held} is stale, so nothing was changed")]
    StaleEpoch {
        /// The lease.
        lease_id: String,
        /// The epoch the caller named.
        held: u64,
        /// The lease's epoch.
        current: u64,
    },
    /// The phase change is not one a node may report from where the lease is.
    #[error("lease {lease_id} cannot move from {from} to {to}")]
    IllegalTransition {
        /// The lease.
        lease_id: String,
        /// The phase it is in.
        from: Phase,
        /// The phase reported.
        to: Phase,
    },
    /// The lease cannot be taken back into its node's custody.
    #[error("lease {lease_id} cannot be taken into custody: {reason}; destroy its workload")]
    CustodyRefused {
        /// The lease.
        lease_id: String,
        /// Why, in a few words.
        reason: String,
    },
    /// A launch registration cannot be taken or spent; the message says why.
    #[error("{0}")]
    LaunchRefused(String),
    /// No node has room for the request.
    #[error("{0}")]
    NoRoom(Shortage),
    /// The lease's node has no room for it to grow.
    #[error(
        "lease {lease_id} cannot grow to {wanted} on node {node_id}: it needs {more} more and the node has {free} free"
    )]
    NoRoomToGrow {
        /// The lease.
        lease_id: String,
        /// Its node.
        node_id: String,
        /// The size asked for.
        wanted: Resources,
        /// What it needs beyond what it reserves now.
        more: Resources,
        /// What the node has free.
        free: Resources,
    },
    /// A resize cannot be asked for or reported now; the message says why.
    #[error("{0}")]
    ResizeRefused(String),
    /// A cache volume cannot be opened or committed now; the message says why.
    #[error("{0}")]
    CacheRefused(String),
    /// No such cache volume, or no such generation of one.
    #[error("{0} not found")]
    CacheNotFound(String),
    /// The ledger cannot serve the call now (it has not learned the nodes yet,
    /// it is shutting down, or its queue is full); retry shortly.
    #[error("{0}")]
    Unavailable(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(LeaseError, |error| match error {
    LeaseError::InvalidArgument { .. } => tonic::Status::invalid_argument(error.to_string()),
    LeaseError::NotFound(_) | LeaseError::CacheNotFound(_) => tonic::Status::not_found(error.to_string()),
    LeaseError::NotOnNode { .. } => tonic::Status::permission_denied(error.to_string()),
    LeaseError::StaleEpoch { .. }
    | LeaseError::IllegalTransition { .. }
    | LeaseError::CustodyRefused { .. }
    | LeaseError::LaunchRefused(_)
    | LeaseError::ResizeRefused(_)
    | LeaseError::CacheRefused(_) => tonic::Status::failed_precondition(error.to_string()),
    LeaseError::NoRoom(_) | LeaseError::NoRoomToGrow { .. } => tonic::Status::resource_exhausted(error.to_string()),
    LeaseError::Unavailable(_) => tonic::Status::unavailable(error.to_string()),
    LeaseError::Store(error) => error.into(),
});

impl LeaseError {
    /// Whether placing the whole batch again may succeed: a collision with a
    /// concurrent placement the retries inside the transaction did not outlast.
    pub(crate) fn is_collision(&self) -> bool {
        matches!(
            self,
            Self::Store(StoreError::Contended { .. } | StoreError::Conflict { .. } | StoreError::AlreadyExists { .. })
        )
    }

    /// The error again, for each caller of a failed batch (or each ask that
    /// shared a key): the same status code, without the driver's detail,
    /// which is logged once.
    pub(crate) fn for_each_caller(&self) -> LeaseError {
        match self {
            Self::NoRoom(shortage) => Self::NoRoom(shortage.clone()),
            Self::Store(StoreError::Unavailable { target, reason, .. }) => {
                Self::Store(StoreError::Unavailable { target: target.clone(), reason: reason.clone(), source: None })
            }
            Self::Store(StoreError::Contended { attempts, .. }) => {
                Self::Store(StoreError::Contended { attempts: *attempts, source: None })
            }
            Self::Store(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => {
                Self::Store(StoreError::Contended { attempts: 1, source: None })
            }
            Self::Store(_) => Self::Store(StoreError::internal("placing the batch failed")),
            other => Self::Unavailable(other.to_string()),
        }
    }
}

/// A validated request for a lease.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LeaseAsk {
    pub(crate) project: String,
    pub(crate) owner: String,
    pub(crate) idempotency_key: String,
    pub(crate) resources: Resources,
    pub(crate) tier: String,
    pub(crate) spread_group: String,
    pub(crate) workload: v1::Workload,
    /// The asking call's trace, kept on the lease (see `Lease.traceparent`).
    pub(crate) traceparent: String,
}

/// A lease as a request for it found it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Placed {
    pub(crate) lease: LeaseRecord,
    /// False when the idempotency key matched an existing lease.
    pub(crate) created: bool,
}

/// A phase change a node reports.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PhaseReport {
    pub(crate) lease_id: String,
    pub(crate) epoch: u64,
    pub(crate) phase: Phase,
    pub(crate) reason: String,
    pub(crate) message: String,
    pub(crate) exit_code: Option<i32>,
    /// With RUNNING: where the replica listens on the node, by port name.
    pub(crate) ports: Vec<(String, u32)>,
}

/// Which leases `ListLeases` (and `WatchLeases`) wants; every set field must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LeaseFilter {
    pub(crate) project: Option<String>,
    pub(crate) node_id: Option<String>,
    pub(crate) phase: Option<Phase>,
    pub(crate) owner: Option<String>,
    /// The owner starts with this.
    pub(crate) owner_prefix: Option<String>,
    /// Only leases in an open phase.
    pub(crate) open_only: bool,
}

impl LeaseFilter {
    /// The `WHERE` conditions selecting these leases, and the text values
    /// they bind as `$1`, `$2`, ….
    fn to_sql(&self) -> (String, Vec<String>) {
        let mut sql = "1 = 1".to_owned();
        let mut values: Vec<String> = Vec::new();
        let conditions = [
            ("project", self.project.clone()),
            ("node_id", self.node_id.clone()),
            ("phase", self.phase.map(|phase| phase.as_str().to_owned())),
            ("owner", self.owner.clone()),
        ];
        for (column, value) in conditions {
            if let Some(value) = value {
                values.push(value);
                sql.push_str(&format!(" AND {column} = ${}", values.len()));
            }
        }
        if let Some(prefix) = &self.owner_prefix {
            values.push(prefix.clone());
            let n = values.len();
            // No LIKE: a prefix is matched as it is, `%` and `_` included.
            sql.push_str(&format!(" AND substr(owner, 1, length(CAST(${n} AS TEXT))) = CAST(${n} AS TEXT)"));
        }
        if self.open_only {
            sql.push_str(&format!(" AND phase IN {OPEN_PHASES_SQL}"));
        }
        (sql, values)
    }
}

/// A `SELECT` of [`lease_columns!`] of the leases `conditions` select, oldest first.
fn oldest_first(conditions: &str) -> String {
    format!(concat!("SELECT ", lease_columns!(), " FROM leases WHERE {} ORDER BY created_at_ms, lease_id"), conditions)
}

/// The leases `sql` (a `SELECT` of [`lease_columns!`]) finds, binding `values` in order.
async fn select_leases(conn: &mut AnyConnection, sql: &str, values: &[String]) -> Result<Vec<LeaseRecord>, StoreError> {
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for value in values {
        query = query.bind(value.as_str());
    }
    let rows = query.fetch_all(&mut *conn).await?;
    rows.iter().map(LeaseRecord::from_row).collect()
}

/// What a lease watch sends next (see [`Ledger::changes`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Changes {
    /// The changes since the cursor asked for (resumed), or the open set.
    pub(crate) leases: Vec<LeaseRecord>,
    /// Where the next read starts: every change below it is in this read or an earlier one.
    pub(crate) cursor: i64,
    /// Whether `leases` are the changes since the cursor asked for rather than the open set.
    pub(crate) resumed: bool,
}

/// What a node's assignment stream sends next.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Assignments {
    /// Open leases (afresh), or every lease changed after the cursor asked for (resumed), by `seq`.
    pub(crate) leases: Vec<LeaseRecord>,
    /// The node's assignment cursor as of this read.
    pub(crate) cursor: i64,
    /// Whether `leases` are the changes after the cursor asked for rather than the whole open set.
    pub(crate) resumed: bool,
}

/// What the reaper found for one due lease.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Expiry {
    /// It was open and past its deadline: now `EXPIRED`.
    Expired(Box<LeaseRecord>),
    /// It was renewed since its deadline was indexed: look again then.
    NotYet(i64),
    /// It is final or forgotten: nothing to watch.
    Gone,
}

/// What `ReconcileNode` found.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Reconciled {
    /// Workloads no open lease on the node covers at their epoch.
    pub(crate) destroy: Vec<v1::LeaseRef>,
    /// `RUNNING` leases the node does not run, now `FAILED`.
    pub(crate) failed: Vec<LeaseRecord>,
}

/// The ledger over its store.
#[derive(Debug, Clone)]
pub(crate) struct Ledger {
    store: Store,
    ttl_ms: i64,
    custody_window_ms: i64,
    /// Generations of each cache volume kept beside its head and the pinned.
    cache_keep: u32,
    /// Where cache generations are kept, for nodes to push and pull.
    cache_registry: Option<crate::config::CacheRegistryConfig>,
    /// The most bytes one project's cache generations may hold.
    cache_project_budget: Option<u64>,
    /// The key launch registrations are signed with, once read.
    launch_key: Arc<tokio::sync::OnceCell<hmac::Key>>,
}

impl Ledger {
    pub(crate) fn new(store: Store, config: &LeasesConfig) -> Self {
        Self {
            store,
            ttl_ms: millis(config.lease_ttl),
            custody_window_ms: millis(config.custody_window),
            cache_keep: config.cache_keep,
            cache_registry: config.cache_registry.clone(),
            cache_project_budget: config.cache_project_budget,
            launch_key: Arc::default(),
        }
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// What is kept of cache generations: the newest of each volume, and
    /// the bytes each project may hold.
    pub(crate) fn cache_retention(&self) -> crate::model::Retention {
        crate::model::Retention { keep: self.cache_keep, project_budget: self.cache_project_budget }
    }

    /// Where `project`'s cache generations are kept, as a node is told it.
    pub(crate) fn cache_registry(&self, project: &str) -> Option<v1::CacheRegistry> {
        self.cache_registry.as_ref().map(|config| v1::CacheRegistry {
            repository: format!("{}/{project}", config.repository.trim_end_matches('/')),
            username: config.username.clone(),
            password: config.password.clone(),
        })
    }

    /// Places a batch in one transaction: existing leases for known keys,
    /// new leases where there is room, a shortage where there is none; one
    /// outcome per ask, in order. Asks sharing a key share one lease.
    pub(crate) async fn place_batch(
        &self,
        asks: &[LeaseAsk],
        nodes: &[PlacementNode],
    ) -> Result<Vec<Result<Placed, LeaseError>>, LeaseError> {
        let (now_sql, ttl_ms) = (self.store.now_ms_sql(), self.ttl_ms);
        self.store.tx("leases.place", |conn| Box::pin(place_in_tx(conn, now_sql, ttl_ms, asks, nodes))).await
    }

    /// One lease.
    pub(crate) async fn get(&self, lease_id: &str) -> Result<LeaseRecord, LeaseError> {
        self.store
            .read("leases.get", |conn| {
                Box::pin(async move {
                    fetch(conn, lease_id).await?.ok_or_else(|| LeaseError::NotFound(lease_id.to_owned()))
                })
            })
            .await
    }

    /// Leases matching `filter`, oldest first.
    pub(crate) async fn list(&self, filter: &LeaseFilter) -> Result<Vec<LeaseRecord>, LeaseError> {
        let (conditions, values) = filter.to_sql();
        let sql = oldest_first(&conditions);
        let (sql, values) = (&sql, &values);
        self.store
            .read("leases.list", |conn| Box::pin(async move { Ok(select_leases(conn, sql, values).await?) }))
            .await
    }

    /// What a lease watch sends next, from one snapshot: with `since` (a
    /// cursor this ledger can still resume from), every lease `filter`
    /// selects that changed at or after it, open or final, in change order;
    /// otherwise (or for `None`) the open leases `filter` selects. Either
    /// way, the cursor to read from next time.
    pub(crate) async fn changes(&self, filter: &LeaseFilter, since: Option<i64>) -> Result<Changes, LeaseError> {
        let position = match self.store.backend() {
            Backend::Postgres => {
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint, resume_floor FROM lease_changes"
            }
            Backend::Sqlite => "SELECT last_seq + 1, resume_floor FROM lease_changes",
        };
        let (conditions, values) = &LeaseFilter { open_only: false, ..filter.clone() }.to_sql();
        let (open_conditions, open_values) = &LeaseFilter { open_only: true, ..filter.clone() }.to_sql();
        self.store
            .read("leases.changes", |conn| {
                Box::pin(async move {
                    let (cursor, floor): (i64, i64) = sqlx::query_as(position).fetch_one(&mut *conn).await?;
                    let resumable = since.filter(|&since| since > floor && since <= cursor);
                    let leases = match resumable {
                        Some(since) => {
                            let sql = format!(
                                concat!(
                                    "SELECT ",
                                    lease_columns!(),
                                    " FROM leases WHERE {} AND change_seq >= {} ORDER BY change_seq, lease_id"
                                ),
                                conditions, since
                            );
                            select_leases(conn, &sql, values).await?
                        }
                        None => select_leases(conn, &oldest_first(open_conditions), open_values).await?,
                    };
                    Ok(Changes { leases, cursor, resumed: resumable.is_some() })
                })
            })
            .await
    }

    /// Releases an open lease; a final one is returned as it is. The flag
    /// says whether anything changed.
    pub(crate) async fn release(
        &self,
        lease_id: &str,
        reason: &str,
        by: &str,
    ) -> Result<(LeaseRecord, bool), LeaseError> {
        let now_sql = self.store.now_ms_sql();
        let message = format!("released by {by}");
        let message = message.as_str();
        self.store
            .tx("leases.release", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let lease =
                        fetch(conn, lease_id).await?.ok_or_else(|| LeaseError::NotFound(lease_id.to_owned()))?;
                    if !lease.phase.is_open() {
                        return Ok((lease, false));
                    }
                    let change = Change::to(Phase::Released, &lease).reason(reason).message(message);
                    Ok((apply(conn, &lease, change, now, None).await?, true))
                })
            })
            .await
    }

    /// Applies a node's phase report, fenced on its epoch; a report of the
    /// phase the lease is already in changes nothing. The flag says whether
    /// anything changed.
    pub(crate) async fn report(&self, node_id: &str, report: &PhaseReport) -> Result<(LeaseRecord, bool), LeaseError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("leases.report_phase", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let lease = held_by(conn, node_id, &report.lease_id, report.epoch).await?;
                    if lease.phase == report.phase {
                        return Ok((lease, false));
                    }
                    if !lease.phase.node_may_move(report.phase) {
                        return Err(LeaseError::IllegalTransition {
                            lease_id: lease.lease_id.clone(),
                            from: lease.phase,
                            to: report.phase,
                        });
                    }
                    let change = Change::to(report.phase, &lease)
                        .reason(&report.reason)
                        .message(&report.message)
                        .exit_code(report.exit_code);
                    let mut record = apply(conn, &lease, change, now, None).await?;
                    if report.phase == Phase::Running && !report.ports.is_empty() {
                        sqlx::query("UPDATE leases SET ports = $2 WHERE lease_id = $1")
                            .bind(&record.lease_id)
                            .bind(format_ports(&report.ports))
                            .execute(&mut *conn)
                            .await?;
                        record.ports.clone_from(&report.ports);
                    }
                    Ok((record, true))
                })
            })
            .await
    }

    /// Renews the leases `node_id` holds at the epochs given, in one
    /// transaction; returns those renewed and when they now expire.
    pub(crate) async fn renew(
        &self,
        node_id: &str,
        held: &[(String, i64)],
    ) -> Result<(HashSet<(String, i64)>, i64), LeaseError> {
        let (now_sql, ttl_ms) = (self.store.now_ms_sql(), self.ttl_ms);
        self.store
            .tx("leases.renew", |conn| {
                Box::pin(async move {
                    let expires_at = berth_store::now_ms_in(conn, now_sql).await?.saturating_add(ttl_ms);
                    let mut renewed = HashSet::new();
                    for chunk in held.chunks(ROWS_PER_STATEMENT) {
                        let sql = format!(
                            "UPDATE leases SET expires_at_ms = $2 WHERE node_id = $1 AND phase IN {OPEN_PHASES_SQL} \
                             AND (lease_id, epoch) IN (VALUES {}) RETURNING lease_id, epoch",
                            placeholders(chunk.len(), 2, 2)
                        );
                        let mut query =
                            sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql)).bind(node_id).bind(expires_at);
                        for (lease_id, epoch) in chunk {
                            query = query.bind(lease_id.as_str()).bind(*epoch);
                        }
                        renewed.extend(query.fetch_all(&mut *conn).await?);
                    }
                    Ok((renewed, expires_at))
                })
            })
            .await
    }

    /// Compares what `node_id` runs with its open leases; see `ReconcileNode`
    /// in the proto for the rule. Leases found lost are failed here.
    pub(crate) async fn reconcile(&self, node_id: &str, running: &[(String, i64)]) -> Result<Reconciled, LeaseError> {
        let now_sql = self.store.now_ms_sql();
        let message = format!("node {node_id} reported that it does not run the workload");
        let message = message.as_str();
        self.store
            .tx("leases.reconcile_node", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let open = open_on(conn, node_id).await?;
                    let covered: HashSet<(&str, i64)> = open.iter().map(|l| (l.lease_id.as_str(), l.epoch)).collect();
                    let run: HashSet<(&str, i64)> = running.iter().map(|(id, epoch)| (id.as_str(), *epoch)).collect();
                    let mut reconciled = Reconciled::default();
                    for (lease_id, epoch) in running {
                        if !covered.contains(&(lease_id.as_str(), *epoch)) {
                            let epoch = u64::try_from(*epoch).unwrap_or_default();
                            reconciled.destroy.push(v1::LeaseRef { lease_id: lease_id.clone(), epoch });
                        }
                    }
                    for lease in open.iter().filter(|l| l.phase == Phase::Running) {
                        if !run.contains(&(lease.lease_id.as_str(), lease.epoch)) {
                            let change = Change::to(Phase::Failed, lease).reason("NodeLost").message(message);
                            reconciled.failed.push(apply(conn, lease, change, now, None).await?);
                        }
                    }
                    Ok(reconciled)
                })
            })
            .await
    }

    /// Takes a lease back into `node_id`'s custody at the next epoch; see
    /// `AssumeCustody` in the proto for the rule. `room` is what the node
    /// offers, as identity last described it, needed to reserve an expired
    /// lease's capacity again.
    pub(crate) async fn assume_custody(
        &self,
        node_id: &str,
        lease_id: &str,
        epoch: u64,
        room: Option<Resources>,
    ) -> Result<LeaseRecord, LeaseError> {
        let (now_sql, ttl_ms, window_ms) = (self.store.now_ms_sql(), self.ttl_ms, self.custody_window_ms);
        let message = format!("taken back into node {node_id}'s custody");
        let message = message.as_str();
        self.store
            .tx("leases.assume_custody", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    if let Some(current) = fetch(conn, lease_id).await?
                        && custody_already_taken(&current, node_id, epoch)
                    {
                        // A retry of a custody whose reply was lost: it already holds.
                        return Ok(current);
                    }
                    let lease = held_by(conn, node_id, lease_id, epoch).await?;
                    let refuse = |reason: String| LeaseError::CustodyRefused { lease_id: lease_id.to_owned(), reason };
                    let room = match lease.phase {
                        phase if phase.is_open() => None,
                        Phase::Expired => {
                            let ago = now.saturating_sub(lease.phase_changed_at_ms);
                            if ago > window_ms {
                                return Err(refuse(format!(
                                    "it expired {ago}ms ago, longer than the {window_ms}ms custody window"
                                )));
                            }
                            Some(room.ok_or_else(|| refuse(format!("node {node_id} is not known to the ledger")))?)
                        }
                        phase => return Err(refuse(format!("it is {phase}"))),
                    };
                    let change = Change::to(Phase::Running, &lease)
                        .epoch(lease.epoch + 1)
                        .reason("CustodyAssumed")
                        .message(message)
                        .expires_at(now.saturating_add(ttl_ms));
                    apply(conn, &lease, change, now, room).await
                })
            })
            .await
    }

    /// Asks for `lease_id`, held at `epoch`, to be resized to `wanted`; see
    /// `ResizeLease` in the proto for the rule. `room` is what its node
    /// offers, as identity last described it. The flag says whether anything
    /// changed.
    pub(crate) async fn resize(
        &self,
        lease_id: &str,
        epoch: u64,
        wanted: Resources,
        room: &(dyn Fn(&str) -> Option<Resources> + Sync),
    ) -> Result<(LeaseRecord, bool), LeaseError> {
        self.store
            .tx("leases.resize", |conn| {
                Box::pin(async move {
                    let lease =
                        fetch(conn, lease_id).await?.ok_or_else(|| LeaseError::NotFound(lease_id.to_owned()))?;
                    if lease.epoch() != epoch {
                        return Err(LeaseError::StaleEpoch {
                            lease_id: lease_id.to_owned(),
                            held: epoch,
                            current: lease.epoch(),
                        });
                    }
                    if !lease.phase.is_open() {
                        return Err(LeaseError::ResizeRefused(format!(
                            "lease {lease_id} is {}; only an open lease can be resized",
                            lease.phase
                        )));
                    }
                    let unchanged = match lease.pending_resize() {
                        Some(pending) => pending == wanted,
                        None => lease.resources == wanted,
                    };
                    if unchanged {
                        return Ok((lease, false));
                    }
                    let (before, after) = (lease.reserved(), lease.holding(lease.resources.max(wanted)));
                    let (more, less) = (after.minus(before), before.minus(after));
                    let total = room(&lease.node_id).ok_or_else(|| {
                        LeaseError::Unavailable(format!(
                            "the ledger has not learned node {}'s capacity yet",
                            lease.node_id
                        ))
                    })?;
                    let cursor: Option<i64> = sqlx::query_scalar(
                        "UPDATE node_ledger SET cpu_allocated = cpu_allocated + $2 - $3, \
                         memory_allocated = memory_allocated + $4 - $5, assignment_cursor = assignment_cursor + 1 \
                         WHERE node_id = $1 AND ($2 = 0 OR cpu_allocated + $2 <= $6) \
                         AND ($4 = 0 OR memory_allocated + $4 <= $7) RETURNING assignment_cursor",
                    )
                    .bind(&lease.node_id)
                    .bind(to_column(more.cpu_millis))
                    .bind(to_column(less.cpu_millis))
                    .bind(to_column(more.memory_bytes))
                    .bind(to_column(less.memory_bytes))
                    .bind(to_column(total.cpu_millis))
                    .bind(to_column(total.memory_bytes))
                    .fetch_optional(&mut *conn)
                    .await?;
                    let Some(seq) = cursor else {
                        let allocated = node_rows(conn).await?.get(&lease.node_id).map(|row| row.allocated);
                        return Err(LeaseError::NoRoomToGrow {
                            lease_id: lease_id.to_owned(),
                            node_id: lease.node_id.clone(),
                            wanted,
                            more,
                            free: total.minus(allocated.unwrap_or_default()),
                        });
                    };
                    let resize = Resize { resources: wanted, state: ResizeState::Pending, ..Resize::default() };
                    let (resources, resize) = write_resize(conn, &lease, lease.resources, resize, seq).await?;
                    Ok((LeaseRecord { resources, resize: Some(resize), seq, ..lease }, true))
                })
            })
            .await
    }

    /// Records how `node_id` dealt with the pending resize of a lease it
    /// holds; see `ReportResize` in the proto for the rule. The flag says
    /// whether anything changed.
    pub(crate) async fn report_resize(
        &self,
        node_id: &str,
        lease_id: &str,
        epoch: u64,
        report: &Resize,
    ) -> Result<(LeaseRecord, bool), LeaseError> {
        self.store
            .tx("leases.report_resize", |conn| {
                Box::pin(async move {
                    let lease = held_by(conn, node_id, lease_id, epoch).await?;
                    match &lease.resize {
                        Some(resize) if resize.resources == report.resources && resize.state == report.state => {
                            return Ok((lease, false));
                        }
                        Some(resize)
                            if resize.resources == report.resources && resize.state == ResizeState::Pending => {}
                        Some(resize) if resize.state == ResizeState::Pending => {
                            return Err(LeaseError::ResizeRefused(format!(
                                "lease {lease_id}'s pending resize asks for {}, not {}",
                                resize.resources, report.resources
                            )));
                        }
                        _ => return Err(LeaseError::ResizeRefused(format!("lease {lease_id} has no pending resize"))),
                    }
                    if !lease.phase.is_open() {
                        return Err(LeaseError::ResizeRefused(format!("lease {lease_id} is {}", lease.phase)));
                    }
                    let kept = if report.state == ResizeState::Applied { report.resources } else { lease.resources };
                    let freed = lease.reserved().minus(lease.holding(kept));
                    let done = sqlx::query(
                        "UPDATE node_ledger SET \
                         cpu_allocated = CASE WHEN cpu_allocated > $2 THEN cpu_allocated - $2 ELSE 0 END, \
                         memory_allocated = CASE WHEN memory_allocated > $3 THEN memory_allocated - $3 ELSE 0 END \
                         WHERE node_id = $1",
                    )
                    .bind(&lease.node_id)
                    .bind(to_column(freed.cpu_millis))
                    .bind(to_column(freed.memory_bytes))
                    .execute(&mut *conn)
                    .await?;
                    expect_one(done.rows_affected(), &format!("node {}'s ledger row", lease.node_id))?;
                    let (resources, resize) = write_resize(conn, &lease, kept, report.clone(), lease.seq).await?;
                    Ok((LeaseRecord { resources, resize: Some(resize), ..lease }, true))
                })
            })
            .await
    }

    /// Moves the open leases of a draining node along: each is told once
    /// (reason `NodeDraining`, a change its watchers see), and once the
    /// drain's deadline has passed each is released (reason `NodeDrained`).
    /// Returns the leases changed.
    pub(crate) async fn drain(&self, node_id: &str, deadline_passed: bool) -> Result<Vec<LeaseRecord>, LeaseError> {
        let now_sql = self.store.now_ms_sql();
        let telling = format!("node {node_id} is draining: a service's replica is replaced elsewhere before it stops");
        let releasing = format!("node {node_id} was drained and its drain's deadline passed");
        let (telling, releasing) = (telling.as_str(), releasing.as_str());
        self.store
            .tx("leases.drain", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let open = open_on(conn, node_id).await?;
                    let mut changed = Vec::new();
                    for lease in open {
                        if deadline_passed {
                            let change = Change::to(Phase::Released, &lease).reason(DRAINED).message(releasing);
                            changed.push(apply(conn, &lease, change, now, None).await?);
                        } else if lease.reason != DRAINING {
                            let change = Change::to(lease.phase, &lease).reason(DRAINING).message(telling);
                            changed.push(apply(conn, &lease, change, now, None).await?);
                        }
                    }
                    Ok(changed)
                })
            })
            .await
    }

    /// Takes the `NodeDraining` mark off the open leases of every node not
    /// in `draining` (a drain lifted), so their requesters leave them be.
    /// Returns the leases changed.
    pub(crate) async fn clear_drain_marks(&self, draining: &BTreeSet<String>) -> Result<Vec<LeaseRecord>, LeaseError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("leases.clear_drain_marks", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let sql = concat!(
                        "SELECT ",
                        lease_columns!(),
                        " FROM leases WHERE reason = $1 AND phase IN ('pending', 'bound', 'launching', 'running')"
                    );
                    let rows = sqlx::query(sql).bind(DRAINING).fetch_all(&mut *conn).await?;
                    let marked = rows.iter().map(LeaseRecord::from_row).collect::<Result<Vec<_>, _>>()?;
                    let mut changed = Vec::new();
                    for lease in marked.iter().filter(|lease| !draining.contains(&lease.node_id)) {
                        changed.push(apply(conn, lease, Change::to(lease.phase, lease), now, None).await?);
                    }
                    Ok(changed)
                })
            })
            .await
    }

    /// Every node row, by node id.
    pub(crate) async fn node_rows(&self) -> Result<Vec<NodeLedgerRow>, LeaseError> {
        self.store
            .tx("leases.node_rows", |conn| {
                Box::pin(async move {
                    let rows = node_rows(conn).await?;
                    let mut rows: Vec<NodeLedgerRow> = rows.into_values().collect();
                    rows.sort_by(|a, b| a.node_id.cmp(&b.node_id));
                    Ok(rows)
                })
            })
            .await
    }

    /// What a node's stream sends: the changes after `resume` when the
    /// ledger still holds them all, otherwise (or for `None`) the whole open set.
    pub(crate) async fn assignments(&self, node_id: &str, resume: Option<i64>) -> Result<Assignments, LeaseError> {
        self.store
            .tx("leases.assignments", |conn| {
                Box::pin(async move {
                    let position: Option<(i64, i64)> =
                        sqlx::query_as("SELECT assignment_cursor, resume_floor FROM node_ledger WHERE node_id = $1")
                            .bind(node_id)
                            .fetch_optional(&mut *conn)
                            .await?;
                    let (cursor, floor) = position.unwrap_or((0, 0));
                    let resumable = resume.filter(|&after| after >= floor && after <= cursor);
                    let rows = match resumable {
                        Some(after) => {
                            let sql = concat!(
                                "SELECT ",
                                lease_columns!(),
                                " FROM leases WHERE node_id = $1 AND seq > $2 ORDER BY seq"
                            );
                            sqlx::query(sql).bind(node_id).bind(after).fetch_all(&mut *conn).await?
                        }
                        None => {
                            let sql = concat!(
                                "SELECT ",
                                lease_columns!(),
                                " FROM leases WHERE node_id = $1 AND phase IN ('pending', 'bound', 'launching', 'running') ORDER BY seq"
                            );
                            sqlx::query(sql).bind(node_id).fetch_all(&mut *conn).await?
                        }
                    };
                    let leases = rows.iter().map(LeaseRecord::from_row).collect::<Result<Vec<_>, _>>()?;
                    let cursor = leases.iter().map(|l| l.seq).fold(cursor, i64::max);
                    Ok(Assignments { leases, cursor, resumed: resumable.is_some() })
                })
            })
            .await
    }

    /// Expires those of `lease_ids` still open and past their deadline, if
    /// `holder` still leads the reaper at `term`.
    pub(crate) async fn expire(
        &self,
        lease_ids: &[String],
        holder: &str,
        term: Term,
    ) -> Result<Vec<(String, Expiry)>, LeaseError> {
        let now_sql = self.store.now_ms_sql();
        let fence = format!(
            "SELECT COUNT(*) FROM _berth_leaders WHERE loop_name = $1 AND holder = $2 AND term = $3 \
             AND expires_at_ms > {now_sql}"
        );
        let fence = fence.as_str();
        let ttl_ms = self.ttl_ms;
        self.store
            .tx("leases.expire", |conn| {
                Box::pin(async move {
                    let leading: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(fence))
                        .bind(REAPER_LOOP)
                        .bind(holder)
                        .bind(term.0)
                        .fetch_one(&mut *conn)
                        .await?;
                    if leading != 1 {
                        return Err(StoreError::Conflict { what: format!("reaper leadership at term {term}") }.into());
                    }
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let found = fetch_many(conn, lease_ids).await?;
                    let mut outcomes = Vec::with_capacity(lease_ids.len());
                    for lease_id in lease_ids {
                        let outcome = match found.get(lease_id) {
                            Some(lease) if lease.phase.is_open() => match lease.expires_at_ms {
                                Some(at) if at > now => Expiry::NotYet(at),
                                _ => {
                                    let message =
                                        format!("node {} did not renew it within the {ttl_ms}ms ttl", lease.node_id);
                                    let change =
                                        Change::to(Phase::Expired, lease).reason("NotRenewed").message(&message);
                                    Expiry::Expired(Box::new(apply(conn, lease, change, now, None).await?))
                                }
                            },
                            _ => Expiry::Gone,
                        };
                        outcomes.push((lease_id.clone(), outcome));
                    }
                    Ok(outcomes)
                })
            })
            .await
    }

    /// Every open lease's deadline, for rebuilding the index.
    pub(crate) async fn open_deadlines(&self) -> Result<Vec<(String, i64)>, LeaseError> {
        self.store
            .read("leases.open_deadlines", |conn| {
                Box::pin(async move {
                    let sql = "SELECT lease_id, expires_at_ms FROM leases \
                               WHERE phase IN ('pending', 'bound', 'launching', 'running') AND expires_at_ms IS NOT NULL";
                    Ok(sqlx::query_as::<_, (String, i64)>(sql).fetch_all(&mut *conn).await?)
                })
            })
            .await
    }

    /// The key launch registrations are signed with: made by the first
    /// replica that needs it, kept in the store, shared by every replica.
    async fn launch_key(&self) -> Result<hmac::Key, LeaseError> {
        let key = self
            .launch_key
            .get_or_try_init(|| async {
                let fresh = rand::random::<[u8; 32]>();
                let fresh = fresh.as_slice();
                let stored: Vec<u8> = self
                    .store
                    .tx("leases.launch_key", |conn| {
                        Box::pin(async move {
                            sqlx::query(
                                "INSERT INTO launch_registration_key (id, key) VALUES (1, $1) ON CONFLICT DO NOTHING",
                            )
                            .bind(fresh)
                            .execute(&mut *conn)
                            .await?;
                            let (key,): (Vec<u8>,) =
                                sqlx::query_as("SELECT key FROM launch_registration_key WHERE id = 1")
                                    .fetch_one(&mut *conn)
                                    .await?;
                            Ok::<_, LeaseError>(key)
                        })
                    })
                    .await?;
                Ok::<_, LeaseError>(hmac::Key::new(hmac::HMAC_SHA256, &stored))
            })
            .await?;
        Ok(key.clone())
    }

    /// A new single-use launch registration for `lease_id`, which `node_id`
    /// must hold open at `epoch`, and when it expires (ms). Nothing is
    /// written: the registration carries its lease, epoch, node and expiry,
    /// signed with [`Ledger::launch_key`]; only its spending is recorded.
    pub(crate) async fn register_launch(
        &self,
        node_id: &str,
        lease_id: &str,
        epoch: u64,
    ) -> Result<(String, i64), LeaseError> {
        let key = self.launch_key().await?;
        let now_sql = self.store.now_ms_sql();
        let now = self
            .store
            .read("leases.register_launch", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let lease = held_by(conn, node_id, lease_id, epoch).await?;
                    if !lease.phase.is_open() {
                        return Err(LeaseError::LaunchRefused(format!(
                            "lease {lease_id} is {}, so it has no launch to register",
                            lease.phase
                        )));
                    }
                    Ok(now)
                })
            })
            .await?;
        let expires_at = now.saturating_add(millis(LAUNCH_REGISTRATION_TTL));
        let registration = LaunchRegistration {
            lease_id: lease_id.to_owned(),
            epoch,
            node_id: node_id.to_owned(),
            expires_at,
            nonce: hex::encode(rand::random::<[u8; 16]>()),
        };
        Ok((registration.sign(&key), expires_at))
    }

    /// The registration `presented` by `node_id`, to be spent by `by`, if
    /// leases signed it; nothing is read or written.
    pub(crate) async fn verify_launch(&self, presented: &str, node_id: &str, by: &str) -> Result<Redeem, LeaseError> {
        let key = self.launch_key().await?;
        let Some(registration) = LaunchRegistration::verify(&key, presented) else {
            return Err(LeaseError::LaunchRefused("no such launch registration".to_owned()));
        };
        Ok(Redeem {
            registration,
            digest: secret_sha256(presented),
            node_id: node_id.to_owned(),
            spent_by: format!("redeemed by {by}"),
        })
    }

    /// Spends every registration of `batch` that can be in one transaction:
    /// for each, its lease if that lease is still open on the presenting
    /// node at the registration's epoch, else why not (and that one changes
    /// nothing). Two of the batch presenting the same registration spend it
    /// once.
    pub(crate) async fn redeem_launches(
        &self,
        batch: &[&Redeem],
    ) -> Result<Vec<Result<LeaseRecord, LeaseError>>, LeaseError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("leases.redeem_launches", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let mut answers = Vec::with_capacity(batch.len());
                    for redeem in batch {
                        answers.push(redeem_one(conn, redeem, now).await?);
                    }
                    Ok(answers)
                })
            })
            .await
    }

    /// Forgets up to `limit` final leases that reached their phase more than
    /// `retention_ms` ago, raising their nodes' resume floors and the lease
    /// watches' one; how many.
    pub(crate) async fn forget_final(&self, retention_ms: i64, limit: usize) -> Result<usize, LeaseError> {
        let now_sql = self.store.now_ms_sql();
        let select = format!(
            "SELECT lease_id, node_id, seq, change_seq FROM leases WHERE phase IN {FINAL_PHASES_SQL} \
             AND phase_changed_at_ms < {now_sql} - $1 ORDER BY phase_changed_at_ms LIMIT {limit}"
        );
        let select = select.as_str();
        self.store
            .tx("leases.forget_final", |conn| {
                Box::pin(async move {
                    let old: Vec<(String, String, i64, i64)> =
                        sqlx::query_as(sqlx::AssertSqlSafe(select)).bind(retention_ms).fetch_all(&mut *conn).await?;
                    let mut floors: BTreeMap<&str, i64> = BTreeMap::new();
                    for (_, node_id, seq, _) in &old {
                        let floor = floors.entry(node_id.as_str()).or_default();
                        *floor = (*floor).max(*seq);
                    }
                    for (node_id, floor) in floors {
                        sqlx::query(
                            "UPDATE node_ledger SET resume_floor = $2 WHERE node_id = $1 AND resume_floor < $2",
                        )
                        .bind(node_id)
                        .bind(floor)
                        .execute(&mut *conn)
                        .await?;
                    }
                    if let Some(floor) = old.iter().map(|(_, _, _, change_seq)| *change_seq).max() {
                        sqlx::query("UPDATE lease_changes SET resume_floor = $1 WHERE resume_floor < $1")
                            .bind(floor)
                            .execute(&mut *conn)
                            .await?;
                    }
                    let forget = format!("DELETE FROM launch_registrations WHERE expires_at_ms < {now_sql} - $1");
                    sqlx::query(sqlx::AssertSqlSafe(forget)).bind(retention_ms).execute(&mut *conn).await?;
                    for chunk in old.chunks(ROWS_PER_STATEMENT) {
                        let sql = format!("DELETE FROM leases WHERE lease_id IN ({})", placeholders(chunk.len(), 0, 1));
                        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
                        for (lease_id, _, _, _) in chunk {
                            query = query.bind(lease_id.as_str());
                        }
                        query.execute(&mut *conn).await?;
                    }
                    Ok(old.len())
                })
            })
            .await
    }
}

/// `n` groups of `width` numbered placeholders after the first `shared`:
/// `($3, $4), ($5, $6)` for `n = 2, shared = 2, width = 2`; with `width = 1`,
/// `$2, $3` without parentheses.
fn placeholders(n: usize, shared: usize, width: usize) -> String {
    let mut out = String::new();
    for row in 0..n {
        if row > 0 {
            out.push_str(", ");
        }
        let first = shared + row * width + 1;
        let numbers: Vec<String> = (first..first + width).map(|i| format!("${i}")).collect();
        if width == 1 {
            out.push_str(&numbers.join(", "));
        } else {
            out.push_str(&format!("({})", numbers.join(", ")));
        }
    }
    out
}

/// The open leases placed on `node_id`, in the order the node was told of them.
async fn open_on(conn: &mut AnyConnection, node_id: &str) -> Result<Vec<LeaseRecord>, LeaseError> {
    let sql = concat!(
        "SELECT ",
        lease_columns!(),
        " FROM leases WHERE node_id = $1 AND phase IN ('pending', 'bound', 'launching', 'running') ORDER BY seq"
    );
    let rows = sqlx::query(sql).bind(node_id).fetch_all(&mut *conn).await?;
    Ok(rows.iter().map(LeaseRecord::from_row).collect::<Result<Vec<_>, _>>()?)
}

async fn fetch(conn: &mut AnyConnection, lease_id: &str) -> Result<Option<LeaseRecord>, LeaseError> {
    let sql = concat!("SELECT ", lease_columns!(), " FROM leases WHERE lease_id = $1");
    let row = sqlx::query(sql).bind(lease_id).fetch_optional(&mut *conn).await?;
    Ok(row.as_ref().map(LeaseRecord::from_row).transpose()?)
}

async fn fetch_many(
    conn: &mut AnyConnection,
    lease_ids: &[String],
) -> Result<HashMap<String, LeaseRecord>, LeaseError> {
    let mut found = HashMap::new();
    for chunk in lease_ids.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            concat!("SELECT ", lease_columns!(), " FROM leases WHERE lease_id IN ({})"),
            placeholders(chunk.len(), 0, 1)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for lease_id in chunk {
            query = query.bind(lease_id.as_str());
        }
        for row in query.fetch_all(&mut *conn).await? {
            let lease = LeaseRecord::from_row(&row)?;
            found.insert(lease.lease_id.clone(), lease);
        }
    }
    Ok(found)
}

/// The lease a node names, checked to be that node's and at the epoch it holds.
/// Whether `lease` is where `node_id`'s own custody of it at `epoch` left it:
/// on that node, RUNNING, one epoch on. Only custody moves a placed lease's
/// epoch, and only its node may take it, so that epoch is this node's custody;
/// answering it again makes a retry after a lost reply harmless instead of a
/// refusal that would destroy the adopted workload.
fn custody_already_taken(lease: &LeaseRecord, node_id: &str, epoch: u64) -> bool {
    lease.node_id == node_id && lease.phase == Phase::Running && lease.epoch() == epoch.saturating_add(1)
}

pub(crate) async fn held_by(
    conn: &mut AnyConnection,
    node_id: &str,
    lease_id: &str,
    epoch: u64,
) -> Result<LeaseRecord, LeaseError> {
    let lease = fetch(conn, lease_id).await?.ok_or_else(|| LeaseError::NotFound(lease_id.to_owned()))?;
    if lease.node_id != node_id {
        return Err(LeaseError::NotOnNode { lease_id: lease_id.to_owned(), caller: node_id.to_owned() });
    }
    if lease.epoch() != epoch {
        return Err(LeaseError::StaleEpoch { lease_id: lease_id.to_owned(), held: epoch, current: lease.epoch() });
    }
    Ok(lease)
}

/// Spends one registration in an open transaction at `now`: its lease, or
/// why not (an `Err` inside `Ok`, which changes nothing); an `Err` outside is
/// the store's and fails the transaction.
async fn redeem_one(
    conn: &mut AnyConnection,
    redeem: &Redeem,
    now: i64,
) -> Result<Result<LeaseRecord, LeaseError>, LeaseError> {
    let Redeem { registration, digest, node_id, spent_by } = redeem;
    let LaunchRegistration { lease_id, epoch, node_id: registered_to, expires_at, .. } = registration;
    let refused = |why: String| Ok(Err(LeaseError::LaunchRefused(why)));
    let spent: Option<(String,)> = sqlx::query_as("SELECT spent_by FROM launch_registrations WHERE secret_sha256 = $1")
        .bind(digest.as_str())
        .fetch_optional(&mut *conn)
        .await?;
    if let Some((spent,)) = spent {
        return refused(format!(
            "the launch registration of lease {lease_id} at epoch {epoch} was already spent ({spent})"
        ));
    }
    if *expires_at <= now {
        return refused(format!("the launch registration of lease {lease_id} at epoch {epoch} has expired"));
    }
    if registered_to != node_id {
        return refused(format!(
            "the launch registration of lease {lease_id} was issued to another node than {node_id}"
        ));
    }
    let lease = match held_by(conn, node_id, lease_id, *epoch).await {
        Ok(lease) => lease,
        Err(error @ LeaseError::Store(_)) => return Err(error),
        Err(error) => return Ok(Err(error)),
    };
    if !lease.phase.is_open() {
        return refused(format!("lease {lease_id} is {}, so its launch is over", lease.phase));
    }
    let inserted = sqlx::query(
        "INSERT INTO launch_registrations \
         (secret_sha256, lease_id, epoch, node_id, spent_at_ms, expires_at_ms, spent_by) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (secret_sha256) DO NOTHING",
    )
    .bind(digest.as_str())
    .bind(lease_id.as_str())
    .bind(lease.epoch)
    .bind(node_id.as_str())
    .bind(now)
    .bind(*expires_at)
    .bind(spent_by.as_str())
    .execute(&mut *conn)
    .await?;
    if inserted.rows_affected() == 0 {
        return refused(format!("the launch registration of lease {lease_id} at epoch {epoch} was already spent"));
    }
    Ok(Ok(lease))
}

/// A launch registration to spend: already verified as leases' own.
#[derive(Debug)]
pub(crate) struct Redeem {
    pub(crate) registration: LaunchRegistration,
    /// The registration's digest, as a spent one is recorded.
    pub(crate) digest: String,
    /// The node presenting it.
    pub(crate) node_id: String,
    /// Who spends it, as recorded.
    pub(crate) spent_by: String,
}

/// What a spent launch registration is recorded under.
fn secret_sha256(secret: &str) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, secret.as_bytes()))
}

/// What a launch registration says, signed by leases:
/// `<lease>/<epoch>/<node>/<expires ms>/<nonce>/<HMAC-SHA256, hex>`. No part
/// holds a `/` (lease ids, node ids and numbers never do).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LaunchRegistration {
    lease_id: String,
    epoch: u64,
    node_id: String,
    expires_at: i64,
    nonce: String,
}

impl LaunchRegistration {
    fn payload(&self) -> String {
        format!("{}/{}/{}/{}/{}", self.lease_id, self.epoch, self.node_id, self.expires_at, self.nonce)
    }

    fn sign(&self, key: &hmac::Key) -> String {
        let payload = self.payload();
        let tag = hmac::sign(key, payload.as_bytes());
        format!("{payload}/{}", hex::encode(tag.as_ref()))
    }

    /// What `presented` says, if `key` signed it.
    fn verify(key: &hmac::Key, presented: &str) -> Option<Self> {
        let (payload, tag) = presented.rsplit_once('/')?;
        hmac::verify(key, payload.as_bytes(), &hex::decode(tag).ok()?).ok()?;
        let mut parts = payload.split('/');
        let registration = Self {
            lease_id: parts.next()?.to_owned(),
            epoch: parts.next()?.parse().ok()?,
            node_id: parts.next()?.to_owned(),
            expires_at: parts.next()?.parse().ok()?,
            nonce: parts.next()?.to_owned(),
        };
        parts.next().is_none().then_some(registration)
    }
}

async fn node_rows(conn: &mut AnyConnection) -> Result<HashMap<String, NodeLedgerRow>, LeaseError> {
    let rows = sqlx::query("SELECT node_id, cpu_allocated, memory_allocated, open_leases FROM node_ledger")
        .fetch_all(&mut *conn)
        .await?;
    let mut by_node = HashMap::with_capacity(rows.len());
    for row in &rows {
        let row = NodeLedgerRow::from_row(row)?;
        by_node.insert(row.node_id.clone(), row);
    }
    Ok(by_node)
}

/// The spread key of a group within a project: groups of different projects never meet.
fn spread_key(project: &str, group: &str) -> String {
    if group.is_empty() { String::new() } else { format!("{project}/{group}") }
}

/// What one lease write changes; built from the lease as read.
#[derive(Debug, Clone)]
struct Change<'a> {
    to: Phase,
    epoch: i64,
    reason: &'a str,
    message: &'a str,
    exit_code: Option<i32>,
    expires_at_ms: Option<i64>,
}

impl<'a> Change<'a> {
    /// A move to `to` keeping the epoch and deadline; a final phase clears the deadline.
    fn to(to: Phase, lease: &LeaseRecord) -> Self {
        Self {
            to,
            epoch: lease.epoch,
            reason: "",
            message: "",
            exit_code: lease.exit_code,
            expires_at_ms: if to.is_open() { lease.expires_at_ms } else { None },
        }
    }

    fn epoch(self, epoch: i64) -> Self {
        Self { epoch, ..self }
    }

    fn reason(self, reason: &'a str) -> Self {
        Self { reason, ..self }
    }

    fn message(self, message: &'a str) -> Self {
        Self { message, ..self }
    }

    fn exit_code(self, exit_code: Option<i32>) -> Self {
        Self { exit_code: exit_code.or(self.exit_code), ..self }
    }

    fn expires_at(self, at_ms: i64) -> Self {
        Self { expires_at_ms: Some(at_ms), ..self }
    }
}

/// Writes `change` to `lease` as read in this transaction, fenced on its
/// epoch and phase, moving its node row's allocation and cursor as the
/// change requires. `room` is the node's total, needed when a final lease
/// becomes open again.
async fn apply(
    conn: &mut AnyConnection,
    lease: &LeaseRecord,
    change: Change<'_>,
    now: i64,
    room: Option<Resources>,
) -> Result<LeaseRecord, LeaseError> {
    let leaving = lease.phase.is_open() && !change.to.is_open();
    let entering = !lease.phase.is_open() && change.to.is_open();
    let reserved = lease.reserved();
    let (cpu, memory) = (to_column(reserved.cpu_millis), to_column(reserved.memory_bytes));
    let moved: Option<i64> = if leaving {
        sqlx::query_scalar(
            "UPDATE node_ledger SET \
             cpu_allocated = CASE WHEN cpu_allocated > $2 THEN cpu_allocated - $2 ELSE 0 END, \
             memory_allocated = CASE WHEN memory_allocated > $3 THEN memory_allocated - $3 ELSE 0 END, \
             open_leases = CASE WHEN open_leases > 0 THEN open_leases - 1 ELSE 0 END, \
             assignment_cursor = assignment_cursor + 1 \
             WHERE node_id = $1 RETURNING assignment_cursor",
        )
        .bind(&lease.node_id)
        .bind(cpu)
        .bind(memory)
        .fetch_optional(&mut *conn)
        .await?
    } else if entering {
        let room = room.ok_or_else(|| StoreError::internal("reopening a lease without its node's capacity"))?;
        let cursor = sqlx::query_scalar(
            "UPDATE node_ledger SET cpu_allocated = cpu_allocated + $2, memory_allocated = memory_allocated + $3, \
             open_leases = open_leases + 1, assignment_cursor = assignment_cursor + 1 \
             WHERE node_id = $1 AND cpu_allocated + $2 <= $4 AND memory_allocated + $3 <= $5 \
             RETURNING assignment_cursor",
        )
        .bind(&lease.node_id)
        .bind(cpu)
        .bind(memory)
        .bind(to_column(room.cpu_millis))
        .bind(to_column(room.memory_bytes))
        .fetch_optional(&mut *conn)
        .await?;
        if cursor.is_none() {
            return Err(LeaseError::CustodyRefused {
                lease_id: lease.lease_id.clone(),
                reason: format!("node {} no longer has room for it", lease.node_id),
            });
        }
        cursor
    } else if change.epoch != lease.epoch {
        sqlx::query_scalar(
            "UPDATE node_ledger SET assignment_cursor = assignment_cursor + 1 WHERE node_id = $1 RETURNING assignment_cursor",
        )
        .bind(&lease.node_id)
        .fetch_optional(&mut *conn)
        .await?
    } else {
        Some(lease.seq)
    };
    let seq =
        moved.ok_or_else(|| StoreError::internal(format!("node {} has leases but no ledger row", lease.node_id)))?;
    let phase_changed_at_ms = if change.to == lease.phase { lease.phase_changed_at_ms } else { now };
    let done = sqlx::query(
        "UPDATE leases SET phase = $4, epoch = $5, reason = $6, message = $7, exit_code = $8, \
         phase_changed_at_ms = $9, expires_at_ms = $10, seq = $11, \
         ports = CASE WHEN $4 = 'running' THEN ports ELSE '' END \
         WHERE lease_id = $1 AND epoch = $2 AND phase = $3",
    )
    .bind(&lease.lease_id)
    .bind(lease.epoch)
    .bind(lease.phase.as_str())
    .bind(change.to.as_str())
    .bind(change.epoch)
    .bind(change.reason)
    .bind(change.message)
    .bind(change.exit_code.map(i64::from))
    .bind(phase_changed_at_ms)
    .bind(change.expires_at_ms)
    .bind(seq)
    .execute(&mut *conn)
    .await?;
    expect_one(done.rows_affected(), &format!("lease {} at epoch {}", lease.lease_id, lease.epoch))?;
    Ok(LeaseRecord {
        phase: change.to,
        epoch: change.epoch,
        reason: change.reason.to_owned(),
        message: change.message.to_owned(),
        exit_code: change.exit_code,
        phase_changed_at_ms,
        expires_at_ms: change.expires_at_ms,
        seq,
        // Where a replica listens holds only while it runs.
        ports: if change.to == Phase::Running { lease.ports.clone() } else { Vec::new() },
        ..lease.clone()
    })
}

/// Writes a lease's size and resize, fenced on the epoch and phase it was
/// read at; returns what was written.
async fn write_resize(
    conn: &mut AnyConnection,
    lease: &LeaseRecord,
    resources: Resources,
    resize: Resize,
    seq: i64,
) -> Result<(Resources, Resize), LeaseError> {
    let done = sqlx::query(
        "UPDATE leases SET cpu_millis = $4, memory_bytes = $5, resize_state = $6, resize_cpu_millis = $7, \
         resize_memory_bytes = $8, resize_reason = $9, resize_message = $10, seq = $11 \
         WHERE lease_id = $1 AND epoch = $2 AND phase = $3",
    )
    .bind(&lease.lease_id)
    .bind(lease.epoch)
    .bind(lease.phase.as_str())
    .bind(to_column(resources.cpu_millis))
    .bind(to_column(resources.memory_bytes))
    .bind(resize.state.as_str())
    .bind(to_column(resize.resources.cpu_millis))
    .bind(to_column(resize.resources.memory_bytes))
    .bind(&resize.reason)
    .bind(&resize.message)
    .bind(seq)
    .execute(&mut *conn)
    .await?;
    expect_one(done.rows_affected(), &format!("lease {} at epoch {}", lease.lease_id, lease.epoch))?;
    Ok((resources, resize))
}

/// How one ask of a batch is answered.
enum Slot {
    /// Its key names a lease that already exists.
    Existing(Box<LeaseRecord>),
    /// It is placed; the index is its position among the requests placed.
    Placed(usize),
    /// An earlier ask of the batch has its key; the index is that ask's position among the requests placed.
    SameAs(usize),
}

async fn place_in_tx(
    conn: &mut AnyConnection,
    now_sql: &str,
    ttl_ms: i64,
    asks: &[LeaseAsk],
    nodes: &[PlacementNode],
) -> Result<Vec<Result<Placed, LeaseError>>, LeaseError> {
    let now = berth_store::now_ms_in(conn, now_sql).await?;
    let existing = leases_by_key(conn, asks).await?;

    let mut slots = Vec::with_capacity(asks.len());
    let mut first_of_key: HashMap<(String, String), usize> = HashMap::new();
    let mut to_place: Vec<&LeaseAsk> = Vec::new();
    for ask in asks {
        let key = (ask.project.clone(), ask.idempotency_key.clone());
        if let Some(lease) = existing.get(&key) {
            slots.push(Slot::Existing(Box::new(lease.clone())));
        } else if let Some(&position) = first_of_key.get(&key) {
            slots.push(Slot::SameAs(position));
        } else {
            first_of_key.insert(key, to_place.len());
            slots.push(Slot::Placed(to_place.len()));
            to_place.push(ask);
        }
    }

    let rows = node_rows(conn).await?;
    let mut candidates: Vec<PlacementNode> = nodes.to_vec();
    for node in &mut candidates {
        node.allocated = rows.get(&node.node_id).map(|row| row.allocated).unwrap_or_default();
        node.spread.clear();
    }
    let groups: BTreeSet<(&str, &str)> = to_place
        .iter()
        .filter(|ask| !ask.spread_group.is_empty())
        .map(|ask| (ask.project.as_str(), ask.spread_group.as_str()))
        .collect();
    if !groups.is_empty() {
        let index: HashMap<String, usize> =
            candidates.iter().enumerate().map(|(i, node)| (node.node_id.clone(), i)).collect();
        for (project, group, node_id, count) in spread_counts(conn, &groups).await? {
            if let Some(&i) = index.get(&node_id) {
                candidates[i].spread.insert(spread_key(&project, &group), u32::try_from(count).unwrap_or(u32::MAX));
            }
        }
    }
    let mut requests: Vec<PlacementRequest> = Vec::with_capacity(to_place.len());
    for ask in &to_place {
        let keys = ask.workload.cache.iter().map(|mount| mount.key.as_str());
        let warm_nodes = warm_nodes(conn, &ask.project, keys).await?;
        requests.push(PlacementRequest {
            resources: ask.resources,
            tier: ask.tier.clone(),
            spread_group: spread_key(&ask.project, &ask.spread_group),
            runtime: RuntimeNeed::of_workload(&ask.workload),
            warm_nodes,
        });
    }
    let plan = place(&candidates, &requests);

    // Node rows are taken in id order so that concurrent batches never deadlock.
    let mut per_node: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (position, placement) in plan.placements.iter().enumerate() {
        if let Some(node_id) = placement.node_id() {
            per_node.entry(node_id).or_default().push(position);
        }
    }
    let missing: Vec<&str> = per_node.keys().copied().filter(|node_id| !rows.contains_key(*node_id)).collect();
    if !missing.is_empty() {
        let rows: Vec<String> = (1..=missing.len()).map(|i| format!("(${i})")).collect();
        let sql =
            format!("INSERT INTO node_ledger (node_id) VALUES {} ON CONFLICT (node_id) DO NOTHING", rows.join(", "));
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for node_id in &missing {
            query = query.bind(*node_id);
        }
        query.execute(&mut *conn).await?;
    }
    let totals: HashMap<&str, Resources> = candidates.iter().map(|n| (n.node_id.as_str(), n.total)).collect();
    // What each placed lease holds of its node: its size and the node's overhead.
    let on_node: HashMap<&str, &PlacementNode> = candidates.iter().map(|n| (n.node_id.as_str(), n)).collect();
    let charged: Vec<Resources> = plan
        .placements
        .iter()
        .zip(&requests)
        .map(|(placement, request)| {
            placement.node_id().and_then(|id| on_node.get(id)).map_or(request.resources, |n| n.footprint(request))
        })
        .collect();
    let cursors = allocate(conn, &per_node, &charged, &totals).await?;
    let mut seqs = vec![0i64; to_place.len()];
    for (node_id, positions) in &per_node {
        let cursor = cursors.get(*node_id).copied().unwrap_or_default();
        let count = i64::try_from(positions.len()).unwrap_or(i64::MAX);
        for (k, &position) in positions.iter().enumerate() {
            seqs[position] = cursor - count + 1 + i64::try_from(k).unwrap_or_default();
        }
    }

    let mut placed: Vec<Option<LeaseRecord>> = vec![None; to_place.len()];
    for (position, placement) in plan.placements.iter().enumerate() {
        if let Placement::Node(node_id) = placement {
            let ask = to_place[position];
            placed[position] = Some(LeaseRecord {
                lease_id: new_lease_id(),
                project: ask.project.clone(),
                idempotency_key: ask.idempotency_key.clone(),
                owner: ask.owner.clone(),
                node_id: node_id.clone(),
                phase: Phase::Bound,
                epoch: 1,
                resources: ask.resources,
                tier: ask.tier.clone(),
                spread_group: ask.spread_group.clone(),
                workload: ask.workload.clone(),
                reason: String::new(),
                message: String::new(),
                exit_code: None,
                created_at_ms: now,
                phase_changed_at_ms: now,
                expires_at_ms: Some(now.saturating_add(ttl_ms)),
                seq: seqs[position],
                traceparent: ask.traceparent.clone(),
                ports: Vec::new(),
                resize: None,
                cache: Vec::new(),
                memory_overhead: charged[position].minus(ask.resources).memory_bytes,
            });
        }
    }
    insert_leases(conn, now, now.saturating_add(ttl_ms), placed.iter().flatten()).await?;

    let outcome = |position: usize, created: bool| match (&placed[position], &plan.placements[position]) {
        (Some(lease), _) => Ok(Placed { lease: lease.clone(), created }),
        (None, Placement::NoRoom(shortage)) => Err(LeaseError::NoRoom(shortage.clone())),
        (None, Placement::Node(_)) => Err(StoreError::internal("a placed lease was not recorded").into()),
    };
    Ok(slots
        .into_iter()
        .map(|slot| match slot {
            Slot::Existing(lease) => Ok(Placed { lease: *lease, created: false }),
            Slot::Placed(position) => outcome(position, true),
            Slot::SameAs(position) => outcome(position, false).map_err(|error| error.for_each_caller()),
        })
        .collect())
}

/// Adds each node's new leases to its row, in one statement, only where they
/// fit the node's total; the node's assignment cursor after the addition.
async fn allocate(
    conn: &mut AnyConnection,
    per_node: &BTreeMap<&str, Vec<usize>>,
    charged: &[Resources],
    totals: &HashMap<&str, Resources>,
) -> Result<HashMap<String, i64>, LeaseError> {
    let mut cursors = HashMap::with_capacity(per_node.len());
    let nodes: Vec<(&&str, &Vec<usize>)> = per_node.iter().collect();
    for chunk in nodes.chunks(ROWS_PER_STATEMENT) {
        let rows: Vec<String> = (0..chunk.len())
            .map(|row| {
                let p = |k: usize| format!("${}", row * 6 + k);
                format!(
                    "SELECT {} AS node_id, {} AS cpu, {} AS memory, {} AS leases, {} AS cpu_total, {} AS memory_total",
                    p(1),
                    p(2),
                    p(3),
                    p(4),
                    p(5),
                    p(6)
                )
            })
            .collect();
        let sql = format!(
            "UPDATE node_ledger SET cpu_allocated = node_ledger.cpu_allocated + v.cpu, \
             memory_allocated = node_ledger.memory_allocated + v.memory, \
             open_leases = node_ledger.open_leases + v.leases, \
             assignment_cursor = node_ledger.assignment_cursor + v.leases \
             FROM ({}) AS v \
             WHERE node_ledger.node_id = v.node_id AND node_ledger.cpu_allocated + v.cpu <= v.cpu_total \
             AND node_ledger.memory_allocated + v.memory <= v.memory_total \
             RETURNING node_ledger.node_id, node_ledger.assignment_cursor",
            rows.join(" UNION ALL ")
        );
        let mut query = sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql));
        for (node_id, positions) in chunk {
            let wanted = positions.iter().fold(Resources::default(), |sum, &p| sum.plus(charged[p]));
            let total = totals.get(**node_id).copied().unwrap_or_default();
            query = query
                .bind(**node_id)
                .bind(to_column(wanted.cpu_millis))
                .bind(to_column(wanted.memory_bytes))
                .bind(i64::try_from(positions.len()).unwrap_or(i64::MAX))
                .bind(to_column(total.cpu_millis))
                .bind(to_column(total.memory_bytes));
        }
        cursors.extend(query.fetch_all(&mut *conn).await?);
    }
    if let Some(node_id) = per_node.keys().find(|node_id| !cursors.contains_key(**node_id)) {
        // Only a concurrent placement can move a row between the read and
        // this write; placing the batch again sees it.
        return Err(StoreError::Conflict { what: format!("node {node_id}'s allocation") }.into());
    }
    Ok(cursors)
}

fn new_lease_id() -> String {
    format!("l-{}", hex::encode(rand::random::<[u8; 10]>()))
}

async fn leases_by_key(
    conn: &mut AnyConnection,
    asks: &[LeaseAsk],
) -> Result<HashMap<(String, String), LeaseRecord>, LeaseError> {
    let keys: BTreeSet<(&str, &str)> = asks.iter().map(|a| (a.project.as_str(), a.idempotency_key.as_str())).collect();
    let keys: Vec<(&str, &str)> = keys.into_iter().collect();
    let mut found = HashMap::new();
    for chunk in keys.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            concat!("SELECT ", lease_columns!(), " FROM leases WHERE (project, idempotency_key) IN (VALUES {})"),
            placeholders(chunk.len(), 0, 2)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (project, key) in chunk {
            query = query.bind(*project).bind(*key);
        }
        for row in query.fetch_all(&mut *conn).await? {
            let lease = LeaseRecord::from_row(&row)?;
            found.insert((lease.project.clone(), lease.idempotency_key.clone()), lease);
        }
    }
    Ok(found)
}

async fn spread_counts(
    conn: &mut AnyConnection,
    groups: &BTreeSet<(&str, &str)>,
) -> Result<Vec<(String, String, String, i64)>, LeaseError> {
    let groups: Vec<&(&str, &str)> = groups.iter().collect();
    let mut counts = Vec::new();
    for chunk in groups.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "SELECT project, spread_group, node_id, COUNT(*) FROM leases \
             WHERE spread_group <> '' AND phase IN {OPEN_PHASES_SQL} AND (project, spread_group) IN (VALUES {}) \
             GROUP BY project, spread_group, node_id",
            placeholders(chunk.len(), 0, 2)
        );
        let mut query = sqlx::query_as::<_, (String, String, String, i64)>(sqlx::AssertSqlSafe(sql));
        for (project, group) in chunk {
            query = query.bind(*project).bind(*group);
        }
        counts.extend(query.fetch_all(&mut *conn).await?);
    }
    Ok(counts)
}

async fn insert_leases<'a>(
    conn: &mut AnyConnection,
    now: i64,
    expires_at: i64,
    leases: impl Iterator<Item = &'a LeaseRecord>,
) -> Result<(), LeaseError> {
    let leases: Vec<&LeaseRecord> = leases.collect();
    for chunk in leases.chunks(ROWS_PER_STATEMENT) {
        let values: Vec<String> = (0..chunk.len())
            .map(|row| {
                let p = |k: usize| format!("${}", 2 + row * 13 + k);
                format!(
                    "({}, {}, {}, {}, {}, 'bound', 1, {}, {}, {}, {}, {}, $1, $1, $2, {}, {}, {})",
                    p(1),
                    p(2),
                    p(3),
                    p(4),
                    p(5),
                    p(6),
                    p(7),
                    p(8),
                    p(9),
                    p(10),
                    p(11),
                    p(12),
                    p(13)
                )
            })
            .collect();
        let sql = format!(
            "INSERT INTO leases (lease_id, project, idempotency_key, owner, node_id, phase, epoch, cpu_millis, \
             memory_bytes, tier, spread_group, workload, created_at_ms, phase_changed_at_ms, expires_at_ms, seq, \
             traceparent, memory_overhead_bytes) VALUES {}",
            values.join(", ")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now).bind(expires_at);
        for lease in chunk {
            query = query
                .bind(lease.lease_id.as_str())
                .bind(lease.project.as_str())
                .bind(lease.idempotency_key.as_str())
                .bind(lease.owner.as_str())
                .bind(lease.node_id.as_str())
                .bind(to_column(lease.resources.cpu_millis))
                .bind(to_column(lease.resources.memory_bytes))
                .bind(lease.tier.as_str())
                .bind(lease.spread_group.as_str())
                .bind(lease.workload.encode_to_vec())
                .bind(lease.seq)
                .bind(lease.traceparent.as_str())
                .bind(to_column(lease.memory_overhead));
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}

/// The nodes holding the heads of `keys` in `project`: those that sealed
/// them and those that reported holding them.
async fn warm_nodes(
    conn: &mut AnyConnection,
    project: &str,
    keys: impl Iterator<Item = &str>,
) -> Result<Vec<String>, LeaseError> {
    let mut nodes: Vec<String> = Vec::new();
    for key in keys {
        let holding: Vec<String> = sqlx::query_scalar(
            "SELECT g.node_id FROM cache_heads h JOIN cache_generations g ON g.project = h.project \
             AND g.cache_key = h.cache_key AND g.generation = h.generation WHERE h.project = $1 AND h.cache_key = $2 \
             UNION SELECT c.node_id FROM cache_heads h JOIN cache_holders c ON c.project = h.project \
             AND c.cache_key = h.cache_key AND c.generation = h.generation WHERE h.project = $1 AND h.cache_key = $2",
        )
        .bind(project)
        .bind(key)
        .fetch_all(&mut *conn)
        .await?;
        for node in holding {
            if !nodes.contains(&node) {
                nodes.push(node);
            }
        }
    }
    nodes.sort();
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_number_rows_after_the_shared_ones() {
        assert_eq!(placeholders(2, 2, 2), "($3, $4), ($5, $6)");
        assert_eq!(placeholders(3, 1, 1), "$2, $3, $4");
        assert_eq!(placeholders(1, 0, 2), "($1, $2)");
    }

    #[test]
    fn spread_keys_keep_projects_apart() {
        assert_ne!(spread_key("a", "web"), spread_key("b", "web"));
        assert_eq!(spread_key("a", ""), "");
    }

    #[test]
    fn each_error_maps_to_the_code_a_client_can_act_on() {
        use tonic::Code;
        let cases: Vec<(LeaseError, Code)> = vec![
            (LeaseError::InvalidArgument { field: "owner", reason: "must not be empty".into() }, Code::InvalidArgument),
            (LeaseError::NotFound("l-1".into()), Code::NotFound),
            (LeaseError::NotOnNode { lease_id: "l-1".into(), caller: "n-2".into() }, Code::PermissionDenied),
            (LeaseError::StaleEpoch { lease_id: "l-1".into(), held: 1, current: 2 }, Code::FailedPrecondition),
            (
                LeaseError::IllegalTransition { lease_id: "l-1".into(), from: Phase::Done, to: Phase::Running },
                Code::FailedPrecondition,
            ),
            (
                LeaseError::CustodyRefused { lease_id: "l-1".into(), reason: "it is DONE".into() },
                Code::FailedPrecondition,
            ),
            (LeaseError::Unavailable("starting".into()), Code::Unavailable),
            (LeaseError::Store(StoreError::Contended { attempts: 5, source: None }), Code::Aborted),
        ];
        for (error, code) in cases {
            let message = error.to_string();
            let status = tonic::Status::from(error);
            assert_eq!(status.code(), code, "{message}");
        }
    }

    #[test]
    fn an_illegal_move_names_both_phases() {
        let error = LeaseError::IllegalTransition { lease_id: "l-1".into(), from: Phase::Done, to: Phase::Running };
        assert_eq!(error.to_string(), "lease l-1 cannot move from DONE to RUNNING");
    }
}
