//! What the agent tells the rest of the host about its standing with the
//! control plane: its current session, its health, and every session that
//! ended under it.
//!
//! # Expected flow
//! `Joined` (an identity, no answered heartbeat yet) → `Up` ⇄ `Retrying`;
//! a fence, a forgotten node or an expired certificate goes `Fenced` →
//! `Joining` → `Joined` → `Up` under the new session; a revocation ends in
//! `Revoked`; shutdown ends in `Stopped`.

use std::time::SystemTime;

/// The session the node holds with the control plane: who it is and the
/// incarnation its heartbeats carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSession {
    /// The node id identity chose.
    pub node_id: String,
    /// The incarnation; a rejoin increases it.
    pub incarnation: u64,
}

/// Where the agent stands with the control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentStatus {
    /// Joining or rejoining: no usable session yet.
    Joining,
    /// Holds a session; no heartbeat has been answered under it yet.
    Joined {
        /// The session.
        session: NodeSession,
    },
    /// Heartbeats are answered.
    Up {
        /// The session.
        session: NodeSession,
        /// When the last heartbeat was answered.
        last_heartbeat: SystemTime,
    },
    /// Heartbeats are failing and being retried with backoff.
    Retrying {
        /// The session.
        session: NodeSession,
        /// When the first of the failures in a row happened.
        since: SystemTime,
        /// How many heartbeats in a row have failed.
        failures: u32,
        /// What the last failure was.
        last_error: String,
    },
    /// The session ended (see [`Fence`]); the agent is about to rejoin.
    Fenced {
        /// The session that ended.
        session: NodeSession,
        /// Why.
        reason: FenceReason,
    },
    /// An operator revoked the node: heartbeats have stopped for good.
    Revoked {
        /// The revoked session.
        session: NodeSession,
    },
    /// The agent stopped: shut down, or failed (`AgentHandle::wait` says why).
    Stopped,
}

impl AgentStatus {
    /// The session, in the states that hold one.
    pub fn session(&self) -> Option<&NodeSession> {
        match self {
            AgentStatus::Joined { session }
            | AgentStatus::Up { session, .. }
            | AgentStatus::Retrying { session, .. }
            | AgentStatus::Fenced { session, .. }
            | AgentStatus::Revoked { session } => Some(session),
            AgentStatus::Joining | AgentStatus::Stopped => None,
        }
    }

    /// Whether heartbeats are being answered.
    pub fn is_up(&self) -> bool {
        matches!(self, AgentStatus::Up { .. })
    }
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceReason {
    /// Identity reaped the node while it was out of reach and fenced its
    /// stale incarnation.
    Fenced,
    /// Identity no longer knows the node.
    Forgotten,
    /// The node certificate expired before it could be renewed.
    CertificateExpired,
    /// The node certificate was superseded by a newer one of the same node
    /// (a renewal this agent never received, or a rejoin from elsewhere):
    /// every service refuses it.
    CertificateSuperseded,
    /// An operator revoked the node.
    Revoked,
    /// The session ended and identity refused every way to rejoin (no join
    /// token, or the token refused): the node can never again account for
    /// what it runs.
    RejoinRefused,
}

impl std::fmt::Display for FenceReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FenceReason::Fenced => "fenced",
            FenceReason::Forgotten => "forgotten by identity",
            FenceReason::CertificateExpired => "certificate expired",
            FenceReason::CertificateSuperseded => "certificate superseded",
            FenceReason::Revoked => "revoked",
            FenceReason::RejoinRefused => "refused a rejoin",
        })
    }
}

/// A session that ended. The lease runner watches these
/// (`AgentHandle::fences`): on each one it stops reporting and renewing and
/// holds what the node runs in custody until the agent has rejoined and the
/// leases service has said which of it is still the node's; on a revocation
/// it destroys everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The session that ended.
    pub session: NodeSession,
    /// Why.
    pub reason: FenceReason,
    /// When the agent learned of it.
    pub at: SystemTime,
}
