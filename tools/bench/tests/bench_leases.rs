//! `berth-bench leases` (and `berth-bench launch`) run as a user runs them:
//! the real binary starting the real services beside it, tiny enough for a
//! debug build.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::process::{Command, Output};

/// `name`, of `package`, beside the `berth-bench` under test.
fn sibling(name: &str, package: &str) -> std::path::PathBuf {
    berth_testkit::sibling(env!("CARGO_BIN_EXE_berth-bench"), name, package)
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_berth-bench")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn json(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\nstderr:\n{stderr}"))
}

#[test]
fn a_tiny_leases_run_places_every_lease_and_reports_the_baseline() {
    sibling("berth-leases", "berth-leases");
    let out = bench(&[
        "leases",
        "--nodes",
        "3",
        "--leases",
        "50",
        "--concurrency",
        "4",
        "--duration",
        "2s",
        "--redis-url",
        "memory://",
        "--output",
        "json",
    ]);
    let report = json(&out);
    let text = report.to_string();
    assert_eq!((report["nodes"].as_u64(), report["leases"].as_u64()), (Some(3), Some(50)), "{text}");
    let placement = &report["placement"];
    assert_eq!(placement["calls"], 50, "{text}");
    assert_eq!(placement["errors"], 0, "{text}");
    assert!(placement["rate_per_s"].as_f64().unwrap() > 0.0, "{text}");
    let (p50, p99) = (placement["p50_ms"].as_f64().unwrap(), placement["p99_ms"].as_f64().unwrap());
    assert!(0.0 < p50 && p50 <= p99, "{text}");
    assert_eq!(report["errors"], serde_json::json!([]), "{text}");
    assert!(report["leases_memory"]["with_leases_mib"].as_f64().unwrap() > 0.0, "{text}");
    let pgbench = &report["pgbench"];
    if pgbench["available"] == true {
        assert!(pgbench["tps"].as_f64().unwrap() > 0.0, "{text}");
        assert!(pgbench["rows_claimed"].as_u64().unwrap() > 0, "{text}");
    } else {
        assert!(pgbench["unavailable_reason"].as_str().unwrap().contains("pgbench"), "{text}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bench: dropping the scratch database"), "{stderr}");
}

#[test]
fn a_sqlite_database_url_is_refused() {
    let out = bench(&["leases", "--nodes", "1", "--leases", "1", "--database-url", "sqlite:///tmp/x.db"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--database-url must be a postgres:// URL"), "{stderr}");
}

#[test]
fn a_tiny_launch_run_reports_latency_and_memory() {
    sibling("berth-identity", "berth-identity");
    sibling("berth-leases", "berth-leases");
    sibling("berth-agent", "berth-agent");
    let out = bench(&["launch", "--leases", "3", "--records", "100", "--compare", "5", "--output", "json"]);
    let report = json(&out);
    let text = report.to_string();
    // Side by side: launches whose workloads get their credential first,
    // and launches on an agent that gives none.
    for kind in ["launch", "launch_without_identity"] {
        let launch = &report[kind];
        assert_eq!(launch["calls"], 3, "{kind}: {text}");
        assert_eq!(launch["errors"], 0, "{kind}: {text}");
        assert!(launch["rate_per_s"].as_f64().unwrap() > 0.0, "{kind}: {text}");
        let (p50, p99) = (launch["p50_ms"].as_f64().unwrap(), launch["p99_ms"].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= p99, "{kind}: {text}");
    }
    let identity_target = report["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"].as_str().is_some_and(|name| name.starts_with("workload identity adds")));
    assert!(identity_target.is_some_and(|t| t["value"].is_number()), "{text}");
    assert_eq!(report["errors"], serde_json::json!([]), "{text}");
    let agent = &report["agent_memory"];
    assert!(agent["idle_mib"].as_f64().unwrap() > 0.0, "{text}");
    assert!(agent["with_leases_mib"].as_f64().unwrap() > 0.0, "{text}");
    assert_eq!(report["leases_memory"]["records_placed"], 100, "{text}");
    assert_eq!(report["targets"].as_array().unwrap().len(), 5, "{text}");
    // What the runtime adds at the provider, beside a raw fork+exec in the
    // same run (the process runtime has no bare-runtime baseline).
    let runtime = &report["runtime"];
    for figures in ["provider", "raw_spawn"] {
        assert_eq!(runtime[figures]["calls"], 5, "{figures}: {text}");
        assert_eq!(runtime[figures]["errors"], 0, "{figures}: {text}");
    }
    assert!(runtime["bare_runtime"].is_null(), "{text}");
}
