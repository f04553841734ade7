//! Cache volumes' heads, and the publication of a lease's view as the next
//! generation.
//!
//! A volume is named by (project, key). Its published generations are
//! numbered from 1; its head is the one new leases start from (0: none
//! yet). A lease's node opens each volume its workload names before the
//! workload starts (`OpenCache`), and once the workload ended asks for its
//! view to be published (`CommitCache`), or says why it will not be.
//!
//! # Invariants
//! - Only a lease's node, at the lease's epoch, opens or commits its
//!   volumes, only those its workload names, and only in its project: the
//!   lease is the credential, so no workload reaches another project's
//!   volume whatever key it knows.
//! - Publishing is a compare-and-swap of the head from the generation the
//!   view started from, in one transaction with the generation's row: of
//!   two leases that started from one head, exactly one publishes and the
//!   other records `CommitConflict`; no head names an unrecorded generation.
//! - A view is published only after its workload ended as its mount's
//!   `commit` allows (DONE; also FAILED for ALWAYS; never for NEVER).
//! - Each volume's first outcome on a lease is kept: a node asking again
//!   (after a crash, a lost answer) gets the same answer, never a second
//!   generation.

use berth_proto::leases::v1;
use prost::Message as _;
use sqlx::{AnyConnection, Row as _};

use crate::ledger::{LeaseError, Ledger, held_by};
use crate::model::{Phase, Retention};
use crate::records::{LeaseRecord, StoredCache, timestamp};

/// A node's ask to publish a view, or to record why it will not be.
#[derive(Debug, Clone)]
pub(crate) struct CommitAsk {
    pub(crate) node_id: String,
    pub(crate) lease_id: String,
    pub(crate) epoch: u64,
    pub(crate) key: String,
    pub(crate) base_generation: u64,
    /// The sealed view (digest, size); `None` records `skip` instead.
    pub(crate) sealed: Option<(String, u64)>,
    /// The sealed view's artifact in the cache registry; empty when not pushed.
    pub(crate) artifact: String,
    /// Why nothing is published, with no sealed view: reason and message.
    pub(crate) skip: (String, String),
}

/// What a commit came to.
#[derive(Debug, Clone)]
pub(crate) struct Committed {
    pub(crate) committed: bool,
    pub(crate) head: v1::CacheGeneration,
    pub(crate) observation: v1::CacheObservation,
    /// Whether this call changed what is recorded.
    pub(crate) changed: bool,
}

impl Ledger {
    /// Opens `key` for `lease_id`, held by `node_id` at `epoch`: the head its
    /// view starts from and what that records (see `OpenCache`).
    pub(crate) async fn open_cache(
        &self,
        node_id: &str,
        lease_id: &str,
        epoch: u64,
        key: &str,
        held: &[u64],
    ) -> Result<(v1::CacheGeneration, v1::CacheObservation, bool), LeaseError> {
        self.store()
            .tx("leases.open_cache", |conn| {
                Box::pin(async move {
                    let lease = held_by(conn, node_id, lease_id, epoch).await?;
                    mount_of(&lease, key)?;
                    if let Some(seen) = observed(&lease, key) {
                        // The generation it opened at, though collected since (then without its digest).
                        let mut head = generation(conn, &lease.project, key, seen.base_generation).await?;
                        head.generation = seen.base_generation;
                        return Ok((head, seen.clone(), false));
                    }
                    if !lease.phase.is_open() {
                        return Err(refused(format!(
                            "lease {lease_id} is {}; its workload will not start",
                            lease.phase
                        )));
                    }
                    if disabled(conn, &lease.project).await? {
                        let observation = v1::CacheObservation {
                            key: key.to_owned(),
                            outcome: v1::CacheOutcome::Miss as i32,
                            reason: CACHE_DISABLED.to_owned(),
                            message: format!("cache volumes of project {} are turned off", lease.project),
                            ..Default::default()
                        };
                        record(conn, &lease, observation.clone()).await?;
                        let none = v1::CacheGeneration {
                            project: lease.project.clone(),
                            key: key.to_owned(),
                            ..Default::default()
                        };
                        return Ok((none, observation, true));
                    }
                    let number = head_of(conn, &lease.project, key).await?;
                    let head = generation(conn, &lease.project, key, number).await?;
                    let outcome = if number > 0 && held.contains(&number) {
                        v1::CacheOutcome::Hit
                    } else {
                        v1::CacheOutcome::Miss
                    };
                    let observation = v1::CacheObservation {
                        key: key.to_owned(),
                        outcome: outcome as i32,
                        base_generation: number,
                        ..Default::default()
                    };
                    record(conn, &lease, observation.clone()).await?;
                    Ok((head, observation, true))
                })
            })
            .await
    }

