//! Gateways, routes, plans and node states in the database: every read and
//! write, each one transaction through [`Store::tx`], and the one error they
//! return.
//!
//! # Who writes this
//! - `ApplyGateway`/`ApplyRoute`/`Delete*`: declarations (`spec`,
//!   `generation`, times). Never a status.
//! - The elected full pass, every write fenced on its leadership term in the
//!   same transaction ([`Fence`]): gateway and route statuses, plans, the
//!   plans each node hosts, and node state generations.
//! - `AckEgress`: the ack columns of one node's rows, for that node only.
//!
//! # Invariants
//! - A plan's generation grows only when its content changed; a status is
//!   written only when it changed.
//! - `node_plans.plan_generation` equals the plan's generation after every
//!   commit: a plan change updates it and bumps the generation of every node
//!   hosting the project in the same transaction. So a node state read in one
//!   transaction is exactly the state at its generation.
//! - A node row is never deleted, so its generation never goes back.

use std::collections::{BTreeMap, BTreeSet};

use berth_proto::egress::v1 as proto;
use berth_store::{Fence, Store, StoreError};
use prost::Message as _;
use sqlx::AnyConnection;
use sqlx::Row as _;
use sqlx::any::AnyRow;

use crate::records::{Declared, DnsRow, GatewayRow, ObjectRow, PlanRow, RouteRow, object_columns, timestamp, unsigned};
use crate::render::Rendered;
use crate::validate::{ObjectKey, ValidGateway, ValidRoute};

/// Why a catalog operation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CatalogError {
    /// No gateway has this name in this project.
    #[error("gateway {0} not found")]
    GatewayNotFound(ObjectKey),
    /// No route has this name in this project.
    #[error("route {0} not found")]
    RouteNotFound(ObjectKey),
    /// No DNS config was applied to this project.
    #[error("no DNS config was applied to project {0}: its workloads resolve with the default (no upstream, ndots 1)")]
    DnsNotFound(String),
    /// No plan has been compiled for this project yet.
    #[error("no plan has been compiled for project {0} yet")]
    PlanNotFound(String),
    /// A node acknowledged a generation it was never sent.
    #[error("generation {acked} was never sent to node {node_id}: its newest state is generation {current}")]
    AckFromTheFuture {
        /// The node.
        node_id: String,
        /// What it acknowledged.
        acked: u64,
        /// What it was last sent.
        current: u64,
    },
    /// The full pass writing lost its leadership; a newer term decides now.
    #[error("this replica no longer runs the egress full pass")]
    Deposed,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(CatalogError, |error| match error {
    CatalogError::GatewayNotFound(_)
    | CatalogError::RouteNotFound(_)
    | CatalogError::DnsNotFound(_)
    | CatalogError::PlanNotFound(_) => {
        tonic::Status::not_found(error.to_string())
    }
    CatalogError::AckFromTheFuture { .. } => tonic::Status::failed_precondition(format!("generation: {error}")),
    CatalogError::Deposed => tonic::Status::unavailable(error.to_string()),
    CatalogError::Store(error) => error.into(),
});

/// What one full pass of a project wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PassWrite {
    /// The plan's generation after the pass.
    pub(crate) generation: u64,
    /// Whether the plan changed (and its generation grew).
    pub(crate) plan_changed: bool,
    /// How many gateway and route statuses changed.
    pub(crate) statuses_written: usize,
    /// Nodes whose state changed with the plan.
    pub(crate) nodes: Vec<String>,
}

/// A node's whole state: its generation and the plans it hosts, by project.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NodeState {
    pub(crate) generation: u64,
    pub(crate) plans: Vec<PlanRow>,
}

/// What the database holds for the egress service; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Catalog {
    store: Store,
}

/// A declared object: the table and the words for it.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Gateway,
    Route,
    /// A project's DNS config, stored under the one name [`DNS_NAME`].
    Dns,
}

/// The name a project's DNS config is stored under.
const DNS_NAME: &str = "dns";

/// A project's DNS config row, by project and [`DNS_NAME`].
const SELECT_DNS: &str = concat!("SELECT ", object_columns!(), " FROM dns_configs WHERE project = $1 AND name = $2");

