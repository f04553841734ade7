//! The OCI runtime spec (`config.json`) of one contained workload: a pure
//! function of what the lease asks for and what the node gives it, so the
//! containment it promises can be read and tested without running anything.
//!
//! # What a workload gets
//! - A read-only root of its own, holding the host's system directories
//!   (`/usr`, `/bin`, `/sbin`, `/lib*`) read-only, its bundle read-only at
//!   [`BUNDLE_MOUNT`], a writable working directory at [`WORK_MOUNT`] (its
//!   `HOME`), a private `/tmp`, and an `/etc` written for it (its user, the
//!   host's resolver settings and CA certificates), and its identity
//!   directory read-only at [`IDENTITY_MOUNT`]. Nothing else of the host:
//!   not the agent's data directory, not other leases' files.
//! - Running a container image instead, its root is the image's own root
//!   filesystem, through an overlay private to the lease (so what it writes
//!   never reaches the shared unpacked image nor another lease), with the
//!   image's working directory, the node's init bound read-only at
//!   [`INIT_MOUNT`], `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf`
//!   bound read-only over the image's, and the same private `/tmp` and
//!   working directory at [`WORK_MOUNT`]; nothing of the host's system
//!   directories.
//! - Its own PID, mount, IPC, UTS and cgroup namespaces; its tenant's network
//!   namespace when the node isolates egress, else the host's network.
//! - A user of its own (never 0, never the agent's), no capabilities in any
//!   set, and `no_new_privs`, so it cannot gain any back (a set-uid binary
//!   does nothing) nor `setns` out of its network namespace.
//! - A cgroup whose memory limit is the lease's memory (swap included), whose
//!   CPU quota is the lease's CPU, and whose process count is bounded. The
//!   provider raises the limit where the runtime needs room of its own: to
//!   at least 8 MiB (runc's init runs in the cgroup before it becomes the
//!   workload), and by gVisor's kernel's share under runsc.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use oci_spec::OciSpecError;
use oci_spec::runtime::{
    LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroupBuilder, LinuxMemoryBuilder,
    LinuxNamespace, LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder, Mount,
    MountBuilder, ProcessBuilder, RootBuilder, Spec, SpecBuilder, UserBuilder,
};

/// Where a workload sees its bundle.
pub(crate) const BUNDLE_MOUNT: &str = "/berth/bundle";

/// Where a workload sees its working directory.
pub(crate) const WORK_MOUNT: &str = "/berth/work";

/// Where a workload sees its identity directory (read-only).
pub(crate) const IDENTITY_MOUNT: &str = "/berth/identity";

/// Where a workload dials its Workload API: a link, at the top of its root,
/// to the socket in its identity directory (see `link_workload_api`).
pub(crate) const WORKLOAD_API_LINK: &str = "/berth-workload-api.sock";

/// Where an image's workload sees the node's init.
pub(crate) const INIT_MOUNT: &str = "/berth/init";

/// The CPU quota period: 100 ms, the kernel's default.
pub(crate) const CPU_PERIOD_US: u64 = 100_000;

/// The CFS quota per [`CPU_PERIOD_US`] that gives `cpu_millis` of CPU, at
/// least a millisecond per period.
pub(crate) fn cpu_quota(cpu_millis: u64) -> i64 {
    i64::try_from(cpu_millis.saturating_mul(CPU_PERIOD_US) / 1000).unwrap_or(i64::MAX).max(1000)
}

/// Where a workload's resolver configuration is.
const RESOLV_CONF: &str = "/etc/resolv.conf";

/// How large a workload's `/tmp` and `/dev/shm` may grow; what it writes
/// there counts against its memory limit too.
const TMPFS_SIZE: &str = "size=262144k";

