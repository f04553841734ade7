//! A tenant's resolver: the DNS server the agent runs inside each isolated
//! tenant's network namespace, at [`RESOLVER_ADDR`], so a workload's names
//! follow its project's DNS config and egress routes instead of the host's.
//!
//! # What it answers
//! - A query for a name some service of the tenant may reach through its
//!   proxy (see [`TenantRules::decide_name`]) is forwarded, as sent, to the
//!   project's upstreams in order (the DNS config in its egress plan), and
//!   the first answer is relayed as it came. No upstream answering within
//!   [`UPSTREAM_TIMEOUT`] each is `SERVFAIL`.
//! - A name no route lets the tenant reach is `REFUSED`, and logged like a
//!   proxy refusal, naming the tenant and why: DNS is no side channel out of
//!   an isolated tenant (a query never leaves the node for a refused name).
//! - A project with no upstream resolves nothing outside berth (`REFUSED`).
//! - Names under `berth.internal` are berth's own and never forwarded.
//!   `<service>.<project>.berth.internal` (and `<tag>--<service>...`) is
//!   answered with [`SERVICES_ADDR`], where the agent forwards every
//!   connection to the router, which serves the service by that host name:
//!   an `A` record, authoritative, [`SERVICE_TTL`]; other types have no
//!   data. Any other name in the zone does not exist (`NXDOMAIN`). A node
//!   told of no router refuses them (`REFUSED`, logged).
//!
//! # Why one address for every service
//! The record names the way to the router, not a replica: the router
//! follows revisions and leases by watch, so a rollout moves the traffic
//! within the second without any resolver or client cache to expire, and
//! a workload sees the same split, tags and draining as anyone outside.
//! Whether a service exists is the router's answer (404 naming what it
//! looked for), not the resolver's: a name a workload resolved before its
//! service was applied works once it is.
//! - A message that is no query is `FORMERR` or `NOTIMP`; one too short to
//!   carry an id is dropped.
//!
//! # Invariants
//! - The policy is read at each query from the tenant's current rules and
//!   upstreams, so an edit applies to the next query, no workload restarts.
//! - The sockets were opened inside the tenant's namespace; the queries to
//!   upstreams leave from the agent's own, like the proxy's connections.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use berth_core::SERVICE_ZONE;
use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::rules::{TenantRules, Verdict};

/// Where a tenant's resolver listens inside its namespace (UDP and TCP), as
/// `systemd-resolved` does on a host: the address its `resolv.conf` names.
pub(crate) const RESOLVER_ADDR: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)), 53);

/// Where the tenant's resolver also listens: a microVM guest reaches its
/// namespace's `127.0.0.1` (at its gateway) and nothing else of its
/// loopback.
pub(crate) const GUEST_RESOLVER_ADDR: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 53);

/// The address a service's internal name resolves to inside a tenant's
/// namespace, where the agent forwards connections to the router (see
/// [`super::netns::Namespaces::listen_at`]); port [`SERVICES_PORT`].
pub(crate) const SERVICES_ADDR: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 54);

/// The port a workload reaches services on at [`SERVICES_ADDR`]: plain
/// HTTP/1.1, or HTTP/2 with prior knowledge (gRPC).
pub(crate) const SERVICES_PORT: u16 = 80;

/// How long a client may keep a service's record: it never changes while
/// the node serves services, so only a node's router setting bounds it.
const SERVICE_TTL: u32 = 30;

/// How long one upstream has to answer before the next is asked.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest DNS message over UDP taken or relayed (EDNS0's common size).
const MAX_UDP: usize = 4096;

/// How long a TCP client may take to send its query.
const TCP_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What a tenant's resolver reads at each query.
#[derive(Debug, Clone)]
pub(crate) struct TenantDns {
    pub(crate) rules: watch::Receiver<Arc<TenantRules>>,
    pub(crate) upstreams: watch::Receiver<Arc<Vec<SocketAddr>>>,
    /// The address services' internal names resolve to, when the node
    /// forwards [`SERVICES_ADDR`] to a router ([`SERVICES_ADDR`] itself for
    /// the resolver replicas' `resolv.conf` names; for a microVM guest's, the
    /// address QEMU relays there); `None` when the node is told of no router.
    pub(crate) services: Option<Ipv4Addr>,
}

/// The upstreams a plan's DNS config names; ones that do not parse are
/// left out (the egress service stores them canonical).
pub(crate) fn upstreams(dns: Option<&berth_proto::egress::v1::DnsConfig>) -> Vec<SocketAddr> {
    dns.map(|dns| dns.upstreams.iter().filter_map(|u| u.parse().ok()).collect()).unwrap_or_default()
}

