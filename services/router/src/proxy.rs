//! The public side: an HTTP server (HTTP/1.1 and HTTP/2: with prior
//! knowledge in cleartext, by ALPN over TLS) that sends each request to a
//! replica of the service its host names, through that replica's agent.
//!
//! # Expected flow
//! A request's host is resolved in the current [`RouteTable`]. An unknown
//! host is answered 404 naming what was looked for; a service with no
//! replica to send to, 503 with `Retry-After`. Otherwise a replica is
//! picked at random and the request is sent to it in the protocol it
//! speaks (see [`crate::routes`]): over a connection kept from an earlier
//! request (an idle HTTP/1.1 one, or the replica's one HTTP/2 connection),
//! else over a new `Tunnel`, opened through the one HTTP/2 connection kept
//! per agent. The replica's answer is streamed back as it comes, in the
//! client's version; the request counts as under way until its answer's
//! body ends (see [`crate::acks`]). An HTTP/1.1 request to switch protocols
//! (`Upgrade`, as a WebSocket asks) goes over a tunnel of its own, and once
//! the replica answers 101 the two connections are joined byte for byte.
//!
//! Client connections are dealt in turn to the router's serving threads
//! (one per CPU, [`berth_rpc::threads`]), and each thread has a [`Proxy`]
//! of its own: its own connection to each agent and its own kept
//! connections to replicas. A request is thus served start to end on one
//! thread, with no wake-up of another; the price is one agent connection
//! per thread rather than one per router, which the agent serves on its
//! own threads the same way.
//!
//! # Invariants
//! - No replica port is ever dialled: every byte goes through an agent's
//!   data plane, over mTLS, as this router's identity.
//! - A request is sent again only when no byte of it reached a replica: a
//!   tunnel refused, or a kept connection found closed before it was
//!   written; nothing else is retried.
//! - A tunnel's ordinary end closes its stream and never resets it (see
//!   [`berth_rpc::tunnel`]): thousands of replica connections that each close after
//!   one answer leave the connection to their agent as it was.
//! - A connection, and every connection made to serve its requests, lives
//!   on the serving thread it was dealt to; the threads outlive the
//!   listeners until the last connection's requests finish.
//! - A client is named to a replica as a workload (`X-Forwarded-Client-Cert`)
//!   only while the SVID it presented is valid: its connection is closed
//!   once the SVID expires, and no TLS session is resumed past it.
//! - Once the router's certificate is renewed, new tunnels open on fresh
//!   connections to agents and idle replica connections through the old
//!   ones are closed within [`SWEEP_EVERY`]: an agent closes a connection
//!   when the certificate it was made with expires, half a lifetime later,
//!   and by then only what was under way at the renewal is left on it.
//! - The connection to an agent, and those to a replica, no route names
//!   any more are dropped with the table that stopped naming them (a
//!   revoked or removed node, a replica out of the routes).

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use berth_mtls::TlsCredentials;
use berth_rpc::threads::ServingThreads;
use berth_rpc::tunnel::{self, Connection, OpenError, Tunnel};
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rand::Rng as _;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::acks::{InFlight, InFlightGuard};
use crate::routes::{self, Endpoint, Resolution, RouteTable};

/// How long a client may take to finish its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a client's connection may go without a request's head: from
/// its start to its first request, and (HTTP/1.1) between one request's
/// answer and the next request's head, as nginx's `client_header_timeout`.
const CLIENT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How often an HTTP/2 client's connection is pinged while it is open; one
/// whose client does not answer within [`CLIENT_PING_TIMEOUT`] is closed.
const CLIENT_PING_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a connection closed for its silence is given to say goodbye.
const CLIENT_GOODBYE: std::time::Duration = std::time::Duration::from_secs(1);

/// How long an HTTP/2 client has to answer a ping.
const CLIENT_PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// How long opening a tunnel may take (its agent connects to the replica
/// within 5s of its own), before the replica counts as unreachable.
const OPEN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long requests under way may take to finish once the router stops.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// One agent's connection and how many times one was made; locked across
/// a dial, so the requests to an agent not yet connected wait for its one
/// connection rather than each making one, and those to others do not wait.
type AgentSlot = Arc<tokio::sync::Mutex<(u64, Option<Connection>)>>;

/// What a client is told to wait before trying a service with no replica.
const RETRY_AFTER_SECONDS: &str = "1";

/// A response body of either kind: the replica's, or the router's own.
type Body = BoxBody<Bytes, hyper::Error>;

/// What every request reads: the routes, and one channel per agent.
#[derive(Debug)]
pub(crate) struct Proxy {
    table: watch::Receiver<Arc<RouteTable>>,
    inflight: Arc<InFlight>,
    credentials: TlsCredentials,
    /// How long a replica may take to begin its answer.
    response_timeout: std::time::Duration,
    /// By agent address: its connection, if one was made.
    agents: Mutex<HashMap<String, AgentSlot>>,
    pool: Arc<Pool>,
}

/// The router's public side: one [`Proxy`] per serving thread, each with
/// its own connections to agents and replicas, so that a request is served
/// start to end on the thread its client's connection was dealt to.
#[derive(Debug)]
pub(crate) struct Proxies {
    threads: Arc<ServingThreads>,
    /// One a thread, in the threads' order.
    proxies: Vec<Arc<Proxy>>,
}

impl Proxies {
    pub(crate) fn new(
        threads: Arc<ServingThreads>,
        table: &watch::Receiver<Arc<RouteTable>>,
        inflight: &Arc<InFlight>,
        credentials: &TlsCredentials,
        response_timeout: std::time::Duration,
    ) -> Arc<Proxies> {
        let proxies = (0..threads.count())
            .map(|_| Proxy::new(table.clone(), inflight.clone(), credentials.clone(), response_timeout))
            .collect();
        Arc::new(Proxies { threads, proxies })
    }

    /// Drops, on every thread, the connections the table no longer names
    /// and those idle for longer than they are kept.
    pub(crate) fn let_go_of_unused(&self, shutdown: &CancellationToken) {
        for proxy in &self.proxies {
            tokio::spawn(proxy.clone().let_go_of_unused(shutdown.clone()));
        }
    }

    /// Serves `listener` until `shutdown`: in TLS first when `tls` is given.
    /// Each connection is dealt to a serving thread and is a task of
    /// `connections` there, which outlives the listener while its requests
    /// finish (and holds the threads up until it does).
    pub(crate) async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Option<crate::PublicTls>,
        connections: TaskTracker,
        shutdown: CancellationToken,
    ) {
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let (stream, client) = match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let tls = tls.as_ref().map(|tls| tls.acceptor(self.credentials().workload_bundle()));
            // Counted as under way from now, so a stop waits for it.
            let (under_way, held, shutdown) = (connections.token(), self.clone(), shutdown.clone());
            let dealt = self.threads.deal(stream, move |thread, stream| async move {
                let _under_way = under_way;
                let proxy = held.proxies[thread].clone();
                match tls {
                    None => {
                        let client = Client::new(client, false, None, None);
                        proxy.serve_connection(stream, client, shutdown).await;
                    }
                    Some(tls) => match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let leaf = stream.get_ref().1.peer_certificates().and_then(|c| c.first());
                            let workload = leaf.and_then(xfcc);
                            let expires_at = leaf
                                .filter(|_| workload.is_some())
                                .and_then(|leaf| berth_mtls::cert_validity(leaf).ok())
                                .map(|(_, to)| to);
                            let client = Client::new(client, true, workload, expires_at);
                            proxy.serve_connection(stream, client, shutdown).await;
                        }
                        Ok(Err(error)) => tracing::debug!(%error, "a client's TLS handshake failed"),
                        Err(_) => tracing::debug!("a client's TLS handshake took too long"),
                    },
                }
            });
            if let Err(error) = dealt {
                tracing::warn!(%client, %error, "cannot hand a connection to a serving thread");
            }
        }
    }

    /// The credentials every thread's proxy dials agents with.
    fn credentials(&self) -> &TlsCredentials {
        &self.proxies[0].credentials
    }
}

