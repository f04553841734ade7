//! `berth health` against a real `berth dev`: what a container's health
//! check or a Kubernetes exec probe sees, by exit code and the one line it
//! prints.

#![allow(clippy::disallowed_methods, reason = "these tests are synchronous and poll with std::thread::sleep")]
#![allow(clippy::unwrap_used, reason = "a failed unwrap in a test is a failed test with a line number")]

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// How long the dev node's agent may take to join and serve its API.
const AGENT_DEADLINE: Duration = Duration::from_secs(30);

/// `berth dev`, killed on drop.
struct Dev(Child, PathBuf);

impl Drop for Dev {
    fn drop(&mut self) {
        common::stop_dev(&mut self.0, &self.1);
    }
}

/// `berth health ARGS` with `env` set and no other BERTH_HEALTH_* variable.
fn health(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_berth"));
    command.arg("health").args(args).env("RUST_LOG", "warn");
    for var in ["BERTH_HEALTH_SERVER", "BERTH_HEALTH_CA", "BERTH_HEALTH_SERVICE", "BERTH_HEALTH_TIMEOUT"] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied()).output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The one error line of a failed check; fails unless the exit code is 1,
/// the code a container runtime reads as "unhealthy".
fn failure(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{}{stderr}", stdout(out));
    assert!(stderr.starts_with("berth: error: ") && stderr.trim_end().lines().count() == 1, "{stderr}");
    stderr
}

#[test]
fn health_passes_only_a_serving_process_whose_certificate_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let (child, base) = common::spawn_dev(dir.path());
    let _dev = Dev(child, dir.path().to_path_buf());
    let ca = dir.path().join("ca.pem");
    let ca = ca.to_str().unwrap();
    let identity = format!("127.0.0.1:{base}");

    let serving = health(&["--server", &identity, "--ca", ca], &[]);
    assert!(serving.status.success(), "{}", String::from_utf8_lossy(&serving.stderr));
    assert_eq!(stdout(&serving).trim(), format!("{identity}: SERVING (the whole server)"));

    // The way the images run it: no flags, the environment says where.
    let from_env = health(&[], &[("BERTH_HEALTH_SERVER", &identity), ("BERTH_HEALTH_CA", ca)]);
    assert!(from_env.status.success(), "{}", String::from_utf8_lossy(&from_env.stderr));

    let one_service = health(&["--server", &identity, "--ca", ca, "--service", "berth.identity.v1.JoinTokens"], &[]);
    assert_eq!(stdout(&one_service).trim(), format!("{identity}: SERVING (berth.identity.v1.JoinTokens)"));

    // The agent's certificate is a node's, issued by identity at join: it
    // names the advertise address the check dials.
    let agent = format!("127.0.0.1:{}", base + 4);
    let deadline = Instant::now() + AGENT_DEADLINE;
    loop {
        let out = health(&["--server", &agent, "--ca", ca, "--timeout", "2s"], &[]);
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "the dev agent never passed: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }

    let unknown = failure(&health(&["--server", &identity, "--ca", ca, "--service", "berth.nope.v1.Nothing"], &[]));
    assert!(unknown.contains(&format!("{identity} refused the health check (NotFound)")), "{unknown}");

    let other_ca = berth_mtls::CertificateAuthority::generate("another mesh", Duration::from_secs(3600)).unwrap();
    let other = dir.path().join("other-ca.pem");
    std::fs::write(&other, other_ca.cert_pem()).unwrap();
    let foreign = failure(&health(&["--server", &identity, "--ca", other.to_str().unwrap()], &[]));
    assert!(foreign.contains(&format!("cannot reach {identity}")) && foreign.contains("certificate"), "{foreign}");

    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let nobody = failure(&health(&["--server", &closed, "--ca", ca, "--timeout", "2s"], &[]));
    assert!(nobody.contains(&format!("cannot reach {closed}")), "{nobody}");

    let missing = dir.path().join("missing.pem");
    let unread = failure(&health(&["--server", &identity, "--ca", missing.to_str().unwrap()], &[]));
    assert!(unread.contains(&format!("cannot read the CA bundle {}", Path::new(&missing).display())), "{unread}");
}
