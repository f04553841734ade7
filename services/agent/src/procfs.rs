//! What `/proc` says about a process: its state, process group, CPU time,
//! resident memory and start time, read without signalling anything; and
//! [`kill_found`], the one step that acts on what was read: killing what a
//! scan of `/proc` found left behind, for every runtime's recovery.
//!
//! # Invariants
//! - A process is named by its pid *and* its start time (clock ticks after
//!   boot, field 22 of `/proc/<pid>/stat`): a recycled pid has another start
//!   time, so it is never taken for the process that was recorded.
//! - A zombie (or a dead task) counts as exited: it runs nothing and only
//!   waits for its parent to reap it.

use std::path::Path;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group};

/// Where Linux exposes processes.
pub(crate) const PROC_ROOT: &str = "/proc";

/// One line of `/proc/<pid>/stat`, the fields berth reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    /// The process id.
    pub(crate) pid: u32,
    /// The state letter: `R`, `S`, `D`, `Z`, `X`, ...
    pub(crate) state: char,
    /// The process group.
    pub(crate) pgrp: i32,
    /// CPU time in user mode, in clock ticks.
    pub(crate) utime: u64,
    /// CPU time in kernel mode, in clock ticks.
    pub(crate) stime: u64,
    /// CPU time of reaped children in user mode, in clock ticks.
    pub(crate) cutime: u64,
    /// CPU time of reaped children in kernel mode, in clock ticks.
    pub(crate) cstime: u64,
    /// When the process started, in clock ticks after boot.
    pub(crate) start_ticks: u64,
    /// Resident set size, in pages.
    pub(crate) rss_pages: u64,
}

impl ProcStat {
    /// Whether the process still runs (is neither a zombie nor dead).
    pub(crate) fn is_live(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }

    /// CPU time used by the process and the children it reaped, in ticks.
    pub(crate) fn cpu_ticks(&self) -> u64 {
        self.utime.saturating_add(self.stime).saturating_add(self.cutime).saturating_add(self.cstime)
    }
}

/// Parses one `/proc/<pid>/stat` line. The command name sits in parentheses
/// and may itself hold spaces and parentheses, so fields are counted from
/// the last `)`.
pub(crate) fn parse_stat(line: &str) -> Option<ProcStat> {
    let (head, tail) = line.rsplit_once(')')?;
    let pid: u32 = head.split_once('(')?.0.trim().parse().ok()?;
    let fields: Vec<&str> = tail.split_whitespace().collect();
    let number = |i: usize| -> Option<u64> { fields.get(i)?.parse().ok() };
    Some(ProcStat {
        pid,
        state: fields.first()?.chars().next()?,
        pgrp: fields.get(2)?.parse().ok()?,
        utime: number(11)?,
        stime: number(12)?,
        // Children's times are signed in the kernel's format.
        cutime: fields.get(13)?.parse::<i64>().ok()?.max(0) as u64,
        cstime: fields.get(14)?.parse::<i64>().ok()?.max(0) as u64,
        start_ticks: number(19)?,
        rss_pages: fields.get(21)?.parse::<i64>().ok()?.max(0) as u64,
    })
}

/// The process `pid` as `/proc` shows it now; `None` when there is none.
pub(crate) fn read_stat(proc_root: &Path, pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    parse_stat(&text)
}

/// Whether the process recorded as (`pid`, `start_ticks`) still runs: the
/// pid exists, is not a zombie, and started when the record says.
pub(crate) fn is_running(proc_root: &Path, pid: u32, start_ticks: u64) -> bool {
    read_stat(proc_root, pid).is_some_and(|stat| stat.start_ticks == start_ticks && stat.is_live())
}

/// Every live process in process group `pgid`.
pub(crate) fn group_members(proc_root: &Path, pgid: i32) -> Vec<ProcStat> {
    let Ok(entries) = std::fs::read_dir(proc_root) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| read_stat(proc_root, pid))
        .filter(|stat| stat.pgrp == pgid && stat.is_live())
        .collect()
}

/// Whether process group `pgid`, led at its start by the process recorded
/// as (`pgid`, `start_ticks`), is still that group. The kernel does not hand
/// out a pid while a group of that number exists, so live members mean the
/// group is the recorded one, unless the leader's pid now names another
/// process (another start time): then the number was recycled after the
/// recorded group emptied, and the group is someone else's.
pub(crate) fn owns_group(proc_root: &Path, pgid: i32, start_ticks: u64) -> bool {
    let Ok(leader) = u32::try_from(pgid) else { return false };
    match read_stat(proc_root, leader) {
        Some(stat) if stat.start_ticks != start_ticks => false,
        _ => !group_members(proc_root, pgid).is_empty(),
    }
}