impl Proxy {
    pub(crate) fn new(
        table: watch::Receiver<Arc<RouteTable>>,
        inflight: Arc<InFlight>,
        credentials: TlsCredentials,
        response_timeout: std::time::Duration,
    ) -> Arc<Proxy> {
        let agents = Mutex::new(HashMap::new());
        Arc::new(Proxy { table, inflight, credentials, response_timeout, agents, pool: Arc::default() })
    }

    /// Serves one client connection, HTTP/1.1 or HTTP/2, until it ends.
    /// When the router stops, the connection takes no new request and those
    /// under way get [`SHUTDOWN_GRACE`] to finish.
    async fn serve_connection<S>(self: Arc<Self>, stream: S, client: Client, shutdown: CancellationToken)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let asked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (first, expires_at) = (asked.clone(), client.expires_at);
        let service = hyper::service::service_fn(move |request| {
            if !first.load(std::sync::atomic::Ordering::Relaxed) {
                first.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let (proxy, client) = (self.clone(), client.clone());
            async move { Ok::<_, Infallible>(proxy.handle(request, client).await) }
        });
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).header_read_timeout(CLIENT_IDLE_TIMEOUT);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(CLIENT_PING_EVERY)
            .keep_alive_timeout(CLIENT_PING_TIMEOUT);
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        tokio::pin!(connection);
        // A connection that never sends a request's head (nothing at all, or
        // less than its protocol's first line) is not read as either
        // protocol yet, so neither limit above holds it.
        let silent = async {
            tokio::time::sleep(CLIENT_IDLE_TIMEOUT).await;
            if asked.load(std::sync::atomic::Ordering::Relaxed) {
                std::future::pending::<()>().await;
            }
        };
        let served = tokio::select! {
            served = connection.as_mut() => served,
            () = silent => {
                tracing::debug!("a client sent no request within {CLIENT_IDLE_TIMEOUT:?}; closing its connection");
                // An HTTP/2 client is told (GOAWAY) rather than cut off.
                connection.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(CLIENT_GOODBYE, connection.as_mut()).await;
                return;
            }
            () = berth_rpc::certificate_expired(expires_at) => {
                tracing::debug!("a workload's SVID expired; closing its connection");
                connection.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(berth_rpc::EXPIRED_GRACE, connection.as_mut()).await;
                return;
            }
            () = shutdown.cancelled() => {
                connection.as_mut().graceful_shutdown();
                match tokio::time::timeout(SHUTDOWN_GRACE, connection.as_mut()).await {
                    Ok(served) => served,
                    Err(_) => return,
                }
            }
        };
        if let Err(error) = served {
            tracing::debug!(%error, "a client connection ended with an error");
        }
    }

    /// Drops the channel of every agent, and the connections to every
    /// replica, the table no longer names; and, every [`SWEEP_EVERY`], the
    /// HTTP/1.1 connections idle for longer than [`IDLE_FOR`], which a
    /// replica that no request reaches any more would otherwise keep (and
    /// its agent with it) until its route changes, and those through a
    /// tunnel made with credentials since reloaded.
    pub(crate) async fn let_go_of_unused(self: Arc<Self>, shutdown: CancellationToken) {
        let mut table = self.table.clone();
        let mut sweeps = tokio::time::interval(SWEEP_EVERY);
        sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = sweeps.tick() => {
                    self.pool.sweep(self.credentials.generation());
                    continue;
                }
                changed = table.changed() => if changed.is_err() { return },
            }
            let current = table.borrow_and_update().clone();
            let agents: HashSet<&str> = current.endpoints().map(|e| e.agent_addr.as_str()).collect();
            self.agents().retain(|addr, _| agents.contains(addr.as_str()));
            let leases: HashSet<&str> = current.endpoints().map(|e| e.lease_id.as_str()).collect();
            self.pool.retain(&leases);
        }
    }

    fn agents(&self) -> std::sync::MutexGuard<'_, HashMap<String, AgentSlot>> {
        self.agents.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The one connection to the agent at `addr`, made on first use and
    /// again once it closed or the router's credentials were reloaded (a
    /// renewed certificate: the agent closes a connection once the
    /// certificate it was made with expires), with the generation it was
    /// made at.
    async fn agent(&self, addr: &str) -> Result<(u64, Connection), String> {
        let slot = self.agents().entry(addr.to_string()).or_default().clone();
        let mut slot = slot.lock().await;
        if let (generation, Some(kept)) = &*slot
            && self.usable(kept)
        {
            return Ok((*generation, kept.clone()));
        }
        let connection = tunnel::connect(addr, &self.credentials).await.map_err(|e| e.to_string())?;
        slot.0 += 1;
        slot.1 = Some(connection.clone());
        Ok((slot.0, connection))
    }

    /// A fresh connection to the agent at `addr` in place of the one of
    /// `generation`, which broke; one already made in its place by a
    /// request before is used as is.
    async fn reconnect(&self, addr: &str, generation: u64) -> Result<Connection, String> {
        let slot = self.agents().entry(addr.to_string()).or_default().clone();
        let mut slot = slot.lock().await;
        if let (current, Some(kept)) = &*slot
            && *current != generation
            && self.usable(kept)
        {
            return Ok(kept.clone());
        }
        let connection = tunnel::connect(addr, &self.credentials).await.map_err(|e| e.to_string())?;
        slot.0 += 1;
        slot.1 = Some(connection.clone());
        Ok(connection)
    }

    /// Whether new tunnels may open on `connection`: it is open, and it
    /// presents the router's current credentials.
    fn usable(&self, connection: &Connection) -> bool {
        !connection.is_closed() && connection.credentials_generation() == self.credentials.generation()
    }

    async fn handle(&self, request: Request<Incoming>, client: Client) -> Response<Body> {
        let host = request
            .uri()
            .authority()
            .map(|authority| authority.as_str().to_string())
            .or_else(|| request.headers().get(hyper::header::HOST).and_then(|h| h.to_str().ok()).map(str::to_string))
            .unwrap_or_default();
        let Picked { candidates, set_cookie } = match self.pick(&host, request.headers()) {
            Ok(picked) => picked,
            Err(answer) => return *answer,
        };
        let mut response = self.forward(request, client, &host, candidates).await;
        if let Some(cookie) = set_cookie {
            response.headers_mut().append(hyper::header::SET_COOKIE, cookie);
        }
        response
    }

    /// Sends `request` to the first of `candidates` (the next only when the
    /// first refused before any byte reached it): the replica's answer, or
    /// the router's own. A candidate's count ends when it is passed over or
    /// its answer ends; those not tried end with this call.
    async fn forward(
        &self,
        mut request: Request<Incoming>,
        client: Client,
        host: &str,
        candidates: Vec<(Arc<Endpoint>, InFlightGuard)>,
    ) -> Response<Body> {
        forwarded_headers(&mut request, host, &client);
        let version = request.version();
        let mut candidates = candidates.into_iter();
        let Some(first) = candidates.next() else {
            return plain(StatusCode::BAD_GATEWAY, "no replica could be reached: none was picked".to_string());
        };
        // Every endpoint of a share runs one revision, so speaks one protocol.
        let h2c = first.0.h2c;
        if !h2c && version == Version::HTTP_11 && switches_protocols(request.headers()) {
            // A switch of protocols goes to the first only: the others' counts end here.
            drop(candidates);
            return self.upgrade(request, host, first).await;
        }
        strip_hop_by_hop(request.headers_mut());
        let mut request = upstream_request(request, host, h2c);
        let mut tried = Vec::new();
        // The second replica only when the first refused before any byte reached it.
        for (endpoint, guard) in std::iter::once(first).chain(candidates) {
            match self.send(&endpoint, request).await {
                Sent::Answered(mut response, kept) => {
                    if !h2c {
                        strip_hop_by_hop(response.headers_mut());
                    }
                    let mut response = response.map(|body| Guarded::new(body, kept, guard).boxed());
                    // The client is answered in its own version, whatever the replica spoke.
                    *response.version_mut() = version;
                    return response;
                }
                Sent::Failed(error) => {
                    return plain(StatusCode::BAD_GATEWAY, format!("the replica did not answer: {error}"));
                }
                Sent::TimedOut => return self.timed_out(&endpoint),
                Sent::Refused(unsent, error) => {
                    tracing::debug!(lease_id = %endpoint.lease_id, node_id = %endpoint.node_id, %error, "a replica could not be reached");
                    tried.push(format!("{} on node {}: {error}", endpoint.lease_id, endpoint.node_id));
                    request = *unsent;
                }
            }
        }
        plain(StatusCode::BAD_GATEWAY, format!("no replica could be reached: {}", tried.join("; ")))
    }

    /// An HTTP/1.1 request to switch protocols (a WebSocket, say): sent over
    /// a tunnel of its own, and when the replica agrees (101), the client's
    /// connection and the tunnel are joined byte for byte until either side
    /// closes; the request counts as under way until then.
    async fn upgrade(
        &self,
        mut request: Request<Incoming>,
        host: &str,
        (endpoint, guard): (Arc<Endpoint>, InFlightGuard),
    ) -> Response<Body> {
        let client_side = hyper::upgrade::on(&mut request);
        let request = upstream_request(request, host, false);
        let tunnel = match self.open(&endpoint).await {
            Ok(tunnel) => tunnel,
            Err(error) => return plain(StatusCode::BAD_GATEWAY, format!("no replica could be reached: {error}")),
        };
        let answered = async {
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tunnel)).await?;
            tokio::spawn(connection.with_upgrades());
            sender.send_request(request).await
        };
        let mut response = match tokio::time::timeout(self.response_timeout, answered).await {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => return plain(StatusCode::BAD_GATEWAY, format!("the replica did not answer: {error}")),
            Err(_) => return self.timed_out(&endpoint),
        };
        if response.status() == StatusCode::SWITCHING_PROTOCOLS {
            let replica_side = hyper::upgrade::on(&mut response);
            tokio::spawn(async move {
                let _inflight = guard;
                match tokio::try_join!(client_side, replica_side) {
                    Ok((client, replica)) => {
                        let (mut client, mut replica) = (TokioIo::new(client), TokioIo::new(replica));
                        if let Err(error) = tokio::io::copy_bidirectional(&mut client, &mut replica).await {
                            tracing::debug!(%error, "an upgraded connection ended with an error");
                        }
                    }
                    Err(error) => tracing::debug!(%error, "a connection could not switch protocols"),
                }
            });
            return response.map(|body| body.boxed());
        }
        response.map(|body| Guarded::new(body, None, guard).boxed())
    }

    /// The answer to a request whose replica did not begin its own within
    /// the response timeout.
    fn timed_out(&self, endpoint: &Endpoint) -> Response<Body> {
        tracing::debug!(lease_id = %endpoint.lease_id, node_id = %endpoint.node_id, "a replica did not answer in time");
        plain(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "replica {} of {} did not begin its answer within {:?} (the router's --response-timeout)",
                endpoint.lease_id, endpoint.revision, self.response_timeout
            ),
        )
    }

    /// Sends `request` to `endpoint`: over a connection kept from an earlier
    /// request when one is idle, else over a new tunnel. Its answer must
    /// begin within the response timeout; a connection it timed out on is
    /// dropped (hyper closes an HTTP/1.1 one whose answer is no longer
    /// awaited, and resets an HTTP/2 stream).
    async fn send(&self, endpoint: &Endpoint, mut request: Request<Incoming>) -> Sent {
        let deadline = tokio::time::Instant::now() + self.response_timeout;
        let current = self.credentials.generation();
        while let Some(mut upstream) = self.pool.take(&endpoint.lease_id, endpoint.h2c, current) {
            let Ok(sent) = tokio::time::timeout_at(deadline, upstream.send(request)).await else {
                return Sent::TimedOut;
            };
            match sent {
                Ok(response) => {
                    return Sent::Answered(response, self.pool.keep(&endpoint.lease_id, current, upstream));
                }
                // A kept connection that closed while idle, or after the
                // answer it gave last: the request is whole, so it goes on
                // the next one.
                Err(mut error) => match error.take_message() {
                    Some(unsent) => request = unsent,
                    None => return Sent::Failed(error.into_error().to_string()),
                },
            }
        }
        let tunnel = match self.open(endpoint).await {
            Ok(tunnel) => tunnel,
            Err(error) => return Sent::Refused(Box::new(request), error),
        };
        let generation = tunnel.credentials_generation();
        let mut upstream = match Upstream::handshake(tunnel, endpoint.h2c).await {
            Ok(upstream) => upstream,
            Err(error) => return Sent::Refused(Box::new(request), error.to_string()),
        };
        let Ok(sent) = tokio::time::timeout_at(deadline, upstream.send(request)).await else {
            return Sent::TimedOut;
        };
        match sent {
            Ok(response) => Sent::Answered(response, self.pool.keep(&endpoint.lease_id, generation, upstream)),
            Err(mut error) => match error.take_message() {
                Some(unsent) => Sent::Refused(Box::new(unsent), error.into_error().to_string()),
                None => Sent::Failed(error.into_error().to_string()),
            },
        }
    }

    /// The replicas of the share `host` resolves to that a request may try,
    /// in order (one picked at random, then the next, if any), with the
    /// request counted against each; or the router's own answer. The table
    /// is read and the request counted as one step, under the lock the
    /// acknowledger reads the table under (see `crate::acks`): the replica
    /// a retry goes to is counted from the start, so no acknowledgement
    /// made meanwhile can let it stop under the retried request.
    fn pick(&self, host: &str, headers: &hyper::HeaderMap) -> Result<Picked, Box<Response<Body>>> {
        let mut inflight = self.inflight.lock();
        let table = self.table.borrow().clone();
        // A session keeps to the share and replica its key picks.
        let (mut session, mut set_cookie) = (None, None);
        let resolved = table.resolve_by(host, |affinity| {
            (session, set_cookie) = affinity.map_or((None, None), |affinity| session_key(affinity, headers));
            session.as_deref().map_or_else(|| rand::rng().random::<f64>(), routes::session_roll)
        });
        match resolved {
            Resolution::Unknown { looked_for } => Err(Box::new(plain(
                StatusCode::NOT_FOUND,
                format!("no service answers at '{host}': looked for {looked_for}"),
            ))),
            Resolution::NoReplica { service } => {
                let mut response =
                    plain(StatusCode::SERVICE_UNAVAILABLE, format!("{service} has no replica ready to answer"));
                let retry_after = hyper::header::HeaderValue::from_static(RETRY_AFTER_SECONDS);
                response.headers_mut().insert(hyper::header::RETRY_AFTER, retry_after);
                Err(Box::new(response))
            }
            // Every endpoint of a share runs one revision.
            Resolution::Endpoints(endpoints) => {
                let first = match session.as_deref() {
                    Some(key) => routes::session_replica(endpoints, key),
                    None => rand::rng().random_range(0..endpoints.len()),
                };
                let candidates = endpoints
                    .iter()
                    .cycle()
                    .skip(first)
                    .take(endpoints.len().min(2))
                    .map(|endpoint| (endpoint.clone(), inflight.enter(endpoint)))
                    .collect();
                Ok(Picked { candidates, set_cookie })
            }
        }
    }

    /// Opens a tunnel to `endpoint`'s first port. When the connection to
    /// its agent broke under the call (the agent restarted, or closed it),
    /// nothing reached the replica: a fresh connection gets one more try.
    async fn open(&self, endpoint: &Endpoint) -> Result<Tunnel, String> {
        let (generation, connection) = self.agent(&endpoint.agent_addr).await?;
        match connection.open(&endpoint.lease_id, "", OPEN_TIMEOUT).await {
            Ok(tunnel) => Ok(tunnel),
            Err(OpenError::Broke(error)) => {
                tracing::debug!(agent = %endpoint.agent_addr, %error, "the connection to an agent broke; reconnecting");
                let connection = self.reconnect(&endpoint.agent_addr, generation).await?;
                connection.open(&endpoint.lease_id, "", OPEN_TIMEOUT).await.map_err(|e| e.to_string())
            }
            Err(refused) => Err(refused.to_string()),
        }
    }
}

