//! Real VMs: QEMU's `microvm` machine booting Debian's cloud kernel with
//! berth's init, a root image built from `busybox-static`, and the
//! workload's output, signals and exit carried over the control port.
//!
//! Needs what `make test` sets up: `scripts/microvm-deps.sh` (QEMU and the
//! kernel) and the static init (`make vminit`). The VMs run under QEMU's
//! translator (TCG), which needs no `/dev/kvm`: this test is about what the
//! guest sees, not about speed.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_microvm::image::{root_image, scratch_image, write_initramfs};
use berth_microvm::kernel::{DEFAULT_KERNEL_DIR, GuestKernel};
use berth_microvm::vmm::{Accel, ShareOwner, ShareSpec, Vm, VmShare, VmSpec, start_share, statuses};
use berth_microvm::wire::{GuestCommand, GuestExit, GuestShare, Status};

/// How long one VM may take from boot to power-off under TCG on a busy
/// machine.
const VM_DEADLINE: Duration = Duration::from_secs(120);

/// The static init `make vminit` builds.
fn vminit() -> PathBuf {
    berth_microvm::install::find_init().expect("no static guest init: `make vminit` builds it")
}

fn kernel() -> GuestKernel {
    let dir = std::env::var_os("BERTH_MICROVM_KERNEL").map_or_else(|| PathBuf::from(DEFAULT_KERNEL_DIR), PathBuf::from);
    GuestKernel::from_dir(&dir).unwrap_or_else(|e| panic!("{e}: scripts/microvm-deps.sh installs it"))
}

/// A root tree of busybox and its applets.
fn busybox_tree(root: &Path) {
    let busybox = berth_microvm::install::find_busybox().expect("busybox-static (scripts/runtime-deps.sh)");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in ["sh", "echo", "id", "cat", "sleep", "hostname", "uname", "touch", "reboot", "ls"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/motd"), b"from the image\n").unwrap();
}

/// One VM's images in a directory of the test's own.
struct Guest {
    _dir: tempfile::TempDir,
    spec: VmSpec,
}

impl Guest {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kernel = kernel();
        let initramfs = dir.path().join("initramfs.cpio");
        let busybox = berth_microvm::install::find_busybox().expect("busybox-static (scripts/runtime-deps.sh)");
        write_initramfs(&vminit(), &busybox, &kernel, &initramfs).unwrap();
        let tree = dir.path().join("tree");
        busybox_tree(&tree);
        let root = dir.path().join("root.ext4");
        root_image(&tree, &root).unwrap();
        let scratch = dir.path().join("scratch.ext4");
        scratch_image(&scratch, 64 << 20).unwrap();
        let spec = VmSpec {
            qemu: "qemu-system-x86_64".into(),
            accel: Accel::Tcg,
            vmlinuz: kernel.vmlinuz,
            initramfs,
            root_image: root,
            scratch_image: scratch,
            cpus: 1,
            memory_mib: 128,
            run_dir: dir.path().join("run"),
            stdout_log: dir.path().join("stdout.log"),
            stderr_log: dir.path().join("stderr.log"),
            network: None,
            enter: Vec::new(),
            shares: Vec::new(),
            run_as: None,
        };
        Self { _dir: dir, spec }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(self.spec.console_log()).unwrap_or_default()
    }
}

fn command(script: &str) -> GuestCommand {
    GuestCommand {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![("PATH".into(), "/bin".into()), ("GREETING".into(), "hello".into())],
        cwd: "/tmp".into(),
        uid: 1000,
        gid: 1001,
        hostname: "lease-a".into(),
        network: None,
        max_processes: 0,
        memory_limit_bytes: 0,
        shares: Vec::new(),
        workload_api: None,
    }
}

/// What the VM left once it powered off: its output and status lines.
struct Run {
    stdout: String,
    stderr: String,
    statuses: Vec<Status>,
}

impl Run {
    fn started(&self) -> bool {
        self.statuses.iter().any(|s| matches!(s, Status::Started(_)))
    }

    fn exit(&self) -> Option<GuestExit> {
        self.statuses.iter().find_map(|s| if let Status::Exited(exit) = s { Some(*exit) } else { None })
    }

