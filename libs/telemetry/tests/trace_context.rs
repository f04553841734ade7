//! W3C trace context across a real tonic client and server on loopback, with spans captured by
//! the SDK's in-memory exporter.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use berth_telemetry::{ClientTraceLayer, ServerTraceLayer, otel_layer};
use opentelemetry::{
    KeyValue, Value, global,
    trace::{SpanId, SpanKind, Status, TraceContextExt, TraceId},
};
use opentelemetry_sdk::{
    propagation::TraceContextPropagator,
    trace::{InMemorySpanExporter, SdkTracerProvider, SpanData},
};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tonic::{
    Code,
    metadata::MetadataValue,
    transport::{Channel, Endpoint, Server, server::TcpIncoming},
};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
use tracing::{Instrument, subscriber::DefaultGuard};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

const CHECK: &str = "grpc.health.v1.Health/Check";

/// Spans finished on this thread while the guard lives.
struct Captured {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _subscriber: DefaultGuard,
}

impl Captured {
    fn start() -> Self {
        global::set_text_map_propagator(TraceContextPropagator::new());
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        let subscriber = tracing_subscriber::registry().with(otel_layer(&provider));
        let guard = tracing::subscriber::set_default(subscriber);
        Self { exporter, provider, _subscriber: guard }
    }

    /// Waits for `count` finished spans named `name` of `kind`: the server's span ends when
    /// hyper drops the response body, which may be just after the client has its answer.
    async fn spans(&self, name: &str, kind: SpanKind, count: usize) -> Vec<SpanData> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            self.provider.force_flush().expect("flush the in-memory exporter");
            let spans: Vec<SpanData> = self
                .exporter
                .get_finished_spans()
                .expect("read finished spans")
                .into_iter()
                .filter(|span| span.name == name && span.span_kind == kind)
                .collect();
            if spans.len() >= count || Instant::now() > deadline {
                assert_eq!(spans.len(), count, "finished {kind:?} spans named {name}: {spans:#?}");
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn span(&self, name: &str, kind: SpanKind) -> SpanData {
        self.spans(name, kind, 1).await.remove(0)
    }
}

/// A health server behind [`ServerTraceLayer`], stopped through a oneshot.
struct HealthServer {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl HealthServer {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let addr = listener.local_addr().expect("bound address");
        let (_reporter, health) = tonic_health::server::health_reporter();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            Server::builder().layer(ServerTraceLayer::default()).add_service(health).serve_with_incoming_shutdown(
                TcpIncoming::from(listener),
                async {
                    let _ = stopped.await;
                },
            ),
        );
        Self { addr, stop, task }
    }

    async fn channel(&self) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.addr))
            .expect("loopback uri")
            .connect()
            .await
            .expect("connect to the health server")
    }

    async fn stop(self) {
        self.stop.send(()).expect("server still running");
        self.task.await.expect("server task").expect("server ends cleanly");
    }
}

fn check(service: &str) -> HealthCheckRequest {
    HealthCheckRequest { service: service.to_owned() }
}

fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes.iter().find(|KeyValue { key: k, .. }| k.as_str() == key).map(|kv| kv.value.clone())
}

