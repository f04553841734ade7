//! A front for a service's replicas: a TCP proxy on one port that hands
//! each new connection to a replica that accepts it, as a Kubernetes
//! Service or a load balancer does in production. Clients, agents and the
//! services themselves dial a service through its front, so killing one
//! replica leaves them the others.
//!
//! # Expected flow
//! Each accepted connection is offered to the replicas round-robin; a
//! replica that refuses (it was killed) or does not answer within
//! [`CONNECT_TIMEOUT`] is skipped. Bytes are copied both ways until either
//! side closes; TLS runs end to end, so the replicas' certificates must
//! name the address the front is dialled by.
//!
//! # Source addresses
//! Identity limits join attempts per peer address, so the front dials the
//! replica from an address that tells clients apart: a loopback client's
//! own address (`127.x.y.z` are all this host), and for a client in a node
//! network namespace `127.3.<c>.<d>` after its `a.b.c.d`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;

/// How long dialling one replica may take before the next is tried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A TCP front for a set of replicas; stops when dropped.
#[derive(Debug)]
pub struct Front {
    name: String,
    port: u16,
    backends: Arc<RwLock<Vec<SocketAddr>>>,
    shutdown: CancellationToken,
}

impl Front {
    /// Listens on a free port on `127.0.0.1` and, with the same port, on
    /// each of `extra` (e.g. the bridge address agents in namespaces dial).
    pub async fn bind(name: impl Into<String>, extra: &[Ipv4Addr]) -> anyhow::Result<Self> {
        let name = name.into();
        let first = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .with_context(|| format!("cannot bind the front of {name}"))?;
        let port = first.local_addr()?.port();
        let mut listeners = vec![first];
        for ip in extra {
            listeners.push(
                TcpListener::bind((*ip, port))
                    .await
                    .with_context(|| format!("cannot bind the front of {name} on {ip}:{port}"))?,
            );
        }
        let backends = Arc::new(RwLock::new(Vec::new()));
        let shutdown = CancellationToken::new();
        let next = Arc::new(AtomicUsize::new(0));
        for listener in listeners {
            tokio::spawn(accept_loop(listener, backends.clone(), next.clone(), shutdown.clone()));
        }
        Ok(Self { name, port, backends, shutdown })
    }

    /// The port the front listens on, on every address it binds.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// The service it fronts.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Replaces the replicas new connections go to.
    pub fn set_backends(&self, backends: Vec<SocketAddr>) {
        *self.backends.write().unwrap_or_else(std::sync::PoisonError::into_inner) = backends;
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    backends: Arc<RwLock<Vec<SocketAddr>>>,
    next: Arc<AtomicUsize>,
    shutdown: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((client, peer)) = accepted else { continue };
        let candidates = {
            let all = backends.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            let start = if all.is_empty() { 0 } else { next.fetch_add(1, Ordering::Relaxed) % all.len() };
            all.iter().cycle().skip(start).take(all.len()).copied().collect::<Vec<_>>()
        };
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let Some(mut upstream) = dial_any(&candidates, source_for(peer.ip())).await else { return };
            let mut client = client;
            let _ = client.set_nodelay(true);
            tokio::select! {
                () = shutdown.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
            }
        });
    }
}

/// The first of `candidates` that accepts a connection from `source`.
async fn dial_any(candidates: &[SocketAddr], source: Ipv4Addr) -> Option<TcpStream> {
    for backend in candidates {
        let attempt = async {
            let socket = TcpSocket::new_v4()?;
            // Falls back to the kernel's choice if the source cannot be bound.
            let _ = socket.bind(SocketAddr::from((source, 0)));
            socket.connect(*backend).await
        };
        if let Ok(Ok(stream)) = tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            let _ = stream.set_nodelay(true);
            return Some(stream);
        }
    }
    None
}

/// The loopback address a connection from `peer` is passed on from.
fn source_for(peer: IpAddr) -> Ipv4Addr {
    match peer {
        IpAddr::V4(ip) if ip.is_loopback() => ip,
        IpAddr::V4(ip) => {
            let [_, _, c, d] = ip.octets();
            Ipv4Addr::new(127, 3, c, d)
        }
        IpAddr::V6(_) => Ipv4Addr::LOCALHOST,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_keep_distinct_source_addresses() {
        assert_eq!(source_for(IpAddr::V4(Ipv4Addr::new(127, 77, 0, 5))), Ipv4Addr::new(127, 77, 0, 5));
        assert_eq!(source_for(IpAddr::V4(Ipv4Addr::new(10, 231, 4, 12))), Ipv4Addr::new(127, 3, 4, 12));
        assert_eq!(source_for(IpAddr::V4(Ipv4Addr::new(10, 231, 4, 13))), Ipv4Addr::new(127, 3, 4, 13));
    }
}
