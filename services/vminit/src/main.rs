//! `berth-vminit`: PID 1 of a berth microVM.
//!
//! The kernel starts it from the initramfs. It mounts the pseudo
//! filesystems, loads the modules the initramfs carries, waits on the
//! control port for the node's [`Frame::Run`], finds the lease's root and
//! scratch drives by their ext4 labels, and builds the workload's root as
//! an overlay of the two (the root image read-only below, the scratch
//! above), and mounts the node's shared directories the command names
//! (virtio-fs) inside it, and relays the Workload API's socket when the
//! command has one. It then starts the workload in that root as the unprivileged
//! user the node named, in a process group of its own, with the stdout and
//! stderr ports as its own stdout and stderr (nothing copies its output),
//! passes on the node's signals, reaps every process that ends (it is
//! PID 1), reports each of the command's inbound ports on the status port
//! once something listens on it (the node's forwards accept before then),
//! and once the workload ends kills what it left, reports the exit on the
//! status port and powers the VM off.
//!
//! # Invariants
//! - Nothing runs as root but the init itself: a command naming uid or gid
//!   0 is refused, and the workload starts with an empty capability
//!   bounding set, `no_new_privs` and its process limit, so nothing it runs
//!   (a set-uid binary of its image) regains root inside the VM.
//! - The exit is the last status line; the VM powers off after it whatever
//!   happens, so a VM never outlives its workload.
//! - Any failure before the workload starts is reported as
//!   [`Status::Failed`] when the status port is open, and on the console
//!   always.
//! - A shared directory is mounted `nosuid,nodev` (and read-only when the
//!   command says so) at a path reached through no link of the image's,
//!   so a mount never lands outside the workload's root.
//! - With a memory limit in the command, the workload and all it starts
//!   run in a memory cgroup (v2) of that size from before the program is
//!   executed, so it never takes the memory the guest's kernel and init
//!   need; a workload SIGKILLed while that cgroup counts an OOM kill is
//!   reported as [`GuestExit::OutOfMemory`].
//!
//! The same binary, started by the init as `/init --exec UID GID NPROC CWD
//! CGROUP -- ARGV...`, is the step between the init and the workload: it
//! enters the cgroup and the root, drops to the workload's user and
//! executes the program, so the init needs no code that runs between
//! `fork` and `exec`.

#![allow(clippy::disallowed_methods, reason = "the init is one blocking process with no async runtime")]

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_microvm::kernel::{MODULES, SHARE_MODULES};
use berth_microvm::wire::{Decoder, Frame, GuestCommand, GuestExit, GuestNetwork, GuestStats, Status};
use berth_microvm::wire::{GuestRelay, GuestShare};
use berth_microvm::{CONTROL_PORT, ROOT_LABEL, SCRATCH_LABEL, STATS_PORT, STATUS_PORT, STDERR_PORT, STDOUT_PORT};
use nix::mount::{MsFlags, mount};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid};

/// How long the devices the modules bring may take to appear: seconds on
/// a guest under QEMU's translator sharing its host's CPUs with many
/// others, so the deadline is only for a VM that is broken.
const DEVICE_DEADLINE: Duration = Duration::from_secs(60);

/// How long the init waits for a node to send the command.
const COMMAND_DEADLINE: Duration = Duration::from_secs(600);

/// How often the control port is read again while no node is connected.
const RECONNECT_POLL: Duration = Duration::from_millis(100);

/// How often the init checks whether the workload listens on its inbound
/// ports yet; as often as the node's readiness checks by default.
const LISTEN_POLL: Duration = Duration::from_millis(100);

/// Where the workload's root is assembled.
const NEW_ROOT: &str = "/run/root";

/// How many Workload API connections the init relays at once. Its relay
/// threads live outside the workload's memory cgroup, so a workload that
/// opened connections without end would otherwise grow the init, not
/// itself; one past this is closed at once. Each holds two threads of
/// [`RELAY_STACK`] each. A workload's SPIFFE client holds one or two.
const MAX_RELAYED: usize = 32;

