//! The lease CLI end to end: the real `berth` binary asks a real `berth dev`
//! for leases that its dev node runs as processes on this machine, and the
//! tests read only what the commands print and what runs in `/proc`.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]
#![allow(clippy::disallowed_methods, reason = "these tests drive processes from plain threads, not a runtime")]

mod common;

use common::{DevProcess, Outcome, berth_command, parse_json, poll, row, run};

use std::net::TcpListener;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

/// How long the dev node may take to join and be offered to leases.
const READY_DEADLINE: Duration = Duration::from_secs(60);

/// How long one CLI command may take before the test calls it hung.
const COMMAND_DEADLINE: Duration = Duration::from_secs(60);

/// How long a lease may take to reach the phase a test waits for.
const PHASE_DEADLINE: Duration = Duration::from_secs(30);

/// A running `berth dev` and its node.
struct Dev {
    process: DevProcess,
    /// The dev node's id, once it is offered to leases.
    node_id: String,
}

impl Dev {
    /// Starts `berth dev` and waits until its node is UP in the ledger, so
    /// leases can be placed on it.
    fn start(dir: &Path) -> Dev {
        Dev::start_with(dir, &[])
    }

    /// Like [`Dev::start`], with `extra` on `berth dev`'s command line.
    fn start_with(dir: &Path, extra: &[&str]) -> Dev {
        let process = DevProcess::start_with(dir, extra);
        let node_id = process.node_up(READY_DEADLINE, COMMAND_DEADLINE, |n| {
            n["total"].get("cpuMillis").is_some().then(|| n["nodeId"].as_str().unwrap().to_string())
        });
        Dev { process, node_id }
    }

    /// Runs `berth ARGS` as the dev admin against this mesh, finding it
    /// through the environment so ARGS may end in `-- COMMAND`.
    fn berth(&self, args: &[&str]) -> Outcome {
        run(self.process.admin_command(args), COMMAND_DEADLINE)
    }

    /// Like [`Dev::berth`], and the command must succeed.
    fn ok(&self, args: &[&str]) -> String {
        self.berth(args).succeeded(args)
    }

    /// Like [`Dev::ok`] with `-o json` in front, parsed.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["-o", "json"];
        // Global flags go after the subcommand words, before any `--`.
        let split = args.iter().position(|a| a.starts_with('-')).unwrap_or(args.len());
        let (words, rest) = args.split_at(split);
        let mut full = words.to_vec();
        full.append(&mut all);
        full.extend_from_slice(rest);
        parse_json(args, &self.ok(&full))
    }

    /// Requests a lease for `command` with `flags`, as JSON; returns its id.
    fn request(&self, flags: &[&str], command: &[&str]) -> (String, Value) {
        let args = [&["lease", "request"][..], flags, &["--"], command].concat();
        let requested = self.json(&args);
        let id = requested["lease"]["leaseId"].as_str().unwrap().to_string();
        assert!(!id.is_empty(), "{requested}");
        (id, requested)
    }

    /// The lease as `lease get -o json` shows it.
    fn lease(&self, id: &str) -> Value {
        self.json(&["lease", "get", id])["lease"].clone()
    }

    /// Waits until the lease is in `phase` (a proto name) and returns it.
    fn await_phase(&self, id: &str, phase: &str) -> Value {
        poll(PHASE_DEADLINE, &format!("lease {id} reaches {phase}"), || {
            let lease = self.lease(id);
            if lease["phase"] == phase { Ok(lease) } else { Err(lease.to_string()) }
        })
    }
}

/// The value of the `Key:` line of a details view.
fn field(details: &str, key: &str) -> String {
    details
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("no {key} line in:\n{details}"))
}

/// Something no other test, or earlier run, puts on a command line.
fn unique() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{}{nanos:09}", std::process::id())
}

/// Pids of the processes on this machine whose command line holds `marker`.
fn processes_with(marker: &str) -> Vec<String> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().map_while(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // A process may end between the listing and the read.
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        if String::from_utf8_lossy(&cmdline).contains(marker) {
            pids.push(name);
        }
    }
    pids
}

