//! The VMM: QEMU's `microvm` machine, started as a process of its own and
//! driven through the guest's control port.
//!
//! The machine has no PCI bus, no firmware and no legacy devices but one
//! serial port (the kernel's console, written to a file for diagnosis):
//! the root and scratch images as virtio-mmio block devices, and four
//! virtio-serial ports. QEMU listens on the control port's socket itself
//! (`server=on`), so the node can connect again after its own restart; the
//! workload's stdout and stderr ports and the init's status port are files
//! QEMU appends to, so nothing the guest says is lost while no node
//! listens, and a VM adopted after a restart still tells how it ended.
//! QMP answers on a socket of its own for the VMM's own questions.
//!
//! Directories of the node's reach a guest over virtio-fs: one
//! `vhost-user-fs` device per directory, each served by a `virtiofsd` of
//! its own ([`start_share`]) that the node starts before QEMU and that
//! exits when QEMU does (it serves one VMM connection, then ends). The
//! guest's memory is then a shared memory file, which the daemon maps to
//! read and write the guest's buffers. `virtiofsd` is a separate process
//! in its own sandbox (its own mount namespace pivoted into the directory,
//! a seccomp filter), so a guest that breaks its parser holds only that
//! directory; a read-only share is refused writes by the daemon as well as
//! mounted read-only in the guest.
//!
//! # Invariants
//! - QEMU runs in a process group of its own: a signal to the node's group
//!   (a Ctrl-C) does not reach the VM; only [`Vm::kill`] or the guest's
//!   power-off ends it.
//! - The root image is attached read-only; only the scratch image is
//!   written.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;
use tokio::net::UnixStream;

use crate::wire::{self, Frame, GuestCommand, GuestStats, Status};
use crate::{CONTROL_PORT, STATS_PORT, STATUS_PORT, STDERR_PORT, STDOUT_PORT};

/// How long QEMU may take to open its control socket.
const SOCKET_DEADLINE: Duration = Duration::from_secs(10);

/// The translator's code cache under TCG, MiB.
const TCG_CACHE_MIB: u32 = 32;

/// The least memory the stock kernel and its initramfs boot in.
pub const MIN_MEMORY_MIB: u32 = 128;

/// How the VMM runs guest code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation through `/dev/kvm`.
    Kvm,
    /// QEMU's own translator: no `/dev/kvm` needed, several times slower.
    Tcg,
}

impl Accel {
    /// Its name on QEMU's command line.
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The guest's address on its network.
pub const GUEST_ADDRESS: &str = "10.0.2.15/24";

/// The guest's gateway: QEMU's user-mode stack.
pub const GUEST_GATEWAY: &str = "10.0.2.2";

/// An address of the guest's network that no machine holds: QEMU hands
/// each connection the guest makes to it to a program (see
/// [`SlirpNetwork::outbound`]).
pub const GUEST_SERVICES_ADDRESS: &str = "10.0.2.100";

/// The guest's network: QEMU's user-mode stack (libslirp), in whichever
/// network namespace QEMU runs. The guest reaches that namespace's
/// `127.0.0.1` at its gateway ([`GUEST_GATEWAY`]), and any other address
/// as the namespace's routes allow (a tenant's namespace has none); the
/// ports named here are forwarded in from the namespace's `127.0.0.1`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlirpNetwork {
    /// Ports on the namespace's `127.0.0.1` forwarded to the same port of
    /// the guest.
    pub inbound: Vec<u16>,
    /// Ports of [`GUEST_SERVICES_ADDRESS`] whose connections QEMU hands to
    /// a program it starts for each (in its namespace; the program's stdin
    /// and stdout are the connection): the port and the program's argv.
    pub outbound: Vec<(u16, Vec<String>)>,
}

/// A directory of the node's a VM mounts (see [`crate::wire::GuestShare`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmShare {
    /// The tag the guest mounts it by.
    pub tag: String,
    /// Where its `virtiofsd` listens ([`start_share`]).
    pub socket: PathBuf,
}

