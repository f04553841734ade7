//! Installing the process-wide subscriber: log lines to stderr, spans to OpenTelemetry, and the
//! W3C propagator; and shutting the exporter down so the last spans are not lost.
//!
//! # Invariants
//! - Installation happens at most once per process. A second [`init`] returns
//!   [`TelemetryError::AlreadyInitialized`] and leaves the first in place, because `berth dev`
//!   and tests may call it more than once.
//! - Configuration is validated before anything global changes, so a rejected configuration
//!   leaves the process as it was and a corrected one can still be installed.
//! - The log filter decides which lines are printed; traces use the same filter but always keep
//!   this crate's RPC spans, so turning logs down never breaks trace propagation, and never take
//!   spans from the HTTP/2 stack the exporter itself sends through.
//!
//! # Why spans are exported from the SDK's own thread
//! The SDK's batch processor runs on a dedicated thread and drives the exporter's futures there;
//! the exporter's tonic channel is built inside the Tokio runtime and does its I/O on it. This is
//! the SDK's stable path (the processor that runs on a Tokio task is still experimental), and it
//! is why shutting down blocks: it waits for the last batch to reach the collector through the
//! runtime.

use std::{
    io::IsTerminal,
    sync::atomic::{AtomicBool, Ordering},
};

use opentelemetry::{InstrumentationScope, KeyValue, global, trace::TracerProvider as _};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing::Subscriber;
use tracing_log::AsLog;
use tracing_subscriber::{EnvFilter, Layer, filter::LevelFilter, layer::SubscriberExt, registry::LookupSpan};

use crate::{
    config::{LogFormat, TelemetryConfig},
    error::TelemetryError,
};

/// Added to the log filter for traces: this crate's RPC spans stay whatever the log filter says,
/// and the crates that carry the exporter's own requests stay out, so exporting spans never
/// produces more spans to export.
const TRACE_DIRECTIVES: [&str; 6] =
    ["berth_telemetry=info", "h2=off", "hyper=off", "tonic=off", "tower=off", "opentelemetry=off"];

/// Set once the global subscriber belongs to this crate.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Installs logging, tracing and the W3C propagator for this process.
///
/// Log lines go to stderr as text or JSON, filtered by `log_filter`. Spans always get
/// OpenTelemetry ids, so trace context passes through this process; they are exported over
/// OTLP/gRPC only when `otlp_endpoint` is set, and then `init` must run inside a Tokio runtime.
/// Records from the `log` crate (rustls, among others) are routed into the same subscriber.
///
/// Call [`TelemetryGuard::shutdown_async`] (or [`TelemetryGuard::shutdown`] off the runtime)
/// before the runtime ends; dropping the guard inside a runtime flushes in the background and may
/// lose the last spans if the process exits first.
pub fn init(config: &TelemetryConfig) -> Result<TelemetryGuard, TelemetryError> {
    let log_filter = env_filter(&config.log_filter)?;
    let trace_filter = TRACE_DIRECTIVES.iter().try_fold(env_filter(&config.log_filter)?, |filter, directive| {
        let directive = directive
            .parse()
            .map_err(|source| TelemetryError::InvalidLogFilter { filter: (*directive).to_owned(), source })?;
        Ok::<_, TelemetryError>(filter.add_directive(directive))
    })?;
    let exporter = match &config.otlp_endpoint {
        Some(endpoint) => Some(otlp_exporter(endpoint)?),
        None => None,
    };

    if INSTALLED.swap(true, Ordering::SeqCst) {
        return Err(TelemetryError::AlreadyInitialized);
    }

    let mut provider = SdkTracerProvider::builder().with_resource(resource(config));
    if let Some(exporter) = exporter {
        provider = provider.with_batch_exporter(exporter);
    }
    let provider = provider.build();

    let log_layer = match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).boxed(),
    };
    let subscriber = tracing_subscriber::registry()
        .with(log_layer.with_filter(log_filter))
        .with(otel_layer(&provider).with_filter(trace_filter));

    if let Err(source) = tracing::subscriber::set_global_default(subscriber) {
        INSTALLED.store(false, Ordering::SeqCst);
        // The provider may already run an export thread; a dropped guard stops it without
        // blocking a runtime worker.
        drop(TelemetryGuard::new(provider));
        return Err(TelemetryError::SubscriberAlreadySet { source });
    }
    global::set_text_map_propagator(TraceContextPropagator::new());
    global::set_tracer_provider(provider.clone());
    // Another `log` logger already installed keeps its records; tracing is unaffected.
    let _ = tracing_log::LogTracer::builder().with_max_level(LevelFilter::current().as_log()).init();

    Ok(TelemetryGuard::new(provider))
}

