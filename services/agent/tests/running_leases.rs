//! The agent running leases for the real identity and leases services, in
//! process: a lease asked for through the Leases API runs on the node, its
//! phases and exit status reach the ledger, a restarted agent adopts what
//! still runs and destroys what no lease covers, and the agent API shows
//! the instance, its logs, and signals it.
//!
//! Identity and leases each run on their own SQLite file and in-process bus,
//! on loopback mTLS ports, the way `berth dev` runs them (see `common`).

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use berth_agent::{AgentConfig, FenceReason};
use berth_identity::NodeTiming;
use berth_proto::agent::v1 as agent;
use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1::LeasePhase;
use berth_testkit::cgroups::memory_limit_of;
use berth_testkit::eventually;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt as _;

use common::*;

/// Relays TCP to identity; while down it cuts every connection, like a
/// partition between the node and identity alone.
struct Relay {
    addr: String,
    down: Arc<AtomicBool>,
    cuts: watch::Sender<u64>,
    accepting: JoinHandle<()>,
}

impl Relay {
    async fn start(target: &str) -> Relay {
        let target = target.to_string();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let down = Arc::new(AtomicBool::new(false));
        let cuts = watch::channel(0u64).0;
        let (d, c) = (down.clone(), cuts.clone());
        let accepting = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else { continue };
                if d.load(Ordering::SeqCst) {
                    continue;
                }
                let mut cut = c.subscribe();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(target).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Relay { addr, down, cuts, accepting }
    }

