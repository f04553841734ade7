//! The [`Bus`] handle: one service's namespaced view of the accelerator.
//!
//! # Key layout
//! Every key and channel lives under `{prefix}:`, so services (and tests)
//! sharing one Redis never see each other's state:
//!
//! | what                 | key                           | Redis type |
//! |----------------------|-------------------------------|------------|
//! | pub/sub topic        | `{prefix}:topic:{topic}`      | channel    |
//! | deadline index       | `{prefix}:deadline:{index}`   | sorted set |
//! | rate-limit window    | `{prefix}:rate:{key}`         | string     |
//! | cache entry          | `{prefix}:cache:{key}`        | string     |
//! | continuity marker    | `{prefix}:continuity`         | string     |
//!
//! # Validation
//! Arguments are checked here, once, so every backend stores the same thing:
//! a prefix is non-empty ASCII letters, digits, `.`, `_` or `-` (no `:`, so two
//! prefixes never overlap, and no glob characters, so `clear` matches only its
//! own keys); deadlines fit the 53 bits a Redis score holds exactly; windows and
//! TTLs are at least a millisecond.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;

use crate::BusError;
use crate::backend::{BusBackend, MarkerState, RateDecision, Subscription};
use crate::memory::MemoryBus;
use crate::redis_bus::RedisBus;

/// The largest deadline magnitude a Redis score (an IEEE double) holds exactly.
pub const MAX_DEADLINE_MS: i64 = 1 << 53;

const CONTINUITY_KEY: &str = "continuity";

/// What [`Bus::continuity`] learned about the bus's state since this handle last looked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// This handle's first look found an empty bus: nothing was there to lose, but
    /// nothing this service needs is there either, so rebuild it.
    Fresh,
    /// The bus still holds what it held at the previous look (or what another
    /// replica put there, on this handle's first look). A first look cannot tell
    /// whether that replica's marker followed a loss, so a newly elected owner of
    /// an index rebuilds it regardless.
    Continuous,
    /// The bus lost its state since the previous look (restart, FLUSHALL, or
    /// the marker evicted under memory pressure, which errs on the safe side):
    /// rebuild from PostgreSQL and grant a grace period before acting on deadlines.
    Reset,
}

impl Continuity {
    /// Whether the bus's contents must be rebuilt from the source of truth.
    pub fn needs_rebuild(self) -> bool {
        !matches!(self, Self::Continuous)
    }
}

/// A cheap, cloneable handle on the bus, namespaced under one prefix.
///
/// Clones share the connection and the continuity marker this handle has seen;
/// [`Bus::with_prefix`] shares only the connection.
#[derive(Clone, Debug)]
pub struct Bus {
    backend: Arc<dyn BusBackend>,
    prefix: Arc<str>,
    /// The continuity marker value this handle last saw, to tell a reset from a peer's install.
    marker: Arc<Mutex<Option<String>>>,
}

