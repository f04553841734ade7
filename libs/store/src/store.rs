//! The handle every service holds on its database: one pool on PostgreSQL or
//! SQLite, picked by the URL, with queries written once for both through
//! sqlx's `Any` driver.
//!
//! # Backends
//! - `postgres://...` (production): one shared PostgreSQL, each service in its
//!   own schema. Connecting creates the schema if missing, and every pooled
//!   connection's `search_path` is that schema alone, so services write
//!   unqualified table names and never see each other's tables.
//! - `sqlite://PATH` (`berth dev`): one SQLite file per service. The file is
//!   created if missing, its parent directory never is. WAL journal,
//!   `busy_timeout`, foreign keys on. The pool holds a single connection: the
//!   embedded mode is one process with light load, and one writer means
//!   transactions never fail on SQLite's database-level write lock within the
//!   process. A transaction body must therefore not call back into the store
//!   (it would wait for the connection it holds); use [`Store::now_ms_sql`]
//!   inside SQL instead of [`Store::now_ms`].
//!
//! # Portable SQL
//! Queries use `$1, $2, ...` placeholders on both backends: sqlx binds SQLite's
//! `$N` parameters by number, so order and repetition behave as on PostgreSQL.
//! Portable column types: `BIGINT` epoch milliseconds for time, `TEXT`,
//! `BIGINT`/`INTEGER`, and `BYTEA` (PostgreSQL) / `BLOB` (SQLite) for bytes,
//! which is why [`Migration`](crate::Migration) carries SQL per backend. The rare
//! query that must differ matches on [`Store::backend`]. The `Any` driver
//! decodes only booleans, integers, floats, text and bytes: a query returning
//! another PostgreSQL type (`name`, `timestamptz`, `uuid`, `void`) casts it in
//! SQL first.
//!
//! # Transactions
//! [`Store::tx`] runs a body in a transaction, names it for traces, and reruns
//! it on contention. PostgreSQL transactions are `SERIALIZABLE`, so a body
//! sees the same isolation as on SQLite (where writers are serialized) and a
//! read-modify-write can never lose an update; the price is serialization
//! failures, which are retried with jittered backoff. SQLite transactions
//! begin `IMMEDIATE`, taking the write lock up front so `busy_timeout`
//! applies instead of failing on upgrade. A failed `COMMIT` whose cause is
//! not contention is reported, never retried: its outcome is unknown and the
//! caller must read the state again. A transaction whose future is dropped
//! before it ends (a cancelled call) closes its connection rather than
//! return it to the pool, so no pooled connection is ever left inside a
//! transaction nobody will end ([`SettledOrClosed`]). [`Store::read`] runs a
//! body that only reads in one snapshot (`REPEATABLE READ READ ONLY` on
//! PostgreSQL), which never fails as contended and never makes a writer
//! fail; lists and lookups use it, read-modify-writes never do.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::pool::PoolConnectionMetadata;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{AnyConnection, AnyPool, ConnectOptions as _, Connection as _, Executor as _};
use tracing::Instrument as _;

use crate::error::{StoreError, TxError};

/// `clock_timestamp()`, not `now()`: inside a transaction `now()` is frozen at
/// its start, and lease deadlines must compare against the present.
macro_rules! pg_now_ms {
    () => {
        "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
    };
}

macro_rules! sqlite_now_ms {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

pub(crate) use {pg_now_ms, sqlite_now_ms};

/// PostgreSQL connections per store (per service replica).
const DEFAULT_MAX_CONNECTIONS: u32 = 10;
/// How long connecting may take before the database counts as unreachable.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a caller waits for a pooled connection.
const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long SQLite waits on another process's lock before reporting busy.
const DEFAULT_SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How many times a contended transaction runs in all.
const DEFAULT_TX_ATTEMPTS: u32 = 5;
/// The first retry waits up to this long; each later one up to twice as long.
const DEFAULT_TX_BACKOFF: Duration = Duration::from_millis(10);
/// No retry waits longer than this.
const DEFAULT_TX_MAX_BACKOFF: Duration = Duration::from_millis(500);

/// How many times [`Store::upsert`] runs a body that keeps racing other
/// writers for the same keys, in rounds of the store's transaction attempts.
const UPSERT_ROUNDS: u32 = 4;

/// Longest PostgreSQL identifier.
const MAX_SCHEMA_LEN: usize = 63;

/// Which database engine a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// PostgreSQL: production, shared by every service.
    Postgres,
    /// SQLite: the embedded `berth dev` mode.
    Sqlite,
}