    fn go_down(&self) {
        self.down.store(true, Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }

    fn come_back(&self) {
        self.down.store(false, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cuts.send_modify(|n| *n += 1);
    }
}

/// A control plane whose nodes follow `nodes` and whose leases live `ttl`,
/// and the config of an agent on `dir` that reaches identity only through a
/// [`Relay`].
async fn behind_relay(ttl: Duration, nodes: NodeTiming, dir: &TestDir) -> (ControlPlane, Relay, AgentConfig) {
    let plane = ControlPlane::start_with(ttl, nodes).await;
    let relay = Relay::start(&plane.identity_addr).await;
    let mut config = agent_config(&plane, dir.path());
    config.server = relay.addr.clone();
    (plane, relay, config)
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_lease_runs_to_done_and_a_failing_one_is_failed_with_its_exit_code() {
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let node_id = agent.handle.node_id();

    let lease = plane.request("ok", "sleep 1; exit 0").await;
    assert_eq!(lease.node_id, node_id);
    let running = plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    assert_eq!(plane.node_capacity(&node_id).await.leases, 1);
    let instance = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await;
    assert_eq!((instance.service.as_str(), instance.epoch), ("web", running.epoch));
    assert_ne!(instance.port, 0, "the workload was given a port on the host: {instance:?}");
    let done = plane.phase_until(&lease.lease_id, LeasePhase::Done).await;
    assert_eq!(done.exit_code, Some(0));
    assert_eq!(done.reason, "Exited");
    let capacity = plane.node_capacity(&node_id).await;
    assert_eq!(capacity.leases, 0, "the capacity is returned: {capacity:?}");
    assert_eq!(capacity.allocated.unwrap().cpu_millis, 0);

    let lease = plane.request("three", "exit 3").await;
    let failed = plane.phase_until(&lease.lease_id, LeasePhase::Failed).await;
    assert_eq!(failed.exit_code, Some(3));
    assert_eq!(failed.reason, "Exited");
    assert!(failed.message.contains("exited with code 3"), "{failed:?}");
    let instance = agent.instance_until(&plane, &lease.lease_id, "failed", |i| i.exit_code.is_some()).await;
    assert_eq!((instance.exit_code, instance.pid), (Some(3), 0));
    assert_eq!(plane.node_capacity(&node_id).await.leases, 0);
    let ok_id = done.lease_id.clone();
    let done_listed = agent.instance_until(&plane, &ok_id, "done", |i| i.phase() == LeasePhase::Done).await;

    // A restarted agent shows what ended as it ended, not as running.
    agent.kill().await;
    let second = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let done_again = second.instance_until(&plane, &ok_id, "listed after the restart", |_| true).await;
    assert_eq!((done_again.phase(), done_again.reason.as_str()), (LeasePhase::Done, done_listed.reason.as_str()));
    assert_eq!(done_again.exit_code, Some(0));
    let failed_again = second.instance_until(&plane, &lease.lease_id, "listed after the restart", |_| true).await;
    assert_eq!((failed_again.phase(), failed_again.reason.as_str()), (LeasePhase::Failed, "Exited"));
    assert_eq!(failed_again.exit_code, Some(3));

    second.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_killed_agent_leaves_its_workload_running_and_the_next_one_adopts_it() {
    let (plane, dir, first) = plane_with_agent(Duration::from_secs(3)).await;
    let lease = plane.request("adopt", "exec sleep 1000").await;
    let pid = first.started(&plane, &lease.lease_id).await.pid;
    let started = start_ticks(pid).unwrap();
    first.kill().await;
    assert_eq!(start_ticks(pid), Some(started), "killing the agent left the workload alone");

    let second = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let adopted = second.instance_until(&plane, &lease.lease_id, "adopted", |i| i.epoch > lease.epoch).await;
    assert_eq!(adopted.pid, pid, "the same process, not a new one");
    assert_eq!(start_ticks(pid), Some(started));
    assert_eq!(adopted.phase(), LeasePhase::Running);
    // Two TTLs later the lease is still RUNNING: the new agent renews it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let lease_now = plane.lease(&lease.lease_id).await;
    assert_eq!(lease_now.phase(), LeasePhase::Running, "{lease_now:?}");
    assert_eq!(lease_now.epoch, adopted.epoch);
    assert_eq!(start_ticks(pid), Some(started));

    plane.release(&lease.lease_id).await;
    gone_until(pid).await;
    second.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_workload_whose_lease_expired_while_the_agent_was_away_is_destroyed() {
    let ttl = Duration::from_secs(1);
    let (plane, dir, first) = plane_with_agent(ttl).await;
    let lease = plane.request("orphan", "sleep 1000 & exec sleep 1000").await;
    let pid = first.started(&plane, &lease.lease_id).await.pid;
    first.kill().await;

    plane.phase_until(&lease.lease_id, LeasePhase::Expired).await;
    // Past the custody window too: the lease cannot be taken back.
    tokio::time::sleep(ttl * 2).await;
    assert!(start_ticks(pid).is_some(), "the orphan ran on while no agent watched");

    let second = RunningAgent::start(agent_config(&plane, dir.path())).await;
    gone_until(pid).await;
    let instance = second.instance_until(&plane, &lease.lease_id, "settled", |i| i.pid == 0).await;
    assert!(!instance.reason.is_empty(), "{instance:?}");
    assert_eq!(plane.lease(&lease.lease_id).await.phase(), LeasePhase::Expired);
    second.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn the_agent_api_shows_the_logs_and_a_term_signal_ends_the_workload() {
    let (plane, _dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let script = "echo $GREETING from $BERTH_LEASE_ID; echo oops >&2; \
                  trap 'echo bye; exit 0' TERM; while true; do sleep 0.05; done";
    let lease = plane.request("logs", script).await;
    agent.started(&plane, &lease.lease_id).await;

    let logs = |follow| agent::GetLogsRequest { lease_id: lease.lease_id.clone(), follow, tail_lines: 0 };
    let expected = format!("hello from {}\n", lease.lease_id);
    let (stdout, stderr) = eventually("the logs to hold the greeting and the oops", SLOW, || async {
        let mut stream = agent.api(&plane).get_logs(logs(false)).await.unwrap().into_inner();
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            match chunk.stream() {
                berth_proto::types::v1::LogStream::Stdout => stdout.extend(chunk.data),
                berth_proto::types::v1::LogStream::Stderr => stderr.extend(chunk.data),
                berth_proto::types::v1::LogStream::Unspecified => panic!("a chunk from no stream"),
            }
        }
        if stdout == expected.as_bytes() && stderr == b"oops\n" {
            Ok((stdout, stderr))
        } else {
            Err((String::from_utf8_lossy(&stdout).into_owned(), String::from_utf8_lossy(&stderr).into_owned()))
        }
    })
    .await;
    assert_eq!((stdout.len(), stderr.len()), (expected.len(), 5));

    let stats = agent
        .api(&plane)
        .get_stats(agent::GetStatsRequest { lease_id: lease.lease_id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert!(stats.memory_bytes > 0, "{stats:?}");

    // Follow, then ask the workload to stop: its goodbye arrives and the
    // stream ends with the lease.
    let mut followed = agent.api(&plane).get_logs(logs(true)).await.unwrap().into_inner();
    let signal = agent::SignalInstanceRequest { lease_id: lease.lease_id.clone(), signal: agent::Signal::Term as i32 };
    agent.api(&plane).signal_instance(signal).await.unwrap();
    let mut seen = Vec::new();
    let ended = tokio::time::timeout(SLOW, async {
        while let Some(chunk) = followed.next().await {
            let chunk = chunk.unwrap();
            if chunk.stream() == berth_proto::types::v1::LogStream::Stdout {
                seen.extend(chunk.data);
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the followed log never ended; saw {:?}", String::from_utf8_lossy(&seen));
    assert_eq!(String::from_utf8_lossy(&seen), format!("{expected}bye\n"));
    let done = plane.phase_until(&lease.lease_id, LeasePhase::Done).await;
    assert_eq!(done.exit_code, Some(0));

    // A workload that does not catch TERM is killed by it: FAILED.
    let lease = plane.request("killed", "exec sleep 1000").await;
    let pid = agent.started(&plane, &lease.lease_id).await.pid;
    let signal = agent::SignalInstanceRequest { lease_id: lease.lease_id.clone(), signal: agent::Signal::Term as i32 };
    agent.api(&plane).signal_instance(signal).await.unwrap();
    let failed = plane.phase_until(&lease.lease_id, LeasePhase::Failed).await;
    assert_eq!((failed.reason.as_str(), failed.exit_code), ("Killed", None));
    assert!(failed.message.contains("SIGTERM"), "{failed:?}");
    gone_until(pid).await;

    // What a caller gets wrong is named.
    let unknown = agent::SignalInstanceRequest { lease_id: "no-such-lease".into(), signal: agent::Signal::Term as i32 };
    let status = agent.api(&plane).signal_instance(unknown).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    let unset = agent::SignalInstanceRequest { lease_id: lease.lease_id.clone(), signal: 0 };
    let status = agent.api(&plane).signal_instance(unset).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("signal"), "{status:?}");
    let status =
        agent.api(&plane).get_stats(agent::GetStatsRequest { lease_id: lease.lease_id.clone() }).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "an ended instance has no stats: {status:?}");

    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_fenced_node_holds_its_workload_in_custody_and_takes_it_back_after_rejoining() {
    let nodes = NodeTiming {
        down_after: Duration::from_millis(600),
        reap_after: Duration::from_millis(500),
        reset_grace: Duration::from_millis(600),
        ..node_timing()
    };
    let dir = TestDir::new();
    let (plane, relay, config) = behind_relay(Duration::from_secs(3), nodes, &dir).await;
    let agent = RunningAgent::start(config).await;
    let node_id = agent.handle.node_id();
    let lease = plane.request("fenced", "exec sleep 1000").await;
    let running = plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;
    let started = start_ticks(pid).unwrap();
    let mut fences = agent.handle.fences();

    // Cut off from identity long enough to be reaped: the next heartbeat
    // that gets through is told the incarnation is fenced.
    relay.go_down();
    eventually("the node to be reaped", SLOW, || async {
        let node = plane.node(&node_id).await;
        if node.incarnation >= 2 { Ok(()) } else { Err(node) }
    })
    .await;
    relay.come_back();
    tokio::time::timeout(SLOW, fences.changed()).await.expect("the agent never saw the fence").unwrap();
    assert_eq!(fences.borrow().as_ref().unwrap().reason, FenceReason::Fenced);

    // After the rejoin the workload is taken back, not restarted.
    let adopted = agent.instance_until(&plane, &lease.lease_id, "taken back", |i| i.epoch > running.epoch).await;
    assert_eq!(adopted.pid, pid);
    assert_eq!(start_ticks(pid), Some(started));
    let lease_now = plane.lease(&lease.lease_id).await;
    assert_eq!((lease_now.phase(), lease_now.epoch), (LeasePhase::Running, adopted.epoch));
    assert!(agent.handle.session().borrow().incarnation >= 2);

    plane.release(&lease.lease_id).await;
    gone_until(pid).await;
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_revoked_node_destroys_its_workloads_before_the_agent_exits() {
    let (plane, _dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let lease = plane.request("revoked", "sleep 1000 & exec sleep 1000").await;
    let pid = agent.started(&plane, &lease.lease_id).await.pid;

    let request = identity::RevokeNodeRequest { node_id: agent.handle.node_id(), reason: "decommissioned".into() };
    identity::nodes_client::NodesClient::new(plane.channel(&plane.identity_addr)).revoke_node(request).await.unwrap();
    let stopped = tokio::time::timeout(SLOW, agent.handle.wait()).await.expect("the agent never stopped");
    assert!(matches!(stopped, Err(berth_agent::AgentError::Revoked { .. })), "{stopped:?}");
    assert_eq!(start_ticks(pid), None, "the agent exited while its workload still ran");
    plane.cleanup().await;
}

#[tokio::test]
async fn a_node_that_cannot_rejoin_holds_its_workload_for_the_stop_grace_and_only_then_exits() {
    let nodes = NodeTiming {
        down_after: Duration::from_millis(600),
        reap_after: Duration::from_millis(300),
        forget_after: Duration::from_millis(300),
        reset_grace: Duration::from_millis(600),
        ..node_timing()
    };
    let dir = TestDir::new();
    let (plane, relay, mut config) = behind_relay(Duration::from_secs(30), nodes, &dir).await;
    RunningAgent::start(config.clone()).await.kill().await;
    // Resumed without a token: once identity forgets the node, nothing can
    // bring it back.
    // No custody bound: a node that can never rejoin still stops its
    // work, one stop grace after its rejoin is refused.
    config.join_token = None;
    config.max_custody = None;
    let grace = config.lease_timing.stop_grace;
    let agent = RunningAgent::start(config).await;
    let node_id = agent.handle.node_id();
    let lease = plane.request("stranded", "exec sleep 1000").await;
    let pid = agent.started(&plane, &lease.lease_id).await.pid;
    let mut fences = agent.handle.fences();

    relay.go_down();
    eventually("the node to be forgotten", SLOW, || async {
        let request = identity::GetNodeRequest { node_id: node_id.clone() };
        let found =
            identity::nodes_client::NodesClient::new(plane.channel(&plane.identity_addr)).get_node(request).await;
        match found {
            Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
            found => Err(found.map(tonic::Response::into_inner)),
        }
    })
    .await;
    relay.come_back();
    // Forgotten first, then the rejoin without a token refused.
    let refused = tokio::time::timeout(
        SLOW,
        fences.wait_for(|f| f.as_ref().is_some_and(|f| f.reason == FenceReason::RejoinRefused)),
    )
    .await
    .expect("the agent never saw its rejoin refused")
    .is_ok();
    assert!(refused);
    let refused_at = tokio::time::Instant::now();

    let waiting = tokio::spawn(agent.handle.wait());
    tokio::time::sleep(grace / 2).await;
    assert!(!waiting.is_finished(), "the agent exited while it held a workload in custody");
    assert!(start_ticks(pid).is_some(), "custody keeps the workload running for the grace");
    let stopped = tokio::time::timeout(SLOW, waiting).await.expect("the agent never stopped").unwrap();
    assert!(refused_at.elapsed() >= grace / 2, "destroyed at once, not after the grace");
    assert!(matches!(stopped, Err(berth_agent::AgentError::RejoinNeedsToken { .. })), "{stopped:?}");
    assert_eq!(start_ticks(pid), None, "the agent exited while its workload still ran");
    drop(agent.stop);
    plane.cleanup().await;
}

#[tokio::test]
async fn a_resize_changes_the_running_workloads_limits_without_a_restart_and_one_that_does_not_fit_changes_nothing() {
    use berth_proto::leases::v1 as leases;
    let (plane, _dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let node_id = agent.handle.node_id();
    let lease = plane.request("resized", "exec sleep 1000").await;
    let running = plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let pid = agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid;
    let contained = rustix::process::geteuid().is_root();
    if contained {
        assert_eq!(memory_limit_of(pid), Some(64 << 20), "the lease's size is its limit");
    }
    let size = |cpu_millis, memory_bytes| Some(berth_proto::types::v1::Capacity { cpu_millis, memory_bytes });
    let resize = |cpu_millis, memory_bytes| leases::ResizeLeaseRequest {
        lease_id: lease.lease_id.clone(),
        epoch: running.epoch,
        resources: size(cpu_millis, memory_bytes),
    };
    let settled = |wanted| {
        let plane = &plane;
        let lease_id = lease.lease_id.clone();
        async move {
            eventually("the node to apply the resize", SLOW, || async {
                let now = plane.lease(&lease_id).await;
                let state = now.resize.as_ref().map(|r| r.state());
                if state == Some(leases::ResizeState::Applied) && now.resources == wanted { Ok(now) } else { Err(now) }
            })
            .await
        }
    };

    plane.leases().resize_lease(resize(500, 256 << 20)).await.unwrap();
    settled(size(500, 256 << 20)).await;
    if contained {
        assert_eq!(memory_limit_of(pid), Some(256 << 20), "the limit grew in place");
    }
    assert_eq!(plane.node_capacity(&node_id).await.allocated, size(500, 256 << 20));

    // More than the node has: refused, naming the shortage; nothing changes.
    let refused = plane.leases().resize_lease(resize(500, 8 << 30)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("cannot grow to"), "{refused:?}");
    assert_eq!(plane.lease(&lease.lease_id).await.resources, size(500, 256 << 20));
    assert_eq!(plane.node_capacity(&node_id).await.allocated, size(500, 256 << 20));

    plane.leases().resize_lease(resize(250, 32 << 20)).await.unwrap();
    let shrunk = settled(size(250, 32 << 20)).await;
    if contained {
        assert_eq!(memory_limit_of(pid), Some(32 << 20), "the limit shrank in place");
    }
    assert_eq!(plane.node_capacity(&node_id).await.allocated, size(250, 32 << 20), "a shrink frees the rest");
    assert_eq!((shrunk.phase(), shrunk.epoch), (LeasePhase::Running, running.epoch), "no restart, no new epoch");
    let instance = agent.instance_until(&plane, &lease.lease_id, "still running", |i| i.pid != 0).await;
    assert_eq!(instance.pid, pid, "the same workload throughout");

    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn an_interruption_notice_from_the_host_drains_the_node_with_the_deadline_it_names() {
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let node_id = agent.handle.node_id();
    let lease = plane.request("interrupted", "exec sleep 1000").await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;

    // The host's tooling writes how long the host has left.
    std::fs::write(dir.path().join("interruption-notice"), "45s\n").unwrap();
    let node = eventually("the node to drain itself", SLOW, || async {
        let node = plane.node(&node_id).await;
        if node.state() == identity::NodeState::Draining { Ok(node) } else { Err(node) }
    })
    .await;
    let left = node.drain_deadline.unwrap().seconds
        - std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert!((35..=46).contains(&left), "the deadline is the notice's: {left}s left");
    // Its work is told, and keeps running until moved or the deadline.
    let told = eventually("the lease to be told its node drains", SLOW, || async {
        let now = plane.lease(&lease.lease_id).await;
        if now.reason == "NodeDraining" { Ok(now) } else { Err(now) }
    })
    .await;
    assert_eq!(told.phase(), LeasePhase::Running);

    agent.kill().await;
    plane.cleanup().await;
}

/// A lease running `sh -c script` with cache volume `deps` at `/cache`.
fn cached(script: &str) -> berth_proto::leases::v1::Workload {
    berth_proto::leases::v1::Workload {
        command: "sh".into(),
        args: vec!["-c".into(), script.into()],
        cache: vec![berth_proto::types::v1::CacheMount { key: "deps".into(), path: "/cache".into(), commit: 0 }],
        ..Default::default()
    }
}

/// The digest of the head of `deps`.
async fn done_head(caches: &berth_proto::leases::v1::caches_client::CachesClient<berth_rpc::Channel>) -> String {
    let request = berth_proto::leases::v1::GetCacheRequest { project: "default".into(), key: "deps".into() };
    caches.clone().get_cache(request).await.unwrap().into_inner().volume.unwrap().head.unwrap().digest
}

/// Waits until the ledger recorded how `lease_id`'s view of `deps` settled.
async fn cache_settled(plane: &ControlPlane, lease_id: &str) -> berth_proto::leases::v1::CacheObservation {
    eventually("the lease's cache view to settle", SLOW, || async {
        let lease = plane.lease(lease_id).await;
        match lease.cache.first() {
            Some(seen) if seen.committed_generation > 0 || !seen.reason.is_empty() => Ok(seen.clone()),
            _ => Err(lease),
        }
    })
    .await
}

#[tokio::test]
async fn a_cache_volume_is_published_only_when_its_workload_succeeds_and_the_next_lease_starts_from_it() {
    use berth_proto::leases::v1::CacheOutcome;
    if !berth_testkit::runs_as_root("a cache volume's contained runtime") {
        return;
    }
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;

    // The first finds the volume empty and publishes what it wrote.
    let first = plane.request_workload("first", cached("test ! -e /cache/marker && echo one > /cache/marker")).await;
    plane.phase_until(&first.lease_id, LeasePhase::Done).await;
    let seen = cache_settled(&plane, &first.lease_id).await;
    assert_eq!(
        (seen.outcome(), seen.base_generation, seen.committed_generation),
        (CacheOutcome::Miss, 0, 1),
        "{seen:?}"
    );

    // The second sees it (a hit on this node), overwrites it, and fails: nothing is published.
    let script = "grep -qx one /cache/marker && echo two > /cache/marker && exit 3";
    let second = plane.request_workload("second", cached(script)).await;
    let failed = plane.phase_until(&second.lease_id, LeasePhase::Failed).await;
    assert_eq!(failed.exit_code, Some(3), "{failed:?}");
    let seen = cache_settled(&plane, &second.lease_id).await;
    assert_eq!((seen.outcome(), seen.base_generation, seen.reason.as_str()), (CacheOutcome::Hit, 1, "WorkloadFailed"));

    // The third still sees the first's, not the failed write, and publishes generation 2.
    let third =
        plane.request_workload("third", cached("grep -qx one /cache/marker && echo three >> /cache/marker")).await;
    plane.phase_until(&third.lease_id, LeasePhase::Done).await;
    let seen = cache_settled(&plane, &third.lease_id).await;
    assert_eq!((seen.base_generation, seen.committed_generation), (1, 2), "{seen:?}");
    let fourth =
        plane.request_workload("fourth", cached("test \"$(cat /cache/marker)\" = \"$(printf 'one\\nthree')\"")).await;
    plane.phase_until(&fourth.lease_id, LeasePhase::Done).await;
    assert_eq!(cache_settled(&plane, &fourth.lease_id).await.committed_generation, 3);

    // Every view is gone with its workload; the published generations stay.
    let views = dir.path().join("caches/views");
    eventually("the finished leases' views to be removed", SLOW, || async {
        let left: Vec<_> =
            std::fs::read_dir(&views).map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect()).unwrap_or_default();
        if left.is_empty() { Ok(()) } else { Err(left) }
    })
    .await;
    let generations = dir.path().join("caches/volumes/default/deps/generations");
    let mut held: Vec<String> =
        std::fs::read_dir(generations).unwrap().filter_map(|e| e.unwrap().file_name().into_string().ok()).collect();
    held.sort();
    assert_eq!(held, ["1", "2", "3"]);
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_node_without_the_head_fetches_it_from_the_cache_registry_and_its_lease_sees_the_same_content() {
    use berth_bundle::testing::TestRegistry;
    use berth_proto::leases::v1::CacheOutcome;
    if !berth_testkit::runs_as_root("a cache volume's contained runtime") {
        return;
    }
    berth_testkit::install_crypto_and_logs();
    let registry = TestRegistry::start_with_htpasswd("caches", "s3cret").await.unwrap();
    let repository = format!("{}/berth-caches", registry.host());
    let cache_registry = berth_leases::CacheRegistryConfig {
        repository: repository.clone(),
        username: "caches".into(),
        password: "s3cret".into(),
    };
    let plane = ControlPlane::start_with_leases(Duration::from_secs(5), |config| {
        config.cache_registry = Some(cache_registry);
    })
    .await;
    let first_dir = TestDir::new();
    let first = RunningAgent::start(agent_config(&plane, first_dir.path())).await;

    // Generation 1 on the first node: files, a directory, a link, an executable.
    let seed = "mkdir -p /cache/lib && echo alpha > /cache/a.txt && echo gone > /cache/old.txt \
                && head -c 300000 /dev/urandom > /cache/lib/blob && ln -s a.txt /cache/link \
                && printf '#!/bin/sh\\necho ran\\n' > /cache/tool && chmod 755 /cache/tool";
    let one = plane.request_workload("one", cached(seed)).await;
    plane.phase_until(&one.lease_id, LeasePhase::Done).await;
    assert_eq!(cache_settled(&plane, &one.lease_id).await.committed_generation, 1);
    // Generation 2 changes one file and removes another: pushed as one more layer over generation 1's.
    let change = "echo beta > /cache/a.txt && rm /cache/old.txt && sha256sum /cache/lib/blob";
    let two = plane.request_workload("two", cached(change)).await;
    plane.phase_until(&two.lease_id, LeasePhase::Done).await;
    assert_eq!(cache_settled(&plane, &two.lease_id).await.committed_generation, 2);

    let caches = berth_proto::leases::v1::caches_client::CachesClient::new(plane.channel(&plane.leases_addr));
    let request = berth_proto::leases::v1::GetCacheRequest { project: "default".into(), key: "deps".into() };
    let got = caches.clone().get_cache(request).await.unwrap().into_inner();
    let artifacts: Vec<&str> = got.generations.iter().map(|g| g.artifact.as_str()).collect();
    assert_eq!(artifacts.len(), 2, "{got:?}");
    assert!(artifacts.iter().all(|a| a.starts_with("sha256:")), "each generation was pushed: {artifacts:?}");
    let client = berth_bundle::BundleClient::new(berth_bundle::RegistryConfig::default()).unwrap();
    let auth = berth_bundle::RegistryCredentials::Basic { username: "caches".into(), password: "s3cret".into() };
    let tagged = client.resolve_str(&format!("{repository}/default:deps"), &auth).await.unwrap();
    assert_eq!(tagged.to_string(), artifacts[0], "the key's tag names the newest generation");
    let layers = |artifact: &str| {
        let (client, repository, auth, artifact) =
            (client.clone(), format!("{repository}/default"), auth.clone(), artifact.parse().unwrap());
        async move { client.cache_generation(&repository, &artifact, &auth).await.unwrap().0 }
    };
    let (newer, older) = (layers(artifacts[0]).await, layers(artifacts[1]).await);
    assert_eq!(newer.len(), older.len() + 1, "generation 2 adds one layer");
    assert_eq!(newer[..older.len()], older[..], "over generation 1's own");
    assert!(newer[older.len()].size < 4096, "the new layer holds the change, not the blob: {newer:?}");

    // The first node drains; a second node, which never held the volume, takes the next lease.
    let request = identity::DrainNodeRequest { node_id: first.handle.node_id(), ..Default::default() };
    identity::nodes_client::NodesClient::new(plane.channel(&plane.identity_addr)).drain_node(request).await.unwrap();
    let second_dir = TestDir::new();
    let mut config = agent_config(&plane, second_dir.path());
    config.join_token = Some(plane.join_token().await);
    config.name = "second-host".into();
    config.advertise_addr = "127.0.0.1:7448".into();
    let second = RunningAgent::start(config).await;
    let (first_id, second_id) = (first.handle.node_id(), second.handle.node_id());
    eventually("leases to see the first node draining and the second up", SLOW, || async {
        let listed = berth_proto::leases::v1::capacity_client::CapacityClient::new(plane.channel(&plane.leases_addr))
            .list_node_capacity(berth_proto::leases::v1::ListNodeCapacityRequest::default())
            .await
            .unwrap()
            .into_inner();
        let state = |id: &str| listed.nodes.iter().find(|n| n.node_id == id).map(|n| n.state());
        match (state(&first_id), state(&second_id)) {
            (Some(identity::NodeState::Draining), Some(identity::NodeState::Up)) => Ok(()),
            states => Err(states),
        }
    })
    .await;
    let check = "test \"$(cat /cache/a.txt)\" = beta && test ! -e /cache/old.txt && test \"$(readlink /cache/link)\" = a.txt \
                 && test \"$(/cache/tool)\" = ran && echo gamma >> /cache/a.txt";
    let three = plane.request_workload("three", cached(check)).await;
    assert_eq!(three.node_id, second.handle.node_id(), "placed on the node that is not draining");
    let done = plane.phase_until(&three.lease_id, LeasePhase::Done).await;
    assert_eq!(done.exit_code, Some(0), "{done:?}");
    let seen = cache_settled(&plane, &three.lease_id).await;
    assert_eq!(
        (seen.outcome(), seen.base_generation, seen.committed_generation),
        (CacheOutcome::Miss, 2, 3),
        "a miss that started from the fetched head, and may publish over it: {seen:?}"
    );
    let blob = |dir: &std::path::Path, digest: &str| {
        let hex = digest.strip_prefix("sha256:").unwrap().to_owned();
        std::fs::read(dir.join("caches/volumes/default/deps/sealed").join(hex).join("lib/blob")).unwrap()
    };
    assert_eq!(blob(second_dir.path(), &got.generations[0].digest), blob(first_dir.path(), &got.generations[0].digest));
    let generations = second_dir.path().join("caches/volumes/default/deps/generations");
    assert!(generations.join("2").exists() && generations.join("3").exists(), "the second node holds 2 and 3");

    // The first node sealed the head generation 3 grew from: it follows the volume, fetches generation 3
    // from the registry, and is recorded as holding it, so the next lease may land on either node.
    let followed = first_dir.path().join("caches/volumes/default/deps/generations/3");
    eventually("the first node to hold the head it follows", SLOW, || async {
        let request = berth_proto::leases::v1::GetCacheRequest { project: "default".into(), key: "deps".into() };
        let head = caches.clone().get_cache(request).await.unwrap().into_inner().volume.unwrap().head.unwrap();
        if followed.exists() && head.held_by == [first_id.clone()] { Ok(()) } else { Err(head) }
    })
    .await;
    assert_eq!(blob(first_dir.path(), &done_head(&caches).await), blob(second_dir.path(), &done_head(&caches).await));
    first.kill().await;
    second.kill().await;
    plane.cleanup().await;
}
