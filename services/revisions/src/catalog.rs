//! Services and revisions in the database: every read and write, each one
//! transaction through [`Store::tx`], and the one error they return.
//!
//! # Who writes this
//! - `ApplyService`: the declaration, minting a revision when the
//!   fingerprint of template and source differs from the newest revision's,
//!   with the resolution it tried; `latest_created_revision` and
//!   `BundleResolved` in the service's status.
//! - `SetTraffic`: the pin. `DeleteService`: removes the service and its
//!   revisions, leaving a tombstone until its leases are released.
//! - The elected deploy reconciler, every write fenced on its leadership term
//!   in the same transaction ([`Fence`]): resolutions, rollout state, the live
//!   revision, the rest of the status, revision GC, forgetting tombstones.
//!
//! # Invariants
//! - Generations of a service grow by one per minted revision, and a
//!   revision's name is made from its generation, so two applies racing each
//!   other mint two revisions in order or one, never one name twice: the
//!   transactions are serializable and the loser is run again.
//! - A revision's template, source and (once set) digest never change.
//! - `version` grows with every write to a service row that changes what
//!   `GetService` shows, so watchers skip repeats.

use std::collections::HashMap;

use berth_proto::revisions::v1;
use berth_proto::revisions::v1::{SessionAffinity, TrafficTarget};
use berth_store::{Fence, Store, StoreError};
use prost::Message as _;
use sqlx::AnyConnection;

use crate::model::{
    BUNDLE_RESOLVED, Observed, READY, ROLLOUT_COMPLETE, ServiceKey, new_uid, revision_name, set_condition,
};
use crate::records::{RevisionRow, RevisionState, ServiceRow, Tombstone, revision_columns, service_columns};
use crate::resolver::ResolveError;
use crate::traffic::StoredTraffic;
use crate::validate::ValidApply;

/// Why a catalog operation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CatalogError {
    /// No service has this name in this project.
    #[error("service {0} not found")]
    ServiceNotFound(ServiceKey),
    /// No revision has this name in this project (never minted, or collected).
    #[error("revision {name} not found in project {project}")]
    RevisionNotFound {
        /// The project.
        project: String,
        /// The revision asked for.
        name: String,
    },
    /// A revision named for a service belongs to another one.
    #[error("revision {revision} belongs to service {owner}, not {service}")]
    NotOfService {
        /// The revision.
        revision: String,
        /// The service it belongs to.
        owner: String,
        /// The service named in the request.
        service: String,
    },
    /// The reconciler writing lost its leadership; a newer term decides now.
    #[error("this replica no longer leads the deploy reconciler")]
    Deposed,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(CatalogError, |error| match error {
    CatalogError::ServiceNotFound(_) | CatalogError::RevisionNotFound { .. } => {
        tonic::Status::not_found(error.to_string())
    }
    CatalogError::NotOfService { .. } => tonic::Status::invalid_argument(format!("pinned_revision: {error}")),
    CatalogError::Deposed => tonic::Status::unavailable(error.to_string()),
    CatalogError::Store(error) => error.into(),
});

/// What resolving a new revision's bundle reference gave, before it was minted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// The digest, `sha256:<hex>`.
    Resolved(String),
    /// Why it failed; the reconciler retries.
    Failed(ResolveError),
    /// Not tried: the reconciler resolves it.
    NotTried,
}

/// What an apply did.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Applied {
    pub(crate) service: ServiceRow,
    pub(crate) revision_created: bool,
    /// The revision minted, or the newest one when nothing changed.
    pub(crate) revision: String,
}

/// A change to a revision's rollout columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RolloutChange {
    /// Its rollout begins now, unless one is under way.
    Start,
    /// Its replicas failed to start: it is failed, with a reason and a message.
    Fail { reason: String, message: String },
    /// Its replicas are no longer wanted (it is neither live nor next): any rollout ends.
    Stop,
}

