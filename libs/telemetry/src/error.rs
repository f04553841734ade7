//! What can go wrong while configuring, installing or shutting down telemetry.

/// An error from reading telemetry configuration, installing the subscriber or flushing spans.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The log format named in configuration is neither `text` nor `json`.
    #[error("unknown log format `{value}`: expected `text` or `json`")]
    UnknownLogFormat {
        /// The value as it was given.
        value: String,
    },

    /// The log filter is not valid `RUST_LOG` syntax.
    #[error("invalid log filter `{filter}`")]
    InvalidLogFilter {
        /// The filter as it was given.
        filter: String,
        /// What the filter parser objected to.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },

    /// Telemetry is already installed in this process; the first installation stays in effect.
    #[error("telemetry is already initialised in this process")]
    AlreadyInitialized,

    /// Another global tracing subscriber was installed before this one.
    #[error("a global tracing subscriber is already installed in this process")]
    SubscriberAlreadySet {
        /// The refusal from `tracing`.
        #[source]
        source: tracing::subscriber::SetGlobalDefaultError,
    },

    /// OTLP export was requested outside a Tokio runtime, which the exporter's gRPC channel needs.
    #[error("exporting spans over OTLP needs a tokio runtime: call init from inside one")]
    NoRuntime,

    /// The OTLP exporter could not be built for the configured endpoint.
    #[error("cannot export spans to `{endpoint}`")]
    Exporter {
        /// The endpoint as it was given.
        endpoint: String,
        /// Why the exporter refused it.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },

    /// The tracer provider did not flush its spans and shut down cleanly.
    #[error("tracer provider did not shut down cleanly")]
    Shutdown {
        /// What the SDK reported.
        #[source]
        source: opentelemetry_sdk::error::OTelSdkError,
    },

    /// The blocking task that shuts the tracer provider down panicked or was cancelled.
    #[error("telemetry shutdown task did not finish")]
    ShutdownTask {
        /// Why the task ended early.
        #[source]
        source: tokio::task::JoinError,
    },
}

// Clap's `FromStr` fallback and `anyhow` both need a `Send + Sync + 'static` error.
const _: fn() = || {
    fn assert_send_sync_static<T: Send + Sync + 'static>() {}
    assert_send_sync_static::<TelemetryError>();
};
