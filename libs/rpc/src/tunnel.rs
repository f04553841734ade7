//! The caller's side of an agent's data plane (`berth.agent.v1.DataPlane`):
//! a `Tunnel` stream to one port of one replica, read and written as a byte
//! stream, so any HTTP or TCP client can run over it.
//!
//! # Why below tonic
//! A tunnel is one gRPC call whose messages carry bytes. Through a tonic
//! channel every write became a message sent on a channel to the call's
//! request body, which hyper polls in a task of its own before h2 queues
//! it, and every read went through tonic's decoder: on a routed HTTP/1.1
//! request that task hand-off and the framing cost the router about 2-3 µs
//! of its 22 (BENCHMARKS.md, "The tunnel written straight onto its HTTP/2
//! stream"). A [`Connection`] is the caller's own HTTP/2 connection to an
//! agent, made with the same mTLS configuration, and a [`Tunnel`] writes
//! and reads the same gRPC frames (`TunnelFrame`, each behind gRPC's
//! 5-byte prefix) straight on its h2 stream: the wire and the agent are
//! what they were. What the tonic channel gave every call the connection
//! keeps: the caller's trace context on each `Tunnel` call, in a
//! `grpc.client` span; keep-alive pings that end a connection whose agent
//! stopped answering; and the bound on reset streams h2 remembers.
//!
//! # Invariants
//! - [`Connection::open`] returns only once the agent connected to the
//!   replica: an error means no byte reached it, and the caller may try
//!   another. [`OpenError::Broke`] says the connection failed under the
//!   call (the agent restarted, or closed it): a fresh one may be tried.
//! - A tunnel shut down before it is dropped closes its stream, never
//!   resets it: the replica's side is read to its end in the background
//!   (within [`CLOSE_GRACE`]). A tunnel dropped without a shutdown (its
//!   caller gave up on it) is reset at once, so the replica stops sending.
//!   A caller keeps one connection per agent (per serving thread) for all
//!   its tunnels, and a
//!   replica that says `Connection: close` ends one tunnel per request:
//!   each reset that can be avoided is one fewer frame the agent may send
//!   after it, and h2 ends a connection, with every tunnel on it, once
//!   such frames made it reset 1024 streams.
//! - A tunnel the agent ends with a status other than OK reads as an error
//!   naming it, never as a clean end.
//! - A message from the agent is taken only as an agent sends it: one
//!   longer than `MAX_MESSAGE_BYTES` (a frame of [`CHUNK_BYTES`] and its
//!   encoding), or compressed, fails the tunnel as soon as its prefix is
//!   read, so a faulty agent cannot make a caller buffer what it claims.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use berth_mtls::TlsCredentials;
use berth_proto::agent::v1::{TunnelFrame, TunnelOpen};
use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use prost::Message as _;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::Instrument as _;

/// The most bytes one frame carries, either way: a caller's writes are
/// cut to it, and the agent reads a replica in chunks of it (its data
/// plane uses this constant).
pub const CHUNK_BYTES: usize = 64 * 1024;

/// The longest message an agent sends: one frame of [`CHUNK_BYTES`], with
/// room for its field's key and length (6 bytes) and to spare.
const MAX_MESSAGE_BYTES: usize = CHUNK_BYTES + 64;

/// How long a dropped tunnel waits for the replica's side to end.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// How much one tunnel, and all of a connection's, may receive before the
/// caller reads it.
const STREAM_WINDOW_BYTES: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW_BYTES: u32 = 5 * 1024 * 1024;

/// The call every tunnel is.
pub const TUNNEL_PATH: &str = "/berth.agent.v1.DataPlane/Tunnel";

/// gRPC's prefix before each message: a compression flag and a length.
const PREFIX_BYTES: usize = 5;

/// Why a tunnel did not open. Either way no byte reached the replica.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The connection failed under the call, or was already closed: a
    /// fresh connection may succeed.
    #[error("the connection to the agent broke: {0}")]
    Broke(String),
    /// The agent answered with this status (no such lease, not running,
    /// nothing accepts on the port), or did not answer in time.
    #[error("{}: {}", .0.code(), .0.message())]
    Refused(tonic::Status),
}

/// One HTTP/2 connection to an agent's data plane, over mTLS, that any
/// number of tunnels share. Dropped (every clone), it takes no new tunnel
/// and closes once the tunnels under way on it end.
#[derive(Debug, Clone)]
pub struct Connection {
    sender: h2::client::SendRequest<Bytes>,
    authority: String,
    /// The generation of the credentials it presented.
    credentials_generation: u64,
    /// Cancelled once the connection ended, or a ping went unanswered.
    closed: CancellationToken,
    /// Stops the keep-alive pings when the last clone is dropped.
    _pings: std::sync::Arc<DropGuard>,
}

