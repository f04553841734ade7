//! `berth dev` end to end, driven the way a user drives it: the real binary
//! on a temp data dir and free ports, and the real grpcurl over mTLS with the
//! admin certificate it wrote.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]
#![allow(clippy::disallowed_methods, reason = "these tests drive processes from plain threads, not a runtime")]

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

const SERVICES: [(u16, &[&str]); 5] = [
    (
        0,
        &[
            "berth.identity.v1.JoinTokens",
            "berth.identity.v1.Join",
            "berth.identity.v1.NodeSession",
            "berth.identity.v1.Nodes",
            "berth.identity.v1.Authority",
        ],
    ),
    (1, &["berth.revisions.v1.Services", "berth.revisions.v1.Revisions"]),
    (2, &["berth.leases.v1.Leases", "berth.leases.v1.Capacity", "berth.leases.v1.NodeLeases"]),
    (3, &["berth.egress.v1.Egress", "berth.egress.v1.NodeEgress"]),
    (4, &["berth.agent.v1.Agent"]),
];

fn grpcurl() -> PathBuf {
    std::env::var_os("BERTH_GRPCURL").map_or_else(|| PathBuf::from("grpcurl"), PathBuf::from)
}

struct Dev {
    child: Child,
    dir: PathBuf,
    /// Whether dropping it leaves its node's containers running, as a
    /// killed `berth dev` does, for the next one to adopt.
    leave_workloads: bool,
}

impl Dev {
    /// Starts `berth dev` on free ports and waits for its banner; its port
    /// base too.
    fn start(dir: &Path) -> (Dev, u16) {
        Dev::start_with(dir, &[])
    }

    /// Starts `berth dev` on a data directory of its own and free ports;
    /// the temp directory that holds it, the data directory and the port
    /// base too.
    fn start_fresh() -> (tempfile::TempDir, PathBuf, u16, Dev) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data");
        let (dev, base) = Dev::start(&dir);
        (tmp, dir, base, dev)
    }

    /// Starts `berth dev` with `extra` flags; its port base too.
    fn start_with(dir: &Path, extra: &[&str]) -> (Dev, u16) {
        let (child, base) = common::spawn_dev_with(dir, extra);
        (Dev { child, dir: dir.to_path_buf(), leave_workloads: false }, base)
    }

    /// Drops a killed `berth dev` without cleaning up after it.
    fn abandon(mut self) {
        self.leave_workloads = true;
    }

    /// SIGTERM, then the exit status.
    fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        for _ in 0..300 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("berth dev did not exit within 15 s of SIGTERM");
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        if self.leave_workloads {
            let _ = self.child.kill();
            let _ = self.child.wait();
        } else {
            common::stop_dev(&mut self.child, &self.dir);
        }
    }
}

/// Runs grpcurl with the certificate and key in `cert` (relative to `dir`),
/// an optional JSON body, then `addr` and `rest` (a method, or `list` ...).
fn grpcurl_with(dir: &Path, cert: (&str, &str), body: Option<&str>, addr: &str, rest: &[&str]) -> std::process::Output {
    let mut command = grpcurl_presenting(&dir.join("ca.pem"), &dir.join(cert.0), &dir.join(cert.1));
    if let Some(body) = body {
        command.args(["-d", body]);
    }
    command.arg(addr).args(rest).output().expect("grpcurl runs (make test installs it; or set BERTH_GRPCURL)")
}

/// grpcurl trusting `ca` and presenting `cert` with `key`.
fn grpcurl_presenting(ca: &Path, cert: &Path, key: &Path) -> Command {
    let mut command = Command::new(grpcurl());
    command.arg("-cacert").arg(ca).arg("-cert").arg(cert).arg("-key").arg(key);
    command
}

/// The admin identity `berth dev` writes.
const ADMIN: (&str, &str) = ("admin.pem", "admin-key.pem");

/// The dev node's own identity, as its agent keeps it.
const NODE: (&str, &str) = ("agent/identity/node.pem", "agent/identity/node.key");

/// What a command printed, stderr then stdout.
fn printed(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout)
}

