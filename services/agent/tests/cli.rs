//! The `berth-agent` binary as an operator meets it: every flag documented
//! with its environment fallback, and a host that cannot join told why in
//! one line with a non-zero exit, never a panic.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn agent(args: &[&str], data_dir: &Path) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_berth-agent"));
    for var in [
        "BERTH_SERVER",
        "BERTH_CA_FILE",
        "BERTH_JOIN_TOKEN",
        "BERTH_DATA_DIR",
        "BERTH_ADVERTISE_ADDR",
        "BERTH_LEASES_ADDR",
    ] {
        command.env_remove(var);
    }
    command.arg("--data-dir").arg(data_dir).args(args).output().unwrap()
}

/// What the agent printed to stderr; fails unless it exited with `code`.
fn stderr_of_exit(out: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    stderr
}

/// A join with a token and `ca_file` as its `--ca-file`.
fn join_with_ca_file(ca_file: &Path, data_dir: &Path) -> Output {
    let args = [
        "--server",
        "127.0.0.1:1",
        "--advertise-addr",
        "a:1",
        "--join-token",
        "t",
        "--ca-file",
        ca_file.to_str().unwrap(),
    ];
    agent(&args, data_dir)
}

fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("berth-agent: error:")).collect()
}

#[test]
fn help_documents_every_flag_with_its_environment_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let out = agent(&["--help"], tmp.path());
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for (flag, env) in [
        ("--server", "BERTH_SERVER"),
        ("--ca-file", "BERTH_CA_FILE"),
        ("--join-token", "BERTH_JOIN_TOKEN"),
        ("--data-dir", "BERTH_DATA_DIR"),
        ("--advertise-addr", "BERTH_ADVERTISE_ADDR"),
        ("--listen", "BERTH_LISTEN"),
        ("--tier", "BERTH_TIER"),
        ("--name", "BERTH_NODE_NAME"),
        ("--label", "BERTH_LABELS"),
        ("--cpu-millis", "BERTH_CPU_MILLIS"),
        ("--memory-bytes", "BERTH_MEMORY_BYTES"),
        ("--leases-addr", "BERTH_LEASES_ADDR"),
        ("--max-custody", "BERTH_MAX_CUSTODY"),
        ("--stop-grace", "BERTH_STOP_GRACE"),
        ("--sweep-interval", "BERTH_SWEEP_INTERVAL"),
        ("--bundle-cache-budget", "BERTH_BUNDLE_CACHE_BUDGET"),
        ("--insecure-registry", "BERTH_INSECURE_REGISTRIES"),
        ("--registry-ca", "BERTH_REGISTRY_CA"),
    ] {
        assert!(help.contains(flag) && help.contains(env), "{flag} / {env} missing from --help:\n{help}");
    }
}

#[test]
fn a_host_with_no_identity_and_no_token_is_told_to_pass_one() {
    let tmp = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = agent(
        &["--server", "127.0.0.1:1", "--advertise-addr", "127.0.0.1:7447", "--listen", "127.0.0.1:0"],
        tmp.path(),
    );
    let stderr = stderr_of_exit(&out, 1);
    let errors = error_lines(&stderr);
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("no node identity") && errors[0].contains("--join-token"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn joining_without_a_ca_file_names_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let args = ["--server", "127.0.0.1:1", "--advertise-addr", "127.0.0.1:7447", "--join-token", "berth-join.a.b"];
    let out = agent(&args, tmp.path());
    let stderr = stderr_of_exit(&out, 1);
    let errors = error_lines(&stderr);
    assert!(errors.len() == 1 && errors[0].contains("--ca-file"), "{stderr}");
}

#[test]
fn a_missing_ca_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.pem");
    let out = join_with_ca_file(&missing, tmp.path());
    let stderr = stderr_of_exit(&out, 1);
    assert!(error_lines(&stderr).first().is_some_and(|l| l.contains("nope.pem")), "{stderr}");
}

#[test]
fn a_ca_file_without_certificates_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let garbage = tmp.path().join("ca.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let out = join_with_ca_file(&garbage, tmp.path());
    let stderr = stderr_of_exit(&out, 1);
    let errors = error_lines(&stderr);
    assert!(errors.len() == 1 && errors[0].contains("--ca-file") && errors[0].contains("ca.pem"), "{stderr}");
}

#[test]
fn a_malformed_label_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = agent(&["--server", "s:1", "--advertise-addr", "a:1", "--label", "novalue"], tmp.path());
    let stderr = stderr_of_exit(&out, 2);
    assert!(stderr.contains("KEY=VALUE"), "{stderr}");
}