    /// Publishes a lease's view as `ask` says, or records why not (see
    /// `CommitCache`).
    pub(crate) async fn commit_cache(&self, ask: &CommitAsk) -> Result<Committed, LeaseError> {
        let now_sql = self.store().now_ms_sql();
        let keep = self.cache_retention();
        self.store()
            .tx("leases.commit_cache", |conn| {
                Box::pin(async move {
                    let CommitAsk { node_id, lease_id, epoch, key, base_generation, sealed, artifact, skip } = ask;
                    let lease = held_by(conn, node_id, lease_id, *epoch).await?;
                    let mount = mount_of(&lease, key)?;
                    let Some(seen) = observed(&lease, key).cloned() else {
                        return Err(refused(format!("lease {lease_id} never opened cache volume {key}")));
                    };
                    let settled = seen.committed_generation > 0 || !seen.reason.is_empty();
                    if settled {
                        let head = current_head(conn, &lease.project, key).await?;
                        let committed = seen.committed_generation > 0;
                        return Ok(Committed { committed, head, observation: seen, changed: false });
                    }
                    if *base_generation != seen.base_generation {
                        return Err(LeaseError::InvalidArgument {
                            field: "base_generation",
                            reason: format!(
                                "lease {lease_id} opened {key} at generation {}, not {base_generation}",
                                seen.base_generation
                            ),
                        });
                    }
                    if lease.phase.is_open() {
                        return Err(refused(format!(
                            "lease {lease_id} is {}: a view is published only once its workload ended",
                            lease.phase
                        )));
                    }
                    let why_not = match (sealed, mount.commit()) {
                        (None, _) => Some(skip.clone()),
                        (Some(_), berth_proto::types::v1::CacheCommit::Never) => {
                            Some(("CommitNever".to_owned(), format!("volume {key} is mounted with commit NEVER")))
                        }
                        (Some(_), commit) => {
                            let allowed = match commit {
                                berth_proto::types::v1::CacheCommit::Always => {
                                    matches!(lease.phase, Phase::Done | Phase::Failed)
                                }
                                _ => lease.phase == Phase::Done,
                            };
                            (!allowed).then(|| {
                                let phase = lease.phase.as_str();
                                let word = format!("Workload{}{}", phase[..1].to_uppercase(), &phase[1..]);
                                (word, format!("the workload ended {}", lease.phase))
                            })
                        }
                    };
                    let mut observation = seen;
                    let mut committed = false;
                    match (why_not, sealed) {
                        (Some((reason, message)), _) => {
                            observation.reason = reason;
                            observation.message = message;
                        }
                        (None, Some((digest, size))) => {
                            let now = berth_store::now_ms_in(conn, now_sql).await?;
                            let published = Published { digest, size: *size, artifact, now };
                            match swap_head(conn, &lease, key, *base_generation, &published, keep).await? {
                                Some(number) => {
                                    observation.committed_generation = number;
                                    committed = true;
                                }
                                None => {
                                    let head = head_of(conn, &lease.project, key).await?;
                                    observation.reason = "CommitConflict".to_owned();
                                    observation.message = format!(
                                        "the view started from generation {base_generation}, and generation {head} \
                                         was published first"
                                    );
                                }
                            }
                        }
                        (None, None) => unreachable!("a missing view always has a reason"),
                    }
                    record(conn, &lease, observation.clone()).await?;
                    let head = current_head(conn, &lease.project, key).await?;
                    Ok(Committed { committed, head, observation, changed: true })
                })
            })
            .await
    }
}