impl Backend {
    /// The OpenTelemetry `db.system` name.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Postgres => "postgresql",
            Backend::Sqlite => "sqlite",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How contended transactions are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxRetry {
    /// How many times a transaction runs in all (at least 1).
    pub max_attempts: u32,
    /// Upper bound of the first retry's random wait.
    pub base_backoff: Duration,
    /// Upper bound of any retry's random wait.
    pub max_backoff: Duration,
}

impl Default for TxRetry {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_TX_ATTEMPTS,
            base_backoff: DEFAULT_TX_BACKOFF,
            max_backoff: DEFAULT_TX_MAX_BACKOFF,
        }
    }
}

impl TxRetry {
    /// A random wait in `[0, min(max, base * 2^(attempt-1))]` ("full jitter"),
    /// so colliding transactions spread out instead of colliding again.
    fn backoff(&self, attempt: u32) -> Duration {
        berth_core::backoff::full_jitter(self.base_backoff, self.max_backoff, attempt)
    }
}

/// Pool sizes and timeouts. [`StoreOptions::default`] suits production; tests
/// shorten the timeouts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// PostgreSQL pool size (default 10). SQLite always uses one connection.
    pub max_connections: u32,
    /// Time allowed to open a connection, after which the database is
    /// [`StoreError::Unavailable`] (default 5 s).
    pub connect_timeout: Duration,
    /// Time a caller waits for a pooled connection (default 5 s).
    pub acquire_timeout: Duration,
    /// SQLite `busy_timeout` (default 5 s).
    pub sqlite_busy_timeout: Duration,
    /// Retry policy of [`Store::tx`].
    pub tx_retry: TxRetry,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            sqlite_busy_timeout: DEFAULT_SQLITE_BUSY_TIMEOUT,
            tx_retry: TxRetry::default(),
        }
    }
}

/// A future returned by a [`Store::tx`] body.
///
/// It may borrow the connection (`'c`) and anything that outlives the call
/// (`'env`); the second type parameter of [`TxScope`] makes the compiler
/// assume `'env: 'c`, which a plain boxed future in a higher-ranked closure
/// bound cannot express.
pub type TxFuture<'env, 'c, T> = std::pin::Pin<Box<dyn TxScope<'env, 'c, Output = T> + Send + 'c>>;

/// A future scoped to one transaction; see [`TxFuture`]. Implemented for every
/// future, so a body returns `Box::pin(async move { ... })`.
pub trait TxScope<'env, 'c, Bound = std::marker::PhantomData<&'c &'env ()>>: std::future::Future {}

impl<'env: 'c, 'c, F: std::future::Future + 'c> TxScope<'env, 'c> for F {}

/// A connected store: a pool, the backend it runs on, and the schema it owns.
/// Cloning is cheap and shares the pool.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    backend: Backend,
    schema: String,
    /// The database named for humans, without credentials.
    target: String,
    tx_retry: TxRetry,
}

impl Store {
    /// Connects with [`StoreOptions::default`]; see [`Store::connect_with`].
    pub async fn connect(url: &str, schema: &str) -> Result<Store, StoreError> {
        Self::connect_with(url, schema, StoreOptions::default()).await
    }

