//! The microVM provider: each lease's workload in a virtual machine of its
//! own, with its own kernel, behind the same [`Provider`] seam as processes
//! and containers.
//!
//! The VMM is QEMU's `microvm` machine, driven through `berth_microvm`: a
//! stock Debian cloud kernel, berth's static init in the initramfs, the
//! lease's root as a read-only ext4 image and a scratch image of its own.
//! The init runs the workload as an unprivileged user inside the guest;
//! the guest's root is the only thing the guest kernel can see of the host
//! besides its own drives and the four serial ports.
//!
//! # What is stored
//! ```text
//! DATA_DIR/microvm/initramfs-<init size>-<init mtime>.cpio   the init and kernel modules
//! DATA_DIR/microvm/images/<kind>-<digest>.ext4            read-only roots, one per digest
//! DATA_DIR/leases/<lease_id>/                                the VM's run directory: scratch
//!                                                            image, control and QMP sockets,
//!                                                            status lines, console log
//! ```
//! Records and logs are kept as [`crate::instances`] says; QEMU appends the
//! workload's output to the lease's `stdout.log` and `stderr.log` itself.
//!
//! # Roots
//! - A container image: its unpacked root, as one image per digest.
//! - A bundle: the node's system directories (`/usr`; `/bin`, `/lib`…
//!   as the host has them, links as links) shared read-only, as a
//!   container sees them bound, with the bundle at `/bundle`
//!   (`$BERTH_BUNDLE_DIR`), one image per digest.
//! - A bare command: the node's system directories alone.
//!
//! Without a `virtiofsd` (or a guest kernel without virtio-fs) a node
//! shares nothing: bundles and bare commands run on the node's `busybox`
//! userland, and cache volumes and identity directories are refused.
//!
//! # Shared directories
//! What a container sees bound from the host, a guest sees over virtio-fs
//! (see `berth_microvm::vmm`): the system directories above (read-only,
//! cached for good: nothing changes them under a running workload), each
//! cache volume's view (read-write, given to the workload's user, so what
//! it writes is in the view the agent seals and publishes when the lease
//! ends, exactly as for a container), and the identity directory
//! (read-only, looked at again each second, so renewed files are seen;
//! the Workload API is relayed, below).
//! A lease's own directories (its views, its identity) are given on the
//! host to a user of the workload range, one per running lease as a
//! container's are, and each daemon translates ids at the VM's edge: that
//! host user is the guest's workload user both ways, and a file the guest
//! makes as any other user (its root too, should a workload take the
//! guest's kernel) is that host user's; so no guest makes a root-owned
//! file on the host, nor one of another lease's user.
//! One `virtiofsd` serves each, started in the VMM's cgroup before QEMU
//! and ending with it. A drive per cache volume would have to be built
//! from the view before the boot and read back into it after, copying
//! the volume twice per lease; a share copies nothing.
//!
//! # Workload API
//! The socket in the identity directory does not cross a share. A guest
//! with a network gets one of its own instead: the init listens on
//! `/berth-workload-api.sock` in the workload's root (`$SPIFFE_ENDPOINT_SOCKET`,
//! the workload's user's alone) and carries each connection to an address
//! of the guest's network, whose connections QEMU hands to the node's
//! `socat`, which dials the agent's relay for the lease (see [`relay`]),
//! carried on to the lease's own socket, so the agent knows the caller by
//! its socket as it does a container's. A guest with no network (a node
//! without egress isolation) has its identity as files only.
//!
//! # Processes and adoption
//! A root agent's QEMU opens its devices, sockets and files as root, then
//! runs as its lease's user of the workload range (`-runas`) before the
//! guest does, as do the relays it starts; an agent that is not root runs
//! it as itself.
//! QEMU runs in a process group of its own and is recorded by its pid and
//! start time, so an agent restarted on the same directory adopts a VM
//! that still runs, connects to its control port again, and reads how it
//! ended from its status lines even when it ended while no agent ran.
//! Destroy asks the init to send SIGTERM to the workload, waits the grace,
//! then kills QEMU: nothing of the VM outlives it.
//!
//! # Stats
//! A VM's stats are its workload's, as the guest's init reads them from the
//! workload's cgroup inside the guest when the node asks on the stats port
//! (CPU time and memory charged, as a container's are read from its
//! cgroup); a guest that does not answer within 2 s (still booting) is
//! described by its VMM's process instead. What the VMM holds beyond the
//! guest is the node's overhead, declared and counted against the node.
//!
//! # Network
//! QEMU runs in its tenant's network namespace, which holds nothing but a
//! loopback interface with the tenant's proxy and resolver on it, and
//! gives the guest one virtio-net interface backed by its user-mode stack
//! (libslirp): what the guest sends to its gateway (`10.0.2.2`) reaches the
//! namespace's `127.0.0.1`, which its environment's proxy variables and its
//! `resolv.conf` name; any other address is as unreachable as from a
//! container in that namespace, for the namespace has no route. The
//! workload's ports are forwarded in from the namespace's loopback, where
//! the agent's data plane reaches replicas. Those forwards accept a
//! connection whether or not the guest listens (and hold it while the
//! guest boots), so a connection to them says nothing of the workload: the
//! guest's init reports each inbound port once something listens on it at
//! the guest's address, and [`Provider::listens`] answers from those
//! reports, which the readiness check asks before it dials. A tap device
//! would need an address in the namespace and a packet filter to keep the
//! guest from the host; the user-mode stack needs neither, and egress is
//! enforced where it is for containers. A workload listens on its guest
//! address (`0.0.0.0`), not only on its guest's loopback, to be reached;
//! names under `.berth.internal` resolve, for a guest (its queries reach
//! the resolver at the namespace's `127.0.0.1`), to an address of the
//! guest's network whose connections QEMU hands to the node's `busybox
//! nc`, which relays each to where the agent forwards services to the
//! router, as a container's connections to those names go.
//!
//! # Not yet
//! A running VM's limits cannot be changed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use berth_microvm::image::{Owner, root_image, scratch_image, set_owners, write_initramfs};
use berth_microvm::kernel::GuestKernel;
use berth_microvm::vmm::{
    Accel, Control, GUEST_ADDRESS, GUEST_GATEWAY, GUEST_SERVICES_ADDRESS, ShareOwner, ShareSpec, SlirpNetwork, Vm,
    VmShare, VmSpec, kill_group, start_share, statuses,
};
use berth_microvm::wire::{GuestCommand, GuestExit, GuestNetwork, GuestRelay, GuestShare, Status};
use tokio::sync::{OnceCell, watch};
use tokio_util::sync::CancellationToken;

use crate::container::{UidPool, UidRange};
use crate::instances::{
    Instances, PortBook, StoredRecord, blocking, from_unix_ms, load_records, prepare, unix_ms, validate_lease_id,
};
use crate::node_ports::NodePorts;
use crate::procfs::{self, PROC_ROOT};
use crate::provider::{
    ExitStatus, IdentitySeen, InstanceStats, LaunchSpec, Launched, LogFiles, ProcessTiming, Provider, ProviderError,
    ResizeAsk, Resized, Runtime, Settlement, WorkloadRoot, WorkloadSignal,
};

/// Where a bundle is seen inside the guest.
const BUNDLE_IN_GUEST: &str = "/bundle";

/// Where a workload's identity directory is seen inside the guest.
const IDENTITY_IN_GUEST: &str = "/run/berth/identity";

/// Where a workload finds the Workload API inside the guest: one component
/// at the top of its root, as in a container (see
/// `container::link_workload_api` for why).
const WORKLOAD_API_IN_GUEST: &str = "/berth-workload-api.sock";

/// The port of [`GUEST_SERVICES_ADDRESS`] whose connections QEMU hands to
/// the node's `socat`, which dials the lease's Workload API relay.
const GUEST_WORKLOAD_API_PORT: u16 = 81;

/// The user a workload runs as inside the guest when its image names none
/// (or names root).
const GUEST_USER: u32 = 1000;

/// The size of a lease's scratch image (sparse: it takes disk as written).
const SCRATCH_BYTES: u64 = 4 << 30;

/// Workload memory for a lease that reserves none.
const DEFAULT_MEMORY_MIB: u32 = 256;

/// Guest memory beyond the workload's, for the guest's own kernel and init:
/// the workload is held to its lease's memory by a cgroup inside the guest,
/// so that going past it is an OOM kill of the workload (reported as such),
/// not a guest whose kernel has nothing left. The cloud kernel keeps about
/// 40 MiB of a guest's memory and its boot about 60 MiB more.
pub(crate) const GUEST_RESERVE_MIB: u32 = 128;

/// The memory a lease's workload may hold in its VM, MiB.
fn workload_memory_mib(memory_bytes: u64) -> u32 {
    match memory_bytes >> 20 {
        0 => DEFAULT_MEMORY_MIB,
        mib => u32::try_from(mib).unwrap_or(u32::MAX),
    }
}

