//! The node's data plane: a router reaches a replica's port through the
//! agent's `Tunnel`, and nothing else gets through it. Where the agent runs
//! as root it isolates egress, so the replica listens only on the loopback
//! of its tenant's network namespace and the tunnel still reaches it.
//!
//! Identity and leases run in process (see `common`).

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::time::Duration;

use berth_agent::Enforcement;
use berth_mtls::TlsCredentials;
use berth_proto::agent::v1 as agent;
use berth_proto::agent::v1::data_plane_client::DataPlaneClient;
use berth_proto::leases::v1::LeasePhase;
use berth_testkit::eventually;
use tokio_stream::StreamExt as _;

use common::*;

/// Sends `request` through a tunnel to the port named `port` of `lease_id`,
/// ending the caller's side after it; what came back, or the status it was
/// refused with.
async fn through_tunnel(
    addr: &str,
    credentials: &TlsCredentials,
    lease_id: &str,
    port: &str,
    request: &[u8],
) -> Result<Vec<u8>, tonic::Status> {
    let channel = berth_rpc::connect(addr, credentials.clone()).unwrap();
    let open = agent::TunnelFrame {
        open: Some(agent::TunnelOpen { lease_id: lease_id.into(), port: port.into() }),
        data: Vec::new(),
    };
    let data = agent::TunnelFrame { open: None, data: request.to_vec() };
    let mut answer = DataPlaneClient::new(channel).tunnel(tokio_stream::iter([open, data])).await?.into_inner();
    let mut bytes = Vec::new();
    while let Some(frame) = answer.next().await {
        bytes.extend(frame?.data);
    }
    Ok(bytes)
}

/// Whether the node shows the instance RUNNING with a port.
fn running_with_a_port(instance: &agent::Instance) -> bool {
    instance.pid != 0 && instance.port != 0 && instance.phase() == LeasePhase::Running
}

