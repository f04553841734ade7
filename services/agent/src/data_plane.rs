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
//! # Why below tonic
//! A tunnel is one gRPC call whose messages carry bytes, and every routed
//! request crosses one. Through tonic's generated server each frame from
//! the caller was decoded into a message and handed to a task of the
//! tunnel's own that wrote it to the replica, and each read of the replica
//! was copied into a message and encoded again. Served one level down (a
//! tower service tonic's router dispatches to, behind the same access,
//! deadline and trace layers), the tunnel is the response's body: each
//! poll of it writes the caller's frames to the replica and reads the
//! replica into frames, in the one task hyper polls the body in, with the
//! replica's bytes copied once. The wire is unchanged: `TunnelFrame`s
//! behind gRPC's prefix, framed by the same code as the router's side
//! ([`berth_rpc::tunnel`]), and the status in the trailers.
//!
//! # Invariants
//! - Only routers call it: the access layer admits no other caller kind.
//! - A tunnel reaches only a port the agent gave a lease that is running on
//!   this node, as the runner's board says at the moment it opens; a tunnel
//!   already open ends when the replica closes its side or the agent stops.
//! - A tunnel that ends, however it ends (the replica closes, the caller
//!   goes, the agent stops), lets go of the replica's connection at once:
//!   a write to a replica that stopped reading is abandoned, never waited
//!   out.
//! - The caller's bytes move while the tunnel's body is polled: as the
//!   replica's do, they wait while the caller takes none of the replica's
//!   (its window on the stream is full), as a TCP connection's two sides
//!   would once both its buffers were.
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

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use berth_proto::agent::v1;
use berth_proto::leases::v1::LeasePhase;
use berth_rpc::MAX_REQUEST_BYTES;
use bytes::{Buf as _, Bytes, BytesMut};
use http_body::{Body as _, Frame};
use tokio::io::{AsyncRead as _, AsyncWrite as _, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::Status;

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

    /// Opens the tunnel `body` (the caller's side of the call) asks for:
    /// the replica's port, connected, or why not.
    async fn tunnel(&self, body: tonic::body::Body) -> Result<http::Response<tonic::body::Body>, Status> {
        let mut caller = FromCaller { body, received: BytesMut::new(), ended: false };
        let first = match tokio::time::timeout(OPEN_TIMEOUT, std::future::poll_fn(|cx| caller.poll_frame(cx))).await {
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
        let replica = self.connect(&lease_id, port).await?;
        let _ = replica.set_nodelay(true);
        tracing::debug!(%lease_id, port, "tunnel open");
        let body = TunnelBody {
            lease_id,
            port,
            replica: Some(replica),
            caller: Some(caller),
            inbound: Inbound::Reading,
            to_replica: Bytes::new(),
            stopping: Box::pin(self.shutdown.clone().cancelled_owned()),
            shutdown: self.shutdown.clone(),
        };
        let mut response = http::Response::new(tonic::body::Body::new(body));
        response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
        // The body only carries the replica's bytes: none of its polls is the call's work.
        response.extensions_mut().insert(berth_telemetry::BodyOutsideSpan);
        Ok(response)
    }
}

/// `DataPlane` is served as the tower service tonic's generated server
/// would be, one level down: see "Why below tonic" in the module docs.
impl tonic::server::NamedService for DataPlane {
    const NAME: &'static str = v1::data_plane_server::SERVICE_NAME;
}

impl tower_service::Service<http::Request<tonic::body::Body>> for DataPlane {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let plane = self.clone();
        Box::pin(async move {
            let path = request.uri().path();
            if path != berth_rpc::tunnel::TUNNEL_PATH {
                let name = v1::data_plane_server::SERVICE_NAME;
                return Ok(Status::unimplemented(format!("{path}: {name} has no such method")).into_http());
            }
            Ok(plane.tunnel(request.into_body()).await.unwrap_or_else(Status::into_http))
        })
    }
}

/// The caller's side of a tunnel: its frames, read off the call's body.
struct FromCaller {
    body: tonic::body::Body,
    /// What came and is not yet a whole frame.
    received: BytesMut,
    /// Whether the caller ended its side.
    ended: bool,
}

impl FromCaller {
    /// The caller's next frame; `None` once it ended its side. After an
    /// error nothing more is read.
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<v1::TunnelFrame>, Status>> {
        let next = self.poll_next(cx);
        if let Poll::Ready(Err(_)) = next {
            self.ended = true;
            self.received.clear();
        }
        next
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<v1::TunnelFrame>, Status>> {
        loop {
            let frame = berth_rpc::tunnel::next_frame(&mut self.received, MAX_REQUEST_BYTES)
                .map_err(|error| Status::invalid_argument(error.to_string()))?;
            if frame.is_some() {
                return Poll::Ready(Ok(frame));
            }
            if self.ended {
                if self.received.is_empty() {
                    return Poll::Ready(Ok(None));
                }
                return Poll::Ready(Err(Status::invalid_argument(format!(
                    "the caller's side ended inside a frame ({} bytes of it came)",
                    self.received.len()
                ))));
            }
            match std::task::ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.received.extend_from_slice(&data);
                    }
                }
                Some(Err(status)) => return Poll::Ready(Err(status)),
                None => self.ended = true,
            }
        }
    }

    /// Reads the caller's frames to their end (within [`CLOSE_GRACE`], or
    /// until the agent stops), so its stream closes rather than being reset.
    async fn drain(mut self, stopping: CancellationToken) {
        let to_end = async { while let Ok(Some(_)) = std::future::poll_fn(|cx| self.poll_frame(cx)).await {} };
        tokio::select! {
            () = stopping.cancelled() => {}
            _ = tokio::time::timeout(CLOSE_GRACE, to_end) => {}
        }
    }
}

