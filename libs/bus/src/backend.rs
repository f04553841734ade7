//! The seam between the [`Bus`](crate::Bus) handle and a store that keeps its
//! keys: Redis in production, an in-process map in `berth dev` and tests.
//!
//! # Contract
//! A backend works on full keys and channel names; the handle has already
//! namespaced them under its prefix and validated every argument. Every
//! backend passes the same contract suite (`tests/contract.rs`), so code
//! above the handle cannot tell them apart except by their failure modes.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;

use crate::BusError;

/// The future every backend operation returns; boxed so that the trait stays dyn-compatible.
pub type BusFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BusError>> + Send + 'a>>;

/// A store that can back a [`Bus`](crate::Bus).
///
/// Keys arrive fully namespaced (`{prefix}:{kind}:{name}`); a backend never
/// interprets them beyond [`clear`](Self::clear).
pub trait BusBackend: fmt::Debug + Send + Sync + 'static {
    /// Sends `payload` to every current subscriber of `channel`; nobody listening is not an error.
    fn publish<'a>(&'a self, channel: &'a str, payload: Bytes) -> BusFuture<'a, ()>;

    /// Starts receiving `channel`; messages published after this resolves are delivered.
    fn subscribe<'a>(&'a self, channel: &'a str) -> BusFuture<'a, Subscription>;

    /// Upserts `(member, at_ms)` pairs into the sorted set at `key`, in one round trip.
    fn deadline_set_many<'a>(&'a self, key: &'a str, entries: &'a [(&'a str, i64)]) -> BusFuture<'a, ()>;

    /// Removes `member`; whether it was there.
    fn deadline_remove<'a>(&'a self, key: &'a str, member: &'a str) -> BusFuture<'a, bool>;

    /// The deadline of `member`, if it has one.
    fn deadline_get<'a>(&'a self, key: &'a str, member: &'a str) -> BusFuture<'a, Option<i64>>;

    /// Up to `limit` members whose deadline is at or before `now_ms`, earliest first
    /// (ties by member name).
    fn deadline_due<'a>(&'a self, key: &'a str, now_ms: i64, limit: usize) -> BusFuture<'a, Vec<(String, i64)>>;

    /// How many members the set at `key` holds.
    fn deadline_len<'a>(&'a self, key: &'a str) -> BusFuture<'a, u64>;

    /// Counts one attempt against the fixed window at `key` and says whether it fits in `limit`.
    fn rate_limit<'a>(&'a self, key: &'a str, limit: u32, window: Duration) -> BusFuture<'a, RateDecision>;

    /// The value at `key`, unless absent or expired.
    fn cache_get<'a>(&'a self, key: &'a str) -> BusFuture<'a, Option<Vec<u8>>>;

    /// Stores `value` at `key` for `ttl`, replacing what was there.
    fn cache_set<'a>(&'a self, key: &'a str, value: &'a [u8], ttl: Duration) -> BusFuture<'a, ()>;

    /// Deletes `key`; whether it was there.
    fn cache_delete<'a>(&'a self, key: &'a str) -> BusFuture<'a, bool>;

    /// Atomically reads the marker at `key`, installing `candidate` (with no expiry) if absent.
    fn marker_get_or_install<'a>(&'a self, key: &'a str, candidate: &'a str) -> BusFuture<'a, MarkerState>;

    /// Answers when the store is reachable.
    fn ping(&self) -> BusFuture<'_, ()>;

    /// Deletes every key that starts with `{prefix}:`; how many there were.
    fn clear<'a>(&'a self, prefix: &'a str) -> BusFuture<'a, u64>;
}

/// What [`BusBackend::marker_get_or_install`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MarkerState {
    /// There was no marker; the candidate is now installed.
    Installed,
    /// A marker was already there, with this value.
    Existing(String),
}

/// The outcome of one [`Bus::rate_limit`](crate::Bus::rate_limit) attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateDecision {
    /// Whether this attempt fits in the window.
    pub allowed: bool,
    /// How many more attempts the current window allows after this one.
    pub remaining: u32,
    /// When refused, how long until the window resets; zero when allowed.
    pub retry_after: Duration,
}

/// One item of a [`Subscription`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BusMessage {
    /// A published payload, in the order it was published.
    Payload(Bytes),
    /// Messages may have been missed (the subscriber lagged, or the connection
    /// to the bus was lost and has just been restored): resync from the source of truth.
    Gap,
}

/// A stream of the messages published on one topic.
///
/// The stream ends only when the bus it came from is gone; dropping it
/// unsubscribes.
pub struct Subscription {
    messages: Pin<Box<dyn Stream<Item = BusMessage> + Send>>,
}

impl Subscription {
    /// Wraps any stream of messages, for backends outside this crate.
    pub fn new(messages: impl Stream<Item = BusMessage> + Send + 'static) -> Self {
        Self { messages: Box::pin(messages) }
    }

    /// A subscription fed by a broadcast channel, where lagging turns into a [`BusMessage::Gap`].
    pub(crate) fn from_broadcast(receiver: broadcast::Receiver<BusMessage>) -> Self {
        Self::new(BroadcastStream::new(receiver).map(|item| item.unwrap_or(BusMessage::Gap)))
    }

    /// The next message, or `None` once the bus is gone.
    pub async fn recv(&mut self) -> Option<BusMessage> {
        self.messages.next().await
    }
}

impl Stream for Subscription {
    type Item = BusMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BusMessage>> {
        self.messages.as_mut().poll_next(cx)
    }
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}
