//! The mTLS client side: a tonic channel whose connections are made by a
//! connector that reads the client configuration from [`TlsCredentials`] on
//! every new connection, so a renewed certificate is presented from the
//! next reconnect on.
//!
//! # Header compression
//! Request headers whose value is new on every call ([`PER_CALL_HEADERS`]:
//! the trace context and the deadline) are sent as never-indexed literals.
//! Indexed, each call would add an entry to the connection's HPACK tables on
//! both ends, only to evict an older one: churn that no later call reuses,
//! and that a server holding thousands of agent connections pays in memory
//! on every one of them (up to its 4 KiB table of entries per connection).

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use berth_mtls::TlsCredentials;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tonic::transport::{Endpoint, Uri};

/// How long dialling a peer may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How often an idle connection is pinged.
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);

/// How many streams this side reset h2 remembers at once (for a second
/// each). A frame the server sent before it saw a reset is ignored while
/// its stream is remembered; on a forgotten one it counts toward the 1024
/// after which h2 closes the connection with every call on it. h2's own 50
/// is a burst a router dropping tunnels reaches.
pub(crate) const RESETS_REMEMBERED: usize = 4096;

/// Request headers never entered into HPACK's dynamic tables: their value
/// changes on every call (W3C trace context, the gRPC deadline).
pub const PER_CALL_HEADERS: [&str; 3] = ["traceparent", "tracestate", "grpc-timeout"];

/// A channel to a berth server, traced on every call.
pub type Channel = berth_telemetry::ClientTraceService<UnindexedPerCallHeaders<tonic::transport::Channel>>;

/// A channel that sends [`PER_CALL_HEADERS`] as never-indexed literals.
#[derive(Debug, Clone)]
pub struct UnindexedPerCallHeaders<S> {
    inner: S,
}

impl<S, B> tower_service::Service<http::Request<B>> for UnindexedPerCallHeaders<S>
where
    S: tower_service::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        mark_per_call_headers(request.headers_mut());
        self.inner.call(request)
    }
}

/// Marks the per-call headers in `headers` sensitive, which HPACK encodes
/// as never-indexed literals.
fn mark_per_call_headers(headers: &mut http::HeaderMap) {
    for name in PER_CALL_HEADERS {
        if let http::header::Entry::Occupied(mut entry) = headers.entry(name) {
            for value in entry.iter_mut() {
                value.set_sensitive(true);
            }
        }
    }
}

/// Why a channel could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is not `host:port` or `https://host:port`.
    #[error("invalid server address '{addr}': {reason}")]
    Address {
        /// What was given.
        addr: String,
        /// Why it is not usable.
        reason: String,
    },
    /// The CA bundle could not be loaded.
    #[error(transparent)]
    Tls(#[from] berth_mtls::MtlsError),
}

/// A channel to `addr` presenting `credentials`; it connects on first use and
/// reconnects by itself.
pub fn connect(addr: &str, credentials: TlsCredentials) -> Result<Channel, ClientError> {
    channel(addr, ConfigSource::Credentials(credentials))
}

/// A channel to one address that follows its credentials: once they are
/// reloaded (a renewed certificate), the next call makes a fresh connection
/// presenting the new material. A healthy connection is otherwise kept for
/// ever, and servers refuse a node certificate a renewal superseded.
pub struct FollowingChannel {
    addr: String,
    credentials: TlsCredentials,
    /// The credentials' generation the channel was made at, and the channel.
    current: std::sync::Mutex<(u64, Channel)>,
}

impl std::fmt::Debug for FollowingChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FollowingChannel").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl FollowingChannel {
    /// A channel to `addr` (`host:port`) presenting `credentials`.
    pub fn new(addr: &str, credentials: TlsCredentials) -> Result<Self, ClientError> {
        let generation = credentials.generation();
        let channel = connect(addr, credentials.clone())?;
        Ok(Self { addr: addr.to_string(), credentials, current: std::sync::Mutex::new((generation, channel)) })
    }

    /// The address it dials.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The channel for the next call: a fresh one when the credentials
    /// changed since the current one was made.
    pub fn channel(&self) -> Channel {
        let generation = self.credentials.generation();
        let mut current = self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.0 != generation {
            match connect(&self.addr, self.credentials.clone()) {
                Ok(channel) => *current = (generation, channel),
                Err(error) => {
                    tracing::warn!(addr = %self.addr, %error, "cannot rebuild a channel; keeping the current one")
                }
            }
        }
        current.1.clone()
    }

    /// Drops the current connection: the next call makes a fresh one.
    pub fn reconnect(&self) {
        match connect(&self.addr, self.credentials.clone()) {
            Ok(channel) => {
                *self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    (self.credentials.generation(), channel);
            }
            Err(error) => {
                tracing::warn!(addr = %self.addr, %error, "cannot rebuild a channel; keeping the current one")
            }
        }
    }
}

