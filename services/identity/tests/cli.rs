//! The service binary's bad-input paths, as an operator meets them: one line
//! naming the problem and a non-zero exit, never a panic.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use berth_core::Identity;
use berth_mtls::CertificateAuthority;

fn write_certs(dir: &Path) {
    let ca = CertificateAuthority::generate("test CA", Duration::from_secs(3600)).unwrap();
    let (cert, key) =
        ca.issue(&Identity::service("identity").unwrap(), &["localhost".into()], Duration::from_secs(600)).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert_pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.cert_pem).unwrap();
    std::fs::write(dir.join("key.pem"), key).unwrap();
}

fn identity(dir: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_berth-identity"))
        .arg("--tls-cert")
        .arg(dir.join("cert.pem"))
        .arg("--tls-key")
        .arg(dir.join("key.pem"))
        .arg("--ca-file")
        .arg(dir.join("ca.pem"))
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .env_remove("BERTH_DATABASE_URL")
        .output()
        .unwrap()
}

fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("berth-identity: error:")).collect()
}

#[test]
fn unreachable_database_fails_fast_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    write_certs(tmp.path());
    let started = Instant::now();
    let out = identity(tmp.path(), &["--database-url", "postgres://postgres@127.0.0.1:1/berth"]);
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
fn missing_certificate_file_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = identity(tmp.path(), &["--database-url", "sqlite://x.db"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors = error_lines(&stderr);
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("cert.pem"), "{stderr}");
}

#[test]
fn missing_database_flag_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    write_certs(tmp.path());
    let out = identity(tmp.path(), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--database-url"), "{stderr}");
}

#[test]
fn bad_database_url_scheme_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    write_certs(tmp.path());
    let out = identity(tmp.path(), &["--database-url", "mysql://localhost/x"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(error_lines(&stderr).len(), 1, "{stderr}");
}