/// A lease's guest memory, MiB: what its workload may hold and the
/// guest's own reserve beside it.
pub fn guest_memory_mib(memory_bytes: u64) -> u32 {
    workload_memory_mib(memory_bytes).saturating_add(GUEST_RESERVE_MIB)
}

/// What a VMM may hold beyond its guest's memory before its cgroup's limit
/// stops it: QEMU's own memory, measured at about 92 MiB under its
/// translator (BENCHMARKS.md), with room to spare. The node declares it
/// (`berth.workload.memory-overhead`), so leases counts it against the
/// node's capacity with each lease.
pub(crate) const VMM_ALLOWANCE: u64 = 256 << 20;

/// The command a VM runs, kept in its run directory.
const COMMAND_FILE: &str = "command.json";

/// The lease's CPU quota (µs per 100 ms), kept in a VM's run directory
/// while it boots unheld.
const CPU_QUOTA_FILE: &str = "cpu-quota";

/// How often a booting VM is looked at for its workload's start.
const BOOT_POLL: Duration = Duration::from_millis(50);

/// How long a killed VMM may take to be gone.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How often a stopping VMM is looked at.
const STOP_POLL: Duration = Duration::from_millis(25);

/// How long a probe VM under KVM may take to run `true` and power off
/// before the node decides KVM cannot boot its guests.
const PROBE_DEADLINE: Duration = Duration::from_secs(10);

/// How the node runs guest code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroVmAccel {
    /// KVM where a probe VM boots under it, else QEMU's translator.
    Auto,
    /// KVM, always.
    Kvm,
    /// QEMU's translator (TCG), always: no `/dev/kvm` needed, several times
    /// slower.
    Tcg,
}

impl std::str::FromStr for MicroVmAccel {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(MicroVmAccel::Auto),
            "kvm" => Ok(MicroVmAccel::Kvm),
            "tcg" => Ok(MicroVmAccel::Tcg),
            other => Err(format!("unknown accelerator '{other}': expected auto, kvm or tcg")),
        }
    }
}

/// What keeps this host from running microVMs with `config`, if anything.
pub(crate) fn missing(config: &MicroVmConfig) -> Option<String> {
    MicroVmSettings::from_config(config, ProcessTiming::default()).err()
}

/// The `virtiofsd` this host's guests mount the node's directories through
/// with `config`, where it can: one found, a guest kernel with virtio-fs, and an agent
/// that is root (the daemon sandboxes itself in namespaces of its own only
/// as root; unsandboxed, a guest that breaks it would hold the agent's
/// rights over the host's files).
pub(crate) fn share_daemon(config: &MicroVmConfig) -> Option<PathBuf> {
    let kernel_shares = GuestKernel::from_dir(&config.kernel_dir).is_ok_and(|kernel| kernel.shares_directories());
    (rustix::process::geteuid().is_root() && kernel_shares).then(berth_microvm::install::find_virtiofsd).flatten()
}

/// What the microVM provider runs with.
#[derive(Debug, Clone)]
pub struct MicroVmSettings {
    /// The QEMU binary.
    pub qemu: PathBuf,
    /// The guest kernel's directory (see `berth_microvm::kernel`).
    pub kernel_dir: PathBuf,
    /// The static guest init (`berth-vminit`).
    pub init: PathBuf,
    /// How guest code runs.
    pub accel: MicroVmAccel,
    /// The node's static `busybox`: the guest init's tools, and the
    /// userland of bundles and bare commands on a node that shares nothing.
    pub busybox: PathBuf,
    /// The `virtiofsd` that shares the node's directories with guests,
    /// when the node has one and its guest kernel mounts what it serves.
    pub virtiofsd: Option<PathBuf>,
    /// The grace between SIGTERM and killing the VM, and how often an
    /// adopted VM is looked for.
    pub timing: ProcessTiming,
    /// How many processes a workload may have at once inside its VM.
    pub pids_limit: i64,
    /// The host users a VM's own shared directories (its cache views, its
    /// identity) are given to, one per running lease, as a container's are.
    pub uids: UidRange,
    /// The host ports its forwards are given.
    pub node_ports: NodePorts,
}

impl MicroVmSettings {
    /// The settings `config` names, with every file it needs found; else
    /// what is missing and how to get it.
    pub fn from_config(config: &MicroVmConfig, timing: ProcessTiming) -> Result<Self, String> {
        let qemu = find_program(&config.qemu).ok_or_else(|| {
            format!("{} is not installed (scripts/microvm-deps.sh installs it)", config.qemu.display())
        })?;
        GuestKernel::from_dir(&config.kernel_dir).map_err(|e| e.to_string())?;
        let init =
            config.init.clone().or_else(berth_microvm::install::find_init).filter(|init| init.is_file()).ok_or_else(
                || format!("no guest init ({}): it ships beside the agent", berth_microvm::install::INIT_NAME),
            )?;
        if !berth_microvm::install::is_static_executable(&init).unwrap_or(false) {
            return Err(format!(
                "the guest init {} is not a statically linked executable, which a guest could not start \
                 (`make vminit` builds one)",
                init.display()
            ));
        }
        let busybox = berth_microvm::install::find_busybox()
            .ok_or_else(|| "no static busybox (Debian's busybox-static) for the guests' userland".to_owned())?;
        let virtiofsd = share_daemon(config);
        if virtiofsd.is_none() {
            tracing::warn!(
                "no virtiofsd, a guest kernel without virtio-fs, or an agent that is not root (virtiofsd sandboxes \
                 itself only as root): microVMs share no directory with the node (bundles run on busybox; cache \
                 volumes and workload identity are refused); scripts/microvm-deps.sh installs virtiofsd and the \
                 modules"
            );
        }
        Ok(Self {
            qemu,
            kernel_dir: config.kernel_dir.clone(),
            init,
            accel: config.accel,
            busybox,
            virtiofsd,
            timing,
            pids_limit: crate::container::DEFAULT_PIDS_LIMIT,
            uids: UidRange::default(),
            node_ports: NodePorts::default(),
        })
    }
}

/// `program` as a path, or found on `PATH`.
fn find_program(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(program)).find(|path| path.is_file())
}

/// Runs each lease in a microVM; see the module docs.
#[derive(Debug, Clone)]
pub struct MicroVmProvider {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    instances: Arc<Instances>,
    settings: MicroVmSettings,
    dir: PathBuf,
    ports: Arc<PortBook>,
    uids: UidPool,
    /// Each VM's Workload API relay.
    relays: relay::Relays,
    initramfs: OnceCell<PathBuf>,
    /// How guest code runs, once decided.
    accel: OnceCell<Accel>,
    /// The busybox applets a bare command may name, once listed.
    applets: std::sync::OnceLock<Vec<String>>,
    /// One image is built at a time, so two leases of one digest share it.
    building: tokio::sync::Mutex<()>,
    /// The control ports the provider holds, by lease.
    controls: tokio::sync::Mutex<BTreeMap<String, Control>>,
    /// The leases whose VMM this provider killed (their exit is SIGKILL).
    killed: Mutex<std::collections::BTreeSet<String>>,
    /// By lease: held while that VM's stats port is asked.
    asking: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
    proc_root: PathBuf,
    shutdown: CancellationToken,
}

impl MicroVmProvider {
    /// A provider keeping its state under `data_dir`; its waiting tasks
    /// stop on `shutdown` (the VMs keep running).
    pub fn new(data_dir: &Path, settings: MicroVmSettings, shutdown: CancellationToken) -> Self {
        let uids = UidPool::new(settings.uids);
        let ports = Arc::new(PortBook::new(settings.node_ports));
        Self {
            inner: Arc::new(Inner {
                instances: Arc::new(Instances::new(data_dir)),
                dir: data_dir.join("microvm"),
                settings,
                uids,
                relays: relay::Relays::new(data_dir, shutdown.clone()),
                ports,
                initramfs: OnceCell::new(),
                accel: OnceCell::new(),
                applets: std::sync::OnceLock::new(),
                building: tokio::sync::Mutex::new(()),
                controls: tokio::sync::Mutex::new(BTreeMap::new()),
                killed: Mutex::default(),
                asking: Mutex::default(),
                proc_root: PathBuf::from(PROC_ROOT),
                shutdown,
            }),
        }
    }

    fn unsupported(spec: &LaunchSpec, what: &str) -> ProviderError {
        ProviderError::Unsupported(format!(
            "lease {} {what}, which the microvm runtime does not provide yet: run it on a node with another runtime",
            spec.lease_id
        ))
    }

