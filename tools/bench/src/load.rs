//! What the clients saw: call latencies and failures, kept per measured
//! window and summed up as a rate and percentiles.
//!
//! # What counts
//! A call counts in a window when its answer arrived inside it, whenever it
//! was sent; its latency runs from send to answer on the client, so it holds
//! the client's own share of the machine too. Percentiles are exact
//! (nearest rank over every sample), not bucketed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

/// The longest an error message is kept in the tally, in characters.
const MAX_ERROR_LEN: usize = 200;

/// A stretch of time calls are counted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    /// When counting starts.
    pub(crate) start: Instant,
    /// When counting stops (exclusive).
    pub(crate) end: Instant,
}

impl Window {
    /// The window of `length` that opens `warmup` after `from`.
    pub(crate) fn after(from: Instant, warmup: Duration, length: Duration) -> Self {
        let start = from + warmup;
        Window { start, end: start + length }
    }

    /// Whether an answer at `at` counts.
    pub(crate) fn contains(&self, at: Instant) -> bool {
        self.start <= at && at < self.end
    }

    /// How long the window is.
    pub(crate) fn length(&self) -> Duration {
        self.end - self.start
    }
}

/// The calls one or more clients completed inside one window.
#[derive(Debug, Default, Clone)]
pub(crate) struct Samples {
    latencies_us: Vec<u32>,
    errors: u64,
}

impl Samples {
    /// One call that succeeded after `latency`.
    pub(crate) fn ok(&mut self, latency: Duration) {
        self.latencies_us.push(u32::try_from(latency.as_micros()).unwrap_or(u32::MAX));
    }

    /// One call that failed.
    pub(crate) fn error(&mut self) {
        self.errors += 1;
    }

    /// Adds another client's calls to these.
    pub(crate) fn merge(&mut self, other: Samples) {
        self.latencies_us.extend(other.latencies_us);
        self.errors += other.errors;
    }

    /// The rate and latencies of the window these samples were taken in,
    /// over `connections` client connections.
    pub(crate) fn figures(mut self, window: Duration, connections: u32) -> Figures {
        self.latencies_us.sort_unstable();
        let seconds = window.as_secs_f64();
        let calls = self.latencies_us.len() as u64;
        Figures {
            calls,
            errors: self.errors,
            rate_per_s: if seconds > 0.0 { calls as f64 / seconds } else { 0.0 },
            p50_ms: percentile(&self.latencies_us, 0.50),
            p99_ms: percentile(&self.latencies_us, 0.99),
            max_ms: self.latencies_us.last().map(|&us| f64::from(us) / 1000.0),
            connections,
            cpu: None,
        }
    }
}

/// CPU time identity, the bench and the machine used over one window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CpuUse {
    /// The server under test.
    pub(crate) identity: Duration,
    /// This process: every client.
    pub(crate) bench: Duration,
    /// Busy time of the whole machine, every CPU added up: identity, the
    /// clients, the database, Redis, the kernel and anything else.
    pub(crate) machine_busy: Duration,
}

/// Nearest-rank percentile of sorted microseconds, in milliseconds.
fn percentile(sorted_us: &[u32], q: f64) -> Option<f64> {
    if sorted_us.is_empty() {
        return None;
    }
    let rank = (q * sorted_us.len() as f64).ceil() as usize;
    let index = rank.clamp(1, sorted_us.len()) - 1;
    Some(f64::from(sorted_us[index]) / 1000.0)
}

/// One measured window, summed up.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Figures {
    /// Calls answered successfully inside the window.
    pub(crate) calls: u64,
    /// Calls that failed inside the window.
    pub(crate) errors: u64,
    /// Successful calls per second.
    pub(crate) rate_per_s: f64,
    /// Median latency; `None` without a successful call.
    pub(crate) p50_ms: Option<f64>,
    /// 99th percentile latency.
    pub(crate) p99_ms: Option<f64>,
    /// The slowest call.
    pub(crate) max_ms: Option<f64>,
    /// Client connections the calls were spread over, one call in flight on each at most.
    pub(crate) connections: u32,
    /// CPU used over the window; `None` where `/proc` could not be read.
    pub(crate) cpu: Option<CpuFigures>,
}