/// One VM to boot.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// The QEMU binary (`qemu-system-x86_64`).
    pub qemu: PathBuf,
    /// How guest code runs.
    pub accel: Accel,
    /// The kernel image.
    pub vmlinuz: PathBuf,
    /// The initramfs from [`crate::image::write_initramfs`].
    pub initramfs: PathBuf,
    /// The read-only root image.
    pub root_image: PathBuf,
    /// The lease's writable scratch image.
    pub scratch_image: PathBuf,
    /// Virtual CPUs.
    pub cpus: u32,
    /// Guest memory, MiB (at least [`MIN_MEMORY_MIB`]).
    pub memory_mib: u32,
    /// The directory for the VM's sockets, status and console log.
    pub run_dir: PathBuf,
    /// The file the workload's stdout is appended to.
    pub stdout_log: PathBuf,
    /// The file the workload's stderr is appended to.
    pub stderr_log: PathBuf,
    /// Its network, if it has one.
    pub network: Option<SlirpNetwork>,
    /// A command line prefix QEMU is started through (`ip netns exec NAME`,
    /// to run it in a tenant's network namespace); empty for none.
    pub enter: Vec<String>,
    /// The directories it mounts, each served by a running `virtiofsd`.
    pub shares: Vec<VmShare>,
    /// The user and group QEMU drops to once it has opened its devices,
    /// sockets and files (`-runas`), before the guest runs; `None` keeps
    /// the user it was started as.
    pub run_as: Option<(u32, u32)>,
}

impl VmSpec {
    /// Where QEMU listens for the node on the guest's control port.
    pub fn control_socket(&self) -> PathBuf {
        self.run_dir.join("control.sock")
    }

    /// Where QEMU answers QMP.
    pub fn qmp_socket(&self) -> PathBuf {
        self.run_dir.join("qmp.sock")
    }

    /// Where the guest kernel's console goes.
    pub fn console_log(&self) -> PathBuf {
        self.run_dir.join("console.log")
    }

    /// Where the init's status lines go.
    pub fn status_file(&self) -> PathBuf {
        status_file(&self.run_dir)
    }

