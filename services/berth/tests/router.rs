//! The data plane as a user drives it: `berth dev`'s router reached with
//! `curl` over HTTP/1.1 and HTTP/2, in cleartext and TLS, an unknown name and
//! a service with no replica answered at once, and a replica killed with
//! SIGKILL passed over while the other answers; a split and a rollout under
//! load; a pin, a split and an unpin under load with no request failed; a
//! replica killed under load failing at most its requests in flight; a
//! request in flight on a revision that drains answered before it stops; a
//! node drained under load, its replicas handed to a second node (a
//! `berth-agent` process joined to the dev mesh) with no request failed;
//! the real `grpcurl` calling a gRPC workload through it; and a
//! connection switched to another protocol, joined to the replica.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{DevProcess, berth_command, parse_json, poll, run};
use serde_json::Value;

/// How long one CLI command may take; an apply with `--wait` starts replicas.
const COMMAND_DEADLINE: Duration = Duration::from_secs(120);

/// How long a change may take to reach the router.
const ROUTE_DEADLINE: Duration = Duration::from_secs(60);

const CURL: &str = "/usr/bin/curl";

const H2LOAD: &str = "/usr/bin/h2load";

/// What `curl -i` printed: the status line, the headers (lowercase names),
/// and the body.
#[derive(Debug)]
struct Answer {
    status: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// `curl -i` of `/` at the router's cleartext port for `host`, with `flags`.
fn curl(port: u16, host: &str, flags: &[&str]) -> Result<Answer, String> {
    let header = format!("Host: {host}");
    curl_url(&format!("http://127.0.0.1:{port}/"), &[&["-H", &header], flags].concat())
}

/// `curl -i` of `url`, with `flags`.
fn curl_url(url: &str, flags: &[&str]) -> Result<Answer, String> {
    let output = Command::new(CURL)
        .args(["-s", "-S", "-i", "--max-time", "10"])
        .args(flags)
        .arg(url)
        .output()
        .map_err(|e| format!("cannot run curl: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout).replace("\r\n", "\n");
    let Some((head, body)) = text.split_once("\n\n") else {
        return Err(format!("curl: {}{}", text, String::from_utf8_lossy(&output.stderr)));
    };
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default().to_string();
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    Ok(Answer { status, headers, body: body.to_string() })
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/hello")
}

/// The example's template with its bundle at `reference` and `replicas`.
fn write_template(path: &Path, reference: &str, replicas: u32) {
    write_template_with(path, reference, replicas, "1");
}

/// Like [`write_template`], with `EDITION` in its environment: a new value
/// mints a new revision.
fn write_template_with(path: &Path, reference: &str, replicas: u32, edition: &str) {
    let mut template: Value =
        serde_json::from_str(&std::fs::read_to_string(example().join("service.json")).unwrap()).unwrap();
    template["bundle"]["reference"] = Value::String(reference.to_string());
    template["replicas"] = Value::from(replicas);
    template["env"] = serde_json::json!({ "EDITION": edition });
    std::fs::write(path, serde_json::to_string_pretty(&template).unwrap()).unwrap();
}

/// `count` GETs of `/` for `host` over one keep-alive HTTP/1.1 connection to
/// the router on `port`: how many times each body came back. Any other
/// answer than 200 fails the test.
fn tally(port: u16, host: &str, count: usize) -> std::collections::BTreeMap<String, usize> {
    let (seen, failures) = hammer(port, host, Some(count), &std::sync::atomic::AtomicBool::new(false));
    assert!(failures.is_empty(), "{failures:?}");
    seen
}

/// GETs of `/` for `host` over keep-alive HTTP/1.1 connections to the router
/// on `port`, one after another, `count` of them or until `stop`: how many
/// times each body came back with 200, and every other answer or error.
fn hammer(
    port: u16,
    host: &str,
    count: Option<usize>,
    stop: &std::sync::atomic::AtomicBool,
) -> (std::collections::BTreeMap<String, usize>, Vec<String>) {
    let mut seen = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    let mut sent = 0;
    while count.is_none_or(|count| sent < count) && !stop.load(std::sync::atomic::Ordering::SeqCst) {
        match keep_alive_gets(port, host, count.map_or(500, |count| count - sent), &mut seen) {
            Ok(done) => sent += done,
            Err((done, failure)) => {
                sent += done + 1;
                failures.push(failure);
            }
        }
    }
    (seen, failures)
}

/// Up to `count` GETs on one connection, tallied into `seen`; how many were
/// answered, or how many were before one failed, and why.
fn keep_alive_gets(
    port: u16,
    host: &str,
    count: usize,
    seen: &mut std::collections::BTreeMap<String, usize>,
) -> Result<usize, (usize, String)> {
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    let io = |done: usize| move |e: std::io::Error| (done, format!("request {done}: {e}"));
    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(io(0))?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(io(0))?;
    stream.set_nodelay(true).map_err(io(0))?;
    let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
    let mut writer = stream.try_clone().map_err(io(0))?;
    let mut reader = BufReader::new(stream);
    for i in 0..count {
        writer.write_all(request.as_bytes()).map_err(io(i))?;
        let mut status = String::new();
        reader.read_line(&mut status).map_err(io(i))?;
        let mut length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).map_err(io(i))?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().map_err(|_| (i, format!("request {i}: bad length {value}")))?;
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).map_err(io(i))?;
        let body = String::from_utf8_lossy(&body).into_owned();
        if !status.starts_with("HTTP/1.1 200") {
            return Err((i, format!("request {i}: {} {body}", status.trim_end())));
        }
        *seen.entry(body).or_default() += 1;
    }
    Ok(count)
}

/// A tally of what [`hammer`] saw.
type Tally = (std::collections::BTreeMap<String, usize>, Vec<String>);

/// `count` clients [`hammer`]ing `host` at the router on `port`, each on a
/// thread of its own, until the flag is set (see [`stop_clients`]).
fn start_clients(
    port: u16,
    host: &'static str,
    count: usize,
) -> (std::sync::Arc<std::sync::atomic::AtomicBool>, Vec<std::thread::JoinHandle<Tally>>) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients = (0..count)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || hammer(port, host, None, &stop))
        })
        .collect();
    (stop, clients)
}