impl Bus {
    /// Connects to the bus at `url` and namespaces every key under `prefix`.
    ///
    /// `redis://` and `rediss://` URLs reach Redis (failing within a few seconds with
    /// [`BusError::Unavailable`] when it cannot be reached); `memory://` (or `memory`)
    /// makes a new, empty in-process bus that needs nothing running.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, BusError> {
        validate_prefix(prefix)?;
        if url == "memory" || url == "memory://" {
            return Self::new(MemoryBus::new(), prefix);
        }
        match url.split_once("://") {
            Some(("redis" | "rediss", _)) => Self::new(RedisBus::connect(url).await?, prefix),
            Some(("memory", _)) => {
                Err(BusError::config("url", url, "an in-process bus takes no address: use memory://"))
            }
            Some((scheme, _)) => Err(BusError::config(
                "url",
                url,
                format!("unsupported scheme `{scheme}`, expected redis, rediss or memory"),
            )),
            None => Err(BusError::config("url", url, "expected redis://host:port, rediss://host:port or memory://")),
        }
    }

    /// A handle on `backend`, namespaced under `prefix`.
    pub fn new(backend: impl BusBackend, prefix: &str) -> Result<Self, BusError> {
        Self::from_shared(Arc::new(backend), prefix)
    }

    /// A handle on a backend that other handles may already share.
    pub fn from_shared(backend: Arc<dyn BusBackend>, prefix: &str) -> Result<Self, BusError> {
        validate_prefix(prefix)?;
        Ok(Self { backend, prefix: prefix.into(), marker: Arc::default() })
    }

    /// A handle on the same connection under another prefix, as a second service
    /// (or a second replica, with the same prefix) would see it.
    pub fn with_prefix(&self, prefix: &str) -> Result<Self, BusError> {
        Self::from_shared(Arc::clone(&self.backend), prefix)
    }

    /// The namespace of every key this handle touches.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Sends `payload` to every current subscriber of `topic`.
    ///
    /// Delivery is at most once: subscribers that are disconnected at the time
    /// miss it and see a [`BusMessage::Gap`](crate::BusMessage::Gap) instead.
    pub async fn publish(&self, topic: &str, payload: impl Into<Bytes>) -> Result<(), BusError> {
        let channel = self.key("topic", topic);
        self.backend.publish(&channel, payload.into()).await
    }

    /// Starts receiving what is published on `topic` from now on.
    pub async fn subscribe(&self, topic: &str) -> Result<Subscription, BusError> {
        let channel = self.key("topic", topic);
        self.backend.subscribe(&channel).await
    }

    /// Sets (or moves) the deadline of `member` in `index` to `at_ms`, in Unix milliseconds.
    pub async fn deadline_set(&self, index: &str, member: &str, at_ms: i64) -> Result<(), BusError> {
        self.deadline_set_many(index, &[(member, at_ms)]).await
    }

    /// Sets many deadlines in one round trip, as when rebuilding `index` after a reset.
    pub async fn deadline_set_many<M: AsRef<str>>(&self, index: &str, entries: &[(M, i64)]) -> Result<(), BusError> {
        if entries.is_empty() {
            return Ok(());
        }
        let entries = entries
            .iter()
            .map(|(member, at_ms)| Ok((member.as_ref(), check_deadline("at_ms", *at_ms)?)))
            .collect::<Result<Vec<_>, BusError>>()?;
        let key = self.key("deadline", index);
        self.backend.deadline_set_many(&key, &entries).await
    }

    /// Removes `member` from `index`; whether it had a deadline.
    pub async fn deadline_remove(&self, index: &str, member: &str) -> Result<bool, BusError> {
        let key = self.key("deadline", index);
        self.backend.deadline_remove(&key, member).await
    }

    /// The deadline of `member` in `index`, in Unix milliseconds.
    pub async fn deadline_get(&self, index: &str, member: &str) -> Result<Option<i64>, BusError> {
        let key = self.key("deadline", index);
        self.backend.deadline_get(&key, member).await
    }

    /// Up to `limit` members of `index` whose deadline is at or before `now_ms`,
    /// earliest first. Listing does not remove them: the caller acts on each (in
    /// SQL, fenced) and then removes or moves its deadline.
    pub async fn deadline_due(&self, index: &str, now_ms: i64, limit: usize) -> Result<Vec<(String, i64)>, BusError> {
        let now_ms = now_ms.clamp(-MAX_DEADLINE_MS, MAX_DEADLINE_MS);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let key = self.key("deadline", index);
        self.backend.deadline_due(&key, now_ms, limit).await
    }

    /// How many members `index` holds.
    pub async fn deadline_len(&self, index: &str) -> Result<u64, BusError> {
        let key = self.key("deadline", index);
        self.backend.deadline_len(&key).await
    }

    /// Counts one attempt against `key` and allows at most `limit` per `window`.
    ///
    /// The window is fixed, not sliding: it starts at the first attempt and
    /// resets `window` later, so a burst straddling the reset can see up to
    /// twice `limit` in one `window`. Refused attempts count too, but never
    /// extend the window.
    pub async fn rate_limit(&self, key: &str, limit: u32, window: Duration) -> Result<RateDecision, BusError> {
        if limit == 0 {
            return Err(BusError::InvalidInput { field: "limit", reason: "must be at least 1" });
        }
        check_duration("window", window)?;
        let key = self.key("rate", key);
        self.backend.rate_limit(&key, limit, window).await
    }

    /// The cached value at `key`, unless absent or expired.
    pub async fn cache_get(&self, key: &str) -> Result<Option<Vec<u8>>, BusError> {
        let key = self.key("cache", key);
        self.backend.cache_get(&key).await
    }

    /// Caches `value` at `key` for `ttl`, replacing what was there.
    pub async fn cache_set(&self, key: &str, value: &[u8], ttl: Duration) -> Result<(), BusError> {
        check_duration("ttl", ttl)?;
        let key = self.key("cache", key);
        self.backend.cache_set(&key, value, ttl).await
    }

    /// Drops the cached value at `key`; whether there was one.
    pub async fn cache_delete(&self, key: &str) -> Result<bool, BusError> {
        let key = self.key("cache", key);
        self.backend.cache_delete(&key).await
    }

    /// Whether the bus kept its state since this handle last asked.
    ///
    /// The first call on an empty bus installs a random marker and returns
    /// [`Continuity::Fresh`]; later calls return [`Continuity::Continuous`] while
    /// the marker this handle saw is still there, and [`Continuity::Reset`] once it
    /// has vanished or been replaced (re-installing one). Services call this
    /// periodically and rebuild what they keep here whenever
    /// [`Continuity::needs_rebuild`] says so.
    pub async fn continuity(&self) -> Result<Continuity, BusError> {
        let key = format!("{}:{CONTINUITY_KEY}", self.prefix);
        let candidate = format!("{:032x}", rand::random::<u128>());
        let state = self.backend.marker_get_or_install(&key, &candidate).await?;
        let current = match &state {
            MarkerState::Installed => candidate.as_str(),
            MarkerState::Existing(value) => value.as_str(),
        };
        let mut seen = self.marker.lock().unwrap_or_else(PoisonError::into_inner);
        let continuity = match (seen.as_deref(), &state) {
            (None, MarkerState::Installed) => Continuity::Fresh,
            (None, MarkerState::Existing(_)) => Continuity::Continuous,
            (Some(previous), _) if previous == current => Continuity::Continuous,
            (Some(_), _) => Continuity::Reset,
        };
        *seen = Some(current.to_owned());
        Ok(continuity)
    }

    /// Answers when the bus is reachable; for readiness probes.
    pub async fn ping(&self) -> Result<(), BusError> {
        self.backend.ping().await
    }

    /// Deletes every key under this handle's prefix; how many there were.
    ///
    /// The effect is that of losing the bus for this service alone: the next
    /// [`continuity`](Self::continuity) says [`Continuity::Reset`] and the
    /// service rebuilds. Pub/sub subscriptions are not keys and stay.
    pub async fn clear(&self) -> Result<u64, BusError> {
        self.backend.clear(&self.prefix).await
    }

    fn key(&self, kind: &str, name: &str) -> String {
        format!("{}:{kind}:{name}", self.prefix)
    }
}