/// What the reconciler observed of a service, merged into its stored status.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StatusReport {
    pub(crate) uid: String,
    /// The newest revision the reconciler saw; `BundleResolved` is about it.
    pub(crate) latest_created: String,
    pub(crate) observed_generation: i64,
    pub(crate) replicas_running: u32,
    pub(crate) replicas_desired: u32,
    pub(crate) conditions: Vec<Observed>,
    /// Replicas running per revision of the service.
    pub(crate) revision_running: Vec<(String, i64)>,
    /// Replicas taken over in place whose leases ended: their record in
    /// `adopted_replicas` goes.
    pub(crate) adoptions_ended: Vec<String>,
}

/// Which services a list wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scope {
    /// One project's.
    Project(String),
    /// Every project's.
    All,
}

/// The catalog over its store.
#[derive(Debug, Clone)]
pub(crate) struct Catalog {
    store: Store,
}

impl Catalog {
    pub(crate) fn new(store: Store) -> Self {
        Self { store }
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// The fingerprint of the service's newest revision, if it has one.
    pub(crate) async fn latest_fingerprint(&self, key: &ServiceKey) -> Result<Option<String>, CatalogError> {
        self.store
            .tx("revisions.latest_fingerprint", |conn| {
                Box::pin(async move { Ok(latest(conn, key).await?.map(|(_, fingerprint)| fingerprint)) })
            })
            .await
    }

    /// Records a declaration, minting a revision when its fingerprint differs
    /// from the newest revision's; `resolution` is what resolving its bundle
    /// gave (used only when it mints), `retry_after_ms` how long a failed
    /// resolution waits before the reconciler tries again.
    pub(crate) async fn apply(
        &self,
        valid: &ValidApply,
        resolution: &Resolution,
        retry_after_ms: i64,
    ) -> Result<Applied, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .upsert("revisions.apply", |conn| Box::pin(apply_in_tx(conn, now_sql, valid, resolution, retry_after_ms)))
            .await
    }

    /// One service.
    pub(crate) async fn service(&self, key: &ServiceKey) -> Result<Option<ServiceRow>, CatalogError> {
        self.store.read("revisions.get_service", |conn| Box::pin(async move { fetch_service(conn, key).await })).await
    }

    /// One service and its revisions (newest first), read together.
    pub(crate) async fn snapshot(
        &self,
        key: &ServiceKey,
    ) -> Result<Option<(ServiceRow, Vec<RevisionRow>)>, CatalogError> {
        self.store
            .read("revisions.snapshot", |conn| {
                Box::pin(async move {
                    let Some(service) = fetch_service(conn, key).await? else { return Ok(None) };
                    Ok(Some((service, fetch_revisions(conn, key).await?)))
                })
            })
            .await
    }

    /// Services in `scope`, by project then name.
    pub(crate) async fn services(&self, scope: &Scope) -> Result<Vec<ServiceRow>, CatalogError> {
        self.store
            .read("revisions.list_services", |conn| {
                Box::pin(async move {
                    let rows = match scope {
                        Scope::Project(project) => {
                            let sql = concat!(
                                "SELECT ",
                                service_columns!(),
                                " FROM services WHERE project = $1 ORDER BY project, name"
                            );
                            sqlx::query(sql).bind(project.as_str()).fetch_all(&mut *conn).await?
                        }
                        Scope::All => {
                            let sql = concat!("SELECT ", service_columns!(), " FROM services ORDER BY project, name");
                            sqlx::query(sql).fetch_all(&mut *conn).await?
                        }
                    };
                    Ok(rows.iter().map(ServiceRow::from_row).collect::<Result<Vec<_>, _>>()?)
                })
            })
            .await
    }

    /// Every service key, and every key with a tombstone, for a full pass.
    pub(crate) async fn keys(&self) -> Result<Vec<ServiceKey>, CatalogError> {
        self.store
            .read("revisions.keys", |conn| {
                Box::pin(async move {
                    let sql = "SELECT project, name FROM services UNION SELECT project, name FROM deleted_services";
                    let rows: Vec<(String, String)> = sqlx::query_as(sql).fetch_all(&mut *conn).await?;
                    Ok(rows.into_iter().map(|(project, name)| ServiceKey::new(project, name)).collect())
                })
            })
            .await
    }