#[tokio::test]
async fn a_router_reaches_a_running_replica_through_its_agent_and_nothing_else_gets_through() {
    let plane = ControlPlane::start(Duration::from_secs(5)).await;
    let dir = TestDir::new();
    let mut config = agent_config(&plane, dir.path());
    let root = rustix::process::geteuid().is_root();
    if root {
        // Nothing listens there: the agent retries quietly, and isolates.
        config.egress = Some("127.0.0.1:1".into());
    }
    let agent = RunningAgent::start(config).await;
    if root {
        let enforcement = agent.handle.egress().unwrap().borrow().enforcement.clone();
        assert_eq!(enforcement, Enforcement::Isolated, "as root the replica listens inside its tenant's namespace");
    }
    let addr = agent.handle.local_addr().to_string();

    // The replica listens on its port on the loopback only.
    let script = "printf 'hello from %s' \"$BERTH_LEASE_ID\" > index.html; \
                  exec busybox httpd -f -p 127.0.0.1:$PORT -h .";
    let lease = plane.request("tunnelled", script).await;
    let instance = agent.instance_until(&plane, &lease.lease_id, "running with a port", running_with_a_port).await;
    let get = b"GET /index.html HTTP/1.0\r\nHost: replica\r\n\r\n";
    let answer = eventually("the replica to answer through the tunnel", SLOW, || async {
        match through_tunnel(&addr, &plane.router, &lease.lease_id, "", get).await {
            Ok(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
            Err(status) => Err(format!("{status:?}")),
        }
    })
    .await;
    let body = format!("hello from {}", lease.lease_id);
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.ends_with(&body), "{answer}");
    let named = through_tunnel(&addr, &plane.router, &lease.lease_id, "http", get).await.unwrap();
    assert!(String::from_utf8_lossy(&named).ends_with(&body), "its first port is the one named http");

    // Only a router is let in.
    let status = through_tunnel(&addr, &plane.admin, &lease.lease_id, "", get).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");

    // A router is held to the ports of leases running here.
    let refused = |lease_id: &str, port: &str| {
        let (addr, router) = (addr.clone(), plane.router.clone());
        let (lease_id, port) = (lease_id.to_string(), port.to_string());
        async move { through_tunnel(&addr, &router, &lease_id, &port, get).await.unwrap_err() }
    };
    let status = refused("no-such-lease", "").await;
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    let status = refused(&lease.lease_id, "admin").await;
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    assert!(status.message().contains("no port named 'admin' (its ports: http)"), "{status:?}");
    let status = refused("", "").await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("open.lease_id"), "{status:?}");

    // A replica that does not listen on its port is unavailable, and the
    // caller is told so before any byte went anywhere.
    let quiet = plane.request("quiet", "exec sleep 1000").await;
    let quiet_instance =
        agent.instance_until(&plane, &quiet.lease_id, "running with a port", running_with_a_port).await;
    let status = refused(&quiet.lease_id, "").await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains(&format!("port {} of lease {}", quiet_instance.port, quiet.lease_id)));

    // Once the lease is released, its port is closed to routers.
    plane.release(&lease.lease_id).await;
    plane.phase_until(&lease.lease_id, LeasePhase::Released).await;
    gone_until(instance.pid).await;
    let status = refused(&lease.lease_id, "").await;
    assert!(
        matches!(status.code(), tonic::Code::FailedPrecondition | tonic::Code::NotFound),
        "a released lease is not reached: {status:?}"
    );

    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_replica_with_a_readiness_check_is_launching_until_it_passes_and_only_then_reachable() {
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let addr = agent.handle.local_addr().to_string();
    let workload = berth_proto::leases::v1::Workload {
        command: "sh".into(),
        args: vec!["-c".into(), "echo up > index.html; exec busybox httpd -f -p 127.0.0.1:$PORT -h .".into()],
        service: "web".into(),
        ports: vec![berth_proto::types::v1::Port { name: "http".into(), port: 8080 }],
        readiness: Some(berth_proto::types::v1::Readiness {
            http_path: "/ready".into(),
            port: "http".into(),
            period_millis: 20,
        }),
        ..Default::default()
    };
    let lease = plane.request_workload("gated", workload).await;
    let instance = agent.instance_until(&plane, &lease.lease_id, "started", |i| i.pid != 0 && i.port != 0).await;

    // It answers, but `/ready` is 404: checked many times over, it is still
    // LAUNCHING, and no router reaches it.
    let get = b"GET /index.html HTTP/1.0\r\n\r\n";
    eventually("the workload to listen", SLOW, || async {
        let work = dir.path().join("leases").join(&lease.lease_id).join("index.html");
        if work.exists() { Ok(()) } else { Err("no index.html yet") }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(plane.lease(&lease.lease_id).await.phase(), LeasePhase::Launching);
    let status = through_tunnel(&addr, &plane.router, &lease.lease_id, "", get).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");

    // Once `/ready` answers, it is RUNNING and reached.
    std::fs::write(dir.path().join("leases").join(&lease.lease_id).join("ready"), "ok").unwrap();
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;
    let answer = through_tunnel(&addr, &plane.router, &lease.lease_id, "", get).await.unwrap();
    assert!(String::from_utf8_lossy(&answer).ends_with("up\n"), "{}", String::from_utf8_lossy(&answer));
    assert_eq!(agent.instance_until(&plane, &lease.lease_id, "running", |i| i.pid != 0).await.pid, instance.pid);

    agent.kill().await;
    plane.cleanup().await;
}

/// A router keeps one connection to an agent for all its tunnels, and a
/// replica that closes after each answer (HTTP/1.0, as Python's own server
/// speaks) ends one tunnel per request: the router's HTTP client shuts the
/// tunnel down once the answer is in, often before the agent's end of the
/// stream came. Thousands of them in a row leave the connection serving:
/// h2 closes a connection, with every tunnel on it, once frames on streams
/// it had reset made it reset 1024 of them.
#[tokio::test]
async fn thousands_of_tunnels_a_replica_closes_leave_their_shared_connection_serving() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let (plane, _dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let addr = agent.handle.local_addr().to_string();
    let script = "echo up > index.html; exec python3 -m http.server $PORT --bind 127.0.0.1";
    let lease = plane.request("closing", script).await;
    agent.instance_until(&plane, &lease.lease_id, "running with a port", running_with_a_port).await;
    let get = b"GET /index.html HTTP/1.1\r\nHost: replica\r\n\r\n";
    eventually("the replica to answer through the tunnel", SLOW, || async {
        through_tunnel(&addr, &plane.router, &lease.lease_id, "", get).await.map_err(|status| format!("{status:?}"))
    })
    .await;
    // One connection, as a router holds; each tunnel used as an HTTP/1.1
    // client uses a connection.
    let connection = berth_rpc::tunnel::connect(&addr, &plane.router).await.unwrap();
    // A refusal comes back as the agent's status, the connection untouched.
    match connection.open("no-such-lease", "", SLOW).await {
        Err(berth_rpc::tunnel::OpenError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
            assert!(status.message().contains("no lease no-such-lease on this node"), "{status:?}");
        }
        other => panic!("a tunnel to no lease opened or broke: {other:?}"),
    }
    for tunnel in 0..2000 {
        let answered = async {
            let mut tunnel = connection.open(&lease.lease_id, "", SLOW).await.map_err(|error| format!("{error:?}"))?;
            tunnel.write_all(get).await.map_err(|e| e.to_string())?;
            let mut answer = Vec::new();
            let mut buffer = [0u8; 4096];
            while !answer.ends_with(b"up\n") {
                match tunnel.read(&mut buffer).await.map_err(|e| e.to_string())? {
                    0 => return Err(format!("ended early: {}", String::from_utf8_lossy(&answer))),
                    n => answer.extend_from_slice(&buffer[..n]),
                }
            }
            tunnel.shutdown().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(())
        };
        let answered = tokio::time::timeout(SLOW, answered).await.unwrap();
        answered.unwrap_or_else(|error| panic!("tunnel {tunnel} failed: {error}"));
    }
    assert!(!connection.is_closed(), "the shared connection still serves");

    agent.kill().await;
    plane.cleanup().await;
}

/// Regression: the agent wrote the caller's bytes to the replica outside
/// its wait for the tunnel's end, so a replica that accepted and never read
/// held the agent's task, the tunnel's stream and the replica's connection
/// for good once the caller (a router giving up) dropped the tunnel.
#[tokio::test]
async fn a_tunnel_dropped_by_its_caller_lets_go_of_a_replica_that_never_reads() {
    use std::net::{Ipv4Addr, SocketAddr};
    use tokio::io::AsyncWriteExt as _;

    /// How soon the agent must let go of the replica's connection.
    const LET_GO: Duration = Duration::from_secs(5);

    let (plane, _dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let addr = agent.handle.local_addr().to_string();
    // The workload listens on nothing: the test is the replica, on its port.
    let lease = plane.request("deaf", "exec sleep 1000").await;
    let instance = agent.instance_until(&plane, &lease.lease_id, "running with a port", running_with_a_port).await;
    let port = u16::try_from(instance.port).unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    // A small window, which what it accepts inherits: the agent's writes
    // block after a little, not after the tens of MB autotuning allows.
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    socket.bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).unwrap();
    let listener = socket.listen(8).unwrap();

    let connection = berth_rpc::tunnel::connect(&addr, &plane.router).await.unwrap();
    let mut tunnel = connection.open(&lease.lease_id, "", SLOW).await.unwrap();
    let (mut replica, _) = tokio::time::timeout(SLOW, listener.accept()).await.unwrap().unwrap();

    // The caller writes until the replica's window, the agent's socket and
    // the stream's window are full, and the agent is stuck writing.
    let chunk = vec![7u8; 256 * 1024];
    let mut sent = 0usize;
    while let Ok(written) = tokio::time::timeout(Duration::from_secs(1), tunnel.write_all(&chunk)).await {
        written.unwrap();
        sent += chunk.len();
        assert!(sent < 256 << 20, "the agent took {sent} bytes for a replica that reads none");
    }
    assert!(sent >= 1 << 20, "only {sent} bytes went before the tunnel stalled");
    drop(tunnel);

    // Once the agent let go, the replica's next bytes are refused: its side
    // closed, and what arrives after is answered with a reset.
    let deadline = tokio::time::Instant::now() + LET_GO;
    let refused = loop {
        if let Err(error) = replica.write_all(b"?").await {
            break error;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the agent still holds the replica's connection {LET_GO:?} after the tunnel was dropped ({sent} bytes sent)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        matches!(refused.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe),
        "{refused:?}"
    );
    assert!(!connection.is_closed(), "the tunnel's end leaves its shared connection serving");

    agent.kill().await;
    plane.cleanup().await;
}

/// Regression: bytes in a tunnel's first frame (the one naming the lease
/// and port) were dropped without a word; the caller is told instead.
#[tokio::test]
async fn data_in_a_tunnels_first_frame_is_refused_naming_the_field_not_dropped() {
    let (plane, _dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let channel = berth_rpc::connect(&agent.handle.local_addr().to_string(), plane.router.clone()).unwrap();
    let open = agent::TunnelFrame {
        open: Some(agent::TunnelOpen { lease_id: "any-lease".into(), port: String::new() }),
        data: b"GET / HTTP/1.0\r\n\r\n".to_vec(),
    };
    let status = DataPlaneClient::new(channel).tunnel(tokio_stream::iter([open])).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("data: the first frame of a tunnel carries no data"), "{status:?}");

    agent.kill().await;
    plane.cleanup().await;
}
