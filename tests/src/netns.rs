//! Network namespaces for nodes, so one node can be cut off from the
//! control plane the way a real partition cuts a host off: its agent and
//! workloads keep running, and every packet between them and the rest of
//! the mesh is dropped.
//!
//! # Layout
//! A [`NodeNetwork`] is a Linux bridge on the host with address
//! `10.a.b.1/24`; each [`NodeNamespace`] is a namespace whose end of a veth
//! pair has `10.a.b.(10 + i)/24` and whose host end is a port of the
//! bridge. Processes in the namespace reach the host (the fronts) at the
//! bridge address; the host reaches them at theirs. Cutting a node sets
//! its host end down; healing sets it up again. TCP connections are not
//! reset by either: they stall and resume, or time out, as they would.
//!
//! # Who may use this
//! Root only (`ip netns`, `ip link`). [`NodeNetwork::available`] says
//! whether it works here; without it a partition is played by SIGSTOP.
//!
//! # Cleaning up
//! Dropping a namespace deletes it (and its veth pair), dropping the
//! network deletes the bridge. Processes still inside a namespace keep it
//! alive until they exit, so stop them first.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

/// The first host address of the nodes: node `i` is `10.a.b.(FIRST + i)`.
const FIRST_NODE_HOST: u8 = 10;

/// Where `ip netns` keeps named namespaces.
const NETNS_DIR: &str = "/run/netns";

/// Where agents record which data directory owns which of their
/// namespaces (`<node>.owner`, holding the data directory's path).
const AGENT_OWNER_DIR: &str = "/run/berth-agent";

