//! Which routers serve which routes: each router replica's acknowledgement
//! of the route generation it serves, per service, and whether it is alive.
//!
//! A service's `route_generation` grows with each change to what routers
//! send its requests to (see [`crate::catalog`]); a revision that traffic
//! left records the generation that left it out. A router acknowledges a
//! generation only once it serves it and nothing it sent under an earlier
//! one is still answering from a revision that generation dropped, so
//! "every router alive acknowledged it" means the revision takes no more
//! requests, and its replicas may stop.
//!
//! # Invariants
//! - A router replica is alive while its last `AckRoutes` is under
//!   [`ROUTER_ALIVE_MS`] old, on the database's clock; one that stopped
//!   calling holds no drain back for longer than that.
//! - An acknowledged generation never goes back: an older one sent late
//!   changes nothing.
//! - With no router alive nothing routes, so nothing waits.

use sqlx::Row as _;

use crate::catalog::{Catalog, CatalogError};
use crate::model::ServiceKey;

/// How long a router replica counts as alive after its last call: three of
/// its keep-alives.
pub(crate) const ROUTER_ALIVE_MS: i64 = 15_000;

/// How long the record of a router replica that stopped calling is kept.
const ROUTER_FORGOTTEN_MS: i64 = 24 * 3600 * 1000;

/// One live router replica's acknowledgement of one service's routes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RouterAck {
    pub(crate) router: String,
    pub(crate) instance: String,
    /// 0 when it acknowledged none of the service's generations.
    pub(crate) generation: i64,
    pub(crate) acked_at_ms: i64,
}

/// Whether every router in `acks` serves `generation` or a later one.
pub(crate) fn all_serve(acks: &[RouterAck], generation: i64) -> bool {
    acks.iter().all(|ack| ack.generation >= generation)
}

impl Catalog {
    /// Records that replica `instance` of `router` is alive and serves each
    /// service's generation in `acks`; the services whose acknowledged
    /// generation grew.
    pub(crate) async fn ack_routes(
        &self,
        router: &str,
        instance: &str,
        acks: &[(ServiceKey, i64)],
    ) -> Result<Vec<ServiceKey>, CatalogError> {
        let now_sql = self.store().now_ms_sql();
        self.store()
            .tx("revisions.ack_routes", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    sqlx::query(
                        "INSERT INTO routers (router, instance, seen_at_ms) VALUES ($1, $2, $3) \
                         ON CONFLICT (router, instance) DO UPDATE SET seen_at_ms = excluded.seen_at_ms",
                    )
                    .bind(router)
                    .bind(instance)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                    let mut advanced = Vec::new();
                    for (key, generation) in acks {
                        let written = sqlx::query(
                            "INSERT INTO route_acks (router, instance, project, service, generation, acked_at_ms) \
                             VALUES ($1, $2, $3, $4, $5, $6) \
                             ON CONFLICT (project, service, router, instance) DO UPDATE \
                             SET generation = excluded.generation, acked_at_ms = excluded.acked_at_ms \
                             WHERE route_acks.generation < excluded.generation",
                        )
                        .bind(router)
                        .bind(instance)
                        .bind(key.project.as_str())
                        .bind(key.name.as_str())
                        .bind(*generation)
                        .bind(now)
                        .execute(&mut *conn)
                        .await?;
                        if written.rows_affected() > 0 {
                            advanced.push(key.clone());
                        }
                    }
                    let forgotten = now.saturating_sub(ROUTER_FORGOTTEN_MS);
                    sqlx::query(
                        "DELETE FROM route_acks WHERE EXISTS (SELECT 1 FROM routers r WHERE r.router = \
                         route_acks.router AND r.instance = route_acks.instance AND r.seen_at_ms < $1)",
                    )
                    .bind(forgotten)
                    .execute(&mut *conn)
                    .await?;
                    sqlx::query("DELETE FROM routers WHERE seen_at_ms < $1")
                        .bind(forgotten)
                        .execute(&mut *conn)
                        .await?;
                    Ok(advanced)
                })
            })
            .await
    }

    /// Every live router replica and the generation of `key`'s routes it
    /// serves, by router and instance.
    pub(crate) async fn route_acks(&self, key: &ServiceKey) -> Result<Vec<RouterAck>, CatalogError> {
        let now_sql = self.store().now_ms_sql();
        self.store()
            .read("revisions.route_acks", |conn| {
                Box::pin(async move {
                    let now = berth_store::now_ms_in(conn, now_sql).await?;
                    let rows = sqlx::query(
                        "SELECT r.router, r.instance, COALESCE(a.generation, 0) AS generation, \
                         COALESCE(a.acked_at_ms, 0) AS acked_at_ms FROM routers r LEFT JOIN route_acks a \
                         ON a.router = r.router AND a.instance = r.instance AND a.project = $1 AND a.service = $2 \
                         WHERE r.seen_at_ms > $3 ORDER BY r.router, r.instance",
                    )
                    .bind(key.project.as_str())
                    .bind(key.name.as_str())
                    .bind(now.saturating_sub(ROUTER_ALIVE_MS))
                    .fetch_all(&mut *conn)
                    .await?;
                    let mut acks = Vec::with_capacity(rows.len());
                    for row in rows {
                        acks.push(RouterAck {
                            router: row.try_get("router")?,
                            instance: row.try_get("instance")?,
                            generation: row.try_get("generation")?,
                            acked_at_ms: row.try_get("acked_at_ms")?,
                        });
                    }
                    Ok(acks)
                })
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(router: &str, generation: i64) -> RouterAck {
        RouterAck { router: router.into(), instance: String::new(), generation, acked_at_ms: 1 }
    }

    #[test]
    fn a_generation_is_served_once_every_live_router_acknowledged_it_or_a_later_one() {
        assert!(all_serve(&[], 7), "with no router alive nothing routes");
        assert!(all_serve(&[ack("a", 7), ack("b", 9)], 7));
        assert!(!all_serve(&[ack("a", 7), ack("b", 6)], 7));
        assert!(!all_serve(&[ack("a", 0)], 1), "a router that acknowledged nothing of the service");
    }
}