impl Ledger {
    /// The newest of `numbers` of (project, key) that is kept and was
    /// pushed: where a node holding it may start a pull of a newer one.
    pub(crate) async fn pushed_generation(
        &self,
        project: &str,
        key: &str,
        numbers: &[u64],
    ) -> Result<Option<v1::CacheGeneration>, LeaseError> {
        self.store()
            .tx("leases.pushed_generation", |conn| {
                Box::pin(async move {
                    let mut newest_first = numbers.to_vec();
                    newest_first.sort_unstable_by(|a, b| b.cmp(a));
                    for number in newest_first.into_iter().filter(|n| *n > 0) {
                        let found = generation(conn, project, key, number).await?;
                        if found.generation == number && !found.artifact.is_empty() {
                            return Ok(Some(found));
                        }
                    }
                    Ok(None)
                })
            })
            .await
    }
}

/// The newest generation a node holds of one volume, as it reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) project: String,
    pub(crate) key: String,
    pub(crate) generation: u64,
}

impl Ledger {
    /// Records what `node_id` reports holding (each volume whose head it
    /// holds), and answers the heads it follows and does not hold yet, each
    /// pushed to the registry, in projects whose caching is on (see
    /// `FollowCaches`).
    pub(crate) async fn follow_caches(
        &self,
        node_id: &str,
        held: &[Held],
    ) -> Result<Vec<(v1::CacheGeneration, Option<v1::CacheGeneration>)>, LeaseError> {
        self.store()
            .tx("leases.follow_caches", |conn| {
                Box::pin(async move {
                    for volume in held {
                        if head_of(conn, &volume.project, &volume.key).await? != volume.generation {
                            continue;
                        }
                        sqlx::query(
                            "INSERT INTO cache_holders (project, cache_key, node_id, generation) \
                             VALUES ($1, $2, $3, $4) ON CONFLICT (project, cache_key, node_id) \
                             DO UPDATE SET generation = excluded.generation",
                        )
                        .bind(volume.project.as_str())
                        .bind(volume.key.as_str())
                        .bind(node_id)
                        .bind(i64::try_from(volume.generation).unwrap_or(i64::MAX))
                        .execute(&mut *conn)
                        .await?;
                    }
                    let followed: Vec<(String, String, i64)> = sqlx::query_as(
                        "SELECT project, cache_key, generation FROM cache_heads WHERE follower = $1 AND generation > 0 \
                         AND project NOT IN (SELECT project FROM cache_disabled) ORDER BY project, cache_key",
                    )
                    .bind(node_id)
                    .fetch_all(&mut *conn)
                    .await?;
                    let mut wanted = Vec::new();
                    for (project, key, number) in followed {
                        let number = u64::try_from(number).unwrap_or_default();
                        let reported = held.iter().find(|h| h.project == project && h.key == key);
                        if reported.is_some_and(|h| h.generation >= number) {
                            continue;
                        }
                        let head = generation(conn, &project, &key, number).await?;
                        if head.artifact.is_empty() {
                            continue;
                        }
                        // What the node holds, when kept and pushed: the pull may start from it.
                        let from = match reported {
                            Some(h) => Some(generation(conn, &project, &key, h.generation).await?)
                                .filter(|from| from.generation == h.generation && !from.artifact.is_empty()),
                            None => None,
                        };
                        wanted.push((head, from));
                    }
                    Ok(wanted)
                })
            })
            .await
    }
}

impl Ledger {
    /// Every volume of `project` (every project's for `None`) that has a
    /// head or a kept generation, by project and key.
    pub(crate) async fn list_caches(&self, project: Option<&str>) -> Result<Vec<v1::CacheVolume>, LeaseError> {
        self.store()
            .tx("leases.list_caches", |conn| {
                Box::pin(async move {
                    let keys: Vec<(String, String)> = match project {
                        Some(project) => sqlx::query_as(
                            "SELECT project, cache_key FROM cache_heads WHERE project = $1 ORDER BY project, cache_key",
                        )
                        .bind(project)
                        .fetch_all(&mut *conn)
                        .await?,
                        None => {
                            sqlx::query_as("SELECT project, cache_key FROM cache_heads ORDER BY project, cache_key")
                                .fetch_all(&mut *conn)
                                .await?
                        }
                    };
                    let mut volumes = Vec::new();
                    for (project, key) in keys {
                        volumes.extend(volume(conn, &project, &key).await?);
                    }
                    Ok(volumes)
                })
            })
            .await
    }