/// Dials the agent at `addr` (`host:port`) with `credentials`' client
/// configuration and makes an HTTP/2 connection, pinged every
/// [`crate::client::KEEPALIVE_INTERVAL`] and closed when a ping goes
/// unanswered that long.
pub async fn connect(addr: &str, credentials: &TlsCredentials) -> io::Result<Connection> {
    // Read before the configuration: a reload in between makes the
    // connection look older than it is, never newer.
    let generation = credentials.generation();
    let tls = tokio::time::timeout(
        crate::client::CONNECT_TIMEOUT,
        crate::client::dial_tls(addr, credentials.client_config()),
    )
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("{addr} did not answer")))??;
    let (sender, mut connection) = h2::client::Builder::new()
        // The windows hyper's client (and so tonic's) opens with: a
        // replica's large answer is not held to h2's 64 KiB default.
        .initial_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .max_concurrent_reset_streams(crate::client::RESETS_REMEMBERED)
        .handshake::<_, Bytes>(tls)
        .await
        .map_err(io::Error::other)?;
    let (closed, dropped) = (CancellationToken::new(), CancellationToken::new());
    let mut pings = connection.ping_pong();
    // h2 ends the connection itself once no handle and no stream is left;
    // only an unanswered ping cuts it short.
    let driver = closed.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = &mut connection => {}
            () = driver.cancelled() => {}
        }
        driver.cancel();
    });
    let (keepalive, stopping) = (closed.clone(), dropped.clone());
    tokio::spawn(async move {
        let Some(pings) = pings.as_mut() else { return };
        loop {
            tokio::select! {
                () = keepalive.cancelled() => return,
                () = stopping.cancelled() => return,
                () = tokio::time::sleep(crate::client::KEEPALIVE_INTERVAL) => {}
            }
            let answered =
                tokio::time::timeout(crate::client::KEEPALIVE_INTERVAL, pings.ping(h2::Ping::opaque())).await;
            if !matches!(answered, Ok(Ok(_))) {
                tracing::debug!("an agent did not answer a keep-alive ping; closing its connection");
                keepalive.cancel();
                return;
            }
        }
    });
    Ok(Connection {
        sender,
        authority: addr.to_string(),
        credentials_generation: generation,
        _pings: std::sync::Arc::new(dropped.drop_guard()),
        closed,
    })
}

impl Connection {
    /// The generation of the credentials it presented
    /// ([`TlsCredentials::generation`]). Once they are reloaded (a renewed
    /// certificate), a caller makes a fresh connection for new tunnels and
    /// lets this one end with the tunnels under way on it: an agent closes
    /// a connection once the certificate it was made with expires.
    pub fn credentials_generation(&self) -> u64 {
        self.credentials_generation
    }

