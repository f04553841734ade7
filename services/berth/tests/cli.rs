//! The admin CLI end to end, driven the way an operator drives it: the real
//! `berth` binary against a real `berth dev` on a temp data dir and free
//! ports, reading only what the commands print and the files they write.

#![allow(clippy::disallowed_methods, reason = "these tests are synchronous and poll with std::thread::sleep")]
#![allow(clippy::unwrap_used, reason = "a failed unwrap in a test helper is a failed test with a line number")]

mod common;

use common::{DevProcess, Outcome, berth_command, parse_json, poll, row, run};

use std::net::TcpListener;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use berth_core::Identity;
use berth_proto::identity::v1;
use serde_json::Value;

/// How long a node may take to join and heartbeat after `berth dev` starts.
const JOIN_DEADLINE: Duration = Duration::from_secs(60);

/// How long one CLI command may take.
const COMMAND_DEADLINE: Duration = Duration::from_secs(60);

/// The `berth dev` these tests drive, named to each command by flags.
type Dev = DevProcess;

impl Dev {
    /// Runs `berth ARGS` as the dev admin against this mesh.
    fn berth(&self, args: &[&str]) -> Outcome {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--server", &self.server, "--data-dir", self.dir.to_str().unwrap()]);
        berth(&all)
    }

    /// Like [`Dev::berth`], and the command must succeed.
    fn ok(&self, args: &[&str]) -> String {
        self.berth(args).succeeded(args)
    }

    /// Like [`Dev::ok`] with `-o json`, parsed.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.extend_from_slice(&["-o", "json"]);
        parse_json(args, &self.ok(&all))
    }
}

/// Runs the real binary with no `BERTH_*` settings from the environment.
fn berth(args: &[&str]) -> Outcome {
    run(berth_command(args), COMMAND_DEADLINE)
}

fn find_token<'a>(listed: &'a Value, id: &str) -> &'a Value {
    listed["joinTokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tokenId"] == id)
        .unwrap_or_else(|| panic!("token {id} not listed: {listed}"))
}

/// Joins a host with `token` over TLS without a client certificate, the way
/// an agent does; returns the node id identity chose.
fn join(dev: &Dev, token: &str, name: &str) -> Result<String, tonic::Status> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = std::fs::read_to_string(dev.dir.join("ca.pem")).unwrap();
    let (csr_pem, _key) = berth_mtls::generate_csr(name).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let channel = berth_rpc::connect_anonymous(&dev.server, &ca).unwrap();
        let response = v1::join_client::JoinClient::new(channel)
            .join(v1::JoinRequest {
                token: token.to_string(),
                csr_pem,
                name: name.to_string(),
                advertise_addr: "127.0.0.1:9".into(),
                version: "test".into(),
                capacity: Some(berth_proto::types::v1::Capacity { cpu_millis: 2000, memory_bytes: 1 << 30 }),
                ..Default::default()
            })
            .await?;
        Ok(response.into_inner().node_id)
    })
}

