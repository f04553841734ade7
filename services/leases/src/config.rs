//! How long leases live and how fast the ledger's loops run, named once so
//! production runs in seconds and tests in milliseconds.
//!
//! # Invariants
//! - Nodes renew every `lease_ttl / 3`, so one lost renewal never expires a
//!   lease.
//! - `assignment_resync` is well under `lease_ttl`: a lease placed while the
//!   bus could not fan the news out still reaches its node's stream, by the
//!   periodic re-read, with most of its first TTL left to be renewed in.
//! - `reset_grace` is at least `lease_ttl`: after the bus loses the deadline
//!   index, every open lease gets at least one full TTL to be renewed before
//!   it can be reaped, since its node may have missed its assignment while
//!   the bus was away.

use std::time::Duration;

use berth_store::ElectionTiming;

/// How long a lease lives past its placement or its last renewal.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// Most requests placed in one transaction.
pub(crate) const DEFAULT_MAX_BATCH: usize = 256;

/// How many requests may wait for the placer before callers are turned away.
pub(crate) const DEFAULT_PLACER_QUEUE: usize = 8192;

/// How often the elected reaper looks for due leases.
pub(crate) const DEFAULT_REAP_EVERY: Duration = Duration::from_secs(1);

/// How often every assignment stream re-reads its node's changes, healing
/// missed notifications, and the reaper restores missing deadlines.
pub(crate) const DEFAULT_ASSIGNMENT_RESYNC: Duration = Duration::from_secs(10);

/// How often the reaper restores the deadline index from the database and
/// forgets leases past their retention.
pub(crate) const DEFAULT_INDEX_RESYNC: Duration = Duration::from_secs(30);

/// How long a final lease is kept for `GetLease`, `ListLeases` and resuming
/// assignment streams.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The timings and limits of the ledger. [`LeasesConfig::default`] suits
/// production; tests shorten every duration.
#[derive(Debug, Clone)]
pub struct LeasesConfig {
    /// How long a lease lives past its placement or last renewal.
    pub lease_ttl: Duration,
    /// Extra life every open lease gets when the deadline index is rebuilt
    /// after the bus lost it; raised to `lease_ttl` if shorter.
    pub reset_grace: Duration,
    /// How long after expiring a lease may still be taken back into its
    /// node's custody (`AssumeCustody`).
    pub custody_window: Duration,
    /// Most requests placed in one transaction.
    pub max_batch: usize,
    /// How many requests may wait for the placer.
    pub placer_queue: usize,
    /// How often the elected reaper acts on due leases.
    pub reap_every: Duration,
    /// How often every assignment stream re-reads its node's changes.
    pub assignment_resync: Duration,
    /// How often the reaper restores the deadline index and forgets old leases.
    pub index_resync: Duration,
    /// How long final leases are kept.
    pub retention: Duration,
    /// Lease of the reaper's leadership.
    pub election: ElectionTiming,
    /// How many generations of each cache volume are kept, beside its head
    /// and the pinned ones; older ones are collected when a new one is
    /// published.
    pub cache_keep: u32,
    /// Where cache generations are pushed and pulled; `None` keeps each only
    /// on the node that sealed it.
    pub cache_registry: Option<CacheRegistryConfig>,
    /// The most bytes the generations of one project's cache volumes may
    /// hold in all: past it, the oldest that are neither a head nor pinned
    /// are collected as new ones are published. `None`: no budget.
    pub cache_project_budget: Option<u64>,
}

/// The registry cache generations are kept in: one repository per project
/// under `repository`, each volume's newest pushed generation tagged with
/// its key.
#[derive(Clone, PartialEq, Eq)]
pub struct CacheRegistryConfig {
    /// `host[:port]/path`, e.g. `registry.internal:5000/berth-caches`.
    pub repository: String,
    /// Basic credentials nodes use for it; both empty for anonymous access.
    pub username: String,
    /// The password, never printed.
    pub password: String,
}

impl std::fmt::Debug for CacheRegistryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheRegistryConfig")
            .field("repository", &self.repository)
            .field("username", &self.username)
            .field("password", &if self.password.is_empty() { "" } else { "<redacted>" })
            .finish()
    }
}

impl Default for LeasesConfig {
    fn default() -> Self {
        Self {
            lease_ttl: DEFAULT_LEASE_TTL,
            reset_grace: DEFAULT_LEASE_TTL,
            custody_window: DEFAULT_LEASE_TTL,
            max_batch: DEFAULT_MAX_BATCH,
            placer_queue: DEFAULT_PLACER_QUEUE,
            reap_every: DEFAULT_REAP_EVERY,
            assignment_resync: DEFAULT_ASSIGNMENT_RESYNC,
            index_resync: DEFAULT_INDEX_RESYNC,
            retention: DEFAULT_RETENTION,
            election: ElectionTiming::default(),
            cache_keep: DEFAULT_CACHE_KEEP,
            cache_registry: None,
            cache_project_budget: None,
        }
    }
}

/// Generations of each cache volume kept by default.
pub const DEFAULT_CACHE_KEEP: u32 = 5;

impl LeasesConfig {
    /// The defaults with a lease TTL of `ttl` (the grace and the custody
    /// window follow it).
    pub fn with_lease_ttl(ttl: Duration) -> Self {
        Self { lease_ttl: ttl, reset_grace: ttl, custody_window: ttl, ..Self::default() }
    }

    /// The grace after a bus loss, never shorter than a TTL.
    pub(crate) fn effective_reset_grace(&self) -> Duration {
        self.reset_grace.max(self.lease_ttl)
    }

    /// The TTL as nodes are told it, in milliseconds.
    pub(crate) fn ttl_ms(&self) -> u32 {
        u32::try_from(self.lease_ttl.as_millis()).unwrap_or(u32::MAX)
    }
}

pub(crate) use berth_core::millis;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_keep_the_documented_order() {
        let config = LeasesConfig::default();
        assert!(config.assignment_resync * 2 < config.lease_ttl);
        assert!(config.effective_reset_grace() >= config.lease_ttl);
        assert!(config.retention > config.custody_window);
    }

    #[test]
    fn a_short_reset_grace_is_raised_to_a_ttl() {
        let config = LeasesConfig { reset_grace: Duration::from_millis(1), ..LeasesConfig::default() };
        assert_eq!(config.effective_reset_grace(), config.lease_ttl);
    }
}
