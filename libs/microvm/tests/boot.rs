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
use berth_microvm::vmm::{Accel, Vm, VmSpec};
use berth_microvm::wire::{Frame, GuestCommand, GuestExit};

/// How long one VM may take from boot to power-off under TCG on a busy
/// machine.
const VM_DEADLINE: Duration = Duration::from_secs(120);

/// The static init `make vminit` builds.
fn vminit() -> PathBuf {
    if let Some(path) = std::env::var_os("BERTH_VMINIT") {
        return path.into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"), PathBuf::from);
    let path = target.join("x86_64-unknown-linux-gnu/release/berth-vminit");
    assert!(path.is_file(), "no static init at {}: `make vminit` builds it", path.display());
    path
}

fn kernel() -> GuestKernel {
    let dir = std::env::var_os("BERTH_MICROVM_KERNEL").map_or_else(|| PathBuf::from(DEFAULT_KERNEL_DIR), PathBuf::from);
    GuestKernel::from_dir(&dir).unwrap_or_else(|e| panic!("{e}: scripts/microvm-deps.sh installs it"))
}

/// A root tree of busybox and its applets.
fn busybox_tree(root: &Path) {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .expect("busybox-static (scripts/runtime-deps.sh)");
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
        write_initramfs(&vminit(), &kernel, &initramfs).unwrap();
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
    }
}

/// Everything the init sent until the port closed, and the VMM's exit.
struct Run {
    started: bool,
    stdout: String,
    stderr: String,
    exit: Option<GuestExit>,
    failed: Option<String>,
}

async fn collect(vm: &mut Vm, guest: &Guest) -> Run {
    let mut run = Run { started: false, stdout: String::new(), stderr: String::new(), exit: None, failed: None };
    let read = async {
        while let Some(frame) = vm.next_frame().await.unwrap() {
            match frame {
                Frame::Started(_) => run.started = true,
                Frame::Stdout(bytes) => run.stdout.push_str(&String::from_utf8_lossy(&bytes)),
                Frame::Stderr(bytes) => run.stderr.push_str(&String::from_utf8_lossy(&bytes)),
                Frame::Exited(exit) => run.exit = Some(exit),
                Frame::Failed(why) => run.failed = Some(why),
                other => panic!("the init sent a node's frame: {other:?}"),
            }
        }
    };
    if tokio::time::timeout(VM_DEADLINE, read).await.is_err() {
        let _ = vm.kill().await;
        panic!("the VM did not finish within {VM_DEADLINE:?}; its console:\n{}", guest.console());
    }
    let status = tokio::time::timeout(Duration::from_secs(30), vm.wait()).await;
    assert!(matches!(status, Ok(Ok(_))), "the VMM exits once the guest powers off: {status:?}\n{}", guest.console());
    run
}

#[tokio::test]
async fn a_workload_runs_in_a_kernel_of_its_own_as_its_user_and_its_output_and_exit_come_back() {
    let guest = Guest::new();
    let script = "echo out; echo err >&2; id -u; id -g; hostname; echo $GREETING; pwd; uname -r; \
                  cat /etc/motd; echo written > /tmp/note && cat /tmp/note; \
                  touch /etc/motd 2>/dev/null && echo image-writable || echo image-protected; exit 3";
    let mut vm = Vm::boot(&guest.spec, &command(script)).await.unwrap();
    let run = collect(&mut vm, &guest).await;
    assert!(run.started && run.failed.is_none(), "{:?}\n{}", run.failed, guest.console());
    assert_eq!(run.exit, Some(GuestExit::Code(3)), "{}", guest.console());
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
    let guest = Guest::new();
    let mut vm = Vm::boot(&guest.spec, &command("echo ready; exec sleep 600")).await.unwrap();
    let signaller = vm.signaller();
    let mut stdout = String::new();
    while !stdout.contains("ready") {
        match tokio::time::timeout(VM_DEADLINE, vm.next_frame()).await {
            Ok(Ok(Some(Frame::Stdout(bytes)))) => stdout.push_str(&String::from_utf8_lossy(&bytes)),
            Ok(Ok(Some(_))) => {}
            other => panic!("no output before {other:?}; console:\n{}", guest.console()),
        }
    }
    signaller.signal(15).await.unwrap();
    let run = collect(&mut vm, &guest).await;
    assert_eq!(run.exit, Some(GuestExit::Signal(15)), "{}", guest.console());
}

#[tokio::test]
async fn a_command_to_run_as_root_is_refused_and_a_missing_program_is_exit_127() {
    let guest = Guest::new();
    let mut as_root = command("id");
    as_root.uid = 0;
    let mut vm = Vm::boot(&guest.spec, &as_root).await.unwrap();
    let run = collect(&mut vm, &guest).await;
    assert!(!run.started && run.exit.is_none(), "nothing ran");
    let why = run.failed.unwrap_or_default();
    assert!(why.contains("must not be root"), "{why}");

    let guest = Guest::new();
    let mut missing = command("");
    missing.argv = vec!["/bin/nope".into()];
    let mut vm = Vm::boot(&guest.spec, &missing).await.unwrap();
    let run = collect(&mut vm, &guest).await;
    assert_eq!(run.exit, Some(GuestExit::Code(127)));
    assert!(run.stderr.contains("cannot run /bin/nope"), "{}", run.stderr);
}
