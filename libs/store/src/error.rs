//! What can go wrong in storage, classified once from the driver's errors and
//! mapped once to a gRPC status a user can act on.
//!
//! # Invariants
//! - Every `sqlx::Error` becomes a [`StoreError`] through [`StoreError::from`]
//!   and nowhere else, so SQLSTATE and SQLite result codes are read in one place.
//! - A client never sees driver or SQL text: [`tonic::Status`] messages are
//!   written here, and the detail behind an internal failure goes to the log.

use std::error::Error as StdError;
use std::fmt;

use sqlx::error::ErrorKind;
use sqlx::postgres::PgDatabaseError;
use sqlx::sqlite::SqliteError;

/// A boxed error kept as the source of an internal failure.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// A storage failure, classified by what the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached: refused, timed out, or the pool is closed.
    #[error("database {} is unavailable: {reason}", .target.as_deref().unwrap_or("connection"))]
    Unavailable {
        /// Which database, when known (`postgres 10.0.0.5:5432/berth`, `sqlite /var/lib/berth/x.db`).
        target: Option<String>,
        /// Why, in a few words.
        reason: String,
        /// The driver error, when there is one.
        #[source]
        source: Option<sqlx::Error>,
    },
    /// A row with the same unique key already exists.
    #[error("{what} already exists")]
    AlreadyExists {
        /// What the caller tried to create, in domain words.
        what: String,
        /// The unique violation reported by the database, when it came from there.
        #[source]
        source: Option<sqlx::Error>,
    },
    /// A fenced write matched no row: the caller acted on a stale epoch, term or incarnation.
    #[error("{what} is stale: a newer writer has changed it")]
    Conflict {
        /// What was written, with the fence the caller held (`lease 7 at epoch 3`).
        what: String,
    },
    /// The row the caller asked for does not exist.
    #[error("{what} not found")]
    NotFound {
        /// What was looked up, in domain words.
        what: String,
    },
    /// The transaction kept colliding with concurrent ones (serialization failure,
    /// deadlock, SQLite busy) and the retries ran out.
    #[error("transaction contended with concurrent writers after {attempts} attempts")]
    Contended {
        /// How many times the transaction ran.
        attempts: u32,
        /// The last collision reported by the database.
        #[source]
        source: Option<sqlx::Error>,
    },
    /// A migration could not be applied, or an applied one has changed.
    #[error("migration {version} ({name}): {reason}")]
    Migration {
        /// The migration's version.
        version: i64,
        /// The migration's name.
        name: String,
        /// What went wrong.
        reason: String,
        /// The database error, when applying it failed.
        #[source]
        source: Option<sqlx::Error>,
    },
    /// The store was configured wrongly: a bad URL, schema name, path or argument.
    #[error("invalid store configuration: {reason}")]
    Config {
        /// What is wrong and which setting it is.
        reason: String,
        /// The underlying error, when there is one.
        #[source]
        source: Option<sqlx::Error>,
    },
    /// Anything else: a decode failure, a protocol error, a bug.
    #[error("internal storage failure: {context}")]
    Internal {
        /// What was happening.
        context: String,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },
}

impl StoreError {
    /// A [`StoreError::NotFound`] for `what`.
    pub fn not_found(what: impl Into<String>) -> Self {
        Self::NotFound { what: what.into() }
    }

    /// A [`StoreError::AlreadyExists`] for `what`, raised by the caller rather than the database.
    pub fn already_exists(what: impl Into<String>) -> Self {
        Self::AlreadyExists { what: what.into(), source: None }
    }

    /// A [`StoreError::Config`] with no underlying error.
    pub fn config(reason: impl Into<String>) -> Self {
        Self::Config { reason: reason.into(), source: None }
    }

    /// A [`StoreError::Internal`] with no underlying error.
    pub fn internal(context: impl Into<String>) -> Self {
        Self::Internal { context: context.into(), source: None }
    }

    /// Whether running the whole transaction again may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Contended { .. })
    }

    /// Names the database in an [`StoreError::Unavailable`] that does not name one yet.
    pub(crate) fn at(mut self, database: &str) -> Self {
        if let Self::Unavailable { target, .. } = &mut self
            && target.is_none()
        {
            *target = Some(database.to_owned());
        }
        self
    }
}