    /// Connects to `url` (`postgres://...` or `sqlite://PATH`) as the owner of
    /// `schema` (`[a-z_][a-z0-9_]{0,62}`, not `pg_*`), creating the schema or
    /// file if missing and the store's own tables.
    pub async fn connect_with(url: &str, schema: &str, options: StoreOptions) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        validate_schema(schema)?;
        let store = if strip_scheme(url, &["postgres://", "postgresql://"]).is_some() {
            connect_postgres(url, schema, &options).await?
        } else if let Some(path) = strip_scheme(url, &["sqlite://", "sqlite:"]) {
            connect_sqlite(path, schema, &options).await?
        } else {
            return Err(StoreError::config("database url must start with postgres:// or sqlite://"));
        };
        store.bootstrap().await?;
        Ok(store)
    }

    /// The engine this store runs on, for the rare query that must differ.
    pub fn backend(&self) -> Backend {
        self.shared.backend
    }

    /// The schema this store owns (on SQLite, a name only).
    pub fn schema(&self) -> &str {
        &self.shared.schema
    }

    /// The database named for logs, without credentials.
    pub fn target(&self) -> &str {
        &self.shared.target
    }

    /// The pool, for queries that need no transaction.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Readiness: a round trip to the database.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.pool.execute("SELECT 1").await.map(drop).map_err(|e| self.classify(e))
    }

    /// The database clock in epoch milliseconds, so replicas on skewed hosts agree.
    pub async fn now_ms(&self) -> Result<i64, StoreError> {
        let sql = match self.backend() {
            Backend::Postgres => concat!("SELECT ", pg_now_ms!()),
            Backend::Sqlite => concat!("SELECT ", sqlite_now_ms!()),
        };
        sqlx::query_scalar::<_, i64>(sql).fetch_one(&self.pool).await.map_err(|e| self.classify(e))
    }

    /// The SQL expression for the database clock in epoch milliseconds
    /// (`BIGINT`), for fencing queries that compare against it.
    pub fn now_ms_sql(&self) -> &'static str {
        match self.backend() {
            Backend::Postgres => pg_now_ms!(),
            Backend::Sqlite => sqlite_now_ms!(),
        }
    }

    /// Closes the pool; later calls fail with [`StoreError::Unavailable`].
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Runs `body` in a transaction named `op` and commits it.
    ///
    /// An error from the body rolls back and is returned as is. A body or
    /// commit that fails on contention (SQLSTATE 40001, 40P01, SQLite busy)
    /// runs again in a fresh transaction, a bounded number of times with
    /// jittered backoff; so the body must have no effects outside the
    /// transaction. The whole call is one `db.transaction` span with
    /// `db.operation = op`.
    ///
    /// ```ignore
    /// store.tx("lease.renew", |conn| Box::pin(async move {
    ///     let done = sqlx::query("UPDATE leases SET expires_at_ms = $3 WHERE id = $1 AND epoch = $2")
    ///         .bind(id).bind(epoch).bind(deadline)
    ///         .execute(&mut *conn).await?;
    ///     expect_one(done.rows_affected(), "lease")
    /// })).await?;
    /// ```
    pub async fn tx<'env, T, E, F>(&self, op: &'static str, body: F) -> Result<T, E>
    where
        F: for<'c> FnMut(&'c mut AnyConnection) -> TxFuture<'env, 'c, Result<T, E>> + Send + 'env,
        T: Send,
        E: TxError + Send,
    {
        self.run(op, Access::ReadWrite, body).await
    }

    /// Runs `body` as [`Store::tx`] does, for a write of keys that
    /// concurrent writers race to create (an apply of a declaration). Two
    /// that both read "no such row" insert the same key, and PostgreSQL
    /// reports the loser as a unique violation ([`StoreError::AlreadyExists`]),
    /// not a serialization failure; and a key hot enough to outlast `tx`'s
    /// own retries is worth more. Either runs the body again, with the
    /// transaction's own backoff, up to four times the store's transaction
    /// attempts in all: run again, it reads what the winner committed.
    pub async fn upsert<'env, T, E, F>(&self, op: &'static str, body: F) -> Result<T, E>
    where
        F: for<'c> FnMut(&'c mut AnyConnection) -> TxFuture<'env, 'c, Result<T, E>> + Send + 'env,
        T: Send,
        E: TxError + Send,
    {
        self.run(op, Access::Upsert, body).await
    }

    /// Runs `body` in a read-only transaction named `op`: one consistent
    /// snapshot of what was committed when it began, and a write in it is
    /// refused. On PostgreSQL it is `REPEATABLE READ READ ONLY`, which never
    /// fails as contended and takes no predicate locks: a read neither
    /// fails under concurrent writers nor makes them fail, as a
    /// `SERIALIZABLE` one can. A read-modify-write belongs in [`Store::tx`].
    pub async fn read<'env, T, E, F>(&self, op: &'static str, body: F) -> Result<T, E>
    where
        F: for<'c> FnMut(&'c mut AnyConnection) -> TxFuture<'env, 'c, Result<T, E>> + Send + 'env,
        T: Send,
        E: TxError + Send,
    {
        self.run(op, Access::ReadOnly, body).await
    }

    async fn run<'env, T, E, F>(&self, op: &'static str, access: Access, mut body: F) -> Result<T, E>
    where
        F: for<'c> FnMut(&'c mut AnyConnection) -> TxFuture<'env, 'c, Result<T, E>> + Send + 'env,
        T: Send,
        E: TxError + Send,
    {
        let span = tracing::info_span!(
            "db.transaction",
            otel.name = op,
            db.operation = op,
            db.system = self.backend().as_str(),
            db.namespace = %self.schema(),
            db.access = access.as_str(),
            attempts = tracing::field::Empty,
        );
        let retry = self.shared.tx_retry;
        let max_attempts = match access {
            Access::Upsert => retry.max_attempts.saturating_mul(UPSERT_ROUNDS),
            Access::ReadWrite | Access::ReadOnly => retry.max_attempts,
        };
        async move {
            let mut attempt = 1;
            loop {
                let result = self.tx_once(access, &mut body).await;
                let store_error = result.as_ref().err().and_then(TxError::store_error);
                let raced = access == Access::Upsert && matches!(store_error, Some(StoreError::AlreadyExists { .. }));
                if raced && attempt < max_attempts {
                    tracing::debug!(attempt, "an upsert raced another for the same key, running it again");
                    tokio::time::sleep(retry.backoff(attempt)).await;
                    attempt += 1;
                    continue;
                }
                let contended = store_error.is_some_and(StoreError::is_retryable);
                if contended && attempt < max_attempts {
                    let wait = retry.backoff(attempt);
                    tracing::debug!(attempt, ?wait, "transaction contended, running it again");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                    continue;
                }
                tracing::Span::current().record("attempts", attempt);
                return match result {
                    Err(error) if contended => {
                        let store_error = error.store_error().map(|e| e.to_string()).unwrap_or_default();
                        tracing::warn!(attempt, error = %store_error, "transaction retries exhausted");
                        Err(E::from(StoreError::Contended { attempts: attempt, source: None }))
                    }
                    other => other,
                };
            }
        }
        .instrument(span)
        .await
    }

    async fn tx_once<'env, T, E, F>(&self, access: Access, body: &mut F) -> Result<T, E>
    where
        F: for<'c> FnMut(&'c mut AnyConnection) -> TxFuture<'env, 'c, Result<T, E>> + Send + 'env,
        E: TxError,
    {
        let (begin, read_only) = match (self.backend(), access) {
            (Backend::Postgres, Access::ReadWrite | Access::Upsert) => ("BEGIN ISOLATION LEVEL SERIALIZABLE", None),
            (Backend::Postgres, Access::ReadOnly) => ("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", None),
            (Backend::Sqlite, Access::ReadWrite | Access::Upsert) => ("BEGIN IMMEDIATE", None),
            // SQLite has no read-only transaction; the connection is made
            // read-only for its length (a setting of the connection, which
            // a cancelled read leaves behind on a connection that is closed).
            (Backend::Sqlite, Access::ReadOnly) => {
                ("BEGIN DEFERRED", Some(("PRAGMA query_only = ON", "PRAGMA query_only = OFF")))
            }
        };
        let mut conn = self.transaction_connection().await.map_err(E::from)?;
        let result = async {
            if let Some((on, _)) = read_only {
                conn.execute(on).await.map_err(|e| E::from(self.classify(e)))?;
            }
            let mut tx = conn.begin_with(begin).await.map_err(|e| E::from(self.classify(e)))?;
            match body(&mut tx).await {
                Ok(value) => {
                    tx.commit().await.map_err(|e| E::from(self.classify(e)))?;
                    Ok(value)
                }
                Err(error) => {
                    if let Err(rollback) = tx.rollback().await {
                        tracing::debug!(error = %rollback, "rollback failed; the connection is discarded");
                    }
                    Err(error)
                }
            }
        }
        .await;
        if let Some((_, off)) = read_only
            && let Err(error) = conn.execute(off).await
        {
            tracing::debug!(%error, "could not make the connection writable again; it is discarded");
            return result;
        }
        conn.settled();
        result
    }

    /// A pooled connection to run one transaction on; see [`SettledOrClosed`].
    pub(crate) async fn transaction_connection(&self) -> Result<SettledOrClosed, StoreError> {
        let conn = self.pool.acquire().await.map_err(|e| self.classify(e))?;
        Ok(SettledOrClosed { conn, settled: false })
    }

    /// Classifies a driver error and names this database in it.
    pub(crate) fn classify(&self, error: sqlx::Error) -> StoreError {
        StoreError::from(error).at(&self.shared.target)
    }
}

