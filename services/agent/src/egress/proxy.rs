//! The egress proxy of one service of one tenant: an HTTP forward proxy that
//! also tunnels CONNECT, serving one listener and holding every request to
//! the tenant's rules (see [`super::rules`]).
//!
//! # Which service is calling
//! Every (tenant, service) pair has a listener of its own, and a replica is
//! given the address of its own service's listener only: the listener a
//! connection arrives on says whose rules apply, so nothing has to be read
//! from the connection itself. Replicas of one tenant share a network
//! namespace when the node isolates them, so a replica that deliberately
//! dials a sibling service's listener gets that sibling's rules; the
//! boundary the kernel holds is the tenant's, never crossed (a tenant's
//! listeners exist only inside its own namespace).
//!
//! # Expected flow
//! The request head is read, bounded in size and time. `CONNECT host:port`
//! is decided as CONNECT traffic: refused, it is answered 403 with the
//! sentence naming the rule; allowed, the proxy dials out, answers 200 and
//! relays bytes both ways. An absolute-form `http://host[:port]/path`
//! request is decided as HTTP traffic and, allowed, sent on in origin form
//! with `Host` taken from the URL and `Connection: close`, so every request
//! is decided on its own connection. Anything else is answered 400. A
//! relayed connection ends when the destination closes it.
//!
//! # Invariants
//! - The rules are read from a watch channel on every request: a new plan
//!   takes effect on the next request, and the listener never restarts for it.
//!   Tunnels already open when the rules change stay open.
//! - The proxy dials from the agent's own network namespace. A host name
//!   that resolves only to loopback or unspecified addresses is refused: a
//!   route must name such an address itself, so that a wildcard route never
//!   becomes a way into the node's own services.
//! - Every refusal is logged with the tenant, the service and the destination.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

use super::rules::{TenantRules, TrafficKind, Verdict, display_destination, normalize_host};

/// How long a replica has to send a request head once it connected.
pub const DEFAULT_PROXY_HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the proxy tries to reach a destination before answering 504.
pub const DEFAULT_PROXY_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest request head the proxy reads.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// How many connections one listener serves at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 1024;

/// The pause after a failed accept (out of file descriptors, say), so the
/// loop never spins.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// How much of a refused request's body is read and dropped, and for how
/// long, so the replica sees the answer instead of a reset.
const DRAIN_BYTES: usize = 64 * 1024;
const DRAIN_TIME: Duration = Duration::from_millis(200);

/// Headers never sent on: those that belong to one hop, and `Host`, which
/// the URL decides.
const DROPPED_HEADERS: [&str; 9] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "upgrade",
    "host",
];

/// The proxy's timings. Production uses [`Default`]; tests shrink them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyTiming {
    /// How long a replica has to send its request head.
    pub head_timeout: Duration,
    /// How long dialling a destination may take.
    pub connect_timeout: Duration,
}

impl Default for ProxyTiming {
    fn default() -> Self {
        Self { head_timeout: DEFAULT_PROXY_HEAD_TIMEOUT, connect_timeout: DEFAULT_PROXY_CONNECT_TIMEOUT }
    }
}

/// One service's proxy: whose it is and the tenant's rules it reads.
#[derive(Debug, Clone)]
pub(crate) struct ServiceProxy {
    /// The service whose replicas the listener serves.
    pub(crate) service: String,
    /// The tenant's rules, swapped whole when a plan arrives.
    pub(crate) rules: watch::Receiver<Arc<TenantRules>>,
    /// Its timings.
    pub(crate) timing: ProxyTiming,
}