/// The `tracing` layer that turns spans into OpenTelemetry spans of `provider`, without touching
/// any global state; [`init`] uses it, and tests pair it with an in-memory exporter under
/// `tracing::subscriber::set_default`.
///
/// The service name belongs in the provider's resource; the instrumentation scope names this
/// crate. Spans carry no `busy_ns`/`idle_ns`: timing every enter and exit would cost two clock
/// reads per poll of every traced body, and a long stream (a data-plane tunnel) is polled once
/// per chunk it carries.
pub fn otel_layer<S>(provider: &SdkTracerProvider) -> impl Layer<S>
where
    S: Subscriber + for<'span> LookupSpan<'span>,
{
    let scope = InstrumentationScope::builder(env!("CARGO_PKG_NAME")).with_version(env!("CARGO_PKG_VERSION")).build();
    tracing_opentelemetry::layer().with_tracked_inactivity(false).with_tracer(provider.tracer_with_scope(scope))
}

fn env_filter(directives: &str) -> Result<EnvFilter, TelemetryError> {
    EnvFilter::try_new(directives)
        .map_err(|source| TelemetryError::InvalidLogFilter { filter: directives.to_owned(), source })
}

fn resource(config: &TelemetryConfig) -> Resource {
    Resource::builder()
        .with_attributes(config.resource.iter().map(|(key, value)| KeyValue::new(key.clone(), value.clone())))
        .with_service_name(config.service_name.clone())
        .build()
}

fn otlp_exporter(endpoint: &str) -> Result<SpanExporter, TelemetryError> {
    // The exporter's channel spawns its connection onto the current runtime.
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(TelemetryError::NoRuntime);
    }
    SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.to_owned(), source })
}

/// Owns the process's tracer provider; shutting it down sends the spans still buffered.
#[derive(Debug)]
#[must_use = "dropping the guard shuts span export down"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    fn new(provider: SdkTracerProvider) -> Self {
        Self { provider: Some(provider) }
    }

    /// Flushes buffered spans to the collector and stops exporting.
    ///
    /// Blocks until the last batch is sent or times out, and that send runs on the Tokio runtime:
    /// call it where blocking is fine (after the runtime's work is done, or in
    /// `spawn_blocking`), or use [`TelemetryGuard::shutdown_async`] from async code.
    pub fn shutdown(mut self) -> Result<(), TelemetryError> {
        match self.provider.take() {
            Some(provider) => shut_down(&provider),
            None => Ok(()),
        }
    }

    /// [`TelemetryGuard::shutdown`] on Tokio's blocking pool, so no runtime worker waits.
    pub async fn shutdown_async(mut self) -> Result<(), TelemetryError> {
        let Some(provider) = self.provider.take() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || shut_down(&provider))
            .await
            .map_err(|source| TelemetryError::ShutdownTask { source })?
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        let Some(provider) = self.provider.take() else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_err() {
            report(shut_down(&provider));
            return;
        }
        // Waiting here could hold the very runtime worker the last export needs, so the flush
        // runs on its own thread; if the process exits first, those spans are lost.
        let spawned = std::thread::Builder::new()
            .name("telemetry-shutdown".to_owned())
            .spawn(move || report(shut_down(&provider)));
        if let Err(error) = spawned {
            tracing::warn!(%error, "cannot start the thread that flushes spans; buffered spans are dropped");
        }
    }
}

fn shut_down(provider: &SdkTracerProvider) -> Result<(), TelemetryError> {
    provider.shutdown().map_err(|source| TelemetryError::Shutdown { source })
}

fn report(outcome: Result<(), TelemetryError>) {
    if let Err(error) = outcome {
        tracing::warn!(error = %error_chain(&error), "span export did not shut down cleanly");
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut chain = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        chain.push_str(": ");
        chain.push_str(&cause.to_string());
        source = cause.source();
    }
    chain
}
