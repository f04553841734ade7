//! The client half of gRPC tracing: one `grpc.client` span per call, a child of the caller's
//! current span, whose context travels to the server in the `traceparent` header.
//!
//! # Expected use
//! `tower::ServiceBuilder::new().layer(ClientTraceLayer::default()).service(channel)`, then hand the result
//! to a generated client's `new`.

use opentelemetry::{global, trace::TraceContextExt};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    propagation::{HeaderInjector, current_context},
    traced::{RpcSide, TraceLayer, TraceService, TraceSide, rpc_span},
};

/// Traces every call made through a gRPC channel and tells the server which span made it:
/// `ClientTraceLayer::default()`.
pub type ClientTraceLayer = TraceLayer<Client>;

/// A channel wrapped by [`ClientTraceLayer`].
pub type ClientTraceService<S> = TraceService<S, Client>;

/// The calling end of a gRPC call.
#[derive(Debug, Clone, Copy, Default)]
pub struct Client;

impl TraceSide for Client {
    const SIDE: RpcSide = RpcSide::Client;

    fn open<B>(request: &mut http::Request<B>) -> Span {
        let span = rpc_span!("grpc.client", "client", request.uri().path());
        let cx = span.context();
        // An untraced client span (filtered out) must not cut the trace: the caller's own
        // context still goes to the server.
        let cx = if cx.has_active_span() { cx } else { current_context() };
        global::get_text_map_propagator(|propagator| {
            propagator.inject_context(&cx, &mut HeaderInjector(request.headers_mut()));
        });
        span
    }
}
