//! What `/proc` says about a process's memory and CPU, and about the whole
//! machine's CPU: the readings behind the report's memory and CPU columns.
//!
//! # Invariants
//! - A reading that cannot be taken (no such process, not Linux) is `None`,
//!   never zero, so a report never shows a figure nothing measured.

use std::time::Duration;

/// A process's resident memory, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Memory {
    /// Resident now (`VmRSS`), KiB.
    pub(crate) rss_kib: u64,
    /// The most it was ever resident (`VmHWM`), KiB.
    pub(crate) peak_kib: u64,
}

/// Process `pid`'s resident memory.
pub(crate) fn read_memory(pid: u32) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_memory(&status)
}

fn parse_memory(status: &str) -> Option<Memory> {
    let field = |name: &str| {
        status.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
        })
    };
    Some(Memory { rss_kib: field("VmRSS")?, peak_kib: field("VmHWM")? })
}

/// CPU time a whole process (every thread) has used so far, from
/// `/proc/<pid>/stat` (user plus system).
pub(crate) fn read_cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(ticks_to_time(parse_cpu_ticks(&stat)?))
}

/// `utime + stime`: fields 14 and 15, counted after the command name, whose
/// parentheses may hold anything.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Field 3 (state) is the first after the name.
    let utime: u64 = fields.get(14 - 3)?.parse().ok()?;
    let stime: u64 = fields.get(15 - 3)?.parse().ok()?;
    Some(utime + stime)
}

/// The whole machine's CPU time so far, every CPU added up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MachineCpu {
    /// Time spent doing anything (every process, the kernel, interrupts).
    pub(crate) busy: Duration,
}

/// The machine's CPU time from the `cpu` line of `/proc/stat`.
pub(crate) fn read_machine_cpu() -> Option<MachineCpu> {
    parse_machine_cpu(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// `user nice system idle iowait irq softirq steal`; idle and iowait are
/// the idle part.
fn parse_machine_cpu(stat: &str) -> Option<MachineCpu> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|t| t.parse().ok()).collect::<Option<_>>()?;
    if ticks.len() < 8 {
        return None;
    }
    let total: u64 = ticks.iter().sum();
    let idle = ticks[3] + ticks[4];
    Some(MachineCpu { busy: ticks_to_time(total - idle) })
}

/// The one-minute load average: how much other work shares the machine.
pub(crate) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

fn ticks_to_time(ticks: u64) -> Duration {
    let per_second = rustix::param::clock_ticks_per_second().max(1);
    Duration::from_secs_f64(ticks as f64 / per_second as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_read_from_the_status_file() {
        let status =
            "Name:\tberth-identity\nVmPeak:\t  900000 kB\nVmHWM:\t   40960 kB\nVmRSS:\t   20480 kB\nThreads:\t3\n";
        assert_eq!(parse_memory(status), Some(Memory { rss_kib: 20480, peak_kib: 40960 }));
        assert_eq!(parse_memory("Name:\tx\n"), None);
    }

    #[test]
    fn cpu_ticks_are_read_after_the_command_name() {
        let stat = "4242 (berth (x) 1) S 1 4242 4242 0 -1 4194560 900 0 0 0 125 37 0 0 20 0 5 0 100 0 0";
        assert_eq!(parse_cpu_ticks(stat), Some(162));
        assert_eq!(parse_cpu_ticks("4242 (berth) S 1"), None);
    }

    #[test]
    fn the_machine_is_busy_outside_idle_and_iowait() {
        let stat = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\n";
        let cpu = parse_machine_cpu(stat).expect("a cpu line");
        let per_second = rustix::param::clock_ticks_per_second() as f64;
        assert_eq!(cpu.busy.as_secs_f64(), 150.0 / per_second);
        assert_eq!(parse_machine_cpu("intr 1 2 3\n"), None);
    }

    #[test]
    fn this_process_and_machine_are_readable() {
        let me = read_memory(std::process::id()).expect("/proc/self/status");
        assert!(me.rss_kib > 0 && me.peak_kib >= me.rss_kib);
        assert!(read_cpu_time(std::process::id()).is_some());
        let machine = read_machine_cpu().expect("/proc/stat");
        assert!(machine.busy > Duration::ZERO);
        assert!(load_average().is_some_and(|l| l >= 0.0));
    }
}
