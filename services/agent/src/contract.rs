//! The provider contract: what every [`Provider`] must do, run against each
//! of them (plain uncontained processes, the container provider under the
//! process runtime and every OCI runtime installed here, and microVMs), as the
//! store's contract suite runs against every store. Then the hostile-workload suite: what a contained workload
//! tries and must fail at, run against every containing provider.
//!
//! A runtime needs root and its binary; without root a test is skipped, but
//! with `CI=true` a missing runtime or missing root fails it instead, so CI
//! never passes by skipping.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use berth_proto::types::v1::Readiness;
use berth_testkit::eventually;
use tokio_util::sync::CancellationToken;

use crate::container::{ContainerProvider, ContainerSettings, DEFAULT_PIDS_LIMIT, OciRuntime, UidRange};
use crate::dial::Dialer;
use crate::process::ProcessProvider;
use crate::provider::{
    Exit, ExitStatus, ExitWatch, LaunchSpec, NetworkAttachment, ProcessTiming, Program, Provider, ProviderError,
    ResizeAsk, Resized, Resources, Settlement, WorkloadRoot, WorkloadSignal,
};
use crate::testdir::TestDir;

/// How long the suite waits for a workload: longer than the kit's
/// `PATIENCE`, since under an OCI runtime (gVisor above all) a workload takes
/// seconds to start, answer and be torn down on a loaded machine.
const SLOW: Duration = Duration::from_secs(30);

/// What a guest under QEMU's translator takes for the same: it forks and
/// executes every program of a fork bomb on one emulated CPU, its programs
/// read from the node's shared `/usr`.
const VM_SLOW: Duration = Duration::from_secs(120);

/// How many processes a microVM's workload may have here. The guest holds
/// it to its limit as it would to the default 1,024, but under QEMU's
/// translator each process a fork bomb starts costs milliseconds: 1,024 of
/// them took a minute alone and over [`VM_SLOW`] beside the rest of the
/// suite.
const VM_PIDS_LIMIT: i64 = 128;

fn timing() -> ProcessTiming {
    ProcessTiming { stop_grace: Duration::from_secs(2), exit_poll: Duration::from_millis(20) }
}

/// Which provider a test runs against.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Uncontained,
    Oci(OciRuntime),
    /// QEMU microVMs under its translator (no `/dev/kvm` needed): what `make
    /// test` installs (`scripts/microvm-deps.sh`) and builds (`make vminit`)
    /// must be there, or the test fails naming it.
    MicroVm,
}

/// The executable that acts as the process runtime: `berth-runtime`, as it
/// ships beside the agent, which the workspace's test run builds beside
/// this test binary. (The agent's own executable acting as the runtime is
/// what the egress runner's tests run.)
fn own_runtime_binary() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let dir = if dir.ends_with("deps") { dir.parent()? } else { dir };
    Some(dir.join(crate::container::OWN_ARG0)).filter(|path| path.is_file())
}

/// A provider of `kind` on `dir`, or `None` when this machine cannot run it
/// and the test may be skipped (never under `CI=true`).
fn provider(kind: Kind, dir: &Path) -> Option<Arc<dyn Provider>> {
    provider_until(kind, dir, CancellationToken::new())
}

/// [`provider`], whose waiting tasks stop on `stop` as an agent's do.
fn provider_until(kind: Kind, dir: &Path, stop: CancellationToken) -> Option<Arc<dyn Provider>> {
    match kind {
        Kind::Uncontained => Some(Arc::new(ProcessProvider::new(dir, timing(), stop))),
        Kind::Oci(runtime) => Some(container_provider(runtime, runtime_binary(runtime)?, dir, stop)),
        Kind::MicroVm => {
            let config = crate::microvm::MicroVmConfig {
                accel: crate::microvm::MicroVmAccel::Tcg,
                ..crate::microvm::MicroVmConfig::default()
            };
            let mut settings = crate::microvm::MicroVmSettings::from_config(&config, timing())
                .unwrap_or_else(|missing| panic!("microVMs cannot run here: {missing}"));
            settings.pids_limit = VM_PIDS_LIMIT;
            Some(Arc::new(crate::microvm::MicroVmProvider::new(dir, settings, stop)))
        }
    }
}

/// The binary of `runtime`, or `None` when this machine cannot run it and
/// the test may be skipped (never under `CI=true`).
fn runtime_binary(runtime: OciRuntime) -> Option<std::path::PathBuf> {
    if !berth_testkit::runs_as_root(&format!("the {runtime} provider")) {
        return None;
    }
    let binary = if runtime == OciRuntime::Own { own_runtime_binary() } else { runtime.binary() };
    if !berth_testkit::needs(binary.is_some(), &format!("{runtime} (make test installs it and builds berth-runtime)")) {
        return None;
    }
    binary
}

fn container_provider(
    runtime: OciRuntime,
    binary: std::path::PathBuf,
    dir: &Path,
    stop: CancellationToken,
) -> Arc<dyn Provider> {
    let settings = ContainerSettings::new(runtime, binary, UidRange { first: 300_000, count: 1000 }, timing());
    Arc::new(ContainerProvider::new(dir, settings, stop))
}

fn spec(lease_id: &str, script: &str) -> LaunchSpec {
    LaunchSpec::for_test(lease_id, script)
}

async fn ended(watch: &mut ExitWatch) -> Exit {
    let exit = tokio::time::timeout(SLOW, watch.wait_for(Option::is_some)).await.expect("the workload never ended");
    exit.unwrap().unwrap()
}

/// Launches `spec` and waits for it to end well; its stderr (for the
/// assertions that follow).
async fn ran_to_success(provider: &dyn Provider, spec: LaunchSpec) -> String {
    let lease_id = spec.lease_id.clone();
    let mut launched = provider.launch(spec).await.unwrap();
    let status = ended(&mut launched.exit).await.status;
    let errors = std::fs::read_to_string(provider.log_files(&lease_id).unwrap().stderr).unwrap_or_default();
    assert!(status.success(), "{status:?}: {errors}");
    errors
}

fn stdout_of(provider: &dyn Provider, lease_id: &str) -> String {
    std::fs::read_to_string(provider.log_files(lease_id).unwrap().stdout).unwrap_or_default()
}

