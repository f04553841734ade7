//! The mTLS listener: accepts TCP, runs each TLS handshake in its own task
//! with a deadline, and hands the server only connections that finished it,
//! each tagged with the identity its certificate names.
//!
//! # Invariants
//! - The server configuration is read from the [`TlsCredentials`] on every
//!   handshake, so a reloaded certificate or trust bundle is in force for the
//!   next connection without restarting the listener.
//! - A slow or silent client costs one task until [`HANDSHAKE_TIMEOUT`], and
//!   never delays other clients' handshakes.
//! - A peer is admitted for as long as its certificate is valid, not for as
//!   long as it keeps its connection: the server closes a connection once
//!   its peer's certificate expired (see [`certificate_expired`]), and the
//!   peer's next handshake needs a certificate valid then. Short-lived
//!   certificates are how the mesh limits a leaked key, so a connection
//!   held open must not outlive them.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use berth_core::Identity;
use berth_mtls::{TlsCredentials, cert_validity, identity_from_cert};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::threads::ServingThreads;

/// How long a client has to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Finished handshakes waiting for the server to pick them up.
const ACCEPT_BACKLOG: usize = 256;

/// Who is on the other end of a connection; the server puts it in every
/// request's extensions.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// The peer's address.
    pub remote_addr: SocketAddr,
    /// The berth identity its verified certificate names; `None` when it
    /// presented no certificate.
    pub identity: Option<Identity>,
    /// When its certificate was issued (its notBefore), seconds since the
    /// Unix epoch; `None` when it presented none. A node's certificates
    /// issued before its floor are refused (see [`Revocations`](crate::Revocations)).
    pub issued_at: Option<i64>,
    /// When its certificate expires (its notAfter), seconds since the Unix
    /// epoch; `None` when it presented none. Its connection is closed then.
    pub expires_at: Option<i64>,
}

/// Certificates valid for longer than this from a connection's start keep
/// no timer: no connection is expected to last that long, and tokio's timer
/// takes deadlines within about two years.
const LONGEST_EXPIRY_WAIT: Duration = Duration::from_secs(366 * 24 * 3600);

/// How long the calls under way on a connection whose peer's certificate
/// expired may take to finish once it is told (GOAWAY) to start no new one;
/// then it is closed.
pub const EXPIRED_GRACE: Duration = Duration::from_secs(5);

/// Completes once a certificate valid until `expires_at` (seconds since the
/// Unix epoch, as [`PeerInfo::expires_at`]) has expired, by this host's
/// clock, the one its handshakes are checked against; never for `None`, or
/// for one valid for over a year more.
pub async fn certificate_expired(expires_at: Option<i64>) {
    // A connection with no certificate (every cleartext one of the router's)
    // reads no clock.
    let Some(at) = expires_at else { return std::future::pending().await };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let left = Duration::from_secs(u64::try_from(at).unwrap_or(0)).saturating_sub(now);
    if left > LONGEST_EXPIRY_WAIT {
        return std::future::pending().await;
    }
    // The last whole second of a notAfter is still within it.
    tokio::time::sleep(left + Duration::from_secs(1)).await;
}

/// A bound TCP socket and the credentials its handshakes use.
#[derive(Debug)]
pub struct Listener {
    tcp: TcpListener,
    credentials: TlsCredentials,
}

impl Listener {
    /// Binds `addr` (port 0 picks a free port).
    pub async fn bind(addr: SocketAddr, credentials: TlsCredentials) -> io::Result<Self> {
        let tcp = TcpListener::bind(addr).await?;
        Ok(Self { tcp, credentials })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Starts accepting; the stream ends when `stop` is cancelled. With
    /// `threads`, each connection is dealt to one of them before its
    /// handshake, and is served there (see [`MtlsStream::thread`]).
    pub(crate) fn incoming(
        self,
        stop: CancellationToken,
        threads: Option<Arc<ServingThreads>>,
    ) -> ReceiverStream<MtlsStream> {
        let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop.cancelled() => break,
                    accepted = self.tcp.accept() => accepted,
                };
                let (tcp, remote_addr) = match accepted {
                    Ok(conn) => conn,
                    Err(error) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = tokio_rustls::TlsAcceptor::from(self.credentials.server_config());
                let tx = tx.clone();
                match &threads {
                    None => {
                        tokio::spawn(handshake(acceptor, tcp, remote_addr, None, tx));
                    }
                    Some(threads) => {
                        let dealt = threads
                            .deal(tcp, move |thread, tcp| handshake(acceptor, tcp, remote_addr, Some(thread), tx));
                        if let Err(error) = dealt {
                            tracing::warn!(%remote_addr, %error, "cannot hand a connection to a serving thread");
                        }
                    }
                }
            }
        });
        ReceiverStream::new(rx)
    }
}

/// Completes `tcp`'s TLS handshake and sends it on as an [`MtlsStream`]
/// served on `thread`.
async fn handshake(
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: TcpStream,
    remote_addr: SocketAddr,
    thread: Option<usize>,
    tx: mpsc::Sender<MtlsStream>,
) {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => {
            let leaf = tls.get_ref().1.peer_certificates().and_then(|certs| certs.first());
            let identity = leaf.and_then(identity_from_cert);
            let validity = leaf.and_then(|cert| cert_validity(cert).ok());
            let (issued_at, expires_at) = (validity.map(|(from, _)| from), validity.map(|(_, to)| to));
            let info = PeerInfo { remote_addr, identity, issued_at, expires_at };
            let _ = tx.send(MtlsStream { tls, info, thread }).await;
        }
        Ok(Err(error)) => tracing::debug!(%remote_addr, %error, "tls handshake refused"),
        Err(_) => tracing::debug!(%remote_addr, "tls handshake timed out"),
    }
}

/// A connection that finished its handshake.
#[derive(Debug)]
pub(crate) struct MtlsStream {
    tls: TlsStream<TcpStream>,
    info: PeerInfo,
    /// The serving thread whose runtime its socket is registered with.
    thread: Option<usize>,
}

impl MtlsStream {
    /// Who is on the other end.
    pub(crate) fn info(&self) -> &PeerInfo {
        &self.info
    }

    /// The serving thread it must be served on, if it was dealt to one.
    pub(crate) fn thread(&self) -> Option<usize> {
        self.thread
    }
}

impl AsyncRead for MtlsStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl AsyncWrite for MtlsStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tls).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tls).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tls.is_write_vectored()
    }
}