impl Figures {
    /// These figures with the CPU `used` over their `window`.
    pub(crate) fn with_cpu(mut self, used: Option<CpuUse>, window: Duration) -> Self {
        self.cpu = used.and_then(|used| CpuFigures::over(used, window, self.calls + self.errors));
        self
    }
}

/// Where the CPU went during a window: what it costs identity to answer,
/// which stays comparable when the clients or other work share the cores.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct CpuFigures {
    /// Cores identity kept busy, on average.
    pub(crate) identity_cores: f64,
    /// Identity's CPU time per call answered in the window, microseconds.
    pub(crate) identity_us_per_call: Option<f64>,
    /// Cores the bench's own clients kept busy.
    pub(crate) bench_cores: f64,
    /// Cores the whole machine kept busy.
    pub(crate) machine_cores: f64,
    /// Cores busy with anything but identity and the bench: the database,
    /// Redis, the kernel's own work, and whatever else runs here.
    pub(crate) other_cores: f64,
}

impl CpuFigures {
    /// The CPU `used` over `window`, in which identity answered `answered` calls.
    pub(crate) fn over(used: CpuUse, window: Duration, answered: u64) -> Option<Self> {
        let seconds = window.as_secs_f64();
        (seconds > 0.0).then(|| CpuFigures {
            identity_cores: used.identity.as_secs_f64() / seconds,
            identity_us_per_call: (answered > 0).then(|| used.identity.as_secs_f64() * 1e6 / answered as f64),
            bench_cores: used.bench.as_secs_f64() / seconds,
            machine_cores: used.machine_busy.as_secs_f64() / seconds,
            other_cores: (used.machine_busy.as_secs_f64() - used.identity.as_secs_f64() - used.bench.as_secs_f64())
                .max(0.0)
                / seconds,
        })
    }
}

/// Every distinct failure any client met, with how often, across all phases
/// (joins and warm-ups included), so a run with errors says what they were.
#[derive(Debug, Clone, Default)]
pub(crate) struct ErrorTally {
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl ErrorTally {
    /// Counts one failure described by `message`.
    pub(crate) fn add(&self, message: &str) {
        let mut message: String = message.split_whitespace().collect::<Vec<_>>().join(" ");
        if message.chars().count() > MAX_ERROR_LEN {
            message = message.chars().take(MAX_ERROR_LEN).collect::<String>() + "...";
        }
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner).entry(message).or_default() += 1;
    }

    /// The failures, most frequent first.
    pub(crate) fn summary(&self) -> Vec<ErrorCount> {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<ErrorCount> =
            counts.iter().map(|(message, &count)| ErrorCount { message: message.clone(), count }).collect();
        all.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.message.cmp(&b.message)));
        all
    }
}

/// One distinct failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ErrorCount {
    /// What the client saw, on one line.
    pub(crate) message: String,
    /// How many calls failed so.
    pub(crate) count: u64,
}

/// A failed call in the tally's words: the status code and its message.
pub(crate) fn status_message(status: &tonic::Status) -> String {
    let mut message = format!("{:?}: {}", status.code(), status.message());
    // The transport's cause says what a bare `Unavailable` does not.
    if let Some(source) = std::error::Error::source(status) {
        let cause = source.to_string();
        if !message.contains(&cause) {
            message = format!("{message} ({cause})");
        }
    }
    message
}

