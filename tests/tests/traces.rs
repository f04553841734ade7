//! One trace across the mesh: the services run as separate processes (two
//! replicas each, a private PostgreSQL and Redis, one agent), every one
//! exporting its spans over OTLP/gRPC to a collector served by this test.
//! An `ApplyService` must show up as one trace that reaches revisions (the
//! call, then its reconciles), leases (the lease requests and the node's
//! phase reports) and the agent (the launch), each span's resource naming
//! the service that made it and the host it ran on.
//!
//! It needs the binaries built, so it is ignored in the ordinary run and
//! runs with the fault suite: `make test-faults`.

#![allow(clippy::unwrap_used, reason = "tests fail loudly")]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_e2e::invariants::{self, ResidentService};
use berth_e2e::{Isolation, Mesh, MeshOptions, RUN_MARKER_ENV, ServiceKind};
use berth_proto::revisions::v1 as revisions_v1;
use berth_proto::types::v1::{BundleRef, Capacity};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};

/// How long the spans of the apply may take to reach the collector.
const EXPORT_DEADLINE: Duration = Duration::from_secs(60);

/// One exported span, with the resource of the process that made it.
#[derive(Debug, Clone)]
struct Seen {
    trace_id: Vec<u8>,
    name: String,
    service: String,
    host: String,
    node: String,
}

/// Keeps every span exported to it.
#[derive(Debug, Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Seen>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let attributes = resource_spans.resource.map(|r| r.attributes).unwrap_or_default();
            let (service, host, node) = (
                text(&attributes, "service.name"),
                text(&attributes, "host.name"),
                text(&attributes, "berth.node.name"),
            );
            for span in resource_spans.scope_spans.into_iter().flat_map(|scope| scope.spans) {
                spans.push(Seen {
                    trace_id: span.trace_id,
                    name: span.name,
                    service: service.clone(),
                    host: host.clone(),
                    node: node.clone(),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn text(attributes: &[KeyValue], key: &str) -> String {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|value| match &value.value {
            Some(any_value::Value::StringValue(text)) => Some(text.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

impl Collector {
    /// The trace holding an `ApplyService` call and its spans, once it
    /// spans revisions (the call and a reconcile), leases (a lease request)
    /// and the agent's launch.
    fn apply_trace(&self) -> Option<(Vec<u8>, Vec<Seen>)> {
        let spans = self.spans.lock().unwrap().clone();
        let mut traces: BTreeMap<Vec<u8>, Vec<Seen>> = BTreeMap::new();
        for span in spans {
            traces.entry(span.trace_id.clone()).or_default().push(span);
        }
        traces.into_iter().find(|(_, spans)| {
            let has = |service: &str, name: &dyn Fn(&str) -> bool| {
                spans.iter().any(|span| span.service == service && name(&span.name))
            };
            has("berth-revisions", &|name| name.ends_with("/ApplyService"))
                && has("berth-revisions", &|name| name == "reconcile")
                && has("berth-leases", &|name| name.ends_with("/RequestLease"))
                && has("berth-agent", &|name| name == "launch")
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs the binaries built: make test-faults"]
async fn an_apply_is_one_trace_through_revisions_leases_and_the_node_that_launches_it() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::default();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );

    // Agents on loopback, so they reach the collector as the services do.
    let options = MeshOptions {
        agents: 1,
        isolation: Isolation::Loopback,
        agent_egress: false,
        env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint),
            // Export every half second rather than every five.
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "500".into()),
        ],
        ..MeshOptions::default()
    };
    let mut mesh = Mesh::start(options).await.unwrap();
    let bundle = berth_e2e::bundles::push_sleeper(&mesh.dir().join("oci"), "sleeper").await.unwrap();
    let mut services =
        revisions_v1::services_client::ServicesClient::new(mesh.channel(ServiceKind::Revisions).unwrap());
    services
        .apply_service(revisions_v1::ApplyServiceRequest {
            name: "traced".into(),
            template: Some(revisions_v1::ServiceTemplate {
                bundle: Some(BundleRef { reference: bundle, ..Default::default() }),
                env: [(RUN_MARKER_ENV.to_string(), mesh.run_id().to_string())].into(),
                resources: Some(Capacity { cpu_millis: 100, memory_bytes: 32 << 20 }),
                replicas: Some(1),
                tier: mesh.options().tier.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let resident = [ResidentService { name: "traced".into(), replicas: 1 }];
    let (_, unsettled) = invariants::wait_settled(&mesh, &resident, Duration::from_secs(90)).await.unwrap();
    assert!(unsettled.is_empty(), "the service never ran: {unsettled:?}");

    let started = Instant::now();
    let found = loop {
        if let Some(found) = collector.apply_trace() {
            break Some(found);
        }
        if started.elapsed() > EXPORT_DEADLINE {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    mesh.shutdown().await.unwrap();
    server.abort();

    let Some((trace_id, spans)) = found else {
        let spans = collector.spans.lock().unwrap();
        let names: BTreeSet<(String, String)> = spans.iter().map(|s| (s.service.clone(), s.name.clone())).collect();
        panic!("no trace reached revisions, leases and the agent's launch; {} spans seen: {names:#?}", spans.len());
    };
    let services: BTreeSet<&str> = spans.iter().map(|span| span.service.as_str()).collect();
    let names: BTreeSet<(&str, &str)> = spans.iter().map(|span| (span.service.as_str(), span.name.as_str())).collect();
    eprintln!("traces: one trace of {} spans over {services:?}: {names:?}", spans.len());
    assert!(services.len() >= 3, "trace {trace_id:02x?} spans {services:?}");
    assert!(spans.iter().all(|span| !span.host.is_empty()), "every span names its host: {spans:#?}");
    let launch = spans.iter().find(|span| span.name == "launch").unwrap();
    assert_eq!(launch.node, "e2e-agent-0", "the launch names the node it ran on");
}