/// The stack of a relay thread: a copy loop needs little.
const RELAY_STACK: usize = 64 * 1024;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--exec") {
        let error = exec_workload(&args[2..]);
        let _ = writeln!(io::stderr(), "berth-vminit: {error}");
        std::process::exit(127);
    }
    let mut console = Console::open();
    let mut status = None;
    if let Err(error) = run(&mut console, &mut status) {
        console.say(&format!("failed: {error}"));
        if let Some(status) = &mut status {
            let _ = report(status, &Status::Failed(error));
        }
    }
    nix::unistd::sync();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
}

/// The kernel's console, for what the node reads only when diagnosing.
struct Console(Option<File>);

impl Console {
    fn open() -> Self {
        let _ = std::fs::create_dir_all("/dev");
        let _ = mount(Some("devtmpfs"), "/dev", Some("devtmpfs"), MsFlags::MS_NOSUID, None::<&str>);
        Self(OpenOptions::new().write(true).open("/dev/console").ok())
    }

    fn say(&mut self, line: &str) {
        if let Some(console) = &mut self.0 {
            let _ = writeln!(console, "berth-vminit: {line}");
        }
    }
}

fn report(port: &mut File, status: &Status) -> io::Result<()> {
    port.write_all(status.line().as_bytes())
}

fn run(console: &mut Console, status_slot: &mut Option<File>) -> Result<(), String> {
    for (source, target, kind) in [("proc", "/proc", "proc"), ("sysfs", "/sys", "sysfs")] {
        let _ = std::fs::create_dir_all(target);
        mount(Some(source), target, Some(kind), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, None::<&str>)
            .map_err(|e| format!("mounting {target}: {e}"))?;
    }
    load_modules(MODULES, console)?;
    let status = status_slot.insert(open_port(STATUS_PORT)?);
    let mut reader = open_port(CONTROL_PORT)?;

    let mut decoder = Decoder::default();
    // A node that went away before the guest read its command (an agent
    // restarted while the VM booted) sends it again once it is back.
    let waiting = Instant::now();
    let command = loop {
        match read_frame(&mut reader, &mut decoder)? {
            Some(Frame::Run(command)) => break *command,
            Some(_) => continue,
            None if waiting.elapsed() < COMMAND_DEADLINE => {
                decoder = Decoder::default();
                std::thread::sleep(RECONNECT_POLL);
            }
            None => return Err(format!("no command came within {COMMAND_DEADLINE:?}")),
        }
    };
    if command.uid == 0 || command.gid == 0 {
        return Err(format!(
            "refusing to run the workload as uid {} gid {}: it must not be root",
            command.uid, command.gid
        ));
    }
    if command.argv.is_empty() {
        return Err("the command has no program".into());
    }
    assemble_root()?;
    if !command.shares.is_empty() {
        load_modules(SHARE_MODULES, console)?;
        for share in &command.shares {
            mount_share(share)?;
        }
    }
    if !command.hostname.is_empty() {
        nix::unistd::sethostname(&command.hostname).map_err(|e| format!("setting the host name: {e}"))?;
    }
    busybox(&["ip", "link", "set", "lo", "up"])?;
    if let Some(network) = &command.network {
        configure_network(network)?;
    }
    if let Some(relay) = &command.workload_api {
        relay_socket(relay, command.uid, command.gid)?;
    }
    let exit = supervise(&command, status, reader, decoder)?;
    report(status, &Status::Exited(exit)).map_err(|e| format!("reporting the exit: {e}"))?;
    Ok(())
}

fn load_modules(modules: &[&str], console: &mut Console) -> Result<(), String> {
    let options = CString::default();
    for name in modules {
        let path = PathBuf::from(format!("/lib/modules/{name}.ko"));
        let Ok(module) = File::open(&path) else { continue };
        match nix::kmod::finit_module(&module, &options, nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(error) => return Err(format!("loading {name}: {error}")),
        }
    }
    console.say("modules loaded");
    Ok(())
}

