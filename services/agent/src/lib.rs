//! The node agent: one per host. It joins the host to the control plane,
//! keeps the node's identity in its data directory, heartbeats to identity
//! (renewing its certificate and taking in CA rotations as it goes), rejoins
//! when its session is fenced, and serves `berth.agent.v1.Agent` on the node
//! certificate.
//!
//! # Expected flow
//! [`start`] joins with a token, or resumes the identity kept in the data
//! directory, binds the agent API and spawns the heartbeater; the returned
//! [`AgentHandle`] reports [`AgentStatus`] and every [`Fence`] (a session that
//! ended, whose work must stop). `berth-agent` is a thin binary over this, and
//! `berth dev` runs the same thing in process.
//!
//! # Invariants
//! - The node's key never leaves the host; only CSRs are sent.
//! - An identity is written to disk whole or not at all, and credentials are
//!   swapped in memory only after the new ones are checked and written.
//! - A failing control plane is retried with jittered exponential backoff,
//!   never in a tight loop.

mod agent;
mod api;
mod backoff;
mod config;
mod heartbeat;
mod host;
mod identity_dir;
mod join;
mod status;

pub use agent::{AgentError, AgentHandle, start};
pub use config::{
    AgentConfig, AgentTiming, DEFAULT_MAX_HEARTBEAT_INTERVAL, DEFAULT_MIN_HEARTBEAT_INTERVAL, DEFAULT_RETRY_INITIAL,
    DEFAULT_RETRY_MAX, DEFAULT_RPC_TIMEOUT,
};
pub use host::{Capacity, HostError, detect_cpu_millis, detect_memory_bytes};
pub use identity_dir::IdentityDirError;
pub use join::JoinError;
pub use status::{AgentStatus, Fence, FenceReason, NodeSession};

/// The port the agent API listens on by default.
pub const DEFAULT_PORT: u16 = 7447;