/// The database clock in epoch milliseconds, read on `conn` (inside a
/// transaction body); `now_sql` is [`Store::now_ms_sql`].
pub async fn now_ms_in(conn: &mut AnyConnection, now_sql: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT {now_sql}"))).fetch_one(&mut *conn).await
}

/// What a transaction may do, which picks how it begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    ReadWrite,
    ReadOnly,
    /// Read-write, and a unique violation runs it again ([`Store::upsert`]).
    Upsert,
}

impl Access {
    fn as_str(self) -> &'static str {
        match self {
            Self::ReadWrite | Self::Upsert => "read-write",
            Self::ReadOnly => "read-only",
        }
    }
}

/// A pooled connection a transaction runs on: back to the pool once the
/// transaction ran to an end ([`SettledOrClosed::settled`]), closed if it
/// is dropped before, that is when the future running the transaction was
/// cancelled (a caller's deadline, a client gone).
///
/// Closing is what keeps the pool sound: sqlx rolls back a transaction
/// dropped after its `BEGIN` was answered, but a `begin` cancelled while its
/// `BEGIN` is in flight leaves the connection inside a transaction it does
/// not know about. Back in the pool, every later statement on it would run
/// in that one transaction, never committed: its writes invisible, its row
/// locks held, its serializable snapshot kept open, which makes every other
/// serializable transaction on the server fail as contended. A closed
/// connection's transaction is rolled back by the server.
pub(crate) struct SettledOrClosed {
    conn: sqlx::pool::PoolConnection<sqlx::Any>,
    settled: bool,
}

