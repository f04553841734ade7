//! `berth bootstrap` as an operator runs it before a mesh's first start: the
//! real binary against a real PostgreSQL database, then the real
//! `berth-identity` started on that database and secret, spoken to only
//! with the files bootstrap wrote.

#![allow(clippy::disallowed_methods, reason = "these tests are synchronous and poll with std::thread::sleep")]
#![allow(clippy::unwrap_used, reason = "a failed unwrap in a test is a failed test with a line number")]

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use berth_core::Identity;
use serde_json::Value;
use sqlx::{AnyConnection, Connection as _, Executor as _};

/// The secret the test's CA is sealed under.
const SECRET: &str = "bootstrap-test-secret-0123456789abcdef";

/// How long identity may take to serve after it is spawned.
const SERVE_DEADLINE: Duration = Duration::from_secs(60);

/// The PostgreSQL server tests use (`BERTH_TEST_DATABASE_URL`, as the store's
/// test fixtures read it).
fn pg_server_url() -> String {
    std::env::var("BERTH_TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// `url` naming database `name` instead of its own.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let start = base.find("://").map_or(0, |i| i + 3);
    let server = base[start..].find('/').map_or(base, |slash| &base[..start + slash]);
    match query {
        Some(query) => format!("{server}/{name}?{query}"),
        None => format!("{server}/{name}"),
    }
}

/// A database of this test's own, dropped on drop: bootstrap and identity
/// use the fixed schema `identity`, which no other test may share.
struct ScratchDatabase {
    server: String,
    name: String,
    url: String,
}

impl ScratchDatabase {
    fn create() -> Self {
        let server = pg_server_url();
        let name = format!("berth_bootstrap_{}_{:08x}", std::process::id(), rand::random::<u32>());
        run_sql(&server, &format!("CREATE DATABASE \"{name}\"")).unwrap();
        let url = with_database(&server, &name);
        ScratchDatabase { server, name, url }
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        // Best effort: a panic here, while a failed test unwinds, would abort.
        if let Err(error) = run_sql(&self.server, &format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name)) {
            eprintln!("could not drop the scratch database {}: {error}", self.name);
        }
    }
}

fn run_sql(url: &str, sql: &str) -> Result<(), sqlx::Error> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        sqlx::any::install_default_drivers();
        let mut conn = AnyConnection::connect(url).await?;
        conn.execute(sqlx::AssertSqlSafe(sql.to_string())).await?;
        conn.close().await
    })
}

/// A running `berth-identity`, killed on drop.
struct IdentityProcess {
    child: Child,
    server: String,
}

impl IdentityProcess {
    fn start(database_url: &str, bundle_out: &Path) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server = format!("127.0.0.1:{port}");
        let child =
            Command::new(berth_testkit::sibling(env!("CARGO_BIN_EXE_berth"), "berth-identity", "berth-identity"))
                .args(["--listen", &server, "--database-url", database_url, "--redis-url", "memory://"])
                .args(["--advertise-names", "127.0.0.1", "--ca-bundle-out"])
                .arg(bundle_out)
                .env("BERTH_AUTH_SECRET", SECRET)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
        IdentityProcess { child, server }
    }
}

impl Drop for IdentityProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Who leads identity's node monitor now (a live, unresigned term), read
/// from the database as a second replica would find it.
fn monitor_leader(database_url: &str) -> Option<String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        sqlx::any::install_default_drivers();
        let mut conn = AnyConnection::connect(database_url).await.unwrap();
        let holder: Option<(String,)> = sqlx::query_as(
            "SELECT holder FROM identity._berth_leaders WHERE loop_name = $1 AND holder <> '' \
             AND expires_at_ms > (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
        )
        .bind(berth_identity::MONITOR_LOOP)
        .fetch_optional(&mut conn)
        .await
        .unwrap();
        conn.close().await.unwrap();
        holder.map(|(holder,)| holder)
    })
}

fn berth(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_berth")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn bootstrap(out: &Path, database_url: &str, secret: &str, extra: &[&str]) -> Output {
    let mut args = vec!["bootstrap", "--out", out.to_str().unwrap(), "--database-url", database_url];
    args.extend_from_slice(&["--auth-secret", secret]);
    args.extend_from_slice(extra);
    berth(&args)
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap()
}

/// The one identity the certificate at `path` names.
fn identity_of(path: &Path) -> Identity {
    let certs = berth_mtls::certs_from_pem("certificate", &read(path)).unwrap();
    berth_mtls::identity_from_cert(&certs[0]).unwrap()
}

