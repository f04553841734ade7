//! What a runtime adds to starting a workload, measured at the provider:
//! `Provider::launch` of `sleep` under the chosen runtime, one at a time,
//! beside two baselines taken in the same run on the same machine: a raw
//! `fork+exec` of the same program (spawn until `/proc/<pid>/exe` is the
//! program), and, for an OCI runtime binary, the same runtime's own
//! `run --detach` of an equivalent bundle with nothing of berth around it.
//! The process runtime is this executable itself (see
//! `berth_agent::runtime_main_if_invoked`), so it has no bare run of its own:
//! the raw spawn is its baseline.
//!
//! # Expected flow
//! The provider and the bare bundles live in a directory of the run's own,
//! removed at the end; every workload started is destroyed (or killed and
//! deleted) before the next figure is taken, so no run leaves one behind.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use berth_agent::{
    ContainerProvider, ContainerSettings, DEFAULT_PIDS_LIMIT, InstanceMeta, LaunchSpec, OciRuntime, ProcessProvider,
    ProcessTiming, Program, Provider, Resources, UidRange, WorkloadRoot,
};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::load::{Figures, Samples};

/// The program every launch starts.
const PROGRAM: &str = "/bin/sleep";

/// Its argument: longer than any run.
const SLEEP_SECONDS: &str = "600";

/// How long one start may take before it counts as failed.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The host directories the bare bundle shows, as the provider does.
const SYSTEM_DIRS: [&str; 5] = ["/usr", "/bin", "/sbin", "/lib", "/lib64"];

/// The memory each bench workload reserves.
const MEMORY: u64 = 64 << 20;

/// The runtimes `berth-bench launch --runtime` compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum BenchRuntime {
    /// The process runtime: contained by the agent itself, no runtime binary.
    Process,
    /// Plain host processes, contained by nothing.
    Uncontained,
    /// Containers through runc.
    Runc,
    /// gVisor sandboxes through runsc.
    Runsc,
    /// Containers through crun (cgroup v2 hosts).
    Crun,
}

impl BenchRuntime {
    /// The OCI runtime, for the container ones.
    pub(crate) fn oci(self) -> Option<OciRuntime> {
        match self {
            BenchRuntime::Process => Some(OciRuntime::Own),
            BenchRuntime::Uncontained => None,
            BenchRuntime::Runc => Some(OciRuntime::Runc),
            BenchRuntime::Runsc => Some(OciRuntime::Runsc),
            BenchRuntime::Crun => Some(OciRuntime::Crun),
        }
    }

    /// Its name.
    pub(crate) fn name(self) -> &'static str {
        self.oci().map_or("uncontained", OciRuntime::name)
    }
}

/// The provider's launches beside their baselines.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RuntimeLaunch {
    /// `Provider::launch` → the workload runs.
    pub(crate) provider: Figures,
    /// A raw `fork+exec` of the same program.
    pub(crate) raw_spawn: Figures,
    /// The runtime's own `run --detach` of an equivalent bundle; `None` for
    /// the process runtime.
    pub(crate) bare_runtime: Option<Figures>,
}

