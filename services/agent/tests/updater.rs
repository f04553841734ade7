//! The detached updater (`berth-agent host-upgrade`, the real binary) as
//! the agent starts it: it acknowledges on its fd 3 pipe, installs the new
//! binary beside the old one, switches, restarts the agent and waits for it
//! to report the new version; a new binary that does not come up is rolled
//! back within the deadline, and a binary that is not the one announced is
//! refused with nothing changed.
//!
//! The agents here are small scripts that behave as an agent does towards
//! its updater (report their version in `DATA_DIR/reported-version` once
//! up, then run), so each case is about the updater alone.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use berth_agent::updater::{self, Ack, UpgradeArgs, UpgradeResult};
use berth_testkit::eventually;

const AGENT: &str = env!("CARGO_BIN_EXE_berth-agent");

/// An "agent" of `version`: says it with `--version`; else reports it once
/// up, then runs until stopped.
fn agent_script(dir: &Path, name: &str, version: &str) -> PathBuf {
    script(dir, name, &format!("{}echo \"{version} $$\" > \"$1/reported-version\"\nexec sleep 600\n", says(version)))
}

/// The start of a script answering `--version` as an agent does.
fn says(version: &str) -> String {
    format!("if [ \"$1\" = --version ]; then echo \"berth-agent {version}\"; exit 0; fi\n")
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A data directory whose agent runs `old` from `agent-bin/current`, as an
/// agent installed by its updater does; the running agent.
async fn installed(data: &Path, old: &Path) -> Child {
    let sha = updater::sha256_of(old).unwrap();
    let dir = data.join(updater::BIN_DIR).join(&sha);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(old, dir.join("berth-agent")).unwrap();
    std::os::unix::fs::symlink(format!("{sha}/berth-agent"), data.join(updater::BIN_DIR).join(updater::CURRENT))
        .unwrap();
    let agent = Command::new(data.join(updater::BIN_DIR).join(updater::CURRENT)).arg(data).spawn().unwrap();
    wait_reported(data, "1.0").await;
    agent
}

/// A host whose data directory's agent runs version 1.0, installed as an
/// updater installs it: the scratch directory, the data directory, the agent.
async fn host_running_1_0() -> (tempfile::TempDir, PathBuf, Child) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let old = installed(&data, &agent_script(tmp.path(), "old", "1.0")).await;
    (tmp, data, old)
}

/// The pid of the agent that reported `version`, once one has.
async fn wait_reported(data: &Path, version: &str) -> u32 {
    wait_reported_by_other(data, version, 0).await
}