#[tokio::test(flavor = "current_thread")]
async fn client_span_is_the_parent_of_the_server_span() {
    let captured = Captured::start();
    let server = HealthServer::start().await;
    let traced = tower::ServiceBuilder::new().layer(ClientTraceLayer::default()).service(server.channel().await);
    let mut client = HealthClient::new(traced);

    let root = tracing::info_span!("test.root");
    let root_cx = root.context().span().span_context().clone();
    let response = client.check(check("")).instrument(root.clone()).await.unwrap();
    drop(root);
    assert_eq!(response.get_ref().status(), ServingStatus::Serving);

    let client_span = captured.span(CHECK, SpanKind::Client).await;
    let server_span = captured.span(CHECK, SpanKind::Server).await;

    assert_eq!(
        server_span.parent_span_id,
        client_span.span_context.span_id(),
        "the server's span hangs under the client's"
    );
    assert!(server_span.parent_span_is_remote);
    assert_eq!(client_span.parent_span_id, root_cx.span_id());
    assert_eq!(client_span.span_context.trace_id(), root_cx.trace_id());
    assert_eq!(server_span.span_context.trace_id(), root_cx.trace_id());

    for span in [&server_span, &client_span] {
        assert_eq!(attribute(span, "rpc.grpc.status_code"), Some(Value::I64(0)));
        assert_eq!(attribute(span, "rpc.system"), Some("grpc".into()));
        assert_eq!(attribute(span, "rpc.service"), Some("grpc.health.v1.Health".into()));
        assert_eq!(attribute(span, "rpc.method"), Some("Check".into()));
        assert_eq!(span.status, Status::Unset);
    }

    server.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn error_status_from_a_trailers_only_response_is_recorded_on_both_sides() {
    let captured = Captured::start();
    let server = HealthServer::start().await;
    let traced = tower::ServiceBuilder::new().layer(ClientTraceLayer::default()).service(server.channel().await);
    let mut client = HealthClient::new(traced);

    let status = client.check(check("no.such.Service")).instrument(tracing::info_span!("test.root")).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);

    let client_span = captured.span(CHECK, SpanKind::Client).await;
    let server_span = captured.span(CHECK, SpanKind::Server).await;
    assert_eq!(attribute(&server_span, "rpc.grpc.status_code"), Some(Value::I64(5)));
    assert_eq!(attribute(&client_span, "rpc.grpc.status_code"), Some(Value::I64(5)));
    assert_eq!(server_span.status, Status::Unset, "answering NOT_FOUND is not a server fault");
    assert!(matches!(client_span.status, Status::Error { .. }), "the caller did not get what it asked for");

    server.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn request_without_traceparent_starts_a_fresh_trace() {
    let captured = Captured::start();
    let server = HealthServer::start().await;
    let mut client = HealthClient::new(server.channel().await);

    let root = tracing::info_span!("test.root");
    let root_trace = root.context().span().span_context().trace_id();
    let response = client.check(check("")).instrument(root).await.unwrap();
    assert_eq!(response.get_ref().status(), ServingStatus::Serving);

    let server_span = captured.span(CHECK, SpanKind::Server).await;
    assert_eq!(server_span.parent_span_id, SpanId::INVALID);
    assert!(server_span.span_context.is_valid());
    assert_ne!(server_span.span_context.trace_id(), root_trace, "a server span joins only the trace its request names");
    assert_eq!(attribute(&server_span, "rpc.grpc.status_code"), Some(Value::I64(0)));

    server.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn incoming_traceparent_and_tracestate_name_the_server_spans_parent() {
    let captured = Captured::start();
    let server = HealthServer::start().await;
    let channel = server.channel().await;
    let mut client = HealthClient::with_interceptor(channel, |mut request: tonic::Request<()>| {
        let metadata = request.metadata_mut();
        metadata.insert(
            "traceparent",
            MetadataValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        metadata.insert("tracestate", MetadataValue::from_static("berth=t61rcwkgmzxk"));
        Ok(request)
    });

    client.check(check("")).await.unwrap();

    let server_span = captured.span(CHECK, SpanKind::Server).await;
    assert_eq!(server_span.span_context.trace_id(), TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap());
    assert_eq!(server_span.parent_span_id, SpanId::from_hex("00f067aa0ba902b7").unwrap());
    assert_eq!(server_span.span_context.trace_state().get("berth"), Some("t61rcwkgmzxk"));

    server.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn malformed_traceparent_is_ignored_and_the_call_succeeds() {
    const MALFORMED: [&str; 7] = [
        "garbage",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    ];
    let captured = Captured::start();
    let server = HealthServer::start().await;
    let channel = server.channel().await;

    for traceparent in MALFORMED {
        let value = MetadataValue::from_static(traceparent);
        let mut client = HealthClient::with_interceptor(channel.clone(), move |mut request: tonic::Request<()>| {
            request.metadata_mut().insert("traceparent", value.clone());
            Ok(request)
        });
        let response = client.check(check("")).await.unwrap();
        assert_eq!(response.get_ref().status(), ServingStatus::Serving, "{traceparent:?}");
    }

    let server_spans = captured.spans(CHECK, SpanKind::Server, MALFORMED.len()).await;
    let named_trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    for span in &server_spans {
        assert_eq!(span.parent_span_id, SpanId::INVALID, "{span:#?}");
        assert!(span.span_context.is_valid());
        assert_ne!(span.span_context.trace_id(), named_trace);
        assert_eq!(attribute(span, "rpc.grpc.status_code"), Some(Value::I64(0)));
    }

    server.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_kept_traceparent_makes_later_work_a_child_of_the_request() {
    let captured = Captured::start();
    let request = tracing::info_span!("request");
    let kept = request.in_scope(berth_telemetry::current_traceparent);
    assert!(kept.starts_with("00-"), "a traced span yields a traceparent: {kept:?}");
    drop(request);
    let request = captured.span("request", SpanKind::Internal).await;

    let later = tracing::info_span!("later");
    berth_telemetry::adopt_traceparent(&later, &kept);
    drop(later);
    let later = captured.span("later", SpanKind::Internal).await;
    assert_eq!(later.span_context.trace_id(), request.span_context.trace_id());
    assert_eq!(later.parent_span_id, request.span_context.span_id());

    // Nothing kept, or something unreadable: the work starts its own trace.
    for kept in ["", "00-not-a-trace-01"] {
        let alone = tracing::info_span!("alone");
        berth_telemetry::adopt_traceparent(&alone, kept);
        drop(alone);
        let alone = captured.span("alone", SpanKind::Internal).await;
        assert_ne!(alone.span_context.trace_id(), request.span_context.trace_id());
        assert_eq!(alone.parent_span_id, SpanId::INVALID);
        captured.exporter.reset();
    }
    assert_eq!(berth_telemetry::current_traceparent(), "", "outside any span there is nothing to keep");
}