/// The `resolv.conf` a tenant's contained replicas see at
/// `/etc/resolv.conf`: its resolver, and its project's search domains and
/// ndots (1 when the plan names none).
pub(crate) fn resolv_conf(dns: Option<&berth_proto::egress::v1::DnsConfig>) -> String {
    let mut text = String::from("# The berth agent's resolver for this project (its DNS config).\n");
    text.push_str(&format!("nameserver {}\n", RESOLVER_ADDR.ip()));
    let search = dns.map(|dns| dns.search.join(" ")).unwrap_or_default();
    if !search.is_empty() {
        text.push_str(&format!("search {search}\n"));
    }
    text.push_str(&format!("options ndots:{}\n", dns.and_then(|dns| dns.ndots).unwrap_or(1)));
    text
}

/// Writes `text` over the file at `path` in place: a file bound into
/// running containers keeps its inode, so they read the new text.
pub(crate) async fn write_in_place(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await?;
    }
    let mut file = tokio::fs::OpenOptions::new().write(true).create(true).truncate(true).open(path).await?;
    file.write_all(text.as_bytes()).await?;
    file.sync_data().await
}

/// Serves `udp` and `tcp` for one tenant until `stop`.
pub(crate) fn serve(
    tenant: String,
    dns: TenantDns,
    udp: UdpSocket,
    tcp: TcpListener,
    tasks: &TaskTracker,
    stop: CancellationToken,
) {
    let tenant: Arc<str> = tenant.into();
    tasks.spawn(serve_udp(tenant.clone(), dns.clone(), Arc::new(udp), stop.clone()));
    tasks.spawn(serve_tcp(tenant, dns, tcp, stop));
}

async fn serve_udp(tenant: Arc<str>, dns: TenantDns, socket: Arc<UdpSocket>, stop: CancellationToken) {
    let mut buffer = vec![0u8; MAX_UDP];
    loop {
        let received = tokio::select! {
            () = stop.cancelled() => return,
            received = socket.recv_from(&mut buffer) => received,
        };
        let (len, client) = match received {
            Ok(received) => received,
            Err(error) => {
                tracing::debug!(%tenant, %error, "the tenant resolver's socket failed a read");
                continue;
            }
        };
        let query = buffer[..len].to_vec();
        let (tenant, dns, socket) = (tenant.clone(), dns.clone(), socket.clone());
        tokio::spawn(async move {
            if let Some(reply) = answer(&tenant, &dns, &query, Transport::Udp).await {
                let _ = socket.send_to(&reply, client).await;
            }
        });
    }
}

async fn serve_tcp(tenant: Arc<str>, dns: TenantDns, listener: TcpListener, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((mut stream, _)) = accepted else { continue };
        let (tenant, dns) = (tenant.clone(), dns.clone());
        tokio::spawn(async move {
            let Ok(Ok(query)) = tokio::time::timeout(TCP_READ_TIMEOUT, read_framed(&mut stream)).await else { return };
            if let Some(reply) = answer(&tenant, &dns, &query, Transport::Tcp).await {
                let _ = write_framed(&mut stream, &reply).await;
            }
        });
    }
}

/// How a query came, and so how it is forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

/// The reply to one query, or `None` to drop it.
async fn answer(tenant: &str, dns: &TenantDns, query: &[u8], transport: Transport) -> Option<Vec<u8>> {
    let id = u16::from_be_bytes([*query.first()?, *query.get(1)?]);
    let Ok(message) = Message::from_vec(query) else {
        return reply(id, OpCode::Query, ResponseCode::FormErr, None);
    };
    let op_code = message.metadata.op_code;
    if message.metadata.message_type != MessageType::Query || op_code != OpCode::Query {
        return reply(id, op_code, ResponseCode::NotImp, Some(&message));
    }
    let [question] = message.queries.as_slice() else {
        return reply(id, op_code, ResponseCode::FormErr, Some(&message));
    };
    let name = question.name().to_lowercase().to_ascii();
    let name = name.trim_end_matches('.');
    if let Some(service) = in_service_zone(name) {
        return answer_internal(tenant, dns, service, &message);
    }
    if let Verdict::Refused { reason } = dns.rules.borrow().decide_name(name) {
        tracing::info!(%tenant, %name, %reason, "DNS query refused");
        return reply(id, op_code, ResponseCode::Refused, Some(&message));
    }
    let upstreams = dns.upstreams.borrow().clone();
    if upstreams.is_empty() {
        tracing::info!(%tenant, %name, "DNS query refused: the project's DNS config names no upstream");
        return reply(id, op_code, ResponseCode::Refused, Some(&message));
    }
    for upstream in upstreams.iter() {
        let forwarded = match transport {
            Transport::Udp => forward_udp(*upstream, query, id).await,
            Transport::Tcp => forward_tcp(*upstream, query).await,
        };
        match forwarded {
            Ok(answer) => return Some(answer),
            Err(error) => tracing::warn!(%tenant, %name, %upstream, %error, "an upstream resolver did not answer"),
        }
    }
    reply(id, op_code, ResponseCode::ServFail, Some(&message))
}