    fn failed(&self) -> Option<&str> {
        self.statuses.iter().find_map(|s| if let Status::Failed(why) = s { Some(why.as_str()) } else { None })
    }
}

async fn powered_off(vm: &mut Vm, guest: &Guest) -> Run {
    match tokio::time::timeout(VM_DEADLINE, vm.child.wait()).await {
        Ok(status) => assert!(status.is_ok(), "{status:?}"),
        Err(_) => {
            let _ = vm.child.kill().await;
            panic!("the VM did not power off within {VM_DEADLINE:?}; its console:\n{}", guest.console());
        }
    }
    let read = |path: &Path| std::fs::read_to_string(path).unwrap_or_default();
    Run {
        stdout: read(&guest.spec.stdout_log),
        stderr: read(&guest.spec.stderr_log),
        statuses: statuses(&guest.spec.run_dir),
    }
}

#[tokio::test]
async fn a_workload_runs_in_a_kernel_of_its_own_as_its_user_and_its_output_and_exit_come_back() {
    let guest = Guest::new();
    let script = "echo out; echo err >&2; id -u; id -g; hostname; echo $GREETING; pwd; uname -r; \
                  cat /etc/motd; echo written > /tmp/note && cat /tmp/note; \
                  touch /etc/motd 2>/dev/null && echo image-writable || echo image-protected; exit 3";
    let mut vm = Vm::boot(&guest.spec, &command(script)).await.unwrap();
    let run = powered_off(&mut vm, &guest).await;
    assert!(run.started() && run.failed().is_none(), "{:?}\n{}", run.failed(), guest.console());
    assert_eq!(run.exit(), Some(GuestExit::Code(3)), "{}", guest.console());
    assert_eq!(run.stderr, "err\n");
    let lines: Vec<&str> = run.stdout.lines().collect();
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(lines[..6], ["out", "1000", "1001", "lease-a", "hello", "/tmp"], "{}", run.stdout);
    let guest_kernel = std::fs::read_to_string(kernel().vmlinuz.with_file_name("version")).unwrap_or_default();
    assert_eq!(lines[6], guest_kernel.trim(), "the guest runs the kernel it was given");
    assert_ne!(lines[6], host_kernel.trim(), "not the host's");
    assert_eq!(lines[7..], ["from the image", "written", "image-protected"], "{}", run.stdout);
}