#[test]
fn command_runs_to_done_and_its_output_listing_and_freed_capacity_show() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));

    // Table output: one row with the lease, where it went, and how it is.
    let args =
        ["lease", "request", "--owner", "t-done", "--wait", "--", "sh", "-c", "echo hello; echo oops >&2; exit 0"];
    let printed = dev.ok(&args);
    assert!(printed.starts_with("LEASE "), "a table with upper-case headers:\n{printed}");
    let id = printed.lines().nth(1).and_then(|l| l.split_whitespace().next()).unwrap().to_string();
    let cells = row(&printed, &id);
    assert_eq!(cells[1], dev.node_id, "{printed}");
    assert!(["RUNNING", "DONE"].contains(&cells[2]), "--wait returns once the lease runs or ends:\n{printed}");
    assert_eq!(cells[3], "1", "a fresh lease is at epoch 1:\n{printed}");

    let lease = dev.await_phase(&id, "LEASE_PHASE_DONE");
    assert_eq!(lease["exitCode"], 0, "an exit code of 0 is set, so shown: {lease}");
    assert_eq!(lease["owner"], "t-done", "{lease}");
    assert_eq!(lease["workload"]["command"], "sh", "{lease}");
    assert_eq!(lease["resources"]["cpuMillis"], "100", "--cpu defaults to 100m: {lease}");
    assert_eq!(lease["resources"]["memoryBytes"], (64u64 << 20).to_string(), "--memory defaults to 64Mi: {lease}");
    let details = dev.ok(&["lease", "get", &id]);
    assert_eq!(field(&details, "Phase"), "DONE", "{details}");
    assert_eq!(field(&details, "Exit code"), "0", "{details}");
    assert_eq!(field(&details, "Node"), dev.node_id, "{details}");
    assert_eq!(field(&details, "Command"), "sh -c 'echo hello; echo oops >&2; exit 0'", "{details}");

    // Each output to its own stream, byte for byte.
    let logs = dev.berth(&["logs", &id]);
    assert_eq!(logs.code, Some(0), "{logs:?}");
    assert_eq!(logs.stdout, "hello\n", "{logs:?}");
    assert_eq!(logs.stderr, "oops\n", "{logs:?}");
    let only_err = dev.berth(&["logs", &id, "--stderr-only"]);
    assert_eq!((only_err.stdout.as_str(), only_err.stderr.as_str()), ("", "oops\n"), "{only_err:?}");
    let only_out = dev.berth(&["logs", &id, "--stdout-only"]);
    assert_eq!((only_out.stdout.as_str(), only_out.stderr.as_str()), ("hello\n", ""), "{only_out:?}");

    let table = dev.ok(&["lease", "list"]);
    assert!(table.starts_with("LEASE "), "{table}");
    let listed = row(&table, &id);
    assert_eq!(
        &listed[..8],
        &[id.as_str(), "default", "t-done", dev.node_id.as_str(), "DONE", "1", "100m", "64Mi"],
        "{table}"
    );
    let done = dev.json(&["lease", "list", "--phase", "done", "--owner", "t-done"]);
    assert_eq!(done["leases"].as_array().unwrap().len(), 1, "{done}");
    let running = dev.json(&["lease", "list", "--phase", "running"]);
    assert!(running.get("leases").is_none(), "an empty list is left out, as grpcurl leaves it out: {running}");

    // The ended lease gave its compute back.
    let capacity = dev.ok(&["capacity"]);
    assert!(capacity.starts_with("NODE "), "{capacity}");
    let node = row(&capacity, &dev.node_id);
    assert_eq!(node[2], "UP", "{capacity}");
    let contained = rustix::process::geteuid().is_root();
    assert_eq!(node[3], if contained { "runc" } else { "process/uncontained" }, "what runs its workloads:\n{capacity}");
    assert_eq!((node[5], node[8], node[10]), ("0", "0", "0"), "nothing allocated, no open leases:\n{capacity}");
    assert_eq!(node[4], node[6], "all cpu is free:\n{capacity}");
    assert_eq!(node[7], node[9], "all memory is free:\n{capacity}");
}

