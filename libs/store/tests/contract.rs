//! The store's contract, written once and run against real PostgreSQL and
//! SQLite (`mod postgres`, `mod sqlite`), plus the few behaviours only one
//! backend has.

use std::time::{Duration, Instant};

use berth_store::testing::{TestDb, TestPg, pg_url, test_options};
use berth_store::{
    Backend, ElectionTiming, LeaderElector, Migration, Store, StoreError, StoreOptions, Term, expect_one,
};
use tokio_util::sync::CancellationToken;

/// Generates one `#[tokio::test]` per case for a backend; each gets a fresh
/// database and cleans it up (a panicking case's fixture cleans up on drop).
macro_rules! contract_suite {
    ($backend:ident, $fixture:expr) => {
        mod $backend {
            use super::*;

            contract_suite!(@cases $fixture;
                migrations_apply_once_and_rerun_is_noop,
                changed_migration_is_refused_naming_its_version,
                concurrent_migrations_apply_each_once,
                failed_migration_leaves_nothing_behind,
                unique_violation_is_already_exists,
                stale_epoch_write_is_conflict,
                failed_body_rolls_back,
                a_cancelled_transaction_leaves_no_pooled_connection_inside_it,
                a_read_sees_one_snapshot_and_refuses_writes,
                contended_body_runs_again_in_a_fresh_transaction,
                concurrent_read_modify_writes_lose_no_update,
                placeholders_bind_by_number,
                portable_types_round_trip,
                now_ms_reads_a_clock_close_to_the_system_clock,
                closed_store_is_unavailable,
                bad_schema_names_are_refused,
                one_leader_at_a_time,
                expired_lead_passes_on_with_the_next_term,
                resigning_frees_the_lead_at_once,
                elector_hands_over_when_cancelled,
                elector_steps_down_when_its_term_is_taken,
            );
        }
    };
    (@cases $fixture:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                let db = $fixture.await.expect("test database");
                cases::$case(&db).await;
                db.cleanup().await.expect("cleanup");
            }
        )*
    };
}

contract_suite!(postgres, TestDb::postgres());
contract_suite!(sqlite, TestDb::sqlite());

const ITEMS: Migration = Migration {
    version: 1,
    name: "items",
    postgres: "CREATE TABLE items (
            id BIGINT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            epoch BIGINT NOT NULL,
            payload BYTEA
        );
        INSERT INTO items (id, name, epoch) VALUES (0, 'seed', 1);",
    sqlite: "CREATE TABLE items (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            epoch BIGINT NOT NULL,
            payload BLOB
        );
        INSERT INTO items (id, name, epoch) VALUES (0, 'seed', 1);",
};

const ITEMS_BY_EPOCH: Migration = Migration {
    version: 2,
    name: "items_by_epoch",
    postgres: "CREATE INDEX items_by_epoch ON items (epoch)",
    sqlite: "CREATE INDEX items_by_epoch ON items (epoch)",
};

const TTL: Duration = Duration::from_millis(300);

async fn count(store: &Store, name: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM items WHERE name = $1")
        .bind(name.to_owned())
        .fetch_one(store.pool())
        .await
        .expect("count items")
}

/// Rounds of cancelled transactions: enough that some are cancelled in
/// each window of their life, which takes a round trip or two to cross.
const CANCEL_ROUNDS: usize = 30;

