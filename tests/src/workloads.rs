//! What actually runs: the workloads the agents started, found in `/proc`
//! rather than asked of anyone, so a test can compare the control plane's
//! records with the truth, even for a node that is cut off or frozen.
//!
//! # How a workload is recognised
//! Every lease and service template a test makes carries the variable
//! [`RUN_MARKER_ENV`] set to the test's run id, and the agent passes a
//! lease's variables to its workload beside `BERTH_LEASE_ID`,
//! `BERTH_NODE_ID` and `BERTH_REVISION`. A workload is a marked process
//! whose parent is not a marked process of the same lease: what a workload
//! forks is not another workload, whether the agent started it as a
//! process group of its own or in a container under an init (whose child
//! is the lease's program).

use std::collections::BTreeMap;
use std::path::Path;

use rustix::process::{Signal, kill_process, kill_process_group};

use crate::process::pid_of;

/// The variable that marks a test run's workloads.
pub const RUN_MARKER_ENV: &str = "BERTH_E2E_RUN";

/// One workload process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// Its pid.
    pub pid: u32,
    /// When it started, in clock ticks since boot (`/proc/<pid>/stat` field
    /// 22): with the pid, it names the process even if the pid is reused.
    pub start_time: u64,
    /// `BERTH_LEASE_ID`.
    pub lease_id: String,
    /// `BERTH_NODE_ID`: the node the agent that started it ran as.
    pub node_id: String,
    /// `BERTH_REVISION`, for a service's replica.
    pub revision: Option<String>,
}

/// Every live workload of run `run_id`.
pub fn scan(run_id: &str) -> Vec<Workload> {
    let marker = format!("{RUN_MARKER_ENV}={run_id}");
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let marked: Vec<(Workload, u32)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| read_workload(pid, &marker))
        .collect();
    let lease_of: BTreeMap<u32, String> = marked.iter().map(|(w, _)| (w.pid, w.lease_id.clone())).collect();
    let mut found: Vec<Workload> = marked
        .into_iter()
        .filter(|(workload, parent)| lease_of.get(parent) != Some(&workload.lease_id))
        .map(|(workload, _)| workload)
        .collect();
    found.sort_by_key(|w| w.pid);
    found
}

/// The workloads of run `run_id`, by lease id.
pub fn by_lease(run_id: &str) -> BTreeMap<String, Vec<Workload>> {
    let mut leases: BTreeMap<String, Vec<Workload>> = BTreeMap::new();
    for workload in scan(run_id) {
        leases.entry(workload.lease_id.clone()).or_default().push(workload);
    }
    leases
}

/// Kills every workload of run `run_id`, with everything in its group.
pub fn kill_all(run_id: &str) -> usize {
    let workloads = scan(run_id);
    for workload in &workloads {
        if let Ok(pid) = pid_of(workload.pid) {
            let _ = kill_process_group(pid, Signal::KILL);
            let _ = kill_process(pid, Signal::KILL);
        }
    }
    workloads.len()
}

/// The marked process `pid` and its parent's pid.
fn read_workload(pid: u32, marker: &str) -> Option<(Workload, u32)> {
    let dir = Path::new("/proc").join(pid.to_string());
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    // The command name is in parentheses and may hold anything; the fields
    // after its closing parenthesis are plain.
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // fields[0] is the state (field 3), fields[1] the parent (4), fields[19]
    // the start time (22).
    let (state, parent, start_time) = (fields.first()?, fields.get(1)?, fields.get(19)?);
    if *state == "Z" {
        return None;
    }
    let environ = std::fs::read(dir.join("environ")).ok()?;
    let mut variables = BTreeMap::new();
    let mut marked = false;
    for entry in environ.split(|b| *b == 0) {
        let entry = String::from_utf8_lossy(entry);
        if entry == marker {
            marked = true;
        }
        if let Some((key, value)) = entry.split_once('=') {
            variables.insert(key.to_string(), value.to_string());
        }
    }
    if !marked {
        return None;
    }
    let workload = Workload {
        pid,
        start_time: start_time.parse().ok()?,
        lease_id: variables.remove("BERTH_LEASE_ID")?,
        node_id: variables.remove("BERTH_NODE_ID").unwrap_or_default(),
        revision: variables.remove("BERTH_REVISION").filter(|r| !r.is_empty()),
    };
    Some((workload, parent.parse().ok()?))
}

/// When process `pid` started, in clock ticks since boot; `None` once it is gone.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(19)?.parse().ok()
}