    /// One volume and its kept generations, newest first.
    pub(crate) async fn get_cache(
        &self,
        project: &str,
        key: &str,
    ) -> Result<(v1::CacheVolume, Vec<v1::CacheGeneration>), LeaseError> {
        self.store()
            .tx("leases.get_cache", |conn| {
                Box::pin(async move {
                    let found = volume(conn, project, key).await?.ok_or_else(|| not_found(project, key))?;
                    let rows = sqlx::query(
                        "SELECT generation, digest, size_bytes, lease_id, node_id, published_at_ms, pinned, artifact \
                         FROM cache_generations WHERE project = $1 AND cache_key = $2 ORDER BY generation DESC",
                    )
                    .bind(project)
                    .bind(key)
                    .fetch_all(&mut *conn)
                    .await?;
                    let blank =
                        v1::CacheGeneration { project: project.to_owned(), key: key.to_owned(), ..Default::default() };
                    let generations =
                        rows.iter().map(|row| generation_of(row, blank.clone())).collect::<Result<Vec<_>, _>>()?;
                    Ok((found, generations))
                })
            })
            .await
    }

    /// Makes kept generation `number` (0: none) the head of (project, key).
    pub(crate) async fn set_cache_head(
        &self,
        project: &str,
        key: &str,
        number: u64,
    ) -> Result<v1::CacheVolume, LeaseError> {
        self.store()
            .tx("leases.set_cache_head", |conn| {
                Box::pin(async move {
                    volume(conn, project, key).await?.ok_or_else(|| not_found(project, key))?;
                    if number > 0 && generation(conn, project, key, number).await?.generation != number {
                        return Err(LeaseError::CacheNotFound(format!(
                            "generation {number} of cache volume {project}/{key}"
                        )));
                    }
                    sqlx::query("UPDATE cache_heads SET generation = $3 WHERE project = $1 AND cache_key = $2")
                        .bind(project)
                        .bind(key)
                        .bind(i64::try_from(number).unwrap_or(i64::MAX))
                        .execute(&mut *conn)
                        .await?;
                    volume(conn, project, key).await?.ok_or_else(|| not_found(project, key))
                })
            })
            .await
    }

    /// Pins (never collected) or unpins kept generation `number` of (project, key).
    pub(crate) async fn pin_cache_generation(
        &self,
        project: &str,
        key: &str,
        number: u64,
        pinned: bool,
    ) -> Result<v1::CacheGeneration, LeaseError> {
        self.store()
            .tx("leases.pin_cache_generation", |conn| {
                Box::pin(async move {
                    let done = sqlx::query(
                        "UPDATE cache_generations SET pinned = $4 WHERE project = $1 AND cache_key = $2 AND generation = $3",
                    )
                    .bind(project)
                    .bind(key)
                    .bind(i64::try_from(number).unwrap_or(i64::MAX))
                    .bind(i64::from(pinned))
                    .execute(&mut *conn)
                    .await?;
                    if done.rows_affected() == 0 {
                        return Err(LeaseError::CacheNotFound(format!("generation {number} of cache volume {project}/{key}")));
                    }
                    generation(conn, project, key, number).await
                })
            })
            .await
    }

    /// Forgets every generation of (project, key): the next lease of it
    /// starts empty. Generation numbers go on from the last one, never reused.
    pub(crate) async fn delete_cache(&self, project: &str, key: &str) -> Result<(), LeaseError> {
        self.store()
            .tx("leases.delete_cache", |conn| {
                Box::pin(async move {
                    volume(conn, project, key).await?.ok_or_else(|| not_found(project, key))?;
                    sqlx::query("DELETE FROM cache_generations WHERE project = $1 AND cache_key = $2")
                        .bind(project)
                        .bind(key)
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query("DELETE FROM cache_holders WHERE project = $1 AND cache_key = $2")
                        .bind(project)
                        .bind(key)
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query(
                        "UPDATE cache_heads SET generation = 0, follower = '' WHERE project = $1 AND cache_key = $2",
                    )
                    .bind(project)
                    .bind(key)
                    .execute(&mut *conn)
                    .await?;
                    Ok(())
                })
            })
            .await
    }

