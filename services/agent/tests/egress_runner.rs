//! A replica launched by the agent's lease runner with an egress service
//! configured: it is given its tenant's proxy in every proxy variable (which
//! its lease cannot override), its proxy refuses everything until a plan
//! arrives, it stays reachable on its node port, and, where the agent runs
//! as root, it runs in its tenant's network namespace, which goes with its
//! lease. The egress service is not running: the agent retries it quietly
//! while all of this holds.
//!
//! Identity and leases run in process (see `common`).

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::io::{Read as _, Write as _};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_agent::{Enforcement, OciRuntime, WorkloadRuntime};
use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::LeasePhase;
use berth_proto::types::v1 as types;
use berth_testkit::eventually;

use common::*;

const CURL: &str = "/usr/bin/curl";
const PYTHON: &str = "/usr/bin/python3";

/// Waits until the file holds a line starting with `prefix`; returns the file.
async fn output_until(path: &Path, prefix: &str) -> String {
    eventually(&format!("a '{prefix}' line to be in {}", path.display()), SLOW, || async {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.lines().any(|line| line.starts_with(prefix)) { Ok(text) } else { Err(text) }
    })
    .await
}

/// `GET /` on `127.0.0.1:port` from the host, once something answers.
async fn fetch_from_host(port: u32) -> String {
    eventually(&format!("the replica to answer on its node port {port}"), SLOW, || async move {
        tokio::task::spawn_blocking(move || {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", u16::try_from(port).unwrap()))
                .map_err(|error| format!("connect: {error}"))?;
            stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(|error| format!("set timeout: {error}"))?;
            stream.write_all(b"GET / HTTP/1.0\r\nHost: replica\r\n\r\n").map_err(|error| format!("write: {error}"))?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer).map_err(|error| format!("read: {error}"))?;
            if answer.starts_with("HTTP/") { Ok(answer) } else { Err(format!("not HTTP: {answer:?}")) }
        })
        .await
        .unwrap()
    })
    .await
}

/// The `ip netns` name of the namespace with this inode, if one is mounted.
fn mounted_namespace(inode: u64) -> Option<PathBuf> {
    std::fs::read_dir("/run/netns")
        .ok()?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| std::fs::metadata(path).is_ok_and(|m| m.ino() == inode))
}

#[tokio::test]
async fn a_replica_launched_by_the_runner_is_given_its_tenants_proxy_and_stays_reachable() {
    replica_held_to_its_proxy(OciRuntime::Runc).await;
}

/// The same under gVisor, whose sandbox runs in the tenant's namespace and
/// passes the workload's sockets through to it.
#[tokio::test]
async fn a_replica_under_runsc_is_held_to_its_tenants_proxy_too() {
    if berth_testkit::runs_as_root("runsc") {
        replica_held_to_its_proxy(OciRuntime::Runsc).await;
    }
}

/// The same under the agent's own process runtime, which enters the
/// tenant's namespace before anything of the workload runs.
#[tokio::test]
async fn a_replica_under_the_process_runtime_is_held_to_its_tenants_proxy_too() {
    if berth_testkit::runs_as_root("the process runtime") {
        replica_held_to_its_proxy(OciRuntime::Own).await;
    }
}