#[test]
fn a_watch_prints_each_change_of_a_lease_as_it_happens() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));
    let owner = format!("t-watch-{}", unique());
    let mut watcher = dev.process.admin_command(&["lease", "list", "--watch", "-o", "json", "--owner", &owner]);
    let mut child = watcher.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let (lines, heard) = std::sync::mpsc::channel::<Value>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { return };
            if lines.send(serde_json::from_str(&line).unwrap()).is_err() {
                return;
            }
        }
    });
    let next = || heard.recv_timeout(PHASE_DEADLINE).expect("the watch printed nothing in time");
    // This owner holds nothing yet: up to date at once.
    assert_eq!(next()["kind"], "EVENT_KIND_SYNCED");

    // Each state it passes through is printed as the watch reads it, up to RUNNING.
    let (id, _) = dev.request(&["--owner", &owner, "--wait"], &["sleep", "300"]);
    let mut phases = Vec::new();
    while phases.last().map(String::as_str) != Some("LEASE_PHASE_RUNNING") {
        let event = next();
        assert_eq!(
            (event["kind"].as_str(), event["lease"]["leaseId"].as_str()),
            (Some("EVENT_KIND_UPSERT"), Some(id.as_str()))
        );
        phases.push(event["lease"]["phase"].as_str().unwrap().to_string());
    }

    dev.ok(&["lease", "release", &id, "--reason", "Done"]);
    let removed = next();
    assert_eq!(removed["kind"], "EVENT_KIND_REMOVED", "{removed}");
    assert_eq!(
        (removed["lease"]["phase"].as_str(), removed["lease"]["reason"].as_str()),
        (Some("LEASE_PHASE_RELEASED"), Some("Done"))
    );
    child.kill().unwrap();
    child.wait().unwrap();

    // The flags the stream cannot filter on are refused, naming them.
    let refused = dev.berth(&["lease", "list", "--watch", "--phase", "running"]);
    assert_eq!(refused.code, Some(2), "{refused:?}");
    assert!(refused.stderr.contains("--phase"), "{refused:?}");
}

#[test]
fn released_lease_stops_its_process() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));
    // A duration no other process has on its command line.
    let marker = format!("300.{}", unique());

    let (id, requested) =
        dev.request(&["--owner", "t-release", "--cpu", "0.25", "--memory", "32Mi", "--wait"], &["sleep", &marker]);
    assert_eq!(requested["lease"]["phase"], "LEASE_PHASE_RUNNING", "{requested}");
    assert_eq!(requested["created"], true, "{requested}");
    poll(PHASE_DEADLINE, "the workload's process runs", || {
        let pids = processes_with(&marker);
        if pids.is_empty() { Err("no process".into()) } else { Ok(pids) }
    });
    let capacity = dev.json(&["capacity"]);
    let node = &capacity["nodes"].as_array().unwrap().iter().find(|n| n["nodeId"] == dev.node_id.as_str()).unwrap();
    assert_eq!(node["allocated"]["cpuMillis"], "250", "64-bit integers are strings: {capacity}");
    assert_eq!(node["allocated"]["memoryBytes"], (32u64 << 20).to_string(), "{capacity}");
    assert_eq!(node["leases"], 1, "{capacity}");

    // Resized in place: its node applies the new size, the same process runs on.
    let pids = processes_with(&marker);
    let resized = dev.ok(&["lease", "resize", &id, "--memory", "64Mi", "--wait"]);
    assert!(resized.contains(&id) && resized.contains("applied"), "{resized}");
    assert!(field(&dev.ok(&["lease", "get", &id]), "Resize").ends_with("applied"), "as shown");
    assert_eq!(dev.lease(&id)["resources"]["memoryBytes"], (64u64 << 20).to_string());
    assert_eq!(processes_with(&marker), pids, "no restart");
    let too_big = dev.berth(&["lease", "resize", &id, "--cpu", "4096"]);
    assert_ne!(too_big.code, Some(0), "{too_big:?}");
    assert!(too_big.error_line().contains("cannot grow"), "{too_big:?}");

    let released = dev.ok(&["lease", "release", &id]);
    assert!(released.contains(&id) && released.contains("RELEASED"), "{released}");
    assert_eq!(dev.lease(&id)["phase"], "LEASE_PHASE_RELEASED");
    assert_eq!(row(&dev.ok(&["lease", "list"]), &id)[4], "RELEASED");
    poll(PHASE_DEADLINE, "the released workload's process is gone", || {
        let pids = processes_with(&marker);
        if pids.is_empty() { Ok(()) } else { Err(format!("still running: {pids:?}")) }
    });

    // Releasing again changes nothing and says so.
    let again = dev.json(&["lease", "release", &id]);
    assert_eq!(again["lease"]["phase"], "LEASE_PHASE_RELEASED", "{again}");
    assert_eq!(again["lease"]["reason"], "Released", "{again}");
}