/// The replicas a request may try, in order, each with the request
/// counted against it, and the affinity cookie to give its client.
struct Picked {
    candidates: Vec<(Arc<Endpoint>, InFlightGuard)>,
    set_cookie: Option<hyper::header::HeaderValue>,
}

/// The session key a request carries under `affinity`; for a cookie
/// affinity and a client with no such cookie, a fresh key and the
/// `Set-Cookie` that gives it to the client.
fn session_key(
    affinity: &routes::Affinity,
    headers: &hyper::HeaderMap,
) -> (Option<String>, Option<hyper::header::HeaderValue>) {
    match affinity {
        routes::Affinity::Header(name) => {
            let value = headers.get(name.as_str()).and_then(|v| v.to_str().ok()).map(str::trim);
            (value.filter(|v| !v.is_empty()).map(str::to_string), None)
        }
        routes::Affinity::Cookie(name) => {
            if let Some(value) = cookie(headers, name) {
                return (Some(value), None);
            }
            let value = format!("{:032x}", rand::rng().random::<u128>());
            let set = format!("{name}={value}; Path=/; HttpOnly; SameSite=Lax");
            (Some(value), hyper::header::HeaderValue::from_str(&set).ok())
        }
    }
}

/// The value of cookie `name` among the request's `Cookie` headers.
fn cookie(headers: &hyper::HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(hyper::header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value.trim().trim_matches('"').to_string())
        .filter(|value| !value.is_empty())
}

