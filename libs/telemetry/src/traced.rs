//! The span of one gRPC call, on either side: the layer that opens it around each call, how it
//! is named, and the response future and body that record the call's gRPC status on it and end
//! it. What differs between the sides (where the span's parent comes from, which way the trace
//! context travels) is each side's [`TraceSide`], in `client` and `server`.
//!
//! # Where the status comes from
//! A gRPC status travels either in the response head (a trailers-only response, which is how
//! most errors are sent) or in the trailers after the last message. Both are read, so the span
//! carries the status the caller saw, for unary and streaming calls alike.
//!
//! # When the span ends
//! The span lives as long as the response body, so a streaming call's span covers the whole
//! stream rather than only the time to the response head.
//!
//! # Where a body is polled
//! A server's body is the handler's stream, whose work belongs to the call, so each of its polls
//! runs inside the span, unless the handler put [`BodyOutsideSpan`] in the response: a stream
//! that only carries a socket's bytes (a data-plane tunnel, polled once per frame) does none of
//! the call's work, and entering a span costs a context attach and detach in the OpenTelemetry
//! layer. A client's body is the connection's, never the caller's work: polled outside.

use std::{
    future::Future,
    marker::PhantomData,
    pin::Pin,
    task::{Context, Poll, ready},
};

use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Span;

/// The response header or trailer that carries the gRPC status code.
const GRPC_STATUS: &str = "grpc-status";

/// `UNKNOWN`: what a caller sees when the status is missing its number.
const GRPC_UNKNOWN: i64 = 2;

/// The span of one call on the path `$path`, named `$name` for tracing and by its method for
/// OpenTelemetry, of kind `$kind`, with the status fields [`TracedResponseFuture`] fills in.
macro_rules! rpc_span {
    ($name:literal, $kind:literal, $path:expr) => {{
        let name = $crate::traced::RpcName::from_path($path);
        tracing::info_span!(
            $name,
            otel.name = name.full,
            otel.kind = $kind,
            rpc.system = "grpc",
            rpc.service = name.service,
            rpc.method = name.method,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        )
    }};
}
pub(crate) use rpc_span;

/// Put in a server response's extensions by a handler whose response body does none of the
/// call's own work (it only carries bytes): the body's polls run outside the call's span, which
/// still lasts until the body ends and records its status.
#[derive(Debug, Clone, Copy, Default)]
pub struct BodyOutsideSpan;

/// One end of a gRPC call, as a [`TraceLayer`] traces it.
pub trait TraceSide {
    /// Which end this is.
    const SIDE: RpcSide;

    /// Opens the call's span for `request` (and, on a client, writes the trace context into it).
    fn open<B>(request: &mut http::Request<B>) -> Span;
}

/// Traces every call through the service it wraps, on the end `Side` names: a client channel
/// ([`ClientTraceLayer`](crate::ClientTraceLayer)) or a server stack
/// ([`ServerTraceLayer`](crate::ServerTraceLayer)).
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceLayer<Side>(PhantomData<Side>);

impl<S, Side> Layer<S> for TraceLayer<Side> {
    type Service = TraceService<S, Side>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceService { inner, side: PhantomData }
    }
}

/// A service wrapped by a [`TraceLayer`].
#[derive(Debug, Clone)]
pub struct TraceService<S, Side> {
    inner: S,
    side: PhantomData<Side>,
}

impl<S, Side, ReqBody, ResBody> Service<http::Request<ReqBody>> for TraceService<S, Side>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    Side: TraceSide,
{
    type Response = http::Response<TracedBody<ResBody>>;
    type Error = S::Error;
    type Future = TracedResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let span = Side::open(&mut request);
        let response = span.in_scope(|| self.inner.call(request));
        TracedResponseFuture::new(response, span, Side::SIDE)
    }
}

/// Which end of the call a span describes; the two ends disagree on which codes are errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RpcSide {
    /// The span of the handler that answered.
    Server,
    /// The span of the caller.
    Client,
}

impl RpcSide {
    /// Whether a finished call with this status marks the span as failed.
    ///
    /// Following the OpenTelemetry gRPC conventions: every non-OK code is a client error, but a
    /// server only failed on codes that say the server itself went wrong (`UNKNOWN`,
    /// `DEADLINE_EXCEEDED`, `UNIMPLEMENTED`, `INTERNAL`, `UNAVAILABLE`, `DATA_LOSS`); a
    /// `NOT_FOUND` answered correctly is not a server fault.
    fn is_error(self, code: i64) -> bool {
        match self {
            RpcSide::Client => code != 0,
            RpcSide::Server => matches!(code, 2 | 4 | 12 | 13 | 14 | 15),
        }
    }
}

/// The parts of a gRPC request path, `/package.Service/Method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RpcName<'a> {
    /// `package.Service/Method`, the span name the OpenTelemetry conventions ask for.
    pub(crate) full: &'a str,
    /// `package.Service`.
    pub(crate) service: &'a str,
    /// `Method`.
    pub(crate) method: &'a str,
}

impl<'a> RpcName<'a> {
    /// Splits a request path; a path that is not `/service/method` keeps all of it as the service
    /// so the span still says what was asked for.
    pub(crate) fn from_path(path: &'a str) -> Self {
        let full = path.strip_prefix('/').unwrap_or(path);
        let (service, method) = full.split_once('/').unwrap_or((full, ""));
        Self { full, service, method }
    }
}

/// Records a gRPC status found in `headers` on `span`; returns whether one was there.
fn record_status(span: &Span, side: RpcSide, headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(GRPC_STATUS) else {
        return false;
    };
    let code = value.to_str().ok().and_then(|text| text.trim().parse::<i64>().ok()).unwrap_or(GRPC_UNKNOWN);
    span.record("rpc.grpc.status_code", code);
    if side.is_error(code) {
        span.record("otel.status_code", "error");
    }
    true
}