#[test]
fn followed_logs_carry_every_line_and_end_with_the_lease() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));

    let script = "i=1; while [ $i -le 10 ]; do echo line-$i; i=$((i+1)); sleep 0.1; done";
    let (id, requested) = dev.request(&["--owner", "t-follow"], &["sh", "-c", script]);
    let phase = requested["lease"]["phase"].as_str().unwrap().to_string();
    assert!(["LEASE_PHASE_BOUND", "LEASE_PHASE_LAUNCHING", "LEASE_PHASE_RUNNING"].contains(&phase.as_str()), "{phase}");

    let followed = dev.berth(&["logs", &id, "-f"]);
    assert_eq!(followed.code, Some(0), "{followed:?}");
    let expected: String = (1..=10).map(|i| format!("line-{i}\n")).collect();
    assert_eq!(followed.stdout, expected, "{followed:?}");
    assert!(followed.stderr.is_empty(), "{followed:?}");
    // It followed the workload rather than printing what was there once.
    assert!(followed.took >= Duration::from_millis(500), "logs -f returned after {:?}", followed.took);
    dev.await_phase(&id, "LEASE_PHASE_DONE");

    // The tail of what is kept, once the lease is over.
    let tail = dev.berth(&["logs", &id, "--tail", "2"]);
    assert_eq!(tail.stdout, "line-9\nline-10\n", "{tail:?}");
}

#[test]
fn nonzero_exit_is_failed_with_its_code_in_table_and_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));
    let key = format!("k-{}", unique());

    // The code comes through --env, so the variable reached the command.
    let flags = ["--owner", "t-fail", "--project", "team-a", "--idempotency-key", &key, "--env", "CODE=3", "--wait"];
    let (id, requested) = dev.request(&flags, &["sh", "-c", "exit $CODE"]);
    assert_eq!(requested["lease"]["project"], "team-a", "{requested}");
    assert_eq!(requested["lease"]["idempotencyKey"], key.as_str(), "{requested}");

    let lease = dev.await_phase(&id, "LEASE_PHASE_FAILED");
    assert_eq!(lease["exitCode"], 3, "{lease}");
    assert_eq!(lease["workload"]["env"]["CODE"], "3", "{lease}");
    let details = dev.ok(&["lease", "get", &id]);
    assert_eq!(field(&details, "Phase"), "FAILED", "{details}");
    assert_eq!(field(&details, "Exit code"), "3", "{details}");
    assert_eq!(field(&details, "Project"), "team-a", "{details}");
    assert_eq!(field(&details, "Environment"), "CODE=3", "{details}");

    // The same key again is the same lease, not a second one.
    let again = dev.berth(&[
        "lease",
        "request",
        "--owner",
        "t-fail",
        "--project",
        "team-a",
        "--idempotency-key",
        &key,
        "--",
        "true",
    ]);
    assert_eq!(again.code, Some(0), "{again:?}");
    assert_eq!(row(&again.stdout, &id)[2], "FAILED", "{again:?}");
    assert!(again.stderr.contains("already made") && again.stderr.contains(&id), "{again:?}");

    // Listed under its project only, with its exit status.
    let team = dev.ok(&["lease", "list", "--project", "team-a"]);
    let listed = row(&team, &id);
    assert_eq!(listed[4], "FAILED", "{team}");
    assert!(team.lines().any(|l| l.starts_with(&id) && l.ends_with("(exit code 3)")), "{team}");
    let default = dev.json(&["lease", "list"]);
    assert!(default.get("leases").is_none(), "not in the default project: {default}");
    let all = dev.json(&["lease", "list", "--all-projects"]);
    assert_eq!(all["leases"].as_array().unwrap().len(), 1, "{all}");
}

#[test]
fn unknown_lease_is_not_found_and_an_unreachable_leases_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start(&tmp.path().join("data"));

    for args in [&["lease", "get", "lse-no-such"][..], &["lease", "release", "lse-no-such"], &["logs", "lse-no-such"]] {
        let out = dev.berth(args);
        let line = out.error_line();
        assert!(line.contains("not found") && line.contains("lse-no-such"), "berth {args:?}: {line}");
        assert!(out.stdout.is_empty(), "{out:?}");
    }

    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let line = dev.berth(&["lease", "list", "--leases-server", &closed]).error_line();
    assert!(line.starts_with(&format!("berth: error: cannot reach leases at {closed}: ")), "{line}");
}