    /// Turns `project`'s cache volumes on or off.
    pub(crate) async fn set_project_caching(&self, project: &str, enabled: bool) -> Result<(), LeaseError> {
        self.store()
            .tx("leases.set_project_caching", |conn| {
                Box::pin(async move {
                    let sql = if enabled {
                        "DELETE FROM cache_disabled WHERE project = $1"
                    } else {
                        "INSERT INTO cache_disabled (project) VALUES ($1) ON CONFLICT DO NOTHING"
                    };
                    sqlx::query(sql).bind(project).execute(&mut *conn).await?;
                    Ok(())
                })
            })
            .await
    }
}

fn not_found(project: &str, key: &str) -> LeaseError {
    LeaseError::CacheNotFound(format!("cache volume {project}/{key}"))
}

/// (project, key) as operators see it; `None` when it has neither a head
/// nor a kept generation.
async fn volume(conn: &mut AnyConnection, project: &str, key: &str) -> Result<Option<v1::CacheVolume>, LeaseError> {
    let mut head = current_head(conn, project, key).await?;
    // Where the head is held, for operators; nodes opening a volume are not told.
    head.held_by = holders(conn, &head).await?;
    let (count, size): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), CAST(COALESCE(SUM(size_bytes), 0) AS BIGINT) FROM cache_generations \
         WHERE project = $1 AND cache_key = $2",
    )
    .bind(project)
    .bind(key)
    .fetch_one(&mut *conn)
    .await?;
    if head.generation == 0 && count == 0 {
        return Ok(None);
    }
    Ok(Some(v1::CacheVolume {
        project: project.to_owned(),
        key: key.to_owned(),
        head: Some(head),
        generations: u32::try_from(count).unwrap_or(u32::MAX),
        size_bytes: u64::try_from(size).unwrap_or_default(),
        enabled: !disabled(conn, project).await?,
    }))
}

/// The reason a lease's volume records while its project's caching is off.
pub(crate) const CACHE_DISABLED: &str = "CacheDisabled";

/// Whether `project`'s cache volumes are turned off.
async fn disabled(conn: &mut AnyConnection, project: &str) -> Result<bool, LeaseError> {
    let found: Option<String> = sqlx::query_scalar("SELECT project FROM cache_disabled WHERE project = $1")
        .bind(project)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(found.is_some())
}

fn refused(message: String) -> LeaseError {
    LeaseError::CacheRefused(message)
}

/// The mount of `key` in the lease's workload, or why there is none.
fn mount_of<'a>(lease: &'a LeaseRecord, key: &str) -> Result<&'a berth_proto::types::v1::CacheMount, LeaseError> {
    lease
        .workload
        .cache
        .iter()
        .find(|mount| mount.key == key)
        .ok_or_else(|| refused(format!("lease {}'s workload mounts no cache volume {key}", lease.lease_id)))
}

fn observed<'a>(lease: &'a LeaseRecord, key: &str) -> Option<&'a v1::CacheObservation> {
    lease.cache.iter().find(|seen| seen.key == key)
}

/// The head generation of (project, key); 0 when none was published.
async fn head_of(conn: &mut AnyConnection, project: &str, key: &str) -> Result<u64, LeaseError> {
    let head: Option<i64> =
        sqlx::query_scalar("SELECT generation FROM cache_heads WHERE project = $1 AND cache_key = $2")
            .bind(project)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(head.and_then(|head| u64::try_from(head).ok()).unwrap_or_default())
}

/// The head of (project, key), as a generation.
async fn current_head(conn: &mut AnyConnection, project: &str, key: &str) -> Result<v1::CacheGeneration, LeaseError> {
    let number = head_of(conn, project, key).await?;
    generation(conn, project, key, number).await
}

/// Generation `number` of (project, key); the empty generation 0 for 0.
async fn generation(
    conn: &mut AnyConnection,
    project: &str,
    key: &str,
    number: u64,
) -> Result<v1::CacheGeneration, LeaseError> {
    let none = v1::CacheGeneration { project: project.to_owned(), key: key.to_owned(), ..Default::default() };
    if number == 0 {
        return Ok(none);
    }
    let row = sqlx::query(
        "SELECT generation, digest, size_bytes, lease_id, node_id, published_at_ms, pinned, artifact \
         FROM cache_generations \
         WHERE project = $1 AND cache_key = $2 AND generation = $3",
    )
    .bind(project)
    .bind(key)
    .bind(i64::try_from(number).unwrap_or(i64::MAX))
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else { return Ok(none) };
    generation_of(&row, none)
}