async fn replica_held_to_its_proxy(runtime: OciRuntime) {
    let tools = Path::new(CURL).exists() && Path::new(PYTHON).exists();
    if !berth_testkit::needs(tools, &format!("{CURL} and {PYTHON} (as the replica)")) {
        return;
    }
    let plane = ControlPlane::start(Duration::from_secs(5)).await;
    let dir = TestDir::new();
    let mut config = agent_config(&plane, dir.path());
    if rustix::process::geteuid().is_root() {
        config.containment.runtime =
            if runtime == OciRuntime::Own { WorkloadRuntime::Process } else { WorkloadRuntime::Oci(runtime) };
        // The whole agent acting as the runtime, as where no
        // `berth-runtime` is installed beside it.
        config.process_runtime_exe = Some(env!("CARGO_BIN_EXE_berth-agent").into());
    }
    // Nothing listens there: the agent keeps retrying, quietly.
    config.egress = Some("127.0.0.1:1".into());
    let agent = RunningAgent::start(config).await;
    let enforcement = agent.handle.egress().expect("egress is configured").borrow().enforcement.clone();
    let isolated = enforcement == Enforcement::Isolated;
    assert_eq!(isolated, rustix::process::geteuid().is_root(), "root isolates, anyone else is advisory: {enforcement}");

    // Around the proxy, straight to a port on the host's loopback (the
    // identity service listens there): from the tenant's namespace there is
    // no such listener and no route out.
    let host_port = plane.identity_addr.rsplit(':').next().unwrap().to_string();
    let script = format!(
        "echo \"proxy=$HTTP_PROXY $HTTPS_PROXY $ALL_PROXY $http_proxy $https_proxy $all_proxy\"; \
         echo \"no_proxy=$NO_PROXY\"; \
         {CURL} -s --noproxy '*' --max-time 3 -o /dev/null -w 'direct=%{{http_code}}\\n' \
           http://127.0.0.1:{host_port}/; \
         {CURL} -s -o /dev/null -w 'status=%{{http_code}}\\n' http://example.invalid/; \
         echo \"resolv=$(grep '^nameserver' /etc/resolv.conf)\"; \
         echo \"dns=$(busybox nslookup api.example.com 2>&1 | grep -o -e REFUSED -e 'timed out' | head -n 1)\"; \
         exec {PYTHON} -m http.server \"$PORT\" --bind 127.0.0.1"
    );
    let workload = leases::Workload {
        command: "sh".into(),
        args: vec!["-c".into(), script],
        // The lease cannot send its replica around the proxy.
        env: [("HTTP_PROXY".to_string(), "http://elsewhere:1".to_string())].into(),
        service: "web".into(),
        ports: vec![types::Port { name: "http".into(), port: 8080 }],
        ..Default::default()
    };
    let lease = plane.request_workload("egress-env", workload).await;
    plane.phase_until(&lease.lease_id, LeasePhase::Running).await;

    let stdout = dir.path().join("logs").join(&lease.lease_id).join("stdout.log");
    let output = output_until(&stdout, "dns=").await;
    let proxy_line = output.lines().find(|line| line.starts_with("proxy=")).unwrap();
    let urls: Vec<&str> = proxy_line["proxy=".len()..].split(' ').collect();
    assert_eq!(urls.len(), 6, "{proxy_line}");
    assert!(urls[0].starts_with("http://127.0.0.1:"), "{proxy_line}");
    assert!(urls.iter().all(|url| *url == urls[0]), "every proxy variable names the same proxy: {proxy_line}");
    assert!(output.contains("no_proxy=localhost,127.0.0.1,::1"), "{output}");
    assert!(output.contains("status=403"), "no plan has arrived, so the proxy refuses: {output}");
    if isolated {
        assert!(output.contains("direct=000"), "nothing is reached around the proxy: {output}");
        // Names go to the tenant's resolver in its namespace, which, with
        // no plan yet, resolves nothing.
        assert!(output.contains("resolv=nameserver 127.0.0.53"), "{output}");
        assert!(output.contains("dns=REFUSED"), "{output}");
    }

    let instance =
        agent.instance_until(&plane, &lease.lease_id, "running with a port", |i| i.pid != 0 && i.port != 0).await;
    let answer = fetch_from_host(instance.port).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "the replica answers on its node port: {answer}");

    let own_namespace = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
    let replica_namespace = std::fs::metadata(format!("/proc/{}/ns/net", instance.pid)).unwrap().ino();
    let mounted = mounted_namespace(replica_namespace);
    if isolated {
        assert_ne!(replica_namespace, own_namespace, "the replica runs in a namespace of its own");
        assert!(mounted.is_some(), "its namespace is one the agent named");
    } else {
        assert_eq!(replica_namespace, own_namespace);
    }

    plane.release(&lease.lease_id).await;
    gone_until(instance.pid).await;
    if let Some(namespace) = mounted {
        eventually(&format!("{} to go with the tenant's last lease", namespace.display()), SLOW, || async {
            if namespace.exists() { Err(format!("{} still exists", namespace.display())) } else { Ok(()) }
        })
        .await;
    }
    agent.kill().await;
    plane.cleanup().await;
}
