//! The agent following its egress state over real mTLS gRPC: it keeps
//! asking while the egress service answers `UNIMPLEMENTED`, then opens
//! `WatchEgress` as its own node, applies each state whole and acknowledges
//! it with the generation, the error when it could not apply it, and how it
//! enforces egress.
//!
//! Identity and leases run in process (see `common`); the egress side is a
//! stand-in `NodeEgress` server that records what the agent sends. It
//! serves on the harness's admin certificate, the one certificate besides
//! the node's that the harness issues for loopback: the agent checks only
//! that the server's certificate chains to the CA.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use berth_agent::EgressIsolation;
use berth_proto::egress::v1::{
    self as egress, AckEgressRequest, AckEgressResponse, Destination, EgressEnforcement, EgressPlan, ListenerProtocol,
    NodeEgressState, ServiceEgress, WatchEgressRequest, node_egress_server::NodeEgressServer,
};
use berth_testkit::eventually;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

use common::*;

/// A `NodeEgress` server that refuses the first opens, then streams what
/// the test pushes, and keeps every acknowledgement with its caller.
#[derive(Debug, Default)]
struct StandIn {
    refusals: AtomicUsize,
    opened: Mutex<Vec<String>>,
    stream: Mutex<Option<mpsc::Sender<Result<NodeEgressState, Status>>>>,
    acks: Mutex<Vec<(String, AckEgressRequest)>>,
}

#[tonic::async_trait]
impl egress::node_egress_server::NodeEgress for StandIn {
    async fn watch_egress(
        &self,
        request: Request<WatchEgressRequest>,
    ) -> Result<Response<BoxStream<NodeEgressState>>, Status> {
        let node_id = berth_rpc::require_own_node(&request, &request.get_ref().node_id)?.to_string();
        self.opened.lock().unwrap().push(node_id);
        if self.refusals.load(Ordering::SeqCst) > 0 {
            self.refusals.fetch_sub(1, Ordering::SeqCst);
            return Err(Status::unimplemented("node egress is not served yet"));
        }
        let (tx, rx) = mpsc::channel(8);
        *self.stream.lock().unwrap() = Some(tx);
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn ack_egress(&self, request: Request<AckEgressRequest>) -> Result<Response<AckEgressResponse>, Status> {
        let caller = berth_rpc::require_own_node(&request, &request.get_ref().node_id)?.to_string();
        self.acks.lock().unwrap().push((caller, request.into_inner()));
        Ok(Response::new(AckEgressResponse {}))
    }
}

impl StandIn {
    async fn push(&self, state: NodeEgressState) {
        let stream = self.stream.lock().unwrap().clone().expect("the agent follows the stream");
        stream.send(Ok(state)).await.unwrap();
    }

    async fn until(&self, what: &str, check: impl Fn(&StandIn) -> bool) {
        eventually(what, SLOW, || async { if check(self) { Ok(()) } else { Err(self) } }).await;
    }

    fn ack(&self, generation: u64) -> Option<(String, AckEgressRequest)> {
        self.acks.lock().unwrap().iter().find(|(_, ack)| ack.generation == generation).cloned()
    }
}

fn state(generation: u64, hostname: &str) -> NodeEgressState {
    let allowed = Destination {
        listener: "http".into(),
        protocol: ListenerProtocol::Http as i32,
        listener_port: 3128,
        hostname: hostname.into(),
        ports: vec![443],
        route: "out".into(),
    };
    let web =
        ServiceEgress { service: "web".into(), gateway: "gw".into(), allowed: vec![allowed], ..Default::default() };
    NodeEgressState {
        generation,
        plans: vec![EgressPlan { project: "acme".into(), generation: 1, services: vec![web], ..Default::default() }],
    }
}

#[tokio::test]
async fn the_agent_retries_an_unimplemented_egress_service_then_applies_and_acks_each_state_as_its_own_node() {
    let plane = ControlPlane::start(Duration::from_secs(5)).await;
    let stand_in = std::sync::Arc::new(StandIn::default());
    stand_in.refusals.store(2, Ordering::SeqCst);
    let listener = berth_rpc::Listener::bind("127.0.0.1:0".parse().unwrap(), plane.admin.clone()).await.unwrap();
    let egress_addr = listener.local_addr().unwrap().to_string();
    let serving = CancellationToken::new();
    let server = berth_rpc::ServerBuilder::new().add_service(NodeEgressServer::from_arc(stand_in.clone()));
    tokio::spawn(server.serve(listener, serving.clone()));

    let dir = TestDir::new();
    let mut config = agent_config(&plane, dir.path());
    config.egress = Some(egress_addr);
    config.egress_isolation = EgressIsolation::Off;
    let agent = RunningAgent::start(config).await;
    let node_id = agent.handle.node_id();

    stand_in.until("the stream to open", |s| s.stream.lock().unwrap().is_some()).await;
    let opened = stand_in.opened.lock().unwrap().clone();
    assert_eq!(opened, vec![node_id.clone(); 3], "two UNIMPLEMENTED answers, then the stream, all as the node");

    stand_in.push(state(3, "api.example.com")).await;
    stand_in.until("generation 3 to be acked", |s| s.ack(3).is_some()).await;
    let (caller, ack) = stand_in.ack(3).unwrap();
    assert_eq!(caller, node_id, "acknowledged on the node's own certificate");
    assert_eq!((ack.node_id.as_str(), ack.error.as_str()), (node_id.as_str(), ""));
    assert_eq!(ack.enforcement, EgressEnforcement::Advisory as i32, "isolation is off");
    let status = agent.handle.egress().unwrap().borrow().clone();
    assert_eq!(status.applied, Some(3));

    stand_in.push(state(4, "not a host")).await;
    stand_in.until("generation 4 to be acked", |s| s.ack(4).is_some()).await;
    let (_, failed) = stand_in.ack(4).unwrap();
    assert!(failed.error.contains("hostname 'not a host'"), "{}", failed.error);
    let status = agent.handle.egress().unwrap().borrow().clone();
    assert_eq!(status.applied, Some(3), "the rules of generation 3 hold");
    assert!(status.error.unwrap().contains("not a host"));

    // A node hosting a large tenant gets a state past gRPC's 4 MiB default.
    let mut large = state(5, "api.example.com");
    let template = large.plans[0].services[0].allowed[0].clone();
    large.plans[0].services[0].allowed = (0..80_000)
        .map(|i| Destination { hostname: format!("host-{i:05}.a-long-enough-domain.example.com"), ..template.clone() })
        .collect();
    assert!(prost::Message::encoded_len(&large) > 4 << 20, "the state is over 4 MiB");
    stand_in.push(large).await;
    stand_in.until("generation 5 to be acked", |s| s.ack(5).is_some()).await;
    let (_, ack) = stand_in.ack(5).unwrap();
    assert_eq!(ack.error, "", "the large state applied");
    assert_eq!(agent.handle.egress().unwrap().borrow().applied, Some(5));

    agent.kill().await;
    serving.cancel();
    plane.cleanup().await;
}
