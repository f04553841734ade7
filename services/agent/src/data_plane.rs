//! The node's data plane (`berth.agent.v1.DataPlane`): a router reaches a
//! replica's port through the agent, over the node's mTLS port, never by
//! dialling the replica itself.
//!
//! Each `Tunnel` stream carries one connection. Its first frame names the
//! lease and one of its ports by name; the agent checks that the lease runs
//! on this node, finds the node port it gave that port, connects, and only then
//! answers with the response headers, so a caller that gets an error knows
//! no byte reached the replica (and may try another). After that the bytes
//! flow both ways until either side closes.
//!
//! # Invariants
//! - Only routers call it: the access layer admits no other caller kind.
//! - A tunnel reaches only a port the agent gave a lease that is running on
//!   this node, as the runner's board says at the moment it opens; a tunnel
//!   already open ends when the replica closes its side or the agent stops.
//! - A tunnel that ends, however it ends (the replica closes, the caller
//!   goes, the agent stops), lets go of the replica's connection and of
//!   its task at once: a write to a replica that stopped reading is
//!   abandoned, never waited out.
//! - A tunnel's ordinary end closes its stream, never resets it: once the
//!   replica is done, the caller's side is still read until the caller
//!   ends it (within [`CLOSE_GRACE`]). A router's tunnels share its
//!   connection (one per router thread), and h2 ends a connection whose
//!   peer made it reset 1024 streams, with every tunnel on it.
//! - What an open tunnel costs the node is bounded: it holds no read buffer
//!   between reads of the replica, and one connection holds at most
//!   [`TUNNELS_PER_CONNECTION`] open.
//! - Where the node isolates egress, the replica is dialled on the loopback
//!   of its tenant's network namespace (so it may listen there only);
//!   otherwise on the host's loopback (see [`crate::dial`]).

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use berth_proto::agent::v1;
use berth_proto::leases::v1::LeasePhase;
use tokio::io::{AsyncRead as _, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::{CancellationToken, DropGuard, WaitForCancellationFutureOwned};
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status, Streaming};

use crate::board::InstanceBoard;
use crate::dial::Dialer;

/// The most streams one connection to the agent holds open at once:
/// tunnels, and the agent API's calls beside them. A router keeps one
/// connection per serving thread to each agent, and a tunnel for each
/// connection it holds to a replica here (each kept HTTP/1.1 one, at most
/// 64 per replica, each replica's HTTP/2 one, each upgraded one), so this
/// bounds what one router thread holds open on the node. Past it, a
/// router's new tunnel waits for one to end, within its open timeout.
pub(crate) const TUNNELS_PER_CONNECTION: u32 = 16_384;

/// How long a caller may take to send a tunnel's first frame.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// The most bytes one frame from the replica carries: the most a caller
/// takes (`berth_rpc::tunnel` refuses a larger frame as a faulty agent's).
const CHUNK_BYTES: usize = berth_rpc::tunnel::CHUNK_BYTES;

/// How long a caller may take to end its side once the replica's is done.
/// Reading the caller's frames to their end closes the stream both ways;
/// dropping them would reset it, and resets a peer keeps sending on count
/// against the connection the tunnel shares with others from that router
/// (h2 closes it after 1024).
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// What the data plane reads.
#[derive(Debug, Clone)]
pub(crate) struct DataPlane {
    /// Which leases run here, on which ports.
    pub(crate) board: InstanceBoard,
    /// Reaches replicas where they listen.
    pub(crate) dialer: Dialer,
    /// Ends every tunnel when the agent stops.
    pub(crate) shutdown: CancellationToken,
}

