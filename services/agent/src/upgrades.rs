//! The agent's side of a fleet upgrade: taking the artifact a heartbeat
//! answer names, handing its binary to the detached updater
//! ([`crate::updater`]), and reporting what came of it on every heartbeat.
//!
//! # Expected flow
//! 1. A heartbeat answer names an upgrade ([`Upgrades::offer`]). One not
//!    seen before is taken: `DATA_DIR/upgrade-target.json` records it (the
//!    id, the artifact) and any earlier outcome is removed, then a task of
//!    its own does the rest, so the heartbeat loop never waits on it.
//! 2. The task pulls the artifact (a berth bundle, pinned to its digest and
//!    verified against it) into `DATA_DIR/agent-artifacts`, finds
//!    `berth-agent` at its root, asks it for its version and records that
//!    in the target.
//! 3. It asks for a heartbeat at once, so identity hears `upgrading` (and
//!    gives the node its upgrade grace) before this agent is stopped, then
//!    starts the updater and reads its acknowledgement.
//! 4. Whatever fails before the updater accepted is written as the outcome
//!    (`DATA_DIR/upgrade-result.json`, as the updater writes its own), so
//!    every report comes from the data directory: the agent that runs
//!    after the swap, new or rolled back, reports the same thing.
//!
//! # What a report says ([`Upgrades::report`])
//! With a target and an outcome for its version: `SUCCEEDED` or `FAILED`
//! with the reason. With a target and no outcome yet: `UPGRADING` (the
//! updater is at work, or the task is). With no target: nothing.
//!
//! # Refusals
//! An agent that cannot be restarted by an updater refuses at once, saying
//! why: one running inside another program (no command line of its own),
//! one in a Kubernetes pod (its DaemonSet's rolling update is its upgrade),
//! or one that is its container's first process (stopping it ends the
//! container, updater and all).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use berth_bundle::{BundleCache, BundleClient, BundleReference, CacheOptions, RegistryCredentials};
use berth_proto::identity::v1;
use tokio::sync::{Notify, watch};

use crate::updater::{self, Ack, UpgradeArgs, UpgradeResult};

/// The file the taken upgrade is recorded in.
const TARGET: &str = "upgrade-target.json";

/// Where pulled agent artifacts are kept.
const ARTIFACTS: &str = "agent-artifacts";

/// Disk the artifact cache may use before it evicts.
const ARTIFACT_BUDGET: u64 = 1 << 30;

/// How long asking the new binary for its version may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the task waits for the heartbeat that says `upgrading`.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a pull may take.
const PULL_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The binary an agent artifact holds at its root.
const BINARY: &str = "berth-agent";

/// The upgrade this node took, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Taken {
    upgrade_id: String,
    artifact: String,
    /// The new binary's version once known; empty before.
    version: String,
}

/// How an agent restarts into a new binary.
#[derive(Debug, Clone, Default)]
pub struct UpgradeSettings {
    /// The systemd unit the agent runs as; the updater restarts it through
    /// `systemctl restart`.
    pub systemd_unit: Option<String>,
    /// The agent's own command line, after the program name, to start the
    /// new binary with; empty for an agent running inside another program,
    /// which refuses upgrades.
    pub agent_args: Vec<String>,
    /// How long the new agent has to report in before it is rolled back.
    pub deadline: Duration,
}

/// The default for [`UpgradeSettings::deadline`].
pub const DEFAULT_UPGRADE_DEADLINE: Duration = Duration::from_secs(60);

/// The agent's upgrades; cheap to clone, clones share state.
#[derive(Clone)]
pub(crate) struct Upgrades {
    inner: Arc<Inner>,
}

struct Inner {
    data_dir: PathBuf,
    client: BundleClient,
    settings: UpgradeSettings,
    /// Whether a task is at an upgrade now.
    busy: Mutex<bool>,
    /// Asks the heartbeater for a beat now.
    beat_now: Notify,
    /// Counts heartbeats identity answered.
    beats: watch::Sender<u64>,
}

impl std::fmt::Debug for Upgrades {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upgrades").field("data_dir", &self.inner.data_dir).finish_non_exhaustive()
    }
}

impl Upgrades {
    pub(crate) fn new(data_dir: &Path, client: BundleClient, settings: UpgradeSettings) -> Self {
        let (beats, _) = watch::channel(0);
        Self {
            inner: Arc::new(Inner {
                data_dir: data_dir.to_path_buf(),
                client,
                settings,
                busy: Mutex::new(false),
                beat_now: Notify::new(),
                beats,
            }),
        }
    }

    /// Resolves when a task wants a heartbeat sent now.
    pub(crate) async fn beat_wanted(&self) {
        self.inner.beat_now.notified().await;
    }

    /// Tells waiting tasks that identity answered a heartbeat.
    pub(crate) fn answered(&self) {
        self.inner.beats.send_modify(|n| *n += 1);
    }

