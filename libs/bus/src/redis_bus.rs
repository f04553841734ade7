//! The Redis bus: commands on a self-reconnecting multiplexed connection,
//! pub/sub on a dedicated connection owned by its own task.
//!
//! # Connections
//! Commands go through a `redis::aio::ConnectionManager`, which replaces a
//! dropped connection by itself; a command caught by the drop fails with
//! [`BusError::Unavailable`] and the next one runs on the new connection.
//! Every command is bounded by [`RedisTimings::command_timeout`] on top of the
//! driver's own timeouts, so a black-holed server never stalls a caller.
//! Pub/sub cannot share that connection (a subscribed RESP2 connection takes no
//! other commands), so [`crate::redis_pubsub`] keeps its own.
//!
//! # Atomicity
//! The rate limiter and the continuity marker are Lua scripts, so concurrent
//! replicas never interleave their read and write. A deadline rebuild is one
//! pipelined round trip of `ZADD`s, not a transaction: a reader may see part of
//! it, which is no worse than the index it is replacing.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, RedisResult, Script};

use crate::BusError;
use crate::backend::{BusBackend, BusFuture, MarkerState, RateDecision, Subscription};
use crate::redis_calls::{RedisTimings, bounded};
use crate::redis_pubsub::PubSubHandle;

/// How many `ZADD` pairs one command of a rebuild carries; keeps each command small
/// enough that Redis never blocks other clients on it for long.
const DEADLINE_BATCH: usize = 1000;

/// How many times the command connection retries a lost connection before
/// failing the waiting command; the next command starts over.
const RECONNECT_ATTEMPTS: usize = 2;

/// How many keys one `SCAN` step of [`BusBackend::clear`] asks for.
const SCAN_COUNT: usize = 500;

/// Counts an attempt in a fixed window: the first attempt starts the window's expiry.
/// KEYS[1] = counter, ARGV[1] = window in ms. Returns `{count, ms until reset}`.
const RATE_LIMIT_SCRIPT: &str = r"
local count = redis.call('INCR', KEYS[1])
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  ttl = tonumber(ARGV[1])
end
return {count, ttl}
";

/// Reads the continuity marker, installing the candidate if there is none.
/// KEYS[1] = marker, ARGV[1] = candidate. Returns `{installed (0/1), value}`.
const MARKER_SCRIPT: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  return {0, current}
end
redis.call('SET', KEYS[1], ARGV[1])
return {1, ARGV[1]}
";

/// The Redis [`BusBackend`].
pub struct RedisBus {
    address: String,
    commands: ConnectionManager,
    pubsub: PubSubHandle,
    timings: RedisTimings,
    rate_limit_script: Script,
    marker_script: Script,
}

impl RedisBus {
    /// Connects to `url` (`redis://` or `rediss://`) with the default [`RedisTimings`].
    pub async fn connect(url: &str) -> Result<Self, BusError> {
        Self::connect_with(url, RedisTimings::default()).await
    }

    /// Connects to `url`, failing with [`BusError::Unavailable`] after one attempt
    /// of at most `timings.connect_timeout` when nothing answers there.
    pub async fn connect_with(url: &str, timings: RedisTimings) -> Result<Self, BusError> {
        let client =
            Client::open(url).map_err(|err| BusError::config("url", url, format!("not a usable redis url ({err})")))?;
        let address = client.get_connection_info().addr().to_string();

        // The pub/sub connection comes first: one bounded attempt, so an
        // unreachable server is reported at once rather than after the
        // command connection's retries.
        let pubsub = PubSubHandle::start(client.clone(), address.clone(), timings.clone()).await?;

        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timings.connect_timeout))
            .set_response_timeout(Some(timings.command_timeout))
            .set_number_of_retries(RECONNECT_ATTEMPTS)
            .set_min_delay(timings.reconnect_backoff_min)
            .set_max_delay(timings.reconnect_backoff_max);
        let commands =
            bounded(&address, "connect", timings.connect_timeout, ConnectionManager::new_with_config(client, config))
                .await?;

        Ok(Self {
            address,
            commands,
            pubsub,
            timings,
            rate_limit_script: Script::new(RATE_LIMIT_SCRIPT),
            marker_script: Script::new(MARKER_SCRIPT),
        })
    }

    /// The `host:port` this bus talks to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Runs one command (or pipeline, or script) on the command connection.
    async fn run<T, F, Fut>(&self, operation: &'static str, command: F) -> Result<T, BusError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        bounded(&self.address, operation, self.timings.command_timeout, command(self.commands.clone())).await
    }
}

impl fmt::Debug for RedisBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBus")
            .field("address", &self.address)
            .field("timings", &self.timings)
            .finish_non_exhaustive()
    }
}

impl BusBackend for RedisBus {
    fn publish<'a>(&'a self, channel: &'a str, payload: Bytes) -> BusFuture<'a, ()> {
        Box::pin(self.run("publish", move |mut conn| async move {
            redis::cmd("PUBLISH").arg(channel).arg(payload.as_ref()).exec_async(&mut conn).await
        }))
    }

    fn subscribe<'a>(&'a self, channel: &'a str) -> BusFuture<'a, Subscription> {
        Box::pin(self.pubsub.subscribe(channel))
    }

    fn deadline_set_many<'a>(&'a self, key: &'a str, entries: &'a [(&'a str, i64)]) -> BusFuture<'a, ()> {
        Box::pin(self.run("deadline_set", move |mut conn| async move {
            let mut pipeline = redis::pipe();
            for batch in entries.chunks(DEADLINE_BATCH) {
                let command = pipeline.cmd("ZADD").arg(key);
                for (member, at_ms) in batch {
                    command.arg(*at_ms).arg(*member);
                }
                command.ignore();
            }
            pipeline.exec_async(&mut conn).await
        }))
    }

    fn deadline_remove<'a>(&'a self, key: &'a str, member: &'a str) -> BusFuture<'a, bool> {
        Box::pin(self.run("deadline_remove", move |mut conn| async move {
            let removed: u64 = redis::cmd("ZREM").arg(key).arg(member).query_async(&mut conn).await?;
            Ok(removed > 0)
        }))
    }