#[test]
fn bad_quantities_and_flags_are_usage_errors() {
    for (args, says) in [
        (
            &["lease", "request", "--owner", "o", "--cpu", "2x", "--", "true"][..],
            "'2x' is not a cpu quantity (use 500m",
        ),
        (&["lease", "request", "--owner", "o", "--cpu", "0", "--", "true"], "--cpu"),
        (&["lease", "request", "--owner", "o", "--memory", "64Mb", "--", "true"], "'64Mb' is not a memory quantity"),
        (&["lease", "request", "--owner", "o", "--memory", "0Gi", "--", "true"], "--memory"),
        (&["lease", "request", "--owner", "o", "--env", "NOVALUE", "--", "true"], "--env"),
        (&["lease", "request", "--owner", "o"], "COMMAND"),
        (&["lease", "request", "--", "true"], "--owner"),
        (&["lease", "list", "--project", "a", "--all-projects"], "--all-projects"),
        (&["lease", "list", "--phase", "sideways"], "--phase"),
        (&["lease", "list", "--leases-server", "leases-without-port"], "--leases-server"),
        (&["logs", "l1", "--stdout-only", "--stderr-only"], "--stderr-only"),
        (&["logs", "l1", "--tail", "0"], "--tail"),
        (&["logs"], "LEASE_ID"),
    ] {
        let out = run(berth_command(args), COMMAND_DEADLINE);
        assert_eq!(out.code, Some(2), "berth {args:?}: {out:?}");
        assert!(out.stderr.contains("error:") && !out.stderr.contains("panicked"), "{}", out.stderr);
        assert!(out.stderr.contains(says), "berth {args:?} should say {says}: {}", out.stderr);
    }
    let cpu = run(berth_command(&["lease", "request", "--owner", "o", "--cpu", "2x", "--", "true"]), COMMAND_DEADLINE);
    assert!(cpu.stderr.contains("--cpu"), "the flag is named: {}", cpu.stderr);
}

#[test]
fn a_cache_volume_is_published_when_its_lease_succeeds_and_steered_with_berth_cache() {
    if !berth_testkit::runs_as_root("a cache volume's contained node") {
        return;
    }
    cache_volume_round(&[]);
}

/// The same in microVMs: each guest mounts its lease's view, shared over
/// virtio-fs, and what it wrote is what the node publishes.
#[test]
fn a_cache_volume_is_published_from_a_microvm_as_from_a_container() {
    if !berth_testkit::runs_as_root("a cache volume's microVM node") {
        return;
    }
    cache_volume_round(&["--runtime", "microvm", "--microvm-accel", "tcg"]);
}

