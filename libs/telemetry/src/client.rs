//! The client half of gRPC tracing: one `grpc.client` span per call, a child of the caller's
//! current span, whose context travels to the server in the `traceparent` header.
//!
//! # Expected use
//! `tower::ServiceBuilder::new().layer(ClientTraceLayer).service(channel)`, then hand the result
//! to a generated client's `new`.

use std::task::{Context, Poll};

use opentelemetry::{global, trace::TraceContextExt};
use tower_layer::Layer;
use tower_service::Service;
use tracing::{Span, field::Empty};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    propagation::{HeaderInjector, current_context},
    traced::{RpcName, RpcSide, TracedBody, TracedResponseFuture},
};

/// Traces every call made through a gRPC channel and tells the server which span made it.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientTraceLayer;

impl<S> Layer<S> for ClientTraceLayer {
    type Service = ClientTraceService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClientTraceService { inner }
    }
}

/// A channel wrapped by [`ClientTraceLayer`].
#[derive(Debug, Clone)]
pub struct ClientTraceService<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for ClientTraceService<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
{
    type Response = http::Response<TracedBody<ResBody>>;
    type Error = S::Error;
    type Future = TracedResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let span = client_span(request.uri().path());
        let cx = span.context();
        // An untraced client span (filtered out) must not cut the trace: the caller's own
        // context still goes to the server.
        let cx = if cx.has_active_span() { cx } else { current_context() };
        global::get_text_map_propagator(|propagator| {
            propagator.inject_context(&cx, &mut HeaderInjector(request.headers_mut()));
        });
        let response = span.in_scope(|| self.inner.call(request));
        TracedResponseFuture::new(response, span, RpcSide::Client)
    }
}

fn client_span(path: &str) -> Span {
    let name = RpcName::from_path(path);
    tracing::info_span!(
        "grpc.client",
        otel.name = name.full,
        otel.kind = "client",
        rpc.system = "grpc",
        rpc.service = name.service,
        rpc.method = name.method,
        rpc.grpc.status_code = Empty,
        otel.status_code = Empty,
    )
}
