//! Network namespaces that hold a tenant's replicas in, where the agent runs
//! as root on Linux: a namespace with nothing but a loopback interface, in
//! which the agent itself opens the tenant's proxy listeners.
//!
//! # Why no veth pair
//! A veth pair into the host would give the namespace a route to the host's
//! own address on it, and every host service bound to `0.0.0.0` (the agent
//! API, a database, another tenant's advisory proxy) would answer there
//! unless a packet filter dropped it; nftables and iptables are not on every
//! host. A namespace with only `lo` has no route anywhere, by construction.
//! The way out is the proxy: a socket belongs to the namespace of the thread
//! that created it, so a short-lived thread enters the tenant's namespace,
//! opens the listening socket on `127.0.0.1` there, and ends; the agent
//! serves that socket from its own namespace, where the proxy's outbound
//! connections are made. Only a thread that ends ever enters a namespace,
//! never one of the runtime's, so nothing else the agent does lands in it.
//!
//! # Inbound
//! A workload still listens on the port the node gave it, now inside the
//! namespace; the agent forwards that port from the host into the namespace
//! (see [`Namespaces::connect`]) for as long as the replica runs. The
//! forwarding lives in the agent: while the agent is down, a replica keeps
//! running but is not reachable from outside, until the restarted agent
//! adopts it.
//!
//! # Names and what is stored
//! ```text
//! /run/netns/berth-<node>-<tenant>-<hash>   the namespace (`ip netns`)
//! /run/berth-agent/<node>.owner             the data directory of the agent
//!                                           whose namespaces those are
//! ```
//! `<node>` is a hash of the agent's data directory, so two agents on one
//! host never share or remove each other's namespaces; `<tenant>` is the
//! project, cut to fit, and `<hash>` a hash of the whole project name.
//!
//! # Clean-up
//! A namespace is removed when the agent no longer needs it and no process
//! is in it: when its tenant leaves the node, and at start for every
//! namespace of this agent that no process uses. At start the agent also
//! removes unused namespaces whose owning data directory is gone (an agent
//! deleted while its namespaces were still mounted), and the owner records
//! of such agents. A namespace a process still uses is never removed: a
//! workload outlives the agent.

use std::collections::BTreeSet;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use crate::files::FileError;

/// Where `ip netns` keeps named namespaces.
const NETNS_DIR: &str = "/run/netns";

/// Where agents record which data directory owns which namespaces.
const OWNER_DIR: &str = "/run/berth-agent";

/// Where `ip` is looked for.
const IP_CANDIDATES: [&str; 4] = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"];

/// Every namespace an agent creates starts with this.
const NAME_PREFIX: &str = "berth-";

/// How much of the project name goes into a namespace name.
const TENANT_LABEL_LEN: usize = 16;

/// The first port tried for a service's proxy listener inside a namespace
/// (the port proxies have long used): below the node's port range, which
/// the ports the node gives workloads come from (see `crate::node_ports`).
const FIRST_PROXY_PORT: u16 = 3128;

/// How many ports above [`FIRST_PROXY_PORT`] are tried.
const PROXY_PORT_TRIES: u16 = 1024;

/// How long connecting to a workload inside its namespace may take; it is
/// on loopback, so it answers at once or not at all.
const INBOUND_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a namespace could not be set up or used.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    /// This host cannot isolate replicas; the message says why.
    #[error("{0}")]
    Unavailable(String),
    /// An `ip` command failed.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// What it said.
        detail: String,
    },
    /// A file could not be read or written.
    #[error(transparent)]
    Io(#[from] crate::files::FileError),
}

/// The namespaces of one agent.
#[derive(Debug, Clone)]
pub(crate) struct Namespaces {
    ip: PathBuf,
    /// The hash of the data directory, in every name.
    node: String,
    data_dir: PathBuf,
    netns_dir: PathBuf,
    owner_dir: PathBuf,
}