/// The nodes beside its sealer that reported holding `head`, by id.
async fn holders(conn: &mut AnyConnection, head: &v1::CacheGeneration) -> Result<Vec<String>, LeaseError> {
    Ok(sqlx::query_scalar(
        "SELECT node_id FROM cache_holders WHERE project = $1 AND cache_key = $2 AND generation = $3 \
         AND node_id <> $4 ORDER BY node_id",
    )
    .bind(head.project.as_str())
    .bind(head.key.as_str())
    .bind(i64::try_from(head.generation).unwrap_or(i64::MAX))
    .bind(head.node_id.as_str())
    .fetch_all(&mut *conn)
    .await?)
}

/// A generation row selected with its number, digest, size, lease, node,
/// time, pin and artifact.
fn generation_of(row: &sqlx::any::AnyRow, volume: v1::CacheGeneration) -> Result<v1::CacheGeneration, LeaseError> {
    Ok(v1::CacheGeneration {
        generation: u64::try_from(row.try_get::<i64, _>("generation")?).unwrap_or_default(),
        digest: row.try_get("digest")?,
        size_bytes: u64::try_from(row.try_get::<i64, _>("size_bytes")?).unwrap_or_default(),
        lease_id: row.try_get("lease_id")?,
        node_id: row.try_get("node_id")?,
        published_at: Some(timestamp(row.try_get("published_at_ms")?)),
        pinned: row.try_get::<i64, _>("pinned")? == 1,
        artifact: row.try_get("artifact")?,
        ..volume
    })
}

/// A sealed view as it is published: its content digest, size, artifact
/// (empty when not pushed) and when.
struct Published<'a> {
    digest: &'a str,
    size: u64,
    artifact: &'a str,
    now: i64,
}

