//! Start-up against a database that is not there yet: a service waits for
//! it instead of exiting, comes up once it appears, and stops waiting when
//! told to stop.

#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

use std::net::SocketAddr;
use std::time::Duration;

use berth_runtime::{StartError, wait_for_store};
use berth_store::testing::{TestPg, pg_url};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A loopback address nothing listens on (yet).
fn vacant_addr() -> SocketAddr {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap()
}

/// The test PostgreSQL's `host:port`.
fn pg_addr() -> String {
    pg_url().split_once('@').unwrap().1.split_once('/').unwrap().0.to_owned()
}

/// The test PostgreSQL's URL, dialled at `addr` instead.
fn url_at(addr: SocketAddr) -> String {
    pg_url().replacen(&pg_addr(), &addr.to_string(), 1)
}

/// Forwards every connection on `listener` to the test PostgreSQL: the
/// database "appearing" at its address.
async fn forward(listener: TcpListener) {
    let target = pg_addr();
    while let Ok((mut inbound, _)) = listener.accept().await {
        let target = target.clone();
        tokio::spawn(async move {
            if let Ok(mut outbound) = TcpStream::connect(&target).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

#[tokio::test]
async fn a_service_started_before_its_database_waits_and_comes_up_with_it() {
    let db = TestPg::new().await.unwrap();
    let addr = vacant_addr();
    let stop = CancellationToken::new();
    let opening = tokio::spawn({
        let (url, schema, stop) = (url_at(addr), db.schema().to_owned(), stop.clone());
        async move { wait_for_store(&url, &schema, &[], &stop).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!opening.is_finished(), "it gave up on a database that was not there yet");

    let forwarder = tokio::spawn(forward(TcpListener::bind(addr).await.unwrap()));
    let store = tokio::time::timeout(Duration::from_secs(30), opening)
        .await
        .expect("it never came up once the database was there")
        .unwrap()
        .unwrap();
    store.ping().await.unwrap();
    assert_eq!(store.schema(), db.schema());
    drop(store);
    forwarder.abort();
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_stop_ends_the_wait_and_a_bad_url_fails_at_once() {
    let stop = CancellationToken::new();
    let waiting = tokio::spawn({
        let (url, stop) = (url_at(vacant_addr()), stop.clone());
        async move { wait_for_store(&url, "never_there", &[], &stop).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(30), waiting).await.unwrap().unwrap().unwrap_err();
    assert!(stopped.to_string().contains("stopped while waiting for the database"), "{stopped}");

    // Not a database being away: nothing to wait for.
    let refused = tokio::time::timeout(
        Duration::from_secs(5),
        wait_for_store("mysql://127.0.0.1/x", "x", &[], &CancellationToken::new()),
    )
    .await
    .expect("a bad URL is refused at once")
    .unwrap_err();
    assert!(matches!(refused, StartError::Store(_)), "{refused}");
    assert!(refused.to_string().contains("postgres://"), "{refused}");
}