impl Namespaces {
    /// Checks that this host can isolate replicas (Linux, root, `ip`, and a
    /// namespace can really be made), and records this agent as the owner
    /// of its namespaces.
    pub(crate) async fn probe(data_dir: &Path) -> Result<Self, NamespaceError> {
        if !cfg!(target_os = "linux") {
            return Err(NamespaceError::Unavailable("network namespaces need Linux".into()));
        }
        if !rustix::process::geteuid().is_root() {
            return Err(NamespaceError::Unavailable("the agent does not run as root".into()));
        }
        let Some(ip) = IP_CANDIDATES.iter().map(PathBuf::from).find(|path| path.is_file()) else {
            return Err(NamespaceError::Unavailable(format!("no `ip` tool at any of {}", IP_CANDIDATES.join(", "))));
        };
        let namespaces = Self {
            ip,
            node: format!("{:08x}", fnv32(data_dir.as_os_str().as_encoded_bytes())),
            data_dir: data_dir.to_path_buf(),
            netns_dir: PathBuf::from(NETNS_DIR),
            owner_dir: PathBuf::from(OWNER_DIR),
        };
        namespaces.record_owner()?;
        let probe = format!("{NAME_PREFIX}{}-probe", namespaces.node);
        let made = namespaces.ensure(&probe).await;
        let _ = namespaces.run(&["netns", "delete", &probe]).await;
        made.map_err(|error| NamespaceError::Unavailable(format!("cannot create a network namespace: {error}")))?;
        Ok(namespaces)
    }

    fn record_owner(&self) -> Result<(), NamespaceError> {
        let io = |action, path: &Path, source| NamespaceError::Io(FileError::new(action, path, source));
        std::fs::create_dir_all(&self.owner_dir).map_err(|e| io("create", &self.owner_dir, e))?;
        let owner = self.owner_dir.join(format!("{}.owner", self.node));
        std::fs::write(&owner, self.data_dir.as_os_str().as_encoded_bytes()).map_err(|e| io("write", &owner, e))
    }

    /// The name of a tenant's namespace.
    pub(crate) fn name(&self, tenant: &str) -> String {
        let label: String = tenant
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
            .take(TENANT_LABEL_LEN)
            .collect();
        format!("{NAME_PREFIX}{}-{label}-{:08x}", self.node, fnv32(tenant.as_bytes()))
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.netns_dir.join(name)
    }

    /// The command line prefix that runs a program inside the namespace.
    /// `ip netns exec` enters the namespace and executes the program in its
    /// own place: the workload keeps the process id the provider records.
    pub(crate) fn exec_prefix(&self, name: &str) -> Vec<String> {
        vec![self.ip.display().to_string(), "netns".into(), "exec".into(), name.to_string()]
    }

    /// Creates the namespace (or takes the one left from before a restart)
    /// and brings its loopback up.
    pub(crate) async fn ensure(&self, name: &str) -> Result<(), NamespaceError> {
        if !self.path(name).exists() {
            self.run(&["netns", "add", name]).await?;
        }
        self.run(&["-n", name, "link", "set", "lo", "up"]).await
    }

    /// Removes the namespace unless a process is in it; whether it is gone.
    pub(crate) async fn remove_if_unused(&self, name: &str) -> Result<bool, NamespaceError> {
        let path = self.path(name);
        let used = tokio::task::spawn_blocking(move || in_use(&path))
            .await
            .map_err(|e| NamespaceError::Unavailable(format!("the process scan failed: {e}")))?;
        match used {
            Ok(true) => Ok(false),
            Ok(false) => self.run(&["netns", "delete", name]).await.map(|()| true),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(true),
            Err(source) => Err(NamespaceError::Io(FileError::new("look at", &self.path(name), source))),
        }
    }

