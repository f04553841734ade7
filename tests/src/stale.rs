//! Leftovers of runs that ended without cleaning up (the test process
//! killed by a timeout or a signal runs no destructor), removed when the
//! next mesh starts.
//!
//! # How a run is recognised
//! Every run has a directory `TMP/berth-e2e-*` holding an [`OWNER_FILE`]:
//! the test's pid and start time, the run id, and the node network's tag.
//! Every process a run starts works inside that directory (its services,
//! agents, PostgreSQL and Redis, and the agents' workloads in the agents'
//! data directories), so a run's processes are those whose working
//! directory lies in it.
//!
//! # What is removed
//! For a run whose test process is gone: every process working in its
//! directory (with its process group), the network namespaces its agents
//! made, its node namespaces and bridge, and the directory. A directory
//! without an owner file (one kept with `BERTH_E2E_KEEP=1`) is left alone.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use rustix::process::{Signal, kill_process, kill_process_group};

use crate::process::pid_of;
use crate::workloads::start_time;

/// The file in a run's directory that names the run's owner.
pub const OWNER_FILE: &str = "owner";

/// What every run directory's name starts with.
const RUN_DIR_PREFIX: &str = "berth-e2e-";

/// How long killed processes get to go before their directory is removed.
const KILL_SETTLE: Duration = Duration::from_millis(500);

/// Records this test process as the owner of run `run_id` in `dir`, with
/// the tag of its node network, if it has one.
pub(crate) fn write_owner(dir: &Path, run_id: &str, network_tag: Option<&str>) -> anyhow::Result<()> {
    let pid = std::process::id();
    let started = start_time(pid).context("cannot read this process's start time")?;
    let text = format!("{pid} {started} {run_id} {}\n", network_tag.unwrap_or("-"));
    std::fs::write(dir.join(OWNER_FILE), text).context("cannot write the run's owner file")
}

/// Makes `dir` a run no sweep removes (it is kept for a post-mortem).
pub(crate) fn disown(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(OWNER_FILE));
}

/// Removes what runs whose test process is gone left behind; describes
/// each run removed.
pub async fn sweep() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let dir = entry.path();
        let is_run = entry.file_name().to_str().is_some_and(|name| name.starts_with(RUN_DIR_PREFIX));
        let Some(owner) = is_run.then(|| std::fs::read_to_string(dir.join(OWNER_FILE)).ok()).flatten() else {
            continue;
        };
        let fields: Vec<&str> = owner.split_whitespace().collect();
        let [pid, started, run_id, tag] = fields.as_slice() else { continue };
        let (Ok(pid), Ok(started)) = (pid.parse::<u32>(), started.parse::<u64>()) else { continue };
        if start_time(pid) == Some(started) {
            continue;
        }
        let killed = kill_working_in(&dir);
        tokio::time::sleep(KILL_SETTLE).await;
        crate::netns::remove_agent_namespaces(&dir);
        if *tag != "-" {
            crate::netns::remove_node_network(tag);
        }
        let _ = std::fs::remove_dir_all(&dir);
        removed.push(format!("run {run_id} in {} ({killed} processes killed)", dir.display()));
    }
    removed
}

/// Kills every process whose working directory lies in `dir`, with its
/// process group when it leads one.
fn kill_working_in(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0 };
    let mut killed = 0;
    for pid in entries.filter_map(Result::ok).filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()) {
        let cwd: Option<PathBuf> = std::fs::read_link(format!("/proc/{pid}/cwd")).ok();
        if !cwd.is_some_and(|cwd| cwd.starts_with(dir)) || pid == std::process::id() {
            continue;
        }
        if let Ok(target) = pid_of(pid) {
            let leads_group = rustix::process::getpgid(Some(target)).is_ok_and(|group| group == target);
            if leads_group {
                let _ = kill_process_group(target, Signal::KILL);
            }
            let _ = kill_process(target, Signal::KILL);
            killed += 1;
        }
    }
    killed
}