/// Polls `future` `polls` times, a millisecond apart (time for the database
/// to answer in between), then drops it unless it finished.
async fn poll_then_drop<F: std::future::Future>(future: F, polls: usize) {
    let mut future = std::pin::pin!(future);
    for _ in 0..polls {
        let done = std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx).is_ready())).await;
        if done {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn applied_versions(store: &Store) -> Vec<i64> {
    sqlx::query_scalar("SELECT version FROM _berth_migrations ORDER BY version")
        .fetch_all(store.pool())
        .await
        .expect("read the migration ledger")
}

async fn insert(store: &Store, id: i64, name: &str) -> Result<(), StoreError> {
    store
        .tx("items.insert", |conn| {
            Box::pin(async move {
                sqlx::query("INSERT INTO items (id, name, epoch) VALUES ($1, $2, 1)")
                    .bind(id)
                    .bind(name)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            })
        })
        .await
}

#[cfg(test)]
mod cases {
    use super::*;

    pub(super) async fn migrations_apply_once_and_rerun_is_noop(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS]).await.unwrap();
        store.migrate(&[ITEMS]).await.unwrap();
        assert_eq!(count(store, "seed").await, 1);
        assert_eq!(applied_versions(store).await, [1]);

        // A later release adds a migration: only the new one runs.
        store.migrate(&[ITEMS, ITEMS_BY_EPOCH]).await.unwrap();
        assert_eq!(applied_versions(store).await, [1, 2]);
        assert_eq!(count(store, "seed").await, 1);

        // A restarted replica finds nothing to do, and an older binary that
        // knows only the first migration still starts.
        let restarted = db.connect().await.unwrap();
        restarted.migrate(&[ITEMS, ITEMS_BY_EPOCH]).await.unwrap();
        restarted.migrate(&[ITEMS]).await.unwrap();
        assert_eq!(applied_versions(&restarted).await, [1, 2]);
        restarted.close().await;
    }

    pub(super) async fn changed_migration_is_refused_naming_its_version(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS, ITEMS_BY_EPOCH]).await.unwrap();
        let edited = Migration {
            postgres: "CREATE INDEX items_by_epoch ON items (epoch, name)",
            sqlite: "CREATE INDEX items_by_epoch ON items (epoch, name)",
            ..ITEMS_BY_EPOCH
        };
        let error = store.migrate(&[ITEMS, edited]).await.unwrap_err();
        assert!(matches!(error, StoreError::Migration { version: 2, .. }), "{error}");
        assert!(error.to_string().starts_with("migration 2 (items_by_epoch)"), "{error}");

        let renamed = Migration { name: "renamed", ..ITEMS };
        let error = store.migrate(&[renamed]).await.unwrap_err();
        assert!(matches!(error, StoreError::Migration { version: 1, .. }), "{error}");
    }

    pub(super) async fn concurrent_migrations_apply_each_once(db: &TestDb) {
        let first = db.store().clone();
        let second = db.connect().await.unwrap();
        let migrations = [ITEMS, ITEMS_BY_EPOCH];
        let (a, b) = tokio::join!(first.migrate(&migrations), second.migrate(&migrations));
        a.unwrap();
        b.unwrap();
        // The seed row would be there twice (or the CREATE TABLE would have
        // failed) had both applied the first migration.
        assert_eq!(count(&first, "seed").await, 1);
        assert_eq!(applied_versions(&first).await, [1, 2]);
        second.close().await;
    }

    pub(super) async fn failed_migration_leaves_nothing_behind(db: &TestDb) {
        let store = db.store();
        let broken = Migration {
            version: 1,
            name: "broken",
            postgres: "CREATE TABLE half_done (id BIGINT); INSERT INTO no_such_table VALUES (1);",
            sqlite: "CREATE TABLE half_done (id BIGINT); INSERT INTO no_such_table VALUES (1);",
        };
        let error = store.migrate(&[broken]).await.unwrap_err();
        assert!(matches!(error, StoreError::Migration { version: 1, .. }), "{error}");
        assert!(applied_versions(store).await.is_empty());
        let half_done = sqlx::query("SELECT id FROM half_done").fetch_all(store.pool()).await;
        assert!(half_done.is_err(), "the failed migration's table survived");

        // The fixed migration applies cleanly afterwards.
        store.migrate(&[ITEMS]).await.unwrap();
        assert_eq!(applied_versions(store).await, [1]);
    }

    pub(super) async fn unique_violation_is_already_exists(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS]).await.unwrap();
        insert(store, 1, "web").await.unwrap();

        let error = insert(store, 2, "web").await.unwrap_err();
        assert!(matches!(error, StoreError::AlreadyExists { .. }), "{error}");
        let error = insert(store, 1, "api").await.unwrap_err();
        assert!(matches!(error, StoreError::AlreadyExists { .. }), "{error}");

        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::AlreadyExists);
        let message = status.message().to_lowercase();
        for leak in ["duplicate", "unique", "constraint", "items", "sql"] {
            assert!(!message.contains(leak), "status leaks {leak:?}: {message}");
        }
        assert_eq!(count(store, "web").await, 1);
        assert_eq!(count(store, "api").await, 0);
    }

    pub(super) async fn stale_epoch_write_is_conflict(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS]).await.unwrap();
        insert(store, 7, "lease").await.unwrap();

        let bump = |epoch: i64| {
            store.tx("items.bump", move |conn| {
                Box::pin(async move {
                    let done = sqlx::query("UPDATE items SET epoch = $2 + 1 WHERE id = $1 AND epoch = $2")
                        .bind(7_i64)
                        .bind(epoch)
                        .execute(&mut *conn)
                        .await?;
                    expect_one(done.rows_affected(), &format!("item 7 at epoch {epoch}"))
                })
            })
        };
        bump(1).await.unwrap();
        let error = bump(1).await.unwrap_err();
        assert!(matches!(&error, StoreError::Conflict { what } if what == "item 7 at epoch 1"), "{error}");
        assert_eq!(tonic::Status::from(error).code(), tonic::Code::FailedPrecondition);
        bump(2).await.unwrap();
    }

    pub(super) async fn failed_body_rolls_back(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS]).await.unwrap();
        // The body borrows from the caller's stack.
        let name = String::from("doomed");
        let name = name.as_str();
        let result: Result<(), StoreError> = store
            .tx("items.insert_then_fail", |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO items (id, name, epoch) VALUES (9, $1, 1)")
                        .bind(name)
                        .execute(&mut *conn)
                        .await?;
                    Err(StoreError::not_found("item 10"))
                })
            })
            .await;
        let error = result.unwrap_err();
        assert!(matches!(&error, StoreError::NotFound { what } if what == "item 10"), "{error}");
        assert_eq!(count(store, "doomed").await, 0);
    }

    pub(super) async fn a_cancelled_transaction_leaves_no_pooled_connection_inside_it(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS]).await.unwrap();
        let observer = db.connect().await.unwrap();
        let mut id = 100;
        for _ in 0..CANCEL_ROUNDS {
            // Cancelled at every point of its life: while acquiring, while
            // its BEGIN is in flight, in its body, while committing.
            for polls in 1..=6 {
                let tx = store.tx("items.count", |conn| {
                    Box::pin(async move {
                        let counted: i64 =
                            sqlx::query_scalar("SELECT COUNT(*) FROM items").fetch_one(&mut *conn).await?;
                        Ok::<_, StoreError>(counted)
                    })
                });
                poll_then_drop(tx, polls).await;
                // Time for the dropped connection to be back in the pool.
                tokio::time::sleep(Duration::from_millis(5)).await;
                // A plain statement on the pool commits as it returns:
                // another connection sees its write at once.
                id += 1;
                let name = format!("after-cancel-{id}");
                sqlx::query("INSERT INTO items (id, name, epoch) VALUES ($1, $2, 1)")
                    .bind(id)
                    .bind(name.clone())
                    .execute(store.pool())
                    .await
                    .unwrap();
                assert_eq!(
                    count(&observer, &name).await,
                    1,
                    "{name}, written outside a transaction after one cancelled at poll {polls}, is not visible"
                );
            }
        }
        observer.close().await;
    }

    pub(super) async fn a_read_sees_one_snapshot_and_refuses_writes(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS]).await.unwrap();
        insert(store, 1, "before").await.unwrap();
        let writer = db.connect().await.unwrap();
        let writer = &writer;
        // A write committed while the read runs is not in its snapshot.
        let (first, second) = store
            .read("items.count_twice", |conn| {
                Box::pin(async move {
                    let first: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM items").fetch_one(&mut *conn).await?;
                    insert(writer, 2, "during").await?;
                    let second: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM items").fetch_one(&mut *conn).await?;
                    Ok::<_, StoreError>((first, second))
                })
            })
            .await
            .unwrap();
        assert_eq!((first, second), (2, 2), "the seed and 'before', twice");
        assert_eq!(count(store, "during").await, 1, "the write committed beside the read is there after it");

        let refused: Result<(), StoreError> = store
            .read("items.write_in_a_read", |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO items (id, name, epoch) VALUES (3, 'sneaked', 1)")
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            })
            .await;
        assert!(refused.is_err(), "a write in a read was accepted");
        assert_eq!(count(store, "sneaked").await, 0);
        // The connection the read ran on writes again afterwards.
        insert(store, 4, "after").await.unwrap();
        assert_eq!(count(store, "after").await, 1);
        writer.close().await;
    }

    pub(super) async fn contended_body_runs_again_in_a_fresh_transaction(db: &TestDb) {
        let store = db.store().clone();
        store.migrate(&[ITEMS]).await.unwrap();
        let mut runs = 0;
        // Spawned, so the transaction future is proven Send for gRPC handlers.
        let outcome = tokio::spawn(async move {
            let result = store
                .tx("items.flaky", |conn| {
                    runs += 1;
                    let run = runs;
                    Box::pin(async move {
                        sqlx::query("INSERT INTO items (id, name, epoch) VALUES (11, 'flaky', 1)")
                            .execute(&mut *conn)
                            .await?;
                        if run == 1 {
                            return Err(StoreError::Contended { attempts: 1, source: None });
                        }
                        Ok(run)
                    })
                })
                .await;
            (result, count(&store, "flaky").await)
        })
        .await
        .unwrap();
        // The first run's insert was rolled back, or the second would have
        // hit the primary key.
        let (result, stored) = outcome;
        assert_eq!(result.unwrap(), 2);
        assert_eq!(stored, 1);
    }

    pub(super) async fn concurrent_read_modify_writes_lose_no_update(db: &TestDb) {
        let store = db.store().clone();
        let other = db.connect().await.unwrap();
        store.migrate(&[ITEMS]).await.unwrap();
        const INCREMENTS: i64 = 8;

        // Each writer counts the increments it saw committed. One that
        // stays contended through every attempt is refused with
        // `Contended` (the caller is told; nothing is half-written), which
        // two writers forced to collide may meet on a loaded machine; what
        // must never happen is a committed increment missing from the row.
        let increment = |store: Store| async move {
            let mut committed = 0_i64;
            for _ in 0..INCREMENTS {
                let result = store
                    .tx("items.increment", |conn| {
                        Box::pin(async move {
                            let epoch: i64 = sqlx::query_scalar("SELECT epoch FROM items WHERE id = 0")
                                .fetch_one(&mut *conn)
                                .await?;
                            // Let the other writer read the same value.
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            sqlx::query("UPDATE items SET epoch = $1 WHERE id = 0")
                                .bind(epoch + 1)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, StoreError>(())
                        })
                    })
                    .await;
                match result {
                    Ok(()) => committed += 1,
                    Err(StoreError::Contended { .. }) => {}
                    Err(other) => panic!("an increment failed other than by contention: {other:?}"),
                }
            }
            committed
        };
        let (mine, theirs) = tokio::join!(increment(store.clone()), increment(other.clone()));
        let epoch: i64 =
            sqlx::query_scalar("SELECT epoch FROM items WHERE id = 0").fetch_one(store.pool()).await.unwrap();
        assert!(mine + theirs >= INCREMENTS, "retries let most increments through: {mine} + {theirs}");
        assert_eq!(epoch, 1 + mine + theirs, "every committed increment is in the row, none twice");
        other.close().await;
    }

    pub(super) async fn placeholders_bind_by_number(db: &TestDb) {
        let joined: String = sqlx::query_scalar("SELECT CAST($2 AS TEXT) || CAST($1 AS TEXT) || CAST($2 AS TEXT)")
            .bind("a")
            .bind("b")
            .fetch_one(db.store().pool())
            .await
            .unwrap();
        assert_eq!(joined, "bab");
    }

    pub(super) async fn portable_types_round_trip(db: &TestDb) {
        let store = db.store();
        store.migrate(&[ITEMS]).await.unwrap();
        let payload = vec![0_u8, 1, 254, 255];
        sqlx::query("INSERT INTO items (id, name, epoch, payload) VALUES ($1, $2, $3, $4)")
            .bind(i64::MAX)
            .bind("ünïcode ✓")
            .bind(i64::MIN)
            .bind(payload.clone())
            .execute(store.pool())
            .await
            .unwrap();
        let row: (i64, String, i64, Option<Vec<u8>>) =
            sqlx::query_as("SELECT id, name, epoch, payload FROM items WHERE id = $1")
                .bind(i64::MAX)
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert_eq!(row, (i64::MAX, "ünïcode ✓".to_owned(), i64::MIN, Some(payload)));
        let seed_payload: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT payload FROM items WHERE id = 0").fetch_one(store.pool()).await.unwrap();
        assert_eq!(seed_payload, None);
    }

    pub(super) async fn now_ms_reads_a_clock_close_to_the_system_clock(db: &TestDb) {
        let system_ms = || {
            i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis())
                .unwrap()
        };
        let before = system_ms();
        let db_ms = db.store().now_ms().await.unwrap();
        let after = system_ms();
        assert!(
            (before - 1000..=after + 1000).contains(&db_ms),
            "database clock {db_ms} vs system clock {before}..{after}"
        );
        // Millisecond resolution, not seconds.
        let samples: Vec<i64> = clock_samples(db.store()).await;
        assert!(samples.iter().any(|ms| ms % 1000 != 0), "{samples:?}");

        // The expression is usable inside queries too.
        let sql = format!("SELECT {}", db.store().now_ms_sql());
        let in_sql: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(db.store().pool()).await.unwrap();
        assert!(in_sql >= db_ms);
    }

    async fn clock_samples(store: &Store) -> Vec<i64> {
        let mut samples = Vec::new();
        for _ in 0..5 {
            samples.push(store.now_ms().await.unwrap());
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        samples
    }

    pub(super) async fn closed_store_is_unavailable(db: &TestDb) {
        let store = db.connect().await.unwrap();
        store.ping().await.unwrap();
        store.close().await;
        let error = store.ping().await.unwrap_err();
        assert!(matches!(error, StoreError::Unavailable { .. }), "{error}");
        assert!(error.to_string().contains(store.target()), "{error}");
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(!status.message().contains("pool"), "{}", status.message());
    }

    pub(super) async fn bad_schema_names_are_refused(db: &TestDb) {
        for schema in ["", "Leases", "1leases", "lea-ses", "x; DROP SCHEMA public", "pg_temp"] {
            let error = Store::connect(db.url(), schema).await.unwrap_err();
            assert!(matches!(error, StoreError::Config { .. }), "{schema:?}: {error}");
        }
    }

    pub(super) async fn one_leader_at_a_time(db: &TestDb) {
        let store = db.store();
        let term =
            store.try_acquire_leadership("reaper", "replica-a", TTL).await.unwrap().expect("a free lead is acquired");
        assert_eq!(term, Term(1));
        assert_eq!(store.try_acquire_leadership("reaper", "replica-b", TTL).await.unwrap(), None);
        // The holder asking again renews at the same term.
        assert_eq!(store.try_acquire_leadership("reaper", "replica-a", TTL).await.unwrap(), Some(term));
        assert!(store.renew_leadership("reaper", "replica-a", term, TTL).await.unwrap());
        assert_eq!(store.leader("reaper").await.unwrap(), Some(("replica-a".to_owned(), term)));
        // Loops are independent.
        assert_eq!(store.try_acquire_leadership("revision-gc", "replica-b", TTL).await.unwrap(), Some(Term(1)));
        assert_eq!(store.leader("node-monitor").await.unwrap(), None);
    }

    pub(super) async fn expired_lead_passes_on_with_the_next_term(db: &TestDb) {
        let store = db.store();
        let first = store.try_acquire_leadership("reaper", "replica-a", TTL).await.unwrap().unwrap();
        tokio::time::sleep(TTL + Duration::from_millis(100)).await;
        assert_eq!(store.leader("reaper").await.unwrap(), None);

        let second = store
            .try_acquire_leadership("reaper", "replica-b", TTL)
            .await
            .unwrap()
            .expect("an expired lead is taken over");
        assert_eq!(second, Term(first.0 + 1));
        // The deposed holder is fenced by its stale term.
        assert!(!store.renew_leadership("reaper", "replica-a", first, TTL).await.unwrap());
        assert_eq!(store.try_acquire_leadership("reaper", "replica-a", TTL).await.unwrap(), None);
        store.resign_leadership("reaper", "replica-a", first).await.unwrap();
        assert_eq!(store.leader("reaper").await.unwrap(), Some(("replica-b".to_owned(), second)));
    }

    pub(super) async fn resigning_frees_the_lead_at_once(db: &TestDb) {
        let store = db.store();
        let first = store
            .try_acquire_leadership("egress-full-pass", "replica-a", Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap();
        store.resign_leadership("egress-full-pass", "replica-a", first).await.unwrap();
        assert_eq!(store.leader("egress-full-pass").await.unwrap(), None);
        assert!(!store.renew_leadership("egress-full-pass", "replica-a", first, TTL).await.unwrap());
        let second = store.try_acquire_leadership("egress-full-pass", "replica-b", TTL).await.unwrap();
        assert_eq!(second, Some(Term(first.0 + 1)));
    }

    pub(super) async fn elector_hands_over_when_cancelled(db: &TestDb) {
        let shutdown = CancellationToken::new();
        let timing = ElectionTiming::from_ttl(TTL);
        let elect = |store: Store, holder: &str| {
            LeaderElector::new(store, "node-monitor", holder).with_timing(timing).spawn(&shutdown)
        };
        let a = elect(db.store().clone(), "replica-a");
        let mut a_leads = a.subscribe();
        let term_a = tokio::time::timeout(Duration::from_secs(5), a_leads.wait_for(Option::is_some))
            .await
            .expect("replica-a leads")
            .unwrap()
            .expect("leading");

        let b = elect(db.connect().await.unwrap(), "replica-b");
        let mut b_leads = b.subscribe();
        tokio::time::sleep(TTL).await;
        assert_eq!(b.current(), None, "two leaders at once");
        assert_eq!(a.current(), Some(term_a), "the leader lost a lead it keeps renewing");

        a.shutdown().await;
        assert_eq!(*a_leads.borrow(), None);
        let handed_over = Instant::now();
        let term_b = tokio::time::timeout(TTL, b_leads.wait_for(Option::is_some))
            .await
            .expect("replica-b takes over within the ttl")
            .unwrap()
            .expect("leading");
        assert!(handed_over.elapsed() < TTL);
        assert_eq!(term_b, Term(term_a.0 + 1));
        assert_eq!(db.store().leader("node-monitor").await.unwrap(), Some(("replica-b".to_owned(), term_b)));

        // Cancelling the parent token stops every elector and frees the lead.
        shutdown.cancel();
        b.shutdown().await;
        assert_eq!(db.store().leader("node-monitor").await.unwrap(), None);
    }

    pub(super) async fn elector_steps_down_when_its_term_is_taken(db: &TestDb) {
        let store = db.store();
        let a = LeaderElector::new(store.clone(), "revision-gc", "replica-a")
            .with_timing(ElectionTiming::from_ttl(TTL))
            .spawn(&CancellationToken::new());
        let mut leads = a.subscribe();
        let term = tokio::time::timeout(Duration::from_secs(5), leads.wait_for(Option::is_some))
            .await
            .expect("replica-a leads")
            .unwrap()
            .expect("leading");

        // Another replica's takeover, as if replica-a had stalled past its ttl.
        let takeover = format!(
            "UPDATE _berth_leaders SET holder = 'replica-b', term = term + 1, expires_at_ms = {} + 60000 WHERE loop_name = 'revision-gc'",
            store.now_ms_sql()
        );
        sqlx::query(sqlx::AssertSqlSafe(takeover)).execute(store.pool()).await.unwrap();

        tokio::time::timeout(TTL, leads.wait_for(Option::is_none))
            .await
            .expect("replica-a steps down within the ttl")
            .unwrap();
        tokio::time::sleep(TTL).await;
        assert_eq!(a.current(), None, "replica-a took the lead back");
        a.shutdown().await;
        // Its resignation was fenced off: replica-b still leads.
        assert_eq!(store.leader("revision-gc").await.unwrap(), Some(("replica-b".to_owned(), Term(term.0 + 1))));
    }
}

#[tokio::test]
async fn postgres_schemas_are_isolated() {
    let a = TestPg::new().await.unwrap();
    let b = TestPg::new().await.unwrap();
    a.store().migrate(&[ITEMS]).await.unwrap();
    b.store().migrate(&[ITEMS]).await.unwrap();
    insert(a.store(), 1, "only-in-a").await.unwrap();
    assert_eq!(count(a.store(), "only-in-a").await, 1);
    assert_eq!(count(b.store(), "only-in-a").await, 0);
    // The same unique name is free in the other schema.
    insert(b.store(), 1, "only-in-a").await.unwrap();

    let schema: String =
        sqlx::query_scalar("SELECT CAST(current_schema() AS TEXT)").fetch_one(b.store().pool()).await.unwrap();
    assert_eq!(schema, b.schema());
    let application: String =
        sqlx::query_scalar("SELECT current_setting('application_name')").fetch_one(b.store().pool()).await.unwrap();
    assert_eq!(application, format!("berth/{}", b.schema()));
    a.cleanup().await.unwrap();
    b.cleanup().await.unwrap();
}

#[tokio::test]
async fn postgres_cleanup_drops_the_schema() {
    let db = TestPg::new().await.unwrap();
    let schema = db.schema().to_owned();
    db.cleanup().await.unwrap();
    assert!(!schema_exists(&schema).await.unwrap(), "{schema} is still there");
}

#[tokio::test]
async fn postgres_fixture_dropped_without_cleanup_still_drops_its_schema() {
    let db = TestPg::new().await.unwrap();
    let schema = db.schema().to_owned();
    drop(db);
    assert!(!schema_exists(&schema).await.unwrap(), "{schema} is still there");
}

/// Whether PostgreSQL still has `schema`, asked through a fixture of its own.
async fn schema_exists(schema: &str) -> Result<bool, StoreError> {
    let observer = TestPg::new().await?;
    let found: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name = $1")
        .bind(schema)
        .fetch_one(observer.store().pool())
        .await?;
    observer.cleanup().await?;
    Ok(found > 0)
}

#[tokio::test]
async fn unreachable_postgres_fails_fast_naming_the_host() {
    let started = Instant::now();
    let error = Store::connect("postgres://postgres:secret@127.0.0.1:1/test", "identity").await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert!(matches!(error, StoreError::Unavailable { .. }), "{error}");
    let message = error.to_string();
    assert_eq!(message, "database postgres 127.0.0.1:1/test is unavailable: connection refused");
    assert!(!message.contains("secret"));
}

#[tokio::test]
async fn silent_postgres_fails_after_the_connect_timeout() {
    // Accepted by the kernel's backlog, never answered.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let options = StoreOptions { connect_timeout: Duration::from_millis(500), ..test_options() };
    let started = Instant::now();
    let error = Store::connect_with(&format!("postgres://postgres@127.0.0.1:{port}/test"), "identity", options)
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert!(matches!(error, StoreError::Unavailable { .. }), "{error}");
    assert!(error.to_string().contains(&format!("127.0.0.1:{port}")), "{error}");
}

#[tokio::test]
async fn postgres_url_without_the_database_is_a_config_error() {
    let mut url = pg_url();
    let database_at = url.rfind('/').unwrap();
    url.replace_range(database_at.., "/berth_no_such_database");
    let error = Store::connect(&url, "identity").await.unwrap_err();
    assert!(matches!(error, StoreError::Config { .. }), "{error}");
    assert!(error.to_string().contains("does not exist"), "{error}");
}

#[tokio::test]
async fn unknown_url_scheme_is_a_config_error() {
    let error = Store::connect("mysql://root@127.0.0.1/berth", "identity").await.unwrap_err();
    assert!(matches!(error, StoreError::Config { .. }), "{error}");
}

#[tokio::test]
async fn sqlite_in_a_missing_directory_is_refused_without_creating_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("not-created");
    let url = format!("sqlite://{}", missing.join("identity.db").display());
    let error = Store::connect(&url, "identity").await.unwrap_err();
    assert!(matches!(error, StoreError::Config { .. }), "{error}");
    assert_eq!(
        error.to_string(),
        format!("invalid store configuration: sqlite directory {} does not exist", missing.display())
    );
    assert!(!missing.exists());
}

#[tokio::test]
async fn sqlite_creates_the_file_in_wal_mode_with_foreign_keys() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.db");
    let store = Store::connect(&format!("sqlite://{}", path.display()), "leases").await.unwrap();
    assert!(path.exists());
    assert_eq!(store.backend(), Backend::Sqlite);
    let journal: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(store.pool()).await.unwrap();
    assert_eq!(journal, "wal");
    let foreign_keys: i64 = sqlx::query_scalar("PRAGMA foreign_keys").fetch_one(store.pool()).await.unwrap();
    assert_eq!(foreign_keys, 1);
    let busy_timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout").fetch_one(store.pool()).await.unwrap();
    assert_eq!(busy_timeout, 5000);
    store.close().await;
}