    /// The initramfs for this node's init and kernel, built once per init binary.
    async fn initramfs(&self) -> Result<PathBuf, ProviderError> {
        let inner = Arc::clone(&self.inner);
        self.inner
            .initramfs
            .get_or_try_init(|| async move {
                blocking(move || {
                    let settings = &inner.settings;
                    let kernel = GuestKernel::from_dir(&settings.kernel_dir).map_err(unsupported_host)?;
                    let meta = std::fs::metadata(&settings.init).map_err(|e| {
                        ProviderError::Unsupported(format!("no guest init at {}: {e}", settings.init.display()))
                    })?;
                    let stamp = meta.modified().map(unix_ms).unwrap_or_default();
                    std::fs::create_dir_all(&inner.dir).map_err(|e| crate::instances::io("creating", &inner.dir, e))?;
                    let modules = kernel.modules.len();
                    let path = inner.dir.join(format!("initramfs-{}-{stamp}-{modules}.cpio", meta.len()));
                    if !path.is_file() {
                        write_initramfs(&settings.init, &settings.busybox, &kernel, &path).map_err(unsupported_host)?;
                    }
                    Ok(path)
                })
                .await
            })
            .await
            .cloned()
    }

    /// How guest code runs: as configured, or for `auto` what a probe VM
    /// showed the first time it was asked.
    async fn accel(&self, initramfs: &Path) -> Accel {
        let initramfs = initramfs.to_path_buf();
        *self
            .inner
            .accel
            .get_or_init(|| async move {
                match self.inner.settings.accel {
                    MicroVmAccel::Kvm => Accel::Kvm,
                    MicroVmAccel::Tcg => Accel::Tcg,
                    MicroVmAccel::Auto => match self.probe_kvm(initramfs).await {
                        Ok(()) => {
                            tracing::info!("microVMs run under KVM");
                            Accel::Kvm
                        }
                        Err(why) => {
                            tracing::warn!(%why, "microVMs run under QEMU's translator (TCG), several times slower");
                            Accel::Tcg
                        }
                    },
                }
            })
            .await
    }

    /// Boots a VM under KVM that runs `true`: whether it powers off having
    /// run it within [`PROBE_DEADLINE`]. A host can open `/dev/kvm` and still
    /// not boot a stock kernel under it (a nested hypervisor that lacks what
    /// the kernel asks of the CPU), so only a boot tells.
    async fn probe_kvm(&self, initramfs: PathBuf) -> Result<(), String> {
        std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").map_err(|e| format!("/dev/kvm: {e}"))?;
        let root_image = self.root_image(&WorkloadRoot::Host, false).await.map_err(|e| e.to_string())?;
        let run_dir = self.inner.dir.join("probe");
        let _ = std::fs::remove_dir_all(&run_dir);
        std::fs::create_dir_all(&run_dir).map_err(|e| e.to_string())?;
        let scratch = run_dir.join("scratch.ext4");
        scratch_image(&scratch, 64 << 20).map_err(|e| e.to_string())?;
        let spec = VmSpec {
            qemu: self.inner.settings.qemu.clone(),
            accel: Accel::Kvm,
            vmlinuz: self.inner.settings.kernel_dir.join("vmlinuz"),
            initramfs,
            root_image,
            scratch_image: scratch,
            cpus: 1,
            memory_mib: berth_microvm::vmm::MIN_MEMORY_MIB,
            stdout_log: run_dir.join("stdout.log"),
            stderr_log: run_dir.join("stderr.log"),
            run_dir: run_dir.clone(),
            network: None,
            enter: Vec::new(),
            shares: Vec::new(),
            run_as: None,
        };
        let command = GuestCommand {
            argv: vec!["true".into()],
            env: vec![("PATH".into(), "/bin".into())],
            cwd: "/".into(),
            uid: GUEST_USER,
            gid: GUEST_USER,
            hostname: "probe".into(),
            network: None,
            max_processes: 0,
            memory_limit_bytes: 0,
            shares: Vec::new(),
            workload_api: None,
        };
        let mut vm = Vm::boot(&spec, &command).await.map_err(|e| e.to_string())?;
        let finished = tokio::time::timeout(PROBE_DEADLINE, vm.child.wait()).await;
        if finished.is_err() {
            let _ = vm.child.kill().await;
        }
        let ran = statuses(&run_dir).contains(&Status::Exited(GuestExit::Code(0)));
        let _ = std::fs::remove_dir_all(&run_dir);
        if ran { Ok(()) } else { Err(format!("a probe VM under KVM did not run within {PROBE_DEADLINE:?}")) }
    }

    /// Whether this node shares directories with its guests.
    fn shares(&self) -> bool {
        self.inner.settings.virtiofsd.is_some()
    }

