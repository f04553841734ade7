//! The microVM provider on real VMs (QEMU's translator, so no `/dev/kvm`
//! is needed): what `make test` installs (`scripts/microvm-deps.sh`) and
//! builds (`make vminit`) must be there, or these fail naming it.

use berth_testkit::eventually;

use super::*;
use crate::instances::write_record;
use crate::provider::{Exit, ExitWatch, Program};
use crate::testdir::TestDir;

/// Boot to power-off of one VM under TCG on a busy machine.
const SLOW: Duration = Duration::from_secs(120);

fn settings(grace: Duration) -> MicroVmSettings {
    let kernel_dir = std::env::var_os("BERTH_MICROVM_KERNEL")
        .map_or_else(|| PathBuf::from(berth_microvm::kernel::DEFAULT_KERNEL_DIR), PathBuf::from);
    assert!(
        kernel_dir.join("vmlinuz").is_file(),
        "no guest kernel in {}: scripts/microvm-deps.sh",
        kernel_dir.display()
    );
    MicroVmSettings {
        qemu: "qemu-system-x86_64".into(),
        kernel_dir,
        init: berth_microvm::install::find_init().expect("no static guest init: `make vminit` builds it"),
        accel: MicroVmAccel::Tcg,
        busybox: berth_microvm::install::find_busybox().expect("busybox-static: scripts/runtime-deps.sh"),
        virtiofsd: Some(berth_microvm::install::find_virtiofsd().expect("no virtiofsd: scripts/microvm-deps.sh")),
        timing: ProcessTiming { stop_grace: grace, exit_poll: Duration::from_millis(50) },
        pids_limit: crate::container::DEFAULT_PIDS_LIMIT,
        uids: crate::container::UidRange { first: 310_000, count: 100 },
        node_ports: crate::NodePorts::default(),
    }
}

fn provider(dir: &Path, stop: CancellationToken) -> MicroVmProvider {
    MicroVmProvider::new(dir, settings(Duration::from_secs(20)), stop)
}

async fn ended(watch: &mut ExitWatch) -> Exit {
    let exit = tokio::time::timeout(SLOW, watch.wait_for(Option::is_some)).await.expect("the VM never ended");
    exit.unwrap().unwrap()
}

async fn printed(provider: &MicroVmProvider, lease_id: &str, text: &str) {
    let logs = provider.log_files(lease_id).unwrap();
    eventually(&format!("{lease_id} to print {text:?}"), SLOW, || async {
        let stdout = std::fs::read_to_string(&logs.stdout).unwrap_or_default();
        if stdout.contains(text) { Ok(()) } else { Err(stdout) }
    })
    .await;
}

/// A figure of `/proc/PID/status` in KiB (`RssAnon:`, `VmRSS:`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap()
}

fn spec(lease_id: &str, script: &str) -> LaunchSpec {
    LaunchSpec::for_test(lease_id, script)
}

#[tokio::test]
async fn a_vm_whose_init_cannot_start_ends_127_with_its_consoles_last_words_in_the_leases_log() {
    let tmp = TestDir::new();
    // An init the guest's kernel cannot execute: it panics, and QEMU powers off.
    let broken = tmp.path().join("not-an-init");
    std::fs::write(&broken, "no program here\n").unwrap();
    let settings = MicroVmSettings { init: broken, ..settings(Duration::from_secs(20)) };
    let provider = MicroVmProvider::new(tmp.path(), settings, CancellationToken::new());
    let mut launched = provider.launch(spec("lease-p", "echo never")).await.unwrap();
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(127), "the workload never ran");
    let stderr = std::fs::read_to_string(provider.log_files("lease-p").unwrap().stderr).unwrap();
    assert!(stderr.contains("the microVM ended before its init started the workload"), "{stderr}");
    assert!(
        stderr.contains("Failed to execute /init") && stderr.contains("Kernel panic"),
        "the console's words name why the kernel panicked: {stderr}"
    );
}

