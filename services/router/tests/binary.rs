//! The `berth-router` binary as an operator starts it: what it refuses,
//! and how it says so, before it serves anything. (A workspace test run
//! builds it for the suites that start it, as this one does.)

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::process::{Command, Output};

fn router(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_berth-router")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

/// The flags every start needs, with files that do not exist.
const ADDRESSES: [&str; 6] =
    ["--identity-addr", "127.0.0.1:1", "--revisions-addr", "127.0.0.1:2", "--leases-addr", "127.0.0.1:3"];

#[test]
fn https_without_a_certificate_is_a_usage_error_naming_what_is_missing() {
    let out = router(&[&ADDRESSES[..], &["--https-listen", "127.0.0.1:0"]].concat());
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("--https-cert") && said.contains("--https-key"), "{said}");
}

#[test]
fn an_identity_it_cannot_read_is_named_and_nothing_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("router.pem");
    let tls = [
        "--tls-cert",
        missing.to_str().unwrap(),
        "--tls-key",
        missing.to_str().unwrap(),
        "--ca-file",
        missing.to_str().unwrap(),
        "--http-listen",
        "127.0.0.1:0",
        "--listen",
        "127.0.0.1:0",
    ];
    let out = router(&[&ADDRESSES[..], &tls[..]].concat());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains(missing.to_str().unwrap()), "the file is named: {said}");
}
