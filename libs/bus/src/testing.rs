//! Helpers for tests that run against the shared Redis or the in-process bus:
//! where Redis is, a prefix no other test uses, cleanup, and a relay that can
//! cut connections to simulate a Redis outage without touching the server.
//!
//! # Sharing one Redis
//! Tests on one server run in parallel: each takes a [`unique_prefix`] and
//! deletes its keys with [`cleanup`] (a `SCAN MATCH {prefix}:*` and `DEL`),
//! never `FLUSHALL` or `KEYS`.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::{Bus, BusError, MemoryBus};

/// The environment variable naming the Redis that tests use.
pub const REDIS_URL_VAR: &str = "BERTH_TEST_REDIS_URL";

/// Where tests find Redis when [`REDIS_URL_VAR`] is unset.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// The Redis URL tests use: [`REDIS_URL_VAR`], else [`DEFAULT_REDIS_URL`].
pub fn redis_url() -> String {
    std::env::var(REDIS_URL_VAR).unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned())
}

/// A key prefix no other test, in this process or another, is using.
pub fn unique_prefix() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("test-{}-{}-{:08x}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed), rand::random::<u32>())
}

/// A bus on the test Redis under a fresh [`unique_prefix`].
pub async fn redis_bus() -> Result<Bus, BusError> {
    Bus::connect(&redis_url(), &unique_prefix()).await
}

/// A new in-process bus under a fresh [`unique_prefix`].
pub fn memory_bus() -> Result<Bus, BusError> {
    Bus::new(MemoryBus::new(), &unique_prefix())
}

/// Deletes every key under the bus's prefix; how many there were.
pub async fn cleanup(bus: &Bus) -> Result<u64, BusError> {
    bus.clear().await
}

/// A TCP relay in front of a server, through which a test can cut every live
/// connection or refuse new ones, as a network fault or a restart would,
/// without disturbing other tests on the same server.
#[derive(Debug)]
pub struct TcpRelay {
    local: SocketAddr,
    url: String,
    control: Arc<RelayControl>,
    accepting: JoinHandle<()>,
}

#[derive(Debug)]
struct RelayControl {
    /// While set, new connections are closed as soon as they are accepted.
    refusing: AtomicBool,
    /// Bumped to close every connection relayed so far.
    cuts: watch::Sender<u64>,
}

impl TcpRelay {
    /// A relay in front of the server a `redis://` URL names; [`url`](Self::url)
    /// is the same URL (credentials, database and all) pointing at the relay.
    pub async fn in_front_of(url: &str) -> io::Result<Self> {
        let invalid = || io::Error::new(io::ErrorKind::InvalidInput, "expected scheme://host:port");
        let (scheme, after_scheme) = url.split_once("://").ok_or_else(invalid)?;
        let authority_end = after_scheme.find('/').unwrap_or(after_scheme.len());
        let (authority, path) = after_scheme.split_at(authority_end);
        let (userinfo, host_port) = match authority.rfind('@') {
            Some(at) => authority.split_at(at + 1),
            None => ("", authority),
        };
        if host_port.is_empty() {
            return Err(invalid());
        }
        let has_port = host_port
            .rsplit_once(':')
            .is_some_and(|(_, port)| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()));
        let target = if has_port { host_port.to_owned() } else { format!("{host_port}:6379") };
        let mut relay = Self::start(&target).await?;
        relay.url = format!("{scheme}://{userinfo}{}{path}", relay.local);
        Ok(relay)
    }

    /// Listens on an ephemeral loopback port and relays each connection to `target` (`host:port`).
    pub async fn start(target: &str) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let local = listener.local_addr()?;
        let control = Arc::new(RelayControl { refusing: AtomicBool::new(false), cuts: watch::channel(0).0 });
        let accepting = tokio::spawn(relay(listener, target.to_owned(), Arc::clone(&control)));
        Ok(Self { local, url: format!("redis://{local}"), control, accepting })
    }

    /// The address clients dial instead of the server's.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The URL that reaches the server through the relay.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Closes every connection relayed so far; new ones are still relayed.
    pub fn cut(&self) {
        self.control.cuts.send_modify(|cuts| *cuts += 1);
    }

    /// While `refusing`, every new connection is closed at once, as by a server that is down.
    pub fn set_refusing(&self, refusing: bool) {
        self.control.refusing.store(refusing, Ordering::SeqCst);
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every relayed connection.
        self.accepting.abort();
    }
}

async fn relay(listener: TcpListener, target: String, control: Arc<RelayControl>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((mut client, _)) = listener.accept().await else {
            // Out of descriptors or similar: pause rather than spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        // Reap finished connections so the set does not grow without bound.
        while connections.try_join_next().is_some() {}
        if control.refusing.load(Ordering::SeqCst) {
            drop(client);
            continue;
        }
        let mut cut = control.cuts.subscribe();
        let target = target.clone();
        connections.spawn(async move {
            let Ok(mut server) = TcpStream::connect(&target).await else {
                return;
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                _ = cut.changed() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_relay_url_keeps_everything_but_the_address() {
        let relay = TcpRelay::in_front_of("redis://:secret@127.0.0.1:6379/2").await.unwrap();
        assert_eq!(relay.url(), format!("redis://:secret@{}/2", relay.local_addr()));
        let relay = TcpRelay::in_front_of("redis://localhost").await.unwrap();
        assert_eq!(relay.url(), format!("redis://{}", relay.local_addr()));
        assert!(TcpRelay::in_front_of("localhost:6379").await.is_err());
    }

    #[test]
    fn unique_prefixes_differ_and_are_valid_prefixes() {
        let a = unique_prefix();
        let b = unique_prefix();
        assert_ne!(a, b);
        assert!(Bus::new(MemoryBus::new(), &a).is_ok(), "{a}");
    }
}