/// Checks that a fenced write changed exactly one row.
///
/// `UPDATE ... WHERE id = $1 AND epoch = $2` matches nothing when the caller's
/// epoch (or term, or incarnation) is stale; that is a [`StoreError::Conflict`]
/// about `what`. More than one row means the fence is not a key, which is a bug.
pub fn expect_one(rows_affected: u64, what: &str) -> Result<(), StoreError> {
    match rows_affected {
        1 => Ok(()),
        0 => Err(StoreError::Conflict { what: what.to_owned() }),
        n => Err(StoreError::internal(format!("fenced write to {what} changed {n} rows"))),
    }
}

/// SQLSTATE codes that say "run the transaction again".
const PG_SERIALIZATION_FAILURE: &str = "40001";
const PG_DEADLOCK_DETECTED: &str = "40P01";

/// SQLite primary result codes (the low byte of the extended code).
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_CANTOPEN: i32 = 14;

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        match error {
            sqlx::Error::Database(db) => classify_database_error(db),
            sqlx::Error::Io(ref io) => Self::Unavailable { target: None, reason: io_reason(io), source: Some(error) },
            sqlx::Error::Tls(_) => {
                Self::Unavailable { target: None, reason: "tls handshake failed".to_owned(), source: Some(error) }
            }
            sqlx::Error::PoolTimedOut => Self::Unavailable {
                target: None,
                reason: "timed out waiting for a connection".to_owned(),
                source: Some(error),
            },
            sqlx::Error::PoolClosed => Self::Unavailable {
                target: None,
                reason: "the connection pool is closed".to_owned(),
                source: Some(error),
            },
            sqlx::Error::WorkerCrashed => Self::Unavailable {
                target: None,
                reason: "the database worker stopped".to_owned(),
                source: Some(error),
            },
            sqlx::Error::RowNotFound => Self::not_found("record"),
            sqlx::Error::Configuration(_) => Self::Config {
                reason: "the database driver rejected its configuration".to_owned(),
                source: Some(error),
            },
            other => {
                Self::Internal { context: "unexpected database response".to_owned(), source: Some(Box::new(other)) }
            }
        }
    }
}

fn classify_database_error(db: Box<dyn sqlx::error::DatabaseError>) -> StoreError {
    let retryable = if let Some(pg) = db.try_downcast_ref::<PgDatabaseError>() {
        matches!(pg.code(), PG_SERIALIZATION_FAILURE | PG_DEADLOCK_DETECTED)
    } else if db.try_downcast_ref::<SqliteError>().is_some() {
        matches!(sqlite_primary_code(db.as_ref()), Some(SQLITE_BUSY | SQLITE_LOCKED))
    } else {
        false
    };
    let pg_unavailable = db.try_downcast_ref::<PgDatabaseError>().is_some_and(|pg| pg_means_unavailable(pg.code()));
    let cantopen =
        db.try_downcast_ref::<SqliteError>().is_some() && sqlite_primary_code(db.as_ref()) == Some(SQLITE_CANTOPEN);
    let kind = db.kind();
    let error = sqlx::Error::Database(db);

    if retryable {
        StoreError::Contended { attempts: 1, source: Some(error) }
    } else if matches!(kind, ErrorKind::UniqueViolation) {
        StoreError::AlreadyExists { what: "record".to_owned(), source: Some(error) }
    } else if pg_unavailable {
        StoreError::Unavailable {
            target: None,
            reason: "the server is shutting down or refusing connections".to_owned(),
            source: Some(error),
        }
    } else if cantopen {
        StoreError::Unavailable {
            target: None,
            reason: "the database file cannot be opened".to_owned(),
            source: Some(error),
        }
    } else {
        StoreError::Internal { context: "database error".to_owned(), source: Some(Box::new(error)) }
    }
}

/// Connection exceptions (class 08), operator intervention (57P01..57P03) and
/// too many connections (53300): the server is there but will not serve us now.
fn pg_means_unavailable(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "53300")
}

fn sqlite_primary_code(db: &dyn sqlx::error::DatabaseError) -> Option<i32> {
    db.code()?.parse::<i32>().ok().map(|extended| extended & 0xff)
}

fn io_reason(io: &std::io::Error) -> String {
    match io.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        std::io::ErrorKind::ConnectionReset => "connection reset".to_owned(),
        std::io::ErrorKind::ConnectionAborted => "connection aborted".to_owned(),
        std::io::ErrorKind::TimedOut => "connection timed out".to_owned(),
        std::io::ErrorKind::UnexpectedEof => "connection closed by the server".to_owned(),
        _ => io.to_string(),
    }
}

