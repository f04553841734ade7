//! The storage layer every berth service uses: one [`Store`] over PostgreSQL
//! (production, a schema per service) or SQLite (`berth dev`, a file per
//! service), with migrations, a retrying transaction wrapper, typed errors and
//! leader election through the database.
//!
//! # Invariants
//! - PostgreSQL is the truth; everything a service must not lose is written
//!   here, inside [`Store::tx`].
//! - A service never reads another service's tables: its store's
//!   `search_path` (or file) holds its own schema alone.
//! - Writes a stale actor could make are fenced in SQL (`WHERE epoch = $n`)
//!   and checked with [`expect_one`]; time comes from the database clock
//!   ([`Store::now_ms`], [`Store::now_ms_sql`]).

pub use crate::error::{BoxError, StoreError, TxError, expect_one};
pub use crate::leader::{ElectionTiming, Fence, LeaderElector, LeaderHandle, Term};
pub use crate::migrate::Migration;
pub use crate::store::{Backend, Store, StoreOptions, TxFuture, TxRetry, TxScope, now_ms_in};
#[doc(hidden)]
pub use sqlx;

mod error;
mod leader;
mod migrate;
mod store;
#[cfg(feature = "testing")]
pub mod testing;
