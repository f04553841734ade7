//! The in-process bus: what Redis does for berth, kept in one process's memory
//! for `berth dev` and tests.
//!
//! # What is stored
//! Maps keyed by the same full keys Redis would hold, behind one mutex that is
//! never held across an `.await`. Expired entries are dropped when read, and
//! swept whenever a map has doubled since its last sweep, so memory stays
//! bounded by what is live. Topics are `tokio::sync::broadcast` channels; a
//! subscriber that falls more than the channel's capacity behind receives a
//! [`BusMessage::Gap`] and then the newest messages.
//!
//! # Time
//! Expiry and windows use `tokio::time::Instant`, so a test may pause the clock.
//! Deadlines are plain numbers given by the caller, as in Redis.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::broadcast;
use tokio::time::Instant;

use crate::backend::{BusBackend, BusFuture, BusMessage, MarkerState, RateDecision, Subscription};

/// How many messages a topic buffers for its slowest subscriber before that subscriber sees a gap.
pub const DEFAULT_TOPIC_CAPACITY: usize = 1024;

/// A map is swept of expired entries only once it holds more than this many.
const SWEEP_FLOOR: usize = 256;

/// The in-process [`BusBackend`]: a new one is empty (its first continuity check says `Fresh`).
pub struct MemoryBus {
    topic_capacity: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    topics: HashMap<String, broadcast::Sender<BusMessage>>,
    values: Expiring<Bytes>,
    counters: Expiring<u64>,
    deadlines: HashMap<String, DeadlineIndex>,
}

impl MemoryBus {
    /// An empty bus whose topics buffer [`DEFAULT_TOPIC_CAPACITY`] messages.
    pub fn new() -> Self {
        Self::with_topic_capacity(DEFAULT_TOPIC_CAPACITY)
    }

    /// An empty bus whose topics buffer `capacity` messages (at least one) per subscriber.
    pub fn with_topic_capacity(capacity: usize) -> Self {
        Self { topic_capacity: capacity.max(1), state: Mutex::default() }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update below completes before anything can panic, so the state
        // behind a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn run<'a, T: Send + 'a>(&'a self, apply: impl FnOnce(&mut State) -> T + Send + 'a) -> BusFuture<'a, T> {
        Box::pin(async move { Ok(apply(&mut self.state())) })
    }
}

impl Default for MemoryBus {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBus").field("topic_capacity", &self.topic_capacity).finish_non_exhaustive()
    }
}

impl BusBackend for MemoryBus {
    fn publish<'a>(&'a self, channel: &'a str, payload: Bytes) -> BusFuture<'a, ()> {
        self.run(move |state| {
            let delivered =
                state.topics.get(channel).is_some_and(|topic| topic.send(BusMessage::Payload(payload)).is_ok());
            if !delivered {
                // Nobody listens: forget the topic, as Redis forgets an unsubscribed channel.
                state.topics.remove(channel);
            }
        })
    }

    fn subscribe<'a>(&'a self, channel: &'a str) -> BusFuture<'a, Subscription> {
        self.run(move |state| {
            let receiver = match state.topics.get(channel) {
                Some(topic) => topic.subscribe(),
                None => {
                    let (topic, receiver) = broadcast::channel(self.topic_capacity);
                    state.topics.insert(channel.to_owned(), topic);
                    receiver
                }
            };
            Subscription::from_broadcast(receiver)
        })
    }

    fn deadline_set_many<'a>(&'a self, key: &'a str, entries: &'a [(&'a str, i64)]) -> BusFuture<'a, ()> {
        self.run(move |state| {
            let index = state.deadlines.entry(key.to_owned()).or_default();
            for (member, at_ms) in entries {
                index.set(member, *at_ms);
            }
        })
    }

    fn deadline_remove<'a>(&'a self, key: &'a str, member: &'a str) -> BusFuture<'a, bool> {
        self.run(move |state| {
            let Some(index) = state.deadlines.get_mut(key) else {
                return false;
            };
            let removed = index.remove(member);
            if index.is_empty() {
                // Redis deletes a sorted set with its last member; so do we.
                state.deadlines.remove(key);
            }
            removed
        })
    }

