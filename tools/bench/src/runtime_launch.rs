//! What a runtime adds to starting a workload, measured at the provider:
//! `Provider::launch` of `sleep` under the chosen runtime, one at a time,
//! beside baselines taken in the same run on the same machine: a raw
//! `fork+exec` of the same program (spawn until `/proc/<pid>/exe` is the
//! program), and, for an OCI runtime binary, the same runtime's own
//! `run --detach` with nothing of berth around it, twice: of a minimal
//! bundle (the host's system directories, the same user and limits), and
//! of a copy of the very bundle the provider wrote for its first launch
//! (its root, mounts, masked paths and init). The second is what berth's
//! own overhead is measured against: the first also counts what the
//! container berth asks for costs the runtime to build.
//! The process runtime (`berth-runtime` where it is built beside this
//! executable, else this executable itself, see
//! `berth_agent::runtime_main_if_invoked`) has no bare run of its own: the
//! raw spawn is its baseline.
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
    /// The runtime's own `run --detach` of a minimal bundle; `None` for
    /// the process runtime.
    pub(crate) bare_runtime: Option<Figures>,
    /// The runtime's own `run --detach` of a copy of the provider's bundle;
    /// `None` for the process runtime.
    pub(crate) same_bundle: Option<Figures>,
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
    let bare = match (runtime.oci(), &binary) {
        (Some(oci), Some(binary)) if oci != OciRuntime::Own => Some((oci, binary.clone())),
        _ => None,
    };
    let bare_runtime = match &bare {
        Some((oci, binary)) => {
            let bare_dir = dir.path().join("bare");
            let bundle = minimal_bundle(&bare_dir)?;
            Some(bare_runs(*oci, binary, count, &bundle, &bare_dir.join("state")).await)
        }
        None => None,
    };
    let same_dir = dir.path().join("same");
    let copy_to = bare.as_ref().map(|_| same_dir.join("bundle"));
    let (provider, copied) =
        provider_launches(runtime, binary, count, &dir.path().join("provider"), copy_to.as_deref()).await;
    let same_bundle = match (&bare, copied) {
        (Some((oci, binary)), Some(copied)) => {
            let bundle = copied
                .map_err(|source| RuntimeLaunchError::Io { what: "cannot copy the provider's bundle", source })?;
            Some(bare_runs(*oci, binary, count, &bundle, &same_dir.join("state")).await)
        }
        _ => None,
    };
    Ok(RuntimeLaunch { provider, raw_spawn, bare_runtime, same_bundle })
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

/// A minimal bundle in `dir`: the host's system directories read-only, the
/// same user, no capabilities, the same memory limit.
fn minimal_bundle(dir: &Path) -> Result<PathBuf, RuntimeLaunchError> {
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
    Ok(bundle)
}

/// Copies the bundle the provider wrote for a running lease (`container`,
/// under the provider's directory `provider`) into `into`, so the runtime
/// can run the very same container bare: its root, mounts, masked paths,
/// user, limits and init. Only the paths of what it mounts from the
/// provider's directory (copied too) and its cgroup change.
fn copy_bundle(container: &Path, provider: &Path, into: &Path) -> std::io::Result<PathBuf> {
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(container.join("config.json"))?)?;
    let rootfs = into.join("rootfs");
    copy_tree(&container.join("rootfs"), &rootfs)?;
    spec["root"]["path"] = rootfs.display().to_string().into();
    if let Some(mounts) = spec["mounts"].as_array_mut() {
        for mount in mounts {
            let Some(source) = mount["source"].as_str().map(PathBuf::from) else { continue };
            let Ok(rest) = source.strip_prefix(provider) else { continue };
            let copy = into.join("sources").join(rest);
            copy_tree(&source, &copy)?;
            mount["source"] = copy.display().to_string().into();
        }
    }
    spec["linux"]["cgroupsPath"] = format!("/berth-bench-same-{}", std::process::id()).into();
    std::fs::write(into.join("config.json"), serde_json::to_vec_pretty(&spec)?)?;
    Ok(into.to_path_buf())
}

/// Copies a file, a link or a whole directory from `from` to `to`.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(from)?;
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent)?;
    }
    if meta.is_symlink() {
        return std::os::unix::fs::symlink(std::fs::read_link(from)?, to);
    }
    if !meta.is_dir() {
        return std::fs::copy(from, to).map(|_| ());
    }
    std::fs::create_dir_all(to)?;
    std::fs::set_permissions(to, meta.permissions())?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        copy_tree(&entry.path(), &to.join(entry.file_name()))?;
    }
    Ok(())
}