    /// The read-only root image for `root`, built unless it exists;
    /// `hosted`, for a bundle or a bare command, is a root for the node's
    /// shared system directories, else for its busybox.
    async fn root_image(&self, root: &WorkloadRoot, hosted: bool) -> Result<PathBuf, ProviderError> {
        let images = self.inner.dir.join("images");
        let name = match root {
            WorkloadRoot::Host if hosted => "host.ext4".to_owned(),
            WorkloadRoot::Host => "busybox.ext4".to_owned(),
            WorkloadRoot::Bundle { digest, .. } if hosted => format!("bundle-{}-host.ext4", digest_name(digest)),
            WorkloadRoot::Bundle { digest, .. } => format!("bundle-{}.ext4", digest_name(digest)),
            // What the image gave its user is its user's in this image.
            WorkloadRoot::Image { digest, account, .. } => match image_user(account.as_deref()) {
                Some(user) => format!("image-{}-{}-{}.ext4", digest_name(digest), user.uid, guest_ids(Some(user)).1),
                None => format!("image-{}.ext4", digest_name(digest)),
            },
        };
        let target = images.join(name);
        let _building = self.inner.building.lock().await;
        if target.is_file() {
            return Ok(target);
        }
        let (root, busybox, out) = (root.clone(), self.inner.settings.busybox.clone(), target.clone());
        blocking(move || {
            std::fs::create_dir_all(&images).map_err(|e| crate::instances::io("creating", &images, e))?;
            // What a root holds (an image's files, a bundle's) is no other host user's to read.
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&images, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| crate::instances::io("closing", &images, e))?;
            match &root {
                WorkloadRoot::Image { dir, account, .. } => {
                    let building = out.with_extension("building");
                    crate::instances::remove_path(&building)?;
                    root_image(dir, &building).map_err(unsupported_host)?;
                    if let Some(user) = image_user(account.as_deref()) {
                        let (uid, gid) = guest_ids(Some(user));
                        let owners: Vec<Owner> = user
                            .owned
                            .iter()
                            .filter(|owned| beneath_without_links(dir, &owned.path))
                            .map(|owned| Owner {
                                path: Path::new("/").join(&owned.path),
                                uid: owned.owner.then_some(uid),
                                gid: owned.group.then_some(gid),
                            })
                            .collect();
                        set_owners(&building, &owners).map_err(unsupported_host)?;
                    }
                    std::fs::rename(&building, &out).map_err(|e| crate::instances::io("renaming", &building, e))
                }
                WorkloadRoot::Host | WorkloadRoot::Bundle { .. } => {
                    // A tree left by an interrupted build is built again whole.
                    let mut name = out.file_name().map(std::ffi::OsStr::to_os_string).unwrap_or_default();
                    name.push(".tree");
                    let tree = out.with_file_name(name);
                    crate::instances::remove_path(&tree)?;
                    if hosted {
                        hosted_tree(&tree)?
                    } else {
                        busybox_tree(&busybox, &tree)?
                    }
                    if let Some(bundle) = root.bundle_dir() {
                        copy_tree(bundle, &tree.join(BUNDLE_IN_GUEST.trim_start_matches('/')))?;
                    }
                    let built = root_image(&tree, &out).map_err(unsupported_host);
                    crate::instances::remove_path(&tree)?;
                    built
                }
            }
        })
        .await?;
        Ok(target)
    }

    /// The node's busybox applets, listed once.
    fn applets(&self) -> &[String] {
        self.inner.applets.get_or_init(|| busybox_applets(&self.inner.settings.busybox))
    }

    /// Whether `program` is in the root the VM boots from: a name is looked
    /// up in the guest, but a path that is not there fails the launch at
    /// once, as it would for a process, rather than inside a booted VM.
    fn in_root(&self, root: &WorkloadRoot, program: &str) -> bool {
        let Some(relative) = program.strip_prefix('/') else { return true };
        match root {
            WorkloadRoot::Image { dir, .. } => std::fs::symlink_metadata(dir.join(relative)).is_ok(),
            WorkloadRoot::Bundle { dir, .. } if Path::new(program).starts_with(BUNDLE_IN_GUEST) => {
                let inside = Path::new(program).strip_prefix(BUNDLE_IN_GUEST).unwrap_or(Path::new(""));
                std::fs::symlink_metadata(dir.join(inside)).is_ok()
            }
            // The node's own system directories, shared.
            WorkloadRoot::Host | WorkloadRoot::Bundle { .. } if self.shares() => {
                crate::container::SYSTEM_DIRS.iter().any(|dir| Path::new(program).starts_with(dir))
                    && std::fs::symlink_metadata(program).is_ok()
            }
            WorkloadRoot::Host | WorkloadRoot::Bundle { .. } => {
                let Some(name) = relative.strip_prefix("bin/") else { return false };
                name == "busybox" || self.applets().iter().any(|applet| applet == name)
            }
        }
    }

    /// The cgroup that holds `lease_id`'s VMM.
    fn cgroup(&self, lease_id: &str) -> crate::container::Cgroup {
        crate::container::Cgroup::new(&format!("{}/{lease_id}", crate::container::cgroup_parent(&self.inner.dir)))
    }

    /// Makes the cgroup of `lease_id`'s VMM: its CPU quota the lease's CPU
    /// (none for a lease that reserves none), its memory the guest's and
    /// [`VMM_ALLOWANCE`], so neither the guest nor QEMU itself takes more
    /// of the node than that; the command line prefix that starts QEMU in
    /// it (before its first allocation). Only root has cgroups to give: an
    /// agent that is not root runs its VMs without (no prefix).
    fn hold(
        &self,
        lease_id: &str,
        cpus: u32,
        resources: crate::provider::Resources,
        memory_mib: u32,
    ) -> Result<Vec<String>, String> {
        if !rustix::process::geteuid().is_root() {
            return Ok(Vec::new());
        }
        let memory = i64::try_from((u64::from(memory_mib) << 20) + VMM_ALLOWANCE).unwrap_or(i64::MAX);
        // The lease's CPU, never less than a tenth of its vCPUs' worth.
        let quota = (resources.cpu_millis > 0)
            .then(|| i64::try_from(resources.cpu_millis.max(u64::from(cpus) * 100) * 100).unwrap_or(i64::MAX));
        // The boot is the guest kernel's work, not the workload's: it runs at
        // its vCPUs' full speed, and the lease's quota holds it once the
        // workload starts (see `hold_cpu_once_started`).
        let boot = quota.map(|quota| quota.max(i64::from(cpus) * 100_000));
        let cgroup = self.cgroup(lease_id);
        // QEMU's threads, its shares' daemons and the relays it starts for the guest's connections.
        let pids = Some(self.inner.settings.pids_limit);
        cgroup.create_with(Some((Some(memory), Some(memory))), Some((boot, Some(100_000))), pids)?;
        let kept = self.inner.instances.layout.work_dir(lease_id).join(CPU_QUOTA_FILE);
        match quota {
            Some(quota) => std::fs::write(&kept, quota.to_string()).map_err(|e| e.to_string())?,
            None => {
                let _ = std::fs::remove_file(&kept);
            }
        }
        Ok(cgroup.enter_prefix())
    }

    /// Once the guest's init reports `lease_id`'s workload started, holds
    /// its VMM to the lease's CPU quota (kept in its run directory by
    /// [`Self::hold`]); until then it boots at its vCPUs' full speed.
    /// Stops looking when the VM ends or the agent stops (an agent
    /// restarted on it looks again).
    fn hold_cpu_once_started(&self, lease_id: String) {
        let kept = self.inner.instances.layout.work_dir(&lease_id).join(CPU_QUOTA_FILE);
        let Some(quota) = std::fs::read_to_string(kept).ok().and_then(|text| text.trim().parse::<i64>().ok()) else {
            return;
        };
        let provider = self.clone();
        tokio::spawn(async move {
            loop {
                if provider.workload_started(&lease_id) {
                    if let Err(error) = provider.cgroup(&lease_id).set_cpu(quota, 100_000) {
                        tracing::warn!(%lease_id, %error, "cannot hold a microVM to its lease's CPU");
                    }
                    return;
                }
                if !matches!(provider.running_vm(&lease_id), Ok((_, Some(_)))) {
                    return;
                }
                tokio::select! {
                    _ = provider.inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(BOOT_POLL) => {}
                }
            }
        });
    }

    /// Sends a VM found running its command again when its init has not
    /// reported the workload started: the agent that booted it may have
    /// gone before the guest read the first one. An init that has the
    /// command already ignores another.
    async fn resend_command(&self, lease_id: &str) {
        let run_dir = self.inner.instances.layout.work_dir(lease_id);
        if !statuses(&run_dir).is_empty() {
            return;
        }
        let Ok(kept) = std::fs::read(run_dir.join(COMMAND_FILE)) else { return };
        let Ok(command) = serde_json::from_slice::<GuestCommand>(&kept) else { return };
        let mut controls = self.inner.controls.lock().await;
        match Control::connect(&run_dir.join("control.sock")).await {
            Ok(mut control) => match control.run(&command).await {
                Ok(()) => {
                    controls.insert(lease_id.to_owned(), control);
                }
                Err(error) => tracing::warn!(%lease_id, %error, "cannot send a booting microVM its command again"),
            },
            Err(error) => tracing::warn!(%lease_id, %error, "cannot reach a booting microVM's control port"),
        }
    }

    /// Kills a VMM of `lease_id` that runs with no pid recorded: an agent
    /// stopped between starting QEMU and recording it left it running, and
    /// once its lease is settled nothing would ever stop it. It is found by
    /// its control port's argument, which names the lease's directory.
    async fn stop_unrecorded(&self, lease_id: &str) {
        let run_dir = self.inner.instances.layout.work_dir(lease_id);
        let socket = run_dir.join("control.sock");
        let (proc_root, chardev) = (self.inner.proc_root.clone(), berth_microvm::vmm::control_chardev(&socket));
        let found = blocking(move || {
            let mut found = procfs::with_args(&proc_root, &["-chardev", &chardev]);
            // The daemons of its shares, each found by its socket.
            for entry in std::fs::read_dir(&run_dir).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("share-") && name.ends_with(".sock") {
                    let socket = entry.path().display().to_string();
                    found.extend(procfs::with_args(&proc_root, &["--socket-path", &socket]));
                }
            }
            Ok(found)
        })
        .await
        .unwrap_or_default();
        if found.is_empty() {
            return;
        }
        tracing::warn!(%lease_id, pids = ?found.iter().map(|p| p.pid).collect::<Vec<_>>(),
            "stopping a microVM (or its shares' daemons) an interrupted launch left running unrecorded");
        crate::procfs::kill_found(&found).await;
        self.release_cgroup(lease_id).await;
    }

    /// Whether the guest's init has reported `lease_id`'s workload started.
    pub fn workload_started(&self, lease_id: &str) -> bool {
        statuses(&self.inner.instances.layout.work_dir(lease_id)).iter().any(|s| matches!(s, Status::Started(_)))
    }

    /// Waits for a VMM this provider started, then records how the
    /// workload ended.
    fn wait_for_vm(&self, lease_id: String, mut child: tokio::process::Child) {
        let provider = self.clone();
        tokio::spawn(async move {
            tokio::select! {
                // The agent stops; the VM runs on and the next agent adopts it.
                _ = provider.inner.shutdown.cancelled() => return,
                _ = child.wait() => {}
            }
            provider.vm_ended(&lease_id).await;
        });
    }

    /// Polls `/proc` for a VMM adopted after a restart until it is gone.
    fn watch_adopted(&self, lease_id: String, pid: u32, start_ticks: u64) {
        let provider = self.clone();
        tokio::spawn(async move {
            let every = provider.inner.settings.timing.exit_poll.max(Duration::from_millis(1));
            loop {
                tokio::select! {
                    _ = provider.inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                if !procfs::is_running(&provider.inner.proc_root, pid, start_ticks) {
                    break;
                }
            }
            provider.vm_ended(&lease_id).await;
        });
    }

    /// Undoes a launch of `lease_id` that failed once its cgroup was held:
    /// its shares' daemons and its relay end, its cgroup goes, and its
    /// record says it never started; the error names `why`.
    async fn abandon(
        &self,
        lease_id: &str,
        daemons: &[tokio::process::Child],
        first: StoredRecord,
        program: String,
        why: String,
    ) -> ProviderError {
        daemons.iter().for_each(kill_group);
        self.release_cgroup(lease_id).await;
        self.inner.instances.never_started(first).await;
        ProviderError::Spawn { command: program, source: std::io::Error::other(why) }
    }

    /// Removes the cgroup of `lease_id`'s VM, whose VMM has ended: what it
    /// still holds is the VM's too (its shares' daemons, which end with
    /// their VMM a moment later, or a relay it started), and is killed
    /// first, so the cgroup is never left behind.
    async fn release_cgroup(&self, lease_id: &str) {
        if let Ok(mut ports) = self.inner.asking.lock() {
            ports.remove(lease_id);
        }
        self.inner.relays.close(lease_id);
        let cgroup = self.cgroup(lease_id);
        let deadline = tokio::time::Instant::now() + KILL_WAIT;
        loop {
            let left = cgroup.processes();
            if left.is_empty() || tokio::time::Instant::now() >= deadline {
                break;
            }
            for pid in
                left.into_iter().filter_map(|pid| i32::try_from(pid).ok()).filter_map(rustix::process::Pid::from_raw)
            {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
            tokio::time::sleep(STOP_POLL).await;
        }
        cgroup.remove();
    }

    /// Records the end of `lease_id`'s VM as its status lines tell it
    /// (nothing, for a lease already removed: its run directory went with it).
    async fn vm_ended(&self, lease_id: &str) {
        self.inner.controls.lock().await.remove(lease_id);
        self.release_cgroup(lease_id).await;
        let killed = self.inner.killed.lock().map(|mut k| k.remove(lease_id)).unwrap_or(false);
        if self.inner.instances.stored(lease_id).is_err() {
            return;
        }
        let run_dir = self.inner.instances.layout.work_dir(lease_id);
        let reported = statuses(&run_dir);
        let status = exit_status(&reported, killed, true);
        let stderr = self.inner.instances.layout.logs(lease_id).stderr;
        if let Some(Status::Failed(why)) = reported.iter().find(|s| matches!(s, Status::Failed(_))) {
            tracing::warn!(%lease_id, %why, "the guest could not start the workload");
            let _ = append(&stderr, &format!("berth: the microVM could not start the workload: {why}\n"));
        } else if reported.is_empty() && !killed {
            // Its kernel or init never got as far as the workload (a panic, an init it could not run).
            let console = std::fs::read_to_string(run_dir.join("console.log")).unwrap_or_default();
            let lines: Vec<&str> = console.lines().filter(|line| !line.trim().is_empty()).collect();
            // A panic's own line and the one before it say why; its stack trace does not.
            let said = match lines.iter().position(|line| line.contains("Kernel panic")) {
                Some(at) => lines[at.saturating_sub(1)..=at].join(" | "),
                None => lines[lines.len().saturating_sub(3)..].join(" | "),
            };
            tracing::warn!(%lease_id, console = %said, "the microVM ended before its init started the workload");
            let _ = append(
                &stderr,
                &format!(
                    "berth: the microVM ended before its init started the workload; its console's last words: {said}\n"
                ),
            );
        }
        self.inner.instances.ended(lease_id, status).await;
    }

    /// The VMM's pid of `lease_id` while it runs.
    fn running_vm(&self, lease_id: &str) -> Result<(StoredRecord, Option<u32>), ProviderError> {
        let stored = self.inner.instances.stored(lease_id)?;
        let pid = stored
            .pid
            .zip(stored.start_ticks)
            .filter(|(pid, ticks)| stored.exit.is_none() && procfs::is_running(&self.inner.proc_root, *pid, *ticks))
            .map(|(pid, _)| pid);
        Ok((stored, pid))
    }

    /// Sends `signal` through the VM's control port, connecting again if
    /// this provider holds none (after a restart).
    async fn send_signal(&self, lease_id: &str, signal: i32) -> Result<(), ProviderError> {
        let mut controls = self.inner.controls.lock().await;
        if !controls.contains_key(lease_id) {
            let socket = self.inner.instances.layout.work_dir(lease_id).join("control.sock");
            let control = Control::connect(&socket).await.map_err(|e| signal_error(lease_id, e))?;
            controls.insert(lease_id.to_owned(), control);
        }
        let Some(control) = controls.get_mut(lease_id) else { return Ok(()) };
        if let Err(error) = control.signal(signal).await {
            controls.remove(lease_id);
            return Err(signal_error(lease_id, error));
        }
        Ok(())
    }

    /// Waits until the VMM `pid` is gone, up to `within`.
    async fn vm_gone(&self, pid: u32, ticks: u64, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while procfs::is_running(&self.inner.proc_root, pid, ticks) {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(STOP_POLL).await;
        }
        true
    }
}

/// The guest's network in its tenant's namespace: the workload's ports
/// forwarded in from the namespace's loopback, where the agent's data plane
/// reaches replicas; the namespace's loopback, where the tenant's proxy and
/// resolver listen, at the guest's gateway, which its environment's proxy
/// variables and its `resolv.conf` name (a guest's `127.0.0.1` is its own).
fn guest_network(
    attachment: &crate::provider::NetworkAttachment,
    meta: &crate::provider::InstanceMeta,
    env: &mut BTreeMap<String, String>,
    busybox: &Path,
) -> Result<(SlirpNetwork, GuestNetwork), ProviderError> {
    let mut inbound: Vec<u16> =
        std::iter::once(meta.port).chain(meta.ports.values().copied()).filter_map(|p| u16::try_from(p).ok()).collect();
    inbound.retain(|port| *port != 0);
    inbound.sort_unstable();
    inbound.dedup();
    for value in env.values_mut() {
        if let Some(port) = value.strip_prefix("http://127.0.0.1:") {
            *value = format!("http://{GUEST_GATEWAY}:{port}");
        }
    }
    let resolv_conf =
        match &attachment.resolv_conf {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| crate::instances::io("reading", path, e))?
                .lines()
                .map(|line| {
                    if line.starts_with("nameserver ") {
                        format!("nameserver {GUEST_GATEWAY}")
                    } else {
                        line.to_owned()
                    }
                })
                .map(|line| line + "\n")
                .collect(),
            None => String::new(),
        };
    let guest = GuestNetwork {
        address: GUEST_ADDRESS.into(),
        gateway: GUEST_GATEWAY.into(),
        resolv_conf,
        inbound: inbound.clone(),
    };
    // Services' internal names resolve, for a guest, to an address whose connections QEMU relays to
    // where the agent forwards them to the router (a guest's 127.0.0.54 is its own).
    let services = crate::egress::SERVICES_ADDR.to_string();
    let relay = vec![busybox.display().to_string(), "nc".into(), services, crate::egress::SERVICES_PORT.to_string()];
    let outbound = vec![(crate::egress::SERVICES_PORT, relay)];
    Ok((SlirpNetwork { inbound, outbound }, guest))
}