/// Moves the head of the lease's (project, key) from `base` to a new
/// generation holding `digest`: its number, or `None` when the head is no
/// longer `base`. The head row is the lock: a concurrent publisher waits on
/// it and then finds it moved.
async fn swap_head(
    conn: &mut AnyConnection,
    lease: &LeaseRecord,
    key: &str,
    base: u64,
    published: &Published<'_>,
    keep: Retention,
) -> Result<Option<u64>, LeaseError> {
    let project = lease.project.as_str();
    sqlx::query(
        "INSERT INTO cache_heads (project, cache_key, generation, last_generation) VALUES ($1, $2, 0, 0) \
         ON CONFLICT DO NOTHING",
    )
    .bind(project)
    .bind(key)
    .execute(&mut *conn)
    .await?;
    let moved: Option<i64> = sqlx::query_scalar(
        "UPDATE cache_heads SET generation = last_generation + 1, last_generation = last_generation + 1 \
         WHERE project = $1 AND cache_key = $2 AND generation = $3 RETURNING generation",
    )
    .bind(project)
    .bind(key)
    .bind(i64::try_from(base).unwrap_or(i64::MAX))
    .fetch_optional(&mut *conn)
    .await?;
    let Some(number) = moved else { return Ok(None) };
    follow(conn, lease, key, base).await?;
    sqlx::query(
        "INSERT INTO cache_generations (project, cache_key, generation, digest, size_bytes, lease_id, node_id, \
         published_at_ms, artifact) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(project)
    .bind(key)
    .bind(number)
    .bind(published.digest)
    .bind(i64::try_from(published.size).unwrap_or(i64::MAX))
    .bind(lease.lease_id.as_str())
    .bind(lease.node_id.as_str())
    .bind(published.now)
    .bind(published.artifact)
    .execute(&mut *conn)
    .await?;
    collect(conn, project, key, keep).await?;
    Ok(u64::try_from(number).ok())
}

/// Names the follower of the lease's (project, key) as its node publishes
/// over generation `base`: the node that sealed `base` when another did
/// (it holds the generation the new one grew from, so it is the cheapest
/// second home for it), else the follower so far unless that is the
/// publisher itself.
async fn follow(conn: &mut AnyConnection, lease: &LeaseRecord, key: &str, base: u64) -> Result<(), LeaseError> {
    let project = lease.project.as_str();
    let base_sealer: Option<String> = sqlx::query_scalar(
        "SELECT node_id FROM cache_generations WHERE project = $1 AND cache_key = $2 AND generation = $3",
    )
    .bind(project)
    .bind(key)
    .bind(i64::try_from(base).unwrap_or(i64::MAX))
    .fetch_optional(&mut *conn)
    .await?;
    let publisher = lease.node_id.as_str();
    let follower = match base_sealer {
        Some(sealer) if sealer != publisher => sealer,
        _ => {
            let current: String =
                sqlx::query_scalar("SELECT follower FROM cache_heads WHERE project = $1 AND cache_key = $2")
                    .bind(project)
                    .bind(key)
                    .fetch_one(&mut *conn)
                    .await?;
            if current == publisher { String::new() } else { current }
        }
    };
    sqlx::query("UPDATE cache_heads SET follower = $3 WHERE project = $1 AND cache_key = $2")
        .bind(project)
        .bind(key)
        .bind(follower)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Forgets the generations of (project, key) beyond the newest `keep`, then,
/// while the project's generations hold more than its budget, its oldest;
/// never a head, never a pinned one.
async fn collect(conn: &mut AnyConnection, project: &str, key: &str, keep: Retention) -> Result<(), LeaseError> {
    let numbers: Vec<i64> = sqlx::query_scalar(
        "SELECT generation FROM cache_generations WHERE project = $1 AND cache_key = $2 AND pinned = 0 \
         AND generation <> (SELECT generation FROM cache_heads WHERE project = $1 AND cache_key = $2) \
         ORDER BY generation DESC",
    )
    .bind(project)
    .bind(key)
    .fetch_all(&mut *conn)
    .await?;
    for number in numbers.iter().skip(usize::try_from(keep.keep).unwrap_or(usize::MAX)) {
        forget(conn, project, key, *number).await?;
    }
    let Some(budget) = keep.project_budget else { return Ok(()) };
    let total: i64 = sqlx::query_scalar(
        "SELECT CAST(COALESCE(SUM(size_bytes), 0) AS BIGINT) FROM cache_generations WHERE project = $1",
    )
    .bind(project)
    .fetch_one(&mut *conn)
    .await?;
    let mut total = u64::try_from(total).unwrap_or_default();
    if total <= budget {
        return Ok(());
    }
    let collectable: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT g.cache_key, g.generation, g.size_bytes FROM cache_generations g WHERE g.project = $1 \
         AND g.pinned = 0 AND NOT EXISTS (SELECT 1 FROM cache_heads h WHERE h.project = g.project \
         AND h.cache_key = g.cache_key AND h.generation = g.generation) \
         ORDER BY g.published_at_ms, g.cache_key, g.generation",
    )
    .bind(project)
    .fetch_all(&mut *conn)
    .await?;
    for (key, number, size) in collectable {
        if total <= budget {
            break;
        }
        forget(conn, project, &key, number).await?;
        total = total.saturating_sub(u64::try_from(size).unwrap_or_default());
    }
    Ok(())
}

async fn forget(conn: &mut AnyConnection, project: &str, key: &str, number: i64) -> Result<(), LeaseError> {
    sqlx::query("DELETE FROM cache_generations WHERE project = $1 AND cache_key = $2 AND generation = $3")
        .bind(project)
        .bind(key)
        .bind(number)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Records `observation` on the lease, replacing the one of its key.
async fn record(
    conn: &mut AnyConnection,
    lease: &LeaseRecord,
    observation: v1::CacheObservation,
) -> Result<(), LeaseError> {
    let mut observations: Vec<v1::CacheObservation> =
        lease.cache.iter().filter(|seen| seen.key != observation.key).cloned().collect();
    observations.push(observation);
    observations.sort_by(|a, b| a.key.cmp(&b.key));
    let bytes = StoredCache { observations }.encode_to_vec();
    sqlx::query("UPDATE leases SET cache = $2 WHERE lease_id = $1")
        .bind(lease.lease_id.as_str())
        .bind(bytes)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