/// Waits until `berth health` finds identity serving, verifying it against
/// `ca`; fails with identity's exit status if it dies first.
fn wait_until_serving(identity: &mut IdentityProcess, ca: &Path) {
    let deadline = Instant::now() + SERVE_DEADLINE;
    loop {
        let out = berth(&["health", "--server", &identity.server, "--ca", ca.to_str().unwrap(), "--timeout", "2s"]);
        if out.status.success() {
            assert!(text(&out.stdout).contains("SERVING"), "{}", text(&out.stdout));
            return;
        }
        if let Some(status) = identity.child.try_wait().unwrap() {
            panic!("berth-identity exited ({status}) before serving");
        }
        assert!(Instant::now() < deadline, "identity never passed berth health: {}", text(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn bootstrap_writes_a_ca_identity_serves_from_and_certificates_it_accepts() {
    let db = ScratchDatabase::create();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pki");
    let token_file = out.join("agent.token");
    let token_arg = token_file.to_str().unwrap().to_string();
    let extra = [
        "--service",
        "leases=leases,leases.berth.svc",
        "--service",
        "revisions",
        "--router",
        "router=router",
        "--join-token-out",
        &token_arg,
        "--join-token-uses",
        "3",
    ];

    let first = bootstrap(&out, &db.url, SECRET, &extra);
    assert!(first.status.success(), "{}{}", text(&first.stdout), text(&first.stderr));
    let printed = text(&first.stdout);
    assert!(printed.contains("leases.svc.berth.internal") && printed.contains("leases.berth.svc"), "{printed}");
    for file in ["ca.pem", "admin.pem", "admin-key.pem", "leases.pem", "leases-key.pem", "revisions.pem"] {
        assert!(out.join(file).is_file(), "{file} missing; printed:\n{printed}");
    }
    assert!(!out.join("egress.pem").exists(), "--service replaces the default list");
    for private in ["admin-key.pem", "leases-key.pem", "revisions-key.pem", "agent.token"] {
        assert_eq!(mode(&out.join(private)), 0o600, "{private}");
    }
    assert_eq!(mode(&out), 0o700, "the directory bootstrap made holds keys");
    assert_eq!(identity_of(&out.join("admin.pem")).to_san(), "admin.admin.berth.internal");
    assert_eq!(identity_of(&out.join("leases.pem")).to_san(), "leases.svc.berth.internal");
    assert_eq!(identity_of(&out.join("router.pem")).to_san(), "router.router.berth.internal");
    assert_eq!(mode(&out.join("router-key.pem")), 0o600);
    berth_mtls::verify_chain(&read(&out.join("leases.pem")), &read(&out.join("ca.pem"))).unwrap();
    let token = read(&token_file);
    assert!(token.starts_with("berth-join.jt-"), "{token}");

    // Identity on the same database and secret serves from the CA bootstrap
    // made: its self-issued certificate verifies against bootstrap's ca.pem.
    let bundle_out = dir.path().join("identity-bundle.pem");
    let mut identity = IdentityProcess::start(&db.url, &bundle_out);
    wait_until_serving(&mut identity, &out.join("ca.pem"));
    assert_eq!(read(&bundle_out), read(&out.join("ca.pem")), "one CA: identity's bundle is bootstrap's");

    // The admin files work as `berth dev`'s do: by --data-dir alone.
    let listed =
        berth(&["token", "list", "-o", "json", "--server", &identity.server, "--data-dir", out.to_str().unwrap()]);
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    let token_id = token.split('.').nth(1).unwrap();
    let tokens = listed["joinTokens"].as_array().unwrap();
    let made = tokens.iter().find(|t| t["tokenId"] == token_id).unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(made["maxUses"].as_u64(), Some(3), "{made}");
    assert!(made.get("uses").is_none(), "no use yet, so no uses field, as grpcurl prints it: {made}");
    assert_eq!(made["createdBy"], "admin", "{made}");

    // This identity was told of no other service: a command that needs
    // leases says so, and how to name it, rather than guessing a port.
    let unnamed = berth(&["lease", "list", "--server", &identity.server, "--data-dir", out.to_str().unwrap()]);
    assert_eq!(unnamed.status.code(), Some(1));
    let refusal = text(&unnamed.stderr);
    let expected = format!(
        "identity at {} names no leases endpoint (identity's --endpoint leases=HOST:PORT); pass --leases-server HOST:PORT",
        identity.server
    );
    assert!(refusal.contains(&expected), "{refusal}");

    // The service certificate is a service to identity: it may list nodes,
    // and may not touch join tokens.
    let as_leases = |args: &[&str]| {
        let mut all = args.to_vec();
        let (cert, key, ca) = (out.join("leases.pem"), out.join("leases-key.pem"), out.join("ca.pem"));
        all.extend_from_slice(&["--server", &identity.server, "--cert", cert.to_str().unwrap()]);
        all.extend_from_slice(&["--key", key.to_str().unwrap(), "--ca", ca.to_str().unwrap()]);
        berth(&all)
    };
    let nodes = as_leases(&["node", "list", "-o", "json"]);
    assert!(nodes.status.success(), "{}", text(&nodes.stderr));
    let refused = as_leases(&["token", "list"]);
    assert_eq!(refused.status.code(), Some(1));
    let refusal = text(&refused.stderr);
    assert!(refusal.contains("permission denied") && refusal.contains("service 'leases'"), "{refusal}");

    // A rerun keeps the CA and renews every certificate and the token.
    let (ca_before, leases_before) = (read(&out.join("ca.pem")), read(&out.join("leases.pem")));
    let second = bootstrap(&out, &db.url, SECRET, &extra);
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert_eq!(read(&out.join("ca.pem")), ca_before, "the CA is never replaced");
    assert_ne!(read(&out.join("leases.pem")), leases_before, "certificates are issued anew");
    assert_ne!(read(&token_file), token, "every run creates a fresh token");
    let renewed = berth(&["health", "--server", &identity.server, "--ca", out.join("ca.pem").to_str().unwrap()]);
    assert!(renewed.status.success(), "{}", text(&renewed.stderr));

    // Another secret cannot open the CA, and nothing is written.
    let leases_now = read(&out.join("leases.pem"));
    let wrong = bootstrap(&out, &db.url, "another-secret-of-more-than-32-characters", &extra);
    assert_eq!(wrong.status.code(), Some(1));
    let error = text(&wrong.stderr);
    assert!(error.starts_with("berth: error:") && error.contains("--auth-secret differs"), "{error}");
    assert_eq!(read(&out.join("leases.pem")), leases_now, "a refused run leaves the files as they were");
    assert_eq!(read(&out.join("ca.pem")), ca_before);
}

#[test]
fn bootstrap_refuses_bad_flags_before_touching_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pki");
    // Nothing listens here: a flag error must come first.
    let unreachable = "postgres://postgres@127.0.0.1:1/none";
    let cases: [(&[&str], &str); 5] = [
        (&["--cert-ttl", "365d"], "--cert-ttl: must be between 1h and 90d"),
        (&["--join-token-ttl", "60d"], "--join-token-ttl: at most 30d"),
        (&["--service", "leases", "--service", "leases=leases"], "--service: 'leases' is given twice"),
        (&["--service", "router", "--router", "router"], "--router: 'router' is given twice"),
        (&["--admin", "Not A Name"], "--admin: 'Not A Name' is not a valid identity name"),
    ];
    for (flags, expected) in cases {
        let out = bootstrap(&out, unreachable, SECRET, flags);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(expected), "{flags:?}: {}", text(&out.stderr));
    }
    assert!(!out.exists(), "no directory is made for a refused run");

    let usage: [(&[&str], &str); 3] = [
        (&["--service", "leases=not a host"], "'not a host' is not a host name or IP"),
        (&["--service", "leases=leases.svc.berth.internal"], "is a berth identity name"),
        (&["--join-token-tier", "GPU!"], "'GPU!' is not a tier name"),
    ];
    for (flags, expected) in usage {
        let out = bootstrap(&out, unreachable, SECRET, flags);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: clap refuses it as usage");
        assert!(text(&out.stderr).contains(expected), "{flags:?}: {}", text(&out.stderr));
    }
}

/// An identity replica stopped by SIGTERM while it leads the node monitor
/// resigns before it exits: another replica takes the monitor over at once,
/// not a leader TTL (15 s by default) later.
#[test]
fn a_leading_replica_stopped_by_sigterm_resigns_before_it_exits() {
    let db = ScratchDatabase::create();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pki");
    let done = bootstrap(&out, &db.url, SECRET, &[]);
    assert!(done.status.success(), "{}", text(&done.stderr));
    let mut identity = IdentityProcess::start(&db.url, &dir.path().join("bundle.pem"));
    wait_until_serving(&mut identity, &out.join("ca.pem"));
    let deadline = Instant::now() + SERVE_DEADLINE;
    while monitor_leader(&db.url).is_none() {
        assert!(Instant::now() < deadline, "the only replica never led the node monitor");
        std::thread::sleep(Duration::from_millis(100));
    }

    let pid = identity.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = identity.child.wait().unwrap();
    assert!(status.success(), "berth-identity ended with {status} on SIGTERM");
    assert_eq!(monitor_leader(&db.url), None, "the stopped replica left its term to lapse");
}
