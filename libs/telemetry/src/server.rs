//! The server half of gRPC tracing: one `grpc.server` span per request, parented on the caller's
//! span from the W3C `traceparent` header.
//!
//! # Invariants
//! - The span's OpenTelemetry parent is only ever the incoming `traceparent`: a request without
//!   one (or with a malformed one) starts a fresh trace, never joins whatever context the
//!   connection task happened to carry.

use opentelemetry::global;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    propagation::HeaderExtractor,
    traced::{RpcSide, TraceLayer, TraceService, TraceSide, rpc_span},
};

/// Traces every request a gRPC server answers; give `ServerTraceLayer::default()` to tonic's
/// `Server::builder().layer(..)`.
pub type ServerTraceLayer = TraceLayer<Server>;

/// A server stack wrapped by [`ServerTraceLayer`].
pub type ServerTraceService<S> = TraceService<S, Server>;

/// The answering end of a gRPC call.
#[derive(Debug, Clone, Copy, Default)]
pub struct Server;

impl TraceSide for Server {
    const SIDE: RpcSide = RpcSide::Server;

    fn open<B>(request: &mut http::Request<B>) -> Span {
        server_span(request)
    }
}

fn server_span<B>(request: &http::Request<B>) -> Span {
    let span = rpc_span!("grpc.server", "server", request.uri().path());
    let parent = global::get_text_map_propagator(|propagator| {
        propagator.extract_with_context(&opentelemetry::Context::new(), &HeaderExtractor(request.headers()))
    });
    // Fails only when the span is not traced (filtered out, or no OpenTelemetry layer); the
    // request is then served untraced, as the filter asked.
    let _ = span.set_parent(parent);
    span
}