/// Every live process whose command line holds each of `args` as a whole
/// argument, with its `/proc` stat: how a monitor is found by the
/// container it was started for, when no record kept its pid.
pub(crate) fn with_args(proc_root: &Path, args: &[&str]) -> Vec<ProcStat> {
    live_whose(proc_root, "cmdline", |words| args.iter().all(|arg| words.contains(&arg.as_bytes())))
}

/// Every live process whose environment holds `entry` (`NAME=value`)
/// exactly, with its `/proc` stat: how a workload is found by its lease
/// (`BERTH_LEASE_ID`), when no record kept its pid.
pub(crate) fn with_env(proc_root: &Path, entry: &str) -> Vec<ProcStat> {
    live_whose(proc_root, "environ", |words| words.contains(&entry.as_bytes()))
}

/// Every live process whose `/proc/<pid>/<file>`, a list of NUL-ended
/// words, passes `keep`.
fn live_whose(proc_root: &Path, file: &str, keep: impl Fn(&[&[u8]]) -> bool) -> Vec<ProcStat> {
    let Ok(entries) = std::fs::read_dir(proc_root) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(text) = std::fs::read(proc_root.join(pid.to_string()).join(file)) else { return false };
            let words: Vec<&[u8]> = text.split(|b| *b == 0).collect();
            keep(&words)
        })
        .filter_map(|pid| read_stat(proc_root, pid))
        .filter(ProcStat::is_live)
        .collect()
}

/// How long a group may outlive SIGKILL before destroy gives up on it
/// (a process in uninterruptible sleep, say).
pub(crate) const KILL_WAIT: Duration = Duration::from_secs(5);

/// How often processes being killed are looked at.
const KILL_POLL: Duration = Duration::from_millis(25);

/// Kills each of `found` (a group leader with its whole group, any other
/// process alone) and waits up to [`KILL_WAIT`] for all to be gone: what
/// an interrupted launch left running where no record names it.
pub(crate) async fn kill_found(found: &[ProcStat]) {
    let own_group = rustix::process::getpgrp().as_raw_nonzero().get();
    for process in found.iter().filter(|p| p.pid != std::process::id() && p.pgrp != own_group) {
        let Some(pid) = i32::try_from(process.pid).ok().and_then(Pid::from_raw) else { continue };
        let _ = if process.pgrp == pid.as_raw_nonzero().get() {
            kill_process_group(pid, Signal::KILL)
        } else {
            rustix::process::kill_process(pid, Signal::KILL)
        };
    }
    let deadline = tokio::time::Instant::now() + KILL_WAIT;
    while found.iter().any(|p| is_running(Path::new(PROC_ROOT), p.pid, p.start_ticks))
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(KILL_POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real line, with a command name that holds `) (` to mislead a
    /// parser that splits on the first parenthesis.
    const LINE: &str = "4242 (we ird) (x) S 1 4242 4242 0 -1 4194560 120 0 0 0 7 3 2 1 20 0 1 0 987654 2400000 321 \
                        18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";

    #[test]
    fn fields_are_counted_from_the_last_parenthesis() {
        let stat = parse_stat(LINE).unwrap();
        assert_eq!(stat.pid, 4242);
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.pgrp, 4242);
        assert_eq!((stat.utime, stat.stime, stat.cutime, stat.cstime), (7, 3, 2, 1));
        assert_eq!(stat.cpu_ticks(), 13);
        assert_eq!(stat.start_ticks, 987654);
        assert_eq!(stat.rss_pages, 321);
        assert!(stat.is_live());
    }

    #[test]
    fn a_zombie_is_not_running() {
        let zombie = LINE.replacen(") S ", ") Z ", 1);
        assert!(!parse_stat(&zombie).unwrap().is_live());
    }

    #[test]
    fn garbage_is_no_process() {
        assert_eq!(parse_stat(""), None);
        assert_eq!(parse_stat("12 (sh) S 1"), None, "truncated");
        assert_eq!(parse_stat("x (sh) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21"), None);
    }

    #[test]
    fn this_process_is_read_and_a_wrong_start_time_is_another_process() {
        let me = std::process::id();
        let root = Path::new(PROC_ROOT);
        let stat = read_stat(root, me).unwrap();
        assert_eq!(stat.pid, me);
        assert!(is_running(root, me, stat.start_ticks));
        assert!(!is_running(root, me, stat.start_ticks + 1), "a recycled pid has another start time");
        assert!(read_stat(root, u32::MAX).is_none());
    }
}