/// What one workload's container is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContainerPlan {
    /// The program and its arguments, as the workload sees them.
    pub(crate) args: Vec<String>,
    /// `NAME=value` pairs.
    pub(crate) env: Vec<String>,
    /// The workload's user and group on the host.
    pub(crate) uid: u32,
    /// Its host directories shown read-only at the same paths.
    pub(crate) system_dirs: Vec<PathBuf>,
    /// Host paths shown read-only at the same paths inside (CA certificates).
    pub(crate) shared_files: Vec<PathBuf>,
    /// The bundle on the host, when it runs one.
    pub(crate) bundle: Option<PathBuf>,
    /// The working directory on the host.
    pub(crate) work_dir: PathBuf,
    /// Its identity directory on the host (its SVID and Workload API).
    pub(crate) identity: Option<PathBuf>,
    /// Its cache volumes' views: (on the host, inside), shown read-write.
    pub(crate) caches: Vec<(PathBuf, PathBuf)>,
    /// The tenant's network namespace; `None` shares the host's network.
    pub(crate) network: Option<PathBuf>,
    /// The tenant's `resolv.conf` (its resolver in that namespace), shown
    /// at `/etc/resolv.conf` in place of the host's or the image's.
    pub(crate) resolv_conf: Option<PathBuf>,
    /// The cgroup, relative to the hierarchy's root.
    pub(crate) cgroup: String,
    /// The memory limit in bytes; 0 is none.
    pub(crate) memory_bytes: u64,
    /// The CPU quota in thousandths of a core; 0 is none.
    pub(crate) cpu_millis: u64,
    /// How many processes it may have at once.
    pub(crate) pids: i64,
    /// The container's host name.
    pub(crate) hostname: String,
    /// Set when it runs a container image.
    pub(crate) image: Option<ImagePlan>,
}

/// What differs for a container image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImagePlan {
    /// The working directory inside the image; empty means `/`.
    pub(crate) working_dir: String,
    /// The node's init binary, bound at [`INIT_MOUNT`].
    pub(crate) init: Option<PathBuf>,
    /// Host files bound read-only over the image's: (host, inside).
    pub(crate) etc: Vec<(PathBuf, PathBuf)>,
    /// The image's `User`, when not root: what the lease's ids are given.
    pub(crate) account: Option<std::sync::Arc<berth_bundle::ImageUser>>,
}

/// The runtime spec for `plan`, with `rootfs` as the root: read-only for a
/// bundle, the lease's own overlay for an image.
pub(crate) fn runtime_spec(plan: &ContainerPlan, rootfs: &Path) -> Result<Spec, OciSpecError> {
    let none: HashSet<_> = HashSet::new();
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(none.clone())
        .effective(none.clone())
        .inheritable(none.clone())
        .permitted(none.clone())
        .ambient(none)
        .build()?;
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(UserBuilder::default().uid(plan.uid).gid(plan.uid).additional_gids(Vec::<u32>::new()).build()?)
        .args(plan.args.clone())
        .env(plan.env.clone())
        .cwd(match &plan.image {
            Some(image) if !image.working_dir.is_empty() => image.working_dir.as_str(),
            Some(_) => "/",
            None => WORK_MOUNT,
        })
        .capabilities(capabilities)
        .no_new_privileges(true)
        .build()?;

    let mut namespaces: Vec<LinuxNamespace> = [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Cgroup,
    ]
    .into_iter()
    .map(|typ| LinuxNamespaceBuilder::default().typ(typ).build())
    .collect::<Result<_, _>>()?;
    if let Some(network) = &plan.network {
        namespaces.push(LinuxNamespaceBuilder::default().typ(LinuxNamespaceType::Network).path(network).build()?);
    }

    let mut resources = LinuxResourcesBuilder::default()
        // Every device is refused but those the runtime always allows
        // (null, zero, full, random, urandom, tty, the pty pair).
        .devices(vec![LinuxDeviceCgroupBuilder::default().allow(false).access("rwm").build()?])
        .pids(LinuxPidsBuilder::default().limit(plan.pids).build()?);
    if plan.memory_bytes > 0 {
        let limit = i64::try_from(plan.memory_bytes).unwrap_or(i64::MAX);
        resources = resources.memory(LinuxMemoryBuilder::default().limit(limit).swap(limit).build()?);
    }
    if plan.cpu_millis > 0 {
        resources =
            resources.cpu(LinuxCpuBuilder::default().quota(cpu_quota(plan.cpu_millis)).period(CPU_PERIOD_US).build()?);
    }
    let linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .resources(resources.build()?)
        .cgroups_path(PathBuf::from(&plan.cgroup))
        .masked_paths(
            [
                "/proc/acpi",
                "/proc/asound",
                "/proc/kcore",
                "/proc/keys",
                "/proc/latency_stats",
                "/proc/timer_list",
                "/proc/timer_stats",
                "/proc/sched_debug",
                "/proc/scsi",
                "/sys/firmware",
                "/sys/devices/virtual/powercap",
            ]
            .map(String::from)
            .to_vec(),
        )
        .readonly_paths(
            ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"].map(String::from).to_vec(),
        )
        .build()?;

    SpecBuilder::default()
        .version("1.0.2")
        .hostname(plan.hostname.clone())
        .root(RootBuilder::default().path(rootfs).readonly(plan.image.is_none()).build()?)
        .process(process)
        .mounts(mounts(plan)?)
        .linux(linux)
        .build()
}