/// Waits until the stdout of `lease_id` holds `text`; `what` names the wait.
async fn printed(what: &str, provider: &dyn Provider, lease_id: &str, text: &str) {
    eventually(what, SLOW, || async {
        let stdout = stdout_of(provider, lease_id);
        if stdout.contains(text) { Ok(()) } else { Err(stdout) }
    })
    .await;
}

/// Waits until no process on the host has `needle` in its command line;
/// `what` names the wait.
async fn none_left(what: &str, needle: &str) {
    eventually(what, SLOW, || async {
        let left = host_processes(needle);
        if left.is_empty() { Ok(()) } else { Err(left) }
    })
    .await;
}

/// Every process on the host whose command line contains `needle`.
fn host_processes(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmdline).replace('\0', " ").contains(needle) {
            found.push(pid);
        }
    }
    found
}

macro_rules! contract {
    ($($name:ident => $kind:expr;)*) => {$(
        mod $name {
            use super::*;

            #[tokio::test]
            async fn runs_a_command_keeps_its_exit_code_and_output() {
                runs_a_command_keeps_its_exit_code_and_output_on($kind).await
            }

            #[tokio::test]
            async fn gives_the_workload_its_own_environment_and_nothing_of_the_agents() {
                gives_the_workload_its_own_environment_on($kind).await
            }

            #[tokio::test]
            async fn destroy_reaches_everything_the_workload_started() {
                destroy_reaches_everything_on($kind).await
            }

            #[tokio::test]
            async fn a_workload_that_ignores_sigterm_is_killed_after_the_grace() {
                ignores_sigterm_on($kind).await
            }

            #[tokio::test]
            async fn a_restarted_provider_adopts_what_runs_and_finds_what_ended() {
                adopts_on($kind).await
            }

            #[tokio::test]
            async fn signals_reach_the_workload_and_stats_are_read() {
                signals_and_stats_on($kind).await
            }

            #[tokio::test]
            async fn unusable_leases_are_refused_before_anything_starts() {
                refuses_on($kind).await
            }

            #[tokio::test]
            async fn a_recycled_pid_is_neither_adopted_nor_signalled() {
                recycled_pid_on($kind).await
            }

            #[tokio::test]
            async fn an_image_root_runs_copy_on_write_is_adopted_after_a_restart_or_is_refused() {
                image_root_on($kind).await
            }

            #[tokio::test]
            async fn an_image_user_is_the_workloads_own_ids_given_what_the_image_gave_it() {
                image_user_on($kind).await
            }

            #[tokio::test]
            async fn the_identity_directory_is_the_workloads_alone_read_only_with_its_socket() {
                identity_on($kind).await
            }

            #[tokio::test]
            async fn a_resize_changes_the_running_workloads_limits_and_a_shrink_below_its_use_is_deferred() {
                resize_on($kind).await
            }

            #[tokio::test]
            async fn a_workload_is_ready_on_its_port_only_once_it_listens_there() {
                ready_once_listening_on($kind).await
            }
        }
    )*};
}

contract! {
    uncontained => Kind::Uncontained;
    process => Kind::Oci(OciRuntime::Own);
    runc => Kind::Oci(OciRuntime::Runc);
    runsc => Kind::Oci(OciRuntime::Runsc);
    microvm => Kind::MicroVm;
}

async fn runs_a_command_keeps_its_exit_code_and_output_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let mut launched = provider.launch(spec("lease-a", "echo out; echo oops >&2; exit 3")).await.unwrap();
    let errors = std::fs::read_to_string(provider.log_files("lease-a").unwrap().stderr).unwrap_or_default();
    assert!(launched.record.pid.is_some(), "a started workload has a pid: {errors}");
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(3));
    let logs = provider.log_files("lease-a").unwrap();
    assert_eq!(std::fs::read_to_string(&logs.stdout).unwrap(), "out\n");
    assert!(std::fs::read_to_string(&logs.stderr).unwrap().contains("oops"));

    let mut good = provider.launch(spec("lease-b", "exit 0")).await.unwrap();
    assert!(ended(&mut good.exit).await.status.success());
    provider.settle("lease-b", Settlement::default()).await.unwrap();
    provider.remove("lease-b").await.unwrap();
    assert!(matches!(provider.log_files("lease-b"), Err(ProviderError::NotFound(_))));
}