#[test]
fn token_is_created_listed_without_its_secret_used_and_revoked() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));

    // Table: the secret, the id and the expiry, each on its own line.
    let created =
        dev.ok(&["token", "create", "--tier", "edge", "--label", "rack=r4", "--ttl", "30m", "--max-uses", "2"]);
    let field = |name: &str| {
        created
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("no {name} line in:\n{created}"))
    };
    let (table_secret, table_id, expires) = (field("Token:"), field("Token ID:"), field("Expires:"));
    assert!(!table_secret.is_empty() && !table_id.is_empty(), "{created}");
    assert!(expires.contains("(in 29m") || expires.contains("(in 30m"), "a 30m token expires in 30m: {expires}");

    // JSON: the response message in the proto3 JSON mapping.
    let json = dev.json(&["token", "create", "--tier", "edge", "--label", "rack=r4"]);
    let json_secret = json["token"].as_str().unwrap().to_string();
    let json_id = json["tokenId"].as_str().unwrap().to_string();
    assert!(!json_secret.is_empty() && json_id != table_id, "{json}");
    prost_types::Timestamp::from_str(json["expiresAt"].as_str().unwrap()).expect("expiresAt is RFC 3339");

    // Listing shows both, unused, and never a secret.
    let table = dev.ok(&["token", "list"]);
    assert!(table.starts_with("ID "), "upper-case headers first:\n{table}");
    let first = row(&table, &table_id);
    for cell in ["usable", "0/2", "edge", "rack=r4"] {
        assert!(first.contains(&cell), "{cell} in {first:?}");
    }
    assert!(row(&table, &json_id).contains(&"0/1"), "max uses defaults to one:\n{table}");
    let listed = dev.json(&["token", "list"]);
    assert!(find_token(&listed, &table_id).get("uses").is_none(), "no use, no uses field: {listed}");
    assert_eq!(find_token(&listed, &table_id)["maxUses"], 2);
    assert_eq!(find_token(&listed, &table_id)["labels"]["rack"], "r4");
    assert!(find_token(&listed, &json_id).get("token").is_none(), "{listed}");
    for secret in [&table_secret, &json_secret] {
        assert!(!table.contains(secret.as_str()) && !listed.to_string().contains(secret.as_str()), "secret listed");
    }

    // The JSON token is the real thing: a host joins with it.
    let node_id = join(&dev, &json_secret, "cli-joined").expect("the printed token joins a host");
    assert_eq!(find_token(&dev.json(&["token", "list"]), &json_id)["uses"], 1);
    let node = dev.json(&["node", "get", &node_id]);
    assert_eq!(node["node"]["name"], "cli-joined", "{node}");
    assert_eq!(node["node"]["tier"], "edge", "{node}");
    assert_eq!(node["node"]["labels"]["rack"], "r4", "{node}");
    let edge = dev.ok(&["node", "list", "--tier", "edge"]);
    assert_eq!(row(&edge, &node_id)[1], "cli-joined", "{edge}");
    assert!(!edge.lines().any(|l| l.split_whitespace().any(|c| c == "dev")), "the dev node is in no tier:\n{edge}");

    // Revoked: said so, and listed so.
    let revoked = dev.ok(&["token", "revoke", &table_id]);
    assert!(revoked.contains(&table_id) && revoked.contains("revoked"), "{revoked}");
    assert!(row(&dev.ok(&["token", "list"]), &table_id).contains(&"revoked"));
    assert_eq!(find_token(&dev.json(&["token", "list"]), &table_id)["revoked"], true);
    let usable = dev.json(&["token", "list", "--usable"]);
    assert!(usable["joinTokens"].as_array().into_iter().flatten().all(|t| t["tokenId"] != table_id.as_str()));
    assert!(join(&dev, &table_secret, "too-late").is_err(), "a revoked token joins nobody");

    let line = dev.berth(&["token", "revoke", "jt-000000000000"]).error_line();
    assert!(line.contains("not found"), "{line}");
}