/// A directory of the node's a VM mounts.
#[derive(Debug, Clone)]
struct Shared {
    /// The directory on the node.
    host: PathBuf,
    /// How the guest mounts it; its tag names its daemon's socket and log.
    guest: GuestShare,
    /// Nothing changes it while the VM runs.
    unchanging: bool,
}

/// The node's directories `spec`'s VM mounts, when the node shares any: a
/// bundle's or bare command's system directories (read-only), its cache
/// volumes' views (read-write) and its identity directory (read-only).
fn shared_dirs(spec: &LaunchSpec, hosted: bool) -> Vec<Shared> {
    if !hosted {
        return Vec::new();
    }
    let mut shared = Vec::new();
    if matches!(spec.root, WorkloadRoot::Host | WorkloadRoot::Bundle { .. }) {
        shared.extend(crate::container::system_dirs().into_iter().map(|dir| (dir.clone(), dir, true, true)));
    }
    shared.extend(spec.caches.iter().map(|cache| (cache.host.clone(), cache.inside.clone(), false, false)));
    shared.extend(spec.identity.iter().map(|dir| (dir.clone(), PathBuf::from(IDENTITY_IN_GUEST), true, false)));
    shared
        .into_iter()
        .enumerate()
        .map(|(index, (host, inside, read_only, unchanging))| Shared {
            host,
            guest: GuestShare { tag: format!("share-{index}"), path: inside.display().to_string(), read_only },
            unchanging,
        })
        .collect()
}

/// Relays the Workload API into a guest with a network: QEMU hands each
/// connection to [`GUEST_WORKLOAD_API_PORT`] of its services address to
/// the node's `socat`, which dials `socket` (the agent's relay to the
/// lease's own socket, see [`relay`], so the agent knows the caller by the
/// socket, as for a container), and the init listens inside the guest at
/// [`WORKLOAD_API_IN_GUEST`]. `None` where the node has no `socat`.
fn relay_workload_api(socket: &Path, network: &mut SlirpNetwork) -> Option<GuestRelay> {
    let socat = find_program(Path::new("socat"))?;
    let relay = vec![socat.display().to_string(), "-".into(), format!("UNIX-CONNECT:{}", socket.display())];
    network.outbound.push((GUEST_WORKLOAD_API_PORT, relay));
    Some(GuestRelay {
        path: WORKLOAD_API_IN_GUEST.into(),
        address: format!("{GUEST_SERVICES_ADDRESS}:{GUEST_WORKLOAD_API_PORT}"),
    })
}

