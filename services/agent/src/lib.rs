//! The node agent: one per host. It joins the host to the control plane,
//! keeps the node's identity in its data directory, heartbeats to identity
//! (renewing its certificate and taking in CA rotations as it goes), rejoins
//! when its session is fenced, runs the leases assigned to the node through
//! a [`Provider`] (pulling their bundles by digest into a verified cache, and
//! giving each workload a port of its own), and serves `berth.agent.v1.Agent`
//! and the data plane routers reach replicas through
//! (`berth.agent.v1.DataPlane`) on the node certificate. With an egress service configured, every
//! replica reaches the network only through its tenant's egress proxy (see
//! [`EgressProxies`]), which follows the plans the egress service pushes.
//!
//! # Expected flow
//! [`start`] joins with a token, or resumes the identity kept in the data
//! directory, binds the agent API, spawns the heartbeater and, with a leases
//! service configured, the lease runner; the returned [`AgentHandle`] reports
//! [`AgentStatus`] and every [`Fence`] (a session that ended, whose work is
//! held in custody until the node rejoins). `berth-agent` is a thin binary
//! over this, and `berth dev` runs the same thing in process.
//!
//! # Invariants
//! - The node's key never leaves the host; only CSRs are sent.
//! - An identity is written to disk whole or not at all, and credentials are
//!   swapped in memory only after the new ones are checked and written.
//! - A failing control plane is retried with jittered exponential backoff,
//!   never in a tight loop.
//! - A workload outlives the agent: stopping or killing the agent never
//!   stops one, and a restarted agent adopts what its leases still cover.

mod agent;
mod api;
mod board;
mod bundles;
mod caches;
mod config;
mod container;
#[cfg(test)]
mod contract;
mod data_plane;
mod dial;
mod egress;
mod error;
#[cfg_attr(
    not(feature = "fault-injection"),
    expect(
        dead_code,
        reason = "only a fault-injection build wraps its seams; the module is built always so it is linted and tested"
    )
)]
mod faults;
mod files;
mod flags;
mod generations;
mod heartbeat;
mod host;
mod identity_dir;
mod identity_servers;
mod instances;
mod interruption;
mod join;
mod keepalive;
mod leases_client;
mod log_rotation;
mod logs;
mod microvm;
mod node_channel;
mod node_ports;
mod overlay;
mod process;
mod procfs;
mod provider;
mod recovery;
mod rpc_status;
mod runner;
mod status;
mod svids;
#[cfg(test)]
mod testdir;
pub mod updater;
mod upgrades;

pub use agent::{AgentHandle, CONTAINED_LABEL, RUNTIME_LABEL, start};
pub use caches::registry::{Fetched, Transfer};
pub use caches::{CacheError, CacheVolumes, Sealed, View};
pub use config::{
    AgentConfig, AgentTiming, Containment, DEFAULT_BUNDLE_CACHE_BUDGET, DEFAULT_CUSTODY_WARNING, DEFAULT_LOG_POLL,
    DEFAULT_MAX_HEARTBEAT_INTERVAL, DEFAULT_MIN_HEARTBEAT_INTERVAL, DEFAULT_RENEW_INTERVAL, DEFAULT_RETAIN_FINISHED,
    DEFAULT_RETRY_INITIAL, DEFAULT_RETRY_MAX, DEFAULT_RPC_TIMEOUT, DEFAULT_SWEEP_INTERVAL, LeaseTiming,
    WorkloadRuntime,
};
pub use container::{
    ContainerProvider, ContainerSettings, DEFAULT_PIDS_LIMIT, OciRuntime, UidRange, containers_left,
    favor_cgroup_migrations, runtime_main, runtime_main_if_invoked,
};
pub use egress::{
    Attachment, DEFAULT_PROXY_CONNECT_TIMEOUT, DEFAULT_PROXY_HEAD_TIMEOUT, EgressError, EgressIsolation, EgressProxies,
    EgressSettings, EgressStatus, Enforcement, NamespaceError, ProxyTiming, RulesError, connect_in_namespace,
};
pub use error::AgentError;
pub use faults::FAULTS_ENV;
pub use flags::RuntimeArgs;
pub use host::{Capacity, HostError, detect_cpu_millis, detect_memory_bytes};
pub use identity_dir::IdentityDirError;
pub use identity_servers::preferred_index;
pub use join::JoinError;
pub use microvm::{MicroVmAccel, MicroVmConfig, MicroVmProvider, MicroVmSettings, guest_memory_mib};
pub use node_ports::NodePorts;
pub use process::ProcessProvider;
pub use provider::{
    CacheBind, DEFAULT_EXIT_POLL, DEFAULT_STOP_GRACE, Exit, ExitStatus, ExitWatch, InstanceMeta, InstanceRecord,
    InstanceStats, LaunchSpec, Launched, LogFiles, NetworkAttachment, ProcessTiming, Program, Provider, ProviderError,
    ResizeAsk, Resized, Resources, Runtime, Settlement, WorkloadRoot, WorkloadSignal,
};
pub use status::{AgentStatus, Fence, FenceReason, NodeSession};
pub use upgrades::{DEFAULT_UPGRADE_DEADLINE, UpgradeSettings};

/// The port the agent API listens on by default.
pub const DEFAULT_PORT: u16 = 7447;

/// Destroys every container an agent on `data_dir` left, through the runtime
/// that runs it, and what its microVMs keep outside it (their Workload API
/// relay directories); returns how many containers there were. For tearing
/// down a data directory whose agent is gone (a test's, a bench's), where
/// no agent will adopt them.
pub fn destroy_containers(data_dir: &std::path::Path) -> usize {
    let destroyed = container::destroy_containers(data_dir);
    microvm::remove_relays(data_dir);
    destroyed
}