#[tokio::test]
async fn a_command_runs_in_its_own_vm_with_its_environment_and_its_exit_code_and_output_are_kept() {
    let tmp = TestDir::new();
    let provider = provider(tmp.path(), CancellationToken::new());
    assert_eq!(provider.runtime(), Runtime { name: "microvm".into(), contained: true });
    let script = "id -u; pwd; env | sort; uname -r; echo oops >&2; exit 3";
    let mut launched = provider.launch(spec("lease-a", script)).await.unwrap();
    assert!(launched.record.pid.is_some());
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(3));

    let logs = provider.log_files("lease-a").unwrap();
    let stdout = std::fs::read_to_string(&logs.stdout).unwrap();
    assert!(stdout.starts_with("1000\n/home/workload\n"), "an unprivileged user in its home: {stdout}");
    for expected in ["BERTH_LEASE_ID=lease-a", "BERTH_NODE_ID=n-1", "GREETING=hello", "HOME=/home/workload"] {
        assert!(stdout.contains(expected), "{expected} missing from:\n{stdout}");
    }
    assert!(!stdout.contains("CARGO"), "nothing of the agent's environment: {stdout}");
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert!(!stdout.contains(host_kernel.trim()), "a kernel of its own, not the host's: {stdout}");
    assert_eq!(std::fs::read_to_string(&logs.stderr).unwrap(), "oops\n");
    assert!(provider.running().is_empty());

    // The same lease again (a restart of its workload) gets a fresh scratch.
    let mut again = provider.launch(spec("lease-a", "ls /home/workload; echo second")).await.unwrap();
    assert_eq!(ended(&mut again.exit).await.status, ExitStatus::Code(0));
    provider.settle("lease-a", Settlement::default()).await.unwrap();
    provider.remove("lease-a").await.unwrap();
    assert!(!tmp.path().join("leases/lease-a").exists());
}

#[tokio::test]
async fn destroy_stops_the_workload_with_sigterm_and_kills_a_vm_that_outlives_its_grace() {
    let tmp = TestDir::new();
    let provider = provider(tmp.path(), CancellationToken::new());
    let mut polite = provider.launch(spec("lease-b", "echo up; exec sleep 1000")).await.unwrap();
    printed(&provider, "lease-b", "up").await;
    provider.destroy("lease-b").await.unwrap();
    assert_eq!(ended(&mut polite.exit).await.status, ExitStatus::Signal(15));
    let vmm = polite.record.pid.unwrap();
    assert!(!Path::new(&format!("/proc/{vmm}")).exists(), "the VMM is gone with its workload");

    let stubborn = MicroVmProvider::new(tmp.path(), settings(Duration::from_millis(500)), CancellationToken::new());
    let mut launched = stubborn.launch(spec("lease-c", "trap '' TERM; echo up; sleep 1000")).await.unwrap();
    printed(&stubborn, "lease-c", "up").await;
    stubborn.destroy("lease-c").await.unwrap();
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Signal(9));
    let err = stubborn.signal("lease-c", WorkloadSignal::Term).await.unwrap_err();
    assert!(matches!(err, ProviderError::NotRunning(_)), "{err}");
    stubborn.destroy("lease-c").await.unwrap();
}