/// An unpacked image root, as the bundle cache leaves one: the host's
/// static busybox as `/bin/busybox` with `sh` linked to it, a `/www` the
/// image makes world-writable, and a file only root may write.
fn image_root(dir: &Path) {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", dir.join("bin/sh")).unwrap();
    std::fs::create_dir_all(dir.join("www")).unwrap();
    std::fs::set_permissions(dir.join("www"), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    std::fs::write(dir.join("www/index.html"), "shared\n").unwrap();
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

async fn image_user_on(kind: Kind) {
    use berth_bundle::{ImageUser, OwnedPath};
    use std::os::unix::fs::MetadataExt as _;
    if matches!(kind, Kind::Uncontained) {
        return; // Runs no image at all (see `image_root_on`).
    }
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let root = tmp.path().join("image-root");
    image_root(&root);
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:App:/home/app:/bin/sh\n")
        .unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\napp:x:1000:\n").unwrap();
    std::fs::create_dir_all(root.join("home/app")).unwrap();
    std::fs::write(root.join("home/app/data.txt"), "from the image\n").unwrap();
    // A hostile image: an owned path through a link to a host directory.
    let host = tmp.path().join("host-dir");
    std::fs::create_dir_all(&host).unwrap();
    std::fs::write(host.join("victim"), "host\n").unwrap();
    std::os::unix::fs::symlink(&host, root.join("escape")).unwrap();
    let owned = |path: &str| OwnedPath { path: path.into(), owner: true, group: true };
    let account = ImageUser {
        name: Some("app".into()),
        uid: 1000,
        gid: 1000,
        group: Some("app".into()),
        home: Some("/home/app".into()),
        owned: vec![owned("home/app"), owned("home/app/data.txt"), owned("escape/victim"), owned("escape")],
    };
    let script = "id -u; id -un; id -gn; echo \"$HOME\"; echo more >> data.txt && cat data.txt; \
                  touch /home/app/new && echo created; echo x > /etc/passwd 2>/dev/null || echo refused";
    let mut spec = spec("lease-user", script);
    spec.root = WorkloadRoot::Image {
        dir: root.clone(),
        digest: "sha256:test".into(),
        working_dir: "/home/app".into(),
        account: Some(Arc::new(account)),
    };
    spec.program = Program::Command("sh".into());
    spec.env.insert("PATH".into(), "/bin".into());
    let errors = ran_to_success(provider.as_ref(), spec).await;
    let out = stdout_of(provider.as_ref(), "lease-user");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines.get(1..),
        Some(&["app", "app", "/home/app", "from the image", "more", "created", "refused"][..]),
        "the workload is the image's account, owns its home and nothing of root's: {errors}"
    );
    let uid: u32 = lines[0].parse().unwrap();
    if matches!(kind, Kind::MicroVm) {
        assert_eq!(uid, 1000, "the image's own uid, in a kernel of its own");
    } else {
        assert!(uid >= 200_000, "its own uid on the host, never the image's 1000: {uid}");
    }

    let shared = std::fs::metadata(root.join("home/app/data.txt")).unwrap();
    assert_eq!(
        (shared.uid(), std::fs::read_to_string(root.join("home/app/data.txt")).unwrap()),
        (0, "from the image\n".into())
    );
    let victim = std::fs::symlink_metadata(host.join("victim")).unwrap();
    assert_eq!(victim.uid(), 0, "nothing outside the root is given away");
    assert_eq!(std::fs::symlink_metadata(root.join("escape")).unwrap().uid(), 0);
    provider.settle("lease-user", Settlement::default()).await.unwrap();
    provider.remove("lease-user").await.unwrap();
}

async fn image_root_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let root = tmp.path().join("image-root");
    image_root(&root);
    let script = "pwd; echo written > new.html; cat new.html; ls /usr 2>&1 | head -1; \
                  echo root > /etc-owned 2>/dev/null || echo refused";
    let mut spec = spec("lease-image", script);
    spec.root = WorkloadRoot::Image {
        dir: root.clone(),
        digest: "sha256:test".into(),
        working_dir: "/www".into(),
        account: None,
    };
    spec.program = Program::Command("sh".into());
    spec.env.insert("PATH".into(), "/bin".into());
    if matches!(kind, Kind::Uncontained) {
        let refused = provider.launch(spec).await.unwrap_err();
        assert!(refused.to_string().contains("nodes that contain their workloads"), "{refused}");
        return;
    }
    ran_to_success(provider.as_ref(), spec).await;
    let out = stdout_of(provider.as_ref(), "lease-image");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"/www"), "the image's working directory: {out}");
    assert_eq!(lines.get(1), Some(&"written"), "a world-writable directory of the image is writable: {out}");
    assert!(lines.get(2).is_some_and(|l| l.contains("No such file")), "nothing of the host's /usr: {out}");
    assert_eq!(lines.last(), Some(&"refused"), "root-owned directories stay closed to the workload: {out}");
    assert_eq!(
        std::fs::read_to_string(root.join("www/index.html")).unwrap(),
        "shared\n",
        "the shared root is untouched"
    );

    provider.settle("lease-image", Settlement::default()).await.unwrap();
    provider.remove("lease-image").await.unwrap();
    let overlays = || {
        let mounted = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        mounted.lines().filter(|line| line.contains(tmp.path().to_str().unwrap())).count()
    };
    assert_eq!(overlays(), 0, "the lease's overlay is unmounted with it");

    // An image workload is adopted across an agent restart like any other,
    // its overlay still under it, and destroying it then unmounts it.
    drop(provider);
    let stopped = CancellationToken::new();
    let Some(first) = provider_until(kind, tmp.path(), stopped.clone()) else { return };
    let mut long = self::spec("lease-long", "echo up; exec sleep 1000");
    long.root = WorkloadRoot::Image {
        dir: root.clone(),
        digest: "sha256:test".into(),
        working_dir: String::new(),
        account: None,
    };
    long.program = Program::Command("sh".into());
    long.env.insert("PATH".into(), "/bin".into());
    let running = first.launch(long).await.unwrap();
    printed("the image workload to be up", first.as_ref(), "lease-long", "up").await;
    stopped.cancel();
    drop(first);
    let Some(second) = self::provider(kind, tmp.path()) else { return };
    let recovered = second.recover().await.unwrap();
    let adopted = recovered.iter().find(|l| l.record.lease_id == "lease-long").expect("adopted");
    assert_eq!(adopted.record.pid, running.record.pid, "the same workload, not a new one");
    assert!(adopted.exit.borrow().is_none(), "it still runs");
    if !matches!(kind, Kind::MicroVm) {
        assert_eq!(overlays(), 1, "its overlay is still mounted under it");
    }
    let mut exit = adopted.exit.clone();
    second.destroy("lease-long").await.unwrap();
    ended(&mut exit).await;
    second.settle("lease-long", Settlement::default()).await.unwrap();
    second.remove("lease-long").await.unwrap();
    assert_eq!(overlays(), 0, "destroyed and removed, its overlay is gone");
}

async fn gives_the_workload_its_own_environment_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let mut with_ports = spec("lease-env", "env | sort; pwd");
    with_ports.ports = vec!["http".into(), "admin-api".into()];
    let mut launched = provider.launch(with_ports).await.unwrap();
    assert!(ended(&mut launched.exit).await.status.success());
    let meta = &launched.record.meta;
    assert!(meta.port > 0 && meta.ports.len() == 2, "{meta:?}");
    let out = stdout_of(provider.as_ref(), "lease-env");
    for expected in [
        "BERTH_LEASE_ID=lease-env".to_string(),
        "BERTH_NODE_ID=n-1".into(),
        "GREETING=hello".into(),
        format!("PORT={}", meta.port),
        format!("BERTH_PORT_ADMIN_API={}", meta.ports["admin-api"]),
    ] {
        assert!(out.lines().any(|line| line == expected), "{expected} in {out}");
    }
    assert!(!out.contains("CARGO"), "nothing of the agent's environment: {out}");
}