    /// QEMU's arguments for this VM.
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |parts: &[&str]| args.extend(parts.iter().map(OsString::from));
        let memory_mib = self.memory_mib.max(MIN_MEMORY_MIB);
        if self.shares.is_empty() {
            push(&["-M", "microvm,isa-serial=on,pit=off,pic=off,rtc=on"]);
        } else {
            // A `virtiofsd` reads and writes the guest's buffers in its memory, which it must be able to map.
            push(&["-M", "microvm,isa-serial=on,pit=off,pic=off,rtc=on,memory-backend=mem"]);
            push(&["-object", &format!("memory-backend-memfd,id=mem,size={memory_mib}M,share=on")]);
        }
        match self.accel {
            Accel::Kvm => push(&["-accel", "kvm"]),
            // The translator's code cache is the VMM's own memory: QEMU's
            // default of a gigabyte grows as the guest runs; a small guest
            // needs a small one.
            Accel::Tcg => push(&["-accel", &format!("tcg,tb-size={TCG_CACHE_MIB}")]),
        }
        push(&["-cpu", if self.accel == Accel::Kvm { "host" } else { "max" }]);
        push(&["-smp", &self.cpus.max(1).to_string()]);
        push(&["-m", &memory_mib.to_string()]);
        push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
        // A seccomp filter of QEMU's own, set before the guest runs: a VMM a
        // guest took over still cannot mount, reboot the host, swap, load a
        // new kernel or read the kernel's log, make an obsolete system call,
        // or change its scheduling or affinity. Spawning and changing
        // sessions stay allowed: the network's relays are programs QEMU
        // starts for each guest connection, each in a session of its own.
        push(&["-sandbox", "on,obsolete=deny,resourcecontrol=deny,spawn=allow"]);
        if let Some((uid, gid)) = self.run_as {
            push(&["-runas", &format!("{uid}:{gid}")]);
        }
        let path = |p: &Path| p.display().to_string();
        push(&["-kernel", &path(&self.vmlinuz), "-initrd", &path(&self.initramfs)]);
        push(&["-drive", &format!("id=root,file={},format=raw,if=none,readonly=on", escape(&self.root_image))]);
        push(&["-device", "virtio-blk-device,drive=root"]);
        push(&["-drive", &format!("id=scratch,file={},format=raw,if=none", escape(&self.scratch_image))]);
        push(&["-device", "virtio-blk-device,drive=scratch"]);
        for (index, share) in self.shares.iter().enumerate() {
            push(&["-chardev", &format!("socket,id=share{index},path={}", escape(&share.socket))]);
            push(&[
                "-device",
                &format!("vhost-user-fs-device,chardev=share{index},tag={}", share.tag.replace(',', ",,")),
            ]);
        }
        push(&["-device", "virtio-serial-device"]);
        push(&["-chardev", &control_chardev(&self.control_socket())]);
        push(&["-device", &format!("virtserialport,chardev=control,name={CONTROL_PORT}")]);
        push(&[
            "-chardev",
            &format!("socket,id=stats,path={},server=on,wait=off", escape(&stats_socket(&self.run_dir))),
        ]);
        push(&["-device", &format!("virtserialport,chardev=stats,name={STATS_PORT}")]);
        for (id, file, name) in [
            ("stdout", &self.stdout_log, STDOUT_PORT),
            ("stderr", &self.stderr_log, STDERR_PORT),
            ("status", &self.status_file(), STATUS_PORT),
        ] {
            push(&["-chardev", &format!("file,id={id},path={},append=on", escape(file))]);
            push(&["-device", &format!("virtserialport,chardev={id},name={name}")]);
        }
        if let Some(network) = &self.network {
            // The guest's resolver is the tenant's, at the gateway; QEMU's
            // own DNS proxy (10.0.2.3) is named nowhere.
            let mut netdev = "user,id=net0,net=10.0.2.0/24,host=10.0.2.2".to_owned();
            for port in &network.inbound {
                netdev.push_str(&format!(",hostfwd=tcp:127.0.0.1:{port}-:{port}"));
            }
            for (port, argv) in &network.outbound {
                // QEMU's option syntax doubles a comma inside a value.
                let program = argv.join(" ").replace(',', ",,");
                netdev.push_str(&format!(",guestfwd=tcp:{GUEST_SERVICES_ADDRESS}:{port}-cmd:{program}"));
            }
            push(&["-netdev", &netdev, "-device", "virtio-net-device,netdev=net0"]);
        }
        push(&["-qmp", &format!("unix:{},server=on,wait=off", escape(&self.qmp_socket()))]);
        push(&["-serial", &format!("file:{}", path(&self.console_log()))]);
        let mut append = "console=ttyS0 reboot=t panic=-1 quiet".to_owned();
        if let Some(khz) = tsc_khz() {
            // The kernel skips calibrating the TSC against a timer it
            // would have to emulate slowly first.
            append.push_str(&format!(" tsc_early_khz={khz}"));
        }
        push(&["-append", &append]);
        args
    }
}

/// The `-chardev` argument of the control port listening at `socket`:
/// whole and unique to its VM, so a VMM no record names is found by it.
pub fn control_chardev(socket: &Path) -> String {
    format!("socket,id=control,path={},server=on,wait=off", escape(socket))
}

/// QEMU's option syntax doubles a comma inside a value.
fn escape(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

/// The host's TSC rate, kHz, as the kernel reported it.
fn tsc_khz() -> Option<u64> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz = cpuinfo.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse::<f64>().ok()?;
    // A rate in kHz fits u64 for any real CPU; the cast truncates the fraction on purpose.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "a positive rate of a few million kHz")]
    Some((mhz * 1000.0) as u64)
}

/// A VM that could not be booted or talked to.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// QEMU (or a share's daemon) could not be started.
    #[error("starting {program}: {source}")]
    Spawn {
        /// The binary.
        program: String,
        /// The failure.
        source: std::io::Error,
    },
    /// QEMU exited before it listened, with what it printed.
    #[error("the VMM exited before it listened ({status}): {stderr}")]
    Exited {
        /// Its exit status.
        status: String,
        /// Its last output.
        stderr: String,
    },
    /// The control socket never opened.
    #[error("the VMM did not open {} within {SOCKET_DEADLINE:?}", .0.display())]
    NoSocket(PathBuf),
    /// Reading or writing the control port failed.
    #[error("the control port: {0}")]
    Io(#[from] std::io::Error),
}

/// Where QEMU listens for the node on the guest's stats port, for the VM
/// whose run directory is `run_dir`.
pub fn stats_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("stats.sock")
}

/// How long the guest may take to answer what its workload uses.
const STATS_DEADLINE: Duration = Duration::from_secs(2);

