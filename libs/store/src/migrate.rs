//! Schema migrations shipped as data by each service and applied in order,
//! once, by whichever replica gets there first.
//!
//! # What is stored
//! `_berth_migrations` in the service's schema: `version`, `name`, the SHA-256
//! `checksum` of the SQL that ran, and `applied_at_ms` (database clock). The
//! store's own tables (`_berth_leaders`) are migrated the same way through a
//! separate ledger, `_berth_store_migrations`, so their versions never collide
//! with a service's.
//!
//! # Invariants
//! - Each migration runs in its own transaction together with its ledger row,
//!   so a migration is applied entirely or not at all.
//! - On PostgreSQL every migration transaction first takes a transaction-level
//!   advisory lock keyed by the schema, then checks the ledger: two replicas
//!   migrating at once apply each migration once. These transactions are
//!   `READ COMMITTED` (not `SERIALIZABLE` like [`Store::tx`]) so the ledger read
//!   after the lock sees what the lock holder committed. On SQLite,
//!   `BEGIN IMMEDIATE` serializes migrators on the file's write lock.
//! - An applied migration is immutable: a different checksum or name for an
//!   applied version is refused with [`StoreError::Migration`] naming it.
//!   Versions the database has but the binary does not know are left alone, so
//!   an older replica keeps running during a rolling upgrade.

use sha2::{Digest as _, Sha256};
use sqlx::{AnyConnection, Connection as _};

use crate::error::StoreError;
use crate::store::{Backend, Store, pg_now_ms, schema_lock_key, sqlite_now_ms};

/// One schema change, as a service ships it (usually its SQL files, through
/// [`migrations!`](crate::migrations)). Each backend's SQL may hold several
/// statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Position in the sequence; strictly increasing, starting above zero.
    pub version: i64,
    /// A short name for logs and the ledger.
    pub name: &'static str,
    /// The SQL run on PostgreSQL.
    pub postgres: &'static str,
    /// The SQL run on SQLite.
    pub sqlite: &'static str,
}

impl Migration {
    /// A migration named by its files' stem, `NNNN_name`: version `NNNN`,
    /// name `name`. A stem of another shape fails the build (the constant
    /// that holds it cannot be evaluated).
    pub const fn from_files(stem: &'static str, postgres: &'static str, sqlite: &'static str) -> Migration {
        let bytes = stem.as_bytes();
        let mut version: i64 = 0;
        let mut digits = 0;
        while digits < bytes.len() && bytes[digits].is_ascii_digit() {
            version = version * 10 + (bytes[digits] - b'0') as i64;
            digits += 1;
        }
        assert!(
            digits > 0 && digits + 1 < bytes.len() && bytes[digits] == b'_',
            "a migration's files are named NNNN_name.sql"
        );
        let (_, name) = stem.split_at(digits + 1);
        Migration { version, name, postgres, sqlite }
    }

    fn sql(&self, backend: Backend) -> &'static str {
        match backend {
            Backend::Postgres => self.postgres,
            Backend::Sqlite => self.sqlite,
        }
    }

    fn checksum(&self, backend: Backend) -> String {
        hex::encode(Sha256::digest(self.sql(backend).as_bytes()))
    }
}

/// A service's migrations, oldest first, from the files it ships beside its
/// `Cargo.toml`: `migrations!["0001_catalog", "0002_traffic"]` reads
/// `migrations/postgres/0001_catalog.sql` and `migrations/sqlite/0001_catalog.sql`
/// into version 1, `catalog`, and so on.
#[macro_export]
macro_rules! migrations {
    ($($stem:literal),+ $(,)?) => {
        &[$($crate::Migration::from_files(
            $stem,
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/postgres/", $stem, ".sql")),
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/sqlite/", $stem, ".sql")),
        )),+]
    };
}