/// An error type a transaction body may return: it can carry a [`StoreError`],
/// and the transaction wrapper looks inside to decide whether to retry.
///
/// Services implement it for their own error enums so a body can abort with a
/// domain error (rolling back) and still have contention retried.
pub trait TxError: From<StoreError> {
    /// The storage failure this error carries, if it is one.
    fn store_error(&self) -> Option<&StoreError>;
}

impl TxError for StoreError {
    fn store_error(&self) -> Option<&StoreError> {
        Some(self)
    }
}

/// Makes a service's error enum, whose `Store(StoreError)` variant carries
/// the storage failures, a [`TxError`], and lets `?` turn a `sqlx::Error`
/// into that variant: `berth_store::store_errors!(LeaseError);`. Given a
/// closure too, the status an RPC answers with is what it makes of the
/// error: `store_errors!(LeaseError, |error| match error { ... })`.
#[macro_export]
macro_rules! store_errors {
    ($error:ty, |$status_of:ident| $status:expr) => {
        $crate::store_errors!($error);

        impl From<$error> for ::tonic::Status {
            fn from($status_of: $error) -> Self {
                $status
            }
        }
    };
    ($error:ty) => {
        impl $crate::TxError for $error {
            fn store_error(&self) -> Option<&$crate::StoreError> {
                #[allow(unreachable_patterns)]
                match self {
                    Self::Store(error) => Some(error),
                    _ => None,
                }
            }
        }

        impl From<$crate::sqlx::Error> for $error {
            fn from(error: $crate::sqlx::Error) -> Self {
                Self::Store(error.into())
            }
        }
    };
}

/// Renders an error with its whole `source()` chain, for logs.
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn StdError + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

impl From<StoreError> for tonic::Status {
    fn from(error: StoreError) -> Self {
        match &error {
            StoreError::Unavailable { .. } => {
                tracing::warn!(error = %Chain(&error), "storage unavailable");
                tonic::Status::unavailable("storage is temporarily unavailable; retry shortly")
            }
            StoreError::AlreadyExists { what, .. } => tonic::Status::already_exists(format!("{what} already exists")),
            StoreError::Conflict { what } => tonic::Status::failed_precondition(format!(
                "{what} is stale: a newer writer has changed it; read it again and retry"
            )),
            StoreError::NotFound { what } => tonic::Status::not_found(format!("{what} not found")),
            StoreError::Contended { .. } => {
                tracing::warn!(error = %Chain(&error), "transaction retries exhausted");
                tonic::Status::aborted("the request collided with concurrent changes; retry it")
            }
            StoreError::Migration { .. } | StoreError::Config { .. } | StoreError::Internal { .. } => {
                tracing::error!(error = %Chain(&error), "storage failure");
                tonic::Status::internal("internal storage error")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expect_one_accepts_exactly_one_row() {
        assert!(expect_one(1, "lease 7 at epoch 3").is_ok());
    }

    #[test]
    fn expect_one_reports_a_stale_fence_as_conflict() {
        let error = expect_one(0, "lease 7 at epoch 3").unwrap_err();
        assert!(matches!(&error, StoreError::Conflict { what } if what == "lease 7 at epoch 3"));
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert!(status.message().contains("lease 7 at epoch 3"));
    }

    #[test]
    fn expect_one_treats_many_rows_as_a_bug() {
        let error = expect_one(2, "lease 7").unwrap_err();
        assert!(matches!(error, StoreError::Internal { .. }));
    }

    #[test]
    fn pool_errors_are_unavailable() {
        for error in [sqlx::Error::PoolTimedOut, sqlx::Error::PoolClosed] {
            let error = StoreError::from(error);
            assert!(matches!(error, StoreError::Unavailable { .. }), "{error}");
            assert_eq!(tonic::Status::from(error).code(), tonic::Code::Unavailable);
        }
    }

    #[test]
    fn refused_connection_names_the_database_once_known() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let error = StoreError::from(sqlx::Error::Io(io)).at("postgres 127.0.0.1:1/test");
        assert_eq!(error.to_string(), "database postgres 127.0.0.1:1/test is unavailable: connection refused");
    }

    #[test]
    fn internal_failures_hide_their_detail_from_clients() {
        let error = StoreError::Internal {
            context: "database error".to_owned(),
            source: Some("relation \"secret_table\" does not exist".into()),
        };
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::Internal);
        assert_eq!(status.message(), "internal storage error");
    }

    #[test]
    fn row_not_found_is_not_found() {
        let status = tonic::Status::from(StoreError::from(sqlx::Error::RowNotFound));
        assert_eq!(status.code(), tonic::Code::NotFound);
    }
}