/// A workload is shown its identity directory (`svids`): it reads the
/// files, dials the Workload API socket through `$SPIFFE_ENDPOINT_SOCKET`,
/// and, contained, can change nothing in it.
async fn identity_on(kind: Kind) {
    use std::io::Write as _;
    use std::os::unix::fs::DirBuilderExt as _;
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let dir = tmp.path().join("svids").join("lease-id");
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).unwrap();
    std::fs::write(dir.join("svid.pem"), "the certificate\n").unwrap();
    let listener = std::os::unix::net::UnixListener::bind(dir.join(crate::svids::SOCKET_FILE)).unwrap();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().map_while(Result::ok) {
            let _ = stream.write_all(b"the workload api\n");
        }
    });
    let script = r#"cat "$BERTH_IDENTITY_DIR/svid.pem"
if touch "$BERTH_IDENTITY_DIR/svid.pem" 2>/dev/null || touch "$BERTH_IDENTITY_DIR/planted" 2>/dev/null; then echo writable; fi
/usr/bin/python3 -S -c 'import os, socket
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["SPIFFE_ENDPOINT_SOCKET"].removeprefix("unix:"))
print(s.recv(64).decode(), end="")'"#;
    let mut with_identity = spec("lease-id", script);
    with_identity.identity = Some(dir.clone());
    if matches!(kind, Kind::MicroVm) {
        // A guest has the files, shared read-only; a socket on the host is nothing it can open.
        let files = "cat \"$BERTH_IDENTITY_DIR/svid.pem\"; touch \"$BERTH_IDENTITY_DIR/planted\" 2>/dev/null && \
                     echo writable; echo \"${SPIFFE_ENDPOINT_SOCKET:-no socket}\"";
        let mut files_only = spec("lease-id", files);
        files_only.identity = Some(dir.clone());
        ran_to_success(provider.as_ref(), files_only).await;
        assert_eq!(stdout_of(provider.as_ref(), "lease-id"), "the certificate\nno socket\n");
        use std::os::unix::fs::MetadataExt as _;
        let (owner, range) = (std::fs::metadata(&dir).unwrap().uid(), UidRange::default());
        assert!(
            (range.first..range.first + range.count).contains(&owner),
            "the directory is given to a user of the workload range, as a container's is, not {owner}"
        );
        assert!(!dir.join("planted").exists());
        return;
    }
    ran_to_success(provider.as_ref(), with_identity).await;
    let out = stdout_of(provider.as_ref(), "lease-id");
    assert!(out.starts_with("the certificate\n"), "{out}");
    assert!(out.ends_with("the workload api\n"), "{out}");
    if provider.runtime().contained {
        assert!(!out.contains("writable"), "a contained workload changes nothing of its identity: {out}");
        use std::os::unix::fs::MetadataExt as _;
        let owner = std::fs::metadata(&dir).unwrap().uid();
        assert_ne!(owner, 0, "the directory is given to the workload's own user");
        assert_eq!(std::fs::metadata(dir.join(crate::svids::SOCKET_FILE)).unwrap().uid(), owner);

        // A container image's workload finds the same, the socket linked
        // at the top of the image's own root.
        let root = tmp.path().join("image-root");
        image_root(&root);
        let script = r#"cat "$BERTH_IDENTITY_DIR/svid.pem"; echo "$SPIFFE_ENDPOINT_SOCKET"
test -S /berth-workload-api.sock && echo "a socket""#;
        let mut image = spec("lease-id-image", script);
        image.root =
            WorkloadRoot::Image { dir: root, digest: "sha256:test".into(), working_dir: String::new(), account: None };
        image.program = Program::Command("sh".into());
        image.env.insert("PATH".into(), "/bin".into());
        image.identity = Some(dir);
        ran_to_success(provider.as_ref(), image).await;
        let out = stdout_of(provider.as_ref(), "lease-id-image");
        assert_eq!(out, "the certificate\nunix:/berth-workload-api.sock\na socket\n");
    }
}

/// What shows a workload's processes on the host: their command line, or,
/// under gVisor (whose processes live inside its user-space kernel), the
/// sandbox's own processes, which name the provider's directory.
fn needle(kind: Kind, marker: &str, dir: &Path) -> String {
    match kind {
        // The VMM names its run directory under the provider's.
        Kind::Oci(OciRuntime::Runsc) | Kind::MicroVm => dir.display().to_string(),
        Kind::Uncontained | Kind::Oci(_) => marker.to_string(),
    }
}

/// Launches `script` as `lease_id` under `kind`: it starts processes that
/// run `marker`, then prints `ready`. Once they run, a destroy must leave
/// none of them, and the workload must have ended.
async fn destroy_leaves_nothing(kind: Kind, lease_id: &str, marker: &str, script: &str, ready: &str) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let launched = provider.launch(spec(lease_id, script)).await.unwrap();
    printed("the workload's processes to run", provider.as_ref(), lease_id, ready).await;
    let needle = needle(kind, marker, tmp.path());
    assert!(!host_processes(&needle).is_empty());
    provider.destroy(lease_id).await.unwrap();
    none_left("every process of the workload to be gone", &needle).await;
    let mut exit = launched.exit;
    ended(&mut exit).await;
}

async fn destroy_reaches_everything_on(kind: Kind) {
    let marker = format!("sleep 31{}", std::process::id() % 1000);
    let script = format!("{marker} & {marker} & sh -c '{marker}' & echo spawned; wait");
    destroy_leaves_nothing(kind, "lease-d", &marker, &script, "spawned").await;
}

async fn ignores_sigterm_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let mut launched =
        provider.launch(spec("lease-t", "trap '' TERM; echo ready; while :; do sleep 1; done")).await.unwrap();
    printed("the workload to be ready", provider.as_ref(), "lease-t", "ready").await;
    let started = std::time::Instant::now();
    provider.destroy("lease-t").await.unwrap();
    assert!(started.elapsed() >= timing().stop_grace, "SIGKILL only after the grace");
    let status = ended(&mut launched.exit).await.status;
    assert!(!status.success(), "{status}");
}

