//! The process-wide installation: what `init` refuses, and spans reaching a real OTLP/gRPC
//! collector served in-process.
//!
//! `init` installs a global subscriber, so only one test here ever succeeds at it; the others
//! check configuration that is refused before anything global changes.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use berth_telemetry::{LogFormat, TelemetryConfig, TelemetryError, current_trace_id, init};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::any_value,
    trace::v1::ResourceSpans,
};
use tokio::{net::TcpListener, sync::oneshot};
use tonic::transport::{Server, server::TcpIncoming};

/// Keeps every export it receives.
#[derive(Debug, Clone, Default)]
struct Collector {
    received: Arc<Mutex<Vec<ResourceSpans>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.received.lock().expect("collector lock").extend(request.into_inner().resource_spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn string_attribute(attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()).and_then(|value| match &value.value {
        Some(any_value::Value::StringValue(text)) => Some(text.clone()),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_collector_with_the_service_resource_and_a_second_init_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let collector = Collector::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder().add_service(TraceServiceServer::new(collector.clone())).serve_with_incoming_shutdown(
            TcpIncoming::from(listener),
            async {
                let _ = stopped.await;
            },
        ),
    );

    let mut config = TelemetryConfig::new("berth-telemetry-test");
    config.log_format = LogFormat::Json;
    config.otlp_endpoint = Some(format!("http://{addr}"));
    config.resource = vec![("berth.node.id".to_owned(), "node-7".to_owned())];
    let guard = init(&config).unwrap();

    let again = init(&TelemetryConfig::new("berth-other"));
    assert!(matches!(again, Err(TelemetryError::AlreadyInitialized)), "second init: {again:?}");

    let trace_id = {
        let span = tracing::info_span!("test.export");
        let _entered = span.enter();
        tracing::info!("inside the exported span");
        current_trace_id().unwrap()
    };

    tokio::time::timeout(Duration::from_secs(10), guard.shutdown_async()).await.unwrap().unwrap();

    let received = collector.received.lock().unwrap().clone();
    let (resource, span) = received
        .iter()
        .flat_map(|resource_spans| {
            resource_spans
                .scope_spans
                .iter()
                .flat_map(move |scope| scope.spans.iter().map(move |span| (resource_spans.resource.as_ref(), span)))
        })
        .find(|(_, span)| span.name == "test.export")
        .unwrap_or_else(|| panic!("no test.export span in {received:#?}"));
    assert_eq!(hex(&span.trace_id), trace_id);
    let resource = resource.unwrap();
    assert_eq!(string_attribute(&resource.attributes, "service.name").as_deref(), Some("berth-telemetry-test"));
    assert_eq!(string_attribute(&resource.attributes, "berth.node.id").as_deref(), Some("node-7"));

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[test]
fn invalid_log_filter_is_refused_naming_the_filter() {
    let mut config = TelemetryConfig::new("berth-telemetry-test");
    config.log_filter = "info,berth_leases=loud".to_owned();
    let err = init(&config).unwrap_err();
    assert!(
        matches!(&err, TelemetryError::InvalidLogFilter { filter, .. } if filter == "info,berth_leases=loud"),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "invalid log filter `info,berth_leases=loud`");
}

#[test]
fn otlp_export_outside_a_runtime_is_refused() {
    let mut config = TelemetryConfig::new("berth-telemetry-test");
    config.otlp_endpoint = Some("http://127.0.0.1:4317".to_owned());
    let err = init(&config).unwrap_err();
    assert!(matches!(err, TelemetryError::NoRuntime), "{err:?}");
}

#[tokio::test]
async fn https_collector_without_tls_support_is_refused_naming_the_endpoint() {
    let mut config = TelemetryConfig::new("berth-telemetry-test");
    config.otlp_endpoint = Some("https://collector.example:4317".to_owned());
    let err = init(&config).unwrap_err();
    assert!(
        matches!(&err, TelemetryError::Exporter { endpoint, .. } if endpoint == "https://collector.example:4317"),
        "{err:?}"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}