    /// Removes every unused namespace of this agent, and every unused one
    /// of an agent whose data directory is gone; returns what it removed.
    pub(crate) async fn sweep(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.netns_dir) else { return Vec::new() };
        let names: Vec<String> = entries
            .filter_map(Result::ok)
            .filter_map(|entry| entry.file_name().to_str().map(str::to_string))
            .filter(|name| name.starts_with(NAME_PREFIX))
            .collect();
        let mut removed = Vec::new();
        for name in names {
            let Some(node) = name[NAME_PREFIX.len()..].split('-').next() else { continue };
            if node != self.node && self.owner_alive(node) {
                continue;
            }
            match self.remove_if_unused(&name).await {
                Ok(true) => removed.push(name),
                Ok(false) => {}
                Err(error) => tracing::warn!(namespace = %name, %error, "cannot remove a stale network namespace"),
            }
        }
        // A missing owner counts as gone, so the records of gone owners can go.
        let owners = std::fs::read_dir(&self.owner_dir).into_iter().flatten().filter_map(Result::ok);
        for owner in owners {
            let name = owner.file_name();
            let node = name.to_str().and_then(|n| n.strip_suffix(".owner"));
            if node.is_some_and(|node| node != self.node && !self.owner_alive(node)) {
                let _ = std::fs::remove_file(owner.path());
            }
        }
        removed
    }

    /// Forgets this agent as an owner once it has no namespace left (at
    /// shutdown); a later start records it again.
    pub(crate) fn release_owner(&self) {
        let prefix = format!("{NAME_PREFIX}{}-", self.node);
        let entries = std::fs::read_dir(&self.netns_dir).into_iter().flatten().filter_map(Result::ok);
        let left = entries.filter(|e| e.file_name().to_str().is_some_and(|name| name.starts_with(&prefix))).count();
        if left == 0 {
            let _ = std::fs::remove_file(self.owner_dir.join(format!("{}.owner", self.node)));
        }
    }

    /// Whether the agent named `node` still has its data directory.
    fn owner_alive(&self, node: &str) -> bool {
        std::fs::read(self.owner_dir.join(format!("{node}.owner")))
            .ok()
            .map(|dir| PathBuf::from(String::from_utf8_lossy(&dir).into_owned()))
            .is_some_and(|dir| dir.exists())
    }

    /// Opens a listener on `127.0.0.1` inside the namespace: on `port`, or
    /// with none on the first free port from [`FIRST_PROXY_PORT`] up that is
    /// not in `avoid`.
    pub(crate) async fn listen(&self, name: &str, port: Option<u16>, avoid: &BTreeSet<u16>) -> io::Result<TcpListener> {
        let avoid = avoid.clone();
        let listener = in_namespace(self.path(name), move || match port {
            Some(port) => std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)),
            None => {
                let mut last = io::Error::new(io::ErrorKind::AddrInUse, "every proxy port is taken");
                for port in (FIRST_PROXY_PORT..).take(usize::from(PROXY_PORT_TRIES)) {
                    if avoid.contains(&port) {
                        continue;
                    }
                    match std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
                        Ok(listener) => return Ok(listener),
                        Err(error) => last = error,
                    }
                }
                Err(last)
            }
        })
        .await?;
        listener.set_nonblocking(true)?;
        TcpListener::from_std(listener)
    }

    /// Opens a listener on `addr` (a loopback address) inside the namespace.
    pub(crate) async fn listen_at(&self, name: &str, addr: SocketAddr) -> io::Result<TcpListener> {
        let listener = in_namespace(self.path(name), move || std::net::TcpListener::bind(addr)).await?;
        listener.set_nonblocking(true)?;
        TcpListener::from_std(listener)
    }

    /// Opens the tenant resolver's UDP socket and TCP listener at `addr`
    /// inside the namespace.
    pub(crate) async fn resolver_sockets(
        &self,
        name: &str,
        addr: SocketAddr,
    ) -> io::Result<(tokio::net::UdpSocket, TcpListener)> {
        let (udp, tcp) = in_namespace(self.path(name), move || {
            Ok((std::net::UdpSocket::bind(addr)?, std::net::TcpListener::bind(addr)?))
        })
        .await?;
        udp.set_nonblocking(true)?;
        tcp.set_nonblocking(true)?;
        Ok((tokio::net::UdpSocket::from_std(udp)?, TcpListener::from_std(tcp)?))
    }

    /// Connects to `127.0.0.1:port` inside the namespace.
    pub(crate) async fn connect(&self, name: &str, port: u16) -> io::Result<TcpStream> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        connect_in_namespace(self.path(name), addr, INBOUND_CONNECT_TIMEOUT).await
    }

    async fn run(&self, args: &[&str]) -> Result<(), NamespaceError> {
        let command = || format!("ip {}", args.join(" "));
        let output = tokio::process::Command::new(&self.ip)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .map_err(|e| NamespaceError::Command { command: command(), detail: e.to_string() })?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_string();
        let detail = if stderr.is_empty() { output.status.to_string() } else { stderr };
        Err(NamespaceError::Command { command: command(), detail })
    }
}

