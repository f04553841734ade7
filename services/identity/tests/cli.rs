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

#[test]
fn unreachable_database_fails_fast_with_one_line() {
    let started = Instant::now();
    let out = identity(&["--auth-secret", SECRET, "--database-url", "postgres://postgres@127.0.0.1:1/berth"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors = error_lines(&stderr);
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("database"), "{stderr}");
    assert!(errors[0].contains("127.0.0.1:1") || errors[0].contains("unavailable"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
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