/// The node port of the lease and port `open` names, once `board` says the
/// lease runs here and is not being stopped.
fn admit(board: &InstanceBoard, open: &v1::TunnelOpen) -> Result<(String, u16), Status> {
    let lease_id = open.lease_id.trim();
    if lease_id.is_empty() {
        return Err(Status::invalid_argument("open.lease_id: the lease to reach is required"));
    }
    let view = board.get(lease_id).ok_or_else(|| Status::not_found(format!("no lease {lease_id} on this node")))?;
    if view.ending && !view.is_over() {
        return Err(Status::failed_precondition(format!(
            "lease {lease_id} is being stopped on this node ({})",
            if view.reason.is_empty() { "its lease ended" } else { view.reason.as_str() }
        )));
    }
    if view.is_over() || view.phase != LeasePhase::Running {
        return Err(Status::failed_precondition(format!(
            "lease {lease_id} is not running on this node (it is {})",
            view.phase.as_str_name()
        )));
    }
    let name = open.port.trim();
    let given = if name.is_empty() { view.meta.port } else { view.meta.ports.get(name).copied().unwrap_or(0) };
    let Some(port) = u16::try_from(given).ok().filter(|port| *port != 0) else {
        let names: Vec<&str> = view.meta.ports.keys().map(String::as_str).collect();
        let names = if names.is_empty() { "none".to_string() } else { names.join(", ") };
        return Err(Status::not_found(if name.is_empty() {
            format!("lease {lease_id} was given no port")
        } else {
            format!("lease {lease_id} has no port named '{name}' (its ports: {names})")
        }));
    };
    Ok((lease_id.to_string(), port))
}

impl DataPlane {
    /// Connects to the replica's port where it listens.
    async fn connect(&self, lease_id: &str, port: u16) -> Result<TcpStream, Status> {
        self.dialer.connect(lease_id, port).await.map_err(|error| {
            Status::unavailable(format!("nothing accepts on port {port} of lease {lease_id}: {error}"))
        })
    }
}

#[tonic::async_trait]
impl v1::data_plane_server::DataPlane for DataPlane {
    async fn tunnel(
        &self,
        request: Request<Streaming<v1::TunnelFrame>>,
    ) -> Result<Response<BoxStream<v1::TunnelFrame>>, Status> {
        let mut incoming = request.into_inner();
        let first = match tokio::time::timeout(OPEN_TIMEOUT, incoming.message()).await {
            Ok(first) => first?,
            Err(_) => return Err(Status::deadline_exceeded(format!("no first frame within {OPEN_TIMEOUT:?}"))),
        };
        let first = first.unwrap_or_default();
        let open = first
            .open
            .ok_or_else(|| Status::invalid_argument("open: the first frame must name the lease and the port"))?;
        // Bytes sent before the agent connected would have to be held or
        // dropped; the caller learns instead that they were not sent.
        if !first.data.is_empty() {
            return Err(Status::invalid_argument(format!(
                "data: the first frame of a tunnel carries no data ({} bytes came); send them once it is open",
                first.data.len()
            )));
        }
        let (lease_id, port) = admit(&self.board, &open)?;
        let upstream = self.connect(&lease_id, port).await?;
        let _ = upstream.set_nodelay(true);
        tracing::debug!(%lease_id, port, "tunnel open");
        let (reading, mut writing) = upstream.into_split();
        let shutdown = self.shutdown.clone();
        // Cancelled once the replica's side is done, the caller gone (the
        // response stream dropped with it), or the agent stopping.
        let done = shutdown.child_token();

        // The caller's bytes to the replica; the caller's end closes the
        // replica's reading side, the way a TCP half-close would.
        let (inbound_done, stopping) = (done.clone(), shutdown.clone());
        tokio::spawn(async move {
            // Waited on across frames, not made anew for each.
            let replica_done = inbound_done.cancelled();
            tokio::pin!(replica_done);
            loop {
                let frame = tokio::select! {
                    () = &mut replica_done => break,
                    frame = incoming.next() => frame,
                };
                match frame {
                    Some(Ok(frame)) if frame.data.is_empty() => {}
                    Some(Ok(frame)) => {
                        // A replica that stops reading blocks the write: the
                        // tunnel's end (the caller gone, the agent stopping)
                        // must still free the task and the replica's socket.
                        let written = tokio::select! {
                            () = &mut replica_done => break,
                            written = writing.write_all(&frame.data) => written,
                        };
                        if written.is_err() {
                            break;
                        }
                    }
                    Some(Err(_)) => return,
                    None => {
                        let _ = writing.shutdown().await;
                        return;
                    }
                }
            }
            drop(writing);
            // The replica is done while the caller still sends: its frames
            // are read to their end, so the stream closes rather than being
            // reset.
            tokio::select! {
                () = stopping.cancelled() => {}
                _ = tokio::time::timeout(CLOSE_GRACE, async { while let Some(Ok(_)) = incoming.next().await {} }) => {}
            }
        });

        // The replica's bytes to the caller, read as the caller's stream is
        // polled for them: no task between the replica and the connection.
        let replica = FromReplica {
            lease_id,
            port,
            reading,
            stopping: Box::pin(shutdown.cancelled_owned()),
            done: Some(done.drop_guard()),
        };
        let mut response = Response::new(Box::pin(replica) as BoxStream<v1::TunnelFrame>);
        // The stream only carries the replica's bytes: none of its polls is the call's work.
        response.extensions_mut().insert(berth_telemetry::BodyOutsideSpan);
        Ok(response)
    }
}