/// The store's own tables, applied on connect through [`Ledger::Store`].
const STORE_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "leaders",
    postgres: "CREATE TABLE _berth_leaders (
        loop_name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        term BIGINT NOT NULL,
        expires_at_ms BIGINT NOT NULL
    )",
    sqlite: "CREATE TABLE _berth_leaders (
        loop_name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        term BIGINT NOT NULL,
        expires_at_ms BIGINT NOT NULL
    )",
}];

/// Which ledger a migration list is recorded in.
#[derive(Debug, Clone, Copy)]
enum Ledger {
    /// The service's migrations.
    Service,
    /// The store's own tables.
    Store,
}

/// The statements that read and write one ledger table, per backend.
struct LedgerSql {
    create: &'static str,
    select: &'static str,
    insert_pg: &'static str,
    insert_sqlite: &'static str,
}

macro_rules! ledger_sql {
    ($table:literal) => {
        LedgerSql {
            create: concat!(
                "CREATE TABLE IF NOT EXISTS ",
                $table,
                " (version BIGINT PRIMARY KEY, name TEXT NOT NULL, checksum TEXT NOT NULL, applied_at_ms BIGINT NOT NULL)"
            ),
            select: concat!("SELECT name, checksum FROM ", $table, " WHERE version = $1"),
            insert_pg: concat!(
                "INSERT INTO ",
                $table,
                " (version, name, checksum, applied_at_ms) VALUES ($1, $2, $3, ",
                pg_now_ms!(),
                ")"
            ),
            insert_sqlite: concat!(
                "INSERT INTO ",
                $table,
                " (version, name, checksum, applied_at_ms) VALUES ($1, $2, $3, ",
                sqlite_now_ms!(),
                ")"
            ),
        }
    };
}

const SERVICE_LEDGER: LedgerSql = ledger_sql!("_berth_migrations");
const STORE_LEDGER: LedgerSql = ledger_sql!("_berth_store_migrations");

impl Ledger {
    fn sql(self) -> &'static LedgerSql {
        match self {
            Ledger::Service => &SERVICE_LEDGER,
            Ledger::Store => &STORE_LEDGER,
        }
    }

    fn insert(self, backend: Backend) -> &'static str {
        match backend {
            Backend::Postgres => self.sql().insert_pg,
            Backend::Sqlite => self.sql().insert_sqlite,
        }
    }
}

impl Store {
    /// Applies the migrations this database lacks, in order, each in its own
    /// transaction. Running it again is a no-op; see the module docs for the
    /// rules on changed and concurrent migrations.
    pub async fn migrate(&self, migrations: &[Migration]) -> Result<(), StoreError> {
        self.apply(Ledger::Service, migrations).await
    }

    /// Creates the ledgers and the store's own tables.
    pub(crate) async fn bootstrap(&self) -> Result<(), StoreError> {
        let mut conn = self.transaction_connection().await?;
        let created = self.create_ledgers(&mut conn).await;
        conn.settled();
        created?;
        self.apply(Ledger::Store, STORE_MIGRATIONS).await
    }

    async fn create_ledgers(&self, conn: &mut AnyConnection) -> Result<(), StoreError> {
        let mut tx = conn.begin_with(self.migration_begin()).await.map_err(|e| self.classify(e))?;
        self.lock_schema(&mut tx).await?;
        for ledger in [Ledger::Service, Ledger::Store] {
            sqlx::query(ledger.sql().create).execute(&mut *tx).await.map_err(|e| self.classify(e))?;
        }
        tx.commit().await.map_err(|e| self.classify(e))
    }

    async fn apply(&self, ledger: Ledger, migrations: &[Migration]) -> Result<(), StoreError> {
        check_sequence(migrations)?;
        for migration in migrations {
            self.apply_one(ledger, migration).await?;
        }
        Ok(())
    }

    async fn apply_one(&self, ledger: Ledger, migration: &Migration) -> Result<(), StoreError> {
        let mut conn = self.transaction_connection().await?;
        let applied = self.apply_one_on(&mut conn, ledger, migration).await;
        conn.settled();
        applied
    }