/// Whether any process is in the namespace mounted at `path`.
fn in_use(path: &Path) -> io::Result<bool> {
    let inode = std::fs::metadata(path)?.ino();
    let wanted = format!("net:[{inode}]");
    for entry in std::fs::read_dir("/proc")?.filter_map(Result::ok) {
        let is_pid = entry.file_name().to_str().is_some_and(|name| name.bytes().all(|b| b.is_ascii_digit()));
        if is_pid
            && std::fs::read_link(entry.path().join("ns/net")).is_ok_and(|link| link.as_os_str() == wanted.as_str())
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Runs `work` on a thread of its own that first enters the namespace at
/// `path`; the thread ends afterwards, and its namespace with it.
/// Connects to `addr` from inside the network namespace at `path` (a
/// namespace's bind mount, or `/proc/<pid>/ns/net`), within `timeout`; the
/// socket stays in that namespace whichever thread uses it.
pub async fn connect_in_namespace(path: PathBuf, addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let stream = in_namespace(path, move || std::net::TcpStream::connect_timeout(&addr, timeout)).await?;
    stream.set_nonblocking(true)?;
    TcpStream::from_std(stream)
}

async fn in_namespace<T: Send + 'static>(
    path: PathBuf,
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let (answer, answered) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("berth-netns".into()).spawn(move || {
        let _ = answer.send(enter(&path).and_then(|()| work()));
    })?;
    answered.await.map_err(|_| io::Error::other("the thread that entered the namespace ended without an answer"))?
}

#[cfg(target_os = "linux")]
fn enter(path: &Path) -> io::Result<()> {
    use std::os::fd::AsFd as _;
    let namespace = std::fs::File::open(path)?;
    rustix::thread::move_into_link_name_space(namespace.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))
        .map_err(io::Error::from)
}

#[cfg(not(target_os = "linux"))]
fn enter(_path: &Path) -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "network namespaces need Linux"))
}

/// FNV-1a, folded to 32 bits: stable across builds and releases, so the
/// names an agent gives survive its upgrade.
pub(crate) fn fnv32(bytes: &[u8]) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    ((hash >> 32) ^ hash) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespaces(data_dir: &str) -> Namespaces {
        Namespaces {
            ip: PathBuf::from("/usr/sbin/ip"),
            node: format!("{:08x}", fnv32(data_dir.as_bytes())),
            data_dir: PathBuf::from(data_dir),
            netns_dir: PathBuf::from(NETNS_DIR),
            owner_dir: PathBuf::from(OWNER_DIR),
        }
    }

    #[test]
    fn names_differ_per_agent_and_per_tenant_and_fit() {
        let (a, b) = (namespaces("/var/lib/berth/a"), namespaces("/var/lib/berth/b"));
        assert_ne!(a.name("acme"), b.name("acme"), "two agents on one host");
        assert_ne!(a.name("acme"), a.name("acme-2"));
        assert_eq!(a.name("acme"), a.name("acme"), "stable");
        let long = a.name(&"Very_Long.Project/Name".repeat(10));
        assert!(long.starts_with(&format!("berth-{}-very-long-projec-", a.node)), "cut to 16: {long}");
        assert!(long.len() <= 48, "{long}");
        assert_ne!(a.name("a.b"), a.name("a-b"), "the hash tells apart what the label cannot");
    }

    #[test]
    fn the_hash_is_the_published_fnv_1a() {
        // FNV-1a 64 of "" and "a", folded.
        assert_eq!(fnv32(b""), ((0xcbf2_9ce4_8422_2325u64 >> 32) ^ 0xcbf2_9ce4_8422_2325u64) as u32);
        let a = 0xaf63_dc4c_8601_ec8cu64;
        assert_eq!(fnv32(b"a"), ((a >> 32) ^ a) as u32);
    }
}
