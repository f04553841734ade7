//! The contract every bus backend keeps, written once and run against the
//! shared Redis (`mod redis`) and the in-process bus (`mod memory`).
//!
//! Each case gets its buses from a [`Harness`], which gives every bus a unique
//! prefix and deletes its keys afterwards, even when the case fails.

#![cfg(test)]

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_bus::testing::{redis_url, unique_prefix};
use berth_bus::{Bus, BusError, BusMessage, Continuity, MAX_DEADLINE_MS, Subscription};
use futures::FutureExt;

/// How long a message may take to arrive before the case fails.
const DELIVERY: Duration = Duration::from_secs(3);

/// How long a subscriber must stay quiet to count as having received nothing.
const QUIET: Duration = Duration::from_millis(300);

#[derive(Clone, Copy, Debug)]
enum Server {
    Redis,
    Memory,
}

/// Hands out buses on one server and remembers them for cleanup.
#[derive(Clone)]
struct Harness {
    server: Server,
    /// For the in-process server: the bus whose store every handle shares.
    memory_root: Option<Bus>,
    created: Arc<Mutex<Vec<Bus>>>,
}

impl Harness {
    fn new(server: Server) -> Self {
        let memory_root = match server {
            Server::Redis => None,
            Server::Memory => Some(berth_bus::testing::memory_bus().unwrap()),
        };
        Self { server, memory_root, created: Arc::default() }
    }

    /// A bus under a prefix of its own, as a separate service would have.
    async fn bus(&self) -> Bus {
        self.open(&unique_prefix()).await
    }

    /// Another replica of `bus`'s service: the same prefix through its own handle
    /// (and, on Redis, its own connections).
    async fn replica(&self, bus: &Bus) -> Bus {
        self.open(bus.prefix()).await
    }

    async fn open(&self, prefix: &str) -> Bus {
        let bus = match (self.server, &self.memory_root) {
            (Server::Memory, Some(root)) => root.with_prefix(prefix).unwrap(),
            _ => Bus::connect(&redis_url(), prefix).await.unwrap(),
        };
        self.created.lock().unwrap().push(bus.clone());
        bus
    }

    async fn cleanup(&self) {
        let created = std::mem::take(&mut *self.created.lock().unwrap());
        for bus in created {
            bus.clear().await.unwrap();
        }
    }
}