impl ServiceProxy {
    /// Serves `listener` until `stop`; every connection it accepted ends then too.
    pub(crate) async fn serve(self, listener: TcpListener, stop: CancellationToken) {
        let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let proxy = Arc::new(self);
        loop {
            let permit = tokio::select! {
                _ = stop.cancelled() => return,
                permit = limit.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, _peer)) => {
                    let (proxy, stop) = (proxy.clone(), stop.clone());
                    tokio::spawn(async move {
                        let _permit = permit;
                        tokio::select! {
                            _ = stop.cancelled() => {}
                            _ = proxy.handle(stream) => {}
                        }
                    });
                }
                Err(error) => {
                    tracing::warn!(service = %proxy.service, %error, "the egress proxy cannot accept a connection");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            }
        }
    }

    async fn handle(&self, mut client: TcpStream) {
        let head = match tokio::time::timeout(self.timing.head_timeout, read_head(&mut client)).await {
            Ok(Ok(head)) => head,
            Ok(Err(HeadError::Closed)) => return,
            Ok(Err(error)) => return respond(&mut client, 400, "Bad Request", &error.to_string()).await,
            Err(_) => return respond(&mut client, 408, "Request Timeout", "no request head in time").await,
        };
        let (request, target) = match parse_request(&head.bytes).and_then(|r| target_of(&r).map(|t| (r, t))) {
            Ok(parsed) => parsed,
            Err(message) => return respond(&mut client, 400, "Bad Request", &message).await,
        };
        let rules = self.rules.borrow().clone();
        let destination = display_destination(&target.host, target.port);
        match rules.decide(&self.service, target.kind, &target.host, target.port) {
            Verdict::Refused { reason } => {
                tracing::warn!(tenant = %rules.tenant(), service = %self.service, %destination, kind = %target.kind,
                    %reason, "egress refused");
                return refuse(&mut client, &reason).await;
            }
            Verdict::Allowed { route } => {
                tracing::debug!(tenant = %rules.tenant(), service = %self.service, %destination, kind = %target.kind,
                    %route, "egress allowed");
            }
        }
        let mut upstream = match dial(&target.host, target.port, self.timing.connect_timeout).await {
            Ok(upstream) => upstream,
            Err(error) => {
                tracing::warn!(tenant = %rules.tenant(), service = %self.service, %destination, %error,
                    "egress allowed, but the destination cannot be reached");
                let (status, text) = match error {
                    DialError::Loopback => {
                        let reason = format!("{error}, so service {} may not reach {destination}", self.service);
                        return refuse(&mut client, &reason).await;
                    }
                    DialError::Timeout => (504, "Gateway Timeout"),
                    DialError::Resolve(_) | DialError::Connect(_) => (502, "Bad Gateway"),
                };
                return respond(&mut client, status, text, &format!("cannot reach {destination}: {error}")).await;
            }
        };
        let sent = match target.kind {
            TrafficKind::Connect => client.write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n").await,
            TrafficKind::Http => upstream.write_all(&forward_head(&request, &target)).await,
        };
        if sent.is_err() || upstream.write_all(&head.rest).await.is_err() {
            return;
        }
        relay(client, upstream).await;
    }
}

/// Relays bytes both ways until the destination is done: once it closes,
/// the replica's side is closed too, so a client that keeps idle
/// connections open never holds one of the listener's connections.
async fn relay(client: TcpStream, upstream: TcpStream) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_upstream, mut to_upstream) = upstream.into_split();
    let outbound = async {
        let _ = tokio::io::copy(&mut from_client, &mut to_upstream).await;
        // A replica that is done sending may still be receiving.
        let _ = to_upstream.shutdown().await;
        std::future::pending::<()>().await
    };
    let inbound = async {
        let _ = tokio::io::copy(&mut from_upstream, &mut to_client).await;
        let _ = to_client.shutdown().await;
    };
    tokio::select! {
        () = outbound => {}
        () = inbound => {}
    }
}

/// A request head and what came after it in the same reads.
struct Head {
    bytes: Vec<u8>,
    rest: Vec<u8>,
}

/// Why no request head could be read.
#[derive(Debug, thiserror::Error)]
enum HeadError {
    /// The replica hung up before sending anything.
    #[error("the connection closed before a request")]
    Closed,
    /// The replica hung up in the middle of the head.
    #[error("the connection closed in the middle of the request head")]
    Truncated,
    /// The head is larger than the proxy reads.
    #[error("the request head is larger than {MAX_HEAD_BYTES} bytes")]
    TooLarge,
    /// Reading failed.
    #[error("cannot read the request: {0}")]
    Io(#[from] std::io::Error),
}

async fn read_head(stream: &mut TcpStream) -> Result<Head, HeadError> {
    let mut bytes = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Err(if bytes.is_empty() { HeadError::Closed } else { HeadError::Truncated });
        }
        let from = bytes.len().saturating_sub(3);
        bytes.extend_from_slice(&chunk[..read]);
        if let Some(end) = bytes[from..].windows(4).position(|w| w == b"\r\n\r\n").map(|at| from + at + 4) {
            let rest = bytes.split_off(end);
            return Ok(Head { bytes, rest });
        }
        if bytes.len() > MAX_HEAD_BYTES {
            return Err(HeadError::TooLarge);
        }
    }
}