/// The replica's side of a tunnel as the stream of frames the caller
/// reads: each poll reads the replica's connection itself. It ends when the
/// replica closes (or its connection breaks, or the agent stops, each with
/// a status); ended or dropped, it tells the caller's side that the
/// replica is done.
struct FromReplica {
    /// The lease and node port the tunnel reaches, for its errors.
    lease_id: String,
    port: u16,
    reading: OwnedReadHalf,
    stopping: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Cancels the tunnel's `done` when the stream ends or is dropped.
    done: Option<DropGuard>,
}

impl Stream for FromReplica {
    type Item = Result<v1::TunnelFrame, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done.is_none() {
            return Poll::Ready(None);
        }
        if this.stopping.as_mut().poll(cx).is_ready() {
            this.done = None;
            return Poll::Ready(Some(Err(Status::unavailable("the node agent is stopping"))));
        }
        // Read onto the stack, uninitialised, and copied out at the size
        // read: a tunnel holds no buffer of its own between reads, however
        // many are open and idle.
        let mut chunk = [std::mem::MaybeUninit::<u8>::uninit(); CHUNK_BYTES];
        let mut buffer = ReadBuf::uninit(&mut chunk);
        let frame = match Pin::new(&mut this.reading).poll_read(cx, &mut buffer) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(())) if buffer.filled().is_empty() => None,
            Poll::Ready(Ok(())) => {
                return Poll::Ready(Some(Ok(v1::TunnelFrame { open: None, data: buffer.filled().to_vec() })));
            }
            Poll::Ready(Err(error)) => Some(Err(Status::unavailable(format!(
                "the replica's connection broke (port {} of lease {}): {error}",
                this.port, this.lease_id
            )))),
        };
        this.done = None;
        Poll::Ready(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::board::InstanceView;
    use crate::provider::InstanceMeta;

    #[test]
    fn a_lease_whose_workload_is_being_stopped_is_reached_no_more() {
        let board = InstanceBoard::default();
        let meta = InstanceMeta { port: 61_000, ..Default::default() };
        board.put(InstanceView::new("l-1", 1, meta, LeasePhase::Running));
        let open = v1::TunnelOpen { lease_id: "l-1".into(), port: String::new() };
        assert_eq!(admit(&board, &open).unwrap(), ("l-1".to_string(), 61_000));

        // The node lost the lease (revoked, say): its workload still runs
        // through its stop grace, and is sent nothing new meanwhile.
        board.update("l-1", |view| {
            view.ending = true;
            view.reason = "NodeRevoked".into();
        });
        let refused = admit(&board, &open).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert_eq!(refused.message(), "lease l-1 is being stopped on this node (NodeRevoked)");
    }
}
