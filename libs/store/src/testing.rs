//! Throwaway databases for tests: a uniquely named PostgreSQL schema, or a
//! SQLite file in a temporary directory, each behind a connected [`Store`].
//!
//! # Invariants
//! - Every fixture's name is unique across processes, so parallel tests never
//!   share tables.
//! - `cleanup().await` drops what the fixture created. A fixture dropped
//!   without it (a failed assertion) still drops its PostgreSQL schema, on a
//!   short-lived thread of its own, so failing tests leave nothing behind.

use std::sync::atomic::{AtomicU64, Ordering};

use rand::Rng as _;
use sqlx::{AnyConnection, Connection as _, Executor as _};

use crate::error::StoreError;
use crate::store::{Store, StoreOptions};

/// The environment variable naming the test PostgreSQL.
pub const TEST_DATABASE_URL_ENV: &str = "BERTH_TEST_DATABASE_URL";

/// The test PostgreSQL when [`TEST_DATABASE_URL_ENV`] is unset.
pub const DEFAULT_TEST_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The PostgreSQL that tests use: `BERTH_TEST_DATABASE_URL`, or the local default.
pub fn pg_url() -> String {
    std::env::var(TEST_DATABASE_URL_ENV).unwrap_or_else(|_| DEFAULT_TEST_DATABASE_URL.to_owned())
}

/// A name no other fixture in any process is using: `<prefix>_<pid>_<n>_<random>`.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let random: u32 = rand::rng().random();
    format!("{prefix}_{}_{n}_{random:08x}", std::process::id())
}

/// Options with short timeouts, so a test against a missing database fails in
/// seconds.
pub fn test_options() -> StoreOptions {
    StoreOptions { max_connections: 4, connect_timeout: std::time::Duration::from_secs(3), ..StoreOptions::default() }
}

/// A uniquely named schema in the test PostgreSQL, dropped with `CASCADE` on
/// [`TestPg::cleanup`].
#[derive(Debug)]
pub struct TestPg {
    url: String,
    schema: String,
    store: Store,
    cleaned: bool,
}

impl TestPg {
    /// Creates a fresh schema and connects a store to it.
    pub async fn new() -> Result<Self, StoreError> {
        let url = pg_url();
        let schema = unique_name("berth_test");
        let store = Store::connect_with(&url, &schema, test_options()).await?;
        Ok(Self { url, schema, store, cleaned: false })
    }

    /// The store connected to this schema.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The schema's name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The database URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Another store on the same schema, as a second replica would have.
    pub async fn connect(&self) -> Result<Store, StoreError> {
        Store::connect_with(&self.url, &self.schema, test_options()).await
    }

    /// Drops the schema and everything in it.
    pub async fn cleanup(mut self) -> Result<(), StoreError> {
        self.store.close().await;
        drop_schema(&self.url, &self.schema).await?;
        self.cleaned = true;
        Ok(())
    }
}

impl Drop for TestPg {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        let (url, schema) = (self.url.clone(), self.schema.clone());
        // Drop cannot await, and the test's runtime may be shutting down:
        // a runtime of its own on a thread of its own does the work.
        let dropped = std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
            runtime.block_on(drop_schema(&url, &schema)).map_err(|e| e.to_string())
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            tracing::warn!(schema = %self.schema, "could not drop the test schema");
        }
    }
}

/// Ends the schema's other sessions first: a test that failed mid-transaction
/// may have left a connection holding locks that `DROP SCHEMA` would wait on
/// forever.
async fn drop_schema(url: &str, schema: &str) -> Result<(), StoreError> {
    crate::store::validate_schema(schema)?;
    sqlx::any::install_default_drivers();
    let mut conn = AnyConnection::connect(url).await?;
    conn.execute("SET lock_timeout = '10s'").await?;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(crate::store::application_name(schema))
    .execute(&mut conn)
    .await?;
    conn.execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))).await?;
    conn.close().await?;
    Ok(())
}

/// A SQLite file in a temporary directory, removed with it.
#[derive(Debug)]
pub struct TestSqlite {
    dir: tempfile::TempDir,
    url: String,
    store: Store,
}

impl TestSqlite {
    /// Creates a temporary directory and connects a store to a new file in it.
    pub async fn new() -> Result<Self, StoreError> {
        let dir = tempfile::Builder::new().prefix("berth-store-test-").tempdir().map_err(|e| StoreError::Internal {
            context: "creating a temporary directory".to_owned(),
            source: Some(Box::new(e)),
        })?;
        let url = format!("sqlite://{}", dir.path().join("store.db").display());
        let store = Store::connect_with(&url, "berth_test", test_options()).await?;
        Ok(Self { dir, url, store })
    }

    /// The store connected to the file.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The database URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The temporary directory holding the file.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Another store on the same file, as a second process would have.
    pub async fn connect(&self) -> Result<Store, StoreError> {
        Store::connect_with(&self.url, "berth_test", test_options()).await
    }

    /// Closes the store and removes the directory.
    pub async fn cleanup(self) -> Result<(), StoreError> {
        self.store.close().await;
        self.dir.close().map_err(|e| StoreError::Internal {
            context: "removing the temporary directory".to_owned(),
            source: Some(Box::new(e)),
        })
    }
}

/// Either fixture, so one contract suite runs against both backends.
#[derive(Debug)]
pub enum TestDb {
    /// A schema in the test PostgreSQL.
    Postgres(TestPg),
    /// A SQLite file in a temporary directory.
    Sqlite(TestSqlite),
}

impl TestDb {
    /// A fresh PostgreSQL schema.
    pub async fn postgres() -> Result<Self, StoreError> {
        TestPg::new().await.map(Self::Postgres)
    }

    /// A fresh SQLite file.
    pub async fn sqlite() -> Result<Self, StoreError> {
        TestSqlite::new().await.map(Self::Sqlite)
    }

    /// The connected store.
    pub fn store(&self) -> &Store {
        match self {
            Self::Postgres(db) => db.store(),
            Self::Sqlite(db) => db.store(),
        }
    }

    /// The database URL.
    pub fn url(&self) -> &str {
        match self {
            Self::Postgres(db) => db.url(),
            Self::Sqlite(db) => db.url(),
        }
    }

    /// Another store on the same database.
    pub async fn connect(&self) -> Result<Store, StoreError> {
        match self {
            Self::Postgres(db) => db.connect().await,
            Self::Sqlite(db) => db.connect().await,
        }
    }

    /// Removes the schema or file.
    pub async fn cleanup(self) -> Result<(), StoreError> {
        match self {
            Self::Postgres(db) => db.cleanup().await,
            Self::Sqlite(db) => db.cleanup().await,
        }
    }
}