/// Where the caller's bytes to the replica are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inbound {
    /// Read from the caller and written to the replica.
    Reading,
    /// The caller ended its side: the replica's reading side is being closed,
    /// as a TCP half-close would.
    Closing,
    /// The replica stopped taking them: the caller's are read and dropped,
    /// so its stream is not reset.
    Dropping,
    /// Nothing more comes from the caller.
    Done,
}

/// One open tunnel, as the body of the call's response: each poll moves
/// the caller's bytes to the replica as far as they go without waiting,
/// then reads the replica, whose bytes are the body's frames. One task,
/// the one hyper polls the body in, serves both ways; the body ends with
/// the call's status in its trailers when the replica closes (OK) or its
/// connection breaks, or the agent stops (UNAVAILABLE). Dropped (the caller
/// went), it lets go of the replica's connection at once.
struct TunnelBody {
    /// The lease and node port the tunnel reaches, for its errors.
    lease_id: String,
    port: u16,
    /// `None` once the tunnel ended.
    replica: Option<TcpStream>,
    /// `None` once the tunnel ended.
    caller: Option<FromCaller>,
    inbound: Inbound,
    /// Caller's bytes the replica has not taken yet.
    to_replica: Bytes,
    stopping: Pin<Box<WaitForCancellationFutureOwned>>,
    shutdown: CancellationToken,
}

impl TunnelBody {
    /// Moves the caller's bytes towards the replica until that would wait.
    fn forward_inbound(&mut self, cx: &mut Context<'_>) {
        let (Some(replica), Some(caller)) = (self.replica.as_mut(), self.caller.as_mut()) else { return };
        loop {
            if !self.to_replica.is_empty() {
                match Pin::new(&mut *replica).poll_write(cx, &self.to_replica) {
                    Poll::Pending => return,
                    Poll::Ready(Ok(written)) if written > 0 => {
                        self.to_replica.advance(written);
                        continue;
                    }
                    // A replica that stopped reading or closed: what else
                    // the caller sends is dropped until its side ends.
                    Poll::Ready(_) => {
                        self.to_replica = Bytes::new();
                        self.inbound = Inbound::Dropping;
                    }
                }
            }
            match self.inbound {
                Inbound::Reading | Inbound::Dropping => match caller.poll_frame(cx) {
                    Poll::Pending => return,
                    Poll::Ready(Ok(Some(frame))) => {
                        if self.inbound == Inbound::Reading {
                            self.to_replica = Bytes::from(frame.data);
                        }
                    }
                    Poll::Ready(Ok(None)) => {
                        self.inbound = if self.inbound == Inbound::Reading { Inbound::Closing } else { Inbound::Done };
                    }
                    // The caller's side broke: the replica hears no more of it.
                    Poll::Ready(Err(_)) => self.inbound = Inbound::Closing,
                },
                Inbound::Closing => match Pin::new(&mut *replica).poll_shutdown(cx) {
                    Poll::Pending => return,
                    Poll::Ready(_) => self.inbound = Inbound::Done,
                },
                Inbound::Done => return,
            }
        }
    }

    /// Ends the tunnel with `status` in the trailers. A caller still
    /// sending is read to its end in the background, so its stream closes
    /// rather than being reset.
    fn end(&mut self, status: &Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.replica = None;
        if let Some(caller) = self.caller.take()
            && !caller.ended
        {
            tokio::spawn(caller.drain(self.shutdown.clone()));
        }
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            trailers.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
        }
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }
}

impl http_body::Body for TunnelBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.replica.is_none() {
            return Poll::Ready(None);
        }
        if this.stopping.as_mut().poll(cx).is_ready() {
            return this.end(&Status::unavailable("the node agent is stopping"));
        }
        this.forward_inbound(cx);
        let Some(replica) = this.replica.as_mut() else { return Poll::Ready(None) };
        // Read onto the stack, uninitialised, and copied once into the
        // frame: a tunnel holds no buffer of its own between reads, however
        // many are open and idle.
        let mut chunk = [std::mem::MaybeUninit::<u8>::uninit(); CHUNK_BYTES];
        let mut buffer = ReadBuf::uninit(&mut chunk);
        match Pin::new(replica).poll_read(cx, &mut buffer) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(())) if buffer.filled().is_empty() => this.end(&Status::ok("")),
            Poll::Ready(Ok(())) => Poll::Ready(Some(Ok(Frame::data(berth_rpc::tunnel::data_message(buffer.filled()))))),
            Poll::Ready(Err(error)) => {
                let message =
                    format!("the replica's connection broke (port {} of lease {}): {error}", this.port, this.lease_id);
                this.end(&Status::unavailable(message))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.replica.is_none()
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
