//! The accelerator beside PostgreSQL: pub/sub fan-out, deadline indexes, rate
//! limits, caches and a continuity marker, behind one [`Bus`] handle backed by
//! Redis ([`RedisBus`]) or by this process's memory ([`MemoryBus`]).
//!
//! # What is stored
//! Only what can be rebuilt from PostgreSQL: liveness and lease deadlines,
//! event fan-out, cached reads, rate-limit counters. Nothing here is the truth
//! about anything; every key lives under the owning service's prefix (see
//! [`Bus`] for the layout).
//!
//! # Losing the bus
//! A Redis restart or `FLUSHALL` loses no data. Services notice it two ways and
//! rebuild: [`Bus::continuity`] turns [`Continuity::Reset`] once the marker it
//! saw is gone (so the owner rebuilds its deadline indexes from PostgreSQL and
//! grants a grace period before reaping anything), and every subscription
//! receives [`BusMessage::Gap`] once it is live again (so the consumer resyncs).
//! While Redis is down, calls fail with [`BusError::Unavailable`] and nothing
//! is reaped for want of a deadline.
//!
//! # Delivery
//! Pub/sub is at most once and only to subscribers connected at the time:
//! consumers are level-triggered, treating a message as a hint to re-read and
//! a `Gap` as a prompt to re-read everything. Messages from one publisher on
//! one topic arrive in the order they were published.
//!
//! # Backends
//! `redis://` / `rediss://` for production, `memory://` for `berth dev` and
//! tests; both pass one contract suite (`tests/contract.rs`). They differ only
//! in failure modes: the in-process bus is never unavailable, and signals a gap
//! only when a subscriber lags.

mod backend;
mod bus;
mod error;
mod memory;
mod redis_bus;
mod redis_calls;
mod redis_pubsub;
mod signals;
#[cfg(feature = "testing")]
pub mod testing;

pub use backend::{BusBackend, BusFuture, BusMessage, MarkerState, RateDecision, Subscription};
pub use bus::{Bus, Continuity, MAX_DEADLINE_MS};
pub use error::BusError;
pub use memory::{DEFAULT_TOPIC_CAPACITY, MemoryBus};
pub use redis_bus::RedisBus;
pub use redis_calls::RedisTimings;
pub use signals::{KeySignals, Signal};