impl SettledOrClosed {
    /// The transaction ran to an end (committed, rolled back, or failed
    /// with an answer): the connection goes back to the pool.
    pub(crate) fn settled(mut self) {
        self.settled = true;
    }
}

impl std::ops::Deref for SettledOrClosed {
    type Target = AnyConnection;

    fn deref(&self) -> &AnyConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for SettledOrClosed {
    fn deref_mut(&mut self) -> &mut AnyConnection {
        &mut self.conn
    }
}

impl Drop for SettledOrClosed {
    fn drop(&mut self) {
        if !self.settled {
            self.conn.close_on_drop();
        }
    }
}

fn strip_scheme<'u>(url: &'u str, schemes: &[&str]) -> Option<&'u str> {
    schemes.iter().find_map(|scheme| url.strip_prefix(scheme))
}

/// Schema names are interpolated into DDL and `search_path`, so only a
/// conservative identifier is accepted; `pg_` is reserved by PostgreSQL.
pub(crate) fn validate_schema(schema: &str) -> Result<(), StoreError> {
    let mut chars = schema.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || schema.len() > MAX_SCHEMA_LEN {
        return Err(StoreError::config(format!("schema name {schema:?} must match [a-z_][a-z0-9_]{{0,62}}")));
    }
    if schema.starts_with("pg_") {
        return Err(StoreError::config(format!(
            "schema name {schema:?} uses the prefix pg_, which PostgreSQL reserves"
        )));
    }
    Ok(())
}