    /// Whether the connection ended (its agent closed it, a ping went
    /// unanswered, or it broke): no tunnel opens on it any more.
    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Opens a tunnel to the port named `port` of `lease_id` (its first
    /// port when empty), waiting at most `timeout` for the agent's answer.
    pub async fn open(&self, lease_id: &str, port: &str, timeout: Duration) -> Result<Tunnel, OpenError> {
        if self.is_closed() {
            return Err(OpenError::Broke(format!("the connection is closed (agent at {})", self.authority)));
        }
        let uri = format!("https://{}{TUNNEL_PATH}", self.authority);
        let mut request = http::Request::post(uri)
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .body(())
            .map_err(|e| OpenError::Refused(tonic::Status::invalid_argument(format!("the agent's address: {e}"))))?;
        let span = <berth_telemetry::Client as berth_telemetry::TraceSide>::open(&mut request);
        let open = TunnelFrame {
            open: Some(TunnelOpen { lease_id: lease_id.to_string(), port: port.to_string() }),
            data: Vec::new(),
        };
        let opening = async {
            let broke = |e: h2::Error| OpenError::Broke(format!("{e} (agent at {})", self.authority));
            let mut sender = self.sender.clone().ready().await.map_err(broke)?;
            let (response, mut send) = sender.send_request(request, false).map_err(broke)?;
            send.send_data(message(&open), false).map_err(broke)?;
            let response = tokio::time::timeout(timeout, response)
                .await
                .map_err(|_| {
                    OpenError::Refused(tonic::Status::deadline_exceeded(format!(
                        "its agent at {} did not answer within {timeout:?}",
                        self.authority
                    )))
                })?
                .map_err(broke)?;
            // An error before any message comes as headers alone.
            if let Some(status) = status_in(response.headers()) {
                send.send_reset(h2::Reason::CANCEL);
                return Err(OpenError::Refused(status));
            }
            if response.status() != http::StatusCode::OK {
                send.send_reset(h2::Reason::CANCEL);
                let status = tonic::Status::unknown(format!("the agent answered HTTP {}", response.status()));
                return Err(OpenError::Refused(status));
            }
            Ok(Tunnel {
                credentials_generation: self.credentials_generation,
                send,
                recv: Some(response.into_body()),
                received: BytesMut::new(),
                pending: Bytes::new(),
                ended: false,
                shut: false,
            })
        };
        opening.instrument(span).await
    }
}

/// `frame` as one gRPC message.
fn message(frame: &TunnelFrame) -> Bytes {
    let len = frame.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX_BYTES + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // A BytesMut grows as it is written: encoding cannot run out of room.
    let _ = frame.encode(&mut buf);
    buf.freeze()
}

/// A `TunnelFrame` carrying `data` as one gRPC message, encoded straight
/// from the sender's bytes (one copy, not one into a frame and one more
/// out of it): field `data`'s key, its length, the bytes. Both ends of a
/// tunnel send their bytes so.
pub fn data_message(data: &[u8]) -> Bytes {
    use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
    const DATA_FIELD: u32 = 2;
    let len = key_len(DATA_FIELD) + encoded_len_varint(data.len() as u64) + data.len();
    let mut buf = BytesMut::with_capacity(PREFIX_BYTES + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    encode_key(DATA_FIELD, WireType::LengthDelimited, &mut buf);
    encode_varint(data.len() as u64, &mut buf);
    buf.put_slice(data);
    buf.freeze()
}

/// The gRPC status `headers` (a response's or its trailers) carry, if it
/// is not OK.
fn status_in(headers: &http::HeaderMap) -> Option<tonic::Status> {
    let status = tonic::Status::from_header_map(headers)?;
    (status.code() != tonic::Code::Ok).then_some(status)
}

/// One open tunnel as a byte stream: what is written goes out as frames,
/// what the replica sends is read back; shutting it down ends the caller's
/// side, as a TCP half-close does.
#[derive(Debug)]
pub struct Tunnel {
    /// Its connection's [`Connection::credentials_generation`].
    credentials_generation: u64,
    send: h2::SendStream<Bytes>,
    /// Taken only on drop.
    recv: Option<h2::RecvStream>,
    /// What came from the agent and is not yet a whole message.
    received: BytesMut,
    /// The replica's bytes not yet read.
    pending: Bytes,
    /// Whether the replica's side ended (or broke).
    ended: bool,
    /// Whether the caller ended its side.
    shut: bool,
}

impl Tunnel {
    /// The generation of the credentials its connection presented (see
    /// [`Connection::credentials_generation`]).
    pub fn credentials_generation(&self) -> u64 {
        self.credentials_generation
    }
}

/// The replica's bytes in the next whole message of `received` (what came
/// from the agent), taken off it, if a whole one came; refused past
/// [`MAX_MESSAGE_BYTES`], the most an agent sends (see [`next_frame`]).
fn next_message(received: &mut BytesMut) -> io::Result<Option<Bytes>> {
    Ok(next_frame(received, MAX_MESSAGE_BYTES)?.map(|frame| Bytes::from(frame.data)))
}

/// The next whole `TunnelFrame` of `received` (the bytes of a tunnel's
/// stream, as they came), taken off it, if a whole one came. Both ends of a
/// tunnel read their peer's frames so. A prefix that announces more than
/// `limit` bytes, or a compressed message, is refused as soon as it is
/// read: neither end sends one, and waiting for it would buffer whatever
/// length it claims.
pub fn next_frame(received: &mut BytesMut, limit: usize) -> io::Result<Option<TunnelFrame>> {
    let Some(prefix) = received.get(..PREFIX_BYTES) else { return Ok(None) };
    let (flag, len) = (prefix[0], u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]));
    if flag != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a tunnel frame came flagged compressed ({flag}); tunnel frames are never compressed"),
        ));
    }
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a tunnel frame of {len} bytes came; the limit is {limit}"),
        ));
    }
    if received.len() < PREFIX_BYTES + len {
        return Ok(None);
    }
    received.advance(PREFIX_BYTES);
    let frame = TunnelFrame::decode(received.split_to(len).freeze())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("a tunnel frame: {e}")))?;
    Ok(Some(frame))
}