/// Stops the clients `hammer`ing and adds up what they saw.
fn stop_clients(stop: &std::sync::atomic::AtomicBool, clients: Vec<std::thread::JoinHandle<Tally>>) -> Tally {
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut seen = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    for client in clients {
        let (tally, failed) = client.join().unwrap();
        for (body, count) in tally {
            *seen.entry(body).or_insert(0) += count;
        }
        failures.extend(failed);
    }
    (seen, failures)
}

/// What the dev node's agent says it runs (`Agent/ListInstances`, called
/// with the real grpcurl as the dev admin).
fn agent_instances(mesh: &Mesh) -> Vec<Value> {
    let grpcurl = std::env::var_os("BERTH_GRPCURL").map_or_else(|| PathBuf::from("grpcurl"), PathBuf::from);
    let file = |name: &str| mesh.dev.dir.join(name).display().to_string();
    let output = Command::new(grpcurl)
        .args(["-cacert", &file("ca.pem"), "-cert", &file("admin.pem"), "-key", &file("admin-key.pem")])
        .arg(format!("127.0.0.1:{}", mesh.base + 4))
        .arg("berth.agent.v1.Agent/ListInstances")
        .output()
        .expect("grpcurl runs (make test installs it; or set BERTH_GRPCURL)");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let listed: Value = serde_json::from_slice(&output.stdout).unwrap();
    listed["instances"].as_array().cloned().unwrap_or_default()
}

/// What one `h2load` run counted, and what it printed.
#[derive(Debug)]
struct H2loadRun {
    succeeded: u64,
    failed: u64,
    errored: u64,
    /// Answers with a status other than 2xx.
    not_2xx: u64,
    text: String,
}

/// One second of `h2load` over HTTP/2 with prior knowledge to the router on
/// `port`, for `host`, two connections with two streams each.
fn h2load_run(port: u16, host: &str) -> H2loadRun {
    let output = Command::new(H2LOAD)
        .args(["-c", "2", "-m", "2", "-D", "1", "-H"])
        .arg(format!(":authority: {host}"))
        .arg(format!("http://127.0.0.1:{port}/"))
        .output()
        .expect("h2load runs (make test installs it)");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    // "requests: 10 total, 10 started, 10 done, 9 succeeded, 1 failed, 0 errored, 0 timeout"
    // "status codes: 9 2xx, 0 3xx, 0 4xx, 1 5xx"
    let count = |line: &str, what: &str| {
        text.lines()
            .find(|l| l.starts_with(line))
            .and_then(|l| {
                l.split(',').find_map(|part| part.trim().strip_suffix(what)?.trim().rsplit(' ').next()?.parse().ok())
            })
            .unwrap_or(u64::MAX)
    };
    let not_2xx = ["3xx", "4xx", "5xx"].iter().map(|kind| count("status codes:", kind)).fold(0u64, u64::saturating_add);
    H2loadRun {
        succeeded: count("requests:", "succeeded"),
        failed: count("requests:", "failed"),
        errored: count("requests:", "errored"),
        not_2xx,
        text,
    }
}

/// A `berth dev` whose node is up, with the example pushed to a layout.
struct Mesh {
    /// The example bundle's reference.
    reference: String,
    dev: DevProcess,
    /// Identity's port; the router's HTTP is five above, its HTTPS six.
    base: u16,
    /// Dropped last (fields drop in order): `berth dev` stops its node's
    /// replicas through the runtime state under it, and a directory gone
    /// first would leave them running.
    tmp: tempfile::TempDir,
}

impl Mesh {
    fn start() -> Mesh {
        Mesh::start_with(&[])
    }

    /// Like [`Mesh::start`], with `extra` flags for `berth dev`.
    fn start_with(extra: &[&str]) -> Mesh {
        let tmp = tempfile::tempdir().unwrap();
        let reference = format!("oci:{}:hello", tmp.path().join("oci").display());
        let push = run(berth_command(&["bundle", "push", example().to_str().unwrap(), &reference]), COMMAND_DEADLINE);
        assert_eq!(push.code, Some(0), "{push:?}");
        let dev = DevProcess::start_with(&tmp.path().join("data"), extra);
        let base = dev.server.rsplit(':').next().unwrap().parse().unwrap();
        dev.node_up(COMMAND_DEADLINE, COMMAND_DEADLINE, |_| Some(()));
        Mesh { tmp, reference, dev, base }
    }

    /// `berth ARGS` as the dev admin, which must succeed; its output.
    fn berth(&self, args: &[&str]) -> String {
        run(self.dev.admin_command(args), COMMAND_DEADLINE).succeeded(args)
    }

    /// `hello` applied twice, two replicas each: `hello-00001`, then
    /// `hello-00002`, which is live once this returns.
    fn two_revisions(&self) {
        let spec = self.tmp.path().join("hello.json");
        let spec_arg = spec.to_str().unwrap();
        write_template_with(&spec, &self.reference, 2, "1");
        self.berth(&["service", "apply", "-f", spec_arg, "--name", "hello", "--wait"]);
        write_template_with(&spec, &self.reference, 2, "2");
        let applied = self.berth(&["service", "apply", "-f", spec_arg, "--name", "hello", "--wait"]);
        assert!(applied.contains("hello-00002 is live"), "{applied}");
    }

    /// Waits until no replica of `revision` of `service` runs.
    fn until_none_running(&self, service: &str, revision: &str) {
        poll(COMMAND_DEADLINE, &format!("no replica of {revision} to run"), || {
            let open = self.running(service, revision);
            if open.is_empty() { Ok(()) } else { Err(format!("{open:?}")) }
        });
    }