#[tokio::test]
async fn a_restarted_provider_adopts_a_running_vm_signals_it_and_learns_how_an_unwatched_one_ended_or_boots() {
    let tmp = TestDir::new();
    let first_stop = CancellationToken::new();
    let first = provider(tmp.path(), first_stop.clone());
    let script = "trap 'echo reloaded' HUP; echo started; while true; do sleep 0.1; done";
    let running = first.launch(spec("lease-d", script)).await.unwrap();
    let mut quick = spec("lease-e", "echo started; sleep 2; exit 4");
    quick.epoch = 7;
    let quick = first.launch(quick).await.unwrap();
    printed(&first, "lease-d", "started").await;
    printed(&first, "lease-e", "started").await;
    // A VM still booting when its agent goes: the command the agent handed
    // QEMU goes with it, unread by the guest.
    let booting = first.launch(spec("lease-g", "echo late; exec sleep 1000")).await.unwrap();
    // The agent goes away without stopping anything.
    first_stop.cancel();
    drop(first);
    let quick_vmm = quick.record.pid.unwrap();
    eventually("the quick VM to end with no agent watching", SLOW, || async {
        if Path::new(&format!("/proc/{quick_vmm}")).exists() { Err("still running") } else { Ok(()) }
    })
    .await;

    let second = provider(tmp.path(), CancellationToken::new());
    let recovered = second.recover().await.unwrap();
    let find = |id: &str| recovered.iter().find(|l| l.record.lease_id == id).unwrap();
    let mut adopted = find("lease-d").exit.clone();
    assert_eq!(find("lease-d").record.pid, running.record.pid, "the same VM, not a new one");
    assert!(adopted.borrow().is_none(), "it still runs");
    let exit = find("lease-e").exit.borrow().unwrap();
    let status_lines = std::fs::read_to_string(tmp.path().join("leases/lease-e/status")).unwrap_or_default();
    assert_eq!(exit.status, ExitStatus::Code(4), "its status lines tell how it ended: {status_lines}");
    assert_eq!(find("lease-e").record.epoch, 7);
    assert_eq!(find("lease-g").record.pid, booting.record.pid);
    printed(&second, "lease-g", "late").await;
    second.destroy("lease-g").await.unwrap();
    // The adopted VM's guest answers for its workload (a shell and its sleeps), not the VMM's memory.
    let stats = second.stats("lease-d").await.unwrap();
    assert!(stats.memory_bytes > 0 && stats.memory_bytes < 64 << 20, "{stats:?}");

    second.signal("lease-d", WorkloadSignal::Hup).await.unwrap();
    printed(&second, "lease-d", "reloaded").await;
    second.destroy("lease-d").await.unwrap();
    assert_eq!(ended(&mut adopted).await.status, ExitStatus::Signal(15), "read from the adopted VM's status");
}

#[tokio::test]
async fn the_vmm_is_held_in_a_cgroup_of_its_lease_to_the_guests_memory_and_the_leases_cpu() {
    if !berth_testkit::runs_as_root("a VMM's cgroup") {
        return;
    }
    let tmp = TestDir::new();
    let provider = provider(tmp.path(), CancellationToken::new());
    let mut sized = spec("lease-cg", "echo up; exec sleep 1000");
    sized.resources = crate::provider::Resources { cpu_millis: 1500, memory_bytes: 192 << 20 };
    let launched = provider.launch(sized).await.unwrap();
    let unified = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let cgroup = provider.cgroup("lease-cg");
    let quota = || -> u64 {
        if unified {
            let dir = format!(
                "/sys/fs/cgroup/{}/lease-cg/cpu.max",
                crate::container::cgroup_parent(&tmp.path().join("microvm"))
            );
            std::fs::read_to_string(dir).unwrap().split_whitespace().next().unwrap().parse().unwrap()
        } else {
            cgroup.read_number("cpu", "cpu.cfs_quota_us")
        }
    };
    // Its guest kernel boots (a kernel boot takes far longer than this look) at its two vCPUs' full speed.
    assert_eq!(quota(), 200_000, "booting unheld by the lease's 1.5 CPUs");
    printed(&provider, "lease-cg", "up").await;
    let vmm = launched.record.pid.unwrap();
    assert!(cgroup.processes().contains(&vmm), "the VMM is in its lease's cgroup");
    // Once set up, the VMM runs as the lease's user of the workload range, not as root.
    let status = std::fs::read_to_string(format!("/proc/{vmm}/status")).unwrap();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).map(|v| v.split_whitespace().collect::<Vec<_>>());
    assert_eq!(uid, Some(vec!["310000"; 4]), "{status}");
    let memory = cgroup.read_number("memory", if unified { "memory.max" } else { "memory.limit_in_bytes" });
    assert_eq!(
        memory,
        ((192 + u64::from(GUEST_RESERVE_MIB)) << 20) + VMM_ALLOWANCE,
        "the guest's memory (the workload's and the guest's reserve) and the VMM's allowance"
    );
    // Its workload runs held to the lease's CPU.
    eventually("the VMM to be held to its lease's CPU once its workload started", SLOW, || async {
        if quota() == 150_000 { Ok(()) } else { Err(quota()) }
    })
    .await;
    assert!(cgroup.memory_bytes() > 64 << 20, "the guest's memory is charged to it");
    // QEMU ran in it from its first page: every anonymous page it holds is charged here
    // (a process moved in after it started leaves what it allocated before charged elsewhere).
    let anon_kib = status_kib(vmm, "RssAnon:");
    assert!(
        cgroup.memory_bytes() >= anon_kib << 10,
        "charged {} bytes, QEMU holds {} anonymous",
        cgroup.memory_bytes(),
        anon_kib << 10
    );
    provider.destroy("lease-cg").await.unwrap();
    // Its directory goes too, though the share's daemon outlives QEMU for a moment.
    let parent = crate::container::cgroup_parent(&tmp.path().join("microvm"));
    let dir = if unified {
        PathBuf::from(format!("/sys/fs/cgroup/{parent}/lease-cg"))
    } else {
        PathBuf::from(format!("/sys/fs/cgroup/memory/{parent}/lease-cg"))
    };
    eventually("the cgroup to be removed with its VM", SLOW, || async {
        if cgroup.processes().is_empty() && !dir.exists() { Ok(()) } else { Err(cgroup.processes()) }
    })
    .await;
}