async fn adopts_on(kind: Kind) {
    let tmp = TestDir::new();
    let stopped = CancellationToken::new();
    let Some(first) = provider_until(kind, tmp.path(), stopped.clone()) else { return };
    let running = first.launch(spec("lease-r", "echo up; exec sleep 1000")).await.unwrap();
    let mut quick = first.launch(spec("lease-q", "exit 0")).await.unwrap();
    ended(&mut quick.exit).await;
    printed("the workload to be up", first.as_ref(), "lease-r", "up").await;
    stopped.cancel();
    drop(first);

    // A restarted agent: a new provider on the same directory.
    let Some(second) = provider(kind, tmp.path()) else { return };
    let recovered = second.recover().await.unwrap();
    let by_id: BTreeMap<_, _> = recovered.into_iter().map(|l| (l.record.lease_id.clone(), l)).collect();
    let adopted = &by_id["lease-r"];
    assert_eq!(adopted.record.pid, running.record.pid, "the same workload, not a new one");
    assert!(adopted.exit.borrow().is_none(), "it still runs");
    assert!(by_id["lease-q"].exit.borrow().is_some(), "what ended stays ended");
    let mut exit = adopted.exit.clone();
    second.destroy("lease-r").await.unwrap();
    ended(&mut exit).await;
}

async fn signals_and_stats_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let script = "trap 'echo got-usr1; exit 7' USR1; echo ready; while :; do sleep 0.1; done";
    let mut launched = provider.launch(spec("lease-s", script)).await.unwrap();
    printed("the workload to be ready", provider.as_ref(), "lease-s", "ready").await;
    let stats = provider.stats("lease-s").await.unwrap();
    assert!(stats.memory_bytes > 0, "{stats:?}");
    provider.signal("lease-s", WorkloadSignal::Usr1).await.unwrap();
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(7));
    assert!(stdout_of(provider.as_ref(), "lease-s").contains("got-usr1"));
    let err = provider.signal("lease-s", WorkloadSignal::Term).await.unwrap_err();
    assert!(matches!(err, ProviderError::NotRunning(_)), "{err}");
}

/// A workload is ready on its port only once it listens there: checks made
/// as it starts (a microVM's port is its VMM's forward, which accepts while
/// the guest boots) and while it runs without listening fail, and once it
/// serves the check passes.
async fn ready_once_listening_on(kind: Kind) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let script = "trap 'go=1' USR1; echo waiting; while [ -z \"$go\" ]; do sleep 0.1; done; \
                  exec busybox httpd -f -p \"$PORT\"";
    let mut late = spec("lease-late", script);
    late.ports = vec!["http".into()];
    if matches!(kind, Kind::MicroVm) {
        // A guest is reached only through its network's forwards: here from the host's loopback.
        late.network = Some(NetworkAttachment { namespace: PathBuf::new(), enter: Vec::new(), resolv_conf: None });
    }
    let launched = provider.launch(late).await.unwrap();
    let port = u16::try_from(launched.record.meta.port).unwrap();
    let (dialer, readiness) = (Dialer::default(), Readiness::default());
    let check = || dialer.ready(provider.as_ref(), "lease-late", port, &readiness);
    assert!(check().await.is_err(), "ready on port {port} as it starts");
    printed("the workload to wait", provider.as_ref(), "lease-late", "waiting").await;
    assert!(check().await.is_err(), "ready on port {port} while its workload does not listen there");
    provider.signal("lease-late", WorkloadSignal::Usr1).await.unwrap();
    let patience = if matches!(kind, Kind::MicroVm) { VM_SLOW } else { SLOW };
    eventually("the workload to be ready", patience, check).await;
    // Ready means served: the workload answers on the port. Under runsc on a loaded machine,
    // busybox's httpd was seen to close one connection unanswered just after the check passed.
    eventually("its server to answer on the port", SLOW, || async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream.write_all(b"GET / HTTP/1.0\r\n\r\n").await?;
        let mut head = [0_u8; 7];
        stream.read_exact(&mut head).await?;
        if &head == b"HTTP/1." { Ok(()) } else { Err(std::io::Error::other(format!("answered {head:?}"))) }
    })
    .await;
    provider.destroy("lease-late").await.unwrap();
}

/// The memory limit in bytes and the CPU quota per period in microseconds
/// that a contained workload's cgroup holds now.
fn cgroup_limits(dir: &Path, lease_id: &str) -> (u64, i64) {
    let relative = format!("{}/{lease_id}", crate::container::cgroup_parent(dir));
    let root = Path::new("/sys/fs/cgroup");
    let read = |path: std::path::PathBuf| {
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).trim().to_string()
    };
    if root.join("cgroup.controllers").exists() {
        let quota = read(root.join(&relative).join("cpu.max"));
        let quota = quota.split_whitespace().next().unwrap_or_default();
        (read(root.join(&relative).join("memory.max")).parse().unwrap(), quota.parse().unwrap_or(-1))
    } else {
        (
            read(root.join("memory").join(&relative).join("memory.limit_in_bytes")).parse().unwrap(),
            read(root.join("cpu").join(&relative).join("cpu.cfs_quota_us")).parse().unwrap(),
        )
    }
}