/// Marks the span failed when the call broke below gRPC (connection lost, body error).
fn record_transport_error(span: &Span) {
    span.record("otel.status_code", "error");
}

pin_project! {
    /// The response future of a traced call: runs the inner future inside the call's span and
    /// hands the span on to the response body.
    #[derive(Debug)]
    pub struct TracedResponseFuture<F> {
        #[pin]
        inner: F,
        span: Span,
        side: RpcSide,
    }
}

impl<F> TracedResponseFuture<F> {
    pub(crate) fn new(inner: F, span: Span, side: RpcSide) -> Self {
        Self { inner, span, side }
    }
}

impl<F, ResBody, E> Future for TracedResponseFuture<F>
where
    F: Future<Output = Result<http::Response<ResBody>, E>>,
{
    type Output = Result<http::Response<TracedBody<ResBody>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let _entered = this.span.enter();
        let outcome = ready!(this.inner.poll(cx));
        Poll::Ready(match outcome {
            Ok(response) => {
                let status_seen = record_status(this.span, *this.side, response.headers());
                let enter = *this.side == RpcSide::Server && response.extensions().get::<BodyOutsideSpan>().is_none();
                let span = this.span.clone();
                Ok(response.map(|inner| TracedBody { inner, span, side: *this.side, enter, status_seen }))
            }
            Err(error) => {
                record_transport_error(this.span);
                Err(error)
            }
        })
    }
}

pin_project! {
    /// A response body that keeps its call's span open until the body is done, and records the
    /// gRPC status from the trailers. On a server, each poll runs inside the span unless the
    /// handler said its body does none of the call's work (see the module's docs).
    #[derive(Debug)]
    pub struct TracedBody<B> {
        #[pin]
        inner: B,
        span: Span,
        side: RpcSide,
        // Whether each poll runs inside the span.
        enter: bool,
        status_seen: bool,
    }
}

impl<B: Body> Body for TracedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let _entered = this.enter.then(|| this.span.enter());
        let frame = ready!(this.inner.poll_frame(cx));
        if !*this.status_seen {
            match &frame {
                Some(Ok(frame)) => {
                    if let Some(trailers) = frame.trailers_ref() {
                        *this.status_seen = record_status(this.span, *this.side, trailers);
                    }
                }
                Some(Err(_)) => {
                    record_transport_error(this.span);
                    *this.status_seen = true;
                }
                None => {}
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A body that ends at once, noting the span it was polled in.
    struct NotesSpan(Arc<Mutex<Option<Option<tracing::Id>>>>);

    impl Body for NotesSpan {
        type Data = &'static [u8];
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Self::Data>, Infallible>>> {
            *self.0.lock().unwrap() = Some(Span::current().id());
            Poll::Ready(None)
        }
    }

    /// The span `side`'s body was polled in, for a response with or without `BodyOutsideSpan`,
    /// and the call's span.
    fn polled_in(side: RpcSide, outside: bool) -> (Option<tracing::Id>, Option<tracing::Id>) {
        let seen = Arc::new(Mutex::new(None));
        let mut response = http::Response::new(NotesSpan(seen.clone()));
        if outside {
            response.extensions_mut().insert(BodyOutsideSpan);
        }
        let span = tracing::info_span!("call");
        let call = TracedResponseFuture::new(std::future::ready(Ok::<_, Infallible>(response)), span.clone(), side);
        let mut context = Context::from_waker(std::task::Waker::noop());
        let Poll::Ready(Ok(response)) = std::pin::pin!(call).poll(&mut context) else { panic!("the call is ready") };
        let _ = std::pin::pin!(response.into_body()).poll_frame(&mut context);
        let polled = seen.lock().unwrap().clone().expect("the body was polled");
        (polled, span.id())
    }

    #[test]
    fn a_server_body_is_polled_in_its_span_unless_its_handler_says_it_only_carries_bytes() {
        tracing::subscriber::with_default(tracing_subscriber::registry(), || {
            let (polled, call) = polled_in(RpcSide::Server, false);
            assert!(call.is_some());
            assert_eq!(polled, call, "the handler's stream runs in its call's span");
            let (polled, call) = polled_in(RpcSide::Server, true);
            assert!(polled.is_none() && call.is_some(), "a body marked BodyOutsideSpan is polled outside it");
            let (polled, call) = polled_in(RpcSide::Client, false);
            assert!(polled.is_none() && call.is_some(), "a client's body is the connection's");
        });
    }

    #[test]
    fn rpc_path_splits_into_service_and_method() {
        let name = RpcName::from_path("/grpc.health.v1.Health/Check");
        assert_eq!(name.full, "grpc.health.v1.Health/Check");
        assert_eq!(name.service, "grpc.health.v1.Health");
        assert_eq!(name.method, "Check");
    }

    #[test]
    fn path_that_is_not_grpc_keeps_what_was_asked_for() {
        assert_eq!(RpcName::from_path("/"), RpcName { full: "", service: "", method: "" });
        assert_eq!(
            RpcName::from_path("/favicon.ico"),
            RpcName { full: "favicon.ico", service: "favicon.ico", method: "" }
        );
    }

    #[test]
    fn not_found_fails_the_caller_but_not_the_server() {
        assert!(RpcSide::Client.is_error(5));
        assert!(!RpcSide::Server.is_error(5));
        assert!(RpcSide::Server.is_error(13));
        assert!(!RpcSide::Client.is_error(0));
        assert!(!RpcSide::Server.is_error(0));
    }
}