/// `request` as the replica is sent it, for the host it was routed by:
/// in HTTP/2 with prior knowledge when the replica speaks it (the host in
/// the URI, none in a header), else in HTTP/1.1 (the path in the request
/// line, the host in a header). The replica sees the host the request was
/// routed by and no other, whatever else the client wrote (RFC 9112
/// §3.2.2: an absolute URI's authority wins over `Host`).
fn upstream_request<B>(mut request: Request<B>, host: &str, h2c: bool) -> Request<B> {
    let from_h2 = request.version() == Version::HTTP_2;
    if h2c {
        // Most are in this form already: a client with prior knowledge sends them so.
        let uri = request.uri();
        let keep = uri.scheme() == Some(&hyper::http::uri::Scheme::HTTP)
            && uri.authority().is_some_and(|authority| authority.as_str() == host);
        if !keep {
            let path = uri.path_and_query().map_or("/", |p| p.as_str());
            if let Ok(uri) = format!("http://{host}{path}").parse() {
                *request.uri_mut() = uri;
            }
        }
        request.headers_mut().remove(hyper::header::HOST);
    } else {
        if request.uri().authority().is_some() {
            let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
            if let Ok(uri) = path.parse() {
                *request.uri_mut() = uri;
            }
        }
        let stated = request.headers().get(hyper::header::HOST);
        if stated.is_none_or(|stated| stated.as_bytes() != host.as_bytes())
            && let Ok(host) = hyper::header::HeaderValue::from_str(host)
        {
            request.headers_mut().insert(hyper::header::HOST, host);
        }
        if from_h2 {
            join_cookies(request.headers_mut());
        }
    }
    *request.version_mut() = if h2c { Version::HTTP_2 } else { Version::HTTP_11 };
    request
}

/// Whether an HTTP/1.1 request asks to switch protocols (RFC 9110 §7.8: an
/// `Upgrade` named in `Connection`) to one the router joins byte for byte.
/// Never to `h2c`: its connection would carry requests the router never
/// reads, so none of its own headers (who called, from where) would reach
/// the replica; such a request is served as the HTTP/1.1 it also is.
fn switches_protocols(headers: &hyper::HeaderMap) -> bool {
    let Some(protocols) = headers.get(hyper::header::UPGRADE) else { return false };
    let asked = connection_options(headers).any(|option| option.eq_ignore_ascii_case("upgrade"));
    asked
        && protocols.to_str().is_ok_and(|protocols| !protocols.split(',').any(|p| p.trim().eq_ignore_ascii_case("h2c")))
}

/// The options a message's `Connection` headers list.
fn connection_options(headers: &hyper::HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .filter(|option| !option.is_empty())
}