async fn resize_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    // 48 MiB in its private tmpfs: memory the kernel cannot reclaim from it.
    // (An uncontained workload has no tmpfs of its own, nor limits.)
    let hold = if matches!(kind, Kind::Uncontained | Kind::MicroVm) {
        ""
    } else {
        "head -c 50331648 /dev/zero > /dev/shm/held && "
    };
    let mut launch = spec("lease-z", &format!("{hold}echo ready; while :; do sleep 0.1; done"));
    let mib = |n: u64| n << 20;
    launch.resources = Resources { cpu_millis: 500, memory_bytes: mib(128) };
    let launched = provider.launch(launch).await.unwrap();
    let pid = launched.record.pid;
    printed("the workload to hold its memory", provider.as_ref(), "lease-z", "ready").await;
    let ask = |from: (u64, u64), to: (u64, u64)| ResizeAsk {
        from: Resources { cpu_millis: from.0, memory_bytes: mib(from.1) },
        to: Resources { cpu_millis: to.0, memory_bytes: mib(to.1) },
        settle: Duration::from_secs(2),
    };
    let contained = match kind {
        Kind::Uncontained => false,
        // Neither gVisor nor a VM changes a running sandbox's size.
        Kind::Oci(OciRuntime::Runsc) | Kind::MicroVm => {
            let refused = provider.resize("lease-z", ask((500, 128), (1000, 256))).await.unwrap();
            assert!(matches!(refused, Resized::Deferred { reason: "Unsupported", .. }), "{refused:?}");
            provider.destroy("lease-z").await.unwrap();
            return;
        }
        Kind::Oci(_) => true,
    };
    if contained {
        assert_eq!(cgroup_limits(tmp.path(), "lease-z"), (mib(128), 50_000));
    }

    let grown = provider.resize("lease-z", ask((500, 128), (1000, 256))).await.unwrap();
    assert_eq!(grown, Resized::Applied);
    if contained {
        assert_eq!(cgroup_limits(tmp.path(), "lease-z"), (mib(256), 100_000), "both limits grew at once");
        // Below what it holds: the old limits stay, with the reason.
        let refused = provider.resize("lease-z", ask((1000, 256), (250, 32))).await.unwrap();
        let Resized::Deferred { reason, message } = &refused else { panic!("{refused:?}") };
        assert_eq!(*reason, "MemoryInUse", "{message}");
        assert!(message.contains("new limit of 32 MiB"), "{message}");
        assert_eq!(cgroup_limits(tmp.path(), "lease-z"), (mib(256), 100_000), "a deferred resize changes nothing");
    }
    let shrunk = provider.resize("lease-z", ask((1000, 256), (250, 96))).await.unwrap();
    assert_eq!(shrunk, Resized::Applied);
    if contained {
        assert_eq!(cgroup_limits(tmp.path(), "lease-z"), (mib(96), 25_000), "a shrink above its use holds");
    }
    assert!(launched.exit.borrow().is_none(), "the workload runs on through every resize");
    assert_eq!(provider.stats("lease-z").await.map(|_| pid).unwrap(), pid);
    provider.destroy("lease-z").await.unwrap();
    let idle = provider.resize("lease-z", ask((250, 96), (500, 128))).await.unwrap_err();
    assert!(matches!(idle, ProviderError::NotRunning(_)), "{idle}");
}

async fn refuses_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    for bad in ["", "../escape", ".hidden", "a/b"] {
        let err = provider.launch(spec(bad, "exit 0")).await.unwrap_err();
        assert!(matches!(err, ProviderError::InvalidLeaseId(_)), "{bad}: {err}");
    }
    let mut missing = spec("lease-h", "");
    missing.program = Program::Command("/nonexistent/program".into());
    let err = provider.launch(missing).await.unwrap_err();
    assert_eq!(err.start_reason(), "StartFailed", "{err}");
    assert!(err.to_string().contains("/nonexistent/program"), "{err}");
    let mut entrypoint = spec("lease-g", "");
    entrypoint.program = Program::Entrypoint;
    assert_eq!(provider.launch(entrypoint).await.unwrap_err().start_reason(), "Unsupported");

    provider.launch(spec("lease-i", "exec sleep 1000")).await.unwrap();
    let err = provider.launch(spec("lease-i", "exit 0")).await.unwrap_err();
    assert!(matches!(err, ProviderError::AlreadyRunning(_)), "{err}");
    provider.destroy("lease-i").await.unwrap();
}

macro_rules! hostile {
    ($($name:ident => $kind:expr;)*) => {$(
        mod $name {
            use super::*;

            #[tokio::test]
            async fn cannot_read_the_node_key_or_another_leases_files() {
                cannot_read_on($kind).await
            }

            #[tokio::test]
            async fn cannot_signal_another_tenants_process() {
                cannot_signal_on($kind).await
            }

            #[tokio::test]
            async fn going_past_its_memory_ends_it_oom_killed_and_the_node_unharmed() {
                out_of_memory_on($kind).await
            }

            #[tokio::test]
            async fn a_fork_bomb_is_held_by_the_process_limit() {
                fork_bomb_on($kind).await
            }

            #[tokio::test]
            async fn nothing_escapes_destroy_by_setsid() {
                setsid_on($kind).await
            }

            #[tokio::test]
            async fn runs_as_its_own_user_with_no_capabilities() {
                unprivileged_on($kind).await
            }

            #[tokio::test]
            async fn what_it_orphans_is_reaped() {
                orphans_reaped_on($kind).await
            }

            #[tokio::test]
            async fn an_images_links_never_send_a_mount_outside_its_root() {
                image_links_on($kind).await
            }
        }
    )*};
}

/// What only a runtime binary can be caught in the middle of.
macro_rules! interrupted {
    ($($name:ident => $runtime:expr;)*) => {$(
        mod $name {
            use super::*;

            #[tokio::test]
            async fn a_launch_stopped_before_its_pid_was_known_leaves_nothing_running_after_a_restart() {
                interrupted_launch_on($runtime).await
            }
        }
    )*};
}

