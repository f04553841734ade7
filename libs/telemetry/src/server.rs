//! The server half of gRPC tracing: one `grpc.server` span per request, parented on the caller's
//! span from the W3C `traceparent` header.
//!
//! # Invariants
//! - The span's OpenTelemetry parent is only ever the incoming `traceparent`: a request without
//!   one (or with a malformed one) starts a fresh trace, never joins whatever context the
//!   connection task happened to carry.

use std::task::{Context, Poll};

use opentelemetry::global;
use tower_layer::Layer;
use tower_service::Service;
use tracing::{Span, field::Empty};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    propagation::HeaderExtractor,
    traced::{RpcName, RpcSide, TracedBody, TracedResponseFuture},
};

/// Traces every request a gRPC server answers; give it to tonic's `Server::builder().layer(..)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerTraceLayer;

impl<S> Layer<S> for ServerTraceLayer {
    type Service = ServerTraceService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerTraceService { inner }
    }
}

/// A server stack wrapped by [`ServerTraceLayer`].
#[derive(Debug, Clone)]
pub struct ServerTraceService<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for ServerTraceService<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
{
    type Response = http::Response<TracedBody<ResBody>>;
    type Error = S::Error;
    type Future = TracedResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let span = server_span(&request);
        let response = span.in_scope(|| self.inner.call(request));
        TracedResponseFuture::new(response, span, RpcSide::Server)
    }
}

fn server_span<B>(request: &http::Request<B>) -> Span {
    let name = RpcName::from_path(request.uri().path());
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = name.full,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = name.service,
        rpc.method = name.method,
        rpc.grpc.status_code = Empty,
        otel.status_code = Empty,
    );
    let parent = global::get_text_map_propagator(|propagator| {
        propagator.extract_with_context(&opentelemetry::Context::new(), &HeaderExtractor(request.headers()))
    });
    // Fails only when the span is not traced (filtered out, or no OpenTelemetry layer); the
    // request is then served untraced, as the filter asked.
    let _ = span.set_parent(parent);
    span
}
