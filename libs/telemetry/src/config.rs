//! How a process wants its logs and traces: format, filter, and where spans go.
//!
//! # Where values come from
//! Flags win over the environment; [`TelemetryConfig::from_env`] reads the environment for
//! processes that take no flags. An empty variable counts as unset, so `RUST_LOG=` in a compose
//! file means the default rather than "log nothing".

use std::{fmt, str::FromStr};

use crate::error::TelemetryError;

/// The filter used when none is configured.
const DEFAULT_LOG_FILTER: &str = "info";

/// The OTLP/gRPC collector endpoint, as the OpenTelemetry specification names it.
const OTLP_ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// `text` or `json`.
const LOG_FORMAT_VAR: &str = "BERTH_LOG_FORMAT";

/// `RUST_LOG`-style directives.
const LOG_FILTER_VAR: &str = "RUST_LOG";

/// How log lines are written to stderr.
///
/// Parses from `text` or `json` (any case), so a clap field of this type needs no custom parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines, coloured when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl LogFormat {
    /// The name this format parses from.
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LogFormat {
    type Err = TelemetryError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let trimmed = value.trim();
        if trimmed.eq_ignore_ascii_case("text") {
            Ok(LogFormat::Text)
        } else if trimmed.eq_ignore_ascii_case("json") {
            Ok(LogFormat::Json)
        } else {
            Err(TelemetryError::UnknownLogFormat { value: value.to_owned() })
        }
    }
}

/// Everything [`crate::init`] needs to install logging and tracing for one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// The `service.name` resource attribute, e.g. `berth-identity`.
    pub service_name: String,
    /// How log lines are written.
    pub log_format: LogFormat,
    /// `RUST_LOG`-style directives, e.g. `info,berth_leases=debug`.
    pub log_filter: String,
    /// The OTLP/gRPC collector, e.g. `http://jaeger:4317`; spans are not exported when unset.
    pub otlp_endpoint: Option<String>,
    /// Extra resource attributes on every exported span, e.g. `("berth.node.id", id)`.
    pub resource: Vec<(String, String)>,
}

impl TelemetryConfig {
    /// Text logs at `info`, no export, no extra resource attributes.
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            service_name: service_name.into(),
            log_format: LogFormat::default(),
            log_filter: DEFAULT_LOG_FILTER.to_owned(),
            otlp_endpoint: None,
            resource: Vec::new(),
        }
    }

    /// Reads `OTEL_EXPORTER_OTLP_ENDPOINT`, `BERTH_LOG_FORMAT` and `RUST_LOG`.
    pub fn from_env(service_name: impl Into<String>) -> Result<Self, TelemetryError> {
        Self::from_lookup(service_name, |name| std::env::var(name).ok())
    }

    fn from_lookup(
        service_name: impl Into<String>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TelemetryError> {
        let var = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        let mut config = Self::new(service_name);
        if let Some(format) = var(LOG_FORMAT_VAR) {
            config.log_format = format.parse()?;
        }
        if let Some(filter) = var(LOG_FILTER_VAR) {
            config.log_filter = filter;
        }
        config.otlp_endpoint = var(OTLP_ENDPOINT_VAR);
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn from_vars(vars: &[(&str, &str)]) -> Result<TelemetryConfig, TelemetryError> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        TelemetryConfig::from_lookup("berth-test", |name| vars.get(name).cloned())
    }

    #[test]
    fn log_format_parses_json_and_text_in_any_case() {
        assert_eq!("json".parse::<LogFormat>().unwrap(), LogFormat::Json);
        assert_eq!("JSON".parse::<LogFormat>().unwrap(), LogFormat::Json);
        assert_eq!(" text ".parse::<LogFormat>().unwrap(), LogFormat::Text);
        assert_eq!(LogFormat::Json.to_string().parse::<LogFormat>().unwrap(), LogFormat::Json);
    }

    #[test]
    fn unknown_log_format_names_the_value_and_the_choices() {
        let err = "yaml".parse::<LogFormat>().unwrap_err();
        assert!(matches!(&err, TelemetryError::UnknownLogFormat { value } if value == "yaml"));
        assert_eq!(err.to_string(), "unknown log format `yaml`: expected `text` or `json`");
    }

    #[test]
    fn empty_environment_gives_text_logs_at_info_without_export() {
        let config = from_vars(&[]).unwrap();
        assert_eq!(config, TelemetryConfig::new("berth-test"));
        assert_eq!(config.log_filter, "info");
        assert_eq!(config.log_format, LogFormat::Text);
        assert_eq!(config.otlp_endpoint, None);
    }

    #[test]
    fn environment_sets_format_filter_and_endpoint() {
        let config = from_vars(&[
            ("BERTH_LOG_FORMAT", "json"),
            ("RUST_LOG", "warn,berth_leases=debug"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4317"),
        ])
        .unwrap();
        assert_eq!(config.service_name, "berth-test");
        assert_eq!(config.log_format, LogFormat::Json);
        assert_eq!(config.log_filter, "warn,berth_leases=debug");
        assert_eq!(config.otlp_endpoint.as_deref(), Some("http://jaeger:4317"));
    }

    #[test]
    fn empty_variables_count_as_unset() {
        let config =
            from_vars(&[("BERTH_LOG_FORMAT", ""), ("RUST_LOG", " "), ("OTEL_EXPORTER_OTLP_ENDPOINT", "")]).unwrap();
        assert_eq!(config, TelemetryConfig::new("berth-test"));
    }

    #[test]
    fn bad_log_format_in_environment_is_an_error() {
        let err = from_vars(&[("BERTH_LOG_FORMAT", "logfmt")]).unwrap_err();
        assert!(matches!(err, TelemetryError::UnknownLogFormat { value } if value == "logfmt"));
    }
}