/// A request line and its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Request {
    method: String,
    target: String,
    version: String,
    headers: Vec<(String, String)>,
}

fn parse_request(head: &[u8]) -> Result<Request, String> {
    let text = std::str::from_utf8(head).map_err(|_| "the request head is not UTF-8".to_string())?;
    let mut lines = text.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let parts: Vec<&str> = line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return Err(format!("'{line}' is not a request line (METHOD TARGET HTTP/1.1)"));
    };
    if method.is_empty() || target.is_empty() || !version.starts_with("HTTP/1.") {
        return Err(format!("'{line}' is not an HTTP/1 request line"));
    }
    let mut headers = Vec::new();
    for line in lines.filter(|line| !line.is_empty()) {
        match line.split_once(':') {
            Some((name, value)) if !name.is_empty() && !name.contains(char::is_whitespace) => {
                headers.push((name.to_string(), value.trim().to_string()));
            }
            _ => return Err(format!("'{line}' is not a header line")),
        }
    }
    Ok(Request { method: method.to_string(), target: target.to_string(), version: version.to_string(), headers })
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    kind: TrafficKind,
    /// Normalised (see [`normalize_host`]).
    host: String,
    port: u16,
    /// The authority as the URL wrote it, for the `Host` header.
    authority: String,
    /// The origin-form target sent on (HTTP only).
    path: String,
}

fn target_of(request: &Request) -> Result<Target, String> {
    if request.method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_authority(&request.target, None)?;
        return Ok(Target {
            kind: TrafficKind::Connect,
            host,
            port,
            authority: request.target.clone(),
            path: String::new(),
        });
    }
    let lower = request.target.to_ascii_lowercase();
    if lower.starts_with("https://") {
        return Err("send https:// requests as CONNECT (through HTTPS_PROXY), not as plain requests".into());
    }
    if !lower.starts_with("http://") {
        return Err(
            "this is an egress proxy: send requests in absolute form (http://host/path) or CONNECT host:port".into()
        );
    }
    let rest = &request.target["http://".len()..];
    let split = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(split);
    if authority.contains('@') {
        return Err("user information in the URL is not sent through the egress proxy".into());
    }
    let path = match path.split('#').next().unwrap_or_default() {
        "" => "/".to_string(),
        query if query.starts_with('?') => format!("/{query}"),
        path => path.to_string(),
    };
    let (host, port) = split_authority(authority, Some(80))?;
    Ok(Target { kind: TrafficKind::Http, host, port, authority: authority.to_string(), path })
}

/// `host:port`, `[v6]:port`, or a host alone when a default port is given.
fn split_authority(authority: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    let bad = || format!("'{authority}' is not host:port");
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or_else(bad)?;
        match after.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if after.is_empty() => (host, None),
            None => return Err(bad()),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(port) => port.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(bad)?,
        None => default_port.ok_or_else(|| format!("'{authority}' has no port"))?,
    };
    let host = normalize_host(host).ok_or_else(bad)?;
    Ok((host, port))
}

/// The head sent on for an allowed HTTP request: origin form, no hop-by-hop
/// headers, `Host` from the URL, and one request per connection.
fn forward_head(request: &Request, target: &Target) -> Vec<u8> {
    let named_hops: Vec<String> = request
        .headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, value)| value.split(',').map(|token| token.trim().to_ascii_lowercase()))
        .collect();
    let mut head = format!("{} {} {}\r\nHost: {}\r\n", request.method, target.path, request.version, target.authority);
    for (name, value) in &request.headers {
        let lower = name.to_ascii_lowercase();
        if DROPPED_HEADERS.contains(&lower.as_str()) || named_hops.contains(&lower) {
            continue;
        }
        head.push_str(name);
        head.push_str(": ");
        head.push_str(value);
        head.push_str("\r\n");
    }
    head.push_str("Connection: close\r\n\r\n");
    head.into_bytes()
}

