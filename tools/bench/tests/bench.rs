//! `berth-bench heartbeats` run as a user runs it: the real binary starting
//! the real `berth-identity` beside it, small enough for a debug build.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::process::{Command, Output};

/// `name`, of `package`, beside the `berth-bench` under test.
fn sibling(name: &str, package: &str) -> std::path::PathBuf {
    berth_testkit::sibling(env!("CARGO_BIN_EXE_berth-bench"), name, package)
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_berth-bench")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

/// Runs `args`, asserts it succeeds, and reads the JSON report it prints,
/// with what it said on stderr.
fn run_for_report(args: &[&str]) -> (serde_json::Value, String) {
    let out = bench(args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let report = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\nstderr:\n{stderr}"));
    (report, stderr.into_owned())
}

/// Runs `args` and asserts it exits `code`, saying `says` on stderr.
fn refused(args: &[&str], code: i32, says: &str) {
    let out = bench(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(stderr.contains(says), "{stderr}");
}

fn figure<'a>(report: &'a serde_json::Value, row: &str, field: &str) -> &'a serde_json::Value {
    &report[row][field]
}

#[test]
fn a_small_run_reports_every_figure_as_json() {
    sibling("berth-identity", "berth-identity");
    let (report, stderr) = run_for_report(&[
        "heartbeats",
        "--nodes",
        "20",
        "--interval",
        "200ms",
        "--duration",
        "2s",
        "--warmup",
        "1s",
        "--output",
        "json",
    ]);

    assert_eq!(report["nodes"], 20);
    assert_eq!((report["store"].as_str(), report["bus"].as_str()), (Some("sqlite"), Some("memory")));
    for row in ["heartbeat", "heartbeat_saturated", "empty_rpc"] {
        let rate = figure(&report, row, "rate_per_s").as_f64().unwrap();
        assert!(rate > 0.0, "{row}: {report}");
        assert_eq!(figure(&report, row, "errors"), 0, "{row}: {report}");
        assert_eq!(figure(&report, row, "connections"), 20, "{row}: {report}");
        let p50 = figure(&report, row, "p50_ms").as_f64().unwrap();
        let p99 = figure(&report, row, "p99_ms").as_f64().unwrap();
        assert!(0.0 < p50 && p50 <= p99, "{row}: {report}");
    }
    // 20 nodes every 200ms offer 100 heartbeats a second; 2s measured.
    assert_eq!(report["heartbeat_offered_per_s"], 100.0);
    let paced = figure(&report, "heartbeat", "calls").as_u64().unwrap();
    assert!((150..=250).contains(&paced), "{paced} paced heartbeats in 2s: {report}");
    assert_eq!(report["errors"], serde_json::json!([]), "{report}");
    assert_eq!(report["join"]["nodes"], 20);
    assert_eq!(report["join"]["first_heartbeat_failed"], 0, "{report}");

    let memory = &report["identity_memory"];
    let idle = memory["idle_mib"].as_f64().unwrap();
    let at_load = memory["at_load_mib"].as_f64().unwrap();
    assert!(0.0 < idle && idle <= at_load, "{report}");
    assert_eq!(report["targets"].as_array().unwrap().len(), 5, "{report}");
    assert!(stderr.contains("bench: stopping berth-identity"), "{stderr}");
}

#[test]
fn three_replicas_on_postgres_and_redis_share_the_fleet_and_each_is_reported() {
    sibling("berth-identity", "berth-identity");
    let (report, _) = run_for_report(&[
        "heartbeats",
        "--nodes",
        "30",
        "--replicas",
        "3",
        "--interval",
        "200ms",
        "--duration",
        "2s",
        "--warmup",
        "1s",
        "--database-url",
        "postgres://postgres@127.0.0.1:5432/postgres",
        // A logical database no other test uses: its `identity:` prefix must be empty.
        "--redis-url",
        "redis://127.0.0.1:6379/13",
        "-o",
        "json",
    ]);

    assert_eq!((report["store"].as_str(), report["bus"].as_str()), (Some("postgres"), Some("redis")));
    let replicas = report["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 3, "{report}");
    let mut pids: Vec<u64> = replicas.iter().map(|r| r["pid"].as_u64().unwrap()).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 3, "three processes: {report}");
    let nodes: Vec<u64> = replicas.iter().map(|r| r["nodes"].as_u64().unwrap()).collect();
    assert_eq!(nodes.iter().sum::<u64>(), 30, "{report}");
    assert!(nodes.iter().all(|&n| n > 0), "every replica holds part of the fleet: {nodes:?}");
    for replica in replicas {
        let idle = replica["idle_mib"].as_f64().unwrap();
        assert!(0.0 < idle && idle <= replica["at_load_mib"].as_f64().unwrap(), "{report}");
        assert!(replica["per_node_kib"].is_number(), "{report}");
    }
    assert_eq!(figure(&report, "heartbeat", "errors"), 0, "{report}");
    assert_eq!(report["join"]["first_heartbeat_failed"], 0, "{report}");
    let targets = report["targets"].as_array().unwrap();
    assert!(targets.iter().any(|t| t["name"] == "RSS at load < 200 MiB per replica"), "{report}");
}

#[test]
fn replicas_without_a_shared_database_and_redis_are_refused() {
    refused(&["heartbeats", "--nodes", "3", "--replicas", "2"], 1, "--replicas 2 needs --database-url and --redis-url");
}

#[test]
fn a_missing_identity_binary_says_how_to_build_it() {
    let dir = tempfile::tempdir().unwrap();
    let lonely = dir.path().join("berth-bench");
    std::fs::copy(env!("CARGO_BIN_EXE_berth-bench"), &lonely).unwrap();
    let out = Command::new(&lonely).args(["heartbeats", "--nodes", "1"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("berth-bench: error: {}", dir.path().join("berth-identity").display())),
        "{stderr}"
    );
    assert!(stderr.contains("not found: build it with cargo build --release --bins"), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_sqlite_database_url_is_refused_before_anything_starts() {
    let args = ["heartbeats", "--nodes", "1", "--database-url", "sqlite:///tmp/identity.db"];
    refused(&args, 1, "--database-url must be a postgres:// URL");
}

#[test]
fn durations_without_a_unit_are_usage_errors() {
    refused(&["heartbeats", "--nodes", "10", "--interval", "1"], 2, "needs a unit: ms, s or m");
}

#[test]
fn egress_push_measures_edits_on_a_real_dev_node() {
    sibling("berth", "berth");
    let (report, _) = run_for_report(&["egress-push", "--edits", "3", "--baseline", "5", "-o", "json"]);
    assert_eq!(report["edits"], 3, "{report}");
    assert_eq!(report["missed"], 0, "every edit reached the node: {report}");
    assert_eq!(report["in_force"]["count"], 3, "{report}");
    assert!(report["in_force"]["p50_ms"].as_f64().unwrap() > 0.0, "{report}");
    assert_eq!(report["baseline"]["count"], 5, "{report}");
    let enforcement = report["enforcement"].as_str().unwrap();
    assert!(enforcement.starts_with("EGRESS_ENFORCEMENT_"), "the node says how it enforces: {report}");
}

#[test]
fn router_measures_requests_through_the_data_plane_beside_direct_ones() {
    sibling("berth", "berth");
    sibling("berth-router", "berth-router");
    let args =
        ["router", "--connections", "2", "--duration", "1s", "--warmup", "200ms", "--changes", "3", "--services", "5"];
    let (report, _) = run_for_report(&[&args[..], &["-o", "json"]].concat());
    for protocol in ["http1", "http2"] {
        for path in ["direct", "routed", "relayed", "mtls_relayed"] {
            let figures = &report[protocol][path];
            assert!(figures["calls"].as_u64().unwrap() > 0, "{protocol} {path} answered: {report}");
            assert_eq!(figures["errors"], 0, "{protocol} {path}: {report}");
        }
        assert!(report[protocol]["rate_share"].as_f64().unwrap() > 0.0, "{report}");
        assert!(report[protocol]["relay_share"].as_f64().unwrap() > 0.0, "{report}");
        assert!(report[protocol]["mtls_relay_share"].as_f64().unwrap() > 0.0, "{report}");
        for hops in ["routed_us_per_request", "relayed_us_per_request", "mtls_relayed_us_per_request"] {
            let hops = report[protocol][hops].as_array().unwrap_or_else(|| panic!("{protocol} {hops}: {report}"));
            assert_eq!(hops.len(), 2, "{report}");
            assert!(hops.iter().all(|us| us.as_f64().is_some_and(|us| us >= 0.0)), "{report}");
        }
    }
    assert_eq!(report["route_change"]["count"], 3, "{report}");
    assert_eq!(report["missed_changes"], 0, "{report}");
    assert_eq!(report["routers"], 2, "the bench's router and berth dev's own acknowledged: {report}");
    assert!(report["rss_many_mib"].as_f64().unwrap() > 0.0, "{report}");
}

#[test]
fn svids_signs_workload_certificates_against_fresh_registrations_on_a_real_dev_node() {
    sibling("berth", "berth");
    let args = ["svids", "--signings", "20", "--concurrency", "4", "--baseline", "5", "-o", "json"];
    let (report, _) = run_for_report(&args);
    assert_eq!(report["register_and_sign"]["count"], 20, "every signing answered: {report}");
    assert_eq!(report["sign"]["count"], 20, "{report}");
    assert_eq!(report["baseline"]["count"], 5, "{report}");
    let rate = report["rate_per_s"].as_f64().unwrap();
    assert!(rate > 0.0, "{report}");
    assert_eq!(report["met"], rate >= 1000.0, "the verdict follows the rate: {report}");
    let (sign, both) =
        (report["sign"]["p50_ms"].as_f64().unwrap(), report["register_and_sign"]["p50_ms"].as_f64().unwrap());
    assert!(0.0 < sign && sign <= both, "the signing is part of the whole: {report}");
}