    /// A service's revisions, newest first.
    pub(crate) async fn revisions(&self, key: &ServiceKey) -> Result<Vec<RevisionRow>, CatalogError> {
        self.store
            .read("revisions.list_revisions", |conn| Box::pin(async move { fetch_revisions(conn, key).await }))
            .await
    }

    /// One revision.
    pub(crate) async fn revision(&self, project: &str, name: &str) -> Result<RevisionRow, CatalogError> {
        self.store
            .read("revisions.get_revision", |conn| {
                Box::pin(async move {
                    fetch_revision(conn, project, name).await?.ok_or_else(|| CatalogError::RevisionNotFound {
                        project: project.to_owned(),
                        name: name.to_owned(),
                    })
                })
            })
            .await
    }

    /// Deletes a service and its revisions, leaving a tombstone for its leases.
    pub(crate) async fn delete(&self, key: &ServiceKey) -> Result<ServiceRow, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.delete_service", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let service =
                        fetch_service(conn, key).await?.ok_or_else(|| CatalogError::ServiceNotFound(key.clone()))?;
                    sqlx::query("DELETE FROM route_acks WHERE project = $1 AND service = $2")
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query("DELETE FROM revisions WHERE project = $1 AND service = $2")
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query("DELETE FROM services WHERE project = $1 AND name = $2")
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query(
                        "INSERT INTO deleted_services (project, name, uid, deleted_at_ms) VALUES ($1, $2, $3, $4)",
                    )
                    .bind(key.project.as_str())
                    .bind(key.name.as_str())
                    .bind(service.uid.as_str())
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                    Ok(service)
                })
            })
            .await
    }

    /// Splits the service's traffic as `targets` say (checked by
    /// [`crate::traffic::requested`]; empty follows the latest ready
    /// revision). Every revision named must be one of the service's; naming
    /// a failed one again asks for it to be rolled out again.
    pub(crate) async fn set_traffic(
        &self,
        key: &ServiceKey,
        targets: &[TrafficTarget],
        affinity: Option<&SessionAffinity>,
    ) -> Result<ServiceRow, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.set_traffic", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let service =
                        fetch_service(conn, key).await?.ok_or_else(|| CatalogError::ServiceNotFound(key.clone()))?;
                    let before = crate::traffic::named(&service.traffic);
                    for name in crate::traffic::named(targets) {
                        let revision = fetch_revision(conn, &key.project, name).await?.ok_or_else(|| {
                            CatalogError::RevisionNotFound { project: key.project.clone(), name: name.to_owned() }
                        })?;
                        if revision.service != key.name {
                            return Err(CatalogError::NotOfService {
                                revision: name.to_owned(),
                                owner: revision.service,
                                service: key.name.clone(),
                            });
                        }
                        if revision.state == RevisionState::Failed && !before.contains(&name) {
                            sqlx::query(
                                "UPDATE revisions SET state = 'pending', state_reason = 'Pinned', \
                                 state_message = 'named for traffic again after it failed', \
                                 state_changed_at_ms = $3, rollout_started_at_ms = NULL \
                                 WHERE project = $1 AND name = $2",
                            )
                            .bind(key.project.as_str())
                            .bind(name)
                            .bind(now)
                            .execute(&mut *conn)
                            .await?;
                        }
                    }
                    if service.traffic == targets && service.affinity.as_ref() == affinity {
                        return Ok(service);
                    }
                    // What the split no longer names drains (the live revision
                    // does when a new one takes over, not now).
                    let after = crate::traffic::named(targets);
                    let routes = service.route_generation + 1;
                    for dropped in before.iter().filter(|name| !after.contains(name)) {
                        if **dropped != service.live_revision {
                            mark_unrouted(conn, &key.project, dropped, now, routes).await?;
                        }
                    }
                    sqlx::query(
                        "UPDATE services SET pinned_revision = $3, traffic = $4, updated_at_ms = $5, \
                         route_generation = $6, version = version + 1 WHERE project = $1 AND name = $2",
                    )
                    .bind(key.project.as_str())
                    .bind(key.name.as_str())
                    .bind(crate::traffic::pinned(targets))
                    .bind(StoredTraffic::encode(targets, affinity))
                    .bind(now)
                    .bind(routes)
                    .execute(&mut *conn)
                    .await?;
                    fetch_service(conn, key).await?.ok_or_else(|| CatalogError::ServiceNotFound(key.clone()))
                })
            })
            .await
    }

    /// Records a resolution the reconciler made for `revision`: the digest
    /// (once), or why it failed and when to try again.
    pub(crate) async fn record_resolution(
        &self,
        fence: &Fence,
        key: &ServiceKey,
        revision: &str,
        outcome: &Result<String, ResolveError>,
        next_at_ms: i64,
    ) -> Result<bool, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.record_resolution", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let Some(row) = fetch_revision(conn, &key.project, revision).await? else {
                        return Ok(false);
                    };
                    if row.resolved() {
                        return Ok(false);
                    }
                    let (digest, reason, message) = match outcome {
                        Ok(digest) => (digest.as_str(), String::new(), String::new()),
                        Err(error) => ("", error.reason().to_owned(), error.to_string()),
                    };
                    let changed = row.resolution() != observed_resolution(outcome);
                    sqlx::query(
                        "UPDATE revisions SET digest = $3, resolve_reason = $4, resolve_message = $5, \
                         resolve_attempts = resolve_attempts + 1, next_resolve_at_ms = $6, \
                         resolve_changed_at_ms = CASE WHEN $7 = 1 THEN $8 ELSE resolve_changed_at_ms END \
                         WHERE project = $1 AND name = $2 AND digest = ''",
                    )
                    .bind(key.project.as_str())
                    .bind(revision)
                    .bind(digest)
                    .bind(reason.as_str())
                    .bind(message.as_str())
                    .bind(next_at_ms)
                    .bind(i64::from(changed))
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                    let Some(service) = fetch_service(conn, key).await? else { return Ok(false) };
                    if service.status.latest_created_revision != revision {
                        return Ok(false);
                    }
                    let mut status = service.status.clone();
                    let generation = u64::try_from(row.generation).unwrap_or_default();
                    set_condition(&mut status.conditions, &observed_resolution(outcome), now, generation);
                    write_service_status(conn, &service, &status, None).await
                })
            })
            .await
    }

    /// Moves `revision`'s rollout columns.
    pub(crate) async fn change_rollout(
        &self,
        fence: &Fence,
        project: &str,
        revision: &str,
        change: &RolloutChange,
    ) -> Result<(), CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.change_rollout", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let query = match change {
                        RolloutChange::Start => sqlx::query(
                            "UPDATE revisions SET rollout_started_at_ms = $3, state_reason = '', state_message = '', \
                             state_changed_at_ms = $3 WHERE project = $1 AND name = $2 \
                             AND rollout_started_at_ms IS NULL AND state <> 'failed'",
                        )
                        .bind(project)
                        .bind(revision)
                        .bind(now),
                        RolloutChange::Fail { reason, message } => sqlx::query(
                            "UPDATE revisions SET state = 'failed', state_reason = $4, state_message = $5, \
                             state_changed_at_ms = $3, rollout_started_at_ms = NULL \
                             WHERE project = $1 AND name = $2 AND state = 'pending'",
                        )
                        .bind(project)
                        .bind(revision)
                        .bind(now)
                        .bind(reason.as_str())
                        .bind(message.as_str()),
                        RolloutChange::Stop => sqlx::query(
                            "UPDATE revisions SET rollout_started_at_ms = NULL \
                             WHERE project = $1 AND name = $2 AND rollout_started_at_ms IS NOT NULL",
                        )
                        .bind(project)
                        .bind(revision),
                    };
                    query.execute(&mut *conn).await?;
                    Ok(())
                })
            })
            .await
    }

    /// Makes `revision` live: it is ready, it serves, and the service's
    /// `latest_ready_revision` follows.
    ///
    /// Its `desired` replicas all run (that is why it goes live), so the
    /// status says so in the same write: no reader sees the new live
    /// revision beside the old one's counts and conditions. `adopted`
    /// replaces the status's `adopted_replicas` in that write, so a router
    /// moves the traffic and the replicas that serve it at once.
    pub(crate) async fn go_live(
        &self,
        fence: &Fence,
        key: &ServiceKey,
        revision: &str,
        desired: u32,
        adopted: &HashMap<String, String>,
    ) -> Result<bool, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.go_live", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let Some(service) = fetch_service(conn, key).await? else { return Ok(false) };
                    sqlx::query(
                        "UPDATE revisions SET state_changed_at_ms = CASE WHEN state = 'ready' \
                         THEN state_changed_at_ms ELSE $3 END, state = 'ready', state_reason = '', \
                         state_message = '', rollout_started_at_ms = NULL WHERE project = $1 AND name = $2",
                    )
                    .bind(key.project.as_str())
                    .bind(revision)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                    let previous = service.live_revision.as_str();
                    let routes = service.route_generation + i64::from(previous != revision);
                    sqlx::query(
                        "UPDATE services SET live_revision = $3, route_generation = $4 \
                         WHERE project = $1 AND name = $2",
                    )
                    .bind(key.project.as_str())
                    .bind(key.name.as_str())
                    .bind(revision)
                    .bind(routes)
                    .execute(&mut *conn)
                    .await?;
                    // The revision that took the traffic until now drains,
                    // unless a split still names it.
                    if !previous.is_empty()
                        && previous != revision
                        && !crate::traffic::named(&service.traffic).contains(&previous)
                    {
                        mark_unrouted(conn, &key.project, previous, now, routes).await?;
                    }
                    let mut status = service.status.clone();
                    status.latest_ready_revision = latest_ready(conn, key).await?;
                    status.replicas_running = desired;
                    status.replicas_desired = desired;
                    status.adopted_replicas.clone_from(adopted);
                    let generation = status.observed_generation;
                    for kind in [READY, ROLLOUT_COMPLETE] {
                        set_condition(&mut status.conditions, &Observed::holds(kind), now, generation);
                    }
                    write_service_status(conn, &service, &status, Some(revision)).await
                })
            })
            .await
    }

    /// Merges what the reconciler observed into the service's status; a
    /// report that changes nothing writes nothing.
    pub(crate) async fn report(
        &self,
        fence: &Fence,
        key: &ServiceKey,
        report: &StatusReport,
    ) -> Result<bool, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.report_status", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let Some(service) = fetch_service(conn, key).await? else { return Ok(false) };
                    if service.uid != report.uid {
                        return Ok(false);
                    }
                    for (revision, running) in &report.revision_running {
                        sqlx::query(
                            "UPDATE revisions SET replicas_running = $3 \
                             WHERE project = $1 AND name = $2 AND replicas_running <> $3",
                        )
                        .bind(key.project.as_str())
                        .bind(revision.as_str())
                        .bind(*running)
                        .execute(&mut *conn)
                        .await?;
                    }
                    let mut status = service.status.clone();
                    let generation = u64::try_from(report.observed_generation).unwrap_or_default();
                    status.replicas_running = report.replicas_running;
                    status.replicas_desired = report.replicas_desired;
                    status.observed_generation = generation;
                    status.latest_ready_revision = latest_ready(conn, key).await?;
                    status.adopted_replicas.retain(|lease_id, _| !report.adoptions_ended.contains(lease_id));
                    for observed in &report.conditions {
                        // An apply minted a newer revision since: its resolution is the apply's to report.
                        if observed.kind == BUNDLE_RESOLVED && report.latest_created != status.latest_created_revision {
                            continue;
                        }
                        set_condition(&mut status.conditions, observed, now, generation);
                    }
                    write_service_status(conn, &service, &status, None).await
                })
            })
            .await
    }

    /// Deletes `names`, revisions of the service, except whichever is live
    /// or pinned by the time the transaction runs; how many went.
    pub(crate) async fn collect(&self, fence: &Fence, key: &ServiceKey, names: &[String]) -> Result<u64, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.collect", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let Some(service) = fetch_service(conn, key).await? else { return Ok(0) };
                    let mut deleted = 0;
                    for name in names {
                        if *name == service.live_revision
                            || *name == service.pinned_revision
                            || crate::traffic::named(&service.traffic).contains(&name.as_str())
                            || *name == service.status.latest_created_revision
                        {
                            continue;
                        }
                        deleted +=
                            sqlx::query("DELETE FROM revisions WHERE project = $1 AND name = $2 AND service = $3")
                                .bind(key.project.as_str())
                                .bind(name.as_str())
                                .bind(key.name.as_str())
                                .execute(&mut *conn)
                                .await?
                                .rows_affected();
                    }
                    Ok(deleted)
                })
            })
            .await
    }

    /// Deleted incarnations of `key` whose leases may still be open.
    pub(crate) async fn tombstones(&self, key: &ServiceKey) -> Result<Vec<Tombstone>, CatalogError> {
        self.store
            .read("revisions.tombstones", |conn| {
                Box::pin(async move {
                    let rows: Vec<(String,)> =
                        sqlx::query_as("SELECT uid FROM deleted_services WHERE project = $1 AND name = $2")
                            .bind(key.project.as_str())
                            .bind(key.name.as_str())
                            .fetch_all(&mut *conn)
                            .await?;
                    Ok(rows.into_iter().map(|(uid,)| Tombstone { key: key.clone(), uid }).collect())
                })
            })
            .await
    }

    /// Forgets a tombstone once its incarnation holds no open lease.
    pub(crate) async fn forget(&self, fence: &Fence, tombstone: &Tombstone) -> Result<(), CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.forget_tombstone", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    sqlx::query("DELETE FROM deleted_services WHERE project = $1 AND name = $2 AND uid = $3")
                        .bind(tombstone.key.project.as_str())
                        .bind(tombstone.key.name.as_str())
                        .bind(tombstone.uid.as_str())
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            })
            .await
    }
}