fn grpcurl_admin(dir: &Path, addr: &str, args: &[&str]) -> String {
    let out = grpcurl_with(dir, ADMIN, None, addr, args);
    assert!(
        out.status.success(),
        "grpcurl {addr} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn grpcurl_lists_every_service_and_health_serves_and_restart_keeps_the_ca() {
    let (_tmp, dir, base, dev) = Dev::start_fresh();

    for (offset, expected) in SERVICES {
        let addr = format!("127.0.0.1:{}", base + offset);
        let listed = grpcurl_admin(&dir, &addr, &["list"]);
        let names: Vec<&str> = listed.lines().collect();
        for service in expected.iter().chain(&["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"]) {
            assert!(names.contains(service), "{addr} lists {names:?}, missing {service}");
        }
        let health = grpcurl_admin(&dir, &addr, &["grpc.health.v1.Health/Check"]);
        assert!(health.contains("\"SERVING\""), "{addr}: {health}");
        // A service can be described with no .proto at hand.
        let described = grpcurl_admin(&dir, &addr, &["describe", expected[0]]);
        assert!(described.contains("rpc "), "{described}");
    }

    let ca_before = std::fs::read(dir.join("ca.pem")).unwrap();
    let admin_before = std::fs::read(dir.join("admin.pem")).unwrap();
    assert!(dev.stop().success(), "berth dev exits cleanly on SIGTERM");

    // Fresh ports: another test may have taken the old ones since.
    let (dev, base) = Dev::start(&dir);
    assert_eq!(std::fs::read(dir.join("ca.pem")).unwrap(), ca_before, "restart keeps ca.pem byte for byte");
    assert_eq!(std::fs::read(dir.join("admin.pem")).unwrap(), admin_before, "a current admin cert is kept");
    let health = grpcurl_admin(&dir, &format!("127.0.0.1:{base}"), &["grpc.health.v1.Health/Check"]);
    assert!(health.contains("\"SERVING\""), "{health}");
    assert!(dev.stop().success());
}

/// ListNodes as the admin, asked up to 100 times 100 ms apart until `done`
/// holds of what it printed; the last answer.
fn list_nodes_until(dir: &Path, addr: &str, done: impl Fn(&str) -> bool) -> String {
    let mut last = String::new();
    for _ in 0..100 {
        last = grpcurl_admin(dir, addr, &["berth.identity.v1.Nodes/ListNodes"]);
        if done(&last) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    last
}

#[test]
fn the_dev_node_joins_and_comes_up() {
    let (_tmp, dir, base, dev) = Dev::start_fresh();
    let addr = format!("127.0.0.1:{base}");
    let last = list_nodes_until(&dir, &addr, |l| l.contains("\"name\": \"dev\"") && l.contains("NODE_STATE_UP"));
    assert!(last.contains("\"name\": \"dev\"") && last.contains("NODE_STATE_UP"), "{last}");
    let first: serde_json::Value = serde_json::from_str(&last).unwrap();
    let node_id = first["nodes"][0]["nodeId"].as_str().unwrap().to_string();
    assert!(dev.stop().success());

    // A restart resumes the same node rather than joining a second one
    // (on fresh ports: another test may have taken the old ones since).
    let (dev, base) = Dev::start(&dir);
    let addr = format!("127.0.0.1:{base}");
    let last = list_nodes_until(&dir, &addr, |l| l.contains("NODE_STATE_UP"));
    let again: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(again["nodes"].as_array().unwrap().len(), 1, "{last}");
    assert_eq!(again["nodes"][0]["nodeId"].as_str().unwrap(), node_id);
    assert!(dev.stop().success());
}

/// grpcurl with the dev node's own certificate, as the agent keeps it.
fn grpcurl_node(dir: &Path, addr: &str, method: &str) -> std::process::Output {
    grpcurl_with(dir, NODE, None, addr, &[method])
}

#[test]
fn a_revoked_node_is_refused_by_every_service_within_seconds() {
    let (_tmp, dir, base, _dev) = Dev::start_fresh();
    let identity = format!("127.0.0.1:{base}");
    let listed = list_nodes_until(&dir, &identity, |l| l.contains("NODE_STATE_UP"));
    let nodes: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let node_id = nodes["nodes"][0]["nodeId"].as_str().expect("the dev node joined").to_string();
    for offset in 0..4 {
        let out = grpcurl_node(&dir, &format!("127.0.0.1:{}", base + offset), "grpc.health.v1.Health/Check");
        assert!(out.status.success(), "before revocation: {out:?}");
    }

    let body = format!("{{\"node_id\": \"{node_id}\"}}");
    let revoke = grpcurl_with(&dir, ADMIN, Some(&body), &identity, &["berth.identity.v1.Nodes/RevokeNode"]);
    assert!(revoke.status.success(), "{revoke:?}");
    for offset in 0..4 {
        let addr = format!("127.0.0.1:{}", base + offset);
        let mut refused = false;
        for _ in 0..50 {
            let out = grpcurl_node(&dir, &addr, "grpc.health.v1.Health/Check");
            let text = String::from_utf8_lossy(&out.stderr).to_string();
            if !out.status.success() && text.contains("PermissionDenied") && text.contains("revoked") {
                refused = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(refused, "{addr} still serves the revoked node after 5 s");
    }
    // The control plane itself keeps serving.
    let health = grpcurl_admin(&dir, &identity, &["grpc.health.v1.Health/Check"]);
    assert!(health.contains("SERVING"), "{health}");
}

/// grpcurl as the admin with a JSON body.
fn grpcurl_admin_call(dir: &Path, addr: &str, method: &str, body: &str) -> serde_json::Value {
    let out = grpcurl_with(dir, ADMIN, Some(body), addr, &[method]);
    assert!(out.status.success(), "{method} {body}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Requests a lease running `sh -c SCRIPT ARGS…`, retrying while the dev
/// node is still joining (placement needs it UP); returns its id.
fn request_lease(dir: &Path, leases: &str, key: &str, sh_args: &[&str]) -> String {
    let body = serde_json::json!({
        "owner": "test",
        "idempotency_key": key,
        "resources": {"cpu_millis": 100, "memory_bytes": 1_048_576},
        "workload": {"command": "sh", "args": std::iter::once("-c").chain(sh_args.iter().copied()).collect::<Vec<_>>()},
    })
    .to_string();
    for _ in 0..100 {
        let out = grpcurl_with(dir, ADMIN, Some(&body), leases, &["berth.leases.v1.Leases/RequestLease"]);
        if out.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            return v["lease"]["leaseId"].as_str().unwrap().to_string();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("no lease could be placed on the dev node");
}

/// Polls GetLease until the lease reaches a final phase.
fn wait_final(dir: &Path, leases: &str, lease_id: &str) -> serde_json::Value {
    let mut lease = serde_json::Value::Null;
    for _ in 0..200 {
        lease = grpcurl_admin_call(
            dir,
            leases,
            "berth.leases.v1.Leases/GetLease",
            &format!("{{\"lease_id\": \"{lease_id}\"}}"),
        )["lease"]
            .clone();
        if matches!(lease["phase"].as_str(), Some("LEASE_PHASE_DONE" | "LEASE_PHASE_FAILED")) {
            return lease;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("lease {lease_id} never finished: {lease}");
}

#[test]
fn a_requested_lease_runs_on_the_dev_node_and_reports_its_exit() {
    let (_tmp, dir, base, _dev) = Dev::start_fresh();
    let leases = format!("127.0.0.1:{}", base + 2);
    let request = |key: &str, script: &str| request_lease(&dir, &leases, key, &[script]);

    let ok = request("ok", "exit 0");
    let done = wait_final(&dir, &leases, &ok);
    assert_eq!(done["phase"], "LEASE_PHASE_DONE", "{done}");

    let bad = request("bad", "exit 3");
    let failed = wait_final(&dir, &leases, &bad);
    assert_eq!(failed["phase"], "LEASE_PHASE_FAILED", "{failed}");
    assert_eq!(failed["exitCode"], 3, "{failed}");

    // Both finished, so the node's capacity is whole again.
    let capacity = grpcurl_admin_call(&dir, &leases, "berth.leases.v1.Capacity/ListNodeCapacity", "{}");
    let node = &capacity["nodes"][0];
    assert!(node["allocated"].get("cpuMillis").is_none(), "nothing allocated, so no cpuMillis: {capacity}");

    // The CLI's `-o json` is grpcurl's answer, field for field.
    let cli = |args: &[&str]| -> serde_json::Value {
        let identity = format!("127.0.0.1:{base}");
        let flags =
            ["-o", "json", "--data-dir", dir.to_str().unwrap(), "--server", &identity, "--leases-server", &leases];
        let all = [args, &flags].concat();
        let out = berth(&all);
        assert!(out.status.success(), "berth {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let body = format!("{{\"lease_id\": \"{bad}\"}}");
    let got = grpcurl_admin_call(&dir, &leases, "berth.leases.v1.Leases/GetLease", &body);
    assert_eq!(cli(&["lease", "get", &bad]), got);
    assert_eq!(cli(&["capacity"]), capacity);
    let listed = grpcurl_admin_call(&dir, &leases, "berth.leases.v1.Leases/ListLeases", "{}");
    assert_eq!(cli(&["lease", "list"]), listed);
    assert_eq!(listed["leases"].as_array().map(Vec::len), Some(2), "{listed}");

    // Identity tells where the rest of the mesh is, at the host a client
    // reached it by; the CLI needs nothing more.
    let identity = format!("127.0.0.1:{base}");
    let endpoints = grpcurl_admin_call(&dir, &identity, "berth.identity.v1.Mesh/GetEndpoints", "{}");
    let at = |offset: u16| format!(":{}", base + offset);
    let expected = serde_json::json!({ "endpoints": [
        { "service": "egress", "address": at(3) },
        { "service": "leases", "address": at(2) },
        { "service": "revisions", "address": at(1) },
        { "service": "router", "address": at(5) },
    ]});
    assert_eq!(endpoints, expected);
    let out = berth(&["lease", "list", "-o", "json", "--data-dir", dir.to_str().unwrap(), "--server", &identity]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap(), listed);
}

/// A plain HTTP GET on loopback; the body, or None while nothing answers.
fn http_get(port: u64, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port as u16)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// What the replica on `port` answers to `GET /`, once it answers: a
/// replica is RUNNING once its process started, which may be before its
/// server listens.
fn answer_of(port: u64) -> Option<String> {
    for _ in 0..50 {
        if let Some(answer) = http_get(port, "/") {
            return Some(answer);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

#[test]
fn the_example_deploys_from_an_oci_layout_with_no_registry() {
    the_example_deploys_with(&[]);
}

#[test]
fn the_example_deploys_under_the_process_runtime() {
    the_example_deploys_with(&["--runtime", "process"]);
}

/// The README's deploy on a `berth dev` started with `flags`: two replicas
/// answer, a changed template rolls out, a deleted service's replicas stop.
fn the_example_deploys_with(flags: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let layout = tmp.path().join("oci");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/hello");
    let reference = format!("oci:{}:hello", layout.display());
    let push = berth(&["bundle", "push", example.to_str().unwrap(), &reference]);
    assert!(push.status.success(), "{}", String::from_utf8_lossy(&push.stderr));

    let (_dev, base) = Dev::start_with(&dir, flags);
    let template: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(example.join("service.json")).unwrap()).unwrap();
    let mut template = template;
    template["bundle"]["reference"] = serde_json::Value::String(reference);
    let body = serde_json::json!({"name": "hello", "template": template}).to_string();
    let revisions = format!("127.0.0.1:{}", base + 1);
    let applied = grpcurl_admin_call(&dir, &revisions, "berth.revisions.v1.Services/ApplyService", &body);
    assert!(applied.to_string().contains("hello-"), "{applied}");

    let mut service = serde_json::Value::Null;
    for _ in 0..300 {
        service =
            grpcurl_admin_call(&dir, &revisions, "berth.revisions.v1.Services/GetService", r#"{"name": "hello"}"#);
        if service["service"]["status"]["replicasRunning"] == 2
            && service["service"]["status"]["liveRevision"].is_string()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = &service["service"]["status"];
    assert_eq!(status["replicasRunning"], 2, "{service}");
    let live = status["liveRevision"].as_str().unwrap().to_string();

    // The README's watch of the replicas: the open set, then SYNCED, until grpcurl's deadline.
    let leases = format!("127.0.0.1:{}", base + 2);
    let watched = grpcurl_presenting(&dir.join("ca.pem"), &dir.join("admin.pem"), &dir.join("admin-key.pem"))
        .args(["-max-time", "3", "-d", r#"{"owner_prefix": "revisions/hello@"}"#, &leases])
        .arg("berth.leases.v1.Leases/WatchLeases")
        .output()
        .unwrap();
    let watched = String::from_utf8_lossy(&watched.stdout);
    assert_eq!(watched.matches("EVENT_KIND_UPSERT").count(), 2, "{watched}");
    assert_eq!(watched.matches("LEASE_PHASE_RUNNING").count(), 2, "{watched}");
    assert_eq!(watched.matches("EVENT_KIND_SYNCED").count(), 1, "{watched}");

    let agent = format!("127.0.0.1:{}", base + 4);
    let instances = grpcurl_admin_call(&dir, &agent, "berth.agent.v1.Agent/ListInstances", "{}");
    let ports: Vec<u64> = instances["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["revision"] == live.as_str())
        .map(|i| i["port"].as_u64().unwrap())
        .collect();
    assert_eq!(ports.len(), 2, "{instances}");
    for port in ports {
        assert_eq!(answer_of(port).as_deref(), Some(format!("hello from {live}\n").as_str()), "replica on port {port}");
    }
    let replicas: Vec<String> = instances["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["revision"] == live.as_str())
        .map(|i| i["leaseId"].as_str().unwrap().to_owned())
        .collect();
    a_replica_reads_only_its_own_with_its_own_certificate(&dir, base, &replicas, &live);

    // A changed template mints the next revision and rolls it out with never
    // fewer than two replicas running on the node, watched as it happens.
    template["env"] = serde_json::json!({"ROLLOUT": "2"});
    let body = serde_json::json!({"name": "hello", "template": template}).to_string();
    grpcurl_admin_call(&dir, &revisions, "berth.revisions.v1.Services/ApplyService", &body);
    let running = |instances: &serde_json::Value, revision: Option<&str>| {
        instances["instances"]
            .as_array()
            .map(|all| {
                all.iter()
                    .filter(|i| i["phase"] == "LEASE_PHASE_RUNNING")
                    .filter(|i| revision.is_none_or(|r| i["revision"] == r))
                    .count()
            })
            .unwrap_or(0)
    };
    let mut fewest = usize::MAX;
    let mut next = String::new();
    for _ in 0..600 {
        let instances = grpcurl_admin_call(&dir, &agent, "berth.agent.v1.Agent/ListInstances", "{}");
        fewest = fewest.min(running(&instances, None));
        let status = grpcurl_admin_call(
            &dir,
            &revisions,
            "berth.revisions.v1.Services/GetService",
            r#"{"name": "hello"}"#,
        )["service"]["status"]
            .clone();
        let now_live = status["liveRevision"].as_str().unwrap_or_default().to_string();
        if now_live != live && status["replicasRunning"] == 2 && running(&instances, Some(&now_live)) == 2 {
            next = now_live;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!next.is_empty(), "the new revision never went live");
    assert!(fewest >= 2, "at some moment only {fewest} replicas ran during the rollout");
    let mut old_gone = false;
    for _ in 0..200 {
        let instances = grpcurl_admin_call(&dir, &agent, "berth.agent.v1.Agent/ListInstances", "{}");
        if running(&instances, Some(&live)) == 0 {
            old_gone = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(old_gone, "the old revision's replicas kept running after the new one went live");
    let instances = grpcurl_admin_call(&dir, &agent, "berth.agent.v1.Agent/ListInstances", "{}");
    for instance in instances["instances"].as_array().unwrap().iter().filter(|i| i["revision"] == next.as_str()) {
        let port = instance["port"].as_u64().unwrap();
        assert_eq!(answer_of(port).as_deref(), Some(format!("hello from {next}\n").as_str()), "port {port}");
    }

    // Deleting the service releases its replicas, and the node stops them.
    grpcurl_admin_call(&dir, &revisions, "berth.revisions.v1.Services/DeleteService", r#"{"name": "hello"}"#);
    let replicas = dir.join("agent").display().to_string();
    for _ in 0..200 {
        if pid_with(&replicas).is_none() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the deleted service's replicas are still running");
}

/// A replica of `hello` calls berth's APIs with the certificate its node
/// minted for it (caller kind WORKLOAD): it reads its own service, revision
/// and lease, and nothing else, whatever it asks for.
fn a_replica_reads_only_its_own_with_its_own_certificate(dir: &Path, base: u16, replicas: &[String], live: &str) {
    let (me, sibling) = (&replicas[0], &replicas[1]);
    let identity = dir.join("agent/svids").join(me);
    let (revisions, leases) = (format!("127.0.0.1:{}", base + 1), format!("127.0.0.1:{}", base + 2));
    let call = |addr: &str, method: &str, body: &str| {
        let out = grpcurl_presenting(
            &identity.join("berth-ca.pem"),
            &identity.join("svid.pem"),
            &identity.join("svid-key.pem"),
        )
        .args(["-d", body, addr, method])
        .output()
        .unwrap();
        (out.status.success(), printed(&out))
    };
    let (ok, got) = call(&revisions, "berth.revisions.v1.Services/GetService", r#"{"name": "hello"}"#);
    assert!(ok && got.contains(r#""name": "hello""#), "its own service: {got}");
    let (ok, got) = call(&revisions, "berth.revisions.v1.Revisions/GetRevision", &format!(r#"{{"name": "{live}"}}"#));
    assert!(ok && got.contains(live), "its own revision: {got}");
    let (ok, got) = call(&leases, "berth.leases.v1.Leases/GetLease", &format!(r#"{{"lease_id": "{me}"}}"#));
    assert!(ok && got.contains(me.as_str()), "its own lease: {got}");

    let spiffe_id = format!("spiffe://berth.internal/ns/default/svc/hello/rev/{live}/lease/{me}");
    for (addr, method, body) in [
        (&revisions, "berth.revisions.v1.Services/GetService", r#"{"name": "other"}"#.to_owned()),
        (&revisions, "berth.revisions.v1.Services/GetService", r#"{"project": "team-b", "name": "hello"}"#.to_owned()),
        (&leases, "berth.leases.v1.Leases/GetLease", format!(r#"{{"lease_id": "{sibling}"}}"#)),
    ] {
        let (ok, got) = call(addr, method, &body);
        assert!(!ok && got.contains("PermissionDenied"), "{method} {body}: {got}");
        assert!(got.contains(&format!("workload '{spiffe_id}' may read only what its SPIFFE ID names")), "{got}");
    }
    for (addr, method) in [
        (&revisions, "berth.revisions.v1.Services/ListServices"),
        (&revisions, "berth.revisions.v1.Services/ApplyService"),
        (&leases, "berth.leases.v1.Leases/ListLeases"),
        (&leases, "berth.leases.v1.Leases/ReleaseLease"),
    ] {
        let (ok, got) = call(addr, method, "{}");
        assert!(!ok && got.contains("PermissionDenied"), "{method}: {got}");
        assert!(got.contains(&format!("workload '{spiffe_id}' may not call")), "{method}: {got}");
    }
}

/// The pid of the process whose command line holds `marker`, if one runs.
fn pid_with(marker: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
        String::from_utf8_lossy(&cmdline).contains(marker).then_some(pid)
    })
}

#[test]
fn a_kill_9_of_the_whole_mesh_leaves_the_workload_running_and_the_restart_adopts_it() {
    let (_tmp, dir, base, mut dev) = Dev::start_fresh();
    let leases = format!("127.0.0.1:{}", base + 2);
    let marker = format!("berth-kill9-{base}-{}", std::process::id());
    let script = format!("sleep 600; echo {marker}");
    let lease_id = request_lease(&dir, &leases, "k9", &[&script, &marker]);
    let get = |leases: &str, lease_id: &str| {
        grpcurl_admin_call(
            &dir,
            leases,
            "berth.leases.v1.Leases/GetLease",
            &format!("{{\"lease_id\": \"{lease_id}\"}}"),
        )["lease"]
            .clone()
    };
    let mut pid = None;
    for _ in 0..100 {
        pid = pid_with(&marker);
        if pid.is_some() && get(&leases, &lease_id)["phase"] == "LEASE_PHASE_RUNNING" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = pid.expect("the workload started");
    let before = get(&leases, &lease_id);
    assert_eq!(before["phase"], "LEASE_PHASE_RUNNING", "{before}");

    // kill -9: no cleanup at all, in any of the five services or the agent.
    Command::new("kill").args(["-KILL", &dev.child.id().to_string()]).status().unwrap();
    let _ = dev.child.wait();
    dev.abandon();
    assert_eq!(pid_with(&marker), Some(pid), "the workload outlives the agent");

    // Fresh ports: another test may have taken the old ones since.
    let (_dev, base) = Dev::start(&dir);
    let leases = format!("127.0.0.1:{}", base + 2);
    let mut after = serde_json::Value::Null;
    for _ in 0..100 {
        after = get(&leases, &lease_id);
        if after["phase"] == "LEASE_PHASE_RUNNING" && after["epoch"] != before["epoch"] {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(after["phase"], "LEASE_PHASE_RUNNING", "{after}");
    assert_eq!(pid_with(&marker), Some(pid), "adopted, not restarted");
    let instances =
        grpcurl_admin_call(&dir, &format!("127.0.0.1:{}", base + 4), "berth.agent.v1.Agent/ListInstances", "{}");
    let adopted =
        instances["instances"].as_array().unwrap().iter().find(|i| i["leaseId"] == lease_id.as_str()).cloned();
    assert_eq!(adopted.as_ref().and_then(|i| i["pid"].as_u64()), Some(u64::from(pid)), "{instances}");

    // Clean up the workload through the API, as a user would.
    grpcurl_admin_call(
        &dir,
        &leases,
        "berth.leases.v1.Leases/ReleaseLease",
        &format!("{{\"lease_id\": \"{lease_id}\"}}"),
    );
    for _ in 0..100 {
        if pid_with(&marker).is_none() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the released workload is still running");
}

#[test]
fn node_rpcs_refuse_the_admin_and_egress_serves_it() {
    let (_tmp, dir, base, dev) = Dev::start_fresh();
    let run = |addr: String, method: &str| grpcurl_with(&dir, ADMIN, Some("{}"), &addr, &[method]);
    let out = run(format!("127.0.0.1:{base}"), "berth.identity.v1.NodeSession/Heartbeat");
    let text = printed(&out);
    assert!(!out.status.success());
    assert!(text.contains("PermissionDenied"), "{text}");
    assert!(text.contains("admin 'dev'"), "{text}");

    let out = run(format!("127.0.0.1:{}", base + 3), "berth.egress.v1.Egress/ListGateways");
    let text = printed(&out);
    assert!(out.status.success(), "{text}");
    let out = run(format!("127.0.0.1:{}", base + 3), "berth.egress.v1.NodeEgress/WatchEgress");
    let text = printed(&out);
    assert!(!out.status.success());
    assert!(text.contains("PermissionDenied"), "{text}");
    drop(dev);
}

fn berth(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_berth")).args(args).output().unwrap()
}

#[test]
fn malformed_flag_is_one_clear_error_not_a_panic() {
    let out = berth(&["dev", "--port-base", "seventy"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--port-base"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = berth(&["dev", "--port-base", "65535"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn unusable_data_dir_is_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let dir = file.join("data");
    let out = berth(&["dev", "--data-dir", dir.to_str().unwrap(), "--port-base", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("berth: error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].contains("cannot create data directory") && errors[0].contains(dir.to_str().unwrap()),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn port_in_use_is_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::free_port_base();
    let _taken = TcpListener::bind(("127.0.0.1", base + 2)).unwrap();
    let out = berth(&["dev", "--data-dir", tmp.path().to_str().unwrap(), "--port-base", &base.to_string()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&format!("cannot listen on 127.0.0.1:{}", base + 2)), "{stderr}");
}

#[test]
fn stopping_berth_dev_stops_its_nodes_workloads_first() {
    let (_tmp, dir, base, dev) = Dev::start_fresh();
    let leases = format!("127.0.0.1:{}", base + 2);
    let marker = format!("berth-dev-stop-{base}-{}", std::process::id());
    let script = format!("sleep 600; echo {marker}");
    request_lease(&dir, &leases, "stop", &[&script, &marker]);
    let mut running = None;
    for _ in 0..100 {
        running = pid_with(&marker);
        if running.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(running.is_some(), "the workload started");

    // Ctrl-C (SIGINT) and SIGTERM stop the same way: nothing else would
    // adopt the dev node's workloads, so they stop with it.
    assert!(dev.stop().success());
    assert_eq!(pid_with(&marker), None, "the dev node's workload outlived berth dev");
}
