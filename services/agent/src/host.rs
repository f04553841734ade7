//! What the host offers and what it uses right now, read from `/proc`.
//!
//! # Invariants
//! - Capacity is detected once at start (or given by the operator) and is what
//!   the node offers to leases; usage is sampled on every heartbeat.
//! - Usage is best effort: a host without `/proc` reports zero rather than
//!   failing a heartbeat.

use std::path::Path;

use berth_proto::types::v1 as types;

/// Where the kernel reports memory.
const MEMINFO: &str = "/proc/meminfo";

/// Where the kernel reports CPU time (`stat`) and memory (`meminfo`).
const PROC: &str = "/proc";

/// Why the host's capacity could not be detected.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The number of usable CPUs could not be read.
    #[error("cannot count the host's cpus ({0}); pass --cpu-millis")]
    Cpus(#[source] std::io::Error),
    /// `/proc/meminfo` could not be read.
    #[error("cannot read {path} ({source}); pass --memory-bytes")]
    MemInfo {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `/proc/meminfo` has no `MemTotal` line.
    #[error("{0} has no MemTotal line; pass --memory-bytes")]
    NoMemTotal(String),
}

/// The compute a node offers to leases, or uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    /// CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
}

impl Capacity {
    /// The whole host: every CPU this process may run on (affinity and cgroup
    /// quota included) times 1000, and `MemTotal`.
    pub fn detect() -> Result<Self, HostError> {
        Ok(Self { cpu_millis: detect_cpu_millis()?, memory_bytes: detect_memory_bytes()? })
    }

    pub(crate) fn to_proto(self) -> types::Capacity {
        types::Capacity { cpu_millis: self.cpu_millis, memory_bytes: self.memory_bytes }
    }
}

/// CPUs this process may run on, times 1000.
pub fn detect_cpu_millis() -> Result<u64, HostError> {
    let cpus = std::thread::available_parallelism().map_err(HostError::Cpus)?;
    Ok(cpus.get() as u64 * 1000)
}

/// `MemTotal` from `/proc/meminfo`, in bytes.
pub fn detect_memory_bytes() -> Result<u64, HostError> {
    let text =
        std::fs::read_to_string(MEMINFO).map_err(|source| HostError::MemInfo { path: MEMINFO.to_string(), source })?;
    meminfo_bytes(&text, "MemTotal").ok_or_else(|| HostError::NoMemTotal(MEMINFO.to_string()))
}

/// A `/proc/meminfo` field in bytes (the file speaks kibibytes).
fn meminfo_bytes(meminfo: &str, field: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
        kib.checked_mul(1024)
    })
}

/// CPU time counters from the aggregate `cpu` line of `/proc/stat`, in ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CpuTimes {
    busy: u64,
    total: u64,
}

fn parse_cpu_times(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    // user nice system idle iowait irq softirq steal; guest time is already
    // counted in user and nice.
    let fields: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|f| f.parse().ok()).collect::<Option<_>>()?;
    if fields.len() < 4 {
        return None;
    }
    let total: u64 = fields.iter().sum();
    let idle = fields[3] + fields.get(4).copied().unwrap_or(0);
    Some(CpuTimes { busy: total.saturating_sub(idle), total })
}

/// Samples host usage between heartbeats: CPU from the change in `/proc/stat`
/// since the previous sample, memory as `MemTotal - MemAvailable`.
#[derive(Debug)]
pub(crate) struct UsageSampler {
    cpus: u64,
    last: Option<CpuTimes>,
    proc_dir: &'static Path,
}

impl UsageSampler {
    pub(crate) fn new() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        Self { cpus, last: None, proc_dir: Path::new(PROC) }
    }

    /// Usage now; zero for what cannot be read. The first sample has no
    /// interval to measure CPU over and reports zero CPU.
    pub(crate) fn sample(&mut self) -> Capacity {
        let stat = std::fs::read_to_string(self.proc_dir.join("stat")).unwrap_or_default();
        let meminfo = std::fs::read_to_string(self.proc_dir.join("meminfo")).unwrap_or_default();
        self.sample_from(&stat, &meminfo)
    }

    fn sample_from(&mut self, stat: &str, meminfo: &str) -> Capacity {
        let now = parse_cpu_times(stat);
        let cpu_millis = match (self.last, now) {
            (Some(before), Some(after)) if after.total > before.total => {
                let busy = after.busy.saturating_sub(before.busy) as u128;
                let total = (after.total - before.total) as u128;
                (busy * u128::from(self.cpus) * 1000 / total) as u64
            }
            _ => 0,
        };
        if now.is_some() {
            self.last = now;
        }
        let memory_bytes = match (meminfo_bytes(meminfo, "MemTotal"), meminfo_bytes(meminfo, "MemAvailable")) {
            (Some(total), Some(available)) => total.saturating_sub(available),
            _ => 0,
        };
        Capacity { cpu_millis, memory_bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO_TEXT: &str =
        "MemTotal:       24684092 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n";

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        assert_eq!(meminfo_bytes(MEMINFO_TEXT, "MemTotal"), Some(24684092 * 1024));
        assert_eq!(meminfo_bytes(MEMINFO_TEXT, "MemAvailable"), Some(20000000 * 1024));
        assert_eq!(meminfo_bytes(MEMINFO_TEXT, "Mem"), None, "a prefix of a field name is not the field");
        assert_eq!(meminfo_bytes("MemTotal: lots kB", "MemTotal"), None);
    }

    #[test]
    fn cpu_usage_is_the_busy_share_of_the_interval_times_the_cpus() {
        let mut sampler = UsageSampler { cpus: 2, last: None, proc_dir: Path::new("/nonexistent") };
        let first = "cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 50 0 50 400 0 0 0 0 0 0\n";
        // 1000 ticks later, 250 of them busy: a quarter of two cpus.
        let second = "cpu  200 0 250 1550 0 0 0 0 0 0\n";
        assert_eq!(sampler.sample_from(first, MEMINFO_TEXT).cpu_millis, 0, "no interval yet");
        let usage = sampler.sample_from(second, MEMINFO_TEXT);
        assert_eq!(usage.cpu_millis, 500);
        assert_eq!(usage.memory_bytes, (24684092 - 20000000) * 1024);
    }

    #[test]
    fn unreadable_proc_reports_zero_not_an_error() {
        let mut sampler = UsageSampler { cpus: 4, last: None, proc_dir: Path::new("/nonexistent") };
        assert_eq!(sampler.sample(), Capacity::default());
        assert_eq!(sampler.sample_from("garbage", ""), Capacity::default());
    }

    #[test]
    fn detected_capacity_is_the_whole_host() {
        let capacity = Capacity::detect().unwrap();
        assert!(capacity.cpu_millis >= 1000 && capacity.cpu_millis.is_multiple_of(1000), "{capacity:?}");
        assert!(capacity.memory_bytes > 0, "{capacity:?}");
    }
}