/// Everything mounted into the root, in order (a mount's parent first).
fn mounts(plan: &ContainerPlan) -> Result<Vec<Mount>, OciSpecError> {
    let mount = |destination: &str, typ: &str, source: &str, options: &[&str]| {
        MountBuilder::default()
            .destination(destination)
            .typ(typ)
            .source(source)
            .options(options.iter().map(|o| o.to_string()).collect::<Vec<_>>())
            .build()
    };
    let bind = |source: &Path, destination: &Path, writable: bool| {
        let mut options = vec!["rbind", "nosuid", "nodev"];
        options.push(if writable { "rw" } else { "ro" });
        MountBuilder::default()
            .destination(destination)
            .typ("bind")
            .source(source)
            .options(options.iter().map(|o| o.to_string()).collect::<Vec<_>>())
            .build()
    };
    let mut mounts = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount("/dev", "tmpfs", "tmpfs", &["nosuid", "strictatime", "mode=755", "size=65536k"])?,
        mount("/dev/pts", "devpts", "devpts", &["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"])?,
        mount("/dev/shm", "tmpfs", "shm", &["nosuid", "noexec", "nodev", "mode=1777", TMPFS_SIZE])?,
        mount("/dev/mqueue", "mqueue", "mqueue", &["nosuid", "noexec", "nodev"])?,
        mount("/tmp", "tmpfs", "tmpfs", &["nosuid", "nodev", "mode=1777", TMPFS_SIZE])?,
    ];
    if plan.network.is_some() {
        // sysfs shows the network namespace it is mounted from: only a
        // workload with a namespace of its own gets one.
        mounts.push(mount("/sys", "sysfs", "sysfs", &["nosuid", "noexec", "nodev", "ro"])?);
    }
    for dir in &plan.system_dirs {
        mounts.push(bind(dir, dir, false)?);
    }
    let resolv = Path::new(RESOLV_CONF);
    let replaced = |inside: &Path| plan.resolv_conf.is_some() && inside == resolv;
    for file in plan.shared_files.iter().filter(|file| !replaced(file)) {
        mounts.push(bind(file, file, false)?);
    }
    if let Some(bundle) = &plan.bundle {
        mounts.push(bind(bundle, Path::new(BUNDLE_MOUNT), false)?);
    }
    if let Some(image) = &plan.image {
        if let Some(init) = &image.init {
            mounts.push(bind(init, Path::new(INIT_MOUNT), false)?);
        }
        for (host, inside) in image.etc.iter().filter(|(_, inside)| !replaced(inside)) {
            mounts.push(bind(host, inside, false)?);
        }
    }
    if let Some(tenant) = &plan.resolv_conf {
        mounts.push(bind(tenant, resolv, false)?);
    }
    if let Some(identity) = &plan.identity {
        mounts.push(bind(identity, Path::new(IDENTITY_MOUNT), false)?);
    }
    mounts.push(bind(&plan.work_dir, Path::new(WORK_MOUNT), true)?);
    for (host, inside) in &plan.caches {
        mounts.push(bind(host, inside, true)?);
    }
    Ok(mounts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> ContainerPlan {
        ContainerPlan {
            args: vec!["/berth/bundle/bin/app".into(), "--serve".into()],
            env: vec!["PORT=8080".into()],
            uid: 200_007,
            system_dirs: vec!["/usr".into()],
            shared_files: vec!["/etc/ssl/certs".into(), "/etc/resolv.conf".into()],
            bundle: Some("/var/lib/berth/bundles/abc".into()),
            work_dir: "/var/lib/berth/leases/l-1".into(),
            identity: Some("/var/lib/berth/svids/l-1".into()),
            caches: Vec::new(),
            network: Some("/run/netns/berth-x".into()),
            resolv_conf: Some("/var/lib/berth/egress/resolv/acme.conf".into()),
            cgroup: "/berth-1234/l-1".into(),
            memory_bytes: 64 << 20,
            cpu_millis: 250,
            pids: 128,
            hostname: "l-1".into(),
            image: None,
        }
    }

    #[test]
    fn the_spec_holds_the_workload_to_its_lease_and_gives_it_no_privilege() {
        let spec = runtime_spec(&plan(), Path::new("/var/lib/berth/containers/l-1/rootfs")).unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        let process = &json["process"];
        assert_eq!(process["user"]["uid"], 200_007);
        assert_eq!(process["user"]["gid"], 200_007);
        assert_eq!(process["noNewPrivileges"], true);
        for set in ["bounding", "effective", "inheritable", "permitted", "ambient"] {
            assert_eq!(process["capabilities"][set], serde_json::json!([]), "{set}");
        }
        assert_eq!(json["root"]["readonly"], true);
        let resources = &json["linux"]["resources"];
        assert_eq!(resources["memory"]["limit"], 64 << 20);
        assert_eq!(resources["memory"]["swap"], 64 << 20, "no swap past the limit");
        assert_eq!(resources["cpu"]["quota"], 25_000);
        assert_eq!(resources["cpu"]["period"], 100_000);
        assert_eq!(resources["pids"]["limit"], 128);
        assert_eq!(resources["devices"][0]["allow"], false);
        let namespaces: Vec<&str> =
            json["linux"]["namespaces"].as_array().unwrap().iter().map(|n| n["type"].as_str().unwrap()).collect();
        for kind in ["pid", "mount", "ipc", "uts", "cgroup", "network"] {
            assert!(namespaces.contains(&kind), "{kind} in {namespaces:?}");
        }
        let network = json["linux"]["namespaces"].as_array().unwrap().iter().find(|n| n["type"] == "network");
        assert_eq!(network.unwrap()["path"], "/run/netns/berth-x");
    }

    #[test]
    fn only_the_bundle_the_system_directories_identity_and_work_are_shown_and_only_work_is_writable() {
        let binds = |plan: &ContainerPlan| -> Vec<(String, String, bool)> {
            let spec = runtime_spec(plan, Path::new("/rootfs")).unwrap();
            let json = serde_json::to_value(&spec).unwrap();
            json["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["type"] == "bind")
                .map(|m| {
                    let options: Vec<&str> =
                        m["options"].as_array().unwrap().iter().map(|o| o.as_str().unwrap()).collect();
                    (
                        m["source"].as_str().unwrap().into(),
                        m["destination"].as_str().unwrap().into(),
                        options.contains(&"rw"),
                    )
                })
                .collect()
        };
        assert_eq!(
            binds(&plan()),
            [
                ("/usr".into(), "/usr".into(), false),
                ("/etc/ssl/certs".into(), "/etc/ssl/certs".into(), false),
                ("/var/lib/berth/bundles/abc".into(), BUNDLE_MOUNT.into(), false),
                ("/var/lib/berth/egress/resolv/acme.conf".into(), RESOLV_CONF.into(), false),
                ("/var/lib/berth/svids/l-1".into(), IDENTITY_MOUNT.into(), false),
                ("/var/lib/berth/leases/l-1".into(), WORK_MOUNT.into(), true),
            ],
            "the tenant's resolv.conf in place of the host's"
        );
        let shared = ContainerPlan { network: None, resolv_conf: None, ..plan() };
        assert!(
            binds(&shared).contains(&(RESOLV_CONF.into(), RESOLV_CONF.into(), false)),
            "the host's without a namespace"
        );
    }

    #[test]
    fn a_lease_without_resources_gets_no_memory_or_cpu_limit_but_still_a_process_bound() {
        let unbounded = ContainerPlan { memory_bytes: 0, cpu_millis: 0, network: None, ..plan() };
        let json = serde_json::to_value(runtime_spec(&unbounded, Path::new("/rootfs")).unwrap()).unwrap();
        let resources = &json["linux"]["resources"];
        assert!(resources.get("memory").is_none() && resources.get("cpu").is_none(), "{resources}");
        assert_eq!(resources["pids"]["limit"], 128);
        let namespaces = json["linux"]["namespaces"].as_array().unwrap();
        assert!(namespaces.iter().all(|n| n["type"] != "network"), "the host's network without an attachment");
    }
}