#[test]
fn dev_node_is_listed_up_then_drained_undrained_and_revoked() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));

    // The dev agent names itself `dev`; identity may give it another id.
    let node_id = poll(JOIN_DEADLINE, "the dev node is listed UP", || {
        let listed = dev.berth(&["node", "list", "-o", "json"]);
        assert_ne!(listed.code, Some(2), "{listed:?}");
        let parsed: Value = serde_json::from_str(&listed.stdout).map_err(|_| format!("{listed:?}"))?;
        parsed["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| (n["name"] == "dev" || n["nodeId"] == "dev") && n["state"] == "NODE_STATE_UP")
            .map(|n| n["nodeId"].as_str().unwrap_or_default().to_string())
            .ok_or_else(|| parsed.to_string())
    });

    let table = dev.ok(&["node", "list"]);
    assert!(table.starts_with("ID "), "{table}");
    assert_eq!(row(&table, &node_id)[2], "UP", "{table}");
    let details = dev.ok(&["node", "get", &node_id]);
    let state_line = details.lines().find(|l| l.starts_with("State:")).unwrap_or_default();
    assert!(state_line.ends_with("UP"), "{details}");
    assert!(details.lines().any(|l| l.starts_with("Last heartbeat:") && l.contains(" ago)")), "{details}");

    // A fleet upgrade: the dev agent runs inside `berth dev`, which no
    // updater can restart. It says so, and the rollout pauses naming it.
    let pinned = format!("127.0.0.1:9/berth/agent@sha256:{}", "2".repeat(64));
    let no_nodes = dev.berth(&["node", "upgrade", "--to", &pinned]);
    assert_eq!(no_nodes.code, Some(2), "nodes by id, --tier or --all: {no_nodes:?}");
    let paused = dev.berth(&["node", "upgrade", "--all", "--to", &pinned, "--max-unavailable", "2", "--wait"]);
    assert_ne!(paused.code, Some(0), "{paused:?}");
    assert!(paused.stdout.contains(&format!("{node_id}: FAILED")), "{paused:?}");
    assert!(paused.stderr.contains("paused") && paused.stderr.contains("inside another program"), "{paused:?}");
    let status = dev.ok(&["node", "upgrade-status"]);
    assert!(status.lines().any(|l| l.starts_with("State:") && l.ends_with("PAUSED")), "{status}");
    assert!(status.lines().any(|l| l.starts_with("Pace:") && l.contains("2 at once")), "{status}");
    assert_eq!(row(&status, &node_id)[1], "FAILED", "{status}");
    let shown = dev.json(&["node", "upgrade-status"]);
    assert_eq!(shown["upgrade"]["state"], "UPGRADE_STATE_PAUSED", "{shown}");
    assert_eq!(shown["upgrade"]["artifact"], pinned.as_str(), "{shown}");
    let upgrade_line = dev.ok(&["node", "get", &node_id]);
    assert!(upgrade_line.lines().any(|l| l.starts_with("Upgrade:") && l.contains("FAILED")), "{upgrade_line}");

    if node_id != "dev" {
        // Operators know the host as `dev`: the refusal names its id.
        let line = dev.berth(&["node", "drain", "dev"]).error_line();
        assert!(line.contains("not found") && line.contains(&node_id), "{line}");
    }

    let drained = dev.ok(&["node", "drain", &node_id, "--deadline", "1h"]);
    assert!(
        drained.contains("DRAINING") && (drained.contains("released in 59m") || drained.contains("released in 60m")),
        "{drained}"
    );
    assert_eq!(dev.json(&["node", "get", &node_id])["node"]["state"], "NODE_STATE_DRAINING");
    let details = dev.ok(&["node", "get", &node_id]);
    assert!(
        details.lines().any(|l| l.starts_with("Drain deadline:") && (l.contains("in 59m") || l.contains("in 60m"))),
        "{details}"
    );
    assert!(details.lines().any(|l| l.starts_with("Drain progress:") && l.contains("no open lease")), "{details}");
    // Nothing runs there: waiting for it to empty returns at once.
    let waited = dev.berth(&["node", "drain", &node_id, "--deadline", "1h", "--wait"]);
    assert_eq!(waited.code, Some(0), "{waited:?}");
    assert!(waited.stderr.contains("no open lease is left"), "{waited:?}");
    let both = dev.berth(&["node", "drain", &node_id, "--undo", "--deadline", "1h"]);
    assert_eq!(both.code, Some(2), "a deadline is for a drain: {both:?}");
    let drained = dev.ok(&["node", "drain", &node_id]);
    assert!(drained.contains("DRAINING"), "{drained}");
    let draining = dev.json(&["node", "list", "--state", "draining"]);
    assert!(draining["nodes"].as_array().unwrap().iter().any(|n| n["nodeId"] == node_id.as_str()), "{draining}");
    let up = dev.json(&["node", "list", "--state", "up"]);
    assert!(up["nodes"].as_array().into_iter().flatten().all(|n| n["nodeId"] != node_id.as_str()), "{up}");

    let undrained = dev.json(&["node", "drain", &node_id, "--undo"]);
    assert_eq!(undrained["node"]["state"], "NODE_STATE_UP", "{undrained}");

    let revoked = dev.ok(&["node", "revoke", &node_id, "--reason", "cli test"]);
    assert!(revoked.contains("REVOKED"), "{revoked}");
    assert_eq!(dev.json(&["node", "get", &node_id])["node"]["state"], "NODE_STATE_REVOKED");
    assert_eq!(row(&dev.ok(&["node", "list"]), &node_id)[2], "REVOKED");

    let line = dev.berth(&["node", "get", "no-such-node"]).error_line();
    assert!(line.contains("not found") && line.contains("no-such-node"), "{line}");
}

