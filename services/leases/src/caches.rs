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
use crate::model::Phase;
use crate::records::{LeaseRecord, StoredCache, timestamp};

/// A node's ask to publish a view, or to record why it will not be.
#[derive(Debug, Clone)]
pub(crate) struct CommitAsk {
    pub(crate) node_id: String,
    pub(crate) lease_id: String,
    pub(crate) epoch: u64,
    pub(crate) key: String,
    pub(crate) base_generation: u64,
    /// The sealed view; `None` records `skip` instead.
    pub(crate) sealed: Option<(String, u64)>,
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
                        let head = generation(conn, &lease.project, key, seen.base_generation).await?;
                        return Ok((head, seen.clone(), false));
                    }
                    if !lease.phase.is_open() {
                        return Err(refused(format!(
                            "lease {lease_id} is {}; its workload will not start",
                            lease.phase
                        )));
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
        self.store()
            .tx("leases.commit_cache", |conn| {
                Box::pin(async move {
                    let CommitAsk { node_id, lease_id, epoch, key, base_generation, sealed, skip } = ask;
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
                            match swap_head(conn, &lease, key, *base_generation, digest, *size, now).await? {
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
        "SELECT digest, size_bytes, lease_id, published_at_ms FROM cache_generations \
         WHERE project = $1 AND cache_key = $2 AND generation = $3",
    )
    .bind(project)
    .bind(key)
    .bind(i64::try_from(number).unwrap_or(i64::MAX))
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else { return Ok(none) };
    Ok(v1::CacheGeneration {
        generation: number,
        digest: row.try_get("digest")?,
        size_bytes: u64::try_from(row.try_get::<i64, _>("size_bytes")?).unwrap_or_default(),
        lease_id: row.try_get("lease_id")?,
        published_at: Some(timestamp(row.try_get("published_at_ms")?)),
        ..none
    })
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
    digest: &str,
    size: u64,
    now: i64,
) -> Result<Option<u64>, LeaseError> {
    let project = lease.project.as_str();
    sqlx::query("INSERT INTO cache_heads (project, cache_key, generation) VALUES ($1, $2, 0) ON CONFLICT DO NOTHING")
        .bind(project)
        .bind(key)
        .execute(&mut *conn)
        .await?;
    let moved: Option<i64> = sqlx::query_scalar(
        "UPDATE cache_heads SET generation = (SELECT COALESCE(MAX(generation), 0) + 1 FROM cache_generations \
         WHERE project = $1 AND cache_key = $2) WHERE project = $1 AND cache_key = $2 AND generation = $3 \
         RETURNING generation",
    )
    .bind(project)
    .bind(key)
    .bind(i64::try_from(base).unwrap_or(i64::MAX))
    .fetch_optional(&mut *conn)
    .await?;
    let Some(number) = moved else { return Ok(None) };
    sqlx::query(
        "INSERT INTO cache_generations (project, cache_key, generation, digest, size_bytes, lease_id, node_id, \
         published_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(project)
    .bind(key)
    .bind(number)
    .bind(digest)
    .bind(i64::try_from(size).unwrap_or(i64::MAX))
    .bind(lease.lease_id.as_str())
    .bind(lease.node_id.as_str())
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(u64::try_from(number).ok())
}

/// The nodes holding the heads of `keys` in `project`: those that sealed them.
pub(crate) async fn warm_nodes(
    conn: &mut AnyConnection,
    project: &str,
    keys: impl Iterator<Item = &str>,
) -> Result<Vec<String>, LeaseError> {
    let mut nodes = Vec::new();
    for key in keys {
        let node: Option<String> = sqlx::query_scalar(
            "SELECT g.node_id FROM cache_heads h JOIN cache_generations g ON g.project = h.project \
             AND g.cache_key = h.cache_key AND g.generation = h.generation WHERE h.project = $1 AND h.cache_key = $2",
        )
        .bind(project)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
        nodes.extend(node.filter(|node| !nodes.contains(node)));
    }
    Ok(nodes)
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