/// Polls `find` until it finds what it looks for or the devices' deadline passes.
fn wait_for(what: &str, find: impl Fn() -> Option<PathBuf>) -> Result<PathBuf, String> {
    let deadline = Instant::now() + DEVICE_DEADLINE;
    loop {
        if let Some(found) = find() {
            return Ok(found);
        }
        if Instant::now() > deadline {
            return Err(format!("{what} did not appear within {DEVICE_DEADLINE:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The virtio-serial port named `name`, opened for reading and writing
/// once it appears.
fn open_port(name: &str) -> Result<File, String> {
    let path = wait_for(name, || port_named(name))?;
    OpenOptions::new().read(true).write(true).open(&path).map_err(|e| format!("opening {}: {e}", path.display()))
}

/// The device of the virtio-serial port named `name`.
fn port_named(name: &str) -> Option<PathBuf> {
    std::fs::read_dir("/sys/class/virtio-ports").ok()?.flatten().find_map(|entry| {
        let found = std::fs::read_to_string(entry.path().join("name")).ok()?;
        let device = Path::new("/dev").join(entry.file_name());
        (found.trim() == name && device.exists()).then_some(device)
    })
}

/// The block device whose ext4 label is `label`.
fn drive_labelled(label: &str) -> Option<PathBuf> {
    std::fs::read_dir("/sys/block").ok()?.flatten().find_map(|entry| {
        let device = Path::new("/dev").join(entry.file_name());
        let mut superblock = [0_u8; 1024];
        let mut file = File::open(&device).ok()?;
        std::io::Seek::seek(&mut file, io::SeekFrom::Start(1024)).ok()?;
        file.read_exact(&mut superblock).ok()?;
        let magic = u16::from_le_bytes([superblock[0x38], superblock[0x39]]);
        let name = &superblock[0x78..0x88];
        let name = &name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())];
        (magic == 0xEF53 && name == label.as_bytes()).then_some(device)
    })
}

/// Mounts the root image read-only and the scratch writable, and the
/// overlay of the two with the pseudo filesystems inside it at [`NEW_ROOT`].
fn assemble_root() -> Result<(), String> {
    let root = wait_for("the root drive", || drive_labelled(ROOT_LABEL))?;
    let scratch = wait_for("the scratch drive", || drive_labelled(SCRATCH_LABEL))?;
    let mounted = |source: &Path, target: &str, flags: MsFlags| {
        std::fs::create_dir_all(target).map_err(|e| format!("creating {target}: {e}"))?;
        mount(Some(source), target, Some("ext4"), flags, None::<&str>)
            .map_err(|e| format!("mounting {} on {target}: {e}", source.display()))
    };
    mounted(&root, "/run/image", MsFlags::MS_RDONLY | MsFlags::MS_NODEV)?;
    mounted(&scratch, "/run/scratch", MsFlags::MS_NODEV)?;
    for dir in ["/run/scratch/upper", "/run/scratch/work", NEW_ROOT] {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {dir}: {e}"))?;
    }
    mount(
        Some("overlay"),
        NEW_ROOT,
        Some("overlay"),
        MsFlags::MS_NODEV,
        Some("lowerdir=/run/image,upperdir=/run/scratch/upper,workdir=/run/scratch/work"),
    )
    .map_err(|e| format!("mounting the overlay root: {e}"))?;
    for (source, target, kind, flags) in [
        ("proc", "proc", "proc", MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC),
        ("devtmpfs", "dev", "devtmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC),
        ("sysfs", "sys", "sysfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY),
        ("tmpfs", "tmp", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV),
    ] {
        let target = Path::new(NEW_ROOT).join(target);
        // An image's link here would lead the mount out of the workload's
        // root (it resolves from the init's); a directory takes its place.
        if std::fs::symlink_metadata(&target).is_ok_and(|meta| !meta.is_dir()) {
            std::fs::remove_file(&target).map_err(|e| format!("replacing {}: {e}", target.display()))?;
        }
        std::fs::create_dir_all(&target).map_err(|e| format!("creating {}: {e}", target.display()))?;
        mount(Some(source), &target, Some(kind), flags, None::<&str>)
            .map_err(|e| format!("mounting {}: {e}", target.display()))?;
    }
    // /tmp for everyone, as on any host.
    std::fs::set_permissions(Path::new(NEW_ROOT).join("tmp"), std::os::unix::fs::PermissionsExt::from_mode(0o1777))
        .map_err(|e| format!("opening /tmp to all: {e}"))?;
    Ok(())
}

/// Mounts the node's directory `share` at its path inside the workload's
/// root: a directory that is not there yet is made (in the scratch), and a
/// link or file at the path itself gives way to one; a link on the way to
/// it is refused, for the init would follow it from its own root.
fn mount_share(share: &GuestShare) -> Result<(), String> {
    let path = Path::new(&share.path);
    if !path.is_absolute()
        || path.components().any(|c| !matches!(c, std::path::Component::RootDir | std::path::Component::Normal(_)))
    {
        return Err(format!("a shared directory's path must be absolute and plain: {}", share.path));
    }
    let mut target = PathBuf::from(NEW_ROOT);
    let steps: Vec<_> = path.components().skip(1).collect();
    for (index, step) in steps.iter().enumerate() {
        target.push(step);
        match std::fs::symlink_metadata(&target) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) if index + 1 == steps.len() => {
                std::fs::remove_file(&target).map_err(|e| format!("replacing {}: {e}", share.path))?;
                std::fs::create_dir(&target).map_err(|e| format!("creating {}: {e}", share.path))?;
            }
            Ok(_) => return Err(format!("{} passes through a link or file at {}", share.path, target.display())),
            Err(_) => std::fs::create_dir(&target).map_err(|e| format!("creating {}: {e}", target.display()))?,
        }
    }
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if share.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(Some(share.tag.as_str()), &target, Some("virtiofs"), flags, None::<&str>)
        .map_err(|e| format!("mounting the shared directory {} at {}: {e}", share.tag, share.path))
}

/// Listens on `relay`'s socket inside the workload's root, the workload's
/// user's alone, and relays each connection to `relay`'s address, both
/// ways, on threads of its own, until the VM powers off.
fn relay_socket(relay: &GuestRelay, uid: u32, gid: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = Path::new(NEW_ROOT).join(relay.path.trim_start_matches('/'));
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path)
        .map_err(|e| format!("listening on {} for the Workload API: {e}", relay.path))?;
    nix::unistd::chown(&path, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(|e| format!("giving {} to the workload: {e}", relay.path))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("closing {} to other users: {e}", relay.path))?;
    let address = relay.address.clone();
    let slots = Slots::new(MAX_RELAYED);
    std::thread::spawn(move || {
        loop {
            // A failed accept (out of descriptors, a connection given up) leaves the relay listening.
            let Ok((inside, _)) = listener.accept() else {
                std::thread::sleep(RECONNECT_POLL);
                continue;
            };
            // Past the bound, the connection is closed as it is dropped.
            let Some(slot) = slots.take() else { continue };
            let address = address.clone();
            let _ = std::thread::Builder::new().stack_size(RELAY_STACK).spawn(move || {
                let _slot = slot;
                if let Ok(outside) = std::net::TcpStream::connect(&address) {
                    join(inside, outside);
                }
            });
        }
    });
    Ok(())
}

/// A count of things under way, at most a bound: each [`Slot`] taken is
/// given back when dropped.
#[derive(Debug, Clone)]
struct Slots {
    bound: usize,
    taken: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// One of [`Slots`], held while its thing is under way.
#[derive(Debug)]
struct Slot(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Slots {
    fn new(bound: usize) -> Self {
        Self { bound, taken: std::sync::Arc::default() }
    }

    /// A slot, unless `bound` are taken.
    fn take(&self) -> Option<Slot> {
        use std::sync::atomic::Ordering;
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |taken| (taken < self.bound).then_some(taken + 1))
            .ok()
            .map(|_| Slot(self.taken.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Copies each way between `inside` and `outside` until both have ended;
/// the end of one way is passed on as the end of writing the other.
fn join(inside: std::os::unix::net::UnixStream, outside: std::net::TcpStream) {
    let (Ok(mut inside_reader), Ok(mut outside_writer)) = (inside.try_clone(), outside.try_clone()) else { return };
    let out = std::thread::Builder::new().stack_size(RELAY_STACK).spawn(move || {
        let _ = io::copy(&mut inside_reader, &mut outside_writer);
        let _ = outside_writer.shutdown(std::net::Shutdown::Write);
    });
    let Ok(out) = out else { return };
    let (mut outside_reader, mut inside_writer) = (outside, inside);
    let _ = io::copy(&mut outside_reader, &mut inside_writer);
    let _ = inside_writer.shutdown(std::net::Shutdown::Write);
    let _ = out.join();
}

/// Runs an applet of the initramfs's busybox.
fn busybox(args: &[&str]) -> Result<(), String> {
    let output =
        Command::new("/bin/busybox").args(args).output().map_err(|e| format!("busybox {}: {e}", args.join(" ")))?;
    if output.status.success() {
        return Ok(());
    }
    Err(format!("busybox {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr).trim()))
}

/// Brings up `eth0` as `network` says and gives the workload its
/// `resolv.conf`.
fn configure_network(network: &GuestNetwork) -> Result<(), String> {
    wait_for("eth0", || Some(PathBuf::from("/sys/class/net/eth0")).filter(|p| p.exists()))?;
    busybox(&["ip", "addr", "add", &network.address, "dev", "eth0"])?;
    busybox(&["ip", "link", "set", "eth0", "up"])?;
    busybox(&["ip", "route", "add", "default", "via", &network.gateway])?;
    let etc = Path::new(NEW_ROOT).join("etc");
    std::fs::create_dir_all(&etc).map_err(|e| format!("creating /etc: {e}"))?;
    let resolv = etc.join("resolv.conf");
    // An image's own (often a link into a resolver's run directory) gives way.
    let _ = std::fs::remove_file(&resolv);
    std::fs::write(&resolv, &network.resolv_conf).map_err(|e| format!("writing /etc/resolv.conf: {e}"))?;
    Ok(())
}

/// Starts the workload with the output ports as its stdout and stderr,
/// passes on the node's signals, reaps every process, and once the
/// workload ended kills what it left; how it ended.
fn supervise(
    command: &GuestCommand,
    status: &mut File,
    mut reader: File,
    mut decoder: Decoder,
) -> Result<GuestExit, String> {
    let stdout = open_port(STDOUT_PORT)?;
    let stderr = open_port(STDERR_PORT)?;
    let cgroup = memory_cgroup(command.memory_limit_bytes)?;
    let watched = inbound(command);
    if let Some((_, ports)) = &watched {
        report(status, &Status::Watching(ports.clone())).map_err(|e| format!("reporting the ports: {e}"))?;
    }
    let child = Command::new("/init")
        .arg("--exec")
        .args([
            command.uid.to_string(),
            command.gid.to_string(),
            command.max_processes.to_string(),
            command.cwd.clone(),
            cgroup.as_ref().map_or_else(|| "-".to_owned(), |dir| dir.display().to_string()),
            "--".into(),
        ])
        .args(&command.argv)
        .env_clear()
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("starting the workload: {e}"))?;
    let workload = Pid::from_raw(i32::try_from(child.id()).map_err(|_| "a pid out of range")?);
    report(status, &Status::Started(child.id())).map_err(|e| format!("reporting the start: {e}"))?;
    let listening = watched.map(|(address, ports)| watch_listening(address, ports, status));
    if let Some(dir) = &cgroup {
        answer_stats(dir.clone());
    }
    std::thread::spawn(move || {
        loop {
            match read_frame(&mut reader, &mut decoder) {
                Ok(Some(Frame::Signal(number))) => {
                    if let Ok(signal) = Signal::try_from(number) {
                        let _ = kill(Pid::from_raw(-workload.as_raw()), signal);
                    }
                }
                Ok(Some(Frame::Run(_))) => {}
                // The node went away (an agent restart): the port reads as
                // ended until a node connects again. What a node had half
                // sent is not the next one's.
                Ok(None) => {
                    decoder = Decoder::default();
                    std::thread::sleep(RECONNECT_POLL);
                }
                Err(_) => decoder = Decoder::default(),
            }
        }
    });

    let exit = loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == workload => break GuestExit::Code(code),
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == workload => break GuestExit::Signal(signal as i32),
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(error) => return Err(format!("waiting for the workload: {error}")),
        }
    };
    // Nothing is reported after the exit.
    if let Some(listening) = listening {
        listening.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    }
    // What the workload left behind ends with it; every process but this one.
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    while waitpid(None, None).is_ok() {}
    // Killed, and the kernel's OOM killer took a process of its cgroup: its memory ended it.
    let oom_killed = cgroup.as_ref().is_some_and(|dir| {
        std::fs::read_to_string(dir.join("memory.events")).is_ok_and(|events| {
            events.lines().any(|line| line.strip_prefix("oom_kill ").is_some_and(|n| n.trim() != "0"))
        })
    });
    Ok(if oom_killed && exit == GuestExit::Signal(Signal::SIGKILL as i32) { GuestExit::OutOfMemory } else { exit })
}

/// The guest's address and the ports the node forwards to it, when it
/// forwards any.
fn inbound(command: &GuestCommand) -> Option<(Ipv4Addr, Vec<u16>)> {
    let network = command.network.as_ref().filter(|network| !network.inbound.is_empty())?;
    let address = network.address.split('/').next()?.parse().ok()?;
    Some((address, network.inbound.clone()))
}

/// Reports each of `ports` on the status port once something listens on
/// it at `address` (what the node's forward connects to), checking every
/// [`LISTEN_POLL`] on a thread of its own until every port has been
/// reported or the returned slot is emptied (the workload ended).
fn watch_listening(address: Ipv4Addr, mut ports: Vec<u16>, status: &File) -> Arc<Mutex<Option<File>>> {
    let slot = Arc::new(Mutex::new(status.try_clone().ok()));
    let port = slot.clone();
    // Without the thread no port is reported, and the node never takes the replica as ready.
    let _ = std::thread::Builder::new().stack_size(RELAY_STACK).spawn(move || {
        while !ports.is_empty() {
            std::thread::sleep(LISTEN_POLL);
            let listened: Vec<u16> = ports
                .iter()
                .copied()
                .filter(|&p| TcpStream::connect_timeout(&SocketAddr::from((address, p)), LISTEN_POLL).is_ok())
                .collect();
            let mut status = port.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some(status) = status.as_mut() else { return };
            for listening in listened {
                if report(status, &Status::Listening(listening)).is_err() {
                    return;
                }
                ports.retain(|&p| p != listening);
            }
        }
    });
    slot
}

/// Answers each byte the node sends on the stats port with what the
/// workload's cgroup `dir` uses now, on a thread of its own, until the VM
/// powers off. The port reads as ended while no node is connected.
fn answer_stats(dir: PathBuf) {
    let Some(path) = port_named(STATS_PORT) else { return };
    let Ok(mut port) = OpenOptions::new().read(true).write(true).open(path) else { return };
    std::thread::spawn(move || {
        let mut asked = [0_u8; 64];
        loop {
            match port.read(&mut asked) {
                Ok(0) => std::thread::sleep(RECONNECT_POLL),
                Ok(read) => {
                    // The last question asked is the one a node still waits on.
                    let tag = asked[read - 1];
                    let read = |file: &str| std::fs::read_to_string(dir.join(file)).unwrap_or_default();
                    let cpu_usec = read("cpu.stat")
                        .lines()
                        .find_map(|line| line.strip_prefix("usage_usec ")?.trim().parse().ok())
                        .unwrap_or(0);
                    let memory_bytes = read("memory.current").trim().parse().unwrap_or(0);
                    let _ = port.write_all(GuestStats { cpu_usec, memory_bytes }.answer(tag).as_bytes());
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => std::thread::sleep(RECONNECT_POLL),
            }
        }
    });
}

/// The memory cgroup (v2) the workload runs in, limited to `limit` bytes;
/// `None` for no limit.
fn memory_cgroup(limit: u64) -> Result<Option<PathBuf>, String> {
    if limit == 0 {
        return Ok(None);
    }
    let root = Path::new("/sys/fs/cgroup");
    let _ = std::fs::create_dir_all(root);
    mount(Some("cgroup2"), root, Some("cgroup2"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, None::<&str>)
        .map_err(|e| format!("mounting the cgroup filesystem: {e}"))?;
    std::fs::write(root.join("cgroup.subtree_control"), "+memory")
        .map_err(|e| format!("enabling the memory controller: {e}"))?;
    let dir = root.join("workload");
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating the workload's cgroup: {e}"))?;
    std::fs::write(dir.join("memory.max"), limit.to_string())
        .map_err(|e| format!("limiting the workload's memory: {e}"))?;
    Ok(Some(dir))
}

fn read_frame(reader: &mut File, decoder: &mut Decoder) -> Result<Option<Frame>, String> {
    let mut buffer = [0_u8; 4096];
    loop {
        if let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
            return Ok(Some(frame));
        }
        match reader.read(&mut buffer) {
            Ok(0) => return Ok(None),
            Ok(read) => decoder.push(&buffer[..read]),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(format!("reading the control port: {error}")),
        }
    }
}

/// The step between the init and the workload: `UID GID NPROC CWD CGROUP
/// -- ARGV...` (CGROUP `-` for none). Returns only when it failed.
fn exec_workload(args: &[String]) -> String {
    let (Some(uid), Some(gid), Some(nproc), Some(cwd), Some(cgroup)) =
        (args.first(), args.get(1), args.get(2), args.get(3), args.get(4))
    else {
        return "usage: --exec UID GID NPROC CWD CGROUP -- ARGV...".into();
    };
    let (Ok(uid), Ok(gid), Ok(nproc)) = (uid.parse::<u32>(), gid.parse::<u32>(), nproc.parse::<u64>()) else {
        return format!("bad uid, gid or process limit: {uid} {gid} {nproc}");
    };
    let argv = &args[6.min(args.len())..];
    let Some(program) = argv.first() else { return "no program".into() };
    let steps = || -> Result<(), String> {
        // Into its memory cgroup first, so all it allocates is charged there.
        if cgroup != "-" {
            std::fs::write(Path::new(cgroup).join("cgroup.procs"), std::process::id().to_string())
                .map_err(|e| format!("entering the workload's cgroup: {e}"))?;
        }
        nix::unistd::chroot(NEW_ROOT).map_err(|e| format!("entering the root: {e}"))?;
        std::env::set_current_dir("/").map_err(|e| format!("entering the root: {e}"))?;
        for capability in rustix::thread::CapabilitySet::all().iter() {
            // A capability this kernel does not know is not in the set.
            match rustix::thread::remove_capability_from_bounding_set(capability) {
                Ok(()) | Err(rustix::io::Errno::INVAL) => {}
                Err(e) => return Err(format!("emptying the capability bounding set: {e}")),
            }
        }
        rustix::thread::set_no_new_privs(true).map_err(|e| format!("no_new_privs: {e}"))?;
        if nproc > 0 {
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NPROC, nproc, nproc)
                .map_err(|e| format!("the process limit: {e}"))?;
        }
        nix::unistd::setgroups(&[]).map_err(|e| format!("dropping groups: {e}"))?;
        nix::unistd::setgid(Gid::from_raw(gid)).map_err(|e| format!("setgid {gid}: {e}"))?;
        nix::unistd::setuid(Uid::from_raw(uid)).map_err(|e| format!("setuid {uid}: {e}"))?;
        std::env::set_current_dir(cwd).map_err(|e| format!("working directory {cwd}: {e}"))
    };
    if let Err(error) = steps() {
        return error;
    }
    let error = Command::new(program).args(&argv[1..]).exec();
    format!("cannot run {program}: {error}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_held_to_their_bound_and_given_back_when_dropped() {
        let slots = Slots::new(2);
        let first = slots.take().expect("a first slot");
        let second = slots.clone().take().expect("a second slot, from a clone of the same count");
        assert!(slots.take().is_none(), "a third is refused");
        drop(first);
        let third = slots.take().expect("a slot given back is taken again");
        assert!(slots.take().is_none());
        drop((second, third));
        assert_eq!(slots.taken.load(std::sync::atomic::Ordering::Acquire), 0);
    }
}