    /// The leases of `service`'s replicas of `revision` that `berth service
    /// get` shows running.
    fn running(&self, service: &str, revision: &str) -> Vec<String> {
        let shown = parse_json(&["service", "get"], &self.berth(&["service", "get", service, "-o", "json"]));
        shown["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["revision"] == revision && r["phase"] == "LEASE_PHASE_RUNNING")
            .filter_map(|r| r["leaseId"].as_str().map(str::to_owned))
            .collect()
    }
}

#[test]
fn the_router_serves_http1_and_http2_in_clear_and_tls_answers_at_once_and_passes_over_a_killed_replica() {
    if !berth_testkit::needs(Path::new(CURL).exists(), CURL) {
        return;
    }
    let mesh = Mesh::start();
    let (tmp, reference, dev, base) = (&mesh.tmp, mesh.reference.as_str(), &mesh.dev, mesh.base);
    let router = base + 5;
    let berth = |args: &[&str]| mesh.berth(args);

    // Before anything is deployed, a name is answered 404 at once, saying
    // what it was read as.
    let unknown = curl(router, "hello.default.berth.localhost", &[]).unwrap();
    assert!(unknown.status.starts_with("HTTP/1.1 404"), "{unknown:?}");
    assert!(unknown.body.contains("looked for service hello in project default"), "{unknown:?}");
    let elsewhere = curl(router, "example.com", &[]).unwrap();
    assert!(elsewhere.status.starts_with("HTTP/1.1 404"), "{elsewhere:?}");
    assert!(elsewhere.body.contains("a name under berth.localhost"), "{elsewhere:?}");

    let spec = tmp.path().join("hello.json");
    write_template(&spec, reference, 2);
    berth(&["service", "apply", "-f", spec.to_str().unwrap(), "--name", "hello", "--wait"]);
    let host = "hello.default.berth.localhost";
    let greeting = "hello from hello-00001\n";
    let answer = poll(ROUTE_DEADLINE, "the router answers over HTTP/1.1", || match curl(router, host, &[]) {
        Ok(answer) if answer.status.starts_with("HTTP/1.1 200") && answer.body == greeting => Ok(answer),
        other => Err(format!("{other:?}")),
    });
    assert_eq!(answer.body, greeting);
    let h2c = curl(router, host, &["--http2-prior-knowledge"]).unwrap();
    assert!(h2c.status.starts_with("HTTP/2 200"), "{h2c:?}");
    assert_eq!(h2c.body, greeting, "{h2c:?}");

    // Over TLS, with the dev CA's certificate for the default project's
    // names: HTTP/2 by ALPN, or HTTP/1.1 when the client offers only that.
    let https = format!("https://{host}:{}/", base + 6);
    let resolve = format!("{host}:{}:127.0.0.1", base + 6);
    let ca = dev.dir.join("ca.pem");
    let tls = ["--cacert", ca.to_str().unwrap(), "--resolve", resolve.as_str()];
    let h2 = curl_url(&https, &tls).unwrap();
    assert!(h2.status.starts_with("HTTP/2 200"), "{h2:?}");
    assert_eq!(h2.body, greeting, "{h2:?}");
    let h1 = curl_url(&https, &[&tls[..], &["--http1.1"]].concat()).unwrap();
    assert!(h1.status.starts_with("HTTP/1.1 200"), "{h1:?}");
    assert_eq!(h1.body, greeting, "{h1:?}");

    // A service whose revision has no replica is unavailable at once, and
    // says when to try again.
    let spec_none = tmp.path().join("none.json");
    write_template(&spec_none, reference, 0);
    berth(&["service", "apply", "-f", spec_none.to_str().unwrap(), "--name", "none"]);
    let none = poll(ROUTE_DEADLINE, "the router knows the service with no replica", || {
        match curl(router, "none.default.berth.localhost", &[]) {
            Ok(answer) if answer.status.starts_with("HTTP/1.1 503") => Ok(answer),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(none.header("retry-after"), Some("1"), "{none:?}");
    assert!(none.body.contains("service none in project default has no replica"), "{none:?}");

    // One replica killed: every request still gets an answer, from the other
    // (a refused connection is tried once more elsewhere), while the killed
    // one is replaced.
    let shown = parse_json(&["service", "get"], &berth(&["service", "get", "hello", "-o", "json"]));
    let running: Vec<String> = shown["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["phase"] == "LEASE_PHASE_RUNNING")
        .map(|r| r["leaseId"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(running.len(), 2, "{shown}");
    // The node's agent knows each replica's process.
    let instances = agent_instances(&mesh);
    let pids: Vec<i32> = running
        .iter()
        .map(|lease| {
            let instance = instances.iter().find(|i| i["leaseId"] == lease.as_str()).unwrap();
            i32::try_from(instance["pid"].as_u64().unwrap()).unwrap()
        })
        .collect();
    let victim = rustix::process::Pid::from_raw(pids[0]).unwrap();
    rustix::process::kill_process(victim, rustix::process::Signal::KILL).unwrap();
    // Once it has exited its port refuses (while it is dying, a connection
    // may still land in its backlog and be reset: a request in flight on
    // it, which is not retried).
    poll(ROUTE_DEADLINE, "the killed replica to have exited", || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", pids[0])).unwrap_or_default();
        let state = status.lines().find(|l| l.starts_with("State:")).unwrap_or("gone").to_string();
        if status.is_empty() || state.contains('Z') { Ok(()) } else { Err(state) }
    });
    for attempt in 0..40 {
        let answer = curl(router, host, &[]).unwrap();
        assert!(answer.status.starts_with("HTTP/1.1 200"), "request {attempt} after the kill: {answer:?}");
        assert_eq!(answer.body, greeting, "request {attempt} after the kill");
    }

    // A revoked node's replicas get no more requests: the service has no
    // replica left to send to, and says so at once.
    let node = dev.node_up(COMMAND_DEADLINE, COMMAND_DEADLINE, |n| n["nodeId"].as_str().map(str::to_string));
    berth(&["node", "revoke", &node]);
    let revoked = poll(Duration::from_secs(10), "the router stops sending to the revoked node", || {
        match curl(router, host, &[]) {
            Ok(answer) if answer.status.starts_with("HTTP/1.1 503") => Ok(answer),
            other => Err(format!("{other:?}")),
        }
    });
    assert!(revoked.body.contains("has no replica ready"), "{revoked:?}");
}

#[test]
fn a_90_10_split_sends_a_tenth_of_the_requests_to_the_new_revision_and_its_tag_reaches_it_alone() {
    let mesh = Mesh::start();
    let (dev, router) = (&mesh.dev, mesh.base + 5);
    let berth = |args: &[&str]| mesh.berth(args);
    mesh.two_revisions();

    let split =
        berth(&["service", "traffic", "hello", "--to", "hello-00001=90,hello-00002=10", "--tag", "canary=hello-00002"]);
    assert!(split.contains("traffic split hello-00001 90%, hello-00002 10% as canary"), "{split}");
    // Both revisions run again: the old one's replicas come back.
    poll(COMMAND_DEADLINE, "two replicas of each revision run", || {
        let running = [mesh.running("hello", "hello-00001"), mesh.running("hello", "hello-00002")];
        if running.iter().all(|leases| leases.len() == 2) { Ok(()) } else { Err(format!("{running:?}")) }
    });
    let shown = berth(&["service", "get", "hello"]);
    let traffic = shown.lines().find(|l| l.trim_start().starts_with("Traffic:")).unwrap_or_default();
    assert!(traffic.ends_with("hello-00001 90%, hello-00002 10% as canary"), "{shown}");
    let host = "hello.default.berth.localhost";
    poll(ROUTE_DEADLINE, "the router splits hello", || {
        let seen = tally(router, host, 50);
        if seen.len() == 2 { Ok(()) } else { Err(format!("{seen:?}")) }
    });

    let requests = 10_000;
    let seen = tally(router, host, requests);
    let new = seen.get("hello from hello-00002\n").copied().unwrap_or(0);
    let old = seen.get("hello from hello-00001\n").copied().unwrap_or(0);
    assert_eq!(new + old, requests, "every answer is one of the two revisions': {seen:?}");
    let share = new * 100 / requests;
    assert!((7..=13).contains(&share), "the new revision got {new} of {requests} requests: {seen:?}");

    // The tag reaches its revision alone.
    let tagged = tally(router, "canary--hello.default.berth.localhost", 20);
    assert_eq!(tagged.keys().collect::<Vec<_>>(), ["hello from hello-00002\n"], "{tagged:?}");

    // A split that does not add up is refused, naming why, and nothing changes.
    let refused = run(dev.admin_command(&["service", "traffic", "hello", "--to", "hello-00001=50"]), COMMAND_DEADLINE);
    assert_ne!(refused.code, Some(0));
    assert!(refused.error_line().contains("the percents sum to 50, not 100"), "{refused:?}");
    let bad_flag = run(dev.admin_command(&["service", "traffic", "hello", "--to", "hello-00001"]), COMMAND_DEADLINE);
    assert!(bad_flag.stderr.contains("is not REVISION=PERCENT"), "{bad_flag:?}");

    // Sticky by a header: each user keeps to one revision, and the users
    // still spread over both.
    let sticky =
        berth(&["service", "traffic", "hello", "--to", "hello-00001=90,hello-00002=10", "--sticky-header", "X-User"]);
    assert!(sticky.contains("each client keeps to one replica by header x-user"), "{sticky}");
    let shown = berth(&["service", "get", "hello"]);
    assert!(shown.lines().any(|l| l.trim_start().starts_with("Sticky:") && l.ends_with("by header x-user")), "{shown}");
    let generation = |shown: &str| -> u64 {
        let routes = shown.lines().find(|l| l.trim_start().starts_with("Routes:")).unwrap_or_default();
        routes.split_whitespace().nth(2).and_then(|g| g.trim_end_matches(';').parse().ok()).unwrap_or(0)
    };
    let wanted = generation(&shown);
    poll(ROUTE_DEADLINE, "the router serves the sticky routes", || {
        let shown = berth(&["service", "get", "hello"]);
        if shown.contains(&format!("generation {wanted}; 1 of 1 routers serve it")) { Ok(()) } else { Err(shown) }
    });
    let get = |flags: &[&str]| {
        let answer = curl(router, host, flags).unwrap();
        assert!(answer.status.starts_with("HTTP/1.1 200"), "{answer:?}");
        answer
    };
    let mut revisions_seen = std::collections::BTreeSet::new();
    for user in 0..40 {
        let header = format!("x-user: user-{user}");
        let first = get(&["-H", &header]).body;
        for _ in 0..2 {
            assert_eq!(get(&["-H", &header]).body, first, "user-{user} moved");
        }
        revisions_seen.insert(first);
    }
    assert_eq!(revisions_seen.len(), 2, "40 users all on one revision: {revisions_seen:?}");

    // Sticky by a cookie: a client without one is given one, and keeps to
    // its revision while it sends it back.
    berth(&[
        "service",
        "traffic",
        "hello",
        "--to",
        "hello-00001=50,hello-00002=50",
        "--sticky-cookie",
        "berth-session",
    ]);
    poll(ROUTE_DEADLINE, "the router gives the session cookie", || {
        let answer = get(&[]);
        answer.header("set-cookie").map(str::to_string).ok_or_else(|| format!("{answer:?}"))
    });
    for _ in 0..5 {
        let answer = get(&[]);
        let cookie = answer.header("set-cookie").unwrap_or_else(|| panic!("no cookie: {answer:?}"));
        assert!(
            cookie.starts_with("berth-session=") && cookie.ends_with("; Path=/; HttpOnly; SameSite=Lax"),
            "{cookie}"
        );
        let session = cookie.split(';').next().unwrap().to_string();
        for _ in 0..3 {
            let again = get(&["-b", &session]);
            assert_eq!(again.body, answer.body, "{session} moved");
            assert_eq!(again.header("set-cookie"), None, "a client with its cookie is given none");
        }
    }
}

#[test]
#[allow(clippy::disallowed_methods, reason = "a plain test: no runtime's worker to block")]
fn a_rollout_under_constant_load_answers_every_request_and_moves_to_the_new_revision() {
    let mesh = Mesh::start();
    let (tmp, reference, router) = (&mesh.tmp, mesh.reference.as_str(), mesh.base + 5);
    let berth = |args: &[&str]| mesh.berth(args);
    let spec = tmp.path().join("hello.json");
    let spec_arg = spec.to_str().unwrap();
    write_template_with(&spec, reference, 2, "1");
    berth(&["service", "apply", "-f", spec_arg, "--name", "hello", "--wait"]);
    let host = "hello.default.berth.localhost";
    poll(ROUTE_DEADLINE, "the router serves hello", || {
        curl(router, host, &[])
            .and_then(|a| if a.status.starts_with("HTTP/1.1 200") { Ok(()) } else { Err(format!("{a:?}")) })
    });

    // Two clients keep asking while a new revision rolls out, goes live,
    // and the old one drains and stops.
    let (stop, clients) = start_clients(router, host, 2);
    // And h2load, over HTTP/2, in runs of a second until the rollout is over.
    let h2load_stop = stop.clone();
    let h2load = std::thread::spawn(move || {
        let mut runs = Vec::new();
        while !h2load_stop.load(std::sync::atomic::Ordering::SeqCst) {
            runs.push(h2load_run(router, host));
        }
        runs
    });
    std::thread::sleep(Duration::from_millis(500));
    write_template_with(&spec, reference, 2, "2");
    let applied = berth(&["service", "apply", "-f", spec_arg, "--name", "hello", "--wait"]);
    assert!(applied.contains("hello-00002 is live"), "{applied}");
    mesh.until_none_running("hello", "hello-00001");
    // The router acknowledged the generation that dropped the old revision.
    let shown = parse_json(&["service", "get"], &berth(&["service", "get", "hello", "-o", "json"]));
    let status = &shown["service"]["status"];
    let generation = status["routeGeneration"].as_str().and_then(|g| g.parse::<u64>().ok()).unwrap_or_default();
    assert!(generation >= 2, "{status}");
    let routers = status["routers"].as_array().cloned().unwrap_or_default();
    assert_eq!(routers.len(), 1, "berth dev runs one router: {status}");
    assert_eq!(routers[0]["generation"].as_str(), Some(generation.to_string().as_str()), "{status}");
    let described = berth(&["service", "get", "hello"]);
    assert!(described.contains(&format!("generation {generation}; 1 of 1 routers serve it")), "{described}");
    std::thread::sleep(Duration::from_millis(500));
    let (seen, failures) = stop_clients(&stop, clients);
    assert!(
        failures.is_empty(),
        "{} requests failed during the rollout: {failures:?}; answered: {seen:?}",
        failures.len()
    );
    let runs = h2load.join().unwrap();
    let answered: u64 = runs.iter().map(|run| run.succeeded).sum();
    assert!(answered > 0, "h2load got answers: {runs:?}");
    for run in &runs {
        assert_eq!((run.failed, run.errored, run.not_2xx), (0, 0, 0), "h2load saw failures: {}", run.text);
    }
    assert!(seen.get("hello from hello-00001\n").is_some_and(|n| *n > 0), "{seen:?}");
    assert!(seen.get("hello from hello-00002\n").is_some_and(|n| *n > 0), "{seen:?}");
    assert_eq!(seen.len(), 2, "{seen:?}");
}

/// The bodies `count` requests to `host` answered, each with 200; any
/// other answer fails the test.
fn bodies(port: u16, host: &str, count: usize) -> Vec<String> {
    tally(port, host, count).into_keys().collect()
}

#[test]
#[allow(clippy::disallowed_methods, reason = "a plain test: no runtime's worker to block")]
fn a_pin_a_split_and_an_unpin_under_constant_load_fail_no_request_and_a_killed_replica_fails_at_most_its_own() {
    const CLIENTS: usize = 3;
    let mesh = Mesh::start();
    let router = mesh.base + 5;
    let berth = |args: &[&str]| mesh.berth(args);
    mesh.two_revisions();
    let host = "hello.default.berth.localhost";
    let (old, new) = ("hello from hello-00001\n", "hello from hello-00002\n");
    poll(ROUTE_DEADLINE, "the router serves hello-00002 alone", || {
        let (seen, failures) = hammer(router, host, Some(20), &std::sync::atomic::AtomicBool::new(false));
        if failures.is_empty() && seen.keys().eq([new]) { Ok(()) } else { Err(format!("{seen:?} {failures:?}")) }
    });

    mesh.until_none_running("hello", "hello-00001");

    // Clients keep asking while the service is pinned to its old revision
    // (whose replicas were stopped: the traffic moves once they run again),
    // split 90/10, and unpinned back to the latest.
    let (stop, clients) = start_clients(router, host, CLIENTS);
    std::thread::sleep(Duration::from_millis(300));
    let pinned = berth(&["service", "pin", "hello", "hello-00001"]);
    assert!(pinned.contains("traffic pinned to hello-00001"), "{pinned}");
    poll(COMMAND_DEADLINE, "every answer comes from the pinned revision", || {
        let seen = bodies(router, host, 20);
        if seen == [old] { Ok(()) } else { Err(format!("{seen:?}")) }
    });
    let split = berth(&["service", "traffic", "hello", "--to", "hello-00001=90,hello-00002=10"]);
    assert!(split.contains("traffic split hello-00001 90%, hello-00002 10%"), "{split}");
    poll(COMMAND_DEADLINE, "answers come from both revisions", || {
        let seen = bodies(router, host, 100);
        if seen.len() == 2 { Ok(()) } else { Err(format!("{seen:?}")) }
    });
    let unpinned = berth(&["service", "unpin", "hello"]);
    assert!(unpinned.contains("traffic follows the latest ready revision"), "{unpinned}");
    poll(COMMAND_DEADLINE, "every answer comes from the latest revision again", || {
        let seen = bodies(router, host, 20);
        if seen == [new] { Ok(()) } else { Err(format!("{seen:?}")) }
    });
    mesh.until_none_running("hello", "hello-00001");
    std::thread::sleep(Duration::from_millis(300));
    let (seen, failures) = stop_clients(&stop, clients);
    assert!(failures.is_empty(), "{} requests failed across the pin, split and unpin: {failures:?}", failures.len());
    assert!(seen.get(old).is_some_and(|n| *n > 0) && seen.get(new).is_some_and(|n| *n > 0), "{seen:?}");
    assert_eq!(seen.len(), 2, "{seen:?}");

    // One replica killed with SIGKILL under the same load: at most the
    // requests in flight on it fail (one per client), and the rest are
    // answered by the other while it is replaced.
    let running = mesh.running("hello", "hello-00002");
    assert_eq!(running.len(), 2, "{running:?}");
    let instances = agent_instances(&mesh);
    let victim = instances.iter().find(|i| i["leaseId"] == running[0].as_str()).unwrap();
    let pid = i32::try_from(victim["pid"].as_u64().unwrap()).unwrap();
    let (stop, clients) = start_clients(router, host, CLIENTS);
    std::thread::sleep(Duration::from_millis(500));
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid).unwrap(), rustix::process::Signal::KILL).unwrap();
    poll(COMMAND_DEADLINE, "the killed replica is replaced", || {
        let now = mesh.running("hello", "hello-00002");
        if now.iter().any(|lease| !running.contains(lease)) { Ok(()) } else { Err(format!("{now:?}")) }
    });
    std::thread::sleep(Duration::from_millis(500));
    let (seen, failures) = stop_clients(&stop, clients);
    assert!(
        failures.len() <= CLIENTS,
        "{} requests failed, more than the {CLIENTS} that may have been in flight on the killed replica: {failures:?}",
        failures.len()
    );
    // A request the killed replica had not begun to answer is a 502; one
    // whose head it had written (and the router passed on) before its body
    // ends short, as the replica's own connection would have.
    assert!(
        failures
            .iter()
            .all(|f| f.contains("502 Bad Gateway the replica did not answer")
                || f.contains("failed to fill whole buffer")),
        "{failures:?}"
    );
    assert!(seen.get(new).is_some_and(|n| *n > 100), "the other replica kept answering: {seen:?}");
}

/// A second node for `berth dev`: the real agent binary, joined with a
/// token, its workloads contained as the dev node's are. Stopped, and what
/// it ran destroyed, on drop.
struct SecondNode {
    child: std::process::Child,
    dir: tempfile::TempDir,
}

impl SecondNode {
    fn join(mesh: &Mesh) -> SecondNode {
        let created = parse_json(&["token", "create"], &mesh.berth(&["token", "create", "-o", "json"]));
        let token = created["token"].as_str().unwrap().to_owned();
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let agent = berth_testkit::sibling(env!("CARGO_BIN_EXE_berth"), "berth-agent", "berth-agent");
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = Command::new(agent)
            .args(["--server", &mesh.dev.server])
            .args(["--leases-addr", &format!("127.0.0.1:{}", mesh.base + 2)])
            .args(["--revisions-addr", &format!("127.0.0.1:{}", mesh.base + 1)])
            .arg("--ca-file")
            .arg(mesh.dev.dir.join("ca.pem"))
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--advertise-addr", &format!("127.0.0.1:{port}"), "--listen", &format!("127.0.0.1:{port}")])
            .args(["--name", "second", "--cpu-millis", "4000", "--memory-bytes", "4294967296"])
            .args(["--stop-grace", "2s", "--sweep-interval", "2s"])
            .env("BERTH_JOIN_TOKEN", token)
            .env_remove("BERTH_SERVER")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        SecondNode { child, dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }
}

impl Drop for SecondNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        berth_agent::destroy_containers(&self.dir.path().join("data"));
    }
}

/// The nodes `berth node list` shows UP, by name, with their ids.
fn up_nodes(mesh: &Mesh) -> std::collections::BTreeMap<String, String> {
    let listed = parse_json(&["node", "list"], &mesh.berth(&["node", "list", "-o", "json"]));
    listed["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["state"] == "NODE_STATE_UP")
        .map(|n| {
            (n["name"].as_str().unwrap_or_default().to_owned(), n["nodeId"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

#[test]
#[allow(clippy::disallowed_methods, reason = "a plain test: no runtime's worker to block")]
fn a_node_drained_under_constant_load_hands_its_replicas_over_with_no_request_failed() {
    let mesh = Mesh::start();
    let (tmp, reference, router) = (&mesh.tmp, mesh.reference.as_str(), mesh.base + 5);
    let spec = tmp.path().join("hello.json");
    let spec_arg = spec.to_str().unwrap();
    write_template_with(&spec, reference, 2, "1");
    // The dev node is the only one: both replicas run there.
    mesh.berth(&["service", "apply", "-f", spec_arg, "--name", "hello", "--wait"]);
    let host = "hello.default.berth.localhost";
    poll(ROUTE_DEADLINE, "the router serves hello", || {
        curl(router, host, &[])
            .and_then(|a| if a.status.starts_with("HTTP/1.1 200") { Ok(()) } else { Err(format!("{a:?}")) })
    });
    let dev_node = up_nodes(&mesh).get("dev").cloned().unwrap();
    let second = SecondNode::join(&mesh);
    let second_node = poll(COMMAND_DEADLINE, "the second node is UP", || {
        up_nodes(&mesh).get("second").cloned().ok_or_else(|| second.log())
    });

    let (stop, clients) = start_clients(router, host, 2);
    std::thread::sleep(Duration::from_millis(500));
    // Drained with a deadline: the replicas are replaced on the second node
    // first, then given back; --wait returns once the node is empty.
    let drained =
        run(mesh.dev.admin_command(&["node", "drain", &dev_node, "--deadline", "2m", "--wait"]), COMMAND_DEADLINE);
    assert_eq!(drained.code, Some(0), "{drained:?}\n{}", second.log());
    std::thread::sleep(Duration::from_millis(500));
    let (seen, failures) = stop_clients(&stop, clients);
    assert!(
        failures.is_empty(),
        "{} requests failed during the drain: {failures:?}; answered: {seen:?}",
        failures.len()
    );
    assert!(seen.get("hello from hello-00001\n").is_some_and(|n| *n > 0), "{seen:?}");

    let shown = parse_json(&["service", "get"], &mesh.berth(&["service", "get", "hello", "-o", "json"]));
    let running: Vec<&Value> =
        shown["replicas"].as_array().into_iter().flatten().filter(|r| r["phase"] == "LEASE_PHASE_RUNNING").collect();
    assert_eq!(running.len(), 2, "{shown}");
    assert!(running.iter().all(|r| r["nodeId"] == second_node.as_str()), "the replicas moved: {shown}");
    // Given back before the second node goes, so it stops nothing mid-test.
    mesh.berth(&["service", "delete", "hello"]);
    poll(COMMAND_DEADLINE, "the second node's replicas are stopped", || {
        let listed =
            parse_json(&["lease", "list"], &mesh.berth(&["lease", "list", "--node", &second_node, "-o", "json"]));
        let open =
            listed["leases"].as_array().into_iter().flatten().filter(|l| l["phase"] == "LEASE_PHASE_RUNNING").count();
        if open == 0 { Ok(()) } else { Err(listed.to_string()) }
    });
}

/// A gRPC workload on the system's python3 and its `grpcio`: answers
/// `grpc.health.v1.Health/Check` with SERVING, knowing no other method.
const GRPC_SERVER: &str = r#"#!/usr/bin/python3
"""A gRPC workload for the router tests: grpc.health.v1.Health/Check on $PORT."""
import os
import signal
from concurrent import futures

import grpc


def check(request, context):
    # HealthCheckResponse{status: SERVING}, encoded by hand.
    return b"\x08\x01"


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    same = lambda message: message
    methods = {"Check": grpc.unary_unary_rpc_method_handler(check, request_deserializer=same, response_serializer=same)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grpc.health.v1.Health", methods),))
    server.add_insecure_port("0.0.0.0:" + os.environ.get("PORT", "8080"))
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: server.stop(1))
    server.wait_for_termination()


main()
"#;

/// The health service's schema, as grpcurl is given it.
const HEALTH_PROTO: &str = r#"syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc Unknown(HealthCheckRequest) returns (HealthCheckResponse);
}
"#;

#[test]
fn grpcurl_reaches_a_grpc_workload_through_the_router_in_cleartext_and_tls() {
    let grpcurl = std::env::var_os("BERTH_GRPCURL").map_or_else(|| PathBuf::from("grpcurl"), PathBuf::from);
    let python_grpc = Command::new("/usr/bin/python3").args(["-c", "import grpc"]).status().is_ok_and(|s| s.success());
    if !berth_testkit::needs(python_grpc, "the grpc module of /usr/bin/python3 (python3-grpcio)") {
        return;
    }
    let mesh = Mesh::start();
    let tmp = mesh.tmp.path();
    // The port is named grpc: the router speaks HTTP/2 to it.
    deploy_program(&mesh, "greeter", GRPC_SERVER, "grpc");
    let schema = tmp.join("health.proto");
    std::fs::write(&schema, HEALTH_PROTO).unwrap();

    let host = "greeter.default.berth.localhost";
    let call = |extra: &[&str], port: u16| {
        let output = Command::new(&grpcurl)
            .args(["-import-path", tmp.to_str().unwrap(), "-proto", "health.proto", "-authority", host])
            .args(extra)
            .arg(format!("127.0.0.1:{port}"))
            .arg("grpc.health.v1.Health/Check")
            .output()
            .expect("grpcurl runs (make test installs it; or set BERTH_GRPCURL)");
        let said = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        if output.status.success() && said.contains("\"SERVING\"") { Ok(said) } else { Err(said) }
    };
    poll(ROUTE_DEADLINE, "grpcurl through the router in cleartext (h2c)", || call(&["-plaintext"], mesh.base + 5));
    let ca = mesh.dev.dir.join("ca.pem");
    let tls = ["-cacert", ca.to_str().unwrap(), "-servername", host];
    poll(ROUTE_DEADLINE, "grpcurl through the router over TLS", || call(&tls, mesh.base + 6));

    // A method the workload does not know is its own answer, passed back
    // as it came: UNIMPLEMENTED from the workload, not a router error.
    let output = Command::new(&grpcurl)
        .args(["-plaintext", "-authority", host, "-import-path", tmp.to_str().unwrap(), "-proto", "health.proto"])
        .arg(format!("127.0.0.1:{}", mesh.base + 5))
        .arg("grpc.health.v1.Health/Unknown")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{said}");
    assert!(said.contains("Code: Unimplemented"), "the workload's own status: {said}");
}

/// An HTTP/1.1 workload that switches to an echo protocol (each chunk sent
/// back upper-cased) when asked with `Upgrade: echo`.
const UPGRADE_SERVER: &str = r#"#!/usr/bin/python3
"""Switches to an upper-casing echo on `Upgrade: echo` (or `h2c`, which it only
pretends to speak); answers 200 otherwise, naming any upgrade it was asked for."""
import http.server
import os


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        asked = self.headers.get("Upgrade", "").lower()
        if asked not in ("echo", "h2c"):
            body = (f"plain, asked to upgrade to {asked}\n" if asked else "plain\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(101)
        self.send_header("Upgrade", asked)
        self.send_header("Connection", "Upgrade")
        self.end_headers()
        self.wfile.flush()
        while True:
            data = self.connection.recv(4096)
            if not data:
                break
            self.connection.sendall(data.upper())
        self.close_connection = True

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("PORT", "8080"))), Handler).serve_forever()
"#;

/// Pushes a bundle of one `server.py` holding `program`, applies it as a
/// one-replica service `name` whose port is named `port_name`, and waits
/// for it to run.
fn deploy_program(mesh: &Mesh, name: &str, program: &str, port_name: &str) {
    let tmp = mesh.tmp.path();
    let bundle = tmp.join(format!("{name}-bundle"));
    std::fs::create_dir_all(&bundle).unwrap();
    let server = bundle.join("server.py");
    std::fs::write(&server, program).unwrap();
    std::fs::set_permissions(&server, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(bundle.join("berth.toml"), "entrypoint = \"server.py\"\n").unwrap();
    let reference = format!("oci:{}:{name}", tmp.join("oci").display());
    mesh.berth(&["bundle", "push", bundle.to_str().unwrap(), &reference]);
    let spec = tmp.join(format!("{name}.json"));
    let template = serde_json::json!({
        "bundle": {"reference": reference},
        "replicas": 1,
        "ports": [{"name": port_name, "port": 8080}],
        "resources": {"cpu_millis": 200, "memory_bytes": 134_217_728},
    });
    std::fs::write(&spec, template.to_string()).unwrap();
    mesh.berth(&["service", "apply", "-f", spec.to_str().unwrap(), "--name", name, "--wait"]);
}

#[test]
fn a_connection_that_switches_protocols_is_joined_to_the_replica_byte_for_byte() {
    use std::io::{Read as _, Write as _};
    let mesh = Mesh::start();
    deploy_program(&mesh, "upgrader", UPGRADE_SERVER, "http");
    let host = "upgrader.default.berth.localhost";
    let router = mesh.base + 5;
    poll(ROUTE_DEADLINE, "the router serves upgrader", || {
        curl(router, host, &[]).and_then(|a| if a.body == "plain\n" { Ok(()) } else { Err(format!("{a:?}")) })
    });

    let mut stream = std::net::TcpStream::connect(("127.0.0.1", router)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let ask = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n");
    stream.write_all(ask.as_bytes()).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(stream.read(&mut byte).unwrap(), 1, "the router closed before answering: {head:?}");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(head.to_ascii_lowercase().contains("upgrade: echo"), "{head}");
    for word in ["ping", "and a longer line"] {
        stream.write_all(word.as_bytes()).unwrap();
        let mut echoed = vec![0u8; word.len()];
        stream.read_exact(&mut echoed).unwrap();
        assert_eq!(String::from_utf8_lossy(&echoed), word.to_uppercase(), "the replica's own answer");
    }

    // `curl --http2` in cleartext asks to upgrade to h2c: joined, the
    // connection would carry requests the router never reads (and so never
    // marks with who called). It is served as the HTTP/1.1 request it also
    // is, and the replica is not asked to switch.
    let answer = curl(router, host, &["--http2"]).unwrap();
    assert!(answer.status.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert_eq!(answer.body, "plain\n", "the replica was asked to switch: {answer:?}");
}

#[test]
fn a_replica_that_does_not_begin_its_answer_in_time_is_answered_504_naming_the_limit() {
    let mesh = Mesh::start_with(&["--response-timeout", "2s"]);
    deploy_program(&mesh, "slow", PYTHON_SERVER, "http");
    let (host, router) = ("slow.default.berth.localhost", mesh.base + 5);
    poll(ROUTE_DEADLINE, "the router serves slow", || {
        curl(router, host, &[])
            .and_then(|a| if a.body == "/ from slow-00001\n" { Ok(()) } else { Err(format!("{a:?}")) })
    });
    // The replica answers `/slow` after six seconds; the router's limit is two.
    let answer = curl_url(&format!("http://127.0.0.1:{router}/slow"), &["-H", &format!("Host: {host}")]).unwrap();
    assert!(answer.status.starts_with("HTTP/1.1 504"), "{answer:?}");
    assert!(answer.body.contains("of slow-00001 did not begin its answer within 2s"), "{answer:?}");
    // Over HTTP/2 as well, and the replica still serves what it answers in time.
    let answer = curl_url(
        &format!("http://127.0.0.1:{router}/slow"),
        &["-H", &format!("Host: {host}"), "--http2-prior-knowledge"],
    )
    .unwrap();
    assert!(answer.status.starts_with("HTTP/2 504"), "{answer:?}");
    let answer = curl(router, host, &[]).unwrap();
    assert_eq!(answer.body, "/ from slow-00001\n", "{answer:?}");
}

/// Answers `GET /slow` after six seconds, `GET /caller` with the
/// `X-Forwarded-Client-Cert` it was given (or `none`), and anything else at
/// once with `<path> from <revision>`; SIGTERM ends it at once, with
/// whatever it was answering.
const PYTHON_SERVER: &str = r#"#!/usr/bin/python3
"""Answers GET /slow after six seconds, GET /caller with the X-Forwarded-Client-Cert
header the router passed (or none), anything else at once; exits on SIGTERM."""
import http.server
import os
import signal
import time

REVISION = os.environ.get("BERTH_REVISION", "berth")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/slow":
            time.sleep(6)
        if self.path == "/caller":
            body = (self.headers.get("X-Forwarded-Client-Cert", "none") + "\n").encode()
        else:
            body = f"{self.path} from {REVISION}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("PORT", "8080"))), Handler).serve_forever()
"#;

#[test]
#[allow(clippy::disallowed_methods, reason = "a plain test: no runtime's worker to block")]
fn a_request_in_flight_when_its_revision_drains_is_answered_before_its_replica_stops() {
    let mesh = Mesh::start();
    deploy_program(&mesh, "slow", PYTHON_SERVER, "http");
    let (host, router) = ("slow.default.berth.localhost", mesh.base + 5);
    poll(ROUTE_DEADLINE, "the router serves slow", || {
        curl(router, host, &[])
            .and_then(|a| if a.body == "/ from slow-00001\n" { Ok(()) } else { Err(format!("{a:?}")) })
    });

    // A request the old revision takes six seconds to answer is under way
    // while a new revision rolls out and takes the traffic.
    let url = format!("http://127.0.0.1:{router}/slow");
    let started = std::time::Instant::now();
    let in_flight = std::thread::spawn(move || curl_url(&url, &["-H", &format!("Host: {host}")]));
    std::thread::sleep(Duration::from_millis(500));
    let redeployed = mesh.berth(&["service", "redeploy", "slow", "--wait"]);
    assert!(redeployed.contains("slow-00002 is live"), "{redeployed}");
    let rolled = started.elapsed();
    assert!(
        rolled < Duration::from_secs(5),
        "the rollout took {rolled:?}, as long as the slow answer: it proves nothing"
    );
    let fresh = curl(router, host, &[]).unwrap();
    assert_eq!(fresh.body, "/ from slow-00002\n", "the new revision takes new requests: {fresh:?}");
    // The old replica is stopped only once the router no longer has anything
    // under way on it: the slow answer arrives whole, from the old revision.
    let answer = in_flight.join().unwrap().unwrap();
    assert!(answer.status.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert_eq!(answer.body, "/slow from slow-00001\n");
    mesh.until_none_running("slow", "slow-00001");
}

#[test]
fn a_workload_presenting_its_svid_to_the_router_is_named_to_the_callee_and_a_claimed_name_is_dropped() {
    if !berth_testkit::needs(Path::new(CURL).exists(), CURL) {
        return;
    }
    let mesh = Mesh::start();
    deploy_program(&mesh, "whoami", PYTHON_SERVER, "http");
    let host = "whoami.default.berth.localhost";
    let claim = "X-Forwarded-Client-Cert: URI=spiffe://berth.internal/ns/bank/lease/l-1";
    let plain = format!("http://127.0.0.1:{}/caller", mesh.base + 5);
    poll(ROUTE_DEADLINE, "the router serves whoami", || {
        curl_url(&plain, &["-H", &format!("Host: {host}"), "-H", claim])
            .and_then(|a| if a.body == "none\n" { Ok(()) } else { Err(format!("{a:?}")) })
    });

    // The replica's own SVID, as the node minted it, presented over TLS.
    let instance = agent_instances(&mesh).into_iter().find(|i| i["service"] == "whoami").unwrap();
    let lease = instance["leaseId"].as_str().unwrap();
    let svids = mesh.dev.dir.join("agent/svids").join(lease);
    let file = |name: &str| svids.join(name).display().to_string();
    let https = format!("https://{host}:{}/caller", mesh.base + 6);
    let resolve = format!("{host}:{}:127.0.0.1", mesh.base + 6);
    let ca = mesh.dev.dir.join("ca.pem").display().to_string();
    let tls = ["--cacert", ca.as_str(), "--resolve", resolve.as_str()];
    let presented = [tls.as_slice(), &["--cert", &file("svid.pem"), "--key", &file("svid-key.pem"), "-H", claim]];
    let named = curl_url(&https, &presented.concat()).unwrap();
    assert!(named.status.contains(" 200"), "{named:?}");
    let spiffe_id = format!("spiffe://berth.internal/ns/default/svc/whoami/rev/whoami-00001/lease/{lease}");
    assert!(named.body.starts_with("Hash=") && named.body.ends_with(&format!(";URI={spiffe_id}\n")), "{named:?}");

    // Without a certificate, over TLS or not, a claimed name never reaches it.
    let anonymous = curl_url(&https, &[tls.as_slice(), &["-H", claim]].concat()).unwrap();
    assert_eq!(anonymous.body, "none\n", "{anonymous:?}");
}