/// Runs one case on `server`, cleaning up its keys whether or not it passes.
async fn run<F, Fut>(server: Server, case: F)
where
    F: FnOnce(Harness) -> Fut,
    Fut: Future<Output = ()>,
{
    let harness = Harness::new(server);
    let outcome = AssertUnwindSafe(case(harness.clone())).catch_unwind().await;
    harness.cleanup().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

macro_rules! contract_suite {
    ($($case:ident),* $(,)?) => {
        mod redis {
            $(
                #[tokio::test]
                async fn $case() {
                    super::run(super::Server::Redis, super::cases::$case).await;
                }
            )*
        }
        mod memory {
            $(
                #[tokio::test]
                async fn $case() {
                    super::run(super::Server::Memory, super::cases::$case).await;
                }
            )*
        }
    };
}

contract_suite!(
    publish_reaches_every_subscriber_of_its_topic_in_order,
    a_subscription_sees_only_what_is_published_after_it,
    dropping_a_subscription_leaves_the_others_receiving,
    prefixes_isolate_buses_on_one_server,
    deadlines_can_be_set_read_moved_and_removed,
    due_lists_only_expired_members_earliest_first_within_the_limit,
    set_many_upserts_every_entry_at_once,
    deadlines_keep_full_millisecond_precision,
    rate_limiter_allows_exactly_the_limit_per_window,
    rate_limits_are_counted_per_key,
    cache_values_expire_and_can_be_deleted,
    continuity_is_fresh_then_continuous_and_reset_after_the_keys_vanish,
    bad_arguments_are_refused_naming_the_field,
    ping_answers,
);

fn payload(bytes: &[u8]) -> BusMessage {
    BusMessage::Payload(bytes.to_vec().into())
}

async fn next(subscription: &mut Subscription) -> BusMessage {
    tokio::time::timeout(DELIVERY, subscription.recv())
        .await
        .expect("a message within the delivery time")
        .expect("the subscription to stay open")
}

async fn assert_quiet(subscription: &mut Subscription) {
    if let Ok(message) = tokio::time::timeout(QUIET, subscription.recv()).await {
        panic!("expected no message, got {message:?}");
    }
}

mod cases {
    use super::*;

    pub(super) async fn publish_reaches_every_subscriber_of_its_topic_in_order(h: Harness) {
        let bus = h.bus().await;
        let replica = h.replica(&bus).await;
        let mut first = bus.subscribe("events").await.unwrap();
        let mut second = bus.subscribe("events").await.unwrap();
        let mut on_replica = replica.subscribe("events").await.unwrap();
        let mut other_topic = bus.subscribe("other").await.unwrap();

        for i in 0..50_u32 {
            bus.publish("events", i.to_be_bytes().to_vec()).await.unwrap();
        }
        bus.publish("other", b"elsewhere".to_vec()).await.unwrap();

        for subscriber in [&mut first, &mut second, &mut on_replica] {
            for i in 0..50_u32 {
                assert_eq!(next(subscriber).await, payload(&i.to_be_bytes()));
            }
        }
        assert_eq!(next(&mut other_topic).await, payload(b"elsewhere"));
        assert_quiet(&mut first).await;
        assert_quiet(&mut other_topic).await;
    }

    pub(super) async fn a_subscription_sees_only_what_is_published_after_it(h: Harness) {
        let bus = h.bus().await;
        bus.publish("events", b"before".to_vec()).await.unwrap();
        let mut late = bus.subscribe("events").await.unwrap();
        bus.publish("events", b"after".to_vec()).await.unwrap();
        assert_eq!(next(&mut late).await, payload(b"after"));
        assert_quiet(&mut late).await;
    }

    pub(super) async fn dropping_a_subscription_leaves_the_others_receiving(h: Harness) {
        let bus = h.bus().await;
        let leaving = bus.subscribe("events").await.unwrap();
        let mut staying = bus.subscribe("events").await.unwrap();
        drop(leaving);
        // Let the release reach whatever tracks subscribers before publishing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        bus.publish("events", b"still here".to_vec()).await.unwrap();
        assert_eq!(next(&mut staying).await, payload(b"still here"));

        drop(staying);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut again = bus.subscribe("events").await.unwrap();
        bus.publish("events", b"resubscribed".to_vec()).await.unwrap();
        assert_eq!(next(&mut again).await, payload(b"resubscribed"));
    }

    pub(super) async fn prefixes_isolate_buses_on_one_server(h: Harness) {
        let a = h.bus().await;
        let b = h.bus().await;

        let mut on_a = a.subscribe("events").await.unwrap();
        let mut on_b = b.subscribe("events").await.unwrap();
        a.publish("events", b"for a".to_vec()).await.unwrap();
        assert_eq!(next(&mut on_a).await, payload(b"for a"));
        assert_quiet(&mut on_b).await;

        a.deadline_set("nodes", "n1", 100).await.unwrap();
        assert_eq!(b.deadline_get("nodes", "n1").await.unwrap(), None);
        assert_eq!(b.deadline_len("nodes").await.unwrap(), 0);
        assert!(b.deadline_due("nodes", i64::MAX, 10).await.unwrap().is_empty());

        a.cache_set("k", b"a-value", Duration::from_secs(30)).await.unwrap();
        assert_eq!(b.cache_get("k").await.unwrap(), None);
        b.cache_set("k", b"b-value", Duration::from_secs(30)).await.unwrap();
        assert_eq!(a.cache_get("k").await.unwrap(), Some(b"a-value".to_vec()));

        let window = Duration::from_secs(30);
        assert!(a.rate_limit("join", 1, window).await.unwrap().allowed);
        assert!(b.rate_limit("join", 1, window).await.unwrap().allowed);

        assert_eq!(a.continuity().await.unwrap(), Continuity::Fresh);
        assert_eq!(b.continuity().await.unwrap(), Continuity::Fresh);

        // Losing b's keys leaves a's alone.
        assert_eq!(b.clear().await.unwrap(), 3);
        assert_eq!(a.cache_get("k").await.unwrap(), Some(b"a-value".to_vec()));
        assert_eq!(a.deadline_len("nodes").await.unwrap(), 1);
        assert!(!a.rate_limit("join", 1, window).await.unwrap().allowed);
        assert_eq!(a.continuity().await.unwrap(), Continuity::Continuous);
        assert_eq!(b.continuity().await.unwrap(), Continuity::Reset);
    }

    pub(super) async fn deadlines_can_be_set_read_moved_and_removed(h: Harness) {
        let bus = h.bus().await;
        assert_eq!(bus.deadline_get("nodes", "n1").await.unwrap(), None);

        bus.deadline_set("nodes", "n1", 1_000).await.unwrap();
        bus.deadline_set("nodes", "n2", 2_000).await.unwrap();
        assert_eq!(bus.deadline_get("nodes", "n1").await.unwrap(), Some(1_000));
        assert_eq!(bus.deadline_len("nodes").await.unwrap(), 2);

        // Setting again moves the deadline rather than adding a member.
        bus.deadline_set("nodes", "n1", 5_000).await.unwrap();
        assert_eq!(bus.deadline_get("nodes", "n1").await.unwrap(), Some(5_000));
        assert_eq!(bus.deadline_len("nodes").await.unwrap(), 2);
        assert_eq!(bus.deadline_due("nodes", 3_000, 10).await.unwrap(), vec![("n2".to_owned(), 2_000)]);

        assert!(bus.deadline_remove("nodes", "n1").await.unwrap());
        assert!(!bus.deadline_remove("nodes", "n1").await.unwrap());
        assert_eq!(bus.deadline_get("nodes", "n1").await.unwrap(), None);
        assert_eq!(bus.deadline_len("nodes").await.unwrap(), 1);

        // Indexes are independent of each other.
        assert_eq!(bus.deadline_len("leases").await.unwrap(), 0);
        assert!(!bus.deadline_remove("leases", "n2").await.unwrap());
    }

    pub(super) async fn due_lists_only_expired_members_earliest_first_within_the_limit(h: Harness) {
        let bus = h.bus().await;
        for (member, at_ms) in [("c", 300), ("a", 100), ("e", 200), ("b", 200), ("d", 400)] {
            bus.deadline_set("leases", member, at_ms).await.unwrap();
        }
        let due = |pairs: &[(&str, i64)]| -> Vec<(String, i64)> {
            pairs.iter().map(|(m, t)| ((*m).to_owned(), *t)).collect()
        };

        // Equal deadlines come in member order.
        assert_eq!(bus.deadline_due("leases", 250, 10).await.unwrap(), due(&[("a", 100), ("b", 200), ("e", 200)]));
        assert_eq!(bus.deadline_due("leases", 250, 2).await.unwrap(), due(&[("a", 100), ("b", 200)]));
        assert!(bus.deadline_due("leases", 99, 10).await.unwrap().is_empty());
        assert!(bus.deadline_due("leases", 1_000, 0).await.unwrap().is_empty());
        // A deadline equal to now is due.
        assert_eq!(bus.deadline_due("leases", 400, 10).await.unwrap().last(), Some(&("d".to_owned(), 400)));
        // Listing removes nothing.
        assert_eq!(bus.deadline_len("leases").await.unwrap(), 5);
    }

    pub(super) async fn set_many_upserts_every_entry_at_once(h: Harness) {
        let bus = h.bus().await;
        bus.deadline_set("nodes", "x", 9_000).await.unwrap();
        bus.deadline_set_many::<&str>("nodes", &[]).await.unwrap();
        bus.deadline_set_many("nodes", &[("x", 50), ("y", 60), ("z", 70)]).await.unwrap();
        assert_eq!(bus.deadline_get("nodes", "x").await.unwrap(), Some(50));
        assert_eq!(bus.deadline_len("nodes").await.unwrap(), 3);

        // A rebuild larger than one command's batch.
        let base = 1_760_000_000_000_i64;
        let rebuild: Vec<(String, i64)> = (0..2_500).map(|i| (format!("node-{i:05}"), base + i)).collect();
        bus.deadline_set_many("rebuilt", &rebuild).await.unwrap();
        assert_eq!(bus.deadline_len("rebuilt").await.unwrap(), 2_500);
        let due = bus.deadline_due("rebuilt", base + 2, 100).await.unwrap();
        assert_eq!(
            due,
            vec![
                ("node-00000".to_owned(), base),
                ("node-00001".to_owned(), base + 1),
                ("node-00002".to_owned(), base + 2),
            ]
        );
        assert_eq!(bus.deadline_get("rebuilt", "node-02499").await.unwrap(), Some(base + 2_499));
    }

    pub(super) async fn deadlines_keep_full_millisecond_precision(h: Harness) {
        let bus = h.bus().await;
        let entries = [
            ("max", MAX_DEADLINE_MS),
            ("min", -MAX_DEADLINE_MS),
            ("now", 1_760_000_000_123),
            ("next", 1_760_000_000_124),
        ];
        bus.deadline_set_many("edge", &entries).await.unwrap();
        for (member, at_ms) in entries {
            assert_eq!(bus.deadline_get("edge", member).await.unwrap(), Some(at_ms));
        }
        assert_eq!(
            bus.deadline_due("edge", 1_760_000_000_123, 10).await.unwrap(),
            vec![("min".to_owned(), -MAX_DEADLINE_MS), ("now".to_owned(), 1_760_000_000_123)]
        );
    }

    pub(super) async fn rate_limiter_allows_exactly_the_limit_per_window(h: Harness) {
        let bus = h.bus().await;
        let window = Duration::from_millis(400);
        for remaining in [2, 1, 0] {
            let decision = bus.rate_limit("join:10.0.0.1", 3, window).await.unwrap();
            assert!(decision.allowed, "{decision:?}");
            assert_eq!(decision.remaining, remaining);
            assert_eq!(decision.retry_after, Duration::ZERO);
        }
        let refused = bus.rate_limit("join:10.0.0.1", 3, window).await.unwrap();
        assert!(!refused.allowed);
        assert_eq!(refused.remaining, 0);
        assert!(refused.retry_after > Duration::ZERO && refused.retry_after <= window, "{refused:?}");
        // Refused attempts do not push the window's end further out.
        let again = bus.rate_limit("join:10.0.0.1", 3, window).await.unwrap();
        assert!(!again.allowed);
        assert!(again.retry_after <= refused.retry_after, "{again:?}");

        tokio::time::sleep(refused.retry_after + Duration::from_millis(50)).await;
        let next_window = bus.rate_limit("join:10.0.0.1", 3, window).await.unwrap();
        assert!(next_window.allowed, "{next_window:?}");
        assert_eq!(next_window.remaining, 2);
    }

    pub(super) async fn rate_limits_are_counted_per_key(h: Harness) {
        let bus = h.bus().await;
        let window = Duration::from_secs(30);
        assert!(bus.rate_limit("join:a", 1, window).await.unwrap().allowed);
        assert!(!bus.rate_limit("join:a", 1, window).await.unwrap().allowed);
        assert!(bus.rate_limit("join:b", 1, window).await.unwrap().allowed);
    }

    pub(super) async fn cache_values_expire_and_can_be_deleted(h: Harness) {
        let bus = h.bus().await;
        assert_eq!(bus.cache_get("digest").await.unwrap(), None);

        let long = Duration::from_secs(30);
        bus.cache_set("digest", b"v1", long).await.unwrap();
        assert_eq!(bus.cache_get("digest").await.unwrap(), Some(b"v1".to_vec()));
        bus.cache_set("digest", b"v2", long).await.unwrap();
        assert_eq!(bus.cache_get("digest").await.unwrap(), Some(b"v2".to_vec()));

        assert!(bus.cache_delete("digest").await.unwrap());
        assert_eq!(bus.cache_get("digest").await.unwrap(), None);
        assert!(!bus.cache_delete("digest").await.unwrap());

        let binary = [0_u8, 255, 0, 10, 13];
        bus.cache_set("binary", &binary, long).await.unwrap();
        assert_eq!(bus.cache_get("binary").await.unwrap(), Some(binary.to_vec()));

        bus.cache_set("short", b"x", Duration::from_millis(200)).await.unwrap();
        assert_eq!(bus.cache_get("short").await.unwrap(), Some(b"x".to_vec()));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(bus.cache_get("short").await.unwrap(), None);
        assert!(!bus.cache_delete("short").await.unwrap());
    }

    pub(super) async fn continuity_is_fresh_then_continuous_and_reset_after_the_keys_vanish(h: Harness) {
        let bus = h.bus().await;
        assert_eq!(bus.continuity().await.unwrap(), Continuity::Fresh);
        assert_eq!(bus.continuity().await.unwrap(), Continuity::Continuous);
        assert_eq!(bus.clone().continuity().await.unwrap(), Continuity::Continuous);

        // A replica starting later finds the state intact.
        let replica = h.replica(&bus).await;
        assert_eq!(replica.continuity().await.unwrap(), Continuity::Continuous);

        // What FLUSHALL would do to this service, without touching the shared server.
        bus.deadline_set("nodes", "n1", 1_000).await.unwrap();
        bus.clear().await.unwrap();
        assert_eq!(bus.deadline_len("nodes").await.unwrap(), 0);

        assert_eq!(bus.continuity().await.unwrap(), Continuity::Reset);
        assert_eq!(bus.continuity().await.unwrap(), Continuity::Continuous);
        // The replica sees that the marker it knew was replaced, not a peer's first install.
        assert_eq!(replica.continuity().await.unwrap(), Continuity::Reset);
        assert_eq!(replica.continuity().await.unwrap(), Continuity::Continuous);
    }

    pub(super) async fn bad_arguments_are_refused_naming_the_field(h: Harness) {
        let bus = h.bus().await;
        let field = |err: BusError| match err {
            BusError::InvalidInput { field, .. } => field,
            other => panic!("expected invalid input, got {other:?}"),
        };
        let window = Duration::from_secs(1);
        assert_eq!(field(bus.rate_limit("k", 0, window).await.unwrap_err()), "limit");
        assert_eq!(field(bus.rate_limit("k", 1, Duration::ZERO).await.unwrap_err()), "window");
        assert_eq!(field(bus.cache_set("k", b"v", Duration::ZERO).await.unwrap_err()), "ttl");
        assert_eq!(field(bus.deadline_set("nodes", "n1", MAX_DEADLINE_MS + 1).await.unwrap_err()), "at_ms");
        // A refused batch stores none of its entries.
        let batch = [("ok", 1), ("too-late", i64::MAX)];
        assert!(bus.deadline_set_many("nodes", &batch).await.is_err());
        assert_eq!(bus.deadline_len("nodes").await.unwrap(), 0);
    }

    pub(super) async fn ping_answers(h: Harness) {
        h.bus().await.ping().await.unwrap();
    }
}