/// Runs `ip ARGS`, failing with its stderr.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let output = Command::new("ip").args(args).output().with_context(|| format!("cannot run ip {}", args.join(" ")))?;
    if !output.status.success() {
        bail!("ip {} failed: {}", args.join(" "), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(())
}

/// A bridge the node namespaces hang off.
#[derive(Debug)]
pub struct NodeNetwork {
    bridge: String,
    prefix: [u8; 2],
    tag: String,
}

impl NodeNetwork {
    /// Whether namespaces can be made here: running as root with `ip`.
    pub fn available() -> bool {
        rustix::process::geteuid().is_root()
            && Command::new("ip").args(["netns", "list"]).output().is_ok_and(|o| o.status.success())
    }

    /// Makes a bridge on an unused `10.a.b.0/24`.
    pub fn create() -> anyhow::Result<Self> {
        let tag = format!("{:06x}", rand::random::<u32>() & 0xff_ffff);
        let in_use = Command::new("ip").args(["-o", "-4", "addr", "show"]).output().context("cannot run ip addr")?;
        let in_use = String::from_utf8_lossy(&in_use.stdout).to_string();
        let prefix = (0..64)
            .map(|_| [rand::random_range(200..=250u8), rand::random::<u8>()])
            .find(|[a, b]| !in_use.contains(&format!(" 10.{a}.{b}.")))
            .context("no free 10.x.y.0/24 for the node network")?;
        let network = Self { bridge: format!("bte{tag}"), prefix, tag };
        ip(&["link", "add", &network.bridge, "type", "bridge"])?;
        // A fixed address: otherwise the bridge takes the lowest of its
        // ports' and changes it as ports join, under namespaces that have
        // already learnt the old one.
        let tag = &network.tag;
        let mac = format!("02:be:{}:{}:{}:01", &tag[0..2], &tag[2..4], &tag[4..6]);
        ip(&["link", "set", "dev", &network.bridge, "address", &mac])?;
        ip(&["addr", "add", &format!("{}/24", network.host_ip()), "dev", &network.bridge])?;
        ip(&["link", "set", &network.bridge, "up"])?;
        Ok(network)
    }

    /// The random tag in the names of its bridge (`bte<tag>`), veths and
    /// namespaces (`e2enode-<tag>-<i>`).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The host's address on the bridge: where namespaced processes reach it.
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.prefix[0], self.prefix[1], 1)
    }

    /// Makes namespace `index` (0 to 200) on the bridge.
    pub fn add_namespace(&self, index: u8) -> anyhow::Result<NodeNamespace> {
        if index > 200 {
            bail!("node namespace index {index} is over 200");
        }
        // Not `berth-...`: agents sweep unused namespaces of that prefix as theirs.
        let name = format!("e2enode-{}-{index}", self.tag);
        let host_end = format!("bth{}h{index}", self.tag);
        let node_end = format!("bth{}n{index}", self.tag);
        let ip_addr = Ipv4Addr::new(10, self.prefix[0], self.prefix[1], FIRST_NODE_HOST + index);
        ip(&["netns", "add", &name])?;
        let namespace = NodeNamespace { name, host_end, ip: ip_addr };
        ip(&["link", "add", &namespace.host_end, "type", "veth", "peer", "name", &node_end])?;
        ip(&["link", "set", &node_end, "netns", &namespace.name])?;
        ip(&["link", "set", &namespace.host_end, "master", &self.bridge])?;
        ip(&["link", "set", &namespace.host_end, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", namespace.name.as_str(), "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        inside(&["addr", "add", &format!("{ip_addr}/24"), "dev", &node_end])?;
        inside(&["link", "set", &node_end, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        Ok(namespace)
    }
}

impl Drop for NodeNetwork {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// One node's network namespace.
#[derive(Debug)]
pub struct NodeNamespace {
    name: String,
    host_end: String,
    ip: Ipv4Addr,
}

impl NodeNamespace {
    /// The namespace's name, for `ip netns exec`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node's address.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// Cuts the node off: every packet to or from it is dropped.
    pub fn cut(&self) -> anyhow::Result<()> {
        ip(&["link", "set", &self.host_end, "down"])
    }

    /// Reconnects the node.
    pub fn heal(&self) -> anyhow::Result<()> {
        ip(&["link", "set", &self.host_end, "up"])
    }
}

impl Drop for NodeNamespace {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host_end]);
    }
}

/// Removes what a [`NodeNetwork`] tagged `tag` made, if its owner could not:
/// the node namespaces, the veth pairs and the bridge.
pub fn remove_node_network(tag: &str) {
    let prefix = format!("e2enode-{tag}-");
    let namespaces = std::fs::read_dir(NETNS_DIR).into_iter().flatten().filter_map(Result::ok);
    for namespace in namespaces {
        if let Some(name) = namespace.file_name().to_str().filter(|n| n.starts_with(&prefix)) {
            let _ = ip(&["netns", "del", name]);
        }
    }
    let links = Command::new("ip").args(["-o", "link", "show"]).output().map(|o| o.stdout).unwrap_or_default();
    let veth_prefix = format!("bth{tag}");
    for line in String::from_utf8_lossy(&links).lines() {
        // "47: bthXXXXXXh0@if46: <...> ..."
        let name = line.split(':').nth(1).map(str::trim).and_then(|n| n.split('@').next()).unwrap_or_default();
        if name.starts_with(&veth_prefix) {
            let _ = ip(&["link", "del", name]);
        }
    }
    let _ = ip(&["link", "del", &format!("bte{tag}")]);
}

/// Removes the namespaces agents whose data directories lie under `root`
/// made for their tenants' replicas (`/run/netns/berth-<node>-...`, owned as
/// `/run/berth-agent/<node>.owner` says), and those owner records. An agent
/// removes them itself only at its next start, which a test's agents never
/// have; call this once their workloads are gone.
pub fn remove_agent_namespaces(root: &Path) -> usize {
    let owners = std::fs::read_dir(AGENT_OWNER_DIR).into_iter().flatten().filter_map(Result::ok);
    let mut removed = 0;
    for owner in owners {
        let path = owner.path();
        let Some(node) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".owner")) else {
            continue;
        };
        let Ok(data_dir) = std::fs::read_to_string(&path) else { continue };
        if !Path::new(data_dir.trim()).starts_with(root) {
            continue;
        }
        let prefix = format!("berth-{node}-");
        let namespaces = std::fs::read_dir(NETNS_DIR).into_iter().flatten().filter_map(Result::ok);
        for namespace in namespaces {
            if let Some(name) = namespace.file_name().to_str().filter(|n| n.starts_with(&prefix))
                && ip(&["netns", "del", name]).is_ok()
            {
                removed += 1;
            }
        }
        let _ = std::fs::remove_file(&path);
    }
    removed
}