    fn deadline_get<'a>(&'a self, key: &'a str, member: &'a str) -> BusFuture<'a, Option<i64>> {
        self.run(move |state| state.deadlines.get(key).and_then(|index| index.get(member)))
    }

    fn deadline_due<'a>(&'a self, key: &'a str, now_ms: i64, limit: usize) -> BusFuture<'a, Vec<(String, i64)>> {
        self.run(move |state| state.deadlines.get(key).map(|index| index.due(now_ms, limit)).unwrap_or_default())
    }

    fn deadline_len<'a>(&'a self, key: &'a str) -> BusFuture<'a, u64> {
        self.run(move |state| state.deadlines.get(key).map_or(0, |index| index.len() as u64))
    }

    fn rate_limit<'a>(&'a self, key: &'a str, limit: u32, window: Duration) -> BusFuture<'a, RateDecision> {
        self.run(move |state| {
            let now = Instant::now();
            let (count, resets_at) = match state.counters.get_mut(key, now) {
                Some((count, resets_at)) => {
                    *count = count.saturating_add(1);
                    (*count, resets_at.unwrap_or(now))
                }
                None => {
                    state.counters.insert(key, 1, Some(now + window));
                    (1, now + window)
                }
            };
            let limit = u64::from(limit);
            let allowed = count <= limit;
            RateDecision {
                allowed,
                remaining: u32::try_from(limit.saturating_sub(count)).unwrap_or(u32::MAX),
                retry_after: if allowed { Duration::ZERO } else { resets_at.saturating_duration_since(now) },
            }
        })
    }

    fn cache_get<'a>(&'a self, key: &'a str) -> BusFuture<'a, Option<Vec<u8>>> {
        self.run(move |state| state.values.get_mut(key, Instant::now()).map(|(value, _)| value.to_vec()))
    }

    fn cache_set<'a>(&'a self, key: &'a str, value: &'a [u8], ttl: Duration) -> BusFuture<'a, ()> {
        self.run(move |state| {
            let expires_at = Instant::now() + ttl;
            state.values.insert(key, Bytes::copy_from_slice(value), Some(expires_at));
        })
    }

    fn cache_delete<'a>(&'a self, key: &'a str) -> BusFuture<'a, bool> {
        self.run(move |state| state.values.remove(key, Instant::now()))
    }

    fn marker_get_or_install<'a>(&'a self, key: &'a str, candidate: &'a str) -> BusFuture<'a, MarkerState> {
        self.run(move |state| match state.values.get_mut(key, Instant::now()) {
            Some((value, _)) => MarkerState::Existing(String::from_utf8_lossy(value).into_owned()),
            None => {
                state.values.insert(key, Bytes::copy_from_slice(candidate.as_bytes()), None);
                MarkerState::Installed
            }
        })
    }

    fn ping(&self) -> BusFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    fn clear<'a>(&'a self, prefix: &'a str) -> BusFuture<'a, u64> {
        self.run(move |state| {
            let namespace = format!("{prefix}:");
            let now = Instant::now();
            let deadlines_before = state.deadlines.len();
            state.deadlines.retain(|key, _| !key.starts_with(&namespace));
            let removed = state.values.remove_namespace(&namespace, now)
                + state.counters.remove_namespace(&namespace, now)
                + (deadlines_before - state.deadlines.len());
            removed as u64
        })
    }
}

/// Values that may expire, dropped when read past their time and swept as the map grows.
struct Expiring<T> {
    entries: HashMap<String, (T, Option<Instant>)>,
    /// The map's size after the last sweep; a sweep runs when it doubles.
    swept_at_len: usize,
}

impl<T> Default for Expiring<T> {
    fn default() -> Self {
        Self { entries: HashMap::new(), swept_at_len: 0 }
    }
}

impl<T> Expiring<T> {
    /// The live value at `key` and when it expires, if ever.
    fn get_mut(&mut self, key: &str, now: Instant) -> Option<(&mut T, Option<Instant>)> {
        if self.is_expired(key, now) {
            self.entries.remove(key);
            return None;
        }
        self.entries.get_mut(key).map(|(value, expires_at)| (value, *expires_at))
    }

    fn insert(&mut self, key: &str, value: T, expires_at: Option<Instant>) {
        self.entries.insert(key.to_owned(), (value, expires_at));
        if self.entries.len() > SWEEP_FLOOR.max(self.swept_at_len * 2) {
            let now = Instant::now();
            self.entries.retain(|_, (_, expires_at)| expires_at.is_none_or(|at| at > now));
            self.swept_at_len = self.entries.len();
        }
    }

    /// Removes `key`; whether it was live.
    fn remove(&mut self, key: &str, now: Instant) -> bool {
        let live = !self.is_expired(key, now) && self.entries.contains_key(key);
        self.entries.remove(key);
        live
    }

    /// Removes every key that starts with `namespace`; how many of them were live.
    fn remove_namespace(&mut self, namespace: &str, now: Instant) -> usize {
        let mut live = 0;
        self.entries.retain(|key, (_, expires_at)| {
            if !key.starts_with(namespace) {
                return true;
            }
            if expires_at.is_none_or(|at| at > now) {
                live += 1;
            }
            false
        });
        live
    }