/// How a VM's workload ended, from its status lines; `killed` when this
/// provider killed its VMM, `watched` when it saw the VMM end (then a VM
/// that reported nothing never started its workload: 127, as a shell
/// reports a program it cannot run).
fn exit_status(statuses: &[Status], killed: bool, watched: bool) -> ExitStatus {
    let reported = statuses.iter().find_map(|status| match status {
        Status::Exited(GuestExit::Code(code)) => Some(ExitStatus::Code(*code)),
        Status::Exited(GuestExit::Signal(signal)) => Some(ExitStatus::Signal(*signal)),
        Status::Exited(GuestExit::OutOfMemory) => Some(ExitStatus::OutOfMemory),
        // The workload never ran: as a shell reports a program it cannot run.
        Status::Failed(_) => Some(ExitStatus::Code(127)),
        Status::Started(_) | Status::Watching(_) | Status::Listening(_) => None,
    });
    match reported {
        Some(status) => status,
        None if killed => ExitStatus::Signal(9),
        // Seen to end with nothing reported: its init never started the workload.
        None if watched && statuses.is_empty() => ExitStatus::Code(127),
        None => ExitStatus::Unknown,
    }
}

fn signal_error(lease_id: &str, error: berth_microvm::vmm::VmError) -> ProviderError {
    ProviderError::Signal { lease_id: lease_id.to_owned(), source: std::io::Error::other(error.to_string()) }
}

fn unsupported_host(error: impl std::fmt::Display) -> ProviderError {
    ProviderError::Unsupported(format!("this node cannot build a microVM: {error}"))
}

fn append(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    std::fs::OpenOptions::new().append(true).create(true).open(path)?.write_all(text.as_bytes())
}

/// The image's user when it names one other than root.
fn image_user(account: Option<&berth_bundle::ImageUser>) -> Option<&berth_bundle::ImageUser> {
    account.filter(|user| user.uid != 0)
}

/// The uid and gid a workload runs as in its guest: its image's user's, else
/// [`GUEST_USER`]'s; never root's group.
fn guest_ids(user: Option<&berth_bundle::ImageUser>) -> (u32, u32) {
    user.map_or((GUEST_USER, GUEST_USER), |user| (user.uid, if user.gid == 0 { user.uid } else { user.gid }))
}

/// A digest as part of a file name: its hex, without the algorithm.
fn digest_name(digest: &str) -> String {
    digest.rsplit(':').next().unwrap_or(digest).chars().filter(char::is_ascii_alphanumeric).collect()
}

/// A root of `busybox` and a link for each of its applets in `/bin`, with
/// the directories a workload expects and an account for [`GUEST_USER`].
fn busybox_tree(busybox: &Path, root: &Path) -> Result<(), ProviderError> {
    base_tree(root, &["bin"])?;
    std::fs::copy(busybox, root.join("bin/busybox")).map_err(tree_io("copying", busybox))?;
    for applet in busybox_applets(busybox) {
        let link = root.join("bin").join(applet);
        std::os::unix::fs::symlink("busybox", &link).map_err(tree_io("linking", &link))?;
    }
    Ok(())
}

/// A root for the node's system directories, shared into the guest at the
/// same paths (a directory here for each; the host's links as links), with
/// the host's CA certificates and name service files under `/etc`, as a
/// container sees them, the directories a workload expects and an account
/// for [`GUEST_USER`].
fn hosted_tree(root: &Path) -> Result<(), ProviderError> {
    base_tree(root, &[])?;
    for dir in crate::container::SYSTEM_DIRS {
        let at = root.join(dir.trim_start_matches('/'));
        match std::fs::read_link(dir) {
            Ok(target) => std::os::unix::fs::symlink(&target, &at).map_err(tree_io("linking", &at))?,
            Err(_) if Path::new(dir).is_dir() => std::fs::create_dir_all(&at).map_err(tree_io("creating", &at))?,
            Err(_) => {}
        }
    }
    for shared in crate::container::SHARED_ETC.iter().map(Path::new) {
        let at = root.join(shared.strip_prefix("/").unwrap_or(shared));
        match std::fs::symlink_metadata(shared) {
            Ok(meta) if meta.is_dir() => {
                std::fs::create_dir_all(&at).map_err(tree_io("creating", &at))?;
                for entry in std::fs::read_dir(shared).map_err(tree_io("reading", shared))? {
                    let entry = entry.map_err(tree_io("reading", shared))?;
                    // A host's private keys (`/etc/ssl/private`) are no guest's: a container's user cannot
                    // read them where they are bound, and a copy would be a guest root's to read.
                    if entry.file_name() == "private" {
                        continue;
                    }
                    copy_entry(&entry.path(), &at.join(entry.file_name()))?;
                }
            }
            Ok(_) => copy_entry(shared, &at)?,
            Err(_) => {}
        }
    }
    Ok(())
}

/// What every guest root made here holds: `extra` directories, the usual
/// ones, a home for [`GUEST_USER`] and its account.
fn base_tree(root: &Path, extra: &[&str]) -> Result<(), ProviderError> {
    for dir in ["etc", "tmp", "proc", "dev", "sys", "run", "home/workload"].iter().chain(extra) {
        std::fs::create_dir_all(root.join(dir)).map_err(tree_io("creating", &root.join(dir)))?;
    }
    let files = [
        (
            "etc/passwd",
            format!("root:x:0:0:root:/root:/bin/sh\nworkload:x:{GUEST_USER}:{GUEST_USER}::/home/workload:/bin/sh\n"),
        ),
        ("etc/group", format!("root:x:0:\nworkload:x:{GUEST_USER}:\n")),
    ];
    for (name, text) in files {
        std::fs::write(root.join(name), text).map_err(tree_io("writing", &root.join(name)))?;
    }
    use std::os::unix::fs::{PermissionsExt as _, chown};
    std::fs::set_permissions(root.join("tmp"), std::fs::Permissions::from_mode(0o1777))
        .map_err(tree_io("opening", &root.join("tmp")))?;
    // Only root gives files away; an agent that is not root runs its
    // workloads uncontained, and builds no image for them to use.
    if rustix::process::geteuid().is_root() {
        chown(root.join("home/workload"), Some(GUEST_USER), Some(GUEST_USER))
            .map_err(tree_io("giving the workload", &root.join("home/workload")))?;
    }
    Ok(())
}

/// An I/O error building a tree, naming what was done to which path.
fn tree_io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ProviderError {
    let path = path.to_path_buf();
    move |e| crate::instances::io(what, &path, e)
}

/// The applets `busybox` offers, `busybox` itself aside.
fn busybox_applets(busybox: &Path) -> Vec<String> {
    let listed = std::process::Command::new(busybox).arg("--list").output().map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&listed).lines().filter(|a| !a.is_empty() && *a != "busybox").map(str::to_owned).collect()
}

/// Whether `relative` names an entry under `root` reached through no link:
/// what an image's user owns is given only there, never through a link
/// that points anywhere else.
fn beneath_without_links(root: &Path, relative: &Path) -> bool {
    let mut path = root.to_path_buf();
    relative.components().all(|component| {
        path.push(component);
        matches!(component, std::path::Component::Normal(_))
            && std::fs::symlink_metadata(&path).is_ok_and(|meta| !meta.file_type().is_symlink())
    })
}

/// Copies the tree at `from` to `to`, links as links.
fn copy_tree(from: &Path, to: &Path) -> Result<(), ProviderError> {
    let io = tree_io;
    std::fs::create_dir_all(to).map_err(io("creating", to))?;
    for entry in std::fs::read_dir(from).map_err(io("reading", from))? {
        let entry = entry.map_err(io("reading", from))?;
        copy_entry(&entry.path(), &to.join(entry.file_name()))?;
    }
    Ok(())
}

/// Copies the file, link (as a link) or tree at `source` to `target`;
/// anything else (a socket, a device) is left out.
fn copy_entry(source: &Path, target: &Path) -> Result<(), ProviderError> {
    let kind = std::fs::symlink_metadata(source).map_err(tree_io("reading", source))?.file_type();
    if kind.is_dir() {
        copy_tree(source, target)?;
    } else if kind.is_symlink() {
        let points = std::fs::read_link(source).map_err(tree_io("reading", source))?;
        std::os::unix::fs::symlink(points, target).map_err(tree_io("linking", target))?;
    } else if kind.is_file() {
        std::fs::copy(source, target).map_err(tree_io("copying", source))?;
    }
    Ok(())
}