#[tokio::test]
async fn a_vm_started_but_never_recorded_is_killed_at_recovery() {
    let tmp = TestDir::new();
    let first_stop = CancellationToken::new();
    let first = provider(tmp.path(), first_stop.clone());
    let launched = first.launch(spec("lease-u", "echo up; exec sleep 1000")).await.unwrap();
    printed(&first, "lease-u", "up").await;
    let vmm = launched.record.pid.unwrap();
    // The record as it is when an agent stops between starting QEMU and
    // recording its pid.
    let layout = crate::instances::Layout { root: tmp.path().to_path_buf() };
    let mut unrecorded = first.inner.instances.stored("lease-u").unwrap();
    (unrecorded.pid, unrecorded.start_ticks, unrecorded.started_at_ms) = (None, None, None);
    write_record(&layout, &unrecorded).unwrap();
    first_stop.cancel();
    drop(first);

    let second = provider(tmp.path(), CancellationToken::new());
    let recovered = second.recover().await.unwrap();
    assert!(recovered[0].exit.borrow().is_some(), "it is not adopted: nothing recorded its pid");
    eventually("the unrecorded VM to be killed", SLOW, || async {
        let live = procfs::read_stat(Path::new(PROC_ROOT), vmm).is_some_and(|stat| stat.is_live());
        if live { Err(format!("{vmm} still runs")) } else { Ok(()) }
    })
    .await;
}

/// A bundle whose program is a shell script printing where it runs from.
fn hello_bundle(dir: &Path, lease_id: &str) -> LaunchSpec {
    let bundle = dir.join("bundle");
    std::fs::create_dir_all(bundle.join("bin")).unwrap();
    std::fs::write(bundle.join("bin/hello"), "#!/bin/sh\necho \"hello from $BERTH_BUNDLE_DIR\"\n").unwrap();
    let executable = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755);
    std::fs::set_permissions(bundle.join("bin/hello"), executable).unwrap();
    let mut hello = spec(lease_id, "");
    hello.root = WorkloadRoot::Bundle { dir: bundle, digest: "sha256:0123abcd".into() };
    hello.program = Program::Bundled("bin/hello".into());
    hello.args = Vec::new();
    hello
}