#[tokio::test]
async fn a_signal_reaches_the_workload_and_the_vm_powers_off_after_it() {
    let mut guest = Guest::new();
    let root = rustix::process::geteuid().is_root();
    if root {
        guest.spec.run_as = Some((300_124, 300_125));
    }
    let mut vm = Vm::boot(&guest.spec, &command("echo ready; exec sleep 600")).await.unwrap();
    let deadline = tokio::time::Instant::now() + VM_DEADLINE;
    while !std::fs::read_to_string(&guest.spec.stdout_log).unwrap_or_default().contains("ready") {
        assert!(tokio::time::Instant::now() < deadline, "no output; console:\n{}", guest.console());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The VMM runs its guest under a seccomp filter of its own (2: filter mode).
    let pid = vm.child.id().expect("QEMU runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let seccomp = status.lines().find_map(|line| line.strip_prefix("Seccomp:")).map(str::trim);
    assert_eq!(seccomp, Some("2"), "QEMU is not sandboxed: {status}");
    if root {
        // It set up as root, then dropped to the lease's user before the guest ran.
        let ids = |field: &str| {
            status.lines().find_map(|l| l.strip_prefix(field)).map(|v| v.split_whitespace().collect::<Vec<_>>())
        };
        assert_eq!(ids("Uid:"), Some(vec!["300124"; 4]), "{status}");
        assert_eq!(ids("Gid:"), Some(vec!["300125"; 4]), "{status}");
    }
    vm.control.signal(15).await.unwrap();
    let run = powered_off(&mut vm, &guest).await;
    assert_eq!(run.exit(), Some(GuestExit::Signal(15)), "{}", guest.console());
}

#[tokio::test]
async fn a_command_to_run_as_root_is_refused_and_a_missing_program_is_exit_127() {
    let guest = Guest::new();
    let mut as_root = command("id");
    as_root.uid = 0;
    let mut vm = Vm::boot(&guest.spec, &as_root).await.unwrap();
    let run = powered_off(&mut vm, &guest).await;
    assert!(!run.started() && run.exit().is_none(), "nothing ran");
    let why = run.failed().unwrap_or_default();
    assert!(why.contains("must not be root"), "{why}");

    let guest = Guest::new();
    let mut missing = command("");
    missing.argv = vec!["/bin/nope".into()];
    let mut vm = Vm::boot(&guest.spec, &missing).await.unwrap();
    let run = powered_off(&mut vm, &guest).await;
    assert_eq!(run.exit(), Some(GuestExit::Code(127)));
    assert!(run.stderr.contains("cannot run /bin/nope"), "{}", run.stderr);
}

#[tokio::test]
async fn a_vm_reads_a_shared_directory_it_cannot_change_and_writes_one_the_node_then_sees() {
    let virtiofsd = berth_microvm::install::find_virtiofsd().expect("virtiofsd (scripts/microvm-deps.sh)");
    assert!(kernel().shares_directories(), "the guest kernel has no virtio-fs modules (scripts/microvm-deps.sh)");
    let mut guest = Guest::new();
    let shared = tempfile::tempdir().unwrap();
    let (library, cache) = (shared.path().join("library"), shared.path().join("cache"));
    std::fs::create_dir_all(library.join("share")).unwrap();
    std::fs::write(library.join("share/words"), b"from the node\n").unwrap();
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(cache.join("kept"), b"kept before\n").unwrap();
    // The node gives the cache to a host user of its own; the guest's user is that user inside.
    let host_user = 300_123;
    std::os::unix::fs::chown(&cache, Some(host_user), Some(host_user)).unwrap();
    let sandbox = rustix::process::geteuid().is_root();
    let mut daemons = Vec::new();
    for (index, (dir, read_only)) in [(&library, true), (&cache, false)].into_iter().enumerate() {
        let share = ShareSpec {
            virtiofsd: virtiofsd.clone(),
            dir: dir.clone(),
            socket: shared.path().join(format!("share-{index}.sock")),
            read_only,
            unchanging: read_only,
            sandbox,
            owner: (!read_only).then_some(ShareOwner { guest: (1000, 1001), host: (host_user, host_user) }),
            log: shared.path().join(format!("share-{index}.log")),
        };
        daemons.push(start_share(&share, &[]).await.unwrap());
        guest.spec.shares.push(VmShare { tag: format!("share{index}"), socket: share.socket });
    }
    let mut run = command(
        "cat /usr/local/share/words; touch /usr/local/share/x 2>/dev/null && echo library-writable || \
         echo library-protected; cat /var/cache/app/kept; echo from the guest > /var/cache/app/made; \
         stat -c %u:%g /var/cache/app /var/cache/app/made; grep -c virtiofs /proc/mounts",
    );
    run.shares = vec![
        GuestShare { tag: "share0".into(), path: "/usr/local".into(), read_only: true },
        GuestShare { tag: "share1".into(), path: "/var/cache/app".into(), read_only: false },
    ];
    let mut vm = Vm::boot(&guest.spec, &run).await.unwrap();
    let ran = powered_off(&mut vm, &guest).await;
    assert_eq!(ran.exit(), Some(GuestExit::Code(0)), "{:?} {}\n{}", ran.failed(), ran.stderr, guest.console());
    assert_eq!(
        ran.stdout, "from the node\nlibrary-protected\nkept before\n1000:1001\n1000:1001\n2\n",
        "{}",
        ran.stderr
    );
    assert_eq!(std::fs::read_to_string(cache.join("made")).unwrap(), "from the guest\n");
    let made = std::fs::metadata(cache.join("made")).unwrap();
    let owner = (std::os::unix::fs::MetadataExt::uid(&made), std::os::unix::fs::MetadataExt::gid(&made));
    assert_eq!(owner, (host_user, host_user), "the guest's file is the node's user's on the host");
    assert!(!library.join("share/x").exists());
    // Each daemon ends with the VMM it served.
    for mut daemon in daemons {
        let ended = tokio::time::timeout(Duration::from_secs(10), daemon.wait()).await;
        assert!(ended.is_ok(), "a virtiofsd outlived its VM");
    }
}
