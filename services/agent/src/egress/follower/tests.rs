//! The follower against a fake egress service: quiet retries while the
//! service does not serve node egress, every state applied and acknowledged
//! with its generation, a state that cannot be applied acknowledged with the
//! error while the previous rules hold, and a new session reopening the
//! stream under the new node id.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use berth_proto::egress::v1::{
    Destination, EgressEnforcement, EgressPlan, ListenerProtocol, NodeEgressState, ServiceEgress,
};
use berth_testkit::{PATIENCE, eventually};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::*;
use crate::egress::{EgressIsolation, EgressSettings, Enforcement};

/// What the fake service was asked, and the stream it serves now.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// `Err(code)` answers for the next opens, in order.
    refusals: VecDeque<tonic::Code>,
    opened_as: Vec<String>,
    acks: Vec<AckEgressRequest>,
    reconnects: usize,
    stream: Option<mpsc::UnboundedSender<Result<NodeEgressState, tonic::Status>>>,
}

#[derive(Debug, Default)]
struct FakeEgress {
    seen: Mutex<Seen>,
}

impl FakeEgress {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap()
    }

    fn push(&self, state: NodeEgressState) {
        self.seen().stream.as_ref().expect("a stream is open").send(Ok(state)).unwrap();
    }

    async fn until(&self, what: &str, check: impl Fn(&Seen) -> bool) {
        eventually(what, PATIENCE, || async {
            let seen = self.seen();
            if check(&seen) { Ok(()) } else { Err(seen.clone()) }
        })
        .await;
    }
}

#[async_trait::async_trait]
impl NodeEgressApi for FakeEgress {
    async fn watch_egress(&self, node_id: &str) -> Result<EgressStream, tonic::Status> {
        let mut seen = self.seen();
        seen.opened_as.push(node_id.to_string());
        if let Some(code) = seen.refusals.pop_front() {
            return Err(tonic::Status::new(code, "not yet"));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        seen.stream = Some(tx);
        Ok(Box::pin(UnboundedReceiverStream::new(rx)))
    }

    async fn ack_egress(&self, request: AckEgressRequest) -> Result<(), tonic::Status> {
        self.seen().acks.push(request);
        Ok(())
    }

    fn reconnect(&self) {
        self.seen().reconnects += 1;
    }
}

fn state(generation: u64, hostname: &str) -> NodeEgressState {
    let allowed = Destination {
        listener: "http".into(),
        protocol: ListenerProtocol::Http as i32,
        listener_port: 3128,
        hostname: hostname.into(),
        ports: vec![],
        route: "r".into(),
    };
    let plan = EgressPlan {
        project: "acme".into(),
        generation,
        services: vec![ServiceEgress {
            service: "web".into(),
            gateway: "gw".into(),
            allowed: vec![allowed],
            ..Default::default()
        }],
        ..Default::default()
    };
    NodeEgressState { generation, plans: vec![plan] }
}

struct Running {
    fake: Arc<FakeEgress>,
    proxies: EgressProxies,
    session: watch::Sender<NodeSession>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

async fn follow(refusals: &[tonic::Code]) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let settings = EgressSettings { isolation: EgressIsolation::Off, ..EgressSettings::new(dir.path()) };
    let proxies = EgressProxies::start(settings, stop.clone()).await.unwrap();
    let fake = Arc::new(FakeEgress::default());
    fake.seen().refusals = refusals.iter().copied().collect();
    let (session, session_rx) = watch::channel(NodeSession { node_id: "n-1".into(), incarnation: 1 });
    let follower = EgressFollower {
        api: fake.clone(),
        proxies: proxies.clone(),
        session: session_rx,
        backoff: Backoff::new(Duration::from_millis(5), Duration::from_millis(20)),
        shutdown: stop.clone(),
    };
    let task = tokio::spawn(follower.run());
    Running { fake, proxies, session, stop, task, _dir: dir }
}

/// [`follow`], once the stream is open; the fake service too.
async fn following(refusals: &[tonic::Code]) -> (Running, Arc<FakeEgress>) {
    let running = follow(refusals).await;
    let fake = running.fake.clone();
    fake.until("the stream to open", |seen| seen.stream.is_some()).await;
    (running, fake)
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(PATIENCE, self.task).await.unwrap().unwrap();
        self.proxies.close().await;
    }
}

#[tokio::test]
async fn an_unimplemented_service_is_retried_until_it_answers_then_each_state_is_applied_and_acked() {
    let (running, fake) =
        following(&[tonic::Code::Unimplemented, tonic::Code::Unimplemented, tonic::Code::Unavailable]).await;
    assert_eq!(fake.seen().opened_as, ["n-1"; 4], "three refusals, then the stream");

    fake.push(state(7, "api.example.com"));
    fake.until("generation 7 to be acked", |seen| seen.acks.len() == 1).await;
    let ack = fake.seen().acks[0].clone();
    assert_eq!((ack.node_id.as_str(), ack.generation, ack.error.as_str()), ("n-1", 7, ""));
    assert_eq!(ack.enforcement, EgressEnforcement::Advisory as i32, "isolation is off");
    let status = running.proxies.status().borrow().clone();
    assert_eq!(status.applied, Some(7));
    assert!(matches!(status.enforcement, Enforcement::Advisory { .. }));
    running.stop().await;
}

#[tokio::test]
async fn a_state_that_cannot_be_applied_is_acked_with_the_error_and_the_previous_rules_hold() {
    let (running, fake) = following(&[]).await;
    fake.push(state(1, "api.example.com"));
    fake.push(state(2, "bad host name"));
    fake.until("both states to be acked", |seen| seen.acks.len() == 2).await;
    let acks = fake.seen().acks.clone();
    assert_eq!(acks[0].error, "");
    assert_eq!(acks[1].generation, 2);
    assert!(acks[1].error.contains("hostname 'bad host name'"), "{}", acks[1].error);
    let status = running.proxies.status().borrow().clone();
    assert_eq!(status.applied, Some(1), "the last state applied is still 1");
    assert!(status.error.unwrap().contains("bad host name"));

    fake.push(state(3, "ok.example.com"));
    fake.until("the fix to be acked", |seen| seen.acks.len() == 3).await;
    assert_eq!(fake.seen().acks[2].error, "");
    assert_eq!(running.proxies.status().borrow().error, None, "a good state clears the error");
    running.stop().await;
}

#[tokio::test]
async fn a_new_session_reopens_the_stream_as_the_new_node() {
    let (running, fake) = following(&[]).await;
    running.session.send_replace(NodeSession { node_id: "n-2".into(), incarnation: 1 });
    fake.until("the stream to reopen as n-2", |seen| seen.opened_as.last().map(String::as_str) == Some("n-2")).await;
    assert!(fake.seen().reconnects >= 1, "the channel is rebuilt for the new certificate");
    fake.push(state(9, "api.example.com"));
    fake.until("generation 9 to be acked as n-2", |seen| {
        seen.acks.iter().any(|a| a.node_id == "n-2" && a.generation == 9)
    })
    .await;
    running.stop().await;
}

#[tokio::test]
async fn a_broken_stream_is_opened_again() {
    let (running, fake) = following(&[]).await;
    // The service goes away: the stream ends.
    fake.seen().stream = None;
    fake.until("the stream to reopen", |seen| seen.opened_as.len() >= 2 && seen.stream.is_some()).await;
    fake.push(state(4, "api.example.com"));
    fake.until("generation 4 to be acked after the reopen", |seen| seen.acks.iter().any(|a| a.generation == 4)).await;
    running.stop().await;
}
