//! The service CLI end to end: the real `berth` binary deploys the hello
//! example from an OCI layout, or from a real registry behind htpasswd,
//! onto a real `berth dev`, and the tests read what the commands print and
//! what the replicas answer over HTTP.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]
#![allow(clippy::disallowed_methods, reason = "these tests drive processes from plain threads, not a runtime")]

mod common;

use common::{DevProcess, Outcome, berth_command, parse_json, poll, run};

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use berth_bundle::RegistryCredentials;
use berth_bundle::test_image::{Layer, TestImage};
use berth_bundle::testing::TestRegistry;
use berth_testkit::cgroups::{memory_limit_of, processes_in_cgroup};
use serde_json::Value;

/// How long the dev node may take to join and be offered to leases.
const READY_DEADLINE: Duration = Duration::from_secs(60);

/// How long one CLI command may take before the test calls it hung; an
/// apply with `--wait` starts two replicas within it.
const COMMAND_DEADLINE: Duration = Duration::from_secs(120);

/// How long traffic may take to move after a pin or unpin.
const TRAFFIC_DEADLINE: Duration = Duration::from_secs(60);

/// How long `service apply --wait` may take for the README's hello as
/// microVMs (see its test).
const MICROVM_APPLY_DEADLINE: Duration = Duration::from_secs(180);

/// A running `berth dev` whose node is UP.
struct Dev(DevProcess);

impl Dev {
    /// Starts `berth dev` and waits until its node is UP in the ledger, so
    /// replicas can be placed on it.
    fn start(dir: &Path) -> Dev {
        Dev::start_with(dir, &[])
    }

    /// Like [`Dev::start`], with `extra` flags for `berth dev`.
    fn start_with(dir: &Path, extra: &[&str]) -> Dev {
        let process = DevProcess::start_with(dir, extra);
        process.node_up(READY_DEADLINE, COMMAND_DEADLINE, |_| Some(()));
        Dev(process)
    }

    /// Runs `berth ARGS` as the dev admin against this mesh.
    fn berth(&self, args: &[&str]) -> Outcome {
        run(self.0.admin_command(args), COMMAND_DEADLINE)
    }

    /// Like [`Dev::berth`], and the command must succeed.
    fn ok(&self, args: &[&str]) -> String {
        self.berth(args).succeeded(args)
    }

    /// Like [`Dev::ok`] with `-o json`, parsed.
    fn json(&self, args: &[&str]) -> Value {
        parse_json(args, &self.ok(&[args, &["-o", "json"]].concat()))
    }

    /// The service's live revision, as `service get -o json` shows it.
    fn live(&self, name: &str) -> String {
        self.json(&["service", "get", name])["service"]["status"]["liveRevision"].as_str().unwrap().to_string()
    }

    /// Waits until the service's live revision is `revision`.
    fn await_live(&self, name: &str, revision: &str) {
        poll(TRAFFIC_DEADLINE, &format!("{name} serves {revision}"), || {
            let live = self.live(name);
            if live == revision { Ok(()) } else { Err(live) }
        });
    }
}