/// The runtime's own `run --detach` of `bundle`, `count` times, each killed
/// and deleted before the next; its state under `state`.
async fn bare_runs(oci: OciRuntime, binary: &Path, count: u32, bundle: &Path, state: &Path) -> Figures {
    let runtime = |args: &[&str]| {
        let mut command = tokio::process::Command::new(binary);
        command.arg("--root").arg(state);
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
    samples.figures(started.elapsed(), 1)
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
/// the next; with `copy_to`, the first launch's bundle is copied there
/// while it runs (see [`copy_bundle`]).
async fn provider_launches(
    runtime: BenchRuntime,
    binary: Option<PathBuf>,
    count: u32,
    dir: &Path,
    copy_to: Option<&Path>,
) -> (Figures, Option<std::io::Result<PathBuf>>) {
    let mut copied = None;
    let stop = CancellationToken::new();
    let timing = ProcessTiming { stop_grace: Duration::from_secs(2), exit_poll: Duration::from_millis(50) };
    let provider: Box<dyn Provider> = match (runtime.oci(), binary) {
        (Some(oci), Some(binary)) => {
            let settings = ContainerSettings::new(oci, binary, UidRange { first: 300_000, count: 1000 }, timing);
            Box::new(ContainerProvider::new(dir, settings, stop.clone()))
        }
        _ => Box::new(ProcessProvider::new(dir, timing, stop.clone())),
    };
    let mut samples = Samples::default();
    let started = Instant::now();
    for index in 0..count {
        let spec = sleep_spec(&format!("bench-{index}"));
        let sent = Instant::now();
        match tokio::time::timeout(START_TIMEOUT, provider.launch(spec)).await {
            Ok(Ok(launched)) if launched.record.pid.is_some() => samples.ok(sent.elapsed()),
            _ => samples.error(),
        }
        let lease_id = format!("bench-{index}");
        if let Some(into) = copy_to.filter(|_| copied.is_none()) {
            // The provider keeps each lease's bundle in `containers/<lease>`.
            copied = Some(copy_bundle(&dir.join("containers").join(&lease_id), dir, into));
        }
        let _ = provider.destroy(&lease_id).await;
        let _ = provider.remove(&lease_id).await;
    }
    let figures = samples.figures(started.elapsed(), 1);
    stop.cancel();
    (figures, copied)
}

/// A lease `lease_id` running [`PROGRAM`] from the host's files, with a
/// core and [`MEMORY`].
pub(crate) fn sleep_spec(lease_id: &str) -> LaunchSpec {
    LaunchSpec {
        lease_id: lease_id.to_owned(),
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
        identity: None,
        caches: Vec::new(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copied_bundle_runs_from_the_copy_with_everything_else_as_the_provider_wrote_it() {
        let tmp = tempfile::tempdir().unwrap();
        let provider = tmp.path().join("provider");
        let container = provider.join("containers/bench-0");
        let work = provider.join("leases/bench-0");
        std::fs::create_dir_all(container.join("rootfs/etc")).unwrap();
        std::fs::write(container.join("rootfs/etc/hostname"), "bench-0\n").unwrap();
        std::os::unix::fs::symlink("usr/bin", container.join("rootfs/bin")).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        std::fs::write(work.join("note"), "kept").unwrap();
        let spec = serde_json::json!({
            "root": {"path": container.join("rootfs"), "readonly": true},
            "process": {"args": ["/usr/bin/tini-static", "--", "/bin/sleep", "600"]},
            "mounts": [
                {"destination": "/berth/work", "type": "bind", "source": work, "options": ["rbind"]},
                {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
                {"destination": "/proc", "type": "proc", "source": "proc"},
            ],
            "linux": {"cgroupsPath": "/berth-0000/bench-0", "maskedPaths": ["/proc/kcore"]},
        });
        std::fs::write(container.join("config.json"), spec.to_string()).unwrap();

        let into = tmp.path().join("same/bundle");
        let bundle = copy_bundle(&container, &provider, &into).unwrap();
        let copied: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
        assert_eq!(copied["root"]["path"], into.join("rootfs").display().to_string());
        assert_eq!(std::fs::read_to_string(into.join("rootfs/etc/hostname")).unwrap(), "bench-0\n");
        assert_eq!(std::fs::read_link(into.join("rootfs/bin")).unwrap(), Path::new("usr/bin"));
        let work_copy = into.join("sources/leases/bench-0");
        assert_eq!(copied["mounts"][0]["source"], work_copy.display().to_string());
        assert_eq!(std::fs::read_to_string(work_copy.join("note")).unwrap(), "kept");
        assert_eq!(copied["mounts"][1]["source"], "/usr", "a host path stays the host's");
        assert_eq!(copied["mounts"][2], spec["mounts"][2]);
        assert_eq!(copied["process"], spec["process"]);
        assert_eq!(copied["linux"]["maskedPaths"], spec["linux"]["maskedPaths"]);
        assert_ne!(
            copied["linux"]["cgroupsPath"], spec["linux"]["cgroupsPath"],
            "the bare run has a cgroup of its own"
        );
    }
}
