//! W3C trace context in and out of carriers: HTTP/2 headers for gRPC, string maps for bus events.
//!
//! # Invariants
//! - Extraction always starts from an empty context, never the caller's ambient one, so a carrier
//!   with no or a malformed `traceparent` yields "no parent" instead of an unrelated trace.
//! - Values that are not valid header bytes are dropped on injection rather than failing the call.

use std::collections::HashMap;

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::{
    Context, global,
    propagation::{Extractor, Injector},
    trace::TraceContextExt,
};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Writes the current span's trace context (`traceparent`, `tracestate`) into a bus event's
/// headers, so a consumer can link its span to the publisher's.
///
/// Writes nothing when no span is being traced.
pub fn inject_context(carrier: &mut HashMap<String, String>) {
    let cx = current_context();
    global::get_text_map_propagator(|propagator| propagator.inject_context(&cx, carrier));
}

/// Reads the trace context a publisher put on a bus event with [`inject_context`].
///
/// The result carries no span when the headers hold none or hold a malformed one. A consumer
/// links to it rather than adopting it as a parent, because one pass may handle events from many
/// traces:
/// `span.add_link(extract_context(&headers).span().span_context().clone())`
/// (an invalid span context is ignored by `add_link`).
pub fn extract_context(carrier: &HashMap<String, String>) -> Context {
    global::get_text_map_propagator(|propagator| propagator.extract_with_context(&Context::new(), carrier))
}

/// The current span's W3C `traceparent`, or empty outside any traced span. Work that outlives
/// the request that asked for it (a lease placed, a service to roll out) keeps this beside it, so
/// whatever acts on it later joins the request's trace with [`adopt_traceparent`].
pub fn current_traceparent() -> String {
    let mut carrier = HashMap::new();
    inject_context(&mut carrier);
    carrier.remove("traceparent").unwrap_or_default()
}

/// Makes `span` a child of the remote span `traceparent` names, so the work it covers shows in
/// the trace of the request that caused it. Does nothing when `traceparent` is empty or
/// malformed (the span then starts a trace of its own), or when the span is not traced.
pub fn adopt_traceparent(span: &tracing::Span, traceparent: &str) {
    if traceparent.is_empty() {
        return;
    }
    let carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    let cx = extract_context(&carrier);
    if cx.span().span_context().is_valid() {
        // Refused only for a span that is already closed or not traced: nothing to join then.
        let _ = span.set_parent(cx);
    }
}

/// The current trace's id as 32 lowercase hex digits, for log lines and error reports; `None`
/// outside any traced span.
pub fn current_trace_id() -> Option<String> {
    let cx = current_context();
    let span = cx.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| span_context.trace_id().to_string())
}

/// The OpenTelemetry context of the current `tracing` span, or the attached OpenTelemetry context
/// when the current span is not traced (disabled by a filter, or no OpenTelemetry layer).
pub(crate) fn current_context() -> Context {
    let cx = tracing::Span::current().context();
    if cx.has_active_span() { cx } else { Context::current() }
}

/// Reads trace context from request headers.
pub(crate) struct HeaderExtractor<'a>(pub(crate) &'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes trace context into request headers.
pub(crate) struct HeaderInjector<'a>(pub(crate) &'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::from_str(&value)) {
            self.0.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
    use opentelemetry_sdk::{
        propagation::TraceContextPropagator,
        trace::{InMemorySpanExporter, SdkTracerProvider},
    };
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    fn traced() -> (SdkTracerProvider, tracing::subscriber::DefaultGuard) {
        global::set_text_map_propagator(TraceContextPropagator::new());
        let provider = SdkTracerProvider::builder().with_simple_exporter(InMemorySpanExporter::default()).build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let guard = tracing::subscriber::set_default(subscriber);
        (provider, guard)
    }

    #[test]
    fn bus_headers_carry_the_publishers_span_to_the_consumer() {
        let (_provider, _guard) = traced();
        let publish = tracing::info_span!("publish");
        let _entered = publish.enter();
        let expected = publish.context().span().span_context().clone();

        let mut headers = HashMap::new();
        inject_context(&mut headers);
        assert_eq!(headers.get("traceparent"), Some(&format!("00-{}-{}-01", expected.trace_id(), expected.span_id())));

        let extracted = extract_context(&headers);
        let remote = extracted.span().span_context().clone();
        assert!(remote.is_remote());
        assert_eq!(remote.trace_id(), expected.trace_id());
        assert_eq!(remote.span_id(), expected.span_id());
        assert_eq!(
            current_trace_id(),
            Some(expected.trace_id().to_string()),
            "the trace id in logs is the one that travels"
        );
    }

    #[test]
    fn nothing_is_injected_outside_a_traced_span() {
        let (_provider, _guard) = traced();
        let mut headers = HashMap::new();
        inject_context(&mut headers);
        assert!(headers.is_empty(), "got {headers:?}");
        assert_eq!(current_trace_id(), None);
    }

    #[test]
    fn malformed_bus_headers_yield_no_parent() {
        global::set_text_map_propagator(TraceContextPropagator::new());
        for traceparent in [
            "",
            "not-a-traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473Z-00f067aa0ba902b7-01",
        ] {
            let headers = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
            let extracted = extract_context(&headers);
            assert!(!extracted.span().span_context().is_valid(), "{traceparent:?} produced a parent");
        }
    }

    #[test]
    fn well_formed_bus_headers_name_the_remote_parent() {
        global::set_text_map_propagator(TraceContextPropagator::new());
        let headers = HashMap::from([(
            "traceparent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        )]);
        let extracted = extract_context(&headers);
        let remote = extracted.span().span_context().clone();
        assert_eq!(remote.trace_id(), TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap());
        assert_eq!(remote.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
    }

    #[test]
    fn header_values_that_are_not_valid_http_are_dropped() {
        let mut headers = HeaderMap::new();
        let mut injector = HeaderInjector(&mut headers);
        injector.set("tracestate", "vendor=ok\r\nx-injected: 1".to_owned());
        injector.set("bad header name", "value".to_owned());
        injector.set("traceparent", "00-abc".to_owned());
        assert_eq!(headers.len(), 1);
        assert_eq!(headers.get("traceparent").unwrap(), "00-abc");
    }
}