/// Whether a call failing with `code` is worth repeating as it was: the
/// server asked for a retry (contention, overload, a rate limit), or the
/// answer did not come (the deadline passed, or the client's transport gave
/// up waiting: `Cancelled: Timeout expired`).
pub(crate) fn is_transient(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Aborted
            | tonic::Code::Unavailable
            | tonic::Code::ResourceExhausted
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(latencies_ms: &[u64], errors: u64) -> Samples {
        let mut s = Samples::default();
        for &ms in latencies_ms {
            s.ok(Duration::from_millis(ms));
        }
        for _ in 0..errors {
            s.error();
        }
        s
    }

    #[test]
    fn percentiles_are_nearest_rank_over_every_sample() {
        let latencies: Vec<u64> = (1..=100).collect();
        let f = samples(&latencies, 0).figures(Duration::from_secs(10), 4);
        assert_eq!(f.calls, 100);
        assert_eq!(f.rate_per_s, 10.0);
        assert_eq!(f.p50_ms, Some(50.0));
        assert_eq!(f.p99_ms, Some(99.0));
        assert_eq!(f.max_ms, Some(100.0));
    }

    #[test]
    fn one_slow_call_in_a_hundred_is_the_p99_only_past_the_rank() {
        let mut latencies = vec![1; 99];
        latencies.push(500);
        let f = samples(&latencies, 0).figures(Duration::from_secs(1), 1);
        assert_eq!(f.p99_ms, Some(1.0));
        assert_eq!(f.max_ms, Some(500.0));
        let mut latencies = vec![1; 98];
        latencies.extend([500, 500]);
        let f = samples(&latencies, 0).figures(Duration::from_secs(1), 1);
        assert_eq!(f.p99_ms, Some(500.0));
    }

    #[test]
    fn errors_are_counted_but_not_in_the_rate() {
        let mut all = samples(&[2, 4], 3);
        all.merge(samples(&[6], 1));
        let f = all.figures(Duration::from_secs(2), 2);
        assert_eq!((f.calls, f.errors), (3, 4));
        assert_eq!(f.rate_per_s, 1.5);
        assert_eq!(f.p50_ms, Some(4.0));
    }

    #[test]
    fn cpu_is_shared_out_over_the_window_and_the_calls() {
        let used = CpuUse {
            identity: Duration::from_millis(1500),
            bench: Duration::from_secs(1),
            machine_busy: Duration::from_secs(3),
        };
        let f = samples(&[1; 999], 1).figures(Duration::from_secs(2), 1).with_cpu(Some(used), Duration::from_secs(2));
        let cpu = f.cpu.unwrap();
        assert_eq!(cpu.identity_cores, 0.75);
        assert_eq!(cpu.bench_cores, 0.5);
        assert_eq!(cpu.identity_us_per_call, Some(1500.0));
        assert_eq!((cpu.machine_cores, cpu.other_cores), (1.5, 0.25));
        let unread = samples(&[1], 0).figures(Duration::from_secs(1), 1).with_cpu(None, Duration::from_secs(1));
        assert_eq!(unread.cpu, None);
    }

    #[test]
    fn a_window_without_answers_has_no_latency() {
        let f = samples(&[], 5).figures(Duration::from_secs(1), 1);
        assert_eq!(f.rate_per_s, 0.0);
        assert_eq!((f.p50_ms, f.p99_ms, f.max_ms), (None, None, None));
    }

    #[test]
    fn a_window_counts_its_start_but_not_its_end() {
        let now = Instant::now();
        let w = Window::after(now, Duration::from_secs(1), Duration::from_secs(2));
        assert!(!w.contains(now));
        assert!(w.contains(now + Duration::from_secs(1)));
        assert!(w.contains(now + Duration::from_millis(2999)));
        assert!(!w.contains(now + Duration::from_secs(3)));
        assert_eq!(w.length(), Duration::from_secs(2));
    }

    #[test]
    fn the_tally_folds_whitespace_and_lists_the_commonest_first() {
        let tally = ErrorTally::default();
        tally.add("Unavailable: connection\n reset");
        tally.add("Unavailable: connection reset");
        tally.add("Internal: boom");
        assert_eq!(
            tally.summary(),
            vec![
                ErrorCount { message: "Unavailable: connection reset".into(), count: 2 },
                ErrorCount { message: "Internal: boom".into(), count: 1 },
            ]
        );
    }
}
