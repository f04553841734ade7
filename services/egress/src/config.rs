//! How fast the egress full pass coalesces, resyncs and follows its sources,
//! named once so production runs in seconds and tests in milliseconds.
//!
//! # Invariants
//! - `debounce <= max_delay`: a quiet tenant is compiled `debounce` after its
//!   last event; a tenant whose events never stop is still compiled at least
//!   every `max_delay`. A burst of N events thus costs about
//!   `burst length / max_delay + 1` passes, not N.

use std::time::Duration;

use berth_store::ElectionTiming;

/// How long a tenant must be quiet before its pending pass runs.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(200);

/// The longest a pending pass waits, however busy its tenant.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(2);

/// How often every tenant gets a pass whether or not anything was heard.
pub const DEFAULT_FULL_RESYNC: Duration = Duration::from_secs(60);

/// How often lease placement is read from leases (it offers requesters no watch).
pub const DEFAULT_PLACEMENT_POLL: Duration = Duration::from_secs(2);

/// The timings of the egress service. [`EgressConfig::default`] suits
/// production; tests shorten every duration.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// How long a tenant must be quiet before its pending pass runs.
    pub debounce: Duration,
    /// The longest a pending pass waits after its first event, however busy
    /// the tenant stays.
    pub max_delay: Duration,
    /// How often every tenant (and every node's hosting) is passed again,
    /// healing a missed event.
    pub full_resync: Duration,
    /// How often open leases are listed to learn which tenants each node hosts.
    pub placement_poll: Duration,
    /// How often a `WatchEgress` stream re-reads its node's generation,
    /// healing a change notification the bus lost.
    pub watch_resync: Duration,
    /// The first wait before following a source (revisions, leases) again
    /// after it failed; doubles up to `source_backoff_max`.
    pub source_backoff_min: Duration,
    /// The longest wait between attempts to follow a source.
    pub source_backoff_max: Duration,
    /// How long a new leader waits for its sources to describe the world
    /// before it compiles with what it has (logging that it does).
    pub sync_timeout: Duration,
    /// Lease of the full pass's leadership.
    pub election: ElectionTiming,
}

impl Default for EgressConfig {
    fn default() -> Self {
        Self {
            debounce: DEFAULT_DEBOUNCE,
            max_delay: DEFAULT_MAX_DELAY,
            full_resync: DEFAULT_FULL_RESYNC,
            placement_poll: DEFAULT_PLACEMENT_POLL,
            watch_resync: Duration::from_secs(30),
            source_backoff_min: Duration::from_millis(200),
            source_backoff_max: Duration::from_secs(10),
            sync_timeout: Duration::from_secs(30),
            election: ElectionTiming::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_keep_the_documented_order() {
        let config = EgressConfig::default();
        assert!(config.debounce <= config.max_delay);
        assert!(config.max_delay < config.full_resync);
        assert!(config.source_backoff_min <= config.source_backoff_max);
    }
}