/// Publishes, reuses, refuses and steers a cache volume on a `berth dev`
/// started with `dev_args`.
fn cache_volume_round(dev_args: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start_with(&tmp.path().join("data"), dev_args);
    let cache_line = |id: &str| field(&dev.ok(&["lease", "get", id]), "Cache");
    let settled = |id: &str, want: &str| {
        poll(PHASE_DEADLINE, &format!("lease {id}'s cache view to settle as {want:?}"), || {
            let line = cache_line(id);
            if line.contains(want) { Ok(line) } else { Err(line) }
        })
    };

    // The first finds it empty and publishes what it wrote.
    let (first, _) = dev.request(&["--owner", "ci", "--cache", "deps:/cache"], &["sh", "-c", "echo hello > /cache/f"]);
    dev.await_phase(&first, "LEASE_PHASE_DONE");
    settled(&first, "deps at /cache: miss from generation 0, published generation 1");
    let listed = dev.ok(&["cache", "list"]);
    let volume = row(&listed, "default");
    assert_eq!(volume[1..4], ["deps", "1", "1"], "{listed}");

    // The next starts from it, and one that fails publishes nothing.
    let (second, _) =
        dev.request(&["--owner", "ci", "--cache", "deps:/cache"], &["sh", "-c", "grep -qx hello /cache/f"]);
    dev.await_phase(&second, "LEASE_PHASE_DONE");
    settled(&second, "hit from generation 1, published generation 2");
    let (third, _) =
        dev.request(&["--owner", "ci", "--cache", "deps:/cache"], &["sh", "-c", "echo broken > /cache/f; exit 2"]);
    dev.await_phase(&third, "LEASE_PHASE_FAILED");
    settled(&third, "not published: WorkloadFailed");

    // Rolled back, shown, deleted.
    let rolled = dev.ok(&["cache", "rollback", "deps", "--to", "1"]);
    assert!(rolled.contains("new leases start from generation 1"), "{rolled}");
    let shown = dev.ok(&["cache", "get", "deps"]);
    assert_eq!(field(&shown, "Head"), "1", "{shown}");
    assert_eq!(field(&shown, "Generations"), "2", "{shown}");
    let missing = dev.berth(&["cache", "rollback", "deps", "--to", "9"]).error_line();
    assert!(missing.contains("generation 9 of cache volume default/deps not found"), "{missing}");
    let off = dev.ok(&["cache", "disable"]);
    assert!(off.contains("cache volumes of project default are off"), "{off}");
    let (fourth, _) = dev.request(&["--owner", "ci", "--cache", "deps:/cache"], &["sh", "-c", "test ! -e /cache/f"]);
    dev.await_phase(&fourth, "LEASE_PHASE_DONE");
    settled(&fourth, "not published: CacheDisabled");
    dev.ok(&["cache", "enable"]);
    let deleted = dev.ok(&["cache", "delete", "deps"]);
    assert!(deleted.contains("cache volume deps deleted"), "{deleted}");
    let gone = dev.berth(&["cache", "get", "deps"]).error_line();
    assert!(gone.contains("cache volume default/deps not found"), "{gone}");

    // A bad mount is a usage error naming it.
    let bad = dev.berth(&["lease", "request", "--owner", "ci", "--cache", "deps", "--", "true"]);
    assert_eq!(bad.code, Some(2), "{bad:?}");
    assert!(bad.stderr.contains("is not KEY:PATH[:COMMIT]"), "{bad:?}");
}

/// A microVM's workload asks the Workload API for its SVID with the SPIFFE
/// Python library, as a container's does: the guest's socket is relayed to
/// its lease's own on the node.
#[test]
fn a_microvm_fetches_its_svid_over_the_workload_api_with_the_spiffe_library() {
    if !berth_testkit::runs_as_root("a microVM node's workload identity") {
        return;
    }
    let spiffe_py = "/usr/local/lib/berth-spiffe-py";
    if !Path::new(spiffe_py).join("spiffe").is_dir() {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "no SPIFFE library in {spiffe_py}: scripts/test-deps.sh"
        );
        eprintln!("skipped: the SPIFFE Python library is not installed at {spiffe_py}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dev = Dev::start_with(&tmp.path().join("data"), &["--runtime", "microvm", "--microvm-accel", "tcg"]);
    let client = "import os\nfrom spiffe import WorkloadApiClient\nwith WorkloadApiClient() as client:\n    \
                  print(client.fetch_x509_svid().spiffe_id)\nprint(os.environ['SPIFFE_ENDPOINT_SOCKET'])\n\
                  print(open(os.environ['BERTH_IDENTITY_DIR'] + '/svid.pem').read().count('BEGIN CERTIFICATE'))";
    let pythonpath = format!("PYTHONPATH={spiffe_py}");
    let (id, _) =
        dev.request(&["--owner", "ci", "--cpu", "1", "--env", &pythonpath], &["/usr/bin/python3", "-S", "-c", client]);
    let ended = poll(Duration::from_secs(120), &format!("lease {id} to end"), || {
        let lease = dev.lease(&id);
        match lease["phase"].as_str() {
            Some("LEASE_PHASE_DONE" | "LEASE_PHASE_FAILED") => Ok(lease),
            _ => Err(lease.to_string()),
        }
    });
    let logs = dev.berth(&["logs", &id]);
    assert_eq!(ended["phase"], "LEASE_PHASE_DONE", "{ended}\n{logs:?}");
    let lines: Vec<&str> = logs.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{logs:?}");
    assert!(lines[0].starts_with("spiffe://") && lines[0].ends_with(&format!("/lease/{id}")), "{logs:?}");
    assert_eq!(lines[1..], ["unix:/berth-workload-api.sock", "1"], "{logs:?}");
}