/// `BundleResolved` as an outcome makes it read.
fn observed_resolution(outcome: &Result<String, ResolveError>) -> Observed {
    use berth_proto::types::v1::ConditionStatus;
    match outcome {
        Ok(_) => Observed::holds(BUNDLE_RESOLVED),
        Err(error) => Observed::new(BUNDLE_RESOLVED, ConditionStatus::False, error.reason(), error.to_string()),
    }
}

async fn apply_in_tx(
    conn: &mut AnyConnection,
    now_sql: &str,
    valid: &ValidApply,
    resolution: &Resolution,
    retry_after_ms: i64,
) -> Result<Applied, CatalogError> {
    let key = &valid.key;
    let now = berth_store::now_ms_in(conn, now_sql).await?;
    let existing = fetch_service(conn, key).await?;
    let newest = latest(conn, key).await?;
    if let (Some(service), Some((revision, fingerprint))) = (&existing, &newest)
        && *fingerprint == valid.fingerprint
    {
        return Ok(Applied { service: service.clone(), revision_created: false, revision: revision.clone() });
    }
    let generation = existing.as_ref().map_or(0, |s| s.generation) + 1;
    let revision = revision_name(&key.name, generation);
    let (digest, reason, message, attempts, next_at) = match resolution {
        Resolution::Resolved(digest) => (digest.clone(), String::new(), String::new(), 1, 0),
        Resolution::Failed(error) => {
            (String::new(), error.reason().to_owned(), error.to_string(), 1, now.saturating_add(retry_after_ms))
        }
        Resolution::NotTried => (String::new(), String::new(), String::new(), 0, 0),
    };
    sqlx::query(
        "INSERT INTO revisions (project, name, service, generation, template, source, fingerprint, digest, \
         resolve_reason, resolve_message, resolve_attempts, resolve_changed_at_ms, next_resolve_at_ms, state, \
         state_changed_at_ms, created_at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 'pending', $12, $12)",
    )
    .bind(key.project.as_str())
    .bind(revision.as_str())
    .bind(key.name.as_str())
    .bind(generation)
    .bind(valid.template.encode_to_vec())
    .bind(valid.source.encode_to_vec())
    .bind(valid.fingerprint.as_str())
    .bind(digest.as_str())
    .bind(reason.as_str())
    .bind(message.as_str())
    .bind(attempts)
    .bind(now)
    .bind(next_at)
    .execute(&mut *conn)
    .await?;

    let mut status = existing.as_ref().map(|s| s.status.clone()).unwrap_or_default();
    status.latest_created_revision.clone_from(&revision);
    let resolved = match resolution {
        Resolution::Resolved(digest) => observed_resolution(&Ok(digest.clone())),
        Resolution::Failed(error) => observed_resolution(&Err(error.clone())),
        Resolution::NotTried => Observed::new(
            BUNDLE_RESOLVED,
            berth_proto::types::v1::ConditionStatus::Unknown,
            "Resolving",
            "the bundle tag is being resolved",
        ),
    };
    set_condition(&mut status.conditions, &resolved, now, u64::try_from(generation).unwrap_or_default());
    match existing {
        Some(_) => {
            sqlx::query(
                "UPDATE services SET generation = $3, template = $4, source = $5, status = $6, updated_at_ms = $7, \
                 version = version + 1 WHERE project = $1 AND name = $2",
            )
            .bind(key.project.as_str())
            .bind(key.name.as_str())
            .bind(generation)
            .bind(valid.template.encode_to_vec())
            .bind(valid.source.encode_to_vec())
            .bind(status.encode_to_vec())
            .bind(now)
            .execute(&mut *conn)
            .await?;
        }
        None => {
            sqlx::query(
                "INSERT INTO services (project, name, uid, generation, template, source, status, created_at_ms, \
                 updated_at_ms, version) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, 1)",
            )
            .bind(key.project.as_str())
            .bind(key.name.as_str())
            .bind(new_uid())
            .bind(generation)
            .bind(valid.template.encode_to_vec())
            .bind(valid.source.encode_to_vec())
            .bind(status.encode_to_vec())
            .bind(now)
            .execute(&mut *conn)
            .await?;
        }
    }
    let service = fetch_service(conn, key).await?.ok_or_else(|| CatalogError::ServiceNotFound(key.clone()))?;
    Ok(Applied { service, revision_created: true, revision })
}