/// Waits for `version` reported by a process other than `not`: the report
/// of an agent the updater stopped may still be in the file.
async fn wait_reported_by_other(data: &Path, version: &str, not: u32) -> u32 {
    let file = data.join(updater::REPORTED_VERSION);
    eventually(&format!("{version} to be reported"), Duration::from_secs(20), || async {
        let says = std::fs::read_to_string(&file).unwrap_or_default();
        let mut words = says.split_whitespace();
        match (words.next(), words.next().and_then(|pid| pid.parse().ok())) {
            (Some(said), Some(pid)) if said == version && pid != not => Ok(pid),
            _ => Err(says.clone()),
        }
    })
    .await
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

fn current(data: &Path) -> PathBuf {
    std::fs::read_link(data.join(updater::BIN_DIR).join(updater::CURRENT)).unwrap()
}

fn upgrade(data: &Path, binary: &Path, sha256: String, agent: u32) -> UpgradeArgs {
    UpgradeArgs {
        data_dir: data.to_path_buf(),
        binary: binary.to_path_buf(),
        sha256,
        version: "2.0".into(),
        agent_pid: agent,
        deadline: Duration::from_secs(10),
        unit: None,
        agent_args: vec![data.display().to_string()],
    }
}

async fn outcome(data: &Path) -> UpgradeResult {
    eventually("the updater to leave its outcome", Duration::from_secs(60), || async {
        let lock = data.join("upgrade.lock");
        match UpgradeResult::read(data) {
            Some(result) if !lock.exists() => Ok(result),
            other => Err(other),
        }
    })
    .await
}

fn kill(pid: u32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

#[tokio::test]
async fn an_upgrade_switches_to_the_new_binary_and_restarts_the_agent_which_reports_it() {
    let (tmp, data, mut old) = host_running_1_0().await;
    let new = agent_script(tmp.path(), "new", "2.0");
    let sha = updater::sha256_of(&new).unwrap();

    let ack = updater::start(Path::new(AGENT), &upgrade(&data, &new, sha.clone(), old.id())).await.unwrap();
    assert_eq!(ack, Ack::Accepted);
    let result = outcome(&data).await;
    assert_eq!((result.version.as_str(), result.state.as_str()), ("2.0", "succeeded"), "{result:?}");
    assert_eq!(current(&data), Path::new(&sha).join("berth-agent"), "current names the new binary");
    let pid = wait_reported(&data, "2.0").await;
    assert!(alive(pid), "the new agent runs, detached from the updater");
    let _ = old.wait();
    assert!(!alive(old.id()), "the old agent was stopped");
    // The old binary stays beside the new one, for a rollback.
    assert_eq!(std::fs::read_dir(data.join(updater::BIN_DIR)).unwrap().count(), 3);
    kill(pid);
}

#[tokio::test]
async fn a_new_binary_that_exits_at_once_is_rolled_back_and_the_old_agent_started_again() {
    let (tmp, data, mut old) = host_running_1_0().await;
    let before = current(&data);
    let broken = script(tmp.path(), "broken", &format!("{}exit 3\n", says("2.0")));
    let sha = updater::sha256_of(&broken).unwrap();

    let ack = updater::start(Path::new(AGENT), &upgrade(&data, &broken, sha, old.id())).await.unwrap();
    assert_eq!(ack, Ack::Accepted);
    let result = outcome(&data).await;
    assert_eq!(result.state, "failed", "{result:?}");
    assert!(result.reason.contains("exited") && result.reason.contains("rolled back"), "{result:?}");
    assert_eq!(current(&data), before, "current names the old binary again");
    let _ = old.wait();
    let pid = wait_reported_by_other(&data, "1.0", old.id()).await;
    assert!(alive(pid));
    kill(pid);
}

#[tokio::test]
async fn a_binary_that_is_not_the_one_announced_is_refused_and_nothing_changes() {
    let (tmp, data, mut old) = host_running_1_0().await;
    let before = current(&data);
    let new = agent_script(tmp.path(), "new", "2.0");

    let wrong = "0".repeat(64);
    let ack = updater::start(Path::new(AGENT), &upgrade(&data, &new, wrong.clone(), old.id())).await.unwrap();
    let Ack::Refused(reason) = ack else { panic!("{ack:?}") };
    assert!(reason.contains(&format!("not {wrong}")), "{reason}");
    assert_eq!(current(&data), before);
    assert!(alive(old.id()), "the running agent was left alone");
    assert!(updater::UpgradeResult::read(&data).is_none(), "a refusal leaves no outcome to report");

    // Nor a binary of another release than announced.
    let older = agent_script(tmp.path(), "older", "1.5");
    let sha = updater::sha256_of(&older).unwrap();
    let ack = updater::start(Path::new(AGENT), &upgrade(&data, &older, sha, old.id())).await.unwrap();
    assert!(matches!(&ack, Ack::Refused(reason) if reason.contains("says 'berth-agent 1.5'")), "{ack:?}");

    // Nor an upgrade while another updater holds the lock.
    std::fs::write(data.join("upgrade.lock"), format!("{}\n", std::process::id())).unwrap();
    let sha = updater::sha256_of(&new).unwrap();
    let ack = updater::start(Path::new(AGENT), &upgrade(&data, &new, sha, old.id())).await.unwrap();
    assert!(matches!(&ack, Ack::Refused(reason) if reason.contains("already in progress")), "{ack:?}");
    old.kill().unwrap();
    let _ = old.wait();
}