impl AsyncRead for Tunnel {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if let Some(data) = next_message(&mut this.received)? {
                this.pending = data;
                continue;
            }
            if this.ended {
                return Poll::Ready(Ok(()));
            }
            let Some(recv) = this.recv.as_mut() else { return Poll::Ready(Ok(())) };
            match recv.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    let _ = recv.flow_control().release_capacity(chunk.len());
                    this.received.extend_from_slice(&chunk);
                }
                Poll::Ready(Some(Err(error))) => {
                    this.ended = true;
                    return Poll::Ready(Err(io::Error::other(error)));
                }
                Poll::Ready(None) => {
                    // The agent's side is over: its trailers say how.
                    let trailers = match recv.poll_trailers(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(trailers) => trailers,
                    };
                    this.ended = true;
                    return Poll::Ready(match trailers {
                        Ok(Some(trailers)) => match status_in(&trailers) {
                            Some(status) => Err(io::Error::other(format!("{}: {}", status.code(), status.message()))),
                            None => Ok(()),
                        },
                        Ok(None) => Ok(()),
                        Err(error) => Err(io::Error::other(error)),
                    });
                }
            }
        }
    }
}

impl AsyncWrite for Tunnel {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.shut {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let n = buf.len().min(CHUNK_BYTES);
        let frame = data_message(&buf[..n]);
        // Wait for the agent's window to take some of it; h2 holds the
        // rest until it does, so at most one frame waits per tunnel.
        self.send.reserve_capacity(frame.len());
        while self.send.capacity() == 0 {
            match self.send.poll_capacity(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(_))) => {}
                Poll::Ready(None | Some(Err(_))) => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            }
        }
        match self.send.send_data(frame, false) {
            Ok(()) => Poll::Ready(Ok(n)),
            Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.shut {
            self.shut = true;
            let _ = self.send.send_data(Bytes::new(), true);
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        let Some(mut recv) = self.recv.take() else { return };
        if self.ended {
            // The replica's side is over: ending the caller's closes the
            // stream both ways.
            if !self.shut {
                let _ = self.send.send_data(Bytes::new(), true);
            }
            return;
        }
        if !self.shut {
            self.send.send_reset(h2::Reason::CANCEL);
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let drained = async {
                    while let Some(Ok(chunk)) = recv.data().await {
                        let _ = recv.flow_control().release_capacity(chunk.len());
                    }
                };
                let _ = tokio::time::timeout(CLOSE_GRACE, drained).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_message_is_the_frame_prost_would_encode() {
        // prost leaves an empty field out; an empty write still decodes as one.
        let empty = data_message(&[]);
        assert_eq!(TunnelFrame::decode(&empty[PREFIX_BYTES..]).unwrap(), TunnelFrame::default());
        for size in [1, 127, 128, 300, CHUNK_BYTES] {
            let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let expected = message(&TunnelFrame { open: None, data: data.clone() });
            assert_eq!(data_message(&data), expected, "{size} bytes");
        }
    }

    #[test]
    fn the_largest_frame_an_agent_sends_is_read_whole_even_when_it_comes_in_pieces() {
        let data: Vec<u8> = (0..CHUNK_BYTES).map(|i| (i % 251) as u8).collect();
        let message = message(&TunnelFrame { open: None, data: data.clone() });
        assert!(message.len() - PREFIX_BYTES <= MAX_MESSAGE_BYTES, "{} bytes", message.len());
        let mut received = BytesMut::new();
        for piece in message.chunks(16 * 1024) {
            assert_eq!(next_message(&mut received).unwrap(), None, "not whole yet");
            received.extend_from_slice(piece);
        }
        received.extend_from_slice(&data_message(b"next"));
        assert_eq!(next_message(&mut received).unwrap().unwrap(), data);
        assert_eq!(next_message(&mut received).unwrap().unwrap(), &b"next"[..]);
        assert_eq!(next_message(&mut received).unwrap(), None);
    }

    /// Regression: the length in a message's prefix was trusted, so an agent
    /// claiming 4 GiB made the caller buffer until that much came, and the
    /// compressed flag was ignored.
    #[test]
    fn a_message_longer_than_an_agent_sends_or_compressed_is_refused_from_its_prefix() {
        for len in [MAX_MESSAGE_BYTES as u32 + 1, u32::MAX] {
            let mut received = BytesMut::new();
            received.put_u8(0);
            received.put_u32(len);
            let error = next_message(&mut received).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::InvalidData);
            let expected = format!("a tunnel frame of {len} bytes came; the limit is {MAX_MESSAGE_BYTES}");
            assert!(error.to_string().contains(&expected), "{error}");
        }

        let mut compressed = BytesMut::from(&data_message(b"hello")[..]);
        compressed[0] = 1;
        let error = next_message(&mut compressed).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert!(error.to_string().contains("flagged compressed"), "{error}");
    }
}
