//! Logs, traces and trace context for every berth process: one call installs the subscriber and
//! the OTLP exporter, and two tower layers carry W3C trace context across every gRPC hop.
//!
//! # Expected flow
//! `main` builds a [`TelemetryConfig`] (usually [`TelemetryConfig::from_env`]), calls [`init`]
//! once inside the Tokio runtime, wraps its tonic server in [`ServerTraceLayer`] and every client
//! `Channel` in [`ClientTraceLayer`], and calls [`TelemetryGuard::shutdown_async`] before the
//! runtime ends so the last spans reach the collector. Bus publishers put the current context on
//! each event with [`inject_context`]; consumers link to it with [`extract_context`].
//!
//! # Invariants
//! - The W3C `traceparent`/`tracestate` propagator is the global propagator whenever [`init`] has
//!   run, whether or not spans are exported.
//! - Spans carry real trace ids even with no OTLP endpoint, so a service that exports nothing
//!   still passes its callers' trace on to the services it calls.

mod client;
mod config;
mod error;
mod install;
mod propagation;
mod server;
mod traced;

pub use crate::{
    client::{Client, ClientTraceLayer, ClientTraceService},
    config::{LogFormat, TelemetryConfig},
    error::TelemetryError,
    install::{TelemetryGuard, init, otel_layer},
    propagation::{adopt_traceparent, current_trace_id, current_traceparent, extract_context, inject_context},
    server::{Server, ServerTraceLayer, ServerTraceService},
    traced::{BodyOutsideSpan, RpcSide, TraceLayer, TraceService, TraceSide, TracedBody, TracedResponseFuture},
};