/// A plain HTTP GET on loopback; the body, or None while nothing answers.
fn http_get(port: u64, path: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", u16::try_from(port).ok()?)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// A GET of `/` through the dev router for `host`; the status line and
/// the body, or None while nothing answers.
fn via_router(dev: &Dev, host: &str) -> Option<(String, String)> {
    let base: u16 = dev.0.server.rsplit(':').next()?.parse().ok()?;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", base + 5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_string(), body.to_string()))
}

/// Waits until the router answers `host` with `body`.
fn router_serves(dev: &Dev, host: &str, body: &str) {
    poll(TRAFFIC_DEADLINE, &format!("the router answers {host} with {body:?}"), || match via_router(dev, host) {
        Some((status, answer)) if status.starts_with("HTTP/1.1 200") && answer == body => Ok(()),
        other => Err(format!("{other:?}")),
    });
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/hello")
}

/// The example's service.json with its bundle reference pointed at
/// `reference` and `env` set, written to `path`.
fn write_template(path: &Path, reference: &str, env: &[(&str, &str)]) {
    let mut template: Value =
        serde_json::from_str(&std::fs::read_to_string(example().join("service.json")).unwrap()).unwrap();
    template["bundle"]["reference"] = Value::String(reference.to_string());
    template["env"] = env.iter().map(|(k, v)| (k.to_string(), Value::String(v.to_string()))).collect();
    std::fs::write(path, serde_json::to_string_pretty(&template).unwrap()).unwrap();
}

/// The names in `revision list -o json`, newest first.
fn revision_names(dev: &Dev, service: &str) -> Vec<String> {
    dev.json(&["revision", "list", service])["revisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect()
}

/// A message's `generation`: a 64-bit integer, so a string in the proto3 JSON
/// mapping, and left out while it is 0.
fn generation(message: &Value) -> u64 {
    match &message["generation"] {
        Value::Null => 0,
        Value::String(text) => text.parse().unwrap_or_else(|_| panic!("generation {text:?} in {message}")),
        other => panic!("a 64-bit generation is a string in JSON, not {other} in {message}"),
    }
}

#[test]
fn the_example_deploys_in_one_apply_and_rolls_forward_and_back() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("oci");
    let reference = format!("oci:{}:hello", layout.display());
    let push = run(berth_command(&["bundle", "push", example().to_str().unwrap(), &reference]), COMMAND_DEADLINE);
    assert_eq!(push.code, Some(0), "{push:?}");
    let dev = Dev::start(&tmp.path().join("data"));
    let spec = tmp.path().join("service.json");
    let spec_arg = spec.to_str().unwrap();
    write_template(&spec, &reference, &[("GREETING_STYLE", "plain")]);

    let applied = dev.ok(&["service", "apply", "-f", spec_arg, "--name", "hello", "--wait"]);
    assert!(applied.contains("service hello: revision hello-00001 minted"), "{applied}");
    assert!(applied.contains("hello-00001 is live, 2 of 2 replicas running"), "{applied}");

    // Both replicas answer as the live revision, on the ports `get` lists.
    let shown = dev.json(&["service", "get", "hello"]);
    assert_eq!(shown["service"]["status"]["liveRevision"], "hello-00001", "{shown}");
    assert_eq!(shown["service"]["status"]["replicasRunning"], 2, "{shown}");
    let ports: Vec<u64> = shown["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["revision"] == "hello-00001" && r["phase"] == "LEASE_PHASE_RUNNING")
        .map(|r| r["port"].as_u64().unwrap())
        .collect();
    assert_eq!(ports.len(), 2, "{shown}");
    for port in ports {
        let answer = poll(Duration::from_secs(10), &format!("the replica on port {port} answers"), || {
            http_get(port, "/").ok_or_else(|| "no answer".to_string())
        });
        assert_eq!(answer, "hello from hello-00001\n", "replica on port {port}");
    }
    // The router serves it by name, through the node's agent.
    let host = "hello.default.berth.localhost";
    router_serves(&dev, host, "hello from hello-00001\n");
    let (status, body) = via_router(&dev, "nope.default.berth.localhost").unwrap();
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    assert!(body.contains("looked for service nope in project default"), "{body}");
    let table = dev.ok(&["service", "get", "hello"]);
    for line in ["Live revision:", "Latest created:", "Latest ready:", "TYPE", "Ready", "NODE"] {
        assert!(table.contains(line), "no {line} in:\n{table}");
    }

    // The same declaration again changes nothing.
    let again = dev.ok(&["service", "apply", "-f", spec_arg, "--name", "hello"]);
    assert!(again.contains("unchanged (no new revision"), "{again}");
    assert_eq!(revision_names(&dev, "hello"), ["hello-00001"]);

    // A new environment mints a revision that takes the traffic.
    write_template(&spec, &reference, &[("GREETING_STYLE", "loud")]);
    let changed = dev.ok(&["service", "apply", "-f", spec_arg, "--name", "hello", "--wait"]);
    assert!(changed.contains("revision hello-00002 minted"), "{changed}");
    assert!(changed.contains("hello-00002 is live, 2 of 2 replicas running"), "{changed}");
    assert_eq!(revision_names(&dev, "hello"), ["hello-00002", "hello-00001"]);
    let revisions = dev.ok(&["revision", "list", "hello"]);
    assert_eq!(revisions.lines().count(), 3, "a header and two revisions:\n{revisions}");
    assert!(revisions.lines().next().unwrap().starts_with("NAME"), "{revisions}");
    router_serves(&dev, host, "hello from hello-00002\n");
    let listed = dev.ok(&["service", "list"]);
    let row: Vec<&str> = listed.lines().find(|l| l.starts_with("hello ")).unwrap().split_whitespace().collect();
    assert_eq!(row[..5], ["hello", "hello-00002", "hello-00002", "True", "2/2"], "{listed}");

    // Pinned, traffic goes back to the first revision; unpinned, it follows
    // the latest again.
    let pinned = dev.ok(&["service", "pin", "hello", "hello-00001"]);
    assert!(pinned.contains("pinned to hello-00001"), "{pinned}");
    dev.await_live("hello", "hello-00001");
    router_serves(&dev, host, "hello from hello-00001\n");
    let unpinned = dev.ok(&["service", "unpin", "hello"]);
    assert!(unpinned.contains("follows the latest ready revision"), "{unpinned}");
    dev.await_live("hello", "hello-00002");

    // Redeploy mints a revision of the same template.
    let redeployed = dev.ok(&["service", "redeploy", "hello", "--wait"]);
    assert!(redeployed.contains("revision hello-00003 minted"), "{redeployed}");
    let third = dev.json(&["revision", "get", "hello-00003"]);
    assert!(third["revision"]["source"]["labels"]["berth.redeploy"].is_string(), "{third}");
    assert_eq!(third["revision"]["template"]["env"]["GREETING_STYLE"], "loud", "{third}");

    let missing = dev.berth(&["service", "get", "nope"]).error_line();
    assert!(missing.contains("not found"), "{missing}");
    let missing = dev.berth(&["revision", "get", "nope-00001"]).error_line();
    assert!(missing.contains("not found"), "{missing}");

    let deleted = dev.ok(&["service", "delete", "hello"]);
    assert!(deleted.contains("service hello deleted"), "{deleted}");
    let gone = dev.berth(&["service", "get", "hello"]).error_line();
    assert!(gone.contains("not found"), "{gone}");
    poll(TRAFFIC_DEADLINE, "the router forgets the deleted service", || match via_router(&dev, host) {
        Some((status, _)) if status.starts_with("HTTP/1.1 404") => Ok(()),
        other => Err(format!("{other:?}")),
    });
}

#[test]
fn a_bad_spec_is_one_error_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = tmp.path().join("bad.json");
    let yaml = tmp.path().join("bad.yaml");
    let cases: [(&Path, &str, &[&str], &str); 7] = [
        (&spec, r#"{"name": "x", "template": {"replicaz": 2}}"#, &[], "template.replicaz: unknown field"),
        (&spec, r#"{"replicas": 2}"#, &[], "name: missing"),
        (&spec, r#"{"replicas": "two"}"#, &["--name", "x"], "replicas: must be a whole number, not the string \"two\""),
        (&spec, "replicas: 2\n", &["--name", "x"], "name a YAML spec .yaml or .yml"),
        (&yaml, "name: x\ntemplate:\n  replicaz: 2\n", &[], "template.replicaz: unknown field"),
        (&yaml, "replicas: two\n", &["--name", "x"], "replicas: must be a whole number, not the string \"two\""),
        (&yaml, "name: x\ntemplate:\n  replicas: [2\n  ports: []\n", &[], "line 4"),
    ];
    for (file, text, flags, expected) in cases {
        std::fs::write(file, text).unwrap();
        let args = [&["service", "apply", "-f", file.to_str().unwrap()][..], flags].concat();
        let line = run(berth_command(&args), COMMAND_DEADLINE).error_line();
        assert!(line.contains(expected), "{text}: {line}");
        assert!(line.contains(file.to_str().unwrap()), "the file is named: {line}");
    }
    let usage = run(berth_command(&["service", "apply", "--name", "x"]), COMMAND_DEADLINE);
    assert_eq!(usage.code, Some(2), "no -f is a usage error: {usage:?}");
}

/// The processes whose working directory is under `dir`: a node's replicas
/// work in directories under its data directory.
fn processes_in(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let cwd = std::fs::read_link(entry.path().join("cwd")).ok()?;
            cwd.starts_with(dir).then_some(pid)
        })
        .collect()
}

#[test]
fn a_private_bundle_runs_with_the_credentials_revisions_holds_and_fails_unauthorized_without() {
    const USER: &str = "ci";
    const PASSWORD: &str = "pull-s3cret";
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = runtime.block_on(TestRegistry::start_with_htpasswd(USER, PASSWORD)).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let example = example();
    let reference = registry.reference("team/hello:v1");

    // The registry takes nobody without credentials, pushes included.
    let refused = run(berth_command(&["bundle", "push", example.to_str().unwrap(), &reference]), COMMAND_DEADLINE);
    assert_eq!(refused.code, Some(1), "{refused:?}");
    let pushed = run(
        berth_command(&[
            "bundle",
            "push",
            example.to_str().unwrap(),
            &reference,
            "--username",
            USER,
            "--password",
            PASSWORD,
            "-o",
            "json",
        ]),
        COMMAND_DEADLINE,
    );
    assert_eq!(pushed.code, Some(0), "{pushed:?}");
    let digest = serde_json::from_str::<Value>(&pushed.stdout).unwrap()["digest"].as_str().unwrap().to_string();

    let credentials = tmp.path().join("registry-credentials.json");
    let file = serde_json::json!({"team": {"registry": registry.host(), "username": USER, "password": PASSWORD}});
    std::fs::write(&credentials, file.to_string()).unwrap();
    let data = tmp.path().join("data");
    let dev = Dev::start_with(&data, &["--registry-credentials", credentials.to_str().unwrap()]);

    // The bundle pinned by digest and naming no credentials needs no
    // registry to mint, and the node's anonymous pull is refused.
    let anonymous = tmp.path().join("anonymous.json");
    write_template(&anonymous, &format!("{}/team/hello@{digest}", registry.host()), &[]);
    let failed = dev.berth(&["service", "apply", "-f", anonymous.to_str().unwrap(), "--name", "anonymous", "--wait"]);
    let line = failed.error_line();
    assert!(line.contains("anonymous-00001") && line.contains("BundleUnauthorized"), "{line}");
    assert!(line.contains("unauthorized at"), "{line}");

    // A YAML declaration naming the credentials: the tag resolves, the node
    // pulls with them, and the replica answers.
    let spec = tmp.path().join("private.yaml");
    std::fs::write(
        &spec,
        format!(
            "name: private\ntemplate:\n  bundle:\n    reference: {reference}\n    secret: team\n  replicas: 1\n  \
             ports:\n    - name: http\n      port: 8080\n  resources:\n    cpu_millis: 100\n    \
             memory_bytes: 67108864\n"
        ),
    )
    .unwrap();
    let applied = dev.ok(&["service", "apply", "-f", spec.to_str().unwrap(), "--wait"]);
    assert!(applied.contains("private-00001 is live, 1 of 1 replicas running"), "{applied}");
    let revision = dev.json(&["revision", "get", "private-00001"]);
    assert_eq!(revision["revision"]["digest"], digest.as_str(), "{revision}");
    let shown = dev.json(&["service", "get", "private"]);
    let port = shown["replicas"][0]["port"].as_u64().unwrap();
    let answer = poll(Duration::from_secs(10), "the private replica answers", || {
        http_get(port, "/").ok_or_else(|| "no answer".to_string())
    });
    assert_eq!(answer, "hello from private-00001\n");

    // Deleting the services releases the replica, and the node stops it.
    dev.ok(&["service", "delete", "private"]);
    dev.ok(&["service", "delete", "anonymous"]);
    let agent = data.join("agent");
    poll(Duration::from_secs(30), "the replicas stopped", || {
        let left = processes_in(&agent);
        if left.is_empty() { Ok(()) } else { Err(format!("{left:?}")) }
    });
}

/// A workload that fetches `?url=` as an ordinary HTTP client would (urllib
/// honours the proxy variables the node sets) and answers with the status
/// and body it got, so the test sees what the replica saw.
const FETCHER: &str = r#"#!/usr/bin/env python3
import http.server, os, socket, urllib.error, urllib.parse, urllib.request

class Fetch(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        if "resolve" in query:
            # ?resolve=NAME looks a name up as any program does (getaddrinfo).
            try:
                found = socket.getaddrinfo(query["resolve"][0], 80, socket.AF_INET, socket.SOCK_STREAM)
                status, body = 200, " ".join(sorted({info[4][0] for info in found})).encode()
            except OSError as failed:
                status, body = 599, str(failed).encode()
            return self.answer(status, body)
        url = query["url"][0]
        # ?direct=1 ignores the proxy variables, as a careless program would.
        handlers = [urllib.request.ProxyHandler({})] if "direct" in query else []
        try:
            with urllib.request.build_opener(*handlers).open(url, timeout=5) as answer:
                status, body = answer.status, answer.read()
        except urllib.error.HTTPError as refused:
            status, body = refused.code, refused.read()
        except Exception as failed:
            status, body = 599, str(failed).encode()
        self.answer(status, body)

    def answer(self, status, body):
        out = b"%d " % status + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

http.server.ThreadingHTTPServer(("", int(os.environ["PORT"])), Fetch).serve_forever()
"#;

/// An HTTP origin on `127.0.0.2` (a loopback address the proxy variables do
/// not exempt) answering every request with `body`; returns its port.
fn origin(body: &'static str) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut head = [0u8; 4096];
            let _ = stream.read(&mut head);
            let _ =
                write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    });
    port
}

#[test]
fn a_replica_reaches_only_what_its_egress_routes_allow_and_an_edit_applies_without_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let (allowed, other) = (origin("allowed origin"), origin("other origin"));

    let bundle = tmp.path().join("fetcher");
    std::fs::create_dir_all(&bundle).unwrap();
    std::fs::write(bundle.join("fetch.py"), FETCHER).unwrap();
    std::fs::set_permissions(bundle.join("fetch.py"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(bundle.join("berth.toml"), "entrypoint = \"fetch.py\"\n\n[[ports]]\nname = \"http\"\nport = 8080\n")
        .unwrap();
    let reference = format!("oci:{}:fetcher", tmp.path().join("oci").display());
    let push = run(berth_command(&["bundle", "push", bundle.to_str().unwrap(), &reference]), COMMAND_DEADLINE);
    assert_eq!(push.code, Some(0), "{push:?}");

    let dev = Dev::start(&tmp.path().join("data"));
    let write = |name: &str, value: Value| {
        let path = tmp.path().join(name);
        std::fs::write(&path, value.to_string()).unwrap();
        path.to_str().unwrap().to_string()
    };
    let gateway = write(
        "gateway.json",
        serde_json::json!({"name": "default", "listeners": [{"name": "http", "protocol": "HTTP", "port": 3128}]}),
    );
    dev.ok(&["egress", "gateway", "apply", "-f", &gateway]);
    let route = |ports: &[u16]| {
        serde_json::json!({
            "name": "origins",
            "parent_refs": [{"gateway": "default", "listener": "http"}],
            "hostnames": ["127.0.0.2"],
            "ports": ports,
        })
    };
    let only_allowed = write("route.json", route(&[allowed]));
    dev.ok(&["egress", "route", "apply", "-f", &only_allowed]);

    let spec = write(
        "service.json",
        serde_json::json!({
            "bundle": {"reference": reference},
            "replicas": 1,
            "ports": [{"name": "http", "port": 8080}],
            "resources": {"cpu_millis": 100, "memory_bytes": 67_108_864},
        }),
    );
    dev.ok(&["service", "apply", "-f", &spec, "--name", "fetch", "--wait"]);
    let shown = dev.json(&["service", "get", "fetch"]);
    let port = shown["replicas"][0]["port"].as_u64().unwrap_or_else(|| panic!("a replica port in {shown}"));
    let fetch_as = |target: u16, extra: &str| {
        let url = format!("http://127.0.0.2:{target}/");
        poll(Duration::from_secs(30), "the replica answers", || {
            http_get(port, &format!("/fetch?url={url}{extra}")).ok_or_else(|| "no answer".to_string())
        })
    };
    let fetch = |target: u16| fetch_as(target, "");

    // The plan reached the node before the replica ran, so its very first
    // requests are held to it.
    let fetched = poll(Duration::from_secs(30), "the allowed origin through the proxy", || {
        let got = fetch(allowed);
        if got.starts_with("200 ") { Ok(got) } else { Err(got) }
    });
    assert_eq!(fetched, "200 allowed origin");
    let refused = fetch(other);
    assert_eq!(refused, format!("403 berth egress: no route allows 127.0.0.2:{other} for service fetch (HTTP)\n"));

    let plan = dev.json(&["egress", "plan"]);
    let acks = plan["plan"]["nodeAcks"].as_array().unwrap_or_else(|| panic!("node acks in {plan}"));
    assert_eq!(acks.len(), 1, "the dev node acknowledged: {plan}");
    assert!(acks[0].get("error").is_none(), "no error, so no error field: {plan}");
    let acked = generation(&acks[0]);
    // Isolated (the agent runs as root), a program that ignores the proxy
    // variables reaches nothing; advisory, only the variables hold it.
    let direct = fetch_as(allowed, "&direct=1");
    match acks[0]["enforcement"].as_str() {
        Some("EGRESS_ENFORCEMENT_ISOLATED") => assert!(direct.starts_with("599 "), "left the namespace: {direct}"),
        Some("EGRESS_ENFORCEMENT_ADVISORY") => assert_eq!(direct, "200 allowed origin"),
        other => panic!("the ack names how the node enforces: {other:?} in {plan}"),
    }
    let service = &plan["plan"]["services"][0];
    assert_eq!(service["service"], "fetch", "{plan}");
    assert_eq!(service["condition"]["reason"], "Accepted", "{plan}");

    // An edit reaches the running replica's proxy: no restart, a new ack.
    let pid_before = processes_in(&dev.0.dir);
    let both = write("route.json", route(&[allowed, other]));
    dev.ok(&["egress", "route", "apply", "-f", &both]);
    let edited = Instant::now();
    let now_allowed = poll(Duration::from_secs(10), "the edited route in force", || {
        let got = fetch(other);
        if got.starts_with("200 ") { Ok(got) } else { Err(got) }
    });
    assert_eq!(now_allowed, "200 other origin");
    // Reported, not asserted: a shared CI machine is no clock.
    eprintln!("the edit was in force on the node {:?} after the apply returned", edited.elapsed());
    assert_eq!(processes_in(&dev.0.dir), pid_before, "the replica was not restarted");
    poll(Duration::from_secs(10), "the node acknowledges the edit", || {
        let plan = dev.json(&["egress", "plan"]);
        if generation(&plan["plan"]["nodeAcks"][0]) > acked { Ok(()) } else { Err(plan.to_string()) }
    });

    // Names: the replica's resolv.conf names its tenant's resolver, which
    // forwards what the routes let the project reach to the project's
    // upstream, with its search domains, and refuses the rest.
    let resolver = berth_testkit::Resolver::start();
    let upstream = resolver.addr;
    let names = serde_json::json!({
        "name": "names", "parent_refs": [{"gateway": "default", "listener": "http"}], "hostnames": ["api.example.com"],
    });
    dev.ok(&["egress", "route", "apply", "-f", &write("names.json", names)]);
    let dns = serde_json::json!({"upstreams": [upstream.to_string()], "search": ["example.com."], "ndots": 1});
    dev.ok(&["egress", "dns", "apply", "-f", &write("dns.json", dns)]);
    let canonical = serde_json::json!({"upstreams": [upstream.to_string()], "search": ["example.com"], "ndots": 1});
    assert_eq!(dev.json(&["egress", "dns", "get"])["dnsConfig"]["spec"], canonical);
    let resolve = |name: &str| http_get(port, &format!("/fetch?resolve={name}")).unwrap_or_default();
    let resolved = poll(Duration::from_secs(10), "the replica resolves through the project's upstream", || {
        let got = resolve("api.example.com");
        if got == "200 192.0.2.10" { Ok(got) } else { Err(got) }
    });
    assert_eq!(resolved, "200 192.0.2.10");
    assert_eq!(resolve("api"), "200 192.0.2.10", "a short name is tried with the search domain");
    // A service's internal name leads, through the router, to a replica of
    // it (here the fetcher itself, asked to look that name up), never
    // through the egress proxy.
    assert_eq!(resolve("fetch.default.berth.internal"), "200 127.0.0.54");
    let inner = "http://fetch.default.berth.internal/fetch?resolve=fetch.default.berth.internal";
    let through_router = poll(Duration::from_secs(10), "the replica reaches its service by name", || {
        let got = http_get(port, &format!("/fetch?url={inner}")).unwrap_or_default();
        if got == "200 200 127.0.0.54" { Ok(got) } else { Err(got) }
    });
    assert_eq!(through_router, "200 200 127.0.0.54");
    let refused = resolve("evil.example.net");
    assert!(refused.starts_with("599 "), "no route reaches it, so it does not resolve: {refused}");
    let asked_names = resolver.asked();
    assert!(
        asked_names.iter().all(|name| name == "api.example.com"),
        "only allowed names left the node: {asked_names:?}"
    );
    let plan = dev.json(&["egress", "plan"]);
    assert_eq!(plan["plan"]["dns"], canonical, "{plan}");

    // An edit applies to the next lookup, with nothing restarted.
    dev.ok(&["egress", "dns", "apply", "-f", &write("dns.json", serde_json::json!({"upstreams": []}))]);
    poll(Duration::from_secs(10), "the edited DNS config in force", || {
        let got = resolve("api.example.com");
        if got.starts_with("599 ") { Ok(got) } else { Err(got) }
    });
    assert_eq!(processes_in(&dev.0.dir), pid_before, "the replica was not restarted");
    dev.ok(&["service", "delete", "fetch"]);
}

/// Whether this run may contain workloads (root); a run that cannot skips,
/// except under `CI=true`, where it fails.
fn contained_here(test: &str) -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{test} needs root to contain workloads, and CI=true");
    eprintln!("skipping {test}: containing workloads needs root");
    false
}

/// A busybox `httpd` packed as a container image by the test (no Python
/// in it), deployed with the same `service apply` as the README's hello,
/// under the dev node's OCI runtime `runtime`: it answers from the image's
/// working directory, with the lower layer's file replaced and another
/// removed by a whiteout, the template's env, working directory and user
/// over the image's, and runs as that user (the image's account, owning
/// what the image gave it) on the lease's own uid, never root.
fn an_image_deploys_and_answers(runtime: &str) {
    if !contained_here(&format!("an image under {runtime}")) {
        return;
    }
    let tokio = tokio::runtime::Runtime::new().unwrap();
    let registry = tokio.block_on(TestRegistry::start()).unwrap();
    let reference = registry.reference("team/httpd:v1");
    // From the image's working directory, which the image gives its user:
    // what the workload writes lands in its own overlay.
    let serve = "echo \"$GREETING from $(id -un) $(id -u)\" > whoami && exec httpd -f -p \"$PORT\" -h .";
    let env = ["PATH=/bin", "GREETING=image-env"];
    let image = TestImage::as_user(&["/bin/sh", "-c"], &[serve], &env, "/", "nobody")
        .layer(
            Layer::busybox(&["sh", "httpd", "id"])
                .unwrap()
                .dir("etc", 0o755)
                .file(
                    "etc/passwd",
                    b"root:x:0:0::/root:/bin/sh\nwww:x:33:33::/www:/bin/sh\nnobody:x:65534:65534::/:\n",
                    0o644,
                )
                .file("etc/group", b"root:x:0:\nwww:x:33:\n", 0o644)
                .owned_by(33, 33)
                .dir("www", 0o755)
                .file("www/index.html", b"from the first layer\n", 0o644)
                .file("www/stale.html", b"whited out\n", 0o644),
        )
        .unwrap()
        .layer(Layer::new().file("www/index.html", b"from the second layer\n", 0o644).whiteout("www/stale.html"))
        .unwrap();
    let client = berth_bundle::BundleClient::new(berth_bundle::RegistryConfig::default()).unwrap();
    let digest = tokio.block_on(image.push(&client, &reference, &RegistryCredentials::Anonymous)).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let flags: &[&str] = if runtime == "process" { &["--runtime", "process"] } else { &["--oci-runtime", runtime] };
    let dev = Dev::start_with(&tmp.path().join("data"), flags);
    let spec = tmp.path().join("service.json");
    let template = serde_json::json!({
        "image": reference,
        "replicas": 1,
        "ports": [{"name": "http", "port": 8080}],
        "env": {"GREETING": "template-env"},
        "working_dir": "/www",
        "user": "www",
        "resources": {"cpu_millis": 100, "memory_bytes": 64 << 20},
        // The dev node's labels say what runs its workloads; placement reads them.
        "runtime": if runtime == "runsc" { "sandboxed" } else { "contained" },
    });
    std::fs::write(&spec, template.to_string()).unwrap();
    let applied = dev.ok(&["service", "apply", "-f", spec.to_str().unwrap(), "--name", "web", "--wait"]);
    assert!(applied.contains("web-00001 is live, 1 of 1 replicas running"), "{applied}");

    let revision = dev.json(&["revision", "get", "web-00001"]);
    assert_eq!(revision["revision"]["digest"], digest.to_string(), "{revision}");
    let shown = dev.json(&["service", "get", "web"]);
    let port = shown["replicas"][0]["port"].as_u64().unwrap();
    // Each request is a fresh connection, which a busy sandbox may leave
    // unanswered, or close before the body: ask until one answers whole.
    let get = |path: &str| {
        poll(Duration::from_secs(20), &format!("the image's httpd answers {path}"), || {
            http_get(port, path).filter(|body| !body.is_empty()).ok_or_else(|| "no answer".to_string())
        })
    };
    assert_eq!(get("/index.html"), "from the second layer\n");
    let whoami = get("/whoami");
    let uid: u32 =
        whoami.trim().strip_prefix("template-env from www ").unwrap_or_else(|| panic!("{whoami}")).parse().unwrap();
    assert!(uid >= 200_000, "the workload runs as a uid of the lease's own, not {uid}");
    assert!(get("/stale.html").contains("404"), "the whiteout removed it");
    let described = dev.ok(&["service", "get", "web"]);
    assert!(described.contains("Image:") && described.contains(&reference), "{described}");

    // More memory and nothing else: a runtime that resizes a running
    // workload (runc's cgroup; the process runtime, which has no limits)
    // keeps the replica, which serves on as web-00002; gVisor cannot, so a
    // new replica replaces it.
    let lease = shown["replicas"][0]["leaseId"].as_str().unwrap().to_string();
    let pids = processes_in_cgroup(&lease);
    if runtime == "runc" {
        assert!(!pids.is_empty(), "no process in the cgroup of lease {lease}");
        assert_eq!(memory_limit_of(pids[0]), Some(64 << 20), "the lease's size is its limit");
    }
    let mut bigger = template.clone();
    bigger["resources"]["memory_bytes"] = (96_u64 << 20).into();
    std::fs::write(&spec, bigger.to_string()).unwrap();
    let resized = dev.ok(&["service", "apply", "-f", spec.to_str().unwrap(), "--name", "web", "--wait"]);
    assert!(resized.contains("web-00002 is live, 1 of 1 replicas running"), "{resized}");
    let shown = dev.json(&["service", "get", "web"]);
    let serving: Vec<&Value> = shown["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["revision"] == "web-00002" && r["phase"] == "LEASE_PHASE_RUNNING")
        .collect();
    assert_eq!(serving.len(), 1, "{shown}");
    let kept = serving[0]["leaseId"] == lease.as_str();
    assert_eq!(kept, runtime != "runsc", "the replica kept (else replaced) under {runtime}: {shown}");
    if runtime == "runc" {
        assert_eq!(processes_in_cgroup(&lease), pids, "the same processes run on");
        assert_eq!(memory_limit_of(pids[0]), Some(96 << 20), "the limit grew in place");
    }
    let port = serving[0]["port"].as_u64().unwrap();
    let answered = poll(Duration::from_secs(20), "the resized service answers", || {
        http_get(port, "/index.html").filter(|body| !body.is_empty()).ok_or_else(|| "no answer".to_string())
    });
    assert_eq!(answered, "from the second layer\n");

    let capacity = dev.json(&["capacity"]);
    assert_eq!(capacity["nodes"][0]["runtime"], runtime, "{capacity}");
    if runtime != "runsc" {
        // Asking for gVisor where no node runs it places nothing, and says why.
        let mut sandboxed = template.clone();
        sandboxed["runtime"] = "sandboxed".into();
        std::fs::write(&spec, sandboxed.to_string()).unwrap();
        dev.ok(&["service", "apply", "-f", spec.to_str().unwrap(), "--name", "untrusted"]);
        poll(Duration::from_secs(30), "the sandboxed service says no node runs gVisor", || {
            let shown = dev.json(&["service", "get", "untrusted"]);
            let conditions = shown["service"]["status"]["conditions"].to_string();
            if conditions.contains("runs gVisor (runsc)") { Ok(()) } else { Err(conditions) }
        });
    }

    let deleted = dev.ok(&["service", "delete", "web"]);
    assert!(deleted.contains("service web deleted"), "{deleted}");
}

#[test]
fn a_container_image_deploys_with_service_apply_under_runc() {
    an_image_deploys_and_answers("runc");
}

#[test]
fn a_container_image_deploys_with_service_apply_under_runsc() {
    an_image_deploys_and_answers("runsc");
}

#[test]
fn a_container_image_deploys_with_service_apply_under_the_process_runtime() {
    an_image_deploys_and_answers("process");
}

/// The README's hello (a Python bundle) deploys as microVMs with `service
/// apply` and answers through the router: its guests run it on the node's
/// own `/usr`, shared with them read-only, as a container would.
#[test]
fn the_readme_hello_deploys_as_microvms_and_answers_through_the_router() {
    if !contained_here("the hello bundle as microVMs") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let reference = format!("oci:{}:hello", tmp.path().join("oci").display());
    let push = run(berth_command(&["bundle", "push", example().to_str().unwrap(), &reference]), COMMAND_DEADLINE);
    assert_eq!(push.code, Some(0), "{push:?}");
    let dev = Dev::start_with(&tmp.path().join("data"), &["--runtime", "microvm", "--microvm-accel", "tcg"]);
    let spec = tmp.path().join("service.json");
    write_template(&spec, &reference, &[]);
    let mut template: Value = serde_json::from_str(&std::fs::read_to_string(&spec).unwrap()).unwrap();
    template["runtime"] = Value::String("microvm".into());
    std::fs::write(&spec, template.to_string()).unwrap();
    // Its replicas run once their guests listen: under QEMU's translator at the example's 0.1 CPU, a
    // guest's boot and Python's start take a minute or more.
    let apply = ["service", "apply", "-f", spec.to_str().unwrap(), "--name", "hello", "--wait"];
    let applied = run(dev.0.admin_command(&apply), MICROVM_APPLY_DEADLINE).succeeded(&apply);
    assert!(applied.contains("hello-00001 is live, 2 of 2 replicas running"), "{applied}");
    router_serves(&dev, "hello.default.berth.localhost", "hello from hello-00001\n");
    let deleted = dev.ok(&["service", "delete", "hello"]);
    assert!(deleted.contains("service hello deleted"), "{deleted}");
}

/// The same busybox `httpd` image under the microVM runtime: `service
/// apply` runs it in a VM of its own (QEMU's translator here, which needs no
/// `/dev/kvm`), reached through the node as any replica is; inside, it runs
/// as the image's user on a kernel that is not the host's, and reaches out
/// only through its tenant's proxy and resolver.
#[test]
fn a_container_image_deploys_with_service_apply_as_a_microvm() {
    if !contained_here("an image as a microVM") {
        return;
    }
    let tokio = tokio::runtime::Runtime::new().unwrap();
    let registry = tokio.block_on(TestRegistry::start()).unwrap();
    let reference = registry.reference("team/httpd:vm");
    // Once serving, it reaches its own service by its internal name, through the router.
    let serve = "{ id -un; id -u; uname -r; nslookup example.com 2>&1 | grep -q REFUSED && echo resolver-refused; \
                 wget -q -O- http://example.com/ 2>&1 | grep -q 403 && echo proxy-refused; } > report \
                 && httpd -p \"$PORT\" -h . && i=0; while [ $i -lt 120 ]; do \
                 wget -q -Y off -O- http://vm.default.berth.internal/index.html 2>/dev/null | grep -q microVM \
                 && { echo service-reached >> report; break; }; sleep 1; i=$((i+1)); done; exec sleep 100000";
    let image = TestImage::as_user(&["/bin/sh", "-c"], &[serve], &["PATH=/bin"], "/www", "www")
        .layer(
            Layer::busybox(&["sh", "httpd", "id", "uname", "nslookup", "wget", "grep", "sleep"])
                .unwrap()
                .dir("etc", 0o755)
                .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\nwww:x:33:33::/www:/bin/sh\n", 0o644)
                .file("etc/group", b"root:x:0:\nwww:x:33:\n", 0o644)
                .owned_by(33, 33)
                .dir("www", 0o755)
                .file("www/index.html", b"from a microVM\n", 0o644),
        )
        .unwrap();
    let client = berth_bundle::BundleClient::new(berth_bundle::RegistryConfig::default()).unwrap();
    tokio.block_on(image.push(&client, &reference, &RegistryCredentials::Anonymous)).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start_with(&tmp.path().join("data"), &["--runtime", "microvm", "--microvm-accel", "tcg"]);
    let capacity = dev.json(&["capacity"]);
    assert_eq!(capacity["nodes"][0]["runtime"], "microvm", "{capacity}");
    let spec = tmp.path().join("service.json");
    let template = serde_json::json!({
        "image": reference,
        "replicas": 1,
        "ports": [{"name": "http", "port": 8080}],
        "resources": {"cpu_millis": 1000, "memory_bytes": 256 << 20},
        "runtime": "microvm",
    });
    std::fs::write(&spec, template.to_string()).unwrap();
    let applied = dev.ok(&["service", "apply", "-f", spec.to_str().unwrap(), "--name", "vm", "--wait"]);
    assert!(applied.contains("vm-00001 is live, 1 of 1 replicas running"), "{applied}");
    let shown = dev.json(&["service", "get", "vm"]);
    let port = shown["replicas"][0]["port"].as_u64().unwrap();
    // Running means serving: the guest's httpd answers as soon as the apply returns.
    assert_eq!(http_get(port, "/index.html").as_deref(), Some("from a microVM\n"), "the VM's httpd, once running");
    let report = poll(Duration::from_secs(150), "the VM to reach its service by its internal name", || {
        http_get(port, "/report").filter(|body| body.contains("service-reached")).ok_or_else(|| "not yet".to_string())
    });
    let lines: Vec<&str> = report.lines().collect();
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(lines[..2], ["www", "33"], "the image's user inside its VM: {report}");
    assert_ne!(lines[2], host_kernel.trim(), "a kernel of its own: {report}");
    assert_eq!(
        lines[3..],
        ["resolver-refused", "proxy-refused", "service-reached"],
        "its names and requests go to its tenant's resolver and proxy, which hold them to its policy, and its \
         services' internal names reach them: {report}"
    );
    // The node holds the guest's reserve and the VMM's allowance beside the workload's memory.
    let lease_id = shown["replicas"][0]["leaseId"].as_str().unwrap().to_owned();
    let lease = dev.ok(&["lease", "get", &lease_id]);
    assert!(lease.contains("Node overhead") && lease.contains("384Mi memory"), "{lease}");
    let capacity = dev.json(&["capacity"]);
    let allocated = &capacity["nodes"][0]["allocated"]["memoryBytes"];
    assert_eq!(*allocated, (640_u64 << 20).to_string(), "256 MiB of workload, 128 of guest, 256 of VMM: {capacity}");

    let deleted = dev.ok(&["service", "delete", "vm"]);
    assert!(deleted.contains("service vm deleted"), "{deleted}");
}