#[test]
fn cert_issue_writes_a_private_key_and_a_cert_that_chains_to_the_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));
    let out = tmp.path();
    let (cert, key, ca) = (out.join("leases.pem"), out.join("leases-key.pem"), out.join("bundle.pem"));
    // Regression: an existing world-readable file at --key-out must not
    // leave the new key world-readable.
    std::fs::write(&key, "old").unwrap();
    set_mode(&key, 0o644);

    let printed = dev.ok(&[
        "cert",
        "issue",
        "--kind",
        "service",
        "--name",
        "leases",
        "--dns-name",
        "leases",
        "--cert-out",
        cert.to_str().unwrap(),
        "--key-out",
        key.to_str().unwrap(),
        "--ca-out",
        ca.to_str().unwrap(),
    ]);
    assert!(printed.contains("leases.svc.berth.internal"), "{printed}");
    assert_eq!(mode(&key), 0o600, "the key is private");

    let cert_pem = std::fs::read_to_string(&cert).unwrap();
    let key_pem = std::fs::read_to_string(&key).unwrap();
    let ca_pem = std::fs::read_to_string(dev.dir.join("ca.pem")).unwrap();
    berth_mtls::verify_chain(&cert_pem, &ca_pem).expect("the cert chains to ca.pem");
    berth_mtls::verify_chain(&cert_pem, &std::fs::read_to_string(&ca).unwrap()).expect("--ca-out holds the bundle");
    let der = berth_mtls::certs_from_pem("certificate", &cert_pem).unwrap().remove(0);
    let identity = berth_mtls::identity_from_cert(&der).expect("the cert names a berth identity");
    assert_eq!(identity.to_san(), "leases.svc.berth.internal");
    // The names given, and loopback for the service's own health checks.
    let hosts = berth_mtls::cert_host_names(&der).unwrap();
    for name in ["leases", "localhost", "127.0.0.1"] {
        assert!(hosts.iter().any(|h| h == name), "{name} missing from {hosts:?}");
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    berth_mtls::TlsCredentials::new(berth_mtls::TlsMaterial {
        cert_chain_pem: cert_pem,
        key_pem,
        ca_bundle_pem: ca_pem,
    })
    .expect("the key belongs to the cert");

    // The service identity is what identity sees: refused where only admins
    // may call, admitted where services may.
    let as_leases = ["--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap()];
    let line = dev.berth(&[&["token", "list"][..], &as_leases[..]].concat()).error_line();
    assert!(line.contains("permission denied") && line.contains("service 'leases' may not call"), "{line}");
    dev.ok(&[&["node", "list"][..], &as_leases[..]].concat());

    // An admin certificate, as JSON, works as an admin.
    let (alice, alice_key) = (out.join("alice.pem"), out.join("alice-key.pem"));
    let issued = dev.json(&[
        "cert",
        "issue",
        "--kind",
        "admin",
        "--name",
        "alice",
        "--ttl",
        "1h",
        "--cert-out",
        alice.to_str().unwrap(),
        "--key-out",
        alice_key.to_str().unwrap(),
    ]);
    assert_eq!(issued["certificatePem"].as_str().unwrap(), std::fs::read_to_string(&alice).unwrap());
    let expires = prost_types::Timestamp::from_str(issued["expiresAt"].as_str().unwrap()).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert!((3500..=3700).contains(&(expires.seconds - now)), "--ttl 1h: {issued}");
    let der = berth_mtls::certs_from_pem("certificate", issued["certificatePem"].as_str().unwrap()).unwrap().remove(0);
    assert_eq!(berth_mtls::identity_from_cert(&der), Some(Identity::admin("alice").unwrap()));
    dev.ok(&["token", "list", "--cert", alice.to_str().unwrap(), "--key", alice_key.to_str().unwrap()]);

    // A refused issue writes nothing.
    let (bob, bob_key) = (out.join("bob.pem"), out.join("bob-key.pem"));
    let refused = dev.berth(&[
        "cert",
        "issue",
        "--kind",
        "admin",
        "--name",
        "bob",
        "--dns-name",
        "bob.example",
        "--cert-out",
        bob.to_str().unwrap(),
        "--key-out",
        bob_key.to_str().unwrap(),
    ]);
    let line = refused.error_line();
    assert!(line.contains("invalid argument") && line.contains("dns_names"), "{line}");
    assert!(!bob.exists() && !bob_key.exists(), "nothing written after a refusal");
}

/// A CA and an admin certificate in `dir`, laid out the way `berth dev`
/// writes them, with no server behind them.
fn offline_credentials(dir: &Path) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = berth_mtls::CertificateAuthority::generate("cli test CA", Duration::from_secs(3600)).unwrap();
    let (cert, key) = ca.issue(&Identity::admin("dev").unwrap(), &[], Duration::from_secs(3600)).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert_pem()).unwrap();
    std::fs::write(dir.join("admin.pem"), cert.cert_pem).unwrap();
    std::fs::write(dir.join("admin-key.pem"), key).unwrap();
}