    /// What the next heartbeat says: whether the node is upgrading, and
    /// its report (see the module docs).
    pub(crate) fn report(&self) -> (bool, Option<v1::NodeUpgradeReport>) {
        let Some(taken) = read_taken(&self.inner.data_dir) else { return (false, None) };
        let outcome = UpgradeResult::read(&self.inner.data_dir).filter(|r| r.version == taken.version);
        let (state, reason) = match &outcome {
            Some(result) if result.state == "succeeded" => (v1::NodeUpgradeState::Succeeded, String::new()),
            Some(result) => (v1::NodeUpgradeState::Failed, result.reason.clone()),
            None => (v1::NodeUpgradeState::Upgrading, String::new()),
        };
        let upgrading = state == v1::NodeUpgradeState::Upgrading;
        let version = if state == v1::NodeUpgradeState::Succeeded { taken.version } else { String::new() };
        (upgrading, Some(v1::NodeUpgradeReport { upgrade_id: taken.upgrade_id, state: state as i32, reason, version }))
    }

    /// Takes the upgrade a heartbeat answer names, unless it was taken
    /// already or one is under way (see the module docs).
    pub(crate) fn offer(&self, target: &v1::NodeUpgradeTarget, running_version: &str) {
        if read_taken(&self.inner.data_dir).is_some_and(|t| t.upgrade_id == target.upgrade_id) {
            return;
        }
        {
            let mut busy = self.inner.busy.lock().unwrap_or_else(PoisonError::into_inner);
            if *busy {
                return;
            }
            *busy = true;
        }
        let taken =
            Taken { upgrade_id: target.upgrade_id.clone(), artifact: target.artifact.clone(), version: String::new() };
        tracing::info!(upgrade_id = %taken.upgrade_id, artifact = %taken.artifact, "taking an agent upgrade");
        let _ = std::fs::remove_file(self.inner.data_dir.join(updater::RESULT));
        if let Err(error) = write_json(&self.inner.data_dir, TARGET, &taken) {
            tracing::warn!(%error, "cannot record the upgrade taken; it is asked for again");
            *self.inner.busy.lock().unwrap_or_else(PoisonError::into_inner) = false;
            return;
        }
        let (this, running) = (self.clone(), running_version.to_owned());
        tokio::spawn(async move {
            let outcome = this.run(taken.clone(), &running).await;
            if let Err(reason) = outcome {
                tracing::warn!(upgrade_id = %taken.upgrade_id, %reason, "agent upgrade failed");
                let version = read_taken(&this.inner.data_dir).map(|t| t.version).unwrap_or_default();
                let result = UpgradeResult { version, state: "failed".into(), reason };
                if let Err(error) = write_json(&this.inner.data_dir, updater::RESULT, &result) {
                    tracing::warn!(%error, "cannot record the upgrade's failure");
                }
            }
            *this.inner.busy.lock().unwrap_or_else(PoisonError::into_inner) = false;
            this.inner.beat_now.notify_one();
        });
    }

    /// Pulls, checks and hands over to the updater; `Err` says why it failed.
    async fn run(&self, mut taken: Taken, running_version: &str) -> Result<(), String> {
        let settings = &self.inner.settings;
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return Err(
                "this agent runs in a Kubernetes pod: upgrade it by rolling its DaemonSet to the new image".into()
            );
        }
        if settings.systemd_unit.is_none() && settings.agent_args.is_empty() {
            return Err("this agent runs inside another program, which no updater can restart".into());
        }
        if settings.systemd_unit.is_none() && std::process::id() == 1 {
            return Err("this agent is its container's first process, whose exit ends the container: \
                upgrade it by running the new image"
                .into());
        }
        let binary = self.pull(&taken.artifact).await?;
        let version = said_version(&binary).await?;
        taken.version.clone_from(&version);
        write_json(&self.inner.data_dir, TARGET, &taken).map_err(|e| format!("cannot record the upgrade: {e}"))?;
        if version == running_version {
            let result = UpgradeResult { version, state: "succeeded".into(), reason: String::new() };
            return write_json(&self.inner.data_dir, updater::RESULT, &result)
                .map_err(|e| format!("cannot record the outcome: {e}"));
        }
        let sha256 = updater::sha256_of(&binary).map_err(|e| format!("cannot read {}: {e}", binary.display()))?;
        self.announce().await;
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this agent's own binary: {e}"))?;
        let args = UpgradeArgs {
            data_dir: self.inner.data_dir.clone(),
            binary,
            sha256,
            version: version.clone(),
            agent_pid: std::process::id(),
            deadline: settings.deadline,
            unit: settings.systemd_unit.clone(),
            agent_args: settings.agent_args.clone(),
        };
        match updater::start(&exe, &args).await? {
            Ack::Accepted => {
                tracing::info!(upgrade_id = %taken.upgrade_id, %version, "the updater took over");
                Ok(())
            }
            Ack::Refused(reason) => Err(format!("refused: {reason}")),
        }
    }

    /// Pulls the artifact and returns its binary's path.
    async fn pull(&self, artifact: &str) -> Result<PathBuf, String> {
        let reference = BundleReference::parse(artifact).map_err(|e| format!("the artifact '{artifact}': {e}"))?;
        if reference.digest().is_none() || !reference.is_registry() {
            return Err(format!("the artifact '{artifact}' is not a registry reference pinned to a digest"));
        }
        let options = CacheOptions { budget_bytes: ARTIFACT_BUDGET, ..CacheOptions::default() };
        let cache = BundleCache::open(self.inner.data_dir.join(ARTIFACTS), options)
            .await
            .map_err(|e| format!("cannot open the artifact cache: {e}"))?;
        let pulled = tokio::time::timeout(
            PULL_TIMEOUT,
            cache.pull(&self.inner.client, &reference, &RegistryCredentials::Anonymous),
        )
        .await
        .map_err(|_| format!("pulling {artifact} took longer than {PULL_TIMEOUT:?}"))?
        .map_err(|e| format!("cannot pull {artifact}: {e}"))?;
        let binary = pulled.definition().root.join(BINARY);
        if !binary.is_file() {
            return Err(format!("the artifact {artifact} holds no {BINARY} at its root"));
        }
        Ok(binary)
    }

    /// Sends a heartbeat now (saying `upgrading`) and waits for identity's
    /// answer, for at most [`ANNOUNCE_TIMEOUT`].
    async fn announce(&self) {
        let mut beats = self.inner.beats.subscribe();
        beats.borrow_and_update();
        self.inner.beat_now.notify_one();
        if tokio::time::timeout(ANNOUNCE_TIMEOUT, beats.changed()).await.is_err() {
            tracing::warn!("identity did not answer the heartbeat saying this node upgrades; going on");
        }
    }
}