/// The agent stops (or is killed) while the runtime is still starting a
/// container, before the pid is recorded; a new agent recovers before the
/// runtime is done. The container must not come up afterwards, unknown to
/// every agent, and run for good.
async fn interrupted_launch_on(runtime: OciRuntime) {
    let tmp = TestDir::new();
    let Some(real) = runtime_binary(runtime) else { return };
    // The runtime as a loaded host runs it: slow to start a container once
    // it has read its bundle (kept here as a copy, which nothing the agent
    // removes can take away from under it).
    let slow = tmp.path().join("slow-runtime");
    let exec = match runtime {
        OciRuntime::Own => format!("exec -a {} {}", crate::container::OWN_ARG0, real.display()),
        _ => format!("exec {}", real.display()),
    };
    let script = format!(
        r#"#!/bin/bash
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = --bundle ]; then cp -a "$2" "$2.read"; args+=(--bundle "$2.read"); shift 2; continue; fi
  [ "$1" = run ] && slow=1
  args+=("$1"); shift
done
[ -n "$slow" ] && sleep 3
{exec} "${{args[@]}}"
"#
    );
    std::fs::write(&slow, script).unwrap();
    std::fs::set_permissions(&slow, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let stopped = CancellationToken::new();
    let first = container_provider(runtime, slow.clone(), tmp.path(), stopped.clone());
    let marker = format!("sleep 32{}", std::process::id() % 1000);
    let launching = {
        let first = first.clone();
        let script = format!("echo up; exec {marker}");
        tokio::spawn(async move { first.launch(spec("lease-x", &script)).await })
    };
    // This test's own script, by its whole path: the same test of another
    // runtime may run beside this one with a script of the same name.
    let slow_path = slow.display().to_string();
    eventually("the runtime to be starting the container", SLOW, || async {
        if host_processes(&slow_path).is_empty() { Err("no slow-runtime process") } else { Ok(()) }
    })
    .await;
    launching.abort();
    stopped.cancel();
    drop(first);

    let second = container_provider(runtime, slow, tmp.path(), CancellationToken::new());
    let recovered = second.recover().await.unwrap();
    let record = recovered.iter().find(|l| l.record.lease_id == "lease-x").map(|l| l.exit.borrow().is_some());
    assert_eq!(record, Some(true), "the interrupted launch is not recorded as ended");
    // Past the runtime's pause and a start: nothing may run.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let needle = needle(Kind::Oci(runtime), &marker, tmp.path());
    assert_eq!(host_processes(&needle), Vec::<u32>::new(), "the container came up after the recovery");
    assert!(host_processes(&slow_path).is_empty(), "the runtime that was starting it still runs");
}

hostile! {
    hostile_process => Kind::Oci(OciRuntime::Own);
    hostile_runc => Kind::Oci(OciRuntime::Runc);
    hostile_runsc => Kind::Oci(OciRuntime::Runsc);
    hostile_microvm => Kind::MicroVm;
}

interrupted! {
    interrupted_process => OciRuntime::Own;
    interrupted_runc => OciRuntime::Runc;
    interrupted_runsc => OciRuntime::Runsc;
}

async fn cannot_read_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    // The node's key and another lease's working directory, as the agent
    // keeps them.
    let key = tmp.path().join("agent/identity/node.key");
    std::fs::create_dir_all(key.parent().unwrap()).unwrap();
    std::fs::write(&key, "-----BEGIN PRIVATE KEY-----secret").unwrap();
    let mut other = provider.launch(spec("lease-other", "echo mine > $HOME/data; exit 0")).await.unwrap();
    ended(&mut other.exit).await;
    let other_file = tmp.path().join("leases/lease-other/data");
    if matches!(kind, Kind::MicroVm) {
        // A VM's writes stay on its own scratch drive: the file another
        // lease's directory on the node holds stands in for them.
        std::fs::write(&other_file, "mine\n").unwrap();
    }
    assert!(other_file.exists());

    let script = format!(
        "cat {key} ; cat {other} ; cat /berth/../leases/lease-other/data ; ls {dir} ; cat /etc/shadow ; echo done",
        key = key.display(),
        other = other_file.display(),
        dir = tmp.path().display(),
    );
    let mut thief = provider.launch(spec("lease-thief", &script)).await.unwrap();
    ended(&mut thief.exit).await;
    let out = stdout_of(provider.as_ref(), "lease-thief");
    assert!(out.ends_with("done\n"), "{out}");
    assert!(!out.contains("secret") && !out.contains("mine"), "the workload read what is not its own: {out}");
}

async fn cannot_signal_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let victim = provider.launch(spec("lease-victim", "exec sleep 1000")).await.unwrap();
    let host_pid = victim.record.pid.unwrap();
    let script = format!("kill -9 {host_pid}; kill -9 -1; pkill sleep; echo tried");
    let mut attacker = provider.launch(spec("lease-attacker", &script)).await.unwrap();
    ended(&mut attacker.exit).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(victim.exit.borrow().is_none(), "the other tenant's workload still runs");
    provider.destroy("lease-victim").await.unwrap();
}

async fn out_of_memory_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    // A buffer well past its lease's memory (gVisor's accounting has slack), though within what a
    // microVM's kernel lets it ask for: a buffer past the whole VM's memory is refused, not OOM-killed.
    let size = if matches!(kind, Kind::MicroVm) { "300M" } else { "600M" };
    let mut greedy = spec("lease-greedy", &format!("exec dd if=/dev/zero of=/dev/null bs={size} count=1"));
    greedy.resources = Resources { cpu_millis: 500, memory_bytes: 256 << 20 };
    let mut launched = provider.launch(greedy).await.unwrap();
    let status = ended(&mut launched.exit).await.status;
    assert_eq!(status, ExitStatus::OutOfMemory, "{}", stdout_of(provider.as_ref(), "lease-greedy"));

    let mut modest = spec("lease-modest", "exec dd if=/dev/zero of=/dev/null bs=16M count=1");
    modest.resources = Resources { cpu_millis: 500, memory_bytes: 256 << 20 };
    let mut launched = provider.launch(modest).await.unwrap();
    assert!(ended(&mut launched.exit).await.status.success(), "the node and the next workload are unharmed");
}

async fn fork_bomb_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let marker = format!("sleep 32{}", std::process::id() % 1000);
    let script = format!("i=0; while [ $i -lt 3000 ]; do {marker} 2>/dev/null & i=$((i+1)); done; echo spawned");
    let launched = provider.launch(spec("lease-bomb", &script)).await.unwrap();
    let within = if matches!(kind, Kind::MicroVm) { VM_SLOW } else { SLOW };
    eventually("the workload to hit its limit", within, || async {
        let (stdout, exit) = (stdout_of(provider.as_ref(), "lease-bomb"), *launched.exit.borrow());
        if stdout.contains("spawned") || exit.is_some() { Ok(()) } else { Err((stdout, exit)) }
    })
    .await;
    let limit = if matches!(kind, Kind::MicroVm) { VM_PIDS_LIMIT } else { DEFAULT_PIDS_LIMIT };
    let running = host_processes(&marker).len();
    assert!(running <= limit as usize, "{running} processes past a limit of {limit}");
    provider.destroy("lease-bomb").await.unwrap();
    none_left("the bomb to be cleared", &marker).await;
}

async fn setsid_on(kind: Kind) {
    let marker = format!("sleep 33{}", std::process::id() % 1000);
    let script = format!("setsid sh -c '{marker} & {marker}' & sleep 0.2; echo left; exec sleep 1000");
    destroy_leaves_nothing(kind, "lease-escape", &marker, &script, "left").await;
}