/// Asks the init of the VM whose run directory is `run_dir` what its
/// workload uses now; `None` when it does not answer in time (a VM still
/// booting, or one whose init predates the stats port). Each question
/// carries a tag of its own, so an answer to an earlier question that
/// timed out is never taken for this one's.
pub async fn guest_stats(run_dir: &Path) -> Option<GuestStats> {
    use std::sync::atomic::{AtomicU8, Ordering};
    use tokio::io::AsyncReadExt as _;
    static NEXT_TAG: AtomicU8 = AtomicU8::new(1);
    let tag = NEXT_TAG.fetch_add(1, Ordering::Relaxed).max(1);
    let asked = async {
        let mut port = UnixStream::connect(stats_socket(run_dir)).await.ok()?;
        port.write_all(&[tag]).await.ok()?;
        let mut answer = Vec::new();
        let mut buffer = [0_u8; 128];
        while answer.len() < 4096 {
            let read = port.read(&mut buffer).await.ok()?;
            if read == 0 {
                return None;
            }
            answer.extend_from_slice(&buffer[..read]);
            if let Some(stats) = GuestStats::parse_answer(&String::from_utf8_lossy(&answer), tag) {
                return Some(stats);
            }
        }
        None
    };
    tokio::time::timeout(STATS_DEADLINE, asked).await.ok().flatten()
}

/// Where the init's status lines go, for the VM whose run directory is `run_dir`.
pub fn status_file(run_dir: &Path) -> PathBuf {
    run_dir.join("status")
}

/// What the init has reported of the VM whose run directory is `run_dir`.
pub fn statuses(run_dir: &Path) -> Vec<Status> {
    Status::parse_all(&std::fs::read_to_string(status_file(run_dir)).unwrap_or_default())
}

/// How a directory is shared with a guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareSpec {
    /// The `virtiofsd` binary.
    pub virtiofsd: PathBuf,
    /// The directory.
    pub dir: PathBuf,
    /// Where the daemon listens for the VMM.
    pub socket: PathBuf,
    /// Whether the guest may only read it.
    pub read_only: bool,
    /// Whether nothing changes it while the VM runs (the node's `/usr`),
    /// so the guest may keep what it read; else the guest looks again
    /// after a second, as the node changes it (an identity's rotated
    /// files).
    pub unchanging: bool,
    /// Whether the daemon sandboxes itself in namespaces of its own (it
    /// can only as root); else it runs unsandboxed (`--sandbox none`),
    /// which a node never does for a guest (only a test run unprivileged).
    pub sandbox: bool,
    /// Whose the guest's files are on the host, for a directory that is one
    /// lease's own (its cache views, its identity); `None` for the node's
    /// own directories, shown as they are.
    pub owner: Option<ShareOwner>,
    /// Where the daemon's own output goes.
    pub log: PathBuf,
}

/// How a share's owners read across the VM's edge: the guest's workload
/// user and the host user the node gave the directory are one, both ways,
/// and whatever the guest writes as any other user (its root included,
/// should a workload take the guest's kernel) lands on the host as that
/// host user too. So no guest ever makes a file on the host owned by root
/// or by a user of another lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareOwner {
    /// The workload's uid and gid inside the guest.
    pub guest: (u32, u32),
    /// The uid and gid the node gave the directory on the host.
    pub host: (u32, u32),
}

impl ShareOwner {
    /// `virtiofsd`'s translation arguments: a 1:1 map between the two
    /// users, and every other guest id squashed onto the host one (the
    /// daemon refuses overlapping ranges, so the squashes go around the map).
    fn args(&self) -> Vec<OsString> {
        let mut args = Vec::new();
        for (flag, guest, host) in
            [("--translate-uid", self.guest.0, self.host.0), ("--translate-gid", self.guest.1, self.host.1)]
        {
            let mut push = |rule: String| args.extend([OsString::from(flag), rule.into()]);
            push(format!("map:{guest}:{host}:1"));
            if guest > 0 {
                push(format!("squash-guest:0:{host}:{guest}"));
            }
            // Ids run to u32::MAX - 1; u32::MAX itself is no id.
            if let Some(above) = guest.checked_add(1).filter(|above| *above < u32::MAX) {
                push(format!("squash-guest:{above}:{host}:{}", u32::MAX - above));
            }
        }
        args
    }
}

