//! `berth-bench deploy` run as a user runs it: the real binary starting
//! identity and leases beside it on PostgreSQL and Redis, revisions and a
//! node in its own process and a registry on loopback, tiny enough for a
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

#[test]
fn a_tiny_deploy_run_reports_warm_and_cold_latency_beside_its_baselines_and_mint_rates() {
    sibling("berth-identity", "berth-identity");
    sibling("berth-leases", "berth-leases");
    let out = bench(&["deploy", "--warm", "3", "--cold", "2", "--bundle-mib", "1", "--mints", "5", "--output", "json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let text = report.to_string();
    assert_eq!(report["scenario"], "deploy", "{text}");
    assert_eq!((report["store"].as_str(), report["bus"].as_str()), (Some("postgres"), Some("redis")), "{text}");
    assert!(report["bundle_bytes"].as_u64().unwrap() > 1 << 20, "a 1 MiB payload of random bytes: {text}");
    for (figure, calls) in [("warm", 3), ("cold", 2), ("lease_request", 3), ("mint_unchanged", 5), ("mint_changed", 5)]
    {
        let figures = &report[figure];
        assert_eq!(figures["calls"], calls, "{figure}: {text}");
        assert_eq!(figures["errors"], 0, "{figure}: {text}");
        let (p50, p99) = (figures["p50_ms"].as_f64().unwrap(), figures["p99_ms"].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= p99, "{figure}: {text}");
    }
    for rate in ["mint_unchanged", "mint_changed", "empty_rpc"] {
        assert!(report[rate]["rate_per_s"].as_f64().unwrap() > 0.0, "{rate}: {text}");
    }
    assert_eq!(report["errors"], serde_json::json!([]), "{text}");
    let targets = report["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 2, "{text}");
    assert!(targets.iter().all(|t| t["value"].is_number() && t["met"].is_boolean()), "{text}");
    for line in ["bench: dropping the scratch database", "bench: deleting the services"] {
        assert!(stderr.contains(line), "{stderr}");
    }
}