async fn unprivileged_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    let script = "id -u; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status; \
                  touch /usr/evil 2>/dev/null && echo wrote-usr; touch $HOME/mine && echo wrote-home; \
                  touch /tmp/mine && echo wrote-tmp; \
                  nsenter --net=/proc/1/ns/net true 2>/dev/null && echo entered";
    let mut launched = provider.launch(spec("lease-who", script)).await.unwrap();
    ended(&mut launched.exit).await;
    let out = stdout_of(provider.as_ref(), "lease-who");
    let uid: u32 = out.lines().next().unwrap().trim().parse().unwrap();
    if matches!(kind, Kind::MicroVm) {
        assert_eq!(uid, 1000, "an unprivileged user of its own VM: {out}");
    } else {
        assert!((300_000..301_000).contains(&uid), "a uid of the workload range, not root: {out}");
    }
    for cap in ["CapEff", "CapPrm", "CapBnd"] {
        let line = out.lines().find(|l| l.starts_with(cap)).unwrap_or_else(|| panic!("{cap} in {out}"));
        assert!(line.ends_with("0000000000000000"), "{line}");
    }
    assert!(out.contains("NoNewPrivs:\t1") || matches!(kind, Kind::Oci(OciRuntime::Runsc)), "{out}");
    assert!(!out.contains("wrote-usr") && !out.contains("entered"), "{out}");
    assert!(out.contains("wrote-home"), "its own directory is writable: {out}");
    assert!(out.contains("wrote-tmp"), "its private /tmp is writable: {out}");
}

/// Every containing runtime gives the workload an init of its own as its
/// PID namespace's first process, which reaps what the workload orphans: the
/// agent is never the parent of processes it did not start (a subreaper's
/// `waitpid(-1)` would take its own children's statuses from it).
async fn orphans_reaped_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    // Twenty double forks, whose short-lived grandchildren are orphaned.
    let script = "i=0; while [ $i -lt 20 ]; do (sh -c 'sleep 0.1' &); i=$((i+1)); done; sleep 1; \
                  echo zombies=$(grep -l '^State:.Z' /proc/[0-9]*/status 2>/dev/null | wc -l); exec sleep 1000";
    let launched = provider.launch(spec("lease-orphans", script)).await.unwrap();
    printed("the workload to count its zombies", provider.as_ref(), "lease-orphans", "zombies=").await;
    let out = stdout_of(provider.as_ref(), "lease-orphans");
    assert!(out.contains("zombies=0"), "orphans were left unreaped: {out}");
    provider.destroy("lease-orphans").await.unwrap();
    let mut exit = launched.exit;
    ended(&mut exit).await;
}

/// An image whose `/tmp` and `/dev` are absolute links to a host directory:
/// the runtime's mounts there land inside the lease's root, where the links
/// lead inside it, never in that directory, and the workload runs.
async fn image_links_on(kind: Kind) {
    let tmp = TestDir::new();
    let Some(provider) = provider(kind, tmp.path()) else { return };
    // Outside /tmp and /dev themselves, so the links do not loop.
    let outside = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = tmp.path().join("image-root");
    image_root(&root);
    for link in ["tmp", "dev"] {
        std::fs::create_dir_all(outside.path().join(link)).unwrap();
        std::os::unix::fs::symlink(outside.path().join(link), root.join(link)).unwrap();
    }
    let mut spec =
        spec("lease-links", "echo inside > /tmp/written && cat /tmp/written && echo x > /dev/null && echo ran");
    spec.root =
        WorkloadRoot::Image { dir: root, digest: "sha256:links".into(), working_dir: "/".into(), account: None };
    spec.program = Program::Command("sh".into());
    spec.env.insert("PATH".into(), "/bin".into());
    ran_to_success(provider.as_ref(), spec).await;
    assert_eq!(stdout_of(provider.as_ref(), "lease-links"), "inside\nran\n");
    for dir in ["tmp", "dev"] {
        let entries: Vec<_> =
            std::fs::read_dir(outside.path().join(dir)).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(entries.is_empty(), "{kind:?} wrote {entries:?} into the host's {dir} through the image's link");
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(outside.path().to_str().unwrap()), "a mount landed outside the root: {mounts}");
}

async fn recycled_pid_on(kind: Kind) {
    let tmp = TestDir::new();
    // A process that is not the workload, holding the pid the record names;
    // its own directory, so the test directory's clean-up leaves it alone.
    let elsewhere = TestDir::new();
    let mut stranger =
        std::process::Command::new("sleep").arg("1000").current_dir(elsewhere.path()).process_group(0).spawn().unwrap();
    let pid = stranger.id();
    let real_start = crate::procfs::read_stat(Path::new(crate::procfs::PROC_ROOT), pid).unwrap().start_ticks;
    let layout = crate::instances::Layout { root: tmp.path().to_path_buf() };
    std::fs::create_dir_all(layout.record_dir()).unwrap();
    let mut record = crate::instances::StoredRecord::starting(&spec("lease-e", "exit 0"));
    record.pid = Some(pid);
    record.start_ticks = Some(real_start.saturating_sub(1));
    record.started_at_ms = Some(1);
    crate::instances::write_record(&layout, &record).unwrap();

    let Some(provider) = provider(kind, tmp.path()) else {
        let _ = stranger.kill();
        let _ = stranger.wait();
        return;
    };
    let recovered = provider.recover().await.unwrap();
    assert_eq!(recovered.len(), 1);
    let mut exit = recovered[0].exit.clone();
    assert_eq!(
        ended(&mut exit).await.status,
        ExitStatus::Unknown,
        "the recorded workload is gone, whatever holds its pid"
    );
    provider.destroy("lease-e").await.unwrap();
    let err = provider.signal("lease-e", WorkloadSignal::Kill).await.unwrap_err();
    assert!(matches!(err, ProviderError::NotRunning(_)), "{err}");
    assert!(
        crate::procfs::is_running(Path::new(crate::procfs::PROC_ROOT), pid, real_start),
        "the stranger was signalled"
    );
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}