impl Kind {
    fn table(self) -> &'static str {
        match self {
            Self::Gateway => "gateways",
            Self::Route => "routes",
            Self::Dns => "dns_configs",
        }
    }

    fn apply_op(self) -> &'static str {
        match self {
            Self::Gateway => "egress.apply_gateway",
            Self::Route => "egress.apply_route",
            Self::Dns => "egress.apply_dns_config",
        }
    }

    fn not_found(self, key: &ObjectKey) -> CatalogError {
        match self {
            Self::Gateway => CatalogError::GatewayNotFound(key.clone()),
            Self::Route => CatalogError::RouteNotFound(key.clone()),
            Self::Dns => CatalogError::DnsNotFound(key.project.clone()),
        }
    }
}

/// The key a project's DNS config is stored under.
fn dns_key(project: &str) -> ObjectKey {
    ObjectKey { project: project.to_owned(), name: DNS_NAME.to_owned() }
}

impl Catalog {
    pub(crate) fn new(store: Store) -> Self {
        Self { store }
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// Creates or replaces a gateway; the gateway as stored, and whether its declaration changed.
    pub(crate) async fn apply_gateway(&self, valid: &ValidGateway) -> Result<(GatewayRow, bool), CatalogError> {
        let spec = valid.spec.encode_to_vec();
        let status = proto::GatewayStatus::default().encode_to_vec();
        let (row, changed) = self.upsert(Kind::Gateway, &valid.key, spec, status).await?;
        Ok((GatewayRow::from_row(&row)?, changed))
    }

    /// Creates or replaces a route; the route as stored, and whether its declaration changed.
    pub(crate) async fn apply_route(&self, valid: &ValidRoute) -> Result<(RouteRow, bool), CatalogError> {
        let spec = valid.spec.encode_to_vec();
        let status = proto::RouteStatus::default().encode_to_vec();
        let (row, changed) = self.upsert(Kind::Route, &valid.key, spec, status).await?;
        Ok((RouteRow::from_row(&row)?, changed))
    }

    /// Sets `project`'s DNS config (canonical); the config as stored, and whether it changed.
    pub(crate) async fn apply_dns(
        &self,
        project: &str,
        spec: &proto::DnsConfig,
    ) -> Result<(DnsRow, bool), CatalogError> {
        let (row, changed) = self.upsert(Kind::Dns, &dns_key(project), spec.encode_to_vec(), Vec::new()).await?;
        Ok((DnsRow::from_row(&row)?, changed))
    }

    /// `project`'s DNS config, as applied.
    pub(crate) async fn dns(&self, project: &str) -> Result<DnsRow, CatalogError> {
        let key = dns_key(project);
        self.object("egress.get_dns_config", SELECT_DNS, &key).await?.ok_or_else(|| Kind::Dns.not_found(&key))
    }

    /// Writes a declaration unless it is unchanged, and reads the row back,
    /// in one transaction. Applies of one object from many clients at once
    /// collide on PostgreSQL; beyond the store's own retries, the whole apply
    /// is run again a few times before the caller is told to retry.
    async fn upsert(
        &self,
        kind: Kind,
        key: &ObjectKey,
        spec: Vec<u8>,
        status: Vec<u8>,
    ) -> Result<(AnyRow, bool), CatalogError> {
        let now = self.store.now_ms_sql();
        let table = kind.table();
        let write = format!(
            "INSERT INTO {table} (project, name, spec, status, generation, created_at_ms, updated_at_ms) \
             VALUES ($1, $2, $3, $4, 1, {now}, {now}) \
             ON CONFLICT (project, name) DO UPDATE SET spec = excluded.spec, \
             generation = {table}.generation + 1, updated_at_ms = excluded.updated_at_ms \
             WHERE {table}.spec <> excluded.spec"
        );
        let read = format!("SELECT {} FROM {table} WHERE project = $1 AND name = $2", object_columns!());
        let (spec, status, write, read) = (&spec, &status, &write, &read);
        let op = kind.apply_op();
        self.store
            .upsert(op, |conn| {
                Box::pin(async move {
                    let done = sqlx::query(sqlx::AssertSqlSafe(write.as_str()))
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .bind(spec.as_slice())
                        .bind(status.as_slice())
                        .execute(&mut *conn)
                        .await?;
                    let row = sqlx::query(sqlx::AssertSqlSafe(read.as_str()))
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .fetch_one(&mut *conn)
                        .await?;
                    Ok::<_, CatalogError>((row, done.rows_affected() > 0))
                })
            })
            .await
    }

    /// One gateway.
    pub(crate) async fn gateway(&self, key: &ObjectKey) -> Result<Option<GatewayRow>, CatalogError> {
        let sql = concat!("SELECT ", object_columns!(), " FROM gateways WHERE project = $1 AND name = $2");
        self.object("egress.get_gateway", sql, key).await
    }

    /// One route.
    pub(crate) async fn route(&self, key: &ObjectKey) -> Result<Option<RouteRow>, CatalogError> {
        let sql = concat!("SELECT ", object_columns!(), " FROM routes WHERE project = $1 AND name = $2");
        self.object("egress.get_route", sql, key).await
    }

    /// One gateway or route, read as `op` by `sql` (which selects
    /// [`object_columns!`] by project and name).
    async fn object<S, T>(
        &self,
        op: &'static str,
        sql: &'static str,
        key: &ObjectKey,
    ) -> Result<Option<ObjectRow<S, T>>, CatalogError>
    where
        S: prost::Message + Default + Send,
        T: prost::Message + Default + Send,
    {
        self.store
            .read(op, |conn| {
                Box::pin(async move {
                    let row = sqlx::query(sql)
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .fetch_optional(&mut *conn)
                        .await?;
                    Ok(row.as_ref().map(ObjectRow::from_row).transpose()?)
                })
            })
            .await
    }

    /// A project's gateways, by name.
    pub(crate) async fn gateways(&self, project: &str) -> Result<Vec<GatewayRow>, CatalogError> {
        self.store
            .read("egress.list_gateways", |conn| Box::pin(async move { fetch_gateways(conn, project).await }))
            .await
    }

    /// A project's routes, by name.
    pub(crate) async fn routes(&self, project: &str) -> Result<Vec<RouteRow>, CatalogError> {
        self.store.read("egress.list_routes", |conn| Box::pin(async move { fetch_routes(conn, project).await })).await
    }

    /// Deletes a gateway.
    pub(crate) async fn delete_gateway(&self, key: &ObjectKey) -> Result<(), CatalogError> {
        self.delete(Kind::Gateway, key, "egress.delete_gateway").await
    }

    /// Deletes a route.
    pub(crate) async fn delete_route(&self, key: &ObjectKey) -> Result<(), CatalogError> {
        self.delete(Kind::Route, key, "egress.delete_route").await
    }

    async fn delete(&self, kind: Kind, key: &ObjectKey, op: &'static str) -> Result<(), CatalogError> {
        let sql = format!("DELETE FROM {} WHERE project = $1 AND name = $2", kind.table());
        let sql = &sql;
        self.store
            .tx(op, |conn| {
                Box::pin(async move {
                    let done = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .execute(&mut *conn)
                        .await?;
                    if done.rows_affected() == 0 { Err(kind.not_found(key)) } else { Ok(()) }
                })
            })
            .await
    }

    /// A project's plan as last compiled, with each hosting node's ack.
    pub(crate) async fn plan(&self, project: &str) -> Result<proto::EgressPlan, CatalogError> {
        self.store
            .read("egress.get_plan", |conn| {
                Box::pin(async move {
                    let plan = fetch_plan(conn, project).await?;
                    let plan = plan.ok_or_else(|| CatalogError::PlanNotFound(project.to_owned()))?;
                    let rows = sqlx::query(
                        "SELECT node_id, acked_plan_generation, acked_at_ms, ack_error, ack_enforcement \
                         FROM node_plans WHERE project = $1 ORDER BY node_id",
                    )
                    .bind(project)
                    .fetch_all(&mut *conn)
                    .await?;
                    let acks = rows
                        .iter()
                        .map(|row| -> Result<proto::NodeAck, sqlx::Error> {
                            let acked_at: Option<i64> = row.try_get("acked_at_ms")?;
                            Ok(proto::NodeAck {
                                node_id: row.try_get("node_id")?,
                                generation: unsigned(row.try_get("acked_plan_generation")?),
                                acked_at: acked_at.map(timestamp),
                                error: row.try_get("ack_error")?,
                                enforcement: i32::try_from(row.try_get::<i64, _>("ack_enforcement")?)
                                    .unwrap_or_default(),
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(plan.to_proto(acks))
                })
            })
            .await
    }

    /// Every project that has a gateway, a route or a plan.
    pub(crate) async fn projects(&self) -> Result<BTreeSet<String>, CatalogError> {
        self.store
            .read("egress.projects", |conn| {
                Box::pin(async move {
                    let rows: Vec<(String,)> = sqlx::query_as(
                        "SELECT project FROM gateways UNION SELECT project FROM routes \
                         UNION SELECT project FROM dns_configs UNION SELECT project FROM plans",
                    )
                    .fetch_all(&mut *conn)
                    .await?;
                    Ok(rows.into_iter().map(|(project,)| project).collect())
                })
            })
            .await
    }

    /// One full pass of `project`: reads its gateways, routes, DNS config
    /// and plan, renders them through `build` (the compile), and writes what
    /// changed, fenced on `fence`, all in one transaction.
    pub(crate) async fn write_pass<F>(&self, fence: &Fence, project: &str, build: F) -> Result<PassWrite, CatalogError>
    where
        F: Fn(&Declared, Option<&PlanRow>, i64) -> Rendered + Send + Sync,
    {
        let now_sql = self.store.now_ms_sql();
        let build = &build;
        self.store
            .tx("egress.full_pass", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let declared = Declared {
                        gateways: fetch_gateways(conn, project).await?,
                        routes: fetch_routes(conn, project).await?,
                        dns: fetch_dns(conn, project).await?,
                    };
                    let previous = fetch_plan(conn, project).await?;
                    let rendered = build(&declared, previous.as_ref(), now);
                    let Declared { gateways, routes, .. } = &declared;
                    write_rendered(conn, project, gateways, routes, previous.as_ref(), rendered, now).await
                })
            })
            .await
    }

    /// Makes each node's hosted projects what `hosting` says (node id to the
    /// projects with an open lease on it), fenced on `fence`: rows for
    /// projects without a plan yet are left for after their first pass. The
    /// nodes whose state changed.
    pub(crate) async fn place(
        &self,
        fence: &Fence,
        hosting: &BTreeMap<String, BTreeSet<String>>,
    ) -> Result<Vec<String>, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("egress.place", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let plans: BTreeMap<String, i64> =
                        sqlx::query_as::<_, (String, i64)>("SELECT project, generation FROM plans")
                            .fetch_all(&mut *conn)
                            .await?
                            .into_iter()
                            .collect();
                    let mut stored: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
                    for (node_id, project) in
                        sqlx::query_as::<_, (String, String)>("SELECT node_id, project FROM node_plans")
                            .fetch_all(&mut *conn)
                            .await?
                    {
                        stored.entry(node_id).or_default().insert(project);
                    }
                    let empty = BTreeSet::new();
                    let nodes: BTreeSet<&String> = hosting.keys().chain(stored.keys()).collect();
                    let mut changed = Vec::new();
                    for node_id in nodes {
                        let want: BTreeSet<&String> = hosting
                            .get(node_id)
                            .unwrap_or(&empty)
                            .iter()
                            .filter(|project| plans.contains_key(*project))
                            .collect();
                        let have: BTreeSet<&String> = stored.get(node_id).unwrap_or(&empty).iter().collect();
                        if want == have {
                            continue;
                        }
                        for project in have.difference(&want) {
                            sqlx::query("DELETE FROM node_plans WHERE node_id = $1 AND project = $2")
                                .bind(node_id.as_str())
                                .bind(project.as_str())
                                .execute(&mut *conn)
                                .await?;
                        }
                        for project in want.difference(&have) {
                            sqlx::query(
                                "INSERT INTO node_plans (node_id, project, plan_generation) VALUES ($1, $2, $3)",
                            )
                            .bind(node_id.as_str())
                            .bind(project.as_str())
                            .bind(plans.get(*project).copied().unwrap_or_default())
                            .execute(&mut *conn)
                            .await?;
                        }
                        bump_node(conn, node_id, now).await?;
                        changed.push(node_id.clone());
                    }
                    Ok(changed)
                })
            })
            .await
    }

    /// A node's current state; generation 0 and no plans for a node never sent anything.
    pub(crate) async fn node_state(&self, node_id: &str) -> Result<NodeState, CatalogError> {
        self.store
            .tx("egress.node_state", |conn| {
                Box::pin(async move {
                    let generation: Option<i64> = sqlx::query_scalar("SELECT generation FROM nodes WHERE node_id = $1")
                        .bind(node_id)
                        .fetch_optional(&mut *conn)
                        .await?;
                    let rows = sqlx::query(
                        "SELECT p.project, p.generation, p.content, p.compiled_at_ms FROM node_plans n \
                         JOIN plans p ON p.project = n.project WHERE n.node_id = $1 ORDER BY p.project",
                    )
                    .bind(node_id)
                    .fetch_all(&mut *conn)
                    .await?;
                    let plans = rows.iter().map(PlanRow::from_row).collect::<Result<Vec<_>, _>>()?;
                    Ok(NodeState { generation: generation.map(unsigned).unwrap_or_default(), plans })
                })
            })
            .await
    }

    /// A node's current generation, cheaply; 0 for a node never sent anything.
    pub(crate) async fn node_generation(&self, node_id: &str) -> Result<u64, CatalogError> {
        let generation: Option<i64> = sqlx::query_scalar("SELECT generation FROM nodes WHERE node_id = $1")
            .bind(node_id)
            .fetch_optional(self.store.pool())
            .await?;
        Ok(generation.map(unsigned).unwrap_or_default())
    }

    /// Records that `node_id` applied (or, with `error`, failed to apply) its
    /// state at `generation`, enforcing it as `enforcement` says. An ack
    /// older than one already recorded changes nothing; acking the current
    /// generation records, per hosted project, the plan generation it carried.
    pub(crate) async fn ack(
        &self,
        node_id: &str,
        generation: u64,
        error: &str,
        enforcement: proto::EgressEnforcement,
    ) -> Result<(), CatalogError> {
        let enforcement = i64::from(enforcement as i32);
        let now_sql = self.store.now_ms_sql();
        let acked = i64::try_from(generation).unwrap_or(i64::MAX);
        self.store
            .tx("egress.ack", |conn| {
                Box::pin(async move {
                    let row: Option<(i64, i64)> =
                        sqlx::query_as("SELECT generation, acked_generation FROM nodes WHERE node_id = $1")
                            .bind(node_id)
                            .fetch_optional(&mut *conn)
                            .await?;
                    let (current, last_acked) = row.unwrap_or((0, 0));
                    if acked > current {
                        return Err(CatalogError::AckFromTheFuture {
                            node_id: node_id.to_owned(),
                            acked: generation,
                            current: unsigned(current),
                        });
                    }
                    if row.is_none() || acked < last_acked {
                        return Ok(());
                    }
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    sqlx::query(
                        "UPDATE nodes SET acked_generation = $2, acked_at_ms = $3, ack_error = $4 WHERE node_id = $1",
                    )
                    .bind(node_id)
                    .bind(acked)
                    .bind(now)
                    .bind(error)
                    .execute(&mut *conn)
                    .await?;
                    if acked == current {
                        let sql = if error.is_empty() {
                            "UPDATE node_plans SET acked_plan_generation = plan_generation, acked_at_ms = $2, \
                             ack_error = $3, ack_enforcement = $4 WHERE node_id = $1"
                        } else {
                            "UPDATE node_plans SET acked_at_ms = $2, ack_error = $3, ack_enforcement = $4 \
                             WHERE node_id = $1"
                        };
                        sqlx::query(sql)
                            .bind(node_id)
                            .bind(now)
                            .bind(error)
                            .bind(enforcement)
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .await
    }
}

/// Writes each of `rendered`'s statuses that differs from its stored row's
/// into `kind`'s table; returns how many it wrote.
async fn write_statuses<S, T: PartialEq + prost::Message>(
    conn: &mut AnyConnection,
    kind: Kind,
    project: &str,
    rows: &[ObjectRow<S, T>],
    rendered: &[(String, T)],
) -> Result<usize, CatalogError> {
    let sql = format!("UPDATE {} SET status = $3 WHERE project = $1 AND name = $2", kind.table());
    let mut written = 0;
    for (name, status) in rendered {
        if rows.iter().any(|row| &row.name == name && &row.status != status) {
            sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
                .bind(project)
                .bind(name.as_str())
                .bind(status.encode_to_vec())
                .execute(&mut *conn)
                .await?;
            written += 1;
        }
    }
    Ok(written)
}

/// Writes what changed in `rendered`: statuses, the plan, and the state of
/// every node hosting the project when the plan changed.
async fn write_rendered(
    conn: &mut AnyConnection,
    project: &str,
    gateways: &[GatewayRow],
    routes: &[RouteRow],
    previous: Option<&PlanRow>,
    rendered: Rendered,
    now: i64,
) -> Result<PassWrite, CatalogError> {
    let statuses_written = write_statuses(conn, Kind::Gateway, project, gateways, &rendered.gateways).await?
        + write_statuses(conn, Kind::Route, project, routes, &rendered.routes).await?;
    if let Some(previous) = previous
        && previous.content == rendered.content
    {
        return Ok(PassWrite {
            generation: unsigned(previous.generation),
            plan_changed: false,
            statuses_written,
            nodes: Vec::new(),
        });
    }
    let generation = previous.map_or(1, |p| p.generation + 1);
    sqlx::query(
        "INSERT INTO plans (project, generation, content, compiled_at_ms) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (project) DO UPDATE SET generation = excluded.generation, content = excluded.content, \
         compiled_at_ms = excluded.compiled_at_ms",
    )
    .bind(project)
    .bind(generation)
    .bind(rendered.content.encode_to_vec())
    .bind(now)
    .execute(&mut *conn)
    .await?;
    sqlx::query("UPDATE node_plans SET plan_generation = $2 WHERE project = $1")
        .bind(project)
        .bind(generation)
        .execute(&mut *conn)
        .await?;
    let nodes: Vec<String> = sqlx::query_scalar("SELECT node_id FROM node_plans WHERE project = $1 ORDER BY node_id")
        .bind(project)
        .fetch_all(&mut *conn)
        .await?;
    for node_id in &nodes {
        bump_node(conn, node_id, now).await?;
    }
    Ok(PassWrite { generation: unsigned(generation), plan_changed: true, statuses_written, nodes })
}

/// Moves a node's state to its next generation (its first, for a new node).
async fn bump_node(conn: &mut AnyConnection, node_id: &str, now: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO nodes (node_id, generation, changed_at_ms) VALUES ($1, 1, $2) \
         ON CONFLICT (node_id) DO UPDATE SET generation = nodes.generation + 1, changed_at_ms = excluded.changed_at_ms",
    )
    .bind(node_id)
    .bind(now)
    .execute(&mut *conn)
    .await
    .map(drop)
}

async fn fetch_gateways(conn: &mut AnyConnection, project: &str) -> Result<Vec<GatewayRow>, CatalogError> {
    let sql = concat!("SELECT ", object_columns!(), " FROM gateways WHERE project = $1 ORDER BY name");
    let rows = sqlx::query(sql).bind(project).fetch_all(&mut *conn).await?;
    Ok(rows.iter().map(GatewayRow::from_row).collect::<Result<Vec<_>, _>>()?)
}

async fn fetch_routes(conn: &mut AnyConnection, project: &str) -> Result<Vec<RouteRow>, CatalogError> {
    let sql = concat!("SELECT ", object_columns!(), " FROM routes WHERE project = $1 ORDER BY name");
    let rows = sqlx::query(sql).bind(project).fetch_all(&mut *conn).await?;
    Ok(rows.iter().map(RouteRow::from_row).collect::<Result<Vec<_>, _>>()?)
}

async fn fetch_dns(conn: &mut AnyConnection, project: &str) -> Result<Option<DnsRow>, CatalogError> {
    let row = sqlx::query(SELECT_DNS).bind(project).bind(DNS_NAME).fetch_optional(&mut *conn).await?;
    Ok(row.as_ref().map(DnsRow::from_row).transpose()?)
}

async fn fetch_plan(conn: &mut AnyConnection, project: &str) -> Result<Option<PlanRow>, CatalogError> {
    let row = sqlx::query("SELECT project, generation, content, compiled_at_ms FROM plans WHERE project = $1")
        .bind(project)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(row.as_ref().map(PlanRow::from_row).transpose()?)
}

/// Refuses the write unless `fence` still holds the lead on the database clock.
async fn check_fence(conn: &mut AnyConnection, fence: &Fence, now_sql: &str) -> Result<(), CatalogError> {
    fence.holds(conn, now_sql).await?.then_some(()).ok_or(CatalogError::Deposed)
}