/// A channel to `addr` that presents no certificate and verifies the server
/// against `ca_bundle_pem`: what a host uses to join.
pub fn connect_anonymous(addr: &str, ca_bundle_pem: &str) -> Result<Channel, ClientError> {
    let config = berth_mtls::anonymous_client_config(ca_bundle_pem)?;
    channel(addr, ConfigSource::Fixed(config))
}

fn channel(addr: &str, config: ConfigSource) -> Result<Channel, ClientError> {
    let uri = if addr.contains("://") { addr.to_string() } else { format!("https://{addr}") };
    let bad = |reason: String| ClientError::Address { addr: addr.to_string(), reason };
    let endpoint = Endpoint::from_shared(uri)
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_while_idle(true)
        .http2_max_concurrent_reset_streams(RESETS_REMEMBERED);
    let host = endpoint.uri().host().unwrap_or_default();
    if host.is_empty() || endpoint.uri().port_u16().is_none() {
        return Err(bad("expected host:port".into()));
    }
    let connector = tower::service_fn(move |uri: Uri| {
        let config = config.current();
        async move {
            let invalid = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, m.to_string());
            let host = uri.host().ok_or_else(|| invalid("server address has no host"))?;
            let port = uri.port_u16().ok_or_else(|| invalid("server address has no port"))?;
            Ok::<_, std::io::Error>(TokioIo::new(dial_tls_to(host, port, config).await?))
        }
    });
    let channel = UnindexedPerCallHeaders { inner: endpoint.connect_with_connector_lazy(connector) };
    Ok(tower_layer::Layer::layer(&berth_telemetry::ClientTraceLayer::default(), channel))
}

/// Where each new connection takes its client configuration from: the
/// node's credentials as they are at that moment (so a renewed certificate
/// is presented from the next connection on), or one fixed configuration.
#[derive(Clone)]
enum ConfigSource {
    Credentials(TlsCredentials),
    Fixed(Arc<ClientConfig>),
}

impl ConfigSource {
    fn current(&self) -> Arc<ClientConfig> {
        match self {
            ConfigSource::Credentials(c) => c.client_config(),
            ConfigSource::Fixed(c) => c.clone(),
        }
    }
}

/// Dials `addr` (`host:port`) and completes a TLS handshake with `config`.
pub(crate) async fn dial_tls(addr: &str, config: Arc<ClientConfig>) -> std::io::Result<TlsStream<TcpStream>> {
    let invalid = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{addr}: {m}"));
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| invalid("expected host:port"))?;
    let port = port.parse().map_err(|_| invalid("the port is not a number"))?;
    dial_tls_to(host, port, config).await
}

async fn dial_tls_to(host: &str, port: u16, config: Arc<ClientConfig>) -> std::io::Result<TlsStream<TcpStream>> {
    let invalid = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, m.to_string());
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    let name = ServerName::try_from(host.clone()).map_err(|_| invalid("server host is not a valid name"))?;
    let tcp = connect_any(&host, port).await?;
    let _ = tcp.set_nodelay(true);
    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await
}

/// Connects to one of the addresses `host` resolves to, trying them in a
/// random order: a name that stands for several replicas spreads its
/// clients' connections over them, and one that is down is passed over.
async fn connect_any(host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host, port)).await?.collect();
    shuffle(&mut addrs);
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(tcp) => return Ok(tcp),
            Err(error) => last = Some(error),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{host} has no address"))))
}

fn shuffle<T>(items: &mut [T]) {
    use rand::seq::SliceRandom as _;
    items.shuffle(&mut rand::rng());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_address_of_a_name_comes_first_in_some_dial() {
        let mut first = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let mut addrs = [1, 2, 3];
            shuffle(&mut addrs);
            first.insert(addrs[0]);
        }
        assert_eq!(first.len(), 3, "{first:?}");
    }

    #[tokio::test]
    async fn a_name_whose_first_address_is_down_is_reached_through_another() {
        // localhost resolves to 127.0.0.1 (and ::1 where configured); a
        // listener on one of them is found whatever order they are tried in.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        for _ in 0..10 {
            let tcp = connect_any("localhost", port).await.unwrap();
            assert_eq!(tcp.peer_addr().unwrap().port(), port);
        }
        assert!(connect_any("127.0.0.1", 1).await.is_err(), "nothing listens on port 1");
    }

    #[test]
    fn per_call_headers_are_never_indexed_and_the_rest_are_left_alone() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            http::HeaderValue::from_static("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        );
        headers.insert("grpc-timeout", http::HeaderValue::from_static("9999870u"));
        headers.insert("content-type", http::HeaderValue::from_static("application/grpc"));
        mark_per_call_headers(&mut headers);
        assert!(headers["traceparent"].is_sensitive());
        assert!(headers["grpc-timeout"].is_sensitive());
        assert!(!headers["content-type"].is_sensitive(), "stable headers stay indexable");
    }
}