fn validate_prefix(prefix: &str) -> Result<(), BusError> {
    if prefix.is_empty() {
        return Err(BusError::config("prefix", prefix, "must not be empty"));
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if !prefix.chars().all(allowed) {
        return Err(BusError::config("prefix", prefix, "may hold only ASCII letters, digits, `.`, `_` and `-`"));
    }
    Ok(())
}

fn check_deadline(field: &'static str, at_ms: i64) -> Result<i64, BusError> {
    if (-MAX_DEADLINE_MS..=MAX_DEADLINE_MS).contains(&at_ms) {
        Ok(at_ms)
    } else {
        Err(BusError::InvalidInput { field, reason: "must be within ±2^53 milliseconds of the Unix epoch" })
    }
}

fn check_duration(field: &'static str, duration: Duration) -> Result<(), BusError> {
    if duration < Duration::from_millis(1) {
        return Err(BusError::InvalidInput { field, reason: "must be at least one millisecond" });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_that_could_overlap_or_glob_are_refused() {
        for bad in ["", "a:b", "a*", "svc?", "[x]", "a b", "é"] {
            let err = validate_prefix(bad).expect_err(bad);
            assert!(matches!(err, BusError::Config { setting: "prefix", .. }), "{bad}: {err}");
        }
        for good in ["identity", "berth-test-01", "a.b_c"] {
            validate_prefix(good).expect(good);
        }
    }

    #[test]
    fn deadlines_beyond_an_exact_double_are_refused() {
        assert!(check_deadline("at_ms", MAX_DEADLINE_MS).is_ok());
        assert!(check_deadline("at_ms", -MAX_DEADLINE_MS).is_ok());
        let err = check_deadline("at_ms", MAX_DEADLINE_MS + 1).expect_err("out of range");
        assert!(err.to_string().starts_with("invalid at_ms"), "{err}");
    }

    #[test]
    fn sub_millisecond_windows_are_refused() {
        assert!(check_duration("ttl", Duration::from_micros(999)).is_err());
        assert!(check_duration("ttl", Duration::from_millis(1)).is_ok());
    }

    #[test]
    fn handles_and_subscriptions_can_move_between_tasks() {
        fn shareable<T: Clone + Send + Sync + std::fmt::Debug + 'static>() {}
        fn movable<T: Send + 'static>() {}
        shareable::<Bus>();
        movable::<Subscription>();
        movable::<BusError>();
    }

    #[test]
    fn only_a_reset_or_a_fresh_bus_needs_a_rebuild() {
        assert!(Continuity::Fresh.needs_rebuild());
        assert!(Continuity::Reset.needs_rebuild());
        assert!(!Continuity::Continuous.needs_rebuild());
    }
}