impl ShareSpec {
    /// The daemon's arguments.
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "--socket-path".into(),
            self.socket.clone().into(),
            "--shared-dir".into(),
            self.dir.clone().into(),
            "--sandbox".into(),
            if self.sandbox { "namespace" } else { "none" }.into(),
            "--log-level".into(),
            "warn".into(),
        ];
        if self.read_only {
            args.push("--readonly".into());
        }
        if self.unchanging {
            args.extend(["--cache".into(), "always".into()]);
        }
        if let Some(owner) = &self.owner {
            args.extend(owner.args());
        }
        args
    }
}

/// Starts a `virtiofsd` for `share` through the command line prefix
/// `enter` (a cgroup's), in a process group of its own, and waits until it
/// listens. It serves the one VMM that connects and exits when that VMM
/// does; the caller kills it (its group) if no VMM ever connects.
pub async fn start_share(share: &ShareSpec, enter: &[String]) -> Result<tokio::process::Child, VmError> {
    let _ = std::fs::remove_file(&share.socket);
    let mut child = spawn_detached(enter, &share.virtiofsd, share.args(), &share.log)?;
    let deadline = tokio::time::Instant::now() + SOCKET_DEADLINE;
    while !share.socket.exists() {
        let ended = match child.try_wait() {
            Ok(ended) => ended,
            Err(error) => {
                kill_group(&child);
                return Err(error.into());
            }
        };
        if let Some(status) = ended {
            let printed = std::fs::read_to_string(&share.log).unwrap_or_default();
            return Err(VmError::Exited { status: status.to_string(), stderr: printed.trim().to_owned() });
        }
        if tokio::time::Instant::now() > deadline {
            kill_group(&child);
            return Err(VmError::NoSocket(share.socket.clone()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(child)
}

/// Starts `program` with `args` through the command line prefix `enter`,
/// in a process group of its own (a signal to the node's group does not
/// reach it), its output to `log`, left running when its handle drops.
fn spawn_detached(
    enter: &[String],
    program: &Path,
    args: Vec<OsString>,
    log: &Path,
) -> Result<tokio::process::Child, VmError> {
    let log = std::fs::File::create(log)?;
    let mut line: Vec<OsString> = enter.iter().map(Into::into).collect();
    line.push(program.as_os_str().to_owned());
    line.extend(args);
    tokio::process::Command::new(&line[0])
        .args(&line[1..])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .kill_on_drop(false)
        .spawn()
        .map_err(|source| VmError::Spawn { program: program.display().to_string(), source })
}

/// Kills the process group `child` leads (a daemon and what it forked).
pub fn kill_group(child: &tokio::process::Child) {
    if let Some(group) = child.id().and_then(|id| i32::try_from(id).ok()).and_then(rustix::process::Pid::from_raw) {
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
    }
}

/// A VM's control port, as the node holds it.
#[derive(Debug)]
pub struct Control(UnixStream);

impl Control {
    /// Connects to the control port of a running VM (after a restart too).
    pub async fn connect(socket: &Path) -> Result<Self, VmError> {
        Ok(Self(UnixStream::connect(socket).await?))
    }

    /// Has the init send `signal` to the workload and all it started.
    pub async fn signal(&mut self, signal: i32) -> Result<(), VmError> {
        self.send(&Frame::Signal(signal)).await
    }

    /// Hands the init the command to run (again, after a node's restart:
    /// an init that has one ignores another).
    pub async fn run(&mut self, command: &GuestCommand) -> Result<(), VmError> {
        self.send(&Frame::Run(Box::new(command.clone()))).await
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), VmError> {
        self.0.write_all(&wire::encode(frame)).await?;
        Ok(())
    }
}

/// A booted VM: its QEMU process and its control port.
#[derive(Debug)]
pub struct Vm {
    /// The QEMU process; the VM ends when it does.
    pub child: tokio::process::Child,
    /// The control port.
    pub control: Control,
}

impl Vm {
    /// Starts QEMU for `spec`, connects to the control port and hands the
    /// init `command`.
    pub async fn boot(spec: &VmSpec, command: &GuestCommand) -> Result<Self, VmError> {
        std::fs::create_dir_all(&spec.run_dir)?;
        let mut child = spawn_detached(&spec.enter, &spec.qemu, spec.args(), &spec.run_dir.join("vmm.log"))?;
        let socket = spec.control_socket();
        let deadline = tokio::time::Instant::now() + SOCKET_DEADLINE;
        let mut control = loop {
            if let Ok(control) = Control::connect(&socket).await {
                break control;
            }
            if let Some(status) = child.try_wait()? {
                let printed = std::fs::read_to_string(spec.run_dir.join("vmm.log")).unwrap_or_default();
                return Err(VmError::Exited { status: status.to_string(), stderr: printed.trim().to_owned() });
            }
            if tokio::time::Instant::now() > deadline {
                let _ = child.start_kill();
                return Err(VmError::NoSocket(socket));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if let Err(error) = control.send(&Frame::Run(Box::new(command.clone()))).await {
            let _ = child.start_kill();
            return Err(error);
        }
        Ok(Self { child, control })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_attaches_the_root_read_only_and_escapes_commas() {
        let spec = VmSpec {
            qemu: "qemu-system-x86_64".into(),
            accel: Accel::Tcg,
            vmlinuz: "/k/vmlinuz".into(),
            initramfs: "/k/initramfs".into(),
            root_image: "/images/sha256,abc.ext4".into(),
            scratch_image: "/leases/l1/scratch.ext4".into(),
            cpus: 0,
            memory_mib: 64,
            run_dir: "/leases/l1".into(),
            stdout_log: "/logs/l1/stdout.log".into(),
            stderr_log: "/logs/l1/stderr.log".into(),
            network: Some(SlirpNetwork {
                inbound: vec![8080, 8081],
                outbound: vec![(80, vec!["/bin/busybox".into(), "nc".into(), "127.0.0.54,x".into(), "80".into()])],
            }),
            enter: Vec::new(),
            shares: Vec::new(),
            run_as: Some((300_000, 300_001)),
        };
        let args: Vec<String> = spec.args().into_iter().map(|a| a.into_string().unwrap()).collect();
        let after = |flag: &str| args.iter().skip_while(|a| *a != flag).nth(1).cloned().unwrap();
        assert_eq!(after("-accel"), "tcg,tb-size=32");
        assert_eq!(after("-runas"), "300000:300001", "QEMU drops to the lease's user before the guest runs");
        assert_eq!(after("-smp"), "1", "at least one vCPU");
        assert_eq!(after("-m"), "128", "at least the memory the kernel boots in");
        assert!(
            args.contains(&"id=root,file=/images/sha256,,abc.ext4,format=raw,if=none,readonly=on".to_owned()),
            "{args:?}"
        );
        assert!(args.contains(&"id=scratch,file=/leases/l1/scratch.ext4,format=raw,if=none".to_owned()), "{args:?}");
        assert!(args.contains(&"socket,id=control,path=/leases/l1/control.sock,server=on,wait=off".to_owned()));
        assert!(args.contains(&format!("virtserialport,chardev=control,name={CONTROL_PORT}")));
        assert!(args.contains(&"socket,id=stats,path=/leases/l1/stats.sock,server=on,wait=off".to_owned()));
        assert!(args.contains(&format!("virtserialport,chardev=stats,name={STATS_PORT}")));
        assert!(args.contains(&"file,id=stdout,path=/logs/l1/stdout.log,append=on".to_owned()), "{args:?}");
        assert!(args.contains(&"file,id=status,path=/leases/l1/status,append=on".to_owned()), "{args:?}");
        assert_eq!(
            after("-netdev"),
            "user,id=net0,net=10.0.2.0/24,host=10.0.2.2,hostfwd=tcp:127.0.0.1:8080-:8080,\
             hostfwd=tcp:127.0.0.1:8081-:8081,guestfwd=tcp:10.0.2.100:80-cmd:/bin/busybox nc 127.0.0.54,,x 80"
        );
    }

    #[test]
    fn a_vm_with_shares_has_shared_memory_and_a_device_per_directory() {
        let spec = VmSpec {
            qemu: "qemu-system-x86_64".into(),
            accel: Accel::Kvm,
            vmlinuz: "/k/vmlinuz".into(),
            initramfs: "/k/initramfs".into(),
            root_image: "/images/root.ext4".into(),
            scratch_image: "/leases/l1/scratch.ext4".into(),
            cpus: 1,
            memory_mib: 384,
            run_dir: "/leases/l1".into(),
            stdout_log: "/logs/l1/stdout.log".into(),
            stderr_log: "/logs/l1/stderr.log".into(),
            network: None,
            enter: Vec::new(),
            shares: vec![
                VmShare { tag: "usr".into(), socket: "/leases/l1/share-0.sock".into() },
                VmShare { tag: "cache,1".into(), socket: "/leases/l1/share-1.sock".into() },
            ],
            run_as: None,
        };
        let args: Vec<String> = spec.args().into_iter().map(|a| a.into_string().unwrap()).collect();
        let after = |flag: &str| args.iter().skip_while(|a| *a != flag).nth(1).cloned().unwrap();
        assert_eq!(after("-M"), "microvm,isa-serial=on,pit=off,pic=off,rtc=on,memory-backend=mem");
        assert!(!args.contains(&"-runas".to_owned()), "{args:?}");
        assert_eq!(after("-object"), "memory-backend-memfd,id=mem,size=384M,share=on");
        assert_eq!(after("-m"), "384", "the backend and the machine agree on the size");
        assert!(args.contains(&"socket,id=share0,path=/leases/l1/share-0.sock".to_owned()), "{args:?}");
        assert!(args.contains(&"vhost-user-fs-device,chardev=share0,tag=usr".to_owned()), "{args:?}");
        assert!(args.contains(&"vhost-user-fs-device,chardev=share1,tag=cache,,1".to_owned()), "{args:?}");

        let without = VmSpec { shares: Vec::new(), ..spec };
        let args: Vec<String> = without.args().into_iter().map(|a| a.into_string().unwrap()).collect();
        assert!(!args.iter().any(|a| a.contains("memory-backend")), "private memory without shares: {args:?}");
    }

    #[test]
    fn a_read_only_share_is_refused_writes_by_its_daemon() {
        let share = ShareSpec {
            virtiofsd: "/usr/libexec/virtiofsd".into(),
            dir: "/usr".into(),
            socket: "/leases/l1/share-0.sock".into(),
            read_only: true,
            unchanging: true,
            sandbox: true,
            owner: None,
            log: "/leases/l1/share-0.log".into(),
        };
        let args: Vec<String> = share.args().into_iter().map(|a| a.into_string().unwrap()).collect();
        assert_eq!(
            args.join(" "),
            "--socket-path /leases/l1/share-0.sock --shared-dir /usr --sandbox namespace --log-level warn \
             --readonly --cache always"
        );
        let writable = ShareSpec { read_only: false, unchanging: false, sandbox: false, ..share };
        let args: Vec<String> = writable.args().into_iter().map(|a| a.into_string().unwrap()).collect();
        assert!(!args.contains(&"--readonly".to_owned()), "{args:?}");
        assert!(!args.contains(&"always".to_owned()), "what the node changes is looked at again: {args:?}");
        assert!(args.contains(&"none".to_owned()), "{args:?}");
    }

    #[test]
    fn a_leases_share_gives_every_guest_id_to_the_host_user_the_node_chose() {
        let owner = ShareOwner { guest: (1000, 1001), host: (300_007, 300_007) };
        let args: Vec<String> = owner.args().into_iter().map(|a| a.into_string().unwrap()).collect();
        assert_eq!(
            args.join(" "),
            "--translate-uid map:1000:300007:1 --translate-uid squash-guest:0:300007:1000 \
             --translate-uid squash-guest:1001:300007:4294966294 \
             --translate-gid map:1001:300007:1 --translate-gid squash-guest:0:300007:1001 \
             --translate-gid squash-guest:1002:300007:4294966293"
        );
        // The ranges end at u32::MAX, never past it, and none is empty.
        let edge = ShareOwner { guest: (0, u32::MAX - 1), host: (5, 5) };
        let args: Vec<String> = edge.args().into_iter().map(|a| a.into_string().unwrap()).collect();
        assert_eq!(
            args.join(" "),
            "--translate-uid map:0:5:1 --translate-uid squash-guest:1:5:4294967294 \
             --translate-gid map:4294967294:5:1 --translate-gid squash-guest:0:5:4294967294"
        );
    }
}