async fn connect_postgres(url: &str, schema: &str, options: &StoreOptions) -> Result<Store, StoreError> {
    let connect_options: AnyConnectOptions =
        url.parse().map_err(|_| StoreError::config("database url is not a valid postgres:// url"))?;
    let target = postgres_target(&connect_options);

    // One connection first, outside the pool, so an unreachable server fails
    // fast with its real cause instead of a pool timeout.
    let mut conn = open(&connect_options, options.connect_timeout, &target).await?;
    create_schema(&mut conn, schema).await.map_err(|e| connect_error(e, &target))?;
    if let Err(error) = conn.close().await {
        tracing::debug!(%error, "closing the bootstrap connection failed");
    }

    // The application name lets an operator (and the test fixtures) find a
    // schema's connections in pg_stat_activity.
    let session =
        [format!("SET search_path TO \"{schema}\""), format!("SET application_name TO '{}'", application_name(schema))];
    let pool = AnyPoolOptions::new()
        .max_connections(options.max_connections.max(1))
        .acquire_timeout(options.acquire_timeout)
        .after_connect(move |conn: &mut AnyConnection, _: PoolConnectionMetadata| {
            let session = session.clone();
            Box::pin(async move {
                for statement in session {
                    conn.execute(sqlx::AssertSqlSafe(statement)).await?;
                }
                Ok(())
            })
        })
        .connect_lazy_with(connect_options);
    Ok(Store {
        pool,
        shared: Arc::new(Shared {
            backend: Backend::Postgres,
            schema: schema.to_owned(),
            target,
            tx_retry: options.tx_retry,
        }),
    })
}

/// The `application_name` of a schema's pooled PostgreSQL connections.
pub(crate) fn application_name(schema: &str) -> String {
    format!("berth/{schema}")
}

/// `postgres host:port/database`, never the credentials.
fn postgres_target(options: &AnyConnectOptions) -> String {
    let url = &options.database_url;
    let host = url.host_str().unwrap_or("localhost");
    let port = url.port().unwrap_or(5432);
    let database = url.path().trim_start_matches('/');
    format!("postgres {host}:{port}/{database}")
}

/// The advisory lock key that serializes schema changes to one schema.
pub(crate) fn schema_lock_key(schema: &str) -> i64 {
    let digest = <sha2::Sha256 as sha2::Digest>::digest(format!("berth-store/{schema}").as_bytes());
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}

/// Creates the schema under an advisory lock: concurrent `CREATE SCHEMA IF
/// NOT EXISTS` from two replicas can otherwise fail on a catalog unique index.
async fn create_schema(conn: &mut AnyConnection, schema: &str) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT 1 FROM (SELECT pg_advisory_xact_lock($1)) AS locked")
        .bind(schema_lock_key(schema))
        .execute(&mut *tx)
        .await?;
    tx.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))).await?;
    tx.commit().await
}

async fn connect_sqlite(path: &str, schema: &str, options: &StoreOptions) -> Result<Store, StoreError> {
    let path = sqlite_path(path)?;
    let target = format!("sqlite {}", path.display());
    let connect_options = AnyConnectOptions::from_url(
        &SqliteConnectOptions::new().filename(&path).create_if_missing(true).to_url_lossy(),
    )
    .map_err(|e| StoreError::Config {
        reason: format!("sqlite path {} is not usable", path.display()),
        source: Some(e),
    })?;

    // WAL is a property of the file: set once, here, where no one else holds
    // the connection (changing it needs a lock busy_timeout cannot wait for).
    let mut conn = open(&connect_options, options.connect_timeout, &target).await?;
    conn.execute("PRAGMA journal_mode = WAL").await.map_err(|e| connect_error(e, &target))?;
    if let Err(error) = conn.close().await {
        tracing::debug!(%error, "closing the bootstrap connection failed");
    }

    let busy_timeout = format!("PRAGMA busy_timeout = {}", options.sqlite_busy_timeout.as_millis());
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(options.acquire_timeout)
        .after_connect(move |conn: &mut AnyConnection, _: PoolConnectionMetadata| {
            let busy_timeout = busy_timeout.clone();
            Box::pin(async move {
                conn.execute(sqlx::AssertSqlSafe(busy_timeout)).await?;
                conn.execute("PRAGMA foreign_keys = ON").await?;
                Ok(())
            })
        })
        .connect_lazy_with(connect_options);
    Ok(Store {
        pool,
        shared: Arc::new(Shared {
            backend: Backend::Sqlite,
            schema: schema.to_owned(),
            target,
            tx_retry: options.tx_retry,
        }),
    })
}