/// Why the comparison could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RuntimeLaunchError {
    /// The runtime's binary is not installed.
    #[error("{0} is not installed (make test installs it)")]
    Missing(&'static str),
    /// Containers need root.
    #[error("launching through {0} needs root")]
    NotRoot(&'static str),
    /// A file or directory of the run could not be made.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Runs `count` launches of each kind under `runtime`.
pub(crate) async fn measure(runtime: BenchRuntime, count: u32) -> Result<RuntimeLaunch, RuntimeLaunchError> {
    let dir =
        tempfile::tempdir().map_err(|source| RuntimeLaunchError::Io { what: "cannot make a directory", source })?;
    let binary = match runtime.oci() {
        Some(oci) => {
            if !rustix::process::geteuid().is_root() {
                return Err(RuntimeLaunchError::NotRoot(oci.name()));
            }
            Some(oci.binary().ok_or(RuntimeLaunchError::Missing(oci.name()))?)
        }
        None => None,
    };
    let raw_spawn = raw_spawns(count).await;
    let bare_runtime = match (runtime.oci(), &binary) {
        (Some(oci), Some(binary)) if oci != OciRuntime::Own => {
            Some(bare_runs(oci, binary, count, &dir.path().join("bare")).await?)
        }
        _ => None,
    };
    let provider = provider_launches(runtime, binary, count, &dir.path().join("provider")).await;
    Ok(RuntimeLaunch { provider, raw_spawn, bare_runtime })
}

/// Spawns the program and waits until it has exec'd, `count` times.
async fn raw_spawns(count: u32) -> Figures {
    let mut samples = Samples::default();
    let started = Instant::now();
    for _ in 0..count {
        let sent = Instant::now();
        match tokio::process::Command::new(PROGRAM).arg(SLEEP_SECONDS).kill_on_drop(true).spawn() {
            Ok(mut child) => {
                let exe = format!("/proc/{}/exe", child.id().unwrap_or(0));
                let execd = wait_until(|| std::fs::read_link(&exe).is_ok_and(|p| p.ends_with("sleep"))).await;
                if execd {
                    samples.ok(sent.elapsed())
                } else {
                    samples.error()
                }
                let _ = child.kill().await;
            }
            Err(_) => samples.error(),
        }
    }
    samples.figures(started.elapsed(), 1)
}

/// The runtime's own `run --detach` of a bundle like the provider's: the
/// host's system directories read-only, the same user, no capabilities,
/// the same memory limit.
async fn bare_runs(oci: OciRuntime, binary: &Path, count: u32, dir: &Path) -> Result<Figures, RuntimeLaunchError> {
    let io = |what| move |source| RuntimeLaunchError::Io { what, source };
    let bundle = dir.join("bundle");
    std::fs::create_dir_all(bundle.join("rootfs")).map_err(io("cannot make the bare bundle"))?;
    // A merged /usr's links, as the provider makes them.
    for dir in SYSTEM_DIRS {
        if let Ok(target) = std::fs::read_link(dir) {
            std::os::unix::fs::symlink(target, bundle.join("rootfs").join(dir.trim_start_matches('/')))
                .map_err(io("cannot link a system directory into the bare bundle"))?;
        }
    }
    std::fs::write(bundle.join("config.json"), bare_spec(&bundle.join("rootfs")).to_string())
        .map_err(io("cannot write the bare bundle's spec"))?;
    let state = dir.join("state");
    let runtime = |args: &[&str]| {
        let mut command = tokio::process::Command::new(binary);
        command.arg("--root").arg(&state);
        if oci == OciRuntime::Runsc {
            command.arg("--network=host");
        }
        command.args(args).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null());
        command.stderr(std::process::Stdio::null());
        command
    };
    let mut samples = Samples::default();
    let started = Instant::now();
    for index in 0..count {
        let id = format!("berth-bench-bare-{}-{index}", std::process::id());
        let sent = Instant::now();
        let bundle_arg = bundle.display().to_string();
        let run = runtime(&["run", "--detach", "--bundle", &bundle_arg, &id]).status().await;
        match run {
            Ok(status) if status.success() => samples.ok(sent.elapsed()),
            _ => samples.error(),
        }
        let _ = runtime(&["kill", &id, "KILL"]).status().await;
        let _ = runtime(&["delete", "--force", &id]).status().await;
    }
    Ok(samples.figures(started.elapsed(), 1))
}

/// A runtime spec equivalent to what the provider writes for the bench's
/// workload, built from the runtime's own defaults.
fn bare_spec(rootfs: &Path) -> serde_json::Value {
    let bind = |dir: &str| {
        serde_json::json!({"destination": dir, "type": "bind", "source": dir,
        "options": ["rbind", "ro", "nosuid", "nodev"]})
    };
    let mut mounts = vec![
        serde_json::json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        serde_json::json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
    ];
    for dir in SYSTEM_DIRS {
        if Path::new(dir).is_dir() && std::fs::read_link(dir).is_err() {
            mounts.push(bind(dir));
        }
    }
    let cgroup = format!("/berth-bench-{}", std::process::id());
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 300_000, "gid": 300_000},
            "args": ["/usr/bin/sleep", SLEEP_SECONDS],
            "env": ["PATH=/usr/bin:/bin"],
            "cwd": "/",
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
            "noNewPrivileges": true
        },
        "root": {"path": rootfs, "readonly": true},
        "hostname": "bench",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}],
            "resources": {"memory": {"limit": MEMORY, "swap": MEMORY}, "pids": {"limit": DEFAULT_PIDS_LIMIT}},
            "cgroupsPath": cgroup
        }
    })
}

/// `Provider::launch` of the program, `count` times, each destroyed before
/// the next.
async fn provider_launches(runtime: BenchRuntime, binary: Option<PathBuf>, count: u32, dir: &Path) -> Figures {
    let stop = CancellationToken::new();
    let timing = ProcessTiming { stop_grace: Duration::from_secs(2), exit_poll: Duration::from_millis(50) };
    let provider: Box<dyn Provider> = match (runtime.oci(), binary) {
        (Some(oci), Some(binary)) => {
            let settings = ContainerSettings {
                runtime: oci,
                binary,
                uids: UidRange { first: 300_000, count: 1000 },
                pids_limit: DEFAULT_PIDS_LIMIT,
                timing,
            };
            Box::new(ContainerProvider::new(dir, settings, stop.clone()))
        }
        _ => Box::new(ProcessProvider::new(dir, timing, stop.clone())),
    };
    let mut samples = Samples::default();
    let started = Instant::now();
    for index in 0..count {
        let spec = LaunchSpec {
            lease_id: format!("bench-{index}"),
            epoch: 1,
            node_id: "bench".into(),
            root: WorkloadRoot::Host,
            program: Program::Command(PROGRAM.into()),
            args: vec![SLEEP_SECONDS.into()],
            env: Default::default(),
            ports: Vec::new(),
            resources: Resources { cpu_millis: 1000, memory_bytes: MEMORY },
            network: None,
            meta: InstanceMeta::default(),
            image: Default::default(),
        };
        let sent = Instant::now();
        match tokio::time::timeout(START_TIMEOUT, provider.launch(spec)).await {
            Ok(Ok(launched)) if launched.record.pid.is_some() => samples.ok(sent.elapsed()),
            _ => samples.error(),
        }
        let lease_id = format!("bench-{index}");
        let _ = provider.destroy(&lease_id).await;
        let _ = provider.remove(&lease_id).await;
    }
    let figures = samples.figures(started.elapsed(), 1);
    stop.cancel();
    figures
}

/// Polls `check` every 100 µs for up to [`START_TIMEOUT`].
async fn wait_until(mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + START_TIMEOUT;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_micros(100)).await;
    }
    false
}
