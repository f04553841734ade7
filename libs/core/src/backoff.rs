//! Jittered waits between retries, one implementation for every crate: the
//! agent's calls to the control plane, a service following another, a
//! transaction or placement that collided.
//!
//! # Invariants
//! - [`Backoff`]: every delay is at least half the current step, so a
//!   failing peer is never retried in a tight loop, and at most the cap.
//! - [`full_jitter`]: anywhere in `[0, step]`, for colliding writers, which
//!   spread out best when some retry at once.
//! - [`spread`]: the wait given, plus up to half again.
//! - The jitter spreads the retries of many callers that failed at the same
//!   moment, so they do not all come back at once.

use std::time::Duration;

/// The delays between consecutive failed attempts: the step doubles from
/// `initial` up to `max`, and each delay is drawn from `[step/2, step]`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        // A zero step would retry at once forever.
        let initial = initial.max(Duration::from_millis(1));
        Self { initial, max: max.max(initial), failures: 0 }
    }

    /// The longest delay handed out.
    pub fn cap(&self) -> Duration {
        self.max
    }

    /// How many failures in a row have been counted since the last reset.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Counts a failure and returns how long to wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.step();
        self.failures = self.failures.saturating_add(1);
        let half = step / 2;
        let spread = step.saturating_sub(half).as_nanos().min(u64::MAX as u128) as u64;
        half + Duration::from_nanos(if spread == 0 { 0 } else { rand::random_range(0..=spread) })
    }

    /// Forgets the failures after a success.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    fn step(&self) -> Duration {
        let doublings = self.failures.min(32);
        self.initial.checked_mul(1u32 << doublings.min(31)).map_or(self.max, |d| d.min(self.max))
    }
}

/// A random wait in `[0, min(max, base * 2^(attempt-1))]` ("full jitter")
/// before attempt `attempt + 1`: colliding writers spread out instead of
/// colliding again.
pub fn full_jitter(base: Duration, max: Duration, attempt: u32) -> Duration {
    let cap = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(16)).min(max);
    let cap_nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rand::random_range(0..=cap_nanos))
}

/// `wait` plus up to half again, so callers retrying together spread out.
pub fn spread(wait: Duration) -> Duration {
    wait + wait.mul_f64(rand::random::<f64>() * 0.5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_within_jitter_and_stop_at_the_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut steps = Vec::new();
        for _ in 0..10 {
            steps.push(backoff.next_delay());
        }
        for (i, expected) in [100u64, 200, 400, 800, 1000, 1000, 1000, 1000, 1000, 1000].into_iter().enumerate() {
            let step = Duration::from_millis(expected);
            assert!(
                steps[i] >= step / 2 && steps[i] <= step,
                "attempt {i}: {:?} not in [{:?}, {step:?}]",
                steps[i],
                step / 2
            );
        }
        assert_eq!(backoff.failures(), 10);
    }

    #[test]
    fn reset_starts_over_from_the_initial_step() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for _ in 0..5 {
            backoff.next_delay();
        }
        backoff.reset();
        assert_eq!(backoff.failures(), 0);
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn a_zero_initial_step_still_waits() {
        let mut backoff = Backoff::new(Duration::ZERO, Duration::ZERO);
        for _ in 0..100 {
            let delay = backoff.next_delay();
            assert!(delay >= Duration::from_micros(500) && delay <= backoff.max, "{delay:?}");
        }
    }

    #[test]
    fn full_jitter_stays_within_its_doubling_cap() {
        let (base, max) = (Duration::from_millis(10), Duration::from_millis(300));
        for attempt in 0u32..40 {
            let cap = base.saturating_mul(1 << attempt.max(1).saturating_sub(1).min(16)).min(max);
            assert!(full_jitter(base, max, attempt) <= cap, "attempt {attempt}");
        }
    }

    #[test]
    fn spread_adds_at_most_half() {
        let wait = Duration::from_millis(200);
        for _ in 0..1000 {
            let spread = spread(wait);
            assert!(spread >= wait && spread <= wait * 3 / 2, "{spread:?}");
        }
    }

    #[test]
    fn many_failures_never_overflow() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        for _ in 0..10_000 {
            assert!(backoff.next_delay() <= Duration::from_secs(30));
        }
    }
}
