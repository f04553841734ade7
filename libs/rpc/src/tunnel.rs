//! The caller's side of an agent's data plane (`berth.agent.v1.DataPlane`):
//! a `Tunnel` stream to one port of one replica, read and written as a byte
//! stream, so any HTTP or TCP client can run over it.
//!
//! # Invariants
//! - [`open`] returns only once the agent connected to the replica: an
//!   error means no byte reached it, and the caller may try another.
//! - A tunnel shut down before it is dropped closes its stream, never
//!   resets it: the replica's side is read to its end in the background
//!   (within [`CLOSE_GRACE`]). A tunnel dropped without a shutdown (its
//!   caller gave up on it) is reset at once, so the replica stops sending.
//!   A caller keeps one connection per agent for all its tunnels, and a
//!   replica that says `Connection: close` ends one tunnel per request:
//!   each reset that can be avoided is one fewer frame the agent may send
//!   after it, and h2 ends a connection, with every tunnel on it, once
//!   such frames made it reset 1024 streams.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use berth_proto::agent::v1::data_plane_client::DataPlaneClient;
use berth_proto::agent::v1::{TunnelFrame, TunnelOpen};
use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::PollSender;

use crate::Channel;

/// The most bytes one frame to a replica carries.
const CHUNK_BYTES: usize = 64 * 1024;

/// How many frames may wait to go out on one tunnel.
const BACKLOG: usize = 8;

/// How long a dropped tunnel waits for the replica's side to end.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Opens a tunnel through the agent `channel` reaches to the port named
/// `port` of `lease_id` (its first port when empty), waiting at most
/// `timeout` for the agent's answer.
pub async fn open(channel: Channel, lease_id: &str, port: &str, timeout: Duration) -> Result<Tunnel, tonic::Status> {
    let (tx, rx) = mpsc::channel(BACKLOG);
    let open = TunnelFrame {
        open: Some(TunnelOpen { lease_id: lease_id.to_string(), port: port.to_string() }),
        data: Vec::new(),
    };
    tx.send(open).await.map_err(|_| tonic::Status::cancelled("the tunnel closed before it opened"))?;
    let opened = tokio::time::timeout(timeout, DataPlaneClient::new(channel).tunnel(ReceiverStream::new(rx)))
        .await
        .map_err(|_| tonic::Status::deadline_exceeded(format!("its agent did not answer within {timeout:?}")))?;
    let inbound = opened?.into_inner();
    Ok(Tunnel {
        outbound: PollSender::new(tx),
        inbound: Some(inbound),
        ended: false,
        shut: false,
        pending: Bytes::new(),
    })
}

/// One open tunnel as a byte stream: what is written goes out as frames,
/// what the replica sends is read back; shutting it down ends the caller's
/// side, as a TCP half-close does.
#[derive(Debug)]
pub struct Tunnel {
    outbound: PollSender<TunnelFrame>,
    /// Taken only on drop.
    inbound: Option<tonic::Streaming<TunnelFrame>>,
    /// Whether the replica's side ended (or broke).
    ended: bool,
    /// Whether the caller ended its side.
    shut: bool,
    pending: Bytes,
}

impl AsyncRead for Tunnel {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                buf.put_slice(&self.pending.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if self.ended {
                return Poll::Ready(Ok(()));
            }
            let Some(inbound) = self.inbound.as_mut() else { return Poll::Ready(Ok(())) };
            match Pin::new(inbound).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.ended = true;
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Some(Err(status))) => {
                    self.ended = true;
                    return Poll::Ready(Err(io::Error::other(format!("{}: {}", status.code(), status.message()))));
                }
                Poll::Ready(Some(Ok(frame))) => self.pending = Bytes::from(frame.data),
            }
        }
    }
}

impl AsyncWrite for Tunnel {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.outbound.poll_reserve(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(_)) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            Poll::Ready(Ok(())) => {
                let n = buf.len().min(CHUNK_BYTES);
                let frame = TunnelFrame { open: None, data: buf[..n].to_vec() };
                match self.outbound.send_item(frame) {
                    Ok(()) => Poll::Ready(Ok(n)),
                    Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
                }
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.outbound.close();
        self.shut = true;
        Poll::Ready(Ok(()))
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        self.outbound.close();
        let Some(mut inbound) = self.inbound.take() else { return };
        if self.ended || !self.shut {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let drained = async { while let Some(Ok(_)) = inbound.next().await {} };
                let _ = tokio::time::timeout(CLOSE_GRACE, drained).await;
            });
        }
    }
}