/// What `binary --version` says its version is (its last word).
async fn said_version(binary: &Path) -> Result<String, String> {
    let run = tokio::process::Command::new(binary).arg("--version").stdin(std::process::Stdio::null()).output();
    let output = tokio::time::timeout(VERSION_TIMEOUT, run)
        .await
        .map_err(|_| format!("{} --version did not answer within {VERSION_TIMEOUT:?}", binary.display()))?
        .map_err(|e| format!("{} does not run on this host: {e}", binary.display()))?;
    let said = String::from_utf8_lossy(&output.stdout);
    match said.split_whitespace().last() {
        Some(version) if output.status.success() && version.len() <= 64 => Ok(version.to_owned()),
        _ => Err(format!("{} --version says '{}' ({})", binary.display(), said.trim(), output.status)),
    }
}

fn read_taken(data_dir: &Path) -> Option<Taken> {
    serde_json::from_slice(&std::fs::read(data_dir.join(TARGET)).ok()?).ok()
}

/// Writes `value` as `name` in `data_dir`, whole or not at all.
fn write_json<T: serde::Serialize>(data_dir: &Path, name: &str, value: &T) -> std::io::Result<()> {
    berth_core::write_json_atomically(&data_dir.join(name), value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upgrades(dir: &Path, settings: UpgradeSettings) -> Upgrades {
        let client = BundleClient::new(berth_bundle::RegistryConfig::default()).unwrap();
        Upgrades::new(dir, client, settings)
    }

    #[tokio::test]
    async fn reports_come_from_the_data_directory() {
        let dir = tempfile::tempdir().unwrap();
        let up = upgrades(dir.path(), UpgradeSettings::default());
        assert_eq!(up.report(), (false, None), "no upgrade taken");
        let taken = Taken { upgrade_id: "up-1".into(), artifact: "r/a@sha256:00".into(), version: "2.0".into() };
        write_json(dir.path(), TARGET, &taken).unwrap();
        let (upgrading, report) = up.report();
        assert!(upgrading);
        assert_eq!(report.unwrap().state(), v1::NodeUpgradeState::Upgrading);
        // An outcome for another version is not this upgrade's.
        let stale = UpgradeResult { version: "1.0".into(), state: "failed".into(), reason: "old".into() };
        write_json(dir.path(), updater::RESULT, &stale).unwrap();
        assert!(up.report().0);
        let done = UpgradeResult { version: "2.0".into(), state: "succeeded".into(), reason: String::new() };
        write_json(dir.path(), updater::RESULT, &done).unwrap();
        let (upgrading, report) = up.report();
        let report = report.unwrap();
        assert!(!upgrading);
        assert_eq!((report.state(), report.version.as_str()), (v1::NodeUpgradeState::Succeeded, "2.0"));
    }

    #[tokio::test]
    async fn an_agent_that_cannot_be_restarted_refuses_saying_why() {
        let dir = tempfile::tempdir().unwrap();
        let up = upgrades(dir.path(), UpgradeSettings::default());
        let target = v1::NodeUpgradeTarget { upgrade_id: "up-2".into(), artifact: "127.0.0.1:9/a@sha256:00".into() };
        up.offer(&target, "1.0");
        let report = berth_testkit::eventually("the refusal", Duration::from_secs(10), || async {
            up.report().1.filter(|r| r.state() == v1::NodeUpgradeState::Failed).ok_or("not yet")
        })
        .await;
        assert_eq!(report.upgrade_id, "up-2");
        assert!(report.reason.contains("inside another program") || report.reason.contains("Kubernetes"), "{report:?}");
        // The same upgrade offered again is not taken again.
        up.offer(&target, "1.0");
        assert_eq!(up.report().1.unwrap().reason, report.reason);
    }
}