#[async_trait::async_trait]
impl Provider for MicroVmProvider {
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, ProviderError> {
        validate_lease_id(&spec.lease_id)?;
        let hosted = self.shares();
        if let Some(cache) = spec.caches.first().filter(|_| !hosted) {
            return Err(Self::unsupported(&spec, &format!("mounts a cache volume at {}", cache.inside.display())));
        }
        if spec.identity.is_some() && !hosted {
            return Err(Self::unsupported(&spec, "has a workload identity directory"));
        }
        let bundle = spec.root.bundle_dir().map(|_| PathBuf::from(BUNDLE_IN_GUEST));
        let program = spec.program_path(bundle.as_deref())?;
        if !self.in_root(&spec.root, &program) {
            let source = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file in the workload's root");
            return Err(ProviderError::Spawn { command: program, source });
        }
        let vm_initramfs = self.initramfs().await?;
        let root_image = self.root_image(&spec.root, hosted).await?;
        let mut spec = spec;
        let _claim = self.inner.instances.prepare_launch(&mut spec, &self.inner.ports)?;

        // Only root gives files away (and only a root agent shares any).
        let host_user = if hosted { Some(self.inner.uids.claim(&self.inner.instances, &spec.lease_id)?) } else { None };
        let layout = self.inner.instances.layout.clone();
        let mut first = StoredRecord::starting(&spec);
        first.uid = host_user.as_ref().map(|claim| claim.uid);
        let (run_dir, _, _) = {
            let first = first.clone();
            blocking(move || prepare(&layout, &first)).await?
        };
        let scratch = run_dir.join("scratch.ext4");
        {
            let scratch = scratch.clone();
            blocking(move || {
                let _ = std::fs::remove_file(&scratch);
                scratch_image(&scratch, SCRATCH_BYTES).map_err(unsupported_host)
            })
            .await?;
        }
        // The status of an earlier run of this lease is not this one's.
        let _ = std::fs::remove_file(berth_microvm::vmm::status_file(&run_dir));

        let (uid, gid, home, cwd) = match &spec.root {
            WorkloadRoot::Image { working_dir, account, .. } => {
                let account = image_user(account.as_deref());
                let (uid, gid) = guest_ids(account);
                let home = account.and_then(|a| a.home.clone()).unwrap_or_else(|| "/tmp".into());
                let cwd = if working_dir.is_empty() { "/".to_owned() } else { working_dir.clone() };
                (uid, gid, home, cwd)
            }
            WorkloadRoot::Host | WorkloadRoot::Bundle { .. } => {
                (GUEST_USER, GUEST_USER, "/home/workload".to_owned(), "/home/workload".to_owned())
            }
        };
        let identity_seen =
            IdentitySeen { dir: Path::new(IDENTITY_IN_GUEST), socket: Path::new(WORKLOAD_API_IN_GUEST) };
        let mut env = spec.environment(Path::new(&home), bundle.as_deref(), Some(identity_seen));
        let shared = shared_dirs(&spec, hosted);
        let owner = first.uid.map(|host| ShareOwner { guest: (uid, gid), host: (host, host) });
        if let Some(host) = first.uid {
            let views: Vec<PathBuf> = spec.caches.iter().map(|cache| cache.host.clone()).collect();
            let identity = spec.identity.clone();
            blocking(move || crate::container::give_workload(identity.as_deref(), &views, host, host)).await?;
        }
        let (mut network, guest_network) = match &spec.network {
            Some(attachment) => {
                let (network, guest) = guest_network(attachment, &spec.meta, &mut env, &self.inner.settings.busybox)?;
                (Some(network), Some(guest))
            }
            None => (None, None),
        };
        // The relay is reached as the lease's user: QEMU's and its relays' once it has set up.
        let relayed = spec.identity.as_ref().zip(first.uid);
        let workload_api = match (relayed, &mut network) {
            (Some(_), Some(network)) => relay_workload_api(&self.inner.relays.socket(&spec.lease_id), network),
            _ => None,
        };
        if workload_api.is_none() {
            // Its identity is files alone: the Workload API's socket does not cross a share.
            env.remove(crate::provider::SPIFFE_SOCKET_VAR);
        }
        let mut argv = vec![program.clone()];
        argv.extend(spec.args.iter().cloned());
        let command = GuestCommand {
            argv,
            env: env.into_iter().collect(),
            cwd,
            uid,
            gid,
            hostname: spec.lease_id.chars().take(63).collect(),
            network: guest_network,
            max_processes: u64::try_from(self.inner.settings.pids_limit).unwrap_or(0),
            // The workload gets its lease's memory; the guest's kernel and init live beside it.
            memory_limit_bytes: u64::from(workload_memory_mib(spec.resources.memory_bytes)) << 20,
            shares: shared.iter().map(|share| share.guest.clone()).collect(),
            workload_api,
        };
        let logs = self.inner.instances.layout.logs(&spec.lease_id);
        let resources = spec.resources;
        let accel = self.accel(&vm_initramfs).await;
        let mut vm = VmSpec {
            qemu: self.inner.settings.qemu.clone(),
            accel,
            vmlinuz: self.inner.settings.kernel_dir.join("vmlinuz"),
            initramfs: vm_initramfs,
            root_image,
            scratch_image: scratch,
            cpus: u32::try_from(resources.cpu_millis.div_ceil(1000)).unwrap_or(u32::MAX).max(1),
            memory_mib: guest_memory_mib(resources.memory_bytes),
            run_dir,
            stdout_log: logs.stdout,
            stderr_log: logs.stderr,
            network,
            enter: spec.network.as_ref().map(|n| n.enter.clone()).unwrap_or_default(),
            shares: Vec::new(),
            // Once set up, QEMU runs as the lease's user of the workload range.
            run_as: first.uid.map(|host| (host, host)),
        };
        // Kept so that an agent restarted before the guest read it sends it again.
        let kept = serde_json::to_vec(&command).unwrap_or_default();
        let command_file = vm.run_dir.join(COMMAND_FILE);
        blocking(move || {
            std::fs::write(&command_file, kept).map_err(|e| crate::instances::io("writing", &command_file, e))
        })
        .await?;
        let (exit_tx, exit_rx) = watch::channel(None);
        // QEMU and its shares' daemons start inside its cgroup; QEMU then enters the tenant's namespace.
        let in_cgroup = match self.hold(&spec.lease_id, vm.cpus, resources, vm.memory_mib) {
            Ok(enter) => enter,
            Err(error) => {
                self.cgroup(&spec.lease_id).remove();
                self.inner.instances.never_started(first).await;
                return Err(ProviderError::Spawn { command: program, source: std::io::Error::other(error) });
            }
        };
        let mut daemons = Vec::new();
        for share in &shared {
            let daemon = ShareSpec {
                virtiofsd: self.inner.settings.virtiofsd.clone().unwrap_or_default(),
                dir: share.host.clone(),
                socket: vm.run_dir.join(format!("{}.sock", share.guest.tag)),
                read_only: share.guest.read_only,
                unchanging: share.unchanging,
                sandbox: rustix::process::geteuid().is_root(),
                // The node's own directories are shown as they are.
                owner: owner.filter(|_| !share.unchanging),
                log: vm.run_dir.join(format!("{}.log", share.guest.tag)),
            };
            match start_share(&daemon, &in_cgroup).await {
                Ok(child) => daemons.push(child),
                Err(error) => {
                    let why = format!("sharing {} with its microVM: {error}", share.host.display());
                    return Err(self.abandon(&spec.lease_id, &daemons, first, program, why).await);
                }
            }
            vm.shares.push(VmShare { tag: share.guest.tag.clone(), socket: daemon.socket });
        }
        if let (Some((identity, host)), Some(_)) = (relayed, &command.workload_api) {
            let target = identity.join(crate::svids::SOCKET_FILE);
            if let Err(error) = self.inner.relays.open(&spec.lease_id, &target, host, &vm.run_dir) {
                let why = format!("relaying its Workload API: {error}");
                return Err(self.abandon(&spec.lease_id, &daemons, first, program, why).await);
            }
        }
        vm.enter = in_cgroup.into_iter().chain(std::mem::take(&mut vm.enter)).collect();
        let Vm { child, control } = match Vm::boot(&vm, &command).await {
            Ok(vm) => vm,
            Err(error) => {
                let why = format!("booting its microVM: {error}");
                return Err(self.abandon(&spec.lease_id, &daemons, first, program, why).await);
            }
        };
        let pid = child.id();
        let start_ticks = pid.and_then(|pid| procfs::read_stat(&self.inner.proc_root, pid)).map(|s| s.start_ticks);
        let started = StoredRecord { pid, start_ticks, started_at_ms: Some(unix_ms(SystemTime::now())), ..first };
        self.inner.controls.lock().await.insert(spec.lease_id.clone(), control);
        self.inner.instances.track(started.clone(), exit_tx).await?;
        tracing::info!(lease_id = %spec.lease_id, epoch = spec.epoch, ?pid, %program, accel = vm.accel.name(),
            cpus = vm.cpus, memory_mib = vm.memory_mib, "microVM started");
        self.hold_cpu_once_started(spec.lease_id.clone());
        self.wait_for_vm(spec.lease_id, child);
        Ok(Launched { record: started.to_record(), exit: exit_rx })
    }