#[test]
fn unreachable_server_is_one_clear_line_naming_the_address() {
    let tmp = tempfile::tempdir().unwrap();
    offline_credentials(tmp.path());
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let out = berth(&["token", "list", "--data-dir", tmp.path().to_str().unwrap(), "--server", &closed]);
    let line = out.error_line();
    assert!(line.starts_with(&format!("berth: error: cannot reach identity at {closed}: ")), "{line}");
    assert!(line.to_lowercase().contains("connection refused"), "{line}");
    assert!(out.stdout.is_empty(), "{}", out.stdout);
}

#[test]
fn missing_credential_file_is_named_with_the_way_out() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    let line = berth(&["node", "list", "--data-dir", empty.to_str().unwrap()]).error_line();
    let expected = empty.join("admin.pem");
    assert!(line.contains(&format!("cannot read client certificate {}", expected.display())), "{line}");
    assert!(line.contains("berth dev") && line.contains("--cert"), "{line}");

    let full = tmp.path().join("full");
    offline_credentials(&full);
    let gone = tmp.path().join("gone-key.pem");
    let line =
        berth(&["token", "list", "--data-dir", full.to_str().unwrap(), "--key", gone.to_str().unwrap()]).error_line();
    assert!(line.contains(&format!("client key {}", gone.display())) && line.contains("--key"), "{line}");
}

#[test]
fn bad_flag_values_are_usage_errors() {
    for args in [
        &["token", "create", "--ttl", "5x"][..],
        &["token", "create", "--ttl", "0s"],
        &["token", "create", "--label", "rack"],
        &["token", "create", "--max-uses", "0"],
        &["node", "list", "--state", "sideways"],
        &["node", "list", "--server", "identity-without-port"],
        &["node", "list", "-o", "yaml"],
        &["node", "get"],
        &["cert", "issue", "--kind", "node", "--name", "n", "--cert-out", "c", "--key-out", "k"],
    ] {
        let out = berth(args);
        assert_eq!(out.code, Some(2), "berth {args:?}: {out:?}");
        assert!(out.stderr.contains("error:") && !out.stderr.contains("panicked"), "{}", out.stderr);
    }
}

#[cfg(unix)]
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[cfg(unix)]
fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}
