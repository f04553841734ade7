//! The Redis bus through connection loss: cut through a relay in front of the
//! shared server, so no other test's connections are touched.

#![cfg(test)]

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;

use berth_bus::testing::{TcpRelay, redis_url, unique_prefix};
use berth_bus::{Bus, BusMessage, Continuity, RedisBus, RedisTimings, Subscription};

/// Timings short enough that a lost connection is noticed and restored in well under a second.
fn quick() -> RedisTimings {
    RedisTimings {
        connect_timeout: Duration::from_millis(500),
        command_timeout: Duration::from_millis(500),
        keepalive_interval: Duration::from_millis(200),
        reconnect_backoff_min: Duration::from_millis(20),
        reconnect_backoff_max: Duration::from_millis(200),
    }
}

/// One service's view of Redis twice over: through a relay the case can cut,
/// and directly, under the same prefix.
struct Setup {
    relay: TcpRelay,
    relayed: Bus,
    direct: Bus,
}

/// Runs `case` on a fresh [`Setup`] and deletes its keys afterwards, even when it fails.
async fn run<F, Fut>(case: F)
where
    F: FnOnce(Arc<Setup>) -> Fut,
    Fut: Future<Output = ()>,
{
    let relay = TcpRelay::in_front_of(&redis_url()).await.unwrap();
    let prefix = unique_prefix();
    let relayed = Bus::new(RedisBus::connect_with(relay.url(), quick()).await.unwrap(), &prefix).unwrap();
    let direct = Bus::connect(&redis_url(), &prefix).await.unwrap();
    let setup = Arc::new(Setup { relay, relayed, direct: direct.clone() });
    let outcome = AssertUnwindSafe(case(setup)).catch_unwind().await;
    direct.clear().await.unwrap();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn next(subscription: &mut Subscription) -> BusMessage {
    tokio::time::timeout(Duration::from_secs(5), subscription.recv())
        .await
        .expect("a message within five seconds")
        .expect("the subscription to stay open")
}

/// Retries `ping` until it succeeds, for at most five seconds.
async fn until_reachable(bus: &Bus) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Err(err) = bus.ping().await {
        assert!(Instant::now() < deadline, "still unreachable: {err}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_cut_connection_yields_a_gap_then_delivery_resumes() {
    run(|setup| async move {
        let Setup { relay, relayed, direct } = &*setup;
        let mut events = relayed.subscribe("events").await.unwrap();

        direct.publish("events", b"before".to_vec()).await.unwrap();
        assert_eq!(next(&mut events).await, BusMessage::Payload("before".into()));

        relay.cut();
        // The gap arrives only once the subscription is live again, so anything
        // published after it is delivered.
        assert_eq!(next(&mut events).await, BusMessage::Gap);
        direct.publish("events", b"after".to_vec()).await.unwrap();
        assert_eq!(next(&mut events).await, BusMessage::Payload("after".into()));

        // The command connection recovers by itself too.
        until_reachable(relayed).await;
        relayed.publish("events", b"from relayed".to_vec()).await.unwrap();
        assert_eq!(next(&mut events).await, BusMessage::Payload("from relayed".into()));
    })
    .await;
}

#[tokio::test]
async fn while_redis_is_away_calls_fail_fast_and_subscribers_resume_after() {
    run(|setup| async move {
        let Setup { relay, relayed, direct } = &*setup;
        let mut events = relayed.subscribe("events").await.unwrap();

        relay.set_refusing(true);
        relay.cut();

        let started = Instant::now();
        let err = relayed.deadline_set("nodes", "n1", 1_000).await.expect_err("redis is away");
        assert!(err.is_unavailable(), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());

        // Once the task has noticed the loss, new subscriptions are refused rather than left hanging.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match relayed.subscribe("other").await {
                Err(err) => {
                    assert!(err.is_unavailable(), "{err:?}");
                    break;
                }
                Ok(_) => assert!(Instant::now() < deadline, "subscribe kept succeeding"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        relay.set_refusing(false);
        assert_eq!(next(&mut events).await, BusMessage::Gap);
        direct.publish("events", b"back".to_vec()).await.unwrap();
        assert_eq!(next(&mut events).await, BusMessage::Payload("back".into()));
        until_reachable(relayed).await;
        relayed.deadline_set("nodes", "n1", 1_000).await.unwrap();
        assert_eq!(direct.deadline_get("nodes", "n1").await.unwrap(), Some(1_000));
    })
    .await;
}

#[tokio::test]
async fn a_lost_connection_is_not_mistaken_for_lost_state() {
    run(|setup| async move {
        let Setup { relay, relayed, direct } = &*setup;
        assert_eq!(relayed.continuity().await.unwrap(), Continuity::Fresh);

        relay.cut();
        until_reachable(relayed).await;
        assert_eq!(relayed.continuity().await.unwrap(), Continuity::Continuous);

        // Whereas state deleted behind its back is.
        direct.clear().await.unwrap();
        assert_eq!(relayed.continuity().await.unwrap(), Continuity::Reset);
    })
    .await;
}