    fn deadline_get<'a>(&'a self, key: &'a str, member: &'a str) -> BusFuture<'a, Option<i64>> {
        Box::pin(self.run("deadline_get", move |mut conn| async move {
            let score: Option<f64> = redis::cmd("ZSCORE").arg(key).arg(member).query_async(&mut conn).await?;
            Ok(score.map(score_to_ms))
        }))
    }

    fn deadline_due<'a>(&'a self, key: &'a str, now_ms: i64, limit: usize) -> BusFuture<'a, Vec<(String, i64)>> {
        Box::pin(self.run("deadline_due", move |mut conn| async move {
            let due: Vec<(String, f64)> = redis::cmd("ZRANGEBYSCORE")
                .arg(key)
                .arg("-inf")
                .arg(now_ms)
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query_async(&mut conn)
                .await?;
            Ok(due.into_iter().map(|(member, score)| (member, score_to_ms(score))).collect())
        }))
    }

    fn deadline_len<'a>(&'a self, key: &'a str) -> BusFuture<'a, u64> {
        Box::pin(self.run("deadline_len", move |mut conn| async move {
            redis::cmd("ZCARD").arg(key).query_async(&mut conn).await
        }))
    }

    fn rate_limit<'a>(&'a self, key: &'a str, limit: u32, window: Duration) -> BusFuture<'a, RateDecision> {
        Box::pin(self.run("rate_limit", move |mut conn| async move {
            let mut invocation = self.rate_limit_script.key(key);
            invocation.arg(millis(window));
            let (count, reset_in_ms): (u64, i64) = invocation.invoke_async(&mut conn).await?;
            let limit = u64::from(limit);
            let allowed = count <= limit;
            Ok(RateDecision {
                allowed,
                remaining: u32::try_from(limit.saturating_sub(count)).unwrap_or(u32::MAX),
                retry_after: if allowed {
                    Duration::ZERO
                } else {
                    // A window in its last millisecond still has to be waited out.
                    Duration::from_millis(u64::try_from(reset_in_ms).unwrap_or(0).max(1))
                },
            })
        }))
    }

    fn cache_get<'a>(&'a self, key: &'a str) -> BusFuture<'a, Option<Vec<u8>>> {
        Box::pin(
            self.run(
                "cache_get",
                move |mut conn| async move { redis::cmd("GET").arg(key).query_async(&mut conn).await },
            ),
        )
    }

    fn cache_set<'a>(&'a self, key: &'a str, value: &'a [u8], ttl: Duration) -> BusFuture<'a, ()> {
        Box::pin(self.run("cache_set", move |mut conn| async move {
            redis::cmd("SET").arg(key).arg(value).arg("PX").arg(millis(ttl)).exec_async(&mut conn).await
        }))
    }

    fn cache_delete<'a>(&'a self, key: &'a str) -> BusFuture<'a, bool> {
        Box::pin(self.run("cache_delete", move |mut conn| async move {
            let deleted: u64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await?;
            Ok(deleted > 0)
        }))
    }

    fn marker_get_or_install<'a>(&'a self, key: &'a str, candidate: &'a str) -> BusFuture<'a, MarkerState> {
        Box::pin(self.run("continuity", move |mut conn| async move {
            let mut invocation = self.marker_script.key(key);
            invocation.arg(candidate);
            let (installed, value): (i64, String) = invocation.invoke_async(&mut conn).await?;
            Ok(if installed == 1 { MarkerState::Installed } else { MarkerState::Existing(value) })
        }))
    }

    fn ping(&self) -> BusFuture<'_, ()> {
        Box::pin(self.run("ping", |mut conn| async move { redis::cmd("PING").exec_async(&mut conn).await }))
    }

    fn clear<'a>(&'a self, prefix: &'a str) -> BusFuture<'a, u64> {
        Box::pin(async move {
            let pattern = format!("{}:*", escape_glob(prefix));
            let mut cursor = 0_u64;
            let mut deleted = 0_u64;
            loop {
                let pattern = pattern.as_str();
                let (next, keys): (u64, Vec<String>) = self
                    .run("clear", move |mut conn| async move {
                        redis::cmd("SCAN")
                            .arg(cursor)
                            .arg("MATCH")
                            .arg(pattern)
                            .arg("COUNT")
                            .arg(SCAN_COUNT)
                            .query_async(&mut conn)
                            .await
                    })
                    .await?;
                if !keys.is_empty() {
                    let keys = &keys;
                    deleted += self
                        .run("clear", move |mut conn| async move {
                            redis::cmd("DEL").arg(keys).query_async::<u64>(&mut conn).await
                        })
                        .await?;
                }
                if next == 0 {
                    return Ok(deleted);
                }
                cursor = next;
            }
        })
    }
}

/// Scores are written as integers within ±2^53, so they read back exactly.
fn score_to_ms(score: f64) -> i64 {
    score as i64
}

/// Whole milliseconds of a duration the handle has already checked to be at least 1 ms.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Makes `text` match itself literally in a `SCAN MATCH` pattern.
fn escape_glob(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_characters_in_a_prefix_match_only_themselves() {
        assert_eq!(escape_glob("svc-1.a_b"), "svc-1.a_b");
        assert_eq!(escape_glob(r"a*b?[c]\"), r"a\*b\?\[c\]\\");
    }
}