/// The file path of a `sqlite://` URL, whose directory must already exist:
/// creating directories is the operator's decision, and a typo should fail
/// loudly rather than scatter databases.
fn sqlite_path(path: &str) -> Result<PathBuf, StoreError> {
    if path.is_empty() || path.contains('?') || path == ":memory:" {
        return Err(StoreError::config("sqlite url must be sqlite://PATH naming a database file"));
    }
    let path = PathBuf::from(path);
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty())
        && !dir.is_dir()
    {
        return Err(StoreError::config(format!("sqlite directory {} does not exist", dir.display())));
    }
    if path.is_dir() {
        return Err(StoreError::config(format!("sqlite path {} is a directory, not a database file", path.display())));
    }
    Ok(path)
}

async fn open(options: &AnyConnectOptions, timeout: Duration, target: &str) -> Result<AnyConnection, StoreError> {
    match tokio::time::timeout(timeout, AnyConnection::connect_with(options)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(error)) => Err(connect_error(error, target)),
        Err(_) => Err(StoreError::Unavailable {
            target: Some(target.to_owned()),
            reason: format!("no answer within {timeout:?}"),
            source: None,
        }),
    }
}

/// At connect time some database errors are the operator's to fix: wrong
/// credentials, a database that does not exist, a file that cannot be opened.
fn connect_error(error: sqlx::Error, target: &str) -> StoreError {
    let reason = match &error {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some(code) if code.starts_with("28") => Some("the server rejected the credentials".to_owned()),
            Some("3D000") => Some("the database does not exist".to_owned()),
            Some("42501") => Some("permission denied to create the schema".to_owned()),
            _ if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() => {
                Some(format!("cannot open the database file: {}", db.message()))
            }
            _ => None,
        },
        _ => None,
    };
    match reason {
        Some(reason) => StoreError::Config { reason: format!("{target}: {reason}"), source: Some(error) },
        None => StoreError::from(error).at(target),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_follow_postgres_identifier_rules() {
        for good in ["identity", "_x", "leases_2", &"a".repeat(63)] {
            assert!(validate_schema(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "Identity",
            "1leases",
            "le-ases",
            "a;drop schema public",
            "with space",
            "pg_catalog",
            "schéma",
            &"a".repeat(64),
        ] {
            let error = validate_schema(bad).unwrap_err();
            assert!(matches!(error, StoreError::Config { .. }), "{bad}: {error}");
        }
    }

    #[test]
    fn sqlite_path_requires_an_existing_directory() {
        let error = sqlite_path("/nonexistent-berth-dir/identity.db").unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid store configuration: sqlite directory /nonexistent-berth-dir does not exist"
        );
        assert!(sqlite_path("identity.db").is_ok());
    }

    #[test]
    fn postgres_target_hides_credentials() {
        let options: AnyConnectOptions = "postgres://berth:hunter2@db.internal:6432/berth".parse().unwrap();
        assert_eq!(postgres_target(&options), "postgres db.internal:6432/berth");
    }

    #[test]
    fn backoff_stays_within_its_cap() {
        let retry = TxRetry::default();
        for attempt in 1..40 {
            assert!(retry.backoff(attempt) <= retry.max_backoff);
        }
    }
}