    async fn recover(&self) -> Result<Vec<Launched>, ProviderError> {
        let provider = self.clone();
        let loaded = blocking(move || load_records(&provider.inner.instances.layout)).await?;
        let mut recovered = Vec::new();
        for mut stored in loaded {
            let (lease_id, uid) = (stored.lease_id.clone(), stored.uid);
            if let Some(tracked) = self.inner.instances.lock().get(&lease_id) {
                recovered.push(Launched { record: tracked.stored.to_record(), exit: tracked.exit.subscribe() });
                continue;
            }
            let running = stored.pid.zip(stored.start_ticks).filter(|(pid, ticks)| {
                stored.exit.is_none() && procfs::is_running(&self.inner.proc_root, *pid, *ticks)
            });
            if stored.pid.is_none() && stored.exit.is_none() {
                self.stop_unrecorded(&lease_id).await;
            }
            if running.is_none() {
                self.inner.relays.close(&lease_id);
            }
            if running.is_none() && stored.exit.is_none() {
                // Ended while no agent watched: its status lines tell how.
                let status = exit_status(&statuses(&self.inner.instances.layout.work_dir(&lease_id)), false, false);
                self.inner.instances.ended_unwatched(&mut stored, status).await?;
            }
            recovered.push(self.inner.instances.recovered(stored));
            if let Some((pid, ticks)) = running {
                tracing::info!(%lease_id, pid, "found a microVM still running from before the restart");
                if let Some(host) = uid {
                    let run_dir = self.inner.instances.layout.work_dir(&lease_id);
                    if let Some(Err(error)) = self.inner.relays.reopen(&lease_id, host, &run_dir) {
                        tracing::warn!(%lease_id, %error, "cannot relay an adopted microVM's Workload API");
                    }
                }
                self.resend_command(&lease_id).await;
                self.hold_cpu_once_started(lease_id.clone());
                self.watch_adopted(lease_id, pid, ticks);
            }
        }
        Ok(recovered)
    }

    async fn set_epoch(&self, lease_id: &str, epoch: u64) -> Result<(), ProviderError> {
        self.inner.instances.update(lease_id, move |record| record.epoch = epoch).await
    }

    async fn settle(&self, lease_id: &str, settlement: Settlement) -> Result<(), ProviderError> {
        self.inner.instances.settle(lease_id, settlement).await
    }

    async fn destroy(&self, lease_id: &str) -> Result<(), ProviderError> {
        let (stored, pid) = self.running_vm(lease_id)?;
        let (Some(pid), Some(ticks)) = (pid, stored.start_ticks) else { return Ok(()) };
        let grace = self.inner.settings.timing.stop_grace;
        tracing::info!(%lease_id, pid, ?grace, "stopping the microVM's workload");
        if let Err(error) = self.send_signal(lease_id, 15).await {
            tracing::warn!(%lease_id, %error, "cannot ask the guest to stop its workload; killing the VM");
        } else if self.vm_gone(pid, ticks, grace).await {
            return Ok(());
        }
        tracing::warn!(%lease_id, pid, "the microVM outlived its grace; killing it");
        if let Ok(mut killed) = self.inner.killed.lock() {
            killed.insert(lease_id.to_owned());
        }
        if let Some(vmm) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(vmm, rustix::process::Signal::KILL);
        }
        if self.vm_gone(pid, ticks, KILL_WAIT).await {
            return Ok(());
        }
        Err(ProviderError::Stuck { lease_id: lease_id.into(), detail: format!("the VMM (pid {pid}) survived SIGKILL") })
    }

    async fn remove(&self, lease_id: &str) -> Result<(), ProviderError> {
        validate_lease_id(lease_id)?;
        if let Ok((_, Some(_))) = self.running_vm(lease_id) {
            return Err(ProviderError::AlreadyRunning(lease_id.to_string()));
        }
        self.inner.controls.lock().await.remove(lease_id);
        self.release_cgroup(lease_id).await;
        self.inner.instances.forget(lease_id).await
    }

    async fn signal(&self, lease_id: &str, signal: WorkloadSignal) -> Result<(), ProviderError> {
        let (_, pid) = self.running_vm(lease_id)?;
        if pid.is_none() {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        }
        let number = match signal {
            WorkloadSignal::Term => 15,
            WorkloadSignal::Kill => 9,
            WorkloadSignal::Int => 2,
            WorkloadSignal::Hup => 1,
            WorkloadSignal::Usr1 => 10,
            WorkloadSignal::Usr2 => 12,
            WorkloadSignal::Quit => 3,
        };
        self.send_signal(lease_id, number).await
    }

    /// The workload's use as its guest's init reads it from the workload's
    /// cgroup (CPU time and memory charged, as a container's are read);
    /// while the guest does not answer (still booting), the VMM's own: its
    /// CPU time is the guest's, and its resident memory what the guest
    /// touched plus the VMM's overhead.
    async fn stats(&self, lease_id: &str) -> Result<InstanceStats, ProviderError> {
        let (stored, pid) = self.running_vm(lease_id)?;
        let stat = pid
            .and_then(|pid| procfs::read_stat(&self.inner.proc_root, pid))
            .ok_or_else(|| ProviderError::NotRunning(lease_id.to_string()))?;
        let started = stored.started_at_ms.map(from_unix_ms).unwrap_or_else(SystemTime::now);
        let uptime = SystemTime::now().duration_since(started).unwrap_or_default();
        let run_dir = self.inner.instances.layout.work_dir(lease_id);
        let asked = {
            // One question at a time on a VM's stats port, which takes one connection.
            let port = self.inner.asking.lock().map(|mut ports| ports.entry(lease_id.to_owned()).or_default().clone());
            let port = port.unwrap_or_default();
            let _asking = port.lock().await;
            berth_microvm::vmm::guest_stats(&run_dir).await
        };
        if let Some(guest) = asked {
            return Ok(InstanceStats {
                cpu_time: Duration::from_micros(guest.cpu_usec),
                memory_bytes: guest.memory_bytes,
                uptime,
            });
        }
        let per_second = rustix::param::clock_ticks_per_second().max(1);
        Ok(InstanceStats {
            cpu_time: Duration::from_millis(stat.cpu_ticks().saturating_mul(1000) / per_second),
            memory_bytes: stat.rss_pages.saturating_mul(rustix::param::page_size() as u64),
            uptime,
        })
    }

    async fn resize(&self, lease_id: &str, _ask: ResizeAsk) -> Result<Resized, ProviderError> {
        if self.running_vm(lease_id)?.1.is_none() {
            return Err(ProviderError::NotRunning(lease_id.to_string()));
        }
        Ok(Resized::unsupported("microvm"))
    }

    fn log_files(&self, lease_id: &str) -> Result<LogFiles, ProviderError> {
        self.inner.instances.stored(lease_id)?;
        Ok(self.inner.instances.layout.logs(lease_id))
    }

    /// From the guest's init's status lines: not before the workload
    /// started (the guest boots), then as the init reports the port, or
    /// `None` from an init that does not watch it (a dial tells what it can).
    fn listens(&self, lease_id: &str, port: u16) -> Option<bool> {
        let statuses = statuses(&self.inner.instances.layout.work_dir(lease_id));
        if statuses.contains(&Status::Listening(port)) {
            return Some(true);
        }
        let watched = statuses.iter().any(|s| matches!(s, Status::Watching(ports) if ports.contains(&port)));
        let started = statuses.iter().any(|s| matches!(s, Status::Started(_)));
        (watched || !started).then_some(false)
    }

    fn runtime(&self) -> Runtime {
        Runtime { name: "microvm".into(), contained: true }
    }

    fn running(&self) -> Vec<String> {
        self.inner.instances.running()
    }
}

/// Where the microVM runtime finds its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroVmConfig {
    /// The QEMU binary, a path or a name looked up on `PATH`.
    pub qemu: PathBuf,
    /// The guest kernel's directory (`scripts/microvm-deps.sh` lays it out).
    pub kernel_dir: PathBuf,
    /// The static guest init; `None` finds it as
    /// `berth_microvm::install::find_init` does.
    pub init: Option<PathBuf>,
    /// How guest code runs.
    pub accel: crate::MicroVmAccel,
}

impl Default for MicroVmConfig {
    fn default() -> Self {
        Self {
            qemu: "qemu-system-x86_64".into(),
            kernel_dir: berth_microvm::kernel::DEFAULT_KERNEL_DIR.into(),
            init: None,
            accel: crate::MicroVmAccel::Auto,
        }
    }
}

mod relay;

/// Removes what the microVM provider on `data_dir` keeps outside it (its
/// VMs' Workload API relay directories), once no agent runs there.
pub(crate) fn remove_relays(data_dir: &Path) {
    relay::Relays::remove_all(data_dir);
}

#[cfg(test)]
mod tests;
