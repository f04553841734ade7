//! How fast the deploy reconciler, tag resolution and revision GC run, and
//! what they keep, named once so production runs in seconds and tests in
//! milliseconds.
//!
//! # Invariants
//! - `rollout_poll` is well under `progress_deadline`: a rollout is looked at
//!   many times before it can be declared failed.
//! - `resolve_backoff_min <= resolve_backoff_max`: a failing tag is retried
//!   ever more slowly, never more slowly than the maximum.
//! - `resolve_timeout < reconcile_timeout`: a slow registry fails the
//!   resolution, not the whole reconcile.
//! - A service whose reconcile fails is tried again at least every
//!   `steady_resync`, like a settled one: a transient fault clears from its
//!   status within that, however many tries failed before.

use std::time::Duration;

use berth_store::ElectionTiming;

/// How long a new revision's replicas have to all run before it is failed.
pub const DEFAULT_PROGRESS_DEADLINE: Duration = Duration::from_secs(300);

/// How many non-live revisions of a service GC keeps.
pub const DEFAULT_GC_KEEP: usize = 5;

/// How old a revision must be before GC may delete it.
pub const DEFAULT_GC_MIN_AGE: Duration = Duration::from_secs(3600);

/// CPU a replica reserves when its template names none, in thousandths of a core.
pub const DEFAULT_CPU_MILLIS: u64 = 100;

/// Memory a replica reserves when its template names none.
pub const DEFAULT_MEMORY_BYTES: u64 = 128 << 20;

/// How long a node may use the registry credentials handed to it for a pull.
pub const DEFAULT_PULL_CREDENTIALS_TTL: Duration = Duration::from_secs(300);

/// The timings and limits of the revisions service. [`RevisionsConfig::default`]
/// suits production; tests shorten every duration.
#[derive(Debug, Clone)]
pub struct RevisionsConfig {
    /// How long a new revision's replicas have to all run before it is
    /// marked failed and the previous live revision keeps serving.
    pub progress_deadline: Duration,
    /// How soon a service with a rollout, a resolution or a lease request in
    /// flight is looked at again. Lease changes wake a service at once
    /// through `WatchLeases`; this polling covers a watch that is broken.
    pub rollout_poll: Duration,
    /// How soon a settled service is looked at again, to replace replicas
    /// that ended.
    pub steady_resync: Duration,
    /// How often every service is queued, healing a missed wake-up.
    pub full_resync: Duration,
    /// The longest one reconcile may take: past it, it is stopped and the
    /// service is tried again, so a call that hangs (a connection cut
    /// without a reset) never holds a service's status still. Every step
    /// of a reconcile is safe to stop and redo.
    pub reconcile_timeout: Duration,
    /// The first retry delay of a tag that failed to resolve; doubles per failure.
    pub resolve_backoff_min: Duration,
    /// The longest delay between resolution attempts.
    pub resolve_backoff_max: Duration,
    /// How long one resolution may take, inside `ApplyService` or the reconciler.
    pub resolve_timeout: Duration,
    /// How many non-live revisions of a service GC keeps (newest first).
    pub gc_keep: usize,
    /// How old a revision must be before GC may delete it.
    pub gc_min_age: Duration,
    /// How many services are reconciled at once (never one service twice).
    pub workers: usize,
    /// How often a `WatchServices` stream re-reads everything, healing a
    /// change notification the bus lost.
    pub watch_resync: Duration,
    /// Lease of the reconciler's leadership.
    pub election: ElectionTiming,
    /// How long a node may use registry credentials handed to it by
    /// `GetPullCredentials`: the `expires_at` it is told.
    pub pull_credentials_ttl: Duration,
    /// The longest a revision that stopped taking traffic (a rollout moved
    /// on, a split dropped it) keeps its replicas waiting for every live
    /// router to acknowledge routes without it, requests they already sent
    /// finished: what a router that never answers holds a rollout back by.
    pub drain: Duration,
}

/// The longest a revision that stopped taking traffic waits for routers
/// before its replicas stop, by default: as long as a router lets requests
/// under way finish when it stops.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(30);

impl Default for RevisionsConfig {
    fn default() -> Self {
        Self {
            progress_deadline: DEFAULT_PROGRESS_DEADLINE,
            rollout_poll: Duration::from_secs(1),
            steady_resync: Duration::from_secs(10),
            full_resync: Duration::from_secs(60),
            reconcile_timeout: Duration::from_secs(20),
            resolve_backoff_min: Duration::from_secs(1),
            resolve_backoff_max: Duration::from_secs(60),
            resolve_timeout: Duration::from_secs(10),
            gc_keep: DEFAULT_GC_KEEP,
            gc_min_age: DEFAULT_GC_MIN_AGE,
            workers: 4,
            watch_resync: Duration::from_secs(30),
            election: ElectionTiming::default(),
            pull_credentials_ttl: DEFAULT_PULL_CREDENTIALS_TTL,
            drain: DEFAULT_DRAIN,
        }
    }
}

impl RevisionsConfig {
    /// The wait before resolution attempt `attempts + 1`, after `attempts` failures.
    pub(crate) fn resolve_backoff(&self, attempts: u32) -> Duration {
        let factor = 1u32 << attempts.saturating_sub(1).min(16);
        self.resolve_backoff_min.saturating_mul(factor).min(self.resolve_backoff_max)
    }
}

pub(crate) use berth_core::millis;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_keep_the_documented_order() {
        let config = RevisionsConfig::default();
        assert!(config.rollout_poll * 10 < config.progress_deadline);
        assert!(config.resolve_backoff_min <= config.resolve_backoff_max);
        assert!(config.resolve_timeout < config.reconcile_timeout);
    }

    #[test]
    fn resolution_backs_off_to_the_maximum() {
        let config = RevisionsConfig::default();
        assert_eq!(config.resolve_backoff(1), Duration::from_secs(1));
        assert_eq!(config.resolve_backoff(2), Duration::from_secs(2));
        assert_eq!(config.resolve_backoff(4), Duration::from_secs(8));
        assert_eq!(config.resolve_backoff(40), Duration::from_secs(60));
    }
}