/// What precedes the service zone in `name` (`""` for the zone itself),
/// when `name` is in it.
fn in_service_zone(name: &str) -> Option<&str> {
    if name == SERVICE_ZONE {
        return Some("");
    }
    name.strip_suffix(SERVICE_ZONE)?.strip_suffix('.')
}

/// The answer to a query for `service` (what precedes the zone) in the
/// service zone.
fn answer_internal(tenant: &str, dns: &TenantDns, service: &str, query: &Message) -> Option<Vec<u8>> {
    let (id, op_code) = (query.metadata.id, query.metadata.op_code);
    let well_formed = service
        .split_once('.')
        .is_some_and(|(label, project)| !label.is_empty() && !project.is_empty() && !project.contains('.'));
    if !well_formed {
        let mut message = reply_message(id, op_code, ResponseCode::NXDomain, Some(query));
        message.metadata.authoritative = true;
        return message.to_vec().ok();
    }
    let Some(services) = dns.services else {
        tracing::info!(%tenant, %service, "DNS query for a service refused: this node is told of no router");
        return reply(id, op_code, ResponseCode::Refused, Some(query));
    };
    let mut message = reply_message(id, op_code, ResponseCode::NoError, Some(query));
    message.metadata.authoritative = true;
    if let Some(question) = query.queries.first()
        && question.query_type() == RecordType::A
    {
        message.add_answer(Record::from_rdata(question.name().clone(), SERVICE_TTL, RData::A(A(services))));
    }
    message.to_vec().ok()
}

/// A reply with `code` to the query `id` (echoing its question when it
/// could be read).
fn reply(id: u16, op_code: OpCode, code: ResponseCode, query: Option<&Message>) -> Option<Vec<u8>> {
    reply_message(id, op_code, code, query).to_vec().ok()
}

/// The reply [`reply`] encodes, to add to.
fn reply_message(id: u16, op_code: OpCode, code: ResponseCode, query: Option<&Message>) -> Message {
    let mut message = Message::error_msg(id, op_code, code);
    if let Some(query) = query {
        message.metadata.recursion_desired = query.metadata.recursion_desired;
        message.add_queries(query.queries.iter().cloned());
    }
    message.metadata.recursion_available = true;
    message
}

async fn forward_udp(upstream: SocketAddr, query: &[u8], id: u16) -> std::io::Result<Vec<u8>> {
    let local: SocketAddr =
        if upstream.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { "[::]:0".parse().unwrap_or(upstream) };
    let socket = UdpSocket::bind(local).await?;
    socket.connect(upstream).await?;
    socket.send(query).await?;
    let mut buffer = vec![0u8; MAX_UDP];
    tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        loop {
            let len = socket.recv(&mut buffer).await?;
            // Only the answer to this query: a stray datagram is no answer.
            if len >= 2 && buffer[..2] == id.to_be_bytes() {
                return Ok(buffer[..len].to_vec());
            }
        }
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time"))?
}

async fn forward_tcp(upstream: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        let mut stream = TcpStream::connect(upstream).await?;
        write_framed(&mut stream, query).await?;
        read_framed(&mut stream).await
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time"))?
}

/// One DNS message over TCP: a two-byte length, then the message.
async fn read_framed(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = stream.read_u16().await?;
    let mut message = vec![0u8; usize::from(len)];
    stream.read_exact(&mut message).await?;
    Ok(message)
}

async fn write_framed(stream: &mut TcpStream, message: &[u8]) -> std::io::Result<()> {
    let len =
        u16::try_from(message.len()).map_err(|_| std::io::Error::other("a DNS message longer than 65535 bytes"))?;
    stream.write_u16(len).await?;
    stream.write_all(message).await
}

#[cfg(test)]
mod tests;