#[tokio::test]
async fn a_bundle_runs_on_the_nodes_own_system_directories_which_it_cannot_change() {
    let tmp = TestDir::new();
    let provider = provider(tmp.path(), CancellationToken::new());
    let mut launched = provider.launch(hello_bundle(tmp.path(), "lease-f")).await.unwrap();
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(0));
    let stdout = std::fs::read_to_string(provider.log_files("lease-f").unwrap().stdout).unwrap();
    assert_eq!(stdout, "hello from /bundle\n");

    // The node's interpreters are the guest's, as a container's are; the guest may not change them.
    let script = "/usr/bin/python3 -c 'import sys; print(sys.version_info[0])'; \
                  touch /usr/bin/planted 2>/dev/null && echo usr-writable || echo usr-protected; \
                  grep -c ' /usr virtiofs ro,' /proc/mounts; test -e /etc/ssl/certs && echo certificates; \
                  test -e /etc/ssl/private && echo private-keys || echo no-private-keys";
    let mut python = provider.launch(spec("lease-py", script)).await.unwrap();
    let status = ended(&mut python.exit).await.status;
    let logs = provider.log_files("lease-py").unwrap();
    let stderr = std::fs::read_to_string(&logs.stderr).unwrap_or_default();
    assert_eq!(status, ExitStatus::Code(0), "{stderr}");
    let stdout = std::fs::read_to_string(&logs.stdout).unwrap();
    assert_eq!(stdout, "3\nusr-protected\n1\ncertificates\nno-private-keys\n", "{stderr}");
    assert!(!Path::new("/usr/bin/planted").exists());
    // The roots it booted from are no other host user's to read.
    let images = std::fs::metadata(tmp.path().join("microvm/images")).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&images.permissions()) & 0o777, 0o700);
    // Its daemons ended with it.
    let daemons = procfs::with_args(Path::new(PROC_ROOT), &["--socket-path"])
        .into_iter()
        .filter(|found| {
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", found.pid)).unwrap_or_default();
            String::from_utf8_lossy(&cmdline).contains(&tmp.path().display().to_string())
        })
        .count();
    assert_eq!(daemons, 0, "no virtiofsd outlives its VM");
}

#[tokio::test]
async fn a_cache_volume_is_written_through_to_its_view_and_the_identity_directory_is_read_only() {
    let tmp = TestDir::new();
    let provider = provider(tmp.path(), CancellationToken::new());
    let view = tmp.path().join("view");
    std::fs::create_dir_all(view.join("deps")).unwrap();
    std::fs::write(view.join("deps/kept"), "from the last generation\n").unwrap();
    let identity = tmp.path().join("identity");
    std::fs::create_dir_all(&identity).unwrap();
    std::fs::write(identity.join("svid.pem"), "CERTIFICATE\n").unwrap();
    let script = "cat /work/cache/deps/kept; echo built > /work/cache/made; cat $BERTH_IDENTITY_DIR/svid.pem; \
                  touch $BERTH_IDENTITY_DIR/x 2>/dev/null && echo identity-writable || echo identity-protected; \
                  echo socket=${SPIFFE_ENDPOINT_SOCKET:-none}; stat -c %u:%g /work/cache/made $BERTH_IDENTITY_DIR";
    let mut cached = spec("lease-cv", script);
    cached.caches = vec![crate::provider::CacheBind { host: view.clone(), inside: "/work/cache".into() }];
    cached.identity = Some(identity.clone());
    let mut launched = provider.launch(cached).await.unwrap();
    let status = ended(&mut launched.exit).await.status;
    let logs = provider.log_files("lease-cv").unwrap();
    let stderr = std::fs::read_to_string(&logs.stderr).unwrap_or_default();
    assert_eq!(status, ExitStatus::Code(0), "{stderr}");
    let stdout = std::fs::read_to_string(&logs.stdout).unwrap();
    assert_eq!(
        stdout, "from the last generation\nCERTIFICATE\nidentity-protected\nsocket=none\n1000:1000\n1000:1000\n",
        "the Workload API's socket does not reach a guest, and the guest's user owns its directories: {stderr}"
    );
    assert_eq!(std::fs::read_to_string(view.join("made")).unwrap(), "built\n", "written through to the view");
    if rustix::process::geteuid().is_root() {
        use std::os::unix::fs::MetadataExt as _;
        let made = std::fs::metadata(view.join("made")).unwrap();
        // On the host, both are a user of the workload range, as a container's are.
        assert_eq!((made.uid(), made.gid()), (310_000, 310_000), "made by the lease's host user");
        assert_eq!(std::fs::metadata(&identity).unwrap().uid(), 310_000, "its identity is its user's alone");
    }
    assert!(!identity.join("x").exists());
}

