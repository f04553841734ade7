//! How fast identity watches its nodes and how long it remembers them and
//! their join tokens, named once so production runs in seconds and tests in
//! milliseconds.
//!
//! # Invariants
//! - `down_after` spans several heartbeat intervals, so one lost beat never
//!   marks a node down.
//! - `reset_grace` is at least `down_after`: after the bus loses its deadlines
//!   every live node gets at least a full grace to be heard from again.
//! - A node's life after its last beat reads: `down_after` → `DOWN`, then
//!   `reap_after` in `DOWN` → reaped (incarnation bumped, the agent is fenced),
//!   then `forget_after` → the row is deleted. Revoked rows are never deleted.

use std::time::Duration;

use berth_store::ElectionTiming;

/// How often agents heartbeat, unless told otherwise.
pub(crate) const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);

/// Silence after which a node is marked `DOWN`: three missed beats.
pub(crate) const DEFAULT_DOWN_AFTER: Duration = Duration::from_secs(15);

/// Time in `DOWN` after which a node is reaped: long enough to ride out a
/// reboot or a short partition without its agent having to start over.
pub(crate) const DEFAULT_REAP_AFTER: Duration = Duration::from_secs(5 * 60);

/// Time after a reap when the node's row is forgotten.
pub(crate) const DEFAULT_FORGET_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

/// Extra life every live node gets when the deadline index is rebuilt after
/// the bus lost it.
pub(crate) const DEFAULT_RESET_GRACE: Duration = Duration::from_secs(20);

/// How long heartbeat bookkeeping (last beat, usage) may go unwritten to the
/// database while nothing else about the node changes.
pub(crate) const DEFAULT_PERSIST_EVERY: Duration = Duration::from_secs(60);

/// Extra silence a node whose last heartbeat said it is upgrading may keep
/// before it is marked `DOWN`: its updater stops the old agent, starts the
/// new one and may roll back, each waiting on the agent's own start.
pub(crate) const DEFAULT_UPGRADE_GRACE: Duration = Duration::from_secs(3 * 60);

/// How often the elected monitor looks for due deadlines.
pub(crate) const DEFAULT_MONITOR_EVERY: Duration = Duration::from_secs(1);

/// How often every replica re-reads the whole registry, healing missed events.
pub(crate) const DEFAULT_RESYNC_EVERY: Duration = Duration::from_secs(30);

/// Join attempts one peer address may make per [`DEFAULT_JOIN_WINDOW`].
pub(crate) const DEFAULT_JOIN_ATTEMPTS: u32 = 10;

/// The fixed window join attempts are counted in.
pub(crate) const DEFAULT_JOIN_WINDOW: Duration = Duration::from_secs(10);

/// A join token's life when its creator names none.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(3600);

/// The longest life a join token may be given.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// The most joins one token may allow.
pub const MAX_TOKEN_USES: u32 = 10_000;

/// How long a token is remembered after it expired, for `ListJoinTokens`.
pub(crate) const DEFAULT_CERTIFICATE_OVERLAP: Duration = Duration::from_secs(60);

pub(crate) const DEFAULT_TOKEN_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The timings of the node side of identity. [`NodeTiming::default`] suits
/// production; tests shorten every field.
#[derive(Debug, Clone)]
pub struct NodeTiming {
    /// How often agents are told to heartbeat.
    pub heartbeat_interval: Duration,
    /// Silence after which a node is marked `DOWN`.
    pub down_after: Duration,
    /// Time in `DOWN` after which a node is reaped (its incarnation bumped).
    pub reap_after: Duration,
    /// Time after a reap when a node's row is deleted.
    pub forget_after: Duration,
    /// Life given to every live node when the deadline index is rebuilt after a bus loss.
    pub reset_grace: Duration,
    /// Longest a replica leaves heartbeat bookkeeping unwritten.
    pub persist_every: Duration,
    /// How often the elected monitor acts on due deadlines.
    pub monitor_every: Duration,
    /// How often every replica re-reads the registry from the database.
    pub resync_every: Duration,
    /// Lease of the monitor's leadership.
    pub election: ElectionTiming,
    /// Join attempts allowed per peer address per `join_window`.
    pub join_attempts: u32,
    /// The window join attempts are counted in.
    pub join_window: Duration,
    /// How long expired join tokens are still listed.
    pub token_retention: Duration,
    /// How long a node's certificate stays good after the node presented
    /// the renewal that replaced it, so calls in flight on connections made
    /// with it finish; then every service refuses it.
    pub certificate_overlap: Duration,
    /// Extra silence allowed after a heartbeat that says the node is upgrading.
    pub upgrade_grace: Duration,
}

impl Default for NodeTiming {
    fn default() -> Self {
        Self {
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            down_after: DEFAULT_DOWN_AFTER,
            reap_after: DEFAULT_REAP_AFTER,
            forget_after: DEFAULT_FORGET_AFTER,
            reset_grace: DEFAULT_RESET_GRACE,
            persist_every: DEFAULT_PERSIST_EVERY,
            monitor_every: DEFAULT_MONITOR_EVERY,
            resync_every: DEFAULT_RESYNC_EVERY,
            election: ElectionTiming::default(),
            join_attempts: DEFAULT_JOIN_ATTEMPTS,
            join_window: DEFAULT_JOIN_WINDOW,
            token_retention: DEFAULT_TOKEN_RETENTION,
            certificate_overlap: DEFAULT_CERTIFICATE_OVERLAP,
            upgrade_grace: DEFAULT_UPGRADE_GRACE,
        }
    }
}

impl NodeTiming {
    /// The grace after a bus loss, never shorter than `down_after`.
    pub(crate) fn effective_reset_grace(&self) -> Duration {
        self.reset_grace.max(self.down_after)
    }
}

pub(crate) use berth_core::millis;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_keep_the_documented_order() {
        let t = NodeTiming::default();
        assert!(t.down_after >= t.heartbeat_interval * 3);
        assert!(t.effective_reset_grace() >= t.down_after);
        assert!(t.reap_after > t.down_after);
        assert!(t.forget_after > t.reap_after);
    }

    #[test]
    fn a_short_reset_grace_is_raised_to_the_down_grace() {
        let t = NodeTiming { reset_grace: Duration::from_millis(1), ..NodeTiming::default() };
        assert_eq!(t.effective_reset_grace(), t.down_after);
    }
}