/// Removes what describes one connection rather than the message (RFC 9110
/// §7.6.1): `Connection` and every header it names, and the hop-by-hop
/// headers of HTTP/1.1, so neither a client's connection options reach the
/// replica (a `Connection: close` would end a kept connection) nor a
/// replica's reach the client. The message's own framing
/// (`Transfer-Encoding`, `Content-Length`) is hyper's to write.
fn strip_hop_by_hop(headers: &mut hyper::HeaderMap) {
    if headers.contains_key(hyper::header::CONNECTION) {
        let named: Vec<hyper::header::HeaderName> =
            connection_options(headers).filter_map(|option| option.parse().ok()).collect();
        for name in named {
            if name != hyper::header::TRANSFER_ENCODING && name != hyper::header::CONTENT_LENGTH {
                headers.remove(name);
            }
        }
        headers.remove(hyper::header::CONNECTION);
    }
    for name in ["keep-alive", "proxy-connection", "upgrade", "http2-settings"] {
        headers.remove(name);
    }
}

/// Joins the `cookie` fields an HTTP/2 client may split a cookie list into
/// into the one `Cookie` header HTTP/1.1 allows (RFC 9113 §8.2.3), so an
/// HTTP/1.1 replica reads every cookie.
fn join_cookies(headers: &mut hyper::HeaderMap) {
    let mut values = headers.get_all(hyper::header::COOKIE).iter();
    if values.next().is_none() || values.next().is_none() {
        return;
    }
    let joined: Vec<&[u8]> = headers.get_all(hyper::header::COOKIE).iter().map(|v| v.as_bytes()).collect();
    if let Ok(joined) = hyper::header::HeaderValue::from_bytes(&joined.join(&b"; "[..])) {
        headers.insert(hyper::header::COOKIE, joined);
    }
}

/// What sending a request to one replica came to.
enum Sent {
    /// The replica answered (any status); its HTTP/1.1 connection goes back
    /// to the pool once the answer's body ended.
    Answered(Response<Incoming>, Option<Returning>),
    /// Nothing of the request reached the replica: it may go to another.
    Refused(Box<Request<Incoming>>, String),
    /// The request was under way when it failed: it is not sent again.
    Failed(String),
    /// The replica did not begin its answer within the response timeout:
    /// the request may have reached it, so it is not sent again.
    TimedOut,
}

/// One connection to a replica, through a tunnel.
enum Upstream {
    Http1(hyper::client::conn::http1::SendRequest<Incoming>),
    Http2(hyper::client::conn::http2::SendRequest<Incoming>),
}

type TrySendError = hyper::client::conn::TrySendError<Request<Incoming>>;

impl Upstream {
    /// Speaks HTTP/2 with prior knowledge over `tunnel` when `h2c`, else
    /// HTTP/1.1; the connection runs as a task of its own until it closes.
    async fn handshake(tunnel: Tunnel, h2c: bool) -> Result<Upstream, hyper::Error> {
        let io = TokioIo::new(tunnel);
        if h2c {
            let (sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(connection);
            return Ok(Upstream::Http2(sender));
        }
        let (sender, connection) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(connection);
        Ok(Upstream::Http1(sender))
    }

    /// Sends `request` once the connection takes one (a kept HTTP/1.1
    /// connection once it has read the end of the answer before, an HTTP/2
    /// one once it has a free stream); a request that never left, as on a
    /// connection that closed, is given back in the error.
    async fn send(&mut self, request: Request<Incoming>) -> Result<Response<Incoming>, TrySendError> {
        match self {
            Upstream::Http1(sender) => {
                let _ = sender.ready().await;
                sender.try_send_request(request).await
            }
            Upstream::Http2(sender) => {
                let _ = sender.ready().await;
                sender.try_send_request(request).await
            }
        }
    }
}

/// The most idle HTTP/1.1 connections kept per replica.
const IDLE_PER_REPLICA: usize = 64;

/// How long an idle HTTP/1.1 connection is kept for the next request: what
/// a replica no request reaches any more holds open through its agent.
const IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(90);

/// How often idle HTTP/1.1 connections past [`IDLE_FOR`] are closed.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// An HTTP/1.1 connection waiting for its next request, since when, and
/// the credentials generation its tunnel's agent connection presented.
type Idle = (tokio::time::Instant, u64, hyper::client::conn::http1::SendRequest<Incoming>);

/// Whether `idle` may still take a request at `now`, while the router's
/// credentials are at `generation`: one through a connection made with
/// credentials since reloaded would be cut when they expire.
fn still_kept(now: tokio::time::Instant, generation: u64, idle: &Idle) -> bool {
    idle.1 == generation && still_open(now, idle)
}

/// Whether `idle` is open and was not idle for [`IDLE_FOR`] at `now`.
fn still_open(now: tokio::time::Instant, (since, _, sender): &Idle) -> bool {
    now.duration_since(*since) < IDLE_FOR && !sender.is_closed()
}

/// Connections to replicas kept for the next request, by lease: idle
/// HTTP/1.1 connections, or the one HTTP/2 connection every request shares.
/// A connection is dropped with the route table that stopped naming its
/// replica.
#[derive(Debug, Default)]
struct Pool {
    /// Idle since when, by lease, the most recent last.
    http1: Mutex<HashMap<String, Vec<Idle>>>,
    /// With the credentials generation it was made at (see [`Idle`]).
    http2: Mutex<HashMap<String, (u64, hyper::client::conn::http2::SendRequest<Incoming>)>>,
}

impl Pool {
    fn lock<T>(map: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A kept connection to the replica of `lease_id` that is not closed,
    /// through a tunnel made with credentials of `generation`.
    fn take(&self, lease_id: &str, h2c: bool, generation: u64) -> Option<Upstream> {
        if h2c {
            let mut http2 = Self::lock(&self.http2);
            let (made_at, sender) = http2.get(lease_id)?;
            if sender.is_closed() || *made_at != generation {
                http2.remove(lease_id);
                return None;
            }
            return Some(Upstream::Http2(sender.clone()));
        }
        let mut http1 = Self::lock(&self.http1);
        let idle = http1.get_mut(lease_id)?;
        let now = tokio::time::Instant::now();
        idle.retain(|kept| still_kept(now, generation, kept));
        idle.pop().map(|(_, _, sender)| Upstream::Http1(sender))
    }

    /// Keeps `upstream` for the next request to `lease_id`: the one HTTP/2
    /// connection at once; an HTTP/1.1 one is handed back, to be returned
    /// once the answer it carries ended.
    fn keep(self: &Arc<Self>, lease_id: &str, generation: u64, upstream: Upstream) -> Option<Returning> {
        match upstream {
            Upstream::Http2(sender) => {
                Self::lock(&self.http2).insert(lease_id.to_string(), (generation, sender));
                None
            }
            Upstream::Http1(sender) => {
                Some(Returning { pool: self.clone(), lease_id: lease_id.to_string(), generation, sender })
            }
        }
    }

    /// An HTTP/1.1 connection whose answer ended, idle from now on. (One
    /// made with credentials reloaded since is dropped at the next take or
    /// sweep, which know the current ones.)
    fn put_back(&self, lease_id: String, generation: u64, sender: hyper::client::conn::http1::SendRequest<Incoming>) {
        let mut http1 = Self::lock(&self.http1);
        let idle = http1.entry(lease_id).or_default();
        let now = tokio::time::Instant::now();
        idle.retain(|kept| still_open(now, kept));
        if idle.len() < IDLE_PER_REPLICA {
            idle.push((now, generation, sender));
        }
    }

    /// Drops the HTTP/1.1 connections idle for [`IDLE_FOR`], closed, or
    /// made with credentials other than those of `generation`, and HTTP/2
    /// ones closed or made with other credentials.
    fn sweep(&self, generation: u64) {
        let now = tokio::time::Instant::now();
        Self::lock(&self.http1).retain(|_, idle| {
            idle.retain(|kept| still_kept(now, generation, kept));
            !idle.is_empty()
        });
        Self::lock(&self.http2).retain(|_, (made_at, sender)| *made_at == generation && !sender.is_closed());
    }

    /// Drops the connections of every lease not in `leases`.
    fn retain(&self, leases: &HashSet<&str>) {
        Self::lock(&self.http1).retain(|lease, _| leases.contains(lease.as_str()));
        Self::lock(&self.http2).retain(|lease, _| leases.contains(lease.as_str()));
    }
}

/// An HTTP/1.1 connection to a replica carrying an answer: back to the
/// pool once the answer's body ended, closed if it is dropped before.
struct Returning {
    pool: Arc<Pool>,
    lease_id: String,
    generation: u64,
    sender: hyper::client::conn::http1::SendRequest<Incoming>,
}

/// A replica's answer body, counting its request as under way until it
/// ends or is dropped (see `crate::acks`). Its connection goes back to the
/// pool as its last byte is read, before the client has it: a client's
/// next request finds the connection idle, not one more tunnel opened.
struct Guarded {
    body: Incoming,
    kept: Option<Returning>,
    _inflight: InFlightGuard,
}

impl Guarded {
    fn new(body: Incoming, kept: Option<Returning>, inflight: InFlightGuard) -> Guarded {
        let mut guarded = Guarded { body, kept, _inflight: inflight };
        // An empty body may never be read.
        if hyper::body::Body::is_end_stream(&guarded.body) {
            guarded.ended();
        }
        guarded
    }

