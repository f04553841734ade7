//! The service binary's bad-input paths, as an operator meets them: one line
//! naming the problem and a non-zero exit, never a panic.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::process::Command;
use std::time::{Duration, Instant};

const SECRET: &str = "a-test-secret-that-is-long-enough-0123";

fn identity(extra: &[&str]) -> std::process::Output {
    let listen: &[&str] = if extra.contains(&"--listen") { &[] } else { &["--listen", "127.0.0.1:0"] };
    Command::new(env!("CARGO_BIN_EXE_berth-identity"))
        .args(listen)
        .args(extra)
        .env_remove("BERTH_DATABASE_URL")
        .env_remove("BERTH_AUTH_SECRET")
        .output()
        .unwrap()
}

fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("berth-identity: error:")).collect()
}

/// A replica started while its database is away (a failover, a deploy that
/// starts it first) waits for it, saying so, instead of exiting; SIGTERM
/// ends the wait with one line naming what it waited for.
#[test]
fn an_unreachable_database_is_waited_for_and_sigterm_ends_the_wait() {
    use std::io::{BufRead as _, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_berth-identity"))
        .args(["--listen", "127.0.0.1:0", "--auth-secret", SECRET])
        .args(["--database-url", "postgres://postgres@127.0.0.1:1/berth"])
        .env_remove("BERTH_DATABASE_URL")
        .env_remove("BERTH_AUTH_SECRET")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let started = Instant::now();
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains("waiting for the database before serving")) {
        let line = lines.recv_timeout(Duration::from_secs(30).saturating_sub(started.elapsed()));
        seen.push(line.unwrap_or_else(|_| panic!("never said it waits: {seen:?}")));
    }
    assert!(seen.iter().any(|l| l.contains("127.0.0.1:1")), "names the database: {seen:?}");
    assert!(child.try_wait().unwrap().is_none(), "it exited instead of waiting: {seen:?}");

    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = child.wait().unwrap();
    seen.extend(lines.try_iter().take(1000));
    // The reader may still be draining: give it a moment for the last line.
    if let Ok(line) = lines.recv_timeout(Duration::from_secs(5)) {
        seen.push(line);
        seen.extend(lines.try_iter());
    }
    assert_eq!(status.code(), Some(1), "{seen:?}");
    let errors: Vec<&String> = seen.iter().filter(|l| l.starts_with("berth-identity: error:")).collect();
    assert_eq!(errors.len(), 1, "{seen:?}");
    assert!(errors[0].contains("stopped while waiting for the database"), "{seen:?}");
    assert!(!seen.iter().any(|l| l.contains("panicked")), "{seen:?}");
}

#[test]
fn short_auth_secret_is_refused_before_anything_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", tmp.path().join("identity.db").display());
    let out = identity(&["--auth-secret", "short", "--database-url", &db]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors = error_lines(&stderr);
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("--auth-secret must be at least 32 characters"), "{stderr}");
    assert!(!tmp.path().join("identity.db").exists(), "nothing was created");
}

#[test]
fn wrong_auth_secret_cannot_unseal_the_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", tmp.path().join("identity.db").display());
    // The first start creates the CA, then fails to bind a taken port and exits.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let first = identity(&["--auth-secret", SECRET, "--database-url", &db, "--listen", &port]);
    assert!(String::from_utf8_lossy(&first.stderr).contains("cannot listen on"), "{first:?}");
    let out = identity(&["--auth-secret", &format!("{SECRET}-other"), "--database-url", &db]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors = error_lines(&stderr);
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("cannot unseal the CA key"), "{stderr}");
}

#[test]
fn missing_database_flag_is_a_usage_error() {
    let out = identity(&["--auth-secret", SECRET]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--database-url"), "{stderr}");
}

#[test]
fn bad_database_url_scheme_is_refused() {
    let out = identity(&["--auth-secret", SECRET, "--database-url", "mysql://localhost/x"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(error_lines(&stderr).len(), 1, "{stderr}");
}
