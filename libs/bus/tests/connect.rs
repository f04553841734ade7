//! What `Bus::connect` does with each kind of URL, including ones that cannot work.

#![cfg(test)]

use std::time::{Duration, Instant};

use berth_bus::testing::unique_prefix;
use berth_bus::{Bus, BusError, Continuity, RedisBus, RedisTimings};
use tokio::net::TcpListener;

#[tokio::test]
async fn an_unreachable_redis_fails_fast_naming_the_address() {
    let started = Instant::now();
    let err = Bus::connect("redis://127.0.0.1:1", &unique_prefix()).await.expect_err("nothing listens on port 1");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(err.is_unavailable(), "{err:?}");
    assert_eq!(err.to_string(), "bus at 127.0.0.1:1 is unavailable");
    // The cause stays reachable for logs.
    assert!(std::error::Error::source(&err).is_some());
}

#[tokio::test]
async fn a_server_that_never_answers_is_given_up_on_after_the_connect_timeout() {
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = silent.local_addr().unwrap();
    // Accept connections and hold them open without ever replying.
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let timings = RedisTimings { connect_timeout: Duration::from_millis(300), ..RedisTimings::default() };

    let started = Instant::now();
    let result = RedisBus::connect_with(&format!("redis://{address}"), timings).await;
    let elapsed = started.elapsed();
    holder.abort();

    let err = result.expect_err("a silent server is not a bus");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(err.to_string().contains(&address.to_string()), "{err}");
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
}

#[tokio::test]
async fn urls_that_cannot_name_a_bus_are_configuration_errors() {
    for url in ["http://127.0.0.1:6379", "127.0.0.1:6379", "memory://elsewhere", "redis://:hunter2@[::1", ""] {
        let err = Bus::connect(url, "svc").await.expect_err(url);
        assert!(matches!(err, BusError::Config { setting: "url", .. }), "{url}: {err:?}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
}

#[tokio::test]
async fn a_prefix_that_could_collide_is_refused_before_connecting() {
    let err = Bus::connect("redis://127.0.0.1:1", "identity:v2").await.expect_err("a prefix with a colon");
    assert!(matches!(err, BusError::Config { setting: "prefix", .. }), "{err:?}");
}

#[tokio::test]
async fn memory_urls_need_nothing_running() {
    for url in ["memory://", "memory"] {
        let bus = Bus::connect(url, &unique_prefix()).await.expect(url);
        bus.ping().await.unwrap();
        assert_eq!(bus.continuity().await.unwrap(), Continuity::Fresh);
    }
}

#[tokio::test]
async fn each_memory_connection_is_a_new_empty_bus() {
    let first = Bus::connect("memory://", "svc").await.unwrap();
    first.cache_set("k", b"v", Duration::from_secs(30)).await.unwrap();
    let second = Bus::connect("memory://", "svc").await.unwrap();
    assert_eq!(second.cache_get("k").await.unwrap(), None);
    // Handles meant to share one in-process bus come from `with_prefix`.
    let shared = first.with_prefix("svc").unwrap();
    assert_eq!(shared.cache_get("k").await.unwrap(), Some(b"v".to_vec()));
}