    async fn apply_one_on(
        &self,
        conn: &mut AnyConnection,
        ledger: Ledger,
        migration: &Migration,
    ) -> Result<(), StoreError> {
        let backend = self.backend();
        let checksum = migration.checksum(backend);
        let failed = |reason: &str, source: Option<sqlx::Error>| StoreError::Migration {
            version: migration.version,
            name: migration.name.to_owned(),
            reason: reason.to_owned(),
            source,
        };

        let mut tx = conn.begin_with(self.migration_begin()).await.map_err(|e| self.classify(e))?;
        self.lock_schema(&mut tx).await?;
        let applied: Option<(String, String)> = sqlx::query_as(ledger.sql().select)
            .bind(migration.version)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.classify(e))?;

        if let Some((name, applied_checksum)) = applied {
            if applied_checksum != checksum {
                return Err(failed(
                    &format!(
                        "was changed after it was applied (checksum {applied_checksum}, now {checksum}); add a new migration instead"
                    ),
                    None,
                ));
            }
            if name != migration.name {
                return Err(failed(&format!("was applied under the name {name:?}"), None));
            }
            return Ok(());
        }

        if let Err(error) = sqlx::raw_sql(migration.sql(backend)).execute(&mut *tx).await {
            return Err(match error {
                sqlx::Error::Database(_) => failed("failed to apply", Some(error)),
                other => self.classify(other),
            });
        }
        sqlx::query(ledger.insert(backend))
            .bind(migration.version)
            .bind(migration.name)
            .bind(&checksum)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.classify(e))?;
        tx.commit().await.map_err(|e| self.classify(e))?;
        tracing::info!(schema = self.schema(), version = migration.version, name = migration.name, "applied migration");
        Ok(())
    }

    fn migration_begin(&self) -> &'static str {
        match self.backend() {
            Backend::Postgres => "BEGIN",
            Backend::Sqlite => "BEGIN IMMEDIATE",
        }
    }

    /// Held until the transaction ends; SQLite's `BEGIN IMMEDIATE` already
    /// holds the only write lock there is.
    async fn lock_schema(&self, conn: &mut AnyConnection) -> Result<(), StoreError> {
        if self.backend() == Backend::Postgres {
            sqlx::query("SELECT 1 FROM (SELECT pg_advisory_xact_lock($1)) AS locked")
                .bind(schema_lock_key(self.schema()))
                .execute(conn)
                .await
                .map_err(|e| self.classify(e))?;
        }
        Ok(())
    }
}

fn check_sequence(migrations: &[Migration]) -> Result<(), StoreError> {
    let mut previous = 0;
    for migration in migrations {
        if migration.version <= previous {
            return Err(StoreError::Migration {
                version: migration.version,
                name: migration.name.to_owned(),
                reason: format!("versions must start above 0 and strictly increase (follows {previous})"),
                source: None,
            });
        }
        previous = migration.version;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn migration(version: i64) -> Migration {
        Migration { version, name: "m", postgres: "SELECT 1", sqlite: "SELECT 1" }
    }

    #[test]
    fn a_migration_takes_its_version_and_name_from_its_files_stem() {
        const SHIPPED: &[Migration] = &[Migration::from_files("0012_route_acks", "SELECT 1", "SELECT 2")];
        assert_eq!(SHIPPED[0], Migration { version: 12, name: "route_acks", postgres: "SELECT 1", sqlite: "SELECT 2" });
    }

    #[test]
    fn migration_versions_must_strictly_increase() {
        assert!(check_sequence(&[migration(1), migration(2), migration(5)]).is_ok());
        let error = check_sequence(&[migration(1), migration(3), migration(3)]).unwrap_err();
        assert!(matches!(error, StoreError::Migration { version: 3, .. }));
        let error = check_sequence(&[migration(0)]).unwrap_err();
        assert!(matches!(error, StoreError::Migration { version: 0, .. }));
    }

    #[test]
    fn lock_keys_differ_per_schema() {
        assert_ne!(schema_lock_key("identity"), schema_lock_key("leases"));
        assert_eq!(schema_lock_key("leases"), schema_lock_key("leases"));
    }
}