    fn ended(&mut self) {
        if let Some(Returning { pool, lease_id, generation, sender }) = self.kept.take() {
            pool.put_back(lease_id, generation, sender);
        }
    }
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended(),
            Poll::Ready(Some(Ok(_))) if self.body.is_end_stream() => self.ended(),
            // A body that broke leaves its connection to close.
            Poll::Ready(Some(Err(_))) => self.kept = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Who sent a request, as the replica is told.
#[derive(Debug, Clone)]
struct Client {
    /// The client's address, as `X-Forwarded-For` names it: made once per
    /// connection, not per request.
    ip: hyper::header::HeaderValue,
    tls: bool,
    /// The `X-Forwarded-Client-Cert` naming the workload that presented its
    /// SVID, if one did.
    workload: Option<hyper::header::HeaderValue>,
    /// When that SVID expires (seconds since the Unix epoch): the
    /// connection is closed then, and the workload dials again with its
    /// renewed one to be named again.
    expires_at: Option<i64>,
}

impl Client {
    fn new(
        addr: std::net::SocketAddr,
        tls: bool,
        workload: Option<hyper::header::HeaderValue>,
        expires_at: Option<i64>,
    ) -> Client {
        let ip = hyper::header::HeaderValue::from_str(&addr.ip().to_string())
            .unwrap_or_else(|_| hyper::header::HeaderValue::from_static("unknown"));
        Client { ip, tls, workload, expires_at }
    }
}

/// The header that names the calling workload to the callee.
const XFCC: &str = "x-forwarded-client-cert";

/// The `X-Forwarded-Client-Cert` value for a client certificate the
/// handshake verified: `Hash=<sha-256 hex>;URI=<SPIFFE ID>` for a workload's
/// SVID, nothing for anything else.
fn xfcc(leaf: &rustls::pki_types::CertificateDer<'_>) -> Option<hyper::header::HeaderValue> {
    let id = berth_mtls::identity_from_cert(leaf)?;
    let workload = id.workload()?;
    let value = format!("Hash={};URI={}", berth_mtls::fingerprint(leaf), workload.uri());
    hyper::header::HeaderValue::from_str(&value).ok()
}

/// Tells the replica who asked and how, as proxies do: `X-Forwarded-For`
/// (the client's address after any the client sent), `-Proto` and `-Host`,
/// and `X-Forwarded-Client-Cert` for a workload that proved who it is (a
/// client's own is never passed on).
fn forwarded_headers<B>(request: &mut Request<B>, host: &str, client: &Client) {
    use hyper::header::HeaderValue;
    let headers = request.headers_mut();
    headers.remove(XFCC);
    if let Some(workload) = &client.workload {
        headers.insert(XFCC, workload.clone());
    }
    let chain = match headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(earlier) if !earlier.is_empty() => {
            HeaderValue::from_str(&format!("{earlier}, {}", client.ip.to_str().unwrap_or_default())).ok()
        }
        _ => Some(client.ip.clone()),
    };
    if let Some(chain) = chain {
        headers.insert("x-forwarded-for", chain);
    }
    headers.insert("x-forwarded-proto", HeaderValue::from_static(if client.tls { "https" } else { "http" }));
    if let Ok(host) = HeaderValue::from_str(host) {
        headers.insert("x-forwarded-host", host);
    }
}

/// The router's own answer.
fn plain(status: StatusCode, text: String) -> Response<Body> {
    let mut response =
        Response::new(Full::new(Bytes::from(format!("{text}\n"))).map_err(|never| match never {}).boxed());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

#[cfg(test)]
mod tests {
    use berth_proto::identity::v1::NodeState;
    use berth_proto::leases::v1::LeasePhase;

    use super::*;
    use crate::routes::tests::{lease, node, service};

    /// A proxy over a table where `web.default` has three replicas (leases
    /// `l-a`, `l-b`, `l-c`), and the requests it counts.
    fn proxy() -> (Arc<Proxy>, Arc<InFlight>) {
        let (proxy, inflight, _) = proxy_and_table();
        (proxy, inflight)
    }

    /// [`proxy`], and the table's sender, for a test that follows it.
    fn proxy_and_table() -> (Arc<Proxy>, Arc<InFlight>, watch::Sender<Arc<RouteTable>>) {
        let mut sources = routes::Sources::default();
        sources.services.insert("/web".into(), service("", "web", "web-00001"));
        for id in ["l-a", "l-b", "l-c"] {
            sources.leases.insert(id.into(), lease(id, "", "web", "web-00001", "n-1", LeasePhase::Running));
        }
        sources.nodes.insert("n-1".into(), node("n-1", NodeState::Up));
        let (sender, table) = watch::channel(Arc::new(RouteTable::build("berth.localhost", &sources)));
        let inflight = InFlight::new(table.clone());
        let ca = berth_mtls::CertificateAuthority::generate("mesh", std::time::Duration::from_secs(600)).unwrap();
        let (cert, key_pem) =
            ca.issue(&berth_core::Identity::router("r").unwrap(), &[], std::time::Duration::from_secs(600)).unwrap();
        let material = berth_mtls::TlsMaterial {
            cert_chain_pem: cert.cert_pem,
            key_pem,
            ca_bundle_pem: ca.cert_pem().to_string(),
        };
        let credentials = TlsCredentials::new(material).unwrap();
        (Proxy::new(table, inflight.clone(), credentials, std::time::Duration::from_secs(1)), inflight, sender)
    }

    #[test]
    fn a_request_is_counted_against_each_replica_it_may_go_to_and_no_other() {
        let (proxy, inflight) = proxy();
        let mut firsts = std::collections::BTreeSet::new();
        for _ in 0..60 {
            let Ok(picked) = proxy.pick("web.default.berth.localhost", &hyper::HeaderMap::new()) else {
                panic!("web has three replicas")
            };
            let tried: std::collections::BTreeMap<String, usize> =
                picked.candidates.iter().map(|(endpoint, _)| (endpoint.lease_id.clone(), 1)).collect();
            assert_eq!(tried.len(), 2, "one replica, then another to retry on");
            assert_eq!(inflight.under_way(), tried, "counted against the replicas it may reach, and no other");
            firsts.insert(picked.candidates[0].0.lease_id.clone());
            drop(picked);
            assert!(inflight.under_way().is_empty(), "a request that ended leaves nothing counted");
        }
        assert_eq!(firsts.len(), 3, "every replica is picked first in turn: {firsts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_connection_with_no_request_head_is_let_go() {
        use tokio::io::AsyncWriteExt as _;
        let (proxy, _) = proxy();
        let client = Client::new("192.0.2.7:40000".parse().unwrap(), false, None, None);
        let limit = CLIENT_IDLE_TIMEOUT * 4;
        // Nothing at all: not yet read as either protocol.
        let (_silent, io) = tokio::io::duplex(4096);
        let started = tokio::time::Instant::now();
        let served =
            tokio::time::timeout(limit, proxy.clone().serve_connection(io, client.clone(), Default::default()));
        assert!(served.await.is_ok(), "a connection that sent nothing is held past {limit:?}");
        assert!(started.elapsed() >= CLIENT_IDLE_TIMEOUT, "let go after {:?}", started.elapsed());
        // Half a request head, as a slow client sends one.
        let (mut slow, io) = tokio::io::duplex(4096);
        slow.write_all(b"GET / HTTP/1.1\r\nHost: web.default.berth.localhost\r\n").await.unwrap();
        let served = tokio::time::timeout(limit, proxy.serve_connection(io, client, Default::default()));
        assert!(served.await.is_ok(), "a connection that never finished its request head is held past {limit:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_workloads_connection_is_closed_when_the_svid_it_was_named_by_expires() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (proxy, _) = proxy();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let workload = hyper::header::HeaderValue::from_static("Hash=00;URI=spiffe://berth.internal/ns/shop/lease/l-1");
        let expires_at = i64::try_from(now).unwrap() + 10;
        let client = Client::new("192.0.2.7:40000".parse().unwrap(), true, Some(workload), Some(expires_at));
        let (mut peer, io) = tokio::io::duplex(4096);
        let started = tokio::time::Instant::now();
        let serving = tokio::spawn(proxy.serve_connection(io, client, Default::default()));
        peer.write_all(b"GET / HTTP/1.1\r\nHost: nowhere.default.berth.localhost\r\n\r\n").await.unwrap();
        let mut answer = [0u8; 512];
        let n = peer.read(&mut answer).await.unwrap();
        assert!(answer[..n].starts_with(b"HTTP/1.1 404"), "{}", String::from_utf8_lossy(&answer[..n]));

        // Kept open for the next request, it is closed once the SVID
        // expired, well before a silent connection would be.
        let ended = tokio::time::timeout(CLIENT_IDLE_TIMEOUT / 2, serving).await;
        assert!(ended.is_ok(), "the connection outlived the SVID it was named by");
        assert!(started.elapsed() >= std::time::Duration::from_secs(9), "closed after {:?}", started.elapsed());
        assert_eq!(peer.read(&mut answer).await.unwrap(), 0, "the client sees its connection end");
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_to_a_replica_is_closed_once_kept_its_time_or_once_the_routers_certificate_renewed() {
        use tokio::io::AsyncReadExt as _;
        let (proxy, _, _table) = proxy_and_table();
        let stop = CancellationToken::new();
        tokio::spawn(proxy.clone().let_go_of_unused(stop.clone()));
        let generation = proxy.credentials.generation();
        let mut replicas = Vec::new();
        for lease in ["l-a", "l-b"] {
            let (replica, io) = tokio::io::duplex(1024);
            let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.unwrap();
            tokio::spawn(connection);
            proxy.pool.put_back(lease.to_string(), generation, sender);
            replicas.push(replica);
        }
        // l-b's connection takes a request half-way through; l-a's none.
        tokio::time::sleep(IDLE_FOR / 2).await;
        let Some(Upstream::Http1(sender)) = proxy.pool.take("l-b", false, generation) else {
            panic!("l-b's connection is kept")
        };
        proxy.pool.put_back("l-b".to_string(), generation, sender);
        tokio::time::sleep(IDLE_FOR / 2 + SWEEP_EVERY).await;

        let mut read = [0u8; 16];
        let (quiet, busy) = replicas.split_at_mut(1);
        let moment = std::time::Duration::from_millis(10);
        let closed = tokio::time::timeout(moment, quiet[0].read(&mut read)).await;
        assert_eq!(closed.ok().map(Result::unwrap), Some(0), "the replica's tunnel is closed, not kept for a request");
        let kept = tokio::time::timeout(moment, busy[0].read(&mut read)).await;
        assert!(kept.is_err(), "one idle for less than {IDLE_FOR:?} stays open");
        let Some(Upstream::Http1(sender)) = proxy.pool.take("l-b", false, generation) else {
            panic!("l-b's connection is kept for the next request")
        };
        proxy.pool.put_back("l-b".to_string(), generation, sender);
        assert!(proxy.pool.take("l-a", false, generation).is_none());

        // The router's certificate is renewed: l-b's tunnel, on a connection
        // that presented the one before, is closed at the next sweep, not
        // cut under a request when the agent closes that connection.
        proxy.credentials.reload(proxy.credentials.material()).unwrap();
        tokio::time::sleep(SWEEP_EVERY).await;
        let closed = tokio::time::timeout(moment, busy[0].read(&mut read)).await;
        assert_eq!(closed.ok().map(Result::unwrap), Some(0), "a tunnel made with renewed-away credentials is closed");
        let renewed = proxy.credentials.generation();
        assert!(proxy.pool.take("l-b", false, renewed).is_none());

        // A connection that carried an answer across the renewal comes back
        // after one made since: it is not taken, and drops nothing.
        let connect = async || {
            let (replica, io) = tokio::io::duplex(1024);
            let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.unwrap();
            tokio::spawn(connection);
            (replica, sender)
        };
        let ((mut fresh, new), (mut stale, old)) = (connect().await, connect().await);
        proxy.pool.put_back("l-c".to_string(), renewed, new);
        proxy.pool.put_back("l-c".to_string(), generation, old);
        let taken = proxy.pool.take("l-c", false, renewed);
        assert!(taken.is_some(), "the connection made with the renewed certificate is kept");
        let closed = tokio::time::timeout(moment, stale.read(&mut read)).await;
        assert_eq!(closed.ok().map(Result::unwrap), Some(0), "the one made with the certificate before is closed");
        assert!(tokio::time::timeout(moment, fresh.read(&mut read)).await.is_err());
        stop.cancel();
    }

    #[test]
    fn the_replica_sees_the_host_it_was_routed_by_and_one_cookie_header() {
        let host = "shop.default.berth.localhost";
        // An absolute URI names where it is routed; a Host beside it is the client's word only.
        let request =
            Request::builder().uri(format!("http://{host}/reset")).header("host", "evil.example").body(()).unwrap();
        let sent = upstream_request(request, host, false);
        assert_eq!(sent.uri(), "/reset");
        assert_eq!(sent.headers().get_all("host").iter().collect::<Vec<_>>(), [host]);
        let sent = upstream_request(
            Request::builder().uri(format!("http://{host}/reset")).header("host", "evil.example").body(()).unwrap(),
            host,
            true,
        );
        assert_eq!(sent.uri().to_string(), format!("http://{host}/reset"));
        assert_eq!(sent.headers().get("host"), None, "HTTP/2 names the host in :authority alone");

        // An HTTP/2 client may split its cookies into fields of their own.
        let request = Request::builder()
            .version(Version::HTTP_2)
            .uri(format!("https://{host}/"))
            .header("cookie", "a=1")
            .header("cookie", "b=2")
            .body(())
            .unwrap();
        let sent = upstream_request(request, host, false);
        assert_eq!(sent.headers().get_all("cookie").iter().collect::<Vec<_>>(), ["a=1; b=2"]);
        assert_eq!(sent.version(), Version::HTTP_11);
    }

    #[test]
    fn only_a_named_upgrade_other_than_h2c_switches_and_connection_options_go_no_further() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut headers = hyper::HeaderMap::new();
            for (name, value) in pairs {
                headers.append(hyper::header::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
            }
            headers
        };
        assert!(switches_protocols(&headers(&[("connection", "Upgrade"), ("upgrade", "websocket")])));
        assert!(switches_protocols(&headers(&[("connection", "keep-alive, upgrade"), ("upgrade", "echo")])));
        assert!(!switches_protocols(&headers(&[("upgrade", "websocket")])), "an upgrade the client did not name");
        assert!(
            !switches_protocols(&headers(&[("connection", "Upgrade, HTTP2-Settings"), ("upgrade", "h2c")])),
            "curl --http2 asks for h2c: served as the HTTP/1.1 it also is"
        );

        let mut asked = headers(&[
            ("connection", "Upgrade, HTTP2-Settings, x-trace"),
            ("upgrade", "h2c"),
            ("http2-settings", "AAMAAABkAAQCAAAAAAIAAAAA"),
            ("x-trace", "1"),
            ("keep-alive", "timeout=5"),
            ("x-kept", "yes"),
        ]);
        strip_hop_by_hop(&mut asked);
        assert_eq!(asked.keys().map(|name| name.as_str()).collect::<Vec<_>>(), ["x-kept"]);
    }

    #[test]
    fn a_session_key_is_the_header_or_cookie_and_a_client_without_the_cookie_is_given_one() {
        let mut headers = hyper::HeaderMap::new();
        headers.insert("x-user", " alice ".parse().unwrap());
        headers.append(hyper::header::COOKIE, "theme=dark; session=abc".parse().unwrap());
        headers.append(hyper::header::COOKIE, "other=\"quoted\"".parse().unwrap());
        let header = routes::Affinity::Header("x-user".into());
        assert_eq!(session_key(&header, &headers), (Some("alice".into()), None));
        let cookie = |name: &str| session_key(&routes::Affinity::Cookie(name.into()), &headers);
        assert_eq!(cookie("session"), (Some("abc".into()), None));
        assert_eq!(cookie("other"), (Some("quoted".into()), None));
        assert_eq!(session_key(&routes::Affinity::Header("x-none".into()), &headers), (None, None));

        let (key, set) = cookie("berth-session");
        let key = key.unwrap();
        assert_eq!(key.len(), 32, "{key}");
        let set = set.unwrap();
        assert_eq!(set.to_str().unwrap(), format!("berth-session={key}; Path=/; HttpOnly; SameSite=Lax"));
        assert_ne!(cookie("berth-session").0.unwrap(), key, "each client without one gets its own");
    }

    #[test]
    fn a_replica_is_told_who_asked_after_any_proxy_before_and_how() {
        let client = Client::new("192.0.2.7:40000".parse().unwrap(), true, None, None);
        let mut request = Request::builder().header("x-forwarded-for", "198.51.100.1").body(()).unwrap();
        forwarded_headers(&mut request, "hello.default.berth.localhost", &client);
        let header = |name: &str| request.headers().get(name).unwrap().to_str().unwrap().to_string();
        assert_eq!(header("x-forwarded-for"), "198.51.100.1, 192.0.2.7");
        assert_eq!(header("x-forwarded-proto"), "https");
        assert_eq!(header("x-forwarded-host"), "hello.default.berth.localhost");

        let mut request = Request::builder().body(()).unwrap();
        forwarded_headers(&mut request, "h", &Client { tls: false, ..client.clone() });
        assert_eq!(request.headers().get("x-forwarded-for").unwrap(), "192.0.2.7");
        assert_eq!(request.headers().get("x-forwarded-proto").unwrap(), "http");
    }

    #[test]
    fn only_a_workload_that_proved_who_it_is_is_named_to_the_callee() {
        let ca = berth_mtls::CertificateAuthority::generate("workloads", std::time::Duration::from_secs(600)).unwrap();
        let (csr, _key) = berth_mtls::generate_csr("l-1").unwrap();
        let id = berth_core::WorkloadId::parse("spiffe://berth.internal/ns/shop/svc/web/lease/l-1").unwrap();
        let svid = ca.sign_svid_csr(&csr, &id, std::time::Duration::from_secs(60)).unwrap();
        let leaf = berth_mtls::certs_from_pem("svid", &svid.cert_pem).unwrap().remove(0);
        let named = xfcc(&leaf).unwrap();
        let expected = format!("Hash={};URI={}", berth_mtls::fingerprint(&leaf), id.uri());
        assert_eq!(named.to_str().unwrap(), expected);
        let (mesh, _) =
            ca.issue(&berth_core::Identity::admin("ops").unwrap(), &[], std::time::Duration::from_secs(60)).unwrap();
        let mesh = berth_mtls::certs_from_pem("mesh", &mesh.cert_pem).unwrap().remove(0);
        assert_eq!(xfcc(&mesh), None, "a mesh identity is no workload");

        let forged =
            || Request::builder().header(XFCC, "URI=spiffe://berth.internal/ns/bank/lease/l-9").body(()).unwrap();
        let anonymous = Client::new("192.0.2.7:40000".parse().unwrap(), true, None, None);
        let mut request = forged();
        forwarded_headers(&mut request, "h", &anonymous);
        assert_eq!(request.headers().get(XFCC), None, "a client's own claim is dropped");
        let mut request = forged();
        forwarded_headers(&mut request, "h", &Client { workload: Some(named), ..anonymous });
        assert_eq!(request.headers().get_all(XFCC).iter().map(|v| v.to_str().unwrap()).collect::<Vec<_>>(), [expected]);
    }
}