#[tokio::test]
async fn a_node_without_virtiofsd_runs_bundles_on_busybox_and_refuses_what_it_cannot_share() {
    let tmp = TestDir::new();
    let settings = MicroVmSettings { virtiofsd: None, ..settings(Duration::from_secs(20)) };
    let provider = MicroVmProvider::new(tmp.path(), settings, CancellationToken::new());
    let mut launched = provider.launch(hello_bundle(tmp.path(), "lease-f")).await.unwrap();
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(0));
    let stdout = std::fs::read_to_string(provider.log_files("lease-f").unwrap().stdout).unwrap();
    assert_eq!(stdout, "hello from /bundle\n");

    let mut cached = spec("lease-g", "true");
    cached.caches = vec![crate::provider::CacheBind { host: tmp.path().join("view"), inside: "/cache".into() }];
    let err = provider.launch(cached).await.unwrap_err();
    assert_eq!(err.start_reason(), "Unsupported", "{err}");
    assert!(err.to_string().contains("cache volume at /cache"), "{err}");
    let mut identified = spec("lease-i", "true");
    identified.identity = Some(tmp.path().join("identity"));
    let err = provider.launch(identified).await.unwrap_err();
    assert_eq!(err.start_reason(), "Unsupported", "{err}");
    let err = provider.launch(spec("../escape", "true")).await.unwrap_err();
    assert!(matches!(err, ProviderError::InvalidLeaseId(_)), "{err}");
}

#[tokio::test]
async fn a_workload_that_tries_to_reboot_or_load_a_module_or_read_the_node_sees_only_its_own_vm() {
    let tmp = TestDir::new();
    let secret = tmp.path().join("node.key");
    std::fs::write(&secret, "private").unwrap();
    let provider = provider(tmp.path(), CancellationToken::new());
    let script = format!(
        "cat {} 2>/dev/null && echo read-the-key; insmod /lib/modules/x.ko 2>/dev/null || echo no-module; \
         reboot -f 2>/dev/null; echo still-here; cat /proc/1/comm; test -e /proc/{} || echo no-host-pid",
        secret.display(),
        std::process::id()
    );
    let mut launched = provider.launch(spec("lease-h", &script)).await.unwrap();
    assert_eq!(ended(&mut launched.exit).await.status, ExitStatus::Code(0));
    let stdout = std::fs::read_to_string(provider.log_files("lease-h").unwrap().stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    // Its PID 1 is the guest's init, and the host's processes are not there.
    assert_eq!(lines, ["no-module", "still-here", "init", "no-host-pid"], "{stdout}");
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "private");
}

#[tokio::test]
async fn stats_are_the_workloads_own_as_its_guest_reads_them_not_the_vmms() {
    let tmp = TestDir::new();
    let provider = provider(tmp.path(), CancellationToken::new());
    let script = "dd if=/dev/zero of=/tmp/held bs=1M count=48 2>/dev/null; i=0; \
                  while [ $i -lt 200000 ]; do i=$((i+1)); done; echo ready; exec sleep 1000";
    let mut busy = spec("lease-st", script);
    busy.resources = crate::provider::Resources { cpu_millis: 0, memory_bytes: 128 << 20 };
    let launched = provider.launch(busy).await.unwrap();
    printed(&provider, "lease-st", "ready").await;
    let stats = provider.stats("lease-st").await.unwrap();
    // /tmp is the guest's memory, charged to the workload's cgroup in it.
    assert!(stats.memory_bytes >= 48 << 20 && stats.memory_bytes < 128 << 20, "{stats:?}");
    assert!(stats.cpu_time >= Duration::from_millis(50), "it counted: {stats:?}");
    let vmm = launched.record.pid.unwrap();
    let vmm_kib = status_kib(vmm, "VmRSS:");
    assert!(stats.memory_bytes < vmm_kib << 10, "the workload's, not the VMM's {vmm_kib} KiB: {stats:?}");
    provider.destroy("lease-st").await.unwrap();
}