/// Why a destination could not be reached.
#[derive(Debug, thiserror::Error)]
enum DialError {
    /// The name did not resolve.
    #[error("cannot resolve it: {0}")]
    Resolve(#[source] std::io::Error),
    /// The name resolves only to loopback or unspecified addresses.
    #[error("the name resolves only to loopback addresses, which a route must name by address")]
    Loopback,
    /// No address answered.
    #[error("{0}")]
    Connect(#[source] std::io::Error),
    /// Nothing answered in time.
    #[error("no answer in time")]
    Timeout,
}

async fn dial(host: &str, port: u16, within: Duration) -> Result<TcpStream, DialError> {
    let attempt = async {
        let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => {
                let resolved: Vec<SocketAddr> =
                    tokio::net::lookup_host((host, port)).await.map_err(DialError::Resolve)?.collect();
                let outside: Vec<SocketAddr> = resolved
                    .iter()
                    .copied()
                    .filter(|addr| !addr.ip().is_loopback() && !addr.ip().is_unspecified())
                    .collect();
                if outside.is_empty() && !resolved.is_empty() {
                    return Err(DialError::Loopback);
                }
                outside
            }
        };
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no addresses");
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(stream) => return Ok(stream),
                Err(error) => last = error,
            }
        }
        Err(DialError::Connect(last))
    };
    tokio::time::timeout(within, attempt).await.unwrap_or(Err(DialError::Timeout))
}

/// Answers 403 with the reason, the sentence that names the rule.
async fn refuse(client: &mut TcpStream, reason: &str) {
    respond(client, 403, "Forbidden", reason).await;
}

/// Answers with a plain-text body and closes the connection.
async fn respond(client: &mut TcpStream, status: u16, text: &str, message: &str) {
    let body = format!("berth egress: {message}\n");
    let head = format!(
        "HTTP/1.1 {status} {text}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if client.write_all(head.as_bytes()).await.is_err() || client.write_all(body.as_bytes()).await.is_err() {
        return;
    }
    let _ = client.shutdown().await;
    // Closing with unread input would reset the connection and could lose the answer.
    let drain = async {
        let mut left = DRAIN_BYTES;
        let mut chunk = [0u8; 4096];
        while left > 0 {
            match client.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(read) => left = left.saturating_sub(read),
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(head: &str) -> Request {
        parse_request(head.as_bytes()).unwrap()
    }

    #[test]
    fn connect_targets_need_a_port_and_keep_ipv6_brackets_out_of_the_host() {
        let target = target_of(&request("CONNECT api.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")).unwrap();
        assert_eq!((target.kind, target.host.as_str(), target.port), (TrafficKind::Connect, "api.example.com", 443));
        let v6 = target_of(&request("CONNECT [::1]:8443 HTTP/1.1\r\n\r\n")).unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 8443));
        assert!(target_of(&request("CONNECT api.example.com HTTP/1.1\r\n\r\n")).unwrap_err().contains("no port"));
        assert!(target_of(&request("CONNECT api.example.com:0 HTTP/1.1\r\n\r\n")).is_err());
    }

    #[test]
    fn absolute_form_requests_are_sent_on_in_origin_form_with_the_urls_host() {
        let request = request(
            "POST http://Example.com:8080?q=1 HTTP/1.1\r\nHost: elsewhere.example\r\nProxy-Authorization: x\r\n\
             Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nContent-Length: 2\r\n\r\n",
        );
        let target = target_of(&request).unwrap();
        assert_eq!((target.host.as_str(), target.port, target.path.as_str()), ("example.com", 8080, "/?q=1"));
        let sent = String::from_utf8(forward_head(&request, &target)).unwrap();
        assert_eq!(
            sent,
            "POST /?q=1 HTTP/1.1\r\nHost: Example.com:8080\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
        );
        let plain = target_of(&self::request("GET http://example.com/a/b#frag HTTP/1.0\r\n\r\n")).unwrap();
        assert_eq!((plain.port, plain.path.as_str()), (80, "/a/b"));
    }

    #[test]
    fn what_is_not_a_proxy_request_is_named() {
        assert!(target_of(&request("GET /index.html HTTP/1.1\r\n\r\n")).unwrap_err().contains("absolute form"));
        assert!(target_of(&request("GET https://example.com/ HTTP/1.1\r\n\r\n")).unwrap_err().contains("CONNECT"));
        assert!(target_of(&request("GET http://user@example.com/ HTTP/1.1\r\n\r\n")).is_err());
        assert!(parse_request(b"GET http://example.com/\r\n\r\n").is_err());
        assert!(parse_request(b"GET http://example.com/ HTTP/1.1\r\nbad header\r\n\r\n").is_err());
        assert!(parse_request(b"GET http://example.com/ SPDY/3\r\n\r\n").is_err());
    }
}