    fn is_expired(&self, key: &str, now: Instant) -> bool {
        self.entries.get(key).and_then(|(_, expires_at)| *expires_at).is_some_and(|at| at <= now)
    }
}

/// A sorted set of deadlines: by member for lookups, by `(deadline, member)` for
/// the due scan, ordered as Redis orders equal scores (by member bytes).
#[derive(Default)]
struct DeadlineIndex {
    by_member: HashMap<String, i64>,
    by_deadline: BTreeSet<(i64, String)>,
}

impl DeadlineIndex {
    fn set(&mut self, member: &str, at_ms: i64) {
        if let Some(previous) = self.by_member.insert(member.to_owned(), at_ms) {
            self.by_deadline.remove(&(previous, member.to_owned()));
        }
        self.by_deadline.insert((at_ms, member.to_owned()));
    }

    fn remove(&mut self, member: &str) -> bool {
        match self.by_member.remove(member) {
            Some(at_ms) => self.by_deadline.remove(&(at_ms, member.to_owned())),
            None => false,
        }
    }

    fn get(&self, member: &str) -> Option<i64> {
        self.by_member.get(member).copied()
    }

    fn due(&self, now_ms: i64, limit: usize) -> Vec<(String, i64)> {
        self.by_deadline
            .iter()
            .take_while(|(at_ms, _)| *at_ms <= now_ms)
            .take(limit)
            .map(|(at_ms, member)| (member.clone(), *at_ms))
            .collect()
    }

    fn len(&self) -> usize {
        self.by_member.len()
    }

    fn is_empty(&self) -> bool {
        self.by_member.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn expired_cache_entries_do_not_pile_up() {
        let bus = MemoryBus::new();
        for round in 0..10 {
            for i in 0..SWEEP_FLOOR {
                let key = format!("p:cache:{round}-{i}");
                bus.cache_set(&key, b"v", Duration::from_millis(5)).await.unwrap();
            }
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let held = bus.state().values.entries.len();
        assert!(held <= 2 * SWEEP_FLOOR, "{held} entries held");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_attempt_waits_exactly_until_the_window_resets() {
        let bus = MemoryBus::new();
        let window = Duration::from_secs(60);
        assert!(bus.rate_limit("p:rate:k", 1, window).await.unwrap().allowed);
        tokio::time::advance(Duration::from_secs(45)).await;
        let refused = bus.rate_limit("p:rate:k", 1, window).await.unwrap();
        assert_eq!(refused, RateDecision { allowed: false, remaining: 0, retry_after: Duration::from_secs(15) });
        tokio::time::advance(Duration::from_secs(15)).await;
        assert!(bus.rate_limit("p:rate:k", 1, window).await.unwrap().allowed);
    }

    #[tokio::test]
    async fn a_lagging_subscriber_sees_a_gap_then_the_newest_messages() {
        let bus = MemoryBus::with_topic_capacity(4);
        let mut slow = bus.subscribe("p:topic:t").await.unwrap();
        for i in 0..10u8 {
            bus.publish("p:topic:t", Bytes::from(vec![i])).await.unwrap();
        }
        assert_eq!(slow.recv().await, Some(BusMessage::Gap));
        for i in 6..10u8 {
            assert_eq!(slow.recv().await, Some(BusMessage::Payload(Bytes::from(vec![i]))));
        }
    }

    #[tokio::test]
    async fn publishing_to_an_abandoned_topic_forgets_it() {
        let bus = MemoryBus::new();
        drop(bus.subscribe("p:topic:t").await.unwrap());
        bus.publish("p:topic:t", Bytes::from_static(b"x")).await.unwrap();
        assert!(bus.state().topics.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn clear_counts_only_live_keys_of_its_own_prefix() {
        let bus = MemoryBus::new();
        bus.cache_set("a:cache:live", b"v", Duration::from_secs(10)).await.unwrap();
        bus.cache_set("a:cache:stale", b"v", Duration::from_millis(1)).await.unwrap();
        bus.deadline_set_many("a:deadline:i", &[("m", 1)]).await.unwrap();
        bus.rate_limit("a:rate:r", 5, Duration::from_secs(10)).await.unwrap();
        bus.cache_set("ab:cache:other", b"v", Duration::from_secs(10)).await.unwrap();
        tokio::time::advance(Duration::from_millis(5)).await;

        assert_eq!(bus.clear("a").await.unwrap(), 3);
        assert_eq!(bus.cache_get("a:cache:live").await.unwrap(), None);
        assert_eq!(bus.cache_get("ab:cache:other").await.unwrap(), Some(b"v".to_vec()));
    }
}