/// Records that `revision` stopped taking traffic at `now`, under route
/// generation `routes`.
async fn mark_unrouted(
    conn: &mut AnyConnection,
    project: &str,
    revision: &str,
    now: i64,
    routes: i64,
) -> Result<(), CatalogError> {
    sqlx::query("UPDATE revisions SET unrouted_at_ms = $3, unrouted_generation = $4 WHERE project = $1 AND name = $2")
        .bind(project)
        .bind(revision)
        .bind(now)
        .bind(routes)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Writes `status` if it differs from what is stored (or `live` moved);
/// whether anything changed.
async fn write_service_status(
    conn: &mut AnyConnection,
    service: &ServiceRow,
    status: &v1::ServiceStatus,
    live: Option<&str>,
) -> Result<bool, CatalogError> {
    let live_changed = live.is_some_and(|l| l != service.live_revision);
    if *status == service.status && !live_changed {
        return Ok(false);
    }
    sqlx::query("UPDATE services SET status = $3, version = version + 1 WHERE project = $1 AND name = $2")
        .bind(service.key.project.as_str())
        .bind(service.key.name.as_str())
        .bind(status.encode_to_vec())
        .execute(&mut *conn)
        .await?;
    Ok(true)
}

impl Catalog {
    /// Issues a new route generation for `key` (routers acknowledge it once
    /// they serve what they know now); the new generation.
    pub(crate) async fn bump_route_generation(&self, fence: &Fence, key: &ServiceKey) -> Result<i64, CatalogError> {
        let now_sql = self.store.now_ms_sql();
        self.store
            .tx("revisions.bump_routes", |conn| {
                Box::pin(async move {
                    check_fence(conn, fence, now_sql).await?;
                    let service = fetch_service(conn, key).await?.ok_or_else(|| CatalogError::ServiceNotFound(key.clone()))?;
                    let routes = service.route_generation + 1;
                    sqlx::query(
                        "UPDATE services SET route_generation = $3, version = version + 1 WHERE project = $1 AND name = $2",
                    )
                    .bind(key.project.as_str())
                    .bind(key.name.as_str())
                    .bind(routes)
                    .execute(&mut *conn)
                    .await?;
                    Ok(routes)
                })
            })
            .await
    }
}

/// Refuses the write unless `fence` still holds the lead on the database clock.
async fn check_fence(conn: &mut AnyConnection, fence: &Fence, now_sql: &str) -> Result<(), CatalogError> {
    fence.holds(conn, now_sql).await?.then_some(()).ok_or(CatalogError::Deposed)
}

async fn fetch_service(conn: &mut AnyConnection, key: &ServiceKey) -> Result<Option<ServiceRow>, CatalogError> {
    let sql = concat!("SELECT ", service_columns!(), " FROM services WHERE project = $1 AND name = $2");
    let row = sqlx::query(sql).bind(key.project.as_str()).bind(key.name.as_str()).fetch_optional(&mut *conn).await?;
    Ok(row.as_ref().map(ServiceRow::from_row).transpose()?)
}

async fn fetch_revision(
    conn: &mut AnyConnection,
    project: &str,
    name: &str,
) -> Result<Option<RevisionRow>, CatalogError> {
    let sql = concat!("SELECT ", revision_columns!(), " FROM revisions WHERE project = $1 AND name = $2");
    let row = sqlx::query(sql).bind(project).bind(name).fetch_optional(&mut *conn).await?;
    Ok(row.as_ref().map(RevisionRow::from_row).transpose()?)
}

async fn fetch_revisions(conn: &mut AnyConnection, key: &ServiceKey) -> Result<Vec<RevisionRow>, CatalogError> {
    let sql = concat!(
        "SELECT ",
        revision_columns!(),
        " FROM revisions WHERE project = $1 AND service = $2 ORDER BY generation DESC"
    );
    let rows = sqlx::query(sql).bind(key.project.as_str()).bind(key.name.as_str()).fetch_all(&mut *conn).await?;
    Ok(rows.iter().map(RevisionRow::from_row).collect::<Result<Vec<_>, _>>()?)
}

/// The newest revision's name and fingerprint.
async fn latest(conn: &mut AnyConnection, key: &ServiceKey) -> Result<Option<(String, String)>, CatalogError> {
    Ok(sqlx::query_as(
        "SELECT name, fingerprint FROM revisions WHERE project = $1 AND service = $2 ORDER BY generation DESC LIMIT 1",
    )
    .bind(key.project.as_str())
    .bind(key.name.as_str())
    .fetch_optional(&mut *conn)
    .await?)
}

/// The newest ready revision's name, or empty.
async fn latest_ready(conn: &mut AnyConnection, key: &ServiceKey) -> Result<String, CatalogError> {
    let name: Option<String> = sqlx::query_scalar(
        "SELECT name FROM revisions WHERE project = $1 AND service = $2 AND state = 'ready' \
         ORDER BY generation DESC LIMIT 1",
    )
    .bind(key.project.as_str())
    .bind(key.name.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    Ok(name.unwrap_or_default())
}
